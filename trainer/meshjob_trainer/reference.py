"""The single-process reference: the same model, data, loss, numerics and optimizer as a pipelined
run, without pipelining or parallelism. Pipelined runs must match it (losses, validation losses,
gradient norms and final weights); it is the oracle every feature is tested against.

What it shares with a pipelined run is only what defines the mathematics: the model family
(families.build_stage, the whole model as one stage), the data (data.make_data), the loss scaling,
the learning-rate schedule and AdamW with its weight-decay groups (optim.lr_at, optim.make_optimizer,
optim.weight_decay_groups). Clipping is torch's own torch.nn.utils.clip_grad_norm_ over the one model,
tensor parallelism and ZeRO-1 do not exist here, and recomputation is off (it changes memory, not results).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshjob.spec.manifest import TrainingJob, TrainingSpec
from meshjob_trainer.data import TRAIN, VAL, Dataset, make_data
from meshjob_trainer.families import build_stage
from meshjob_trainer.model import PipelineStage
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.optim import lr_at, make_optimizer, weight_decay_groups


@dataclass
class ReferenceResult:
    losses: list[float]  # mean token cross-entropy over the global batch, per step
    weights: dict[str, torch.Tensor]  # final full weights by parameter name
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, mean validation loss)
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping (with gradClip)


def batch_loss(model: PipelineStage, data: Dataset, step: int, microbatches: int, backward: bool) -> float:
    """The global-batch mean loss of `step`, microbatch by microbatch (gradients accumulate into .grad)."""
    tokens = data.global_batch * model.config.seq_len
    total = 0.0
    for mb in range(microbatches):
        batch = data.microbatch(step, mb, microbatches)
        loss = model({"tokens": batch.tokens, "targets": batch.targets})["loss"] / tokens
        if backward:
            loss.backward()
        total += loss.item()
    return total


def train_reference(
    model: PipelineStage,
    data: Dataset,
    training: TrainingSpec,
    val_data: Dataset | None = None,
) -> ReferenceResult:
    """Train `model` (the whole model as one stage) as meshjob.spec.manifest.TrainingSpec `training` says."""
    t = training
    groups = weight_decay_groups(model, t.optimizer.weight_decay, t.weight_decay_embeddings)
    optimizer = make_optimizer(groups, t.learning_rate)
    result = ReferenceResult([], {})
    for step in range(t.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        result.losses.append(batch_loss(model, data, step, t.microbatches, backward=True))
        if t.grad_clip is not None:
            result.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if val_data is not None and (step + 1) % t.eval_every == 0:
            with torch.no_grad():
                val = [batch_loss(model, val_data, i, t.microbatches, backward=False) for i in range(t.eval_batches)]
            result.val_losses.append((step + 1, math.fsum(val) / len(val)))
    result.weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def reference_for_job(job: TrainingJob) -> ReferenceResult:
    """The reference of a TrainingJob (meshjob.spec.manifest): its model, data, steps, numerics and optimizer."""
    t = job.training
    model = build_stage(job.model, 0, job.model.layers, t.seed, numerics=Numerics(t.precision))
    val = make_data(job, VAL) if t.eval_every > 0 else None
    return train_reference(model, make_data(job, TRAIN), t, val)
