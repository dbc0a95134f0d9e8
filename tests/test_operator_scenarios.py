"""The operator's scenarios, written once and run against kmock and a real kube-apiserver.

`cluster` is parametrized: kmock's in-memory API server (a fresh one per scenario), and (when
KUBEBUILDER_ASSETS names a folder with kube-apiserver, as tests/run.sh arranges) a real kube-apiserver
v1.20 with kube-controller-manager and ServiceAccount admission on, as on every real cluster (one for the
module: each scenario has its own namespace, nodes and device resource). No kubelet runs: a scenario
plays it by patching pod status. Tests that need one kind of server only live in
test_operator_kmock.py (fault injection) and test_operator_envtest.py (peering, kubectl apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import (  # noqa: F401 - the fixtures: kmock and a real API server
    add_nodes,
    apiserver,
    cluster,
    condition,
    delete_and_wait,
    env_of,
    job_gone,
    operator,
    plan_on_cluster,
    prepare_namespace,
    scenario_job,
    wait_pods,
    wait_status,
)
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from meshjob.spec import api
from meshjob_operator import names
from meshjob_operator.handlers import STATE
from meshjob_operator.reconcile import ALLOWED_IMAGES_ENV
from meshjob_operator.status import parse_time
from meshjob_operator.testing import Cluster, OperatorThread, eventually, free_port, job_body, running_operator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


async def create_service_account(cluster: Cluster, namespace: str, name: str) -> None:
    """What a job's namespace needs before pods may name the account (ServiceAccount admission)."""
    if cluster.real:
        await cluster.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        )


async def test_create_makes_pinned_pods_with_env_service_configmap_and_owner(cluster, operator):
    tag = "create"
    await prepare_namespace(cluster, tag)
    nodes = await add_nodes(cluster, tag, 2)
    job = await cluster.create_job(scenario_job(tag))
    pods = await wait_pods(cluster, tag, 2)
    uid = (await cluster.job(tag, tag))["metadata"]["uid"]
    pinned = set()
    for index, pod in enumerate(pods):
        env = env_of(pod)
        assert pod["metadata"]["name"] == f"{tag}-host-{index}"
        assert env["NODE_RANK"] == str(index) and env["WORLD_SIZE"] == "4" and env["PET_NNODES"] == "2"
        assert env["MASTER_ADDR"] == f"{tag}-host-0.{tag}.{tag}.svc"
        assert pod["metadata"]["labels"][names.HOST_INDEX_LABEL] == str(index)
        assert [o["uid"] for o in pod["metadata"]["ownerReferences"]] == [uid]
        term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        pinned.update(term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])
    assert pinned == set(nodes)  # one pod per node
    svc = await cluster.get("services", tag, tag)
    cm = await cluster.get("configmaps", f"{tag}-plan", tag)
    assert svc["spec"]["clusterIP"] == "None" and "plan.json" in cm["data"]
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Created", "phase Created")
    assert status["hosts"] == 2 and {p["node"] for p in status["placement"]} == set(nodes)
    assert condition(status, "Created")["status"] == "True"
    assert job["metadata"]["name"] == tag
    await delete_and_wait(cluster, tag)


@contextlib.contextmanager
def trainer_exporter(step: int, checkpoint_step: int, step_seconds: float) -> Iterator[int]:
    """A Prometheus exporter on 127.0.0.1 with what global rank 0 serves (the names of meshjob.spec.api)."""
    registry = CollectorRegistry()
    labels = {"trainingjob": "x", "stage": "0"}
    Gauge(api.STEP_METRIC, "step", list(labels), registry=registry).labels(**labels).set(step)
    Gauge(api.CHECKPOINT_STEP_METRIC, "ckpt", list(labels), registry=registry).labels(**labels).set(checkpoint_step)
    histogram = Histogram(api.STEP_SECONDS_METRIC, "time", list(labels), registry=registry).labels(**labels)
    for _ in range(step):
        histogram.observe(step_seconds)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port
    finally:
        server.shutdown()
        thread.join(5)


async def test_running_pods_report_progress_then_success_cleans_up_and_ttl_deletes(cluster, operator):
    """The operator reads step, checkpoint step and progress from global rank 0's metrics endpoint (pod 0's
    IP, spec.metrics.port); all pods Succeeded: the job too, its pods cleaned up, then deleted by its TTL."""
    tag = "success"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    with trainer_exporter(step=7, checkpoint_step=4, step_seconds=2.0) as port:
        body = scenario_job(
            tag, run_policy={"ttlSecondsAfterFinished": 2, "cleanPodPolicy": "All"}, metrics={"port": port}
        )
        body["spec"]["training"]["steps"] = 10
        await cluster.create_job(body)
        pods = await wait_pods(cluster, tag, 2)
        for pod in pods:
            await cluster.set_pod_phase(pod["metadata"]["name"], "Running", tag, ip="127.0.0.1")
        status = await wait_status(
            cluster, tag, lambda s: s.get("phase") == "Running" and s.get("step") == 7, "Running at step 7"
        )
    assert status["checkpointStep"] == 4 and condition(status, "Running")["status"] == "True"
    progress = status["progress"]
    assert (progress["step"], progress["total"], progress["percent"]) == (7, 10, 70)
    assert (
        5
        <= (
            parse_time(progress["eta"]) - parse_time(condition(status, "Running")["lastTransitionTime"])
        ).total_seconds()
        <= 60
    )  # 3 steps of 2 s from about now
    assert set(status["pods"].values()) == {"Running"}
    summaries = ['{"step": 10}\n', '{"step": 10, "loss": 2.25}\n']  # the last stage's host knows the loss
    for pod, summary in zip(pods, summaries):
        await cluster.set_pod_phase(pod["metadata"]["name"], "Succeeded", tag, message=summary)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Succeeded", "Succeeded")
    assert status["completionTime"] and condition(status, "Succeeded")["reason"] == "AllPodsSucceeded"
    assert status["step"] == 10 and status["loss"] == 2.25
    assert "final loss 2.2500" in condition(status, "Succeeded")["message"]
    assert condition(status, "Running")["status"] == "False" and status["progress"]["percent"] == 100
    await wait_pods(cluster, tag, 0)  # cleanPodPolicy All
    await eventually(lambda: job_gone(cluster, tag), timeout=20, what="job deleted by ttlSecondsAfterFinished")


