"""One reconcile of one TrainingJob: compare desired children with actual ones and converge.

Safe to interrupt anywhere: child names are deterministic, creation is create-if-absent, and a
gang restart is recorded in status (restartPending) before any pod is deleted, so an operator
restarted in the middle neither duplicates pods nor counts a restart twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import fnmatch
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from meshjob.cluster import auto_stages
from meshjob.cluster.nodes import node_infos, still_fits
from meshjob.errors import FieldError, PlacementError, SpecError
from meshjob.plan import rendered
from meshjob.plan.placement import Host, parse_hosts
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job
from meshjob.spec.safeyaml import load_one
from meshjob_operator import lifecycle, names, podsecurity, progress, render
from meshjob_operator.kube import JSON_PATCH, ApiError, Kube
from meshjob_operator.metrics import OperatorMetrics
from meshjob_operator.planning import TIMEOUT, Planned, Planner, PlanningFailed, planning_work
from meshjob_operator.status import (
    CREATED,
    FAILED,
    PENDING,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    TERMINAL_PHASES,
    PodView,
    clear_condition,
    get_condition,
    is_true,
    parse_time,
    set_condition,
    status_placement,
    timestamp,
)
from meshjob_operator.usage import DeviceUsage

# status fields this module owns (others, e.g. kopf's, are left alone)
MANAGED = (
    "phase",
    "conditions",
    "hosts",
    "restarts",
    "disruptions",
    "restartPending",
    "step",
    "loss",
    "checkpointStep",
    "progress",
    "startTime",
    "completionTime",
    "placement",
    "pods",
    "observedGeneration",
    "tuned",
    "configMapDigests",
)
RESTART_RECHECK_S = 1.0
POD_SECURITY_TTL_S = 10.0  # how long a reconcile trusts a namespace's Pod Security level it read (admission: 0)
POD_UNSCHEDULABLE = "PodUnschedulable"  # reason of condition Unschedulable while the scheduler places a pod nowhere
SHOWN_PODS = 3  # pods whose scheduler message the condition quotes
PLACEMENT_ATTEMPTS = 3  # plans of a job whose devices other jobs took meanwhile, before it waits (Unschedulable)
EXCLUSIVE_PLAN_S = 1.0  # a job that lost its devices to a plan made beside it, and plans in less, re-plans alone
# (and any job does on its last attempt)
PLAN_RETRY_S = 2.0  # the first retry after a planning timeout; each next one waits twice as long ...
PLAN_RETRY_MAX_S = 60.0  # ... up to this
PLAN_TIMEOUT_GROWTH = 4  # ... and its time limit doubles with each retry, up to this many times --plan-timeout
NOT_RETRIABLE = {"metadata": {"annotations": {"kueue.x-k8s.io/retriable-in-group": "false"}}}
MAX_DIGESTS = 4  # status.configMapDigests: the content written last, and what a rewrite cut short may have left

EmitFn = Callable[[Mapping[str, Any], str, str, str], None]  # (job body, type, reason, message)


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def manifest(body: Mapping[str, Any]) -> dict[str, Any]:
    """The user's document without server-side metadata and status (for parse_job)."""
    meta = body.get("metadata", {})
    return {
        "apiVersion": body.get("apiVersion", names.API_VERSION),
        "kind": body.get("kind", names.KIND),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace") or "default"},
        "spec": body.get("spec"),
    }


TRAINER_IMAGE_ENV = "MESHJOB_TRAINER_IMAGE"  # the chart's trainer image, for jobs that name none
ALLOWED_IMAGES_ENV = "MESHJOB_ALLOWED_IMAGES"  # comma-separated glob patterns; unset: any image


def validate(body: Mapping[str, Any], pod_security: str = podsecurity.RESTRICTED) -> TrainingJob:
    """parse_job (the operator's spec.scheduling and spec.serviceAccountName included); raises
    SpecError naming every bad field. A `stages: auto` job comes back with one placeholder stage: the
    search replaces it when the job is planned (meshjob.cluster.auto_stages). A job without spec.image runs the
    operator's trainer image;
    with an allow-list ($MESHJOB_ALLOWED_IMAGES), an image it does not match is refused. Its pods must pass
    `pod_security`, the Pod Security level of its namespace (Reconciler.pod_security)."""
    doc = manifest(body)
    job = auto_stages.read_for_cluster(doc).job
    default_image = os.environ.get(TRAINER_IMAGE_ENV)
    if default_image and not (body.get("spec") or {}).get("image"):
        job = dataclasses.replace(job, image=default_image)
    check_runnable(job)
    render.check_pod_security(job, pod_security)
    return job


def check_runnable(job: TrainingJob) -> None:
    """What admission checks of a job besides its model: the pod template (and that spec.resources holds
    Kubernetes quantities) and the image allow-list. Also run on every job the operator renders pods from."""
    render.check_pod_template(job)
    check_image(job.image, allowed_images())


