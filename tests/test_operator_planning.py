"""The operator's planning pool and device ledger, without an API server: what many jobs at once share."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest
from kubernetes.utils.quantity import parse_quantity

from meshjob.cluster.nodes import HostPod, node_infos
from meshjob_operator import planning
from meshjob_operator.planning import Planner
from meshjob_operator.reconcile import validate
from meshjob_operator.testing import eventually, job_body, node_body
from meshjob_operator.usage import DeviceUsage

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio]


def _job(name: str = "small") -> Any:
    return validate(job_body(name, "default", hosts=2, devices_per_host=2))


async def test_admission_validation_never_waits_behind_plans_and_the_pool_bounds_them(monkeypatch):
    """Twelve jobs planned at once, every running plan blocked: at most `concurrency` children run, and a
    validation (what the admission webhook runs on the default executor) finishes while they are all still
    blocked. The planner's waits used to take default-executor threads, one per plan, so it queued."""
    release, waiting = threading.Event(), []
    receive = planning._receive

    def blocked(receiver: Any, timeout_s: float) -> tuple[str, Any]:
        waiting.append(threading.current_thread().name)
        release.wait(60)
        return receive(receiver, timeout_s)

    monkeypatch.setattr(planning, "_receive", blocked)
    planner = Planner(timeout_s=60, concurrency=2)
    await planner.start()
    job, nodes = _job(), [node_body(f"n{i}", 2) for i in range(4)]

    async def plan() -> planning.Planned:
        async with planner.slot():
            return await planner.plan(job, nodes, None)

    try:
        plans = [asyncio.create_task(plan()) for _ in range(12)]

        async def two_running() -> bool:
            return len(waiting) == 2

        await eventually(two_running, timeout=60, what="two plans running")
        body = job_body("admitted", "default")
        validated = await asyncio.wait_for(asyncio.to_thread(validate, body), 60)  # a hang here: the old bug
        assert validated.name == "admitted"
        assert not any(p.done() for p in plans) and len(waiting) == 2  # the pool held the other ten back
        assert all(name.startswith("planner") for name in waiting)  # the planner's own threads
        release.set()
        done = await asyncio.gather(*plans)
        assert len(done) == 12 and len(waiting) == 12 and all(len(p.pods) == 2 for p in done)
    finally:
        release.set()
        planner.close()


def _listed(*pods: tuple[str, str, int]) -> list[dict[str, Any]]:
    """Running pods as the API lists them: (name, node, devices), of job "other"."""
    return [
        {
            "metadata": {"namespace": "default", "name": name, "labels": {"meshjob.io/job-name": "other"}},
            "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"cpu": str(devices)}}}]},
            "status": {"phase": "Running"},
        }
        for name, node, devices in pods
    ]


async def test_a_reservation_holds_devices_until_a_later_pod_list_shows_its_pods():
    now = [0.0]
    listed: list[dict[str, Any]] = []
    calls = []

    async def list_pods() -> list[dict[str, Any]]:
        calls.append(now[0])
        return list(listed)

    usage = DeviceUsage(list_pods, max_age_s=1.0, clock=lambda: now[0])
    job, nodes = _job(), [node_body(f"n{i}", 2) for i in range(3)]
    free = {i.name: i.devices for i in node_infos(nodes, job, parse_quantity, await usage.pods())}
    assert free == {"n0": 2, "n1": 2, "n2": 2}

    plan = [HostPod(0, "n0", "", 2, (0,)), HostPod(1, "n1", "", 2, (1,))]
    usage.reserve(("default", "other"), plan, {"n0": "n0", "n1": "n1"}, "cpu")
    free = {i.name: i.devices for i in node_infos(nodes, job, parse_quantity, await usage.pods())}
    assert free == {"n0": 0, "n1": 0, "n2": 2} and len(calls) == 1  # the list was young: shared, not asked again

    now[0] = 5.0
    usage.created(("default", "other"))
    listed[:] = _listed(("other-host-0", "n0", 2))  # a list asked for as the pods were created may miss some
    # (asked at the very moment of creation: not "after" it, so the reservation stays)
    assert {i.name: i.devices for i in node_infos(nodes, job, parse_quantity, await usage.pods())}["n1"] == 0
    # the listed pod replaced its own reservation: n0 counted once
    assert {i.name: i.devices for i in node_infos(nodes, job, parse_quantity, await usage.pods())}["n0"] == 0

    listed[:] = _listed(("other-host-0", "n0", 2), ("other-host-1", "n1", 2))
    now[0] = 7.0  # a list asked for after the pods were created shows them: the reservation goes
    infos = node_infos(nodes, job, parse_quantity, await usage.pods())
    assert {i.name: i.devices for i in infos} == {"n0": 0, "n1": 0, "n2": 2} and usage.reserved() == {}

    usage.reserve(("default", "third"), [HostPod(0, "n2", "", 2, (0,))], {"n2": "n2"}, "cpu")
    usage.release(("default", "third"))  # the plan was not carried out: free again
    assert {i.name: i.devices for i in node_infos(nodes, job, parse_quantity, await usage.pods())}["n2"] == 2


