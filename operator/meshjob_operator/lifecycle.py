"""Pure lifecycle rules: what the run policy says about a set of pods at a moment in time."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshjob.spec.api import PERMANENT_EXIT_CODES
from meshjob_operator.status import PodView

FINISHED_POD_PHASES = ("Succeeded", "Failed")
MUTABLE_WHILE_STARTED = ("runPolicy",)  # suspend, backoffLimit, deadlines, TTL, cleanPodPolicy


def cleanup_targets(pods: Iterable[PodView], clean_pod_policy: str) -> list[PodView]:
    """Pods to delete once the job has finished: All, Running (still running or pending), or None."""
    live = [p for p in pods if not p.deleting]
    if clean_pod_policy == "All":
        return live
    if clean_pod_policy == "Running":
        return [p for p in live if p.phase not in FINISHED_POD_PHASES]
    return []


def seconds_left(since: datetime.datetime | None, limit_s: int | None, now: datetime.datetime) -> float | None:
    """Seconds until `since + limit_s` (negative when past); None when there is no limit."""
    if since is None or limit_s is None:
        return None
    return limit_s - (now - since).total_seconds()


FAILURE, DISRUPTION, PERMANENT = "failure", "disruption", "permanent"


@dataclass(frozen=True)
class GangBreak:
    """Why the gang must stop: a pod failed (retried, counts toward runPolicy.backoffLimit), was evicted,
    preempted or deleted by someone else (retried, not counted), or exited with a code no restart cures."""

    kind: str  # FAILURE | DISRUPTION | PERMANENT
    message: str


def gang_break(pods: Iterable[PodView], vanished: list[str]) -> GangBreak | None:
    """The first reason to stop the gang, if any: a Failed pod (by node rank), else a vanished one."""
    failed = sorted((p for p in pods if p.phase == "Failed"), key=lambda p: p.index)
    if failed:
        pod = failed[0]
        message = f"pod {pod.name} failed" + (f": {pod.message}" if pod.message else "")
        if pod.disrupted:
            return GangBreak(DISRUPTION, message)
        if pod.exit_code in PERMANENT_EXIT_CODES:
            return GangBreak(
                PERMANENT, f"{message} (exit code {pod.exit_code}: the job itself is invalid, a restart cannot help)"
            )
        return GangBreak(FAILURE, message)
    if vanished:
        return GangBreak(DISRUPTION, f"pod {vanished[0]} disappeared (evicted, preempted or deleted)")
    return None


def immutable_changes(started: Mapping[str, Any], edited: Mapping[str, Any]) -> list[str]:
    """Fields of a started job's spec an edit changed: all but runPolicy are fixed once pods exist (the
    trainers run, and resume from checkpoints of, the spec they started with). Both specs normalized."""
    return [
        f"spec.{key}"
        for key in sorted(set(started) | set(edited))
        if key not in MUTABLE_WHILE_STARTED and started.get(key) != edited.get(key)
    ]


def all_succeeded(pods: Iterable[PodView], expected: int) -> bool:
    pods = list(pods)
    return expected > 0 and len({p.index for p in pods}) == expected and all(p.phase == "Succeeded" for p in pods)


def all_running(pods: Iterable[PodView], expected: int) -> bool:
    pods = [p for p in pods if not p.deleting]
    return expected > 0 and len({p.index for p in pods}) == expected and all(p.phase == "Running" for p in pods)


def missing_indices(pods: Iterable[PodView], expected: int) -> list[int]:
    have = {p.index for p in pods}
    return [i for i in range(expected) if i not in have]
