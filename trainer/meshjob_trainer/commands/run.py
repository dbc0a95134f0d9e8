"""`meshjob run job.yaml`: train a TrainingJob on this machine on an emulated cluster.

One network namespace per host (tbf at --nic-rate as its NIC), the host's devices as forked
worker ranks inside it, rendezvous on host 0. A progress bar while it runs, a summary table at
the end, Prometheus metrics of the aggregated figures on --metrics-address:--metrics-port, exit status 1 when the
job fails. With --max-restarts N a dead rank restarts the whole gang from the last checkpoint.
With --compute emulated --device a100|h100|<TFLOPs> the ranks do no math: each compute waits the time
the device would need (meshjob.costs.devices), the real tensors still cross the emulated NICs; losses are
then not meaningful (reported as missing) and no checkpoints are written.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import tempfile
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from meshjob.costs.devices import ComputeMode, parse_compute
from meshjob.errors import FieldError, SpecError, UsageError
from meshjob.plan.build import Plan
from meshjob.plan.placement import default_hosts, load_hosts
from meshjob.plan.rendered import PlanInputs
from meshjob.spec.manifest import TrainingJob, load_job
from meshjob.units import parse_rate
from meshjob_trainer.checkpoint import survey
from meshjob_trainer.dist import WorkerSettings
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.emulate.progress import ProgressView, RunStats, summary_table
from meshjob_trainer.events import Event, StepFinished
from meshjob_trainer.launch import LaunchResult, RankContext, launch_with_restarts
from meshjob_trainer.metrics import TrainerMetrics
from meshjob_trainer.worker import JobSetup, run_worker

HELP = "run a TrainingJob on this machine on an emulated cluster"
METRICS_ADDRESS = "127.0.0.1"  # bound and printed alike: the URL printed is the one that answers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="TrainingJob YAML")
    parser.add_argument(
        "--hosts",
        help="hosts.yaml: [{name, devices, rack}] (default: the smallest cluster of identical hosts that fits the job)",
    )
    parser.add_argument("--nic-rate", default="1gbit", help="each emulated host's NIC (tc rate; default 1gbit)")
    parser.add_argument("--no-netns", action="store_true", help="plain loopback: no namespaces, no NIC limit")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics of the aggregated figures on this port while running",
    )
    parser.add_argument(
        "--metrics-address",
        default=None,
        help=f"the IP address --metrics-port binds, and the printed URL names (default {METRICS_ADDRESS}: "
        "this machine only; 0.0.0.0 or :: for every address)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="restart the whole gang from the last checkpoint at most N times"
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="checkpoints (default: spec.training.checkpoint.path, else a temporary folder when --max-restarts > 0)",
    )
    parser.add_argument("--json", dest="json_out", help="write the summary as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_compute_arguments(parser)


def add_compute_arguments(parser: argparse.ArgumentParser, default: str = "real") -> None:
    """--compute and --device, for meshjob run and the benchmarks that train."""
    parser.add_argument(
        "--compute",
        default=default,
        help="real: the ranks compute on this machine's CPU; "
        f"emulated: each compute waits a device's modelled time, no math (default {default})",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="with --compute emulated: a100, h100 or a number of "
        "TFLOP/s (default a100; efficiency and memory bandwidth: see meshjob.costs.devices)",
    )


@dataclass
class RunSetup:
    job: TrainingJob
    plan: Plan  # built once here and inherited by the forked ranks
    checkpoint_dir: str
    rank_hosts: list[int]  # emulated host of each rank
    compute: ComputeMode | None = None


def _rank_main(setup: RunSetup, ctx: RankContext) -> None:
    """In a forked rank, inside its host's namespace: the trainer's worker; its events also go to the
    launcher's event pipe."""
    run_worker(
        ctx.env,
        WorkerSettings(checkpoint_dir=setup.checkpoint_dir, compute=setup.compute),
        JobSetup(setup.job, setup.plan),
        listeners=(ctx.events,),
    )


