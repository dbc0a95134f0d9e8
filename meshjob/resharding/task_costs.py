"""What a unit task lifted to hosts costs from a chosen sender host, one function per strategy's shape.

A unit task at host level (meshjob.network.host_task.HostTask) costs, from a chosen sender host, a duration and a set
of NIC links it holds for that duration (TaskCost), on a network model (meshjob.network.model: its links, its
per-message and per-byte times, its CPU on shared cores). Durations follow the strategies of "On
Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022) §3.1, written as pipelines of
messages: a chain of K chunks whose stages take s_1..s_n per chunk ends after sum(s) + (K - 1) max(s)
(with B = 1 and no message cost that is the paper's t + (A - 1) t / K). The all-gather strategies are
timed message by message as they are lowered, each part's ring hops as soon as it lands
(_scatter_ring_cost): one task then costs exactly what the simulator times for its steps.
"""

from __future__ import annotations

import functools

from meshjob.network.host_task import HostTask, Link, TaskCost
from meshjob.network.model import NetworkModel
from meshjob.network.ready_order import in_ready_order

Remote = tuple[tuple[int, int], ...]  # (receiving host, devices needing the slice there), the sender's excluded
Messages = tuple[tuple[float, float], tuple[float, float]]  # ((messages, bytes) between hosts, ... inside hosts)

MAX_AUTO_CHUNKS = 256  # beyond this, chunks gain < 1% at every size measured, and each is a plan step


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
        return TaskCost(
            seconds,
            links,
            chunks,
            tuple(self.spans[k][0] for k in links),
            tuple(self.spans[k][1] - self.spans[k][0] for k in links),
        )


def chain_cost(
    model: NetworkModel, task: HostTask, sender: int, own: int, remote: Remote, chunks: int | str
) -> TaskCost:
    """Pipelined broadcast: sender -> (own host's head) -> head of each remote host in turn, in K chunks
    (`auto`: the K that ends soonest on `model`)."""
    chain = _chain_of(own, remote)
    if chunks == "auto":
        k = _best_chunks(model, task.bytes, chain, min(MAX_AUTO_CHUNKS, task.max_chunks), task.share, task.cpu_share)
    else:
        k = max(1, min(int(chunks), task.max_chunks))
    return _chain_holds(model, task.bytes, sender, own, remote, k)


def one_byte_chain_cost(
    model: NetworkModel, task: HostTask, sender: int, own: int, remote: Remote, chunks: int | str
) -> TaskCost:
    """The broadcast chain's dependencies with one 1-byte message per hop (signal)."""
    return _chain_holds(model, 1, sender, own, remote, 1)


def send_recv_cost(
    model: NetworkModel, task: HostTask, sender: int, own: int, remote: Remote, chunks: int | str
) -> TaskCost:
    """The sender sends the whole slice to every receiving device, host after host."""
    return _send_recv_cost(model, task.bytes, sender, own, remote)


def ring_per_host_cost(
    model: NetworkModel, task: HostTask, sender: int, own: int, remote: Remote, chunks: int | str
) -> TaskCost:
    """A part per receiving device, then a ring all-gather inside each host (local all-gather)."""
    return _scatter_ring_cost(model, task.bytes, sender, own, remote, one_ring=False)


def one_ring_cost(
    model: NetworkModel, task: HostTask, sender: int, own: int, remote: Remote, chunks: int | str
) -> TaskCost:
    """A part per receiving device, then one ring over all of them (global all-gather)."""
    return _scatter_ring_cost(model, task.bytes, sender, own, remote, one_ring=True)


def _chain_of(own: int, remote: Remote) -> tuple[tuple[bool, int], ...]:
    """The chain's hosts in order as (local hop?, devices there): the sender's own host first."""
    return tuple(([(True, own)] if own else []) + [(False, b) for _, b in remote])


def _chain_holds(model: NetworkModel, nbytes: float, sender: int, own: int, remote: Remote, k: int) -> TaskCost:
    seconds, hops, slowest = _chain_s(model, nbytes, _chain_of(own, remote), k)
    holds = _Holds()
    previous = sender
    for (h, _), (offset, s) in zip(remote, hops[1:] if own else hops):  # the own host's hop is local
        busy = s + (k - 1) * slowest  # from its first chunk to its last
        holds.add(model.link(previous, "out"), offset, offset + busy)
        holds.add(model.link(h, "in"), offset, offset + busy)
        previous = h
    return holds.cost(seconds, k)


