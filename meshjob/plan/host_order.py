"""The plan's order on each host's NIC links, across all ranks (devices) of the host.

A host's NIC out-link (and in-link) is shared by every rank of the host, but each rank's engine
(meshjob_trainer.engine) only knows its own messages: with a window per rank, two ranks of one host
send at once and share the NIC however TCP decides, so plans that differ only in the order of
their ranks' messages on a link measure the same. This module derives, from the plan alone, each
host link's messages of one pass (a training step, or evaluation's forward pass) in the order the
plan runs them; the executor's per-host board (meshjob_trainer.board) lets a rank issue its next
message on the link only when that order says it is its turn.

The order is one total order of every message of the pass, restricted to each link: transfers in the
step's order (meshjob.plan.comm_order), and inside a transfer its messages in planned start order (the
order meshjob.plan.program gives each rank; every rank's own sequence on a link is a subsequence of the
host's). Hence it cannot deadlock, for the reason meshjob.plan.program gives for one rank: the earliest
unfinished message of that total order has its data, and is at the head of its sender host's
out-link and of its receiver host's in-link, with nothing in flight before it.

Only full-duplex NIC links ("out", "in") that two or more ranks of a host use are on the board; a
link one rank uses alone keeps that rank's own window, and intra-host links are not shared NICs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshjob.network.host_task import Link
from meshjob.schedule.boundary import BoundaryKey

BoardEntry = tuple[int, BoundaryKey, int, int]  # (rank, boundary, microbatch, message index)
Side = tuple[int, int, Link]  # (rank, message index, link): one end of one message of a boundary
BOARD_DIRECTIONS = ("out", "in")


@dataclass(frozen=True)
class HostLinkOrder:
    """One host's shared NIC links, each with its messages of one pass in issue order."""

    host: int
    links: Mapping[Link, tuple[BoardEntry, ...]]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e[0] for entries in self.links.values() for e in entries}))

    def positions(self, rank: int, link: Link) -> tuple[int, ...]:
        """Where `rank`'s messages stand in the link's order."""
        return tuple(i for i, e in enumerate(self.links.get(link, ())) if e[0] == rank)

    def links_of(self, rank: int) -> tuple[Link, ...]:
        return tuple(link for link, entries in self.links.items() if any(e[0] == rank for e in entries))

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "links": {
                f"{h}/{d}": [[r, str(k), mb, i] for r, k, mb, i in entries] for (h, d), entries in self.links.items()
            },
        }


def host_link_orders(
    transfers: Sequence[tuple[BoundaryKey, int]], sides: Mapping[BoundaryKey, Sequence[Side]]
) -> dict[int, HostLinkOrder]:
    """Per host, its shared NIC links' orders. `transfers`: the pass's transfers in issue order;
    `sides[key]`: both ends of every message of boundary `key`, in the boundary's planned order
    (its send side on the sender's out-link, its receive side on the receiver's in-link)."""
    links: dict[Link, list[BoardEntry]] = {}
    for key, mb in transfers:
        for rank, index, link in sides.get(key, ()):
            if link[1] in BOARD_DIRECTIONS:
                links.setdefault(link, []).append((rank, key, mb, index))
    shared = {link: tuple(entries) for link, entries in links.items() if len({e[0] for e in entries}) > 1}
    hosts = sorted({link[0] for link in shared})
    return {h: HostLinkOrder(h, {link: e for link, e in sorted(shared.items()) if link[0] == h}) for h in hosts}


def check_subsequence(order: HostLinkOrder, rank: int, link: Link, own: Sequence[tuple[BoundaryKey, int, int]]) -> None:
    """A rank's own sequence on a link must be its messages in the host's order: else the board and
    the rank disagree on whose turn it is (a hang), so say so at setup."""
    mine = [(k, mb, i) for r, k, mb, i in order.links.get(link, ()) if r == rank]
    if mine != list(own):
        first = next((j for j, (a, b) in enumerate(zip(mine, own)) if a != b), min(len(mine), len(own)))
        raise ValueError(
            f"rank {rank}: its messages on link {link} differ from the host's order at its message "
            f"{first} ({len(own)} messages, the host's order has {len(mine)} of this rank)"
        )
