"""`meshjob bench pipeline --parts recompute`'s pure parts: the jobs it runs, the ratios and the target it reports
(recompute full / none per schedule, bf16 / fp32 boundary bytes), its table rows, the README table they feed, and
how a run of some parts merges into an existing pipeline.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST
from meshjob.schedule.boundary import BoundaryKey
from meshjob_bench import readme_tables
from meshjob_bench.pipeline import (
    PART_KEYS,
    PARTS,
    PRECISION_SCHEDULE,
    SCHEDULES,
    LandedBytes,
    bench_job,
    memory_activations,
    merge_results,
)
from meshjob_bench.pipeline_report import (
    RECOMPUTE_HEADER,
    TARGET_RECOMPUTE_SCHEDULE,
    precision_section,
    recompute_section,
    recompute_table_rows,
)
from meshjob_trainer.events import Resharded, StepFinished

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def run_row(schedule: str, recompute: str, step_s: float, precision: str = "fp32", nbytes: float = 48 * MIB) -> dict:
    """A row as meshjob_bench.pipeline.section_row writes it."""
    stashed = {"gpipe": [8, 8, 8, 8], "1f1b": [4, 3, 2, 1]}.get(schedule, [7, 7, 7, 7])
    return {
        "schedule": schedule,
        "recompute": recompute,
        "precision": precision,
        "nic_rate": "205269kbit",
        "weight_delay": {"0": 0, "1": 2 if recompute == "none" else 1} if schedule == "eager-1f1b+wdelay" else {},
        "step_s": step_s,
        "tokens_per_s": 1024 / step_s,
        "bubble": 0.2,
        "peak_stashed": stashed,
        "bytes_per_step": nbytes,
        "cross_host_bytes_per_step": nbytes,
        "planned_nic_bytes_per_step": 48 * MIB if precision == "fp32" else 24 * MIB,
        "predicted_step_s": step_s * 0.98,
        "predicted_over_measured": 0.98,
    }


def rows() -> list[dict]:
    steps = {"gpipe": (4.0, 5.6), "1f1b": (4.0, 5.2), "eager-1f1b": (3.8, 5.0), "eager-1f1b+wdelay": (3.0, 3.9)}
    out = [run_row(s, r, step) for s, (none, full) in steps.items() for r, step in (("none", none), ("full", full))]
    return out + [run_row(PRECISION_SCHEDULE, "none", 2.7, "bf16", 24 * MIB)]


def test_the_part_runs_bench_memory_s_four_schedules_with_recompute_and_precision_from_the_spec():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "eager-1f1b", "eager-1f1b+wdelay"]
    assert TARGET_RECOMPUTE_SCHEDULE == PRECISION_SCHEDULE == "eager-1f1b+wdelay"
    gpipe = bench_job("gpt", "gpipe", 3, quick=True, recompute="full")
    assert gpipe.schedule.kind == "gpipe" and gpipe.training.recompute == "full" and gpipe.recompute(3) == "full"
    delayed = bench_job("gpt", "eager-1f1b+wdelay", 3, quick=True, precision="bf16")
    assert delayed.schedule.weight_grad_delay == "auto" and delayed.training.activation_itemsize == 2
    assert delayed.name.endswith("-bf16") and gpipe.name.endswith("-full")
    plain = bench_job("gpt", "1f1b", 3, quick=True)  # the sweep's jobs: unchanged defaults
    assert (plain.training.recompute, plain.training.precision, plain.name) == ("none", "fp32", "bench-gpt-4-1f1b")


def test_recompute_ratios_are_full_over_none_per_schedule_and_the_target_is_on_the_delayed_schedule():
    memory = {"file": "memory.json", "quick": False, "what": "bench memory"}
    memory["activations_full_over_none"] = {"1f1b": 0.36}
    section = recompute_section(rows(), memory)
    assert list(section["ratios"]) == list(SCHEDULES)
    assert all(r["precision"] == "fp32" for r in section["rows"]) and len(section["rows"]) == 8
    delayed = section["ratios"]["eager-1f1b+wdelay"]
    assert delayed["step"] == pytest.approx(1.3) and delayed["predicted_step"] == pytest.approx(1.3)
    assert (delayed["step_none_s"], delayed["step_full_s"]) == (3.0, 3.9)
    assert section["ratios"]["gpipe"]["step"] == pytest.approx(1.4)
    assert section["ratios"]["1f1b"]["peak_stashed_none"] == 4
    assert section["ratios"]["1f1b"]["activations"] == 0.36 and section["ratios"]["gpipe"]["activations"] is None
    target = section["target"]
    assert target["value"] == pytest.approx(1.3) and target["met"] is True and target["bound"] == 1.4
    assert section["activations_from"] == {"file": "memory.json", "quick": False, "what": "bench memory"}

    delayed_full = (PRECISION_SCHEDULE, "full")
    slow = [{**r, "step_s": 4.5} if (r["schedule"], r["recompute"]) == delayed_full else r for r in rows()]
    assert recompute_section(slow)["target"]["met"] is False  # 1.5x
    unmeasured = recompute_section([r for r in rows() if r["schedule"] != "eager-1f1b+wdelay"])
    assert unmeasured["target"]["met"] is None and unmeasured["target"]["value"] is None
    assert recompute_section(rows())["activations_from"] is None  # no memory.json


def test_bf16_over_fp32_is_the_counted_boundary_bytes_ratio():
    section = precision_section(rows(), PRECISION_SCHEDULE)
    assert section["bf16_over_fp32"] == 0.5 and section["met"] is True and section["expected"] == 0.5
    assert section["counted_over_planned"] == {"fp32": 1.0, "bf16": 1.0}
    assert section["fp32_runs_moved_the_same_bytes"] is True
    assert section["bf16_step_over_fp32"] == pytest.approx(0.9)
    assert [r["precision"] for r in section["rows"]] == ["fp32", "bf16"]
    off = rows()[:-1] + [run_row(PRECISION_SCHEDULE, "none", 2.7, "bf16", 36 * MIB)]  # bf16 crossing as 3/4
    assert precision_section(off, PRECISION_SCHEDULE)["met"] is False
    with pytest.raises(ValueError, match="bf16"):
        precision_section(rows()[:-1], PRECISION_SCHEDULE)


def test_table_rows_show_each_schedules_steps_ratios_stash_and_bench_memory_s_activations():
    memory = {"activations_full_over_none": {"eager-1f1b+wdelay": 0.586}}
    table = recompute_table_rows(recompute_section(rows(), memory))
    assert [r[0] for r in table] == list(SCHEDULES) and all(len(r) == len(RECOMPUTE_HEADER) for r in table)
    delayed = dict(zip(RECOMPUTE_HEADER, table[-1]))
    assert delayed["W delay"] == "2 -> 1"  # the plan's auto delay, without and with recompute
    assert delayed["step ms (none -> full)"] == "3000 -> 3900"
    assert delayed["step full / none"] == "1.30" and delayed["predicted full / none"] == "1.30"
    assert delayed["peak stash"] == "7 -> 7" and delayed["activations full / none (bench memory)"] == "0.59"
    assert dict(zip(RECOMPUTE_HEADER, table[0]))["activations full / none (bench memory)"] == "-"


def test_the_landed_bytes_sink_adds_up_resharded_events_per_scope():
    sink = LandedBytes()
    key = BoundaryKey(0, 1, "activation")
    for scope, nbytes in ((CROSS_HOST, 1000), (CROSS_HOST, 24), (INTRA_HOST, 8)):
        sink.emit(Resharded(key, "broadcast", scope, nbytes, 0.01))
    sink.emit(StepFinished(0, 1, 1.0, 1024, float("nan")))  # not a transfer: not counted
    assert sink.by_scope == {CROSS_HOST: 1024, INTRA_HOST: 8}


def test_memory_activations_reads_bench_memory_s_ratios(tmp_path: Path):
    assert memory_activations(str(tmp_path)) is None
    (tmp_path / "memory.json").write_text("not json")
    assert memory_activations(str(tmp_path)) is None
    shutil.copy(ROOT / "bench" / "results" / "memory.json", tmp_path / "memory.json")
    got = memory_activations(str(tmp_path))
    assert got is not None and set(got["activations_full_over_none"]) == set(SCHEDULES)
    assert all(0 < v < 1 for v in got["activations_full_over_none"].values())


def test_a_run_of_some_parts_keeps_the_other_parts_keys():
    assert set(PARTS) == {"sweep", *PART_KEYS}
    old = {"rows": [1], "targets": [], "machine": "old", "recompute": {"old": 1}, "precision": {"old": 1}}
    section = {"recompute": {"new": 1}, "precision": {"new": 1}}
    merged = merge_results(old, section, ["recompute"])
    assert merged == {"rows": [1], "targets": [], "machine": "old", **section}
    sweep = {"rows": [2], "machine": "new"}
    assert merge_results(old, sweep, ["sweep"]) == {**sweep, "recompute": {"old": 1}, "precision": {"old": 1}}
    both = merge_results(old, {**sweep, **section}, ["sweep", "recompute"])
    assert both == {**sweep, **section} and list(both) == ["rows", "machine", "recompute", "precision"]
    assert merge_results({}, section, ["recompute"]) == section


def test_the_pipeline_readme_table_gains_the_recompute_part_once_pipeline_json_has_it(tmp_path: Path):
    results = tmp_path  # the pipeline table reads pipeline.json only
    pipeline = json.loads((ROOT / "bench" / "results" / "pipeline.json").read_text())
    for part in ("recompute", "precision"):  # the sweep's keys alone, as before a recompute run
        pipeline.pop(part, None)
    (results / "pipeline.json").write_text(json.dumps(pipeline))
    before = readme_tables.pipeline_cases(results)
    common = {
        "model": "gpt",
        "stages_count": 4,
        "hidden": 2048,
        "microbatches": 8,
        "comm_fraction": 0.3,
        "nic_rate": "205269kbit",
        "network": "4 emulated hosts, NIC 205269kbit each (tbf, burst 128kb)",
        "machine": {"cpus": 16, "torch": "9.9"},
        "transport": "gloo",
        "quick": False,
    }
    memory = {"file": "memory.json", "quick": False, "what": "bench memory's Llama"}
    pipeline["recompute"] = {**common, **recompute_section(rows(), {**memory, "activations_full_over_none": {}})}
    pipeline["precision"] = {**common, **precision_section(rows(), PRECISION_SCHEDULE)}
    (results / "pipeline.json").write_text(json.dumps(pipeline))
    after = readme_tables.pipeline_cases(results)
    assert after.startswith(before)
    added = after[len(before) :]
    assert "| eager-1f1b+wdelay | 2 -> 1 | 3000 -> 3900 | 1.30 | 1.30 | 7 -> 7 | - |" in added
    assert "NICs 205 mbit (30% of compute; tbf, burst 128kb)" in added
    assert "<= 1.4x the step without: met (1.30x)" in added and "bf16 / fp32 0.500 (expected 0.5: met)" in added
    assert "16 CPUs, torch 9.9, gloo" in added and "bench memory's Llama" in added


@pytest.mark.slow
def test_quick_recompute_part_counts_half_the_bytes_in_bf16_and_keeps_the_sweep_s_keys(tmp_path: Path):
    from meshjob_bench.pipeline import main

    (tmp_path / "pipeline.json").write_text(json.dumps({"rows": ["the sweep's"], "recompute": {"stale": True}}))
    assert main(["--quick", "--parts", "recompute", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pipeline.json").read_text())
    assert report["rows"] == ["the sweep's"] and set(report) == {"rows", "recompute", "precision"}
    recompute, precision = report["recompute"], report["precision"]
    assert list(recompute["ratios"]) == list(SCHEDULES) and recompute["quick"] is True
    assert all(r["step"] > 0 and r["predicted_step"] > 1 for r in recompute["ratios"].values())
    assert recompute["target"]["value"] is not None  # met or not: the machine's to say, the JSON's to read
    assert precision["bf16_over_fp32"] == 0.5 and precision["met"] is True  # counted bytes: exact
    assert precision["counted_over_planned"] == {"fp32": 1.0, "bf16": 1.0}
    assert precision["fp32_runs_moved_the_same_bytes"] is True
    assert (tmp_path / "pipeline_recompute.png").stat().st_size > 10_000
