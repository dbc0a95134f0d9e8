"""A Node's pods on the cluster network: each pod its own namespace and address (meshjob_cluster.network), and a
hosts file that gives it the names cluster DNS would (meshjob_cluster.dns), rewritten as pods come and go.

The node agent calls `place` before a pod's containers start and `release` once they have ended; `keep_names`
runs beside it and refreshes every hosts file it made from the cluster's pods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshjob_cluster.dns import hosts_text, write_in_place
from meshjob_cluster.network import ClusterNetwork, PodNet, node_address
from meshjob_cluster.podspec import PodPlace

ListPods = Callable[[], Awaitable[list[dict[str, Any]]]]


@dataclass
class NodePods:
    """The pods of node `index` of `network`, with their hosts files under `state_dir/hosts`."""

    network: ClusterNetwork
    index: int
    state_dir: Path
    node_name: str
    placed: dict[str, tuple[PodNet, Mapping[str, Any], Path]] = field(default_factory=dict)  # uid -> ...

    def place(self, pod: Mapping[str, Any]) -> PodPlace:
        uid = pod["metadata"]["uid"]
        if uid not in self.placed:
            net = self.network.add_pod(self.index)
            hosts = (
                self.state_dir / "hosts" / f"{pod['metadata'].get('namespace', 'default')}_{pod['metadata']['name']}"
            )
            hosts.parent.mkdir(parents=True, exist_ok=True)
            write_in_place(hosts, hosts_text(pod, net.ip, []))
            self.placed[uid] = (net, pod, hosts)
        net, _, hosts = self.placed[uid]
        address = node_address(self.index)
        return PodPlace(pod_ip=net.ip, node_name=self.node_name, host_ip=address, netns=net.netns, hosts_file=hosts)

    def release(self, pod: Mapping[str, Any]) -> None:
        found = self.placed.pop(pod["metadata"]["uid"], None)
        if found is not None:
            net, _, hosts = found
            self.network.remove_pod(net)
            hosts.unlink(missing_ok=True)

    def refresh(self, pods: list[dict[str, Any]]) -> int:
        """Rewrite every placed pod's hosts file from the cluster's `pods`; how many changed."""
        return sum(write_in_place(hosts, hosts_text(own, net.ip, pods)) for net, own, hosts in self.placed.values())

    async def keep_names(self, list_pods: ListPods, every: float = 1.0) -> None:
        """Refresh the hosts files every `every` seconds while pods are placed, until cancelled."""
        while True:
            if self.placed:
                try:
                    self.refresh(await list_pods())
                except OSError:  # the API server away for a moment: the next round catches up
                    pass
            await asyncio.sleep(every)