def allowed_images() -> tuple[str, ...]:
    """The operator's image allow-list (--allowed-image, repeatable): glob patterns; empty = any image."""
    return tuple(p.strip() for p in os.environ.get(ALLOWED_IMAGES_ENV, "").split(",") if p.strip())


def check_image(image: str, allowed: tuple[str, ...]) -> None:
    """SpecError naming spec.image unless it matches one allowed pattern (fnmatch; `*` crosses `/`)."""
    if allowed and not any(fnmatch.fnmatchcase(image, pattern) for pattern in allowed):
        raise SpecError(
            [
                FieldError(
                    "spec.image",
                    image,
                    f"an image this operator may run: one matching {', '.join(allowed)} (its --allowed-image list)",
                )
            ]
        )


class PlanAltered(Exception):
    """The job's ConfigMap holds content the operator did not write: no pod is rendered from it."""

    def __init__(self, configmap: str):
        super().__init__(
            f"ConfigMap {configmap} was changed by someone other than the operator (its content is not what the "
            "operator wrote, status.configMapDigests): no pods are created from it. Delete that ConfigMap to "
            "re-plan from the job's own spec, or delete and re-create the job"
        )


@dataclass(frozen=True)
class PlanFiles:
    """The job's ConfigMap as read: its files, their digest, and whether that digest is one the operator
    recorded (False only for a job started before digests were recorded)."""

    data: dict[str, str]
    digest: str
    recorded: bool

    def started_job(self) -> TrainingJob | None:
        """The job as it started (job.yaml), if the model reads it."""
        text = self.data.get(rendered.JOB_FILE)
        try:
            return parse_job(load_one(text, rendered.JOB_FILE, "TrainingJob")) if text else None
        except SpecError:
            return None


def invalid_status(status: Mapping[str, Any], err: Exception, now: datetime.datetime) -> dict[str, Any]:
    conditions = set_condition(status.get("conditions") or [], "Failed", True, "InvalidSpec", str(err), now)
    return {"phase": FAILED, "conditions": conditions}


