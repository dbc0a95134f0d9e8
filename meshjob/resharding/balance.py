"""Host-level sender choice and ordering of unit tasks ("On Optimizing the Communication of Model
Parallelism", Zhuang et al., 2022, §3.2) on the one network model (meshjob.network.model).

Model: a task, once its sender host is chosen, holds the NIC links the network model names for it
(full duplex: the sender's out-link, every receiving host's in-link, a chain's forwarding hosts'
out-links; half duplex, the paper's constraint 3: whole hosts) for its whole duration, so tasks
that share a link never overlap. A schedule is a sender per task plus an order; each task then
starts at the earliest time all of its links are free (list scheduling), which is what a per-link
ordered executor produces.

Balancers: `naive` (lowest-index sender host, given order), `load_balance` (longest first onto the
least-loaded sender host), `dfs` (branch and bound over sender and order, work budget), `greedy`
(randomized rounds of non-overlapping tasks, seeded, best of many tries). `list_schedule` times a
given choice of senders and order (joint plans re-time each boundary's share with it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshjob.network.host_task import HostTask, Link, TaskCost
from meshjob.network.model import NetworkModel
from meshjob.resharding.strategies import by_name, task_cost


@dataclass(frozen=True)
class Schedule:
    sender_host: tuple[int, ...]  # per task
    start_s: tuple[float, ...]
    seconds: tuple[float, ...]  # duration of each task
    makespan_s: float
    lower_bound_s: float
    balancer: str
    finished: bool = True  # False when dfs ran out of budget (the result is the best found)
    chunks: tuple[int, ...] = ()  # K of each task (broadcast; 1 otherwise)
    sequence: tuple[int, ...] = ()  # the list-scheduling order the start times come from

    @property
    def order(self) -> tuple[int, ...]:
        """The order tasks were scheduled in: every link runs its tasks in this order. (A task may
        start before an earlier one that holds its links only later, e.g. a chain's last hop.)"""
        if self.sequence:
            return self.sequence
        return tuple(sorted(range(len(self.start_s)), key=lambda i: (self.start_s[i], i)))


def task_seconds(task: HostTask, sender_host: int, strategy: str, chunks: int | str, network: NetworkModel) -> float:
    """Seconds the task takes from `sender_host` on the network model."""
    return task_cost(network, task, sender_host, strategy, chunks).seconds


def lower_bound(tasks: Sequence[HostTask], network: NetworkModel) -> float:
    return network.lower_bound(tasks)


# Budgets are work, not wall time: every rank builds its plan on its own and all must agree, so a
# search may not stop at a different point on a busier machine. budget_s is converted with these
# rates, measured on a 2-core development machine (about one CPU second of work per budget second,
# on the network model's links: `meshjob bench planner` shows the planning times).
DFS_WORK_PER_SECOND = 150_000  # nodes visited + (class, sender) candidates evaluated
GREEDY_TASK_TRIES_PER_SECOND = 4_000  # tries x tasks


def work_budget(budget_s: float, per_second: float) -> int:
    return max(1, int(budget_s * per_second))


def _check(tasks: Sequence[HostTask], strategy: str, chunks: int | str, network: NetworkModel) -> None:
    by_name(strategy)
    for i, task in enumerate(tasks):
        if not task.sender_hosts or not task.receiver_hosts:
            raise ValueError(f"tasks[{i}]: {task} is invalid: at least one sender and one receiver host")
    if not isinstance(network, NetworkModel):
        raise ValueError(f"network {network!r} is invalid: a meshjob.network.model.NetworkModel")
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"chunks {chunks!r} is invalid: auto or an integer >= 1")


def balance(
    tasks: Sequence[HostTask],
    balancer: str,
    strategy: str,
    network: NetworkModel,
    chunks: int | str = "auto",
    budget_s: float = 1.0,
    seed: int = 0,
) -> Schedule:
    """Choose a sender host and a start time for every task with the named balancer."""
    if balancer not in BALANCERS:
        raise ValueError(f"balancer {balancer!r} is invalid: one of {', '.join(BALANCERS)}")
    _check(tasks, strategy, chunks, network)
    if budget_s < 0:
        raise ValueError(f"budget_s {budget_s!r} is invalid: a number >= 0")
    bound = network.lower_bound(tasks)
    problem = _Problem(tasks, lambda t, s: task_cost(network, t, s, strategy, chunks), network.with_cpu)
    moves, finished = BALANCERS[balancer](problem, budget_s, seed, bound)
    return problem.schedule(moves, balancer, bound, finished)


