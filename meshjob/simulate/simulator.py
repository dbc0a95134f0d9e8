"""A discrete-event model of a Plan: predicts step time, bubbles and resharding time at any scale.

Two levels, both deterministic and pure:
- `simulate_transfer(steps, host_of, network)`: the lowered point-to-point steps of one boundary over the
  links of meshjob.network.model's model (full duplex: each host NIC is two FIFO resources, out and in; half
  duplex: one). A cross-host step occupies its source host's out-link and its destination host's in-link for
  nbytes / bandwidth plus the per-message cost, starting when its dependencies are done and both links are
  free. Intra-host steps use a per-host local link. This reproduces the strategies' cost formulas (e.g.
  broadcast: t + (A-1)t/K) and the contention between tasks that share a link.
  With `burst_bytes` > 0 each link is a token bucket like `tc tbf` (the emulated cluster's NICs): bytes
  within the bucket leave at line rate, the rest at the NIC rate. Real NICs: burst 0.
  With `shared_cpu_cores` > 0 (every host on one machine's cores), the cores are one fluid resource:
  no transfer ends before they have done its messages' CPU work (NetworkModel.cpu_s), and where the
  links' time and the cores' are close, they contend (NetworkModel.with_cpu).
- `simulate_pipeline(plan, cost)`: every stage runs its action list in order; F/B/I/W take compute time from
  the cost model; a SEND starts the boundary's transfer, which holds the NICs of the hosts it moves bytes
  through for the boundary's simulated makespan (transfers sharing a NIC direction queue behind each other;
  a token bucket shortens the busiest link's share); a RECV waits for it. Given the step's transfer
  order (meshjob.plan.comm_order: what the executor issues each link's messages in), a link takes its
  transfers in that order, a sent transfer waiting behind those planned before it. From the timeline:
  step time, bubble fraction and communication overlap per stage. `PipelineRun` is its list scheduler:
  a heap of the stages that can act, each NIC link group booked once per transfer, and more actions run
  on from where a run ended (meshjob.simulate.steady's later steps).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from meshjob.costs.compute import CostModel, StageCost
from meshjob.network.host_task import Link
from meshjob.network.model import NetworkModel
from meshjob.network.ready_order import in_ready_order
from meshjob.resharding.tasks import Step
from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.spec.manifest import job_to_dict, parse_job
from meshjob.spec.model import TrainingJob

COMPUTE = ("F", "B", "I", "W")
SENDS = ("SEND_F", "SEND_B")

__all__ = [
    "CostModel",
    "Link",
    "PipelineRun",
    "StageCost",
    "TransferCost",
    "simulate_transfer",
    "simulate_pipeline",
    "simulate_plan",
]


class Links:
    """FIFO links of the network model, each NIC link optionally a token bucket: `book` holds
    `nbytes` on all of `links` together. `messages` > 0 adds the network's per-message cost."""

    def __init__(self, network: NetworkModel):
        self.network = network
        self.free: dict[Link, float] = {}  # when the link's last booking ends
        self.tokens: dict[Link, tuple[float, float]] = {}  # link -> (tokens, at time)

    def _seconds(self, link: Link, nbytes: float, start: float) -> float:
        n = self.network
        if link[1] == "local":
            return nbytes / n.intra_host_bytes_per_s
        if n.burst_bytes <= 0:
            return nbytes / n.nic_bytes_per_s
        tokens, at = self.tokens.get(link, (n.burst_bytes, 0.0))
        tokens = min(n.burst_bytes, tokens + (start - at) * n.nic_bytes_per_s)
        return max(nbytes / n.line_bytes_per_s, (nbytes - tokens) / n.nic_bytes_per_s)

    def _message_s(self, link: Link, nbytes: float) -> float:
        return self.network.intra_message_s if link[1] == "local" else self.network.net_message_s(nbytes)

    def book(
        self, links: Sequence[Link], nbytes: Sequence[float], ready: float, messages: int = 0
    ) -> tuple[float, float]:
        """(start, end) of a transfer of nbytes[i] over links[i], all starting together."""
        start = max([ready] + [self.free.get(link, 0.0) for link in links])
        end = start + max(
            (self._seconds(link, n, start) + messages * self._message_s(link, n) for link, n in zip(links, nbytes)),
            default=0.0,
        )
        for link, n in zip(links, nbytes):
            self.free[link] = end
            if self.network.burst_bytes > 0 and link[1] != "local":
                tokens, at = self.tokens.get(link, (self.network.burst_bytes, 0.0))
                tokens = min(self.network.burst_bytes, tokens + (start - at) * self.network.nic_bytes_per_s) - n
                self.tokens[link] = (tokens, start)  # negative: still owed, refilled at the NIC rate
        return start, end


