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
    return subprocess.run([sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


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
    for heading in ("Placement", "Network: NIC bytes per step", "Balancing windows", "joint makespan",
                    "Boundaries", "unit tasks by start", "lower bound", "chunks", "Schedules", "stash bound",
                    "W delay", "peak stashed"):
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
    hosts.write_text("hosts:\n- {name: n0, devices: 2, rack: r0}\n- {name: n1, devices: 1, rack: r0}\n"
                     "- {name: n2, devices: 1, rack: r1}\n")
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


def test_plan_too_small_cluster_exits_2_saying_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: n0, devices: 2}\n- {name: n1, devices: 1}\n")
    assert main(["plan", str(TINY), "--hosts", str(hosts)]) == 2
    assert "missing 1 host with 1 free cpu device" in capsys.readouterr().err


def test_plan_missing_manifest_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


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


def test_plan_bad_message_cost_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--message-us", "-5"]) == 2
    assert "--message-us: -5.0 is invalid: a number of microseconds >= 0" in capsys.readouterr().err


def test_plan_calibrate_without_the_trainer_distribution_exits_2_saying_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
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
