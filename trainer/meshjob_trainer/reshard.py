"""The resharding executor: moves one tensor across a plan boundary for one microbatch.

Every rank of both stages of a boundary calls start() for the same (boundary, microbatch).
1. The source side holds its natural-layout tile; the plan's steps name regions in global
   coordinates inside the send layout, so a source slices them out of that tile (free).
2. The plan's lowered Steps run as point-to-point isend/irecv on the default group. All irecvs
   are posted up front (gloo sends only once the receiver is ready); a rank forwards a region as
   soon as the steps it depends on (`after`) have completed. Chunked broadcast thus becomes a
   pipelined chain, and ring all-gathers become forwards of the parts a rank received.
3. Receivers assemble their recv-layout tile. When the recv layout shards more than the
   destination's natural layout, each rank then fetches the missing recv tiles from peers of its
   own mesh (same host first), which is the all-gather inside the destination mesh.

Asynchrony: each start() gets one background thread that posts the receives, walks this rank's
sends in plan order and assembles the result; wait() joins it. A thread, not progress-on-wait,
because a forwarding rank in a broadcast chain must pass chunks on while its pipeline stage is
busy computing: with progress-on-wait the whole chain would stall behind that computation.
Sends are walked in the plan's order, which is a topological order of the steps (each `after`
names an earlier step); every rank following it cannot deadlock: the earliest unposted send
always has its inputs posted.

Backends: every payload is a CPU tensor, so resharding always runs on gloo. On CUDA the default
group is torch's combined "cpu:gloo,cuda:nccl" (meshjob_trainer.dist.backend_for_device): gloo
matches point-to-point ops by (peer, tag) from any thread, so concurrent handle threads are safe,
whereas NCCL requires every rank to issue a communicator's operations in one order, which those
threads do not guarantee; and gloo has no CUDA point-to-point. Hence a source copies its tile to
the CPU once, receives land in CPU buffers, forwards read from them, and only the assembled tile
moves to the context's device. The stage-internal collectives (TP all-reduce, DP gradient reduce)
keep CUDA tensors on NCCL: the training thread issues them in program order on every rank.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshjob.boundary import BoundaryKey
from meshjob.mesh import Mesh
from meshjob.plan import Boundary
from meshjob.resharding import CROSS_HOST, INTRA_HOST, Step
from meshjob.sharding import ShardingSpec, Slice, contains, intersect, relative, slice_numel, slice_shape, tile, to_index
from meshjob_trainer.events import LowerBoundRatio, MetricsSink, NicBandwidth, Resharded, UnitTasks

SIGNAL_BYTES = 1
STAGING = torch.device("cpu")  # where every payload lives: gloo carries it (see the module docstring)


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


@dataclass
class ReshardStats:
    """What one rank saw of one (boundary, microbatch)."""

    strategy: str
    boundary: BoundaryKey
    seconds: float = 0.0
    bytes_received: dict[str, int] = field(default_factory=dict)  # scope -> bytes
    bytes_sent: dict[str, int] = field(default_factory=dict)  # scope -> bytes
    host_pair_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (src host, dst host) -> sent
    task_seconds: dict[int, float] = field(default_factory=dict)  # task -> until this rank's last step of it
    task_bytes: dict[int, int] = field(default_factory=dict)  # task -> bytes this rank received of it


class Handle:
    """One running resharding on one rank. wait() -> destination natural-layout local tensor, or
    None on a rank that only sends. `delivered` is False for `signal` (zeros come back)."""

    def __init__(self, run: "_Run | None") -> None:
        self._run = run
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if run is not None:
            self._thread = threading.Thread(target=self._main, name=f"reshard {run.route.name}", daemon=True)
            self._thread.start()

    def _main(self) -> None:
        assert self._run is not None
        try:
            self._result = self._run.execute()
        except BaseException as err:  # noqa: BLE001 - re-raised in wait()
            self._error = err

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"resharding {self._run.route.name if self._run else ''} still running after "
                                   f"{timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def stats(self) -> ReshardStats | None:
        return None if self._run is None else self._run.stats

    @property
    def delivered(self) -> bool:
        return self._run is None or not self._run.signal


class _Run:
    """The state of one (boundary, microbatch) on one rank; execute() runs on the handle's thread."""

    def __init__(self, route: Route, rank: int, natural_local: torch.Tensor | None, tag_base: int,
                 dtype: torch.dtype, device: torch.device, events: MetricsSink | None, host: str) -> None:
        self.route, self.rank, self.tag_base = route, rank, tag_base
        self.events, self.host = events, host  # where this rank's resharding events go; its host's name
        b = route.boundary
        self.signal = b.strategy == "signal" or any(s.signal for s in route.steps)
        self.is_dst = rank in route.dst_ranks
        self.dtype, self.device = dtype, device  # device: where the assembled result goes
        self.itemsize = torch.tensor([], dtype=dtype).element_size()
        self.stats = ReshardStats(strategy=b.strategy, boundary=b.key)
        self.source: torch.Tensor | None = None  # the natural tile, detached; staged to CPU in execute()
        self.natural_local: torch.Tensor | None = None  # its CPU copy, which sends slice from
        self.natural_tile: Slice | None = None
        if rank in route.src_ranks:
            self.natural_tile = route.tile_of(rank, route.src_natural, route.src_mesh)
            want = slice_shape(self.natural_tile)
            if natural_local is None or tuple(natural_local.shape) != want:
                got = None if natural_local is None else tuple(natural_local.shape)
                raise ReshardError(f"boundary {route.name}: rank {rank} must pass its natural-layout "
                                   f"({route.src_natural}) tile of shape {want}, got {got}")
            self.source = natural_local.detach()  # data only
            self.dtype = natural_local.dtype
            self.itemsize = natural_local.element_size()
        self.recv_tile = route.holding(rank) if self.is_dst else None
        self.buffer: torch.Tensor | None = None  # the recv tile, on the CPU: forwards send from it
        if self.recv_tile is not None:
            self.buffer = torch.zeros(slice_shape(self.recv_tile), dtype=self.dtype, device=STAGING)

    # -- data in and out -------------------------------------------------------------------
    def _payload(self, region: Slice, signal: bool) -> torch.Tensor:
        if signal:
            return torch.ones(SIGNAL_BYTES, dtype=torch.uint8, device=STAGING)
        if self.natural_tile is not None:
            assert self.natural_local is not None
            return self.natural_local[to_index(relative(region, self.natural_tile))].contiguous()
        assert self.buffer is not None and self.recv_tile is not None
        return self.buffer[to_index(relative(region, self.recv_tile))].contiguous()

    def _empty(self, region: Slice, signal: bool) -> torch.Tensor:
        if signal:
            return torch.empty(SIGNAL_BYTES, dtype=torch.uint8, device=STAGING)
        return torch.empty(slice_shape(region), dtype=self.dtype, device=STAGING)

    def _nbytes(self, region: Slice, signal: bool) -> int:
        return SIGNAL_BYTES if signal else slice_numel(region) * self.itemsize

    # -- the run ---------------------------------------------------------------------------
    def execute(self) -> torch.Tensor | None:
        t0 = time.perf_counter()
        route, rank = self.route, self.rank
        if self.source is not None:  # one device-to-host copy of the whole tile, on this thread (the
            # default stream orders it after the kernels that produced the tile)
            self.natural_local = self.source.to(STAGING)
        steps = list(route.steps)
        n = len(steps)
        recvs: dict[int, tuple[Any, torch.Tensor, Step]] = {}  # step id -> (work, tensor, step)
        for i, s in enumerate(steps):
            if s.dst == rank:
                buf = self._empty(s.region, self.signal)
                recvs[s.id] = (dist.irecv(buf, s.src, tag=self.tag_base + i), buf, s)
        gather_recvs: list[tuple[Any, torch.Tensor, Step]] = []
        for j, g in enumerate(route.gather):
            if g.dst == rank:
                buf = self._empty(g.region, self.signal)
                gather_recvs.append((dist.irecv(buf, g.src, tag=self.tag_base + n + j), buf, g))
        landed: set[int] = set()
        sends: list[Any] = []

        def land(step_id: int) -> None:
            if step_id in landed:
                return
            work, buf, s = recvs[step_id]
            work.wait()
            if not self.signal:
                assert self.buffer is not None and self.recv_tile is not None
                self.buffer[to_index(relative(s.region, self.recv_tile))] = buf
            nbytes = self._nbytes(s.region, self.signal)
            self.stats.bytes_received[s.scope] = self.stats.bytes_received.get(s.scope, 0) + nbytes
            self.stats.task_bytes[s.task] = self.stats.task_bytes.get(s.task, 0) + nbytes
            self.stats.task_seconds[s.task] = time.perf_counter() - t0
            landed.add(step_id)

        for i, s in enumerate(steps):
            if s.src != rank:
                continue
            for d in s.after:
                if d in recvs:
                    land(d)
            payload = self._payload(s.region, self.signal)
            sends.append((dist.isend(payload, s.dst, tag=self.tag_base + i), payload, s))
        for step_id in recvs:
            land(step_id)
        for work, _payload, s in sends:
            work.wait()
            nbytes = self._nbytes(s.region, self.signal)
            self.stats.bytes_sent[s.scope] = self.stats.bytes_sent.get(s.scope, 0) + nbytes
            pair = (route.host_of(s.src), route.host_of(s.dst))
            self.stats.host_pair_bytes[pair] = self.stats.host_pair_bytes.get(pair, 0) + nbytes
            self.stats.task_seconds[s.task] = time.perf_counter() - t0
        result = self._gather(gather_recvs, n)
        self.stats.seconds = time.perf_counter() - t0
        self._record()
        return result

    def _gather(self, gather_recvs: list[tuple[Any, torch.Tensor, Step]], n: int) -> torch.Tensor | None:
        """recv tile -> natural tile: serve peers from our recv tile, place what peers send us."""
        route, rank = self.route, self.rank
        sends = []
        for j, g in enumerate(route.gather):
            if g.src == rank:
                payload = self._payload(g.region, self.signal)
                sends.append(dist.isend(payload, g.dst, tag=self.tag_base + n + j))
        if not self.is_dst:
            return None
        assert self.buffer is not None and self.recv_tile is not None
        natural_tile = route.tile_of(rank, route.dst_natural, route.dst_mesh)
        if natural_tile == self.recv_tile:
            out = self.buffer
        else:
            out = torch.zeros(slice_shape(natural_tile), dtype=self.dtype, device=STAGING)
            out[to_index(relative(self.recv_tile, natural_tile))] = self.buffer
        for work, buf, g in gather_recvs:
            work.wait()
            if not self.signal:
                out[to_index(relative(g.region, natural_tile))] = buf
            nbytes = self._nbytes(g.region, self.signal)
            self.stats.bytes_received[g.scope] = self.stats.bytes_received.get(g.scope, 0) + nbytes
        for work in sends:
            work.wait()
        return out.to(self.device)

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
    """Runs the plan's boundaries on one rank. Build it from a Plan, or from explicit routes
    (tests and benchmarks that make boundaries without a whole job). Its events (bytes, times, NIC
    rate of `host`, unit tasks) go to `events`; `host` defaults to the plan's name of the rank's host,
    or "host-<index>" with explicit routes."""

    def __init__(self, plan: Any, rank: int, events: MetricsSink | None = None, *,
                 routes: Sequence[Route] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, host: str = "") -> None:
        self.rank, self.events, self.dtype = rank, events, dtype
        self.device = torch.device(device or "cpu")
        if routes is None:
            if plan is None:
                raise ReshardError("ReshardExecutor needs a plan or explicit routes")
            routes = routes_from_plan(plan)
            host = host or plan.placement.hosts[plan.placement.host_of(rank)].name
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
        """Begin resharding boundary `key` for one microbatch; returns at once (a background thread runs it).
        Sources pass their natural-layout tile; destinations pass None (or anything: it is ignored)."""
        route = self.route(key)
        if self.rank not in route.src_ranks and self.rank not in route.dst_ranks:
            return Handle(None)
        if self.rank in route.dst_ranks:
            natural_local = None
        return Handle(_Run(route, self.rank, natural_local, self.tag_base(key, microbatch), self.dtype, self.device,
                           self.events, self.host))


def routes_from_plan(plan: Any) -> list[Route]:
    from meshjob.spec import natural_layout

    naturals: dict[int, ShardingSpec] = {}
    routes = []
    for b in plan.boundaries:
        for stage in (b.src, b.dst):
            if stage not in naturals:
                naturals[stage] = ShardingSpec.parse(natural_layout(plan.job.stages[stage]), len(b.shape))
        routes.append(Route(b, plan.mesh(b.src), plan.mesh(b.dst), naturals[b.src], naturals[b.dst]))
    return routes


def make_routes(boundaries: Sequence[Boundary], meshes: Mapping[int, Mesh],
                naturals: Mapping[int, ShardingSpec | str]) -> list[Route]:
    """Routes from explicit pieces: stage -> mesh and stage -> natural layout."""
    return [Route(b, meshes[b.src], meshes[b.dst], _spec(naturals[b.src], len(b.shape)),
                  _spec(naturals[b.dst], len(b.shape))) for b in boundaries]
