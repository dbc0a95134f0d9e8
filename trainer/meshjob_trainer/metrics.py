"""The Prometheus exporter of one trainer process (prometheus-client): a listener of its events.

Every event's METRICS (meshjob_trainer.events) say what it records; this module knows no event kind.
Names carry the `meshjob_` prefix and their unit; counters end in `_total`. Labels stay
low-cardinality: job, stage, strategy, scope, boundary, host, balancer. A process is told apart
from its peers by the scrape target (pod / port), not by a rank label, so the series count does not
grow with the number of devices.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from meshjob.spec.api import TRAINER_METRICS_PORT
from meshjob_trainer.events import STANDARD_EVENTS, Event, Metric

DEFAULT_PORT = TRAINER_METRICS_PORT
Series = Counter | Gauge | Histogram
_RECORD: dict[str, Callable[[Any, float], None]] = {  # how each kind of series takes a value (by its kind)
    "counter": lambda series, value: series.inc(value),
    "gauge": lambda series, value: series.set(value),
    "histogram": lambda series, value: series.observe(value),
}


def _forget_server_in_child(metrics: TrainerMetrics) -> Callable[[], None]:
    """An at-fork hook that holds `metrics` weakly, so registering it keeps nothing alive."""
    ref = weakref.ref(metrics)

    def hook() -> None:
        m = ref()
        if m is not None:
            m.forget_server()

    return hook


@dataclass
class TrainerMetrics:
    """The metrics of one trainer process; `registry` defaults to a fresh private one."""

    job: str  # the TrainingJob: label `trainingjob` (Prometheus keeps `job` for its scrape job)
    rank: int
    host: str
    stage: int
    namespace: str = "default"  # the TrainingJob's: same-named jobs of two namespaces stay apart
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _server: WSGIServer | None = field(default=None, init=False, repr=False)
    _series: dict[str, tuple[Metric, Series]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.info = Info(
            "meshjob",
            "Job configuration: strategy, schedule, balancer, mesh shapes",
            ["trainingjob", "namespace", "stage"],
            registry=self.registry,
        )
        for kind in STANDARD_EVENTS:
            for metric in kind.METRICS:
                self._declare(metric)

    def _declare(self, metric: Metric) -> Series:
        """The series of `metric`, created on first use (resharding threads emit concurrently)."""
        with self._lock:
            known = self._series.get(metric.name)
            if known is not None:
                if known[0] != metric:
                    raise ValueError(f"metric {metric.name} is declared twice, differently: {known[0]} and {metric}")
                return known[1]
            labels = ["trainingjob", "namespace", *metric.labels]
            series: Series
            if metric.kind == "counter":
                series = Counter(metric.name, metric.help, labels, registry=self.registry)
            elif metric.kind == "gauge":
                series = Gauge(metric.name, metric.help, labels, registry=self.registry)
            else:
                series = Histogram(metric.name, metric.help, labels, buckets=metric.buckets, registry=self.registry)
            self._series[metric.name] = (metric, series)
            return series

    def emit(self, event: Event) -> None:
        """Record `event` in every series its kind declares."""
        for metric in type(event).METRICS:
            value = getattr(event, metric.value)
            if isinstance(value, float) and math.isnan(value):
                continue  # "none here", e.g. the loss of a stage that computes none
            labels = {name: str(getattr(event, name)) for name in metric.labels}
            _RECORD[metric.kind](
                self._declare(metric).labels(trainingjob=self.job, namespace=self.namespace, **labels), value
            )

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
        self.info.labels(trainingjob=self.job, namespace=self.namespace, stage=str(self.stage)).info(
            {
                "strategy": strategy,
                "schedule": schedule,
                "balancer": balancer,
                "meshes": meshes,
                "rank": str(self.rank),
                "host": self.host,
            }
        )
