"""The pipeline simulator as it was before it was made fast: the reference tests compare it with.

Each action, every stage sorted by when it is free and the first that can run goes; each NIC link booked on
its own; the steady period's steps simulated together from an empty pipeline.
"""

from __future__ import annotations

import collections
import statistics

from meshjob.costs.compute import CostModel
from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import PipelineResult, StageStats, TransferCost


class Links:
    def __init__(self, network):
        self.network = network
        self.free = {}
        self.tokens = {}

    def _seconds(self, link, nbytes, start):
        n = self.network
        if n.burst_bytes <= 0:
            return nbytes / n.nic_bytes_per_s
        tokens, at = self.tokens.get(link, (n.burst_bytes, 0.0))
        tokens = min(n.burst_bytes, tokens + (start - at) * n.nic_bytes_per_s)
        return max(nbytes / n.line_bytes_per_s, (nbytes - tokens) / n.nic_bytes_per_s)

    def book(self, links, nbytes, ready):
        start = max([ready] + [self.free.get(link, 0.0) for link in links])
        end = start + max((self._seconds(link, n, start) for link, n in zip(links, nbytes)), default=0.0)
        for link, n in zip(links, nbytes):
            self.free[link] = end
            if self.network.burst_bytes > 0:
                tokens, at = self.tokens.get(link, (self.network.burst_bytes, 0.0))
                tokens = min(self.network.burst_bytes, tokens + (start - at) * self.network.nic_bytes_per_s) - n
                self.tokens[link] = (tokens, start)
        return start, end

    def paced(self, per_link, ready, seconds, early_s):
        start = max([ready] + [self.free.get(link, 0.0) for link in per_link])
        done = start + seconds
        landed = max(start, done - early_s)
        for link in per_link:
            self.free[link] = landed if link[1] == "in" else done
            if self.network.burst_bytes > 0:
                self.tokens[link] = (self.network.burst_bytes, done)
        return landed


class LinkQueue:
    def __init__(self, transfers, order):
        self.transfers = transfers
        self.planned = order is not None
        self.heads = collections.defaultdict(collections.deque)
        for key, mb in order or ():
            for link in transfers[key][1]:
                self.heads[link].append((key, mb))
        self.ready = {}
        self.arrived = {}

    def send(self, key, mb, now):
        if not self.planned:
            return [(key, mb, now)]
        self.ready[(key, mb)] = now
        self.arrived[(key, mb)] = len(self.arrived)
        out = []
        batch = [(key, mb)] if self._first((key, mb)) else []
        while batch:
            freed = []
            for t in batch:
                for link in self.transfers[t[0]][1]:
                    self.heads[link].popleft()
                    freed.append(link)
                out.append((t[0], t[1], self.ready.pop(t)))
            candidates = {self.heads[link][0] for link in freed if self.heads[link]}
            batch = sorted((t for t in candidates if t in self.ready and self._first(t)), key=self.arrived.__getitem__)
        return out

    def _first(self, transfer):
        return all(self.heads[link] and self.heads[link][0] == transfer for link in self.transfers[transfer[0]][1])


def simulate_pipeline(schedules, compute_s, transfers, cost=None, order=None, pause_s=None) -> PipelineResult:
    cost = cost or CostModel()
    pause_s = pause_s or {}
    stats = {s: StageStats() for s in schedules}
    pos = {s: 0 for s in schedules}
    sent = {}
    links = Links(cost.network)
    queue = LinkQueue(transfers, order)
    remaining = sum(len(v) for v in schedules.values())
    run, started = [], []

    def book(key, mb, ready):
        seconds, per_link, early = TransferCost(*transfers[key])
        if early is not None:
            end = links.paced(per_link, ready, seconds, early)
        else:
            bottleneck = max(per_link.values(), default=0.0) / cost.nic_bytes_per_s
            _, end = links.book(list(per_link), list(per_link.values()), ready)
            end += max(0.0, seconds - bottleneck)
            for link in per_link:
                links.free[link] = end
        sent[(key, mb)] = end
        stats[key.src].comm_s += end - ready

    while remaining:
        progressed = False
        for stage in sorted(schedules, key=lambda s: stats[s].busy_until_s):
            acts = schedules[stage]
            if pos[stage] >= len(acts):
                continue
            a = acts[pos[stage]]
            st = stats[stage]
            now = st.busy_until_s
            if a.kind in ("F", "B", "I", "W"):
                dur = compute_s[(stage, a.kind)]
                st.timeline.append((str(a), now, now + dur))
                st.compute_s += dur
                st.busy_until_s = now + dur
            elif a.kind in ("SEND_F", "SEND_B"):
                for key, mb, ready in queue.send(BoundaryKey.of_action(stage, a), a.mb, now):
                    book(key, mb, ready)
            else:
                key = BoundaryKey.of_action(stage, a)
                if (key, a.mb) not in sent:
                    continue
                arrival = sent[(key, a.mb)]
                wait = max(0.0, arrival - now)
                st.exposed_comm_s += wait
                st.busy_until_s = now + wait
            st.busy_until_s += pause_s.get((stage, pos[stage]), 0.0)
            pos[stage] += 1
            remaining -= 1
            run.append((stage, a))
            started.append(now)
            progressed = True
            break
        if not progressed:
            raise ValueError("schedule deadlocks")
    step_s = max((s.busy_until_s for s in stats.values()), default=0.0)
    return PipelineResult(step_s, stats, {k: v[0] for k, v in transfers.items()}, tuple(run), tuple(started))


def steady_period_s(schedules, compute_s, transfers, cost, microbatches, order=None, tail_s=None, steps=3) -> float:
    """All `steps` steps simulated together from an empty pipeline."""
    tail_s = tail_s or {}
    pause = {
        (stage, (k + 1) * len(actions) - 1): tail_s.get(stage, 0.0)
        for stage, actions in schedules.items()
        if actions
        for k in range(steps)
    }
    lists = {
        stage: [Action(a.kind, a.mb + k * microbatches, a.peer, a.tensor) for k in range(steps) for a in actions]
        for stage, actions in schedules.items()
    }
    steps_order = None if order is None else [(key, mb + k * microbatches) for k in range(steps) for key, mb in order]
    run = simulate_pipeline(lists, compute_s, transfers, cost, steps_order, pause)
    starts = {stage: [] for stage in schedules}
    for (stage, _), at in zip(run.order, run.started_s):
        starts[stage].append(at)
    periods = [
        (stats.busy_until_s - starts[stage][len(schedules[stage])]) / (steps - 1)
        for stage, stats in run.stages.items()
        if schedules[stage]
    ]
    return statistics.median(periods) if periods else 0.0
