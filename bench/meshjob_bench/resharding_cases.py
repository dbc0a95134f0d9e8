"""The cases `meshjob bench resharding` runs (the paper's §5.1, figures 5, 6 and 8) and their plans.

A case is one tensor moved between two meshes of the emulated cluster, with every variant it runs: each
strategy on the main balancer, broadcast at each K and under every balancer, Alpa's default. Here: the
case lists, the ranks' layout on the hosts, the physical limit L, and each variant's plan, planned
makespan and simulated time on the network model the run plans with (meshjob_bench.resharding runs and
reports them; meshjob_bench.resharding_targets checks the issues' targets on the measured rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec
from meshjob.network.model import NetworkModel
from meshjob.plan.build import Boundary, plan_boundary
from meshjob.plan.comm_order import TransferOrder
from meshjob.resharding.balance import BALANCERS as BALANCER_REGISTRY
from meshjob.resharding.tasks import UnitTask, decompose
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import simulate_transfer
from meshjob.spec.manifest import ReshardingSpec
from meshjob_bench.pipeline import TCP_PAYLOAD_PER_FRAME_BYTE

DEVICES_PER_HOST = 4
ITEMSIZE = 4  # float32
STRATEGY_ORDER = ("send_recv", "local_allgather", "global_allgather", "broadcast", "signal")
BALANCERS = tuple(BALANCER_REGISTRY)
MAIN_BALANCER = "greedy"
# Zhuang et al., 2022, Table 2 style: (send spec, recv spec) of a 2-D tensor between two (2, 2) meshes
MANY_TO_MANY = (
    ("RR", "S0R"),
    ("S0R", "RR"),
    ("S0R", "S1R"),
    ("RS0", "S0R"),
    ("S01R", "RS01"),
    ("S0S1", "S1S0"),
    ("S1R", "RR"),
    ("RR", "RR"),
)
# The paper's scale (issue 10, figure 6): between two (2, 4) meshes (2 hosts of 4 devices each side) and
# two (4, 2) meshes (4 hosts of 2), 2-D and 3-D tensors; most destinations replicate the tensor across
# their hosts, where broadcast's chains beat sending it to every host from the sources.
PAPER_SCALE_MESHES = ((2, 4), (4, 2))
PAPER_SCALE = (
    ("RR", "RR"),
    ("S1R", "RR"),
    ("S0R", "RR"),
    ("RS1", "S1R"),
    ("S0S1", "RS1"),
    ("RRR", "RRR"),
    ("RS1R", "RRS1"),
    ("S0RR", "RRR"),
)
SECTIONS = ("one_to_many", "many_to_many", "paper_scale")
ALPA_DEFAULT = "alpa default"


@dataclass(frozen=True)
class Variant:
    strategy: str
    chunks: int | str  # K, or "auto"
    balancer: str
    host_sharded: bool = False  # Alpa's default: send/recv into a host-sharded layout, all-gather inside hosts

    @property
    def label(self) -> str:
        if self.host_sharded:
            return ALPA_DEFAULT
        if self.strategy == "broadcast":
            return f"broadcast K={self.chunks} {self.balancer}"
        return f"{self.strategy} {self.balancer}" if self.balancer != MAIN_BALANCER else self.strategy


@dataclass
class Case:
    section: str  # one of SECTIONS
    name: str
    shape: tuple[int, ...]
    src_mesh: Mesh
    dst_mesh: Mesh
    send: ShardingSpec
    recv: ShardingSpec
    limit_s: float = 0.0  # physical limit L
    variants: list[Variant] = field(default_factory=list)
    boundaries: list[Boundary] = field(default_factory=list)  # one per variant, tensor "v<variant>"
    simulated_s: list[float] = field(default_factory=list)  # meshjob.simulate.simulator's prediction of each, same NICs
    simulated_cpu_s: list[float] = field(default_factory=list)  # the CPU seconds it prices each at (all ranks)
    planned_s: list[float] = field(default_factory=list)  # the plan's makespan of each (see planned_makespan)
    messages: list[dict[str, int]] = field(default_factory=list)  # of each: scope -> messages the executor sends


class Layout:
    """Global ranks of (host, device) slots, given out in first-use order so that the gang
    holds only the ranks some case uses (8 in --quick, 18 in the full run)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}
        self.hosts: list[int] = []  # rank -> host

    def rank(self, host: int, device: int) -> int:
        if (host, device) not in self.slots:
            self.slots[(host, device)] = len(self.hosts)
            self.hosts.append(host)
        return self.slots[(host, device)]

    def host_of(self, rank: int) -> int:
        return self.hosts[rank]

    def grid(self, shape: tuple[int, int], first_host: int) -> Mesh:
        """Mesh row i on host first_host + i, devices 0..shape[1]-1 of that host."""
        ranks = tuple(self.rank(first_host + i, j) for i in range(shape[0]) for j in range(shape[1]))
        return Mesh(tuple(shape), ranks, tuple(self.host_of(r) for r in ranks))


