"""Host-level sender choice and ordering of unit tasks (seed 000 §3.2), with a NIC cost model.

CONTRACT STUB. Names other modules rely on:
  @dataclass(frozen=True) HostTask: sender_hosts: tuple[int, ...]; receiver_hosts: tuple[int, ...];
      bytes: int
  task_seconds(task: HostTask, sender_host, strategy, chunks, receiver_devices_per_host: int,
               nic_bytes_per_s) -> float       # the strategy's cost formula (A*B*t, A*t, 2t, t+(A-1)t/K)
  @dataclass(frozen=True) Schedule: sender_host: tuple[int, ...]; start_s: tuple[float, ...];
      seconds: tuple[float, ...]; makespan_s: float; lower_bound_s: float; balancer: str
  balance(tasks, balancer, strategy, chunks, nic_bytes_per_s, budget_s=1.0, seed=0,
          receiver_devices_per_host=1) -> Schedule
  lower_bound(tasks, nic_bytes_per_s) -> float   # max over hosts of NIC bytes / bandwidth
"""
from __future__ import annotations
