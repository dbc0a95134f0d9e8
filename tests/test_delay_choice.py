"""weightGradDelay auto picks its delays by simulating candidates on the plan's own network and costs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import parse_device
from meshjob.network.model import NetworkModel
from meshjob.plan import comm_order, delay_choice
from meshjob.plan.build import build_plan
from meshjob.plan.delay_choice import DelayCandidate, candidate_delays, global_delays, pick, warmup_leads
from meshjob.schedule.actions import generate, peak_stashed, stash_bound
from meshjob.simulate.simulator import compute_costs, plan_cost, transfer_costs
from meshjob.simulate.steady import plan_period_s
from meshjob.spec.manifest import job_to_dict, load_job, parse_job

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def with_schedule(job: Any, kind: str, delay: Any = "auto") -> Any:
    doc = job_to_dict(job)
    doc["spec"]["schedule"] = {"kind": kind, "weightGradDelay": delay}
    return parse_job(doc)


def step_s(plan: Any) -> float:
    """The plan's steady-state period on its own costs, in its own transfer order: what the choice rates."""
    return plan_period_s(plan, plan_cost(plan))


def queued_gradients_job() -> Any:
    """4 stages of a small GPT on (1, 2) meshes, M = 8, emulated 1 TFLOP/s devices on 1 gbit NICs: each
    stage's gradient fits under one W by the ratio rule, but the step's transfers share the NICs."""
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "queued-gradients"},
            "spec": {
                "model": {"kind": "gpt", "layers": 8, "hidden": 256, "heads": 8, "vocab": 256, "seqLen": 64},
                "training": {"globalBatch": 32, "microbatches": 8},
                "topology": {"devicesPerHost": 2},
                "stages": [{"layers": [2 * i, 2 * i + 2], "mesh": [1, 2], "tensorParallelDim": 1} for i in range(4)],
                "schedule": {"kind": "eager-1f1b", "weightGradDelay": "auto"},
            },
        }
    )


