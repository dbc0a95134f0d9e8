"""Planning off the operator's event loop: in a child process, within a time limit.

A job whose every count is within the spec's bounds can still take seconds of CPU to plan (hundreds
of stages, thousands of devices). On kopf's event loop, or in a thread that shares the interpreter
lock with it, that would delay every other job's pods, the webhook and the liveness probe; a child
process spends the CPU elsewhere and is killed when the time is up. The child returns only what the
reconciler writes (the ConfigMap's plan files, the host pods, the placement), never the Plan itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import math
import multiprocessing
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from meshjob.cluster import auto_stages
from meshjob.cluster.nodes import HostPod, host_pods, plan_on_nodes
from meshjob.errors import PlacementError, SpecError, UsageError
from meshjob.plan import rendered
from meshjob.plan.placement import Host
from meshjob.plan.rendered import DEFAULT_NIC_BYTES_PER_S, PlanInputs
from meshjob.spec.manifest import TrainingJob

DEFAULT_TIMEOUT_S = 60.0  # the largest job the spec allows plans in seconds; a minute is generous


def cpu_limit(cgroup: str = "/sys/fs/cgroup") -> int:
    """Cores this process may use: its CPU affinity, less a container's CPU limit (cgroup v2 cpu.max, v1 quota)."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(os.path.join(cgroup, quota_file)) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(os.path.join(cgroup, period_file)) as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0] not in ("max", "-1") and int(fields[1]) > 0:
            cores = min(cores, math.ceil(int(fields[0]) / int(fields[1])))
        break
    return max(1, cores)


# plans at once: one child per core (more only share the cores, so every plan takes longer and times out sooner;
# the chart's operator has a limit of 1 CPU, on a node of many)
DEFAULT_CONCURRENCY = cpu_limit()
# forkserver: children forked from a small clean process that has these imported (the operator's own
# process has threads, which fork does not copy safely, and spawning a fresh interpreter per plan is slow)
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([__name__])


# a plan of at most this many rank x stage x microbatch cells takes well under a second: it may take the quick
# lane, a place beyond the pool's, so a small job never waits behind large plans
QUICK_WORK = 1 << 16
QUICK_PLACES = 1
LARGE_PLAN_NICENESS = 10  # os.nice of a larger plan's child

TIMEOUT = "PlanningTimeout"  # PlanningFailed's reason when the time was up: the job retries later, with backoff


