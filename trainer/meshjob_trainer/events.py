"""The trainer's typed events, the metrics each feeds, and the one interface they travel through.

The training loop, the resharding executor and the checkpoints emit events (frozen dataclasses)
to one MetricsSink. Its listeners: the Prometheus exporter (metrics.TrainerMetrics), the pod's log line
per step (steplog.StepLog) and, under `meshjob run`, the launcher's event pipe, whose far end
aggregates them for the progress bar and summary (emulate.progress.RunStats) and exports them
again on the run's own /metrics (commands.run.MetricsFeed). Nothing is monkeypatched and nothing is
decoded by hand: the pipe pickles whole events, and every exporter records any event the same way.

Adding a metric is one registration: an Event subclass whose METRICS declare the series it feeds,
with its labels and value read from the event's fields. Exporters create the series of the events
below when they start (dashboards see them before the first event) and any other event kind's when
it first arrives. Validation lives in the events: a bad value is a trainer bug, better a ValueError
that names the field, the value and what is allowed than a silent NaN on a dashboard.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar, Protocol

from meshjob.resharding.strategies import STRATEGIES
from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST
from meshjob.schedule.boundary import BoundaryKey

METRIC_KINDS = ("counter", "gauge", "histogram")
SCOPES = (INTRA_HOST, CROSS_HOST)
# Resharding of one boundary runs from about a millisecond (a local hop) to tens of seconds.
RESHARDING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class Metric:
    """One Prometheus series fed by an event: counters add `value`, gauges are set to it, histograms
    observe it; a NaN value records nothing. Labels are event fields (the exporter adds `trainingjob` and
    `namespace`)."""

    name: str  # meshjob_ prefix and the unit; counters end in _total
    help: str
    kind: str  # one of METRIC_KINDS
    value: str  # the event field recorded
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only

    def __post_init__(self) -> None:
        if self.kind not in METRIC_KINDS:
            raise ValueError(f"metric {self.name}: kind={self.kind!r}: must be one of {', '.join(METRIC_KINDS)}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"metric {self.name}: buckets are required for histograms and only for them")


class Event:
    """Base of the trainer's events; a subclass (a frozen dataclass) lists the metrics it feeds."""

    METRICS: ClassVar[tuple[Metric, ...]] = ()


class MetricsSink(Protocol):
    def emit(self, event: Event) -> None: ...


@dataclass(frozen=True)
class Fanout:
    """One sink that hands every event to several listeners, in order."""

    sinks: tuple[MetricsSink, ...] = ()

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)


def non_negative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a number >= 0")


def fraction(name: str, value: float) -> None:
    non_negative(name, value)
    if value > 1.0:
        raise ValueError(f"{name}={value!r}: must be a fraction in [0, 1]")


