"""The data-parallel gradient reduction in buckets (meshjob_trainer.optim): started during the step's
last backward pass it trains exactly as after the step, plain and under ZeRO-1; the timeline shows a
bucket's reduction starting before that pass ends; weight decay leaves norms, biases and embeddings alone."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_equivalence import pipeline_losses, run_job

from meshjob.plan.build import build_plan
from meshjob.spec.manifest import TrainingJob, parse_job
from meshjob_trainer.events import Resharded
from meshjob_trainer.families import build_stage
from meshjob_trainer.launch import launch
from meshjob_trainer.model import full_parameters
from meshjob_trainer.optim import StageOptimizer, no_decay_parameters, plan_buckets
from meshjob_trainer.parallel import StageGroups, TPGroup
from meshjob_trainer.reference import reference_for_job
from meshjob_trainer.train import train_rank

STAGES = [  # data parallel 2 on both stages: the first inside a host, the second across two
    {"layers": [0, 2], "mesh": [1, 2], "dataParallelDim": 1},
    {"layers": [2, 4], "mesh": [2, 1], "dataParallelDim": 0},
]


def make_job(schedule: str = "1f1b", delay: int = 0, kind: str = "gpt", **training) -> TrainingJob:
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "buckets"},
            "spec": {
                "model": {"kind": kind, "layers": 4, "hidden": 16, "heads": 2, "vocab": 32, "seqLen": 8},
                "training": {
                    "steps": 4,
                    "globalBatch": 8,
                    "microbatches": 4,
                    "learningRate": 1e-2,
                    "seed": 0,
                    "gradBucketMiB": 0.004,  # ~1000 elements: several buckets per stage
                    **training,
                },
                "topology": {"devicesPerHost": 2},
                "stages": STAGES,
                "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy"},
                "schedule": {"kind": schedule, "weightGradDelay": delay},
            },
        }
    )


def assert_same_training(a, b, tol: float = 1e-6) -> None:
    for x, y in zip(pipeline_losses(a), pipeline_losses(b), strict=True):
        assert x == pytest.approx(y, abs=tol)
    wa, wb = full_parameters([r.params for r in a]), full_parameters([r.params for r in b])
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=tol, msg=name)


def test_buckets_follow_the_backward_and_keep_the_tied_ones_apart():
    buckets = plan_buckets([4, 3, 5, 2, 6], ["tied", "reduce", "reduce", "reduce", "skip"], 6, 2, 1)
    assert [b.params for b in buckets] == [(3, 2), (1,), (0,)]  # reverse order, at least 6 elements
    assert [(b.offset, b.layout.padded, b.layout.shard) for b in buckets] == [
        (0, 8, (4, 8)),
        (8, 4, (2, 4)),
        (12, 4, (2, 4)),
    ]
    assert buckets[-1].tied and not buckets[0].tied


@pytest.mark.slow
@pytest.mark.parametrize("schedule,delay,zero", [("1f1b", 0, 0), ("eager-1f1b", 1, 0), ("eager-1f1b", 1, 1)])
def test_overlapped_reduction_trains_exactly_as_after_the_step(schedule, delay, zero):
    optimizer = {"zeroStage": zero}
    overlapped = run_job(make_job(schedule, delay, optimizer=optimizer))
    after = run_job(make_job(schedule, delay, optimizer=optimizer, overlapGradReduce=False))
    assert_same_training(overlapped, after)
    ref = reference_for_job(make_job())
    for losses in pipeline_losses(overlapped):
        assert losses == pytest.approx(ref.losses, abs=1e-5)
    # the timeline: a bucket's reduction starts before the step's last backward pass ends
    for r in overlapped:
        backward = [(name, end) for name, _, end in r.stats.timeline if name[0] in "BW"]
        last_end = backward[-1][1]
        assert len(r.stats.reductions) > 1
        assert min(at for _, at in r.stats.reductions) < last_end, (r.rank, backward[-1], r.stats.reductions)
    for r in after:
        assert r.stats.reductions == []


def test_weight_decay_leaves_norms_biases_and_embeddings_alone():
    job = make_job()
    module = build_stage(job.model, 0, 4, 0)
    groups = StageGroups(TPGroup(), None, 0, 1, None, 1)
    names = {id(p): n for n, p in module.named_parameters()}
    for embeddings in (False, True):
        params = list(module.parameters())
        before = [p.detach().clone() for p in params]
        skip = no_decay_parameters(module, embeddings)
        opt = StageOptimizer(params, groups, 0.1, weight_decay=0.5, no_decay=skip)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        kept = {names[id(p)] for p, b in zip(params, before) if torch.equal(p.detach(), b)}
        decayed = {names[id(p)] for p in params} - kept
        assert {n for n in kept if n.startswith("wte") or n.startswith("wpe")} == (
            set() if embeddings else {"wte.weight", "wpe.weight"}
        )
        assert all(n.endswith("bias") or ".ln" in n or n.startswith("ln") for n in kept - {"wte.weight", "wpe.weight"})
        assert any(n.endswith("weight") and "ln" not in n for n in decayed)  # the linears are decayed
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)


class _Received:
    """A MetricsSink adding up the resharding bytes a rank received."""

    def __init__(self) -> None:
        self.nbytes = 0

    def emit(self, event) -> None:
        if isinstance(event, Resharded):
            self.nbytes += event.nbytes


def _run_counting(job: TrainingJob) -> list[tuple[list[float], int]]:
    def target(ctx):
        sink = _Received()
        result = train_rank(ctx.env, job, events=sink)
        return result.losses, sink.nbytes

    world = build_plan(job).placement.world_size
    return launch(world, target, timeout_s=55).raise_on_failure().values


@pytest.mark.slow
def test_bf16_boundary_tensors_cross_in_half_the_bytes_and_train_like_fp32():
    """Boundary tensors in bf16 (training.precision), the data-parallel reduction too (gradReduceDtype):
    the trainer's byte counters read half the fp32 run's, the plan's per-host bytes likewise, and the
    losses stay within bf16 rounding of fp32's."""
    fp32, bf16 = make_job(), make_job(precision="bf16", gradReduceDtype="bf16")
    full, half = _run_counting(fp32), _run_counting(bf16)
    assert sum(n for _, n in half) * 2 == sum(n for _, n in full) > 0
    planned = {h: o for h, (o, _) in build_plan(fp32).host_bytes_per_step().items()}
    assert {h: o // 2 for h, o in planned.items()} == {
        h: o for h, (o, _) in build_plan(bf16).host_bytes_per_step().items()
    }
    for (a, _), (b, _) in zip(full, half):
        assert b == pytest.approx(a, abs=0.02)
    assert any(losses for losses, _ in half)


def test_the_grad_sync_benchmarks_two_jobs_differ_only_in_when_gradients_are_reduced():
    from meshjob.spec.manifest import parse_job
    from meshjob_bench.grad_sync import job

    overlapped, after = parse_job(job(True, 4)), parse_job(job(False, 4))
    assert overlapped.training.overlap_grad_reduce and not after.training.overlap_grad_reduce
    assert overlapped.stages[0].mesh == (2, 1) and overlapped.stages[0].data_parallel_dim == 0  # DP=2 over hosts
    assert job(True, 4)["spec"]["training"] | {"overlapGradReduce": False} == job(False, 4)["spec"]["training"]
