"""The optimizer step of one stage: the learning-rate schedule, the data-parallel gradient reduction
(plain, or ZeRO-1's reduce-scatter), global-norm clipping, AdamW, and the optimizer's checkpoint state.

Data-parallel reduction in buckets (PyTorch DDP's and Megatron's design): with data parallelism every
gradient is a view into one flat buffer, cut into buckets of about spec.training.gradBucketMiB in the
order the backward completes them (the reverse of the parameters' order). During the step's last
backward pass (B, or the last W) a bucket whose gradients are all complete starts its reduction at
once (async_op), so it overlaps the rest of that backward and the pipeline's flush; reduce_gradients()
waits for them before clipping and the optimizer step. spec.training.overlapGradReduce: false starts
every bucket there instead, after the step's backward. Buckets start in the order they complete,
which is the same on every data-parallel rank of a stage: the same module runs the same action list.

ZeRO-1 (spec.training.optimizer.zeroStage: 1, Rajbhandari et al. 2020): the stage's parameters
live in one flat fp32 buffer laid out like the gradients' (the parameters are views into it); each
bucket is padded to a multiple of dp_size and cut into dp_size equal shards, of which data-parallel
rank r owns shard r (Megatron's distributed optimizer). Each bucket is reduce-scattered straight from
the gradient buffer, so rank r receives the summed gradient of its shards only; it runs AdamW on them
alone, holding 1/DP of the optimizer state, and the updated shards are all-gathered back into every
rank's buffer. AdamW is elementwise, so a shard updates exactly like the same elements of the whole.

Weight decay (AdamW's decoupled decay, applied here before the Adam update exactly as torch's AdamW
does) is off for norms and biases (Megatron's rule), and for embeddings too with
spec.training.weightDecayEmbeddings: false.

Clipping (spec.training.gradClip) uses the norm of the gradient of the whole model, every stage
and rank together, computed once: each rank adds the squares of the elements it is the one holder
of (see StageOptimizer.counted) and one all-reduce over every rank sums them, then the gradients
scale by torch.nn.utils.clip_grad_norm_'s coefficient max_norm / (norm + 1e-6) when it is below 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshjob.spec.manifest import TrainingSpec
from meshjob_trainer.checkpoint import CheckpointMismatch
from meshjob_trainer.parallel import StageGroups, first_tp_copy, shard_info

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
DEFAULT_BUCKET_MIB = 25.0  # torch DDP's bucket_cap_mb
GRAD_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OptimizerLayoutError(CheckpointMismatch):
    """A checkpoint's optimizer state is laid out for other ranks or parameters than this run's."""


def make_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], learning_rate: float, weight_decay: float = 0.01
) -> torch.optim.Optimizer:
    """The optimizer every run uses (AdamW, elementwise, so shards update like the full weight)."""
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)


def is_embedding(module: nn.Module) -> bool:
    """nn.Embedding, or a family's own embedding module (llama's VocabParallelEmbedding)."""
    return isinstance(module, nn.Embedding) or type(module).__name__.endswith("Embedding")


def no_decay_parameters(module: nn.Module, embeddings: bool = False) -> list[nn.Parameter]:
    """The parameters weight decay leaves alone: norms and biases (fewer than 2 dims, or named bias, as
    Megatron's default), and embeddings unless `embeddings`: those of an embedding module, and the weights
    a pipeline stage ties across stages (the embedding, also where only the head holds it)."""
    tied = getattr(module, "tied_weights", None)
    skip: list[nn.Parameter] = [] if embeddings or tied is None else list(tied())
    for _, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.ndim < 2 or name.endswith("bias") or (not embeddings and is_embedding(sub)):
                if all(p is not q for q in skip):
                    skip.append(p)
    return skip


def weight_decay_groups(module: nn.Module, weight_decay: float, embeddings: bool = False) -> list[dict[str, Any]]:
    """AdamW parameter groups with decay off for no_decay_parameters (the single-process reference's)."""
    skip = {id(p) for p in no_decay_parameters(module, embeddings)}
    params = list(module.parameters())
    return [
        {"params": [p for p in params if id(p) not in skip], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]


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
    """Where ZeRO-1 cuts one bucket of the flat buffers: equal shards of `padded` elements."""

    numel: int  # elements of the bucket's parameters on this rank
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


@dataclass(frozen=True)
class Bucket:
    """One reduction's gradients: parameters (indices into StageOptimizer.params) laid out from `offset`
    of the flat buffers, cut by `layout` into ZeRO-1's shards."""

    index: int
    params: tuple[int, ...]
    offset: int
    layout: FlatLayout
    tied: bool = False  # the tied embedding's: complete only after tie_gradients, started by reduce_gradients

    @property
    def stop(self) -> int:
        return self.offset + self.layout.padded


def plan_buckets(
    numels: Sequence[int], kinds: Sequence[str], bucket_elements: int, dp_size: int, dp_rank: int
) -> list[Bucket]:
    """Buckets of at least `bucket_elements` elements (but the last) over the parameters in reverse
    order, the order the backward completes them. kinds[i]: "reduce", "tied" (in a last bucket of their
    own) or "skip" (in none)."""
    groups: list[tuple[list[int], bool]] = []
    current: list[int] = []
    for i in reversed(range(len(numels))):
        if kinds[i] != "reduce":
            continue
        current.append(i)
        if sum(numels[j] for j in current) >= bucket_elements:
            groups.append((current, False))
            current = []
    if current:
        groups.append((current, False))
    if "tied" in kinds:
        groups.append(([i for i, kind in enumerate(kinds) if kind == "tied"], True))
    buckets, offset = [], 0
    for index, (members, is_tied) in enumerate(groups):
        layout = FlatLayout(sum(numels[i] for i in members), dp_size, dp_rank)
        buckets.append(Bucket(index, tuple(members), offset, layout, is_tied))
        offset += layout.padded
    return buckets


class StageOptimizer:
    """AdamW for one rank's parameters, with the data-parallel reduction of their gradients
    (zero_stage 0: all-reduce, every rank steps everything; 1: ZeRO-1, see the module docstring).

    `tied` parameters come with gradients already complete (parallel.tie_gradients): no reduction
    but ZeRO-1's scatter. `no_decay` parameters are left alone by weight decay."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        groups: StageGroups,
        learning_rate: float,
        weight_decay: float = 0.01,
        zero_stage: int = 0,
        tied: Sequence[nn.Parameter] = (),
        no_decay: Sequence[nn.Parameter] = (),
        overlap: bool = True,
        bucket_mib: float = DEFAULT_BUCKET_MIB,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        self.params, self.groups = list(params), groups
        self.tied = {id(p) for p in tied}
        self.weight_decay, self.overlap, self.reduce_dtype = weight_decay, overlap, reduce_dtype
        self.zero = zero_stage == 1 and groups.dp_size > 1
        self.counted = [self._counted(p) for p in self.params]
        skip = {id(p) for p in no_decay}
        self.decays = [id(p) not in skip for p in self.params]
        self.buckets: list[Bucket] = []
        if groups.dp_group is not None and self.params:
            # plain data parallelism leaves the tied ones out: their gradients are complete already
            kinds = ["reduce" if id(p) not in self.tied else "tied" if self.zero else "skip" for p in self.params]
            elements = max(1, int(bucket_mib * 2**20) // 4)  # fp32 gradient elements
            self.buckets = plan_buckets(
                [p.numel() for p in self.params], kinds, elements, groups.dp_size, groups.dp_rank
            )
        self.offsets = self._offsets()
        size = self.buckets[-1].stop if self.buckets else 0
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_flat = torch.zeros(size, dtype=torch.float32, device=device)  # every bucketed gradient's storage
        self._bucket_of = {i: b for b in self.buckets for i in b.params}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._pending: dict[int, int] = {}  # bucket index -> parameters whose gradient is not complete yet
        self._armed = False
        self._on_start: Callable[[str], None] | None = None
        self._works: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket index -> (work, reduced tensor)
        if self.buckets and self.overlap:
            for p in self.params:
                if id(p) not in self.tied:
                    p.register_post_accumulate_grad_hook(self._accumulated)
        if self.zero:
            self.flat = self._flatten()
            self.shards = [self.flat[b.offset + b.layout.shard[0] : b.offset + b.layout.shard[1]] for b in self.buckets]
            self.shard_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
            # leaf views: AdamW updates the buffer in place
            self.optimizer = make_optimizer(self.shards, learning_rate, 0.0)
            self.shard_counted = self._shard_masks(self.counted)
            self.shard_decays = self._shard_masks(self.decays)
        else:
            self.optimizer = make_optimizer(self.params, learning_rate, 0.0)

    # --- which elements this rank counts in the global norm ---------------------------------

    def _counted(self, p: nn.Parameter) -> bool:
        """Whether this rank is the one holder of p's gradient elements (before the data-parallel
        split of ZeRO-1): not a tensor-parallel copy of a replicated weight, not a redundant
        replica, not the last stage's copy of a tied weight; with plain data parallelism (every
        rank ends with the whole reduced gradient) only data-parallel rank 0."""
        g = self.groups
        if id(p) in self.tied and not g.is_first_stage:
            return False
        if not first_tp_copy(shard_info(p), g.tp):
            return False
        return g.replica_rank == 0 and (self.zero or g.dp_rank == 0)

    def _offsets(self) -> dict[int, int]:
        """Parameter index -> where its elements start in the flat buffers."""
        offsets: dict[int, int] = {}
        for b in self.buckets:
            at = b.offset
            for i in b.params:
                offsets[i] = at
                at += self.params[i].numel()
        return offsets

    def _shard_masks(self, flags: Sequence[bool]) -> list[torch.Tensor]:
        """Per bucket, which elements of this rank's shard belong to a parameter with the flag."""
        mask = torch.zeros(self.flat.numel(), dtype=torch.bool, device=self.flat.device)
        for i, flag in enumerate(flags):
            if i in self.offsets:
                mask[self.offsets[i] : self.offsets[i] + self.params[i].numel()] = flag
        return [mask[b.offset + b.layout.shard[0] : b.offset + b.layout.shard[1]] for b in self.buckets]

    # --- ZeRO-1's flat buffer ------------------------------------------------------------------

    def _flatten(self) -> torch.Tensor:
        flat = torch.zeros_like(self.grad_flat)
        for i, p in enumerate(self.params):
            at, n = self.offsets[i], p.numel()
            flat[at : at + n].copy_(p.detach().reshape(-1))
            p.data = flat[at : at + n].view_as(p)
        return flat

    def _grad_view(self, i: int) -> torch.Tensor:
        at, p = self.offsets[i], self.params[i]
        return self.grad_flat[at : at + p.numel()].view_as(p)

    # --- the bucketed reduction ------------------------------------------------------------

    def arm(self, on_start: Callable[[str], None] | None = None) -> None:
        """The step's last backward pass begins: from now on a bucket whose gradients are all complete
        starts its reduction (on_start(name) as each starts). No-op without overlap."""
        if self.buckets and self.overlap:
            self._armed, self._on_start = True, on_start

    def ready(self, params: Iterable[torch.Tensor]) -> None:
        """These parameters' gradients are complete (the backward hook, or the split backward's W per
        group of weights it computes)."""
        if not self._armed:
            return
        for p in params:
            i = self._index.get(id(p))
            bucket = None if i is None else self._bucket_of.get(i)
            if bucket is None or bucket.tied or bucket.index in self._works:
                continue
            left = self._pending.setdefault(bucket.index, len(bucket.params)) - 1
            self._pending[bucket.index] = left
            if left == 0:
                self._start(bucket)

    def flush(self) -> None:
        """The step's last backward pass ended: start every bucket not started yet (parameters no
        backward reached), in bucket order."""
        if self._armed:
            for bucket in self.buckets:
                if not bucket.tied and bucket.index not in self._works:
                    self._start(bucket)
        self._armed = False

    def _accumulated(self, p: torch.Tensor) -> None:
        self.ready([p])

    def _start(self, bucket: Bucket) -> None:
        g = self.groups
        grads = self.grad_flat[bucket.offset : bucket.stop]
        send = grads if self.reduce_dtype == grads.dtype else grads.to(self.reduce_dtype)
        if self.zero:
            start, stop = bucket.layout.shard
            out = torch.empty(stop - start, dtype=send.dtype, device=send.device)
            work = dist.reduce_scatter_single(out, send, group=g.dp_group, async_op=True)
        else:
            out = send
            work = dist.all_reduce(out, group=g.dp_group, async_op=True)
        self._works[bucket.index] = (work, out)
        if self._on_start is not None:
            self._on_start(f"reduce {bucket.index}")

    def reduce_gradients(self) -> None:
        """Data parallel: SUM the gradients over the DP group (each rank's loss is already its share
        of the global-batch mean, so a mean here would divide twice): start the buckets not started
        during the backward (all of them without overlap, and ZeRO-1's tied one, after tie_gradients),
        then wait for every one."""
        self._armed = False
        for bucket in self.buckets:
            if bucket.index in self._works:
                continue
            if bucket.tied:  # complete already: reduce-scattered from data-parallel rank 0's copy only
                for i in bucket.params:
                    p, view = self.params[i], self._grad_view(i)
                    if p.grad is not None and self.groups.dp_rank == 0:
                        view.copy_(p.grad)  # tie_gradients gave p a new gradient tensor
                    else:
                        view.zero_()
            self._start(bucket)
        for bucket in self.buckets:
            work, out = self._works.pop(bucket.index)
            work.wait()
            if self.zero:
                self.shard_grads[bucket.index] = out.float()
            elif out.dtype != torch.float32:  # reduced in another dtype: fp32 reduces in place
                self.grad_flat[bucket.offset : bucket.stop].copy_(out)
        self._pending.clear()
        if self.zero:
            for shard, grad in zip(self.shards, self.shard_grads):
                shard.grad = grad

    # --- the step --------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def local_square_sum(self) -> torch.Tensor:
        """The squares of the gradient elements this rank counts (float64, on the CPU)."""
        device = self.params[0].device if self.params else "cpu"
        total = torch.zeros((), dtype=torch.float64, device=device)
        if self.zero:
            for shard, in_norm in zip(self.shards, self.shard_counted):
                assert shard.grad is not None, "reduce_gradients() gives the shards their gradients first"
                total = total + shard.grad.double().pow(2)[in_norm].sum()
        else:
            for p, counted in zip(self.params, self.counted):
                if counted and p.grad is not None:
                    total = total + p.grad.double().pow(2).sum()
        return total.cpu()

    def scale_gradients(self, factor: float) -> None:
        for p in self.shards if self.zero else self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def _decay(self) -> None:
        """AdamW's decoupled decay, param.mul_(1 - lr * weight_decay) before the update as torch's AdamW
        does it (the optimizer itself runs with weight_decay 0), on the decayed elements only."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.weight_decay == 0 or lr == 0:
            return
        factor = 1.0 - lr * self.weight_decay
        with torch.no_grad():
            if self.zero:
                for shard, decayed in zip(self.shards, self.shard_decays):
                    shard[decayed] = shard[decayed] * factor
            else:
                for p, decays in zip(self.params, self.decays):
                    if decays and p.grad is not None:  # torch's AdamW skips a parameter without a gradient
                        p.mul_(factor)

    def step(self) -> None:
        self._decay()
        self.optimizer.step()
        if self.zero:
            works = []
            for bucket, shard in zip(self.buckets, self.shards):
                target = self.flat[bucket.offset : bucket.stop]
                works.append(dist.all_gather_single(target, shard.clone(), group=self.groups.dp_group, async_op=True))
            for work in works:
                work.wait()
            for shard in self.shards:
                shard.grad = None

    def zero_grad(self) -> None:
        """Before a step: bucketed gradients are zeroed views of the flat buffer (the backward adds into
        them in place), the others none."""
        self.grad_flat.zero_()
        for i, p in enumerate(self.params):
            p.grad = self._grad_view(i) if i in self.offsets else None

    # --- checkpoint state ------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            **FlatLayout(sum(p.numel() for p in self.params), self.groups.dp_size, self.groups.dp_rank).describe(),
            "buckets": [b.layout.numel for b in self.buckets],
        }

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state; under ZeRO-1 this rank's shards of it, with the layout they belong to."""
        state = self.optimizer.state_dict()
        return {"zero": self.describe(), "adamw": state} if self.zero else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses state laid out for another ZeRO stage, data-parallel degree, parameter count or buckets."""
        written = state.get("zero") if isinstance(state, dict) and "adamw" in state else None
        mine = self.describe() if self.zero else None
        if written != mine:
            raise OptimizerLayoutError(
                f"the checkpoint's optimizer state is {_layout_words(written)}, this run's is "
                f"{_layout_words(mine)}: resume with the spec.training.optimizer.zeroStage, data-parallel "
                f"meshes and spec.training.gradBucketMiB it was written with, or start from another "
                f"spec.training.checkpoint.path"
            )
        self.optimizer.load_state_dict(state["adamw"] if self.zero else state)
        for group in self.optimizer.param_groups:  # decay is _decay()'s: older checkpoints stored AdamW's own
            group["weight_decay"] = 0.0


def _layout_words(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "whole on every rank (zeroStage 0)"
    buckets = layout.get("buckets")
    cut = "" if buckets is None else f" in {len(buckets)} buckets"
    return (
        f"sharded by ZeRO-1 over {layout['dp_size']} data-parallel ranks ({layout['numel']} elements{cut}, this "
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
