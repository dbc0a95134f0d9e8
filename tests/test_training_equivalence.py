"""Real training, pipelined, against the single-process reference on the same real data (the
shipped Shakespeare token files): the Llama family under tensor parallel 2, data parallel 2 and
three stages with every schedule; bf16; recomputation; ZeRO-1; clipping by the global norm; the
learning-rate schedule and evaluation; kill-and-resume; a user's model from its own package.

The job: 6 layers in 3 stages on 8 ranks. Stage 0 runs tensor parallel 2 inside a host, stage 1
tensor parallel 2 x data parallel 2 across two hosts, stage 2 data parallel 2 inside a host, so
every boundary reshards between differently shaped meshes, the tied vocab-parallel embedding joins
two tensor-parallel stages, and ZeRO-1 shards over data-parallel ranks that also split tensors.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from test_pipeline_equivalence import pipeline_losses, run_job

from meshjob.plan.build import build_plan
from meshjob.spec.manifest import TrainingJob, parse_job
from meshjob_trainer.events import StepFinished
from meshjob_trainer.launch import launch_with_restarts
from meshjob_trainer.model import full_parameters
from meshjob_trainer.reference import ReferenceResult, reference_for_job
from meshjob_trainer.train import TrainResult, train_rank

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
CUSTOM = ROOT / "examples" / "custom_model"
STEPS, LR = 6, 1e-2
STAGES = [
    {"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1},
    {"layers": [2, 4], "mesh": [2, 2], "dataParallelDim": 0, "tensorParallelDim": 1},
    {"layers": [4, 6], "mesh": [1, 2], "dataParallelDim": 1},
]
LLAMA = {"kind": "llama", "layers": 6, "hidden": 16, "heads": 4, "kvHeads": 2, "vocab": 256, "seqLen": 8}
WEIGHT_ATOL = (
    LR / 50
)  # Adam moves an element with a rounding-noise gradient by up to ~lr: see test_pipeline_equivalence


def make_job(
    schedule: str = "1f1b", delay: int | str = 0, model: dict | None = None, stages=STAGES, **training
) -> TrainingJob:
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "training"},
            "spec": {
                "model": model or LLAMA,
                "data": {
                    "kind": "tokens",
                    "path": str(DATA / "shakespeare-train.bin"),
                    "valPath": str(DATA / "shakespeare-val.bin"),
                    "dtype": "uint16",
                },
                "training": {
                    "steps": STEPS,
                    "globalBatch": 8,
                    "microbatches": 4,
                    "learningRate": LR,
                    "seed": 0,
                    **training,
                },
                "topology": {"devicesPerHost": 2},
                "stages": stages,
                "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy"},
                "schedule": {"kind": schedule, "weightGradDelay": delay},
            },
        }
    )


_REFERENCES: dict[str, ReferenceResult] = {}


def reference(**training) -> ReferenceResult:
    """The reference of make_job(**training), computed once per module run (schedules do not change it)."""
    key = repr(sorted(training.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_for_job(make_job(**training))
    return _REFERENCES[key]


def assert_matches(
    results: list[TrainResult], ref: ReferenceResult, loss_tol: float = 1e-5, weight_atol: float | None = WEIGHT_ATOL
) -> None:
    losses = pipeline_losses(results)
    assert len(losses) == 2  # the last stage's two data-parallel ranks both report
    for reported in losses:
        assert reported == pytest.approx(ref.losses, abs=loss_tol)
    if weight_atol is not None:
        weights = full_parameters([r.params for r in results])
        assert set(weights) == set(ref.weights)
        for name, expected in ref.weights.items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=weight_atol, msg=name)


SCHEDULES = [("gpipe", 0), ("1f1b", 0), ("eager-1f1b", 0), ("eager-1f1b", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,delay", SCHEDULES)
def test_llama_with_tensor_data_and_pipeline_parallelism_matches_the_reference(schedule, delay):
    assert_matches(run_job(make_job(schedule, delay)), reference())


@pytest.mark.slow
def test_bf16_matches_the_bf16_reference_within_a_fraction_of_a_bf16_step():
    """bf16 keeps 8 significant bits: one step of a bf16 number near the loss (4..8) is 2^-5 = 0.031.
    The pipelined run rounds differently grouped sums (tensor-parallel partial products rounded to
    bf16 one by one, then added in fp32; microbatches of other sizes), so its losses differ from the
    single-process bf16 run by rounding, not by mathematics: a sixth of that step (0.005) bounds them,
    while a mistake (a missing reduction, a wrong shard) moves the loss by whole units. The weights are
    left to the fp32 tests: Adam turns rounding differences of near-zero gradients into lr-sized steps."""
    ref = reference(precision="bf16")
    assert max(abs(a - b) for a, b in zip(ref.losses, reference().losses)) > 1e-4  # bf16 really ran
    assert_matches(run_job(make_job(precision="bf16")), ref, loss_tol=0.005, weight_atol=None)


@pytest.mark.slow
def test_recompute_gives_the_same_training_with_the_split_backward():
    """Every block recomputed in the backward, under eager-1F1B with delayed weight gradients (I, then W)."""
    job = make_job("eager-1f1b", 1, recompute="full")
    assert all(job.recompute(s) == "full" for s in range(3)) and build_plan(job).split_backward
    assert_matches(run_job(job), reference())


@pytest.mark.slow
def test_zero_1_gives_the_same_training():
    assert_matches(run_job(make_job("1f1b", optimizer={"zeroStage": 1})), reference())


@pytest.mark.slow
def test_clipping_the_global_norm_matches_clip_grad_norm_on_the_reference_and_evaluation_matches():
    """gradClip below every step's norm, so every step clips; warm-up and cosine decay; a validation
    loss every 2 steps."""
    training = {"gradClip": 0.2, "lrSchedule": {"warmupSteps": 2, "minLr": 1e-3}, "evalEvery": 2}
    ref = reference(**training)
    assert min(ref.grad_norms) > 0.2  # clipping bites on every step
    results = run_job(make_job("1f1b", **training))
    assert_matches(results, ref)
    for r in results:
        assert r.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)  # every rank knows the global norm
        if r.losses:
            assert [s for s, _ in r.val_losses] == [2, 4, 6]
            assert [v for _, v in r.val_losses] == pytest.approx([v for _, v in ref.val_losses], abs=1e-5)


class KillAtStep:
    """An event listener that SIGKILLs its rank when the rank finishes `step`, once per marker file."""

    def __init__(self, step: int, marker: Path):
        self.step, self.marker = step, marker

    def emit(self, event) -> None:
        if isinstance(event, StepFinished) and event.step == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def run_with_kill(job: TrainingJob, checkpoints: Path, kill_rank: int, kill_step: int) -> list:
    """The job with checkpoints; rank `kill_rank` dies at `kill_step`; the gang restarts once."""
    marker = checkpoints.parent / "killed"

    def target(ctx):
        events = KillAtStep(kill_step, marker) if ctx.env.rank == kill_rank else None
        return train_rank(ctx.env, job, checkpoint_dir=str(checkpoints), events=events)

    attempts = launch_with_restarts(build_plan(job).placement.world_size, target, max_restarts=1, timeout_s=120)
    assert marker.exists() and len(attempts) == 2 and not attempts[0].ok
    return attempts[-1].raise_on_failure().values


@pytest.mark.slow
def test_a_killed_run_with_zero_1_resumes_bit_identical_to_an_uninterrupted_one(tmp_path):
    """Rank 3 (stage 1) dies at step 5; the checkpoint of step 3 holds each rank's ZeRO-1 shard of the
    optimizer state; the data of every step depends only on (seed, step)."""
    job = make_job(
        "eager-1f1b", 1, steps=8, optimizer={"zeroStage": 1}, checkpoint={"every": 3, "path": str(tmp_path / "unused")}
    )
    whole = run_job(job)
    resumed = run_with_kill(job, tmp_path / "ckpt", kill_rank=3, kill_step=5)
    assert {r.start_step for r in resumed} == {3}  # every rank had written step 3 before rank 3 finished 5
    assert pipeline_losses(resumed)[0] == pipeline_losses(whole)[0][3:]
    after, expected = full_parameters([r.params for r in resumed]), full_parameters([r.params for r in whole])
    for name, weight in expected.items():
        assert torch.equal(after[name], weight), name


CUSTOM_MODEL = {
    "kind": "custom",
    "entrypoint": "conv_lm:build",
    "config": {"kernel": 3, "tieEmbeddings": True},
    "layers": 4,
    "hidden": 16,
    "vocab": 256,
    "seqLen": 8,
}
CUSTOM_STAGES = [
    {"layers": [0, 1], "mesh": [1, 2], "dataParallelDim": 1},
    {"layers": [1, 3], "mesh": [1, 1]},
    {"layers": [3, 4], "mesh": [2, 1], "dataParallelDim": 0},
]


@pytest.fixture
def conv_lm(monkeypatch):
    monkeypatch.syspath_prepend(str(CUSTOM))  # forked ranks inherit it


@pytest.mark.slow
def test_a_custom_model_from_its_package_trains_like_its_reference_and_resumes(conv_lm, tmp_path):
    """examples/custom_model's causal-convolution model: its blocks cut into 3 stages, data parallel on
    two, the embedding and the head sharing their weight across the first and the last stage."""
    job = make_job(
        "eager-1f1b",
        1,
        model=CUSTOM_MODEL,
        stages=CUSTOM_STAGES,
        steps=4,
        checkpoint={"every": 2, "path": str(tmp_path / "unused")},
    )
    ref = reference_for_job(job)
    whole = run_job(job)
    losses = pipeline_losses(whole)
    assert len(losses) == 2 and losses[0] == pytest.approx(ref.losses, abs=1e-5)
    weights = full_parameters([r.params for r in whole])
    for name, expected in ref.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)
    resumed = run_with_kill(job, tmp_path / "ckpt", kill_rank=0, kill_step=3)
    assert {r.start_step for r in resumed} == {2}
    assert pipeline_losses(resumed)[0] == pytest.approx(losses[0][2:], abs=1e-6)
