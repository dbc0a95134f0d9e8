"""What a message costs through the communication engine on the emulated cluster: link time and CPU.

The network model's per-message costs (meshjob.network.model: `message_s`, `intra_message_s`) default to
raw gloo between two idle ranks, and every emulated host runs on this machine's few cores, so a chain
cut into many chunks runs out of CPU before it runs out of NIC (`shared_cpu_cores`). `chunks: auto`
is only as good as these figures. The benchmark that plans with them measures them first, in a gang
on the same emulated cluster, through the executor the timed transfers use (engine, wires, waiter
threads): one rank sends a tensor to a rank on another host (cross_host) and to a rank on its own
host (intra_host), in K = 1 and K = 128 messages, at two sizes: PROBE_ROUNDS rounds, each every link,
size and K in turn, PROBE_REPEATS timed transfers each (their median).

Each round is fitted alone (below) and every cost is the median over the rounds; their spread (least
and most over the rounds) is recorded beside it (`EngineCosts.spread`, the JSON's message_costs). One
round of median-of-5 varied ~5x between runs in the per-message link time (81-431 µs: it comes from
the 2 MiB transfer cut in 128 messages, whose time follows whatever else runs on the shared cores);
the rounds interleave the probes, so a burst of load moves one round, not the fit.

- Link time, per link: seconds = per transfer + per byte * bytes + per message * K (least squares
  over the four transfers); the per-message term is the model's message_s / intra_message_s.
- CPU: the process time of the two ranks, all threads included; per byte (each link): its slope over
  the two sizes sent as one message; per message (each link: message_cpu_s between hosts,
  intra_message_cpu_s inside one): the extra CPU of K = 128 over K = 1 at the same size, per extra
  message, averaged over the sizes (see `fit_round`). The two links cost different CPU per message:
  between hosts gloo's send and receive (and its socket threads), inside a host the engine's one-copy
  local wire; two full runs measured 300-510 µs and 120-225 µs (rounds), so one figure for both
  over-charged the copies inside a host and under-charged the messages between hosts.
- A NIC message above the executor's overlap threshold runs alone (`EngineCosts.apply`: the model's
  alone_bytes and alone_message_s).

The probe guards itself against other processes on the shared cores: meshjob_bench.probe_guard.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec
from meshjob.network.model import NetworkModel, on_shared_cores
from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST
from meshjob_bench.resharding_cases import Case, Layout, Variant, variant_boundary

PROBE_CHUNKS = (1, 128)
PROBE_MIB = (2, 8)
PROBE_REPEATS = 3  # timed transfers per round, link, size and K (their median)
PROBE_ROUNDS = 5  # rounds fitted alone; each cost is the median over them
TERMS = ("message_s", "intra_message_s", "message_cpu_s", "intra_message_cpu_s", "net_byte_cpu_s", "local_byte_cpu_s")
LINKS = (CROSS_HOST, INTRA_HOST)


@dataclass(frozen=True)
class EngineCosts:
    message_s: float  # link time per message between hosts
    intra_message_s: float  # inside a host
    message_cpu_s: float  # CPU per message between hosts, both ranks together
    intra_message_cpu_s: float  # inside a host
    net_byte_cpu_s: float
    local_byte_cpu_s: float
    samples: tuple[dict[str, Any], ...]  # every probe transfer: link, bytes, chunks, messages, seconds, cpu_seconds
    # per cost (TERMS): (least, most) over the rounds' fits; rounds: how many were fitted
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)
    rounds: int = 1

    def apply(self, network: NetworkModel, cores: int) -> NetworkModel:
        """`network` with these costs, its hosts sharing `cores` cores (meshjob.network.model.on_shared_cores:
        a NIC message above the executor's overlap threshold runs alone and pays one message's CPU on
        the shared cores more of its link)."""
        return on_shared_cores(
            network,
            cores,
            self.message_s,
            self.intra_message_s,
            self.message_cpu_s,
            self.intra_message_cpu_s,
            self.net_byte_cpu_s,
            self.local_byte_cpu_s,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "message_s": self.message_s,
            "intra_message_s": self.intra_message_s,
            "message_cpu_s": self.message_cpu_s,
            "intra_message_cpu_s": self.intra_message_cpu_s,
            "net_byte_cpu_s": self.net_byte_cpu_s,
            "local_byte_cpu_s": self.local_byte_cpu_s,
            "rounds": self.rounds,
            "spread": {term: list(lo_hi) for term, lo_hi in self.spread.items()},
            "samples": list(self.samples),
        }

    def spread_ratio(self, term: str) -> float:
        """Most over least of `term` across the rounds (1.0: they agree; inf: one round fitted 0)."""
        lo, hi = self.spread.get(term, (getattr(self, term), getattr(self, term)))
        return 1.0 if hi == lo else (hi / lo if lo > 0 else math.inf)

    def describe(self, cores: int) -> str:
        return (
            f"measured through the engine: {self.message_s * 1e6:.0f} µs per message between hosts, "
            f"{self.intra_message_s * 1e6:.0f} µs inside a host; CPU {self.message_cpu_s * 1e6:.0f} µs per "
            f"message between hosts, {self.intra_message_cpu_s * 1e6:.0f} µs inside a host, "
            f"{self.net_byte_cpu_s * 1e9:.2f} ns per byte between hosts, "
            f"{self.local_byte_cpu_s * 1e9:.2f} ns inside a host, on {cores} shared cores (median of "
            f"{self.rounds} rounds; per message between hosts {self.range_text('message_s', 1e6)} µs, CPU "
            f"{self.range_text('message_cpu_s', 1e6)} µs, "
            f"inside a host {self.range_text('intra_message_cpu_s', 1e6)} µs)"
        )

    def range_text(self, term: str, scale: float) -> str:
        """`term`'s lowest-highest over the rounds, times `scale` (1e6: in µs), as "lo-hi"."""
        lo, hi = self.spread.get(term, (getattr(self, term), getattr(self, term)))
        return f"{lo * scale:.0f}-{hi * scale:.0f}"


