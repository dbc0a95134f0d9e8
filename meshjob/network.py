"""The one network model: host links, a per-message cost, and what each unit task costs on them.

The balancers (all four), their lower bound, the simulator and `meshjob plan` read this module and
nothing else about the network, so the plan optimises the problem that runs:

- every host has an egress and an ingress link of `nic_bytes_per_s` each (full duplex, as real NICs
  are, and as `tc tbf` on both ends of each emulated host's veth is);
- copies between devices of one host use a separate intra-host link (`intra_host_bytes_per_s`);
- every message (one chunk of one point-to-point step) costs `message_s` on its link on top of its
  bytes (`intra_message_s` inside a host): the syscalls, framing and the receiver's wake-up of one
  send. It is what makes chunks cost something, so `chunks: auto` can pick K;
- where every host's ranks share one machine's cores (the emulated cluster: `shared_cpu_cores`), a
  message also costs CPU: `message_cpu_s` for its two ranks together between hosts (gloo),
  `intra_message_cpu_s` inside a host (the engine's one-copy local wire: about 2.4x less), plus a cost
  per byte, measured through the communication engine under the run's own ranks. No task
  ends before the shared cores have done its messages' work, so on two cores a chain cut into many
  chunks is bound by the CPU, not the NICs, and `chunks: auto` stops before the two meet: where
  neither dominates, each message waits for the other resource (`cpu_contention_p`, `with_cpu`). Real hosts
  have CPUs of their own, far from saturated by a few ranks' messages: `shared_cpu_cores` 0.
- a NIC message larger than `alone_bytes` (the executor's overlap threshold) runs alone on its link:
  the executor issues the link's next message only once its bytes can have left, so the next one's
  cost cannot overlap it on the wire, and it takes `alone_message_s` more (the resharding bench: one
  message's CPU on the shared cores). On the emulated cluster this is what made one-to-many chains
  of 16-44 chunks of 16 MiB (0.4-1 MiB each) measure 5-10% over their plan and over 48 chunks.

`duplex="half"` is the paper's model (a host takes part in one task at a time, either direction):
kept for the ablation in `meshjob bench planner` only.

A unit task at host level (HostTask) costs, from a chosen sender host, a duration and a set of NIC
links it holds for that duration (TaskCost). Durations follow the strategies of "On Optimizing the
Communication of Model Parallelism" (Zhuang et al., 2022) §3.1, written as pipelines of messages:
a chain of K chunks whose stages take s_1..s_n per chunk ends after sum(s) + (K - 1) max(s) (with
B = 1 and no message cost that is the paper's t + (A - 1) t / K). The all-gather strategies are timed
message by message as they are lowered, each part's ring hops as soon as it lands (_scatter_ring_cost):
one task then costs exactly what the simulator times for its steps.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Sequence

from meshjob.ready_order import in_ready_order
from meshjob.resharding import STRATEGIES

DUPLEX = ("full", "half")
Link = tuple[int, str]  # (host, "out" | "in") full duplex, (host, "nic") half duplex, (host, "local")

# Per-message costs on the emulated cluster (gloo point-to-point, 2 in flight, 2 shared cores): the
# slope of a one-hop transfer's time over its number of chunks (4 MiB in 1..256 chunks), measured by
# `meshjob bench message-cost` (bench/results/message_cost.json; median of 5 rounds): 21 µs between
# network namespaces over a 1 gbit tbf-shaped veth (rounds 15-30 µs; 20 µs also reproduces earlier chain
# measurements on this cluster, e.g. 64 MiB to 4 hosts in 256 chunks at 1.07 L), 38 µs between two ranks of
# one namespace (loopback, rounds 33-59 µs), where no wire time hides a message's own cost.
DEFAULT_MESSAGE_S = 20e-6
DEFAULT_INTRA_MESSAGE_S = 40e-6
# The emulated cluster (`meshjob run`): every host's ranks share this machine's cores, and a message through
# the communication engine (engine thread, waiter threads, gloo or the one-copy local wire) costs more than
# raw gloo. Measured through the engine by `meshjob bench resharding` before it plans, with nothing else
# running (bench/results/resharding.json: message_costs; meshjob_bench.engine_costs): link time per message
# between hosts and inside a host, and the CPU a message costs its two ranks, between hosts (gloo) and inside
# a host (the one-copy local wire), plus per byte. The figures of the last two full runs (main 8d959ac and
# 8c239a8, medians of 5 rounds each): 73 / 118 µs and 106 / 78 µs of link time, CPU 394 / 386 µs and
# 173 / 150 µs per message, 1.43 / 1.53 and 0.65 / 0.93 ns per byte. Probes on this shared machine spread
# by about +-50% between runs.
EMULATED_MESSAGE_S = 120e-6
EMULATED_INTRA_MESSAGE_S = 90e-6
EMULATED_MESSAGE_CPU_S = 390e-6
EMULATED_INTRA_MESSAGE_CPU_S = 160e-6
EMULATED_NET_BYTE_CPU_S = 1.5e-9
EMULATED_LOCAL_BYTE_CPU_S = 0.8e-9
# How NIC time and CPU time combine on the emulated cluster (NetworkModel.cpu_contention_p): one exponent
# for every case, from the 170 fixed-K rows of one-to-many and paper scale in a full resharding bench
# (bench/results/resharding.json at 9db701a): max(net, cpu) under-predicted the rows where both are close
# (a 3x4 or 4x4 destination at K = 16: -19% to -22%); p = 4 brings those within 10% and leaves rows bound
# by one resource alone as they were. The resharding bench and `meshjob run` plan with it (on_shared_cores).
EMULATED_CPU_CONTENTION_P = 4.0
# A NIC message that lasts this many per-message costs needs no second one in flight behind it to keep its
# link busy (the gap it leaves is 2% of it); two such messages in flight together would share the link
# instead of running one after the other as the plan times them (meshjob_trainer.board.may_start).
# Swept at 10 / 25 / 50 / 100 (bench resharding many-to-many, K auto, with sends held until their bytes can
# have left, meshjob_trainer.engine): 3 / 3 / 4 / 5 of 32 rows with measured / planned above 1.10 (and 1 in
# another run at 50), within the spread between runs (the threshold's bytes also follow each run's measured
# per-message cost): 50 is kept. Tried and left out: the threshold from the nominal EMULATED_MESSAGE_S
# instead of each run's probe (76-738 µs between runs, so 0.4-4.2 MiB): 20 against 4 of 64 many-to-many rows
# above 1.10 (one lock hold, two runs each), time / L 1.37 against 1.27.
OVERLAP_MESSAGE_COSTS = 50
# Behind a NIC message that runs alone, the link's next one is issued this long before the link's clock says
# the first is through (meshjob_trainer.board.may_start): its notice reaches the peer while the link still
# carries the first. Without it, handing a host's in-link from one rank's receive to the next rank's took
# 0.3-2.4 ms of wake-ups on the shared cores (MESHJOB_ENGINE_TRACE), the link idle meanwhile.
HANDOVER_LEAD_S = 2e-3
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

    def holds(self) -> tuple[tuple[Link, float, float], ...]:
        """(link, offset, busy) for every held link."""
        if not self.offsets:
            return tuple((link, 0.0, self.seconds) for link in self.links)
        return tuple(zip(self.links, self.offsets, self.busy))


@dataclass(frozen=True)
class NetworkModel:
    nic_bytes_per_s: float = 1e9 / 8  # per host and direction
    message_s: float = DEFAULT_MESSAGE_S
    intra_host_bytes_per_s: float = 8e9 / 8  # shared memory / NVLink: far faster than the NIC
    intra_message_s: float = DEFAULT_INTRA_MESSAGE_S
    duplex: str = "full"
    burst_bytes: float = 0.0  # a token bucket per NIC link (tc tbf's burst); 0 = a plain link
    line_bytes_per_s: float = 10e9 / 8  # how fast a burst leaves (the veth / wire under the shaper)
    # The executor keeps at most this many chunks in flight per link: one on the wire while the next
    # is posted; more would let the NIC's queue, not the plan, decide the order.
    in_flight_per_link: int = 2
    # Small messages pack beyond that window on a NIC link: up to this many in flight, each of at most
    # overlap_bytes / this and all together within overlap_bytes, so a stream of small chunks is not held
    # to two round trips of wake-ups on the shared cores at a time (meshjob_trainer.board.may_start).
    # The simulator does not model it (it charges such chunks message_s each, as probed unpacked).
    # Equal to in_flight_per_link: no packing.
    small_in_flight_per_link: int = 8
    # The CPU messages take where all hosts share one machine (see the module's docstring); 0 cores:
    # not modelled.
    shared_cpu_cores: int = 0
    message_cpu_s: float = 0.0  # both ranks of one message between hosts together
    intra_message_cpu_s: float = 0.0  # both ranks of one message inside a host together
    net_byte_cpu_s: float = 0.0  # per byte between hosts (kernel copies through the NIC path)
    local_byte_cpu_s: float = 0.0  # per byte inside a host
    # How a task's NIC time and its CPU time on the shared cores combine: (net^p + cpu^p)^(1/p). Every
    # message needs both, so where neither dominates, each waits for the other (a chunk ready to send
    # waits for a core, a core for the chunk on the wire): 0 is max(net, cpu), no interference.
    cpu_contention_p: float = 0.0
    # A NIC message of more than `alone_bytes` runs alone on its link: the executor issues the link's
    # next message only once its bytes can have left (meshjob_trainer.engine; the threshold is
    # meshjob.network.overlap_bytes), so the next message's own cost no longer overlaps this
    # one on the wire: each such message takes `alone_message_s` more of its link. 0: none is held.
    alone_bytes: float = 0.0
    alone_message_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nic_bytes_per_s", "intra_host_bytes_per_s", "line_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value!r} is invalid: a positive number of bytes per second")
        for name in ("message_s", "intra_message_s", "burst_bytes", "message_cpu_s", "intra_message_cpu_s",
                     "net_byte_cpu_s", "local_byte_cpu_s", "cpu_contention_p", "alone_bytes", "alone_message_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} is invalid: a number >= 0")
        if self.duplex not in DUPLEX:
            raise ValueError(f"duplex {self.duplex!r} is invalid: one of {', '.join(DUPLEX)}")
        if not isinstance(self.in_flight_per_link, int) or self.in_flight_per_link < 1:
            raise ValueError(f"in_flight_per_link {self.in_flight_per_link!r} is invalid: an integer >= 1")
        small = self.small_in_flight_per_link
        if not isinstance(small, int) or small < self.in_flight_per_link:
            raise ValueError(f"small_in_flight_per_link {self.small_in_flight_per_link!r} is invalid: an integer >= "
                             f"in_flight_per_link ({self.in_flight_per_link})")
        if not isinstance(self.shared_cpu_cores, int) or self.shared_cpu_cores < 0:
            raise ValueError(f"shared_cpu_cores {self.shared_cpu_cores!r} is invalid: an integer >= 0")

    # ---------------------------------------------------------------- links and messages
    def link(self, host: int, direction: str) -> Link:
        """The link a host sends ("out") or receives ("in") on; half duplex: one for both."""
        if direction == "local":
            return (host, "local")
        return (host, "nic") if self.duplex == "half" else (host, direction)

    def net_s(self, nbytes: float) -> float:
        """One message between hosts."""
        return nbytes / self.nic_bytes_per_s + self.net_message_s(nbytes)

    def net_message_s(self, nbytes: float) -> float:
        """What a message of `nbytes` between hosts takes of its link beyond its bytes: message_s, and
        alone_message_s more where it runs alone on the link (more than alone_bytes)."""
        return self.message_s + (self.alone_message_s if 0 < self.alone_bytes < nbytes else 0.0)

    def local_s(self, nbytes: float) -> float:
        """One message between devices of one host."""
        return nbytes / self.intra_host_bytes_per_s + self.intra_message_s

    def cpu_s(self, net: tuple[float, float] = (0, 0), local: tuple[float, float] = (0, 0)) -> float:
        """Seconds the shared cores need for (messages, bytes) between hosts and inside hosts."""
        if not self.shared_cpu_cores:
            return 0.0
        work = (net[0] * self.message_cpu_s + local[0] * self.intra_message_cpu_s + net[1] * self.net_byte_cpu_s
                + local[1] * self.local_byte_cpu_s)
        return work / self.shared_cpu_cores

    def with_cpu(self, seconds: float, cpu: float) -> float:
        """A task's time given its time on the links alone and its shared cores' work (cpu_s)."""
        if cpu <= 0:
            return seconds
        p = self.cpu_contention_p
        if p <= 0:
            return max(seconds, cpu)
        top = max(seconds, cpu)
        return top * ((seconds / top) ** p + (cpu / top) ** p) ** (1 / p)

    def to_json(self) -> dict[str, object]:
        return {"nic_bytes_per_s": self.nic_bytes_per_s, "message_s": self.message_s,
                "intra_host_bytes_per_s": self.intra_host_bytes_per_s, "intra_message_s": self.intra_message_s,
                "duplex": self.duplex,
                "burst_bytes": self.burst_bytes, "line_bytes_per_s": self.line_bytes_per_s,
                "in_flight_per_link": self.in_flight_per_link,
                "small_in_flight_per_link": self.small_in_flight_per_link, "shared_cpu_cores": self.shared_cpu_cores,
                "message_cpu_s": self.message_cpu_s, "intra_message_cpu_s": self.intra_message_cpu_s,
                "net_byte_cpu_s": self.net_byte_cpu_s,
                "local_byte_cpu_s": self.local_byte_cpu_s, "cpu_contention_p": self.cpu_contention_p,
                "alone_bytes": self.alone_bytes, "alone_message_s": self.alone_message_s}

    # ---------------------------------------------------------------- unit tasks
    def task_cost(self, task: HostTask, sender: int, strategy: str, chunks: int | str = "auto") -> TaskCost:
        """Duration and held links of `task` sent from host `sender` by `strategy`."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is invalid: one of {', '.join(STRATEGIES)}")
        return _task_cost(self, task, sender, strategy, chunks)

    def lower_bound(self, tasks: Sequence[HostTask]) -> float:
        """No schedule of `tasks` ends sooner: the busiest link's unavoidable messages (one per task
        it must carry). A receiving host must take in every slice it does not hold; a host must send
        what only it holds; and the holders of slices that must leave their host share at least
        evenly what crosses their out-links (half duplex: a host's in and out add up)."""
        forced: dict[Link, float] = {}
        pooled, pool_hosts = 0.0, set()
        for task in tasks:
            one = task.bytes / self.nic_bytes_per_s + self.message_s  # chunks need not run alone
            for h in set(task.receiver_hosts) - set(task.sender_hosts):
                _add(forced, self.link(h, "in"), one)
            if all(set(task.receiver_hosts) - {s} for s in task.sender_hosts):  # every holder must send
                pooled += one
                pool_hosts.update(task.sender_hosts)
                if len(set(task.sender_hosts)) == 1:
                    _add(forced, self.link(task.sender_hosts[0], "out"), one)
        most = max(forced.values(), default=0.0)
        if pool_hosts:
            most = max(most, pooled / len(pool_hosts))
        return most


