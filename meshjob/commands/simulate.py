"""`meshjob simulate job.yaml`: predict a plan's step time, bubbles and resharding time (no processes run).

Two step times: one step from an empty pipeline (the timeline and bubbles are that step's), and the
steady-state period of steps run one after another (meshjob.simulate.steady: what a running job's step takes,
and what `weightGradDelay: auto` rates its candidates by)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from meshjob.commands import costs as cost_options
from meshjob.errors import UsageError
from meshjob.plan.build import build_plan
from meshjob.simulate.simulator import scale_job, simulate_plan, summarize
from meshjob.simulate.steady import plan_period_s
from meshjob.spec.manifest import load_job

HELP = "predict step time, bubbles and resharding time of a plan at any scale"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="TrainingJob manifest (YAML, one document; - reads standard input)")
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="spread the job over this many hosts (each stage's mesh dim 0 grows; data parallel)",
    )
    cost_options.add_arguments(p)
    p.add_argument(
        "--layer-forward-ms",
        type=float,
        default=None,
        help="forward time of one layer for one sample, in ms (default: calibration or 0.25)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    network = cost_options.network_from_args(args)
    if args.hosts is not None and args.hosts < 1:
        raise UsageError(f"--hosts: {args.hosts} is invalid: use a positive number of hosts")
    job = load_job(args.job)
    cost = cost_options.cost_from_args(args, job, network)  # on the job as written: per-sample costs
    if args.hosts:  # do not change with scale
        job = scale_job(job, args.hosts)
        if args.device is not None:  # a device's costs are per stage: those of the scaled stages
            cost = cost_options.cost_from_args(args, job, network)
    if args.layer_forward_ms is not None:
        if args.device is not None:
            raise UsageError("--layer-forward-ms and --device: choose one source of compute costs")
        cost = replace(cost, layer_forward_s=args.layer_forward_ms / 1e3, measured=False)
    t0 = time.perf_counter()
    plan = build_plan(job, network=network, cost=cost)  # the costs size the plan's weight delays too
    t_plan = time.perf_counter() - t0
    result = simulate_plan(plan, cost)
    period = plan_period_s(plan, cost)
    t_sim = time.perf_counter() - t0 - t_plan
    out = {
        "job": job.name,
        "world_size": plan.placement.world_size,
        "hosts": len(plan.placement.hosts_used()),
        "nic_rate": args.nic_rate,
        "schedule": job.schedule.kind,
        "plan_seconds": t_plan,
        "simulate_seconds": t_sim,
        "cost_model": cost.to_json(),
        "weight_delay": {str(s): d for s, d in sorted(plan.weight_delay.items())},
        **result.to_json(),
        "period_s": period,
        "boundaries": summarize(plan, result),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    con = Console()
    con.print(
        f"[bold]{job.name}[/]: {out['world_size']} devices on {out['hosts']} hosts, NIC {args.nic_rate} "
        f"({network.duplex} duplex), {job.schedule.kind}; planned in {t_plan:.2f}s, simulated in {t_sim:.2f}s"
        + ("; measured compute costs" if cost.measured else "")
    )
    con.print(
        f"predicted step time {result.step_s * 1e3:.2f} ms from an empty pipeline, {period * 1e3:.2f} ms per "
        f"step run after step (steady period); mean bubble {result.bubble_fraction():.1%}"
    )
    t = Table("stage", "compute ms", "bubble", "comm overlap", "exposed comm ms", "W delay", title="stages")
    for i, s in result.stages.items():
        t.add_row(
            str(i),
            f"{s.compute_s * 1e3:.2f}",
            f"{s.bubble_fraction(result.step_s):.1%}",
            f"{s.overlap_fraction():.1%}",
            f"{s.exposed_comm_s * 1e3:.2f}",
            str(plan.weight_delay.get(i, 0)),
        )
    con.print(t)
    t = Table("boundary", "simulated ms", "planned ms", "lower bound ms", "sim / bound", title="resharding")
    for row in out["boundaries"]:
        lb = row["lower_bound_s"]
        t.add_row(
            row["boundary"],
            f"{row['simulated_s'] * 1e3:.2f}",
            f"{row['planned_s'] * 1e3:.2f}",
            f"{lb * 1e3:.2f}",
            f"{row['simulated_s'] / lb:.2f}" if lb > 0 else "-",
        )
    con.print(t)
    return 0
