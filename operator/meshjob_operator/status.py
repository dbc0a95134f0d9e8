"""TrainingJob status: conditions (Kubernetes style), phases, and what the pods report."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshjob_operator import names

CONDITION_TYPES = (
    "Created",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
    "Unschedulable",
    "Blocked",
    "EditRefused",
    "SpecAltered",
    "PlanningDelayed",
)

PENDING, CREATED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending",
    "Created",
    "Running",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)
TERMINAL_PHASES = (SUCCEEDED, FAILED)
PHASES = (PENDING, CREATED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
# a pod's status.reason when the kubelet evicted it (node pressure) or the scheduler preempted it
DISRUPTION_REASONS = ("Evicted", "Preempting", "Preempted", "Shutdown", "NodeShutdown", "Terminated")


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def get_condition(conditions: Iterable[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: Iterable[Mapping[str, Any]], type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def set_condition(
    conditions: Iterable[Mapping[str, Any]], type_: str, status: bool, reason: str, message: str, now: datetime.datetime
) -> list[dict[str, Any]]:
    """A new list with `type_` set; lastTransitionTime moves only when the status flips."""
    if type_ not in CONDITION_TYPES:
        raise ValueError(f"condition type {type_!r} is invalid: one of {', '.join(CONDITION_TYPES)}")
    value = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != value
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": timestamp(now) if changed else cond.get("lastTransitionTime", timestamp(now)),
            }
        )
    if not found:
        out.append(
            {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": timestamp(now)}
        )
    return out


def clear_condition(
    conditions: Iterable[Mapping[str, Any]], type_: str, reason: str, message: str, now: datetime.datetime
) -> list[dict[str, Any]]:
    """Set `type_` False if it is present and True; absent conditions stay absent."""
    conditions = list(conditions)
    if is_true(conditions, type_):
        return set_condition(conditions, type_, False, reason, message, now)
    return [dict(c) for c in conditions]


@dataclass(frozen=True)
class PodView:
    """What the reconciler needs from a child pod."""

    name: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    deleting: bool
    owner_uid: str
    message: str = ""
    ip: str = ""  # status.podIP: where its metrics endpoint is
    disrupted: bool = False  # evicted or preempted (status.reason, or condition DisruptionTarget)
    exit_code: int | None = None  # of the trainer container, once it terminated
    unschedulable: str = ""  # the scheduler's message while it finds no node for the pod
    final_loss: float | None = None  # from the trainer's summary, once it succeeded on a last-stage host

    @classmethod
    def of(cls, pod: Mapping[str, Any], index: int) -> PodView:
        meta = pod.get("metadata", {})
        st = pod.get("status") or {}
        owners = [o.get("uid", "") for o in meta.get("ownerReferences") or [] if o.get("kind") == names.KIND]
        disrupted = st.get("reason") in DISRUPTION_REASONS or any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in st.get("conditions") or []
        )
        return cls(
            name=meta["name"],
            index=index,
            phase=st.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            owner_uid=owners[0] if owners else "",
            message=_failure_message(st),
            ip=st.get("podIP") or "",
            disrupted=disrupted,
            exit_code=_exit_code(st),
            unschedulable=_unschedulable(st),
            final_loss=_final_loss(st),
        )


def _unschedulable(pod_status: Mapping[str, Any]) -> str:
    """Why the scheduler places the pod nowhere (condition PodScheduled False, reason Unschedulable)."""
    for cond in pod_status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return cond.get("message") or "the scheduler found no node for it"
    return ""


def _exit_code(pod_status: Mapping[str, Any]) -> int | None:
    for cs in pod_status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == "trainer" and "exitCode" in terminated:
            return int(terminated["exitCode"])
    return None


def _final_loss(pod_status: Mapping[str, Any]) -> float | None:
    """The loss in the trainer's summary (meshjob_trainer.commands.worker.write_summary): its termination
    message once it exited 0, a line of JSON."""
    for cs in pod_status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") != "trainer" or terminated.get("exitCode") != 0:
            continue
        try:
            summary = json.loads(terminated.get("message") or "")
        except ValueError:
            return None
        loss = summary.get("loss") if isinstance(summary, dict) else None
        return float(loss) if isinstance(loss, (int, float)) else None
    return None


def _failure_message(pod_status: Mapping[str, Any]) -> str:
    parts = [pod_status.get("reason", ""), pod_status.get("message", "")]
    for cs in pod_status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term:
            parts.append(f"container {cs.get('name')} exited {term.get('exitCode')} {term.get('reason', '')}".strip())
            if term.get("message"):  # its termination message: the worker's last lines
                parts.append(str(term["message"]).strip()[-1000:])
    return "; ".join(p for p in parts if p)


def status_placement(placement_rows: list[dict[str, Any]], node_of_host: dict[str, str]) -> list[dict[str, Any]]:
    """status.placement from Placement.to_json(): one entry per mesh row, with the Node it landed on."""
    return [
        {
            "stage": row["stage"],
            "host": row["host"],
            "node": node_of_host.get(row["host"], ""),
            "devices": list(row["devices"]),
        }
        for row in placement_rows
    ]