async def test_pod_failure_restarts_the_gang_then_fails_after_backoff_limit(cluster, operator):
    tag = "restart"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, run_policy={"backoffLimit": 1, "cleanPodPolicy": "All"}))
    first = await wait_pods(cluster, tag, 2)
    failures = STATE.metrics.restarts.labels(namespace=tag, trainingjob=tag, reason="failure")
    before = failures._value.get()  # the registry outlives one operator: kmock's run counts too
    await cluster.set_pod_phase(first[1]["metadata"]["name"], "Failed", tag)
    status = await wait_status(
        cluster, tag, lambda s: s.get("restarts") == 1 and not s.get("restartPending"), "restart 1"
    )
    assert condition(status, "Restarting")["status"] == "True"
    assert f"pod {tag}-host-1 failed" in condition(status, "Restarting")["message"]
    second = await wait_pods(cluster, tag, 2, phase="Pending")
    if cluster.real:  # recreated, not kept: new uids
        assert {p["metadata"]["uid"] for p in second}.isdisjoint({p["metadata"]["uid"] for p in first})
    assert failures._value.get() == before + 1
    await cluster.set_pod_phase(second[0]["metadata"]["name"], "Failed", tag)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "Failed after backoffLimit")
    failed = condition(status, "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit=1" in failed["message"]
    assert status["restarts"] == 1
    await wait_pods(cluster, tag, 0)
    await delete_and_wait(cluster, tag)


async def test_suspend_deletes_pods_and_resume_recreates_them(cluster, operator):
    tag = "suspend"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag))
    await wait_pods(cluster, tag, 2)
    await cluster.patch_job(tag, {"spec": {"runPolicy": {"suspend": True}}}, tag)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Suspended", "Suspended")
    assert condition(status, "Suspended")["status"] == "True"
    await wait_pods(cluster, tag, 0)
    await cluster.patch_job(tag, {"spec": {"runPolicy": {"suspend": False}}}, tag)
    await wait_pods(cluster, tag, 2)
    status = await wait_status(cluster, tag, lambda s: condition(s, "Suspended").get("status") == "False", "resumed")
    assert condition(status, "Suspended")["reason"] == "Resumed" and status["phase"] != "Suspended"
    await delete_and_wait(cluster, tag)


@pytest.mark.parametrize("case", ["layers", "image"])
async def test_invalid_spec_sets_invalid_spec_condition_and_warning_event(cluster, operator, monkeypatch, case):
    """A spec the plan layer refuses, and an image off the operator's allow-list (no webhook stopped either:
    the operator refuses them itself)."""
    tag = f"invalid-{case}"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    body = scenario_job(tag)
    if case == "layers":
        body["spec"]["stages"][1]["layers"] = [1, 3]  # past the model's 2 layers: the schema cannot tell
        field, says = "spec.stages[1].layers", "spec.stages[1].layers: [1, 3] is invalid"
    else:
        monkeypatch.setenv(ALLOWED_IMAGES_ENV, "registry.example.com/ml/*")
        field, says = "spec.image", "one matching registry.example.com/ml/*"
    await cluster.create_job(body)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "Failed")
    failed = condition(status, "Failed")
    assert failed["reason"] == "InvalidSpec" and field in failed["message"] and says in failed["message"]

    async def warning() -> list[dict] | None:
        found = [
            e
            for e in await cluster.events(tag)
            if e.get("reason") == "InvalidSpec"
            and e.get("type") == "Warning"
            and e.get("involvedObject", {}).get("name") == tag
        ]
        return found or None

    events = await eventually(warning, what="a Warning Event InvalidSpec")
    assert field in events[0]["message"]
    assert await cluster.pods(tag, tag) == []
    await delete_and_wait(cluster, tag)


async def test_unschedulable_until_a_node_appears(cluster, operator):
    tag = "unsched"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 1)
    await cluster.create_job(scenario_job(tag))
    status = await wait_status(
        cluster, tag, lambda s: condition(s, "Unschedulable").get("status") == "True", "Unschedulable"
    )
    message = condition(status, "Unschedulable")["message"]
    assert "missing 1 host" in message and f"example.com/{tag}" in message
    assert await cluster.pods(tag, tag) == []
    await add_nodes(cluster, tag, 1, start=1)
    await wait_pods(cluster, tag, 2)
    status = await wait_status(
        cluster, tag, lambda s: condition(s, "Unschedulable").get("status") == "False", "scheduled"
    )
    assert condition(status, "Unschedulable")["reason"] == "Scheduled"
    await delete_and_wait(cluster, tag)


