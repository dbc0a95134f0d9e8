"""`meshjob tune job.yaml --hosts N`: choose stage cuts, meshes, parallel splits, microbatches, schedule and
resharding settings for a cluster (meshjob.search.algorithm), print the ranked candidates and write the winner.

Fields the manifest sets are kept (meshjob.search.inputs says which are searched when absent or `auto`).
Bad flags and manifests exit 2 naming the flag or field, the value and what is allowed; a model that fits
no plan's memory exits 2 with the smallest overflow found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshjob.errors import UsageError
from meshjob.plan.placement import MAX_CLUSTER_HOSTS
from meshjob.search.algorithm import Prediction, Problem, Result, default_space, search
from meshjob.search.algorithm import Progress as SearchProgress
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.settings import DEFAULT_DEVICE, DEFAULT_NIC_RATE, Settings, resolve
from meshjob.spec.manifest import MAX_DEVICES_PER_HOST, parse_job
from meshjob.spec.model import TunedForSpec
from meshjob.spec.safeyaml import load_documents, read_text, source_name

HELP = "choose stages, meshes, parallel degrees, microbatches, schedule and resharding for a cluster"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "job",
        help="TrainingJob manifest (YAML, one document; - reads standard input); spec.stages may be auto or left out",
    )
    p.add_argument("--hosts", type=int, required=True, help="hosts in the cluster")
    p.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        help="devices per host (default: the manifest's spec.topology.devicesPerHost, else 8)",
    )
    p.add_argument(
        "--nic-rate",
        default=None,
        help=f"NIC rate per host and direction, tc style (default: spec.tunedFor's, else {DEFAULT_NIC_RATE})",
    )
    p.add_argument(
        "--device", default=None, help=f"device profile: h100 or a100 (default: spec.tunedFor's, else {DEFAULT_DEVICE})"
    )
    p.add_argument(
        "--memory",
        default=None,
        help="memory per device, e.g. 80Gi or 40GiB (default: spec.tunedFor's, else the profile's)",
    )
    p.add_argument("--top", type=int, default=5, help="candidates to rank (default 5)")
    p.add_argument("--max-stages", type=int, default=None, help="most pipeline stages to consider (default 16)")
    p.add_argument(
        "--max-evaluations",
        type=int,
        default=None,
        help="most candidates to simulate (default 100); the search says when it stopped there",
    )
    p.add_argument("--out", default=None, help="write the chosen manifest here (it passes meshjob plan)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _positive(args: argparse.Namespace, flag: str, value: int | None, most: int | None = None) -> None:
    if value is not None and (value < 1 or (most is not None and value > most)):
        allowed = "a positive integer" + (f" at most {most}" if most is not None else "")
        raise UsageError(f"--{flag}: {value} is invalid: {allowed}")


def settings_from_args(args: argparse.Namespace, tuned: TunedForSpec | None) -> Settings:
    """The cluster the flags describe, over the manifest's spec.tunedFor (meshjob.search.settings)."""
    _positive(args, "hosts", args.hosts, MAX_CLUSTER_HOSTS)
    _positive(args, "devices-per-host", args.devices_per_host, MAX_DEVICES_PER_HOST)
    _positive(args, "top", args.top)
    _positive(args, "max-stages", args.max_stages)
    _positive(args, "max-evaluations", args.max_evaluations)
    return resolve(tuned, args.hosts, args.nic_rate, args.device, args.memory)


def run(args: argparse.Namespace) -> int:
    docs = load_documents(read_text(args.job, "TrainingJob manifest"), source_name(args.job))
    if len(docs) != 1:
        raise UsageError(f"{args.job}: {len(docs)} documents: meshjob tune takes exactly one TrainingJob")
    doc = docs[0]
    fixed = read_fixed(doc)
    topology = (doc.get("spec") or {}).get("topology") or {}
    devices_per_host = args.devices_per_host or int(topology.get("devicesPerHost") or 8)
    _positive(args, "devices-per-host", devices_per_host, MAX_DEVICES_PER_HOST)
    job = base_job(doc, devices_per_host)
    settings = settings_from_args(args, job.tuned_for)
    cluster = settings.cluster(devices_per_host)
    space = default_space(job, fixed, cluster, **({"max_stages": args.max_stages} if args.max_stages else {}))
    problem = Problem(doc, job, cluster, fixed, space, settings)
    t0 = time.perf_counter()
    kwargs = {"max_evaluations": args.max_evaluations} if args.max_evaluations else {}
    result = _with_progress(args, lambda progress: search(problem, top=args.top, progress=progress, **kwargs))
    seconds = time.perf_counter() - t0
    manifest = problem.manifest(result.best.candidate)
    parse_job(manifest)  # the written manifest is one meshjob plan accepts
    if args.out:
        with open(args.out, "w") as f:
            yaml.safe_dump(manifest, f, sort_keys=False)
    out = summary(problem, result, seconds)
    if args.json:
        print(json.dumps({**out, "manifest": manifest}, indent=2))
    else:
        print_tables(out, args.out)
    return 0


