"""Kubernetes Nodes -> placement Hosts (meshjob.cluster.nodes): what the operator and `meshjob plan --cluster` share."""

from __future__ import annotations

import pytest
from kubernetes.utils.quantity import parse_quantity

from meshjob.cluster.nodes import (
    describe_cluster,
    devices_in_use,
    hosts_of,
    node_info,
    node_infos,
    plan_on_nodes,
    still_fits,
    tolerates,
)
from meshjob.errors import PlacementError
from meshjob.plan.placement import Host
from meshjob.spec.manifest import parse_job
from meshjob_operator.testing import job_body, node_body

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def job(devices_per_host: int = 2, hosts: int = 2, **template):
    body = job_body("x", hosts=hosts, devices_per_host=devices_per_host)
    if template:
        body["spec"]["podTemplate"] = {"spec": template}
    return parse_job(body)


def test_ready_schedulable_labelled_nodes_become_hosts_with_whole_devices():
    node = node_body("n1", 3, rack="r1")
    node["status"]["allocatable"]["cpu"] = "3500m"
    info = node_info(node, job(devices_per_host=2), parse_quantity)
    assert (info.name, info.host, info.rack, info.devices, info.usable) == ("n1", "n1", "r1", 2, True)
    assert hosts_of([info]) == (Host("n1", 2, "r1"),)
    node["status"]["allocatable"]["cpu"] = "1500m"
    assert node_info(node, job(devices_per_host=2), parse_quantity).devices == 1


def test_a_host_offers_the_job_at_most_devices_per_host():
    """devicesPerHost is the number of devices the job uses per host, whatever a node could give."""
    assert node_info(node_body("n1", 8), job(devices_per_host=2), parse_quantity).devices == 2


def a_pod(
    devices: int,
    node: str = "",
    *,
    pin: str = "",
    phase: str = "Running",
    namespace: str = "other",
    labels: dict | None = None,
) -> dict:
    """A pod requesting `devices` cpu, on `node`, or pending and pinned to host `pin` as the operator pins."""
    spec: dict = {"containers": [{"name": "c", "resources": {"limits": {"cpu": str(devices)}}}]}
    if node:
        spec["nodeName"] = node
    if pin:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [pin]}]}
                    ]
                }
            }
        }
    return {
        "metadata": {"name": "p", "namespace": namespace, "labels": labels or {}},
        "spec": spec,
        "status": {"phase": phase},
    }


def test_devices_other_pods_hold_or_are_pinned_to_are_not_offered():
    nodes = [node_body("n1", 2), node_body("n2", 2)]
    pods = [
        a_pod(1, "n1"),
        a_pod(2, pin="n2"),
        a_pod(2, "n1", phase="Succeeded"),
        a_pod(2, phase="Pending"),
        a_pod(2, "n1", namespace="default", labels={"meshjob.io/job-name": "x"}),
    ]  # the job's own
    assert devices_in_use(pods, nodes, job(), parse_quantity) == {"n1": 1, "n2": 2}
    infos = node_infos(nodes, job(), parse_quantity, pods)
    assert [(i.name, i.devices) for i in infos] == [("n1", 1), ("n2", 0)]
    assert "all 2 cpu in use by other pods" in infos[1].problem and not infos[1].usable


def test_pending_pods_pinned_by_node_name_or_a_hostname_node_selector_hold_that_nodes_devices():
    """A pod bound to a node (spec.nodeName) or pinned there by a nodeSelector on kubernetes.io/hostname (or any
    selector only one node matches) holds its devices there before the scheduler binds it; a selector several
    nodes match is the scheduler's to place and counts nowhere yet."""
    nodes = [node_body("n1", 2, labels={"pool": "a"}), node_body("n2", 2, labels={"pool": "b"})]
    nodes.append(node_body("n3", 2, labels={"pool": "b"}))
    pinned, bound, pooled, pool_b = (a_pod(2, phase="Pending") for _ in range(4))
    pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "n2"}
    bound["spec"]["nodeName"] = "n3"
    pooled["spec"]["nodeSelector"] = {"pool": "a"}  # only n1 is in pool a
    pool_b["spec"]["nodeSelector"] = {"pool": "b"}  # n2 or n3: not placed yet
    assert devices_in_use([pinned, bound, pooled, pool_b], nodes, job(), parse_quantity) == {"n1": 2, "n2": 2, "n3": 2}
    infos = node_infos(nodes, job(), parse_quantity, [pinned])
    assert [(i.name, i.devices) for i in infos] == [("n1", 2), ("n2", 0), ("n3", 2)]
    from meshjob.cluster.nodes import host_pods

    _, plan, _ = plan_on_nodes(job(), nodes, parse_quantity, pods=[pinned])
    planned = host_pods(plan.placement)
    assert {p.host for p in planned} == {"n1", "n3"}
    assert not still_fits(planned, node_infos(nodes, job(), parse_quantity, [pinned, bound]))


