"""`meshjob bench tune --parts hand`: the tuned plan against hand-written ones, all predicted by the one model
`meshjob simulate` uses for a tuned manifest."""

from __future__ import annotations

import pytest

from meshjob.spec.manifest import parse_job
from meshjob_bench import tune_hand


def test_the_hand_written_plans_include_megatrons_on_the_whole_cluster_and_on_fewer_hosts():
    plans = tune_hand.hand_written("gpt", 8)
    assert "megatron-1f1b S=8 M=32" in plans and "megatron-eager S=8 M=16" in plans
    assert "megatron-1f1b S=1 M=1 on 1 hosts" in plans and "megatron-eager S=2 M=4 on 2 hosts" in plans
    assert "readme example" in plans and "one layer per device, 1f1b" in plans
    for name, doc in plans.items():
        job = parse_job(doc)
        hosts = max(1, sum(st.mesh[0] for st in job.stages if st.mesh[1:] == (2,)))
        assert hosts <= 8, name
        assert all(st.tensor_parallel_dim != 0 for st in job.stages), name  # TP stays inside a host


def test_the_targets_need_every_case_at_least_even_and_the_u_transformer_at_1_2x():
    rows = [
        {"model": "gpt", "hand_over_tuned": 1.0},
        {"model": "utransformer", "hand_over_tuned": 1.25},
        {"model": "utransformer", "hand_over_tuned": 1.19},
    ]
    assert tune_hand.targets(rows) == {"never_worse": True, "utransformer_at_least_1_2x": False}
    rows[2]["hand_over_tuned"] = 1.2
    assert tune_hand.targets(rows)["utransformer_at_least_1_2x"] is True
    rows[0]["hand_over_tuned"] = 0.99
    assert tune_hand.targets(rows)["never_worse"] is False


@pytest.mark.slow
def test_a_case_predicts_the_tuned_plan_as_simulate_does_and_is_never_worse_than_the_hand_written():
    case = tune_hand.run_case("utransformer", 8, "100gbit")  # asserts tune's prediction == simulate's
    assert case["hand_over_tuned"] >= 1.0
    assert case["best_hand_written_step_s"] == min(v for v in case["hand_written"].values() if v is not None)
    assert case["nic_rate"] == "100gbit" and case["optimality_gap"] >= 0
