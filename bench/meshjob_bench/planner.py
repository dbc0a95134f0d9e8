"""Planner benchmark: each balancer's makespan over the lower bound, and its planning time.

Cases (tensor float32; one host per index of mesh dim 0; meshes on disjoint hosts):
  - one device -> a (2, 4) mesh (the Fig. 5 shape of Zhuang et al., 2022): one unit task;
  - (2, 4) -> (2, 4) with the paper-like spec pairs of MANY_TO_MANY (Zhuang et al., 2022, Fig. 8);
  - meshes of different shapes and host counts, whose cuts give slices of unequal size;
  - (4, 4) -> (4, 4), S01R -> RS01: 256 tasks;
  - 20 random tasks (seeded; 1-2 sender hosts of 4, 1-3 receiver hosts of 4, unequal sizes):
    where dfs may run out of budget, as the paper reports beyond about 20 tasks;
  - a 10,000-task case: (10, 10) S1RR -> (10, 10, 10) RS0S12, every slice held by all 10 sender
    hosts (sender choice) and needed on one of 10 receiving hosts (ordering).
The cost model is meshjob.balance's (NIC bytes / rate; intra-host time ignored); nothing runs on a
network here. Ratios are the result: makespan / lower bound (1.00 = the physical limit) and each
balancer against naive. Planning times are wall-clock on a shared machine: compare, don't quote.

Run: `python -m meshjob_bench.planner` or `meshjob bench planner`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence


from meshjob.balance import BALANCERS, STRATEGIES, HostTask, balance
from meshjob.mesh import Mesh
from meshjob.resharding import decompose
from meshjob.sharding import ShardingSpec

ITEMSIZE = 4
MANY_TO_MANY = (("S01R", "S0R"), ("RS1", "S0R"), ("S0R", "S1R"), ("S0S1", "S1S0"), ("RS01", "S01R"),
                ("S1R", "RS0"), ("RR", "S01R"))


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
    makespan_s: float
    lower_bound_s: float
    ratio_to_bound: float
    ratio_to_naive: float  # naive makespan / this makespan: the speed-up over naive
    plan_ms: float
    finished: bool


def cases() -> list[Case]:
    out = [Case("1 -> (2,4)", (1024, 1024), (1,), "RR", (2, 4), "RR")]
    out += [Case(f"(2,4) {s} -> {r}", (1024, 1024), (2, 4), s, (2, 4), r) for s, r in MANY_TO_MANY]
    out += [Case("(4,2) S0S1 -> (3,4) S1S0", (1680, 1680), (4, 2), "S0S1", (3, 4), "S1S0"),
            Case("(4,2) RS0 -> (3,4) S01R", (1680, 1024), (4, 2), "RS0", (3, 4), "S01R"),
            Case("(2,4) RS01 -> (5,2) S01R", (1680, 1680), (2, 4), "RS01", (5, 2), "S01R")]
    out.append(Case("(4,4) S01R -> RS01", (1024, 1024), (4, 4), "S01R", (4, 4), "RS01"))
    out.append(Case("random: 20 tasks, 4 + 4 hosts", (), (), "", (), ""))
    out.append(Case("10k: (10,10) S1RR -> (10,10,10) RS0S12", (1000, 100, 100), (10, 10), "S1RR",
                    (10, 10, 10), "RS0S12"))
    return out


def random_tasks(seed: int, n: int = 20, hosts: int = 4) -> list[HostTask]:
    rng = random.Random(seed)
    return [HostTask(tuple(rng.sample(range(hosts), rng.randint(1, 2))),
                     tuple(rng.sample(range(hosts, 2 * hosts), rng.randint(1, 3))),
                     rng.choice([1, 2, 4]) * (1 << 20)) for _ in range(n)]


def host_tasks(case: Case) -> tuple[list[HostTask], int]:
    """Decompose the case and lift its unit tasks to hosts; also the receiving devices per host."""
    if case.name.startswith("random"):
        return random_tasks(0), 1
    src = Mesh.grid(case.src_shape)
    dst = Mesh.grid(case.dst_shape, first_rank=src.size, first_host=case.src_shape[0])
    host = {**dict(zip(src.ranks, src.hosts)), **dict(zip(dst.ranks, dst.hosts))}
    units = decompose(case.shape, src, ShardingSpec.parse(case.send), dst, ShardingSpec.parse(case.recv),
                      ITEMSIZE)
    tasks = [HostTask(tuple(dict.fromkeys(host[r] for r in u.senders)),
                      tuple(dict.fromkeys(host[r] for r in u.receivers)), u.bytes) for u in units]
    per_host = max(sum(1 for r in units[0].receivers if host[r] == h) for h in tasks[0].receiver_hosts)
    return tasks, per_host


def bench_case(case: Case, strategy: str, chunks: int, nic_bytes_per_s: float, budget_s: float,
               seed: int) -> list[Row]:
    tasks, per_host = host_tasks(case)
    results = []
    for balancer in BALANCERS:
        began = time.perf_counter()
        sched = balance(tasks, balancer, strategy, chunks, nic_bytes_per_s, budget_s=budget_s, seed=seed,
                        receiver_devices_per_host=per_host)
        results.append((balancer, sched, (time.perf_counter() - began) * 1e3))
    naive = results[0][1].makespan_s
    return [Row(case.name, len(tasks), b, s.makespan_s, s.lower_bound_s,
                s.makespan_s / s.lower_bound_s if s.lower_bound_s else float("nan"),
                naive / s.makespan_s if s.makespan_s else float("nan"), ms, s.finished)
            for b, s, ms in results]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", default="broadcast", choices=STRATEGIES,
                        help="unit-task strategy whose cost formula is balanced (default broadcast)")
    parser.add_argument("--chunks", type=int, default=16, help="broadcast K (default 16)")
    parser.add_argument("--nic-gbit", type=float, default=1.0,
                        help="NIC rate of every host in Gbit/s (default 1)")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="dfs/greedy time budget in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="greedy seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-task case")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="folder for planner.json")


def print_table(rows: Sequence[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("case", "tasks", "balancer", "makespan / bound", "naive / makespan", "plan ms", "finished"):
        table.add_column(col, justify="left" if col in ("case", "balancer") else "right")
    last = None
    for r in rows:
        if last is not None and r.case != last:
            table.add_section()
        table.add_row(r.case if r.case != last else "", str(r.tasks) if r.case != last else "", r.balancer,
                      f"{r.ratio_to_bound:.3f}", f"{r.ratio_to_naive:.2f}x", f"{r.plan_ms:.1f}",
                      "yes" if r.finished else "budget")
        last = r.case
    Console(width=130).print(table)


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="meshjob_bench.planner", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(argv)
    if args.chunks < 1 or args.nic_gbit <= 0 or args.budget < 0:
        raise SystemExit("bench planner: --chunks must be >= 1, --nic-gbit > 0 and --budget >= 0")
    nic = args.nic_gbit * 1e9 / 8
    rows: list[Row] = []
    for case in cases():
        if args.quick and case.name.startswith("10k"):
            continue
        rows += bench_case(case, args.strategy, args.chunks, nic, args.budget, args.seed)
    title = (f"planner: strategy {args.strategy}, K={args.chunks}, NIC {args.nic_gbit:g} Gbit/s, "
             f"budget {args.budget:g} s (cost model, no network)")
    print_table(rows, title)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "planner.json")
    config = {"strategy": args.strategy, "chunks": args.chunks, "nic_gbit": args.nic_gbit,
              "budget_s": args.budget, "seed": args.seed, "itemsize": ITEMSIZE}
    with open(path, "w") as f:
        json.dump({"config": config, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
