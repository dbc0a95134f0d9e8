"""`meshjob bench message-cost`: the per-message cost is the slope of time over messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshjob_bench.message_cost import collect, fit_line
from meshjob_trainer.emulate.netns import netns_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_NETNS, WHY_NOT = netns_available()


def test_the_fit_recovers_a_fixed_cost_per_message():
    ks = [1, 4, 16, 64, 256]
    intercept, slope = fit_line(ks, [0.035 + 20e-6 * k for k in ks])
    assert intercept == pytest.approx(0.035) and slope == pytest.approx(20e-6)


def test_each_round_keeps_the_fastest_repeat_per_link_and_k():
    events = [
        dict(round=0, link="network", chunks=4, rep=rep, start=10.0, end=10.0 + t)
        for rep, t in enumerate([0.5, 0.3, 0.9], start=1)
    ]
    events += [
        dict(round=0, link="local", chunks=4, rep=1, start=0.0, end=0.1),
        dict(round=1, link="network", chunks=4, rep=1, start=0.0, end=0.01),
    ]  # another round
    assert collect(events, [4], 0) == {"network": {4: pytest.approx(0.3)}, "local": {4: pytest.approx(0.1)}}


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
def test_quick_run_writes_the_per_message_cost_of_both_links(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "message-cost", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "message_cost.json").read_text())
    assert doc["emulated"] is True and set(doc["summary"]) == {"network", "local"}
    assert doc["transport"] == "gloo" and doc["machine"]["torch"]
    assert {(r["link"], r["chunks"]) for r in doc["rows"]} == {
        (link, k) for link in ("network", "local") for k in (1, 16, 64)
    }
    assert all(r["seconds"] > 0 for r in doc["rows"])
    assert (tmp_path / "message_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
