"""Intra-stage parallelism: process groups per stage mesh, Megatron tensor-parallel linears,
and the gradient reductions that make a sharded stage compute what one process would.

Conventions (the natural layout, meshjob.spec.manifest.natural_layout): a stage's activation is sharded
over the batch along its data-parallel mesh dims (one, or several: S01 splits it over dim 0, then dim 1) and
replicated along its tensor-parallel dim. Mesh dims that are neither are redundant replicas (same inputs, same
gradients: nothing to reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshjob.layout.mesh import Mesh
from meshjob.spec.manifest import StageSpec


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group; size 1 means no tensor parallelism (group None)."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    dtype: torch.dtype = torch.float32  # what its reductions add in: bf16 under spec.training.precision bf16


@dataclass(frozen=True)
class StageGroups:
    """The groups one rank belongs to, built by build_groups()."""

    tp: TPGroup
    dp_group: dist.ProcessGroup | None  # None when the stage has no data parallelism
    dp_rank: int
    dp_size: int
    # ranks of the first and last stage together: the tied token embedding's gradient is summed
    # over it (None when this rank is in neither, or there is one stage).
    tie_group: dist.ProcessGroup | None
    tie_members: int  # number of ranks holding a copy of the tied embedding in this group's stage
    # 0 on the one rank of each set of redundant replicas (ranks of the stage that differ only along
    # mesh dims that are neither data- nor tensor-parallel: same inputs, same gradients)
    replica_rank: int = 0
    is_first_stage: bool = True


def _lines(mesh: Mesh, dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every set of ranks that differ only along the mesh dims `dims` (they share every other coordinate), in
    a fixed order; each set's ranks in row-major mesh order, which for increasing `dims` is the mixed-radix
    order of their coordinates along `dims`, major first (the order of the batch's tiles, S01)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in mesh.ranks:
        index = list(mesh.index_of(rank))
        for dim in dims:
            index[dim] = 0
        groups.setdefault(tuple(index), []).append(rank)
    return [tuple(g) for _, g in sorted(groups.items())]


def build_groups(
    stages: Sequence[StageSpec], meshes: Sequence[Mesh], rank: int, tp_dtype: torch.dtype = torch.float32
) -> StageGroups:
    """Create the DP, TP and tie groups of every stage (its spec names the DP and TP mesh dims, the
    plan's mesh holds its ranks; `tp_dtype` the tensor-parallel reductions'). Collective: every rank
    calls it with the same stages and meshes, so new_group is called in the same order everywhere."""
    stage = next(s for s, m in enumerate(meshes) if rank in m.ranks)
    tp, dp_group, dp_rank, dp_size = TPGroup(), None, 0, 1
    for spec, mesh in zip(stages, meshes):
        tp_dims = () if spec.tensor_parallel_dim is None else (spec.tensor_parallel_dim,)
        for dims, kind in ((tp_dims, "tp"), (spec.dp_dims, "dp")):
            if math.prod(mesh.shape[d] for d in dims) == 1:
                continue
            for members in _lines(mesh, dims):
                group = dist.new_group(list(members))
                if rank in members:
                    if kind == "tp":
                        tp = TPGroup(group, members.index(rank), len(members), tp_dtype)
                    else:
                        dp_group, dp_rank, dp_size = group, members.index(rank), len(members)
    tie_group, tie_members = None, len(meshes[stage].ranks)
    last = len(meshes) - 1
    if last > 0:
        group = dist.new_group(sorted(meshes[0].ranks + meshes[last].ranks))
        if stage in (0, last):
            tie_group = group
    return StageGroups(
        tp=tp,
        dp_group=dp_group,
        dp_rank=dp_rank,
        dp_size=dp_size,
        tie_group=tie_group,
        tie_members=tie_members,
        replica_rank=_replica_rank(stages[stage], meshes[stage], rank),
        is_first_stage=stage == 0,
    )


def _replica_rank(spec: StageSpec, mesh: Mesh, rank: int) -> int:
    """This rank's index along the mesh dims that are neither data- nor tensor-parallel."""
    index = 0
    for dim, (coord, size) in enumerate(zip(mesh.index_of(rank), mesh.shape)):
        if dim not in spec.dp_dims and dim != spec.tensor_parallel_dim:
            index = index * size + coord
    return index


