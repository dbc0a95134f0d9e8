"""Stashed activations measured by the executor (microbatches forwarded and not yet fully
backwarded) against the schedules' memory bounds: eager-1f1b's stage i holds
min(M, 2(S-i)-1) microbatches (§4 of
"On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022)), 1f1b min(M, S-i), gpipe all M."""

from __future__ import annotations

import pytest
from test_pipeline_equivalence import make_job, run_job  # noqa: E402 - tests dir is on sys.path

from meshjob.plan.build import build_plan
from meshjob.schedule.actions import peak_stashed_stage, warmup_forwards

ONE_DEVICE_STAGES = [{"layers": [2 * s, 2 * s + 2], "mesh": [1, 1]} for s in range(4)]
MICROBATCHES = 8


def measured_peaks(schedule: str, delay: int | str) -> tuple[dict[int, int], object]:
    job = make_job(
        "gpt", schedule, delay, stages=ONE_DEVICE_STAGES, steps=1, global_batch=MICROBATCHES, microbatches=MICROBATCHES
    )
    results = run_job(job)
    return {r.stage: r.stats.peak_stashed for r in results}, build_plan(job)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["eager-1f1b", "1f1b", "gpipe"])
def test_peak_stashed_activations_per_stage_equal_the_warmup_count(schedule):
    peaks, _ = measured_peaks(schedule, 0)
    assert peaks == {s: warmup_forwards(schedule, s, 4, MICROBATCHES) for s in range(4)}


def test_eager_1f1b_warmup_is_the_papers_bound():
    assert [warmup_forwards("eager-1f1b", s, 4, MICROBATCHES) for s in range(4)] == [7, 5, 3, 1]
    assert [warmup_forwards("eager-1f1b", s, 4, 4) for s in range(4)] == [4, 4, 3, 1]


@pytest.mark.slow
def test_delayed_weight_gradients_keep_stashes_alive_as_the_action_list_says():
    peaks, plan = measured_peaks("eager-1f1b", 1)
    assert any(d > 0 for d in plan.weight_delay.values())
    assert peaks == {s: peak_stashed_stage(plan.schedules[s]) for s in range(4)}
    # a delayed W keeps one more microbatch's graph alive on the stages that delay
    for s, delay in plan.weight_delay.items():
        assert peaks[s] == min(MICROBATCHES, warmup_forwards("eager-1f1b", s, 4, MICROBATCHES) + delay)
