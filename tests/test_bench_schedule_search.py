"""`meshjob bench schedule-search`: the search around bench pipeline's eager-1F1B plan on the simulator
(issue 10's pipeline targets: is a miss the plan's choice or the schedule family's?)."""

from __future__ import annotations

import argparse
import json

import pytest

from meshjob.errors import SpecError
from meshjob_bench.schedule_search import Search, _checked, coordinate_descent, main, order_moves, pair_moves

FAR = float("inf")


def bowl(point) -> float:
    """A separable toy period, least at warm-ups (3, 1) and delays (0, 2); invalid past warm-up 4."""
    (w0, w1), (d0, d1) = point
    if w0 > 4:
        return FAR
    return 10 + (w0 - 3) ** 2 + (w1 - 1) ** 2 + d0**2 + (d1 - 2) ** 2


def test_coordinate_descent_reaches_the_least_period_of_a_separable_one():
    search = Search(bowl, ((1, 4), (3, 0)))
    coordinate_descent(search, 4, 1000)
    assert search.best == ((3, 1), (0, 2)) and search.best_s == 10


def test_a_search_keeps_only_faster_points_and_rates_each_once():
    calls = []
    search = Search(lambda p: calls.append(p) or bowl(p), ((3, 1), (0, 2)))
    assert not search.take(((4, 1), (0, 2))) and not search.take(((4, 1), (0, 2)))
    assert search.best == ((3, 1), (0, 2)) and len(calls) == 2


def test_a_search_stops_at_its_budget_and_the_same_budget_gives_the_same_result():
    runs = []
    for _ in range(2):
        search = Search(bowl, ((1, 4), (3, 0)))
        coordinate_descent(search, 4, 5)
        pair_moves(search, 4, 9)
        runs.append((search.best, len(search.rated)))
    assert runs[0] == runs[1] and runs[0][1] == 9


def test_pair_moves_stay_within_the_ranges_and_never_lose_the_best():
    seen = []
    search = Search(lambda p: seen.append(p) or bowl(p), ((2, 2), (1, 1)))
    pair_moves(search, 4, 40)
    assert all(1 <= w <= 4 for p in seen for w in p[0]) and all(0 <= d < 4 for p in seen for d in p[1])
    assert search.best_s == min(map(bowl, seen)) < bowl(((2, 2), (1, 1)))


def test_order_moves_move_a_transfer_earlier_on_its_link_when_that_is_faster():
    order = [("a", 0), ("b", 0), ("c", 0)]
    links = {"a": ["L"], "b": ["M"], "c": ["L"]}
    best, period, tried = order_moves(
        order,
        links,  # faster once c precedes a on link L
        lambda o: 1.0 if o.index(("c", 0)) < o.index(("a", 0)) else 2.0,
        10,
    )
    assert best.index(("c", 0)) < best.index(("a", 0)) and period == 1.0 and tried >= 2


def test_an_order_that_cannot_run_is_not_taken():
    order = [("a", 0), ("b", 0)]
    best, period, _ = order_moves(order, {"a": ["L"], "b": ["L"]}, lambda o: 1.0 if o == order else FAR, 10)
    assert best == order and period == 1.0


@pytest.mark.parametrize(
    "flag,value", [("models", "bert"), ("stages", 3), ("comm_fractions", "0"), ("comm_fractions", "x"), ("budget", 2)]
)
def test_bad_arguments_are_refused_naming_the_flag(flag, value):
    args = argparse.Namespace(quick=False, models=None, stages=None, comm_fractions=None, budget=None)
    setattr(args, flag, value)
    with pytest.raises(SpecError, match=f"--{flag.replace('_', '-')}"):
        _checked(args)


def test_quick_run_finds_no_slower_schedule_than_the_plans_and_writes_every_field(tmp_path):
    assert main(["--quick", "--budget", "60", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "schedule_search.json").read_text())
    (row,) = report["rows"]
    assert row["best"]["period_s"] <= row["period_s"]["eager-1f1b+wdelay"] * (1 + 1e-9)
    assert row["best_vs_1f1b"] >= row["plan_vs_1f1b"] * (1 - 1e-9)
    assert row["plan_vs_1f1b"] == pytest.approx(row["period_s"]["1f1b"] / row["period_s"]["eager-1f1b+wdelay"])
    assert row["candidates_rated"] > 1 and row["orders_rated"] >= 1
    assert row["job"]["spec"]["schedule"] == {"kind": "eager-1f1b", "weightGradDelay": "auto"}
    assert row["compute"]["device"]["tflops"] == 3.0 and report["device"]["name"] == "3tflops"
    assert 0 < row["step_bound_vs_signal"] <= 1.0 + 1e-9
    assert (tmp_path / "schedule_search.png").stat().st_size > 0
