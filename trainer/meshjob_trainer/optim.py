"""The optimizer step of one stage: the learning-rate schedule, the data-parallel gradient reduction
(plain, or ZeRO-1's reduce-scatter), global-norm clipping, AdamW, and the optimizer's checkpoint state.

ZeRO-1 (spec.training.optimizer.zeroStage: 1, Rajbhandari et al. 2020): the stage's parameters
live in one flat fp32 buffer (the parameters are views into it) cut into dp_size equal shards;
data-parallel rank r owns shard r. After the backward the gradients are reduce-scattered, so rank
r receives the summed gradient of its shard only; it runs AdamW on that shard alone, holding 1/DP
of the optimizer state, and the updated shards are all-gathered back into every rank's buffer.
AdamW is elementwise, so a shard updates exactly like the same elements of the whole.

Clipping (spec.training.gradClip) uses the norm of the gradient of the whole model, every stage
and rank together, computed once: each rank adds the squares of the elements it is the one holder
of (see StageOptimizer.counted) and one all-reduce over every rank sums them, then the gradients
scale by torch.nn.utils.clip_grad_norm_'s coefficient max_norm / (norm + 1e-6) when it is below 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshjob.spec.manifest import TrainingSpec
from meshjob_trainer.checkpoint import CheckpointMismatch
from meshjob_trainer.parallel import StageGroups, shard_info

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class OptimizerLayoutError(CheckpointMismatch):
    """A checkpoint's optimizer state is laid out for other ranks or parameters than this run's."""


def make_optimizer(
    params: Iterable[torch.Tensor], learning_rate: float, weight_decay: float = 0.01
) -> torch.optim.Optimizer:
    """The optimizer every run uses (AdamW, elementwise, so shards update like the full weight)."""
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)


def lr_at(step: int, training: TrainingSpec) -> float:
    """The learning rate of 0-based step `step` (meshjob.spec.manifest.TrainingSpec): constant, or with
    spec.training.lrSchedule a linear warm-up to learningRate over warmupSteps, then a cosine decay
    that reaches minLr at the last step (nanoGPT's schedule)."""
    lr, schedule = training.learning_rate, training.lr_schedule
    if schedule is None:
        return lr
    if step < schedule.warmup_steps:
        return lr * (step + 1) / (schedule.warmup_steps + 1)
    decay_steps = max(1, training.steps - 1 - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps) / decay_steps)
    return schedule.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - schedule.min_lr)


def clip_coefficient(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + CLIP_EPS))


