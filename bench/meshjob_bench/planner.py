"""Planner benchmark: the balancers on the one network model (meshjob.network.model), in two parts.

Part 1, unit-task cases (tensor float32; one host per index of mesh dim 0; meshes on disjoint hosts):
  - one device -> a (2, 4) mesh (the paper's Fig. 5 shape): one unit task;
  - (2, 4) -> (2, 4) with the paper-like spec pairs of MANY_TO_MANY (Fig. 8);
  - meshes of different shapes and host counts, whose cuts give slices of unequal size;
  - (4, 4) -> (4, 4), S01R -> RS01: 256 tasks;
  - 20 random tasks (seeded; 1-2 sender hosts of 4, 1-3 receiver hosts of 4, unequal sizes):
    where dfs may run out of budget, as the paper reports beyond about 20 tasks;
  - a 10,000-task case: (10, 10) S1RR -> (10, 10, 10) RS0S12, every slice held by all 10 sender
    hosts (sender choice) and needed on one of 10 receiving hosts (ordering).
  Each balancer plans every case under both network models: `full` (what runs: separate egress and
  ingress links, per-message cost) and `half` (the paper's: a host in one task at a time). Reported:
  makespan / lower bound in each model, and "half on full": the half-duplex plan (senders, order)
  run on the full-duplex network, i.e. what planning with the paper's model costs on real NICs.
Part 2, step windows: every boundary of a pipeline step balanced jointly (meshjob.resharding.window) against
  each boundary balanced alone and then run together (the old per-boundary planning), on a
  U-Transformer stage pair whose three tensors can each come from either of two hosts (small and
  paper-scale tensors), a 4-stage U-Transformer on (2, 4) meshes, and the repository's examples.
Nothing runs on a network here. Ratios are the result (1.00 = the lower bound). Planning times are
wall-clock on a shared machine: compare, don't quote.

Run: `python -m meshjob_bench.planner` or `meshjob bench planner`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec
from meshjob.network.host_task import HostTask
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan, host_task
from meshjob.resharding.balance import BALANCERS, Schedule, balance, list_schedule
from meshjob.resharding.strategies import STRATEGIES
from meshjob.resharding.tasks import decompose
from meshjob.resharding.window import separately_balanced, with_shares
from meshjob.spec.manifest import job_to_dict, load_job, parse_job
from meshjob_bench import parsed_arguments

ITEMSIZE = 4
MANY_TO_MANY = (
    ("S01R", "S0R"),
    ("RS1", "S0R"),
    ("S0R", "S1R"),
    ("S0S1", "S1S0"),
    ("RS01", "S01R"),
    ("S1R", "RS0"),
    ("RR", "S01R"),
)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    src_shape: tuple[int, ...]
    send: str
    dst_shape: tuple[int, ...]
    recv: str


@dataclass(frozen=True)
class Row:
    case: str
    tasks: int
    balancer: str
    makespan_s: float  # full duplex
    lower_bound_s: float
    ratio_to_bound: float  # full duplex: makespan / lower bound
    ratio_to_naive: float  # naive makespan / this makespan (full duplex): the speed-up over naive
    half_ratio_to_bound: float  # the paper's model, its own makespan / its own lower bound
    half_on_full_ratio_to_bound: float  # the half-duplex plan run on the full-duplex network
    plan_ms: float  # full duplex
    finished: bool


@dataclass(frozen=True)
class WindowRow:
    case: str
    boundaries: int
    tasks: int
    balancer: str
    joint_makespan_s: float
    per_boundary_makespan_s: float
    lower_bound_s: float
    joint_ratio_to_bound: float
    per_boundary_ratio_to_bound: float
    joint_speedup: float  # per-boundary makespan / joint makespan
    half_plan_on_full_ratio_to_bound: float  # the joint plan made with the paper's model, run on full duplex
    plan_ms: float


# ------------------------------------------------------------------------------ part 1
def cases() -> list[Case]:
    out = [Case("1 -> (2,4)", (1024, 1024), (1,), "RR", (2, 4), "RR")]
    out += [Case(f"(2,4) {s} -> {r}", (1024, 1024), (2, 4), s, (2, 4), r) for s, r in MANY_TO_MANY]
    out += [
        Case("(4,2) S0S1 -> (3,4) S1S0", (1680, 1680), (4, 2), "S0S1", (3, 4), "S1S0"),
        Case("(4,2) RS0 -> (3,4) S01R", (1680, 1024), (4, 2), "RS0", (3, 4), "S01R"),
        Case("(2,4) RS01 -> (5,2) S01R", (1680, 1680), (2, 4), "RS01", (5, 2), "S01R"),
    ]
    out.append(Case("(4,4) S01R -> RS01", (1024, 1024), (4, 4), "S01R", (4, 4), "RS01"))
    out.append(Case("random: 20 tasks, 4 + 4 hosts", (), (), "", (), ""))
    out.append(
        Case("10k: (10,10) S1RR -> (10,10,10) RS0S12", (1000, 100, 100), (10, 10), "S1RR", (10, 10, 10), "RS0S12")
    )
    return out


def random_tasks(seed: int, n: int = 20, hosts: int = 4) -> list[HostTask]:
    rng = random.Random(seed)
    return [
        HostTask(
            tuple(rng.sample(range(hosts), rng.randint(1, 2))),
            tuple(rng.sample(range(hosts, 2 * hosts), rng.randint(1, 3))),
            rng.choice([1, 2, 4]) * (1 << 20),
        )
        for _ in range(n)
    ]


def host_tasks(case: Case) -> list[HostTask]:
    """Decompose the case and lift its unit tasks to hosts."""
    if case.name.startswith("random"):
        return random_tasks(0)
    src = Mesh.grid(case.src_shape)
    dst = Mesh.grid(case.dst_shape, first_rank=src.size, first_host=case.src_shape[0])
    host = {**dict(zip(src.ranks, src.hosts)), **dict(zip(dst.ranks, dst.hosts))}
    units = decompose(case.shape, src, ShardingSpec.parse(case.send), dst, ShardingSpec.parse(case.recv), ITEMSIZE)
    return [host_task(u, host.__getitem__) for u in units]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def bench_case(
    case: Case, strategy: str, chunks: int | str, network: NetworkModel, budget_s: float, seed: int
) -> list[Row]:
    tasks = host_tasks(case)
    half = replace(network, duplex="half")
    results = []
    for balancer in BALANCERS:
        began = time.perf_counter()
        full_plan = balance(tasks, balancer, strategy, network, chunks, budget_s=budget_s, seed=seed)
        ms = (time.perf_counter() - began) * 1e3
        half_plan = balance(tasks, balancer, strategy, half, chunks, budget_s=budget_s, seed=seed)
        on_full = list_schedule(tasks, half_plan.sender_host, half_plan.order, strategy, network, chunks)
        results.append((balancer, full_plan, half_plan, on_full, ms))
    naive = results[0][1].makespan_s
    return [
        Row(
            case.name,
            len(tasks),
            b,
            f.makespan_s,
            f.lower_bound_s,
            _ratio(f.makespan_s, f.lower_bound_s),
            _ratio(naive, f.makespan_s),
            _ratio(h.makespan_s, h.lower_bound_s),
            _ratio(o.makespan_s, f.lower_bound_s),
            ms,
            f.finished,
        )
        for b, f, h, o, ms in results
    ]


# ------------------------------------------------------------------------------ part 2
U_PAIR: dict[str, Any] = {
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "u-pair"},
    "spec": {
        "model": {"kind": "utransformer", "layers": 4, "hidden": 256, "heads": 2, "vocab": 64, "seqLen": 64},
        "training": {"steps": 1, "globalBatch": 12, "microbatches": 2, "seed": 0},
        "topology": {"devicesPerHost": 1},
        "stages": [
            {"layers": [0, 2], "mesh": [2, 1], "tensorParallelDim": 0},
            {"layers": [2, 4], "mesh": [3, 1], "dataParallelDim": 0},
        ],
        "resharding": {"strategy": "broadcast", "chunks": "auto", "balancer": "greedy", "budgetSeconds": 0.5},
        "schedule": {"kind": "eager-1f1b", "weightGradDelay": "auto"},
    },
}


def u_pair_job(hidden: int = 256, seq_len: int = 64, **resharding: Any) -> Any:
    """A U-Transformer stage pair: layers 0,1 -> 3,2 skips from stage 0 to stage 1 beside the
    activation, so three tensors and their gradients cross the same pair. Stage 0 is tensor
    parallel across 2 hosts (every tensor replicated on both: either may send), stage 1 data
    parallel over 3 hosts."""
    doc = copy.deepcopy(U_PAIR)
    doc["spec"]["model"].update({"hidden": hidden, "seqLen": seq_len})
    doc["spec"]["resharding"].update(resharding)
    return parse_job(doc)


def u_four_stages_job(**resharding: Any) -> Any:
    """A paper-scale U-Transformer on four (2, 4) / (4, 2) meshes, 4 devices per host: the (2, 4)
    stages are tensor parallel across their 2 hosts (activations replicated on both), the (4, 2)
    ones data parallel over their 4 hosts."""
    tp_across = {"mesh": [2, 4], "tensorParallelDim": 0, "dataParallelDim": 1}
    dp_across = {"mesh": [4, 2], "dataParallelDim": 0, "tensorParallelDim": 1}
    doc = copy.deepcopy(U_PAIR)
    doc["metadata"]["name"] = "u-four"
    doc["spec"].update(
        {
            "model": {"kind": "utransformer", "layers": 8, "hidden": 2048, "heads": 16, "vocab": 64, "seqLen": 1024},
            "training": {"steps": 1, "globalBatch": 32, "microbatches": 8, "seed": 0},
            "topology": {"devicesPerHost": 4},
            "stages": [{"layers": [2 * i, 2 * i + 2], **(tp_across if i % 2 == 0 else dp_across)} for i in range(4)],
        }
    )
    doc["spec"]["resharding"].update(resharding)
    return parse_job(doc)


def window_jobs() -> list[tuple[str, Any]]:
    """(case name, builder of the job for a balancer)."""

    def example(name: str) -> Any:
        def build(balancer: str) -> Any:
            doc = job_to_dict(load_job(str(EXAMPLES / f"{name}.yaml")))
            doc["spec"]["resharding"]["balancer"] = balancer
            return parse_job(doc)

        return build

    jobs: list[tuple[str, Any]] = [
        ("U-Transformer pair (2 TP hosts -> 3 DP hosts), 128 KiB tensors", lambda b: u_pair_job(balancer=b)),
        (
            "U-Transformer pair, paper scale (24 MiB tensors)",
            lambda b: u_pair_job(hidden=1024, seq_len=1024, balancer=b),
        ),
        ("U-Transformer 4 stages on (2,4)/(4,2) meshes (16 MiB)", lambda b: u_four_stages_job(balancer=b)),
    ]
    jobs += [
        (f"example {name}", example(name))
        for name in ("gpt-demo", "utransformer-demo")
        if (EXAMPLES / f"{name}.yaml").exists()
    ]
    return jobs


def per_boundary(plan: Any) -> list[Schedule]:
    """Each window of the plan, its boundaries balanced alone and then run together."""
    spec = plan.job.resharding
    tasks = [[host_task(t, plan.placement.host_of) for t in b.tasks] for b in plan.boundaries]
    return [
        separately_balanced(
            w,
            tasks,
            spec.balancer,
            spec.strategy,
            plan.network,
            spec.chunks,
            spec.budget_seconds,
            plan.job.training.seed,
        )
        for w in plan.windows
    ]


def on_network(plan: Any, network: NetworkModel) -> list[Schedule]:
    """Each window's joint plan (senders, order) re-timed on another network model."""
    spec, out = plan.job.resharding, []
    for w in plan.windows:
        tasks = with_shares(
            [host_task(t, plan.placement.host_of) for b in w.boundaries for t in plan.boundaries[b].tasks]
        )
        out.append(list_schedule(tasks, w.schedule.sender_host, w.schedule.order, spec.strategy, network, spec.chunks))
    return out


