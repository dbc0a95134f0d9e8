"""The network model's per-message cost, measured on the emulated cluster.

One payload crosses one link cut into K messages, for K from 1 to 1024: rank 0 (host 0) sends to
rank 1 (host 1: across a tc-tbf NIC) and to rank 2 (also host 0: the intra-host link, loopback).
The receiver posts every receive up front; the sender keeps at most `--in-flight` messages
outstanding, as the planned executor does (meshjob.network.model.NetworkModel.in_flight_per_link). A
transfer then takes T(K) = T0 + K * message_s: the slope of a least-squares line through the fastest
of the repeats (the one least disturbed by other processes on a shared machine) is the per-message
cost, the intercept over bytes / NIC rate the link's efficiency (tbf counts headers). The whole
measurement runs `--rounds` times; the median slope is the result, the spread is reported.
meshjob.network.model.DEFAULT_MESSAGE_S and DEFAULT_INTRA_MESSAGE_S are this benchmark's medians.

Run: `meshjob bench message-cost` (root for network namespaces; loopback otherwise, and it says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any, TypedDict

from rich.console import Console
from rich.table import Table

from meshjob.errors import FieldError, SpecError
from meshjob.units import parse_rate, parse_size
from meshjob_bench.machine import machine
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.launch import launch

LINKS = {"network": 1, "local": 2}  # link -> receiving rank (rank 0 sends)
RANK_HOSTS = [0, 1, 0]


class LinkSummary(TypedDict):
    """One link's fitted per-message cost: the median over rounds, each round's, and the fit's intercept."""

    message_s: float
    message_s_rounds: list[float]
    intercept_over_bytes_at_nic_rate: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nic-rate", default="1gbit", help="emulated NIC of both hosts (default 1gbit)")
    parser.add_argument("--size", default="4MiB", help="payload of one transfer (default 4MiB)")
    parser.add_argument(
        "--chunks",
        default="1,4,16,64,256",
        help="K values, comma separated (default 1,4,16,64,256: chunks of 16 KiB and more, where a "
        "message costs its bytes plus a fixed overhead; smaller ones run out of CPU first)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed transfers per K and link (default 15)")
    parser.add_argument("--rounds", type=int, default=5, help="whole measurements, median slope (default 5)")
    parser.add_argument("--in-flight", type=int, default=2, help="messages outstanding per sender (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 256 KiB, K 1,16,64, 2 repeats, 1 round")
    parser.add_argument("--no-netns", action="store_true", help="loopback: no NIC emulation (results say so)")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="folder for message_cost.json")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _send(dist: Any, flat: Any, k: int, dst: int, in_flight: int) -> None:
    pending: list[Any] = []  # torch.distributed Work handles, oldest first
    for i, piece in enumerate(flat.tensor_split(k)):
        if len(pending) >= in_flight:
            pending.pop(0).wait()
        pending.append(dist.isend(piece, dst, tag=i))
    for work in pending:
        work.wait()


def _receive(dist: Any, flat: Any, k: int, src: int) -> None:
    for work in [dist.irecv(piece, src, tag=i) for i, piece in enumerate(flat.tensor_split(k))]:
        work.wait()