def list_schedule(
    tasks: Sequence[HostTask],
    senders: Sequence[int],
    order: Sequence[int],
    strategy: str,
    network: NetworkModel,
    chunks: int | str = "auto",
    balancer: str = "given",
) -> Schedule:
    """Time a given sender host per task, tasks taken in `order` (list scheduling)."""
    _check(tasks, strategy, chunks, network)
    problem = _Problem(tasks, lambda t, s: task_cost(network, t, s, strategy, chunks), network.with_cpu)
    moves = [(i, senders[i]) for i in order]
    return problem.schedule(moves, balancer, network.lower_bound(tasks), True)


# ------------------------------------------------------------------------------ shared machinery
Move = tuple[int, int]  # (task index, sender host), in execution order
# One task's tables, per sender host: (senders, seconds, links held, (link, offset, busy) holds, K, CPU seconds,
# seconds on the links alone).
_Tables = tuple[
    tuple[int, ...],
    dict[int, float],
    dict[int, tuple[Link, ...]],
    dict[int, tuple[tuple[Link, float, float], ...]],
    dict[int, int],
    dict[int, float],
    dict[int, float],
]


class _Problem:
    """Tasks with per-sender durations and the links each (task, sender) holds."""

    def __init__(
        self,
        tasks: Sequence[HostTask],
        cost: Callable[[HostTask, int], TaskCost],
        with_cpu: Callable[[float, float], float] = max,
    ):
        self.tasks = list(tasks)
        self.with_cpu = with_cpu  # (links' seconds, cores' seconds) -> seconds: NetworkModel.with_cpu
        self.senders: list[tuple[int, ...]] = []
        self.duration: list[dict[int, float]] = []  # per task: sender host -> seconds
        self.links: list[dict[int, tuple[Link, ...]]] = []  # per task: sender host -> links held
        self.holds: list[dict[int, tuple[tuple[Link, float, float], ...]]] = []  # ... (link, offset, busy)
        self.chunks: list[dict[int, int]] = []  # per task: sender host -> K
        self.cpu: list[dict[int, float]] = []  # per task: sender host -> seconds of the shared cores
        self.link_s: list[dict[int, float]] = []  # per task: sender host -> seconds on the links alone
        seen: dict[HostTask, _Tables] = {}  # identical tasks share their tables
        for t in tasks:
            if t not in seen:
                ss = tuple(dict.fromkeys(t.sender_hosts))
                costs = {s: cost(t, s) for s in ss}
                seen[t] = (
                    ss,
                    {s: c.seconds for s, c in costs.items()},
                    {s: c.links for s, c in costs.items()},
                    {s: c.holds() for s, c in costs.items()},
                    {s: c.chunks for s, c in costs.items()},
                    {s: c.cpu_s for s, c in costs.items()},
                    {s: c.seconds if c.link_s is None else c.link_s for s, c in costs.items()},
                )
            ss, duration, links, holds, chunks, cpu, link_s = seen[t]
            self.senders.append(ss)
            self.duration.append(duration)
            self.links.append(links)
            self.holds.append(holds)
            self.chunks.append(chunks)
            self.cpu.append(cpu)
            self.link_s.append(link_s)

    def earliest(self, i: int, s: int, free: dict[Link, float]) -> float:
        """When task i from host s can start: each held link must be free by its offset."""
        begin = 0.0
        for link, off, _ in self.holds[i][s]:
            begin = max(begin, free.get(link, 0.0) - off)
        return begin

    def occupy(self, i: int, s: int, begin: float, free: dict[Link, float]) -> None:
        for link, off, busy in self.holds[i][s]:
            free[link] = begin + off + busy

    def classes(self) -> list[list[int]]:
        """Task indices grouped by equal HostTasks: interchangeable tasks."""
        groups: dict[HostTask, list[int]] = {}
        for i, t in enumerate(self.tasks):
            groups.setdefault(t, []).append(i)
        return list(groups.values())

    def schedule(self, moves: list[Move], balancer: str, bound: float, finished: bool) -> Schedule:
        """List scheduling: each task starts once all of its links finished their earlier tasks."""
        n = len(self.tasks)
        sender, start, seconds, chunks = [0] * n, [0.0] * n, [0.0] * n, [1] * n
        free: dict[Link, float] = {}
        for i, s in moves:
            if s not in self.duration[i]:
                raise ValueError(f"task {i}: host {s} is invalid: one of its sender hosts {self.senders[i]}")
            begin = self.earliest(i, s, free)
            self.occupy(i, s, begin, free)
            sender[i], start[i], seconds[i], chunks[i] = s, begin, self.duration[i][s], self.chunks[i][s]
        if sorted(i for i, _ in moves) != list(range(n)):
            raise ValueError("every task must be scheduled exactly once")
        makespan = max((b + d for b, d in zip(start, seconds)), default=0.0)
        # On shared cores (an emulated cluster) no schedule ends before they did every task's messages,
        # and where the links' time and the cores' are close, they contend as in one task (the simulator's
        # form; max(total CPU, list schedule) alone under-predicts CPU-bound chains).
        cpu = sum(self.cpu[i][s] for i, s in moves)
        if cpu > 0:
            on_links = max((start[i] + self.link_s[i][s] for i, s in moves), default=0.0)
            makespan = max(makespan, self.with_cpu(on_links, cpu))
        return Schedule(
            tuple(sender),
            tuple(start),
            tuple(seconds),
            makespan,
            bound,
            balancer,
            finished,
            tuple(chunks),
            tuple(i for i, _ in moves),
        )


