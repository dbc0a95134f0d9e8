"""kopf handlers: thin glue between Kubernetes events and the Reconciler.

One daemon per TrainingJob runs its reconcile loop (so reconciles of one job never overlap);
pod, node and job events wake it. Validation runs on create/update/resume (a permanent error:
condition, Warning Event, no retries) and, when enabled, in an admission webhook.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from meshjob.errors import SpecError
from meshjob.spec.api import OPERATOR_METRICS_PORT
from meshjob.spec.manifest import job_to_dict
from meshjob_operator import names
from meshjob_operator.certs import webhook_server
from meshjob_operator.kube import ApiError, Connection, Kube, kopf_connection
from meshjob_operator.lifecycle import immutable_changes
from meshjob_operator.metrics import OperatorMetrics
from meshjob_operator.planning import DEFAULT_CONCURRENCY as DEFAULT_PLAN_CONCURRENCY
from meshjob_operator.planning import DEFAULT_TIMEOUT_S as DEFAULT_PLAN_TIMEOUT_S
from meshjob_operator.planning import Planner
from meshjob_operator.podsecurity import PRIVILEGED
from meshjob_operator.reconcile import Reconciler, invalid_status, validate
from meshjob_operator.status import is_true
from meshjob_operator.wakeups import Key, Wakeups, wait_any

NODES_KEY = "nodes"
RESYNC_S = 60.0  # a periodic re-check even without events (missed watch events, clock-based policies)
MAX_BACKOFF_S = 30.0


@dataclass
class OperatorConfig:
    """Set by `meshjob operator` before kopf starts; env variables for `kopf run -m meshjob_operator.handlers`."""

    metrics_port: int | None = field(
        default_factory=lambda: _env_int("MESHJOB_OPERATOR_METRICS_PORT", OPERATOR_METRICS_PORT)
    )
    webhook: bool = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK", "1") != "0")
    webhook_addr: str = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK_ADDR", "0.0.0.0"))
    webhook_port: int = field(default_factory=lambda: _env_int("MESHJOB_OPERATOR_WEBHOOK_PORT", 9443) or 9443)
    webhook_host: str | None = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK_HOST"))
    # serving certificate, key and the CA the API server should trust (e.g. from cert-manager);
    # without them the operator makes a self-signed one at start-up (operator/certs.py)
    webhook_cert: str | None = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK_CERT"))
    webhook_key: str | None = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK_KEY"))
    webhook_ca: str | None = field(default_factory=lambda: os.environ.get("MESHJOB_OPERATOR_WEBHOOK_CA"))
    kubeconfig: str | None = field(default_factory=lambda: os.environ.get("KUBECONFIG") or None)
    peering: str | None = None  # set: the peering object must exist (never act alone by mistake)
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S  # planning longer: stopped, retried later (PlanningDelayed)
    plan_concurrency: int = DEFAULT_PLAN_CONCURRENCY  # jobs planned at once (the planner's pool)


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return int(raw) if raw.strip() and raw.strip() != "0" else None


@dataclass
class State:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    wakeups: Wakeups = field(default_factory=Wakeups)
    reconciler: Reconciler | None = None
    metrics_served: bool = False
    node_index: kopf.Index[str, dict[str, Any]] | None = None  # kopf's index of Nodes (filled before job handlers run)

    def cached_nodes(self) -> list[dict[str, Any]]:
        return list(self.node_index.get(NODES_KEY, [])) if self.node_index is not None else []


STATE = State()


def _job_key(namespace: str | None, name: str) -> Key:
    """(namespace, name) of a TrainingJob or its pod: both are namespaced, so kopf never passes None here."""
    assert namespace is not None, f"{name}: a namespaced resource without a namespace"
    return (namespace, name)


def _emit(body: Any, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1000])


@kopf.on.startup()
async def startup(*, settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    cfg = STATE.config
    settings.posting.level = logging.WARNING  # kopf's own log lines as Events: only problems
    settings.persistence.finalizer = "meshjob.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="meshjob.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="meshjob.io", key="last-handled-configuration"
    )
    settings.networking.error_backoffs = [1, 2, 5, 10, 20]
    settings.watching.server_timeout = 300
    if cfg.peering:
        settings.peering.mandatory = True
    server = None
    if cfg.webhook:  # no certificate to serve with: a warning and no webhook, never a crash loop
        server = webhook_server(
            addr=cfg.webhook_addr,
            port=cfg.webhook_port,
            host=cfg.webhook_host,
            cert=cfg.webhook_cert,
            key=cfg.webhook_key,
            ca=cfg.webhook_ca,
            logger=logger,
        )
    if server is not None:  # kopf registers a ValidatingWebhookConfiguration pointing at this server
        settings.admission.server = server
        settings.admission.managed = f"{names.PLURAL}.{names.GROUP}"
    else:
        settings.admission.server = NoWebhookServer()
    kube = Kube(Connection.load(cfg.kubeconfig))
    planner = Planner(cfg.plan_timeout_s, cfg.plan_concurrency)  # its own threads: none of the default executor's
    STATE.reconciler = Reconciler(
        kube=kube, metrics=STATE.metrics, emit=_emit, nodes=STATE.cached_nodes, planner=planner
    )
    await STATE.reconciler.planner.start()
    if cfg.metrics_port and not STATE.metrics_served:  # one exporter per process, even across restarts
        STATE.metrics.serve(cfg.metrics_port)
        STATE.metrics_served = True
        logger.info(f"metrics on :{cfg.metrics_port}/metrics")


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if STATE.reconciler is not None:
        STATE.reconciler.planner.close()
        await STATE.reconciler.kube.close()
        await STATE.reconciler.scraper.close()


@kopf.on.create(names.GROUP, names.VERSION, names.PLURAL)
@kopf.on.update(names.GROUP, names.VERSION, names.PLURAL, field="spec")
@kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL)
async def check_spec(*, body: kopf.Body, patch: kopf.Patch, namespace: str | None, name: str, **_: Any) -> None:
    """Invalid spec: condition Failed/InvalidSpec, a Warning Event, and no retries."""
    key = _job_key(namespace, name)
    try:
        await asyncio.to_thread(validate, body, await _reconciler().pod_security(key[0]))
    except SpecError as err:
        now = datetime.datetime.now(datetime.timezone.utc)
        patch.status.update(invalid_status(body.get("status") or {}, err, now))
        kopf.warn(body, reason="InvalidSpec", message=str(err)[:1000])
        raise kopf.PermanentError(f"invalid spec: {err}") from err
    STATE.wakeups.wake(key)


def _reconciler() -> Reconciler:
    assert STATE.reconciler is not None, "startup() creates the reconciler"
    return STATE.reconciler


class NoWebhookServer:
    """Admission switched off: serves nothing (kopf insists on a server once a handler exists)."""

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield  # pragma: no cover  (never reached: an async generator that only waits)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The operator's kubeconfig (--kubeconfig, $KUBECONFIG) or in-cluster account, read at login time."""
    return kopf_connection(STATE.config.kubeconfig)


