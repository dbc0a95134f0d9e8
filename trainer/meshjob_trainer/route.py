"""A boundary as the resharding executor (meshjob_trainer.reshard) runs it: one Route per boundary.

A Route holds the plan's boundary with both meshes and natural layouts, checked once at construction
(every step's region inside what its sender holds and its receiver's recv tile, no forward before its
region has arrived, no cycle among the steps). It adds the gather inside the destination mesh, where
the recv layout shards more than the destination's natural layout, and answers, per rank, what the
engine needs: the messages the rank sends and receives in their planned order (MessageSpec), where
each one's region lies in the tile it reads or fills (Where), the links they take, and the buffers a
receive allocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import (
    ShardingSpec,
    Slice,
    contains,
    intersect,
    relative,
    slice_numel,
    slice_shape,
    tile,
    to_index,
)
from meshjob.network.host_task import Link
from meshjob.network.model import NetworkModel
from meshjob.plan.build import Boundary, Plan
from meshjob.plan.host_order import Side
from meshjob.plan.program import RankProgram, in_link, out_link, planned_keys, rank_programs
from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST, Step
from meshjob.spec.manifest import natural_layout
from meshjob_trainer.engine_job import MessageSpec


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
        self.gather = _gather_steps(
            self.dst_mesh,
            self.recv,
            self.dst_natural,
            tuple(b.shape),
            first_id=1 + max((s.id for s in self.steps), default=-1),
        )
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
        """Every rank's program (meshjob.plan.program), on plain links as Plan.program orders them."""
        if not hasattr(self, "_programs"):
            plain = dataclasses.replace(self.network, burst_bytes=0.0)
            self._programs = rank_programs(self.steps, self.host_of, plain, self.boundary.itemsize)
        return self._programs

    def planned_sides(self) -> tuple[Side, ...]:
        """Both ends of every message of the boundary in its planned order (the plan's steps in planned
        start order, as every rank's program has them, then the gather inside the destination): what
        meshjob.plan.host_order merges into each host's link order."""
        if not hasattr(self, "_sides"):
            plain = dataclasses.replace(self.network, burst_bytes=0.0)
            key = planned_keys(self.steps, self.host_of, plain, self.boundary.itemsize)
            index = {s.id: i for i, s in enumerate(self.steps)}
            ordered = [(index[s.id], s) for s in sorted(self.steps, key=lambda s: key[s.id])]
            ordered += [(len(self.steps) + j, g) for j, g in enumerate(self.gather)]
            self._sides = tuple(
                side
                for i, s in ordered
                for side in ((s.src, i, self.link(s.src, s.dst)), (s.dst, i, self.in_link(s.src, s.dst)))
            )
        return self._sides

    def where(self, rank: int, index: int) -> Where:
        """Message `index` as `rank` sees it (computed once per rank: the engine asks per message)."""
        cache = self.__dict__.setdefault("_where_cache", {})
        if rank not in cache:
            cache[rank] = {m.index: self._where(rank, m.index) for m in self.message_specs(rank)}
        return cache[rank][index]

    def _where(self, rank: int, index: int) -> Where:
        step = self.step_at(index)
        if rank in self.src_ranks:
            origin = self.tile_of(rank, self.src_natural, self.src_mesh)  # a source sends from its tile
        elif index < len(self.steps) or step.src == rank:
            origin = self.holding(rank)  # receives land in the recv tile, forwards and gathers read it
        else:
            origin = self.tile_of(rank, self.dst_natural, self.dst_mesh)  # a gather lands in the natural tile
        at = to_index(relative(step.region, origin))
        contiguous = torch.empty(slice_shape(origin), device="meta")[at].is_contiguous()
        return Where(
            at,
            slice_shape(step.region),
            slice_numel(step.region),
            contiguous,
            step.scope,
            step.task,
            (self.host_of(step.src), self.host_of(step.dst)),
        )

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
        """The link a message from rank src to rank dst leaves on (meshjob.plan.program.out_link)."""
        return out_link(self.network, self.host_of(src), self.host_of(dst))

    def in_link(self, src: int, dst: int) -> Link:
        """The link a message from rank src to rank dst arrives on (meshjob.plan.program.in_link)."""
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
        sends = [
            MessageSpec(index[s.id], s.id, s.dst, True, link, tuple(index[d] for d in s.after if d in own))
            for s, link in zip(mine.sends, mine.send_links)
        ]
        landed = tuple(m.index for m in recvs)  # a gather sends this rank's whole recv tile
        n = len(self.steps)
        gather = [
            MessageSpec(n + j, g.id, g.dst, True, self.link(rank, g.dst), landed)
            if g.src == rank
            else MessageSpec(n + j, g.id, g.src, False, self.in_link(g.src, rank))
            for j, g in enumerate(self.gather)
            if rank in (g.src, g.dst)
        ]
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
                raise ReshardError(
                    f"boundary {self.name}: send layout {self.send} must shard at least as much "
                    f"as the source's natural layout {self.src_natural} (rank {r})"
                )
        for s in self.steps:
            if s.src not in ranks or s.dst not in self.dst_ranks:
                raise ReshardError(
                    f"boundary {self.name}: step {s.id} sends {s.src} -> {s.dst}, but the "
                    f"destination must be in the destination mesh {self.dst_mesh.ranks} and the "
                    f"source in either mesh"
                )
            if not contains(self.holding(s.src), s.region):
                raise ReshardError(
                    f"boundary {self.name}: step {s.id} has rank {s.src} send region {s.region}, "
                    f"outside what it holds {self.holding(s.src)}"
                )
            if not contains(self.holding(s.dst), s.region):
                raise ReshardError(
                    f"boundary {self.name}: step {s.id} delivers region {s.region} to rank "
                    f"{s.dst}, outside its recv tile {self.holding(s.dst)}"
                )

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
                raise ReshardError(
                    f"boundary {self.name}: step {s.id} has rank {s.src} forward region {s.region} "
                    f"before receiving all of it (it waits only for steps {list(s.after)})"
                )

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
            raise ReshardError(
                f"boundary {self.name}: rank {rank} would never receive {missing} of the "
                f"{mask.numel()} elements of its recv tile {own}"
            )


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


