"""Host-level sender choice and ordering of unit tasks, with a NIC cost model (§3.2 of
"On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022)).

Model: hosts are the bottleneck. A task, once its sender host is chosen, occupies that host and
every receiving host for its whole duration (the strategy's cost formula with t = bytes / NIC
bandwidth; intra-host time ignored), so tasks that share a host never overlap. A schedule is a
sender per task plus an order; each task then starts at the earliest time all of its hosts are
free (list scheduling), which is what the trainer's per-host execution order produces.

Balancers: `naive` (lowest-index sender host, given order), `load_balance` (longest first onto the
least-loaded sender host), `dfs` (branch and bound over sender and order, work budget), `greedy`
(randomized rounds of non-overlapping tasks, seeded, best of many tries).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from meshjob.resharding import STRATEGIES

BALANCERS = ("naive", "load_balance", "dfs", "greedy")


@dataclass(frozen=True)
class HostTask:
    sender_hosts: tuple[int, ...]  # hosts holding the slice (any one may send)
    receiver_hosts: tuple[int, ...]  # hosts needing it
    bytes: int


@dataclass(frozen=True)
class Schedule:
    sender_host: tuple[int, ...]  # per task
    start_s: tuple[float, ...]
    seconds: tuple[float, ...]  # duration of each task
    makespan_s: float
    lower_bound_s: float
    balancer: str
    finished: bool = True  # False when dfs ran out of budget (the result is the best found)

    @property
    def order(self) -> tuple[int, ...]:
        """Task indices by start time (ties by index): the order hosts execute them in."""
        return tuple(sorted(range(len(self.start_s)), key=lambda i: (self.start_s[i], i)))


def task_seconds(task: HostTask, sender_host: int, strategy: str, chunks: int,
                 receiver_devices_per_host: int, nic_bytes_per_s: float) -> float:
    """Seconds the task takes from `sender_host` (Zhuang et al., 2022, §3.1) with A receiving
    hosts other than the sender's, B devices each, t = bytes / bandwidth (K = chunks)."""
    a = sum(1 for h in task.receiver_hosts if h != sender_host)
    if a == 0:
        return 0.0
    if strategy == "signal":
        return a / nic_bytes_per_s  # 1 byte along the broadcast chain
    t = task.bytes / nic_bytes_per_s
    if strategy == "send_recv":
        return a * receiver_devices_per_host * t
    if strategy == "local_allgather":
        return a * t
    if strategy == "global_allgather":
        return 2 * t if a > 1 else t  # one receiving host: its all-gather stays intra-host
    if strategy == "broadcast":
        return t + (a - 1) * t / chunks
    raise ValueError(f"strategy {strategy!r} is invalid: one of {', '.join(STRATEGIES)}")


def lower_bound(tasks: Sequence[HostTask], nic_bytes_per_s: float) -> float:
    """Max over hosts of the bytes its NIC must move / bandwidth. A receiving host must take in
    every slice it does not hold; a host must send what only it holds; and the hosts that can send
    share at least evenly what must cross the network in any case."""
    forced: dict[int, int] = {}
    pooled, pool_hosts = 0, set()
    for task in tasks:
        for h in set(task.receiver_hosts) - set(task.sender_hosts):
            forced[h] = forced.get(h, 0) + task.bytes
        if all(set(task.receiver_hosts) - {s} for s in task.sender_hosts):  # every sender must send
            pooled += task.bytes
            pool_hosts.update(task.sender_hosts)
            if len(set(task.sender_hosts)) == 1:
                h = task.sender_hosts[0]
                forced[h] = forced.get(h, 0) + task.bytes
    most = max(forced.values(), default=0)
    if pool_hosts:
        most = max(most, pooled / len(pool_hosts))
    return most / nic_bytes_per_s


# Budgets are work, not wall time: every rank builds its plan on its own and all must agree, so a
# search may not stop at a different point on a busier machine. budget_s is converted with these
# rates, measured on a 2-core development machine (about one second of work per budget second).
DFS_NODES_PER_SECOND = 100_000
GREEDY_TASK_TRIES_PER_SECOND = 10_000  # tries x tasks


def work_budget(budget_s: float, per_second: float) -> int:
    return max(1, int(budget_s * per_second))


