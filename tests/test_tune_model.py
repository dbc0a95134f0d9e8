"""`meshjob tune` is exact where it says so and predicts what `meshjob simulate` says: on generated small spaces
(every microbatch count and schedule) its default budget returns the exhaustive optimum, every candidate's bound
is below its predicted step, and the winner's prediction is `meshjob simulate`'s of the written manifest."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshjob.cli import main
from meshjob.network.model import NetworkModel
from meshjob.search.algorithm import Prediction, Problem, default_space, exhaustive, search
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.problem import SCHEDULES, Candidate
from meshjob.search.settings import DEFAULT_NIC_RATE, resolve
from meshjob.spec.model import TunedForSpec


def manifest(layers: int, hidden: int, batch: int, seq: int) -> dict:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"kind": "gpt", "layers": layers, "hidden": hidden, "heads": 4, "vocab": 256, "seqLen": seq},
            "training": {"globalBatch": batch},
        },
    }


def small_problem(layers: int, hidden: int, batch: int, seq: int, shape: tuple[int, int], nic_gbit: float) -> Problem:
    doc = manifest(layers, hidden, batch, seq)
    device = DEVICES["h100"]
    network = NetworkModel(nic_bytes_per_s=nic_gbit * 1e9 / 8, intra_host_bytes_per_s=device.link_bytes_per_s)
    cluster = Cluster(shape[0], shape[1], device, network)
    fixed = read_fixed(doc)
    job = base_job(doc, shape[1])
    space = replace(default_space(job, fixed, cluster), strategies=("broadcast",), balancers=("greedy",))
    return Problem(doc, job, cluster, fixed, space)


def checked(problem: Problem) -> Problem:
    """Every prediction made once (exhaustive and the search share them), each checked against its bound."""
    cache: dict[Candidate, Prediction | None] = {}
    predict = problem.predict

    def once(c: Candidate) -> Prediction | None:
        if c not in cache:
            cache[c] = predict(c)
            p = cache[c]
            assert p is None or problem.bound(c) <= p.step_s * (1 + 1e-9), c.label()
        return cache[c]

    problem.predict = once  # type: ignore[method-assign]
    return problem


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(2, 3),
    hidden=st.sampled_from([64, 128]),
    batch=st.sampled_from([2, 4]),
    seq=st.sampled_from([16, 64]),
    shape=st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4)]),
    nic_gbit=st.sampled_from([0.1, 1.0, 100.0]),
)
def test_the_default_budget_finds_the_exhaustive_optimum_on_small_spaces(layers, hidden, batch, seq, shape, nic_gbit):
    p = checked(small_problem(layers, hidden, batch, seq, shape, nic_gbit))
    assert p.space.schedules == SCHEDULES  # every schedule, every microbatch count dividing the batch
    best = exhaustive(p)
    found = search(p)  # the default budget
    assert found.proven and found.gap == 0.0
    assert found.best.step_s == best.step_s


def test_a_budget_cut_short_states_its_optimality_gap():
    p = small_problem(4, 128, 8, 64, (2, 2), 1.0)
    r = search(p, max_evaluations=1)
    assert r.evaluated == 1
    if not r.proven:
        assert r.gap == pytest.approx(r.best.step_s / r.threshold_s - 1)
        assert r.gap > 0


DEMO = "examples/gpt-demo.yaml"


def open_demo(tmp_path, layers: int = 4) -> str:
    doc = yaml.safe_load(open(DEMO))
    spec = doc["spec"]
    for key in ("stages", "edges", "schedule", "resharding"):
        spec.pop(key)
    spec["training"].pop("microbatches")
    spec["model"]["layers"] = layers
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("flags", [[], ["--nic-rate", "100gbit", "--device", "a100"]])
def test_tunes_prediction_is_what_simulate_says_of_the_written_manifest(tmp_path, capsys, flags):
    job, out = open_demo(tmp_path), tmp_path / "tuned.yaml"
    assert main(["tune", job, "--hosts", "2", "--devices-per-host", "2", "--out", str(out), "--json", *flags]) == 0
    tuned = json.loads(capsys.readouterr().out)
    written = yaml.safe_load(out.read_text())["spec"]["tunedFor"]
    assert written["hosts"] == 2 and written["nicRate"] == (flags[1] if flags else DEFAULT_NIC_RATE)
    assert main(["simulate", str(out), "--json"]) == 0  # no flags: the manifest's tunedFor
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["model"] == "tuned"
    assert simulated["step_s"] == pytest.approx(tuned["ranked"][0]["step_s"], rel=1e-12)
    other = "h100" if flags else "a100"
    assert main(["simulate", str(out), "--json", "--device", other]) == 0  # a flag wins over tunedFor
    assert json.loads(capsys.readouterr().out)["cluster"]["device"]["name"] == other


def test_plan_builds_the_tuned_plan_on_the_cluster_it_was_tuned_for(tmp_path, capsys):
    out = tmp_path / "tuned.yaml"
    assert main(["tune", open_demo(tmp_path), "--hosts", "3", "--devices-per-host", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--json", "--skip-files"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nic_bytes_per_s"] == 1e9 / 8
    assert plan["costs"]  # the stage model's compute


def test_flags_win_over_tuned_for_which_wins_over_the_defaults():
    tuned = TunedForSpec(hosts=4, nic_rate="100gbit", device="a100", memory="40Gi")
    assert resolve(None).nic_rate == DEFAULT_NIC_RATE
    s = resolve(tuned, nic_rate="10gbit")
    assert (s.hosts, s.nic_rate, s.device, s.memory) == (4, "10gbit", "a100", "40Gi")
    assert s.nic_path == "--nic-rate" and s.device_path == "spec.tunedFor.device"
    assert s.cluster(2).memory == 40 * 2**30


def test_a_bad_tuned_for_value_exits_2_naming_the_field(tmp_path, capsys):
    doc = yaml.safe_load(open(DEMO))
    doc["spec"]["tunedFor"] = {"hosts": 4, "nicRate": "fast", "device": "h100"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["simulate", str(path)]) == 2
    assert "spec.tunedFor.nicRate: 'fast' is invalid" in capsys.readouterr().err


def live_peak(actions) -> int:
    """Microbatches alive at once at the most: an F makes one live, its W (or B, backward not split) ends it."""
    live: set[int] = set()
    peak = 0
    for a in actions:
        if a.kind == "F":
            live.add(a.mb)
            peak = max(peak, len(live))
        elif a.kind in ("W", "B"):
            live.discard(a.mb)
    return peak


@pytest.mark.parametrize("delay", [0, 4])
def test_memory_counts_what_the_schedule_holds_and_zero1s_sharded_optimizer(delay):
    from meshjob.search.job_step import job_step
    from meshjob.search.memory_model import stage_memory, stage_parameters
    from meshjob.spec.manifest import parse_job

    doc = manifest(4, 128, 16, 64)
    spec = doc["spec"]
    spec["training"].update(microbatches=8, optimizer={"zeroStage": 1})
    spec["stages"] = [{"layers": [0, 2], "mesh": [1, 1]}, {"layers": [2, 4], "mesh": [2, 1], "dataParallelDim": 0}]
    spec["schedule"] = {"kind": "eager-1f1b", "weightGradDelay": delay}
    device = DEVICES["h100"]
    cluster = Cluster(3, 1, device, NetworkModel(intra_host_bytes_per_s=device.link_bytes_per_s))
    job = base_job(doc, 1)
    fixed = read_fixed(doc)
    p = Problem(doc, job, cluster, fixed, replace(default_space(job, fixed, cluster), strategies=("broadcast",)))
    best = search(p).best
    plan = job_step(parse_job(p.manifest(best.candidate)), cluster).plan
    peaks = [live_peak(plan.schedules[k]) for k in range(2)]
    t = parse_job(p.manifest(best.candidate)).training
    expected = tuple(
        stage_memory(job.model, t, a, b, dp, 1, peak, "none", directions).total
        for (a, b), dp, peak, directions in zip([(0, 2), (2, 4)], [1, 2], peaks, [2, 2])
    )
    assert best.memory == expected
    if delay:  # stage 1 delays 4 W's: it holds 4 more microbatches than its warm-up
        assert (
            peaks[1]
            == live_peak(job_step(parse_job(p.manifest(replace(best.candidate, delay="0"))), cluster).plan.schedules[1])
            + 4
        )
    optimizer = stage_memory(job.model, t, 2, 4, 2, 1, 0, "none", 2).optimizer
    assert optimizer == -(-2 * 4 * stage_parameters(job.model, 2, 4) // 2)  # two fp32 moments, halved over dp 2
