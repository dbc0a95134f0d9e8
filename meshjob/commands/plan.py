"""`meshjob plan job.yaml [--hosts hosts.yaml | --cluster] [--json] [--nic-rate 1gbit] [--calibrate]`: show the plan.

Readable tables by default (placement; the network: per-host egress/ingress bytes per step and each
balancing window's joint makespan vs its lower bound; each boundary's unit tasks with sender,
receivers, bytes, chunks and start; makespan vs lower bound; each stage's weight-gradient delay,
peak stash and action list; with weightGradDelay auto, the delay candidates the plan simulated and the
one it took), or one JSON object with --json (the contract tools rely on, see
Plan.to_json). With --cluster a `spec.stages: auto` manifest gets the operator's search on the cluster's
Nodes first ("tuned" says what it chose); without it `auto` exits 2. `-` reads the manifest from
standard input. A file of several YAML documents (`---`) holds one job per document: every job is checked
first, then each is planned; --json then prints a JSON list of plans, in document order. Bad manifests,
hosts files and rates exit 2 with the field (and the document) named. --emulated shows the plan `meshjob
run` starts from on its emulated cluster (every host on this machine's cores, the engine's costs there; the
run then sizes the weight-gradient delay on the costs its ranks measure) instead of the plan for real NICs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.cluster.auto_stages import read_for_cluster, tune_on_nodes
from meshjob.cluster.nodes import plan_on_nodes, pods_json
from meshjob.commands import costs as cost_options
from meshjob.errors import UsageError
from meshjob.network.model import NetworkModel
from meshjob.plan.build import Plan, build_plan
from meshjob.plan.placement import Host, load_hosts
from meshjob.schedule import torch_csv
from meshjob.search.job_step import job_cost
from meshjob.search.stage_model import job_figures
from meshjob.spec.inputs import check_jobs_inputs
from meshjob.spec.manifest import TrainingJob, load_jobs
from meshjob.units import format_rate

HELP = "show the plan for a TrainingJob: placement, resharding tasks, schedules"
# --export: the plan's action lists in another runtime's format (torch's _PipelineScheduleRuntime CSV)
EXPORTS: dict[str, Callable[[Plan], str]] = {
    torch_csv.FORMAT: lambda plan: torch_csv.csv_text(
        torch_csv.torch_rows(plan.schedules, plan.job.training.microbatches, plan.transfer_order.depth)
    )
}
MAX_TASK_ROWS = 64  # per boundary in the table; --json always has every task


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="TrainingJob manifest (YAML; - reads standard input; one job per document)")
    p.add_argument(
        "--hosts",
        metavar="HOSTS_YAML",
        help="cluster: a list of {name, devices, rack} (default: the smallest cluster of "
        "identical hosts with topology.devicesPerHost devices)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="place on the Nodes of the cluster the kubeconfig names (read-only), with the function "
        "the operator calls: the pods it would create and the nodes it would leave out (and, "
        "for spec.stages: auto, the operator's search and what it chose)",
    )
    p.add_argument(
        "--kubeconfig", metavar="FILE", help="with --cluster: kubeconfig (default $KUBECONFIG, then ~/.kube/config)"
    )
    p.add_argument("--context", help="with --cluster: a context of the kubeconfig")
    cost_options.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (the plan contract)")
    p.add_argument(
        "--export",
        choices=sorted(EXPORTS),
        help="print the stages' action lists instead: torch-csv is the CSV torch's _PipelineScheduleRuntime "
        "loads (_load_csv(path, format='compute_comms')), one row per pipeline rank",
    )
    p.add_argument(
        "--skip-files",
        action="store_true",
        help="don't check spec.data's token files and spec.model.entrypoint's package on this "
        "machine (a plan for a cluster that holds them; implied by --cluster)",
    )


def run(args: argparse.Namespace) -> int:
    if args.cluster and args.hosts:
        raise UsageError("--cluster and --hosts exclude each other: the cluster's Nodes are the hosts")
    if not args.cluster and (args.kubeconfig or args.context):
        raise UsageError("--kubeconfig and --context go with --cluster")
    if args.cluster and args.export:
        raise UsageError("--export exports a plan made here: drop --cluster (use --hosts for the cluster's hosts)")
    network = cost_options.network_from_args(args)
    if args.cluster:  # as the operator reads them: `stages: auto` runs its search on the Nodes
        _operator_costs_only(args, network)
        entries = load_jobs(args.job, parse=read_for_cluster)
        nodes, pods = read_cluster(args.kubeconfig, args.context)
        docs = [plan_on_cluster(e.job, nodes, pods, network.nic_bytes_per_s, e.search) for e in entries]
    else:
        jobs = load_jobs(args.job)
        if not args.skip_files:  # a cluster's pods read their files there, not here
            check_jobs_inputs(jobs, args.job)
        hosts = load_hosts(args.hosts) if args.hosts else None
        if args.export:
            for job in jobs:
                sys.stdout.write(EXPORTS[args.export](_build(args, job, hosts)))
            return 0
        docs = [_plan(args, job, hosts) for job in jobs]
    if args.json:
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for doc in docs:
            print_tables(doc, format_rate(doc["nic_bytes_per_s"]))
    return 0


def _plan(args: argparse.Namespace, job: TrainingJob, hosts: Sequence[Host] | None) -> dict[str, Any]:
    return _build(args, job, hosts).to_json()


def _build(args: argparse.Namespace, job: TrainingJob, hosts: Sequence[Host] | None) -> Plan:
    """The job's plan; a tuned manifest's (spec.tunedFor) on the cluster it was tuned for, with the search's
    stage model as its compute: the plan `meshjob tune` and `meshjob simulate` predict."""
    network = cost_options.network_from_args(args, job.tuned_for)
    cluster = cost_options.tuned_cluster(args, job, network)
    if cluster is None:
        return build_plan(job, hosts, network=network, cost=cost_options.cost_from_args(args, job, network))
    cost = job_cost(cluster.network, job_figures(job, cluster))
    return build_plan(job, hosts or cluster.host_list(), network=cluster.network, cost=cost)


def _operator_costs_only(args: argparse.Namespace, network: NetworkModel) -> None:
    """--cluster prints what the operator runs, and the operator plans with the default network model at
    its NIC rate: other cost options would print a plan it does not run."""
    if args.calibrate or network != NetworkModel(nic_bytes_per_s=network.nic_bytes_per_s):
        raise UsageError(
            "--cluster shows the operator's plan, made with the default network model at a NIC rate: "
            "it takes --nic-rate, not --calibrate, --duplex, --message-us or --emulated"
        )


def plan_on_cluster(
    job: TrainingJob,
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    nic_bytes_per_s: float,
    search: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan on these Nodes, less what the cluster's pods use there, as the operator makes it, plus
    "cluster": its pods and every node's verdict; with `search` (a `stages: auto` manifest, `job` its
    placeholder) the operator's search chooses the stages first and "tuned" says what it chose."""
    # the Kubernetes client only for --cluster: the plan layer never imports it otherwise
    from kubernetes.utils.quantity import parse_quantity

    tuned = None
    if search is not None:
        tuned = tune_on_nodes(job, search, nodes, parse_quantity, nic_bytes_per_s, pods)
        job = tuned.job()
    _, plan, infos = plan_on_nodes(job, nodes, parse_quantity, nic_bytes_per_s, pods=pods)
    doc = plan.to_json()
    doc["cluster"] = {
        "pods": pods_json(job, plan, infos),
        "nodes": [{"name": i.name, "host": i.host, "devices": i.devices, "problem": i.problem} for i in infos],
    }
    if tuned is not None:
        doc["tuned"] = tuned.status()
    return doc


