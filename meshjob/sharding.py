"""GSPMD sharding specs (seed 000 §2.2) and the tile each device holds.

CONTRACT STUB. Types and names other modules rely on:
  Interval = tuple[int, int]          # [start, stop)
  Slice = tuple[Interval, ...]        # one interval per tensor dim
  ShardingSpec(dims: tuple[tuple[int, ...], ...])   # per tensor dim: mesh dims, major first; () = R
    ShardingSpec.parse(text: str, ndim: int | None = None) -> ShardingSpec   # "S01R", "S01,R", "RS1"
    str(spec) -> canonical compact form, e.g. "S01R", "RRR"
    spec.is_replicated(), spec.mesh_dims_used()
  check_spec(spec, mesh_shape, tensor_shape, path="") -> list[FieldError]   # divisibility, reuse, ndim
  tile(spec, mesh_shape, tensor_shape, mesh_index) -> Slice
  slice_shape(s) -> tuple[int, ...]; slice_numel(s) -> int; intersect(a, b) -> Slice | None
  contains(outer, inner) -> bool
  at_least_as_sharded(finer, coarser) -> bool   # finer's tiles nest in coarser's (edge layout rule)
"""
from __future__ import annotations