def unpacked(network: NetworkModel) -> NetworkModel:
    """`network` with no small messages packed beyond the window (NetworkModel.small_in_flight_per_link):
    the probe measures what a message costs one window at a time, the cost the model charges each; the
    overlap threshold comes from it too. Probed packed, the 16 KiB messages measured about half the link
    time and two thirds the CPU, the threshold fell below the 256 KiB chunks of one-to-many at K = 64,
    which then ran alone, and `chunks: auto` cut more chunks than the shared cores could carry (1 -> 4x3,
    1 -> 4x4: 1.5-2.4 L against 1.35-1.75 L, two interleaved runs each)."""
    return replace(network, small_in_flight_per_link=network.in_flight_per_link)


def probe_cases(
    layout: Layout, nic_bytes_per_s: float, network: NetworkModel, rounds: int = PROBE_ROUNDS
) -> list[Case]:
    """Per round, one case per link and size, each with a broadcast variant per K, named
    "<link> <MiB> MiB round <r>"."""
    sender = layout.grid((1, 1), 0)
    neighbour = layout.rank(0, 1)
    targets = {CROSS_HOST: layout.grid((1, 1), 1), INTRA_HOST: Mesh((1, 1), (neighbour,), (0,))}
    cases = []
    for r in range(rounds):  # interleaved: a burst of load on the shared cores moves one round
        for link in LINKS:
            for mib in PROBE_MIB:
                shape = (mib * 2**20 // 4 // 1024, 1024)
                case = Case(
                    "engine_probe",
                    f"{link} {mib} MiB round {r}",
                    shape,
                    sender,
                    targets[link],
                    ShardingSpec.parse("RR"),
                    ShardingSpec.parse("RR"),
                )
                case.limit_s = mib * 2**20 / nic_bytes_per_s
                case.variants = [Variant("broadcast", k, "greedy") for k in PROBE_CHUNKS]
                case.boundaries = [
                    variant_boundary(case, v, i, layout.host_of, network) for i, v in enumerate(case.variants)
                ]
                case.simulated_s = [math.nan] * len(case.variants)
                case.planned_s = [math.nan] * len(case.variants)
                case.messages = [{link: len(b.steps)} for b in case.boundaries]
                cases.append(case)
    return cases


def fit(rows: Sequence[Any]) -> EngineCosts:
    """The costs from the probe's rows (the bench's Row: seconds, cpu_seconds, messages; case
    "<link> <MiB> MiB [round <r>]"): each round fitted alone (`fit_round`), each cost the median over
    the rounds, its spread the least and most of them."""
    samples = [
        {
            "link": r.case.split()[0],
            "bytes": int(r.case.split()[1]) * 2**20,
            "chunks": r.chunks,
            "messages": sum(r.messages.values()),
            "seconds": r.seconds,
            "cpu_seconds": r.cpu_seconds,
            "round": int(r.case.split()[4]) if len(r.case.split()) > 4 else 0,
        }
        for r in rows
    ]
    rounds = sorted({s["round"] for s in samples})
    fits = [fit_round([s for s in samples if s["round"] == r]) for r in rounds]
    costs = {term: statistics.median(f[term] for f in fits) for term in TERMS}
    spread = {term: (min(f[term] for f in fits), max(f[term] for f in fits)) for term in TERMS}
    return EngineCosts(**costs, samples=tuple(samples), spread=spread, rounds=len(fits))


def fit_round(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One round's costs (TERMS) from its samples: every link at both sizes and both K."""
    per_message = {}
    for link in LINKS:  # seconds = per transfer + per byte * bytes + per message * messages
        mine = [s for s in samples if s["link"] == link]
        coef = _least_squares([[1.0, s["bytes"], s["messages"]] for s in mine], [s["seconds"] for s in mine])
        per_message[link] = max(0.0, coef[2])
    # CPU, each term from the probes that isolate it: per byte (each link) from the single-message
    # transfers of both sizes, per message from the extra CPU of the many-message transfer over the
    # single-message one of the same link and size. One least-squares fit of all terms together let
    # the noise of the many-message probes (their CPU spreads by tens of ms on the shared cores) decide
    # the per-byte terms, and put them at 0: the bench then charged CPU per message only and chunks:
    # auto over-chunked where bytes, not messages, kept the cores busy.
    per_byte = {}
    for link in LINKS:
        fewest = min(s["messages"] for s in samples if s["link"] == link)
        ones = [s for s in samples if s["link"] == link and s["messages"] == fewest]
        per_byte[link] = (
            max(0.0, _least_squares([[1.0, s["bytes"]] for s in ones], [s["cpu_seconds"] for s in ones])[1])
            if len(ones) > 1
            else 0.0
        )
    per_message_cpu = {}
    for link in LINKS:
        extra = []
        for nbytes in sorted({s["bytes"] for s in samples if s["link"] == link}):
            same = sorted(
                (s for s in samples if s["link"] == link and s["bytes"] == nbytes), key=lambda s: s["messages"]
            )
            if len(same) > 1 and same[-1]["messages"] > same[0]["messages"]:
                extra.append(
                    (same[-1]["cpu_seconds"] - same[0]["cpu_seconds"]) / (same[-1]["messages"] - same[0]["messages"])
                )
        per_message_cpu[link] = max(0.0, sum(extra) / len(extra)) if extra else 0.0
    return dict(
        zip(
            TERMS,
            (
                per_message[CROSS_HOST],
                per_message[INTRA_HOST],
                per_message_cpu[CROSS_HOST],
                per_message_cpu[INTRA_HOST],
                per_byte[CROSS_HOST],
                per_byte[INTRA_HOST],
            ),
        )
    )


def _least_squares(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    import numpy  # for this fit only: the module (imported by `meshjob bench resharding`) stays light

    coef, *_ = numpy.linalg.lstsq(numpy.array(xs, dtype=float), numpy.array(ys, dtype=float), rcond=None)
    return [float(c) for c in coef]