@dataclass(frozen=True)
class FlatLayout:
    """Where ZeRO-1 cuts the flat parameter buffer: equal shards of `padded` elements."""

    numel: int  # elements of all the stage's parameters on this rank
    dp_size: int
    dp_rank: int

    @property
    def padded(self) -> int:
        return -(-self.numel // self.dp_size) * self.dp_size

    @property
    def shard(self) -> tuple[int, int]:
        size = self.padded // self.dp_size
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def describe(self) -> dict[str, int]:
        return {"numel": self.numel, "dp_size": self.dp_size, "dp_rank": self.dp_rank}


class StageOptimizer:
    """AdamW for one rank's parameters, with the data-parallel reduction of their gradients
    (zero_stage 0: all-reduce, every rank steps everything; 1: ZeRO-1, see the module docstring).

    `tied` parameters come with gradients already complete (parallel.tie_gradients): no reduction."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        groups: StageGroups,
        learning_rate: float,
        weight_decay: float = 0.01,
        zero_stage: int = 0,
        tied: Sequence[nn.Parameter] = (),
    ):
        self.params, self.groups = list(params), groups
        self.tied = {id(p) for p in tied}
        self.zero = zero_stage == 1 and groups.dp_size > 1
        self.counted = [self._counted(p) for p in self.params]
        if self.zero:
            self.layout = FlatLayout(sum(p.numel() for p in self.params), groups.dp_size, groups.dp_rank)
            self.flat = self._flatten()
            start, stop = self.layout.shard
            self.shard = self.flat[start:stop]  # a leaf view: AdamW updates the buffer in place
            self.optimizer = make_optimizer([self.shard], learning_rate, weight_decay)
            self.shard_counted = self._flat_counted()[start:stop]
        else:
            self.optimizer = make_optimizer(self.params, learning_rate, weight_decay)

    # --- which elements this rank counts in the global norm ---------------------------------

    def _counted(self, p: nn.Parameter) -> bool:
        """Whether this rank is the one holder of p's gradient elements (before the data-parallel
        split of ZeRO-1): not a tensor-parallel copy of a replicated weight, not a redundant
        replica, not the last stage's copy of a tied weight; with plain data parallelism (every
        rank ends with the whole reduced gradient) only data-parallel rank 0."""
        g = self.groups
        if id(p) in self.tied and not g.is_first_stage:
            return False
        if shard_info(p).dim is None and g.tp.rank != 0:
            return False
        return g.replica_rank == 0 and (self.zero or g.dp_rank == 0)

    def _flat_counted(self) -> torch.Tensor:
        mask = torch.zeros(self.layout.padded, dtype=torch.bool, device=self.flat.device)
        offset = 0
        for p, counted in zip(self.params, self.counted):
            mask[offset : offset + p.numel()] = counted
            offset += p.numel()
        return mask

    # --- ZeRO-1's flat buffer ------------------------------------------------------------------

    def _flatten(self) -> torch.Tensor:
        first = self.params[0]
        flat = torch.zeros(self.layout.padded, dtype=torch.float32, device=first.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            offset += n
        return flat

    def _flat_grads(self) -> torch.Tensor:
        """Every gradient in buffer order; a tied one, already summed everywhere, from DP rank 0 only
        (the reduce-scatter adds it once)."""
        flat = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None and (id(p) not in self.tied or self.groups.dp_rank == 0):
                flat[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return flat

    # --- the step --------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reduce_gradients(self) -> None:
        """Data parallel: SUM the gradients over the DP group (each rank's loss is already its share
        of the global-batch mean, so a mean here would divide twice)."""
        g = self.groups
        if self.zero:
            start, stop = self.layout.shard
            grad = torch.empty(stop - start, dtype=torch.float32, device=self.flat.device)
            dist.reduce_scatter_single(grad, self._flat_grads(), group=g.dp_group)
            self.shard.grad = grad
            return
        if g.dp_group is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None and id(p) not in self.tied]
        if grads:  # one all-reduce for all of them: one message per peer instead of one per tensor
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=g.dp_group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def local_square_sum(self) -> torch.Tensor:
        """The squares of the gradient elements this rank counts (float64, on the CPU)."""
        if self.zero:
            grad = self.shard.grad
            assert grad is not None, "reduce_gradients() gives the shard its gradient first"
            total = grad.double().pow(2)[self.shard_counted].sum()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.params[0].device if self.params else "cpu")
            for p, counted in zip(self.params, self.counted):
                if counted and p.grad is not None:
                    total = total + p.grad.double().pow(2).sum()
        return total.cpu()

    def scale_gradients(self, factor: float) -> None:
        for p in [self.shard] if self.zero else self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()
        if self.zero:
            start, stop = self.layout.shard
            dist.all_gather_single(self.flat, self.flat[start:stop].clone(), group=self.groups.dp_group)
            self.shard.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # --- checkpoint state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state; under ZeRO-1 this rank's shard of it, with the layout it belongs to."""
        state = self.optimizer.state_dict()
        return {"zero": self.layout.describe(), "adamw": state} if self.zero else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses state laid out for another ZeRO stage, data-parallel degree or parameter count."""
        written = state.get("zero") if isinstance(state, dict) and "adamw" in state else None
        mine = self.layout.describe() if self.zero else None
        if written != mine:
            raise OptimizerLayoutError(
                f"the checkpoint's optimizer state is {_layout_words(written)}, this run's is "
                f"{_layout_words(mine)}: resume with the spec.training.optimizer.zeroStage and data-parallel "
                f"meshes it was written with, or start from another spec.training.checkpoint.path"
            )
        self.optimizer.load_state_dict(state["adamw"] if self.zero else state)


def _layout_words(layout: dict[str, int] | None) -> str:
    if layout is None:
        return "whole on every rank (zeroStage 0)"
    return (
        f"sharded by ZeRO-1 over {layout['dp_size']} data-parallel ranks ({layout['numel']} elements, this "
        f"rank's shard {layout['dp_rank']})"
    )


def clip_global_norm(optimizer: StageOptimizer, max_norm: float | None) -> float:
    """The global gradient norm over every stage and rank (one all-reduce over the default group, the
    CPU tensor going through gloo), after which gradients are clipped to `max_norm` if given.
    Collective: every rank calls it once per step."""
    total = optimizer.local_square_sum()
    dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None:
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient < 1.0:
            optimizer.scale_gradients(coefficient)
    return norm
