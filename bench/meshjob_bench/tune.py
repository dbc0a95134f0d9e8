"""`meshjob bench tune`: meshjob tune's search against exhaustive enumeration on small spaces, and its time
on a large cluster.

Part 1: `--cases` random small models and clusters (seeded; <= 8 devices, <= 6 layers; microbatches 2 or 4,
every schedule, one strategy and balancer, at most 3 stages: a space exhaustive enumeration can simulate
whole). Each is searched (meshjob.search.algorithm.search, its default budget) and enumerated
(meshjob.search.algorithm.exhaustive); the target is the same predicted step time on every case. Reported: both step
times, the candidates each simulated and their times.
Part 2: the search on `--hosts` x `--devices-per-host` devices (default 64 x 8) and a `--layers`-layer GPT
(default 96; hidden 1024, 16 heads, global batch 1024) with the default space and budget, as `meshjob tune`
runs it; target: under 60 s here. Reported: search time, plans simulated, whether the result is proven best,
and its step against the DP's least lower bound.
Part 4 (`hand`, meshjob_bench.tune_hand): the tuned plan against about 20 hand-written ones in simulated step time,
on the paper's GPT and U-Transformer shapes at 8 and 64 hosts.
Part 3 (meshjob_bench.tune_measure): the tuned manifest against hand-written ones for the same model and
emulated cluster, measured with emulated device compute, and the simulator's prediction of each; targets:
tuned throughput >= the best hand-written one's, predictions within 10%. `--quick`: a small GPT, 2 steps.
`--parts` picks the parts to run (default all four); the parts not run keep what tune.json in `--out`
already holds.
Times are wall-clock on a shared 2-core machine: compare, don't quote.

Run: `python -m meshjob_bench.tune` or `meshjob bench tune`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.errors import UsageError
from meshjob.network.model import NetworkModel
from meshjob.search.algorithm import Problem, default_space, exhaustive, search
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.problem import SCHEDULES, Candidate, Prediction
from meshjob_bench import parsed_arguments, tune_hand, tune_measure

PARTS = ("search", "large", "measure", "hand")
SHAPES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (1, 8), (8, 1)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=int, default=20, help="random small cases (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case (default 0)")
    parser.add_argument("--hosts", type=int, default=64, help="hosts of the large case (default 64)")
    parser.add_argument("--devices-per-host", type=int, default=8, help="devices per host, large case (default 8)")
    parser.add_argument("--layers", type=int, default=96, help="layers of the large case's model (default 96)")
    parser.add_argument("--nic-rate-gbit", type=float, default=100.0, help="NIC rate of the large case (default 100)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma separated, from search (small spaces "
        "against exhaustive), large (search time), measure (tuned vs hand-written on the emulated "
        "cluster), hand (tuned vs hand-written plans, simulated); default all",
    )
    parser.add_argument("--quick", action="store_true", help="measure: a small GPT, 2 steps (a smoke run)")
    tune_measure.add_arguments(parser)
    parser.add_argument("--out", default="bench/results", help="folder for tune.json, tune.png and tune_measured.png")


def manifest(layers: int, hidden: int, heads: int, batch: int, seq: int, vocab: int = 256) -> dict[str, Any]:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "bench-tune"},
        "spec": {
            "model": {"kind": "gpt", "layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seqLen": seq},
            "training": {"globalBatch": batch},
        },
    }


def problem(
    doc: dict[str, Any], hosts: int, per_host: int, nic_bytes_per_s: float, memory: int | None = None, **space: Any
) -> Problem:
    device = DEVICES["h100"]
    network = NetworkModel(nic_bytes_per_s=nic_bytes_per_s, intra_host_bytes_per_s=device.link_bytes_per_s)
    cluster = Cluster(hosts, per_host, device, network, memory)
    fixed = read_fixed(doc)
    job = base_job(doc, per_host)
    return Problem(doc, job, cluster, fixed, replace(default_space(job, fixed, cluster), **space))


def small_case(seed: int) -> tuple[dict[str, Any], Problem]:
    rng = random.Random(seed)
    hosts, per_host = rng.choice(SHAPES)
    layers = rng.randint(2, 6)
    hidden = rng.choice([64, 128, 256])
    batch, seq = rng.choice([4, 8, 16]), rng.choice([16, 64, 128])
    nic_gbit = rng.choice([0.1, 1.0, 10.0, 100.0])
    schedules = SCHEDULES  # every schedule of the search's space
    doc = manifest(layers, hidden, 4, batch, seq)
    p = problem(
        doc,
        hosts,
        per_host,
        nic_gbit * 1e9 / 8,
        microbatches=(2, 4),
        schedules=schedules,
        strategies=("broadcast",),
        balancers=("greedy",),
        max_stages=3,
    )
    info = {
        "seed": seed,
        "hosts": hosts,
        "devices_per_host": per_host,
        "layers": layers,
        "hidden": hidden,
        "global_batch": batch,
        "seq_len": seq,
        "nic_gbit": nic_gbit,
        "schedules": [list(s) for s in schedules],
    }
    return info, p


class CountingProblem(Problem):
    """A problem that counts its simulations."""

    calls = 0

    @classmethod
    def of(cls, p: Problem) -> CountingProblem:
        return cls(p.doc, p.job, p.cluster, p.fixed, p.space)

    def predict(self, c: Candidate) -> Prediction | None:
        self.calls += 1
        return super().predict(c)


def run_small(seed: int) -> dict[str, Any]:
    info, small = small_case(seed)
    p = CountingProblem.of(small)
    t0 = time.perf_counter()
    found = search(p)  # the default budget: exact where it says so
    t_search, n_search = time.perf_counter() - t0, p.calls
    t0 = time.perf_counter()
    truth = exhaustive(p)
    t_all, n_all = time.perf_counter() - t0, p.calls - n_search
    equal = abs(found.best.step_s - truth.step_s) <= 1e-9 * truth.step_s
    return {
        **info,
        "search_step_s": found.best.step_s,
        "exhaustive_step_s": truth.step_s,
        "equal": equal,
        "proven": found.proven,
        "optimality_gap": found.gap,
        "search_simulations": n_search,
        "exhaustive_simulations": n_all,
        "search_seconds": t_search,
        "exhaustive_seconds": t_all,
        "chosen": found.best.candidate.label(),
    }


def run_large(args: argparse.Namespace) -> dict[str, Any]:
    doc = manifest(args.layers, 1024, 16, 1024, 128, vocab=1024)
    p = problem(doc, args.hosts, args.devices_per_host, args.nic_rate_gbit * 1e9 / 8)
    t0 = time.perf_counter()
    r = search(p)
    seconds = time.perf_counter() - t0
    best = r.best
    return {
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "layers": args.layers,
        "nic_gbit": args.nic_rate_gbit,
        "search_seconds": seconds,
        "simulated": r.evaluated,
        "listed": r.listed,
        "proven": r.proven,
        "optimality_gap": r.gap,
        "step_s": best.step_s,
        "least_lower_bound_s": r.best_bound_s,
        "step_over_bound": best.step_s / r.best_bound_s,
        "tokens_per_s": best.tokens_per_s,
        "max_memory_gib": max(best.memory) / 2**30,
        "chosen": best.candidate.label(),
    }


def print_table(rows: list[dict[str, Any]], large: dict[str, Any]) -> None:
    """Parts 1 and 2."""
    con = Console(width=160)
    t = Table(
        "seed",
        "cluster",
        "layers",
        "NIC",
        "search ms",
        "exhaustive ms",
        "equal",
        "sims search/all",
        "time search/all",
        title="search vs exhaustive enumeration (small spaces, h100 profile)",
    )
    for r in rows:
        t.add_row(
            str(r["seed"]),
            f"{r['hosts']}x{r['devices_per_host']}",
            str(r["layers"]),
            f"{r['nic_gbit']:g}G",
            f"{r['search_step_s'] * 1e3:.4f}",
            f"{r['exhaustive_step_s'] * 1e3:.4f}",
            "yes" if r["equal"] else "NO",
            f"{r['search_simulations']}/{r['exhaustive_simulations']}",
            f"{r['search_seconds'] / r['exhaustive_seconds']:.2f}",
        )
    con.print(t)
    equal = sum(r["equal"] for r in rows)
    con.print(
        f"target 1: same predicted step time as exhaustive enumeration on every case: {equal}/{len(rows)} "
        f"-> {'met' if equal == len(rows) else 'MISSED'}"
    )
    con.print(
        f"target 2: {large['hosts']} hosts x {large['devices_per_host']} devices, {large['layers']} layers "
        f"(NIC {large['nic_gbit']:g} Gbit/s): searched in {large['search_seconds']:.1f} s, "
        f"{large['simulated']} plans simulated, "
        f"{'proven best' if large['proven'] else 'optimality gap ' + format(large['optimality_gap'], '.1%')}, "
        f"step / least lower bound {large['step_over_bound']:.2f} -> "
        f"{'met' if large['search_seconds'] < 60 else 'MISSED'} (< 60 s)"
    )
    con.print(f"chosen: {large['chosen']}")


def plot(rows: list[dict[str, Any]], large: dict[str, Any], path: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["exhaustive_step_s"] * 1e3 for r in rows]
    ys = [r["search_step_s"] * 1e3 for r in rows]
    left.loglog(xs, ys, "o")
    lo, hi = min(xs + ys), max(xs + ys)
    left.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="equal")
    left.set_xlabel("exhaustive: best predicted step (ms)")
    left.set_ylabel("search: best predicted step (ms)")
    left.set_title(f"{len(rows)} random small spaces")
    left.legend()
    seeds = [str(r["seed"]) for r in rows]
    right.bar(seeds, [r["search_simulations"] / max(1, r["exhaustive_simulations"]) for r in rows])
    right.set_xlabel("case (seed)")
    right.set_ylabel("simulations: search / exhaustive")
    right.set_title(
        f"large case {large['hosts']}x{large['devices_per_host']}, {large['layers']} layers: "
        f"{large['search_seconds']:.0f} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_parts(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise UsageError(f"--parts: {text!r} is invalid: comma separated, from {', '.join(PARTS)}")
    return parts


def previous(path: str) -> dict[str, Any]:
    """What an earlier run wrote to tune.json (the parts this run leaves alone), or nothing."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    args = parsed_arguments(argv, "meshjob_bench.tune", __doc__, add_arguments)
    parts = parse_parts(args.parts)
    setting = tune_measure.setting_from_args(args) if "measure" in parts else None
    models = tune_measure.models_from_args(args) if "measure" in parts else []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune.json")
    doc = previous(path)
    old_targets = doc.pop("targets", None) or {}
    targets: dict[str, Any] = {}
    if "search" in parts:
        doc["cases"] = [run_small(args.seed + i) for i in range(args.cases)]
        targets["equal_to_exhaustive"] = all(r["equal"] for r in doc["cases"])
    if "large" in parts:
        doc["large"] = run_large(args)
        targets["large_search_under_60_s"] = doc["large"]["search_seconds"] < 60
    if "cases" in doc and "large" in doc and ("search" in parts or "large" in parts):
        print_table(doc["cases"], doc["large"])
        plot(doc["cases"], doc["large"], os.path.join(args.out, "tune.png"))
    if "hand" in parts:
        doc["hand_written"] = tune_hand.run()
        tune_hand.print_table(doc["hand_written"])
        targets["hand_written"] = doc["hand_written"]["targets"]
    if setting is not None:
        doc["measured"] = tune_measure.measure(models, setting)
        doc["measured"]["plots"] = [os.path.join(args.out, "tune_measured.png")]
        tune_measure.print_table(doc["measured"])
        tune_measure.plot(doc["measured"], doc["measured"]["plots"][0])
        targets["measured_throughput"] = doc["measured"]["targets"]
    doc["targets"] = {**{k: v for k, v in old_targets.items() if k not in targets}, **targets}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")
    return 0 if doc["targets"].get("equal_to_exhaustive", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
