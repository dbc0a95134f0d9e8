"""The resharding executor: moves one tensor across a plan boundary for one microbatch.

Every rank of both stages of a boundary calls start() for the same (boundary, microbatch).
1. The source side holds its natural-layout tile; the plan's steps name regions in global
   coordinates inside the send layout, so a source sends views of that tile (copied only where a
   region is not contiguous).
2. The plan's lowered Steps are point-to-point messages, issued by the rank's one communication
   engine (meshjob_trainer.engine) on its wire (meshjob_trainer.wire: gloo for CPU tensors, NCCL
   device to device for CUDA ones): receives posted as soon as the transfer starts, sends in the
   sender's program order (meshjob.program) with a bounded number in flight per link, a region
   forwarded as soon as the steps it depends on (`after`) have landed. Chunked broadcast thus
   becomes a pipelined chain, and ring all-gathers become forwards of the parts a rank received.
   With a plan, transfers follow the step's order (meshjob.comm_order), which every rank derives.
3. Receivers assemble their recv-layout tile, receiving straight into it where a region is
   contiguous. When the recv layout shards more than the destination's natural layout, each rank
   then fetches the missing recv tiles from peers of its own mesh (same host first), which is the
   all-gather inside the destination mesh.

start() returns at once: the engine's thread moves the data while the stage computes, so a
forwarding rank in a broadcast chain passes chunks on while its pipeline stage is busy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from meshjob.boundary import BoundaryKey
from meshjob.comm_order import TransferOrder, recv_depths
from meshjob.mesh import Mesh
from meshjob.network import HANDOVER_LEAD_S, Link, NetworkModel, overlap_bytes
from meshjob.plan import ITEMSIZE, Boundary
from meshjob.host_order import HostLinkOrder, Side, host_link_orders
from meshjob.program import RankProgram, in_link, out_link, planned_keys, rank_programs
from meshjob.resharding import CROSS_HOST, INTRA_HOST, Step
from meshjob.sharding import ShardingSpec, Slice, contains, intersect, relative, slice_numel, slice_shape, tile, to_index
from meshjob_trainer.engine import CommEngine
from meshjob_trainer.engine_job import Handle, Job, MessageSpec
from meshjob_trainer.events import LowerBoundRatio, MetricsSink, NicBandwidth, Resharded, UnitTasks
from meshjob_trainer.wire import Wire, wire_for

SIGNAL_BYTES = 1
_BOARDS = itertools.count()  # boards built by this process: every rank of a host counts them alike


class ReshardError(RuntimeError):
    """A plan the executor cannot run, or a wrong call; the message names the boundary."""


GATHER_TASK = -1  # the task index of the steps the executor adds: fetching a peer's recv tile


def _spec(value: ShardingSpec | str, ndim: int) -> ShardingSpec:
    return value if isinstance(value, ShardingSpec) else ShardingSpec.parse(str(value), ndim)


@dataclass
class Route:
    """One boundary with everything a rank needs to run it, checked once at construction."""

    boundary: Boundary
    src_mesh: Mesh
    dst_mesh: Mesh
    src_natural: ShardingSpec
    dst_natural: ShardingSpec
    network: NetworkModel = field(default_factory=NetworkModel)  # what orders each rank's sends
    steps: tuple[Step, ...] = field(init=False)  # the plan's steps, topologically ordered
    gather: tuple[Step, ...] = field(init=False)  # recv tiles -> natural tiles in the destination
    src_ranks: frozenset[int] = field(init=False)
    dst_ranks: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        b = self.boundary
        self.src_ranks, self.dst_ranks = frozenset(self.src_mesh.ranks), frozenset(self.dst_mesh.ranks)
        self.steps = _topological(b.steps, str(b.key))
        self.gather = _gather_steps(self.dst_mesh, self.recv, self.dst_natural, tuple(b.shape),
                                    first_id=1 + max((s.id for s in self.steps), default=-1))
        self._check_regions()
        self._check_forwards()

    @property
    def name(self) -> str:
        return str(self.boundary.key)

    @property
    def send(self) -> ShardingSpec:
        return self.boundary.send

    @property
    def recv(self) -> ShardingSpec:
        return self.boundary.recv

    @property
    def tag_span(self) -> int:
        """Tags one (boundary, microbatch) uses: tag_base .. tag_base + tag_span - 1."""
        return len(self.steps) + len(self.gather)

    def host_of(self, rank: int) -> int:
        mesh = self.src_mesh if rank in self.src_ranks else self.dst_mesh
        return mesh.host_of(rank)

    def step_at(self, index: int) -> Step:
        """A message's step: the plan's steps first, then the gather steps."""
        n = len(self.steps)
        return self.steps[index] if index < n else self.gather[index - n]

    def pairs(self) -> set[tuple[int, int]]:
        """(sender, receiver) of every message of this boundary."""
        return {(s.src, s.dst) for s in (*self.steps, *self.gather)}

    def programs(self) -> dict[int, RankProgram]:
        """Every rank's program (meshjob.program), on plain links as Plan.program orders them."""
        if not hasattr(self, "_programs"):
            plain = dataclasses.replace(self.network, burst_bytes=0.0)
            self._programs = rank_programs(self.steps, self.host_of, plain, ITEMSIZE)
        return self._programs

    def planned_sides(self) -> tuple[Side, ...]:
        """Both ends of every message of the boundary in its planned order (the plan's steps in planned
        start order, as every rank's program has them, then the gather inside the destination): what
        meshjob.host_order merges into each host's link order."""
        if not hasattr(self, "_sides"):
            plain = dataclasses.replace(self.network, burst_bytes=0.0)
            key = planned_keys(self.steps, self.host_of, plain, ITEMSIZE)
            index = {s.id: i for i, s in enumerate(self.steps)}
            ordered = [(index[s.id], s) for s in sorted(self.steps, key=lambda s: key[s.id])]
            ordered += [(len(self.steps) + j, g) for j, g in enumerate(self.gather)]
            self._sides = tuple(side for i, s in ordered for side in
                                ((s.src, i, self.link(s.src, s.dst)), (s.dst, i, self.in_link(s.src, s.dst))))
        return self._sides

    def where(self, rank: int, index: int) -> "Where":
        """Message `index` as `rank` sees it (computed once per rank: the engine asks per message)."""
        cache = self.__dict__.setdefault("_where_cache", {})
        if rank not in cache:
            cache[rank] = {m.index: self._where(rank, m.index) for m in self.message_specs(rank)}
        return cache[rank][index]

    def _where(self, rank: int, index: int) -> "Where":
        step = self.step_at(index)
        if rank in self.src_ranks:
            origin = self.tile_of(rank, self.src_natural, self.src_mesh)  # a source sends from its tile
        elif index < len(self.steps) or step.src == rank:
            origin = self.holding(rank)  # receives land in the recv tile, forwards and gathers read it
        else:
            origin = self.tile_of(rank, self.dst_natural, self.dst_mesh)  # a gather lands in the natural tile
        at = to_index(relative(step.region, origin))
        contiguous = torch.empty(slice_shape(origin), device="meta")[at].is_contiguous()
        return Where(at, slice_shape(step.region), slice_numel(step.region), contiguous, step.scope, step.task,
                     (self.host_of(step.src), self.host_of(step.dst)))

    def contiguous_at(self, rank: int, index: int) -> bool:
        """Whether message `index` is a contiguous view where `rank` holds or receives it (else it is
        staged through a copy)."""
        return self.where(rank, index).contiguous

    def placeholder(self, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What `signal` delivers to a destination rank: zeros of its natural tile's shape (made once)."""
        cache = self.__dict__.setdefault("_placeholder_cache", {})
        key = (rank, dtype, device)
        if key not in cache:
            natural = self.tile_of(rank, self.dst_natural, self.dst_mesh)
            cache[key] = torch.zeros(slice_shape(natural), dtype=dtype, device=device)
        return cache[key]

    def receive_bytes(self, rank: int, dtype: torch.dtype) -> int:
        """The buffers one microbatch's receive allocates on `rank`: its recv tile, its natural tile
        when larger, and a staging buffer per message that cannot land in place."""
        if rank not in self.dst_ranks:
            return 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        recv, natural = self.holding(rank), self.tile_of(rank, self.dst_natural, self.dst_mesh)
        total = slice_numel(recv) + (slice_numel(natural) if natural != recv else 0)
        for spec in self.message_specs(rank):
            if not spec.send and not self.contiguous_at(rank, spec.index):
                total += slice_numel(self.step_at(spec.index).region)
        return total * itemsize

    def link(self, src: int, dst: int) -> Link:
        """The link a message from rank src to rank dst leaves on (meshjob.program.out_link)."""
        return out_link(self.network, self.host_of(src), self.host_of(dst))

    def in_link(self, src: int, dst: int) -> Link:
        """The link a message from rank src to rank dst arrives on (meshjob.program.in_link)."""
        return in_link(self.network, self.host_of(src), self.host_of(dst))

    def message_specs(self, rank: int) -> tuple[MessageSpec, ...]:
        """What `rank` sends and receives for one microbatch: its sends in its program's order (each
        waiting for the receives that bring it the region), its receives in planned start order (those
        from one peer in that peer's send order), then the gather inside the destination mesh."""
        index = {s.id: i for i, s in enumerate(self.steps)}
        programs = self.programs()
        empty = RankProgram(rank, (), (), ())
        mine = programs.get(rank, empty)
        recvs = [MessageSpec(index[s.id], s.id, s.src, False, link) for s, link in zip(mine.recvs, mine.recv_links)]
        own = {m.step for m in recvs}
        sends = [MessageSpec(index[s.id], s.id, s.dst, True, link, tuple(index[d] for d in s.after if d in own))
                 for s, link in zip(mine.sends, mine.send_links)]
        landed = tuple(m.index for m in recvs)  # a gather sends this rank's whole recv tile
        n = len(self.steps)
        gather = [MessageSpec(n + j, g.id, g.dst, True, self.link(rank, g.dst), landed) if g.src == rank
                  else MessageSpec(n + j, g.id, g.src, False, self.in_link(g.src, rank))
                  for j, g in enumerate(self.gather) if rank in (g.src, g.dst)]
        return tuple(sends + recvs + gather)

    def tile_of(self, rank: int, spec: ShardingSpec, mesh: Mesh) -> Slice:
        return tile(spec, mesh.shape, tuple(self.boundary.shape), mesh.index_of(rank))

    def holding(self, rank: int) -> Slice:
        """Where `rank` reads regions it sends: its send tile (source) or its recv tile (destination)."""
        if rank in self.src_ranks:
            return self.tile_of(rank, self.send, self.src_mesh)
        return self.tile_of(rank, self.recv, self.dst_mesh)

    def _check_regions(self) -> None:
        ranks = set(self.src_mesh.ranks) | set(self.dst_mesh.ranks)
        for r in self.src_mesh.ranks:
            natural = self.tile_of(r, self.src_natural, self.src_mesh)
            if not contains(natural, self.holding(r)):
                raise ReshardError(f"boundary {self.name}: send layout {self.send} must shard at least as much "
                                   f"as the source's natural layout {self.src_natural} (rank {r})")
        for s in self.steps:
            if s.src not in ranks or s.dst not in self.dst_ranks:
                raise ReshardError(f"boundary {self.name}: step {s.id} sends {s.src} -> {s.dst}, but the "
                                   f"destination must be in the destination mesh {self.dst_mesh.ranks} and the "
                                   f"source in either mesh")
            if not contains(self.holding(s.src), s.region):
                raise ReshardError(f"boundary {self.name}: step {s.id} has rank {s.src} send region {s.region}, "
                                   f"outside what it holds {self.holding(s.src)}")
            if not contains(self.holding(s.dst), s.region):
                raise ReshardError(f"boundary {self.name}: step {s.id} delivers region {s.region} to rank "
                                   f"{s.dst}, outside its recv tile {self.holding(s.dst)}")

    def _check_forwards(self) -> None:
        """A rank may only pass on what its `after` steps brought it: else it would send zeros."""
        by_id = {s.id: s for s in self.steps}
        for s in self.steps:
            if s.src in self.src_ranks:
                continue
            deps = [by_id[d] for d in s.after if by_id[d].dst == s.src]
            if any(contains(d.region, s.region) for d in deps):
                continue
            mask = torch.zeros(slice_shape(s.region), dtype=torch.bool)
            for d in deps:
                part = intersect(d.region, s.region)
                if part is not None:
                    mask[to_index(relative(part, s.region))] = True
            if not bool(mask.all()):
                raise ReshardError(f"boundary {self.name}: step {s.id} has rank {s.src} forward region {s.region} "
                                   f"before receiving all of it (it waits only for steps {list(s.after)})")

    def check_coverage(self, rank: int) -> None:
        """Signal-free plans must deliver every element of a receiver's recv tile."""
        if rank not in self.dst_ranks or any(s.signal for s in self.steps):
            return
        own = self.holding(rank)
        mask = torch.zeros(slice_shape(own), dtype=torch.bool)
        for s in self.steps:
            if s.dst == rank:
                mask[to_index(relative(s.region, own))] = True
        if not bool(mask.all()):
            missing = int((~mask).sum())
            raise ReshardError(f"boundary {self.name}: rank {rank} would never receive {missing} of the "
                               f"{mask.numel()} elements of its recv tile {own}")


def _topological(steps: Iterable[Step], name: str) -> tuple[Step, ...]:
    """The plan's order, moved only where a step would come before one it depends on."""
    steps = list(steps)
    by_id = {s.id: s for s in steps}
    for s in steps:
        for d in s.after:
            if d not in by_id:
                raise ReshardError(f"boundary {name}: step {s.id} depends on unknown step {d}")
    done: set[int] = set()
    out: list[Step] = []
    visiting: set[int] = set()

    def visit(s: Step) -> None:
        if s.id in done:
            return
        if s.id in visiting:
            raise ReshardError(f"boundary {name}: steps depend on each other in a cycle through step {s.id}")
        visiting.add(s.id)
        for d in s.after:
            visit(by_id[d])
        visiting.discard(s.id)
        done.add(s.id)
        out.append(s)

    for s in steps:
        visit(s)
    return tuple(out)


def _gather_steps(mesh: Mesh, recv: ShardingSpec, natural: ShardingSpec, shape: tuple[int, ...],
                  first_id: int) -> tuple[Step, ...]:
    """Point-to-point fetches turning recv tiles into natural tiles inside the destination mesh.

    recv is at least as sharded as natural, so a natural tile is a union of whole, disjoint recv
    tiles; each missing one comes from a holder on the same host when there is one, spread over
    the holders by the fetching rank's position so no holder serves everyone."""
    if str(recv) == str(natural):
        return ()
    recv_tile = {r: tile(recv, mesh.shape, shape, mesh.index_of(r)) for r in mesh.ranks}
    holders: dict[Slice, list[int]] = {}
    for r in mesh.ranks:
        holders.setdefault(recv_tile[r], []).append(r)
    out: list[Step] = []
    for pos, r in enumerate(mesh.ranks):
        nat = tile(natural, mesh.shape, shape, mesh.index_of(r))
        for t, owners in holders.items():
            if t == recv_tile[r] or not contains(nat, t):
                continue
            near = [q for q in owners if mesh.host_of(q) == mesh.host_of(r)] or owners
            q = near[pos % len(near)]
            scope = INTRA_HOST if mesh.host_of(q) == mesh.host_of(r) else CROSS_HOST
            out.append(Step(id=first_id + len(out), task=GATHER_TASK, src=q, dst=r, region=t, after=(), scope=scope))
    return tuple(out)


@dataclass(frozen=True)
class Where:
    """One message as one rank sees it: where its region lies in the tile the rank reads or fills."""

    index: tuple[slice, ...]  # into that tile
    shape: tuple[int, ...]
    numel: int
    contiguous: bool  # else it is staged through a copy
    scope: str
    task: int
    hosts: tuple[int, int]  # (sending host, receiving host)


@dataclass
class ReshardStats:
    """What one rank saw of one (boundary, microbatch)."""

    strategy: str
    boundary: BoundaryKey
    seconds: float = 0.0  # from start() until every message of this rank is done
    bytes_received: dict[str, int] = field(default_factory=dict)  # scope -> bytes
    bytes_sent: dict[str, int] = field(default_factory=dict)  # scope -> bytes
    host_pair_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (src host, dst host) -> sent
    task_seconds: dict[int, float] = field(default_factory=dict)  # task -> until this rank's last step of it
    task_bytes: dict[int, int] = field(default_factory=dict)  # task -> bytes this rank received of it


def _add(table: dict[Any, int], key: Any, nbytes: int) -> None:
    table[key] = table.get(key, 0) + nbytes


class _Transfer(Job):
    """One (boundary, microbatch) on one rank: the data behind its messages (meshjob_trainer.engine_job.Job)."""

    def __init__(self, route: Route, rank: int, mb: int, specs: Sequence[MessageSpec], tag_base: int,
                 natural_local: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 events: MetricsSink | None, host: str) -> None:
        super().__init__(route.boundary.key, mb, specs, tag_base)
        self.route, self.rank, self.events, self.host = route, rank, events, host
        b = route.boundary
        self.signal = b.strategy == "signal" or any(s.signal for s in route.steps)
        self.is_dst = rank in route.dst_ranks
        self.dtype, self.device = dtype, device
        self.stats = ReshardStats(strategy=b.strategy, boundary=b.key)
        self.source: torch.Tensor | None = None  # the natural tile sends read from (sources)
        self.source_tile: Slice | None = None
        if rank in route.src_ranks:
            self.source_tile = route.tile_of(rank, route.src_natural, route.src_mesh)
            want = slice_shape(self.source_tile)
            if natural_local is None or tuple(natural_local.shape) != want:
                got = None if natural_local is None else tuple(natural_local.shape)
                raise ReshardError(f"boundary {route.name}: rank {rank} must pass its natural-layout "
                                   f"({route.src_natural}) tile of shape {want}, got {got}")
            self.source = natural_local.detach()  # data only; on its own device: no staging
            self.dtype = natural_local.dtype
        self.recv_tile = route.holding(rank) if self.is_dst else None
        self.natural_tile = route.tile_of(rank, route.dst_natural, route.dst_mesh) if self.is_dst else None
        self.buffer: torch.Tensor | None = None  # the recv tile: receives land in it, forwards read it
        self.out: torch.Tensor | None = None  # the natural tile, when it is larger (gathers land in it)
        self.temps: dict[int, torch.Tensor] = {}  # message index -> where its staging buffer goes on landing
        self.staged: dict[int, int] = {}  # message index -> bytes of a send's staging copy

    # -- buffers -------------------------------------------------------------------------------
    def _empty(self, shape: Sequence[int], result: bool = False) -> torch.Tensor:
        return self.hold(torch.empty(tuple(shape), dtype=self.dtype, device=self.device), result)

    def _recv_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            assert self.recv_tile is not None
            self.buffer = self._empty(slice_shape(self.recv_tile), result=True)
        return self.buffer

    def _natural(self) -> torch.Tensor:
        if self.out is None:
            assert self.natural_tile is not None
            self.out = self._recv_buffer() if self.natural_tile == self.recv_tile else \
                self._empty(slice_shape(self.natural_tile), result=True)
        return self.out

    def _signal(self) -> torch.Tensor:
        return torch.ones(SIGNAL_BYTES, dtype=torch.uint8, device=self.device)

    # -- the engine's calls ----------------------------------------------------------------------
    def nbytes(self, spec: MessageSpec) -> int:
        if self.signal:
            return SIGNAL_BYTES
        return self.route.where(self.rank, spec.index).numel * self.dtype.itemsize

    def payload(self, spec: MessageSpec) -> torch.Tensor:
        if self.signal:
            return self._signal()
        where = self.route.where(self.rank, spec.index)
        view = (self.source if self.source is not None else self._recv_buffer())[where.index]
        if where.contiguous:
            return view
        copy = self.hold(view.contiguous())  # released when sent
        self.staged[spec.index] = copy.numel() * copy.element_size()
        return copy

    def target(self, spec: MessageSpec) -> torch.Tensor:
        if self.signal:
            return torch.empty(SIGNAL_BYTES, dtype=torch.uint8, device=self.device)
        where = self.route.where(self.rank, spec.index)
        view = (self._recv_buffer() if spec.index < len(self.route.steps) else self._natural())[where.index]
        if where.contiguous:
            return view
        self.temps[spec.index] = view
        return self._empty(where.shape)

    def landed(self, spec: MessageSpec, tensor: torch.Tensor) -> None:
        place = self.temps.pop(spec.index, None)
        if place is not None:
            place.copy_(tensor)
            self.release(tensor)
        where = self.route.where(self.rank, spec.index)
        nbytes = SIGNAL_BYTES if self.signal else where.numel * tensor.element_size()
        _add(self.stats.bytes_received, where.scope, nbytes)
        if where.task != GATHER_TASK:
            _add(self.stats.task_bytes, where.task, nbytes)
            self.stats.task_seconds[where.task] = self.elapsed()

    def sent(self, spec: MessageSpec, tensor: torch.Tensor) -> None:
        if spec.index in self.staged:
            self.release(tensor)
            del self.staged[spec.index]
        where = self.route.where(self.rank, spec.index)
        nbytes = SIGNAL_BYTES if self.signal else where.numel * tensor.element_size()
        _add(self.stats.bytes_sent, where.scope, nbytes)
        _add(self.stats.host_pair_bytes, where.hosts, nbytes)
        if where.task != GATHER_TASK:
            self.stats.task_seconds[where.task] = self.elapsed()

    def assemble(self) -> torch.Tensor | None:
        if not self.is_dst:
            return None
        assert self.natural_tile is not None and self.recv_tile is not None
        if self.signal:  # a placeholder of the right shape, shared: signal moves no data
            return self.route.placeholder(self.rank, self.dtype, self.device)
        out = self._natural()
        if out is not self.buffer:
            out[to_index(relative(self.recv_tile, self.natural_tile))] = self._recv_buffer()
        return out

    def finished(self, seconds: float) -> None:
        self.stats.seconds = seconds
        self._record()

    def retire(self) -> None:
        super().retire()
        self.source = self.buffer = self.out = None  # the result lives on in the handle, for the compute
        self.temps.clear()

    def _record(self) -> None:
        """Receivers: bytes and time per scope, time over the plan's lower bound, and the achieved
        NIC rate of their host (cross-host bytes over the resharding's wall time). Chosen senders:
        one unit task each (so the sum over ranks counts every task once)."""
        if self.events is None:
            return
        b, stats = self.route.boundary, self.stats
        if self.is_dst:
            for scope, nbytes in stats.bytes_received.items():
                self.events.emit(Resharded(b.key, stats.strategy, scope, nbytes, stats.seconds))
            cross = stats.bytes_received.get(CROSS_HOST, 0)
            if cross and stats.seconds > 0 and not self.signal:  # signal bytes say nothing of the NIC
                self.events.emit(NicBandwidth(self.host, cross / stats.seconds))
            if b.lower_bound_s > 0:
                self.events.emit(LowerBoundRatio(b.key, stats.seconds / b.lower_bound_s))
        else:
            first_hops = {s.task for s in self.route.steps if s.src == self.rank}
            if first_hops:
                self.events.emit(UnitTasks(b.balancer, len(first_hops)))


class ReshardExecutor:
    """Runs the plan's boundaries on one rank, through the rank's communication engine.

    Built from a Plan: every boundary, the step's transfer order (`order="plan"`: meshjob.comm_order;
    start() must then be called for every transfer of each step, as the pipeline does), how many
    receives this rank's stage keeps posted per boundary (`recv_depth`) and the plan's network model.
    With `order=None`, or built from explicit routes (tests and benchmarks that make boundaries
    without a whole job), transfers go in the order start() is called, which must then be the same
    on every rank. Events
    (bytes, times, NIC rate of `host`, unit tasks) go to `events`; `host` defaults to the plan's name
    of the rank's host, or "host-<index>" with explicit routes. `wire`: default gloo on the CPU, NCCL
    on CUDA (meshjob_trainer.wire.wire_for). Call close() before leaving the process group.

    With an order, the ranks of a host also take their turns on the host's shared NIC links as the
    plan orders them (meshjob_trainer.board): `board` True / False, or None: when torch.distributed is
    up (the ranks of a host meet in its store; every rank of the job then builds its executors, and
    switches orders, in the same sequence). `board_timeout_s`: the longest wait for a turn."""

    def __init__(self, plan: Any, rank: int, events: MetricsSink | None = None, *,
                 routes: Sequence[Route] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, host: str = "", wire: Wire | None = None,
                 order: TransferOrder | str | None = "plan", in_flight_per_link: int | None = None,
                 board: bool | None = None, board_timeout_s: float = 300.0,
                 small_in_flight_per_link: int | None = None) -> None:
        self.rank, self.events, self.dtype = rank, events, dtype
        self.device = torch.device(device or "cpu")
        self.recv_depth: dict[BoundaryKey, int] = {}
        network = routes[0].network if routes else NetworkModel()
        if routes is None:
            if plan is None:
                raise ReshardError("ReshardExecutor needs a plan or explicit routes")
            routes = routes_from_plan(plan)
            host = host or plan.placement.hosts[plan.placement.host_of(rank)].name
            network = plan.network
            if order == "plan":
                order = plan.transfer_order  # computed once per plan (meshjob.plan)
            if order is not None:
                self.recv_depth = recv_depths(plan.schedules, order).get(plan.placement.stage_of(rank), {})
        order = None if order == "plan" else order  # explicit routes: no plan to take an order from
        assert order is None or isinstance(order, TransferOrder)
        self.order = order
        self.routes: dict[BoundaryKey, Route] = {}
        for r in routes:
            if r.boundary.key in self.routes:  # start() finds a boundary by its key
                raise ReshardError(f"two boundaries share the key {r.name}; give each its own tensor name")
            self.routes[r.boundary.key] = r
        self.max_tag_span = max((r.tag_span for r in self.routes.values()), default=0)
        self._order = {k: i for i, k in enumerate(self.routes)}
        for r in self.routes.values():
            r.check_coverage(rank)
        mine = [r for r in self.routes.values() if rank in r.src_ranks or rank in r.dst_ranks]
        self.host = host or (f"host-{mine[0].host_of(rank)}" if mine else "")
        self.specs = {k: r.message_specs(rank) for k, r in self.routes.items()}
        self.in_flight_per_link = in_flight_per_link or network.in_flight_per_link
        self.small_in_flight_per_link = max(self.in_flight_per_link, small_in_flight_per_link
                                            or network.small_in_flight_per_link)
        pairs = set().union(*(r.pairs() for r in self.routes.values()))
        self.wire = wire or wire_for(self.device, rank, pairs, local_peers=local_peers(self.routes.values(), rank))
        self.network = network
        self.board_timeout_s = board_timeout_s
        use_board = order is not None and (_dist_up() if board is None else board)
        self.engine = CommEngine(rank, self.wire, self.specs, self.in_flight_per_link, order,
                                 self._board_for if use_board else None, overlap_bytes(network),
                                 network.nic_bytes_per_s, HANDOVER_LEAD_S, self.small_in_flight_per_link)

    def host_link_orders(self, order: TransferOrder) -> dict[int, HostLinkOrder]:
        """Every host's shared NIC links in the plan's order for one pass of `order` (meshjob.host_order)."""
        sides = {k: r.planned_sides() for k, r in self.routes.items()}
        return host_link_orders(order.transfers, sides)

    def _board_for(self, order: TransferOrder, wake: Any) -> Any:
        """This rank's host board for `order`, or None when it shares no NIC link on its host. Every rank
        calls it at the same points (the serial number names the board in the store)."""
        from meshjob_trainer.board import HostBoard

        serial = next(_BOARDS)
        host = next((r.host_of(self.rank) for r in self.routes.values()
                     if self.rank in r.src_ranks or self.rank in r.dst_ranks), None)
        mine = self.host_link_orders(order).get(host) if host is not None else None
        if mine is None or self.rank not in mine.ranks:
            return None
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        return HostBoard(mine, self.rank, self.in_flight_per_link, overlap_bytes(self.network), store,
                         f"meshjob/board/{serial}/h{host}", wake, self.board_timeout_s,
                         nic_bytes_per_s=self.network.nic_bytes_per_s, lead_s=HANDOVER_LEAD_S,
                         small_window=self.small_in_flight_per_link)

    def route(self, key: BoundaryKey) -> Route:
        try:
            return self.routes[key]
        except KeyError:
            raise ReshardError(f"boundary {key} is not in this plan; "
                               f"known: {', '.join(map(str, self.routes))}") from None

    def tag_base(self, key: BoundaryKey, microbatch: int) -> int:
        """Tags that cannot collide between boundaries and microbatches of one training step."""
        slot = microbatch * len(self.routes) + self._order[self.route(key).boundary.key]
        return slot * self.max_tag_span

    def start(self, key: BoundaryKey, microbatch: int, natural_local: torch.Tensor | None) -> Handle:
        """Begin resharding boundary `key` for one microbatch; returns at once (the engine runs it).
        Sources pass their natural-layout tile; destinations pass None (or anything: it is ignored)."""
        route = self.route(key)
        if self.rank not in route.src_ranks and self.rank not in route.dst_ranks:
            idle = Job(key, microbatch, (), 0)
            idle.handle._set_done()
            return idle.handle
        if self.rank in route.dst_ranks:
            natural_local = None
        job = _Transfer(route, self.rank, microbatch, self.specs[key], self.tag_base(key, microbatch), natural_local,
                        self.dtype, self.device, self.events, self.host)
        return self.engine.submit(job)

    def memory_bound_bytes(self) -> int:
        """The most payload memory the engine can hold when the stage keeps `recv_depth` receives posted
        per boundary: that many receiving jobs' buffers, plus a staging copy per send in flight (on a NIC
        link, small ones packed beyond the window hold overlap_bytes at most together)."""
        total = 0
        for key, depth in self.recv_depth.items():
            total += depth * self.routes[key].receive_bytes(self.rank, self.dtype)
        largest: dict[Link, int] = {}
        for key, specs in self.specs.items():
            route = self.routes[key]
            for spec in specs:
                if spec.send and not route.contiguous_at(self.rank, spec.index):
                    nbytes = route.step_at(spec.index).nbytes(_itemsize(self.dtype))
                    largest[spec.link] = max(largest.get(spec.link, 0), nbytes)
        packed = overlap_bytes(self.network) if self.small_in_flight_per_link > self.in_flight_per_link else 0
        return total + sum(self.in_flight_per_link * nbytes + (packed if link[1] != "local" else 0)
                           for link, nbytes in largest.items() if link is not None)

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """A pass of forward transfers only (evaluation) inside: the step's order less its gradients,
        which every rank derives alike; the step's order again after."""
        if self.order is None:
            yield
            return
        self.engine.use_order(self.order.forward_only())
        try:
            yield
        finally:
            self.engine.use_order(self.order)

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the transfers under way finish (a chain's last forwards), then stop the engine."""
        self.engine.close(timeout_s)


def _dist_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def local_peers(routes: Iterable[Route], rank: int) -> set[int]:
    """The ranks on `rank`'s host that it exchanges messages with."""
    out: set[int] = set()
    for r in routes:
        for a, b in r.pairs():
            if rank in (a, b):
                peer = b if a == rank else a
                if r.host_of(peer) == r.host_of(rank):
                    out.add(peer)
    return out


def routes_from_plan(plan: Any) -> list[Route]:
    from meshjob.spec import natural_layout

    naturals: dict[int, ShardingSpec] = {}
    routes = []
    for b in plan.boundaries:
        for stage in (b.src, b.dst):
            if stage not in naturals:
                naturals[stage] = ShardingSpec.parse(natural_layout(plan.job.stages[stage]), len(b.shape))
        routes.append(Route(b, plan.mesh(b.src), plan.mesh(b.dst), naturals[b.src], naturals[b.dst], plan.network))
    return routes


def make_routes(boundaries: Sequence[Boundary], meshes: Mapping[int, Mesh],
                naturals: Mapping[int, ShardingSpec | str], network: NetworkModel | None = None) -> list[Route]:
    """Routes from explicit pieces: stage -> mesh and stage -> natural layout (and the network model
    the senders' programs are ordered on; default: the standard one)."""
    return [Route(b, meshes[b.src], meshes[b.dst], _spec(naturals[b.src], len(b.shape)),
                  _spec(naturals[b.dst], len(b.shape)), network or NetworkModel()) for b in boundaries]
