"""Cross-mesh resharding's unit tasks: a tensor's decomposition into slices, and the steps that move them.

Appendix B of "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022).

decompose() cuts the tensor at every shard boundary of both specs, so each resulting slice is held
whole by a set of source devices and needed whole by a set of destination devices: one UnitTask.
A strategy (meshjob.resharding.strategies) lowers one UnitTask into point-to-point region copies
(Steps) for a chosen sender rank; all-gathers become ring steps, so executors only ever copy regions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshjob.errors import SpecError
from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec, Slice, check_spec, slice_numel, slice_shape, tile

CROSS_HOST = "cross_host"
INTRA_HOST = "intra_host"


@dataclass(frozen=True)
class UnitTask:
    slice: Slice
    senders: tuple[int, ...]  # global ranks holding the slice, source mesh row-major order
    receivers: tuple[int, ...]  # global ranks needing it, destination mesh row-major order
    bytes: int


@dataclass(frozen=True)
class Step:
    id: int
    task: int
    src: int  # global rank
    dst: int
    region: Slice  # global tensor coordinates
    after: tuple[int, ...]  # steps through which src receives `region`; they finish first
    scope: str  # CROSS_HOST or INTRA_HOST
    signal: bool = False  # send 1 byte instead of the region (upper-bound baseline)

    def nbytes(self, itemsize: int = 4) -> int:
        return 1 if self.signal else slice_numel(self.region) * itemsize


def _cuts(length: int, pieces: int) -> set[int]:
    return {length * i // pieces for i in range(pieces + 1)}


def decompose(
    shape: tuple[int, ...],
    src_mesh: Mesh,
    src_spec: ShardingSpec,
    dst_mesh: Mesh,
    dst_spec: ShardingSpec,
    itemsize: int = 4,
) -> list[UnitTask]:
    """Unit tasks of resharding a tensor of `shape` from (src_mesh, src_spec) to (dst_mesh, dst_spec).

    Slices are ordered row-major over the per-dim intervals."""
    errors = check_spec(src_spec, src_mesh.shape, shape, "src_spec") + check_spec(
        dst_spec, dst_mesh.shape, shape, "dst_spec"
    )
    if errors:
        raise SpecError(errors)
    src_pieces, dst_pieces = src_spec.shards(src_mesh.shape), dst_spec.shards(dst_mesh.shape)
    intervals = []
    for length, a, b in zip(shape, src_pieces, dst_pieces):
        points = sorted(_cuts(length, a) | _cuts(length, b))
        intervals.append(list(zip(points, points[1:])))
    holders = _holders_by_shard(shape, src_mesh, src_spec)
    needers = _holders_by_shard(shape, dst_mesh, dst_spec)
    tasks = []
    for piece in itertools.product(*intervals):
        # Cuts include every shard boundary, so each piece lies in exactly one shard per spec.
        src_key = tuple(lo * k // n for (lo, _), k, n in zip(piece, src_pieces, shape))
        dst_key = tuple(lo * k // n for (lo, _), k, n in zip(piece, dst_pieces, shape))
        tasks.append(UnitTask(piece, holders[src_key], needers[dst_key], slice_numel(piece) * itemsize))
    return tasks


def _holders_by_shard(shape: tuple[int, ...], mesh: Mesh, spec: ShardingSpec) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Per-dim shard index -> the ranks (row-major) whose tile is that shard."""
    pieces = spec.shards(mesh.shape)
    out: dict[tuple[int, ...], list[int]] = {}
    for rank in mesh.ranks:
        t = tile(spec, mesh.shape, shape, mesh.index_of(rank))
        out.setdefault(tuple(lo * k // n for (lo, _), k, n in zip(t, pieces, shape)), []).append(rank)
    return {key: tuple(ranks) for key, ranks in out.items()}


def split(region: Slice, parts: int) -> list[Slice]:
    """Cut `region` into at most `parts` non-empty pieces (no more than its longest dim has elements),
    each as few contiguous runs of the row-major tensor as the region allows: along its outermost dim
    that has `parts` elements; where none before it has, every element of the outer dims apart first,
    then each slab so (a piece cut along an inner dim is one short run per outer element, which every
    executor must pack and unpack through a copy: CPU per byte on shared cores)."""
    sizes = slice_shape(region)
    parts = max(1, min(parts, max(sizes)))
    for axis, n in enumerate(sizes):
        if n >= parts:
            start, stop = region[axis]
            bounds = [start + (stop - start) * i // parts for i in range(parts + 1)]
            return [region[:axis] + ((lo, hi),) + region[axis + 1 :] for lo, hi in zip(bounds, bounds[1:])]
        if n > 1:  # fewer elements than parts: a slab per element, each cut in parts // n
            start, _ = region[axis]
            slabs = [region[:axis] + ((start + i, start + i + 1),) + region[axis + 1 :] for i in range(n)]
            return [piece for slab in slabs for piece in split(slab, parts // n)]
    return [region]


def group_by_host(ranks: Iterable[int], host_of: Callable[[int], int]) -> list[list[int]]:
    """Ranks grouped by host, hosts in first-seen order, ranks in given order."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(host_of(r), []).append(r)
    return list(groups.values())


def nic_bytes(steps: Iterable[Step], host_of: Callable[[int], int], itemsize: int = 4) -> dict[int, tuple[int, int]]:
    """Bytes each host's NIC sends and receives (cross-host steps only): host -> (out, in)."""
    out: dict[int, list[int]] = {}
    for s in steps:
        if s.scope != CROSS_HOST:
            continue
        n = s.nbytes(itemsize)
        out.setdefault(host_of(s.src), [0, 0])[0] += n
        out.setdefault(host_of(s.dst), [0, 0])[1] += n
    return {h: (o, i) for h, (o, i) in out.items()}
