"""The Plan: everything decided before a process starts (placement, boundaries, schedules).

CONTRACT STUB. Names other modules rely on:
  @dataclass(frozen=True) Boundary: src: int; dst: int; tensor: str ("activation", "skip<i>",
      and "grad:<tensor>" for the backward direction); shape: tuple[int, ...];
      send: ShardingSpec; recv: ShardingSpec; strategy: str; balancer: str; chunks: int;
      tasks: tuple[UnitTask, ...]; schedule: balance.Schedule; senders: tuple[int, ...] (chosen
      sender rank per task); steps: tuple[Step, ...] (lowered, ordered by task start);
      makespan_s; lower_bound_s;  to_json()
  @dataclass(frozen=True) Plan: job: TrainingJob; placement: Placement;
      boundaries: tuple[Boundary, ...]; schedules: dict[int, tuple[Action, ...]];
      nic_bytes_per_s: float;  mesh(stage) -> Mesh; to_json() -> dict (DESIGN.md contract)
  build_plan(job, hosts=None, nic_bytes_per_s=1e9/8) -> Plan
"""
from __future__ import annotations
