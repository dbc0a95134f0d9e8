"""Operator metrics (prometheus-client), served on --metrics-port."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from meshjob_operator.lifecycle import DISRUPTION, FAILURE
from meshjob_operator.status import PHASES

RESTART_REASONS = (FAILURE, DISRUPTION)


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _phases: dict[tuple[str, str], str] = field(default_factory=dict)
    _error_codes: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # api_errors series of each job

    def __post_init__(self) -> None:
        self.jobs = Gauge(
            "meshjob_operator_jobs", "TrainingJobs known to the operator, by phase", ["phase"], registry=self.registry
        )
        self.reconcile_duration = Histogram(
            "meshjob_operator_reconcile_duration_seconds",
            "Time of one reconcile of one TrainingJob",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.restarts = Counter(
            "meshjob_operator_restarts_total",
            "Gang restarts of TrainingJobs, by reason: failure (counts toward backoffLimit) or "
            "disruption (an eviction, preemption or deletion by someone else)",
            ["namespace", "trainingjob", "reason"],
            registry=self.registry,
        )
        self.pod_creation_latency = Histogram(
            "meshjob_operator_pod_creation_latency_seconds",
            "From the reconcile deciding a host pod is missing to the API server accepting it",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.api_errors = Counter(
            "meshjob_operator_api_errors_total",
            "API calls for a TrainingJob refused for a reason that does not pass by itself (quota, admission "
            "policy, RBAC, an invalid child): the job is Blocked until the next attempt succeeds",
            ["namespace", "trainingjob", "code"],
            registry=self.registry,
        )
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def api_error(self, namespace: str, name: str, code: int) -> None:
        """Count a refused API call of a job (its series goes when the job does)."""
        self._error_codes.setdefault((namespace, name), set()).add(str(code))
        self.api_errors.labels(namespace=namespace, trainingjob=name, code=str(code)).inc()

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a job's phase (None: the job is gone: every series naming it goes too, so no alert fires
        for a job that no longer exists) and refresh the per-phase gauge."""
        key = (namespace, name)
        if phase is None:
            self._phases.pop(key, None)
            gone = [(self.restarts, reason) for reason in RESTART_REASONS]
            gone += [(self.api_errors, code) for code in self._error_codes.pop(key, set())]
            for metric, label in gone:
                with contextlib.suppress(KeyError):  # a series never made (older prometheus-client raise)
                    metric.remove(namespace, name, label)
        else:
            if key not in self._phases:  # series from 0, so that increase() counts a job's first restart
                for reason in RESTART_REASONS:
                    self.restarts.labels(namespace=namespace, trainingjob=name, reason=reason)
            self._phases[key] = phase
        counts = {p: 0 for p in PHASES}
        for value in self._phases.values():
            counts[value] = counts.get(value, 0) + 1
        for p, n in counts.items():
            self.jobs.labels(phase=p).set(n)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