# Creating a TrainingJob is creating pods: with its image, its service account and its podTemplate. So the
# requester must be allowed to create pods in the namespace (a SubjectAccessReview), as Kubeflow and JobSet
# users expect; with that right Kubernetes lets anyone name any ServiceAccount of the namespace in a pod, and
# so may they here. failurePolicy Fail, and persistent (kopf leaves it registered when the operator
# stops): while the operator is down no job can be created (none would run anyway), so none gets past.
@kopf.on.validate(
    names.GROUP, names.VERSION, names.PLURAL, operations=["CREATE"], ignore_failures=False, persistent=True
)
async def authorize(*, body: kopf.Body, userinfo: kopf.UserInfo, **_: Any) -> None:
    """The admission webhook's check that creating this job is no way around RBAC."""
    await _check_requester(body, userinfo)


async def _check_requester(body: kopf.Body, userinfo: Mapping[str, Any]) -> None:
    namespace = body.get("metadata", {}).get("namespace") or "default"
    reconciler = STATE.reconciler
    assert reconciler is not None, "startup() creates the reconciler"
    try:
        allowed, reason = await reconciler.kube.may_create_pods(userinfo or {}, namespace)
    except ApiError as err:
        raise kopf.AdmissionError(f"cannot check the requester's right to create pods: {err}", code=500) from err
    if not allowed:
        who = (userinfo or {}).get("username") or "the requester"
        raise kopf.AdmissionError(
            f"{who} may not create pods in namespace {namespace}{f' ({reason})' if reason else ''}: a TrainingJob "
            "runs pods with its image, service account and podTemplate, so creating or editing one needs that "
            "right too",
            code=403,
        )


