"""`meshjob tune`: ranked candidates, the chosen manifest written (and accepted by meshjob plan), exit 2 naming
the flag or field for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from meshjob.cli import main

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "gpt-demo.yaml"


def auto_manifest(tmp_path: Path, **changes) -> Path:
    """gpt-demo with the stages, microbatches, schedule and resharding left to the search."""
    doc = yaml.safe_load(DEMO.read_text())
    spec = doc["spec"]
    spec["stages"] = "auto"
    for key in ("edges", "schedule", "resharding"):
        spec.pop(key)
    spec["training"].pop("microbatches")
    spec["model"]["layers"] = 4
    for path, value in changes.items():
        node = doc
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    out = tmp_path / "auto.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def test_tune_writes_a_manifest_that_meshjob_plan_accepts(tmp_path, capsys):
    out = tmp_path / "tuned.yaml"
    assert (
        main(
            [
                "tune",
                str(auto_manifest(tmp_path)),
                "--hosts",
                "2",
                "--devices-per-host",
                "2",
                "--json",
                "--out",
                str(out),
                "--max-evaluations",
                "40",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranked"][0]["rank"] == 1 and doc["ranked"][0]["step_s"] > 0
    assert all("why_lost" in row for row in doc["ranked"][1:])
    assert yaml.safe_load(out.read_text())["spec"]["stages"] == doc["manifest"]["spec"]["stages"]
    assert main(["plan", str(out), "--json", "--skip-files"]) == 0


def test_tune_prints_a_ranked_table(tmp_path, capsys):
    assert (
        main(
            [
                "tune",
                str(auto_manifest(tmp_path)),
                "--hosts",
                "2",
                "--devices-per-host",
                "2",
                "--max-evaluations",
                "20",
                "--top",
                "3",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "step ms" in text and "tokens/s" in text and "memory/device" in text


def test_a_fully_written_manifest_is_kept_as_it_is(capsys):
    assert main(["tune", str(DEMO), "--hosts", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    written = yaml.safe_load(DEMO.read_text())["spec"]["stages"]
    assert doc["manifest"]["spec"]["stages"] == written
    assert doc["proven_best"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--hosts", "0"], "--hosts: 0 is invalid"),
        (["--hosts", "2", "--device", "tpu"], "--device: 'tpu' is invalid: one of a100, h100"),
        (["--hosts", "2", "--nic-rate", "fast"], "--nic-rate: 'fast' is invalid"),
        (["--hosts", "2", "--memory", "lots"], "--memory: 'lots' is invalid"),
        (["--hosts", "2", "--top", "0"], "--top: 0 is invalid"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, named):
    assert main(["tune", str(auto_manifest(tmp_path)), *flags]) == 2
    assert named in capsys.readouterr().err


def test_a_bad_field_exits_2_naming_it(tmp_path, capsys):
    path = auto_manifest(tmp_path, **{"spec.model.heads": 3})
    assert main(["tune", str(path), "--hosts", "2"]) == 2
    assert "spec.model.heads" in capsys.readouterr().err


def test_a_model_that_fits_nowhere_exits_2_with_the_overflow(tmp_path, capsys):
    assert (
        main(["tune", str(auto_manifest(tmp_path)), "--hosts", "1", "--devices-per-host", "1", "--memory", "1Mi"]) == 2
    )
    assert "smallest overflow found is" in capsys.readouterr().err