def all_reduce_fp32(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over `group` of a (possibly bf16) tensor, added in fp32 and returned in x's dtype: partial
    sums rounded to bf16 once each, not again at every addition."""
    return all_reduce_in(x, group, torch.float32)


def all_reduce_in(x: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype) -> torch.Tensor:
    """The sum over `group` of x added in `dtype`, returned in x's dtype. The tensor-parallel reductions of
    activations and their gradients run in the training dtype (Megatron's): bf16 halves their bytes."""
    total = x.to(dtype, copy=True).contiguous()
    dist.all_reduce(total, group=group)
    return total.to(x.dtype)


# --- Megatron's conjugate pair: f (identity forward, all-reduce backward) and g (the reverse) ---


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.dtype = group, dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce_in(grad, ctx.group, ctx.dtype), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype) -> torch.Tensor:
        return all_reduce_in(x, group, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group, tp.dtype)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group, tp.dtype)


# --- sharded parameters -------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """How a local parameter relates to the full one: the slice `index` of `parts` equal slices
    along `dim` (dim None: replicated)."""

    dim: int | None
    index: int = 0
    parts: int = 1


def take_shard(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    if info.dim is None or info.parts == 1:
        return full.clone()
    return full.chunk(info.parts, dim=info.dim)[info.index].clone()


def sharded(full: torch.Tensor, info: ShardInfo) -> nn.Parameter:
    """A parameter holding this rank's shard; it remembers its ShardInfo for reassembly."""
    param = nn.Parameter(take_shard(full, info))
    param.shard = info  # type: ignore[attr-defined]  # torch's Parameter has no such attribute: ours (shard_info)
    return param


def shard_info(param: torch.Tensor) -> ShardInfo:
    return getattr(param, "shard", ShardInfo(None))


def first_tp_copy(info: ShardInfo, tp: TPGroup) -> bool:
    """Whether this rank holds the first of the identical copies the TP ranks keep of a parameter's slice:
    tp / parts copies (a replicated weight: all of them; llama's key/value heads when fewer than the ranks)."""
    parts = 1 if info.dim is None else info.parts
    return tp.rank % (tp.size // parts) == 0


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over the TP group: input replicated, output
    sharded. The caller applies copy_to_tp to the input once for all column-parallel linears
    that read it (q, k and v share one backward all-reduce)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__()
        info = ShardInfo(0, tp.rank, tp.size)
        self.weight = sharded(weight, info)
        self.bias = None if bias is None else sharded(bias, info)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over TP ranks of x_r W_r^T, + b once: input sharded on its last dim, output
    replicated (all-reduced forward; its backward is the identity)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = sharded(weight, ShardInfo(1, tp.rank, tp.size))
        self.bias = None if bias is None else sharded(bias, ShardInfo(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


# --- the tied embedding's gradient -------------------------------------------------------


def tie_gradients(tied: Sequence[nn.Parameter], groups: StageGroups) -> None:
    """The first and the last stage each hold a copy of a tied parameter (the token embedding, used
    for the input lookup and the output head): give every copy the gradient of the one tied weight.

    This runs before the data-parallel reduction, which then leaves these parameters out (their
    gradient is complete): each rank adds its own gradient divided by the ranks that hold the same
    slice for the same rows of data (tensor-parallel copies of a replicated weight, redundant mesh
    dims), so the sum over the tie group counts every data-parallel rank of both stages once. A
    sharded copy (llama's vocab-parallel embedding) goes into a full-size buffer at its slice, so
    stages of different tensor-parallel degrees tie as well."""
    if groups.tie_group is None:
        return
    for p in tied:
        info = shard_info(p)
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        shape = list(p.shape)
        if info.dim is not None:
            shape[info.dim] *= info.parts
        full = torch.zeros(shape, dtype=torch.float32, device=p.device)
        mine = full if info.dim is None else full.chunk(info.parts, dim=info.dim)[info.index]
        mine.copy_(grad / (groups.tie_members // (info.parts * groups.dp_size)))
        dist.all_reduce(full, group=groups.tie_group)
        p.grad = mine.to(p.dtype).clone()


def init_std(hidden: int, layers: int, residual_proj: bool) -> float:
    """nanoGPT's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)."""
    return 0.02 / math.sqrt(2 * layers) if residual_proj else 0.02
