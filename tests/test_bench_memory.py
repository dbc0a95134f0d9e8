"""`meshjob bench memory`: per-rank parameter, optimizer and activation bytes for fp32/bf16, recompute
off/on and ZeRO 0/1, against the analytic expectation (issue 12's targets: ZeRO-1's optimizer bytes
are 1/DP of ZeRO-0's within 5%; with recompute the peak activations are at most one block's per stashed microbatch)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from meshjob_bench.memory import bench_job, llama_parameters, main
from meshjob_trainer.families import build_stage


@pytest.mark.parametrize("quick", [True, False])
def test_the_analytic_parameter_count_is_the_models(quick):
    m = bench_job("fp32", "none", 0, 4, quick).model
    stage = build_stage(m, 0, m.layers, seed=0)
    assert llama_parameters(m) == sum(p.numel() for p in stage.parameters())


def test_zero_1_and_recompute_variants_set_the_fields_they_measure():
    job = bench_job("bf16", "full", 1, 4, quick=True)
    assert job.training.precision == "bf16" and job.recompute(0) == "full"
    assert job.training.optimizer.zero_stage == 1 and job.stages[0].data_parallel == 4


@pytest.mark.slow
def test_quick_run_meets_the_targets_and_writes_json_and_png(tmp_path):
    out = tmp_path / "results"
    assert main(argparse.Namespace(dp=2, quick=True, out=str(out))) == 0
    report = json.loads((out / "memory.json").read_text())
    assert len(report["rows"]) == 4  # fp32 x recompute off/on x ZeRO 0/1
    assert report["targets"]["zero1_optimizer_over_zero0_per_dp"] == pytest.approx(1.0, abs=0.05)
    assert report["targets"]["recompute_blocks_per_stashed_microbatch"] <= 1.0
    assert report["targets"]["no_recompute_blocks_per_stashed_microbatch"] > 1.5  # 2 blocks each without recompute
    for row in report["rows"]:
        assert row["measured"]["parameters"] == row["expected"]["parameters"]
        assert row["measured"]["optimizer"] == pytest.approx(row["expected"]["optimizer"], rel=0.05)
        assert row["measured"]["stashed"] == 4  # GPipe: every microbatch stashed at the peak
        assert row["measured"]["activations"] >= row["expected"]["activations_stashed"]
    assert os.path.getsize(out / "memory.png") > 10_000
