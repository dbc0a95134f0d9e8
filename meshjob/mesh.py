"""Device meshes: an N-d array (1-3 dims) of global ranks; mesh dim 0 runs across hosts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks, row-major over shape
    hosts: tuple[int, ...]  # host index (into the plan's host list) of each device, row-major

    # CONTRACT STUB (owner: resharding/sharding module author):
    # size, index_of(rank) -> tuple, rank_at(index) -> int, host_of(rank) -> int,
    # hosts_used() -> tuple of distinct host indices in first-seen order