async def test_plans_that_start_together_share_one_pod_list():
    gate = asyncio.Event()
    calls = []

    async def list_pods() -> list[dict[str, Any]]:
        calls.append(1)
        await gate.wait()
        return _listed(("a", "n0", 1))

    usage = DeviceUsage(list_pods)
    readers = [asyncio.create_task(usage.pods()) for _ in range(20)]
    await asyncio.sleep(0.05)
    gate.set()
    results = await asyncio.gather(*readers)
    assert len(calls) == 1 and all(len(r) == 1 for r in results)


async def test_small_plans_start_first_and_one_takes_the_quick_lane_past_large_ones():
    """Both places held by large plans, three more large and two small waiting: a small one starts at once on the
    quick lane, the other small one next, and the large ones only after them, in arrival order."""
    places = planning.PlanningPlaces(places=2)
    started: list[str] = []
    gates = {name: asyncio.Event() for name in ["L1", "L2", "L3", "L4", "L5", "s1", "s2"]}

    async def plan(name: str, work: float) -> None:
        async with places.hold(work):
            started.append(name)
            await gates[name].wait()

    large, small = 10 * planning.QUICK_WORK, 16
    tasks = [asyncio.create_task(plan(n, large)) for n in ["L1", "L2", "L3", "L4"]]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(plan("s1", small)), asyncio.create_task(plan("s2", small))]
    tasks.append(asyncio.create_task(plan("L5", large)))
    await asyncio.sleep(0.01)
    assert started == ["L1", "L2", "s1"] and places.running == 3  # s1 on the quick lane, past L3 and L4
    gates["L1"].set()
    await asyncio.sleep(0.01)
    assert started == ["L1", "L2", "s1", "s2"]  # the cheapest waiting plan takes the freed place
    for name in ["s1", "s2", "L2"]:
        gates[name].set()
    await asyncio.sleep(0.01)
    assert started[4:] == ["L3", "L4"] and places.running == 2  # the quick lane never takes a large plan
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*tasks)
    assert started[-1] == "L5" and places.running == 0


async def test_a_cancelled_waiter_gives_up_its_turn():
    places = planning.PlanningPlaces(places=1, quick=0)
    gate = asyncio.Event()

    async def hold() -> None:
        async with places.hold(1):
            await gate.wait()

    first = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    second, third = asyncio.create_task(hold()), asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    second.cancel()
    gate.set()
    await asyncio.gather(first, third)
    assert second.cancelled() and places.running == 0


async def test_planning_work_counts_ranks_stages_and_microbatches():
    small = _job()
    assert planning.planning_work(small) <= planning.QUICK_WORK
    assert planning.planning_work(small, search={"maxStages": 2}) == float("inf")  # a search is never quick


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2: a limit of 1.5 CPU gives 2 places
        ({"cpu.max": "max 100000\n"}, None),  # no limit: the affinity
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files at all
    ],
)
async def test_the_default_pool_is_the_containers_cpu_limit(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert planning.cpu_limit(str(tmp_path)) == (affinity if cores is None else min(affinity, cores))


async def test_a_large_plans_child_yields_the_cores_and_a_small_ones_does_not():
    assert planning.niceness(planning.planning_work(_job())) == 0
    assert planning.niceness(planning.QUICK_WORK + 1) == planning.LARGE_PLAN_NICENESS > 0