def emulated_cost(job: Any) -> CostModel:
    return CostModel(
        network=NetworkModel(nic_bytes_per_s=1e9 / 8), stages=emulated_costs(job, parse_device("1")), measured=True
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("kind", ["eager-1f1b", "1f1b"])
def test_simulated_delays_never_raise_a_stash_above_the_bound_on_any_example(path: Path, kind: str) -> None:
    job = with_schedule(load_job(str(path)), kind)
    edges = [(e.src, e.dst, e.tensor) for e in job.edges]
    undelayed = peak_stashed(generate(kind, len(job.stages), job.training.microbatches, edges, True, {}))
    bound = stash_bound(len(job.stages), job.training.microbatches)
    for layer_forward_s in (1e-6, 2.5e-4, 1e-2):
        plan = build_plan(job, cost=CostModel(layer_forward_s=layer_forward_s, measured=True))
        assert plan.delay_choice is not None and plan.delay_choice.simulated
        for candidate in plan.delay_choice.candidates:  # every candidate, not only the one taken
            lists = generate(kind, len(job.stages), job.training.microbatches, edges, True, candidate.delays)
            for stage, peak in peak_stashed(lists).items():
                assert peak <= max(bound, undelayed[stage]), (path.stem, candidate)
        assert plan.weight_delay == dict(plan.delay_choice.chosen.delays)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_simulated_choice_is_never_slower_than_the_ratio_rule(path: Path) -> None:
    job = with_schedule(load_job(str(path)), "eager-1f1b")
    for nic_bytes_per_s in (1e6, 1e9 / 8, 1e12):
        chosen = build_plan(job, nic_bytes_per_s=nic_bytes_per_s)
        rule = build_plan(job, nic_bytes_per_s=nic_bytes_per_s, simulate_delays=False)
        assert rule.delay_choice is None and rule.weight_delay == dict(chosen.delay_choice.rule.delays)
        assert step_s(chosen) <= step_s(rule) * (1 + 1e-9)
        assert step_s(chosen) == pytest.approx(chosen.delay_choice.chosen.step_s)


def test_where_the_steps_transfers_share_the_nics_the_rule_delays_too_little_and_a_larger_delay_is_faster() -> None:
    job = queued_gradients_job()
    cost = emulated_cost(job)
    rule = build_plan(job, cost=cost, network=cost.network, simulate_delays=False)
    chosen = build_plan(job, cost=cost, network=cost.network)
    assert rule.weight_delay == {0: 0, 1: 1, 2: 1, 3: 1}  # ceil(comm / W) = 1 on every stage that sends gradients
    assert all(chosen.weight_delay[s] > rule.weight_delay[s] for s in (1, 2, 3))
    assert step_s(chosen) < 0.95 * step_s(rule)
    assert max(peak_stashed(chosen.schedules).values()) <= stash_bound(4, 8)


def test_the_plan_takes_the_chosen_candidates_transfer_order_without_simulating_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = queued_gradients_job()
    cost = emulated_cost(job)
    plan = build_plan(job, cost=cost, network=cost.network)
    assert plan.delay_choice.chosen.order is not None
    recomputed = comm_order.transfer_order(plan)  # what every rank would derive from the plan alone
    monkeypatch.setattr(comm_order, "fastest_order", lambda *a, **k: pytest.fail("simulated again"))
    assert plan.transfer_order == recomputed
    changed = dataclasses.replace(plan, schedules=dict(plan.schedules))  # a changed plan computes its own
    with pytest.raises(pytest.fail.Exception, match="simulated again"):
        _ = changed.transfer_order


def test_an_integer_weight_grad_delay_still_forces_the_delay() -> None:
    job = with_schedule(queued_gradients_job(), "eager-1f1b", 2)
    cost = emulated_cost(job)
    plan = build_plan(job, cost=cost, network=cost.network)
    assert plan.weight_delay == {0: 0, 1: 2, 2: 2, 3: 2} and plan.delay_choice is None
    assert plan.to_json()["schedule"]["delay_choice"] is None


def test_pick_takes_the_smallest_within_tolerance_and_never_slower_than_the_rule() -> None:
    def c(name: str, delay: int, step: float) -> DelayCandidate:
        return DelayCandidate(name, {0: 0, 1: delay}, step)

    assert pick([c("rule", 1, 10.0), c("d=0", 0, 11.0), c("d=4", 4, 9.0), c("d=6", 6, 8.95)]).name == "d=4"
    # d=1 is slower than the rule, d=3 larger than it: the rule
    assert pick([c("rule", 2, 10.0), c("d=1", 1, 10.05), c("d=3", 3, 9.95)]).name == "rule"
    assert pick([c("rule", 2, 10.0), c("d=1", 1, 10.05), c("d=3", 3, 9.0)]).name == "d=3"
    assert pick([c("rule", 2, 10.0), c("d=1", 1, 10.0)]).name == "d=1"  # as fast, smaller
    assert pick([c("rule", 3, 10.0), c("d=3", 3, 10.0)]).name == "rule"  # ties go to the earlier
    with pytest.raises(ValueError, match="tolerance -0.1 is invalid"):
        pick([c("rule", 1, 1.0)], tolerance=-0.1)


def test_candidates_are_the_rule_one_global_delay_and_the_rule_raised_each_capped_by_the_stages_room() -> None:
    assert global_delays(7) == [0, 1, 2, 3, 4, 6, 7] and global_delays(31) == [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 31]
    listed = candidate_delays({0: 0, 1: 1, 2: 2, 3: 0}, {0: 0, 1: 4, 2: 3, 3: 4})
    assert listed == [
        ("rule", {0: 0, 1: 1, 2: 2, 3: 0}),
        ("d=0", {0: 0, 1: 0, 2: 0, 3: 0}),
        ("d=1", {0: 0, 1: 1, 2: 1, 3: 1}),
        ("d=2", {0: 0, 1: 2, 2: 2, 3: 2}),
        ("d=3", {0: 0, 1: 3, 2: 3, 3: 3}),
        ("d=4", {0: 0, 1: 4, 2: 3, 3: 4}),
        ("rule+1", {0: 0, 1: 2, 2: 3, 3: 1}),
        ("rule+2", {0: 0, 1: 3, 2: 3, 3: 2}),
        ("rule+3", {0: 0, 1: 4, 2: 3, 3: 3}),
    ]  # rule+4 is d=4: listed once


def test_ramp_candidates_raise_the_rule_toward_the_last_stage_by_its_shorter_warm_up() -> None:
    leads = warmup_leads("eager-1f1b", 8, 8)
    assert leads == {0: 7, 1: 7, 2: 7, 3: 7, 4: 6, 5: 4, 6: 2, 7: 0}  # warm-ups min(8, 2(8-s)-1) less the last's 1
    rule, rooms = {0: 0, **{s: 1 for s in range(1, 8)}}, {0: 0, **{s: 7 for s in range(1, 8)}}
    ramps = dict(c for c in candidate_delays(rule, rooms, leads) if c[0].startswith("ramp="))
    assert ramps["ramp=7"] == {0: 0, 1: 1, 2: 1, 3: 1, 4: 1, 5: 3, 6: 5, 7: 7}
    assert ramps["ramp=4"] == {0: 0, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 4}
    assert "ramp=1" not in ramps  # the rule itself: listed once
    assert not any(name.startswith("ramp=") for name, _ in candidate_delays(rule, rooms))  # no leads, no ramps


def one_device_stages_job(stages: int) -> Any:
    """`stages` stages of a small GPT (2 layers each) on one device each, M = 8."""
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": f"stages-{stages}"},
            "spec": {
                "model": {"kind": "gpt", "layers": 2 * stages, "hidden": 256, "heads": 8, "vocab": 256, "seqLen": 64},
                "training": {"globalBatch": 32, "microbatches": 8},
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [2 * i, 2 * i + 2], "mesh": [1, 1]} for i in range(stages)],
                "schedule": {"kind": "eager-1f1b", "weightGradDelay": "auto"},
            },
        }
    )


