"""`meshjob bench compare-runs`: recorded resharding runs side by side, runs of one NIC rate merged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is a source-tree folder, not an installed package

from meshjob_bench.compare_runs import TargetCount, columns, summarize  # noqa: E402


def target(name: str, checked: int, failures: int, bounded: int = 0) -> dict:
    return {
        "name": name,
        "checked": checked,
        "failures": [f"row {i}" for i in range(failures)],
        "bounded": [f"row {i}" for i in range(bounded)],
    }


def run(
    nic_rate: str, section: str, over_limit: float, errors: list[float], targets: list[dict], disturbed: bool = False
) -> dict:
    """A run as `bench resharding` records it: only the fields the comparison reads."""
    rows = [{"section": section, "strategy": "broadcast", "simulator_error": e} for e in errors]
    rows.append({"section": section, "strategy": "signal", "simulator_error": 5.0})  # the bound: left out
    return {
        "benchmark": "resharding",
        "nic_rate": nic_rate,
        "rows": rows,
        "targets": targets,
        "summary": {section: {"broadcast K=auto greedy": {"over_limit": over_limit}}},
        "message_costs": {"disturbed": disturbed},
    }


def test_a_run_is_summarized_by_its_targets_auto_broadcast_and_simulator_agreement():
    s = summarize(
        "a.json",
        run(
            "1gbit",
            "paper_scale",
            1.16,
            [0.02, -0.3, 0.05],
            [target("paper scale", 64, 13, 3), target("unchecked", 0, 0)],
        ),
    )
    assert s.auto_over_limit == {"paper_scale": 1.16}
    assert s.targets == {"paper scale": TargetCount(64, 13, 3)}  # a target this run did not check is left out
    assert s.targets["paper scale"].text() == "13 of 64 missed (3 bounded)"
    assert s.simulator_text() == "2 of 3 (5.0%)"  # |errors| 0.02, 0.3, 0.05; the signal row not counted


def test_runs_of_one_nic_rate_over_other_sections_become_one_column_and_their_counts_add():
    a = summarize("a.json", run("250mbit", "one_to_many", 1.07, [0.01], [target("plan better", 93, 0)]))
    b = summarize("b.json", run("250mbit", "paper_scale", 1.08, [0.2], [target("plan better", 260, 2)], disturbed=True))
    c = summarize("c.json", run("1gbit", "paper_scale", 1.16, [0.01], [target("plan better", 948, 10)]))
    d = summarize("d.json", run("250mbit", "paper_scale", 1.09, [0.01], [target("plan better", 260, 0)]))
    merged, gbit, again = columns([a, b, c, d])
    assert merged.paths == ("a.json", "b.json") and merged.auto_over_limit == {"one_to_many": 1.07, "paper_scale": 1.08}
    assert merged.targets["plan better"] == TargetCount(353, 2, 0) and merged.disturbed_probe
    assert merged.simulator_text() == "1 of 2 (10.5%)"
    assert gbit.paths == ("c.json",)
    assert again.paths == ("d.json",)  # a second paper-scale run of 250mbit is a column of its own


def test_a_run_without_a_broadcast_auto_row_still_owns_its_section():
    fixed_k = run("1gbit", "paper_scale", 1.2, [0.01], [])
    fixed_k["summary"]["paper_scale"] = {"broadcast K=16 greedy": {"over_limit": 1.2}}  # a --chunks 16 run
    first = summarize("k16.json", fixed_k)
    assert first.sections == {"paper_scale"} and first.auto_over_limit == {}
    second = summarize("auto.json", run("1gbit", "paper_scale", 1.1, [0.01], []))
    assert len(columns([first, second])) == 2  # the same section twice: not merged


def test_cli_prints_the_table_and_writes_json_and_a_plot(tmp_path):
    paths = []
    for i, (rate, section) in enumerate([("1gbit", "paper_scale"), ("250mbit", "paper_scale")]):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(run(rate, section, 1.1 + i, [0.01], [target("paper scale", 64, i)])))
        paths.append(str(p))
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "compare-runs", *paths, "--json", str(out), "--png", str(png)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "250mbit" in proc.stdout and "1 of 64 missed" in proc.stdout and "met (64)" in proc.stdout
    doc = json.loads(out.read_text())
    assert [c["nic_rate"] for c in doc] == ["1gbit", "250mbit"]
    assert doc[1]["targets"]["paper scale"] == {"checked": 64, "missed": 1, "bounded": 0}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content", ["not json", json.dumps({"benchmark": "pipeline"}), json.dumps({"benchmark": "resharding"})]
)
def test_a_file_that_is_not_a_resharding_run_exits_2_naming_it(tmp_path, content):
    p = tmp_path / "bad.json"
    p.write_text(content)
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "compare-runs", str(p)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "runs" in proc.stderr + proc.stdout and "bad.json" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
