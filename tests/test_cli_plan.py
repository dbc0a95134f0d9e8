"""`meshjob plan`: tables, --json, and exit code 2 with the field named for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshjob.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TINY = ROOT / "examples" / "tiny.yaml"


def meshjob(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def bad_manifest(tmp_path: Path) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["stages"][1]["mesh"] = [2, "two"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_plan_json_on_each_example_prints_one_json_object(path: Path) -> None:
    result = meshjob("plan", str(path), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {"placement", "boundaries", "schedules"} <= doc.keys()
    assert doc["job"] == yaml.safe_load(path.read_text())["metadata"]["name"]


@pytest.mark.slow
def test_plan_tables_show_placement_tasks_makespan_and_schedules() -> None:
    result = meshjob("plan", str(TINY))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for heading in (
        "Placement",
        "Network: NIC bytes per step",
        "Balancing windows",
        "joint makespan",
        "Boundaries",
        "unit tasks by start",
        "lower bound",
        "chunks",
        "Schedules",
        "stash bound",
        "W delay",
        "peak stashed",
    ):
        assert heading in out
    assert "grad:activation" in out
    assert "SEND_F0@1" in out


@pytest.mark.slow
def test_plan_bad_manifest_exits_2_naming_the_field(tmp_path: Path) -> None:
    result = meshjob("plan", str(bad_manifest(tmp_path)))
    assert result.returncode == 2
    assert "spec.stages[1].mesh[1]" in result.stderr
    assert result.stdout == ""


def test_plan_json_in_process_matches_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--json", "--nic-rate", "500mbit"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nic_bytes_per_s"] == pytest.approx(500e6 / 8)
    assert [row["stage"] for row in doc["placement"]] == [0, 1, 1]


def test_plan_with_a_hosts_file_places_on_those_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(
        "hosts:\n- {name: n0, devices: 2, rack: r0}\n- {name: n1, devices: 1, rack: r0}\n"
        "- {name: n2, devices: 1, rack: r1}\n"
    )
    assert main(["plan", str(TINY), "--hosts", str(hosts), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(row["stage"], row["host"]) for row in doc["placement"]] == [(0, "n0"), (1, "n1"), (1, "n2")]


def test_plan_bad_nic_rate_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--nic-rate", "fast"]) == 2
    assert "--nic-rate" in capsys.readouterr().err


def test_plan_bad_hosts_file_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: n0, devices: -2}\n")
    assert main(["plan", str(TINY), "--hosts", str(hosts)]) == 2
    assert "hosts[0].devices: -2" in capsys.readouterr().err


def test_plan_too_small_cluster_exits_2_saying_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: n0, devices: 2}\n- {name: n1, devices: 1}\n")
    assert main(["plan", str(TINY), "--hosts", str(hosts)]) == 2
    assert "missing 1 host with 1 free cpu device" in capsys.readouterr().err


def test_plan_missing_manifest_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert main(["plan", missing]) == 2
    err = capsys.readouterr().err
    assert f"{missing!r} is invalid: a readable TrainingJob manifest (No such file or directory)" in err
    assert "None" not in err


def test_plan_json_shows_the_network_per_step_and_the_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples" / "utransformer-demo.yaml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    net = doc["network"]
    assert net["model"]["duplex"] == "full" and net["model"]["message_s"] > 0
    (step,) = net["windows"]
    assert step["name"] == "step" and step["boundaries"] == list(range(len(doc["boundaries"])))
    assert step["lower_bound_s"] <= step["makespan_s"] <= 1.1 * step["lower_bound_s"]
    microbatches = 4
    for host in net["hosts"]:  # every tensor's bytes cross once per microbatch
        assert host["egress_bytes"] % microbatches == 0 and host["egress_bytes"] > 0
    assert sum(h["egress_bytes"] for h in net["hosts"]) == sum(h["ingress_bytes"] for h in net["hosts"])
    assert doc["costs"]["measured"] is False and set(doc["costs"]["stages"]["0"]) == {"F", "I", "W"}
    assert doc["schedule"]["stash_bound"] == min(microbatches, 2 * 4 - 1)
    assert all(task["chunks"] >= 1 for b in doc["boundaries"] for task in b["tasks"])


def test_plan_half_duplex_is_the_papers_model_for_the_ablation(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "examples" / "gpt-demo.yaml")
    assert main(["plan", path, "--json", "--duplex", "half"]) == 0
    half = json.loads(capsys.readouterr().out)["network"]
    assert main(["plan", path, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["network"]
    assert half["model"]["duplex"] == "half"
    assert half["windows"][0]["lower_bound_s"] > full["windows"][0]["lower_bound_s"]


def test_plan_emulated_is_the_plan_meshjob_run_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from meshjob.plan.rendered import PlanInputs
    from meshjob.spec.manifest import load_job

    path = ROOT / "examples" / "gpt-demo.yaml"
    assert main(["plan", str(path), "--emulated", "--nic-rate", "500mbit", "--skip-files", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    run_plan = PlanInputs.emulated(load_job(str(path)), None, 500e6 / 8, os.cpu_count() or 1).build()
    assert doc == json.loads(json.dumps(run_plan.to_json()))
    assert doc["network"]["model"]["shared_cpu_cores"] == (os.cpu_count() or 1)
    assert doc != json.loads(json.dumps(PlanInputs.of(load_job(str(path)), None, 500e6 / 8).build().to_json()))


def test_plan_emulated_header_names_the_cpu_a_message_takes_on_the_shared_cores() -> None:
    result = meshjob("plan", str(TINY), "--emulated")
    assert result.returncode == 0, result.stderr
    assert "µs of CPU per message on" in result.stdout.splitlines()[0] + result.stdout.splitlines()[1]


@pytest.mark.parametrize("option", [["--message-us", "5"], ["--duplex", "half"], ["--tbf-burst", "128kb"]])
def test_plan_emulated_refuses_the_options_it_sets_itself(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(TINY), "--emulated", *option]) == 2
    assert (
        f"--emulated plans with the costs `meshjob run` uses on the emulated cluster: it takes --nic-rate, "
        f"not {option[0]}" in capsys.readouterr().err
    )


def test_plan_bad_message_cost_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--message-us", "-5"]) == 2
    assert "--message-us: -5.0 is invalid: a number of microseconds >= 0" in capsys.readouterr().err


def test_plan_calibrate_without_the_trainer_distribution_exits_2_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "meshjob_trainer.calibrate", None)  # as if not installed
    assert main(["plan", str(TINY), "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert "--calibrate: needs the meshjob-trainer distribution" in err and "pip install ./trainer" in err


@pytest.mark.slow
def test_plan_calibrate_measures_the_costs_that_size_the_plan() -> None:
    result = meshjob("plan", str(ROOT / "examples" / "gpt-demo.yaml"), "--calibrate", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["costs"]["measured"] is True
    default = json.loads(meshjob("plan", str(ROOT / "examples" / "gpt-demo.yaml"), "--json").stdout)
    assert doc["costs"]["stages"] != default["costs"]["stages"]
    assert doc["schedule"]["weight_delay"].keys() == default["schedule"]["weight_delay"].keys()


# --- manifests read like kubectl reads them, and safely -----------------------------------------


def billion_laughs() -> str:
    """300 bytes that stand for 9**9 strings once every alias is expanded."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def test_plan_dash_reads_the_manifest_from_stdin() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "plan", "-", "--json"],
        input=TINY.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["job"] == "tiny"


