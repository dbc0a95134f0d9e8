"""The transport bench (a device check for GPU machines) runs its gloo half here: every receiver exact,
every row's fields, ratios to broadcast that follow from the medians."""

from __future__ import annotations

import json

import pytest

from meshjob_bench import nccl_transport


@pytest.mark.slow
def test_the_gloo_half_of_the_transport_bench_delivers_exactly_and_reports_every_row(tmp_path, capsys):
    import torch

    torch.ones(10**7).mul(2).sum()  # this process's thread pool is up before the ranks fork (it hung them once)
    assert nccl_transport.main(["--out", str(tmp_path), "--mib", "1", "--repeats", "1", "--transports", "gloo"]) == 0
    result = json.loads((tmp_path / "nccl_transport.json").read_text())
    assert result["exact"] and result["machine"]["torch"] and "gpu" not in result["machine"]
    rows = result["rows"]
    assert {(r["case"], r["strategy"]) for r in rows} == {
        (c, s) for c in nccl_transport.CASES for s in nccl_transport.STRATEGY_NAMES
    }
    for r in rows:
        assert r["transport"] == "gloo" and r["nccl_over_gloo"] is None and len(r["runs_s"]) == 1
        broadcast = next(b for b in rows if b["case"] == r["case"] and b["strategy"] == "broadcast")
        assert r["over_broadcast"] == pytest.approx(r["median_s"] / broadcast["median_s"])
    assert "exact on every receiver: True" in capsys.readouterr().out
