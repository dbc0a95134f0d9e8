"""Prometheus metrics of one trainer process (prometheus-client).

Names carry the `meshjob_` prefix and their unit; counters end in `_total`. Labels stay
low-cardinality: job, stage, strategy, scope, boundary, host, balancer. A process is told
apart from its peers by the scrape target (pod / port), not by a rank label, so the series
count does not grow with the number of devices.

Every `record_*` call validates its input and raises ValueError naming the argument, the
value and what is allowed: a bad metric value is a trainer bug, better loud than a silent
NaN on a dashboard.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from meshjob.api import TRAINER_METRICS_PORT
from meshjob.boundary import BoundaryKey
from meshjob.resharding import STRATEGIES

DEFAULT_PORT = TRAINER_METRICS_PORT
SCOPES = ("intra_host", "cross_host")

# Resharding of one boundary runs from about a millisecond (a local hop) to tens of seconds.
RESHARDING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def _non_negative(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a number >= 0")
    return float(value)


def _fraction(name: str, value: float) -> float:
    value = _non_negative(name, value)
    if value > 1.0:
        raise ValueError(f"{name}={value!r}: must be a fraction in [0, 1]")
    return value


def _forget_server_in_child(metrics: "TrainerMetrics") -> "Callable[[], None]":
    """An at-fork hook that holds `metrics` weakly, so registering it keeps nothing alive."""
    ref = weakref.ref(metrics)

    def hook() -> None:
        m = ref()
        if m is not None:
            m.forget_server()

    return hook


def _boundary(value: BoundaryKey | str) -> str:
    """The label of a boundary: its key's text, which names the tensor and the direction."""
    if isinstance(value, BoundaryKey):
        return str(value)
    try:
        return str(BoundaryKey.parse(value))
    except ValueError:
        raise ValueError(f"boundary={value!r}: must be a BoundaryKey or its text, e.g. '0->1:activation' "
                         f"or '1->0:grad:activation'") from None