def _with_progress(args: argparse.Namespace, work: Callable[[SearchProgress | None], Result]) -> Result:
    """Run work(progress) under a rich progress bar on a terminal's stderr (none with --json or a pipe)."""
    if args.json or not sys.stderr.isatty():
        return work(None)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                label = {"bounds": "bounds (DP per microbatches x schedule)", "simulate": "simulating candidates"}
                tasks[phase] = bar.add_task(label.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=max(total, done))

        return work(progress)


def why_lost(winner: Prediction, other: Prediction) -> str:
    """The part of the step that grew most against the winner's."""
    slower = other.step_s / winner.step_s - 1 if winner.step_s > 0 else 0.0
    if other.step_s == winner.step_s:
        return "tie on predicted step time (ranked after the winner by its settings)"
    parts = {
        "busiest stage computes longer": other.compute_s - winner.compute_s,
        "more bubble (idle stage time)": (other.bubble - winner.bubble) * other.step_s,
        "longer gradient all-reduce": other.allreduce_s - winner.allreduce_s,
        "more exposed resharding (waits on transfers)": other.exposed_comm_s - winner.exposed_comm_s,
    }
    reason, _ = max(parts.items(), key=lambda kv: (kv[1], kv[0]))
    return f"{slower:+.1%} step time: {reason}"


def summary(problem: Problem, result: Result, seconds: float) -> dict[str, Any]:
    best = result.best
    rows: list[dict[str, Any]] = []
    for rank, p in enumerate(result.ranked, 1):
        row = {"rank": rank, **p.to_json()}
        if rank > 1:
            row["why_lost"] = why_lost(best, p)
        rows.append(row)
    return {
        "job": problem.job.name,
        "cluster": problem.cluster.to_json(),
        "search_seconds": seconds,
        "evaluated": result.evaluated,
        "listed": result.listed,
        "proven_best": result.proven,
        "optimality_gap": result.gap if result.gap < float("inf") else None,
        "lower_bound_s": result.best_bound_s,
        "threshold_s": result.threshold_s if result.threshold_s < float("inf") else None,
        "ranked": rows,
    }


def print_tables(out: dict[str, Any], path: str | None) -> None:
    con = Console(width=max(120, Console().width))
    c = out["cluster"]
    plans = f"{out['evaluated']} plan{'' if out['evaluated'] == 1 else 's'}"
    con.print(
        f"[bold]{out['job']}[/]: {c['hosts']} hosts x {c['devices_per_host']} {c['device']['name']}, "
        f"{c['memory_bytes'] / 2**30:.1f} GiB each, NIC {c['network']['nic_bytes_per_s'] * 8 / 1e9:g} Gbit/s; "
        f"searched in {out['search_seconds']:.1f} s, {plans} simulated"
    )
    con.print(
        "the best of the space: proven (every candidate that could beat it was simulated)"
        if out["proven_best"]
        else f"[yellow]not proven best[/]: the search stopped at its budget; every candidate not simulated "
        f"predicts at least {out['threshold_s'] * 1e3:.3f} ms (its lower bound): optimality gap "
        + ("unbounded" if out["optimality_gap"] is None else f"{out['optimality_gap']:.1%}")
    )
    t = Table("rank", "step ms", "tokens/s", "memory/device", "bubble", "resharding ms", "plan", title="candidates")
    for row in out["ranked"]:
        t.add_row(
            str(row["rank"]),
            f"{row['step_s'] * 1e3:.3f}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['max_memory_bytes'] / 2**30:.2f} GiB",
            f"{row['bubble']:.1%}",
            f"{row['resharding_s'] * 1e3:.3f}",
            row["label"],
        )
    con.print(t)
    for row in out["ranked"][1:]:
        con.print(f"#{row['rank']} lost: {row['why_lost']}")
    if path:
        con.print(f"wrote {path} (check it with: meshjob plan {path})")
