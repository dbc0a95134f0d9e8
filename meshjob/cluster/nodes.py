"""Kubernetes Nodes -> placement Hosts: the one conversion `meshjob plan --cluster` and the operator share.

Both call `plan_on_nodes` with the job and the Nodes as the API returns them (plain JSON dicts), so the
plan a user inspects is the plan the operator runs. Pure: resource quantities are parsed by the
caller's parser (kubernetes.utils.parse_quantity), so the plan layer imports no Kubernetes client.

A Node becomes a Host when it is Ready, schedulable, carries the topology's host label and the
device resource, tolerates nothing it must not (the job's podTemplate tolerations cover every
NoSchedule/NoExecute taint) and matches the podTemplate's nodeSelector and required node affinity.
The Host offers min(allocatable devices, topology.devicesPerHost) devices: devicesPerHost is the
number of devices the job uses per host, whatever a node could give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from meshjob.errors import PlacementError
from meshjob.plan.build import Plan
from meshjob.plan.placement import Host, Placement
from meshjob.plan.rendered import DEFAULT_NIC_BYTES_PER_S, PlanInputs
from meshjob.spec.api import JOB_LABEL, pod_name
from meshjob.spec.manifest import PodTemplateSpec, TopologySpec, TrainingJob

Quantity = Callable[[str], Decimal]  # a Kubernetes quantity parser: "4", "3500m", "1Ki" -> Decimal
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class NodeInfo:
    name: str  # the Node's metadata.name
    host: str  # value of the topology's host label (what pods are pinned to); "" when missing
    rack: str  # value of the topology's rack label; "" when missing
    devices: int  # devices the job may use there: allocatable, at most topology.devicesPerHost
    problem: str = ""  # why the job's pods cannot go there; "" when they can

    @property
    def usable(self) -> bool:
        return not self.problem


def _ready(node: Mapping[str, Any]) -> bool:
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            ready: bool = cond.get("status") == "True"
            return ready
    return False


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' rule: empty effect matches every effect; operator Exists with an empty key matches
    every taint; Exists ignores the value; Equal (the default) compares it."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    operator = toleration.get("operator") or "Equal"
    if not toleration.get("key"):
        return operator == "Exists"
    if toleration.get("key") != taint.get("key"):
        return False
    return operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated(node: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> list[str]:
    """The node's scheduling taints no toleration covers, as key=value:effect."""
    return [
        f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
        for t in node.get("spec", {}).get("taints") or []
        if t.get("effect") in BLOCKING_EFFECTS and not any(tolerates(tol, t) for tol in tolerations)
    ]


