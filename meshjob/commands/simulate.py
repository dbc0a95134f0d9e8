"""`meshjob simulate job.yaml`: predict a plan's step time, bubbles and resharding time (no processes run).

Two step times: one step from an empty pipeline (the timeline and bubbles are that step's), and the
steady-state period of steps run one after another (meshjob.simulate.steady: what a running job's step takes,
and what `weightGradDelay: auto` rates its candidates by)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.commands import costs as cost_options
from meshjob.errors import UsageError
from meshjob.network.model import NetworkModel
from meshjob.plan.build import Plan, build_plan
from meshjob.search.cluster import Cluster
from meshjob.search.job_step import job_step
from meshjob.simulate.simulator import PipelineResult, scale_job, summarize
from meshjob.simulate.steady import plan_period_s, plan_step_and_period
from meshjob.simulate.torch_peers import torch_families
from meshjob.spec.manifest import TrainingJob, load_job
from meshjob.units import format_rate

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
    p.add_argument(
        "--torch-schedules",
        action="store_true",
        help="also one step of each torch.distributed.pipelining schedule on the same pipeline and costs",
    )


def run(args: argparse.Namespace) -> int:
    if args.hosts is not None and args.hosts < 1:
        raise UsageError(f"--hosts: {args.hosts} is invalid: use a positive number of hosts")
    job = load_job(args.job)
    network = cost_options.network_from_args(args, job.tuned_for)
    cluster = None if args.hosts else cost_options.tuned_cluster(args, job, network)
    if cluster is not None:
        return _tuned(args, job, cluster)
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
    result, period = plan_step_and_period(plan, cost)  # one run gives the first step and the steady period
    t_sim = time.perf_counter() - t0 - t_plan
    out = {
        "job": job.name,
        "world_size": plan.placement.world_size,
        "hosts": len(plan.placement.hosts_used()),
        "nic_rate": format_rate(network.nic_bytes_per_s),
        "schedule": job.schedule.kind,
        "plan_seconds": t_plan,
        "simulate_seconds": t_sim,
        "cost_model": cost.to_json(),
        "weight_delay": {str(s): d for s, d in sorted(plan.weight_delay.items())},
        **result.to_json(),
        "period_s": period,
        "boundaries": summarize(plan, result),
    }
    if args.torch_schedules:  # which schedule family wins on this job (meshjob.simulate.torch_peers)
        out["torch_schedules_step_s"] = torch_families(plan, cost)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out, plan, result, network, cost.measured)
    for name, step_s in out.get("torch_schedules_step_s", {}).items():
        print(f"torch {name}: one step {step_s * 1e3:.2f} ms ({step_s / out['step_s']:.2f}x meshjob's)")
    return 0


def _tuned(args: argparse.Namespace, job: TrainingJob, cluster: Cluster) -> int:
    """A tuned manifest on the cluster it was tuned for, predicted as `meshjob tune` did (meshjob.search.job_step):
    the step ends with every stage's gradient all-reduce and optimizer step."""
    t0 = time.perf_counter()
    run = job_step(job, cluster)
    t_plan = time.perf_counter() - t0  # planning and simulating one step: one call
    tails = {k: f.tail_s for k, f in enumerate(run.figures)}
    period = plan_period_s(run.plan, run.cost, tails)
    pipeline = run.pipeline.to_json()
    out = {
        "job": job.name,
        "world_size": run.plan.placement.world_size,
        "hosts": len(run.plan.placement.hosts_used()),
        "nic_rate": format_rate(cluster.network.nic_bytes_per_s),
        "schedule": job.schedule.kind,
        "plan_seconds": t_plan,
        "simulate_seconds": time.perf_counter() - t0 - t_plan,
        "model": "tuned",  # spec.tunedFor: the search's stage model and the stages' tails
        "cluster": cluster.to_json(),
        "cost_model": run.cost.to_json(),
        "weight_delay": {str(s): d for s, d in sorted(run.plan.weight_delay.items())},
        **pipeline,
        "step_s": run.step_s,
        "pipeline_step_s": pipeline["step_s"],
        "stage_ends_s": list(run.ends),
        "period_s": period,
        "boundaries": summarize(run.plan, run.pipeline),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out, run.plan, run.pipeline, cluster.network, True)
    return 0


def _print(out: dict[str, Any], plan: Plan, result: PipelineResult, network: NetworkModel, measured: bool) -> None:
    con = Console()
    job = plan.job
    t_plan, t_sim, period = out["plan_seconds"], out["simulate_seconds"], out["period_s"]
    tuned = out.get("model") == "tuned"
    con.print(
        f"[bold]{job.name}[/]: {out['world_size']} devices on {out['hosts']} hosts, NIC {out['nic_rate']} "
        f"({network.duplex} duplex), {job.schedule.kind}; planned in {t_plan:.2f}s, simulated in {t_sim:.2f}s"
        + (f"; as tuned for {out['cluster']['device']['name']} (spec.tunedFor)" if tuned else "")
        + ("; measured compute costs" if measured and not tuned else "")
    )
    con.print(
        f"predicted step time {out['step_s'] * 1e3:.2f} ms from an empty pipeline"
        + (" (gradient all-reduces and optimizer steps included)" if tuned else "")
        + f", {period * 1e3:.2f} ms per step run after step (steady period); mean bubble "
        f"{result.bubble_fraction():.1%}"
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