def test_plan_of_a_multi_document_file_prints_one_plan_per_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = TINY.read_text().replace("name: tiny", "name: tiny-two")
    path = tmp_path / "two.yaml"
    path.write_text(TINY.read_text() + "---\n" + second)
    assert main(["plan", str(path), "--json"]) == 0
    assert [doc["job"] for doc in json.loads(capsys.readouterr().out)] == ["tiny", "tiny-two"]


def test_plan_of_a_multi_document_file_names_the_bad_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(TINY.read_text() + "---\n" + TINY.read_text().replace("layers: 2,", "layers: 0,"))
    assert main(["plan", str(path)]) == 2
    assert f"{path} document 2: spec.model.layers: 0 is invalid" in capsys.readouterr().err


def test_plan_names_a_duplicate_key_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(
        TINY.read_text().replace(
            "  topology: {devicesPerHost: 2}\n", "  topology: {devicesPerHost: 2, devicesPerHost: 4}\n"
        )
    )
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:8:" in err and "'spec.topology.devicesPerHost' is invalid: each key once" in err


def test_plan_reads_exponent_floats_like_kubectl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text(TINY.read_text().replace("learningRate: 1.0e-3", "learningRate: 1e-3"))
    assert "learningRate: 1e-3" in path.read_text()
    assert main(["plan", str(path), "--json"]) == 0


def test_plan_refuses_unquoted_on_for_weight_grad_delay_saying_what_to_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "on.yaml"
    path.write_text(TINY.read_text().replace("weightGradDelay: 0", "weightGradDelay: on"))
    assert main(["plan", str(path)]) == 2
    assert (
        "spec.schedule.weightGradDelay: True is invalid: auto or an integer in 0..4095; True is no longer "
        "accepted: true is what YAML makes of unquoted on/yes: write 1" in capsys.readouterr().err
    )


def test_plan_alias_bomb_exits_2_fast_with_a_short_message(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    result = meshjob("plan", str(path))  # the subprocess' own timeout (60 s) fails the test on a hang
    assert result.returncode == 2
    assert "at most 100000 values" in result.stderr and len(result.stderr) < 1000


def test_plan_500_levels_of_nesting_exit_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(TINY.read_text() + "  resources: " + "[" * 500 + "]" * 500 + "\n")
    result = meshjob("plan", str(path))
    assert result.returncode == 2
    assert "levels of nesting" in result.stderr and "Traceback" not in result.stderr


def test_plan_piped_into_a_reader_that_stops_early_prints_no_traceback() -> None:
    script = f"{sys.executable} -m meshjob.cli plan {TINY} --json | head -c 10 >/dev/null"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