# Edits of a job's spec are checked like creation (the requester may create pods). failurePolicy Fail and
# persistent, as `authorize` (and Kubeflow's, JobSet's, Kueue's webhooks): an edit made while the operator is
# down is refused, not run unchecked later, since managedFields name a client, never a user, to re-check.
# Deletes and status writes (a subresource) are not matched, so jobs still finish and go; other updates wait
# for the operator (after uninstalling it, delete the configuration before removing finalizers by hand).
@kopf.on.validate(
    names.GROUP, names.VERSION, names.PLURAL, operations=["CREATE", "UPDATE"], ignore_failures=False, persistent=True
)
async def admit(*, body: kopf.Body, userinfo: kopf.UserInfo, **kwargs: Any) -> None:
    """The admission webhook: `kubectl apply` itself shows what is wrong with the spec, and refuses an
    edit of a started job beside spec.runPolicy (the operator refuses it too, should the webhook be off).

    Updates that leave the spec alone (finalizers, annotations) always pass: a job that is invalid
    already must still be deletable."""
    operation: str | None = kwargs.get("operation")  # kopf passes these two beside its WebhookFn's arguments
    old: kopf.Body | None = kwargs.get("old")
    if operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec"):
        return
    namespace = body.get("metadata", {}).get("namespace") or "default"
    try:  # the namespace's Pod Security level as it is now: a label just set applies at once
        level = await _reconciler().pod_security(namespace, max_age_s=0)
    except ApiError as err:
        raise kopf.AdmissionError(f"cannot read namespace {namespace}'s Pod Security level: {err}", code=500) from err
    try:  # bounded (the spec's limits), but off the event loop all the same
        job = await asyncio.to_thread(validate, body, level)
    except SpecError as err:
        raise kopf.AdmissionError(f"invalid TrainingJob: {err}", code=422) from err
    if operation != "UPDATE" or old is None:
        return
    await _check_requester(body, userinfo)
    if is_true((old.get("status") or {}).get("conditions") or [], "Created"):
        # (the old spec as it was: a level tightened since must not stop the edit that fixes it)
        changed = immutable_changes(job_to_dict(validate(old, PRIVILEGED))["spec"], job_to_dict(job)["spec"])
        if changed:
            raise kopf.AdmissionError(
                f"{', '.join(changed)} cannot change once the job has started (spec.runPolicy "
                "can): delete and re-create the job to change them",
                code=422,
            )


@kopf.daemon(names.GROUP, names.VERSION, names.PLURAL, cancellation_timeout=2.0)
async def run_job(
    *,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """The job's reconcile loop. It never stops on an API error: errors that pass by themselves are
    retried with backoff; the others also show as condition Blocked, an Event and a metric."""
    STATE.node_index = kwargs["node_index"]  # kopf passes each index by its name, beside its DaemonFn's arguments
    key = _job_key(namespace, name)
    wakeup = STATE.wakeups.register(key)
    reconciler = STATE.reconciler
    assert reconciler is not None, "startup() creates the reconciler"
    failures = 0
    try:
        while not stopped:
            wakeup.clear()
            try:
                recheck = await reconciler.reconcile(*key)
                failures = 0
            except ApiError as err:
                failures += 1
                recheck = backoff_s(failures)
                logger.warning(f"{err}; retrying in {recheck:.0f} s")
                if not err.temporary:
                    await _report_blocked(reconciler, *key, err, logger)
            if key in reconciler.unschedulable:
                STATE.wakeups.waiting_for_nodes.add(key)
            else:
                STATE.wakeups.waiting_for_nodes.discard(key)
            timeout = RESYNC_S if recheck is None else max(0.05, min(RESYNC_S, recheck))
            await wait_any(wakeup, stopped, timeout)
    finally:  # kopf stops the loop when the job is deleted (before its finalizer goes): its series go with it
        reconciler.forget(*key)
        STATE.wakeups.unregister(key)


def backoff_s(failures: int) -> float:
    """1, 2, 4, ... seconds after consecutive failures, at most MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, 2.0 ** (failures - 1))


async def _report_blocked(
    reconciler: Reconciler, namespace: str, name: str, err: ApiError, logger: kopf.Logger
) -> None:
    try:
        await reconciler.blocked(namespace, name, err)
    except ApiError as again:  # even the status write is refused: the log is all that is left
        logger.error(f"cannot report {err} on the job: {again}")


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL)
def job_event(*, body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    """Spec changes (suspend, resume, ...) wake the loop; our own status writes do not."""
    observed = (body.get("status") or {}).get("observedGeneration")
    if observed != body.get("metadata", {}).get("generation"):
        STATE.wakeups.wake(_job_key(namespace, name))


@kopf.on.event("", "v1", "pods", labels={names.JOB_LABEL: kopf.PRESENT})
def pod_event(*, body: kopf.Body, namespace: str | None, type: str | None, **_: Any) -> None:
    STATE.wakeups.wake(_job_key(namespace, body["metadata"]["labels"][names.JOB_LABEL]))
    if type == "DELETED" or (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        STATE.wakeups.wake_waiting_for_nodes()  # its devices are free: jobs waiting for room try again


@kopf.index("", "v1", "nodes")
def node_index(*, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    """A watch-fed cache of what placement reads from Nodes (kopf fills it before job handlers start)."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return {
        NODES_KEY: {
            "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"unschedulable": bool(spec.get("unschedulable")), "taints": list(spec.get("taints") or [])},
            "status": {
                "allocatable": dict(status.get("allocatable") or {}),
                "conditions": [
                    {"type": c.get("type"), "status": c.get("status")} for c in status.get("conditions") or []
                ],
            },
        }
    }


@kopf.on.event("", "v1", "nodes")
def node_event(**kwargs: Any) -> None:
    STATE.node_index = kwargs["node_index"]  # kopf passes each index by its name, beside its WatchingFn's arguments
    STATE.wakeups.wake_waiting_for_nodes()
