"""Kubernetes Nodes -> plan-layer Hosts: which nodes can hold trainer pods, and how many devices each has."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from kubernetes.utils.quantity import parse_quantity

from meshjob.placement import Host
from meshjob.spec import TopologySpec



@dataclass(frozen=True)
class NodeInfo:
    name: str  # the Node's metadata.name
    host: str  # value of the topology's host label (what pods are pinned to); "" when missing
    rack: str  # value of the topology's rack label; "" when missing
    devices: int  # allocatable units of the device resource (whole devices)
    problem: str = ""  # why the node cannot hold trainer pods; "" when it can

    @property
    def usable(self) -> bool:
        return not self.problem


def _ready(node: Mapping[str, Any]) -> bool:
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def node_info(node: Mapping[str, Any], topology: TopologySpec) -> NodeInfo:
    meta = node.get("metadata", {})
    name = meta.get("name", "")
    labels = meta.get("labels") or {}
    raw = (node.get("status", {}).get("allocatable") or {}).get(topology.device_resource, "0")
    try:
        devices = max(0, math.floor(parse_quantity(raw)))
    except ValueError:
        devices = 0
    host = labels.get(topology.host_label, "")
    problems = []
    if not host:
        problems.append(f"no label {topology.host_label}")
    if not _ready(node):
        problems.append("not Ready")
    if node.get("spec", {}).get("unschedulable"):
        problems.append("unschedulable (cordoned)")
    if devices < 1:
        problems.append(f"no allocatable {topology.device_resource}")
    return NodeInfo(name=name, host=host, rack=labels.get(topology.rack_label, ""), devices=devices,
                    problem=", ".join(problems))


def node_infos(nodes: Iterable[Mapping[str, Any]], topology: TopologySpec) -> list[NodeInfo]:
    """Every node, sorted by name so that placement is deterministic whatever order the API lists."""
    return sorted((node_info(n, topology) for n in nodes), key=lambda info: info.name)


def hosts_of(infos: Iterable[NodeInfo]) -> tuple[Host, ...]:
    """Usable nodes as placement Hosts; a Host's name is its host label value (what pods are pinned to)."""
    return tuple(Host(name=i.host, devices=i.devices, rack=i.rack) for i in infos if i.usable)


def describe_cluster(infos: Iterable[NodeInfo], topology: TopologySpec) -> str:
    """One line for an Unschedulable message: what the cluster offers and which nodes were left out."""
    infos = list(infos)
    usable = [i for i in infos if i.usable]
    text = (f"{len(usable)} usable node(s) with {sum(i.devices for i in usable)} "
            f"{topology.device_resource} in total")
    left_out = [f"{i.name} ({i.problem})" for i in infos if not i.usable]
    if left_out:
        text += "; left out: " + "; ".join(left_out)
    return text
