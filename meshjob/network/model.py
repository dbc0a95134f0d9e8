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
  per byte, measured through the communication engine under the run's own ranks. No task (and no
  balanced schedule of tasks) ends before the shared cores have done its messages' work, so on two
  cores a chain cut into many chunks is bound by the CPU, not the NICs, and `chunks: auto` stops
  before the two meet: where neither dominates, each message waits for the other resource
  (`cpu_contention_p`, `with_cpu`; a schedule: its time on the links against all its tasks' CPU). Real hosts
  have CPUs of their own, far from saturated by a few ranks' messages: `shared_cpu_cores` 0.
- a NIC message larger than `alone_bytes` (the executor's overlap threshold) runs alone on its link:
  the executor issues the link's next message only once its bytes can have left, so the next one's
  cost cannot overlap it on the wire, and it takes `alone_message_s` more (one message's CPU on the
  shared cores, as `meshjob bench resharding` measures it).

`duplex="half"` is the paper's model (a host takes part in one task at a time, either direction):
kept for the ablation in `meshjob bench planner` only.

What a unit task (HostTask) costs on these links from a chosen sender host, by strategy, is
meshjob.resharding.task_costs (NetworkModel.task_cost asks it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshjob.network.host_task import HostTask, Link

DUPLEX = ("full", "half")

# A message's cost on its link beyond its bytes, between hosts and inside one (gloo point-to-point): the slope of a
# one-hop transfer's time over its chunks, measured by `meshjob bench message-cost`, bench/results/message_cost.json.
DEFAULT_MESSAGE_S = 20e-6
DEFAULT_INTRA_MESSAGE_S = 40e-6
# The communication engine's costs on the emulated cluster (`meshjob run`: every host's ranks on this machine's
# cores): link time per message, and the CPU a message and a byte cost its two ranks, between hosts and inside one;
# measured by `meshjob bench resharding` before it plans, bench/results/resharding.json (message_costs).
EMULATED_MESSAGE_S = 120e-6
EMULATED_INTRA_MESSAGE_S = 90e-6
EMULATED_MESSAGE_CPU_S = 390e-6
EMULATED_INTRA_MESSAGE_CPU_S = 160e-6
EMULATED_NET_BYTE_CPU_S = 1.5e-9
EMULATED_LOCAL_BYTE_CPU_S = 0.8e-9
# How NIC and CPU time combine on the emulated cluster, (net^p + cpu^p)^(1/p), since max(net, cpu) under-predicts
# where they are close (NetworkModel.cpu_contention_p): p is fitted by `meshjob bench resharding`,
# bench/results/resharding.json.
EMULATED_CPU_CONTENTION_P = 4.0
# A NIC message that lasts this many per-message costs needs no second one in flight behind it to keep its link
# busy (the gap it leaves is 2% of it), so it runs alone: two in flight together would share the link instead of
# running one after the other as the plan times them (meshjob_trainer.board.may_start). Chosen by the measured /
# planned ratios of `meshjob bench resharding`'s many-to-many rows (bench/results/resharding.json).
OVERLAP_MESSAGE_COSTS = 50
# Behind a NIC message that runs alone, the link's next one is issued this long before the link's clock says the
# first is through (meshjob_trainer.board.may_start): its notice reaches the peer while the link still carries the
# first, so the link does not idle through the wake-ups that hand it to the next rank's receive (MESHJOB_ENGINE_TRACE).
HANDOVER_LEAD_S = 2e-3


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
    # meshjob.network.model.overlap_bytes), so the next message's own cost no longer overlaps this
    # one on the wire: each such message takes `alone_message_s` more of its link. 0: none is held.
    alone_bytes: float = 0.0
    alone_message_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nic_bytes_per_s", "intra_host_bytes_per_s", "line_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value!r} is invalid: a positive number of bytes per second")
        for name in (
            "message_s",
            "intra_message_s",
            "burst_bytes",
            "message_cpu_s",
            "intra_message_cpu_s",
            "net_byte_cpu_s",
            "local_byte_cpu_s",
            "cpu_contention_p",
            "alone_bytes",
            "alone_message_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} is invalid: a number >= 0")
        if self.duplex not in DUPLEX:
            raise ValueError(f"duplex {self.duplex!r} is invalid: one of {', '.join(DUPLEX)}")
        if not isinstance(self.in_flight_per_link, int) or self.in_flight_per_link < 1:
            raise ValueError(f"in_flight_per_link {self.in_flight_per_link!r} is invalid: an integer >= 1")
        small = self.small_in_flight_per_link
        if not isinstance(small, int) or small < self.in_flight_per_link:
            raise ValueError(
                f"small_in_flight_per_link {self.small_in_flight_per_link!r} is invalid: an integer >= "
                f"in_flight_per_link ({self.in_flight_per_link})"
            )
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
        work = (
            net[0] * self.message_cpu_s
            + local[0] * self.intra_message_cpu_s
            + net[1] * self.net_byte_cpu_s
            + local[1] * self.local_byte_cpu_s
        )
        return work / self.shared_cpu_cores

    def with_cpu(self, seconds: float, cpu: float) -> float:
        """A task's time given its time on the links alone and its shared cores' work (cpu_s)."""
        if cpu <= 0:
            return seconds
        p = self.cpu_contention_p
        if p <= 0:
            return max(seconds, cpu)
        top = max(seconds, cpu)
        combined: float = top * ((seconds / top) ** p + (cpu / top) ** p) ** (1 / p)
        return combined

    def to_json(self) -> dict[str, object]:
        return {
            "nic_bytes_per_s": self.nic_bytes_per_s,
            "message_s": self.message_s,
            "intra_host_bytes_per_s": self.intra_host_bytes_per_s,
            "intra_message_s": self.intra_message_s,
            "duplex": self.duplex,
            "burst_bytes": self.burst_bytes,
            "line_bytes_per_s": self.line_bytes_per_s,
            "in_flight_per_link": self.in_flight_per_link,
            "small_in_flight_per_link": self.small_in_flight_per_link,
            "shared_cpu_cores": self.shared_cpu_cores,
            "message_cpu_s": self.message_cpu_s,
            "intra_message_cpu_s": self.intra_message_cpu_s,
            "net_byte_cpu_s": self.net_byte_cpu_s,
            "local_byte_cpu_s": self.local_byte_cpu_s,
            "cpu_contention_p": self.cpu_contention_p,
            "alone_bytes": self.alone_bytes,
            "alone_message_s": self.alone_message_s,
        }

    def lower_bound(self, tasks: Sequence[HostTask]) -> float:
        """No schedule of `tasks` ends sooner: the busiest link's unavoidable messages (one per task
        it must carry). A receiving host must take in every slice it does not hold; a host must send
        what only it holds; and the holders of slices that must leave their host share at least
        evenly what crosses their out-links (half duplex: a host's in and out add up)."""
        forced: dict[Link, float] = {}
        pooled = 0.0
        pool_hosts: set[int] = set()
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
    one is issued HANDOVER_LEAD_S before that, and the charge still holds (`meshjob bench resharding`)."""
    return replace(
        network, alone_bytes=float(overlap_bytes(network)), alone_message_s=message_cpu_s / cores if cores else 0.0
    )


def on_shared_cores(
    network: NetworkModel,
    cores: int,
    message_s: float,
    intra_message_s: float,
    message_cpu_s: float,
    intra_message_cpu_s: float,
    net_byte_cpu_s: float,
    local_byte_cpu_s: float,
) -> NetworkModel:
    """`network` with every host's ranks on `cores` cores of one machine and the engine's costs there:
    link time per message between and inside hosts, CPU per message (both ranks; between and inside
    hosts) and per byte, NIC and
    CPU time contending (EMULATED_CPU_CONTENTION_P), and the messages the executor runs alone priced as
    it runs them (with_alone)."""
    costed = replace(
        network,
        message_s=message_s,
        intra_message_s=intra_message_s,
        shared_cpu_cores=cores,
        message_cpu_s=message_cpu_s,
        intra_message_cpu_s=intra_message_cpu_s,
        net_byte_cpu_s=net_byte_cpu_s,
        local_byte_cpu_s=local_byte_cpu_s,
        cpu_contention_p=EMULATED_CPU_CONTENTION_P,
    )
    return with_alone(costed, message_cpu_s, cores)


def emulated_network(nic_bytes_per_s: float, cores: int) -> NetworkModel:
    """The model of an emulated cluster whose hosts all run on `cores` cores of one machine, with the
    engine's costs as `meshjob bench resharding` measured them (the EMULATED_* figures)."""
    return on_shared_cores(
        NetworkModel(nic_bytes_per_s=nic_bytes_per_s),
        cores,
        EMULATED_MESSAGE_S,
        EMULATED_INTRA_MESSAGE_S,
        EMULATED_MESSAGE_CPU_S,
        EMULATED_INTRA_MESSAGE_CPU_S,
        EMULATED_NET_BYTE_CPU_S,
        EMULATED_LOCAL_BYTE_CPU_S,
    )


def _add(loads: dict[Link, float], link: Link, seconds: float) -> None:
    loads[link] = loads.get(link, 0.0) + seconds
