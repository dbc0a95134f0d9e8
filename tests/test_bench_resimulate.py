"""`meshjob bench resimulate`: a recorded resharding run's plans simulated again on its model or a changed one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is a source-tree folder, not an installed package

from meshjob.network.model import NetworkModel  # noqa: E402
from meshjob_bench.resharding_cases import Layout, build_cases, plan_cases  # noqa: E402
from meshjob_bench.resimulate import TOLERANCE, Change, resimulate  # noqa: E402

MODEL = NetworkModel(
    nic_bytes_per_s=1.25e8,
    shared_cpu_cores=2,
    message_cpu_s=200e-6,
    intra_message_cpu_s=80e-6,
    net_byte_cpu_s=1e-9,
    local_byte_cpu_s=0.2e-9,
)


def recorded_run(slower: float = 1.05) -> dict:
    """A quick run as `bench resharding` records it, each row measured `slower` times its simulated time."""
    layout = Layout()
    cases = build_cases(quick=True, size_bytes=2**20, chunks=[16], nic_bytes_per_s=1.25e8, layout=layout)
    plan_cases(cases, layout, MODEL)
    rows = [
        {
            "section": c.section,
            "case": c.name,
            "label": v.label,
            "strategy": v.strategy,
            "seconds": s * slower,
            "simulated_s": s,
        }
        for c in cases
        for v, s in zip(c.variants, c.simulated_s)
    ]
    return {
        "benchmark": "resharding",
        "nic_rate": "1gbit",
        "tensor_mib": 1.0,
        "chunks": [16],
        "quick": True,
        "network_model": MODEL.to_json(),
        "rows": rows,
    }


def test_the_runs_own_model_reproduces_its_recorded_predictions():
    (own,), replanned = resimulate(recorded_run(), [])
    assert replanned == 0
    assert own.rows > 0 and own.within == own.rows and not own.misses  # 1 / 1.05 - 1: within 10%
    assert own.worst_error == pytest.approx(1 / 1.05 - 1)


def test_a_changed_model_is_judged_against_the_same_measurements():
    own, dearer = resimulate(recorded_run(), [Change("x message_cpu_s=100", {"message_cpu_s": 100.0}, {})])[0]
    assert dearer.rows == own.rows and dearer.within < own.rows  # priced 100x dearer: the cores decide, too slowly
    assert dearer.worst_error > TOLERANCE and all(m["error"] > TOLERANCE for m in dearer.misses)
    free = resimulate(recorded_run(), [Change("= message_cpu_s=0", {}, {"message_cpu_s": 0.0})])[0][1]
    assert free.worst_error <= own.worst_error < 0  # messages priced no CPU: nothing predicted slower
    assert all(m["error"] < -TOLERANCE for m in free.misses)


def test_rows_a_former_plan_layer_recorded_are_counted():
    run = recorded_run()
    run["rows"][0]["simulated_s"] *= 1.5
    assert resimulate(run, [])[1] == 1


def test_cli_compares_each_model_and_writes_json(tmp_path):
    path = tmp_path / "resharding.json"
    path.write_text(json.dumps(recorded_run(slower=1.3)))
    out = tmp_path / "comparison.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshjob.cli",
            "bench",
            "resimulate",
            str(path),
            "--scale",
            "message_cpu_s=2,net_byte_cpu_s=2",
            "--set",
            "cpu_contention_p=8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run's model" in proc.stdout and "message_cpu_s=2,net_byte_cpu_s=2" in proc.stdout
    doc = json.loads(out.read_text())
    assert [m["name"] for m in doc["models"]] == [
        "run's model",
        "x message_cpu_s=2,net_byte_cpu_s=2",
        "= cpu_contention_p=8",
    ]
    own = doc["models"][0]
    assert own["within"] == 0 and len(own["misses"]) == own["rows"]  # measured 1.3x the prediction everywhere


@pytest.mark.parametrize(
    "args,named",
    [
        (["--scale", "bogus=2"], "--scale: 'bogus=2'"),
        (["--set", "message_cpu_s=-1"], "--set: 'message_cpu_s=-1'"),
        ([], "run: '/no/such/run.json'"),
    ],
)
def test_bad_input_exits_2_naming_the_option_and_what_is_allowed(args, named):
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "resimulate", "/no/such/run.json", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert named in proc.stdout + proc.stderr
