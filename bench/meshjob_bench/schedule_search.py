"""`meshjob bench schedule-search`: how far eager-1F1B's schedule of bench pipeline's plan goes on the simulator.

bench pipeline misses two targets on the U-Transformer at 8 stages (eager-1F1B + W delay >= 1.3x over 1F1B
where communication equals compute; >= 90% of signal at 30%), and the simulator, within 1-4% of those runs,
predicts the same misses. Is that the plan's choice (weightGradDelay: auto's few candidates, two tie rules for
the transfer order) or the schedule family? This searches around the plan's schedule on the simulator the plan
trusts, each candidate in its fastest transfer order (meshjob.plan.comm_order) and rated by its steady period
with every stage's optimizer step (meshjob.simulate.steady), as bench pipeline predicts:
1. per stage, its warm-up forwards (1 .. M: 1F1B's S - s, eager-1F1B's 2(S - s) - 1, GPipe's M, anything
   between) and its delayed W's (0 .. M - 1), one stage at a time until no move helps (coordinate descent);
2. two such moves at once (+-1 or +-2 on two coordinates), drawn with a fixed seed, until the budget;
3. on the best schedule, its transfer order: one transfer moved up to 3 places earlier on one of its links,
   until no move helps.
Every candidate keeps eager-1F1B's stash bound (meshjob.schedule.actions.stash_bound) and must validate. The budget
counts simulated steps, a third to each part, not seconds: the same budget finds the same schedule anywhere.
No measured run: a table of the plan's, the best found and the step bound's (meshjob.simulate.step_bound) ratios over
1F1B and over signal, a JSON and a plot of the best period found against candidates rated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.costs.device_costs import emulated_cost
from meshjob.costs.devices import parse_compute
from meshjob.errors import FieldError, SpecError
from meshjob.plan.build import build_plan
from meshjob.plan.comm_order import fastest_order
from meshjob.schedule.actions import ScheduleError, generate, peak_stashed, stash_bound, validate, warmup_forwards
from meshjob.simulate.simulator import compute_costs, plan_cost, simulate_plan, transfer_costs
from meshjob.simulate.steady import plan_period_s, steady_period_s
from meshjob.simulate.step_bound import step_bound
from meshjob.spec.manifest import job_to_dict
from meshjob_bench import parsed_arguments
from meshjob_bench.pipeline import MODELS, bench_job, cost_model, emulated_device, nic_rate_for, one_step_s

Point = tuple[tuple[int, ...], tuple[int, ...]]  # (warm-up forwards per stage, W's delayed per stage)
SEED = 0
BUDGET, QUICK_BUDGET = 1500, 150  # simulated steps per case (points of the neighbourhood plus orders)
DRAWS_PER_POINT = 20  # pair moves: draws per point of the budget before giving up on finding new ones
ORDER_REACH = 3  # a transfer moves at most this many places earlier among its link's transfers


@dataclass
class Search:
    """Rates points of one plan's neighbourhood, each once, and keeps the best."""

    rate: Callable[[Point], float]  # steady period, inf where the point is invalid
    start: Point
    best: Point = ((), ())
    best_s: float = float("inf")
    rated: dict[Point, float] = field(default_factory=dict)
    progress: list[tuple[int, float]] = field(default_factory=list)  # (candidates rated, best period)

    def __post_init__(self) -> None:
        self.best, self.best_s = self.start, self.period(self.start)

    def period(self, point: Point) -> float:
        if point not in self.rated:
            self.rated[point] = self.rate(point)
            if self.rated[point] < self.best_s:
                self.progress.append((len(self.rated), self.rated[point]))
        return self.rated[point]

    def take(self, point: Point) -> bool:
        """Rate `point`; keep it when it is faster than the best."""
        period = self.period(point)
        if period < self.best_s * (1 - 1e-9):
            self.best, self.best_s = point, period
            return True
        return False


def moved(point: Point, which: int, stage: int, value: int) -> Point:
    parts = [list(point[0]), list(point[1])]
    parts[which][stage] = value
    return tuple(parts[0]), tuple(parts[1])


