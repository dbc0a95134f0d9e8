"""GSPMD sharding specs and the tile each device holds (§2.2 of
"On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022)).

A spec has one entry per tensor dim: the mesh dims that dim is sharded over (major first), or ()
for replicated. Written compactly as `S01R` / `RS1` / `S0RR`, or separated as `S01,R`; the compact
form is canonical. Names other modules rely on:
  Interval, Slice, ShardingSpec(.parse, str, .is_replicated, .mesh_dims_used), check_spec, tile,
  slice_shape, slice_numel, intersect, contains, at_least_as_sharded.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from meshjob.errors import FieldError, SpecError

Interval = tuple[int, int]  # [start, stop)
Slice = tuple[Interval, ...]  # one interval per tensor dim

_TOKEN = re.compile(r"R|S[0-9]+")
_ALLOWED = (
    "one token per tensor dim: R (replicated) or S<mesh dims> (e.g. S0, S01), "
    "written compactly (S01R) or comma-separated (S01,R)"
)


@dataclass(frozen=True)
class ShardingSpec:
    dims: tuple[tuple[int, ...], ...]  # per tensor dim: mesh dims, major first; () = replicated

    @classmethod
    def parse(cls, text: str, ndim: int | None = None, path: str = "spec") -> ShardingSpec:
        """Parse compact (`S01R`) or separated (`S01,R`) notation; raise SpecError naming `path`."""
        if not isinstance(text, str):
            raise SpecError([FieldError(path, text, "a string; " + _ALLOWED)])
        compact = text.replace(" ", "")
        parts = compact.split(",") if "," in compact else [compact]
        tokens: list[str] = []
        for part in parts:
            found = _TOKEN.findall(part)
            if not part or "".join(found) != part:
                raise SpecError([FieldError(path, text, _ALLOWED)])
            if "," in compact and len(found) != 1:
                raise SpecError([FieldError(path, text, "exactly one token between commas; " + _ALLOWED)])
            tokens.extend(found)
        if ndim is not None and len(tokens) != ndim:
            raise SpecError([FieldError(path, text, f"{ndim} tokens, one per tensor dim (got {len(tokens)})")])
        return cls(tuple(() if t == "R" else tuple(int(c) for c in t[1:]) for t in tokens))

    def __str__(self) -> str:
        return "".join("R" if not d else "S" + "".join(str(m) for m in d) for d in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def is_replicated(self) -> bool:
        return all(not d for d in self.dims)

    def mesh_dims_used(self) -> tuple[int, ...]:
        return tuple(m for d in self.dims for m in d)

    def shards(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Number of pieces each tensor dim is cut into on this mesh."""
        return tuple(math.prod(mesh_shape[m] for m in d) for d in self.dims)


def check_spec(
    spec: ShardingSpec, mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...], path: str = "spec"
) -> list[FieldError]:
    """Every reason `spec` cannot lay out `tensor_shape` on a mesh of `mesh_shape` (empty if valid)."""
    errors: list[FieldError] = []
    text = str(spec)
    if spec.ndim != len(tensor_shape):
        errors.append(
            FieldError(
                path, text, f"{len(tensor_shape)} tokens, one per dim of tensor {tuple(tensor_shape)} (got {spec.ndim})"
            )
        )
    used = spec.mesh_dims_used()
    for m in sorted({m for m in used if used.count(m) > 1}):
        errors.append(
            FieldError(path, text, f"each mesh dim at most once (mesh dim {m} is used {used.count(m)} times)")
        )
    for m in sorted({m for m in used if m >= len(mesh_shape)}):
        errors.append(
            FieldError(
                path,
                text,
                f"mesh dims 0..{len(mesh_shape) - 1} of mesh {tuple(mesh_shape)} (mesh dim {m} does not exist)",
            )
        )
    if errors:
        return errors
    for axis, (length, pieces) in enumerate(zip(tensor_shape, spec.shards(mesh_shape))):
        if length % pieces:
            errors.append(
                FieldError(
                    path,
                    text,
                    f"tensor dim {axis} (length {length}) divisible by the "
                    f"{pieces} shards of mesh dims {list(spec.dims[axis])}",
                )
            )
    return errors


def tile(
    spec: ShardingSpec, mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...], mesh_index: tuple[int, ...]
) -> Slice:
    """The part of the tensor held by the device at `mesh_index` (spec assumed valid)."""
    out: list[Interval] = []
    for length, mesh_dims in zip(tensor_shape, spec.dims):
        pieces, shard = 1, 0
        for m in mesh_dims:  # major first: mixed-radix index over the listed mesh dims
            shard = shard * mesh_shape[m] + mesh_index[m]
            pieces *= mesh_shape[m]
        size = length // pieces
        out.append((shard * size, (shard + 1) * size))
    return tuple(out)


def full_slice(tensor_shape: tuple[int, ...]) -> Slice:
    return tuple((0, n) for n in tensor_shape)


def slice_shape(s: Slice) -> tuple[int, ...]:
    return tuple(b - a for a, b in s)


def slice_numel(s: Slice) -> int:
    return math.prod(slice_shape(s))


def intersect(a: Slice, b: Slice) -> Slice | None:
    """The common region of two slices, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def contains(outer: Slice, inner: Slice) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def relative(s: Slice, origin: Slice) -> Slice:
    """`s` in the local coordinates of a buffer holding `origin` (e.g. a device's tile)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(s, origin))


def to_index(s: Slice) -> tuple[slice, ...]:
    """A Python index (tuple of slices) selecting `s` from an array."""
    return tuple(slice(a, b) for a, b in s)


def at_least_as_sharded(
    finer: ShardingSpec, coarser: ShardingSpec, mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...]
) -> bool:
    """True when on every device the tile of `finer` lies inside the tile of `coarser`:
    `finer` can then be produced from `coarser` by local slicing alone."""
    for index in itertools.product(*(range(n) for n in mesh_shape)):
        if not contains(tile(coarser, mesh_shape, tensor_shape, index), tile(finer, mesh_shape, tensor_shape, index)):
            return False
    return True