def _validate_args(args: argparse.Namespace) -> None:
    errors: list[FieldError] = []
    try:
        parse_rate(args.nic_rate, "--nic-rate")
    except ValueError as err:
        errors.append(FieldError("--nic-rate", args.nic_rate, str(err).split("is invalid: ", 1)[-1]))
    if args.max_restarts < 0:
        errors.append(FieldError("--max-restarts", args.max_restarts, "an integer >= 0"))
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        errors.append(FieldError("--metrics-port", args.metrics_port, "a port in [0, 65535]"))
    if args.metrics_address is not None:
        if args.metrics_port is None:
            errors.append(FieldError("--metrics-address", args.metrics_address, "only with --metrics-port"))
        elif not _is_ip(args.metrics_address):
            errors.append(
                FieldError(
                    "--metrics-address",
                    args.metrics_address,
                    f"an IP address of this machine, e.g. {METRICS_ADDRESS} (the default) or 0.0.0.0 (every address)",
                )
            )
    try:
        parse_compute(args.compute, args.device)
    except SpecError as err:
        errors.extend(err.errors)
    if errors:
        raise SpecError(errors)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def metrics_url(address: str, port: int) -> str:
    """The URL of the metrics served on `address`:`port` (an IPv6 address in brackets)."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    where = " (every address of this machine)" if ipaddress.ip_address(address).is_unspecified else ""
    return f"http://{host}:{port}/metrics{where}"


class MetricsFeed:
    """The launcher's own TrainerMetrics, fed with every rank's events: steps once every rank has
    finished one (timed by the slowest, as the last stage's), every other event as it comes.

    Per-host series (achieved NIC bandwidth) carry the host names of the plan that the ranks
    report, so the launcher's endpoint shows the same hosts a pod's would. Ranks forked while it
    serves close their copy of its listening socket (TrainerMetrics.serve registers that)."""

    def __init__(self, job: TrainingJob, plan: Plan, port: int, address: str = METRICS_ADDRESS) -> None:
        last = len(job.stages) - 1
        placement = plan.placement
        hosts = ",".join(placement.hosts[h].name for h in placement.hosts_used())  # the launcher stands for all
        self.metrics = TrainerMetrics(job=job.name, rank=0, host=hosts, stage=last, namespace=job.namespace)
        self.metrics.set_info(
            job.resharding.strategy,
            job.schedule.kind,
            job.resharding.balancer,
            ",".join("x".join(map(str, s.mesh)) for s in job.stages),
        )
        try:
            self.port = self.metrics.serve(port, addr=address)
        except OSError as err:  # in use, or not an address of this machine: one line, not a traceback
            raise UsageError(
                f"cannot serve metrics on {address} port {port} (--metrics-address, --metrics-port): {err}"
            ) from err
        self.address = address
        self.url = metrics_url(address, self.port)
        self.stage = last
        self._reported_step = 0

    def on_event(self, event: Event, stats: RunStats) -> None:
        """After `stats` took `event` in."""
        if not isinstance(event, StepFinished):
            self.metrics.emit(event)
        while self._reported_step < stats.step:  # a step every rank has finished
            s = self._reported_step + 1
            self.metrics.emit(StepFinished(self.stage, s, stats.step_seconds[s], stats.step_tokens[s], stats.loss))
            self._reported_step = s

    def restart(self, resume_step: int) -> None:
        """The gang resumes after `resume_step`: report steps from there on."""
        self._reported_step = resume_step

    def close(self) -> None:
        self.metrics.close()


def serve_metrics(args: argparse.Namespace, job: TrainingJob, plan: Plan, console: Console) -> MetricsFeed:
    """The run's exporter on --metrics-address:--metrics-port, and its URL printed: the address it binds."""
    feed = MetricsFeed(job, plan, args.metrics_port, args.metrics_address or METRICS_ADDRESS)
    console.print(f"metrics: {feed.url}", highlight=False, soft_wrap=True)
    return feed


def run(args: argparse.Namespace) -> int:
    from meshjob_trainer.families import check_inputs  # imports torch: `meshjob run --help` must not

    _validate_args(args)
    compute = parse_compute(args.compute, args.device)
    job = load_job(args.job)
    check_inputs(job)  # token files, the custom model: one clear error here, not one per rank
    hosts = load_hosts(args.hosts) if args.hosts else default_hosts(job)
    nic_bytes_per_s = parse_rate(args.nic_rate, "--nic-rate")
    # every emulated host runs on this machine's cores: chunks: auto weighs the CPU its messages take
    plan = PlanInputs.emulated(job, hosts, nic_bytes_per_s, os.cpu_count() or 1).build()  # inherited by every rank
    placement = plan.placement
    rank_hosts = [placement.host_of(r) for r in range(placement.world_size)]
    used = sorted(set(rank_hosts))
    compact = {h: i for i, h in enumerate(used)}  # emulate only the hosts the job occupies

    checkpoint_dir = args.checkpoint_dir or job.training.checkpoint.path or ""
    tmp_ckpt = None
    if not checkpoint_dir and args.max_restarts > 0:
        tmp_ckpt = tempfile.TemporaryDirectory(prefix="meshjob-ckpt-")
        checkpoint_dir = tmp_ckpt.name
    if compute.emulated:
        checkpoint_dir = ""  # no weights under emulated compute: nothing to checkpoint or resume
    setup = RunSetup(
        job=job,
        plan=plan,
        checkpoint_dir=os.path.abspath(checkpoint_dir) if checkpoint_dir else "",
        rank_hosts=[compact[h] for h in rank_hosts],
        compute=compute,
    )

    console = Console(stderr=True)
    if args.max_restarts > 0 and job.training.checkpoint.every <= 0:
        console.print(
            "[yellow]warning:[/] spec.training.checkpoint.every is 0: no checkpoints are "
            "written, so a restarted gang starts again from step 0"
        )
    resume = _resume_step(console, setup.checkpoint_dir, placement.world_size)
    if resume:
        console.print(
            f"resuming from the checkpoint of step {resume} in {setup.checkpoint_dir} "
            f"(another folder via --checkpoint-dir starts afresh)"
        )
    stats = RunStats(world_size=placement.world_size, total_steps=job.training.steps, resume_step=resume)
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    cleanup_stale()
    t0 = time.monotonic()
    results: list[LaunchResult] = []
    feed: MetricsFeed | None = None
    try:
        with ExitStack() as stack:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cluster = stack.enter_context(EmulatedCluster(len(used), args.nic_rate, use_netns=not args.no_netns))
            for w in caught:
                console.print(f"[yellow]warning:[/] {w.message}")
            console.print(
                f"[bold]{job.name}[/]: {placement.world_size} ranks on {cluster.describe()}, "
                f"compute {compute.describe()}"
            )
            if args.metrics_port is not None:
                feed = serve_metrics(args, job, plan, console)
                feed.restart(stats.resume_step)  # steps a checkpoint holds are not re-reported
            with ProgressView(stats, console, enabled=not args.quiet) as view:

                def on_event(rank: int, event: Event) -> None:
                    stats.add(rank, event)
                    if feed is not None:
                        feed.on_event(event, stats)
                    view.update()

                def on_restart(failed: LaunchResult) -> None:
                    assert failed.first_failure is not None
                    try:
                        step = _resume_step(console, setup.checkpoint_dir, placement.world_size)
                    except UsageError as err:  # the new gang's ranks fail saying so
                        console.print(str(err), markup=False, highlight=False)
                        step = 0
                    console.print(
                        f"[yellow]{failed.first_failure.describe()}: restarting the gang from "
                        f"the last checkpoint (step {step})[/]"
                    )
                    stats.restart()
                    if feed is not None:
                        feed.restart(step)

                results = launch_with_restarts(
                    placement.world_size,
                    lambda ctx: _rank_main(setup, ctx),
                    max_restarts=args.max_restarts,
                    on_restart=on_restart,
                    on_event=on_event,
                    **cluster.gang(setup.rank_hosts).launch_args(),
                )
            network = cluster.describe()
            emulated = cluster.emulated
    finally:
        if feed is not None:
            feed.close()
        if tmp_ckpt is not None:
            tmp_ckpt.cleanup()

    ok = bool(results) and results[-1].ok
    wall = time.monotonic() - t0
    summary = {
        "job": job.name,
        "ok": ok,
        "world_size": placement.world_size,
        "hosts": len(used),
        "network": network,
        "emulated": emulated,
        "nic_rate": args.nic_rate,
        "network_model": plan.network.to_json(),  # what the plan (chunks: auto, balancers) assumed
        "wall_seconds": wall,
        "attempts": len(results),
        **compute.to_json(),
        "failure": (results[-1].first_failure.describe() if results and results[-1].first_failure else None),
        **stats.to_json(),
    }
    _print_summary(console, summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if ok else 1


def _resume_step(console: Console, directory: str, world_size: int) -> int:
    """The step the ranks will resume from (0: none), found as they will find it: the newest complete
    checkpoint every rank's file of which loads. Newer ones that cannot be loaded are told with the
    reason. Complete checkpoints none of which loads on every rank are an error (exit 2) before any
    rank starts; after a failure (restarts) the ranks report it themselves. The summary's
    resume_step is what the ranks report they restored."""
    if not directory:
        return 0
    found = survey(directory, world_size)
    if found.corrupt:
        raise UsageError(
            f"checkpoints in {directory}: none can be loaded by every rank, and the run does not "
            f"start again from step 0 over them:\n  "
            + "\n  ".join(found.skipped)
            + f"\nrestore the damaged files from a copy, or move {directory} away to start afresh"
        )
    for line in found.skipped:
        console.print(
            f"[yellow]skipping a checkpoint that cannot be loaded:[/] {line}", highlight=False, soft_wrap=True
        )  # one line per step, for logs and grep
    return found.resume_step or 0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _describe_delays(delays: dict[str, dict[str, Any]]) -> str:
    """Each stage's delay, sized by which costs, and its peak stash against the bound."""
    how = "costs measured at start" if all(d["measured"] for d in delays.values()) else "planner's cost formula"
    per_stage = ", ".join(f"{d['delay']}" for d in delays.values())
    peaks = ", ".join(f"{d['peak_stash']}" for d in delays.values())
    bound = max(d["stash_bound"] for d in delays.values())
    return f"stages {per_stage} ({how}); peak stash {peaks} (bound {bound})"


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    rows = [
        ("result", "[green]succeeded[/]" if s["ok"] else f"[red]failed[/]: {s['failure']}"),
        ("cluster", f"{s['world_size']} ranks, {s['network']}"),
        ("compute", "real" if s["compute"] == "real" else f"emulated on {s['device']['name']} (losses not meaningful)"),
        (
            "steps",
            f"{s['steps_completed']}/{s['total_steps']}"
            + (f" (resumed at step {s['resume_step']})" if s["resume_step"] else ""),
        ),
        ("final loss", _fmt(s["final_loss"], ".4f")),
        (
            "validation loss",
            _fmt(s["final_val_loss"], ".4f") + (f" (step {s['val_losses'][-1][0]})" if s["val_losses"] else ""),
        ),
        ("tokens/s (mean)", _fmt(s["tokens_per_s_mean"], ",.0f")),
        (
            "resharding",
            f"{s['resharding_bytes'] / 1e6:,.1f} MB received by all ranks, "
            f"{_fmt(s['resharding_gbytes_per_s'], '.3g')} GB/s over the training time",
        ),
        ("attempts", f"{s['attempts']} (restarts: {s['restarts']})"),
        ("wall time", f"{s['wall_seconds']:.1f} s"),
    ]
    if s["weight_delay"]:
        rows.append(("weight-grad delay", _describe_delays(s["weight_delay"])))
    for stage, p in s["pipeline"].items():
        memory = s["payload_memory"].get(stage)
        payload = (
            f", payload in flight {memory['peak_bytes'] / 1e6:,.2f} MB (bound {memory['bound_bytes'] / 1e6:,.2f} MB)"
            if memory
            else ""
        )
        rows.append((f"stage {stage}", f"bubble {p['bubble']:.1%}, overlap {p['overlap']:.1%}{payload}"))
    console.print(summary_table(rows, f"meshjob run: {s['job']}"))