def coordinate_descent(search: Search, microbatches: int, budget: int) -> None:
    """One coordinate at a time to each of its values, until no move helps or `budget` points are rated."""
    improved = True
    while improved and len(search.rated) < budget:
        improved = False
        for stage in range(len(search.best[0])):
            for which, values in ((0, range(1, microbatches + 1)), (1, range(microbatches))):
                for value in values:
                    if len(search.rated) >= budget:
                        return
                    improved |= search.take(moved(search.best, which, stage, value))


def pair_moves(search: Search, microbatches: int, budget: int) -> None:
    """Two moves at once from the best, drawn with SEED, until `budget` points are rated (or as many draws
    as the budget allow found nothing new)."""
    rng = random.Random(SEED)
    stages = len(search.best[0])
    steps = [(which, stage, d) for which in (0, 1) for stage in range(stages) for d in (-2, -1, 1, 2)]
    for _ in range(DRAWS_PER_POINT * budget):
        if len(search.rated) >= budget:
            return
        point = search.best
        for which, stage, d in rng.sample(steps, 2):
            point = moved(point, which, stage, point[which][stage] + d)
        if all(1 <= w <= microbatches for w in point[0]) and all(0 <= d < microbatches for d in point[1]):
            search.take(point)


def _earlier_on_a_link(order: list, links_of: Mapping) -> Iterator[list]:
    """`order` with one transfer moved up to ORDER_REACH places earlier among the transfers of one of its
    links, each such move in turn."""
    on_link: dict = {}
    for i, (key, _) in enumerate(order):
        for link in links_of[key]:
            on_link.setdefault(link, []).append(i)
    for positions in on_link.values():
        for a in range(len(positions)):
            for later in positions[a + 1 : a + 1 + ORDER_REACH]:
                candidate = list(order)
                candidate.insert(positions[a], candidate.pop(later))
                yield candidate


def order_moves(
    order: Sequence, links_of: Mapping, rate: Callable[[Sequence], float], budget: int
) -> tuple[list, float, int]:
    """(the best order found, its period, orders rated): the first move of _earlier_on_a_link that is
    faster, again from there, until none is. `rate`: inf for an order that cannot run. At most `budget`
    orders rated."""
    best, best_s, tried = list(order), rate(order), 1
    improved = True
    while improved and tried < budget:
        improved = False
        for candidate in _earlier_on_a_link(best, links_of):
            if tried >= budget:
                break
            period, tried = rate(candidate), tried + 1
            if period < best_s * (1 - 1e-9):
                best, best_s, improved = candidate, period, True
                break
    return best, best_s, tried


