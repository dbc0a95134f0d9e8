"""The per-host board: the ranks of one host take their turns on the host's shared NIC links.

Each rank's communication engine (meshjob_trainer.engine) keeps its own window per link, but a
host's NIC is shared by all its ranks. The board holds, per shared link, the plan's order of the
host's messages (meshjob.plan.host_order) as counters in a small shared-memory segment: how many of
the link's messages have been issued (written only by the rank whose turn it is, so one writer at
a time), and per rank how many of its messages on the link are done and how many bytes it has in
flight (each rank writes only its own). A rank issues its next message on a board link when the
issued count says it is its turn and the host's messages in flight leave room (`may_start`).

Wake-ups do not poll: every rank owns a FIFO; after it issues or completes a message on a link it
writes a byte to the FIFO of the rank whose turn it is now on that link (only that rank may issue
next, so only it can be waiting for this), and a waker thread per rank turns the bytes into a nudge
of its engine. The waker also ticks once a second so a rank blocked on the board
notices a dead peer (its pid is gone) or a turn that never comes (`timeout_s`): a clear error, no hang.

A peer's landing: where the host's in-link hands over from one rank's large receive to another rank's
receive of the same transfer, the next rank cannot read the first one's landing markers (its buffer is
in the first rank's memory, meshjob_trainer.landing). So the first rank watches them (`watch`) and says
on the board when its bytes are within the lead (`landed_soon`, which wakes the next rank); until then
the next rank's receive waits (`peer_landing_due_s`), and without a watch it goes by the host's clock.

Naming and cleanup: the ranks of a host meet in the job's key-value store under a key every rank
derives alike (the board's serial number in the process and the host); the first to arrive names
the segment (a random name in /dev/shm), the others open it, and the last rank to have opened every
FIFO unlinks the files: the mappings live on until close(), nothing is left in /dev/shm.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import math
import mmap
import os
import select
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshjob.network.host_task import Link
from meshjob.plan.host_order import BoardEntry, HostLinkOrder
from meshjob_trainer.procs import pid_alive

PREFIX = "meshjob-board-"
TICK_S = 1.0  # how often a blocked rank checks its peers


class BoardError(RuntimeError):
    """A rank waited on its host's board for a peer that died or never took its turn."""


def may_start(
    in_flight: int,
    in_flight_bytes: int,
    nbytes: int,
    window: int,
    overlap_bytes: int | None,
    due_in_s: float = math.inf,
    lead_s: float = 0.0,
    small_window: int = 0,
) -> bool:
    """Whether a message may join a NIC link's `in_flight` messages: always onto an idle link; behind
    others only within the window, and only while those in flight are small (`overlap_bytes`): a second
    message in flight hides the gap between two small ones, but two large ones would share the link
    for their whole length instead of running one after the other as the plan times them. Behind a
    large one, the next may go `lead_s` before the link's clock says those in flight are through
    (`due_in_s` from now): its notice reaches the peer while the link still carries the previous one,
    instead of a hand-over gap of wake-ups on the shared cores (meshjob.network.model.HANDOVER_LEAD_S). Not
    once they are overdue by more than that: their sender started late, and the clock does not know
    how much they have left. Beyond the window, small messages pack: one of at most overlap_bytes /
    small_window bytes joins while fewer than `small_window` are in flight and their bytes, its own
    included, stay within `overlap_bytes` (together they are as short as one message the threshold lets
    another join)."""
    if in_flight == 0:
        return True
    if in_flight >= window:
        return (
            overlap_bytes is not None
            and in_flight < small_window
            and packs(nbytes, small_window, overlap_bytes)
            and in_flight_bytes + nbytes <= overlap_bytes
        )
    return overlap_bytes is None or in_flight_bytes <= overlap_bytes or (lead_s > 0 and abs(due_in_s) <= lead_s)


def packs(nbytes: int, small_window: int, overlap_bytes: int | None) -> bool:
    """Whether a message is small enough to pack beyond the window: at most overlap_bytes / small_window."""
    return overlap_bytes is not None and nbytes * small_window <= overlap_bytes