def _load_balance(p: _Problem) -> list[Move]:
    """Longest task first onto the sender host whose links end least loaded (the paper's load
    balancing, with every link a task holds counted: a chain's forwarding hosts' out-links too);
    ties: the less loaded sender link, then the lower host."""
    load: dict[Link, float] = {}
    moves = []

    def after(i: int, s: int) -> tuple[float, float, int]:
        held = p.holds[i][s]
        peak = max((load.get(link, 0.0) + busy for link, _, busy in held), default=0.0)
        own = sum(load.get(link, 0.0) + busy for link, _, busy in held if link[0] == s)
        return peak, own, s

    for i in sorted(range(len(p.tasks)), key=lambda i: -min(p.duration[i].values())):
        s = min(p.senders[i], key=lambda s: after(i, s))
        for link, _, busy in p.holds[i][s]:
            load[link] = load.get(link, 0.0) + busy
        moves.append((i, s))
    return moves


# ------------------------------------------------------------------------------ dfs
_Child = tuple[float, float, int, int]  # (earliest finish, earliest start, class, sender)
_Undo = tuple[int, int, dict[Link, float | None], float]  # (class, sender, links' old free times, old makespan)


def _dfs(p: _Problem, budget_s: float, bound: float) -> tuple[list[Move], bool]:
    """Branch and bound over (next task, its sender), tasks taken in start-time order.

    Pruning: (1) a node's bound is max over links of (when the link is free + the time it must
    still be held); branches whose bound cannot beat the best makespan are cut. (2) Identical
    tasks are interchangeable, so only one of each class is branched on. Children are tried by
    earliest finish. (Branching only on tasks that could start before the earliest finish, the
    active schedules of a job shop, is not safe here: a task holds several links at once, and
    hypothesis found four tasks where it missed the optimum, 5.0 against 4.0.) The search ends early
    when a schedule meets the lower bound (proved optimal). Returns the best found and whether the
    search finished.
    """
    max_work = work_budget(budget_s, DFS_WORK_PER_SECOND)
    members = p.classes()
    count = [len(m) for m in members]
    rep = [m[0] for m in members]
    # Time every remaining instance of a class must hold a link, whichever sender it gets.
    forced = []
    for i in rep:
        must = set.intersection(*(set(h) for h in p.links[i].values()))
        forced.append(
            {h: min(busy for s in p.senders[i] for link, _, busy in p.holds[i][s] if link == h) for h in must}
        )
    remaining: dict[Link, float] = {}
    for c, f in enumerate(forced):
        for h, d in f.items():
            remaining[h] = remaining.get(h, 0.0) + d * count[c]

    best = _load_balance(p)
    best_makespan = p.schedule(best, "dfs", 0.0, True).makespan_s
    if best_makespan <= bound * (1 + 1e-9):
        return best, True
    free: dict[Link, float] = {}
    path: list[tuple[int, int]] = []  # (class, sender)
    makespan = 0.0
    work = 0  # nodes + candidates: a node's cost grows with the classes and senders it weighs
    finished = True

    def children() -> list[_Child]:
        nonlocal work
        out: list[_Child] = []
        for c, n in enumerate(count):
            if n:
                i = rep[c]
                for s in p.senders[i]:
                    est = p.earliest(i, s, free)
                    out.append((est + p.duration[i][s], est, c, s))
        work += len(out)
        if not out:
            return out
        return sorted(out)

    # frames: (children, next child, undo info of the move in)
    stack: list[tuple[list[_Child], int, _Undo | None]] = [(children(), 0, None)]
    while stack:
        kids, k, undo = stack[-1]
        if k == len(kids):
            stack.pop()
            if undo is not None:  # undo the move that created this frame
                c, s, old_free, old_makespan = undo
                path.pop()
                count[c] += 1
                for h, d in forced[c].items():
                    remaining[h] += d
                for h, v in old_free.items():
                    if v is None:
                        free.pop(h, None)
                    else:
                        free[h] = v
                makespan = old_makespan
            continue
        stack[-1] = (kids, k + 1, undo)
        work += 1
        if work >= max_work:
            finished = False
            break
        end, est, c, s = kids[k]
        i = rep[c]
        held = {link: est + off + busy for link, off, busy in p.holds[i][s]}
        new_makespan = max(makespan, end)
        # Bound after the move: held links are busy until `held`, the class's forced time leaves
        # `remaining`; a link's last task ends no earlier than the link frees.
        node_bound = new_makespan
        for h, rest in remaining.items():
            start_h = held.get(h, free.get(h, 0.0))
            node_bound = max(node_bound, start_h + rest - forced[c].get(h, 0.0))
        if node_bound >= best_makespan - 1e-12:
            continue
        old_free = {h: free.get(h) for h in held}
        free.update(held)
        count[c] -= 1
        for h, d in forced[c].items():
            remaining[h] -= d
        path.append((c, s))
        old_makespan, makespan = makespan, new_makespan
        if not any(count):
            best_makespan = makespan
            best = _expand(path, members)
            if best_makespan <= bound * (1 + 1e-9):
                break
        stack.append((children(), 0, (c, s, old_free, old_makespan)))
    return best, finished