def bench_window(name: str, build: Any, network: NetworkModel) -> list[WindowRow]:
    rows = []
    for balancer in BALANCERS:
        job = build(balancer)
        began = time.perf_counter()
        plan = build_plan(job, network=network)
        ms = (time.perf_counter() - began) * 1e3
        alone = per_boundary(plan)
        half = on_network(build_plan(job, network=replace(network, duplex="half")), network)
        joint = max(w.makespan_s for w in plan.windows)
        separate = max(s.makespan_s for s in alone)
        bound = max(w.lower_bound_s for w in plan.windows)
        rows.append(
            WindowRow(
                name,
                len(plan.boundaries),
                sum(len(b.tasks) for b in plan.boundaries),
                balancer,
                joint,
                separate,
                bound,
                _ratio(joint, bound),
                _ratio(separate, bound),
                _ratio(separate, joint),
                _ratio(max(s.makespan_s for s in half), bound),
                ms,
            )
        )
    return rows


# ------------------------------------------------------------------------------ output
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        default="broadcast",
        choices=tuple(STRATEGIES),
        help="unit-task strategy whose cost is balanced in part 1 (default broadcast)",
    )
    parser.add_argument("--chunks", default="auto", help="broadcast K, or auto (default auto)")
    parser.add_argument("--nic-gbit", type=float, default=1.0, help="NIC rate of every host in Gbit/s (default 1)")
    parser.add_argument(
        "--message-us",
        type=float,
        default=None,
        help="per-message cost in µs (default: the network model's measured default)",
    )
    parser.add_argument("--budget", type=float, default=1.0, help="dfs/greedy budget in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="greedy seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-task case and the paper-scale windows")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="folder for planner.json/png")


def print_tables(rows: Sequence[Row], windows: Sequence[WindowRow], title: str) -> None:
    console = Console(width=150)
    table = Table(title=f"{title} — part 1: makespan / lower bound, full vs half duplex")
    for col in (
        "case",
        "tasks",
        "balancer",
        "full",
        "half",
        "half plan on full",
        "naive / makespan",
        "plan ms",
        "finished",
    ):
        table.add_column(col, justify="left" if col in ("case", "balancer") else "right")
    last = None
    for r in rows:
        if last is not None and r.case != last:
            table.add_section()
        table.add_row(
            r.case if r.case != last else "",
            str(r.tasks) if r.case != last else "",
            r.balancer,
            f"{r.ratio_to_bound:.3f}",
            f"{r.half_ratio_to_bound:.3f}",
            f"{r.half_on_full_ratio_to_bound:.3f}",
            f"{r.ratio_to_naive:.2f}x",
            f"{r.plan_ms:.1f}",
            "yes" if r.finished else "budget",
        )
        last = r.case
    console.print(table)
    table = Table(title=f"{title} — part 2: a step's boundaries balanced jointly vs one at a time (makespan / bound)")
    for col in (
        "case",
        "boundaries",
        "tasks",
        "balancer",
        "joint",
        "per boundary",
        "joint speed-up",
        "half plan on full",
        "plan ms",
    ):
        table.add_column(col, justify="left" if col in ("case", "balancer") else "right")
    last = None
    for w in windows:
        if last is not None and w.case != last:
            table.add_section()
        new = w.case != last
        table.add_row(
            w.case if new else "",
            str(w.boundaries) if new else "",
            str(w.tasks) if new else "",
            w.balancer,
            f"{w.joint_ratio_to_bound:.3f}",
            f"{w.per_boundary_ratio_to_bound:.3f}",
            f"{w.joint_speedup:.2f}x",
            f"{w.half_plan_on_full_ratio_to_bound:.3f}",
            f"{w.plan_ms:.0f}",
        )
        last = w.case
    console.print(table)


def gmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def plot(rows: Sequence[Row], windows: Sequence[WindowRow], path: str, title: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = (
        ("full", "ratio_to_bound"),
        ("half (its own model)", "half_ratio_to_bound"),
        ("half plan on full", "half_on_full_ratio_to_bound"),
    )
    width = 0.8 / len(labels)
    for j, (label, attr) in enumerate(labels):
        ys = [gmean([getattr(r, attr) for r in rows if r.balancer == b]) for b in BALANCERS]
        left.bar([i + j * width for i in range(len(BALANCERS))], ys, width, label=label)
    left.axhline(1.0, color="black", lw=0.8, ls="--")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(BALANCERS))], list(BALANCERS))
    left.set_ylabel("makespan / lower bound (geometric mean)")
    left.set_title("balancers: full vs half duplex", fontsize=9)
    left.legend(fontsize=8)
    cases = list(dict.fromkeys(w.case for w in windows))
    width = 0.8 / len(BALANCERS)
    for j, b in enumerate(BALANCERS):
        ys = [next((w.joint_speedup for w in windows if w.case == c and w.balancer == b), math.nan) for c in cases]
        right.bar([i + j * width for i in range(len(cases))], ys, width, label=b)
    right.axhline(1.0, color="black", lw=0.8, ls="--")
    right.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(cases))], [c[:28] for c in cases], rotation=20, ha="right", fontsize=7
    )
    right.set_ylabel("per-boundary makespan / joint makespan")
    right.set_title("a step's boundaries balanced jointly", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(args: argparse.Namespace) -> tuple[int | str, NetworkModel]:
    chunks: int | str = args.chunks if args.chunks == "auto" else int(args.chunks) if args.chunks.isdigit() else -1
    if (
        isinstance(chunks, int)
        and chunks < 1
        or args.nic_gbit <= 0
        or args.budget < 0
        or (args.message_us is not None and args.message_us < 0)
    ):
        raise SystemExit(
            "bench planner: --chunks must be auto or >= 1, --nic-gbit > 0, --budget >= 0 and --message-us >= 0"
        )
    network = NetworkModel(nic_bytes_per_s=args.nic_gbit * 1e9 / 8)
    if args.message_us is not None:
        network = replace(network, message_s=args.message_us / 1e6)
    return chunks, network


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    args = parsed_arguments(argv, "meshjob_bench.planner", __doc__, add_arguments)
    chunks, network = _parse(args)
    rows: list[Row] = []
    for case in cases():
        if args.quick and case.name.startswith("10k"):
            continue
        rows += bench_case(case, args.strategy, chunks, network, args.budget, args.seed)
    windows: list[WindowRow] = []
    for name, build in window_jobs():
        if args.quick and ("paper scale" in name or "4 stages" in name):
            continue
        windows += bench_window(name, build, network)
    title = (
        f"planner: strategy {args.strategy}, K={chunks}, NIC {args.nic_gbit:g} Gbit/s, "
        f"{network.message_s * 1e6:g} µs per message, budget {args.budget:g} s (network model, no network)"
    )
    print_tables(rows, windows, title)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "planner.png")
    plot(rows, windows, png, title)
    config = {
        "strategy": args.strategy,
        "chunks": chunks,
        "nic_gbit": args.nic_gbit,
        "budget_s": args.budget,
        "seed": args.seed,
        "itemsize": ITEMSIZE,
        "quick": bool(args.quick),
        "network_model": network.to_json(),
        "models": {"full": "full duplex (what runs)", "half": "half duplex (the paper's constraint 3)"},
    }
    path = os.path.join(args.out, "planner.json")
    with open(path, "w") as f:
        json.dump(
            {
                "config": config,
                "rows": [asdict(r) for r in rows],
                "windows": [asdict(w) for w in windows],
                "plots": [png],
            },
            f,
            indent=1,
        )
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
