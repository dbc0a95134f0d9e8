"""`meshjob plan job.yaml [--hosts hosts.yaml] [--json] [--nic-rate 1gbit]`: show the plan.

Readable tables by default (placement; each boundary's unit tasks with sender, receivers, bytes
and start; makespan vs lower bound; each stage's action list), or one JSON object with --json
(the contract tools rely on, see Plan.to_json). Bad manifests, hosts files and rates exit 2 with the field named.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "show the plan for a TrainingJob: placement, resharding tasks, schedules"
MAX_TASK_ROWS = 64  # per boundary in the table; --json always has every task


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="TrainingJob manifest (YAML)")
    p.add_argument("--hosts", metavar="HOSTS_YAML",
                   help="cluster: a list of {name, devices, rack} (default: the smallest cluster of "
                        "identical hosts with topology.devicesPerHost devices)")
    p.add_argument("--nic-rate", default="1gbit", help="NIC rate per host, tc style (default 1gbit)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the plan contract)")


def run(args: argparse.Namespace) -> int:
    from meshjob.errors import UsageError
    from meshjob.placement import load_hosts
    from meshjob.plan import build_plan
    from meshjob.spec import load_job
    from meshjob.units import parse_rate

    try:
        nic_bytes_per_s = parse_rate(args.nic_rate, "--nic-rate")
    except ValueError as err:
        raise UsageError(str(err)) from None
    job = load_job(args.job)
    hosts = load_hosts(args.hosts) if args.hosts else None
    plan = build_plan(job, hosts, nic_bytes_per_s=nic_bytes_per_s)
    doc = plan.to_json()
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_tables(doc, args.nic_rate)
    return 0


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3 or seconds == 0:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _slice(s: list[list[int]]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in s) + "]"


def print_tables(doc: dict[str, Any], nic_rate: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    schedule = doc["schedule"]
    console.print(
        f"[bold]{doc['job']}[/]: {doc['world_size']} ranks on {len(doc['hosts'])} hosts, NIC {nic_rate}, "
        f"schedule {schedule['kind']} (weight-grad delay {schedule['weight_grad_delay']})"
    )

    placement = Table(title="Placement (mesh rows on hosts)")
    for col in ("stage", "row", "host", "rack", "global ranks", "local devices"):
        placement.add_column(col)
    for row in doc["placement"]:
        placement.add_row(str(row["stage"]), str(row["row"]), row["host"], row["rack"] or "-",
                          ", ".join(map(str, row["devices"])), ", ".join(map(str, row["local_devices"])))
    console.print(placement)

    summary = Table(title="Boundaries (cross-mesh resharding)")
    for col in ("boundary", "send", "recv", "strategy", "balancer", "tasks", "makespan", "lower bound", "ratio"):
        summary.add_column(col, justify="right" if col in ("tasks", "makespan", "lower bound", "ratio") else "left")
    for b in doc["boundaries"]:
        ratio = b["makespan_s"] / b["lower_bound_s"] if b["lower_bound_s"] > 0 else float("nan")
        summary.add_row(b["key"], b["send"], b["recv"], b["strategy"],
                        b["balancer"], str(len(b["tasks"])), _ms(b["makespan_s"]), _ms(b["lower_bound_s"]),
                        f"{ratio:.2f}")
    console.print(summary)

    for b in doc["boundaries"]:
        tasks = sorted(enumerate(b["tasks"]), key=lambda it: (it[1]["start_s"], it[0]))
        table = Table(title=f"{b['key']}: unit tasks by start "
                            f"(makespan {_ms(b['makespan_s'])}, lower bound {_ms(b['lower_bound_s'])})")
        for col in ("task", "slice", "sender", "holders", "receivers", "bytes", "start", "seconds"):
            table.add_column(col, justify="right" if col in ("task", "bytes", "start", "seconds") else "left")
        for index, task in tasks[:MAX_TASK_ROWS]:
            table.add_row(str(index), _slice(task["slice"]), str(task["sender"]),
                          ", ".join(map(str, task["senders"])), ", ".join(map(str, task["receivers"])),
                          _bytes(task["bytes"]), _ms(task["start_s"]), _ms(task["seconds"]))
        if len(tasks) > MAX_TASK_ROWS:
            table.caption = f"{len(tasks) - MAX_TASK_ROWS} more tasks: see --json"
        console.print(table)

    actions = Table(title="Schedules (per-stage action lists)")
    actions.add_column("stage")
    actions.add_column("peak stashed", justify="right")
    actions.add_column("W delay", justify="right")
    actions.add_column("actions")
    for stage, items in doc["schedules"].items():
        actions.add_row(stage, str(schedule["peak_stashed"][stage]),
                        str(schedule["weight_delay"].get(stage, 0)), " ".join(items))
    console.print(actions)
