"""Pure lifecycle rules: what the run policy says about a set of pods at a moment in time."""
from __future__ import annotations

import datetime
from typing import Iterable

from meshjob_operator.status import PodView

FINISHED_POD_PHASES = ("Succeeded", "Failed")


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


def first_failure(pods: Iterable[PodView]) -> PodView | None:
    failed = sorted((p for p in pods if p.phase == "Failed"), key=lambda p: p.index)
    return failed[0] if failed else None


def all_succeeded(pods: Iterable[PodView], expected: int) -> bool:
    pods = list(pods)
    return expected > 0 and len({p.index for p in pods}) == expected and all(p.phase == "Succeeded" for p in pods)


def all_running(pods: Iterable[PodView], expected: int) -> bool:
    pods = [p for p in pods if not p.deleting]
    return expected > 0 and len({p.index for p in pods}) == expected and all(p.phase == "Running" for p in pods)


def missing_indices(pods: Iterable[PodView], expected: int) -> list[int]:
    have = {p.index for p in pods}
    return [i for i in range(expected) if i not in have]
