"""Planning off the operator's event loop: in a child process, within a time limit.

A job whose every count is within the spec's bounds can still take seconds of CPU to plan (hundreds
of stages, thousands of devices). On kopf's event loop, or in a thread that shares the interpreter
lock with it, that would delay every other job's pods, the webhook and the liveness probe; a child
process spends the CPU elsewhere and is killed when the time is up. The child returns only what the
reconciler writes (the ConfigMap's plan files, the host pods, the placement), never the Plan itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
# forkserver: children forked from a small clean process that has these imported (the operator's own
# process has threads, which fork does not copy safely, and spawning a fresh interpreter per plan is slow)
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([__name__])


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


def _child(
    sender: Connection,
    job: TrainingJob,
    nodes: Sequence[Mapping[str, Any]],
    hosts: tuple[Host, ...] | None,
    pods: Sequence[Mapping[str, Any]],
    search: Mapping[str, Any] | None,
) -> None:
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


@dataclass(frozen=True)
class Planner:
    timeout_s: float = DEFAULT_TIMEOUT_S

    async def start(self) -> None:
        """Start the fork server now (it imports the plan layer: seconds), not when the first job is planned."""
        await asyncio.to_thread(forkserver.ensure_running)

    async def plan(
        self,
        job: TrainingJob,
        nodes: Sequence[Mapping[str, Any]],
        hosts: tuple[Host, ...] | None,
        pods: Sequence[Mapping[str, Any]] = (),
        search: Mapping[str, Any] | None = None,
    ) -> Planned:
        """plan_job in a child process; raises PlacementError, SpecError or PlanningFailed (after timeout_s,
        when the child dies, or when the search finds no plan that fits: reason Infeasible)."""
        receiver, sender = _CONTEXT.Pipe(duplex=False)
        child = _CONTEXT.Process(
            target=_child,
            args=(sender, job, list(nodes), hosts, list(pods), search),
            daemon=True,
            name=f"plan-{job.namespace}-{job.name}",
        )
        try:
            await asyncio.to_thread(child.start)
            sender.close()
            kind, value = await asyncio.to_thread(_receive, receiver, self.timeout_s)
        finally:
            if child.is_alive():
                child.kill()
            await asyncio.to_thread(child.join, 10)
            receiver.close()
        if kind == "placement":
            raise PlacementError(value)
        if kind == "spec":
            raise SpecError(value)
        if kind == "infeasible":
            raise PlanningFailed("Infeasible", value)
        if kind == "timeout":
            raise PlanningFailed(
                "PlanningTimeout",
                f"planning took longer than {self.timeout_s:g} s (the operator's "
                "--plan-timeout): fewer stages, devices or microbatches plan faster",
            )
        if kind == "died":
            raise PlanningFailed(
                "PlanningFailed", f"the planning process died (exit code {child.exitcode}): out of memory, perhaps"
            )
        return value
