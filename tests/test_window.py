"""Step-level balancing: the boundaries that share a time window are balanced as one problem."""

from __future__ import annotations

from typing import Any

import pytest

from meshjob.plan.build import build_plan
from meshjob.resharding.window import BACKWARD, FORWARD, STEP, window_groups
from meshjob.schedule.actions import SCHEDULE_KINDS
from meshjob.spec.manifest import job_to_dict, load_job, parse_job
from meshjob_bench.planner import per_boundary, u_pair_job


def pair_job(**resharding: Any):
    """A U-Transformer stage pair: three tensors cross it, each replicated on both of stage 0's hosts
    (tensor parallel across them); stage 1 is data parallel over 3 hosts (meshjob_bench.planner)."""
    return u_pair_job(**resharding)


def test_windows_follow_the_schedule_kind():
    backward = [False, True, False, True]
    for kind in ("eager-1f1b", "1f1b"):
        assert window_groups(SCHEDULE_KINDS[kind].forwards_first, backward) == [(STEP, (0, 1, 2, 3))]
    assert window_groups(SCHEDULE_KINDS["gpipe"].forwards_first, backward) == [(FORWARD, (0, 2)), (BACKWARD, (1, 3))]


def test_every_boundary_of_a_step_is_balanced_in_one_window():
    plan = build_plan(pair_job())
    assert [str(b.key) for b in plan.boundaries] == [
        "0->1:activation",
        "1->0:grad:activation",
        "0->1:skip0",
        "1->0:grad:skip0",
        "0->1:skip1",
        "1->0:grad:skip1",
    ]
    assert len(plan.windows) == 1 and plan.windows[0].boundaries == tuple(range(6))
    assert {b.window for b in plan.boundaries} == {0}


@pytest.mark.parametrize("balancer", ["load_balance", "dfs", "greedy"])
def test_joint_balancing_beats_per_boundary_balancing_on_a_u_transformer_stage_pair(balancer):
    # Alone, each forward boundary sends two of its three thirds from stage 0's first host (the
    # tie-break), whose out-link also forwards every gradient chain to the second host: it carries
    # 5 tensors' worth. Together, the planner moves the forward thirds to the second host.
    plan = build_plan(pair_job(balancer=balancer))
    joint, (alone,) = plan.windows[0], per_boundary(plan)
    assert joint.makespan_s <= 0.7 * alone.makespan_s
    forward_senders = {plan.placement.host_of(r) for b in plan.boundaries if not b.is_backward for r in b.senders}
    assert forward_senders == {1}  # host 0's out-link forwards the gradient chains


def test_joint_shares_keep_the_joint_sender_choice_and_are_timed_alone():
    plan = build_plan(pair_job())
    joint = plan.windows[0]
    for b, first in zip(plan.boundaries, joint.offsets):
        n = len(b.tasks)
        assert b.schedule.sender_host == joint.schedule.sender_host[first : first + n]
        assert b.makespan_s <= joint.makespan_s + 1e-12


def test_gpipe_balances_forward_and_backward_boundaries_in_separate_windows():
    doc = job_to_dict(pair_job())
    doc["spec"]["schedule"] = {"kind": "gpipe", "weightGradDelay": 0}
    plan = build_plan(parse_job(doc))
    assert [w.name for w in plan.windows] == [FORWARD, BACKWARD]
    assert all(plan.boundaries[i].is_backward == (w.name == BACKWARD) for w in plan.windows for i in w.boundaries)


def test_the_u_transformer_examples_step_is_within_10_percent_of_its_lower_bound():
    plan = build_plan(load_job("examples/utransformer-demo.yaml"))
    (step,) = plan.windows
    assert step.name == STEP and len(step.boundaries) == len(plan.boundaries)
    assert step.makespan_s <= 1.1 * step.lower_bound_s


def test_quick_planner_bench_reports_both_network_models_and_joint_vs_per_boundary(tmp_path):
    import json

    from meshjob_bench.planner import main

    assert main(["--quick", "--budget", "0.1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "planner.json").read_text())
    assert doc["config"]["network_model"]["duplex"] == "full" and set(doc["config"]["models"]) == {"full", "half"}
    for row in doc["rows"]:
        assert row["ratio_to_bound"] >= 1 - 1e-9 and row["half_ratio_to_bound"] >= 1 - 1e-9
        assert row["half_on_full_ratio_to_bound"] >= 1 - 1e-9
    pair = [w for w in doc["windows"] if w["case"].startswith("U-Transformer pair") and w["balancer"] == "greedy"]
    assert pair and pair[0]["joint_speedup"] > 1.4
    assert (tmp_path / "planner.png").stat().st_size > 0


def test_every_task_of_a_window_counts_the_window_on_the_shared_cores():
    from meshjob.network.host_task import HostTask
    from meshjob.resharding.window import with_shares

    tasks = with_shares([HostTask((0,), (2,), 10), HostTask((0,), (2,), 10), HostTask((1,), (3,), 10)])
    assert [t.share for t in tasks] == [2, 2, 1]  # two queue on host 2's in-link
    assert [t.cpu_share for t in tasks] == [3, 3, 3]