@dataclass
class TrainerMetrics:
    """The metrics of one trainer process; `registry` defaults to a fresh private one."""

    job: str
    rank: int
    host: str
    stage: int
    registry: CollectorRegistry | None = None
    _server: WSGIServer | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.registry is None:
            self.registry = CollectorRegistry()
        r = self.registry
        self.info = Info("meshjob", "Job configuration: strategy, schedule, balancer, mesh shapes",
                         ["job", "stage"], registry=r)
        self.resharding_bytes = Counter(
            "meshjob_resharding_bytes_total", "Bytes received by cross-mesh resharding",
            ["job", "strategy", "scope", "boundary"], registry=r)
        self.resharding_seconds = Histogram(
            "meshjob_resharding_seconds", "Wall time of one cross-mesh resharding of a boundary",
            ["job", "strategy", "scope", "boundary"], buckets=RESHARDING_BUCKETS, registry=r)
        self.nic_bandwidth = Gauge(
            "meshjob_nic_bandwidth_bytes_per_second", "Achieved NIC bandwidth of a host while resharding",
            ["job", "host"], registry=r)
        self.unit_tasks = Counter(
            "meshjob_unit_tasks_total", "Resharding unit tasks executed, by sender balancer",
            ["job", "balancer"], registry=r)
        self.lower_bound_ratio = Gauge(
            "meshjob_resharding_lower_bound_ratio",
            "Last resharding time of a boundary over its lower bound (1 is optimal)",
            ["job", "boundary"], registry=r)
        self.step_seconds = Histogram(
            "meshjob_step_seconds", "Wall time of one training step", ["job", "stage"],
            buckets=STEP_BUCKETS, registry=r)
        self.tokens = Counter(
            "meshjob_tokens_total", "Tokens of the global batch trained (same on every rank)",
            ["job", "stage"], registry=r)
        self.loss = Gauge("meshjob_loss", "Training loss of the last step", ["job", "stage"], registry=r)
        self.step = Gauge("meshjob_step", "Last completed training step", ["job", "stage"], registry=r)
        self.bubble = Gauge(
            "meshjob_pipeline_bubble_fraction", "Idle fraction of a stage's step time",
            ["job", "stage"], registry=r)
        self.overlap = Gauge(
            "meshjob_pipeline_overlap_fraction", "Fraction of communication time hidden behind compute",
            ["job", "stage"], registry=r)
        self.checkpoint_seconds = Histogram(
            "meshjob_checkpoint_seconds", "Wall time of writing one checkpoint", ["job", "stage"],
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.last_checkpoint_step = Gauge(
            "meshjob_last_checkpoint_step", "Step of the last checkpoint written", ["job", "stage"], registry=r)

    @property
    def _stage(self) -> str:
        return str(self.stage)

    def serve(self, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on a daemon thread; returns the bound port (useful with port 0)."""
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r}: must be an integer in [0, 65535]")
        if self._server is not None:
            raise RuntimeError(f"metrics already served on port {self._server.server_port}")
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        os.register_at_fork(after_in_child=_forget_server_in_child(self))
        return int(self._server.server_port)

    def forget_server(self) -> None:
        """In a forked child: close the inherited copy of the listening socket and forget the server.

        A child must not keep the parent's port bound (it would outlive the parent's close()), and
        must not call shutdown(): the serving thread was not forked, so shutdown() would wait forever."""
        if self._server is not None:
            self._server.socket.close()
            self._server = None

    def close(self) -> None:
        """Stop the HTTP server started by serve() (no-op when none runs)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set_info(self, strategy: str, schedule: str, balancer: str, meshes: str) -> None:
        """meshes: the stages' mesh shapes, e.g. '1x2,2x1'."""
        self.info.labels(job=self.job, stage=self._stage).info(
            {"strategy": strategy, "schedule": schedule, "balancer": balancer, "meshes": meshes,
             "rank": str(self.rank), "host": self.host})

    def record_resharding(self, strategy: str, scope: str, boundary: BoundaryKey | str, nbytes: int,
                          seconds: float) -> None:
        """One resharding of `boundary` as seen by this receiver: bytes received and wall time."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: must be one of {', '.join(STRATEGIES)}")
        if scope not in SCOPES:
            raise ValueError(f"scope={scope!r}: must be one of {', '.join(SCOPES)}")
        labels = dict(job=self.job, strategy=strategy, scope=scope, boundary=_boundary(boundary))
        self.resharding_bytes.labels(**labels).inc(_non_negative("nbytes", nbytes))
        self.resharding_seconds.labels(**labels).observe(_non_negative("seconds", seconds))

    def record_nic(self, host: str, bytes_per_second: float) -> None:
        self.nic_bandwidth.labels(job=self.job, host=host).set(_non_negative("bytes_per_second", bytes_per_second))

    def record_unit_tasks(self, balancer: str, count: int) -> None:
        self.unit_tasks.labels(job=self.job, balancer=balancer).inc(_non_negative("count", count))

    def record_resharding_ratio(self, boundary: BoundaryKey | str, seconds_over_lower_bound: float) -> None:
        self.lower_bound_ratio.labels(job=self.job, boundary=_boundary(boundary)).set(
            _non_negative("seconds_over_lower_bound", seconds_over_lower_bound))

    def record_step(self, seconds: float, tokens: int, loss: float, step: int | None = None) -> None:
        """One finished step: its wall time, the tokens of the global batch, the loss (NaN allowed:
        a stage that computes no loss passes math.nan and the loss gauge is left untouched) and,
        optionally, its number (after a resume from a checkpoint); else the step gauge counts up."""
        labels = dict(job=self.job, stage=self._stage)
        self.step_seconds.labels(**labels).observe(_non_negative("seconds", seconds))
        self.tokens.labels(**labels).inc(_non_negative("tokens", tokens))
        if not (isinstance(loss, (int, float)) and math.isnan(loss)):
            if not isinstance(loss, (int, float)) or isinstance(loss, bool) or math.isinf(loss):
                raise ValueError(f"loss={loss!r}: must be a finite number (or nan for 'no loss on this stage')")
            self.loss.labels(**labels).set(loss)
        if step is None:
            self.step.labels(**labels).inc()
        else:
            self.step.labels(**labels).set(_non_negative("step", step))

    def record_pipeline(self, stage: int, bubble_fraction: float, overlap_fraction: float) -> None:
        labels = dict(job=self.job, stage=str(stage))
        self.bubble.labels(**labels).set(_fraction("bubble_fraction", bubble_fraction))
        self.overlap.labels(**labels).set(_fraction("overlap_fraction", overlap_fraction))

    def record_checkpoint(self, seconds: float, step: int) -> None:
        labels = dict(job=self.job, stage=self._stage)
        self.checkpoint_seconds.labels(**labels).observe(_non_negative("seconds", seconds))
        self.last_checkpoint_step.labels(**labels).set(_non_negative("step", step))