class TransferCost(NamedTuple):
    """One microbatch's transfer of a boundary, as simulate_pipeline takes it (a plain (seconds,
    per_link) pair means early_s None)."""

    seconds: float  # its makespan on plain links (no bucket), every message's cost included
    per_link: Mapping[Link, float]  # bytes through each NIC link (host, "out"|"in")
    # Not None where every NIC message is above the network's alone_bytes: the executor holds each on
    # its out-link until its bytes can have left at the NIC rate (meshjob_trainer.engine), so a tbf
    # bucket shortens none of them (each also pays alone_message_s, in `seconds`); its last message
    # lands this much sooner than its link is free (its bytes leave from the refilled bucket)
    early_s: float | None = None


# One microbatch's transfer of a boundary as simulate_pipeline takes it: (seconds, bytes per NIC link) or paced.
TransferInput = tuple[float, Mapping[Link, float]] | TransferCost


# What the simulator reads of a plan. The Plan (meshjob.plan.build) is a layer above this one, so these
# protocols name the parts it uses; a Plan has them all.
class BoundaryView(Protocol):
    @property
    def key(self) -> BoundaryKey: ...
    @property
    def steps(self) -> Sequence[Step]: ...
    @property
    def makespan_s(self) -> float: ...
    @property
    def lower_bound_s(self) -> float: ...


class PlacementView(Protocol):
    def host_of(self, rank: int, /) -> int: ...


class OrderView(Protocol):
    @property
    def transfers(self) -> Sequence[tuple[BoundaryKey, int]]: ...


class PlanView(Protocol):
    """A plan as the simulator reads it (meshjob.plan.build.Plan)."""

    @property
    def job(self) -> TrainingJob: ...
    @property
    def placement(self) -> PlacementView: ...
    @property
    def boundaries(self) -> Sequence[BoundaryView]: ...
    @property
    def schedules(self) -> Mapping[int, Sequence[Action]]: ...
    @property
    def network(self) -> NetworkModel: ...
    @property
    def stage_costs(self) -> Mapping[int, StageCost]: ...
    @property
    def transfer_order(self) -> OrderView: ...


@dataclass(frozen=True)
class TransferResult:
    makespan_s: float
    finish_s: Mapping[int, float]  # step id -> finish time
    start_s: Mapping[int, float]  # step id -> when it took its links
    nic_busy_s: Mapping[Link, float]  # (host, "out"|"in") -> busy seconds
    nic_bytes: Mapping[Link, int]  # (host, "out"|"in") -> bytes through that NIC direction
    link_s: float = 0.0  # the makespan on the links alone, before the shared cores' work
    cpu_work_s: float = 0.0  # CPU seconds its messages take on the shared cores, all cores together (0: unmodelled)