class PlanningFailed(Exception):
    """No plan: it took longer than the operator allows (reason PlanningTimeout), or the child died."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Planned:
    files: dict[str, str]  # the ConfigMap's plan files beside job.yaml (hosts.yaml, plan.json)
    pods: tuple[HostPod, ...]  # one per host
    placement: list[dict[str, Any]]  # Placement.to_json(): one row per mesh
    chosen: TrainingJob | None = None  # spec.stages: auto: the job the search chose (what runs)
    tuned: dict[str, Any] | None = None  # ... and status.tuned
    tuned_message: str = ""  # ... and the StagesChosen Event's message


def plan_job(
    job: TrainingJob,
    nodes: Sequence[Mapping[str, Any]],
    hosts: tuple[Host, ...] | None,
    pods: Sequence[Mapping[str, Any]] = (),
    search: Mapping[str, Any] | None = None,
) -> Planned:
    """The job's plan on these Nodes less what the cluster's `pods` use there (hosts None: a fresh
    placement, as `meshjob plan --cluster` makes it), or on the hosts its running pods already hold.
    With `search` (a `stages: auto` manifest; `job` its placeholder) the stages are chosen first, on
    those same hosts (meshjob.cluster.auto_stages)."""
    if search is not None:
        tuned = auto_stages.tune_on_nodes(job, search, nodes, parse_quantity, DEFAULT_NIC_BYTES_PER_S, pods, hosts)
        chosen = dataclasses.replace(tuned.job(), image=job.image)
        planned = plan_job(chosen, nodes, hosts, pods)
        return dataclasses.replace(planned, chosen=chosen, tuned=tuned.status(), tuned_message=tuned.message())
    if hosts is None:
        inputs, plan, _ = plan_on_nodes(job, nodes, parse_quantity, pods=pods)
    else:
        inputs = PlanInputs.of(job, hosts)
        plan = inputs.build()
    return Planned(rendered.render(inputs, plan), host_pods(plan.placement), plan.placement.to_json())


def planning_work(job: TrainingJob, search: Mapping[str, Any] | None = None) -> float:
    """How much a plan of `job` costs, in rank x stage x microbatch cells (a search: unbounded)."""
    if search is not None:
        return math.inf
    return job.world_size * max(1, len(job.stages)) * job.training.microbatches


def niceness(work: float) -> int:
    """The scheduling priority a plan's child takes: a large plan yields the cores to the operator's own
    process (webhook, /healthz, pod creation) and to quick plans, which would otherwise wait for it."""
    return 0 if work <= QUICK_WORK else LARGE_PLAN_NICENESS


def _child(
    sender: Connection,
    job: TrainingJob,
    nodes: Sequence[Mapping[str, Any]],
    hosts: tuple[Host, ...] | None,
    pods: Sequence[Mapping[str, Any]],
    search: Mapping[str, Any] | None,
) -> None:
    os.nice(niceness(planning_work(job, search)))
    try:
        answer: tuple[str, Any] = ("planned", plan_job(job, nodes, hosts, pods, search))
    except PlacementError as err:
        answer = ("placement", str(err))
    except SpecError as err:
        answer = ("spec", err.errors)
    except UsageError as err:  # the search: no plan fits (meshjob.search.algorithm.Infeasible), or the fixed fields
        answer = ("infeasible", str(err))
    sender.send(answer)
    sender.close()


def _receive(receiver: Connection, timeout_s: float) -> tuple[str, Any]:
    try:
        return receiver.recv() if receiver.poll(timeout_s) else ("timeout", None)
    except EOFError:  # it crashed (out of memory, say)
        return ("died", None)


@dataclass
class PlanningPlaces:
    """The planning pool's places: `places` for any plan, `quick` more for plans of at most QUICK_WORK.
    Waiting plans start cheapest first (then in arrival order), so one large plan never holds up small ones."""

    places: int
    quick: int = QUICK_PLACES
    _running: int = 0
    _waiting: list[tuple[float, int, asyncio.Future[None]]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def _may_start(self, work: float) -> bool:
        return self._running < self.places or (work <= QUICK_WORK and self._running < self.places + self.quick)

    @contextlib.asynccontextmanager
    async def hold(self, work: float) -> AsyncIterator[None]:
        if self._waiting or not self._may_start(work):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (work, next(self._order), waiter))
            self._wake()
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # given a place as it was cancelled: hand it on
                    self._running -= 1
                    self._wake()
                else:
                    self._waiting = [w for w in self._waiting if w[2] is not waiter]
                    heapq.heapify(self._waiting)
                raise
        else:
            self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._wake()

    def _wake(self) -> None:
        """Start the cheapest waiting plans that may start now (one that may not waits: others keep their turn,
        except a quick one, which may take the quick lane past it)."""
        kept: list[tuple[float, int, asyncio.Future[None]]] = []
        while self._waiting:
            work, order, waiter = heapq.heappop(self._waiting)
            if waiter.done():
                continue
            if self._may_start(work):
                self._running += 1
                waiter.set_result(None)
            else:
                kept.append((work, order, waiter))
        for entry in kept:
            heapq.heappush(self._waiting, entry)

    @property
    def running(self) -> int:
        return self._running


@dataclass
class Planner:
    """Plans in child processes, at most `concurrency` at once, plus the quick lane for small plans (a bounded
    pool: jobs beyond it wait for a place, cheapest first, and their time limit starts with their child). Its
    waits run on its own threads, never on the event loop's default executor, so what runs there (admission's
    validation) never queues behind a plan."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = DEFAULT_CONCURRENCY
    _places: PlanningPlaces | None = field(default=None, init=False, repr=False)
    _threads: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    async def start(self) -> None:
        """Start the fork server now (it imports the plan layer: seconds), not when the first job is planned."""
        await self._run(forkserver.ensure_running)

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._threads is None:  # a start, a wait and a join per plan, one after the other: one thread each
            workers = self.concurrency + QUICK_PLACES + 1
            self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="planner")
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    @contextlib.asynccontextmanager
    async def slot(self, work: float = math.inf) -> AsyncIterator[None]:
        """One of the pool's places for a plan of `work` (planning_work): hold it around what the plan reads (the
        devices in use) and the plan, so that a job waiting for a place reads what the plans before it took."""
        if self._places is None:
            self._places = PlanningPlaces(max(1, self.concurrency))
        async with self._places.hold(work):
            yield

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    async def plan(
        self,
        job: TrainingJob,
        nodes: Sequence[Mapping[str, Any]],
        hosts: tuple[Host, ...] | None,
        pods: Sequence[Mapping[str, Any]] = (),
        search: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Planned:
        """plan_job in a child process (the caller holds a `slot()`); raises PlacementError, SpecError or
        PlanningFailed (after `timeout_s`, by default the planner's, when the child dies, or when the search
        finds no plan that fits: reason Infeasible)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        receiver, sender = _CONTEXT.Pipe(duplex=False)
        child = _CONTEXT.Process(
            target=_child,
            args=(sender, job, list(nodes), hosts, list(pods), search),
            daemon=True,
            name=f"plan-{job.namespace}-{job.name}",
        )
        try:
            await self._run(child.start)
            sender.close()
            kind, value = await self._run(_receive, receiver, limit)
        finally:
            if child.is_alive():
                child.kill()
            await self._run(child.join, 10)
            receiver.close()
        if kind == "placement":
            raise PlacementError(value)
        if kind == "spec":
            raise SpecError(value)
        if kind == "infeasible":
            raise PlanningFailed("Infeasible", value)
        if kind == "timeout":
            raise PlanningFailed(
                TIMEOUT,
                f"planning took longer than {limit:g} s (the operator's "
                "--plan-timeout, longer on each retry): fewer stages, devices or microbatches plan faster",
            )
        if kind == "died":
            raise PlanningFailed(
                "PlanningFailed", f"the planning process died (exit code {child.exitcode}): out of memory, perhaps"
            )
        return value
