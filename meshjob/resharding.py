"""Cross-mesh resharding: decomposition into unit tasks (seed 000 App. B) and lowering by strategy.

CONTRACT STUB. Names other modules rely on:
  @dataclass(frozen=True) UnitTask: slice: Slice; senders: tuple[int, ...] (global ranks holding it);
      receivers: tuple[int, ...] (global ranks needing it); bytes: int
  decompose(shape, src_mesh, src_spec, dst_mesh, dst_spec, itemsize=4) -> list[UnitTask]
  @dataclass(frozen=True) Step: id: int; task: int; src: int; dst: int (global ranks);
      region: Slice (global tensor coordinates); after: tuple[int, ...] (step ids that must finish
      before src may send: src receives region through them); scope: "cross_host" | "intra_host";
      signal: bool (send 1 byte instead of the region);  property nbytes(itemsize=4)
  lower(task, task_index, sender, strategy, chunks, host_of: Callable[[int], int],
        first_step_id=0) -> list[Step]
      strategies: send_recv, local_allgather, global_allgather, broadcast, signal.
      All-gathers are lowered to point-to-point ring steps, so executors only copy regions.
  nic_bytes(steps, host_of, itemsize=4) -> dict[host, (bytes_out, bytes_in)]   # cross_host only
"""
from __future__ import annotations