def simulate_transfer(
    steps: Sequence[Step], host_of: Callable[[int], int], network: NetworkModel, itemsize: int = 4
) -> TransferResult:
    """Run one boundary's steps over FIFO links; steps become ready when their `after` steps finish.
    Each step is one message: its bytes plus the network's per-message cost."""
    index = {s.id: i for i, s in enumerate(steps)}  # plan order breaks ties: the balancer's ordering
    links = Links(network)
    tally = {False: [0, 0], True: [0, 0]}  # inside a host? -> [messages, bytes]: their CPU work
    busy: dict[Link, float] = {}
    moved: dict[Link, int] = {}
    finish: dict[int, float] = {}
    began: dict[int, float] = {}

    def book(i: int, t_ready: float) -> float:
        step = steps[i]
        src_h, dst_h = host_of(step.src), host_of(step.dst)
        nbytes = 1 if step.signal else step.nbytes(itemsize)
        used = (
            [network.link(src_h, "local")]
            if src_h == dst_h
            else list(dict.fromkeys((network.link(src_h, "out"), network.link(dst_h, "in"))))
        )
        start, end = links.book(used, [nbytes] * len(used), t_ready, messages=1)
        tally[src_h == dst_h][0] += 1
        tally[src_h == dst_h][1] += nbytes
        for link in used:
            busy[link] = busy.get(link, 0.0) + end - start
            moved[link] = moved.get(link, 0) + nbytes
        finish[step.id], began[step.id] = end, start
        return end

    in_ready_order([tuple(index.get(d, -1) for d in s.after) for s in steps], book)
    if len(finish) != len(steps):
        missing = sorted(set(index) - set(finish))[:5]
        raise ValueError(f"steps {missing} wait on steps that never run (a dependency cycle or a missing step)")
    link_s = max(finish.values(), default=0.0)
    net, local = tally[False], tally[True]
    cpu_s = network.cpu_s((net[0], net[1]), (local[0], local[1]))  # the shared cores' work, per core
    nic = {k for k in busy if k[1] != "local"}
    return TransferResult(
        network.with_cpu(link_s, cpu_s),
        finish,
        began,
        {k: busy[k] for k in nic},
        {k: moved[k] for k in nic},
        link_s,
        cpu_s * network.shared_cpu_cores,
    )


@dataclass
class StageStats:
    compute_s: float = 0.0
    busy_until_s: float = 0.0
    comm_s: float = 0.0  # time its outgoing/incoming transfers were in flight
    exposed_comm_s: float = 0.0  # time it sat in a RECV waiting for a transfer
    timeline: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end)

    def bubble_fraction(self, step_s: float) -> float:
        return 0.0 if step_s <= 0 else max(0.0, 1.0 - self.compute_s / step_s)

    def overlap_fraction(self) -> float:
        """Share of this stage's communication time hidden behind its compute."""
        return 1.0 if self.comm_s <= 0 else max(0.0, 1.0 - self.exposed_comm_s / self.comm_s)


@dataclass(frozen=True)
class PipelineResult:
    step_s: float
    stages: Mapping[int, StageStats]
    transfer_s: Mapping[BoundaryKey, float]  # simulated makespan of one microbatch's transfer
    # (stage, action) in the order the list scheduler ran them: a causal order of the whole step
    # (a RECV comes after its SEND), which meshjob.plan.comm_order turns into the order transfers are issued in
    order: tuple[tuple[int, Action], ...] = ()
    started_s: tuple[float, ...] = ()  # when each action of `order` began (a RECV: when its stage reached it)

    def bubble_fraction(self) -> float:
        return sum(s.bubble_fraction(self.step_s) for s in self.stages.values()) / max(1, len(self.stages))

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "bubble_fraction": self.bubble_fraction(),
            "stages": {
                str(i): {
                    "compute_s": s.compute_s,
                    "bubble_fraction": s.bubble_fraction(self.step_s),
                    "overlap_fraction": s.overlap_fraction(),
                    "exposed_comm_s": s.exposed_comm_s,
                    "timeline": [[name, start, end] for name, start, end in s.timeline],  # compute actions
                }
                for i, s in self.stages.items()
            },
            "transfer_s": {str(key): s for key, s in self.transfer_s.items()},
        }