@dataclass
class Draft:
    """The status being built in one reconcile; `changes()` is the merge patch to send."""

    old: Mapping[str, Any]
    new: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.new = {k: self.old[k] for k in MANAGED if k in self.old}

    def __getitem__(self, key: str) -> Any:
        return self.new.get(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if value is None:
            self.new.pop(key, None)
        else:
            self.new[key] = value

    @property
    def conditions(self) -> list[dict[str, Any]]:
        return list(self.new.get("conditions") or [])

    def condition(self, type_: str, status: bool, reason: str, message: str, now: datetime.datetime) -> bool:
        """Set a condition; True when it just became True (worth an Event)."""
        was = is_true(self.conditions, type_)
        self["conditions"] = set_condition(self.conditions, type_, status, reason, message, now)
        return status and not was

    def clear(self, type_: str, reason: str, message: str, now: datetime.datetime) -> None:
        self["conditions"] = clear_condition(self.conditions, type_, reason, message, now)

    def changes(self) -> dict[str, Any]:
        patch: dict[str, Any] = {}
        for key in MANAGED:
            if self.old.get(key) != self.new.get(key):
                patch[key] = merge_patch(self.old.get(key), self.new.get(key))
        return patch


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch from `old` to `new`: None deletes; a mapping merges into the one there, so keys
    gone from it are deleted by name (a bare {} would leave every old key, e.g. status.pods after a restart)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    gone = {k: None for k in old if k not in new}
    return {**gone, **{k: merge_patch(old.get(k), v) for k, v in new.items() if old.get(k) != v}}


@dataclass
class Reconciler:
    kube: Kube
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    emit: EmitFn = lambda body, type_, reason, message: None
    clock: Callable[[], datetime.datetime] = utcnow
    unschedulable: set[tuple[str, str]] = field(default_factory=set)  # jobs to re-check when Nodes change
    # the Nodes as a watch-fed cache (kopf index); None: list them from the API on each placement
    nodes: Callable[[], Sequence[Mapping[str, Any]]] | None = None
    scraper: progress.Scraper = field(default_factory=progress.Scraper)  # trainers' metrics endpoints
    planner: Planner = field(default_factory=Planner)  # plans in a child process, within a time limit
    usage: DeviceUsage = field(init=False)  # the devices other pods hold, and what accepted plans reserved
    _placing: asyncio.Lock = field(default_factory=asyncio.Lock)  # fresh placements are accepted one at a time
    _timeouts: dict[tuple[str, str], int] = field(default_factory=dict)  # job -> planning timeouts in a row
    _retry_in: dict[tuple[str, str], float] = field(default_factory=dict)  # job -> seconds to its next plan
    _read_at: dict[tuple[str, str], float] = field(default_factory=dict)  # job -> monotonic time of last reading
    _levels: dict[str, tuple[float, str]] = field(default_factory=dict)  # namespace -> (monotonic time, level)

    def __post_init__(self) -> None:
        self.usage = DeviceUsage(self.kube.list_running_pods)

    async def reconcile(self, namespace: str, name: str) -> float | None:
        """Converge one job; returns seconds until a timed re-check is due (deadline, TTL), else None."""
        started = time.perf_counter()
        try:
            return await self._reconcile(namespace, name)
        finally:
            self.metrics.reconcile_duration.observe(time.perf_counter() - started)

    async def pod_security(self, namespace: str, max_age_s: float = POD_SECURITY_TTL_S) -> str:
        """The Pod Security level the namespace's labels ask for (podsecurity.namespace_level), read again
        when the one known is older than `max_age_s`."""
        known = self._levels.get(namespace)
        if known is None or time.monotonic() - known[0] >= max_age_s:
            level = podsecurity.namespace_level(await self.kube.namespace_labels(namespace))
            known = self._levels[namespace] = (time.monotonic(), level)
        return known[1]

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone (or its loop ends): its metric series and progress readings go too."""
        self.metrics.job_phase(namespace, name, None)
        self._read_at.pop((namespace, name), None)
        self._timeouts.pop((namespace, name), None)
        self._retry_in.pop((namespace, name), None)
        self.usage.release((namespace, name))

    async def _reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.kube.get_job(namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        now = self.clock()
        meta = render.JobMeta.of(body)
        draft = Draft(body.get("status") or {})
        level = await self.pod_security(namespace)
        try:  # bounded by the spec's limits, but off the event loop all the same
            job = await asyncio.to_thread(validate, body, level)
        except SpecError as err:  # the spec handler reports it; nothing to run until the spec changes
            await self._write(meta, body, draft, invalid_status(draft.new, err, now))
            return None

        # a `stages: auto` job searches until it has started; then it runs what it started with
        search = manifest(body) if auto_stages.wants_search(manifest(body)) else None
        altered: PlanAltered | None = None
        try:
            job, started = await self._refuse_edits(meta, body, draft, job, now, search)
        except PlanAltered as err:  # its pods are followed with the job's own spec; none is created (below)
            started, altered = True, err
        self._note_altered(body, draft, altered, now)
        search = None if started else search
        if (
            draft["phase"] == FAILED
            and (get_condition(draft.conditions, "Failed") or {}).get("reason") == "InvalidSpec"
        ):
            draft.condition("Failed", False, "SpecValid", "the spec is valid now", now)
            draft["phase"] = PENDING
        draft["observedGeneration"] = body.get("metadata", {}).get("generation")

        pods = await self._own_pods(meta, draft)
        recorded = set(draft["pods"] or {})  # pods this job had at the last status write
        draft["pods"] = {p.name: p.phase for p in pods}
        policy = job.run_policy

        if draft["phase"] in TERMINAL_PHASES:
            return await self._finished(meta, body, draft, job, pods, now)

        if policy.suspend:
            await self._delete(meta, [p for p in pods if not p.deleting])
            if draft.condition("Suspended", True, "Suspended", "runPolicy.suspend is true: pods deleted", now):
                self.emit(body, "Normal", "Suspended", "runPolicy.suspend is true: pods deleted")
            draft.clear("Running", "Suspended", "the job is suspended", now)
            draft["phase"], draft["startTime"], draft["restartPending"] = SUSPENDED, None, None
            draft["pods"] = {}  # deleted on purpose: not "disappeared" on resume
            await self._write(meta, body, draft)
            return None
        if is_true(draft.conditions, "Suspended"):
            draft.condition("Suspended", False, "Resumed", "runPolicy.suspend is false: pods recreated", now)
            draft["phase"] = PENDING

        if draft["restartPending"]:
            remaining = [p for p in pods if not p.deleting]
            await self._delete(meta, remaining)
            if pods:  # wait until every old pod is gone: new ones reuse their names
                await self._write(meta, body, draft)
                return RESTART_RECHECK_S
            draft["restartPending"] = None
            recorded = set()  # the old gang is gone on purpose

        vanished = sorted(recorded - {p.name for p in pods})  # deleted, evicted or preempted by someone else
        broken = lifecycle.gang_break(pods, vanished)
        if broken is not None:
            return await self._restart_or_fail(meta, body, draft, job, pods, broken, now)

        expected = int(draft["hosts"] or 0)
        if pods and lifecycle.all_succeeded(pods, expected):
            draft["phase"] = SUCCEEDED
            steps = job.training.steps  # every step is done: the trainers exit only then
            draft["step"], draft["progress"] = steps, {"step": steps, "total": steps, "percent": 100}
            losses = [p.final_loss for p in pods if p.final_loss is not None]
            if losses:  # from the last stage's pods' summaries (all the same global-batch mean)
                draft["loss"] = losses[0]
            draft["completionTime"] = timestamp(now)
            ended = f"all {expected} host pod(s) succeeded" + (f", final loss {losses[0]:.4f}" if losses else "")
            draft.condition("Succeeded", True, "AllPodsSucceeded", ended, now)
            draft.clear("Running", "Succeeded", "the job has finished", now)
            draft.clear("Restarting", "Succeeded", "the job has finished", now)
            self.emit(body, "Normal", "Succeeded", ended)
            return await self._finished(meta, body, draft, job, pods, now)

        deadline_left = lifecycle.seconds_left(parse_time(draft["startTime"]), policy.active_deadline_seconds, now)
        if deadline_left is not None and deadline_left <= 0:
            text = f"running longer than runPolicy.activeDeadlineSeconds={policy.active_deadline_seconds}"
            return await self._fail(meta, body, draft, job, pods, "DeadlineExceeded", text, now)

        if not pods or not expected or lifecycle.missing_indices(pods, expected):
            if altered is not None:  # never a pod from content someone else wrote
                await self._write(meta, body, draft)
                return None
            created = await self._create_children(meta, body, draft, job, pods, now, search)
            if not created:  # a planning timeout: planned again after a backoff
                return self._retry_in.pop((namespace, name), None)

        expected = int(draft["hosts"] or 0)
        self._report_scheduling(body, draft, pods, now)
        if lifecycle.all_running(pods, expected):
            draft["phase"] = RUNNING
            draft.condition("Running", True, "AllPodsRunning", f"all {expected} host pod(s) are running", now)
            draft.clear("Restarting", "Running", "all host pods are running again", now)
        elif draft["phase"] not in (RESTARTING,):
            draft["phase"] = CREATED if is_true(draft.conditions, "Created") else PENDING
        next_reading = await self._read_progress(job, pods, draft, now)
        await self._write(meta, body, draft)
        deadline = None
        if policy.active_deadline_seconds is not None and draft["startTime"]:
            deadline = lifecycle.seconds_left(parse_time(draft["startTime"]), policy.active_deadline_seconds, now)
        return min((t for t in (deadline, next_reading) if t is not None), default=None)

    # --- steps ---------------------------------------------------------------------------
    def _report_scheduling(
        self, body: Mapping[str, Any], draft: Draft, pods: list[PodView], now: datetime.datetime
    ) -> None:
        """Pods the scheduler places nowhere: condition Unschedulable with its message and a Warning Event
        for each new message (the phase alone would say Created while they wait); cleared once every pod is placed."""
        waiting = [p for p in pods if p.unschedulable and not p.deleting]
        if waiting:
            shown = "; ".join(f"pod {p.name}: {p.unschedulable}" for p in waiting[:SHOWN_PODS])
            more = f" (and {len(waiting) - SHOWN_PODS} more)" if len(waiting) > SHOWN_PODS else ""
            message = f"the scheduler places {len(waiting)} pod(s) nowhere: {shown}{more}"
            said = (get_condition(draft.conditions, "Unschedulable") or {}).get("message")
            # the scheduler's reason changes as the cluster does (a claim bound, a node tainted): say each one
            if draft.condition("Unschedulable", True, POD_UNSCHEDULABLE, message, now) or said != message:
                self.emit(body, "Warning", "Unschedulable", message)
        elif (get_condition(draft.conditions, "Unschedulable") or {}).get("reason") == POD_UNSCHEDULABLE:
            draft.clear("Unschedulable", "Scheduled", "the scheduler placed every pod", now)

    async def _read_progress(
        self, job: TrainingJob, pods: list[PodView], draft: Draft, now: datetime.datetime
    ) -> float | None:
        """While the gang runs: step, checkpointStep and progress from global rank 0's metrics endpoint
        (local rank 0 of host pod 0), at most every progress.INTERVAL_S; returns when to read again."""
        first = pods[0] if pods else None
        if draft["phase"] != RUNNING or first is None or first.index != 0 or not first.ip:
            return None
        key, clock = (job.namespace, job.name), time.monotonic()
        since = clock - self._read_at.get(key, -progress.INTERVAL_S)
        if since < progress.INTERVAL_S:
            return progress.INTERVAL_S - since
        self._read_at[key] = clock
        reading = await self.scraper.read(first.ip, job.metrics.port)
        if reading is not None and reading.step is not None:
            draft["step"], draft["progress"] = reading.step, progress.status(reading, job.training.steps, now)
        if reading is not None and reading.checkpoint_step is not None:
            draft["checkpointStep"] = reading.checkpoint_step
        return progress.INTERVAL_S

    async def _own_pods(self, meta: render.JobMeta, draft: Draft) -> list[PodView]:
        """This job's host pods; pods left by an older job of the same name, or beyond the host count, go."""
        ours, stale = [], []
        expected = int(draft["hosts"] or 0)
        for raw in await self.kube.list_pods(meta.namespace, meta.name):
            index = names.host_index(raw["metadata"]["name"], meta.name)
            if index is None:
                continue
            view = PodView.of(raw, index)
            if (meta.uid and view.owner_uid and view.owner_uid != meta.uid) or (expected and index >= expected):
                stale.append(view)
            else:
                ours.append(view)
        await self._delete(meta, [p for p in stale if not p.deleting])
        return sorted(ours, key=lambda p: p.index)

    async def _delete(self, meta: render.JobMeta, pods: list[PodView]) -> None:
        await asyncio.gather(*(self.kube.delete_pod(meta.namespace, p.name) for p in pods))

    async def _restart_or_fail(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        pods: list[PodView],
        broken: lifecycle.GangBreak,
        now: datetime.datetime,
    ) -> float | None:
        """A gang restart from the last checkpoint; evictions and preemptions do not count toward
        runPolicy.backoffLimit, failures do, and a permanent exit code fails the job at once."""
        limit = job.run_policy.backoff_limit
        restarts, disruptions = int(draft["restarts"] or 0), int(draft["disruptions"] or 0)
        if broken.kind == lifecycle.PERMANENT:
            return await self._fail(meta, body, draft, job, pods, "PermanentError", broken.message, now)
        counted = restarts - disruptions
        if broken.kind == lifecycle.FAILURE and counted >= limit:
            text = f"{broken.message}; {counted} restart(s) after failures reached runPolicy.backoffLimit={limit}"
            return await self._fail(meta, body, draft, job, pods, "BackoffLimitExceeded", text, now)
        disrupted = broken.kind == lifecycle.DISRUPTION
        draft["restarts"], draft["restartPending"], draft["phase"] = restarts + 1, True, RESTARTING
        if disrupted:
            draft["disruptions"] = disruptions + 1
        budget = (
            "not counted toward runPolicy.backoffLimit"
            if disrupted
            else f"failure {counted + 1} of at most {limit} (runPolicy.backoffLimit)"
        )
        reason = "PodDisrupted" if disrupted else "PodFailed"
        draft.condition("Restarting", True, reason, f"{broken.message}: restarting all pods ({budget})", now)
        draft.clear("Running", "Restarting", broken.message, now)
        await self._write(meta, body, draft)  # record the restart before deleting anything
        self.metrics.restarts.labels(namespace=meta.namespace, trainingjob=meta.name, reason=broken.kind).inc()
        self.emit(body, "Warning", reason, f"{broken.message}: gang restart {restarts + 1} ({budget})")
        await self._delete(meta, [p for p in pods if not p.deleting])
        return RESTART_RECHECK_S

    async def _fail(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        pods: list[PodView],
        reason: str,
        message: str,
        now: datetime.datetime,
    ) -> float | None:
        if job.scheduling.queue:  # Kueue: a group with a pod marked so is finished, its quota released
            await asyncio.gather(
                *(self.kube.patch(meta.namespace, "pods", p.name, NOT_RETRIABLE) for p in pods if not p.deleting)
            )
        draft["phase"] = FAILED
        draft["completionTime"] = timestamp(now)
        draft["restartPending"] = None
        draft.condition("Failed", True, reason, message, now)
        draft.clear("Running", reason, message, now)
        draft.clear("Restarting", reason, message, now)
        self.emit(body, "Warning", reason, message)
        return await self._finished(meta, body, draft, job, pods, now)

    async def _finished(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        pods: list[PodView],
        now: datetime.datetime,
    ) -> float | None:
        """cleanPodPolicy, then ttlSecondsAfterFinished."""
        await self._delete(meta, lifecycle.cleanup_targets(pods, job.run_policy.clean_pod_policy))
        await self._write(meta, body, draft)
        left = lifecycle.seconds_left(
            parse_time(draft["completionTime"]), job.run_policy.ttl_seconds_after_finished, now
        )
        if left is not None and left <= 0:
            await self.kube.delete_job(meta.namespace, meta.name)
            self.metrics.job_phase(meta.namespace, meta.name, None)
            return None
        return left

    async def _refuse_edits(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        now: datetime.datetime,
        search: Mapping[str, Any] | None = None,
    ) -> tuple[TrainingJob, bool]:
        """Once its pods exist a job runs, and resumes from checkpoints of, the spec it started with (kept
        in its ConfigMap): an edit beside spec.runPolicy is refused (condition EditRefused, a Warning Event)
        and the job runs on as it was, with the edited runPolicy. A `stages: auto` job (`search`, its
        manifest) started with what the search chose then: the fields it left to the search are compared
        with those. Returns the job to run and whether it is the started one; PlanAltered when the ConfigMap
        holds what the operator did not write (no ConfigMap: the job re-plans from its own spec)."""
        files = await self._plan_files(meta, draft) if is_true(draft.conditions, "Created") else None
        started = files.started_job() if files is not None else None
        if files is None or started is None:
            return job, False
        if search is not None:
            job = auto_stages.as_started(job, search, started)
        changed = lifecycle.immutable_changes(job_to_dict(started)["spec"], job_to_dict(job)["spec"])
        if not files.recorded:  # started before digests were recorded: trusted only as the job's own spec
            if changed:
                raise PlanAltered(names.configmap_name(meta.name))
            draft["configMapDigests"] = [files.digest]
        if not changed:
            draft.clear("EditRefused", "Unchanged", "the spec is the one the job started with", now)
            return (job if search is None else dataclasses.replace(started, run_policy=job.run_policy)), True
        message = (
            f"{', '.join(changed)} cannot change once the job has started (spec.runPolicy can): it runs on "
            "with the spec it started with; delete and re-create it to change them"
        )
        old = (get_condition(draft.conditions, "EditRefused") or {}).get("message")
        draft.condition("EditRefused", True, "ImmutableWhileStarted", message, now)
        if old != message:
            self.emit(body, "Warning", "EditRefused", message)
        return dataclasses.replace(started, run_policy=job.run_policy), True

    async def _plan_files(self, meta: render.JobMeta, draft: Draft) -> PlanFiles | None:
        """The job's ConfigMap, if it exists. Anyone who may patch ConfigMaps can rewrite it, so the operator
        records the digest of what it wrote in status (which only it writes) and raises PlanAltered for any
        other content."""
        name = names.configmap_name(meta.name)
        cm = await self.kube.get(meta.namespace, "configmaps", name)
        if cm is None:
            return None
        digest, recorded = render.configmap_digest(cm), draft["configMapDigests"]
        if recorded is not None and digest not in recorded:
            raise PlanAltered(name)
        return PlanFiles(dict(cm.get("data") or {}), digest, recorded is not None)

    async def _hosts_in_use(self, meta: render.JobMeta, draft: Draft) -> tuple[Host, ...] | None:
        """The hosts the existing pods were placed on (from the job's ConfigMap, if the operator's), if any."""
        files = await self._plan_files(meta, draft)
        text = files.data.get("hosts.yaml") if files is not None and files.recorded else None
        if not text:
            return None
        return parse_hosts(load_one(text, "hosts.yaml", "hosts"))

    def _note_altered(
        self, body: Mapping[str, Any], draft: Draft, altered: PlanAltered | None, now: datetime.datetime
    ) -> None:
        """Condition SpecAltered, and a Warning Event when it becomes True, while the job's ConfigMap holds what
        the operator did not write; cleared once it holds the operator's content again (or is gone)."""
        if altered is None:
            draft.clear("SpecAltered", "ConfigMapIntact", "the job's ConfigMap holds what the operator wrote", now)
        elif draft.condition("SpecAltered", True, "ConfigMapAltered", str(altered), now):
            self.emit(body, "Warning", "SpecAltered", str(altered))

    async def _create_children(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        pods: list[PodView],
        now: datetime.datetime,
        search: Mapping[str, Any] | None = None,
    ) -> bool:
        nodes = self.nodes() if self.nodes is not None else await self.kube.list_nodes()
        # surviving pods keep their placement; a fresh (re)start places on the nodes there are now,
        # with the function `meshjob plan --cluster` calls
        try:
            hosts = await self._hosts_in_use(meta, draft) if pods else None
        except PlanAltered as err:
            self._note_altered(body, draft, err, now)
            await self._write(meta, body, draft)
            return False
        fresh = hosts is None
        key = (meta.namespace, meta.name)
        timeout_s = self.planner.timeout_s * min(PLAN_TIMEOUT_GROWTH, 2 ** self._timeouts.get(key, 0))
        try:
            plan_s = math.inf
            for attempt in range(PLACEMENT_ATTEMPTS):
                # a fresh placement counts the devices every other pod holds and every accepted plan reserved.
                # Plans run in the planner's pool, unlocked (one can take seconds); a job waiting for a place
                # there reads the devices in use only once it has one, so it sees what the plans before it took.
                # Then, one job at a time, the plan is checked against what is taken now and, if it still fits,
                # its devices are reserved before the next check: two jobs never take the same devices. A plan
                # that another one planned at the same time beat to its devices is made again holding the lock
                # (no plan is accepted meanwhile, so it cannot lose again) when it is quick to make, and on the
                # last attempt whatever it takes (a slow plan then delays other jobs' acceptance, not its own).
                last = attempt == PLACEMENT_ATTEMPTS - 1
                exclusive = fresh and attempt > 0 and (plan_s <= EXCLUSIVE_PLAN_S or last)
                async with self._placing if exclusive else contextlib.nullcontext():
                    async with self.planner.slot(planning_work(job, search)):
                        others = await self.usage.pods() if fresh else []
                        started = time.perf_counter()
                        planned = await self.planner.plan(job, nodes, hosts, others, search, timeout_s)
                        plan_s = time.perf_counter() - started
                    self._timeouts.pop(key, None)
                    if not fresh:
                        return await self._create_planned(meta, body, draft, job, pods, planned, nodes, fresh, now)
                    if exclusive:
                        fits = await self._accept(key, planned, nodes, job)
                if not exclusive:
                    async with self._placing:
                        fits = await self._accept(key, planned, nodes, job)
                if fits:  # created outside the lock: the reservation holds the devices meanwhile
                    try:
                        created = await self._create_planned(meta, body, draft, job, pods, planned, nodes, fresh, now)
                    except BaseException:
                        self.usage.release(key)
                        raise
                    self.usage.created(key)
                    return created
            raise PlacementError(
                f"the devices it was planned on were taken by other jobs while it was planned "
                f"({PLACEMENT_ATTEMPTS} times)"
            )
        except PlanningFailed as err:
            if err.reason == TIMEOUT:
                await self._plan_later(meta, body, draft, err, now)
                return False
            await self._fail(meta, body, draft, job, pods, err.reason, str(err), now)
            return False
        except PlacementError as err:
            self.unschedulable.add((meta.namespace, meta.name))
            message = str(err)
            if draft.condition("Unschedulable", True, "InsufficientDevices", message, now):
                self.emit(body, "Warning", "Unschedulable", message)
            draft["phase"] = PENDING
            await self._write(meta, body, draft)
            return False
        except SpecError as err:
            await self._write(meta, body, draft, invalid_status(draft.new, err, now))
            self.emit(body, "Warning", "InvalidSpec", str(err))
            return False

    async def _accept(
        self, key: tuple[str, str], planned: Planned, nodes: Sequence[Mapping[str, Any]], job: TrainingJob
    ) -> bool:
        """Whether the plan still fits what other pods hold and other plans reserved now (the caller holds
        `_placing`); if it does, its devices are reserved for it from now on."""
        chosen = planned.chosen or job
        infos = node_infos(nodes, chosen, parse_quantity, await self.usage.pods())
        if not still_fits(planned.pods, infos):
            return False
        node_of_host = {i.host: i.name for i in infos if i.host}
        self.usage.reserve(key, planned.pods, node_of_host, chosen.topology.device_resource)
        return True

    async def _plan_later(
        self, meta: render.JobMeta, body: Mapping[str, Any], draft: Draft, err: PlanningFailed, now: datetime.datetime
    ) -> None:
        """Planning ran out of time (a loaded machine, a job near the spec's limits): not a verdict on the job.
        It stays Pending with condition PlanningDelayed, and is planned again after a backoff (2, 4, 8, ...
        seconds, at most PLAN_RETRY_MAX_S) with a longer limit (twice, then PLAN_TIMEOUT_GROWTH times
        --plan-timeout)."""
        key = (meta.namespace, meta.name)
        timeouts = self._timeouts[key] = self._timeouts.get(key, 0) + 1
        delay = self._retry_in[key] = min(PLAN_RETRY_MAX_S, PLAN_RETRY_S * 2 ** (timeouts - 1))
        message = f"{err}; timed out {timeouts} time(s) in a row, planning again in {delay:g} s"
        if draft.condition("PlanningDelayed", True, TIMEOUT, message, now):
            self.emit(body, "Warning", TIMEOUT, message)
        draft["phase"] = PENDING
        await self._write(meta, body, draft)

    async def _create_planned(
        self,
        meta: render.JobMeta,
        body: Mapping[str, Any],
        draft: Draft,
        job: TrainingJob,
        pods: list[PodView],
        planned: Planned,
        nodes: Sequence[Mapping[str, Any]],
        fresh: bool,
        now: datetime.datetime,
    ) -> bool:
        """The plan's ConfigMap, Service, PodGroup and missing pods (of the job the search chose, for a
        `stages: auto` job: status.tuned and a StagesChosen Event say what it chose)."""
        if planned.chosen is not None:
            job = planned.chosen
            if draft["tuned"] != planned.tuned:
                self.emit(body, "Normal", "StagesChosen", planned.tuned_message)
            draft["tuned"] = planned.tuned
        self.unschedulable.discard((meta.namespace, meta.name))
        draft.clear("Unschedulable", "Scheduled", "the cluster can hold the job", now)
        draft.clear("PlanningDelayed", "Planned", "the job was planned", now)
        node_of_host = {i.host: i.name for i in node_infos(nodes, job, parse_quantity) if i.host}
        wanted = planned.pods

        check_runnable(job)  # every job pods are rendered from, the started one too: as admission checks it
        have = {p.index for p in pods}
        missing = [render.pod(meta, job, hp, wanted) for hp in wanted if hp.index not in have]
        # the very pods to create pass the namespace's Pod Security level, whatever job they are rendered from
        podsecurity.check(job, missing, await self.pod_security(meta.namespace), meta.namespace)
        await self._write_configmap(meta, draft, render.configmap(meta, job_to_dict(job)["spec"], planned.files), fresh)
        await self.kube.create_if_absent(render.service(meta, job), "services")
        if job.scheduling.gang:
            pg = render.podgroup(meta, wanted)
            await self.kube.create_if_absent(
                pg, "podgroups", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{meta.namespace}/podgroups"
            )

        await asyncio.gather(*(self._create_pod(pod) for pod in missing))
        draft["hosts"] = len(wanted)
        draft["placement"] = status_placement(planned.placement, node_of_host)
        draft["pods"] = {**{names.pod_name(meta.name, hp.index): "Pending" for hp in wanted}, **(draft["pods"] or {})}
        if not draft["startTime"]:
            draft["startTime"] = timestamp(now)
        if (
            draft.condition("Created", True, "PodsCreated", f"{len(wanted)} host pod(s) created", now)
            and job.training.checkpoint.every
            and job.training.checkpoint.volume is None
        ):
            self.emit(
                body,
                "Warning",
                "EphemeralCheckpoints",
                "checkpoints go to an emptyDir that a gang restart "
                "loses: set spec.training.checkpoint.volume (e.g. a PersistentVolumeClaim)",
            )
        return True

    async def _write_configmap(self, meta: render.JobMeta, draft: Draft, cm: dict[str, Any], fresh: bool) -> None:
        """The ConfigMap with the spec that runs: created, or for a fresh placement its whole content replaced
        (keys someone else added go too). Its digest goes to status first, beside the ones before it, so an
        operator stopped between the two writes finds either content recorded."""
        digest = render.configmap_digest(cm)
        recorded = list(draft["configMapDigests"] or [])
        if digest not in recorded:
            ahead = [digest, *recorded][:MAX_DIGESTS]
            await self.kube.patch_job_status(meta.namespace, meta.name, {"configMapDigests": ahead})
            draft["configMapDigests"] = ahead
        if await self.kube.create_if_absent(cm, "configmaps"):
            draft["configMapDigests"] = [digest]
        elif fresh:
            content = [
                {"op": "add", "path": "/data", "value": cm["data"]},
                {"op": "add", "path": "/binaryData", "value": {}},
            ]
            await self.kube.patch(
                meta.namespace, "configmaps", cm["metadata"]["name"], content, content_type=JSON_PATCH
            )
            draft["configMapDigests"] = [digest]

    async def _create_pod(self, body: dict[str, Any]) -> None:
        started = time.perf_counter()
        if await self.kube.create_if_absent(body, "pods"):
            self.metrics.pod_creation_latency.observe(time.perf_counter() - started)

    async def blocked(self, namespace: str, name: str, err: ApiError) -> None:
        """A call for the job was refused for a reason that needs someone to act (quota, admission, RBAC, an
        invalid child): condition Blocked with the API's reason and message, a Warning Event when that is
        news, a metric. The job's loop retries with backoff; the next reconcile that gets through clears it."""
        body = await self.kube.get_job(namespace, name)
        if body is None:  # gone: nothing to count it against
            self.metrics.job_phase(namespace, name, None)
            return
        self.metrics.api_error(namespace, name, err.status)
        message = f"{err.method} {err.path} refused (HTTP {err.status} {err.reason}): {err.message}"
        draft = Draft(body.get("status") or {})
        old = get_condition(draft.conditions, "Blocked") or {}
        draft.condition("Blocked", True, err.reason, message, self.clock())
        patch = draft.changes()
        if patch:
            await self.kube.patch_job_status(namespace, name, patch)
        self.metrics.job_phase(namespace, name, draft["phase"] or PENDING)  # a job blocked before its first write
        if old.get("status") != "True" or old.get("message") != message:
            self.emit(body, "Warning", "Blocked", message)

    async def _write(
        self, meta: render.JobMeta, body: Mapping[str, Any], draft: Draft, override: Mapping[str, Any] | None = None
    ) -> None:
        if override:
            for key, value in override.items():
                draft[key] = value
        # every API call of this reconcile so far went through
        draft.clear("Blocked", "Unblocked", "the API server accepts the job's requests again", self.clock())
        patch = draft.changes()
        if patch:
            await self.kube.patch_job_status(meta.namespace, meta.name, patch)
        self.metrics.job_phase(meta.namespace, meta.name, draft["phase"])
