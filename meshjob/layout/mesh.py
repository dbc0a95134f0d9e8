"""Device meshes: an N-d array (1-3 dims) of global ranks; mesh dim 0 runs across hosts."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

MAX_DIMS = 3


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks, row-major over shape
    hosts: tuple[int, ...]  # host index (into the plan's host list) of each device, row-major
    _position: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape, ranks, hosts = tuple(self.shape), tuple(self.ranks), tuple(self.hosts)
        if not 1 <= len(shape) <= MAX_DIMS or any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(f"mesh shape {shape!r} is invalid: 1 to {MAX_DIMS} positive integers")
        size = math.prod(shape)
        if len(ranks) != size or len(hosts) != size:
            raise ValueError(
                f"mesh of shape {shape} needs {size} ranks and hosts (got {len(ranks)} ranks, {len(hosts)} hosts)"
            )
        if len(set(ranks)) != size:
            raise ValueError(f"mesh ranks {ranks} are invalid: each global rank at most once")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "_position", {r: i for i, r in enumerate(ranks)})

    @classmethod
    def grid(cls, shape: tuple[int, ...], first_rank: int = 0, first_host: int = 0) -> Mesh:
        """Consecutive ranks, one host per index of mesh dim 0 (mesh dim 0 runs across hosts)."""
        size = math.prod(shape)
        per_host = size // shape[0]
        return cls(
            tuple(shape),
            tuple(range(first_rank, first_rank + size)),
            tuple(first_host + i // per_host for i in range(size)),
        )

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def index_of(self, rank: int) -> tuple[int, ...]:
        """Mesh index (one coordinate per mesh dim) of a global rank."""
        try:
            flat = self._position[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in this mesh (ranks {self.ranks})") from None
        index = []
        for n in reversed(self.shape):
            flat, i = divmod(flat, n)
            index.append(i)
        return tuple(reversed(index))

    def rank_at(self, index: tuple[int, ...]) -> int:
        if len(index) != len(self.shape) or any(not 0 <= i < n for i, n in zip(index, self.shape)):
            raise ValueError(f"mesh index {tuple(index)} is outside mesh shape {self.shape}")
        flat = 0
        for i, n in zip(index, self.shape):
            flat = flat * n + i
        return self.ranks[flat]

    def host_of(self, rank: int) -> int:
        self.index_of(rank)  # validates the rank
        return self.hosts[self._position[rank]]

    def hosts_used(self) -> tuple[int, ...]:
        """Distinct host indices in first-seen (row-major) order."""
        return tuple(dict.fromkeys(self.hosts))

    def indices(self) -> list[tuple[int, ...]]:
        """Every mesh index, row-major (the order of `ranks`)."""
        return list(itertools.product(*(range(n) for n in self.shape)))
