"""Emulated device compute (meshjob.costs.devices, meshjob.costs.device_costs, meshjob_trainer.compute): a rank waits
the modelled time of each compute and sends tensors of the real shapes, so the network sees what a
real run sends."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_pipeline_equivalence import make_job  # noqa: E402 - tests dir is on sys.path

from meshjob.cli import main as cli_main
from meshjob.costs.device_costs import emulated_cost, emulated_costs, stage_work
from meshjob.costs.devices import DEVICES, ComputeMode, parse_compute, parse_device
from meshjob.errors import SpecError
from meshjob.plan.build import build_plan
from meshjob.spec.manifest import parse_job
from meshjob_bench.pipeline import emulated_compute_job
from meshjob_trainer.launch import launch


def one_rank_job(microbatches: int = 4, samples: int = 2):
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "one-rank"},
            "spec": {
                "model": {"kind": "gpt", "layers": 2, "hidden": 1024, "heads": 8, "vocab": 512, "seqLen": 1024},
                "training": {
                    "steps": 4,
                    "globalBatch": samples * microbatches,
                    "microbatches": microbatches,
                    "learningRate": 1e-3,
                    "seed": 0,
                },
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [0, 2], "mesh": [1, 1]}],
                "schedule": {"kind": "1f1b", "weightGradDelay": 0},
            },
        }
    )


def test_a_device_is_a_named_profile_or_a_positive_number_of_tflops():
    assert parse_device("A100") == DEVICES["a100"]
    custom = parse_device("50")
    assert custom.tflops == 50 and custom.memory_gbytes_per_s / 50 == pytest.approx(2039 / 312)
    for bad in ("a200", "0", "-3", "nan", "inf", ""):
        with pytest.raises(SpecError, match=r"--device: .* is invalid: one of a100, h100, or a positive number"):
            parse_device(bad)


def test_compute_flags_refuse_an_unknown_mode_and_a_device_with_real_compute():
    assert parse_compute("real", None) == ComputeMode()
    assert parse_compute("emulated", None).device == DEVICES["a100"]
    with pytest.raises(SpecError, match="--compute: 'fake' is invalid: one of real, emulated"):
        parse_compute("fake", None)
    with pytest.raises(SpecError, match="--device: 'h100' is invalid: only with --compute emulated"):
        parse_compute("real", "h100")


def test_modelled_time_grows_with_the_work_and_shrinks_with_the_device():
    job = one_rank_job()
    a100, h100 = emulated_cost(job, 0, DEVICES["a100"]), emulated_cost(job, 0, DEVICES["h100"])
    assert h100.stage.forward_s < a100.stage.forward_s
    # I + W = 2 F for the matmuls; the attention's backward sits in I
    work = stage_work(job, 0)
    assert work.input_grad_flops > work.weight_grad_flops
    assert work.input_grad_flops + work.weight_grad_flops == pytest.approx(2 * work.forward_flops, rel=0.2)
    # twice the samples: twice the FLOPs, more time but less than twice (the weights are read once)
    twice = one_rank_job(samples=4)
    assert stage_work(twice, 0).forward_flops == pytest.approx(2 * work.forward_flops)
    assert a100.stage.forward_s < emulated_costs(twice, DEVICES["a100"])[0].forward_s <= 2 * a100.stage.forward_s
    tiny = make_job("gpt", "1f1b", 0)
    assert emulated_costs(tiny, DEVICES["a100"])[2].forward_s > stage_work(tiny, 2).forward_flops / 156e12


def test_meshjob_run_refuses_a_bad_device_with_exit_2_naming_flag_value_and_allowed(tmp_path, capsys):
    assert cli_main(["run", "examples/gpt-demo.yaml", "--compute", "emulated", "--device", "a200"]) == 2
    err = capsys.readouterr().err
    assert "--device: 'a200' is invalid: one of a100, h100, or a positive number of TFLOP/s" in err


@pytest.mark.slow
def test_bench_pipeline_refuses_a_bad_device_with_exit_2():
    assert cli_main(["bench", "pipeline", "--quick", "--device", "fast"]) == 2


def _rank_recording_waits(job, device):
    """One rank of `job` under emulated compute, EmulatedCompute's waits recorded instead of slept."""
    from meshjob_trainer import compute as compute_module
    from meshjob_trainer.train import train_rank

    def target(ctx):
        waits: list[float] = []
        # this forked rank's copy of the class: each wait recorded, none slept
        compute_module.DeadlineClock.wait = lambda clock, seconds: waits.append(seconds)
        result = train_rank(ctx.env, job, compute=ComputeMode("emulated", device))
        return waits, [name for name, _, _ in result.stats.timeline], result.losses

    return target