def balance(tasks: Sequence[HostTask], balancer: str, strategy: str, chunks: int,
            nic_bytes_per_s: float, budget_s: float = 1.0, seed: int = 0,
            receiver_devices_per_host: int = 1) -> Schedule:
    """Choose a sender host and a start time for every task with the named balancer."""
    if balancer not in BALANCERS:
        raise ValueError(f"balancer {balancer!r} is invalid: one of {', '.join(BALANCERS)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is invalid: one of {', '.join(STRATEGIES)}")
    for i, task in enumerate(tasks):
        if not task.sender_hosts or not task.receiver_hosts:
            raise ValueError(f"tasks[{i}]: {task} is invalid: at least one sender and one receiver host")
    if nic_bytes_per_s <= 0:
        raise ValueError(f"nic_bytes_per_s {nic_bytes_per_s!r} is invalid: a positive number")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks {chunks!r} is invalid: an integer >= 1")
    if budget_s < 0:
        raise ValueError(f"budget_s {budget_s!r} is invalid: a number >= 0")
    bound = lower_bound(tasks, nic_bytes_per_s)
    problem = _Problem(tasks, lambda t, s: task_seconds(t, s, strategy, chunks, receiver_devices_per_host,
                                                        nic_bytes_per_s))
    if balancer == "naive":
        moves, finished = [(i, min(t.sender_hosts)) for i, t in enumerate(tasks)], True
    elif balancer == "load_balance":
        moves, finished = _load_balance(problem), True
    elif balancer == "dfs":
        moves, finished = _dfs(problem, budget_s, bound)
    else:
        moves, finished = _greedy(problem, budget_s, seed, bound), True
    return problem.schedule(moves, balancer, bound, finished)


# ------------------------------------------------------------------------------ shared machinery
Move = tuple[int, int]  # (task index, sender host), in execution order


class _Problem:
    """Tasks with per-sender durations and the hosts each (task, sender) occupies."""

    def __init__(self, tasks: Sequence[HostTask], seconds: Callable[[HostTask, int], float]):
        self.tasks = list(tasks)
        self.senders: list[tuple[int, ...]] = []
        self.duration: list[dict[int, float]] = []  # per task: sender host -> seconds
        self.hosts: list[dict[int, tuple[int, ...]]] = []  # per task: sender host -> hosts occupied
        seen: dict[HostTask, tuple] = {}  # identical tasks share their tables
        for t in tasks:
            if t not in seen:
                ss = tuple(dict.fromkeys(t.sender_hosts))
                seen[t] = (ss, {s: seconds(t, s) for s in ss},
                           {s: tuple(dict.fromkeys((s,) + t.receiver_hosts)) for s in ss})
            ss, duration, hosts = seen[t]
            self.senders.append(ss)
            self.duration.append(duration)
            self.hosts.append(hosts)

    def classes(self) -> list[list[int]]:
        """Task indices grouped by (senders, receivers, bytes): interchangeable tasks."""
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(self.tasks):
            groups.setdefault((self.senders[i], t.receiver_hosts, t.bytes), []).append(i)
        return list(groups.values())

    def schedule(self, moves: list[Move], balancer: str, bound: float, finished: bool) -> Schedule:
        """List scheduling: each task starts once all of its hosts finished their earlier tasks."""
        n = len(self.tasks)
        sender, start, seconds = [0] * n, [0.0] * n, [0.0] * n
        free: dict[int, float] = {}
        for i, s in moves:
            hosts = self.hosts[i][s]
            begin = max((free.get(h, 0.0) for h in hosts), default=0.0)
            end = begin + self.duration[i][s]
            for h in hosts:
                free[h] = end
            sender[i], start[i], seconds[i] = s, begin, self.duration[i][s]
        assert sorted(i for i, _ in moves) == list(range(n)), "every task scheduled exactly once"
        makespan = max((b + d for b, d in zip(start, seconds)), default=0.0)
        return Schedule(tuple(sender), tuple(start), tuple(seconds), makespan, bound, balancer, finished)


def _load_balance(p: _Problem) -> list[Move]:
    """Longest task first onto the sender host with the least work so far (Zhuang et al., 2022, §3.2)."""
    load: dict[int, float] = {}
    moves = []
    for i in sorted(range(len(p.tasks)), key=lambda i: -min(p.duration[i].values())):
        s = min(p.senders[i], key=lambda s: (load.get(s, 0.0) + p.duration[i][s], s))
        load[s] = load.get(s, 0.0) + p.duration[i][s]
        moves.append((i, s))
    return moves


