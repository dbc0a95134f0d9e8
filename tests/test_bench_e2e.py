"""`meshjob bench e2e` (figure 7): the three configurations of one job, a smoke run on the emulated cluster."""

from __future__ import annotations

import json
import os

import pytest

from meshjob.costs.devices import parse_compute
from meshjob.plan.build import build_plan
from meshjob.simulate.simulator import simulate_plan
from meshjob_bench.e2e import CONFIGS, DEVICES_PER_HOST, HOSTS, bench_job, main, planned, predicted_step_s
from meshjob_bench.pipeline import TBF_BURST_BYTES, TCP_PAYLOAD_PER_FRAME_BYTE


@pytest.mark.parametrize("model", ["gpt", "utransformer"])
def test_every_configuration_runs_the_same_model_on_the_same_hosts_with_dp_tp_pp(model):
    plans = {c: build_plan(bench_job(model, c, 2, quick=False)) for c in CONFIGS}
    placements = {c: [p.placement.host_of(r) for r in range(p.placement.world_size)] for c, p in plans.items()}
    assert len({tuple(h) for h in placements.values()}) == 1
    hosts = next(iter(placements.values()))
    assert len(hosts) == HOSTS * DEVICES_PER_HOST and len(set(hosts)) == HOSTS
    job = bench_job(model, "meshjob", 2, quick=False)
    assert all(s.data_parallel == 1 and s.tensor_parallel == 2 for s in job.stages) and len(job.stages) == 8


def test_the_configurations_are_meshjobs_alpas_and_the_signal_bound():
    mine, alpa, bound = (bench_job("gpt", c, 2, quick=True) for c in ("meshjob", "alpa", "signal"))
    assert (mine.resharding.strategy, mine.resharding.balancer, mine.schedule.kind) == (
        "broadcast",
        "greedy",
        "eager-1f1b",
    )
    assert (alpa.resharding.strategy, alpa.resharding.balancer, alpa.schedule.kind) == (
        "local_allgather",
        "naive",
        "1f1b",
    )
    assert bound.resharding.strategy == "signal" and bound.schedule == mine.schedule


def test_the_ranks_plan_and_the_prediction_are_made_for_the_emulated_nics_they_run_on():
    job = bench_job("utransformer", "meshjob", 2, quick=True)
    plan, cost = planned(job, parse_compute("emulated", "1"), "1gbit")
    assert plan.network == cost.network  # transfer order, receives posted ahead and W delay planned on it
    assert cost.network.burst_bytes == TBF_BURST_BYTES  # tbf's bucket
    assert cost.network.nic_bytes_per_s == pytest.approx(1e9 / 8 * TCP_PAYLOAD_PER_FRAME_BYTE)  # TCP payload
    assert cost.network.shared_cpu_cores >= 1  # every host's ranks on this machine's cores


def test_the_prediction_ends_after_the_slowest_stage_s_optimizer_step():
    job = bench_job("gpt", "alpa", 2, quick=True)
    compute = parse_compute("emulated", "1")
    plan, cost = planned(job, compute, "1gbit")
    simulated = simulate_plan(plan, cost)
    predicted = predicted_step_s(job, plan, cost, compute)
    assert predicted > simulated.step_s
    assert predicted <= simulated.step_s + max(c.forward_s + c.backward_s for c in cost.stage_costs(job).values())


@pytest.mark.slow
def test_quick_run_writes_ratios_predictions_a_json_and_a_png(tmp_path):
    out = tmp_path / "results"
    assert main(["--quick", "--out", str(out)]) == 0
    report = json.loads((out / "e2e.json").read_text())
    assert report["compute"] == "emulated" and report["device"]["tflops"] == 1.0
    assert report["transport"] == "gloo" and report["machine"]["torch"]
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == set(CONFIGS)
    assert rows["alpa"]["vs_alpa"] == pytest.approx(1.0) and rows["signal"]["vs_signal"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["simulated_step_s"] > 0
        assert row["simulated_over_measured"] == pytest.approx(row["simulated_step_s"] / row["step_s"])
    assert set(report["jobs"]) == {f"gpt/{c}" for c in CONFIGS}
    assert os.path.getsize(out / "e2e.png") > 10_000
