"""One communication engine per rank: it issues every message the rank sends or receives, in the
order the plan gives, with a bounded number in flight per link.

The resharding executor (meshjob_trainer.reshard) turns each (boundary, microbatch) this rank takes
part in into a Job: its messages (each one point-to-point step of the plan, or of the all-gather
inside the destination mesh) and the buffers they read and fill. The compute thread starts jobs
(the pipeline's SEND and RECV actions) and goes on computing; one engine thread issues every
message on the wire (meshjob_trainer.wire):

- receives are posted on their in-link (the host's NIC in-link, or its local link) in the link's
  planned order, at most `in_flight_per_link` at a time, as soon as their job has started: a sender
  never waits on a receiver that is busy computing, and since gloo and NCCL send only once the
  receive is posted, the in-link takes its messages in the planned order instead of sharing itself
  between every sender at once (a forwarding rank then has first what it must forward first);
- sends leave on their link (the host's NIC out-link, or its local link: meshjob.network.model) in the
  link's order, at most `in_flight_per_link` at a time, each once the receives it depends on have
  landed: a chain forwards chunk k while chunk k + 1 is still arriving, and the plan, not the NIC's
  queue, decides which transfer goes first;
- the order is planned (a meshjob.plan.comm_order.TransferOrder): every transfer of the step in one order
  all ranks derive from the plan, and inside a transfer the sender's program order (meshjob.plan.program).
  It is what NCCL needs, and it cannot deadlock (meshjob.plan.comm_order says why). Without a plan
  (benchmarks and tests of single boundaries) transfers go in the order their jobs start, which
  every rank must then start them in.

Across the ranks of a host: a host's NIC links are shared by all its ranks, each with its own engine.
With a plan, the ranks of a host also follow the plan's order of the host's messages on each shared
NIC link, and its bound on those in flight, through the host's board (meshjob_trainer.board,
meshjob.plan.host_order): a rank's next message on such a link waits for its turn there. On every NIC
link a message joins others in flight only while those are small (`overlap_bytes`): two large ones
would share the link instead of running one after the other as the plan times them.

The rules on a NIC link (trainer/ENGINE.md has why, the runs that decided each, and what was tried
and left out):
- a large send (more than `overlap_bytes`: it runs alone on the link) counts in flight, in the link's
  window and on the board, until its bytes can have left at the NIC's rate (`nic_bytes_per_s`; the
  link's clock, board.link_clock_after: on a board's link the host's, else this rank's), not merely
  until the wire reports it done: gloo reports a send done once its bytes sit in the socket buffer;
- small messages pack beyond the window: one of at most overlap_bytes / `small_in_flight_per_link`
  joins while fewer than that many are in flight and their bytes stay within overlap_bytes
  (board.may_start); anything else meets a full window and waits for a completion (`_within_window`);
- the hand-over lead: behind a large message, the link's next one is issued `lead_s`
  (meshjob.network.model.HANDOVER_LEAD_S) before the link's clock says the first is through, the engine
  waking itself for it (`_wake_at`); not once the first is overdue by more than the lead. A large
  receive on an in-link carries landing markers (meshjob_trainer.landing) and the next receive of the
  same transfer goes by its buffer, not the clock (`_in_link_due_s`); where that next receive is another
  rank's of the host, this rank tells it through the board (`_watch_landings`).

Completions come from waiter threads, one per peer and direction, each blocking on its messages in
issue order (gloo has no other way to tell, see meshjob_trainer.wire); they only report back. The
engine thread sleeps until a job starts or a message completes: no polling.

Memory: the buffers a job allocates count as payload in flight from allocation until they are not:
its receive tile and assembled result until the compute takes the result (they are activations
then; a chain's forwards still read them, at no cost), a staging copy of a region that is not
contiguous until it is sent or has landed. `memory` holds the bytes and their peak.

`MESHJOB_ENGINE_TRACE` (a folder): every engine writes there, when it closes, each message's job
start, when only the window or the board held it, its issue, when the wire reported it (`wire_s`: for a
send, its bytes are in the kernel's socket buffer, which gloo fills only once the receive is posted) and
its completion (time.monotonic, one clock for every process of a machine), one JSON line each: where a
transfer's time went (a large send reported after its link clock's end: a late receive, or busy cores).
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from meshjob.network.host_task import Link
from meshjob.plan.comm_order import TransferOrder
from meshjob.plan.host_order import check_subsequence
from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.board import HostBoard, link_clock_after, may_start, packs
from meshjob_trainer.engine_job import Handle, Job, Memory, Message, MessageSpec
from meshjob_trainer.landing import LandingProbe
from meshjob_trainer.wire import Wire

Entry = tuple[BoundaryKey, int, int]  # (boundary, microbatch, message index): one message of one transfer
# what the engine thread takes: a started job, a wake-up ("board" or "tick"), a message done (with its error)
_Item = (
    tuple[Literal["job"], Job]
    | tuple[Literal["wake"], str]
    | tuple[Literal["done"], Job, Message, BaseException | None]
)
TRACE_ENV = "MESHJOB_ENGINE_TRACE"  # a folder: each engine writes there, on close, every message's times
_ENGINES = itertools.count()  # engines built by this process (names its trace file)


class Clock:
    """Where the engine reads the time and waits on it: time.monotonic (its link clocks in time.monotonic_ns,
    as the host's board's) and real waits. Tests pass one whose time they move themselves, to check the
    instants the engine chooses exactly (tests/test_host_board.py)."""

    def now(self) -> float:
        return time.monotonic()

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, cond: threading.Condition, timeout_s: float | None) -> None:
        """Wait on `cond` (held by the caller) until it is notified or `timeout_s` has passed (None: no limit)."""
        cond.wait(timeout_s)


class EngineError(RuntimeError):
    """A job the engine cannot run (not in the step's order, or the engine is closed)."""


class _Sequence:
    """The messages of one link (sends) or one peer (receives) in issue order. Planned: one step's
    entries, issued round and round (every step runs the same transfers). Unplanned: entries are
    appended as their jobs start."""

    def __init__(self, planned: Sequence[Entry] | None = None) -> None:
        self.planned = planned is not None
        self.entries: collections.deque[Entry] = collections.deque(planned or ())

    def head(self) -> Entry | None:
        return self.entries[0] if self.entries else None

    def advance(self) -> None:
        entry = self.entries.popleft()
        if self.planned:
            self.entries.append(entry)


BoardFor = Callable[[TransferOrder, Callable[[str], None]], HostBoard | None]  # (order, wake) -> the host's board


class CommEngine:
    """The rank's engine. `specs`: per boundary, this rank's messages (sends in the sender's program
    order, receives in their sender's); `order`: the step's transfer order, or None (start order).
    `board_for(order, wake)`: the host's board for a planned order (meshjob_trainer.board), or None
    when this rank shares no NIC link with another rank of its host; `overlap_bytes`: on NIC links,
    how many bytes in flight still let another message join them (None: the window alone); `clock`: its
    time (a board's must read the same)."""

    def __init__(
        self,
        rank: int,
        wire: Wire,
        specs: Mapping[BoundaryKey, Sequence[MessageSpec]],
        in_flight_per_link: int = 2,
        order: TransferOrder | None = None,
        board_for: BoardFor | None = None,
        overlap_bytes: int | None = None,
        nic_bytes_per_s: float | None = None,
        lead_s: float = 0.0,
        small_in_flight_per_link: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if in_flight_per_link < 1:
            raise ValueError(f"in_flight_per_link {in_flight_per_link!r} is invalid: an integer >= 1")
        small = in_flight_per_link if small_in_flight_per_link is None else small_in_flight_per_link
        if small < in_flight_per_link:
            raise ValueError(
                f"small_in_flight_per_link {small!r} is invalid: an integer >= in_flight_per_link "
                f"({in_flight_per_link})"
            )
        self.rank, self.wire, self.specs, self.order = rank, wire, specs, order
        self.clock = Clock() if clock is None else clock
        self.in_flight_per_link = in_flight_per_link
        # on NIC links small messages pack beyond the window, within overlap_bytes (board.may_start)
        self.small_in_flight_per_link = small if overlap_bytes is not None else in_flight_per_link
        self.overlap_bytes = overlap_bytes
        self.nic_bytes_per_s, self.lead_s = nic_bytes_per_s, lead_s
        self._link_clock: dict[Link, int] = {}  # NIC links off the board: when their bytes are through (ns)
        self.memory = Memory()
        self._board_for = board_for
        self.board: HostBoard | None = None
        self._blocked_since: float | None = None  # when a message first waited on the board for its turn
        self._sends: dict[Link | None, _Sequence] = {}
        self._recvs: dict[Link | None, _Sequence] = {}
        self._in_flight: dict[Link | None, int] = collections.defaultdict(int)  # sends issued, not done
        self._posted: dict[Link | None, int] = collections.defaultdict(int)  # receives posted, not landed
        self._bytes: dict[Link | None, int] = collections.defaultdict(int)  # their bytes, per link
        self._landing: dict[Link | None, list[tuple[Job, Message]]] = collections.defaultdict(list)  # with markers
        self._watched: list[tuple[Link, int, Message]] = []  # marked receives the host's next rank waits on
        self._jobs: dict[tuple[BoundaryKey, int], collections.deque[Job]] = collections.defaultdict(collections.deque)
        self._inbox: list[_Item] = []
        self._cond = threading.Condition()
        self._waiters: dict[tuple[int, bool], _Waiter] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._board_waits = False
        self._wake_at: float | None = None  # when a message held behind a large one may go (its lead)
        self.serial = next(_ENGINES)
        self._trace_dir = os.environ.get(TRACE_ENV) or None
        self._trace: list[tuple[Any, ...]] = []
        if order is not None:
            self._plan_sequences(order)
            self._use_board(None if board_for is None else board_for(order, self._wake))
        self._thread = threading.Thread(target=self._main, name=f"comm engine rank {rank}", daemon=True)
        self._thread.start()

    def _plan_sequences(self, order: TransferOrder) -> None:
        sends: dict[Link | None, list[Entry]] = collections.defaultdict(list)
        recvs: dict[Link | None, list[Entry]] = collections.defaultdict(list)
        for key, mb in order.transfers:
            for spec in self.specs.get(key, ()):
                if spec.send:
                    sends[spec.link].append((key, mb, spec.index))
                else:
                    recvs[spec.link].append((key, mb, spec.index))
        self._sends = {link: _Sequence(entries) for link, entries in sends.items()}
        self._recvs = {link: _Sequence(entries) for link, entries in recvs.items()}

    def _use_board(self, board: HostBoard | None) -> None:
        """Follow `board` (None: none) from now on; its turns must be this rank's own sequences."""
        if board is not None:
            try:
                for link in board.links:
                    seq = self._sends.get(link) if link[1] == "out" else self._recvs.get(link)
                    check_subsequence(board.order, self.rank, link, list(seq.entries) if seq else [])
            except ValueError:
                board.close()
                raise
        self.board = board

    def _wake(self, why: str) -> None:
        """The board's waker: a peer moved on a shared link ("board"), or a second passed ("tick")."""
        self._post(("wake", why))

    # -- the compute thread's side -----------------------------------------------------------
    def use_order(self, order: TransferOrder) -> None:
        """Run another planned order from the next job on (evaluation's forward-only pass). Only
        between passes, when no job is under way: every planned sequence is back at its start then."""
        with self._cond:
            if self.order is None or any(i[0] != "wake" for i in self._inbox) or self._active():
                raise EngineError("the order can change only between passes of a planned engine")
            self.order = order
            self._plan_sequences(order)
            old, self.board = self.board, None  # no job is under way: nothing is issued meanwhile
        if old is not None:
            old.close()  # outside the lock: its waker may be posting to the engine
        board = None if self._board_for is None else self._board_for(order, self._wake)
        with self._cond:
            self._use_board(board)

    def submit(self, job: Job) -> Handle:
        """Hand a job to the engine; returns its handle at once."""
        if self.order is not None:
            self.order.position(job.key, job.mb)  # KeyError names a transfer the step does not have
        job.source_mark = self.wire.mark()
        job.memory = self.memory
        handle = job.handle  # the engine drops it from the job once the job is done, maybe before we return
        with self._cond:
            if self._error is not None:
                handle._fail(self._error)
                return handle
            if self._closing:
                raise EngineError(f"rank {self.rank}: the communication engine is closed")
            self._inbox.append(("job", job))
            self._cond.notify()
        return handle

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the jobs under way (a chain's last forwards), then stop the engine and its waiters."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        for waiter in self._waiters.values():
            waiter.stop()
        for waiter in self._waiters.values():
            waiter.thread.join(timeout_s)
        if self.board is not None:
            self.board.close()
        if self._trace_dir is not None and self._trace:
            self._write_trace(self._trace_dir)

    def _write_trace(self, folder: str) -> None:
        """Every message's times (time.monotonic: one clock for every process of the machine) as JSON lines:
        its job's start, when only its link's window or the board held it back, its issue, when the wire
        reported it, its completion."""
        path = os.path.join(folder, f"engine-r{self.rank}-{os.getpid()}-{self.serial}.jsonl")
        names = (
            "key",
            "mb",
            "index",
            "send",
            "peer",
            "link",
            "nbytes",
            "job_s",
            "ready_s",
            "issued_s",
            "wire_s",
            "done_s",
        )
        with open(path, "w") as f:
            for row in self._trace:
                f.write(json.dumps({"rank": self.rank, "engine": self.serial, **dict(zip(names, row))}) + "\n")
        self._trace = []

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- the engine thread ---------------------------------------------------------------------
    def _post(self, item: _Item) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def _main(self) -> None:
        item: _Item | None = None
        with self.wire.engine_stream():
            while True:
                with self._cond:
                    while not self._inbox:
                        if self._closing and not self._active():
                            return  # closing, nothing under way
                        timeout = None if self._wake_at is None else self._wake_at - self.clock.now()
                        if timeout is not None and timeout <= 0:
                            break  # a held message's lead has come: issue again
                        self.clock.wait(self._cond, timeout)
                    items, self._inbox = self._inbox, []
                try:
                    for item in items:
                        self._take(item)
                    self._issue()
                except BaseException as err:  # noqa: BLE001 - a broken wire fails every job, not the thread
                    self._fail_all(err)
                items.clear()  # hold no job while waiting for the next
                item = None

    def _active(self) -> bool:
        return any(self._jobs.values())

    def _take(self, item: _Item) -> None:
        if item[0] == "job":
            job = item[1]
            if self._error is not None:
                job.handle._fail(self._error)
                return
            self._jobs[(job.key, job.mb)].append(job)
            if self.order is None:
                self._append(job)
            self._settle(job)
            return
        if item[0] == "wake":
            if item[1] == "tick" and self._blocked_since is not None and self.board is not None:
                self.board.check(self.clock.now() - self._blocked_since)
            return
        _, job, message, error = item
        if error is not None:
            raise error
        self._completed(job, message)

    def _append(self, job: Job) -> None:
        """Unplanned: the job's messages join their sequences in its own (program) order."""
        for spec in self.specs.get(job.key, ()):
            entry = (job.key, job.mb, spec.index)
            if spec.send:
                self._sends.setdefault(spec.link, _Sequence()).entries.append(entry)
            else:
                self._recvs.setdefault(spec.link, _Sequence()).entries.append(entry)

    def _job_for(self, entry: Entry) -> tuple[Job, Message] | None:
        """The oldest started job whose message `entry` is not issued yet (None: not started)."""
        key, mb, index = entry
        for job in self._jobs.get((key, mb), ()):
            message = job.messages[index]
            if not message.issued:
                return job, message
        return None

    def _may_start(self, link: Link | None, count: int, nbytes: int, job: Job | None = None) -> bool:
        """Whether the next message on `link` may go, given this rank's `count` in flight there: its
        turn on the host's board, and room in the link's window. `job`: a receive's (_in_link_due_s)."""
        if self.board is not None and link in self.board.links:
            due_in_s, landing = self._in_link_due_s(link, self.board.due_in_s(link), job)
            peer_s = self.board.peer_landing_due_s(link) if job is not None else None
            if self.board.ready(link, nbytes, due_in_s if peer_s is None else max(due_in_s, peer_s)):
                return True
            self._board_waits = True
            if peer_s is None or peer_s <= due_in_s:  # else the peer's rank wakes this one (board.landed_soon)
                self._wake_for(due_in_s, landing)
            return False
        if link is None or link[1] == "local":
            return True
        clock_s = (self._link_clock[link] - self.clock.now_ns()) * 1e-9 if link in self._link_clock else math.inf
        due_in_s, landing = self._in_link_due_s(link, clock_s, job)
        if may_start(
            count,
            self._bytes[link],
            nbytes,
            self.in_flight_per_link,
            self.overlap_bytes,
            due_in_s,
            self.lead_s,
            self.small_in_flight_per_link,
        ):
            return True
        self._wake_for(due_in_s, landing)
        return False

    def _in_link_due_s(self, link: Link | None, clock_s: float, job: Job | None) -> tuple[float, bool]:
        """When the messages in flight on `link` are through, for the hand-over lead: the link's clock
        (`clock_s` from now), or, with this rank's large receives of the same transfer as the next one
        (`job`) in flight there, the later of the clock and what their buffers show (landing markers,
        meshjob_trainer.landing). Also whether markers were read."""
        rate = self.nic_bytes_per_s
        probes = [m.landing for j, m in self._landing.get(link, ()) if j is job and m.landing is not None]
        if not probes or not rate:  # markers are placed only with a NIC rate
            return clock_s, False
        due = max(p.due_in_s(rate) for p in probes)
        return (max(clock_s, due) if clock_s < math.inf else due), True

    def _mark_landing(self, link: Link | None, job: Job, message: Message) -> None:
        """A large receive on a NIC in-link gets landing markers, where the lead is on (see above)."""
        rate = self.nic_bytes_per_s
        if (
            self.lead_s > 0
            and rate
            and self.overlap_bytes is not None
            and link is not None
            and link[1] == "in"
            and message.nbytes > self.overlap_bytes
            and message.tensor is not None
        ):
            probe = message.landing = LandingProbe.place(message.tensor, int(self.lead_s * rate))
            if probe is not None:
                self._landing[link].append((job, message))
                if self.board is not None and link in self.board.links:
                    number = self.board.watch(link)
                    if number is not None:
                        self._watched.append((link, number, message))
                        self._wake_for(probe.due_in_s(rate), True)

    def _watch_landings(self) -> None:
        """Tell the host's next rank on a board in-link when this rank's watched receive is within the lead
        of landing (meshjob_trainer.board: it cannot read the markers); look again when it may be."""
        watching = []
        rate = self.nic_bytes_per_s  # set: markers are placed only with a NIC rate
        for link, number, message in self._watched:
            if message.landing is None or not rate:
                continue  # landed: its completion woke the next rank
            due_in_s = message.landing.due_in_s(rate)
            if due_in_s <= self.lead_s:
                assert self.board is not None  # only the links of a board are watched
                self.board.landed_soon(link, number)
                continue
            watching.append((link, number, message))
            self._wake_for(due_in_s, True)
        self._watched = watching

    def _wake_for(self, due_in_s: float, landing: bool = False) -> None:
        """A message waits behind a large one due through its link in `due_in_s`: wake the engine when
        its lead comes (nothing else may happen then to wake it). `landing`: the due is read off a
        receive's markers, whose bytes may be anywhere short of the next one: look again no sooner than
        an eighth of the lead (meshjob_trainer.landing)."""
        if self.lead_s > 0 and self.lead_s < due_in_s < math.inf:
            at = self.clock.now() + max(due_in_s - self.lead_s, self.lead_s / 8 if landing else 0.0)
            self._wake_at = at if self._wake_at is None else min(self._wake_at, at)

    def _within_window(self, link: Link | None, count: int, nbytes: int) -> bool:
        """Whether a message of `nbytes` fits `link`'s window beside `count` in flight: within it, or beyond
        it on a NIC link a small one that may pack (board.may_start then checks their bytes). Anything else
        waits for a completion, as it did before small messages packed."""
        if count < self.in_flight_per_link:
            return True
        return (
            link is not None
            and link[1] != "local"
            and count < self.small_in_flight_per_link
            and packs(nbytes, self.small_in_flight_per_link, self.overlap_bytes)
        )

    def _issue(self) -> None:
        self._board_waits, self._wake_at = False, None
        if self._watched:
            self._watch_landings()
        for link, seq in self._recvs.items():
            while (entry := seq.head()) is not None:
                found = self._job_for(entry)
                if found is None:
                    break
                job, message = found
                message.nbytes = job.nbytes(message.spec)
                if not self._within_window(link, self._posted[link], message.nbytes):
                    break
                message.ready_s = message.ready_s or self.clock.now()
                if not self._may_start(link, self._posted[link], message.nbytes, job):
                    break
                message.tensor = job.target(message.spec)
                self._posted[link] += 1
                self._mark_landing(link, job, message)
                self._start(job, message, self.wire.irecv)
                seq.advance()
        for link, seq in self._sends.items():
            while (entry := seq.head()) is not None:
                found = self._job_for(entry)
                if found is None:
                    break
                job, message = found
                if not all(job.messages[d].done for d in message.spec.deps):
                    break
                message.nbytes = job.nbytes(message.spec)
                if not self._within_window(link, self._in_flight[link], message.nbytes):
                    break
                message.ready_s = message.ready_s or self.clock.now()
                if not self._may_start(link, self._in_flight[link], message.nbytes):
                    break
                if job.source_mark is not None:
                    self.wire.after(job.source_mark)
                    job.source_mark = None
                message.tensor = job.payload(message.spec)
                self._in_flight[link] += 1
                self._start(job, message, self.wire.isend)
                seq.advance()
        if not self._board_waits:
            self._blocked_since = None
        elif self._blocked_since is None:
            self._blocked_since = self.clock.now()

    def _start(self, job: Job, message: Message, issue: Callable[..., Any]) -> None:
        spec = message.spec
        now_ns = self.clock.now_ns()
        message.issued_s = now_ns * 1e-9
        message.work = issue(message.tensor, spec.peer, job.tag_base + spec.index, job.name(spec))
        message.issued = True
        self._issued(spec.link, message, now_ns)
        self._waiter(spec.peer, spec.send).put((job, message))

    def _issued(self, link: Link | None, message: Message, now_ns: int) -> None:
        """Count an issued message in flight on its link and advance the link's clock: on a board link the
        host's (the board's, one for all its ranks), else this rank's own. A large send (it runs alone on a
        NIC link) is held until that clock: until its bytes, and the host's issued before them, can have left."""
        self._bytes[link] += message.nbytes
        clock_ns = None
        if self.board is not None and link in self.board.links:
            clock_ns = self.board.issued(link, message.nbytes, now_ns)
        elif self.nic_bytes_per_s and link is not None and link[1] in ("out", "in") and message.nbytes:
            clock_ns = link_clock_after(self._link_clock.get(link, 0), now_ns, message.nbytes, self.nic_bytes_per_s)
            self._link_clock[link] = clock_ns
        if (
            clock_ns is not None
            and message.spec.send
            and self.overlap_bytes is not None
            and message.nbytes > self.overlap_bytes
        ):
            message.floor_s = clock_ns * 1e-9

    def _waiter(self, peer: int, send: bool) -> _Waiter:
        waiter = self._waiters.get((peer, send))
        if waiter is None:
            waiter = self._waiters[(peer, send)] = _Waiter(self, peer, send)
        return waiter

    def _completed(self, job: Job, message: Message) -> None:
        message.done = True
        spec = message.spec
        if self._trace_dir is not None:
            self._trace.append(
                (
                    str(job.key),
                    job.mb,
                    spec.index,
                    spec.send,
                    spec.peer,
                    spec.link,
                    message.nbytes,
                    job.started_s,
                    message.ready_s,
                    message.issued_s,
                    message.wire_s,
                    message.done_s,
                )
            )
        self._bytes[spec.link] -= message.nbytes
        if self.board is not None and spec.link in self.board.links:
            self.board.completed(spec.link, message.nbytes)
        tensor = message.tensor
        assert tensor is not None  # what it was issued with
        if spec.send:
            self._in_flight[spec.link] -= 1
            job.sent(spec, tensor)
            message.tensor = None
            job.sends_left -= 1
        else:
            self._posted[spec.link] -= 1
            if message.landing is not None:
                self._landing[spec.link] = [e for e in self._landing[spec.link] if e[1] is not message]
                message.landing = None
            job.landed(spec, tensor)
            message.tensor = None
            job.recvs_left -= 1
        self._settle(job)

    def _settle(self, job: Job) -> None:
        handle = job.handle
        if job.recvs_left == 0 and not handle._ready.is_set() and (job.receives or job.sends_left == 0):
            handle._set_result(job.assemble(), self.wire, self.wire.hand_over())
        if job.recvs_left == 0 and job.sends_left == 0 and not handle.done():
            job.finished(time.perf_counter() - job.started_s)
            job.release_all()
            self._jobs[(job.key, job.mb)].remove(job)
            handle._set_done()
            job.retire()

    def _fail_all(self, error: BaseException) -> None:
        self._error = error
        self._watched = []
        for jobs in self._jobs.values():
            for job in jobs:
                job.handle._fail(error)
        self._jobs.clear()


class _Waiter:
    """Blocks on one peer's messages in one direction, in issue order, and reports each completion."""

    def __init__(self, engine: CommEngine, peer: int, send: bool) -> None:
        self.engine = engine
        self.queue: queue.SimpleQueue[tuple[Job, Message] | None] = queue.SimpleQueue()
        kind = "sends to" if send else "receives from"
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"rank {engine.rank} {kind} rank {peer}")
        self.thread.start()

    def put(self, item: tuple[Job, Message]) -> None:
        self.queue.put(item)

    def stop(self) -> None:
        self.queue.put(None)

    def _main(self) -> None:
        while (item := self.queue.get()) is not None:
            job, message = item
            clock = self.engine.clock
            try:
                self.engine.wire.wait(message.work)
                message.wire_s = clock.now()
                if (late := message.floor_s - clock.now()) > 0:
                    clock.sleep(late)  # a send is done for its link once its bytes can have left the NIC
                message.done_s = clock.now()
                error = None
            except BaseException as err:  # noqa: BLE001 - reported to the engine, which fails the jobs
                error = err
            self.engine._post(("done", job, message, error))
            del item, job, message  # hold no job while blocked on the next
