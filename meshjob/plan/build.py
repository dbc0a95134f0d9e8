"""The Plan: everything decided before a process starts (placement, boundaries, schedules).

build_plan(job) places the stage meshes on hosts, then for every edge builds two Boundaries:
the forward one (the edge's tensor, src mesh in the `send` layout -> dst mesh in the `recv`
layout) and the backward one (its gradient, dst mesh in `recv` -> src mesh in `send`), each named
by a BoundaryKey. Each boundary is decomposed into unit tasks; the tasks of all boundaries that can be in flight
together (a window, meshjob.resharding.window: the whole step, or gpipe's forward and backward phases) are balanced as
one problem on the network model (meshjob.network.model: full-duplex NIC links, per-message cost), which
picks every task's sender host, order and chunk count; each boundary keeps its share, timed alone
(the all-gather strategies' by their lowered steps, message by message: Boundary.timed_s).
Tasks are lowered, in start order, into point-to-point steps from the chosen sender rank (on a
sender host, the holder with the fewest bytes so far across the window sends). Schedules come from
job.schedule; the plan is validated and deterministic.

Weight-grad delay (job.schedule.weightGradDelay, auto or a number of microbatches N):
  0     backward not split (B)
  N     split into I and W; each stage that sends gradients delays min(N, M - 1) W's
  auto  split; the smallest delays that cover the communication as the plan's own simulator judges
        it (meshjob.plan.delay_choice): candidates are the ratio rule (each stage alone, §4 of "On
        Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022): ceil(comm / W),
        comm = the summed makespans of the backward boundaries it sends, W = the stage's
        weight-gradient time from the cost model, measured with --calibrate), one delay d for
        every stage, the rule raised by d, and the rule ramped up to d toward the last stage; each is
        simulated on the plan's network and stage costs, step after step (meshjob.simulate.steady), and the smallest
        within 1% of the fastest (and no slower than the rule) is taken. No stage ever delays so
        many that its peak stash exceeds eager-1F1B's stage-0 bound min(M, 2S - 1) (or its own
        undelayed peak, where that is higher already).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshjob.costs.compute import CostModel, StageCost
from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec, slice_shape
from meshjob.network.host_task import HostTask
from meshjob.network.model import NetworkModel
from meshjob.plan import delay_choice
from meshjob.plan.comm_order import TransferOrder, transfer_order
from meshjob.plan.placement import Host, Placement, default_hosts, place
from meshjob.plan.program import RankProgram, rank_programs
from meshjob.plan.recent import Recent
from meshjob.resharding import balance as bal
from meshjob.resharding import strategies
from meshjob.resharding.strategies import lower
from meshjob.resharding.tasks import Step, UnitTask, decompose, nic_bytes
from meshjob.resharding.window import STEP, Window, balance_window, window_groups
from meshjob.schedule.actions import (
    Action,
    generate,
    max_delay_within,
    peak_stashed,
    schedule_kind,
    stash_bound,
    validate,
    weight_delay_for,
)
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import compute_costs, plan_cost, simulate_transfer, transfer_costs
from meshjob.spec.manifest import ReshardingSpec, TrainingJob

ITEMSIZE = 4  # float32 activations: a boundary's default (Boundary.itemsize: the job's training dtype)


@dataclass(frozen=True)
class Boundary:
    key: BoundaryKey  # sending stage -> receiving stage, tensor, direction
    shape: tuple[int, ...]
    send: ShardingSpec  # layout on the src mesh
    recv: ShardingSpec  # layout on the dst mesh
    strategy: str
    balancer: str
    chunks: int | str  # the spec's K, or "auto" (each task's K is in schedule.chunks)
    tasks: tuple[UnitTask, ...]
    schedule: bal.Schedule  # this boundary's share of its window's joint schedule, timed alone
    senders: tuple[int, ...]  # chosen sender rank per task
    steps: tuple[Step, ...]  # lowered, ordered by task start
    window: int = 0  # index into Plan.windows
    # The all-gather strategies' steps timed together, message by message (meshjob.simulate.simulator): their
    # tasks' rings interleave on the links, where the balancer holds each link of a task from its first
    # message to its last, which overestimates them. None: the schedule's makespan, which the other strategies'
    # executor follows.
    timed_s: float | None = None
    itemsize: int = ITEMSIZE  # bytes of one element on the wire: TrainingSpec.activation_itemsize

    @property
    def src(self) -> int:
        return self.key.src

    @property
    def dst(self) -> int:
        return self.key.dst

    @property
    def tensor(self) -> str:
        return self.key.tensor

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan_s if self.timed_s is None else self.timed_s

    @property
    def lower_bound_s(self) -> float:
        return self.schedule.lower_bound_s

    @property
    def is_backward(self) -> bool:
        return self.key.grad

    def task_order(self) -> list[int]:
        """Task indices by start time (ties by index): the order the steps were lowered in."""
        return sorted(range(len(self.tasks)), key=lambda i: (self.schedule.start_s[i], i))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": str(self.key),
            "from": self.src,
            "to": self.dst,
            "tensor": self.tensor,
            "grad": self.key.grad,
            "shape": list(self.shape),
            "send": str(self.send),
            "recv": str(self.recv),
            "strategy": self.strategy,
            "balancer": self.balancer,
            "chunks": self.chunks,
            "window": self.window,
            "makespan_s": self.makespan_s,
            "lower_bound_s": self.lower_bound_s,
            "num_steps": len(self.steps),
            "tasks": [
                {
                    "slice": [list(interval) for interval in task.slice],
                    "senders": list(task.senders),
                    "receivers": list(task.receivers),
                    "sender": self.senders[i],
                    "bytes": task.bytes,
                    "chunks": self.schedule.chunks[i],
                    "start_s": self.schedule.start_s[i],
                    "seconds": self.schedule.seconds[i],
                }
                for i, task in enumerate(self.tasks)
            ],
        }


@dataclass(frozen=True)
class Plan:
    job: TrainingJob
    placement: Placement
    boundaries: tuple[Boundary, ...]
    schedules: dict[int, tuple[Action, ...]]
    network: NetworkModel
    split_backward: bool = False
    weight_delay: dict[int, int] = field(default_factory=dict)
    windows: tuple[Window, ...] = ()
    stage_costs: dict[int, StageCost] = field(default_factory=dict)  # what sized the weight delays
    costs_measured: bool = False
    delay_choice: delay_choice.DelayChoice | None = None  # auto: the simulated candidates and the pick

    @property
    def nic_bytes_per_s(self) -> float:
        return self.network.nic_bytes_per_s

    def mesh(self, stage: int) -> Mesh:
        return self.placement.mesh(stage)

    def boundary(self, key: BoundaryKey) -> Boundary:
        for b in self.boundaries:
            if b.key == key:
                return b
        raise KeyError(f"no boundary {key} in plan {self.job.name!r}")

    @functools.cached_property
    def transfer_order(self) -> TransferOrder:
        """The order every rank issues the step's transfers in (meshjob.plan.comm_order), computed once."""
        return transfer_order(self)

    @functools.cached_property
    def _programs(self) -> dict[int, dict[int, RankProgram]]:
        return {}  # boundary index -> rank -> program, filled on first use

    def program(self, boundary: Boundary, rank: int) -> RankProgram:
        """What `rank` sends and receives for one microbatch of `boundary`, in order (meshjob.plan.program).
        Ordered on plain links: a token bucket changes how fast, not in which order."""
        index = self.boundaries.index(boundary)
        if index not in self._programs:
            plain = replace(self.network, burst_bytes=0.0)
            self._programs[index] = rank_programs(boundary.steps, self.placement.host_of, plain, boundary.itemsize)
        return self._programs[index].get(rank, RankProgram(rank, (), (), ()))

    def host_bytes_per_step(self) -> dict[int, tuple[int, int]]:
        """Bytes each host's NIC sends and receives in one training step (every boundary runs once
        per microbatch): host index -> (egress, ingress)."""
        total: dict[int, list[int]] = {}
        for b in self.boundaries:
            for host, (out, into) in nic_bytes(b.steps, self.placement.host_of, b.itemsize).items():
                pair = total.setdefault(host, [0, 0])
                pair[0] += out * self.job.training.microbatches
                pair[1] += into * self.job.training.microbatches
        return {h: (o, i) for h, (o, i) in sorted(total.items())}

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: the plan's one fingerprint. Ranks that built their plan on
        their own compare it before any transfer can hang, and workers compare it with the digest
        the operator rendered (meshjob.plan.rendered)."""
        return _sha256(self.to_json())

    def section_digests(self) -> dict[str, str]:
        """The digest of each top-level key of the JSON: says where two plans differ."""
        return {key: _sha256(value) for key, value in self.to_json().items()}

    def to_json(self) -> dict[str, Any]:
        """The `meshjob plan --json` contract (placement, boundaries, schedules) plus hosts, meshes,
        world size, the network (model, windows, per-host bytes per step), the costs and the
        schedule settings."""
        placement = self.placement
        microbatches = self.job.training.microbatches
        return {
            "job": self.job.name,
            "world_size": placement.world_size,
            "nic_bytes_per_s": self.nic_bytes_per_s,
            "hosts": [
                {"name": h.name, "devices": h.devices, "rack": h.rack, "ranks": list(placement.ranks_on(i))}
                for i, h in enumerate(placement.hosts)
            ],
            "meshes": [
                {"stage": s, "shape": list(m.shape), "ranks": list(m.ranks), "hosts": list(m.hosts)}
                for s, m in ((s, self.mesh(s)) for s in range(len(self.job.stages)))
            ],
            "placement": placement.to_json(),
            "network": {
                "model": self.network.to_json(),
                "windows": [w.to_json() for w in self.windows],
                "hosts": [
                    {
                        "host": placement.hosts[h].name,
                        "egress_bytes": out,
                        "ingress_bytes": into,
                        "egress_s": out / self.nic_bytes_per_s,
                        "ingress_s": into / self.nic_bytes_per_s,
                    }
                    for h, (out, into) in self.host_bytes_per_step().items()
                ],
                "per": f"step ({microbatches} microbatches)",
            },
            "costs": {
                "measured": self.costs_measured,
                "stages": {str(s): c.to_json() for s, c in sorted(self.stage_costs.items())},
            },
            "boundaries": [b.to_json() for b in self.boundaries],
            "schedule": {
                "kind": self.job.schedule.kind,
                "weight_grad_delay": self.job.schedule.weight_grad_delay,
                "split_backward": self.split_backward,
                "weight_delay": {str(s): d for s, d in sorted(self.weight_delay.items())},
                "peak_stashed": {str(s): n for s, n in peak_stashed(self.schedules).items()},
                "stash_bound": stash_bound(len(self.job.stages), microbatches),
                "delay_choice": None if self.delay_choice is None else self.delay_choice.to_json(),
            },
            "schedules": {str(s): [str(a) for a in actions] for s, actions in sorted(self.schedules.items())},
        }


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------------------ boundaries
@dataclass(frozen=True)
class _Edge:
    """One direction of an edge, decomposed: what a window balances."""

    key: BoundaryKey
    shape: tuple[int, ...]
    send: ShardingSpec
    recv: ShardingSpec
    tasks: tuple[UnitTask, ...]
    host_tasks: tuple[HostTask, ...]


def host_task(task: UnitTask, host_of: Callable[[int], int]) -> HostTask:
    """A unit task lifted to hosts: its holders' hosts, its receivers' hosts (first-seen order,
    the order the lowering chains them in) with their device counts, and how finely it can be cut."""
    senders = tuple(dict.fromkeys(host_of(r) for r in task.senders))
    devices: dict[int, int] = {}
    for r in task.receivers:
        devices[host_of(r)] = devices.get(host_of(r), 0) + 1
    return HostTask(senders, tuple(devices), task.bytes, tuple(devices.values()), max(slice_shape(task.slice)))


def _decompose(
    key: BoundaryKey,
    shape: tuple[int, ...],
    src: tuple[Mesh, ShardingSpec],
    dst: tuple[Mesh, ShardingSpec],
    host_of: Callable[[int], int],
    itemsize: int = ITEMSIZE,
) -> _Edge:
    (src_mesh, send), (dst_mesh, recv) = src, dst
    tasks = tuple(decompose(shape, src_mesh, send, dst_mesh, recv, itemsize))
    return _Edge(key, shape, send, recv, tasks, tuple(host_task(t, host_of) for t in tasks))


def _directions(job: TrainingJob, placement: Placement) -> list[_Edge]:
    shape = tuple(job.activation_shape())
    itemsize = job.training.activation_itemsize
    out: list[_Edge] = []
    for e in job.edges:
        forward = BoundaryKey(e.src, e.dst, e.tensor)
        send, recv = ShardingSpec.parse(e.send, len(shape)), ShardingSpec.parse(e.recv, len(shape))
        src, dst = (placement.mesh(e.src), send), (placement.mesh(e.dst), recv)
        out.append(_decompose(forward, shape, src, dst, placement.host_of, itemsize))
        out.append(_decompose(forward.backward(), shape, dst, src, placement.host_of, itemsize))
    return out


def lower_in_start_order(
    tasks: Sequence[UnitTask],
    schedule: bal.Schedule,
    host_of: Callable[[int], int],
    strategy: str,
    load: dict[int, int] | None = None,
) -> tuple[tuple[int, ...], tuple[Step, ...]]:
    """(sender rank per task, the lowered steps in task-start order), each task cut into its
    schedule.chunks. On the balancer's sender host the holder with the fewest bytes to send so far
    sends (`load`: rank -> bytes, carried across the boundaries of a window): spreads a host's
    sends over its devices. Decided in start order, so it is deterministic."""
    load = {} if load is None else load
    chosen: dict[int, int] = {}
    steps: list[Step] = []
    for i in sorted(range(len(tasks)), key=lambda i: (schedule.start_s[i], i)):
        host = schedule.sender_host[i]
        holders = [r for r in tasks[i].senders if host_of(r) == host]
        if not holders:
            raise ValueError(f"balancer chose host {host} for task {i}, which holds none of its senders")
        rank = min(holders, key=lambda r: (load.get(r, 0), r))
        load[rank] = load.get(rank, 0) + tasks[i].bytes
        chosen[i] = rank
        chunks = schedule.chunks[i] if schedule.chunks else 1
        steps += lower(tasks[i], i, rank, strategy, chunks, host_of, len(steps))
    return tuple(chosen[i] for i in range(len(tasks))), tuple(steps)


def _plan_windows(
    edges: Sequence[_Edge],
    groups: Sequence[tuple[str, tuple[int, ...]]],
    resharding: ReshardingSpec,
    host_of: Callable[[int], int],
    network: NetworkModel,
    seed: int,
    itemsize: int = ITEMSIZE,
) -> tuple[list[Boundary], list[Window]]:
    """Balance each window of `edges` jointly, then lower every boundary from its share (`itemsize`: the
    bytes of one element, which the edges' tasks were decomposed with)."""
    spec = resharding
    tasks = [e.host_tasks for e in edges]
    shares: dict[int, bal.Schedule] = {}
    windows: list[Window] = []
    for name, members in groups:
        window, share = balance_window(
            name, members, tasks, spec.balancer, spec.strategy, network, spec.chunks, spec.budget_seconds, seed
        )
        windows.append(window)
        shares.update(share)
    out: dict[int, Boundary] = {}  # edge index -> its boundary (every edge is in one window)
    for w, window in enumerate(windows):
        load: dict[int, int] = {}  # per-rank send bytes across the window
        for b in window.boundaries:
            e = edges[b]
            senders, steps = lower_in_start_order(e.tasks, shares[b], host_of, spec.strategy, load)
            timed = (
                simulate_transfer(steps, host_of, network, itemsize).makespan_s
                if strategies.by_name(spec.strategy).interleaved
                else None
            )
            out[b] = Boundary(
                key=e.key,
                shape=e.shape,
                send=e.send,
                recv=e.recv,
                strategy=spec.strategy,
                balancer=spec.balancer,
                chunks=spec.chunks,
                tasks=e.tasks,
                schedule=shares[b],
                senders=senders,
                steps=steps,
                window=w,
                timed_s=timed,
                itemsize=itemsize,
            )
        if strategies.by_name(spec.strategy).interleaved:
            windows[w] = replace(
                window, timed_s=timed_together(window, [out[b] for b in window.boundaries], host_of, network)
            )
    return [out[b] for b in range(len(edges))], windows


def timed_together(
    window: Window, members: Sequence[Boundary], host_of: Callable[[int], int], network: NetworkModel
) -> float:
    """The makespan of a window's boundaries' steps run at once on `network` (meshjob.simulate.simulator), in the
    joint schedule's order (each step at its task's joint start; a boundary's own order among equals),
    each boundary's step ids renumbered apart (every boundary numbers its own from 0), so the boundaries'
    steps interleave as their tasks do in the joint schedule."""
    keyed: list[tuple[float, int, Step]] = []
    for k, boundary in enumerate(members):
        renumber = {s.id: len(keyed) + i for i, s in enumerate(boundary.steps)}
        keyed += [
            (
                window.schedule.start_s[window.offsets[k] + s.task],
                len(keyed) + i,
                replace(s, id=renumber[s.id], after=tuple(renumber[a] for a in s.after)),
            )
            for i, s in enumerate(boundary.steps)
        ]
    steps = [step for _, _, step in sorted(keyed, key=lambda x: x[:2])]
    itemsize = members[0].itemsize if members else ITEMSIZE
    return simulate_transfer(steps, host_of, network, itemsize).makespan_s


# ------------------------------------------------------------------------------ recent results
# Candidates of a search that differ only in schedule share their boundaries (balancing their windows is slow);
# those that differ only in strategy or balancer often move the same bytes in the same times, so share their
# delay choice (simulating its candidates is most of building a plan).
KEPT = 32
_BOUNDARIES: Recent[tuple[list[Boundary], list[Window]]] = Recent(KEPT)
_CHOICES: Recent[tuple[delay_choice.DelayChoice, Mapping[int, Sequence[Action]]]] = Recent(KEPT)


def _boundaries(job: TrainingJob, placement: Placement, network: NetworkModel) -> tuple[list[Boundary], list[Window]]:
    forwards_first = schedule_kind(job.schedule.kind).forwards_first
    training = job.training
    key = (placement, network, job.resharding, training.seed, training.activation_itemsize, forwards_first)
    key_job = (tuple(job.activation_shape()), tuple(job.edges))

    def plan() -> tuple[list[Boundary], list[Window]]:
        directions = _directions(job, placement)
        groups = window_groups(forwards_first, [e.key.grad for e in directions])
        return _plan_windows(
            directions, groups, job.resharding, placement.host_of, network, training.seed, training.activation_itemsize
        )

    boundaries, windows = _BOUNDARIES.get((key, key_job), plan)
    return list(boundaries), list(windows)


def plan_boundary(
    key: BoundaryKey,
    shape: tuple[int, ...],
    src: tuple[Mesh, ShardingSpec],
    dst: tuple[Mesh, ShardingSpec],
    resharding: ReshardingSpec,
    host_of: Callable[[int], int],
    nic_bytes_per_s: float = 1e9 / 8,
    seed: int = 0,
    network: NetworkModel | None = None,
) -> Boundary:
    """Decompose, balance and lower one transfer of a tensor of `shape` from (mesh, layout) `src` to
    `dst`, alone (a window of one boundary), on `network` (default: the standard model at
    `nic_bytes_per_s`). For the benchmarks and tests that need no whole job; build_plan balances a
    job's boundaries together."""
    network = network or NetworkModel(nic_bytes_per_s=nic_bytes_per_s)
    edge = _decompose(key, shape, src, dst, host_of)
    (boundary,), _ = _plan_windows([edge], [(STEP, (0,))], resharding, host_of, network, seed)
    return boundary


# ------------------------------------------------------------------------------ weight delays
def _sends_gradients(boundaries: Sequence[Boundary], stage: int) -> bool:
    return any(b.is_backward and b.src == stage for b in boundaries)


def delay_rooms(job: TrainingJob, boundaries: Sequence[Boundary]) -> dict[int, int]:
    """Per stage, the most W's it may delay: none where it sends no gradients, else at most M - 1 and
    never so many that its peak stash passes eager-1F1B's stage-0 bound min(M, 2S - 1) (or its own
    undelayed peak, where that is higher already)."""
    num_stages, microbatches = len(job.stages), job.training.microbatches
    edges = _edges(job)
    return {
        stage: min(
            max(0, microbatches - 1),
            max_delay_within(
                job.schedule.kind, stage, num_stages, microbatches, edges, stash_bound(num_stages, microbatches)
            ),
        )
        if _sends_gradients(boundaries, stage)
        else 0
        for stage in range(num_stages)
    }


def weight_delays(
    job: TrainingJob,
    boundaries: Sequence[Boundary],
    costs: Mapping[int, StageCost],
    rooms: Mapping[int, int] | None = None,
) -> tuple[bool, dict[int, int]]:
    """(split_backward, W's each stage delays) for job.schedule.weightGradDelay; for auto, the ratio
    rule ceil(comm / W) within each stage's room (`rooms`: delay_rooms, computed when not given;
    build_plan then simulates candidates around it)."""
    mode = job.schedule.weight_grad_delay
    if mode == 0:
        return False, {}
    microbatches = job.training.microbatches
    if isinstance(mode, int):
        return True, {
            stage: min(mode, max(0, microbatches - 1)) if _sends_gradients(boundaries, stage) else 0
            for stage in range(len(job.stages))
        }
    delays: dict[int, int] = {}
    for stage, room in (delay_rooms(job, boundaries) if rooms is None else rooms).items():
        comm_s = sum(b.makespan_s for b in boundaries if b.is_backward and b.src == stage)
        delays[stage] = weight_delay_for(comm_s, costs[stage].weight_grad_s, room)
    return True, delays


def simulated_delays(plan: Plan, rooms: Mapping[int, int]) -> Plan:
    """`plan` (its delays from the ratio rule, each stage within `rooms`) with the delays
    meshjob.plan.delay_choice picks by simulating candidates on the plan's own network and stage costs,
    and the candidates it simulated."""
    job = plan.job
    leads = delay_choice.warmup_leads(job.schedule.kind, len(job.stages), job.training.microbatches)
    if not delay_choice.within_budget(plan.weight_delay, plan.schedules, rooms, leads):
        return replace(plan, delay_choice=delay_choice.unsimulated(plan.weight_delay))
    cost = plan_cost(plan)
    compute, transfers = compute_costs(plan, cost), transfer_costs(plan, cost)
    # the lists are generate()'s of the rest, so these name every input of the choice
    key = (
        job.schedule.kind,
        job.training.microbatches,
        tuple(_edges(job)),
        tuple(plan.weight_delay.items()),
        tuple(rooms.items()),
        tuple(compute.items()),
        tuple((k, t.seconds, tuple(t.per_link.items()), t.early_s) for k, t in transfers.items()),
        cost,
    )
    choice, lists = _CHOICES.get(
        key,
        lambda: delay_choice.choose(
            job.schedule.kind,
            job.training.microbatches,
            _edges(job),
            plan.weight_delay,
            plan.schedules,
            rooms,
            compute,
            transfers,
            cost,
        ),
    )
    if choice.chosen.name == delay_choice.RULE:
        return _with_order(replace(plan, delay_choice=choice), choice.chosen.order)
    validate(lists, _edges(job), job.training.microbatches, True)
    return _with_order(
        replace(
            plan,
            schedules={s: tuple(actions) for s, actions in lists.items()},
            weight_delay=dict(choice.chosen.delays),
            delay_choice=choice,
        ),
        choice.chosen.order,
    )


def _with_order(plan: Plan, order: TransferOrder | None) -> Plan:
    """`plan` with its transfer order already known, where the delay choice ran the same runs that
    comm_order.transfer_order would (same action lists, costs and rounds): not computed twice. It fills
    the cached_property's slot; dataclasses.replace builds a new Plan, so a changed plan computes its own."""
    if order is not None:
        plan.__dict__["transfer_order"] = order
    return plan


def _edges(job: TrainingJob) -> list[tuple[int, int, str]]:
    return [(e.src, e.dst, e.tensor) for e in job.edges]


# ------------------------------------------------------------------------------ the plan
def build_plan(
    job: TrainingJob,
    hosts: Sequence[Host] | None = None,
    nic_bytes_per_s: float = 1e9 / 8,
    cost: CostModel | None = None,
    network: NetworkModel | None = None,
    simulate_delays: bool = True,
) -> Plan:
    """Place, decompose, balance, lower and schedule. `network` (default: the standard model at
    `nic_bytes_per_s`) is what the balancers optimise; `cost` supplies the per-stage compute times
    that size the weight-gradient delay (default: the formula; measured ones with --calibrate).
    `weightGradDelay: auto` takes the delays meshjob.plan.delay_choice picks by simulating candidates
    (`simulate_delays` False: the ratio rule alone, which the search uses to stay fast).
    Raises PlacementError when the hosts cannot hold the job; the same inputs always give the same plan."""
    if network is None:
        if not nic_bytes_per_s > 0:
            raise ValueError(f"nic_bytes_per_s must be > 0, got {nic_bytes_per_s}")
        network = NetworkModel(nic_bytes_per_s=nic_bytes_per_s)
    cost = cost or CostModel(network=network)
    placement = place(job, default_hosts(job) if hosts is None else hosts)
    boundaries, windows = _boundaries(job, placement, network)
    stage_costs = cost.stage_costs(job)
    simulate = simulate_delays and job.schedule.weight_grad_delay == "auto"
    rooms = delay_rooms(job, boundaries) if simulate else None
    split, delays = weight_delays(job, boundaries, stage_costs, rooms)
    edges = _edges(job)
    microbatches = job.training.microbatches
    lists = generate(job.schedule.kind, len(job.stages), microbatches, edges, split, delays)
    validate(lists, edges, microbatches, split)
    plan = Plan(
        job=job,
        placement=placement,
        boundaries=tuple(boundaries),
        schedules={s: tuple(actions) for s, actions in lists.items()},
        network=network,
        split_backward=split,
        weight_delay=delays,
        windows=tuple(windows),
        stage_costs=stage_costs,
        costs_measured=cost.measured,
    )
    if rooms is not None:
        return simulated_delays(plan, rooms)
    return plan