def _expand(path: list[tuple[int, int]], members: list[list[int]]) -> list[Move]:
    """Class-level moves -> task-level moves (instances of a class taken in index order)."""
    taken = [0] * len(members)
    moves = []
    for c, s in path:
        moves.append((members[c][taken[c]], s))
        taken[c] += 1
    return moves


# ------------------------------------------------------------------------------ greedy
def _greedy(
    p: _Problem, budget_s: float, seed: int, bound: float, samples: int = 4, scan: int = 256, max_tries: int = 200
) -> list[Move]:
    """The paper's randomized greedy (Zhuang et al., 2022, §3.2), run at every moment links free up:
    at time `now`, among the tasks whose links are free when they need them, pick a large set sharing no link (the best,
    by tasks started then work, of `samples` random walks over the unscheduled tasks, each looking
    at most at `scan` of them), start it, and move `now` to the next release. With equal tasks this
    is the paper's rounds; with unequal ones no link waits for a round to end. A task takes the
    free sender host with the shortest duration. Identical tasks always conflict (same receivers), so
    walks are over classes of identical tasks. Tries repeat with fresh randomness until the
    budget is spent, `max_tries` are done or a try meets the lower bound (at least one try)."""
    rng = random.Random(seed)
    tries = min(max_tries, work_budget(budget_s, GREEDY_TASK_TRIES_PER_SECOND / max(1, len(p.tasks))))
    members = p.classes()
    best: list[Move] | None = None
    best_makespan = float("inf")
    for _ in range(tries):
        moves = _greedy_try(p, members, rng, samples, scan)
        makespan = p.schedule(moves, "greedy", 0.0, True).makespan_s
        if makespan < best_makespan - 1e-12:
            best, best_makespan = moves, makespan
        if best_makespan <= bound * (1 + 1e-9):
            break
    assert best is not None
    return best