def read_cluster(kubeconfig: str | None, context: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cluster's Nodes and its pods not terminated yet, as the API returns them (JSON), read through
    the kubeconfig."""
    try:  # the Kubernetes client only for --cluster: the plan layer never imports it otherwise
        import kubernetes
    except ImportError:
        raise UsageError("--cluster needs the kubernetes package: pip install kubernetes") from None
    try:
        client = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]  # kubernetes: untyped
            config_file=kubeconfig, context=context, persist_config=False
        )
    except (kubernetes.config.ConfigException, OSError, TypeError) as err:
        raise UsageError(f"--cluster: cannot load the kubeconfig ({kubeconfig or 'default'}): {err}") from None
    try:
        api = kubernetes.client.CoreV1Api(client)
        nodes = api.list_node(_preload_content=False, _request_timeout=30)
        pods = api.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed", _preload_content=False, _request_timeout=30
        )
        # _preload_content=False returns the raw HTTP response, not the V1NodeList / V1PodList the client declares
        node_items: list[dict[str, Any]] = json.loads(nodes.data)["items"]  # type: ignore[attr-defined]
        pod_items: list[dict[str, Any]] = json.loads(pods.data)["items"]  # type: ignore[attr-defined]
        return node_items, pod_items
    except kubernetes.client.ApiException as err:
        raise UsageError(f"--cluster: listing Nodes and pods was refused: HTTP {err.status} {err.reason}") from None
    except Exception as err:  # noqa: BLE001 - unreachable server, TLS: say so, exit 2
        raise UsageError(f"--cluster: cannot reach the API server: {type(err).__name__}: {err}") from None
    finally:
        client.close()


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


def _shared_cores(model: dict[str, Any]) -> str:
    """How the header names the CPU a message takes where every host shares a machine's cores (--emulated)."""
    if not model.get("shared_cpu_cores"):
        return ""
    return (
        f", {model['message_cpu_s'] * 1e6:g} µs of CPU per message on {model['shared_cpu_cores']} shared "
        f"core{'s' if model['shared_cpu_cores'] > 1 else ''}"
    )


def print_tables(doc: dict[str, Any], nic_rate: str) -> None:
    console = Console(width=max(120, Console().width))
    schedule = doc["schedule"]
    model = doc["network"]["model"]
    console.print(
        f"[bold]{doc['job']}[/]: {doc['world_size']} ranks on {len(doc['hosts'])} hosts, NIC {nic_rate} "
        f"({model['duplex']} duplex, {model['message_s'] * 1e6:g} µs per message{_shared_cores(model)}), "
        f"schedule {schedule['kind']} (weight-grad delay {schedule['weight_grad_delay']}, "
        f"{'measured' if doc['costs']['measured'] else 'default'} compute costs)"
    )

    placement = Table(title="Placement (mesh rows on hosts)")
    for col in ("stage", "row", "host", "rack", "global ranks", "local devices"):
        placement.add_column(col)
    for row in doc["placement"]:
        placement.add_row(
            str(row["stage"]),
            str(row["row"]),
            row["host"],
            row["rack"] or "-",
            ", ".join(map(str, row["devices"])),
            ", ".join(map(str, row["local_devices"])),
        )
    console.print(placement)
    print_network(console, doc)
    if "cluster" in doc:
        print_cluster(console, doc["cluster"])
    if "tuned" in doc:
        t = doc["tuned"]
        console.print(
            f"spec.stages: auto: the search chose {t['plan']} on {t['cluster']['hosts']} host(s) x "
            f"{t['cluster']['devicesPerHost']} device(s) ({t['cluster']['device']} profile), predicted "
            f"step {_ms(t['predictedStepSeconds'])}, "
            + ("proven best" if t["provenBest"] else f"best of the {t['evaluated']} simulated")
        )

    summary = Table(title="Boundaries (cross-mesh resharding)")
    for col in ("boundary", "send", "recv", "strategy", "balancer", "tasks", "makespan", "lower bound", "ratio"):
        summary.add_column(col, justify="right" if col in ("tasks", "makespan", "lower bound", "ratio") else "left")
    for b in doc["boundaries"]:
        ratio = b["makespan_s"] / b["lower_bound_s"] if b["lower_bound_s"] > 0 else float("nan")
        summary.add_row(
            b["key"],
            b["send"],
            b["recv"],
            b["strategy"],
            b["balancer"],
            str(len(b["tasks"])),
            _ms(b["makespan_s"]),
            _ms(b["lower_bound_s"]),
            f"{ratio:.2f}",
        )
    console.print(summary)

    for b in doc["boundaries"]:
        tasks = sorted(enumerate(b["tasks"]), key=lambda it: (it[1]["start_s"], it[0]))
        table = Table(
            title=f"{b['key']}: unit tasks by start "
            f"(makespan {_ms(b['makespan_s'])}, lower bound {_ms(b['lower_bound_s'])})"
        )
        for col in ("task", "slice", "sender", "holders", "receivers", "bytes", "chunks", "start", "seconds"):
            table.add_column(col, justify="right" if col in ("task", "bytes", "chunks", "start", "seconds") else "left")
        for index, task in tasks[:MAX_TASK_ROWS]:
            table.add_row(
                str(index),
                _slice(task["slice"]),
                str(task["sender"]),
                ", ".join(map(str, task["senders"])),
                ", ".join(map(str, task["receivers"])),
                _bytes(task["bytes"]),
                str(task["chunks"]),
                _ms(task["start_s"]),
                _ms(task["seconds"]),
            )
        if len(tasks) > MAX_TASK_ROWS:
            table.caption = f"{len(tasks) - MAX_TASK_ROWS} more tasks: see --json"
        console.print(table)

    actions = Table(title=f"Schedules (per-stage action lists; stash bound min(M, 2S-1) = {schedule['stash_bound']})")
    actions.add_column("stage")
    actions.add_column("W ms", justify="right")
    actions.add_column("W delay", justify="right")
    actions.add_column("peak stashed", justify="right")
    actions.add_column("actions")
    for stage, items in doc["schedules"].items():
        actions.add_row(
            stage,
            f"{doc['costs']['stages'][stage]['W'] * 1e3:.3f}",
            str(schedule["weight_delay"].get(stage, 0)),
            str(schedule["peak_stashed"][stage]),
            " ".join(items),
        )
    console.print(actions)
    print_delay_choice(console, schedule.get("delay_choice"))


def print_delay_choice(console: Console, choice: dict[str, Any] | None) -> None:
    """weightGradDelay auto: each simulated candidate's step period (meshjob.simulate.steady), the ratio rule's and
    the one taken."""
    if choice is None:
        return
    if not choice["simulated"]:
        console.print(
            "weightGradDelay auto: the ratio rule ceil(comm / W) per stage, not simulated (simulating "
            f"the candidates would pass the planner's work budget of {choice['work_budget']:,} "
            "actions x stages)"
        )
        return
    table = Table(
        title="weightGradDelay auto: delay candidates simulated step after step on the plan's network "
        "and stage costs "
        f"(taken: the smallest within {choice['tolerance']:.0%} of the fastest, "
        "no slower than the rule)"
    )
    for col in ("candidate", "W delay per stage", "simulated period", "vs rule", "taken"):
        table.add_column(col, justify="right" if col in ("simulated period", "vs rule") else "left")
    rule = choice["rule_step_s"]
    for c in choice["candidates"]:
        delays = " ".join(f"{d}" for _, d in sorted(c["weight_delay"].items(), key=lambda kv: int(kv[0])))
        table.add_row(
            c["name"] + (" (ceil(comm / W))" if c["name"] == "rule" else ""),
            delays,
            _ms(c["step_s"]),
            f"{c['step_s'] / rule:.3f}" if rule > 0 else "-",
            "yes" if c["name"] == choice["chosen"] else "",
        )
    console.print(table)


def print_network(console: Console, doc: dict[str, Any]) -> None:
    """Per-host NIC bytes per step, and each window's joint makespan against its lower bound."""
    net = doc["network"]
    hosts = Table(title=f"Network: NIC bytes per {net['per']}, and their time at the NIC rate")
    for col in ("host", "egress", "ingress", "egress time", "ingress time"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    for row in net["hosts"]:
        hosts.add_row(
            row["host"],
            _bytes(row["egress_bytes"]),
            _bytes(row["ingress_bytes"]),
            _ms(row["egress_s"]),
            _ms(row["ingress_s"]),
        )
    console.print(hosts)
    windows = Table(title="Balancing windows (one microbatch of every boundary in the window, jointly)")
    for col in ("window", "boundaries", "tasks", "balancer", "joint makespan", "lower bound", "ratio"):
        windows.add_column(col, justify="left" if col in ("window", "balancer") else "right")
    for w in net["windows"]:
        windows.add_row(
            w["name"],
            str(len(w["boundaries"])),
            str(w["tasks"]),
            w["balancer"] + ("" if w["finished"] else " (budget)"),
            _ms(w["makespan_s"]),
            _ms(w["lower_bound_s"]),
            f"{w['ratio']:.2f}" if w["ratio"] is not None else "-",
        )
    console.print(windows)


def print_cluster(console: Console, cluster: dict[str, Any]) -> None:
    """What the operator creates on the cluster's Nodes, and the nodes it leaves out (with why)."""
    pods = Table(title="Pods the operator creates (one per host)")
    for col in ("pod", "node", "devices", "stages"):
        pods.add_column(col)
    for pod in cluster["pods"]:
        pods.add_row(pod["name"], pod["node"], str(pod["devices"]), ", ".join(map(str, pod["stages"])))
    console.print(pods)
    for node in cluster["nodes"]:
        if node["problem"]:
            console.print(f"left out: node {node['name']}: {node['problem']}")
