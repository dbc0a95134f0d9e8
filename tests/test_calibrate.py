"""Calibration at the start of a run (weightGradDelay: auto): every rank profiles its stage, all ranks
agree on one figure per stage, re-plan, and run the same plan, whose delays keep every stage's stash
within eager-1F1B's bound."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshjob.costs.compute import StageCost
from meshjob.plan.build import build_plan
from meshjob.schedule.actions import peak_stashed, peak_stashed_stage, stage_actions, stash_bound
from meshjob.spec.manifest import load_job

EXAMPLES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def with_auto_delay(job):
    return dataclasses.replace(
        job, schedule=dataclasses.replace(job.schedule, kind="eager-1f1b", weight_grad_delay="auto")
    )


def calibrate_everywhere(gang, plan):
    """Every rank calibrates `plan`; each returns (its plan's digest, the plan)."""
    from meshjob_trainer.calibrate import calibrate
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    def target(env):
        init_distributed(env, timeout_s=30)
        try:
            mine = calibrate(plan, env.rank)
            return mine.digest(), mine
        finally:
            shutdown_distributed()

    return gang(plan.placement.world_size, target, timeout_s=120)


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_every_rank_runs_one_calibrated_plan_within_the_stash_bound(gang, example):
    plan = build_plan(with_auto_delay(load_job(example)))
    results = calibrate_everywhere(gang, plan)
    digests = {digest for digest, _ in results}
    calibrated = results[0][1]
    assert len(digests) == 1 and calibrated.costs_measured and not plan.costs_measured
    assert calibrated.stage_costs != plan.stage_costs  # measured here, not the formula's figures
    assert all(c.forward_s > 0 and c.weight_grad_s > 0 for c in calibrated.stage_costs.values())
    job = calibrated.job
    stages, microbatches = len(job.stages), job.training.microbatches
    bound = stash_bound(stages, microbatches)
    edges = [(e.src, e.dst, e.tensor) for e in job.edges]
    for stage, peak in peak_stashed(calibrated.schedules).items():
        undelayed = peak_stashed_stage(stage_actions("eager-1f1b", stage, stages, microbatches, edges, True, 0))
        assert peak <= max(bound, undelayed), f"stage {stage} stashes {peak} > bound {bound}"


@pytest.mark.slow
def test_each_stage_gets_its_slowest_ranks_figures_on_every_rank(gang):
    from meshjob_trainer.calibrate import agree
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    stage_of = [0, 0, 1, 1]

    def target(env):
        init_distributed(env, timeout_s=30)
        try:
            r = env.rank
            return agree(StageCost(0.1 * (r + 1), 0.01 * (r + 1), 0.5 - 0.1 * r), stage_of[r], 2)
        finally:
            shutdown_distributed()

    agreed = gang(4, target)
    assert all(a == agreed[0] for a in agreed)
    assert agreed[0][0] == pytest.approx(StageCost(0.2, 0.02, 0.5))
    assert agreed[0][1] == pytest.approx(StageCost(0.4, 0.04, 0.3))


def test_only_an_auto_delay_with_a_split_backward_is_calibrated():
    from meshjob_trainer.calibrate import needs_calibration

    job = load_job(EXAMPLES[0])
    assert needs_calibration(build_plan(with_auto_delay(job)))
    for fixed in (0, 1):
        plan = build_plan(dataclasses.replace(job, schedule=dataclasses.replace(job.schedule, weight_grad_delay=fixed)))
        assert not needs_calibration(plan)


@pytest.mark.slow
def test_the_worker_calibrates_and_reports_every_stages_delay(gang, capfd):
    """Through run_worker: the events each rank emits name its stage's delay, measured costs, its peak
    stash and the bound; rank 0's log line says the same."""
    from meshjob_trainer.dist import WorkerSettings
    from meshjob_trainer.worker import JobSetup, run_worker

    job = with_auto_delay(load_job(EXAMPLES[0]))
    job = dataclasses.replace(
        job,
        training=dataclasses.replace(
            job.training, steps=1, checkpoint=dataclasses.replace(job.training.checkpoint, every=0, path="")
        ),
    )
    plan = build_plan(job)

    class Collect:
        def __init__(self):
            self.events = []

        def emit(self, event):
            self.events.append(event)

    def target(env):
        sink = Collect()
        run_worker(env, WorkerSettings(), JobSetup(job, plan), timeout_s=60, listeners=(sink,))
        return [e for e in sink.events if type(e).__name__ == "WeightDelay"]

    reported = gang(plan.placement.world_size, target, timeout_s=180)
    bound = stash_bound(len(job.stages), job.training.microbatches)
    for rank, events in enumerate(reported):
        (event,) = events
        assert event.stage == plan.placement.stage_of(rank) and event.measured and event.stash_bound == bound
    log = capfd.readouterr().err
    assert "weightGradDelay auto (costs: measured at start" in log and "stage 3: delay" in log
