"""`meshjob bench tune`, part 3: the tuned manifest against hand-written ones on the emulated cluster."""

from __future__ import annotations

import json

import pytest

from meshjob.costs.devices import parse_device
from meshjob.errors import UsageError
from meshjob.spec.manifest import parse_job
from meshjob.units import parse_rate
from meshjob_bench import tune_measure as tm
from meshjob_bench.tune import main, parse_parts
from meshjob_trainer.emulate.netns import netns_available

HAVE_NETNS, WHY_NOT = netns_available()
QUICK = tm.Setting(quick=True)
FULL = tm.Setting()


def test_scaled_example_stages_keep_their_meshes_and_cover_every_layer():
    stages = [{"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1}, {"layers": [2, 8], "mesh": [2, 1]}]
    assert tm.scale_layers(stages, 8, 8) == stages
    doubled = tm.scale_layers(stages, 8, 16)
    assert [s["layers"] for s in doubled] == [[0, 4], [4, 16]]
    assert [s["mesh"] for s in doubled] == [[1, 2], [2, 1]] and doubled[0]["tensorParallelDim"] == 1


def test_scaling_to_fewer_layers_than_stages_names_the_layers():
    with pytest.raises(ValueError, match="layers 1 is invalid"):
        tm.scale_layers([{"layers": [0, 1]}, {"layers": [1, 2]}], 2, 1)


@pytest.mark.parametrize("model", tm.MODELS)
def test_hand_written_configurations_share_the_model_and_fit_the_emulated_hosts(model):
    doc = tm.model_doc(model, FULL)
    configs = tm.hand_written(doc, model, FULL)
    assert tuple(configs) == tm.HAND_WRITTEN
    for config in configs.values():
        job = parse_job(config)
        assert config["spec"]["model"] == doc["spec"]["model"]
        assert job.training.global_batch == 16 and tm.hosts_used(job) <= FULL.hosts
        assert sum(s.size for s in job.stages) == FULL.devices


def test_the_example_configuration_is_the_examples_layout():
    example = tm.hand_written(tm.model_doc("gpt", FULL), "gpt", FULL)["example"]["spec"]
    written = tm._load_example(tm.EXAMPLES["gpt"])["spec"]
    assert [s["mesh"] for s in example["stages"]] == [s["mesh"] for s in written["stages"]]
    assert example["schedule"] == written["schedule"]
    assert example["training"]["microbatches"] == written["training"]["microbatches"]


def test_the_search_plans_on_the_emulated_clusters_nics_hosts_and_device():
    cluster = tm.search_cluster(tm.Setting(hosts=3, devices_per_host=2, nic_rate="500mbit", device="2"))
    assert (cluster.hosts, cluster.devices_per_host) == (3, 2)
    assert cluster.network.nic_bytes_per_s == parse_rate("500mbit")
    assert cluster.network.burst_bytes == tm.TBF_BURST_BYTES
    assert cluster.device.profile == parse_device("2")


def test_a_data_parallel_stage_adds_its_gradient_all_reduce_and_optimizer_step_to_the_prediction():
    configs = tm.hand_written(tm.model_doc("gpt", QUICK), "gpt", QUICK)
    data_parallel = parse_job(configs["data-parallel"])
    assert tm.stage_tail_s(data_parallel, 0, QUICK) > 0
    pipeline = parse_job(configs["pipeline-1f1b"])
    assert tm.predicted_step_s(pipeline, QUICK) > 0


def _row(model, config, tokens):
    return tm.Row(model, config, "", 1, 1.0, 1.0 / tokens, tokens, tokens, search_over_measured=1.0)


def test_rows_are_ranked_against_the_best_hand_written_configuration_of_their_model():
    rows = [
        _row("gpt", "tuned", 12.0),
        _row("gpt", "example", 10.0),
        _row("gpt", "data-parallel", 5.0),
        _row("utransformer", "tuned", 3.0),
        _row("utransformer", "example", 4.0),
    ]
    tm.rank_rows(rows)
    assert [r.over_best_hand_written for r in rows] == pytest.approx([1.2, 1.0, 0.5, 0.75, 1.0])
    got = tm.targets(rows)
    assert got["tuned_over_best_hand_written"] == pytest.approx({"gpt": 1.2, "utransformer": 0.75})
    assert got["tuned_at_least_best_hand_written"] is False


def test_a_prediction_off_by_more_than_ten_percent_misses_the_target():
    rows = [_row("gpt", "tuned", 1.0), _row("gpt", "example", 1.0)]
    rows[1].predicted_over_measured = 1.15
    got = tm.targets(rows)
    assert got["prediction_within_10_percent"] is False and got["predictions_within_10_percent"] == "1 of 2"
    assert got["worst_prediction_error"] == {"run": "gpt/example", "error": pytest.approx(0.15)}
    assert got["search_prediction_within_10_percent"] is True


def test_the_search_objective_off_by_more_than_ten_percent_misses_its_target():
    rows = [_row("gpt", "tuned", 1.0), _row("gpt", "example", 1.0)]
    rows[0].search_over_measured = 0.66
    got = tm.targets(rows)
    assert got["prediction_within_10_percent"] is True and got["search_prediction_within_10_percent"] is False
    assert got["worst_search_prediction_error"] == {"run": "gpt/tuned", "error": pytest.approx(-0.34)}


def test_the_example_layouts_two_data_parallel_stages_share_their_hosts_nics_in_the_prediction():
    from meshjob.costs.device_costs import emulated_costs
    from meshjob.plan.build import build_plan
    from meshjob.search.gradient_sync import stage_hosts
    from meshjob.simulate.simulator import CostModel, simulate_plan

    doc = tm.hand_written(tm.model_doc("gpt", FULL), "gpt", FULL)["example"]
    job = parse_job(doc)
    network = tm.prediction_network(FULL)
    cost = CostModel(network=network, stages=emulated_costs(job, tm.emulated_device(FULL)), measured=True)
    plan = build_plan(job, nic_bytes_per_s=network.nic_bytes_per_s, cost=cost)
    hosts = stage_hosts(plan.placement)
    assert hosts[1] == hosts[3] and len(hosts[1]) == 2  # the two 2x1 data-parallel stages
    stages = simulate_plan(plan, cost).stages
    unshared = max(stages[k].busy_until_s + tm.stage_tail_s(job, k, FULL) for k in stages)
    assert tm.predicted_step_s(job, FULL) > 1.1 * unshared  # the rings overlap on hosts 1 and 2
    assert tm.search_step_s(doc, FULL) > 1.1 * unshared


def test_the_ranks_run_the_plan_the_prediction_simulates(monkeypatch):
    import meshjob_bench.e2e as e2e

    ran = []
    monkeypatch.setattr(
        e2e, "run", lambda job, nic_rate, compute, plan=None: (ran.append((job, plan)), (1.0, "net"))[1]
    )
    doc = tm.model_doc("utransformer", QUICK)
    monkeypatch.setattr(
        tm,
        "configurations",
        lambda model, setting: ({"example": tm.example_doc(doc, tm._load_example(tm.EXAMPLES["utransformer"]))}, None),
    )
    monkeypatch.setattr(tm, "search_step_s", lambda doc, setting: 1.0)
    tm.measure(["utransformer"], QUICK, log=lambda line: None)
    ((job, plan),) = ran
    expected, _ = tm.planned(job, QUICK)
    assert plan is not None and plan.weight_delay == expected.weight_delay  # not each rank's default plan
    assert plan.schedules == expected.schedules


def test_unknown_parts_name_the_flag_and_what_is_allowed():
    assert parse_parts("measure") == ["measure"]
    with pytest.raises(UsageError, match="--parts: 'all' is invalid: comma separated, from search, large, measure"):
        parse_parts("all")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
def test_quick_measure_writes_every_field_and_keeps_the_other_parts(tmp_path):
    (tmp_path / "tune.json").write_text(
        json.dumps({"cases": [], "large": {"hosts": 1}, "targets": {"equal_to_exhaustive": True}})
    )
    assert main(["--parts", "measure", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["large"] == {"hosts": 1} and doc["targets"]["equal_to_exhaustive"] is True
    part = doc["measured"]
    assert part["compute"] == "emulated" and part["setting"]["quick"] is True and part["timed_steps"] == 1
    rows = {r["config"]: r for r in part["rows"]}
    assert set(rows) == set(tm.CONFIGS) and set(part["jobs"]) == {f"gpt/{c}" for c in tm.CONFIGS}
    for r in rows.values():
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 and r["tokens_per_s"] > 0
        assert r["predicted_over_measured"] == pytest.approx(r["predicted_step_s"] / r["measured_step_s"])
        assert r["hosts_used"] <= part["setting"]["hosts"] and r["plan"]
    for r in rows.values():
        assert r["search_step_s"] > 0
        assert r["search_over_measured"] == pytest.approx(r["search_step_s"] / r["measured_step_s"])
    assert max(rows[c]["over_best_hand_written"] for c in tm.HAND_WRITTEN) == pytest.approx(1.0)
    assert set(doc["targets"]["measured_throughput"]) == {
        "tuned_over_best_hand_written",
        "tuned_at_least_best_hand_written",
        "worst_prediction_error",
        "predictions_within_10_percent",
        "prediction_within_10_percent",
        "worst_search_prediction_error",
        "search_predictions_within_10_percent",
        "search_prediction_within_10_percent",
    }
    assert (tmp_path / "tune_measured.png").stat().st_size > 10_000
