"""Per-rank communication programs: what an ordered executor issues for one boundary.

A boundary's lowered steps are point-to-point messages (one chunk each). The plan times them on the
network model (meshjob.simulate.simulate_transfer: per-link FIFO, dependencies, per-message cost);
each rank's program lists:
- `sends`: its messages in planned start order. An executor issues them in this order, with at
  most `NetworkModel.in_flight_per_link` messages in flight on each link (`send_links[i]` is the
  link of sends[i]); a send whose `after` steps have not landed yet waits for them (they are this
  rank's receives: a chain forwards chunk k as soon as it has it).
- `recvs`: its incoming messages in planned arrival order; post them all when the boundary starts,
  so no sender ever waits on a receiver that is still busy.
The order is a topological order of the steps (a step starts after the steps it depends on end),
and every rank derives it from the same plan, which is also what NCCL needs: two ranks agree on the
order of the messages between them. Across boundaries, a rank runs programs in the order its stage's
action list issues the SEND/RECV actions (meshjob.schedule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from meshjob.network import Link, NetworkModel
from meshjob.resharding import Step
from meshjob.simulate import simulate_transfer


@dataclass(frozen=True)
class RankProgram:
    rank: int
    sends: tuple[Step, ...]  # issue in this order
    send_links: tuple[Link, ...]  # the link each send uses (bound the messages in flight per link)
    recvs: tuple[Step, ...]  # post all up front; they land in this order

    @property
    def send_bytes(self) -> int:
        return sum(s.nbytes() for s in self.sends)


def rank_programs(steps: Sequence[Step], host_of: Callable[[int], int], network: NetworkModel,
                  itemsize: int = 4) -> dict[int, RankProgram]:
    """Every rank's program for one boundary (ranks with nothing to do are absent)."""
    timed = simulate_transfer(steps, host_of, network, itemsize)
    key = {s.id: (timed.start_s[s.id], timed.finish_s[s.id], s.id) for s in steps}
    sends: dict[int, list[Step]] = {}
    recvs: dict[int, list[Step]] = {}
    for s in steps:
        sends.setdefault(s.src, []).append(s)
        recvs.setdefault(s.dst, []).append(s)
    out = {}
    for rank in sorted(set(sends) | set(recvs)):
        mine = sorted(sends.get(rank, []), key=lambda s: key[s.id])
        links = tuple(_link(s, host_of, network) for s in mine)
        landing = sorted(recvs.get(rank, []), key=lambda s: (key[s.id][1], s.id))
        out[rank] = RankProgram(rank, tuple(mine), links, tuple(landing))
    return out


def _link(step: Step, host_of: Callable[[int], int], network: NetworkModel) -> Link:
    src, dst = host_of(step.src), host_of(step.dst)
    return network.link(src, "local") if src == dst else network.link(src, "out")