def test_a_plan_no_longer_fits_once_another_job_took_its_devices():
    nodes = [node_body("n1", 2), node_body("n2", 2), node_body("n3", 2)]
    _, plan, infos = plan_on_nodes(job(), nodes, parse_quantity, pods=[a_pod(2, "n1")])
    from meshjob.cluster.nodes import host_pods

    pods = host_pods(plan.placement)
    assert {p.host for p in pods} == {"n2", "n3"} and still_fits(pods, infos)
    assert not still_fits(pods, node_infos(nodes, job(), parse_quantity, [a_pod(2, "n1"), a_pod(1, "n3")]))


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(ready=False), "not Ready"),
        (dict(unschedulable=True), "unschedulable (cordoned)"),
        (dict(devices=0), "no allocatable cpu"),
        (dict(host_label="other/label"), "no label kubernetes.io/hostname"),
        (dict(taints=[GPU_TAINT]), "taint nvidia.com/gpu=present:NoSchedule not tolerated"),
    ],
)
def test_unusable_nodes_are_left_out_with_the_reason(change, problem):
    args = {"devices": 2, **change}
    info = node_info(node_body("n1", args.pop("devices"), **args), job(), parse_quantity)
    assert not info.usable and problem in info.problem
    assert hosts_of([info]) == ()
    assert f"n1 ({info.problem})" in describe_cluster([info], job().topology)


def test_a_tolerated_taint_and_a_soft_one_leave_the_node_usable():
    tolerating = job(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    soft = {"key": "spot", "value": "true", "effect": "PreferNoSchedule"}
    assert node_info(node_body("n1", 2, taints=[GPU_TAINT, soft]), tolerating, parse_quantity).usable


@pytest.mark.parametrize(
    "toleration, tolerated",
    [
        ({"operator": "Exists"}, True),  # empty key with Exists: every taint
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}, True),  # empty effect: every effect
        ({"key": "nvidia.com/gpu", "value": "absent"}, False),  # Equal is the default operator
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, False),
        ({"key": "other", "operator": "Exists"}, False),
    ],
)
def test_tolerations_follow_the_kubernetes_rules(toleration, tolerated):
    assert tolerates(toleration, GPU_TAINT) is tolerated


def test_node_selector_and_required_node_affinity_narrow_the_nodes():
    nodes = [
        node_body("a", 2, labels={"pool": "gpu", "gen": "9"}),
        node_body("b", 2, labels={"pool": "gpu"}),
        node_body("c", 2, labels={"pool": "cpu", "gen": "9"}),
    ]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["8"]}]}]
            }
        }
    }
    infos = node_infos(nodes, job(nodeSelector={"pool": "gpu"}, affinity=affinity), parse_quantity)
    assert [i.name for i in infos if i.usable] == ["a"]
    assert "outside spec.podTemplate.spec.affinity" in infos[1].problem
    assert "label pool differs from spec.podTemplate.spec.nodeSelector" in infos[2].problem


def test_node_order_does_not_change_the_hosts():
    nodes = [node_body(n, 2) for n in ("c", "a", "b")]
    assert hosts_of(node_infos(nodes, job(), parse_quantity)) == hosts_of(
        node_infos(list(reversed(nodes)), job(), parse_quantity)
    )


def test_gpu_nodes_are_counted_by_the_device_resource():
    body = job_body("x")
    body["spec"]["topology"] = {"devicesPerHost": 8, "deviceResource": "nvidia.com/gpu"}
    gpu_job = parse_job(body)
    assert node_info(node_body("g1", 8, resource="nvidia.com/gpu"), gpu_job, parse_quantity).devices == 8
    assert not node_info(node_body("c1", 8), gpu_job, parse_quantity).usable


def test_nodes_with_more_devices_than_devices_per_host_get_one_pod_per_mesh_row():
    """The issue's case: devicesPerHost 2, Nodes allocating 4: 4 hosts of 2 devices, as `meshjob plan` shows."""
    body = job_body("x", hosts=4, devices_per_host=2)  # stage 0: one 2-device row, stage 1: three
    _, plan, _ = plan_on_nodes(parse_job(body), [node_body(f"n{i}", 4) for i in range(4)], parse_quantity)
    assert {len(plan.placement.ranks_on(h)) for h in plan.placement.hosts_used()} == {2}
    assert len(plan.placement.hosts_used()) == 4


def test_a_cluster_too_small_says_which_nodes_were_left_out_and_why():
    nodes = [node_body("a", 2), node_body("b", 2, taints=[GPU_TAINT])]
    with pytest.raises(PlacementError, match=r"missing 1 host.*left out: b \(taint nvidia.com/gpu=present"):
        plan_on_nodes(job(hosts=2), nodes, parse_quantity)


def _plan(*argv: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "plan", "examples/tiny.yaml", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--cluster", "--hosts", "h.yaml"), "--cluster and --hosts exclude each other"),
        (("--kubeconfig", "k.yaml"), "--kubeconfig and --context go with --cluster"),
        (("--cluster", "--kubeconfig", "/nonexistent/kubeconfig"), "--cluster: cannot load the kubeconfig"),
        (
            ("--cluster", "--duplex", "half"),
            "it takes --nic-rate, not --calibrate, --duplex, --message-us or --emulated",
        ),
        (("--cluster", "--calibrate"), "it takes --nic-rate, not --calibrate, --duplex, --message-us or --emulated"),
        (("--cluster", "--emulated"), "it takes --nic-rate, not --calibrate, --duplex, --message-us or --emulated"),
    ],
)
def test_plan_cluster_usage_errors_exit_2_naming_the_flag(argv, message):
    result = _plan(*argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_plan_cluster_says_when_the_api_server_cannot_be_reached(tmp_path):
    import yaml

    from meshjob_operator.testing import free_port

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    result = _plan("--cluster", "--kubeconfig", str(tmp_path / "kubeconfig"))
    assert result.returncode == 2 and "--cluster: cannot reach the API server" in result.stderr, result.stderr