def overlap_bytes(network: NetworkModel) -> int:
    """The executor's overlap threshold: in-flight bytes on a NIC link up to which another message may
    join them (OVERLAP_MESSAGE_COSTS of the link's per-message cost); a larger message runs alone."""
    return int(network.nic_bytes_per_s * network.message_s * OVERLAP_MESSAGE_COSTS)


def with_alone(network: NetworkModel, message_cpu_s: float, cores: int) -> NetworkModel:
    """`network` as the executor runs it where every host shares `cores` cores: a NIC message above the
    overlap threshold runs alone, held on its out-link until its bytes can have left, and the link's next
    message is issued only then, so that one's CPU on the shared cores (`message_cpu_s` / cores) is on the
    link's path each time (NetworkModel.alone_message_s; the simulator paces such transfers). The next
    one is issued HANDOVER_LEAD_S before that; the charge is kept: with the lead, many-to-many measured /
    planned stayed where it was (geometric mean 1.02 of both), the rows above 1.10 fell from 4 to 2 of 64."""
    return replace(network, alone_bytes=float(overlap_bytes(network)),
                   alone_message_s=message_cpu_s / cores if cores else 0.0)


def on_shared_cores(network: NetworkModel, cores: int, message_s: float, intra_message_s: float,
                    message_cpu_s: float, intra_message_cpu_s: float, net_byte_cpu_s: float,
                    local_byte_cpu_s: float) -> NetworkModel:
    """`network` with every host's ranks on `cores` cores of one machine and the engine's costs there:
    link time per message between and inside hosts, CPU per message (both ranks; between and inside
    hosts) and per byte, NIC and
    CPU time contending (EMULATED_CPU_CONTENTION_P), and the messages the executor runs alone priced as
    it runs them (with_alone)."""
    costed = replace(network, message_s=message_s, intra_message_s=intra_message_s, shared_cpu_cores=cores,
                     message_cpu_s=message_cpu_s, intra_message_cpu_s=intra_message_cpu_s,
                     net_byte_cpu_s=net_byte_cpu_s, local_byte_cpu_s=local_byte_cpu_s,
                     cpu_contention_p=EMULATED_CPU_CONTENTION_P)
    return with_alone(costed, message_cpu_s, cores)


