"""The resharding executor: moves one tensor across a plan boundary for one microbatch.

Every rank of both stages of a boundary calls start() for the same (boundary, microbatch).
1. The source side holds its natural-layout tile; the plan's steps name regions in global
   coordinates inside the send layout, so a source sends views of that tile (copied only where a
   region is not contiguous).
2. The plan's lowered Steps are point-to-point messages, issued by the rank's one communication
   engine (meshjob_trainer.engine) on its wire (meshjob_trainer.wire: gloo for CPU tensors, NCCL
   device to device for CUDA ones): receives posted as soon as the transfer starts, sends in the
   sender's program order (meshjob.plan.program) with a bounded number in flight per link, a region
   forwarded as soon as the steps it depends on (`after`) have landed. Chunked broadcast thus
   becomes a pipelined chain, and ring all-gathers become forwards of the parts a rank received.
   With a plan, transfers follow the step's order (meshjob.plan.comm_order), which every rank derives.
3. Receivers assemble their recv-layout tile, receiving straight into it where a region is
   contiguous. When the recv layout shards more than the destination's natural layout, each rank
   then fetches the missing recv tiles from peers of its own mesh (same host first), which is the
   all-gather inside the destination mesh.

start() returns at once: the engine's thread moves the data while the stage computes, so a
forwarding rank in a broadcast chain passes chunks on while its pipeline stage is busy. What each rank
sends and receives for a boundary, and where in its tiles, is the boundary's Route (meshjob_trainer.route).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from meshjob.layout.sharding import Slice, relative, slice_shape, to_index
from meshjob.network.host_task import Link
from meshjob.network.model import HANDOVER_LEAD_S, NetworkModel, overlap_bytes
from meshjob.plan.build import Plan
from meshjob.plan.comm_order import TransferOrder, recv_depths
from meshjob.plan.host_order import HostLinkOrder, host_link_orders
from meshjob.resharding.tasks import CROSS_HOST
from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.board import HostBoard
from meshjob_trainer.engine import CommEngine
from meshjob_trainer.engine_job import Handle, Job, MessageSpec
from meshjob_trainer.events import LowerBoundRatio, MetricsSink, NicBandwidth, Resharded, UnitTasks
from meshjob_trainer.route import GATHER_TASK, ReshardError, Route, local_peers, one_feeder_pairs, routes_from_plan
from meshjob_trainer.wire import Wire, close_wire, wire_for

SIGNAL_BYTES = 1
K = TypeVar("K")
_BOARDS = itertools.count()  # boards built by this process: every rank of a host counts them alike


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


def _add(table: dict[K, int], key: K, nbytes: int) -> None:
    table[key] = table.get(key, 0) + nbytes


class _Transfer(Job):
    """One (boundary, microbatch) on one rank: the data behind its messages (meshjob_trainer.engine_job.Job)."""

    def __init__(
        self,
        route: Route,
        rank: int,
        mb: int,
        specs: Sequence[MessageSpec],
        tag_base: int,
        natural_local: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        events: MetricsSink | None,
        host: str,
    ) -> None:
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
                raise ReshardError(
                    f"boundary {route.name}: rank {rank} must pass its natural-layout "
                    f"({route.src_natural}) tile of shape {want}, got {got}"
                )
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
            self.out = (
                self._recv_buffer()
                if self.natural_tile == self.recv_tile
                else self._empty(slice_shape(self.natural_tile), result=True)
            )
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

    Built from a Plan: every boundary, the step's transfer order (`order="plan"`: meshjob.plan.comm_order;
    start() must then be called for every transfer of each step, as the pipeline does), how many
    receives this rank's stage keeps posted per boundary (`recv_depth`) and the plan's network model.
    With `order=None`, or built from explicit routes (tests and benchmarks that make boundaries
    without a whole job), transfers go in the order start() is called, which must then be the same
    on every rank. Events
    (bytes, times, NIC rate of `host`, unit tasks) go to `events`; `host` defaults to the plan's name
    of the rank's host, or "host-<index>" with explicit routes. `wire`: default on the CPU gloo between hosts
    (`cpu_wire` "tcp": a TCP connection per directed pair, meshjob_trainer.tcp_wire) and a memory copy inside
    one, NCCL on CUDA (meshjob_trainer.wire.wire_for); a wire the executor made is closed with it. Call
    close() before leaving the process group.

    With an order, the ranks of a host also take their turns on the host's shared NIC links as the
    plan orders them (meshjob_trainer.board): `board` True / False, or None: when torch.distributed is
    up (the ranks of a host meet in its store; every rank of the job then builds its executors, and
    switches orders, in the same sequence). `board_timeout_s`: the longest wait for a turn."""

    def __init__(
        self,
        plan: Plan | None,
        rank: int,
        events: MetricsSink | None = None,
        *,
        routes: Sequence[Route] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        host: str = "",
        wire: Wire | None = None,
        order: TransferOrder | str | None = "plan",
        in_flight_per_link: int | None = None,
        board: bool | None = None,
        board_timeout_s: float = 300.0,
        small_in_flight_per_link: int | None = None,
        cpu_wire: str = "gloo",
    ) -> None:
        self.rank, self.events = rank, events
        # the wire's dtype: the plan's job's training dtype (its byte counts assume it), else fp32
        self.dtype = dtype or (wire_dtype(plan.job.training.activation_itemsize) if plan is not None else torch.float32)
        self.device = torch.device(device or "cpu")
        self.recv_depth: dict[BoundaryKey, int] = {}
        if isinstance(order, str) and order != "plan":
            raise ValueError(f'order {order!r} is invalid: a TransferOrder, "plan" or None')
        network = routes[0].network if routes else NetworkModel()
        self.order = None if isinstance(order, str) else order  # explicit routes: no plan to take an order from
        if routes is None:
            if plan is None:
                raise ReshardError("ReshardExecutor needs a plan or explicit routes")
            routes = routes_from_plan(plan)
            host = host or plan.placement.hosts[plan.placement.host_of(rank)].name
            network = plan.network
            if order == "plan":
                self.order = plan.transfer_order  # computed once per plan (meshjob.plan.build)
            if self.order is not None:
                self.recv_depth = recv_depths(plan.schedules, self.order).get(plan.placement.stage_of(rank), {})
        order = self.order
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
        self.small_in_flight_per_link = max(
            self.in_flight_per_link, small_in_flight_per_link or network.small_in_flight_per_link
        )
        pairs = set().union(*(r.pairs() for r in self.routes.values()))
        self._own_wire = wire is None  # closed with the executor
        self.wire = wire or wire_for(
            self.device,
            rank,
            pairs,
            local_peers=local_peers(self.routes.values(), rank),
            cpu_wire=cpu_wire,
            ungranted=one_feeder_pairs(self.routes.values()) if cpu_wire == "tcp" else (),
        )
        self.network = network
        self.board_timeout_s = board_timeout_s
        use_board = order is not None and ((dist.is_available() and dist.is_initialized()) if board is None else board)
        self.engine = CommEngine(
            rank,
            self.wire,
            self.specs,
            in_flight_per_link=self.in_flight_per_link,
            order=order,
            board_for=self._board_for if use_board else None,
            overlap_bytes=overlap_bytes(network),
            nic_bytes_per_s=network.nic_bytes_per_s,
            lead_s=HANDOVER_LEAD_S,
            small_in_flight_per_link=self.small_in_flight_per_link,
        )

    def host_link_orders(self, order: TransferOrder) -> dict[int, HostLinkOrder]:
        """Every host's shared NIC links in the plan's order for one pass of `order` (meshjob.plan.host_order)."""
        sides = {k: r.planned_sides() for k, r in self.routes.items()}
        return host_link_orders(order.transfers, sides)

    def _board_for(self, order: TransferOrder, wake: Callable[[str], None]) -> HostBoard | None:
        """This rank's host board for `order`, or None when it shares no NIC link on its host. Every rank
        calls it at the same points (the serial number names the board in the store)."""
        serial = next(_BOARDS)
        host = next(
            (
                r.host_of(self.rank)
                for r in self.routes.values()
                if self.rank in r.src_ranks or self.rank in r.dst_ranks
            ),
            None,
        )
        mine = self.host_link_orders(order).get(host) if host is not None else None
        if mine is None or self.rank not in mine.ranks:
            return None
        store = dist.distributed_c10d._get_default_store()
        return HostBoard(
            mine,
            self.rank,
            self.in_flight_per_link,
            overlap_bytes(self.network),
            store,
            f"meshjob/board/{serial}/h{host}",
            wake,
            self.board_timeout_s,
            nic_bytes_per_s=self.network.nic_bytes_per_s,
            lead_s=HANDOVER_LEAD_S,
            small_window=self.small_in_flight_per_link,
        )

    def route(self, key: BoundaryKey) -> Route:
        try:
            return self.routes[key]
        except KeyError:
            raise ReshardError(
                f"boundary {key} is not in this plan; known: {', '.join(map(str, self.routes))}"
            ) from None

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
        job = _Transfer(
            route,
            self.rank,
            microbatch,
            self.specs[key],
            self.tag_base(key, microbatch),
            natural_local,
            self.dtype,
            self.device,
            self.events,
            self.host,
        )
        return self.engine.submit(job)

    def memory_bound_bytes(self) -> int:
        """The most payload memory the engine can hold when the stage keeps `recv_depth` receives posted
        per boundary: that many receiving jobs' buffers, plus a staging copy per send in flight (on a NIC
        link, small ones packed beyond the window hold overlap_bytes at most together)."""
        total = 0
        for key, depth in self.recv_depth.items():
            total += depth * self.routes[key].receive_bytes(self.rank, self.dtype)
        largest: dict[Link | None, int] = {}
        for key, specs in self.specs.items():
            route = self.routes[key]
            for spec in specs:
                if spec.send and not route.contiguous_at(self.rank, spec.index):
                    nbytes = route.step_at(spec.index).nbytes(_itemsize(self.dtype))
                    largest[spec.link] = max(largest.get(spec.link, 0), nbytes)
        packed = overlap_bytes(self.network) if self.small_in_flight_per_link > self.in_flight_per_link else 0
        return total + sum(
            self.in_flight_per_link * nbytes + (packed if link[1] != "local" else 0)
            for link, nbytes in largest.items()
            if link is not None
        )

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
        if self._own_wire:
            close_wire(self.wire)


def wire_dtype(itemsize: int) -> torch.dtype:
    """The dtype boundary tensors cross in (meshjob.spec.manifest.TrainingSpec.activation_itemsize's bytes)."""
    return torch.bfloat16 if itemsize == 2 else torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