@pytest.mark.slow
def test_emulated_compute_waits_the_modelled_time_of_each_compute_on_one_rank():
    """Each F, B and optimizer step waits exactly its modelled time, once per microbatch and step, so a step
    waits M x (F + B) + the optimizer step. How long those waits take on this machine, measured against the
    model: `meshjob bench pipeline`'s JSON, field emulated_compute (step_over_modelled, forward_over_modelled)."""
    job, device = one_rank_job(), parse_device("2")
    assert job == emulated_compute_job()  # the benchmark measures this very job
    cost = emulated_cost(job, 0, device)
    waits, names, losses = launch(1, _rank_recording_waits(job, device), timeout_s=60).raise_on_failure().values[0]
    m, steps = job.training.microbatches, job.training.steps
    one_step = [cost.stage.forward_s] * m + [cost.stage.backward_s] * m + [cost.optimizer_s]
    assert sorted(waits) == sorted(one_step * steps)
    per_step = len(one_step)
    for step in range(steps):  # each step's waits end with its optimizer step, and add up to the modelled step
        mine = waits[step * per_step : (step + 1) * per_step]
        assert mine[-1] == cost.optimizer_s
        assert math.fsum(mine) == pytest.approx(m * (cost.stage.forward_s + cost.stage.backward_s) + cost.optimizer_s)
    assert sum(name.startswith("F") for name in names) == m  # the last step's timeline: one F per microbatch
    assert all(math.isnan(loss) for loss in losses)  # not a loss: reported as such


@pytest.mark.slow
def test_after_its_first_step_a_ranks_collector_skips_the_jobs_objects_until_training_ends():
    """A full collection over the model, plan and engine stalled the rank that ran it (meshjob_trainer.launch)."""
    import gc

    from meshjob_trainer.train import train_rank

    job, device = one_rank_job(), parse_device("4")

    class FreezeCounts:
        def __init__(self):
            self.at_steps = []

        def emit(self, event):
            if type(event).__name__ == "StepFinished":
                self.at_steps.append(gc.get_freeze_count())

    def target(ctx):
        counts = FreezeCounts()
        inherited = gc.get_freeze_count()  # the launcher's: the parent's objects
        train_rank(ctx.env, job, compute=ComputeMode("emulated", device), events=counts)
        return inherited, counts.at_steps, gc.get_freeze_count()

    inherited, at_steps, after = launch(1, target, timeout_s=60).raise_on_failure().values[0]
    assert at_steps[0] <= inherited  # nothing of the job frozen yet (inherited objects may die meanwhile)
    assert all(n > at_steps[0] + 100 for n in at_steps[1:])  # then what outlives the first step is
    assert after == 0  # and handed back when training ends


