"""Per-rank communication programs: what an ordered executor issues for one boundary.

A boundary's lowered steps are point-to-point messages (one chunk each). The plan times them on the
network model (meshjob.simulate.simulator.simulate_transfer: per-link FIFO, dependencies, per-message cost);
each rank's program lists:
- `sends`: its messages in planned start order. An executor issues them in this order, with at
  most `NetworkModel.in_flight_per_link` messages in flight on each link (`send_links[i]` is the
  link of sends[i]); a send whose `after` steps have not landed yet waits for them (they are this
  rank's receives: a chain forwards chunk k as soon as it has it).
- `recvs`: its incoming messages in planned start order, `recv_links[i]` the link recvs[i] arrives on
  (the host's NIC in-link, or its local link). An executor posts them in this order, at most
  `in_flight_per_link` at a time on each link, as soon as the boundary starts: a sender never waits on
  a receiver that is busy computing, and a host's in-link takes its messages in the planned order
  rather than sharing itself between every sender at once (gloo and NCCL send only once the receive
  is posted). A forward then finds its chunk where the plan put it: when two senders feed one rank,
  the chunks it must forward first are the ones that arrive first.
Both orders are the planned start order of the steps, a topological order (a step starts after the
steps it depends on end), and every rank derives it from the same plan, which is also what NCCL needs:
two ranks agree on the order of the messages between them. Bounding sends per out-link and receives
per in-link cannot deadlock: the unfinished step that starts first has its data (its dependencies
started, and ended, before it) and is at the head of its sender's link and its receiver's link. Across boundaries, a
rank runs programs in the order its stage's
action list issues the SEND/RECV actions (meshjob.schedule.actions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshjob.network.host_task import Link
from meshjob.network.model import NetworkModel
from meshjob.resharding.tasks import Step
from meshjob.simulate.simulator import simulate_transfer


@dataclass(frozen=True)
class RankProgram:
    rank: int
    sends: tuple[Step, ...]  # issue in this order
    send_links: tuple[Link, ...]  # the link each send uses (bound the messages in flight per link)
    recvs: tuple[Step, ...]  # post in this order, a bounded number at a time per link
    recv_links: tuple[Link, ...] = ()  # the link each receive arrives on

    @property
    def send_bytes(self) -> int:
        return sum(s.nbytes() for s in self.sends)


def rank_programs(
    steps: Sequence[Step], host_of: Callable[[int], int], network: NetworkModel, itemsize: int = 4
) -> dict[int, RankProgram]:
    """Every rank's program for one boundary (ranks with nothing to do are absent)."""
    key = planned_keys(steps, host_of, network, itemsize)
    sends: dict[int, list[Step]] = {}
    recvs: dict[int, list[Step]] = {}
    for s in steps:
        sends.setdefault(s.src, []).append(s)
        recvs.setdefault(s.dst, []).append(s)
    out = {}
    for rank in sorted(set(sends) | set(recvs)):
        mine = sorted(sends.get(rank, []), key=lambda s: key[s.id])
        links = tuple(out_link(network, host_of(s.src), host_of(s.dst)) for s in mine)
        arriving = sorted(recvs.get(rank, []), key=lambda s: key[s.id])
        out[rank] = RankProgram(
            rank,
            tuple(mine),
            links,
            tuple(arriving),
            tuple(in_link(network, host_of(s.src), host_of(s.dst)) for s in arriving),
        )
    return out


def planned_keys(
    steps: Sequence[Step], host_of: Callable[[int], int], network: NetworkModel, itemsize: int = 4
) -> dict[int, tuple[float, float, int]]:
    """Step id -> its key in the planned start order (start, finish, id on the network model's FIFO
    links): the one order every rank's program and every host's link order (meshjob.plan.host_order) follow."""
    timed = simulate_transfer(steps, host_of, network, itemsize)
    return {s.id: (timed.start_s[s.id], timed.finish_s[s.id], s.id) for s in steps}


def out_link(network: NetworkModel, src_host: int, dst_host: int) -> Link:
    """The link a message between these hosts leaves on: the source host's NIC out-link, or its local link."""
    return network.link(src_host, "local") if src_host == dst_host else network.link(src_host, "out")


def in_link(network: NetworkModel, src_host: int, dst_host: int) -> Link:
    """The link a message between these hosts arrives on: the destination's NIC in-link, or its local link."""
    return network.link(dst_host, "local") if src_host == dst_host else network.link(dst_host, "in")