def simulate_pipeline(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel | None = None,
    order: Sequence[tuple[BoundaryKey, int]] | None = None,
    pause_s: Mapping[tuple[int, int], float] | None = None,
) -> PipelineResult:
    """Execute the action lists. compute_s[(stage, kind)] for F/B/I/W; transfers[boundary] = (seconds of one
    microbatch's transfer on plain links, the bytes it moves through each NIC link (host, "out"|"in")).
    Deterministic list scheduling: the stage whose next action can start earliest goes first.
    `order`: the step's transfer order the executor follows (meshjob.plan.comm_order.TransferOrder.transfers);
    each NIC link then carries its transfers in that order, a sent transfer waiting for the ones planned
    before it on its links (meshjob_trainer.engine issues each link's messages in the planned order).
    None: each link takes its transfers as they are sent (the run that defines the order).
    `pause_s[(stage, i)]`: seconds the stage spends after its i-th action before its next (the optimizer
    step between repeated steps: meshjob.simulate.steady)."""
    run = PipelineRun(compute_s, transfers, cost, planned=order is not None)
    run.extend(schedules, order or (), pause_s)
    return run.result()


class PipelineRun:
    """simulate_pipeline's list scheduler, which can be given more actions once it has run the ones it
    has (`extend`): meshjob.simulate.steady runs a step, reads it, then runs the steps after it on.
    With a planned order every time is a function of the times before it (each link takes its transfers
    in that order), so a step run, then extended, gives the times of the steps run in one go."""

    def __init__(
        self,
        compute_s: Mapping[tuple[int, str], float],
        transfers: Mapping[BoundaryKey, TransferInput],
        cost: CostModel | None = None,
        planned: bool = False,
    ) -> None:
        self.compute_s = compute_s
        # boundaries by number: a transfer is (boundary, mb), two ints that hash and compare fast
        self.keys = list(transfers)
        self.ids = {key: b for b, key in enumerate(self.keys)}
        self.transfers = [TransferCost(*transfers[key]) for key in self.keys]  # a plain pair: not paced
        self.links = _PipelineLinks(self.transfers, cost or CostModel())
        self.queue = _LinkQueue(self.links.groups_of, len(self.links.free), planned)
        self.schedules: dict[int, list[Action]] = {}
        self.stats: dict[int, StageStats] = {}
        self.pos: dict[int, int] = {}
        self.sent: dict[tuple[int, int], float] = {}  # (boundary, mb) -> arrival time
        self.pause_s: dict[tuple[int, int], float] = {}
        self.order: list[tuple[int, Action]] = []
        self.started: list[float] = []
        self.bookings = 0  # transfers booked on the links: the work a run did (tests count it)

    def plan_links(self) -> None:
        """Links take the transfers of later `extend` calls in their planned order. A run without one so far is
        the run its own send order planned gives (each transfer is first on its links when sent, and goes at
        once), and runs on as that one would."""
        self.queue.planned = True

    def pause(self, stage: int, seconds: float) -> None:
        """The stage spends `seconds` after its last action so far (its optimizer step, before the actions
        `extend` adds)."""
        self.stats[stage].busy_until_s += seconds

    def extend(
        self,
        schedules: Mapping[int, Sequence[Action]],
        order: Sequence[tuple[BoundaryKey, int]] = (),
        pause_s: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        """Append each stage's actions to its list, and `order` to the links' planned order, and run them
        all. pause_s[(stage, i)]: i counts from the stage's first action of the run, not of this call."""
        for stage, actions in schedules.items():
            self.schedules.setdefault(stage, []).extend(actions)
            self.stats.setdefault(stage, StageStats())
            self.pos.setdefault(stage, 0)
        self.pause_s.update(pause_s or {})
        self.queue.plan([(self.ids[key], mb) for key, mb in order])
        self._run()

    def _run(self) -> None:
        # A heap of the stages that can run their next action, by (when they are free, their place in
        # the lists): the stage a stable sort by free time would try first. A stage stopped at the
        # RECV of a transfer not sent waits aside until its SEND books it.
        schedules, stats, pos, pause_s, sent = self.schedules, self.stats, self.pos, self.pause_s, self.sent
        compute_s, send, book, order, started = self.compute_s, self.queue.send, self._book, self.order, self.started
        heappop, heappush = heapq.heappop, heapq.heappush
        rank = {stage: i for i, stage in enumerate(schedules)}
        ids: dict[tuple[int, str, int | None, str], int] = {}  # an action's boundary (of_action is slow)
        ready = [(stats[s].busy_until_s, rank[s], s) for s, acts in schedules.items() if pos[s] < len(acts)]
        heapq.heapify(ready)
        waiting: dict[tuple[int, int], int] = {}  # a transfer not sent -> the stage stopped at its RECV
        while ready:
            _, r, stage = heappop(ready)
            acts, st, i = schedules[stage], stats[stage], pos[stage]
            # the stage runs on while it would be the heap's first again (ranks differ: no ties)
            while True:
                a = acts[i]
                kind = a.kind
                now = st.busy_until_s
                if kind in COMPUTE:
                    dur = compute_s[(stage, kind)]
                    st.timeline.append((a.text, now, now + dur))
                    st.compute_s += dur
                    st.busy_until_s = now + dur
                else:
                    b = ids.get((stage, kind, a.peer, a.tensor))
                    if b is None:
                        key = BoundaryKey.of_action(stage, a)
                        b = self.ids[key] if kind in SENDS else self.ids.get(key, -1)
                        ids[(stage, kind, a.peer, a.tensor)] = b
                    if kind in SENDS:
                        for transfer, at in send((b, a.mb), now):
                            book(transfer, at)
                            peer = waiting.pop(transfer, None)
                            if peer is not None:  # its RECV can run now, from when the peer is free
                                heappush(ready, (stats[peer].busy_until_s, rank[peer], peer))
                    else:  # RECV_F / RECV_B: wait for the matching SEND's arrival
                        arrival = sent.get((b, a.mb))
                        if arrival is None:
                            waiting[(b, a.mb)] = stage  # the peer has not sent yet: other stages first
                            break
                        wait = max(0.0, arrival - now)
                        st.exposed_comm_s += wait
                        st.busy_until_s = now + wait
                if pause_s:  # none: no lookup (adding 0.0 changes no time)
                    st.busy_until_s += pause_s.get((stage, i), 0.0)
                i += 1
                order.append((stage, a))
                started.append(now)
                if i == len(acts):
                    break
                busy = st.busy_until_s
                if ready:
                    top = ready[0]
                    if not (busy < top[0] or (busy == top[0] and r < top[1])):
                        heappush(ready, (busy, r, stage))
                        break
            pos[stage] = i
        if waiting:
            blocked = {s: str(acts[pos[s]]) for s, acts in schedules.items() if pos[s] < len(acts)}
            raise ValueError(f"schedule deadlocks: stages wait on {blocked}")

    def _book(self, transfer: tuple[int, int], ready: float) -> None:
        end = self.links.book(transfer[0], ready)
        self.sent[transfer] = end
        self.stats[self.keys[transfer[0]].src].comm_s += end - ready
        self.bookings += 1

    def result(self) -> PipelineResult:
        """The run so far (a copy: extending the run leaves it as it is)."""
        stats = {s: replace(st, timeline=list(st.timeline)) for s, st in self.stats.items()}
        step_s = max((s.busy_until_s for s in stats.values()), default=0.0)
        transfer_s = {key: t.seconds for key, t in zip(self.keys, self.transfers)}
        return PipelineResult(step_s, stats, transfer_s, tuple(self.order), tuple(self.started))


def _link_groups(
    transfers: Sequence[TransferCost], split: Callable[[Link], object]
) -> tuple[list[tuple[int, ...]], list[list[Link]]]:
    """The NIC links in groups, each of the links the same boundaries use (and `split` tells apart): a
    transfer takes a group whole, so its links keep one state. Per boundary, its groups; per group, its links."""
    users: dict[Link, list[int]] = {}
    for b, t in enumerate(transfers):
        for link in t.per_link:
            users.setdefault(link, []).append(b)
    index: dict[tuple[tuple[int, ...], object], int] = {}
    members: list[list[Link]] = []
    group_of: dict[Link, int] = {}
    for link, boundaries in users.items():
        g = index.setdefault((tuple(boundaries), split(link)), len(members))
        if g == len(members):
            members.append([])
        members[g].append(link)
        group_of[link] = g
    return [tuple(dict.fromkeys(group_of[link] for link in t.per_link)) for t in transfers], members


class _PipelineLinks:
    """The NIC links of simulate_pipeline's transfers, booked in groups (_link_groups): without a token
    bucket the links one transfer frees together share one free time (in-links apart: a paced transfer frees
    them sooner); with one, each link keeps its tokens, a group of its own. The same times as Links."""

    def __init__(self, transfers: Sequence[TransferCost], cost: CostModel) -> None:
        self.network = cost.network
        self.nic_bytes_per_s = cost.nic_bytes_per_s
        local = next((link for t in transfers for link in t.per_link if link[1] == "local"), None)
        if local is not None:  # a transfer's hops inside a host are in its seconds, not on a link here
            raise ValueError(f"link {local!r} is invalid here: a transfer's bytes per NIC link, (host, 'out'|'in')")
        bucket = self.network.burst_bytes > 0
        split: Callable[[Link], object] = (lambda link: link) if bucket else (lambda link: link[1] == "in")
        self.groups_of, members = _link_groups(transfers, split)
        self.inbound = [group[0][1] == "in" for group in members]
        self.free = [0.0] * len(members)  # when each group's last booking ends
        self.tokens: list[tuple[float, float]] = [(self.network.burst_bytes, 0.0)] * len(members)  # (tokens, at)
        self.transfers = transfers
        # with a bucket, each group is one link: its bytes per boundary
        self.nbytes = [
            tuple(t.per_link[members[g][0]] for g in groups) if bucket else ()
            for t, groups in zip(transfers, self.groups_of)
        ]
        self.top = [max(t.per_link.values(), default=0.0) for t in transfers]  # the busiest link's bytes

    def book(self, b: int, ready: float) -> float:
        """Book one microbatch's transfer of boundary `b`, sent at `ready`, on its links: when it has landed."""
        seconds, _, early = self.transfers[b]
        groups = self.groups_of[b]
        free = self.free
        start = max([ready] + [free[g] for g in groups])
        n = self.network
        if early is not None:  # paced (TransferCost): its links for its plain makespan, the bucket unused
            done = start + seconds
            landed = max(start, done - early)
            for g in groups:
                free[g] = landed if self.inbound[g] else done
                if n.burst_bytes > 0:
                    self.tokens[g] = (n.burst_bytes, done)
            return landed
        # the busiest link's share goes through the (token-bucket) links; the rest of the transfer's
        # makespan (chain fill, intra-host hops) is added as it is
        top = self.top[b]
        if n.burst_bytes <= 0:
            end = start + top / n.nic_bytes_per_s  # max(m / rate) over the links is (max m) / rate
        else:
            wire = 0.0
            for g, m in zip(groups, self.nbytes[b]):
                tokens, at = self.tokens[g]
                tokens = min(n.burst_bytes, tokens + (start - at) * n.nic_bytes_per_s)
                wire = max(wire, m / n.line_bytes_per_s, (m - tokens) / n.nic_bytes_per_s)
                self.tokens[g] = (tokens - m, start)  # negative: still owed, refilled at the NIC rate
            end = start + wire
        end += max(0.0, seconds - top / self.nic_bytes_per_s)
        for g in groups:
            free[g] = end
        return end


class _LinkQueue:
    """Which sent transfers may take their links: all of them at once without a planned order; with one,
    a transfer once it is first among the unbooked transfers planned on each of its NIC links (per link
    group: the links of a group are planned the same transfers). A transfer: (boundary number, mb)."""

    def __init__(self, groups_of: Sequence[tuple[int, ...]], groups: int, planned: bool) -> None:
        self.groups_of = groups_of
        self.planned = planned
        self.heads: list[collections.deque[tuple[int, int]]] = [collections.deque() for _ in range(groups)]
        self.ready: dict[tuple[int, int], float] = {}  # sent, waiting for their links
        self.arrived: dict[tuple[int, int], int] = {}  # when each was sent, as a count

    def plan(self, order: Sequence[tuple[int, int]]) -> None:
        """Append `order` to the links' planned order."""
        for transfer in order:
            for g in self.groups_of[transfer[0]]:
                self.heads[g].append(transfer)

    def send(self, transfer: tuple[int, int], now: float) -> list[tuple[tuple[int, int], float]]:
        """`transfer` is sent at `now`: the transfers that take their links now, in order, each with the
        time it was sent."""
        if not self.planned:
            return [(transfer, now)]
        self.ready[transfer] = now
        self.arrived[transfer] = len(self.arrived)
        # No other ready transfer was first on all its links (the last call took every one that was), so
        # only this one can start; then only new heads of links just freed: rounds of those, each round
        # the ones first on all their links, in the order they were sent.
        if not self._first(transfer):
            return []
        heads, ready = self.heads, self.ready
        out: list[tuple[tuple[int, int], float]] = []
        batch = [transfer]
        while batch:
            freed: list[int] = []
            for t in batch:
                for g in self.groups_of[t[0]]:
                    heads[g].popleft()
                    freed.append(g)
                out.append((t, ready.pop(t)))
            batch = []
            for g in freed:
                if heads[g]:
                    t = heads[g][0]
                    if t in ready and t not in batch and self._first(t):
                        batch.append(t)
            if len(batch) > 1:
                batch.sort(key=self.arrived.__getitem__)
        return out

    def _first(self, transfer: tuple[int, int]) -> bool:
        heads = self.heads
        for g in self.groups_of[transfer[0]]:
            if not heads[g] or heads[g][0] != transfer:
                return False
        return True


def compute_costs(plan: PlanView, cost: CostModel) -> dict[tuple[int, str], float]:
    """Per stage: F, B, I, W seconds for one microbatch (measured, or from layers and parallel degrees)."""
    out: dict[tuple[int, str], float] = {}
    for i, c in cost.stage_costs(plan.job).items():
        out[(i, "F")], out[(i, "B")], out[(i, "I")], out[(i, "W")] = (
            c.forward_s,
            c.backward_s,
            c.input_grad_s,
            c.weight_grad_s,
        )
    return out


def transfer_costs(plan: PlanView, cost: CostModel) -> dict[BoundaryKey, TransferCost]:
    """Simulate every boundary of the plan once on plain links: its makespan and its bytes per NIC link
    (token buckets act across transfers, in the pipeline simulation), and whether it is paced."""
    plain = replace(cost.network, burst_bytes=0.0)
    itemsize = plan.job.training.activation_itemsize  # the wire's dtype is the job's, whatever the cost model
    out: dict[BoundaryKey, TransferCost] = {}
    for b in plan.boundaries:
        res = simulate_transfer(b.steps, plan.placement.host_of, plain, itemsize)
        out[b.key] = TransferCost(
            res.makespan_s,
            dict(res.nic_bytes),
            paced_early_s(b.steps, plan.placement.host_of, res, cost.network, itemsize),
        )
    return out


def paced_early_s(
    steps: Sequence[Step], host_of: Callable[[int], int], res: TransferResult, network: NetworkModel, itemsize: int = 4
) -> float | None:
    """TransferCost.early_s of a boundary: None unless every message between hosts is above
    network.alone_bytes (> 0); else how much sooner than its link time its last such message lands:
    held to the NIC rate, it leaves from a full bucket (max(m / line rate, (m - burst) / NIC rate))."""
    nic = [s for s in steps if host_of(s.src) != host_of(s.dst)]
    if network.alone_bytes <= 0 or not nic or any(s.signal or s.nbytes(itemsize) <= network.alone_bytes for s in nic):
        return None
    last = max(nic, key=lambda s: res.finish_s[s.id])
    m = last.nbytes(itemsize)
    if network.burst_bytes <= 0:
        return 0.0
    wire = max(m / network.line_bytes_per_s, (m - network.burst_bytes) / network.nic_bytes_per_s)
    return max(0.0, m / network.nic_bytes_per_s - wire)


def plan_cost(plan: PlanView) -> CostModel:
    """The costs the plan was made with: its network and its stages' compute."""
    return CostModel(network=plan.network, stages=tuple(plan.stage_costs[s] for s in sorted(plan.stage_costs)))


def simulate_plan(plan: PlanView, cost: CostModel | None = None, follow_plan_order: bool = True) -> PipelineResult:
    """The plan's step on `cost` (default: the plan's own). The executor issues transfers in the plan's
    order (meshjob.plan.comm_order.transfer_order, chosen on the plan's own costs); the links follow it here
    too (`follow_plan_order`), on other costs (another NIC rate or bucket, measured compute) as well,
    where a run on those costs alone would not. Without it, each link takes transfers as they are sent."""
    cost = cost or CostModel(network=plan.network)
    order = plan.transfer_order.transfers if follow_plan_order else None
    return simulate_pipeline(plan.schedules, compute_costs(plan, cost), transfer_costs(plan, cost), cost, order)


def bubble_1f1b(stages: int, microbatches: int) -> float:
    """Analytic bubble fraction of 1F1B/GPipe without communication: (S-1)/(M+S-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def broadcast_time(t: float, hosts: int, chunks: int) -> float:
    """Zhuang et al., 2022, §3.1: T_bc = t + (A-1) t / K."""
    return t + (hosts - 1) * t / chunks


def scale_job(job: TrainingJob, hosts: int) -> TrainingJob:
    """The same job spread over `hosts` hosts: each stage's mesh dim 0 grows to hosts/S (data parallel over it),
    the global batch grows so every data-parallel replica keeps whole samples. Re-validated like a manifest."""
    per_stage = max(1, hosts // len(job.stages))
    doc = job_to_dict(job)
    degrees = []
    for stage in doc["spec"]["stages"]:
        stage["mesh"] = [per_stage] + list(stage["mesh"][1:])
        if stage.get("tensorParallelDim") == 0:  # dim 0 now spans hosts: keep tensor parallel inside hosts
            stage.pop("tensorParallelDim")
        listed = stage.pop("dataParallelDims", None)
        dims = [0] if listed is None else sorted({0, *listed})  # dim 0 joins the data-parallel dims, major first
        if listed is None:
            stage["dataParallelDim"] = 0
        else:
            stage["dataParallelDims"] = dims
        degrees.append(math.prod(stage["mesh"][d] for d in dims))
    doc["spec"].pop("edges", None)  # default edges follow the new natural layouts
    training = doc["spec"]["training"]
    unit = training["microbatches"] * math.lcm(*degrees)
    training["globalBatch"] = max(unit, -(-training["globalBatch"] // unit) * unit)
    return parse_job(doc)


def summarize(plan: PlanView, result: PipelineResult) -> list[dict[str, Any]]:
    """One row per boundary: simulated transfer makespan vs the plan's balanced estimate and lower bound."""
    rows: list[dict[str, Any]] = []
    for b in plan.boundaries:
        rows.append(
            {
                "boundary": str(b.key),
                "simulated_s": result.transfer_s[b.key],
                "planned_s": b.makespan_s,
                "lower_bound_s": b.lower_bound_s,
            }
        )
    return rows