class SizedWire:
    """Delegates to a CheckedWire and records every message issued: (op, peer, message, bytes, dtype)."""

    def __init__(self, inner):
        self.inner, self.device, self.issued = inner, inner.device, []

    def isend(self, tensor, peer, tag, message):
        self.issued.append(("send", peer, message, tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return self.inner.isend(tensor, peer, tag, message)

    def irecv(self, tensor, peer, tag, message):
        self.issued.append(("recv", peer, message, tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return self.inner.irecv(tensor, peer, tag, message)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _messages_per_peer(job, compute: ComputeMode) -> list[dict]:
    """Per rank: for each (op, peer), the messages issued in order with their bytes (CheckedWire on)."""
    from meshjob_trainer.dist import WorkerContext, init_distributed, shutdown_distributed
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.train import train
    from meshjob_trainer.wire import CheckedWire, GlooWire

    plan = build_plan(job)

    def target(ctx):
        init_distributed(ctx.env, timeout_s=30)
        try:
            wire = SizedWire(CheckedWire(GlooWire(), ctx.env.rank))
            reshard = ReshardExecutor(plan, ctx.env.rank, wire=wire)
            train(
                WorkerContext(
                    env=ctx.env,
                    job=job,
                    plan=plan,
                    stage=plan.placement.stage_of(ctx.env.rank),
                    reshard=reshard,
                    compute=compute,
                )
            )
            torch.distributed.barrier()  # rank 0 hosts the store the checks use: nobody leaves early
            per_peer: dict = {}
            for op, peer, message, nbytes, dtype in wire.issued:
                per_peer.setdefault((op, peer), []).append((message, nbytes, dtype))
            return per_peer
        finally:
            shutdown_distributed()

    return launch(plan.placement.world_size, target, timeout_s=90).raise_on_failure().values


@pytest.mark.slow
def test_real_and_emulated_compute_send_the_same_bytes_in_the_same_order():
    """Tensor and data parallel meshes, skip edges, the I/W split: the same messages, sizes and order."""
    job = make_job("utransformer", "eager-1f1b", 1, steps=2)
    real = _messages_per_peer(job, ComputeMode())
    emulated = _messages_per_peer(job, ComputeMode("emulated", parse_device("1000")))
    assert sum(len(v) for rank in real for v in rank.values()) > 0
    assert emulated == real


@pytest.mark.slow
def test_meshjob_run_under_emulated_compute_says_so_and_reports_no_loss(tmp_path):
    out = tmp_path / "summary.json"
    assert (
        cli_main(
            [
                "run",
                "examples/tiny.yaml",
                "--compute",
                "emulated",
                "--device",
                "h100",
                "--no-netns",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["steps_completed"] == summary["total_steps"]
    assert summary["compute"] == "emulated" and summary["device"]["name"] == "h100"
    assert summary["final_loss"] is None  # NaN losses: not meaningful, not reported


class FakeHost:
    """A host clock that moves only when slept on, and oversleeps each sleep by `overshoot` (a 2 us
    time.sleep took 73 us on this machine)."""

    def __init__(self, overshoot: float):
        self.t, self.overshoot, self.slept = 100.0, overshoot, 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds + self.overshoot
        self.slept += seconds + self.overshoot


def test_waits_go_to_deadlines_so_oversleeping_does_not_add_up():
    from meshjob_trainer.compute import DeadlineClock

    host = FakeHost(overshoot=73e-6)
    clock = DeadlineClock(host.now, host.sleep)
    start, waits = host.t, [2e-6] * 1000 + [1e-3] * 10
    for seconds in waits:
        clock.wait(seconds)
    modelled = math.fsum(waits)
    assert clock.modelled == pytest.approx(modelled)
    assert clock.deadline == pytest.approx(start + modelled)  # back to back: each deadline the previous + its time
    # the whole run ends within one overshoot of the modelled time; one sleep per wait would add 1010 of them
    assert start + modelled <= host.t <= start + modelled + host.overshoot
    assert host.slept < modelled + 2 * host.overshoot


def test_time_a_rank_spends_between_waits_counts_and_the_overshoot_is_made_up():
    from meshjob_trainer.compute import DeadlineClock

    host = FakeHost(overshoot=50e-6)
    clock = DeadlineClock(host.now, host.sleep)
    clock.wait(1e-3)
    first = clock.deadline
    host.t += 5e-3  # the rank waited for a transfer
    clock.wait(1e-3)
    # the next compute starts when the rank got to it, less the overshoot the previous wait still owes
    assert clock.deadline == pytest.approx(first + 5e-3 + 1e-3)
    assert host.t == pytest.approx(clock.deadline + host.overshoot)


def recompute_job(steps: int = 2):
    doc = {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "two-stage-recompute"},
        "spec": {
            "model": {
                "kind": "llama",
                "layers": 4,
                "hidden": 256,
                "heads": 8,
                "kvHeads": 2,
                "vocab": 512,
                "seqLen": 256,
            },
            "training": {"steps": steps, "globalBatch": 8, "microbatches": 4, "recompute": "full"},
            "topology": {"devicesPerHost": 2},
            "stages": [{"layers": [0, 2], "mesh": [1, 1]}, {"layers": [2, 4], "mesh": [1, 1]}],
            "schedule": {"kind": "eager-1f1b", "weightGradDelay": 1},
        },
    }
    return parse_job(doc)


def _rank_timing_waits(job, device):
    from meshjob_trainer import compute as compute_module
    from meshjob_trainer.train import train_rank

    def target(ctx):
        waits: list[tuple[float, float, float]] = []  # (modelled seconds, started, ended) on the host clock
        real_wait = compute_module.DeadlineClock.wait

        def timed(clock, seconds):
            started = clock.now()
            real_wait(clock, seconds)
            waits.append((seconds, started, clock.now()))

        compute_module.DeadlineClock.wait = timed
        train_rank(ctx.env, job, compute=ComputeMode("emulated", device))
        return waits

    return target


@pytest.mark.slow
def test_an_emulated_step_waits_the_modelled_times_with_recompute_and_no_less():
    """Two stages of llama with full recompute: each stage's waits add up to M x (F + I + W) + the optimizer
    step per step, I holding the recomputed forward; the rank's waits end no sooner than their sum."""
    job, device = recompute_job(), parse_device("20")
    plan = build_plan(job)
    values = launch(2, _rank_timing_waits(job, device), timeout_s=90).raise_on_failure().values
    m = job.training.microbatches
    for rank, waits in enumerate(values):
        cost = emulated_cost(job, plan.placement.stage_of(rank), device)
        assert cost.recompute_s > 0
        step = m * (cost.stage.forward_s + cost.stage.backward_s) + cost.optimizer_s
        modelled = math.fsum(seconds for seconds, _, _ in waits)
        assert modelled == pytest.approx(job.training.steps * step)
        assert waits[-1][2] - waits[0][1] >= modelled  # deadlines: the overshoots are made up, never skipped


def _dp_rank_sync_times(env, overlap: bool):
    """One emulated step of a one-stage job on 2 data-parallel ranks: when (in modelled compute) each gradient
    bucket's all-reduce started, and how much modelled compute the step's backward passes held."""
    import torch.distributed as dist

    from meshjob_trainer.compute import DPSync, EmulatedCompute
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.model import PipelineStage

    init_distributed(env, timeout_s=30)
    job = one_rank_job(microbatches=3)
    cost = emulated_cost(job, 0, parse_device("1000"))  # a fast device: a step of milliseconds
    sync = DPSync(microbatches=3, overlap=overlap, bucket_bytes=cost.params, itemsize=4)  # 4 buckets
    stage = PipelineStage(job.model, 0, 2)
    compute = EmulatedCompute(stage, cost, (1, 4), torch.float32, dp_group=dist.group.WORLD, dp_sync=sync)
    before_last = 0.0
    for _ in range(3):
        compute.forward({})
        before_last = compute.clock.modelled
        compute.backward([], [], [])
    started_by_backward = list(compute.dp_started)
    compute.update(None, 0)  # type: ignore[arg-type]  # emulated compute reads nothing of the step's state
    dist.destroy_process_group()
    return started_by_backward, before_last, compute.clock.modelled, sync.buckets(cost.params)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_emulated_data_parallel_buckets_start_during_the_last_backward_pass(gang, overlap):
    """overlapGradReduce: each bucket's all-reduce starts during the step's last backward pass, spread over it
    (as its weight gradients would be done), and the optimizer step waits for them; off: none starts before it."""
    import functools

    for started, before_last, end, buckets in gang(2, functools.partial(_dp_rank_sync_times, overlap=overlap)):
        if not overlap:
            assert started == []
            continue
        assert buckets == 4 and len(started) == buckets
        assert all(before_last < t <= end for t in started)  # inside the last B pass, none before it
        assert started == sorted(started) and started[0] < started[-1]  # spread over it, in order