# ------------------------------------------------------------------------------ dfs
def _dfs(p: _Problem, budget_s: float, bound: float) -> tuple[list[Move], bool]:
    """Branch and bound over (next task, its sender), tasks taken in start-time order.

    Pruning: (1) a node's bound is max over hosts of (when the host is free + the work that must
    still run on it); branches whose bound cannot beat the best makespan are cut. (2) Identical
    tasks are interchangeable, so only one of each class is branched on. (3) Only tasks that could
    start before the earliest possible finish of any candidate are branched on (active schedules:
    some optimal schedule has this form). The search ends early when a schedule meets the lower
    bound (proved optimal). Returns the best found and whether the search finished.
    """
    max_nodes = work_budget(budget_s, DFS_NODES_PER_SECOND)
    members = p.classes()
    count = [len(m) for m in members]
    rep = [m[0] for m in members]
    # Work every remaining instance of a class must do on a host, whichever sender it gets.
    forced = []
    for i in rep:
        must = set.intersection(*(set(h) for h in p.hosts[i].values()))
        forced.append({h: min(p.duration[i].values()) for h in must})
    remaining: dict[int, float] = {}
    for c, f in enumerate(forced):
        for h, d in f.items():
            remaining[h] = remaining.get(h, 0.0) + d * count[c]

    best = _load_balance(p)
    best_makespan = p.schedule(best, "dfs", 0.0, True).makespan_s
    if best_makespan <= bound * (1 + 1e-9):
        return best, True
    free: dict[int, float] = {}
    path: list[tuple[int, int]] = []  # (class, sender)
    makespan = 0.0
    nodes = 0
    finished = True

    def children() -> list[tuple[float, float, int, int]]:
        out = []
        for c, n in enumerate(count):
            if n:
                i = rep[c]
                busy_until = max(free.get(h, 0.0) for h in p.tasks[i].receiver_hosts)
                for s in p.senders[i]:
                    est = max(busy_until, free.get(s, 0.0))
                    out.append((est + p.duration[i][s], est, c, s))
        if not out:
            return out
        first = min(out)
        return sorted(x for x in out if x[1] < first[0] or x == first)

    stack = [(children(), 0, None)]  # frames: (children, next child, undo info of the move in)
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
        nodes += 1
        if nodes >= max_nodes:
            finished = False
            break
        end, est, c, s = kids[k]
        i = rep[c]
        hosts = p.hosts[i][s]
        new_makespan = max(makespan, end)
        # Bound after the move: hosts get `end`, the class's forced work leaves `remaining`.
        node_bound = new_makespan
        for h, rest in remaining.items():
            start_h = end if h in hosts else free.get(h, 0.0)
            node_bound = max(node_bound, start_h + rest - forced[c].get(h, 0.0))
        if node_bound >= best_makespan - 1e-12:
            continue
        old_free = {h: free.get(h) for h in hosts}
        for h in hosts:
            free[h] = end
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
def _greedy(p: _Problem, budget_s: float, seed: int, bound: float, samples: int = 4, scan: int = 256,
            max_tries: int = 200) -> list[Move]:
    """Seed 000's randomized greedy, run at every moment hosts become free: at time `now`, among
    the tasks whose hosts are all free, pick a large non-overlapping set (the best, by hosts kept
    busy then work, of `samples` random walks over the unscheduled tasks, each looking at most at
    `scan` of them), start it, and move `now` to the next finish. With equal tasks this is the
    paper's rounds; with unequal ones no host waits for a round to end. A task takes the free
    sender host with the shortest duration. Identical tasks always conflict (same receivers), so
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


def _greedy_try(p: _Problem, members: list[list[int]], rng: random.Random, samples: int,
                scan: int) -> list[Move]:
    taken = [0] * len(members)
    pending = list(range(len(members)))  # classes with tasks left
    free: dict[int, float] = {}  # host -> when it finishes its last started task
    moves: list[Move] = []
    now = 0.0
    while pending:
        busy_now = {h for h, end in free.items() if end > now + 1e-12}
        best_set: list[tuple[int, int, int]] = []  # (position in pending, class, sender)
        best_score = (0, -1.0)
        for _ in range(samples):
            chosen, busy, work = [], set(busy_now), 0.0
            for pos in rng.sample(range(len(pending)), min(len(pending), scan)):
                c = pending[pos]
                i = members[c][0]
                fits = [s for s in p.senders[i] if busy.isdisjoint(p.hosts[i][s])]
                if fits:
                    s = min(fits, key=lambda s: (p.duration[i][s], s))
                    chosen.append((pos, c, s))
                    busy.update(p.hosts[i][s])
                    work += p.duration[i][s]
            if (len(chosen), work) > best_score:
                best_set, best_score = chosen, (len(chosen), work)
        for _, c, s in best_set:
            i = members[c][taken[c]]
            taken[c] += 1
            for h in p.hosts[i][s]:
                free[h] = now + p.duration[i][s]
            moves.append((i, s))
        for pos in sorted((pos for pos, c, _ in best_set if taken[c] == len(members[c])), reverse=True):
            pending[pos] = pending[-1]
            pending.pop()
        later = [end for end in free.values() if end > now + 1e-12]
        if later:
            now = min(later)
        elif not best_set:
            raise AssertionError("greedy: no task fits while every host is free")
    return moves