def physical_limit(tasks: Sequence[UnitTask], host_of: Callable[[int], int], nic_bytes_per_s: float) -> float:
    """L: bytes the busiest receiving host must take in, over the NIC rate (unit task slices are
    disjoint, so a host's bytes are the sum over the tasks any of its ranks receives)."""
    per_host: dict[int, int] = {}
    for t in tasks:
        senders = {host_of(r) for r in t.senders}
        for h in {host_of(r) for r in t.receivers} - senders:
            per_host[h] = per_host.get(h, 0) + t.bytes
    return max(per_host.values(), default=0) / nic_bytes_per_s


def host_sharded(spec: ShardingSpec, mesh: Mesh, shape: tuple[int, ...]) -> ShardingSpec:
    """Alpa's rewrite of a destination layout: also shard over the devices of a host (mesh dim 1) the
    first tensor dim that divides, so each device receives a part and the host all-gathers them.
    Unchanged when the layout already uses mesh dim 1 or no dim divides."""
    if len(mesh.shape) < 2 or mesh.shape[1] == 1 or 1 in spec.mesh_dims_used():
        return spec
    for d, dims in enumerate(spec.dims):
        pieces = math.prod(mesh.shape[m] for m in dims) * mesh.shape[1]
        if shape[d] % pieces == 0:
            return ShardingSpec(spec.dims[:d] + (dims + (1,),) + spec.dims[d + 1 :])
    return spec


def variant_boundary(
    case: Case, variant: Variant, index: int, host_of: Callable[[int], int], network: NetworkModel
) -> Boundary:
    """The plan layer's boundary for one variant: senders, order and chunks from its balancer on the
    network model, lowered steps."""
    resharding = ReshardingSpec(variant.strategy, variant.chunks, variant.balancer, budget_seconds=0.5)
    recv = host_sharded(case.recv, case.dst_mesh, case.shape) if variant.host_sharded else case.recv
    return plan_boundary(
        BoundaryKey(0, 1, f"v{index}"),
        case.shape,
        (case.src_mesh, case.send),
        (case.dst_mesh, recv),
        resharding,
        host_of,
        network=network,
    )


def executed_steps(case: Case, boundary: Boundary) -> list[Any]:
    """Every message the executor sends for `boundary`: the plan's steps, then its all-gather inside the
    destination (when the boundary's layout shards more than the case's), each gather step after what
    its sender receives."""
    # the trainer's routes import torch: only when called (`meshjob bench --help` imports every benchmark)
    from meshjob_trainer.route import make_routes

    (route,) = make_routes([boundary], {0: case.src_mesh, 1: case.dst_mesh}, {0: case.send, 1: case.recv})
    gather = [dataclasses.replace(g, after=tuple(s.id for s in boundary.steps if s.dst == g.src)) for g in route.gather]
    return list(boundary.steps) + gather


def planned_makespan(case: Case, boundary: Boundary, host_of: Callable[[int], int], network: NetworkModel) -> float:
    """The plan's makespan (its balancer's schedule on the network model); for Alpa's default, whose
    plan covers only the send/recv, that part and the all-gather inside the hosts timed together on
    the same model."""
    if str(boundary.recv) == str(case.recv):
        return boundary.makespan_s
    return simulate_transfer(executed_steps(case, boundary), host_of, network).makespan_s


def balancer_chunks(chunks: Sequence[int | str]) -> int | str:
    """The K the balancers are compared at: auto when it runs, else the largest K."""
    return "auto" if "auto" in chunks else max(int(k) for k in chunks)