async def test_a_pod_the_scheduler_places_nowhere_makes_the_job_say_why(cluster, operator):
    """The operator placed the job, but the scheduler finds no node for one pod (another tenant took the
    node's memory, say): condition Unschedulable quotes the scheduler's message, with a Warning Event, rather than
    a phase Created that hides the wait; a new reason gets a new Event; it clears once the pod is placed."""
    tag = "podunsched"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag))
    pod = (await wait_pods(cluster, tag, 2))[1]["metadata"]["name"]
    why = "0/2 nodes are available: 1 Insufficient memory, 1 node(s) didn't match Pod's node affinity/selector."
    await cluster.set_pod_scheduled(pod, tag, unschedulable=why)
    status = await wait_status(
        cluster, tag, lambda s: condition(s, "Unschedulable").get("status") == "True", "Unschedulable"
    )
    assert condition(status, "Unschedulable")["reason"] == "PodUnschedulable"
    assert f"pod {pod}: {why}" in condition(status, "Unschedulable")["message"]

    async def warned() -> list[dict] | None:
        return [e for e in await cluster.events(tag) if e.get("reason") == "Unschedulable"] or None

    assert why in (await eventually(warned, what="a Warning Event Unschedulable"))[0]["message"]
    later = "0/2 nodes are available: 2 node(s) had untolerated taint {meshjob.io/maintenance: now}."
    await cluster.set_pod_scheduled(pod, tag, unschedulable=later)

    await wait_status(cluster, tag, lambda s: later in condition(s, "Unschedulable").get("message", ""), "new reason")

    async def warned_again() -> list[dict] | None:
        return [e for e in await warned() or [] if later in e.get("message", "")] or None

    if cluster.real:  # kmock ignores generateName, so kopf's second Event collides with the first by name
        await eventually(warned_again, what="a second Warning Event with the scheduler's new reason")
    await cluster.set_pod_scheduled(pod, tag)
    status = await wait_status(
        cluster, tag, lambda s: condition(s, "Unschedulable").get("status") == "False", "scheduled"
    )
    assert condition(status, "Unschedulable")["reason"] == "Scheduled"
    await delete_and_wait(cluster, tag)


def huge_but_valid_job(tag: str, stages: int = 128) -> dict[str, Any]:
    """Every count within the spec's bounds, and seconds of CPU to plan: 128 stages of 2x8 devices on 2
    hosts of 1024 devices, 128 microbatches (the schedule's 16384 cells are its bound)."""
    return scenario_job(
        tag,
        hosts=2,
        devices=1024,
        model={"kind": "gpt", "layers": stages, "hidden": 64, "heads": 8, "vocab": 64, "seqLen": 16},
        training={"steps": 3, "globalBatch": 256, "microbatches": 128},
        stages=[{"layers": [i, i + 1], "mesh": [2, 8], "tensorParallelDim": 1} for i in range(stages)],
        resharding={"strategy": "broadcast", "balancer": "greedy", "budgetSeconds": 1},
        schedule={"kind": "1f1b", "weightGradDelay": "auto"},
    )


def _probe(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as answer:
        return int(answer.status)


@pytest.mark.timeout(300)
async def test_a_huge_but_valid_job_delays_neither_another_jobs_pods_nor_the_liveness_probe(cluster):
    """Planning runs in a child process, not on kopf's event loop: a job created just after a huge one gets
    its pods before the huge one, and /healthz answers again and again while the huge job is planned. How
    long each took, as fractions of the huge job's time: `meshjob bench operator`'s JSON, section planning."""
    huge, small = "hugejob", "smalljob"
    for tag in (huge, small):
        await prepare_namespace(cluster, tag)
    await add_nodes(cluster, huge, 2, devices=1024)
    await add_nodes(cluster, small, 2)
    health = f"http://127.0.0.1:{free_port()}/healthz"
    async with running_operator(cluster, liveness=health):
        await cluster.create_job(huge_but_valid_job(huge))
        await cluster.create_job(scenario_job(small))
        await wait_pods(cluster, small, 2, timeout=120)
        assert await cluster.pods(huge, huge) == []  # the small job did not wait for the huge one's plan
        probes: list[int] = []

        async def huge_placed() -> list[dict] | None:
            probes.append(await asyncio.to_thread(_probe, health))
            return await cluster.pods(huge, huge) or None

        await eventually(huge_placed, timeout=240, interval=0.5, what="the huge job's pods")
        # a loop busy planning would answer once, when the plan is done (and its pods with it)
        assert len(probes) >= 3 and set(probes) == {200}, probes
        for tag in (huge, small):
            await delete_and_wait(cluster, tag)


async def test_a_job_whose_planning_outlasts_the_operators_limit_waits_and_is_planned_again(cluster):
    """A planning timeout is no verdict on the job (a loaded machine, a job near the spec's limits): it stays
    Pending with condition PlanningDelayed and is planned again after a backoff, with a longer limit."""
    tag = "slowplan"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2, devices=1024)
    async with running_operator(cluster, config={"plan_timeout_s": 0.2}):
        await cluster.create_job(huge_but_valid_job(tag))

        def delayed(times: int):
            def check(s: dict[str, Any]) -> bool:
                found = condition(s, "PlanningDelayed")
                return found.get("status") == "True" and f"timed out {times} time(s)" in found.get("message", "")

            return check

        status = await wait_status(cluster, tag, delayed(1), "PlanningDelayed", timeout=60)
        found = condition(status, "PlanningDelayed")
        assert found["reason"] == "PlanningTimeout" and "planning took longer than 0.2 s" in found["message"]
        assert status["phase"] == "Pending" and condition(status, "Failed") == {}
        # planned again after the backoff, with twice the limit
        status = await wait_status(cluster, tag, delayed(2), "a second attempt", timeout=60)
        assert "planning took longer than 0.4 s" in condition(status, "PlanningDelayed")["message"]
        assert status["phase"] == "Pending" and condition(status, "Failed") == {}
        assert await cluster.pods(tag, tag) == []
        await delete_and_wait(cluster, tag)


