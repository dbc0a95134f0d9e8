"""`meshjob bench pipeline` smoke run: real ranks on the emulated cluster, table + JSON + PNG."""
from __future__ import annotations

import json
import os

import pytest

from meshjob_bench.pipeline import bench_job, main

pytestmark = pytest.mark.slow


def test_eager_1f1b_warms_up_with_more_forwards_than_1f1b():
    one = bench_job("gpt", "1f1b", 2, quick=True)
    eager = bench_job("gpt", "eager-1f1b", 2, quick=True)
    assert one.schedule.kind == "1f1b" and eager.schedule.kind == "eager-1f1b"
    assert bench_job("gpt", "signal", 2, quick=True).resharding.strategy == "signal"


def test_quick_run_writes_ratios_a_json_and_a_timeline_png(tmp_path):
    out = tmp_path / "results"
    assert main(["--quick", "--steps", "2", "--variants", "1f1b,signal", "--out", str(out)]) == 0
    report = json.loads((out / "pipeline.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"1f1b", "signal"}
    assert rows["1f1b"]["vs_1f1b"] == pytest.approx(1.0)
    assert rows["signal"]["vs_signal"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["step_s"] > 0 and row["simulated_step_s"] > 0
        assert len(row["stages"]) == 4
        assert all(0.0 <= s["bubble"] <= 1.0 for s in row["stages"].values())
    # 1f1b stage i stashes min(M, S-i) microbatches; the plan's M=8, S=4
    assert [rows["1f1b"]["stages"][str(i)]["peak_stashed"] for i in range(4)] == [4, 3, 2, 1]
    png = out / "pipeline_timeline_gpt.png"
    assert png.exists() and os.path.getsize(png) > 10_000
