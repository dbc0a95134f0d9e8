"""A pipelined run (real processes, gloo, cross-mesh resharding on every edge) computes what the
single-process reference computes: the same losses and the same final weights.

The job: 8 layers in 4 stages on 7 ranks; tensor parallel 2 on stage 0, data parallel 2 across
hosts on stage 1, one device on stage 2, data parallel 2 inside a host on the last stage, so the
boundaries reshard between differently shaped and differently sharded meshes.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from meshjob.plan.build import build_plan
from meshjob.spec.manifest import ModelSpec, TrainingJob, parse_job
from meshjob_trainer.launch import launch
from meshjob_trainer.model import StageModule, full_parameters
from meshjob_trainer.reference import ReferenceResult, reference_for_job
from meshjob_trainer.train import TrainResult, train_rank

STEPS, LR = 10, 1e-2
STAGES = [
    {"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1},
    {"layers": [2, 4], "mesh": [2, 1], "dataParallelDim": 0},
    {"layers": [4, 6], "mesh": [1, 1]},
    {"layers": [6, 8], "mesh": [1, 2], "dataParallelDim": 1},
]
# Adam moves every element by up to ~lr per step whatever its gradient's size, so an element whose
# gradient is rounding noise (near 0) can differ by a small fraction of lr after a few steps.
WEIGHT_ATOL = LR / 50


def make_job(
    kind: str,
    schedule: str,
    weight_grad_delay: int | str,
    stages=STAGES,
    steps: int = STEPS,
    global_batch: int = 8,
    microbatches: int = 4,
    checkpoint_every: int = 0,
    edges: list | None = None,
) -> TrainingJob:
    checkpoint = {"every": checkpoint_every, "path": "/unused/train_rank/takes/a/directory"}
    extra = {} if edges is None else {"edges": edges}
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "equivalence"},
            "spec": {
                "model": {"kind": kind, "layers": 8, "hidden": 16, "heads": 2, "vocab": 32, "seqLen": 8},
                "training": {
                    "steps": steps,
                    "globalBatch": global_batch,
                    "microbatches": microbatches,
                    "learningRate": LR,
                    "seed": 0,
                    "checkpoint": checkpoint,
                },
                "topology": {"devicesPerHost": 2},
                "stages": stages,
                "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy"},
                "schedule": {"kind": schedule, "weightGradDelay": weight_grad_delay},
                **extra,
            },
        }
    )


def run_job(job: TrainingJob, schedules=None, checkpoint_dir: str | None = None, plan=None) -> list[TrainResult]:
    world = (plan or build_plan(job)).placement.world_size
    target = functools.partial(train_rank, job=job, schedules=schedules, checkpoint_dir=checkpoint_dir, plan=plan)
    result = launch(world, lambda ctx: target(ctx.env), timeout_s=55)
    return result.raise_on_failure().values


@functools.cache
def reference(kind: str) -> ReferenceResult:
    return reference_for_job(make_job(kind, "gpipe", 0))


def pipeline_losses(results: list[TrainResult]) -> list[list[float]]:
    return [r.losses for r in results if r.losses]


SCHEDULES = [("gpipe", 0), ("1f1b", 0), ("eager-1f1b", 0), ("eager-1f1b", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "utransformer"])
@pytest.mark.parametrize("schedule,delay", SCHEDULES)
def test_pipelined_training_matches_the_single_process_reference(kind, schedule, delay):
    job = make_job(kind, schedule, delay)
    if delay:  # the plan must really split the backward and delay weight gradients
        plan = build_plan(job)
        assert plan.split_backward and any(d > 0 for d in plan.weight_delay.values())
    results = run_job(job)
    ref = reference(kind)

    losses = pipeline_losses(results)
    assert len(losses) == 2  # the last stage's two data-parallel ranks both report
    for reported in losses:
        assert reported == pytest.approx(ref.losses, abs=1e-5)

    weights = full_parameters([r.params for r in results])
    assert set(weights) == set(ref.weights)
    for name, expected in ref.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow
def test_edges_sharded_beyond_the_natural_layouts_train_the_same():
    """0 -> 1 sends sequence-sharded slices of its replicated activation; 2 -> 3 delivers them
    sequence-sharded to a tensor-parallel stage, which all-gathers inside its mesh."""
    stages = STAGES[:3] + [{"layers": [6, 8], "mesh": [1, 2], "tensorParallelDim": 1}]
    edges = [{"from": 0, "to": 1, "send": "RS1R", "recv": "S0RR"}, {"from": 2, "to": 3, "send": "RRR", "recv": "RS1R"}]
    results = run_job(make_job("gpt", "1f1b", 0, stages=stages, edges=edges))
    ref = reference("gpt")
    for reported in pipeline_losses(results):
        assert reported == pytest.approx(ref.losses, abs=1e-5)
    weights = full_parameters([r.params for r in results])
    for name, expected in ref.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow
def test_ranks_that_follow_a_need_order_of_transfers_train_the_same():
    """On NICs as slow as the compute, stage 0's skips to the last stage would hold the last stage's
    in-link ahead of the activation it needs first: the plan's links take transfers in need order, not
    in the order they are sent (meshjob.plan.comm_order), and real ranks issuing them so still match."""
    from meshjob.costs.compute import CostModel
    from meshjob.network.model import NetworkModel
    from meshjob.plan.comm_order import TransferOrder
    from meshjob.simulate.simulator import plan_cost, simulate_plan

    one_device = [{"layers": [2 * i, 2 * i + 2], "mesh": [1, 1]} for i in range(4)]
    job = make_job("utransformer", "eager-1f1b", 1, stages=one_device, microbatches=8)
    cost = CostModel(network=NetworkModel(nic_bytes_per_s=1e6), layer_forward_s=1e-3, measured=True)
    plan = build_plan(job, cost=cost, network=cost.network)
    sent_first = simulate_plan(plan, plan_cost(plan), follow_plan_order=False)
    assert plan.transfer_order.transfers != TransferOrder.of_run(sent_first.order).transfers

    def target(ctx):  # the order checked: any message issued out of the planned order fails the run
        from meshjob_trainer.dist import WorkerContext, init_distributed, shutdown_distributed
        from meshjob_trainer.reshard import ReshardExecutor
        from meshjob_trainer.train import train
        from meshjob_trainer.wire import CheckedWire, GlooWire

        init_distributed(ctx.env, timeout_s=30)
        try:
            reshard = ReshardExecutor(plan, ctx.env.rank, wire=CheckedWire(GlooWire(), ctx.env.rank))
            result = train(
                WorkerContext(
                    env=ctx.env, job=job, plan=plan, stage=plan.placement.stage_of(ctx.env.rank), reshard=reshard
                )
            )
            torch.distributed.barrier()  # rank 0 hosts the store the checks use: nobody leaves early
            return result
        finally:
            shutdown_distributed()

    results = launch(plan.placement.world_size, target, timeout_s=55).raise_on_failure().values
    ref = reference_for_job(job)
    for reported in pipeline_losses(results):
        assert reported == pytest.approx(ref.losses, abs=1e-5)
    weights = full_parameters([r.params for r in results])
    for name, expected in ref.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


def test_the_comparison_tolerance_is_far_below_what_training_changes():
    """Guards the test above: the weights move much more than WEIGHT_ATOL in training."""
    job = make_job("gpt", "gpipe", 0)
    initial = dict(StageModule(job.model, 0, 8, job.training.seed).named_parameters())
    moved = max((reference("gpt").weights[n] - p.detach()).abs().max().item() for n, p in initial.items())
    assert moved > 20 * WEIGHT_ATOL


def test_reference_loss_goes_down_on_the_equivalence_job():
    losses = reference("utransformer").losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2


@pytest.mark.slow
def test_tied_embedding_copies_stay_equal_on_first_and_last_stage():
    results = run_job(make_job("gpt", "1f1b", 0, steps=3))
    copies = [r.params["wte.weight"][0] for r in results if r.stage in (0, 3)]
    assert len(copies) == 4
    for copy in copies[1:]:
        torch.testing.assert_close(copy, copies[0], rtol=0, atol=1e-7)


@pytest.mark.slow
def test_resuming_from_a_checkpoint_continues_exactly_like_an_uninterrupted_run(tmp_path):
    whole = run_job(make_job("utransformer", "eager-1f1b", 1, steps=6))
    first = make_job("utransformer", "eager-1f1b", 1, steps=3, checkpoint_every=3)
    run_job(first, checkpoint_dir=str(tmp_path))
    resumed = run_job(
        make_job("utransformer", "eager-1f1b", 1, steps=6, checkpoint_every=3), checkpoint_dir=str(tmp_path)
    )

    assert {r.start_step for r in resumed} == {3}
    assert pipeline_losses(resumed)[0] == pytest.approx(pipeline_losses(whole)[0][3:], abs=1e-6)
    after, expected = full_parameters([r.params for r in resumed]), full_parameters([r.params for r in whole])
    for name, weight in expected.items():
        torch.testing.assert_close(after[name], weight, rtol=0, atol=1e-6, msg=name)


# --- the executor alone, in one process: a recording transport stands in for resharding ------


class RecordingTransport:
    """Receives return fixed random tensors; sends are recorded (test double for this unit test)."""

    def __init__(self, shape):
        self.shape, self.sent = shape, {}

    def start(self, key, mb, local):
        if local is not None:
            self.sent[(key.tensor, mb, key.grad)] = local.clone()
            return _Done(None)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{key.tensor}:{mb}:{key.grad}".encode()))
        return _Done(torch.randn(self.shape, generator=gen))


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value

    def wait(self):
        return self.value


def run_middle_stage(actions: str):
    """Layers [2, 4) of an 8-layer U-Transformer: input 'activation', outputs 'activation',
    'skip2' and 'skip3' (a skip output is also used inside the stage)."""
    from meshjob.schedule.actions import Action
    from meshjob_trainer.pipeline import PipelineExecutor

    config = ModelSpec("utransformer", 8, 16, 2, 32, 8)
    module = StageModule(config, 2, 4, seed=0)
    transport = RecordingTransport((2, 8, 16))
    executor = PipelineExecutor(1, module, [Action.parse(a) for a in actions.split()], transport, 1.0)
    _, stats = executor.run_step(lambda mb: None)
    return {n: p.grad for n, p in module.named_parameters()}, transport.sent, stats


RECV_BACK = "RECV_B{m}@2 RECV_B{m}@2:skip2 RECV_B{m}@2:skip3"


def test_split_backward_gives_the_same_gradients_as_the_full_backward():
    full = " ".join(f"RECV_F{m}@0 F{m} {RECV_BACK.format(m=m)} B{m} SEND_B{m}@0" for m in range(2))
    split = (
        "RECV_F0@0 F0 RECV_F1@0 F1 "
        + RECV_BACK.format(m=0)
        + " I0 SEND_B0@0 "
        + RECV_BACK.format(m=1)
        + " I1 SEND_B1@0 W0 W1"
    )
    grads_b, sent_b, _ = run_middle_stage(full)
    grads_iw, sent_iw, stats = run_middle_stage(split)
    assert stats.peak_stashed == 2
    assert set(sent_b) == set(sent_iw) == {("activation", 0, True), ("activation", 1, True)}
    for key in sent_b:
        torch.testing.assert_close(sent_iw[key], sent_b[key], rtol=1e-6, atol=1e-7)
    for name, grad in grads_b.items():
        torch.testing.assert_close(grads_iw[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_backward_before_its_forward_is_refused_naming_stage_and_action():
    from meshjob_trainer.pipeline import PipelineError

    with pytest.raises(PipelineError, match="stage 1: action B0: microbatch 0 has no stashed forward"):
        run_middle_stage(RECV_BACK.format(m=0) + " B0")


def test_a_forward_without_its_receive_is_refused():
    from meshjob_trainer.pipeline import PipelineError

    with pytest.raises(
        PipelineError, match="stage 1: action F0: input 'activation' of microbatch 0 was never received"
    ):
        run_middle_stage("F0")


def test_an_action_list_that_leaves_a_microbatch_unfinished_is_refused():
    from meshjob_trainer.pipeline import PipelineError

    with pytest.raises(PipelineError, match=r"stage 1: the action list ended with microbatches \[0\] forwarded"):
        run_middle_stage("RECV_F0@0 F0")


def test_a_plan_whose_edges_miss_a_skip_connection_is_refused_naming_the_stage():
    from meshjob.spec.manifest import EdgeSpec
    from meshjob_trainer.train import check_edges

    module = StageModule(ModelSpec("utransformer", 8, 16, 2, 32, 8), 6, 8, seed=0)
    edges = [EdgeSpec(2, 3, "RRR", "RRR"), EdgeSpec(0, 3, "RRR", "RRR", tensor="skip0")]
    with pytest.raises(
        ValueError,
        match=r"spec.edges: stage 3 receives \['activation', 'skip0'\].*"
        r"need inputs \['activation', 'skip0', 'skip1'\]",
    ):
        check_edges(module, 3, edges)


class ManualClock:
    """A step clock whose time moves only when the test says (test double for this unit test)."""

    def __init__(self):
        self.now = 100.0

    def start(self):
        self.origin = self.now
        return self.now

    def mark(self):
        return self.now

    def seconds(self, marks):
        return [m - self.origin for m in marks]


class SlowTransport(RecordingTransport):
    """Taking a received tensor costs 5 s on the clock; a send's end-of-step wait 2 s."""

    def __init__(self, shape, clock):
        super().__init__(shape)
        self.clock = clock

    def start(self, key, mb, local):
        done, clock = super().start(key, mb, local), self.clock

        class Slow:
            def result(self):
                clock.now += 5.0
                return done.value

            def wait(self):
                clock.now += 2.0 if done.value is None else 0.0
                return done.value

        return Slow()