def one_of(name: str, value: str, allowed: Collection[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(allowed)}")


def _finite_or_nan(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isinf(value):
        raise ValueError(f"{name}={value!r}: must be a finite number (or nan for 'no loss on this stage')")


def _boundary(value: BoundaryKey) -> None:
    if not isinstance(value, BoundaryKey):
        raise ValueError(f"boundary={value!r}: must be a BoundaryKey, e.g. BoundaryKey(0, 1, 'activation')")


LAST_CHECKPOINT_STEP = Metric(
    "meshjob_last_checkpoint_step", "Step of the newest checkpoint written or restored", "gauge", "step", ("stage",)
)


@dataclass(frozen=True)
class StepFinished(Event):
    """One training step done on a rank: wall time, tokens of the global batch, loss, step number."""

    METRICS = (
        Metric(
            "meshjob_step_seconds", "Wall time of one training step", "histogram", "seconds", ("stage",), STEP_BUCKETS
        ),
        Metric(
            "meshjob_tokens_total",
            "Tokens of the global batch trained (same on every rank)",
            "counter",
            "tokens",
            ("stage",),
        ),
        Metric("meshjob_loss", "Training loss of the last step", "gauge", "loss", ("stage",)),
        Metric("meshjob_step", "Last completed training step", "gauge", "step", ("stage",)),
    )
    stage: int
    step: int  # steps done, counting those a resumed checkpoint holds
    seconds: float
    tokens: int
    loss: float  # NaN: this stage computes no loss

    def __post_init__(self) -> None:
        non_negative("seconds", self.seconds)
        non_negative("tokens", self.tokens)
        non_negative("step", self.step)
        _finite_or_nan("loss", self.loss)


@dataclass(frozen=True)
class Evaluated(Event):
    """The validation loss after `step` steps (spec.training.evalEvery): NaN off the last stage."""

    METRICS = (
        Metric(
            "meshjob_validation_loss",
            "Loss on the validation data (spec.data.valPath), last evaluation",
            "gauge",
            "loss",
            ("stage",),
        ),
    )
    stage: int
    step: int
    loss: float

    def __post_init__(self) -> None:
        non_negative("step", self.step)
        _finite_or_nan("loss", self.loss)


@dataclass(frozen=True)
class GradientNorm(Event):
    """The global gradient norm of a step, before clipping (spec.training.gradClip), over every stage and rank."""

    METRICS = (
        Metric(
            "meshjob_gradient_norm",
            "Global gradient norm of the last step, before clipping",
            "gauge",
            "norm",
            ("stage",),
        ),
    )
    stage: int
    step: int
    norm: float

    def __post_init__(self) -> None:
        non_negative("step", self.step)
        non_negative("norm", self.norm)


@dataclass(frozen=True)
class Resharded(Event):
    """One resharding of a boundary as one receiver saw it, per scope: bytes received and wall time."""

    METRICS = (
        Metric(
            "meshjob_resharding_bytes_total",
            "Bytes received by cross-mesh resharding",
            "counter",
            "nbytes",
            ("strategy", "scope", "boundary"),
        ),
        Metric(
            "meshjob_resharding_seconds",
            "Wall time of one cross-mesh resharding of a boundary",
            "histogram",
            "seconds",
            ("strategy", "scope", "boundary"),
            RESHARDING_BUCKETS,
        ),
    )
    boundary: BoundaryKey
    strategy: str
    scope: str
    nbytes: int
    seconds: float

    def __post_init__(self) -> None:
        _boundary(self.boundary)
        one_of("strategy", self.strategy, STRATEGIES)
        one_of("scope", self.scope, SCOPES)
        non_negative("nbytes", self.nbytes)
        non_negative("seconds", self.seconds)


@dataclass(frozen=True)
class NicBandwidth(Event):
    """Achieved rate of a host's NIC while a rank there received cross-host bytes."""

    METRICS = (
        Metric(
            "meshjob_nic_bandwidth_bytes_per_second",
            "Achieved NIC bandwidth of a host while resharding",
            "gauge",
            "bytes_per_second",
            ("host",),
        ),
    )
    host: str  # the host's name in the plan
    bytes_per_second: float

    def __post_init__(self) -> None:
        non_negative("bytes_per_second", self.bytes_per_second)


@dataclass(frozen=True)
class LowerBoundRatio(Event):
    """A boundary's last resharding time over its lower bound (1 is optimal)."""

    METRICS = (
        Metric(
            "meshjob_resharding_lower_bound_ratio",
            "Last resharding time of a boundary over its lower bound (1 is optimal)",
            "gauge",
            "ratio",
            ("boundary",),
        ),
    )
    boundary: BoundaryKey
    ratio: float

    def __post_init__(self) -> None:
        _boundary(self.boundary)
        non_negative("ratio", self.ratio)


@dataclass(frozen=True)
class UnitTasks(Event):
    """Unit tasks a chosen sender started, by the balancer that chose it."""

    METRICS = (
        Metric(
            "meshjob_unit_tasks_total",
            "Resharding unit tasks executed, by sender balancer",
            "counter",
            "count",
            ("balancer",),
        ),
    )
    balancer: str
    count: int

    def __post_init__(self) -> None:
        non_negative("count", self.count)


@dataclass(frozen=True)
class PipelineFractions(Event):
    """A stage's step: idle share of its time, and the share of its communication hidden behind compute."""

    METRICS = (
        Metric(
            "meshjob_pipeline_bubble_fraction", "Idle fraction of a stage's step time", "gauge", "bubble", ("stage",)
        ),
        Metric(
            "meshjob_pipeline_overlap_fraction",
            "Fraction of communication time hidden behind compute",
            "gauge",
            "overlap",
            ("stage",),
        ),
    )
    stage: int
    bubble: float
    overlap: float

    def __post_init__(self) -> None:
        fraction("bubble", self.bubble)
        fraction("overlap", self.overlap)


@dataclass(frozen=True)
class PayloadMemory(Event):
    """The most memory a rank's communication engine held for payloads in flight during one step
    (receive buffers, staging copies), and the bound the plan puts on it."""

    METRICS = (
        Metric(
            "meshjob_comm_payload_peak_bytes",
            "Most bytes of in-flight payload buffers a rank's communication engine held during the last step",
            "gauge",
            "peak_bytes",
            ("stage",),
        ),
        Metric(
            "meshjob_comm_payload_bound_bytes",
            "Bound on those bytes from the plan (receives posted ahead per "
            "boundary, staging copies per send in flight)",
            "gauge",
            "bound_bytes",
            ("stage",),
        ),
    )
    stage: int
    peak_bytes: int
    bound_bytes: int

    def __post_init__(self) -> None:
        non_negative("peak_bytes", self.peak_bytes)
        non_negative("bound_bytes", self.bound_bytes)


@dataclass(frozen=True)
class WeightDelay(Event):
    """The weight-gradient delay a stage runs with, the per-microbatch costs that sized it (measured at
    the start of the run, or the planner's formula) and the peak stash it leads to."""

    METRICS = (
        Metric(
            "meshjob_weight_grad_delay_microbatches",
            "Weight gradients a stage delays behind later input gradients (spec.schedule.weightGradDelay)",
            "gauge",
            "delay",
            ("stage",),
        ),
        Metric(
            "meshjob_stash_peak_microbatches",
            "Most microbatches a stage's action list keeps stashed at once",
            "gauge",
            "peak_stash",
            ("stage",),
        ),
    )
    stage: int
    delay: int
    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    peak_stash: int
    stash_bound: int  # eager-1F1B's stage-0 bound min(M, 2S - 1)
    measured: bool  # costs profiled at the start of this run (weightGradDelay: auto)

    def __post_init__(self) -> None:
        for name in ("delay", "forward_s", "input_grad_s", "weight_grad_s", "peak_stash", "stash_bound"):
            non_negative(name, getattr(self, name))


@dataclass(frozen=True)
class CheckpointWritten(Event):
    METRICS = (
        Metric(
            "meshjob_checkpoint_seconds",
            "Wall time of writing one checkpoint",
            "histogram",
            "seconds",
            ("stage",),
            CHECKPOINT_BUCKETS,
        ),
        LAST_CHECKPOINT_STEP,
    )
    stage: int
    step: int
    seconds: float

    def __post_init__(self) -> None:
        non_negative("step", self.step)
        non_negative("seconds", self.seconds)


@dataclass(frozen=True)
class CheckpointRestored(Event):
    """Training resumes after the checkpoint of `step`."""

    METRICS = (LAST_CHECKPOINT_STEP,)
    stage: int
    step: int

    def __post_init__(self) -> None:
        non_negative("step", self.step)


# Exporters create these events' series when they start; the list is derived, not kept by hand.
STANDARD_EVENTS: tuple[type[Event], ...] = tuple(k for k in Event.__subclasses__() if k.__module__ == __name__)
