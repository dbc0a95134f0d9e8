"""Unit tasks lifted to hosts (HostTask) and what one costs on the links (TaskCost).

The balancers, their lower bound and the simulator see a resharding unit task only at this level: which
hosts may send it, which hosts receive it, its bytes; and, once a strategy prices it
(meshjob.resharding.strategies), its duration and the NIC links it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

Link = tuple[int, str]  # (host, "out" | "in") full duplex, (host, "nic") half duplex, (host, "local")

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
    # their messages' CPU work together (meshjob.resharding.window.with_shares).
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
