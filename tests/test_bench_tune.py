"""`meshjob bench tune`: a quick run writes the table's JSON and PNG, and the search equals exhaustive
enumeration on its cases."""

from __future__ import annotations

import json

import pytest

from meshjob_bench.tune import main, small_case


def test_small_cases_stay_within_eight_devices_and_six_layers():
    for seed in range(20):
        info, p = small_case(seed)
        assert info["hosts"] * info["devices_per_host"] <= 8 and 2 <= info["layers"] <= 6
        assert p.space.max_stages == 3


@pytest.mark.slow
def test_quick_run_writes_json_and_png_and_meets_the_equality_target(tmp_path):
    assert (
        main(
            [
                "--cases",
                "1",
                "--seed",
                "2",
                "--hosts",
                "2",
                "--devices-per-host",
                "2",
                "--layers",
                "4",
                "--parts",
                "search,large",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["targets"]["equal_to_exhaustive"] and len(doc["cases"]) == 1
    assert doc["large"]["simulated"] >= 1 and (tmp_path / "tune.png").stat().st_size > 0
