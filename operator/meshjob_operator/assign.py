"""The Plan's placement -> one HostPod per host the job uses (the unit the operator creates)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostPod:
    index: int  # node rank: position among the hosts the job uses, in plan order
    host: str  # the host label value the pod is pinned to (= placement Host.name)
    rack: str
    devices: int  # trainer processes in the pod (= devices the plan uses on that host)
    stages: tuple[int, ...]  # pipeline stages with ranks on this host
    stage_devices: tuple[int, ...] = ()  # devices of each of those stages on this host

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "host": self.host, "rack": self.rack, "devices": self.devices,
                "stages": list(self.stages)}


def host_pods(placement: Any) -> tuple[HostPod, ...]:
    """Read a meshjob.placement.Placement (duck-typed: hosts, slots, hosts_used(), ranks_on())."""
    pods = []
    for index, host_idx in enumerate(placement.hosts_used()):
        host = placement.hosts[host_idx]
        ranks = placement.ranks_on(host_idx)
        per_stage: dict[int, int] = {}
        for slot in placement.slots:
            if slot.host == host_idx:
                per_stage[slot.stage] = per_stage.get(slot.stage, 0) + 1
        stages = sorted(per_stage)
        pods.append(HostPod(index=index, host=host.name, rack=host.rack, devices=len(ranks),
                            stages=tuple(stages), stage_devices=tuple(per_stage[s] for s in stages)))
    return tuple(pods)


def world_size(pods: tuple[HostPod, ...]) -> int:
    return sum(p.devices for p in pods)


def status_placement(placement_rows: list[dict[str, Any]], node_of_host: dict[str, str]) -> list[dict[str, Any]]:
    """status.placement from Placement.to_json(): one entry per mesh row, with the Node it landed on."""
    return [{"stage": row["stage"], "host": row["host"], "node": node_of_host.get(row["host"], ""),
             "devices": list(row["devices"])} for row in placement_rows]