@pytest.mark.timeout(400)
async def test_fifty_jobs_on_two_nodes_place_only_those_that_fit_and_freed_devices_take_the_next(cluster, operator):
    """Each job wants a whole node (one host of 2 devices): 2 jobs are placed, one per node, the other 48
    wait Unschedulable saying the devices are in use; a placed job's pod finishing frees its node for one.
    50 on the real API server; kmock, which answers every request on the test's own event loop, takes 8."""
    tag, count = "crowd", 50 if cluster.real else 8
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    jobs = [f"{tag}-{i:02d}" for i in range(count)]
    for name in jobs:
        body = job_body(
            name,
            tag,
            hosts=1,
            devices_per_host=2,
            model={"kind": "gpt", "layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16},
        )
        body["spec"]["topology"]["deviceResource"] = f"example.com/{tag}"
        await cluster.create_job(body)

    async def verdicts() -> tuple[list[str], list[dict]] | None:
        statuses = [((await cluster.job(name, tag)) or {}).get("status") or {} for name in jobs]
        failed = [s for s in statuses if s.get("phase") == "Failed"]
        assert not failed, failed[0]
        placed = [name for name, s in zip(jobs, statuses) if condition(s, "Created").get("status") == "True"]
        waiting = [s for s in statuses if condition(s, "Unschedulable").get("status") == "True"]
        return (placed, waiting) if len(placed) + len(waiting) == count else None

    placed, waiting = await eventually(verdicts, timeout=300, interval=1, what="every job placed or Unschedulable")
    assert len(placed) == 2 and len(waiting) == count - 2
    assert all("in use by other pods" in condition(s, "Unschedulable")["message"] for s in waiting)
    pods = [p for name in placed for p in await cluster.pods(name, tag)]
    assert len(pods) == 2 and len({json.dumps(p["spec"]["affinity"], sort_keys=True) for p in pods}) == 2

    await cluster.set_pod_phase(pods[0]["metadata"]["name"], "Succeeded", tag)

    async def third() -> list[str] | None:
        found = await verdicts()
        return [n for n in found[0] if n not in placed] or None if found else None

    assert len(await eventually(third, timeout=120, interval=1, what="a waiting job placed on the freed node")) == 1
    for name in jobs:
        await cluster.delete_job(name, tag)
    for name in jobs:
        await eventually(lambda name=name: _gone(cluster, name, tag), timeout=60, what=f"job {name} deleted")


@pytest.mark.timeout(400)
async def test_fifty_small_jobs_that_all_fit_are_all_placed_without_colliding(cluster, operator):
    """50 jobs of 2 hosts created at once on 128 free nodes: each plan reserves its devices before the next
    plan reads what is free, so every job gets pods on nodes of its own and none waits Unschedulable (they all
    used to plan on the same first nodes and collide). 50 on the real API server; kmock, which answers every
    request on the test's own event loop, takes 8."""
    tag = "fiftysmall"
    count = 50 if cluster.real else 8
    await prepare_namespace(cluster, tag)
    added = set(await add_nodes(cluster, tag, 128))

    async def nodes_seen() -> bool:  # the operator's watch-fed node cache has them all (else: a transient verdict)
        return added <= {n["metadata"]["name"] for n in STATE.cached_nodes()}

    await eventually(nodes_seen, timeout=60, what="the operator's node cache")
    jobs = [f"{tag}-{i:02d}" for i in range(count)]
    for name in jobs:
        body = job_body(name, tag, hosts=2, devices_per_host=2, model={**SMALL_MODEL})
        body["spec"]["topology"]["deviceResource"] = f"example.com/{tag}"
        await cluster.create_job(body)

    async def all_created() -> list[dict] | None:
        statuses = [((await cluster.job(name, tag)) or {}).get("status") or {} for name in jobs]
        for name, s in zip(jobs, statuses):
            assert condition(s, "Unschedulable") == {}, (name, s)
            assert s.get("phase") != "Failed", (name, s)
        return statuses if all(condition(s, "Created").get("status") == "True" for s in statuses) else None

    await eventually(all_created, timeout=300, interval=1, what="every job placed")
    nodes = [pinned_node(p) for name in jobs for p in await cluster.pods(name, tag)]
    assert len(nodes) == 2 * count and len(set(nodes)) == len(nodes)  # one pod per node: no device given twice
    for name in jobs:
        await cluster.delete_job(name, tag)
    for name in jobs:
        await eventually(lambda name=name: _gone(cluster, name, tag), timeout=60, what=f"job {name} deleted")


SMALL_MODEL = {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16}


async def _gone(cluster: Cluster, name: str, namespace: str) -> bool:
    return await cluster.job(name, namespace) is None


async def test_deletion_leaves_owned_children_to_the_garbage_collector(cluster, operator):
    tag = "delete"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag))
    pods = await wait_pods(cluster, tag, 2)
    uid = (await cluster.job(tag, tag))["metadata"]["uid"]
    await delete_and_wait(cluster, tag)
    if cluster.real:
        # kube-controller-manager's garbage collector follows the owner references. It learns of a CRD's kind
        # at its discovery resync (every 30 s), so on a loaded machine the first job deleted may wait that long
        # and more before its children go.
        await wait_pods(cluster, tag, 0, timeout=120)
        await eventually(lambda: _absent(cluster, "configmaps", f"{tag}-plan", tag), timeout=60, what="configmap gone")
        await eventually(lambda: _absent(cluster, "services", tag, tag), timeout=60, what="service gone")
    else:  # kmock has no garbage collector: the children are owned, so a real cluster removes them
        for pod in pods:
            owner = pod["metadata"]["ownerReferences"][0]
            assert owner["uid"] == uid and owner["controller"] and owner["blockOwnerDeletion"]


