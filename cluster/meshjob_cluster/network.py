"""The local cluster's network: every Node a network namespace behind one bridge, `tc tbf` on both ends of its
link as its NIC, and every pod a namespace of its own on its Node's pod bridge, as kubenet lays a real one.

    <prefix>_sw      bridge br0: the switch; every Node's link and the root namespace's link plug in here
    root namespace   <prefix>-root 198.51.100.254/24 (the API server, Prometheus and kubectl reach pods here)
    <prefix>_n<i>    eth0 198.51.100.<i+1>/24 (tbf both ways: the Node's NIC), bridge cbr0 203.0.113.<16i+1>/28
    <prefix>_p<i>_<k> eth0 203.0.113.<16i+1+k>/28 on node i's cbr0, default route through the Node

Each Node routes its pods' /28 (forwarding on); the root namespace and every other Node reach node i's pods
through 198.51.100.<i+1>. Traffic between pods of one Node stays on its bridge, off the NIC, as on a real
host. Every address is in a documentation range (RFC 5737), never one of this machine's own networks.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

NODE_NET = "198.51.100"
ROOT_ADDRESS = f"{NODE_NET}.254"
POD_NET = "203.0.113"
MAX_NODES = 16  # a /28 of 203.0.113.0/24 each
MAX_PODS_PER_NODE = 13  # .16i+2 .. .16i+14
NETNS_DIR = "/var/run/netns"


class NetworkError(RuntimeError):
    """A namespace, link, address or route could not be made; the message has the failing command."""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _in(ns: str, *cmd: str) -> None:
    _run("ip", "netns", "exec", ns, *cmd)


def node_address(index: int) -> str:
    return f"{NODE_NET}.{index + 1}"


def pod_cidr(index: int) -> str:
    return f"{POD_NET}.{16 * index}/28"


def pod_gateway(index: int) -> str:
    return f"{POD_NET}.{16 * index + 1}"


@dataclass(frozen=True)
class PodNet:
    """A pod's network namespace and address on its Node."""

    netns: str
    ip: str
    slot: int


@dataclass(frozen=True)
class ClusterNetwork:
    """The namespaces, links and routes of a local cluster of `nodes` Nodes (see the module's docstring)."""

    nodes: int
    nic_rate: str = "1gbit"
    burst: str = "128kb"
    latency: str = "10ms"
    prefix: str = "mjc"

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes {self.nodes!r} is invalid: 1 to {MAX_NODES}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r} is invalid: 1-6 lowercase letters and digits")

    @property
    def switch(self) -> str:
        return f"{self.prefix}_sw"

    def node_netns(self, index: int) -> str:
        return f"{self.prefix}_n{index}"

    def up(self) -> None:
        """Make the switch, the root namespace's link, every Node and the routes between them."""
        sw, root_link = self.switch, f"{self.prefix}-root"
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        _ip("link", "add", root_link, "type", "veth", "peer", "name", "root", "netns", sw)
        _ip("addr", "add", f"{ROOT_ADDRESS}/24", "dev", root_link)
        _ip("link", "set", root_link, "up")
        _ip("-n", sw, "link", "set", "root", "master", "br0")
        _ip("-n", sw, "link", "set", "root", "up")
        for i in range(self.nodes):
            self._node(i)
        for j in range(self.nodes):
            _ip("route", "add", pod_cidr(j), "via", node_address(j))
            for i in range(self.nodes):
                if i != j:
                    _ip("-n", self.node_netns(i), "route", "add", pod_cidr(j), "via", node_address(j))

    def _node(self, i: int) -> None:
        ns, port = self.node_netns(i), f"n{i}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", ns, "addr", "add", f"{node_address(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        # the NIC, both ways: what the Node sends (eth0) and what it receives (its switch port)
        for where, dev in ((ns, "eth0"), (self.switch, port)):
            _in(
                where,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.nic_rate,
                "burst",
                self.burst,
                "latency",
                self.latency,
            )
        _ip("-n", ns, "link", "add", "cbr0", "type", "bridge")
        _ip("-n", ns, "addr", "add", f"{pod_gateway(i)}/28", "dev", "cbr0")
        _ip("-n", ns, "link", "set", "cbr0", "up")
        _in(ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")

    def add_pod(self, node: int) -> PodNet:
        """A namespace for a new pod on `node`, with the first free address of the Node's range."""
        taken = {
            int(m.group(1))
            for m in map(self._pod_name.fullmatch, _netns())
            if m and m.group(0).startswith(f"{self.prefix}_p{node}_")
        }
        free = [k for k in range(1, MAX_PODS_PER_NODE + 1) if k not in taken]
        if not free:
            raise NetworkError(f"node {node} has no pod address left ({MAX_PODS_PER_NODE} pods at most)")
        slot = free[0]
        ns, port, ip = f"{self.prefix}_p{node}_{slot}", f"p{slot}", f"{POD_NET}.{16 * node + 1 + slot}"
        _ip("netns", "add", ns)
        try:
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.node_netns(node))
            _ip("-n", self.node_netns(node), "link", "set", port, "master", "cbr0")
            _ip("-n", self.node_netns(node), "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/28", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", pod_gateway(node))
        except NetworkError:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            raise
        return PodNet(netns=ns, ip=ip, slot=slot)

    @property
    def _pod_name(self) -> re.Pattern[str]:
        return re.compile(rf"{self.prefix}_p\d+_(\d+)")

    def remove_pod(self, pod: PodNet) -> None:
        """The pod's namespace, and with it its link (idempotent)."""
        subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)

    def down(self) -> list[str]:
        """Delete every namespace of this cluster (pods, Nodes, switch; the root link and the routes through it
        go with the switch). Returns what it deleted; idempotent."""
        mine = [n for n in _netns() if n.startswith(f"{self.prefix}_")]
        order = sorted(mine, key=lambda n: (not n.startswith(f"{self.prefix}_p"), n == self.switch, n))
        for name in order:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.prefix}-root"], capture_output=True)
        return order


def _netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []
