"""`meshjob plan job.yaml [--hosts hosts.yaml] [--json] [--nic-rate 1gbit] [--calibrate]`: show the plan.

Readable tables by default (placement; the network: per-host egress/ingress bytes per step and each
balancing window's joint makespan vs its lower bound; each boundary's unit tasks with sender,
receivers, bytes, chunks and start; makespan vs lower bound; each stage's weight-gradient delay,
peak stash and action list), or one JSON object with --json (the contract tools rely on, see
Plan.to_json). `-` reads the manifest from standard input. A file of several YAML documents
(`---`) holds one job per document: every job is checked first, then each is planned; --json then
prints a JSON list of plans, in document order. Bad manifests, hosts files and rates exit 2 with
the field (and the document) named.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshjob.commands import costs as cost_options

HELP = "show the plan for a TrainingJob: placement, resharding tasks, schedules"
MAX_TASK_ROWS = 64  # per boundary in the table; --json always has every task


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="TrainingJob manifest (YAML; - reads standard input; one job per document)")
    p.add_argument("--hosts", metavar="HOSTS_YAML",
                   help="cluster: a list of {name, devices, rack} (default: the smallest cluster of "
                        "identical hosts with topology.devicesPerHost devices)")
    cost_options.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (the plan contract)")


def run(args: argparse.Namespace) -> int:
    from meshjob.placement import load_hosts
    from meshjob.plan import build_plan
    from meshjob.spec import load_jobs

    network = cost_options.network_from_args(args)
    jobs = load_jobs(args.job)
    hosts = load_hosts(args.hosts) if args.hosts else None
    docs = [build_plan(job, hosts, network=network, cost=cost_options.cost_from_args(args, job, network)).to_json()
            for job in jobs]
    if args.json:
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for doc in docs:
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
    model = doc["network"]["model"]
    console.print(
        f"[bold]{doc['job']}[/]: {doc['world_size']} ranks on {len(doc['hosts'])} hosts, NIC {nic_rate} "
        f"({model['duplex']} duplex, {model['message_s'] * 1e6:g} µs per message), "
        f"schedule {schedule['kind']} (weight-grad delay {schedule['weight_grad_delay']}, "
        f"{'measured' if doc['costs']['measured'] else 'default'} compute costs)"
    )

    placement = Table(title="Placement (mesh rows on hosts)")
    for col in ("stage", "row", "host", "rack", "global ranks", "local devices"):
        placement.add_column(col)
    for row in doc["placement"]:
        placement.add_row(str(row["stage"]), str(row["row"]), row["host"], row["rack"] or "-",
                          ", ".join(map(str, row["devices"])), ", ".join(map(str, row["local_devices"])))
    console.print(placement)
    print_network(console, doc)

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
        for col in ("task", "slice", "sender", "holders", "receivers", "bytes", "chunks", "start", "seconds"):
            table.add_column(col, justify="right" if col in ("task", "bytes", "chunks", "start", "seconds")
                             else "left")
        for index, task in tasks[:MAX_TASK_ROWS]:
            table.add_row(str(index), _slice(task["slice"]), str(task["sender"]),
                          ", ".join(map(str, task["senders"])), ", ".join(map(str, task["receivers"])),
                          _bytes(task["bytes"]), str(task["chunks"]), _ms(task["start_s"]), _ms(task["seconds"]))
        if len(tasks) > MAX_TASK_ROWS:
            table.caption = f"{len(tasks) - MAX_TASK_ROWS} more tasks: see --json"
        console.print(table)

    actions = Table(title=f"Schedules (per-stage action lists; stash bound min(M, 2S-1) = "
                          f"{schedule['stash_bound']})")
    actions.add_column("stage")
    actions.add_column("W ms", justify="right")
    actions.add_column("W delay", justify="right")
    actions.add_column("peak stashed", justify="right")
    actions.add_column("actions")
    for stage, items in doc["schedules"].items():
        actions.add_row(stage, f"{doc['costs']['stages'][stage]['W'] * 1e3:.3f}",
                        str(schedule["weight_delay"].get(stage, 0)), str(schedule["peak_stashed"][stage]),
                        " ".join(items))
    console.print(actions)


def print_network(console: Any, doc: dict[str, Any]) -> None:
    """Per-host NIC bytes per step, and each window's joint makespan against its lower bound."""
    from rich.table import Table

    net = doc["network"]
    hosts = Table(title=f"Network: NIC bytes per {net['per']}, and their time at the NIC rate")
    for col in ("host", "egress", "ingress", "egress time", "ingress time"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    for row in net["hosts"]:
        hosts.add_row(row["host"], _bytes(row["egress_bytes"]), _bytes(row["ingress_bytes"]), _ms(row["egress_s"]),
                      _ms(row["ingress_s"]))
    console.print(hosts)
    windows = Table(title="Balancing windows (one microbatch of every boundary in the window, jointly)")
    for col in ("window", "boundaries", "tasks", "balancer", "joint makespan", "lower bound", "ratio"):
        windows.add_column(col, justify="left" if col in ("window", "balancer") else "right")
    for w in net["windows"]:
        windows.add_row(w["name"], str(len(w["boundaries"])), str(w["tasks"]),
                        w["balancer"] + ("" if w["finished"] else " (budget)"), _ms(w["makespan_s"]),
                        _ms(w["lower_bound_s"]), f"{w['ratio']:.2f}" if w["ratio"] is not None else "-")
    console.print(windows)