async def _absent(cluster: Cluster, plural: str, name: str, ns: str) -> bool:
    return await cluster.get(plural, name, ns) is None


async def test_active_deadline_fails_the_job(cluster, operator):
    tag = "deadline"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, run_policy={"activeDeadlineSeconds": 2, "cleanPodPolicy": "Running"}))
    await wait_pods(cluster, tag, 2)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "Failed by deadline", timeout=30)
    assert condition(status, "Failed")["reason"] == "DeadlineExceeded"
    await wait_pods(cluster, tag, 0)
    await delete_and_wait(cluster, tag)


async def test_operator_killed_mid_creation_converges_without_duplicates(cluster):
    """The operator dies after creating 2 of 4 pods; a new one creates the rest, once each."""
    tag = "killed"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 4)
    async with running_operator(cluster) as op:
        kube = STATE.reconciler.kube
        original = kube.create_if_absent
        created: list[str] = []

        async def dying(body: dict[str, Any], plural: str, path: str | None = None) -> bool:
            result = await original(body, plural, path)
            if plural == "pods":
                created.append(body["metadata"]["name"])
                if len(created) == 2:
                    op.kill()  # killed: no graceful stop, no status written after this point
                    await asyncio.sleep(3600)
            return result

        kube.create_if_absent = dying  # type: ignore[method-assign]
        await cluster.create_job(scenario_job(tag, hosts=4))
        await eventually(lambda: _dead(op), what="the first operator killed")
    survivors = await cluster.pods(tag, tag)
    assert 1 <= len(survivors) <= 4
    async with running_operator(cluster):
        pods = await wait_pods(cluster, tag, 4)
        assert [p["metadata"]["name"] for p in pods] == [f"{tag}-host-{i}" for i in range(4)]
        if cluster.real:  # the survivors were kept, not recreated
            kept = {p["metadata"]["name"]: p["metadata"]["uid"] for p in survivors}
            assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods if p["metadata"]["name"] in kept} == kept
        status = await wait_status(
            cluster, tag, lambda s: s.get("hosts") == 4 and len(s.get("pods") or {}) == 4, "4 pods"
        )
        assert not status.get("restarts")
        await asyncio.sleep(0.5)  # a later reconcile must not add anything
        assert len(await cluster.pods(tag, tag)) == 4
        await delete_and_wait(cluster, tag)


async def _dead(op: OperatorThread) -> bool:
    return not op.alive


async def test_restart_is_counted_once_across_operator_restart(cluster):
    """The operator died after recording a gang restart but before deleting pods: no second count."""
    tag = "once"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    async with running_operator(cluster):
        await cluster.create_job(scenario_job(tag, run_policy={"backoffLimit": 3}))
        pods = await wait_pods(cluster, tag, 2)
        await wait_status(cluster, tag, lambda s: s.get("hosts") == 2, "hosts recorded")
    await cluster.set_pod_phase(pods[0]["metadata"]["name"], "Failed", tag)
    await cluster.kube.patch_job_status(tag, tag, {"restarts": 1, "restartPending": True, "phase": "Restarting"})
    async with running_operator(cluster):
        status = await wait_status(
            cluster, tag, lambda s: not s.get("restartPending") and len(s.get("pods") or {}) == 2, "restart finished"
        )
        new = await wait_pods(cluster, tag, 2, phase="Pending")
        assert status["restarts"] == 1
        if cluster.real:
            assert {p["metadata"]["uid"] for p in new}.isdisjoint({p["metadata"]["uid"] for p in pods})
        await delete_and_wait(cluster, tag)


async def test_a_pod_deleted_by_someone_else_restarts_the_gang_without_consuming_backoff_limit(cluster, operator):
    """A host pod deleted by someone else (the eviction API, a drain, a preemption) breaks the gang: restart
    all of it, even with runPolicy.backoffLimit 0, since a disruption is not a failure of the job."""
    tag = "evicted"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, run_policy={"backoffLimit": 0}))
    pods = await wait_pods(cluster, tag, 2)
    await wait_status(cluster, tag, lambda s: len(s.get("pods") or {}) == 2, "pods recorded")
    await cluster.kube.delete_pod(tag, pods[1]["metadata"]["name"])
    status = await wait_status(
        cluster, tag, lambda s: s.get("restarts") == 1 and not s.get("restartPending"), "restart 1"
    )
    restarting = condition(status, "Restarting")
    assert f"pod {tag}-host-1 disappeared" in restarting["message"] and restarting["reason"] == "PodDisrupted"
    assert status["disruptions"] == 1 and status["phase"] != "Failed"
    await wait_pods(cluster, tag, 2)
    await asyncio.sleep(0.5)
    assert (await cluster.job(tag, tag))["status"]["restarts"] == 1  # the planned deletions are not counted again
    await delete_and_wait(cluster, tag)