def emulated_network(nic_bytes_per_s: float, cores: int) -> NetworkModel:
    """The model of an emulated cluster whose hosts all run on `cores` cores of one machine, with the
    engine's costs as `meshjob bench resharding` measured them (the EMULATED_* figures)."""
    return on_shared_cores(NetworkModel(nic_bytes_per_s=nic_bytes_per_s), cores, EMULATED_MESSAGE_S,
                           EMULATED_INTRA_MESSAGE_S, EMULATED_MESSAGE_CPU_S, EMULATED_INTRA_MESSAGE_CPU_S,
                           EMULATED_NET_BYTE_CPU_S,
                           EMULATED_LOCAL_BYTE_CPU_S)


def _add(loads: dict[Link, float], link: Link, seconds: float) -> None:
    loads[link] = loads.get(link, 0.0) + seconds


def auto_chunks(nbytes: int, hops: int, nic_bytes_per_s: float, message_s: float = DEFAULT_MESSAGE_S) -> int:
    """K for a broadcast chain from a sender to `hops` hosts of one device each: the K that minimises
    (K + hops - 1) * (t / K + message_s), t = nbytes / rate, i.e. near sqrt((hops - 1) t / message_s).
    One hop gains nothing from chunks (K = 1); free messages would want as many as allowed."""
    model = NetworkModel(nic_bytes_per_s=nic_bytes_per_s, message_s=message_s)
    task = HostTask((0,), tuple(range(1, hops + 1)), nbytes)
    return model.task_cost(task, 0, "broadcast", "auto").chunks


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
def _task_cost(model: NetworkModel, task: HostTask, sender: int, strategy: str, chunks: int | str) -> TaskCost:
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
        cost = replace(cost, seconds=model.with_cpu(cost.seconds, cpu), cpu_s=cpu)
    if model.duplex == "half":  # the paper's constraint 3: every host of the task, all along
        hosts = dict.fromkeys([model.link(sender, "out")] + [model.link(h, "in") for h, _ in remote])
        return TaskCost(cost.seconds, tuple(hosts) if remote else (), cost.chunks, cpu_s=cost.cpu_s)
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
