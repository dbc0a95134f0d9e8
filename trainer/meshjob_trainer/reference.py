"""The single-process reference: the same model, data, loss and optimizer as a pipelined run,
without pipelining or parallelism. Pipelined runs must match it (losses and final weights)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshjob.spec import ModelSpec
from meshjob_trainer.data import BigramData
from meshjob_trainer.model import StageModule


@dataclass
class ReferenceResult:
    losses: list[float]  # mean token cross-entropy over the global batch, per step
    weights: dict[str, torch.Tensor]  # final full weights by parameter name


def make_optimizer(params, learning_rate: float) -> torch.optim.Optimizer:
    """The optimizer every run uses (AdamW, elementwise, so shards update like the full weight)."""
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.01, foreach=False)


def train_reference(config: ModelSpec, data: BigramData, steps: int, microbatches: int,
                    learning_rate: float, seed: int) -> ReferenceResult:
    model = StageModule(config, 0, config.layers, seed)
    optimizer = make_optimizer(model.parameters(), learning_rate)
    tokens_per_batch = data.global_batch * config.seq_len
    losses = []
    for step in range(steps):
        total = 0.0
        for mb in range(microbatches):
            batch = data.microbatch(step, mb, microbatches)
            loss = model({"tokens": batch.tokens, "targets": batch.targets})["loss"] / tokens_per_batch
            loss.backward()  # gradients accumulate over microbatches: the global-batch mean
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return ReferenceResult(losses, weights)


def reference_for_job(job) -> ReferenceResult:
    """The reference of a TrainingJob (meshjob.spec): its model, data, steps and optimizer."""
    t = job.training
    config = job.model
    data = BigramData(config.vocab, config.seq_len, t.global_batch, t.seed)
    return train_reference(config, data, t.steps, t.microbatches, t.learning_rate, t.seed)
