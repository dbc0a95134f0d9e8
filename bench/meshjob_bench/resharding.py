"""Cross-mesh resharding on the emulated cluster (the paper's §5.1, figures 5, 6 and 8).

The paper: "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022).

(a) one device -> a mesh of A hosts x B devices (A, B in 1..4): figure 5.
(b) many-to-many: a (2, 2) mesh on hosts 0-1 -> a (2, 2) mesh on hosts 2-3, 2-D tensor, sharding
    spec pairs in the spirit of the paper's Table 2: figure 6.
Every case runs every strategy side by side (send_recv, local_allgather, global_allgather,
broadcast with K swept, signal = the 1-byte upper bound), Alpa's actual default ("alpa default":
send/recv into the destination layout rewritten to be sharded inside each host, then an all-gather
inside the host, which the executor does), and for (b) broadcast under each balancer (figure 8).
Time is reported over the physical limit L = bytes the busiest receiving host must take / NIC rate,
as speed-ups over global_allgather and send_recv, and against the plan: each variant's planned
makespan on the network model (meshjob.network.model, which the JSON records), measured / planned.
The issue's targets are checked at the end (`targets` in the JSON). The cases, the ranks' layout and
each variant's plan: meshjob_bench.resharding_cases; the targets: meshjob_bench.resharding_targets.

All ranks live in one gang: host h holds ranks 4h..4h+3; a case uses the ranks its meshes name,
the others only join the barriers. Plans are made in the parent before the fork, so every rank
runs the same steps; each receiver checks its tile against the expected values on the first
repetition, so a wrong plan or executor fails the benchmark instead of timing it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.errors import FieldError, SpecError
from meshjob.layout.sharding import tile, to_index
from meshjob.network.model import NetworkModel
from meshjob.units import parse_rate
from meshjob_bench import engine_costs, probe_guard
from meshjob_bench.cpu_pricing import cpu_pricing, print_cpu_pricing
from meshjob_bench.machine import gpu_visible, machine
from meshjob_bench.resharding_cases import (
    BALANCERS,
    DEVICES_PER_HOST,
    MAIN_BALANCER,
    SECTIONS,
    Case,
    Layout,
    Row,
    balancer_chunks,
    bench_network,
    build_cases,
    case_order,
    plan_cases,
)
from meshjob_bench.resharding_targets import check_paper_targets, check_targets, planned, print_targets
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.launch import RankContext, launch

TRANSPORTS = ("gloo", "tcp", "nccl")
QUICK_PROBE_ROUNDS = 2  # --quick: enough for a spread between rounds; a full run takes PROBE_ROUNDS (5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nic-rate", default="1gbit", help="emulated NIC of every host (default 1gbit)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny tensors, few cases, one K")
    parser.add_argument("--out", default="bench/results", help="folder for resharding.json and PNGs")
    parser.add_argument("--size-mib", type=float, default=None, help="tensor size (default 16, quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 3, quick 1)")
    parser.add_argument(
        "--chunks",
        default=None,
        help="broadcast K values, comma separated, auto = per task from the network model (default 4,16,64,auto)",
    )
    parser.add_argument("--no-netns", action="store_true", help="loopback: no NIC emulation (results say so)")
    parser.add_argument(
        "--message-costs",
        choices=("measured", "default"),
        default="measured",
        help="plan with per-message link time and CPU on the shared cores measured first through "
        "the engine (default), or with the network model's defaults (raw gloo, CPU not "
        "modelled)",
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="gloo",
        help="gloo: CPU tensors over gloo's isend/irecv between hosts (default, the trainer's); tcp: "
        "CPU tensors, a TCP connection per directed pair between hosts (meshjob_trainer."
        "tcp_wire); nccl: CUDA tensors device to device (needs a GPU; ranks that share one each "
        "become an NCCL host of their own)",
    )
    parser.add_argument(
        "--section", action="append", choices=SECTIONS, help="run only this section (repeatable; default all)"
    )
    parser.add_argument(
        "--case",
        action="append",
        default=None,
        help="run only the cases whose name contains this text, e.g. 'x1' or 'S0R -> RR' (repeatable; default all)",
    )


def measure_engine(
    cluster: EmulatedCluster, nic_bytes_per_s: float, rounds: int = engine_costs.PROBE_ROUNDS, transport: str = "gloo"
) -> engine_costs.EngineCosts | None:
    """Per-message link time and CPU, measured in a gang on `cluster` (meshjob_bench.engine_costs) in
    `rounds` rounds; None if the probe failed. One attempt: `main` runs it under
    probe_guard.guarded_probe (retried when disturbed)."""
    layout = Layout()
    cases = engine_costs.probe_cases(layout, nic_bytes_per_s, bench_network(nic_bytes_per_s), rounds)
    network = engine_costs.unpacked(bench_network(nic_bytes_per_s))
    result = launch(
        len(layout.hosts),
        lambda ctx: _rank_main(cases, 1, engine_costs.PROBE_REPEATS, ctx, network, transport),
        **cluster.gang(layout.hosts).launch_args(),
    )
    if not result.ok:
        return None
    return engine_costs.fit(collect(cases, [timing for timings in result.values for timing in timings]))


def _expected(shape: tuple[int, ...]) -> Any:
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    import torch

    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def _common_start(lead_s: float = 0.03, wait: bool = True, group: Any = None) -> float:
    """Every rank starts the timed transfer at one instant: rank 0 names an instant a little ahead and
    each rank sleeps until it. The emulated hosts share this machine's monotonic clock; a barrier alone
    releases ranks milliseconds apart on two cores, and the spread would be timed as transfer.
    `wait` False (a rank the transfer does not use): no sleep; it goes on to the next barrier at once, so
    it does not wake with the transfer's ranks and take the shared cores from them at their start."""
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)  # everyone is done with the previous transfer
    at = torch.tensor([time.monotonic() + lead_s], dtype=torch.float64)
    dist.broadcast(at, 0, group=group)
    start = float(at.item())
    if wait:
        time.sleep(max(0.0, start - time.monotonic()))
    return start