def test_eight_stages_delay_more_ws_toward_the_last_stage_and_that_is_faster_than_one_delay_for_all() -> None:
    job = one_device_stages_job(8)  # every stage's room is 7 W's (the stash bound is M)
    cost = emulated_cost(job)
    plan = build_plan(job, cost=cost, network=cost.network)
    choice = plan.delay_choice
    assert choice.chosen.name.startswith("ramp=")
    delays = [plan.weight_delay[s] for s in range(8)]
    assert delays == sorted(delays) and delays[-1] > delays[1]
    others = [c.step_s for c in choice.candidates if not c.name.startswith("ramp=")]
    assert step_s(plan) < 0.95 * min(others)
    assert max(peak_stashed(plan.schedules).values()) <= stash_bound(8, 8)


def test_over_the_work_budget_the_rule_stands_unsimulated(monkeypatch: pytest.MonkeyPatch) -> None:
    job = queued_gradients_job()
    monkeypatch.setattr(delay_choice, "WORK_BUDGET", 0)
    plan = build_plan(job)
    assert plan.weight_delay == build_plan(job, simulate_delays=False).weight_delay
    doc = plan.to_json()["schedule"]["delay_choice"]
    assert doc == {"chosen": "rule", "simulated": False, "work_budget": 0}
    json.dumps(plan.to_json(), allow_nan=False)  # the plan contract stays plain JSON


def test_candidates_are_rated_by_their_steady_period_where_the_last_stages_ws_overlap_the_next_step() -> None:
    job = one_device_stages_job(4)  # rooms 0/2/4/6
    cost = emulated_cost(job)
    plan = build_plan(job, cost=cost, network=cost.network)
    choice = plan.delay_choice
    assert plan.weight_delay == {0: 0, 1: 2, 2: 4, 3: 6}
    pc = plan_cost(plan)
    compute, transfers = compute_costs(plan, pc), transfer_costs(plan, pc)
    edges = [(e.src, e.dst, e.tensor) for e in job.edges]

    def one_step(delays: dict) -> float:
        return comm_order.fastest_order(generate("eager-1f1b", 4, 8, edges, True, delays), compute, transfers, pc)[1]

    chosen = one_step(dict(choice.chosen.delays))
    # one isolated step rates a smaller candidate as fast, but run step after step it is slower
    smaller = [
        c for c in choice.candidates if c.size < choice.chosen.size and one_step(dict(c.delays)) <= chosen * 1.01
    ]
    assert smaller and all(c.step_s > 1.03 * choice.chosen.step_s for c in smaller)