def search_case(model: str, stages: int, fraction: float, device, budget: int) -> dict:
    """One (model, stages, communication fraction) of bench pipeline: the plans' periods and the best found."""
    rate_bytes = nic_rate_for(bench_job(model, "1f1b", 3, False, stages), device, fraction)
    plans = {}
    for variant in ("1f1b", "eager-1f1b+wdelay", "signal"):
        job = bench_job(model, variant, 3, False, stages)
        cost = cost_model(job, device, rate_bytes)
        plans[variant] = build_plan(job, cost=cost, network=cost.network)
    plan = plans["eager-1f1b+wdelay"]
    job, microbatches = plan.job, plan.job.training.microbatches
    cost = plan_cost(plan)
    optimizer = {s: emulated_cost(job, s, device).optimizer_s for s in range(stages)}
    periods = {v: plan_period_s(p, cost, optimizer) for v, p in plans.items()}
    compute, transfers = compute_costs(plan, cost), transfer_costs(plan, cost)
    edges = [(e.src, e.dst, e.tensor) for e in job.edges]
    bound = stash_bound(stages, microbatches)

    def schedule(point: Point) -> tuple[dict, Any] | None:
        """The point's action lists and their fastest transfer order; None where it is not a schedule
        to run (does not validate, or passes the stash bound)."""
        warmups, delays = dict(enumerate(point[0])), dict(enumerate(point[1]))
        try:
            lists = generate("eager-1f1b", stages, microbatches, edges, True, delays, warmups)
            validate(lists, edges, microbatches, True)
        except ScheduleError:
            return None
        if max(peak_stashed(lists).values()) > bound:
            return None
        return lists, fastest_order(lists, compute, transfers, cost)[0]

    def rate(point: Point) -> float:
        ran = schedule(point)
        if ran is None:
            return float("inf")
        return steady_period_s(ran[0], compute, transfers, cost, microbatches, ran[1].transfers, optimizer)

    start = (
        tuple(warmup_forwards("eager-1f1b", s, stages, microbatches) for s in range(stages)),
        tuple(plan.weight_delay.get(s, 0) for s in range(stages)),
    )
    t0 = time.monotonic()
    search = Search(rate, start)
    coordinate_descent(search, microbatches, budget // 3)
    single_s = search.best_s
    pair_moves(search, microbatches, 2 * budget // 3)
    pair_s = search.best_s
    best = schedule(search.best)
    assert best is not None, "the best was rated, so it is a schedule"
    lists, order = best

    def rate_order(transfer_order: Sequence) -> float:
        try:
            return steady_period_s(lists, compute, transfers, cost, microbatches, transfer_order, optimizer)
        except ValueError:  # a link would wait on a transfer sent only after it: not an order to run
            return float("inf")

    _, order_s, orders_rated = order_moves(
        order.transfers, {k: list(t[1]) for k, t in transfers.items()}, rate_order, budget // 3
    )
    stepped = step_bound(plan, cost, [optimizer[s] for s in range(stages)])
    # bench pipeline's "most / signal": both sides one step (the bound is one step's)
    signal_one_step = one_step_s(simulate_plan(plans["signal"], cost), optimizer)
    best_s = min(order_s, search.best_s)
    return {
        "model": model,
        "stages": stages,
        "comm_fraction": fraction,
        "nic_bytes_per_s": rate_bytes,
        "job": job_to_dict(job),
        "compute": {"mode": "emulated", "device": device.to_json()},
        "seconds": time.monotonic() - t0,
        "candidates_rated": len(search.rated),
        "orders_rated": orders_rated,
        "period_s": periods,
        "plan_weight_delay": list(start[1]),
        "plan_warmups": list(start[0]),
        "best": {"warmups": list(search.best[0]), "weight_delay": list(search.best[1]), "period_s": best_s},
        "best_after": {"one_move": single_s, "two_moves": pair_s, "order_moves": order_s},
        "plan_vs_1f1b": periods["1f1b"] / periods["eager-1f1b+wdelay"],
        "best_vs_1f1b": periods["1f1b"] / best_s,
        "plan_vs_signal": periods["signal"] / periods["eager-1f1b+wdelay"],
        "best_vs_signal": periods["signal"] / best_s,
        "step_bound_s": stepped and stepped.step_s,
        "signal_one_step_s": signal_one_step,
        "step_bound_vs_signal": stepped and signal_one_step / stepped.step_s,
        "progress": search.progress,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: the GPT, 4 stages, comm 1.0, budget {QUICK_BUDGET}"
    )
    parser.add_argument("--models", default=None, help="comma separated (default utransformer; quick gpt)")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages, 2, 4 or 8 (default 8; quick 4)")
    parser.add_argument(
        "--comm-fractions",
        default=None,
        help="communication / compute per microbatch, comma separated (default 0.3,1.0)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="simulated steps per case, a third each to single moves, pairs and the order (default "
        f"{BUDGET}, about 2 minutes here; quick {QUICK_BUDGET}); the same budget, the same result",
    )
    parser.add_argument("--device", default="3", help="emulated device TFLOP/s or profile (default bench pipeline's 3)")
    parser.add_argument("--out", default="bench/results", help="folder for schedule_search.json and its PNG")


def _checked(args: argparse.Namespace) -> tuple[list[str], int, list[float], int]:
    models = (args.models or ("gpt" if args.quick else "utransformer")).split(",")
    for m in models:
        if m not in MODELS:
            raise SpecError([FieldError("--models", m, f"one of {', '.join(MODELS)}")])
    stages = args.stages or (4 if args.quick else 8)
    if stages not in (2, 4, 8):
        raise SpecError([FieldError("--stages", stages, "one of 2, 4, 8")])
    fractions = []
    for text in (args.comm_fractions or ("1.0" if args.quick else "0.3,1.0")).split(","):
        try:
            fractions.append(float(text))
        except ValueError:
            fractions.append(-1.0)
        if not 0 < fractions[-1] <= 10:
            raise SpecError([FieldError("--comm-fractions", text, "a number in (0, 10]")])
    budget = args.budget if args.budget is not None else (QUICK_BUDGET if args.quick else BUDGET)
    if not budget >= 3:
        raise SpecError([FieldError("--budget", budget, "an integer >= 3")])
    return models, stages, fractions, budget


def print_table(rows: list[dict]) -> None:
    t = Table(
        "model",
        "S",
        "comm",
        "plan / 1f1b",
        "best / 1f1b",
        "plan / signal",
        "best / signal",
        "step bound / signal",
        "best warm-ups",
        "best W delays",
        "rated",
        title="meshjob bench schedule-search — simulated steady periods (no run), ratios over 1f1b and signal",
    )
    for r in rows:
        t.add_row(
            r["model"],
            str(r["stages"]),
            f"{r['comm_fraction']:.0%}",
            f"{r['plan_vs_1f1b']:.3f}",
            f"{r['best_vs_1f1b']:.3f}",
            f"{r['plan_vs_signal']:.3f}",
            f"{r['best_vs_signal']:.3f}",
            "-" if not r["step_bound_vs_signal"] else f"{r['step_bound_vs_signal']:.3f}",
            "/".join(map(str, r["best"]["warmups"])),
            "/".join(map(str, r["best"]["weight_delay"])),
            f"{r['candidates_rated']} + {r['orders_rated']} orders",
        )
    Console(width=180).print(t)


def plot(rows: list[dict], path: str) -> None:
    """Per case, the best simulated throughput found against schedules rated: over 1F1B (target 1.3x) and
    over signal (target 0.9; dashed: the step bound, which no schedule of the plan's transfers passes)."""
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, base, target, title in ((axes[0], "1f1b", 1.3, "over 1F1B"), (axes[1], "signal", 0.9, "over signal")):
        for r in rows:
            xs = [1] + [n for n, _ in r["progress"]] + [r["candidates_rated"]]
            ys = (
                [r["period_s"][base] / r["period_s"]["eager-1f1b+wdelay"]]
                + [r["period_s"][base] / s for _, s in r["progress"]]
                + [r["period_s"][base] / r["best"]["period_s"]]
            )
            (line,) = ax.step(xs, ys, where="post", label=f"{r['model']} S={r['stages']} comm {r['comm_fraction']:.0%}")
            if base == "signal" and r["step_bound_vs_signal"]:
                ax.axhline(r["step_bound_vs_signal"], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target}")
        ax.set_xscale("log")
        ax.set_xlabel("schedules rated (last point: after the order moves)")
        ax.set_title(f"best simulated throughput {title}", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench schedule-search", __doc__, add_arguments)
    models, stages, fractions, budget = _checked(args)
    device = emulated_device(parse_compute("emulated", args.device))
    rows = [search_case(m, stages, f, device, budget) for m in models for f in fractions]
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "schedule_search.png")
    plot(rows, png)
    with open(os.path.join(args.out, "schedule_search.json"), "w") as f:
        json.dump(
            {
                "benchmark": "schedule-search",
                "device": device.to_json(),
                "budget_per_case": budget,
                "rows": rows,
                "plots": [png],
            },
            f,
            indent=1,
        )
    print(f"wrote {os.path.join(args.out, 'schedule_search.json')} and {png}")
    return 0