def build_cases(
    quick: bool,
    size_bytes: int,
    chunks: Sequence[int | str],
    nic_bytes_per_s: float,
    layout: Layout,
    sections: Sequence[str] = SECTIONS,
) -> list[Case]:
    numel = size_bytes // ITEMSIZE
    cols = 1024 if not quick else 256
    rows = max(16, numel // cols // 16 * 16)  # divisible by every mesh size used
    shape = (rows, cols)
    cases: list[Case] = []
    sizes = [(1, 1), (1, 2), (2, 1), (2, 2)] if quick else [(a, b) for a in range(1, 5) for b in range(1, 5)]
    sizes = sizes if "one_to_many" in sections else []
    for a, b in sizes:
        cases.append(
            Case(
                "one_to_many",
                f"1 -> {a}x{b}",
                shape,
                layout.grid((1, 1), 0),
                layout.grid((a, b), first_host=1),
                ShardingSpec.parse("RR"),
                ShardingSpec.parse("RR"),
            )
        )
    pairs: Sequence[tuple[str, str]] = (
        (MANY_TO_MANY[:3] if quick else MANY_TO_MANY) if "many_to_many" in sections else ()
    )
    for send, recv in pairs:
        cases.append(
            Case(
                "many_to_many",
                f"{send} -> {recv}",
                shape,
                layout.grid((2, 2), 0),
                layout.grid((2, 2), 2),
                ShardingSpec.parse(send, 2),
                ShardingSpec.parse(recv, 2),
            )
        )
    pairs = (PAPER_SCALE[:1] if quick else PAPER_SCALE) if "paper_scale" in sections else ()
    for mesh in PAPER_SCALE_MESHES if pairs else ():
        for send, recv in pairs:
            spec_in, spec_out = ShardingSpec.parse(send), ShardingSpec.parse(recv)
            case_shape = shape if spec_in.ndim == 2 else (16, rows // 16, cols)
            cases.append(
                Case(
                    "paper_scale",
                    f"{mesh[0]}x{mesh[1]} {send} -> {recv}",
                    case_shape,
                    layout.grid(mesh, 0),
                    layout.grid(mesh, mesh[0]),
                    spec_in,
                    spec_out,
                )
            )
    for c in cases:
        tasks = decompose(c.shape, c.src_mesh, c.send, c.dst_mesh, c.recv, itemsize=ITEMSIZE)
        c.limit_s = physical_limit(tasks, layout.host_of, nic_bytes_per_s)
        c.variants = [Variant(s, 1, MAIN_BALANCER) for s in ("send_recv", "local_allgather", "global_allgather")]
        c.variants += [Variant("broadcast", k, MAIN_BALANCER) for k in chunks]
        c.variants.append(Variant("signal", 1, MAIN_BALANCER))
        if host_sharded(c.recv, c.dst_mesh, c.shape) != c.recv:
            c.variants.insert(3, Variant("send_recv", 1, MAIN_BALANCER, host_sharded=True))
        if c.section in ("many_to_many", "paper_scale"):
            k = balancer_chunks(chunks)
            c.variants += [Variant("broadcast", k, b) for b in BALANCERS if b != MAIN_BALANCER]
    return cases


def plan_cases(cases: Sequence[Case], layout: Layout, network: NetworkModel) -> None:
    """Each variant's plan on `network`, with its planned makespan and the simulator's prediction."""
    for c in cases:
        c.boundaries = [variant_boundary(c, v, i, layout.host_of, network) for i, v in enumerate(c.variants)]
        results = [simulate_transfer(executed_steps(c, b), layout.host_of, network) for b in c.boundaries]
        c.simulated_s = [r.makespan_s for r in results]
        c.simulated_cpu_s = [r.cpu_work_s for r in results]
        c.planned_s = [planned_makespan(c, b, layout.host_of, network) for b in c.boundaries]
        c.messages = [message_counts(c, b) for b in c.boundaries]


def bench_network(nic_bytes_per_s: float) -> NetworkModel:
    """The network model the benchmark plans with before the CPU is measured: NIC links of the tc rate,
    of which TCP payload gets TCP_PAYLOAD_PER_FRAME_BYTE (tbf counts the frames' headers too; the
    physical limit L stays bytes over the tc rate)."""
    return NetworkModel(nic_bytes_per_s=nic_bytes_per_s * TCP_PAYLOAD_PER_FRAME_BYTE)


def case_order(case: Case, reps: int) -> Any:
    """The order a case's transfers run in: repetition by repetition (one microbatch each), every variant
    in each. Interleaved, so a burst of load on the shared cores (seconds long: another process, a
    kernel thread) moves one repetition of every variant, and the median of each, instead of every
    repetition of the variants that happened to run then; the comparisons between variants are what
    the benchmark reports. Planned, so the ranks of a host take their turns on its NIC links as the
    plan orders them (meshjob_trainer.board)."""
    return TransferOrder(tuple((b.key, rep) for rep in range(reps) for b in case.boundaries))


def message_counts(case: Case, boundary: Boundary) -> dict[str, int]:
    """Messages the executor sends for the boundary, by scope (between hosts, inside a host)."""
    counts: dict[str, int] = {}
    for step in executed_steps(case, boundary):
        counts[step.scope] = counts.get(step.scope, 0) + 1
    return counts


@dataclass
class Row:
    section: str
    case: str
    strategy: str
    chunks: int | str
    balancer: str
    label: str
    seconds: float  # median over repetitions of (last end - first start) over participating ranks
    repeats: list[float]
    limit_s: float
    over_limit: float
    speedup_vs_global_allgather: float
    speedup_vs_send_recv: float
    planned_makespan_s: float
    planned_lower_bound_s: float
    correct: bool
    simulated_s: float = math.nan  # the simulator's prediction for the same steps
    simulator_error: float = math.nan  # simulated / measured - 1
    measured_over_planned: float = math.nan  # seconds / planned_makespan_s
    cpu_seconds: float = math.nan  # median over repetitions of the CPU time all ranks spent in the transfer
    minor_faults: float = math.nan  # median over repetitions of the pages all ranks faulted in during it
    messages: dict[str, int] = field(default_factory=dict)  # scope (cross_host, intra_host) -> messages sent
    # the CPU seconds the simulator's model prices the same steps at, all ranks together (NaN: not modelled)
    simulated_cpu_seconds: float = math.nan
