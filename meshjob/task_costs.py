"""Unit tasks lifted to hosts, and what one costs from a chosen sender host by each strategy.

A unit task at host level (HostTask) costs, from a chosen sender host, a duration and a set of NIC
links it holds for that duration (TaskCost), on a network model (meshjob.network: its links, its
per-message and per-byte times, its CPU on shared cores). Durations follow the strategies of "On
Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022) §3.1, written as pipelines of
messages: a chain of K chunks whose stages take s_1..s_n per chunk ends after sum(s) + (K - 1) max(s)
(with B = 1 and no message cost that is the paper's t + (A - 1) t / K). The all-gather strategies are
timed message by message as they are lowered, each part's ring hops as soon as it lands
(_scatter_ring_cost): one task then costs exactly what the simulator times for its steps.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshjob.ready_order import in_ready_order

if TYPE_CHECKING:  # the model prices a task through task_cost: imported at run time, a cycle
    from meshjob.network import Link, NetworkModel

MAX_AUTO_CHUNKS = 256  # beyond this, chunks gain < 1% at every size measured, and each is a plan step
MAX_CHUNKS = 1 << 30  # no cap from the slice's shape


@dataclass(frozen=True)
class HostTask:
    """A unit task lifted to hosts: any one of `sender_hosts` may send the slice to every
    receiving host (in chain order: the order the lowering visits them)."""

    sender_hosts: tuple[int, ...]
    receiver_hosts: tuple[int, ...]
    bytes: int
    receiver_devices: tuple[int, ...] = ()  # devices needing the slice per receiving host (default 1 each)
    max_chunks: int = MAX_CHUNKS  # the slice cannot be cut into more pieces (its longest dim)
    # Tasks that queue on this one's busiest receiving link (itself included): chunks: auto weighs
    # the chain's fill, which only the last of them exposes, against every chunk's message cost,
    # which they all pay.
    share: int = 1
    # Tasks that run on the shared cores in the same window (itself included): chunks: auto weighs
    # their messages' CPU work together (meshjob.window.with_shares).
    cpu_share: int = 1

    def devices_on(self, host: int) -> int:
        if not self.receiver_devices:
            return 1
        return self.receiver_devices[self.receiver_hosts.index(host)]


@dataclass(frozen=True)
class TaskCost:
    """A task from one sender: it ends `seconds` after it starts, and holds each of `links` from
    `offsets[i]` to `offsets[i] + busy[i]` after its start (a chain's later hops start later; a
    host's in-link is free again while its devices copy the slice among themselves)."""

    seconds: float
    links: tuple[Link, ...]  # NIC links the task holds
    chunks: int  # K of a broadcast chain (1 for the other strategies)
    offsets: tuple[float, ...] = ()  # per link; empty: every link from 0 for `seconds`
    busy: tuple[float, ...] = ()
    cpu_s: float = 0.0  # seconds of the shared cores its messages take (0: not modelled)
    link_s: float | None = None  # its time on the links alone, before the CPU (None: `seconds`)

    def holds(self) -> tuple[tuple[Link, float, float], ...]:
        """(link, offset, busy) for every held link."""
        if not self.offsets:
            return tuple((link, 0.0, self.seconds) for link in self.links)
        return tuple(zip(self.links, self.offsets, self.busy))


# -------------------------------------------------------------------- strategy costs
class _Holds:
    """Link occupancy of one task being costed: link -> (from, to) after the task's start."""

    def __init__(self) -> None:
        self.spans: dict[Link, tuple[float, float]] = {}

    def add(self, link: Link, begin: float, end: float) -> None:
        old = self.spans.get(link)
        self.spans[link] = (begin, end) if old is None else (min(old[0], begin), max(old[1], end))

    def cost(self, seconds: float, chunks: int) -> TaskCost:
        links = tuple(self.spans)
        return TaskCost(seconds, links, chunks, tuple(self.spans[k][0] for k in links),
                        tuple(self.spans[k][1] - self.spans[k][0] for k in links))


@functools.lru_cache(maxsize=4096)
def task_cost(model: NetworkModel, task: HostTask, sender: int, strategy: str, chunks: int | str) -> TaskCost:
    """Duration and held links of `task` sent from host `sender` by `strategy` on `model`
    (NetworkModel.task_cost, which checks the strategy). Cached: models and tasks are frozen."""
    own = task.devices_on(sender) if sender in task.receiver_hosts else 0
    remote = tuple((h, task.devices_on(h)) for h in task.receiver_hosts if h != sender)
    if strategy in ("broadcast", "signal"):
        cost = _chain_cost(model, task, sender, own, remote, strategy, chunks)
    elif strategy == "send_recv":
        cost = _send_recv_cost(model, task.bytes, sender, own, remote)
    else:
        cost = _scatter_ring_cost(model, task.bytes, sender, own, remote, strategy == "global_allgather")
    if model.shared_cpu_cores:  # it cannot end before the shared cores did its messages' work
        nbytes = 1 if strategy == "signal" else task.bytes
        cpu = model.cpu_s(*_messages(strategy, nbytes, own, remote, cost.chunks))
        cost = replace(cost, seconds=model.with_cpu(cost.seconds, cpu), cpu_s=cpu, link_s=cost.seconds)
    if model.duplex == "half":  # the paper's constraint 3: every host of the task, all along
        hosts = dict.fromkeys([model.link(sender, "out")] + [model.link(h, "in") for h, _ in remote])
        return TaskCost(cost.seconds, tuple(hosts) if remote else (), cost.chunks, cpu_s=cost.cpu_s,
                        link_s=cost.link_s)
    return cost


def _chain_cost(model: NetworkModel, task: HostTask, sender: int, own: int, remote: tuple[tuple[int, int], ...],
                strategy: str, chunks: int | str) -> TaskCost:
    """Pipelined broadcast: sender -> (own host's head) -> head of each remote host in turn."""
    nbytes = 1 if strategy == "signal" else task.bytes
    chain = ([(True, own)] if own else []) + [(False, b) for _, b in remote]
    if strategy == "signal":
        k = 1
    elif chunks == "auto":
        k = _best_chunks(model, nbytes, tuple(chain), min(MAX_AUTO_CHUNKS, task.max_chunks), task.share,
                         task.cpu_share)
    else:
        k = max(1, min(int(chunks), task.max_chunks))
    seconds, hops, slowest = _chain_s(model, nbytes, tuple(chain), k)
    holds = _Holds()
    previous = sender
    for (h, _), (offset, s) in zip(remote, hops[1:] if own else hops):  # the own host's hop is local
        busy = s + (k - 1) * slowest  # from its first chunk to its last
        holds.add(model.link(previous, "out"), offset, offset + busy)
        holds.add(model.link(h, "in"), offset, offset + busy)
        previous = h
    return holds.cost(seconds, k)


def _chain_s(model: NetworkModel, nbytes: float, chain: tuple[tuple[bool, int], ...],
             k: int) -> tuple[float, list[tuple[float, float]], float]:
    """A pipelined chain of k chunks: per host in chain order (local hop?, devices there), one hop
    to its head, then the head's copies to its other devices. The last chunk ends after every stage
    once plus k - 1 times the slowest stage. Returns (seconds, per host (path before its hop, hop
    time), the slowest stage's time)."""
    chunk = nbytes / k
    path = finish = slowest = 0.0
    hops = []
    for local, devices in chain:
        hop = model.local_s(chunk) if local else model.net_s(chunk)
        fan_out = (devices - 1) * model.local_s(chunk)
        hops.append((path, hop))
        path += hop
        finish = max(finish, path + fan_out)
        slowest = max(slowest, hop, fan_out)
    return finish + (k - 1) * slowest, hops, slowest


@functools.lru_cache(maxsize=4096)
def _best_chunks(model: NetworkModel, nbytes: float, chain: tuple[tuple[bool, int], ...], most: int,
                 share: int = 1, cpu_share: int = 1) -> int:
    """K in 1..most minimising the time until the last of `share` such chains queued on one link
    ends: (share - 1) times a chain's hold of its busiest link (K chunks at the slowest stage), then
    the whole of one chain. share = 1: the chain alone, the paper's t + (A - 1) t / K plus K
    message costs. On shared cores, no sooner than they do the messages of `cpu_share` such chains.
    Ties: the fewer chunks."""
    own = chain[0][1] if chain and chain[0][0] else 0
    remote = tuple((i, b) for i, (local, b) in enumerate(chain) if not local)

    def objective(k: int) -> float:
        seconds, _, slowest = _chain_s(model, nbytes, chain, k)
        cpu = cpu_share * model.cpu_s(*_messages("broadcast", nbytes, own, remote, k))
        return model.with_cpu(seconds + (share - 1) * k * slowest, cpu)

    best, best_s = 1, objective(1)
    for k in range(2, most + 1):
        value = objective(k)
        if value < best_s - 1e-15:
            best, best_s = k, value
    return best


def _messages(strategy: str, nbytes: float, own: int, remote: tuple[tuple[int, int], ...],
              chunks: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((messages, bytes) between hosts, (messages, bytes) inside hosts) of one task by `strategy`
    (the CPU they cost: NetworkModel.cpu_s)."""
    devices = [b for _, b in remote]
    every = devices + ([own] if own else [])  # devices of every receiving host, the sender's included
    if strategy in ("broadcast", "signal"):  # every chunk: a hop per host, then its head's copies
        local_hops = (1 if own else 0) + sum(b - 1 for b in every)
        return (chunks * len(remote), nbytes * len(remote)), (chunks * local_hops, nbytes * local_hops)
    if strategy == "send_recv":
        return (sum(devices), nbytes * sum(devices)), (own, nbytes * own)
    if strategy == "local_allgather":  # a part per device, then a ring inside each host
        ring = sum((b - 1) * b for b in every)
        net = (sum(devices), nbytes * len(devices))
        local = (own + ring, nbytes * (1 if own else 0) + sum(nbytes * (b - 1) for b in every))
        return net, local
    n = own + sum(devices)  # global all-gather: a part to each device, then n - 1 ring rounds
    per_round_net = len(every) if len(every) > 1 else 0
    per_round_local = sum(b - 1 for b in every)
    part = nbytes / n
    net_messages = sum(devices) + (n - 1) * per_round_net
    local_messages = own + (n - 1) * per_round_local
    return (net_messages, net_messages * part), (local_messages, local_messages * part)


def _send_recv_cost(model: NetworkModel, nbytes: int, sender: int, own: int,
                    remote: tuple[tuple[int, int], ...]) -> TaskCost:
    """The sender sends the whole slice to every receiving device, host after host."""
    holds, sent = _Holds(), 0.0
    for h, b in remote:
        holds.add(model.link(h, "in"), sent, sent + b * model.net_s(nbytes))
        sent += b * model.net_s(nbytes)
    if remote:
        holds.add(model.link(sender, "out"), 0.0, sent)
    return holds.cost(max(sent, own * model.local_s(nbytes)), 1)


def _scatter_ring_cost(model: NetworkModel, nbytes: int, sender: int, own: int,
                       remote: tuple[tuple[int, int], ...], one_ring: bool) -> TaskCost:
    """The scatter-then-ring strategies timed message by message as meshjob.resharding.lower issues
    them and meshjob.simulate runs them: each receiving device gets its part of the slice from the
    sender, then every part travels the ring one device on per hop, each hop as soon as the part has
    reached the forwarding device and its links are free (FIFO links; messages booked in the order
    they become ready, ties in issue order). one_ring: the global all-gather, one ring over every
    receiving device, hosts in chain order; else the local all-gather, one ring inside each host.
    A closed form of rounds one after the other (scatter, then N - 1 rounds) over-charged both: a
    part's hops start as soon as it lands, so the ring overlaps the scatter; 1.25x (local) and up to
    1.43x (global) the simulated time on the resharding bench's cases, whose measurements follow the
    simulator."""
    groups = [[sender] * own] if own else []  # the host of each receiving device, host by host
    groups += [[h] * b for h, b in remote]
    rings = [[h for g in groups for h in g]] if one_ring else groups
    steps: list[tuple[int, int, float, tuple[int, ...]]] = []  # (from host, to host, bytes, the steps it waits on)
    for ring in rings:
        n = len(ring)
        part = nbytes / n
        last = []
        for h in ring:  # the scatter: part p to ring device p
            steps.append((sender, h, part, ()))
            last.append(len(steps) - 1)
        for k in range(1, n):  # round k: part p from device p + k - 1 to device p + k
            for p in range(n):
                steps.append((ring[(p + k - 1) % n], ring[(p + k) % n], part, (last[p],)))
                last[p] = len(steps) - 1
    free: dict[Link, float] = {}
    holds = _Holds()

    def book(i: int, at: float) -> float:
        src, dst, part, _ = steps[i]
        links = [model.link(src, "local")] if src == dst else [model.link(src, "out"), model.link(dst, "in")]
        begin = max([at] + [free.get(link, 0.0) for link in links])
        end = begin + (model.local_s(part) if src == dst else model.net_s(part))
        for link in links:
            free[link] = end
            if src != dst:
                holds.add(link, begin, end)
        return end

    finish = max(in_ready_order([after for *_, after in steps], book).values(), default=0.0)
    return holds.cost(finish, 1)