def _chain_s(
    model: NetworkModel, nbytes: float, chain: tuple[tuple[bool, int], ...], k: int
) -> tuple[float, list[tuple[float, float]], float]:
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
def _best_chunks(
    model: NetworkModel,
    nbytes: float,
    chain: tuple[tuple[bool, int], ...],
    most: int,
    share: int = 1,
    cpu_share: int = 1,
) -> int:
    """K in 1..most minimising the time until the last of `share` such chains queued on one link
    ends: (share - 1) times a chain's hold of its busiest link (K chunks at the slowest stage), then
    the whole of one chain. share = 1: the chain alone, the paper's t + (A - 1) t / K plus K
    message costs. On shared cores, no sooner than they do the messages of `cpu_share` such chains.
    Ties: the fewer chunks."""
    own = chain[0][1] if chain and chain[0][0] else 0
    remote = tuple((i, b) for i, (local, b) in enumerate(chain) if not local)

    def objective(k: int) -> float:
        seconds, _, slowest = _chain_s(model, nbytes, chain, k)
        cpu = cpu_share * model.cpu_s(*chain_messages(nbytes, own, remote, k))
        return model.with_cpu(seconds + (share - 1) * k * slowest, cpu)

    best, best_s = 1, objective(1)
    for k in range(2, most + 1):
        value = objective(k)
        if value < best_s - 1e-15:
            best, best_s = k, value
    return best


# Messages of one task by each strategy's shape (the CPU they cost on shared cores: NetworkModel.cpu_s).
def chain_messages(nbytes: float, own: int, remote: Remote, chunks: int) -> Messages:
    """Every chunk: a hop per host, then its head's copies."""
    every = [b for _, b in remote] + ([own] if own else [])  # devices of every receiving host
    local_hops = (1 if own else 0) + sum(b - 1 for b in every)
    return (chunks * len(remote), nbytes * len(remote)), (chunks * local_hops, nbytes * local_hops)


def send_messages(nbytes: float, own: int, remote: Remote, chunks: int) -> Messages:
    """One message per receiving device."""
    devices = [b for _, b in remote]
    return (sum(devices), nbytes * sum(devices)), (own, nbytes * own)


def ring_per_host_messages(nbytes: float, own: int, remote: Remote, chunks: int) -> Messages:
    """A part per device, then a ring inside each host."""
    devices = [b for _, b in remote]
    every = devices + ([own] if own else [])
    ring = sum((b - 1) * b for b in every)
    net = (sum(devices), nbytes * len(devices))
    local = (own + ring, nbytes * (1 if own else 0) + sum(nbytes * (b - 1) for b in every))
    return net, local


def one_ring_messages(nbytes: float, own: int, remote: Remote, chunks: int) -> Messages:
    """A part to each device, then n - 1 ring rounds over every receiving device."""
    devices = [b for _, b in remote]
    every = devices + ([own] if own else [])
    n = own + sum(devices)
    per_round_net = len(every) if len(every) > 1 else 0
    per_round_local = sum(b - 1 for b in every)
    part = nbytes / n
    net_messages = sum(devices) + (n - 1) * per_round_net
    local_messages = own + (n - 1) * per_round_local
    return (net_messages, net_messages * part), (local_messages, local_messages * part)


def _send_recv_cost(model: NetworkModel, nbytes: int, sender: int, own: int, remote: Remote) -> TaskCost:
    """The sender sends the whole slice to every receiving device, host after host."""
    holds, sent = _Holds(), 0.0
    for h, b in remote:
        holds.add(model.link(h, "in"), sent, sent + b * model.net_s(nbytes))
        sent += b * model.net_s(nbytes)
    if remote:
        holds.add(model.link(sender, "out"), 0.0, sent)
    return holds.cost(max(sent, own * model.local_s(nbytes)), 1)


def _scatter_ring_cost(
    model: NetworkModel, nbytes: int, sender: int, own: int, remote: Remote, one_ring: bool
) -> TaskCost:
    """The scatter-then-ring strategies timed message by message as meshjob.resharding.lowering issues
    them and meshjob.simulate.simulator runs them: each receiving device gets its part of the slice from the
    sender, then every part travels the ring one device on per hop, each hop as soon as the part has
    reached the forwarding device and its links are free (FIFO links; messages booked in the order
    they become ready, ties in issue order). one_ring: the global all-gather, one ring over every
    receiving device, hosts in chain order; else the local all-gather, one ring inside each host.
    Not a closed form of rounds one after the other (scatter, then N - 1 rounds): a part's hops start as
    soon as it lands, so the ring overlaps the scatter, which such a form over-charges."""
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