def _rank_main(nbytes: int, chunks: list[int], repeats: int, rounds: int, in_flight: int, ctx: Any) -> list[dict]:
    """One rank: every round, link, repeat and K in turn; returns the transfers it timed."""
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    import torch
    import torch.distributed as dist

    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(ctx.env, timeout_s=120, backend="gloo")
    flat = torch.zeros(nbytes // 4, dtype=torch.float32)
    timed: list[dict] = []
    try:
        for rnd, (link, peer) in [(r, lp) for r in range(rounds) for lp in LINKS.items()]:
            # K values interleaved: a busy spell of the shared machine hits them alike
            for rep, k in [(rep, k) for rep in range(repeats + 1) for k in chunks]:  # repeat 0 warms up
                dist.barrier()
                t0 = time.monotonic()
                if ctx.rank == 0:
                    _send(dist, flat, k, peer, in_flight)
                elif ctx.rank == peer:
                    _receive(dist, flat, k, 0)
                else:
                    continue
                if rep:
                    timed.append(dict(round=rnd, link=link, chunks=k, rep=rep, start=t0, end=time.monotonic()))
        dist.barrier()
    finally:
        shutdown_distributed()
    return timed


def collect(events: list[dict], chunks: list[int], rnd: int) -> dict[str, dict[int, float]]:
    """link -> K -> the fastest repeat's span (first start to last end) in round `rnd`."""
    spans: dict[tuple[str, int, int], list[float]] = {}
    for e in events:
        if e.get("round") == rnd:
            lo, hi = spans.get((e["link"], e["chunks"], e["rep"]), [float("inf"), float("-inf")])
            spans[(e["link"], e["chunks"], e["rep"])] = [min(lo, e["start"]), max(hi, e["end"])]
    return {
        link: {k: min(hi - lo for (l2, k2, _), (lo, hi) in spans.items() if l2 == link and k2 == k) for k in chunks}
        for link in LINKS
    }


def _median_round(round_fits: list[dict[str, tuple[float, float]]]) -> int:
    order = sorted(range(len(round_fits)), key=lambda r: round_fits[r]["network"][1])
    return order[len(order) // 2]


def plot(medians: dict[str, dict[int, float]], fits: dict[str, tuple[float, float]], path: str, title: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for link, by_k in medians.items():
        ks = sorted(by_k)
        ax.plot(ks, [by_k[k] * 1e3 for k in ks], "o", label=f"{link}: measured (fastest repeat)")
        a, b = fits[link]
        ax.plot(ks, [(a + b * k) * 1e3 for k in ks], "-", label=f"{link}: {b * 1e6:.1f} µs per message")
    ax.set_xlabel("messages per transfer (K)")
    ax.set_ylabel("transfer time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    size_text, chunk_text, repeats, rounds = args.size, args.chunks, args.repeats, args.rounds
    if args.quick:
        size_text, chunk_text, repeats, rounds = "256KiB", "1,16,64", 2, 1
    errors = []
    try:
        nic = parse_rate(args.nic_rate, "--nic-rate")
    except ValueError as err:
        errors.append(FieldError("--nic-rate", args.nic_rate, str(err).split("is invalid: ", 1)[-1]))
    try:
        nbytes = parse_size(size_text) // 4 * 4
        chunks = sorted({int(k) for k in chunk_text.split(",")})
        if nbytes < 4 * max(chunks) or min(chunks) < 1 or len(chunks) < 2:
            raise ValueError
    except ValueError:
        errors.append(FieldError("--chunks", chunk_text, "at least two positive K values, each at most size / 4"))
    if repeats < 1 or rounds < 1 or args.in_flight < 1:
        errors.append(FieldError("--repeats/--rounds/--in-flight", (repeats, rounds, args.in_flight), "integers >= 1"))
    if errors:
        raise SpecError(errors)
    import torch  # noqa: F401 - once in the parent: forked ranks start without importing it

    cleanup_stale()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with EmulatedCluster(2, args.nic_rate, use_netns=not args.no_netns) as cluster:
            described, emulated = cluster.describe(), cluster.emulated
            result = launch(
                len(RANK_HOSTS),
                lambda ctx: _rank_main(nbytes, chunks, repeats, rounds, args.in_flight, ctx),
                **cluster.gang(RANK_HOSTS).launch_args(),
            )
    if not result.ok:
        print(f"meshjob bench message-cost: failed: {result.first_failure.describe() if result.first_failure else ''}")
        return 1
    events = [timing for timings in result.values for timing in timings or ()]
    per_round = [collect(events, chunks, r) for r in range(rounds)]
    round_fits = [{link: fit_line(chunks, [by_k[k] for k in chunks]) for link, by_k in m.items()} for m in per_round]
    middle = _median_round(round_fits)  # the round whose network slope is the median one: table and plot
    medians, fits = per_round[middle], round_fits[middle]
    t_nic = nbytes / nic
    rows = [
        {
            "round": r,
            "link": link,
            "chunks": k,
            "seconds": m[link][k],
            "fit_s": round_fits[r][link][0] + round_fits[r][link][1] * k,
        }
        for r, m in enumerate(per_round)
        for link in LINKS
        for k in chunks
    ]
    summary: dict[str, LinkSummary] = {
        link: {
            "message_s": statistics.median(f[link][1] for f in round_fits),
            "message_s_rounds": [f[link][1] for f in round_fits],
            "intercept_over_bytes_at_nic_rate": statistics.median(f[link][0] / t_nic for f in round_fits),
        }
        for link in LINKS
    }
    title = (
        f"per-message cost: {size_text} in K messages, {args.in_flight} in flight, NIC {args.nic_rate}"
        + ("" if emulated else " NOT applied: loopback")
        + f"; {described}"
    )
    _print([r for r in rows if r["round"] == middle], summary, title)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "message_cost.png")
    plot(medians, fits, png, title)
    doc = {
        "benchmark": "message-cost",
        "nic_rate": args.nic_rate,
        "emulated": emulated,
        "network": described,
        "bytes": nbytes,
        "repeats": repeats,
        "rounds": rounds,
        "in_flight": args.in_flight,
        "quick": bool(args.quick),
        "transport": "gloo",
        "machine": machine(),  # CPU tensors, whatever the machine
        "summary": summary,
        "rows": rows,
        "plots": [png],
    }
    path = os.path.join(args.out, "message_cost.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path} and {png}")
    return 0


def _print(rows: list[dict], summary: dict[str, LinkSummary], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for col in ("link", "K", "fastest ms", "fit ms"):
        table.add_column(col, justify="left" if col == "link" else "right")
    for r in rows:
        table.add_row(r["link"], str(r["chunks"]), f"{r['seconds'] * 1e3:.2f}", f"{r['fit_s'] * 1e3:.2f}")
    Console(width=120).print(table)
    for link, s in summary.items():
        spread = ", ".join(f"{x * 1e6:.1f}" for x in sorted(s["message_s_rounds"]))
        print(
            f"{link}: {s['message_s'] * 1e6:.1f} µs per message (median of rounds: {spread}); one message of the "
            f"whole payload takes {s['intercept_over_bytes_at_nic_rate']:.3f} x bytes / NIC rate"
        )
