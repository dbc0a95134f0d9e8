"""The calibrated weight-gradient delay: least that covers the gradient transfers, within the stash bound."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from meshjob.costs.compute import CostModel, StageCost
from meshjob.plan.build import build_plan
from meshjob.schedule.actions import generate, peak_stashed, stash_bound
from meshjob.spec.manifest import job_to_dict, load_job, parse_job

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
# From "almost free" to "far slower than any transfer" weight gradients
LAYER_FORWARD_S = (1e-9, 1e-6, 2.5e-4, 1e-2, 1.0)


def with_schedule(job, kind: str, delay: Any = "auto"):
    doc = job_to_dict(job)
    doc["spec"]["schedule"] = {"kind": kind, "weightGradDelay": delay}
    return parse_job(doc)


def undelayed_peaks(plan) -> dict[int, int]:
    edges = [(e.src, e.dst, e.tensor) for e in plan.job.edges]
    lists = generate(plan.job.schedule.kind, len(plan.job.stages), plan.job.training.microbatches, edges, True, {})
    return peak_stashed(lists)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("kind", ["eager-1f1b", "1f1b"])
@pytest.mark.parametrize("layer_forward_s", LAYER_FORWARD_S)
def test_calibrated_delay_respects_the_stash_bound_on_every_example(path, kind, layer_forward_s):
    job = with_schedule(load_job(str(path)), kind)
    cost = CostModel(layer_forward_s=layer_forward_s, measured=True)
    plan = build_plan(job, cost=cost)
    bound = stash_bound(len(job.stages), job.training.microbatches)
    base = undelayed_peaks(plan)
    for stage, peak in peak_stashed(plan.schedules).items():
        assert peak <= max(bound, base[stage]), (stage, plan.weight_delay)


def gpt_of_the_issue() -> Any:
    """Issue 9's case: 4 stages, hidden 1024, sequence 512, 8 microbatches (delays 7, stashes [7,8,8,8])."""
    doc = job_to_dict(load_job("examples/gpt-demo.yaml"))
    doc["spec"]["model"].update({"hidden": 1024, "heads": 8, "seqLen": 512})
    doc["spec"]["training"].update({"microbatches": 8, "globalBatch": 16})
    return parse_job(doc)


def test_the_issues_gpt_no_longer_stashes_like_gpipe():
    plan = build_plan(gpt_of_the_issue())
    assert max(peak_stashed(plan.schedules).values()) <= 7  # min(M, 2S-1)
    assert plan.weight_delay[3] <= 6 and plan.weight_delay[1] <= 2


def test_the_ratio_rule_delays_the_least_number_of_w_that_covers_the_gradient_transfers():
    """The rule alone (what the search sizes auto delays with, and the first candidate build_plan simulates)."""
    job = gpt_of_the_issue()
    for layer_forward_s in (3e-3, 1e-2, 1e-1):  # W from a sixth of the transfer to ten times it
        plan = build_plan(job, cost=CostModel(layer_forward_s=layer_forward_s, measured=True), simulate_delays=False)
        for stage, delay in plan.weight_delay.items():
            comm = sum(b.makespan_s for b in plan.boundaries if b.is_backward and b.src == stage)
            w = plan.stage_costs[stage].weight_grad_s
            if comm == 0:
                assert delay == 0
            elif delay < min(math.ceil(comm / w), job.training.microbatches - 1):  # capped by the stash bound
                assert peak_stashed(plan.schedules)[stage] == stash_bound(4, 8)
            else:
                assert (delay - 1) * w < comm <= delay * w or delay == job.training.microbatches - 1


def test_measured_per_stage_costs_size_the_delays_and_are_part_of_the_plan():
    job = gpt_of_the_issue()
    slow_w = CostModel(stages=tuple(StageCost(1e-3, 1e-3, 1.0) for _ in range(4)), measured=True)
    fast_w = CostModel(stages=tuple(StageCost(1e-3, 1e-3, 1e-6) for _ in range(4)), measured=True)
    slow, fast = build_plan(job, cost=slow_w), build_plan(job, cost=fast_w)
    slow_rule, fast_rule = slow.delay_choice.rule.delays, fast.delay_choice.rule.delays
    assert all(slow_rule[s] <= 1 for s in range(4))  # one W covers any transfer
    assert fast_rule[3] > slow_rule[3]
    doc = slow.to_json()
    assert doc["costs"]["measured"] is True and doc["costs"]["stages"]["3"] == {"F": 1e-3, "I": 1e-3, "W": 1.0}
    assert slow.digest() != fast.digest()


def test_measured_costs_for_the_wrong_number_of_stages_are_refused():
    with pytest.raises(ValueError, match="cost model has 2 measured stages, the job 'gpt-demo' has 4"):
        build_plan(load_job("examples/gpt-demo.yaml"), cost=CostModel(stages=(StageCost(1, 1, 1),) * 2))


def test_a_spelled_out_delay_is_taken_as_asked_capped_at_m_minus_1():
    job = with_schedule(load_job("examples/gpt-demo.yaml"), "eager-1f1b", 1)
    assert build_plan(job).weight_delay == {0: 0, 1: 1, 2: 1, 3: 1}
