"""Placement: hosts -> stage meshes (each mesh row on one host; racks and adjacency respected).

CONTRACT STUB. Names other modules rely on:
  @dataclass(frozen=True) Host: name: str; devices: int; rack: str = ""
  @dataclass(frozen=True) RankSlot: rank: int; stage: int; host: int; local_device: int
  @dataclass(frozen=True) Placement: hosts: tuple[Host, ...]; slots: tuple[RankSlot, ...]
      (ordered by global rank: stage by stage, each mesh row-major)
      world_size, ranks_on(host) -> tuple[int, ...], host_of(rank) -> int, mesh(stage) -> Mesh,
      hosts_used() -> tuple[int, ...], to_json() -> list[{stage, host, devices}]
  place(job: TrainingJob, hosts: Sequence[Host]) -> Placement   # raises PlacementError
  default_hosts(job) -> tuple[Host, ...]   # smallest cluster of identical hosts that fits the job
  load_hosts(path) -> tuple[Host, ...]     # hosts.yaml: [{name, devices, rack}]
"""
from __future__ import annotations