async def test_an_evicted_pod_does_not_consume_backoff_limit_but_a_failure_does(cluster, operator):
    tag = "kubeletevict"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, run_policy={"backoffLimit": 0, "cleanPodPolicy": "None"}))
    first = await wait_pods(cluster, tag, 2)
    await cluster.set_pod_phase(first[0]["metadata"]["name"], "Failed", tag, reason="Evicted")
    status = await wait_status(
        cluster, tag, lambda s: s.get("restarts") == 1 and not s.get("restartPending"), "restart"
    )
    assert status["disruptions"] == 1 and condition(status, "Restarting")["reason"] == "PodDisrupted"
    assert "not counted toward runPolicy.backoffLimit" in condition(status, "Restarting")["message"]
    second = await wait_pods(cluster, tag, 2, phase="Pending")
    await cluster.set_pod_phase(second[1]["metadata"]["name"], "Failed", tag, exit_code=1)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "Failed")
    assert condition(status, "Failed")["reason"] == "BackoffLimitExceeded"
    await delete_and_wait(cluster, tag)


async def test_a_permanent_exit_code_fails_the_job_at_once_and_tells_kueue(cluster, operator):
    """Exit code 2 (`meshjob worker`: the job itself is invalid) cannot pass with a restart: Failed at once,
    whatever runPolicy.backoffLimit says; a Kueue pod group is marked not retriable so its quota is freed."""
    tag = "permanent"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(
        scenario_job(tag, run_policy={"backoffLimit": 5, "cleanPodPolicy": "None"}, scheduling={"queue": "team"})
    )
    pods = await wait_pods(cluster, tag, 2)
    await cluster.set_pod_phase(pods[1]["metadata"]["name"], "Failed", tag, exit_code=2)
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "Failed")
    failed = condition(status, "Failed")
    assert failed["reason"] == "PermanentError" and "exit code 2" in failed["message"]
    assert not status.get("restarts")
    for pod in await cluster.pods(tag, tag):
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"] == "false"
    await delete_and_wait(cluster, tag)


async def test_an_edit_to_a_started_jobs_stages_is_refused_and_the_job_runs_on(cluster, operator):
    """Without the webhook (--no-webhook; with it down the API server refuses edits) the operator refuses the edit:
    condition EditRefused and a Warning Event, no restart, the ConfigMap keeps the spec the trainers run;
    spec.runPolicy may still change."""
    tag = "immutable"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 3)
    await cluster.create_job(scenario_job(tag))
    pods = await wait_pods(cluster, tag, 2)
    await wait_status(cluster, tag, lambda s: condition(s, "Created").get("status") == "True", "Created")
    started = (await cluster.get("configmaps", f"{tag}-plan", tag))["data"]["job.yaml"]
    stages = scenario_job(tag, hosts=3)["spec"]["stages"]
    await cluster.patch_job(tag, {"spec": {"stages": stages, "training": {"globalBatch": 16}}}, tag)
    status = await wait_status(cluster, tag, lambda s: condition(s, "EditRefused").get("status") == "True", "refused")
    refused = condition(status, "EditRefused")
    assert "cannot change once the job has started" in refused["message"]
    assert "spec.stages" in refused["message"] and "spec.training" in refused["message"]  # (edges follow stages)

    async def warned() -> list[dict] | None:
        return [e for e in await cluster.events(tag) if e.get("reason") == "EditRefused"] or None

    assert "spec.stages" in (await eventually(warned, what="a Warning Event EditRefused"))[0]["message"]
    identity = "uid" if cluster.real else "name"  # kmock gives the pods it stores no uid
    assert [p["metadata"][identity] for p in await cluster.pods(tag, tag)] == [p["metadata"][identity] for p in pods]
    assert (await cluster.get("configmaps", f"{tag}-plan", tag))["data"]["job.yaml"] == started
    assert (await cluster.job(tag, tag))["status"]["hosts"] == 2 and not status.get("restarts")
    await cluster.patch_job(tag, {"spec": {"runPolicy": {"suspend": True}}}, tag)
    await wait_pods(cluster, tag, 0)
    await delete_and_wait(cluster, tag)


# scheduler-plugins' PodGroup, reduced to what the operator writes (a real API server needs the CRD)
PODGROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.x-k8s.io"},
    "spec": {
        "group": "scheduling.x-k8s.io",
        "scope": "Namespaced",
        "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup", "shortNames": ["pg"]},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"minMember": {"type": "integer", "format": "int32"}},
                            }
                        },
                    }
                },
            }
        ],
    },
}


async def install_podgroup_crd(cluster: Cluster) -> None:
    if cluster.real:
        await cluster.create(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json.loads(json.dumps(PODGROUP_CRD))
        )
        await asyncio.to_thread(cluster.envtest.wait_established, "podgroups.scheduling.x-k8s.io")


