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
    for heading in ("Placement", "Boundaries", "unit tasks by start", "lower bound", "Schedules"):
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
