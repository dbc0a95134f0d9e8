"""Progress on the trainer's own pod: annotations meshjob.io/step and meshjob.io/checkpoint-step.

The operator (and `kubectl get pod -o yaml`) can read a rank's progress without scraping it.
A listener of the trainer's events (meshjob_trainer.events). Active only inside a pod (the
operator's MESHJOB_POD_NAME, in WorkerSettings, and in-cluster credentials mounted); a no-op
otherwise. `kubernetes` is imported lazily so a trainer outside Kubernetes never needs it.
Reporting must never stop training: failures are logged once and swallowed. Step updates are
rate-limited (one PATCH per `min_interval_s`); checkpoint updates always go out.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from meshjob.api import CHECKPOINT_ANNOTATION, STEP_ANNOTATION
from meshjob_trainer.dist import WorkerSettings
from meshjob_trainer.events import CheckpointRestored, CheckpointWritten, Event, StepFinished

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
log = logging.getLogger(__name__)


@dataclass
class PodStatus:
    pod_name: str = ""
    namespace: str = "default"
    api: Any = None  # kubernetes.client.CoreV1Api; None: reporting is off
    min_interval_s: float = 5.0
    request_timeout_s: float = 5.0
    _last_patch: float = field(default=-1e18, init=False)
    _last_step: int | None = field(default=None, init=False)
    _failed: bool = field(default=False, init=False)

    @property
    def enabled(self) -> bool:
        return bool(self.pod_name) and self.api is not None

    @classmethod
    def in_pod(cls, settings: WorkerSettings, service_account: str = SERVICE_ACCOUNT) -> PodStatus:
        """Reporting on in a pod (the operator sets MESHJOB_POD_NAME) with mounted credentials; off
        (silently) anywhere else."""
        token = os.path.join(service_account, "token")
        if not settings.pod_name or not os.path.exists(token):
            return cls()
        namespace = settings.namespace
        if not namespace:
            try:
                with open(os.path.join(service_account, "namespace")) as f:
                    namespace = f.read().strip()
            except OSError:
                namespace = "default"
        try:
            from kubernetes import client, config

            config.load_incluster_config()  # reads the API server's address from the pod's environment itself
            return cls(pod_name=settings.pod_name, namespace=namespace, api=client.CoreV1Api())
        except Exception as err:  # noqa: BLE001 - no client library, not in a cluster, bad credentials
            log.warning("pod status reporting off: %s: %s", type(err).__name__, err)
            return cls()

    @functools.singledispatchmethod
    def emit(self, event: Event) -> None:
        """A listener of the trainer's events: steps and checkpoints become annotations, others are ignored."""

    @emit.register
    def _step_finished(self, event: StepFinished) -> None:
        self.step(event.step)

    @emit.register
    def _checkpoint_written(self, event: CheckpointWritten) -> None:
        self.checkpoint(event.step)

    @emit.register
    def _checkpoint_restored(self, event: CheckpointRestored) -> None:
        self.checkpoint(event.step)

    def step(self, step: int) -> None:
        """Training finished `step` steps (rate-limited)."""
        self._last_step = step
        if time.monotonic() - self._last_patch >= self.min_interval_s:
            self._patch({STEP_ANNOTATION: str(step)})

    def checkpoint(self, step: int) -> None:
        """A checkpoint of `step` was written or restored (always sent, with the latest step)."""
        annotations = {CHECKPOINT_ANNOTATION: str(step)}
        if self._last_step is not None:
            annotations[STEP_ANNOTATION] = str(self._last_step)
        self._patch(annotations)

    def flush(self) -> None:
        """Send the latest step regardless of the rate limit (end of training)."""
        if self._last_step is not None:
            self._patch({STEP_ANNOTATION: str(self._last_step)})

    def _patch(self, annotations: dict[str, str]) -> None:
        if not self.enabled:
            return
        self._last_patch = time.monotonic()
        try:
            self.api.patch_namespaced_pod(self.pod_name, self.namespace, {"metadata": {"annotations": annotations}},
                                          _request_timeout=self.request_timeout_s)
        except Exception as err:  # noqa: BLE001 - never crash training over a progress note
            if not self._failed:
                log.warning("could not annotate pod %s/%s (%s: %s); training goes on", self.namespace,
                            self.pod_name, type(err).__name__, err)
            self._failed = True