async def test_gang_scheduling_creates_a_podgroup_and_sets_the_scheduler(cluster, operator):
    """spec.scheduling (part of the CRD: a real API server keeps it) gives a PodGroup, the gang scheduler,
    Kueue labels; the pods carry no service-account token."""
    tag = "gang"
    await prepare_namespace(cluster, tag)
    await install_podgroup_crd(cluster)
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, scheduling={"gang": True, "queue": "team"}))
    stored = await cluster.job(tag, tag)
    assert stored["spec"]["scheduling"] == {"gang": True, "queue": "team"}  # not pruned
    pods = await wait_pods(cluster, tag, 2)
    group = await cluster.kube.request("GET", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{tag}/podgroups/{tag}")
    assert group["spec"]["minMember"] == 2
    assert [o["uid"] for o in group["metadata"]["ownerReferences"]] == [stored["metadata"]["uid"]]
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == tag
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"
        assert pod["spec"]["automountServiceAccountToken"] is False
    await delete_and_wait(cluster, tag)


async def test_a_service_account_the_spec_names_is_the_pods_identity(cluster, operator):
    """spec.serviceAccountName (kept by a real API server; ServiceAccount admission finds it there)."""
    tag = "ownsa"
    await prepare_namespace(cluster, tag)
    await create_service_account(cluster, tag, "team-trainer")
    await add_nodes(cluster, tag, 2)
    await cluster.create_job(scenario_job(tag, serviceAccountName="team-trainer"))
    assert (await cluster.job(tag, tag))["spec"]["serviceAccountName"] == "team-trainer"
    pods = await wait_pods(cluster, tag, 2)
    assert {p["spec"]["serviceAccountName"] for p in pods} == {"team-trainer"}
    await delete_and_wait(cluster, tag)


async def test_a_refused_api_call_blocks_the_job_visibly_until_it_goes_through(cluster, operator):
    """A ResourceQuota of zero pods (on kmock: a 403 on the pods): within 30 s condition Blocked
    with the API's reason and message, a Warning Event and a metric; the job's loop keeps retrying, so once
    pods are allowed it proceeds and Blocked clears."""
    tag = "quota"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    refusal = await cluster.forbid_pods(tag)
    await cluster.create_job(scenario_job(tag))
    status = await wait_status(
        cluster, tag, lambda s: condition(s, "Blocked").get("status") == "True", "Blocked", timeout=30
    )
    blocked = condition(status, "Blocked")
    assert blocked["reason"] == "Forbidden" and refusal in blocked["message"]
    assert f"/api/v1/namespaces/{tag}/pods refused (HTTP 403 Forbidden)" in blocked["message"]

    async def warned() -> list[dict] | None:
        return [e for e in await cluster.events(tag) if e.get("reason") == "Blocked"] or None

    assert refusal in (await eventually(warned, what="a Warning Event Blocked"))[0]["message"]
    assert STATE.metrics.api_errors.labels(namespace=tag, trainingjob=tag, code="403")._value.get() >= 1
    if cluster.real:  # (kmock refuses every listing of these pods, the test's own too)
        assert await cluster.pods(tag, tag) == []
    await cluster.allow_pods(tag)
    await wait_pods(cluster, tag, 2, timeout=45)
    status = await wait_status(cluster, tag, lambda s: condition(s, "Blocked").get("status") == "False", "unblocked")
    assert condition(status, "Blocked")["reason"] == "Unblocked"
    await delete_and_wait(cluster, tag)


async def test_meshjob_plan_cluster_shows_the_placement_the_operator_makes(cluster, operator, tmp_path):
    """The issue's case: topology.devicesPerHost 2 on Nodes that allocate 4, plus a tainted node the job does not
    tolerate. `meshjob plan --cluster` (reading the same Nodes through the kubeconfig) prints the pods the operator
    creates: same names, nodes and devices; the tainted node is left out with the reason."""
    tag = "plancluster"
    await prepare_namespace(cluster, tag)
    for i in range(4):
        taints = [{"key": "dedicated", "value": "other-team", "effect": "NoSchedule"}] if i == 1 else None
        await cluster.add_node(f"{tag}-n{i}", 4, resource=f"example.com/{tag}", taints=taints)
    body = scenario_job(tag, hosts=3, devices=2)
    plan = await plan_on_cluster(cluster, body, tmp_path)
    await cluster.create_job(body)
    pods = await wait_pods(cluster, tag, 3)
    made = [
        {
            "name": p["metadata"]["name"],
            "node": pinned_node(p),
            "devices": int(p["metadata"]["annotations"]["meshjob.io/devices"]),
        }
        for p in pods
    ]
    assert [{k: p[k] for k in ("name", "node", "devices")} for p in plan["cluster"]["pods"]] == made
    assert {p["devices"] for p in made} == {2} and f"{tag}-n1" not in {p["node"] for p in made}
    (left_out,) = [n for n in plan["cluster"]["nodes"] if n["problem"] and n["name"].startswith(tag)]
    assert (
        left_out["name"] == f"{tag}-n1" and "taint dedicated=other-team:NoSchedule not tolerated" in left_out["problem"]
    )
    status = await wait_status(cluster, tag, lambda s: s.get("placement"), "placement in status")
    assert [(r["stage"], r["node"], r["devices"]) for r in status["placement"]] == [
        (r["stage"], r["host"], r["devices"]) for r in plan["placement"]
    ]  # host label = node name here
    await delete_and_wait(cluster, tag)


def pinned_node(pod: dict[str, Any]) -> str:
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (value,) = term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    return value


async def test_pod_template_tolerations_and_volumes_reach_the_pods_on_tolerated_nodes(cluster, operator):
    """spec.podTemplate's tolerations, nodeSelector, volumes and the trainer's mounts and env, and the checkpoint
    PVC, are on every pod the API server stored (a real one validates them); the nodes the job may use are
    the tainted pool it tolerates, not the untainted node its nodeSelector excludes."""
    tag = "template"
    await prepare_namespace(cluster, tag)
    gpu = [{"key": "pool", "value": "gpu", "effect": "NoSchedule"}]
    for i in range(2):
        await cluster.add_node(f"{tag}-n{i}", 2, resource=f"example.com/{tag}", taints=gpu, labels={"pool": "gpu"})
    await cluster.add_node(f"{tag}-cpu", 2, resource=f"example.com/{tag}", labels={"pool": "cpu"})
    template = {
        "metadata": {"labels": {"team": "vision"}},
        "spec": {
            "tolerations": [{"key": "pool", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "gpu"},
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
            "containers": [
                {
                    "name": "trainer",
                    "env": [{"name": "DATA", "value": "/data"}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                }
            ],
        },
    }
    body = scenario_job(tag, podTemplate=template)
    body["spec"]["training"]["checkpoint"]["volume"] = {"persistentVolumeClaim": {"claimName": "checkpoints"}}
    await cluster.create_job(body)
    pods = await wait_pods(cluster, tag, 2)
    assert {pinned_node(p) for p in pods} == {f"{tag}-n0", f"{tag}-n1"}
    for pod in pods:
        spec, (trainer,) = pod["spec"], pod["spec"]["containers"]
        assert pod["metadata"]["labels"]["team"] == "vision" and spec["nodeSelector"] == {"pool": "gpu"}
        assert template["spec"]["tolerations"][0].items() <= spec["tolerations"][0].items()
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "datasets"}
        assert volumes["checkpoint"]["persistentVolumeClaim"] == {"claimName": "checkpoints"}
        assert {"name": "data", "mountPath": "/data", "readOnly": True} in trainer["volumeMounts"]
        assert {"name": "DATA", "value": "/data"} in trainer["env"]
    await delete_and_wait(cluster, tag)


def _series(registry: CollectorRegistry, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in registry.collect() for s in family.samples if s.name == name]


async def test_deleted_jobs_leave_no_series_behind(cluster, monkeypatch):
    """Jobs created, blocked (their pods refused) and deleted: every series naming a deleted job goes with it
    (restarts, API errors), and the jobs-by-phase gauge counts exactly the TrainingJobs that exist, so no
    alert fires for a job that is gone."""
    from meshjob_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()  # this operator's own: the module's STATE.metrics holds earlier tests' jobs
    monkeypatch.setattr(STATE, "metrics", metrics)
    tag = "series"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 2)
    await cluster.forbid_pods(tag)
    jobs = [f"{tag}-{i}" for i in range(3)]

    async def existing() -> int:
        found = await cluster.kube.request("GET", f"/apis/{names.GROUP}/{names.VERSION}/{names.PLURAL}")
        return len(found.get("items") or [])

    async def counted(expected: set[str]) -> bool:
        """The gauge counts the jobs there are; the per-job series name exactly `expected` of this namespace."""
        gauge = sum(value for _, value in _series(metrics.registry, "meshjob_operator_jobs"))
        named = {
            labels["trainingjob"]
            for metric in ("meshjob_operator_restarts_total", "meshjob_operator_api_errors_total")
            for labels, _ in _series(metrics.registry, metric)
            if labels["namespace"] == tag
        }
        return gauge == await existing() and named == expected

    async with running_operator(cluster):
        for name in jobs:
            body = job_body(name, tag, hosts=2, devices_per_host=1)
            body["spec"]["topology"]["deviceResource"] = f"example.com/{tag}"
            await cluster.create_job(body)
        for name in jobs:
            await eventually(lambda name=name: _blocked(cluster, name, tag), timeout=45, what=f"job {name} Blocked")
        await eventually(lambda: counted(set(jobs)), what="a series for every job")
        for name in jobs[:2]:
            await cluster.delete_job(name, tag)
            await eventually(lambda name=name: _gone(cluster, name, tag), what=f"job {name} deleted")
        await eventually(lambda: counted(set(jobs[2:])), what="no series of the deleted jobs")
        await cluster.delete_job(jobs[2], tag)
        await eventually(lambda: _gone(cluster, jobs[2], tag), what=f"job {jobs[2]} deleted")
        await eventually(lambda: counted(set()), what="no series of any job of the namespace")
    await cluster.allow_pods(tag)


async def _blocked(cluster: Cluster, name: str, namespace: str) -> bool:
    status = ((await cluster.job(name, namespace)) or {}).get("status") or {}
    return condition(status, "Blocked").get("status") == "True"


async def test_pod_security_restricted_is_enforced_unless_the_namespace_opts_out(cluster, operator):
    """A job whose pods would mount an nfs volume: refused in a namespace without a label (restricted, the
    default: Failed/InvalidSpec naming the field and the label that allows it, no pod), run in a namespace
    whose Kubernetes label `pod-security.kubernetes.io/enforce` says baseline."""
    template = {"spec": {"volumes": [{"name": "share", "nfs": {"server": "nas", "path": "/data"}}]}}
    for tag, labels in (("psa-restricted", {}), ("psa-baseline", {"pod-security.kubernetes.io/enforce": "baseline"})):
        await cluster.create_namespace(tag, labels)
        await add_nodes(cluster, tag, 2)
        await cluster.create_job(scenario_job(tag, podTemplate=template))
    status = await wait_status(cluster, "psa-restricted", lambda s: s.get("phase") == "Failed", "Failed/InvalidSpec")
    failed = condition(status, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.podTemplate.spec.volumes[0].nfs" in failed["message"]
    assert "Pod Security 'restricted'" in failed["message"] and "meshjob.io/pod-security=baseline" in failed["message"]
    pods = await wait_pods(cluster, "psa-baseline", 2)
    assert all(any(v.get("nfs") for v in p["spec"]["volumes"]) for p in pods)
    assert await cluster.pods("psa-restricted", "psa-restricted") == []
    for tag in ("psa-restricted", "psa-baseline"):
        await delete_and_wait(cluster, tag)
