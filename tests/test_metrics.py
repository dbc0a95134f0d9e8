"""The trainer's events and their Prometheus exporter: what each event records, naming conventions,
validation, serving, and a new metric added by one registration."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.events import (
    CheckpointRestored,
    CheckpointWritten,
    Evaluated,
    Event,
    Fanout,
    GradientNorm,
    LowerBoundRatio,
    Metric,
    NicBandwidth,
    PayloadMemory,
    PipelineFractions,
    Resharded,
    StepFinished,
    UnitTasks,
    WeightDelay,
)
from meshjob_trainer.metrics import TrainerMetrics

ALLOWED_LABELS = {"trainingjob", "namespace", "stage", "strategy", "scope", "boundary", "host", "balancer", "le"}
FORWARD = BoundaryKey(0, 1, "activation")


@pytest.fixture
def metrics() -> TrainerMetrics:
    return TrainerMetrics(job="gpt-demo", rank=3, host="h1", stage=1)


def value(m: TrainerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def feed_everything(m: TrainerMetrics) -> None:
    m.set_info("broadcast", "eager-1f1b", "greedy", "1x2,2x1")
    for event in (
        Resharded(FORWARD, "broadcast", "cross_host", 1000, 0.2),
        NicBandwidth("h1", 1.25e8),
        UnitTasks("greedy", 4),
        LowerBoundRatio(FORWARD, 1.1),
        StepFinished(1, 1, 0.5, 4096, 2.5),
        PipelineFractions(1, 0.25, 0.75),
        CheckpointWritten(1, 10, 0.05),
        Evaluated(1, 10, 2.75),
        GradientNorm(1, 1, 0.8),
        PayloadMemory(1, 300, 400),
        WeightDelay(1, 2, 0.01, 0.01, 0.012, 5, 7, True),
    ):
        m.emit(event)


def test_resharding_adds_bytes_and_observes_seconds_per_strategy_scope_boundary(metrics):
    metrics.emit(Resharded(FORWARD, "broadcast", "cross_host", 1000, 0.2))
    metrics.emit(Resharded(FORWARD, "broadcast", "cross_host", 500, 0.1))
    metrics.emit(Resharded(BoundaryKey(1, 2, "activation"), "send_recv", "intra_host", 7, 0.001))
    labels = dict(
        trainingjob="gpt-demo",
        namespace="default",
        strategy="broadcast",
        scope="cross_host",
        boundary="0->1:activation",
    )
    assert value(metrics, "meshjob_resharding_bytes_total", **labels) == 1500
    assert value(metrics, "meshjob_resharding_seconds_count", **labels) == 2
    assert value(metrics, "meshjob_resharding_seconds_sum", **labels) == pytest.approx(0.3)
    assert (
        value(
            metrics,
            "meshjob_resharding_bytes_total",
            trainingjob="gpt-demo",
            namespace="default",
            strategy="send_recv",
            scope="intra_host",
            boundary="1->2:activation",
        )
        == 7
    )


def test_payload_memory_sets_the_steps_peak_and_its_bound(metrics):
    metrics.emit(PayloadMemory(1, 300, 400))
    metrics.emit(PayloadMemory(1, 250, 400))
    assert (
        value(metrics, "meshjob_comm_payload_peak_bytes", trainingjob="gpt-demo", namespace="default", stage="1") == 250
    )
    assert (
        value(metrics, "meshjob_comm_payload_bound_bytes", trainingjob="gpt-demo", namespace="default", stage="1")
        == 400
    )


def test_weight_delay_sets_the_stages_delay_and_peak_stash(metrics):
    metrics.emit(WeightDelay(1, 2, 0.01, 0.01, 0.012, 5, 7, True))
    assert (
        value(metrics, "meshjob_weight_grad_delay_microbatches", trainingjob="gpt-demo", namespace="default", stage="1")
        == 2
    )
    assert (
        value(metrics, "meshjob_stash_peak_microbatches", trainingjob="gpt-demo", namespace="default", stage="1") == 5
    )


def test_step_counts_tokens_sets_loss_and_the_step(metrics):
    metrics.emit(StepFinished(1, 1, 0.5, 4096, 2.5))
    metrics.emit(StepFinished(1, 2, 0.7, 4096, 2.25))
    labels = dict(trainingjob="gpt-demo", namespace="default", stage="1")
    assert value(metrics, "meshjob_tokens_total", **labels) == 8192
    assert value(metrics, "meshjob_loss", **labels) == 2.25
    assert value(metrics, "meshjob_step", **labels) == 2
    assert value(metrics, "meshjob_step_seconds_count", **labels) == 2


def test_the_step_after_a_resume_counts_from_the_checkpoint(metrics):
    metrics.emit(StepFinished(1, 41, 0.5, 4096, 2.5))
    assert value(metrics, "meshjob_step", trainingjob="gpt-demo", namespace="default", stage="1") == 41


def test_nan_loss_means_this_stage_computes_no_loss(metrics):
    metrics.emit(StepFinished(1, 1, 0.5, 4096, math.nan))
    assert value(metrics, "meshjob_loss", trainingjob="gpt-demo", namespace="default", stage="1") is None
    assert value(metrics, "meshjob_tokens_total", trainingjob="gpt-demo", namespace="default", stage="1") == 4096


def test_validation_loss_and_gradient_norm_are_gauges_of_the_stage(metrics):
    metrics.emit(Evaluated(1, 10, 2.75))
    metrics.emit(GradientNorm(1, 10, 0.8))
    assert value(metrics, "meshjob_validation_loss", trainingjob="gpt-demo", namespace="default", stage="1") == 2.75
    assert value(metrics, "meshjob_gradient_norm", trainingjob="gpt-demo", namespace="default", stage="1") == 0.8
    metrics.emit(Evaluated(1, 20, math.nan))  # a stage without the loss records nothing
    assert value(metrics, "meshjob_validation_loss", trainingjob="gpt-demo", namespace="default", stage="1") == 2.75


def test_pipeline_fractions_are_exported_for_the_given_stage(metrics):
    metrics.emit(PipelineFractions(2, 0.25, 0.75))
    assert (
        value(metrics, "meshjob_pipeline_bubble_fraction", trainingjob="gpt-demo", namespace="default", stage="2")
        == 0.25
    )
    assert (
        value(metrics, "meshjob_pipeline_overlap_fraction", trainingjob="gpt-demo", namespace="default", stage="2")
        == 0.75
    )


def test_checkpoints_observe_seconds_and_remember_the_step_written_or_restored(metrics):
    metrics.emit(CheckpointWritten(1, 10, 0.05))
    metrics.emit(CheckpointWritten(1, 20, 0.07))
    assert value(metrics, "meshjob_last_checkpoint_step", trainingjob="gpt-demo", namespace="default", stage="1") == 20
    assert (
        value(metrics, "meshjob_checkpoint_seconds_count", trainingjob="gpt-demo", namespace="default", stage="1") == 2
    )
    metrics.emit(CheckpointRestored(1, 10))
    assert value(metrics, "meshjob_last_checkpoint_step", trainingjob="gpt-demo", namespace="default", stage="1") == 10


def test_nic_unit_tasks_and_lower_bound_ratio(metrics):
    for event in (
        NicBandwidth("h1", 1.25e8),
        UnitTasks("greedy", 4),
        UnitTasks("greedy", 2),
        LowerBoundRatio(FORWARD, 1.1),
    ):
        metrics.emit(event)
    assert (
        value(metrics, "meshjob_nic_bandwidth_bytes_per_second", trainingjob="gpt-demo", namespace="default", host="h1")
        == 1.25e8
    )
    assert (
        value(metrics, "meshjob_unit_tasks_total", trainingjob="gpt-demo", namespace="default", balancer="greedy") == 6
    )
    assert (
        value(
            metrics,
            "meshjob_resharding_lower_bound_ratio",
            trainingjob="gpt-demo",
            namespace="default",
            boundary="0->1:activation",
        )
        == 1.1
    )


def test_info_carries_strategy_schedule_balancer_and_mesh_shapes(metrics):
    metrics.set_info("broadcast", "eager-1f1b", "greedy", "1x2,2x1")
    assert (
        value(
            metrics,
            "meshjob_info",
            trainingjob="gpt-demo",
            namespace="default",
            stage="1",
            strategy="broadcast",
            schedule="eager-1f1b",
            balancer="greedy",
            meshes="1x2,2x1",
            rank="3",
            host="h1",
        )
        == 1
    )


def test_the_standard_series_exist_before_the_first_event(metrics):
    names = {f.name for f in metrics.registry.collect()}
    assert {"meshjob_step", "meshjob_resharding_bytes", "meshjob_last_checkpoint_step"} <= names


def test_names_have_prefix_and_counters_end_in_total(metrics):
    feed_everything(metrics)
    families = list(metrics.registry.collect())
    assert len(families) == 20
    unitless = {
        "meshjob_loss",
        "meshjob_step",
        "meshjob_last_checkpoint_step",
        "meshjob_validation_loss",
        "meshjob_gradient_norm",
    }
    units = ("_seconds", "_bytes_per_second", "_fraction", "_ratio", "_bytes", "_microbatches")
    for family in families:
        for sample in family.samples:
            assert sample.name.startswith("meshjob_"), sample.name
        if family.type == "counter":
            assert family.name + "_total" in {s.name for s in family.samples}, family.name
        elif family.type in ("histogram", "gauge"):
            assert family.name in unitless or family.name.endswith(units), family.name


def test_series_carry_only_low_cardinality_labels(metrics):
    feed_everything(metrics)
    for family in metrics.registry.collect():
        if family.type == "info":
            continue  # one series per process, by design
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (sample.name, sample.labels)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: Resharded(FORWARD, "magic", "cross_host", 1, 0.1), "strategy='magic'"),
        (lambda m: Resharded(FORWARD, "broadcast", "rack", 1, 0.1), "scope='rack'"),
        (lambda m: Resharded("0-1", "broadcast", "cross_host", 1, 0.1), "boundary='0-1'"),
        (lambda m: Resharded(FORWARD, "broadcast", "cross_host", -5, 0.1), "nbytes=-5"),
        (lambda m: StepFinished(0, 1, math.nan, 1, 1.0), "seconds=nan"),
        (lambda m: StepFinished(0, 1, 0.1, 1, math.inf), "loss=inf"),
        (lambda m: PipelineFractions(0, 1.5, 0.5), "bubble=1.5"),
        (lambda m: NicBandwidth("h0", -1.0), "bytes_per_second=-1.0"),
        (lambda m: m.serve(70000), "port=70000"),
    ],
)
def test_bad_input_names_the_field_the_value_and_what_is_allowed(metrics, call, message):
    with pytest.raises(ValueError) as err:
        call(metrics)
    assert message in str(err.value)
    assert "must be" in str(err.value)


def test_two_trainers_in_one_process_keep_separate_registries():
    a = TrainerMetrics(job="a", rank=0, host="h0", stage=0)
    b = TrainerMetrics(job="a", rank=1, host="h0", stage=0)
    a.emit(StepFinished(0, 1, 0.1, 10, 1.0))
    assert (
        b.registry.get_sample_value("meshjob_tokens_total", {"trainingjob": "a", "namespace": "default", "stage": "0"})
        is None
    )


def test_serve_exposes_the_metrics_over_http_and_close_frees_the_port(metrics):
    feed_everything(metrics)
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["meshjob_resharding_bytes"].samples[0].value == 1000
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_forked_child_does_not_keep_the_metrics_port(metrics):
    """Ranks forked by a serving launcher close their copy of its listening socket: once the
    launcher closes, the port is free although the child still runs, and close() in the child
    returns at once (the serving thread was not forked with it)."""
    import os
    import signal
    import socket

    port = metrics.serve(0, addr="127.0.0.1")
    go_r, go_w = os.pipe()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: close() must not wait for a serving thread it does not have
        os.write(started_w, b"x")  # the at-fork hooks have run: the parent may check the port
        signal.alarm(10)
        metrics.close()
        os.read(go_r, 1)  # live on until the parent has checked the port
        os._exit(0)
    try:
        os.read(started_r, 1)  # on a busy machine the child may not have run at all yet
        metrics.close()
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))  # EADDRINUSE if the child still listened on it
            probe.listen()
    finally:
        os.write(go_w, b"x")
        _, status = os.waitpid(pid, 0)
        os.close(started_r)
        os.close(started_w)
        os.close(go_r)
        os.close(go_w)
    assert os.waitstatus_to_exitcode(status) == 0


def test_every_boundary_of_the_utransformer_example_is_its_own_series(metrics):
    """Between two stages a U-Transformer moves the activation and skip tensors, forward and backward:
    the boundary label names the tensor and the direction, so none of them shares a series."""
    from pathlib import Path

    from meshjob.plan.build import build_plan
    from meshjob.spec.manifest import load_job

    plan = build_plan(load_job(str(Path(__file__).resolve().parents[1] / "examples" / "utransformer-demo.yaml")))
    pairs = [b.key.edge for b in plan.boundaries]
    assert any(pairs.count(pair) > 2 for pair in pairs)  # a stage pair with several tensors
    for i, b in enumerate(plan.boundaries):
        metrics.emit(LowerBoundRatio(b.key, 1.0 + i))
    for i, b in enumerate(plan.boundaries):
        assert (
            value(
                metrics,
                "meshjob_resharding_lower_bound_ratio",
                trainingjob="gpt-demo",
                namespace="default",
                boundary=str(b.key),
            )
            == 1.0 + i
        )


# --- adding a metric: one registration ---------------------------------------------------------


@dataclass(frozen=True)
class QueueDepth(Event):
    """A metric this test adds: the one registration is this class, which declares its series."""

    METRICS = (Metric("meshjob_test_queue_depth", "Transfers waiting in a test queue", "gauge", "depth", ("stage",)),)
    stage: int
    depth: int


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_a_new_metric_is_served_by_a_trainers_exporter(metrics):
    Fanout((metrics,)).emit(QueueDepth(stage=1, depth=5))
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        assert 'meshjob_test_queue_depth{namespace="default",stage="1",trainingjob="gpt-demo"} 5.0' in scrape(port)
    finally:
        metrics.close()


@pytest.mark.slow
def test_a_new_metric_reaches_meshjob_runs_endpoint_from_forked_ranks():
    """Ranks forked by the launcher emit it into the event pipe; `meshjob run`'s aggregation path
    (RunStats, then MetricsFeed) takes it in and serves it, with no code that knows the kind."""
    from pathlib import Path

    from meshjob.plan.build import build_plan
    from meshjob.plan.placement import default_hosts
    from meshjob.spec.manifest import load_job
    from meshjob_trainer.commands.run import MetricsFeed
    from meshjob_trainer.emulate.progress import RunStats
    from meshjob_trainer.launch import launch

    job = load_job(str(Path(__file__).resolve().parents[1] / "examples" / "tiny.yaml"))
    stats = RunStats(world_size=2, total_steps=1)
    feed = MetricsFeed(job, build_plan(job, default_hosts(job)), 0)

    def on_event(rank: int, event: Event) -> None:
        stats.add(rank, event)
        feed.on_event(event, stats)

    try:
        result = launch(
            2,
            lambda ctx: ctx.events.emit(QueueDepth(stage=ctx.rank, depth=10 + ctx.rank)),
            on_event=on_event,
            timeout_s=30,
        )
        assert result.raise_on_failure().ok
        text = scrape(feed.port)
    finally:
        feed.close()
    assert 'meshjob_test_queue_depth{namespace="default",stage="0",trainingjob="tiny"} 10.0' in text
    assert 'meshjob_test_queue_depth{namespace="default",stage="1",trainingjob="tiny"} 11.0' in text