def link_clock_after(clock_ns: int, now_ns: int, nbytes: int, nic_bytes_per_s: float) -> int:
    """A NIC link's clock once `nbytes` more are issued on it at `now_ns`: when the bytes issued so far can
    be through (ns, time.monotonic_ns), at the NIC's rate from the issue or from the end of those before,
    whichever is later. A lower bound on when they leave: the real link is no faster. The engine keeps one
    per rank and NIC link, the board one per shared link of the host (meshjob_trainer.engine)."""
    if not nic_bytes_per_s > 0:
        raise ValueError(f"nic_bytes_per_s {nic_bytes_per_s!r} is invalid: a rate > 0")
    if nbytes < 0:
        raise ValueError(f"nbytes {nbytes!r} is invalid: an integer >= 0")
    return max(clock_ns, now_ns) + int(nbytes / nic_bytes_per_s * 1e9)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass
class _Turns:
    """This rank's messages on one board link: where they stand in the host's order of one pass."""

    base: int  # index of the link's first counter in the board
    positions: tuple[int, ...]
    length: int  # messages of the host on the link per pass
    peers: tuple[int, ...]  # slots of the other ranks on the link
    owners: tuple[int, ...]  # slot of the rank of each of the link's messages
    due: int  # index of the link's clock: when (ns, time.monotonic) the bytes issued so far are through
    lands: int  # index of the link's landing cells: per slot, its watched message's number + 1 and its state
    next: int = 0
    rounds: int = 0

    def target(self) -> int:
        """The issued count at which this rank's next message is the link's next."""
        return self.rounds * self.length + self.positions[self.next]

    def same_transfer(self, order: tuple[BoardEntry, ...], number: int, other: int) -> bool:
        """Whether the link's messages `number` and `other` (issued counts) are of one transfer in one pass."""
        if number < 0 or other < 0 or number // self.length != other // self.length:
            return False
        a, b = order[number % self.length], order[other % self.length]
        return a[1:3] == b[1:3]

    def advance(self) -> None:
        self.next += 1
        if self.next == len(self.positions):
            self.next, self.rounds = 0, self.rounds + 1