def _greedy_try(p: _Problem, members: list[list[int]], rng: random.Random, samples: int, scan: int) -> list[Move]:
    taken = [0] * len(members)
    pending = list(range(len(members)))  # classes with tasks left
    free: dict[Link, float] = {}  # link -> when its last started task releases it
    moves: list[Move] = []
    now = 0.0
    while pending:
        est: dict[int, dict[int, float]] = {}  # class -> sender -> earliest start (this round)

        def earliest(c: int, est: dict[int, dict[int, float]] = est) -> dict[int, float]:
            if c not in est:
                i = members[c][0]
                est[c] = {s: p.earliest(i, s, free) for s in p.senders[i]}
            return est[c]

        if len(pending) <= scan:  # every class is looked at anyway: jump to when one can start
            now = max(now, min(min(earliest(c).values()) for c in pending))
        best_set: list[tuple[int, int, int]] = []  # (position in pending, class, sender)
        best_score = (0, -1.0)
        for _ in range(samples):
            chosen: list[tuple[int, int, int]] = []
            busy: set[Link] = set()
            work = 0.0
            for pos in rng.sample(range(len(pending)), min(len(pending), scan)):
                c = pending[pos]
                i = members[c][0]
                fits = [s for s, t in earliest(c).items() if t <= now + 1e-12 and busy.isdisjoint(p.links[i][s])]
                if fits:
                    s = min(fits, key=lambda s: (p.duration[i][s], s))
                    chosen.append((pos, c, s))
                    busy.update(p.links[i][s])
                    work += p.duration[i][s]
            if (len(chosen), work) > best_score:
                best_set, best_score = chosen, (len(chosen), work)
        for _, c, s in best_set:
            i = members[c][taken[c]]
            taken[c] += 1
            p.occupy(i, s, now, free)
            moves.append((i, s))
        for pos in sorted((pos for pos, c, _ in best_set if taken[c] == len(members[c])), reverse=True):
            pending[pos] = pending[-1]
            pending.pop()
        later = [end for end in free.values() if end > now + 1e-12]
        if later:
            now = min(later)
        elif not best_set:
            raise AssertionError("greedy: no task fits while every link is free")
    return moves


# ------------------------------------------------------------------------------ the registry
# A balancer: (problem, work budget in seconds, seed, lower bound) -> (moves, whether the search finished).
Balancer = Callable[[_Problem, float, int, float], tuple[list[Move], bool]]


def _naive(p: _Problem, budget_s: float, seed: int, bound: float) -> tuple[list[Move], bool]:
    return [(i, min(t.sender_hosts)) for i, t in enumerate(p.tasks)], True


def _least_loaded(p: _Problem, budget_s: float, seed: int, bound: float) -> tuple[list[Move], bool]:
    return _load_balance(p), True


def _branch_and_bound(p: _Problem, budget_s: float, seed: int, bound: float) -> tuple[list[Move], bool]:
    return _dfs(p, budget_s, bound)


def _randomized_rounds(p: _Problem, budget_s: float, seed: int, bound: float) -> tuple[list[Move], bool]:
    return _greedy(p, budget_s, seed, bound), True


BALANCERS: dict[str, Balancer] = {
    "naive": _naive,
    "load_balance": _least_loaded,
    "dfs": _branch_and_bound,
    "greedy": _randomized_rounds,
}