class TimedCompute:
    """The module's own math, each call taking `seconds` on the clock."""

    def __init__(self, inner, clock, seconds):
        self.inner, self.clock, self.seconds, self.emulated = inner, clock, seconds, False

    def __getattr__(self, name):
        def timed(*args):
            self.clock.now += self.seconds[name]
            return getattr(self.inner, name)(*args)

        return timed


def test_a_step_reads_its_clock_an_action_computing_after_its_waits_for_inputs():
    """On any clock (the host's, a GPU's stream): F0 waits 5 s for its input then computes 1 s; I0 waits
    5 s for each of its three gradients then computes 2 s; W0 computes 3 s; the send waits 2 s at the end."""
    from meshjob.schedule.actions import Action
    from meshjob_trainer.compute import RealCompute
    from meshjob_trainer.pipeline import PipelineExecutor

    clock = ManualClock()
    module = StageModule(ModelSpec("utransformer", 8, 16, 2, 32, 8), 2, 4, seed=0)
    actions = [Action.parse(a) for a in ("RECV_F0@0 F0 " + RECV_BACK.format(m=0) + " I0 SEND_B0@0 W0").split()]
    params = [p for p in module.parameters() if p.requires_grad]
    compute = TimedCompute(
        RealCompute(module, params, True), clock, {"forward": 1.0, "input_grad": 2.0, "weight_grad": 3.0}
    )
    executor = PipelineExecutor(1, module, actions, SlowTransport((2, 8, 16), clock), 1.0, compute=compute, clock=clock)
    _, stats = executor.run_step(lambda mb: None)
    assert stats.timeline_origin == 100.0
    assert stats.compute_s == 6.0 and stats.wait_s == 22.0
    assert stats.timeline == [
        ("wait", 0.0, 5.0),
        ("F0", 5.0, 6.0),
        ("wait", 6.0, 11.0),
        ("wait", 11.0, 16.0),
        ("wait", 16.0, 21.0),
        ("I0", 21.0, 23.0),
        ("W0", 23.0, 26.0),
    ] + [("wait", 26.0, 26.0)] * 4 + [("wait", 26.0, 28.0)]
    # at the end the step waits for every handle: the four received ones are done, the send takes 2 s


def test_a_cuda_device_reads_the_step_on_its_stream_a_cpu_on_the_host():
    from meshjob_trainer.step_clock import DeviceClock, HostClock, clock_for

    assert isinstance(clock_for("cpu"), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), DeviceClock)  # not read: no GPU here
