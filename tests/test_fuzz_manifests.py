"""Fuzz in CI: a few hundred generated and mutated manifests (meshjob_bench.fuzz: deep nesting, alias
bombs, huge numbers, wrong types, duplicate keys, unicode, missing fields, random bytes...) through
`meshjob plan` and the operator's validate(). Each must end in success or a clear error (exit 2 with
a message, SpecError); never a traceback, never a hang."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from meshjob_bench.fuzz import MUTATIONS, PATHS, generate_cases, run_cases

ROOT = Path(__file__).resolve().parent.parent
CASES = 20 * len(MUTATIONS)
BUDGET_S = 20.0  # per case: a hang, not a slow shared machine, is what trips it (cases take ms)


@pytest.fixture(scope="module")
def results():
    return run_cases(generate_cases(CASES, seed=1), BUDGET_S)


def test_every_generated_manifest_ends_in_success_or_a_clear_error(results):
    failures = [(r.case, r.mutation, r.path, r.outcome, r.detail) for r in results if r.outcome not in ("ok", "error")]
    assert failures == []


def test_clear_errors_carry_a_message(results):
    assert all(r.detail for r in results if r.outcome == "error")


def test_the_corpus_covers_every_mutation_both_paths_and_both_outcomes(results):
    assert {r.mutation for r in results} == set(MUTATIONS)
    assert {r.path for r in results} == set(PATHS)
    outcomes = Counter(r.outcome for r in results)
    assert outcomes["ok"] >= 20 and outcomes["error"] >= CASES // 2


@pytest.mark.parametrize("mutation", ["alias-bomb", "nesting"])
def test_bombs_and_deep_nesting_exit_2_in_a_fresh_process(mutation, tmp_path):
    cases = [c for c in generate_cases(4 * len(MUTATIONS), seed=2) if c.mutation == mutation]
    for case in cases:
        path = tmp_path / f"case-{case.index}.yaml"
        path.write_bytes(case.data)
        done = subprocess.run(
            [sys.executable, "-m", "meshjob.cli", "plan", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode in (0, 2), done.stderr
        assert "Traceback" not in done.stderr
        assert done.returncode == 0 or done.stderr.strip()


def test_bench_fuzz_writes_counts_percentiles_and_a_histogram(tmp_path):
    import json

    from meshjob_bench.cli import BENCHMARKS
    from meshjob_bench.fuzz import main

    assert "fuzz" in BENCHMARKS  # meshjob bench fuzz
    assert main(["--cases", str(2 * len(MUTATIONS)), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fuzz.json").read_text())
    assert [row["group"] for row in report["by_path"]] == list(PATHS)
    plan = report["by_path"][0]
    assert plan["cases"] == 2 * len(MUTATIONS) == plan["ok"] + plan["error"] + plan["traceback"] + plan["overrun"]
    assert 0 < plan["p50_ms"] <= plan["p99_ms"] <= plan["max_ms"]
    assert (tmp_path / "fuzz_times.png").stat().st_size > 10_000


def test_the_fuzz_budget_counts_cpu_time_not_a_busy_machines_wall_time():
    import time

    from meshjob_bench.fuzz import Overrun, deadline

    with deadline(0.2):
        time.sleep(0.5)  # waiting (as on a loaded machine) is not work; the wall backstop is 2 s
    with pytest.raises(Overrun):
        with deadline(0.2):
            while True:
                pass