class HostBoard:
    """One rank's view of its host's board for one pass order (`order`: the host's link orders). `clock_ns`:
    the host's clock, which the board's link clocks count in (time.monotonic_ns: one clock for every process
    of the machine; tests pass one whose time they set)."""

    def __init__(
        self,
        order: HostLinkOrder,
        rank: int,
        window: int,
        overlap_bytes: int | None,
        store: Any,
        key: str,
        on_wake: Callable[[str], None] = lambda _: None,
        timeout_s: float = 300.0,
        nic_bytes_per_s: float | None = None,
        lead_s: float = 0.0,
        small_window: int = 0,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.order, self.rank, self.window, self.overlap_bytes = order, rank, window, overlap_bytes
        self.small_window = small_window
        self.nic_bytes_per_s, self.lead_s = nic_bytes_per_s, lead_s
        self.timeout_s, self._on_wake = timeout_s, on_wake
        self._clock_ns = clock_ns  # the host's clock: every rank of the host must read the same one
        self.ranks = order.ranks
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} has no message on host {order.host}'s shared links")
        self.slot = self.ranks.index(rank)
        n = len(self.ranks)
        self.turns: dict[Link, _Turns] = {}
        clocks = n + len(order.links) * (1 + 2 * n)  # one clock per link after the links' counters
        lands = clocks + len(order.links)  # then per link and slot two landing cells
        for i, (link, entries) in enumerate(order.links.items()):
            on_link = {self.ranks.index(e[0]) for e in entries}
            if self.slot in on_link:
                self.turns[link] = _Turns(
                    n + i * (1 + 2 * n),
                    order.positions(rank, link),
                    len(entries),
                    tuple(sorted(on_link - {self.slot})),
                    tuple(self.ranks.index(e[0]) for e in entries),
                    clocks + i,
                    lands + i * 2 * n,
                )
        self._size = lands + len(order.links) * 2 * n
        self._closed = False
        name = store.compare_set(f"{key}/name", "", f"{PREFIX}{uuid.uuid4().hex}").decode()
        self.path = os.path.join(shm_dir(), name)
        self._fifo_path = f"{self.path}.r{rank}"
        os.mkfifo(self._fifo_path, 0o600)
        self._rfd = os.open(self._fifo_path, os.O_RDONLY | os.O_NONBLOCK)
        self._keep = os.open(self._fifo_path, os.O_WRONLY | os.O_NONBLOCK)  # no EOF while peers come and go
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self._size * 8:
                os.ftruncate(fd, self._size * 8)  # zero-filled; every rank asks the same size
            self._map = mmap.mmap(fd, self._size * 8)
        finally:
            os.close(fd)
        self._cells = (ctypes.c_int64 * self._size).from_buffer(self._map)
        self._cells[self.slot] = os.getpid()
        timeout = datetime.timedelta(seconds=timeout_s)
        if store.add(f"{key}/attached", 1) == n:
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"], timeout)  # every FIFO exists now
        self._peer_fds: dict[int, int] = {}
        for slot in sorted({p for t in self.turns.values() for p in t.peers}):
            try:
                self._peer_fds[slot] = os.open(f"{self.path}.r{self.ranks[slot]}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # it died on the way (its FIFO is gone or unread): check() says so if we wait on it
                pass
        if store.add(f"{key}/opened", 1) == n:  # everyone holds what it needs: leave nothing behind
            self._unlink_all()
        self._thread = threading.Thread(target=self._wake_loop, name=f"board waker rank {rank}", daemon=True)
        self._thread.start()

    # -- the engine's calls (its thread only) ------------------------------------------------------
    @property
    def links(self) -> frozenset[Link]:
        return frozenset(self.turns)

    def ready(self, link: Link, nbytes: int, due_in_s: float | None = None) -> bool:
        """Whether this rank's next message on `link` may go now. `due_in_s`: when those in flight are
        through, where the rank knows more than the host's clock (its own receive's landing markers)."""
        t = self.turns[link]
        c, n = self._cells, len(self.ranks)
        issued = c[t.base]
        if issued != t.target():
            return False
        done = sum(c[t.base + 1 + 2 * s] for s in range(n))
        in_bytes = sum(c[t.base + 2 + 2 * s] for s in range(n))
        due = self.due_in_s(link) if due_in_s is None else due_in_s
        return may_start(
            issued - done, in_bytes, nbytes, self.window, self.overlap_bytes, due, self.lead_s, self.small_window
        )

    def due_in_s(self, link: Link) -> float:
        """How long until the host's messages issued on `link` are through by its clock (inf: no clock)."""
        if not self.nic_bytes_per_s:
            return math.inf
        return (self._cells[self.turns[link].due] - self._clock_ns()) * 1e-9

    def watch(self, link: Link) -> int | None:
        """This rank's next message on `link`, a receive with landing markers, is about to be issued: when
        the link's next message is another rank's of the same transfer, mark it watched (that rank then
        waits for `landed_soon`) and return its number; None otherwise. Call before `issued`."""
        t = self.turns[link]
        number = t.target()
        if t.owners[(number + 1) % t.length] == self.slot or not t.same_transfer(
            self.order.links[link], number, number + 1
        ):
            return None
        cell = t.lands + 2 * self.slot
        self._cells[cell + 1] = 0  # not within the lead yet: written before the number that makes it read
        self._cells[cell] = number + 1
        return number

    def landed_soon(self, link: Link, number: int) -> None:
        """This rank's watched message `number` on `link` is within the lead of landing: the next may go."""
        t = self.turns[link]
        cell = t.lands + 2 * self.slot
        if self._cells[cell] == number + 1:
            self._cells[cell + 1] = 1
            self._notify(t)

    def peer_landing_due_s(self, link: Link) -> float | None:
        """At this rank's turn on `link`: when the previous message, another rank's watched receive of the
        same transfer, is in, as far as its rank has said: inf until its bytes are within the lead, then 0.
        None where there is no such message (the host's clock leads then)."""
        t = self.turns[link]
        number = t.target() - 1
        if self._cells[t.base] != number + 1 or not t.same_transfer(self.order.links[link], number, number + 1):
            return None
        slot = t.owners[number % t.length]
        cell = t.lands + 2 * slot
        if slot == self.slot or self._cells[cell] != number + 1:
            return None
        return 0.0 if self._cells[cell + 1] else math.inf

    def issued(self, link: Link, nbytes: int, now_ns: int | None = None) -> int | None:
        """This rank's next message on `link` is issued (at `now_ns`, the board's clock; default: now): count
        its bytes, advance the host's link clock and hand the turn on. Returns that clock (ns: when the
        host's bytes issued on the link so far are through; None: no NIC rate)."""
        t = self.turns[link]
        mine = t.base + 2 + 2 * self.slot
        self._cells[mine] = self._cells[mine] + nbytes
        clock_ns = None
        if self.nic_bytes_per_s:  # the host's link clock (only the rank whose turn it is writes it)
            now_ns = self._clock_ns() if now_ns is None else now_ns
            clock_ns = self._cells[t.due] = link_clock_after(self._cells[t.due], now_ns, nbytes, self.nic_bytes_per_s)
        self._cells[t.base] = t.target() + 1  # the next message's turn: written last
        t.advance()
        self._notify(t)
        return clock_ns

    def completed(self, link: Link, nbytes: int) -> None:
        t = self.turns[link]
        done, held = t.base + 1 + 2 * self.slot, t.base + 2 + 2 * self.slot
        self._cells[held] = self._cells[held] - nbytes
        self._cells[done] = self._cells[done] + 1
        self._notify(t)

    def check(self, blocked_s: float) -> None:
        """Raise BoardError when a rank this one waits on is dead, or the wait passed `timeout_s`."""
        for slot, rank in enumerate(self.ranks):
            pid = self._cells[slot]
            if slot != self.slot and pid and not pid_alive(pid):
                raise BoardError(
                    f"rank {self.rank}: rank {rank} of host {self.order.host} (pid {pid}) died while "
                    f"this rank waited for its turn on the host's links {self._waiting()}"
                )
        if blocked_s > self.timeout_s:
            raise BoardError(
                f"rank {self.rank}: waited {blocked_s:.0f} s (more than {self.timeout_s:g} s) for its "
                f"turn on host {self.order.host}'s links {self._waiting()}"
            )

    def _waiting(self) -> str:
        parts = []
        for link, t in self.turns.items():
            issued = self._cells[t.base]
            if issued != t.target():
                holder = self.order.links[link][issued % t.length]
                parts.append(
                    f"{link[0]}/{link[1]}: message {issued % t.length} of {t.length} is rank {holder[0]}'s "
                    f"({holder[1]} microbatch {holder[2]}), this rank's next is {t.target() % t.length}"
                )
        return "; ".join(parts) or "(in flight full)"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._keep, b"q")
        except OSError:
            pass
        self._thread.join(5.0)
        for fd in (self._rfd, self._keep, *self._peer_fds.values()):
            os.close(fd)
        del self._cells
        self._map.close()
        self._unlink_all()  # already gone unless a peer never came

    # -- internals ---------------------------------------------------------------------------------
    def _notify(self, t: _Turns) -> None:
        """Wake the rank whose turn it is on the link (unless this one): it alone may be waiting for what
        just changed (its turn, or room in flight). A wake-up lost to a stale read costs one tick."""
        slot = t.owners[self._cells[t.base] % t.length]
        fd = self._peer_fds.get(slot) if slot != self.slot else None
        if fd is None:
            return
        try:
            os.write(fd, b"!")
        except OSError as err:  # a full FIFO has wake-ups enough; a gone reader is checked on the tick
            if err.errno not in (errno.EAGAIN, errno.EPIPE):
                raise

    def _wake_loop(self) -> None:
        while not self._closed:
            readable, _, _ = select.select([self._rfd], [], [], TICK_S)
            if self._closed:
                return
            if readable:
                try:
                    os.read(self._rfd, 4096)
                except BlockingIOError:
                    continue
                self._on_wake("board")
            else:
                self._on_wake("tick")

    def _unlink_all(self) -> None:
        for path in (self.path, *(f"{self.path}.r{r}" for r in self.ranks)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