def _matches(expression: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    """One nodeSelectorRequirement against a node's labels (or its fields, for matchFields)."""
    key: str | None = expression.get("key")
    operator, wanted = expression.get("operator"), expression.get("values") or []
    have = values.get(key) if key is not None else None
    if operator == "In":
        return have in wanted
    if operator == "NotIn":
        return have not in wanted
    if operator == "Exists":
        return have is not None
    if operator == "DoesNotExist":
        return have is None
    if operator in ("Gt", "Lt") and have is not None and wanted:
        try:
            number, bound = int(have), int(wanted[0])
        except ValueError:
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def required_affinity_matches(affinity: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """requiredDuringScheduling node affinity: any term, each with all its expressions."""
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    meta = node.get("metadata", {})
    labels, fields = meta.get("labels") or {}, {"metadata.name": meta.get("name", "")}
    return any(
        all(_matches(e, labels) for e in term.get("matchExpressions") or [])
        and all(_matches(e, fields) for e in term.get("matchFields") or [])
        for term in terms
    )


def _problems(
    node: Mapping[str, Any], topology: TopologySpec, template: PodTemplateSpec, allocatable: int, free: int
) -> list[str]:
    labels = node.get("metadata", {}).get("labels") or {}
    problems = []
    if not labels.get(topology.host_label):
        problems.append(f"no label {topology.host_label}")
    if not _ready(node):
        problems.append("not Ready")
    if node.get("spec", {}).get("unschedulable"):
        problems.append("unschedulable (cordoned)")
    if allocatable < 1:
        problems.append(f"no allocatable {topology.device_resource}")
    elif free < 1:
        problems.append(f"all {allocatable} {topology.device_resource} in use by other pods")
    taints = untolerated(node, template.tolerations)
    if taints:
        problems.append(f"taint {', '.join(taints)} not tolerated (spec.podTemplate.spec.tolerations)")
    wrong = sorted(k for k, v in template.node_selector.items() if labels.get(k) != v)
    if wrong:
        problems.append(f"label {', '.join(wrong)} differs from spec.podTemplate.spec.nodeSelector")
    if not required_affinity_matches(template.affinity, node):
        problems.append("outside spec.podTemplate.spec.affinity (required node affinity)")
    return problems


def _count(raw: Any, quantity: Quantity) -> int:
    try:
        return max(0, math.ceil(quantity(str(raw))))
    except (ValueError, ArithmeticError):
        return 0


def node_info(node: Mapping[str, Any], job: TrainingJob, quantity: Quantity, in_use: int = 0) -> NodeInfo:
    """The node as a host for the job: its allocatable devices less `in_use` (what other pods there request),
    at most topology.devicesPerHost."""
    topology = job.topology
    meta = node.get("metadata", {})
    labels = meta.get("labels") or {}
    raw = (node.get("status", {}).get("allocatable") or {}).get(topology.device_resource, "0")
    try:
        allocatable = max(0, math.floor(quantity(str(raw))))
    except (ValueError, ArithmeticError):
        allocatable = 0
    free = max(0, allocatable - in_use)
    problems = _problems(node, topology, job.pod_template.spec, allocatable, free)
    return NodeInfo(
        name=meta.get("name", ""),
        host=labels.get(topology.host_label, ""),
        rack=labels.get(topology.rack_label, ""),
        devices=min(free, topology.devices_per_host),
        problem="; ".join(problems),
    )


def node_infos(
    nodes: Iterable[Mapping[str, Any]], job: TrainingJob, quantity: Quantity, pods: Iterable[Mapping[str, Any]] = ()
) -> list[NodeInfo]:
    """Every node, less the devices `pods` (any but the job's own) use there, sorted by name so that
    placement is deterministic whatever order the API lists."""
    nodes = list(nodes)
    in_use = devices_in_use(pods, nodes, job, quantity)
    return sorted(
        (node_info(n, job, quantity, in_use.get(n.get("metadata", {}).get("name", ""), 0)) for n in nodes),
        key=lambda info: info.name,
    )


def _requested(pod: Mapping[str, Any], resource: str, quantity: Quantity) -> int:
    """Devices a pod requests (a limit alone is the request, as for every extended resource); an init
    container runs alone, so the pod holds the larger of its largest init container and its containers."""

    def of(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        raw = (res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource, 0))
        return _count(raw, quantity)

    spec = pod.get("spec") or {}
    return max(
        sum(of(c) for c in spec.get("containers") or []),
        max((of(c) for c in spec.get("initContainers") or []), default=0),
    )


def devices_in_use(
    pods: Iterable[Mapping[str, Any]], nodes: Sequence[Mapping[str, Any]], job: TrainingJob, quantity: Quantity
) -> dict[str, int]:
    """Devices of the job's resource that pods hold or wait for, per node name: every pod not terminated
    (Succeeded, Failed) but the job's own, on its spec.nodeName, or, not scheduled yet, on the one node its
    nodeSelector and required node affinity allow (the operator pins its pods by affinity; others pin theirs
    with a nodeSelector on kubernetes.io/hostname); a pending pod more than one node could take is the
    scheduler's to place and counts nowhere yet."""
    used: dict[str, int] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            continue
        if meta.get("namespace") == job.namespace and (meta.get("labels") or {}).get(JOB_LABEL) == job.name:
            continue
        devices = _requested(pod, job.topology.device_resource, quantity)
        if not devices:
            continue
        node = (pod.get("spec") or {}).get("nodeName") or _pinned_node(pod, nodes)
        if node:
            used[node] = used.get(node, 0) + devices
    return used


def _pinned_node(pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the one node a pending pod's nodeSelector and required node affinity allow, if one."""
    spec = pod.get("spec") or {}
    selector: Mapping[str, Any] = spec.get("nodeSelector") or {}
    affinity: Mapping[str, Any] = spec.get("affinity") or {}
    if not selector and not affinity:
        return None
    allowed = [
        n
        for n in nodes
        if all((n.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items())
        and required_affinity_matches(affinity, n)
    ]
    return str(allowed[0].get("metadata", {}).get("name")) if len(allowed) == 1 else None


def still_fits(pods: Sequence[HostPod], infos: Iterable[NodeInfo]) -> bool:
    """Whether every host pod of a plan still finds its devices free (another job may have taken them
    while this one was planned)."""
    by_host = {i.host: i for i in infos if i.usable}
    return all(p.host in by_host and by_host[p.host].devices >= p.devices for p in pods)


def hosts_of(infos: Iterable[NodeInfo]) -> tuple[Host, ...]:
    """Usable nodes as placement Hosts; a Host's name is its host label value (what pods are pinned to)."""
    return tuple(Host(name=i.host, devices=i.devices, rack=i.rack) for i in infos if i.usable)


def describe_cluster(infos: Iterable[NodeInfo], topology: TopologySpec) -> str:
    """One line for an Unschedulable message: what the cluster offers and which nodes were left out."""
    infos = list(infos)
    usable = [i for i in infos if i.usable]
    text = (
        f"{len(usable)} usable node(s) with {sum(i.devices for i in usable)} "
        f"{topology.device_resource} for the job in total (at most topology.devicesPerHost="
        f"{topology.devices_per_host} per node)"
    )
    left_out = [f"{i.name} ({i.problem})" for i in infos if not i.usable]
    if left_out:
        text += "; left out: " + "; ".join(left_out)
    return text


@dataclass(frozen=True)
class HostPod:
    index: int  # node rank: position among the hosts the job uses, in plan order
    host: str  # the host label value the pod is pinned to (= placement Host.name)
    rack: str
    devices: int  # trainer processes in the pod (= devices the plan uses on that host)
    stages: tuple[int, ...]  # pipeline stages with ranks on this host
    stage_devices: tuple[int, ...] = ()  # devices of each of those stages on this host

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "host": self.host,
            "rack": self.rack,
            "devices": self.devices,
            "stages": list(self.stages),
        }


def host_pods(placement: Placement) -> tuple[HostPod, ...]:
    """One HostPod per host the placement uses, in plan order (the unit the operator creates)."""
    pods = []
    for index, host_idx in enumerate(placement.hosts_used()):
        host = placement.hosts[host_idx]
        ranks = placement.ranks_on(host_idx)
        per_stage: dict[int, int] = {}
        for slot in placement.slots:
            if slot.host == host_idx:
                per_stage[slot.stage] = per_stage.get(slot.stage, 0) + 1
        stages = sorted(per_stage)
        pods.append(
            HostPod(
                index=index,
                host=host.name,
                rack=host.rack,
                devices=len(ranks),
                stages=tuple(stages),
                stage_devices=tuple(per_stage[s] for s in stages),
            )
        )
    return tuple(pods)


def world_size(pods: tuple[HostPod, ...]) -> int:
    return sum(p.devices for p in pods)


def pods_json(job: TrainingJob, plan: Plan, infos: Iterable[NodeInfo]) -> list[dict[str, Any]]:
    """The trainer pods the operator creates for this plan: name, node, devices, stages."""
    node_of_host = {i.host: i.name for i in infos if i.host}
    return [
        {"name": pod_name(job.name, p.index), "node": node_of_host.get(p.host, ""), **p.to_json()}
        for p in host_pods(plan.placement)
    ]


def plan_on_nodes(
    job: TrainingJob,
    nodes: Iterable[Mapping[str, Any]],
    quantity: Quantity,
    nic_bytes_per_s: float = DEFAULT_NIC_BYTES_PER_S,
    pods: Iterable[Mapping[str, Any]] = (),
) -> tuple[PlanInputs, Plan, list[NodeInfo]]:
    """The plan of the job on these Nodes, less the devices the cluster's `pods` hold there (and the inputs
    it is a function of, which the operator renders for its workers): what the operator runs and
    `meshjob plan --cluster` prints.

    Raises PlacementError saying what is missing and which nodes were left out, and why."""
    infos = node_infos(nodes, job, quantity, pods)
    inputs = PlanInputs.of(job, hosts_of(infos), nic_bytes_per_s)
    try:
        return inputs, inputs.build(), infos
    except PlacementError as err:
        raise PlacementError(f"{err} (cluster: {describe_cluster(infos, job.topology)})") from None