def _minor_faults() -> int:
    """This process's minor page faults so far: a transfer that faults its buffers' pages in pays ~1 µs of
    CPU per 4 KiB on the shared cores (meshjob_trainer.heap)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _case_routes(case: Case, network: NetworkModel | None) -> list[Any]:
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    from meshjob_trainer.route import make_routes

    return make_routes(case.boundaries, {0: case.src_mesh, 1: case.dst_mesh}, {0: case.send, 1: case.recv}, network)


def _rank_main(
    cases: list[Case],
    warmup: int,
    repeats: int,
    ctx: RankContext,
    network: NetworkModel | None = None,
    transport: str = "gloo",
) -> list[dict]:
    """One rank of the gang: for every case and variant, a common start, reshard; returns the times.
    `network`: the model the cases were planned on (each rank's program and its NIC window follow it).
    `transport` tcp or gloo: CPU tiles, the wire between hosts (meshjob_trainer.wire.wire_for); nccl: the tiles
    live on the GPU and cross over NCCL; the common starts stay on gloo."""
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    import torch
    import torch.distributed as dist

    from meshjob_trainer.dist import device_sync, init_distributed, shutdown_distributed
    from meshjob_trainer.heap import release_freed_memory
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.wire import wire_for

    on_cpu = transport != "nccl"
    init_distributed(ctx.env, timeout_s=120, backend="gloo" if on_cpu else None)
    rank = ctx.rank
    timed: list[dict] = []
    try:
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        sync = device_sync(device)
        cpu_group = None if on_cpu else dist.new_group(backend="gloo")
        # NCCL: one wire, every pair of every case connected once (a wire per case would leave a communicator
        # per pair and case, each with its own proxy thread and buffers)
        shared_wire = (
            None
            if on_cpu
            else wire_for(
                device, rank, set().union(*(r.pairs() for case in cases for r in _case_routes(case, network)))
            )
        )
        for ci, case in enumerate(cases):
            inside = rank in case.src_mesh.ranks or rank in case.dst_mesh.ranks
            full = _expected(case.shape) if inside else None
            local = None
            if full is not None and rank in case.src_mesh.ranks:  # a source rank is inside: full is its data
                local = (
                    full[to_index(tile(case.send, case.src_mesh.shape, case.shape, case.src_mesh.index_of(rank)))]
                    .contiguous()
                    .to(device)
                )
            routes = _case_routes(case, network)
            executor = ReshardExecutor(
                None,
                rank,
                routes=routes,
                order=case_order(case, warmup + repeats),
                device=device,
                wire=shared_wire,
                cpu_wire=transport if on_cpu else "gloo",
            )
            for rep in range(warmup + repeats):  # the case's order (case_order)
                for vi, (variant, boundary) in enumerate(zip(case.variants, case.boundaries)):
                    t0 = _common_start(wait=inside, group=cpu_group)
                    if not inside:
                        continue
                    c0, f0 = time.process_time(), _minor_faults()
                    out = executor.start(boundary.key, rep, local).wait()
                    if sync is not None:  # a GPU's copies may still run after the engine handed the result over
                        sync()
                    t1, c1, f1 = time.monotonic(), time.process_time(), _minor_faults()
                    ok = True
                    if rep == 0 and out is not None and full is not None and variant.strategy != "signal":
                        want = full[
                            to_index(tile(case.recv, case.dst_mesh.shape, case.shape, case.dst_mesh.index_of(rank)))
                        ]
                        ok = bool(torch.equal(out.cpu(), want))
                    if rep >= warmup or not ok:
                        timed.append(
                            dict(
                                case=ci,
                                variant=vi,
                                rep=rep - warmup,
                                start=t0,
                                end=t1,
                                cpu=c1 - c0,
                                faults=f1 - f0,
                                correct=ok,
                            )
                        )
            executor.close()
            del routes, executor, local, full
            release_freed_memory()  # the next case's buffers have other shapes (meshjob_trainer.heap)
            dist.barrier(group=cpu_group)
    finally:
        shutdown_distributed()
    return timed


def collect(cases: list[Case], events: list[dict]) -> list[Row]:
    spans: dict[tuple[int, int, int], list[float]] = {}
    totals: dict[tuple[int, int, int], list[float]] = {}  # summed over ranks: [CPU seconds, minor faults]
    wrong: set[tuple[int, int]] = set()
    for e in events:
        if not e.get("correct", True):
            wrong.add((e["case"], e["variant"]))
        if e.get("rep", -1) < 0:
            continue
        key = (e["case"], e["variant"], e["rep"])
        lo, hi = spans.get(key, [math.inf, -math.inf])
        spans[key] = [min(lo, e["start"]), max(hi, e["end"])]
        total = totals.setdefault(key, [0.0, 0])
        total[0] += e.get("cpu", 0.0)
        total[1] += e.get("faults", 0)

    def median_over_reps(ci: int, vi: int, index: int) -> float:
        values = [total[index] for (c, v, _), total in totals.items() if c == ci and v == vi]
        return statistics.median(values) if values else math.nan

    rows: list[Row] = []
    for ci, case in enumerate(cases):
        times = {
            vi: [hi - lo for (c, v, _), (lo, hi) in sorted(spans.items()) if c == ci and v == vi]
            for vi in range(len(case.variants))
        }
        med = {vi: statistics.median(t) if t else math.nan for vi, t in times.items()}
        base = {
            case.variants[vi].strategy: med[vi]
            for vi in med
            if case.variants[vi].balancer == MAIN_BALANCER and not case.variants[vi].host_sharded
        }
        for vi, v in enumerate(case.variants):
            b, simulated, planned = case.boundaries[vi], case.simulated_s[vi], case.planned_s[vi]
            rows.append(
                Row(
                    case.section,
                    case.name,
                    v.strategy,
                    v.chunks,
                    v.balancer,
                    v.label,
                    med[vi],
                    times[vi],
                    case.limit_s,
                    med[vi] / case.limit_s if case.limit_s else math.nan,
                    base.get("global_allgather", math.nan) / med[vi],
                    base.get("send_recv", math.nan) / med[vi],
                    planned,
                    b.lower_bound_s,
                    (ci, vi) not in wrong,
                    simulated,
                    simulated / med[vi] - 1.0 if med[vi] > 0 else math.nan,
                    med[vi] / planned if planned > 0 else math.nan,
                    median_over_reps(ci, vi, 0),
                    median_over_reps(ci, vi, 1),
                    case.messages[vi] if case.messages else {},
                    case.simulated_cpu_s[vi] if case.simulated_cpu_s else math.nan,
                )
            )
    return rows


Summary = dict[str, dict[str, dict[str, float]]]  # section -> variant label -> geometric means over its cases


def summarize(rows: list[Row]) -> Summary:
    """Per section and strategy (main balancer, broadcast at each K): geometric means over the
    cases of time / L and of the speed-ups, the one-line answer to "how much faster"."""

    def gmean(xs: list[float]) -> float:
        xs = [x for x in xs if x > 0 and math.isfinite(x)]
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan

    out: Summary = {}
    for section in SECTIONS:
        sec = [r for r in rows if r.section == section and r.balancer == MAIN_BALANCER]
        for label in dict.fromkeys(r.label for r in sec):
            rs = [r for r in sec if r.label == label]
            out.setdefault(section, {})[label] = {
                "over_limit": gmean([r.over_limit for r in rs]),
                "speedup_vs_global_allgather": gmean([r.speedup_vs_global_allgather for r in rs]),
                "speedup_vs_send_recv": gmean([r.speedup_vs_send_recv for r in rs]),
            }
    return out


def print_summary(summary: Summary, title: str) -> None:
    console = Console(width=None if Console().is_terminal else 150)
    table = Table(title=f"{title} — geometric means over cases", title_justify="left")
    for col in ("section", "variant", "time / L", "x vs global_allgather", "x vs send_recv"):
        table.add_column(col, justify="left" if col in ("section", "variant") else "right")
    for section, by_label in summary.items():
        for i, (label, m) in enumerate(by_label.items()):
            table.add_row(
                section if i == 0 else "",
                label,
                f"{m['over_limit']:.2f}",
                f"{m['speedup_vs_global_allgather']:.2f}",
                f"{m['speedup_vs_send_recv']:.2f}",
            )
    console.print(table)


def print_table(rows: list[Row], title: str) -> None:
    console = Console(width=None if Console().is_terminal else 150)
    for section in SECTIONS:
        table = Table(title=f"{title} — {section.replace('_', '-')}", title_justify="left")
        for col in (
            "case",
            "variant",
            "time s",
            "time / L",
            "x vs global_allgather",
            "x vs send_recv",
            "planned s",
            "measured / planned",
            "planned / LB",
            "sim error",
            "ok",
        ):
            table.add_column(col, justify="left" if col in ("case", "variant") else "right")
        last = None
        for r in rows:
            if r.section != section:
                continue
            table.add_row(
                "" if r.case == last else r.case,
                r.label,
                f"{r.seconds:.3f}",
                f"{r.over_limit:.2f}",
                f"{r.speedup_vs_global_allgather:.2f}",
                f"{r.speedup_vs_send_recv:.2f}",
                f"{r.planned_makespan_s:.3f}",
                f"{r.measured_over_planned:.2f}" if planned(r) else "-",
                f"{r.planned_makespan_s / r.planned_lower_bound_s:.2f}"
                if r.planned_lower_bound_s and r.strategy != "signal"
                else "-",
                f"{r.simulator_error:+.0%}" if math.isfinite(r.simulator_error) else "-",
                "yes" if r.correct else "[red]WRONG[/]",
                end_section=False,
            )
            last = r.case
        if table.row_count:
            console.print(table)


def _bars(
    rows: list[Row], series: Callable[[Row], str], names: Sequence[str], title: str, path: str, legend: dict[str, Any]
) -> str:
    """One grouped bar chart of time / L: a group per case, a bar per series name."""
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.8), 4.5))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ys = [next((r.over_limit for r in rows if r.case == c and series(r) == name), math.nan) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=45, ha="right")
    ax.set_ylabel("time / physical limit L")
    ax.set_title(title)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[Row], out_dir: str, subtitle: str) -> list[str]:
    """PNG figures like the paper's figures 5 (one-to-many), 6 (many-to-many) and 8 (balancers)."""
    paths = []
    main = [r for r in rows if r.balancer == MAIN_BALANCER]
    for section, fig_name, number in (
        ("one_to_many", "fig5_one_to_many.png", 5),
        ("many_to_many", "fig6_many_to_many.png", 6),
        ("paper_scale", "fig6_paper_scale.png", 6),
    ):
        sec = [r for r in main if r.section == section]
        if sec:
            labels = list(dict.fromkeys(r.label for r in sec))
            title = f"Fig. {number}-style: {section.replace('_', '-')} resharding ({subtitle})"
            paths.append(
                _bars(
                    sec, lambda r: r.label, labels, title, os.path.join(out_dir, fig_name), {"fontsize": 7, "ncol": 2}
                )
            )
    bal = [r for r in rows if r.section == "many_to_many" and r.strategy == "broadcast"]
    kmax = balancer_chunks([r.chunks for r in bal]) if bal else 0
    bal = [r for r in bal if r.chunks == kmax]
    if bal:
        paths.append(
            _bars(
                bal,
                lambda r: r.balancer,
                BALANCERS,
                f"Fig. 8-style: balancers, broadcast K={kmax} ({subtitle})",
                os.path.join(out_dir, "fig8_balancers.png"),
                {"fontsize": 8},
            )
        )
    return paths


def _finite(value: Any) -> Any:
    """NaN/inf (a missing baseline) become null: strict JSON readers reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def main(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    size_mib = args.size_mib if args.size_mib is not None else (1.0 if quick else 16.0)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    chunk_text = args.chunks or ("16" if quick else "4,16,64,auto")
    errors = []
    try:
        nic_bytes_per_s = parse_rate(args.nic_rate, "--nic-rate")
    except ValueError as err:
        errors.append(FieldError("--nic-rate", args.nic_rate, str(err).split("is invalid: ", 1)[-1]))
    try:
        chunks: list[int | str] = [k if k == "auto" else int(k) for k in chunk_text.split(",")]
        if any(isinstance(k, int) and k < 1 for k in chunks):
            raise ValueError
    except ValueError:
        errors.append(
            FieldError("--chunks", chunk_text, "comma-separated positive integers or auto, e.g. 4,16,64,auto")
        )
    if size_mib <= 0:
        errors.append(FieldError("--size-mib", size_mib, "a positive number of MiB"))
    if repeats < 1:
        errors.append(FieldError("--repeats", repeats, "an integer >= 1"))
    transport = getattr(args, "transport", "gloo")
    if transport == "nccl" and not gpu_visible():
        errors.append(
            FieldError("--transport", transport, "gloo or tcp here: nccl needs a CUDA GPU, and torch sees none")
        )
    if errors:
        raise SpecError(errors)

    t_start = time.monotonic()
    layout = Layout()
    cases = build_cases(quick, int(size_mib * 2**20), chunks, nic_bytes_per_s, layout, args.section or SECTIONS)
    if getattr(args, "case", None):
        cases = [c for c in cases if any(text in c.name for text in args.case)]
        if not cases:
            raise SpecError([FieldError("--case", args.case, "text in a case's name, e.g. x1 or 'S0R -> RR'")])
    import torch  # noqa: F401 - once in the parent: forked ranks start without importing it

    cleanup_stale()
    planning = bench_network(nic_bytes_per_s)
    probe = None  # probe_guard.GuardedCosts: every attempt of the probe, the one used
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with EmulatedCluster(max(layout.hosts) + 1, args.nic_rate, use_netns=not args.no_netns) as cluster:
            network = cluster.describe()
            emulated = cluster.emulated
            if args.message_costs == "measured":
                rounds = QUICK_PROBE_ROUNDS if quick else engine_costs.PROBE_ROUNDS
                nominal = probe_guard.nominal_message_s_for(transport, nic_bytes_per_s)
                probe = probe_guard.guarded_probe(
                    lambda: measure_engine(cluster, nic_bytes_per_s, rounds, transport),
                    attempts=1 if quick else probe_guard.PROBE_ATTEMPTS,
                    nominal_message_s=nominal,
                )
                if probe is None:
                    print("meshjob bench resharding: failed: the message-cost probe did not finish")
                    return 1
                print(probe.describe())
                costs = probe.costs
                planning = costs.apply(planning, os.cpu_count() or 1)
                print(
                    f"planning model: {costs.describe(planning.shared_cpu_cores)}; NIC messages above "
                    f"{planning.alone_bytes / 1024:.0f} KiB run alone, "
                    f"{planning.alone_message_s * 1e6:.0f} µs more each"
                )
            plan_cases(cases, layout, planning)
            result = launch(
                len(layout.hosts),
                lambda ctx: _rank_main(cases, 1, repeats, ctx, planning, transport),
                **cluster.gang(layout.hosts).launch_args(),
            )
    if not result.ok:
        print(f"meshjob bench resharding: failed: {result.first_failure.describe() if result.first_failure else ''}")
        return 1
    rows = collect(cases, [timing for timings in result.values for timing in timings])
    subtitle = (
        f"NIC {args.nic_rate}"
        + ("" if emulated else " NOT applied: loopback")
        + f", {size_mib:g} MiB"
        + (", NCCL on CUDA" if transport == "nccl" else f", CPU wire {transport}")
    )
    title = f"Cross-mesh resharding, {subtitle}, K in {{{chunk_text}}}, {network}"
    print_table(rows, title)
    summary = summarize(rows)
    print_summary(summary, title)
    pricing = cpu_pricing(rows)  # where the simulator's CPU term is off, and which way
    print_cpu_pricing(pricing)
    os.makedirs(args.out, exist_ok=True)
    pngs = plot(rows, args.out, subtitle)
    model = planning.to_json()  # what the plans, planned_* and simulated_s assume
    targets = check_targets(rows) + check_paper_targets(rows, cases)
    print_targets(targets)
    doc = {
        "benchmark": "resharding",
        "nic_rate": args.nic_rate,
        "emulated": emulated,
        "network": network,
        "network_model": model,
        "message_costs": probe.to_json() if probe else None,
        "tensor_mib": size_mib,
        "chunks": chunks,
        "repeats": repeats,
        "quick": quick,
        "transport": transport,
        "machine": machine(),
        "devices_per_host": DEVICES_PER_HOST,
        "wall_seconds": time.monotonic() - t_start,
        "load_average_1m_at_end": os.getloadavg()[0],  # what else ran on the shared cores
        "summary": summary,
        "cpu_pricing": pricing,
        "rows": [asdict(r) for r in rows],
        "plots": pngs,
        "targets": [t.to_json() for t in targets],
    }
    path = os.path.join(args.out, "resharding.json")
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=2)
    print(f"wrote {path} and {', '.join(pngs)} in {doc['wall_seconds']:.0f} s")
    if probe is not None and probe.disturbed:
        print(probe.describe())  # again at the end: the whole run planned with a disturbed probe
    return 0 if all(r.correct for r in rows) else 1