def _gather_steps(
    mesh: Mesh, recv: ShardingSpec, natural: ShardingSpec, shape: tuple[int, ...], first_id: int
) -> tuple[Step, ...]:
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


def one_feeder_pairs(routes: Iterable[Route]) -> set[tuple[int, int]]:
    """The (sender, receiver) pairs between hosts where the receiving host takes NIC messages from the
    sender's host and no other: that host's out-link, and its board, already put them in the plan's order,
    so the receive need not grant the send (meshjob_trainer.tcp_wire). The same on every rank."""
    feeders: dict[int, set[int]] = {}
    cross: list[tuple[int, int, int]] = []
    for r in routes:
        for a, b in r.pairs():
            sender, receiver = r.host_of(a), r.host_of(b)
            if sender != receiver:
                feeders.setdefault(receiver, set()).add(sender)
                cross.append((a, b, receiver))
    return {(a, b) for a, b, receiver in cross if len(feeders[receiver]) == 1}


def routes_from_plan(plan: Plan) -> list[Route]:
    naturals: dict[int, ShardingSpec] = {}
    routes = []
    for b in plan.boundaries:
        for stage in (b.src, b.dst):
            if stage not in naturals:
                naturals[stage] = ShardingSpec.parse(natural_layout(plan.job.stages[stage]), len(b.shape))
        routes.append(Route(b, plan.mesh(b.src), plan.mesh(b.dst), naturals[b.src], naturals[b.dst], plan.network))
    return routes


def make_routes(
    boundaries: Sequence[Boundary],
    meshes: Mapping[int, Mesh],
    naturals: Mapping[int, ShardingSpec | str],
    network: NetworkModel | None = None,
) -> list[Route]:
    """Routes from explicit pieces: stage -> mesh and stage -> natural layout (and the network model
    the senders' programs are ordered on; default: the standard one)."""
    return [
        Route(
            b,
            meshes[b.src],
            meshes[b.dst],
            _spec(naturals[b.src], len(b.shape)),
            _spec(naturals[b.dst], len(b.shape)),
            network or NetworkModel(),
        )
        for b in boundaries
    ]
