"""The ranks of one host follow the plan's order on the host's shared NIC links (meshjob.plan.host_order,
meshjob_trainer.board): the order is data derived from the plan, the board enforces it across the
ranks' engines, nothing deadlocks, and a rank waiting on a dead peer fails with a clear error.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from test_trainer_reshard import CASES, Case, global_tensor, make_boundary, mesh, natural_tile

from meshjob.plan.comm_order import TransferOrder
from meshjob.plan.host_order import HostLinkOrder, check_subsequence, host_link_orders
from meshjob.resharding.strategies import STRATEGIES
from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.board import BoardError, HostBoard, link_clock_after, may_start
from meshjob_trainer.engine import Clock, CommEngine
from meshjob_trainer.engine_job import Job, MessageSpec
from meshjob_trainer.reshard import ReshardExecutor
from meshjob_trainer.route import make_routes

# Two hosts of two ranks each send to two hosts of two: every source host's out-link carries messages of
# both its ranks, every destination host's in-link messages for both of its ranks.
TRANSPOSE = Case(
    "2x2 S0S1 -> 2x2 S1S0", (8, 8), mesh((2, 2), 0), "S0S1", "S0S1", mesh((2, 2), 4, first_host=2), "S1S0", "S1S0"
)
KEY = BoundaryKey(0, 1, "activation")


def routes_of(case: Case, boundaries):
    return make_routes(boundaries, {0: case.src, 1: case.dst}, {0: case.src_natural, 1: case.dst_natural})


# --- the plan side: pure data ---------------------------------------------------------------------


def test_a_hosts_link_order_interleaves_its_ranks_messages_in_the_plans_order():
    boundary = make_boundary(TRANSPOSE, "broadcast", chunks=2)
    (route,) = routes_of(TRANSPOSE, [boundary])
    transfers = ((boundary.key, 0), (boundary.key, 1))
    orders = host_link_orders(transfers, {boundary.key: route.planned_sides()})
    assert set(orders) == {0, 1, 2, 3}
    for host, order in orders.items():
        direction = "out" if host < 2 else "in"
        assert list(order.links) == [(host, direction)]  # only NIC links two ranks share
        entries = order.links[(host, direction)]
        assert len(set(order.ranks)) == 2 and {e[0] for e in entries} == set(order.ranks)
        assert [e[2] for e in entries] == sorted(e[2] for e in entries)  # microbatch 0's before 1's
        for rank in order.ranks:  # each rank's own program is a subsequence of the host's order
            own = [
                (k, mb, s.index)
                for k, mb in transfers
                for s in route.message_specs(rank)
                if (s.link == (host, direction))
            ]
            check_subsequence(order, rank, (host, direction), own)
    json.dumps([o.to_json() for o in orders.values()])  # printable


def test_a_rank_whose_own_order_differs_from_its_hosts_is_named_at_setup():
    order = HostLinkOrder(0, {(0, "out"): ((1, KEY, 0, 0), (0, KEY, 0, 1), (0, KEY, 0, 2))})
    with pytest.raises(ValueError, match="rank 0: its messages on link"):
        check_subsequence(order, 0, (0, "out"), [(KEY, 0, 2), (KEY, 0, 1)])


def test_a_large_message_runs_alone_on_its_link_and_small_ones_overlap():
    assert may_start(0, 0, 1 << 30, 2, 1 << 20)  # an idle link takes anything
    assert may_start(1, 1 << 16, 1 << 16, 2, 1 << 20)  # behind a small one, within the window
    assert not may_start(1, 4 << 20, 1 << 16, 2, 1 << 20)  # behind a large one: wait
    assert not may_start(2, 1 << 10, 1 << 10, 2, 1 << 20)  # the window is full
    assert may_start(1, 4 << 20, 1 << 16, 2, None)  # no byte bound: the window alone


def test_beyond_the_window_small_messages_pack_while_their_bytes_together_stay_within_the_threshold():
    assert may_start(2, 1 << 16, 1 << 16, 2, 1 << 20, small_window=8)  # 3 small ones: 192 KiB of 1 MiB
    assert may_start(7, 7 << 17, 1 << 17, 2, 1 << 20, small_window=8)  # the eighth: 1 MiB in all
    assert not may_start(8, 8 << 16, 1 << 16, 2, 1 << 20, small_window=8)  # the small window is full
    assert not may_start(6, 15 << 16, 1 << 17, 2, 1 << 20, small_window=8)  # it would pass the threshold
    assert not may_start(2, 1 << 10, 1 << 18, 2, 1 << 20, small_window=8)  # 256 KiB: more than 1 MiB / 8
    assert not may_start(2, 1 << 16, 1 << 16, 2, None, small_window=8)  # no byte bound: the window alone
    assert not may_start(2, 1 << 16, 1 << 16, 2, 1 << 20)  # no small window: no packing


def test_behind_a_large_message_the_next_goes_a_lead_before_the_links_clock_says_it_is_through():
    assert may_start(1, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=1e-3, lead_s=2e-3)  # due within the lead
    assert may_start(1, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=-1e-3, lead_s=2e-3)  # just overdue: a late wake
    assert not may_start(1, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=-5e-3, lead_s=2e-3)  # long overdue: sent late
    assert not may_start(1, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=10e-3, lead_s=2e-3)  # still far: wait
    assert not may_start(1, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=-5e-3)  # no lead: wait for its completion
    assert not may_start(2, 4 << 20, 4 << 20, 2, 1 << 20, due_in_s=0.0, lead_s=2e-3)  # the window still binds


def test_a_links_clock_advances_by_each_messages_bytes_at_the_nic_rate_from_its_issue_or_the_previous_end():
    ms = 1_000_000  # ns
    rate = 1e9  # bytes per second: 1 MB per ms
    assert link_clock_after(0, 5 * ms, 2_000_000, rate) == 7 * ms  # an idle link: from the issue
    assert link_clock_after(9 * ms, 5 * ms, 2_000_000, rate) == 11 * ms  # a busy one: from the previous end
    assert link_clock_after(9 * ms, 5 * ms, 0, rate) == 9 * ms  # nothing issued: unchanged
    with pytest.raises(ValueError, match="nic_bytes_per_s 0 is invalid"):
        link_clock_after(0, 0, 1, 0)
    with pytest.raises(ValueError, match="nbytes -1 is invalid"):
        link_clock_after(0, 0, -1, rate)


# --- the board across processes ---------------------------------------------------------------------


class _Recorder:
    """A wire that records when each message is issued (monotonic: one clock for every rank here)."""

    def __init__(self, inner) -> None:
        self.inner, self.device, self.log = inner, inner.device, []

    def isend(self, tensor, peer, tag, message):
        self.log.append((time.monotonic(), "send", message))
        return self.inner.isend(tensor, peer, tag, message)

    def irecv(self, tensor, peer, tag, message):
        self.log.append((time.monotonic(), "recv", message))
        return self.inner.irecv(tensor, peer, tag, message)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow
@pytest.mark.parametrize("balancer", ["naive", "greedy"])
def test_the_ranks_of_a_host_issue_their_messages_on_a_shared_link_in_the_hosts_order(gang, balancer):
    from test_trainer_reshard import NIC_BYTES_PER_S, host_of

    from meshjob.layout.sharding import ShardingSpec
    from meshjob.plan.build import plan_boundary
    from meshjob.spec.manifest import ReshardingSpec
    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.wire import GlooWire

    case = TRANSPOSE
    boundary = plan_boundary(
        KEY,
        case.shape,
        (case.src, ShardingSpec.parse(case.send)),
        (case.dst, ShardingSpec.parse(case.recv)),
        ReshardingSpec("broadcast", 3, balancer),
        host_of(case),
        NIC_BYTES_PER_S,
    )
    (route,) = routes_of(case, [boundary])
    order = TransferOrder(tuple((KEY, mb) for mb in range(3)))

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            wire = _Recorder(GlooWire())
            ex = ReshardExecutor(None, env.rank, routes=[route], wire=wire, order=order)
            on_board = ex.engine.board is not None
            full = global_tensor(case, 5)
            mine = natural_tile(case, full, env.rank)
            handles = [ex.start(KEY, mb, mine if env.rank in case.src.ranks else None) for mb in range(3)]
            got = [h.wait(timeout_s=30) for h in handles]
            ex.close()
            ok = all(g is None or torch.equal(g, mine) for g in got)
            return wire.log, on_board, ok
        finally:
            shutdown_distributed()

    results = gang(case.world_size, target)
    assert all(ok and on_board for _, on_board, ok in results)
    issued = {(op, message): t for log, _, _ in results for t, op, message in log}
    orders = host_link_orders(order.transfers, {KEY: route.planned_sides()})
    for host, host_order in orders.items():
        for link, entries in host_order.links.items():
            op = "send" if link[1] == "out" else "recv"
            names = [f"{k}#{mb}/{route.step_at(i).id}" for _, k, mb, i in entries]
            times = [issued[(op, n)] for n in names]
            assert times == sorted(times), f"host {host} link {link}: issued out of the plan's order"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_strategy_runs_to_the_exact_tiles_with_the_board_without_deadlock(gang, case: Case):
    """All four strategies as four boundaries, two microbatches each, interleaved in one planned order,
    started at once: every destination tile exact, on every (mesh, spec) pair the executor tests cover."""
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    strategies = [s for s in STRATEGIES if s != "signal"]
    boundaries = [make_boundary(case, s, tensor=s) for s in strategies]
    routes = routes_of(case, boundaries)
    order = TransferOrder(tuple((b.key, mb) for mb in range(2) for b in boundaries))

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = ReshardExecutor(None, env.rank, routes=routes, order=order)
            full = global_tensor(case, 11)
            mine = natural_tile(case, full, env.rank)
            local = mine if env.rank in case.src.ranks else None
            handles = [ex.start(k, mb, local) for k, mb in order.transfers]
            got = [h.wait(timeout_s=30) for h in handles]
            on_board = ex.engine.board is not None
            ex.close()
            return on_board, all(g is None or torch.equal(g, mine) for g in got)
        finally:
            shutdown_distributed()

    results = gang(case.world_size, target, timeout_s=90)
    assert all(ok for _, ok in results)
    shared = host_link_orders(order.transfers, {r.boundary.key: r.planned_sides() for r in routes})
    assert {r for r, (on_board, _) in enumerate(results) if on_board} == {r for o in shared.values() for r in o.ranks}


class _Payload(Job):
    def nbytes(self, spec):
        return 4

    def payload(self, spec):
        return torch.zeros(1)


class _Silent:
    """A wire whose messages never complete (the test is about waiting for a turn)."""

    device = torch.device("cpu")

    def isend(self, tensor, peer, tag, message):
        return None

    irecv = isend

    def wait(self, work):
        time.sleep(3600)

    def __getattr__(self, name):
        from meshjob_trainer.wire import GlooWire

        return getattr(GlooWire(), name)


def test_a_rank_waiting_for_its_turn_behind_a_dead_peer_fails_with_a_clear_error(tmp_path):
    """Rank 1 holds the first turn on host 0's out-link and dies; rank 0's engine, whose message comes
    next, fails its job naming the dead rank within a few ticks, and the board leaves nothing behind."""
    link = (0, "out")
    order = HostLinkOrder(0, {link: ((1, KEY, 0, 0), (0, KEY, 0, 1))})
    path = str(tmp_path / "store")
    pid = os.fork()
    if pid == 0:  # rank 1: joins the board, then dies without taking its turn
        try:
            HostBoard(order, 1, 2, None, dist.FileStore(path, 2), "k")
        finally:
            os._exit(0)
    store = dist.FileStore(path, 2)
    boards = []

    def board_for(transfers, wake):
        boards.append(HostBoard(order, 0, 2, None, store, "k", wake, timeout_s=60))
        return boards[-1]

    specs = {KEY: (MessageSpec(1, 1, 5, True, link),)}
    engine = CommEngine(0, _Silent(), specs, 2, TransferOrder(((KEY, 0),)), board_for)
    os.waitpid(pid, 0)
    handle = engine.submit(_Payload(KEY, 0, specs[KEY], 0))
    with pytest.raises(BoardError, match=r"rank 1 of host 0 \(pid \d+\) died .* rank 1's"):
        handle.wait(timeout_s=10)
    engine.close(timeout_s=5)
    assert not os.path.exists(boards[0].path)
    assert not [
        f for f in os.listdir(os.path.dirname(boards[0].path)) if f.startswith(os.path.basename(boards[0].path))
    ]


def test_a_turn_that_never_comes_times_out_with_the_link_and_the_holder_named(tmp_path):
    order = HostLinkOrder(3, {(3, "in"): ((7, KEY, 0, 0), (6, KEY, 0, 1))})
    store = dist.FileStore(str(tmp_path / "store"), 1)
    store.set("k/all", "1")  # rank 7 "attached" (it stays alive: this process stands in for it)
    store.add("k/attached", 1)
    board = HostBoard(order, 6, 2, None, store, "k", timeout_s=5)
    try:
        board._cells[board.ranks.index(7)] = os.getpid()
        assert not board.ready((3, "in"), 1)
        with pytest.raises(BoardError, match=r"waited 6 s .* 3/in: message 0 of 2 is rank 7's"):
            board.check(6.0)
    finally:
        board.close()


# --- a clock the test moves: the instants the engine and the board choose, exactly ---------------


class FakeClock(Clock):
    """time.monotonic's part for a test's engines and boards (CommEngine's and HostBoard's clock), moved only by
    the test (_Timeline): sleeps and the engines' timed waits block until it is moved past their end, however
    busy the cores are, so every instant an engine or its board picks is read back exactly."""

    def __init__(self, start_s: float = 100.0) -> None:
        self._t = start_s
        self._cond = threading.Condition()  # sleepers wait on it
        self._lock = threading.Lock()  # guards `waits` (taken inside an engine's lock, never around one)
        self.sleepers: dict[threading.Thread, float] = {}  # a thread in sleep(): until when
        # an engine's thread in wait(): its lock and until when; a new tuple each call (_Timeline._idle)
        self.waits: dict[threading.Thread, tuple[threading.Condition, float | None]] = {}

    def now(self) -> float:
        return self._t

    def now_ns(self) -> int:
        return round(self._t * 1e9)

    def sleep(self, seconds: float) -> None:
        me = threading.current_thread()
        with self._cond:
            until = self.sleepers[me] = self._t + seconds
            while self._t < until:
                self._cond.wait()
            del self.sleepers[me]

    def wait(self, cond: threading.Condition, timeout_s: float | None) -> None:
        me = threading.current_thread()
        with self._lock:
            self.waits[me] = (cond, None if timeout_s is None else self._t + timeout_s)
        try:
            cond.wait(1.0)  # notified by the engine's inbox or by advance(); the timeout only re-checks
        finally:
            with self._lock:
                del self.waits[me]

    def advance(self, t: float) -> None:
        with self._cond:
            assert t >= self._t, (t, self._t)
            self._t = t
            self._cond.notify_all()
        with self._lock:
            waits = list(self.waits.values())
        for cond, _ in waits:
            with cond:
                cond.notify_all()

    def deadlines(self) -> list[float]:
        with self._cond:
            sleeps = list(self.sleepers.values())
        with self._lock:
            waits = [until for _, until in self.waits.values() if until is not None]
        return sleeps + waits


def ns(seconds: float) -> int:
    """An instant of the fake clock in whole ns (the engines' and boards' link clocks count in ns)."""
    return round(seconds * 1e9)


class _Timeline:
    """Runs engines on a FakeClock to the end of their jobs: lets every thread of theirs do what the current
    instant brings (the engines idle in their waits, each message issued and not done held by its link's clock
    or not finished on the wire), then moves the clock to the next instant something waits for: an engine's
    timer, a send held for its link, a trickle's next bytes. A board's wake-ups go the same way: its FIFO's are
    dropped here (each board's `on_wake` does nothing) and, when a board's cells changed, the timeline wakes
    every engine on it at that instant, as its FIFO would wake the rank whose turn it is."""

    def __init__(self, clock: FakeClock, engines, jobs, wires=()) -> None:
        """`jobs`: (engine, job) pairs."""
        self.clock, self.engines, self.jobs = clock, list(engines), list(jobs)
        self.trickles = [w for w in wires if isinstance(w, _Trickle)]
        self._cells: tuple = ()

    def run(self, handles, limit_s: float = 60.0) -> None:
        """Until every one of `handles` is done."""
        deadline = time.monotonic() + limit_s  # real time: only against a hang
        while True:
            self._settle(deadline)
            if all(h.done() for h in handles):
                return
            upcoming = self.clock.deadlines() + [t for w in self.trickles if (t := w.next_s()) is not None]
            assert upcoming, f"at {self.clock.now()}: the jobs are not done and nothing waits for a later instant"
            t = min(upcoming)
            for w in self.trickles:
                w.write_until(t)  # the bytes in by then, before an engine can read the clock at t
            self.clock.advance(t)
            for w in self.trickles:
                w.finish()  # then the receives all in by then, which wakes their waiters

    def _settle(self, deadline: float) -> None:
        while True:
            while not all(self._idle(e) for e in self.engines):
                assert time.monotonic() < deadline, f"the engines never settled at {self.clock.now()}: {self._state()}"
                time.sleep(1e-4)
            cells = tuple(tuple(e.board._cells) for e in self.engines if e.board is not None)
            if cells == self._cells:
                return
            self._cells = cells
            for engine in self.engines:
                if engine.board is not None:
                    engine._wake("board")

    def _state(self) -> str:
        """What every thread waits for, and every message's state: why the engines did not settle."""
        waits = {t.name: w[1] for t, w in list(self.clock.waits.items())}
        sleeps = {t.name: until for t, until in list(self.clock.sleepers.items())}
        messages = [(str(j.key), i, m.issued, m.done, m.work) for _, j in self.jobs for i, m in j.messages.items()]
        engines = [(e._inbox, e.error) for e in self.engines]
        return f"waits {waits}, sleeps {sleeps}, engines' inboxes and errors {engines}, messages {messages}"

    def _idle(self, engine: CommEngine) -> bool:
        """Whether `engine` waits for a later instant and nothing else: its thread in one wait() from before to
        after its waiters were found waiting too (asleep until a later instant, or for the wire), its inbox empty."""
        now = self.clock.now()
        waiting = self._waiting(engine, now)
        if waiting is None:
            return False
        with engine._cond:
            waiters = dict(engine._waiters)  # the engine's thread changes them only outside its waits
        with self.clock._cond:
            asleep = {t for t, until in self.clock.sleepers.items() if until > now}
        for job in (job for e, job in self.jobs if e is engine):
            for m in job.messages.values():
                if m.issued and not m.done and (m.spec.peer, m.spec.send) in waiters:
                    thread = waiters[(m.spec.peer, m.spec.send)].thread
                    if thread not in asleep and (m.work is None or m.work.is_set()):
                        return False  # its waiter has it to report
        return self._waiting(engine, now) is waiting  # the same wait: nothing ran on the engine meanwhile

    def _waiting(self, engine: CommEngine, now: float):
        """The engine's wait() if it is in one for a later instant (or none) with an empty inbox, else None."""
        with engine._cond:
            with self.clock._lock:
                waiting = self.clock.waits.get(engine._thread)
            if waiting is None or engine._inbox or (waiting[1] is not None and waiting[1] <= now):
                return None
            return waiting


def _run_on(clock, engines, jobs, wires=()):
    """Submit `jobs` ((engine, job) pairs) and run them to the end on `clock`; raises what a job failed with."""
    handles = [engine.submit(job) for engine, job in jobs]
    _Timeline(clock, engines, jobs, wires).run(handles)
    for handle in handles:
        handle.wait(timeout_s=0)


# --- when a send is done for its NIC link ------------------------------------------------------------

P = 41_943_040  # ns: 4 MiB at 100 MB/s, what a link's clock gives each message (board.link_clock_after)
LEAD = 10_000_000  # ns: the hand-over lead these tests use (10 ms)


class _Instant:
    """A wire whose sends are done the moment they are issued (as gloo reports a send done once its bytes
    sit in the kernel's socket buffer), recording when (on the test's clock) each is issued."""

    device = torch.device("cpu")

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.log: list[tuple[float, str]] = []

    def isend(self, tensor, peer, tag, message):
        self.log.append((self.clock.now(), message))

    def wait(self, work):
        pass

    def __getattr__(self, name):
        from meshjob_trainer.wire import GlooWire

        return getattr(GlooWire(), name)


class _Sized(Job):
    size = 4 << 20

    def nbytes(self, spec):
        return self.size

    def payload(self, spec):
        return torch.zeros(1)

    def assemble(self):
        return None


def _send_times(link, nic_bytes_per_s, nbytes=4 << 20, lead_s=0.0):
    """Three sends of `nbytes` on `link` (to three peers), window 2, 1 MiB overlap: when each was issued (ns
    after the first, on the fake clock)."""
    clock = FakeClock()
    specs = {KEY: tuple(MessageSpec(i, i, 1 + i, True, link) for i in range(3))}
    wire = _Instant(clock)
    engine = CommEngine(
        0,
        wire,
        specs,
        2,
        None,
        None,
        overlap_bytes=1 << 20,
        nic_bytes_per_s=nic_bytes_per_s,
        lead_s=lead_s,
        clock=clock,
    )
    job = _Sized(KEY, 0, specs[KEY], 0)
    job.size = nbytes
    try:
        _run_on(clock, [engine], [(engine, job)])
    finally:
        engine.close(timeout_s=5)
    return [ns(t - wire.log[0][0]) for t, _ in wire.log]


def test_a_large_send_holds_its_nic_link_until_its_bytes_can_have_left():
    """Counted done when the wire says so, the next large send (to another host) would start while the
    first still drains and share the NIC with it. At 100 MB/s, 4 MiB take 42 ms: the second send is
    issued when the first's bytes can have left, the third when the second's can. On a local link nothing
    waits, nor do small sends (the window alone bounds them: the socket's buffer keeps a chain of them going)."""
    assert _send_times((0, "out"), 1e8) == [0, P, 2 * P]
    assert _send_times((0, "local"), 1e8) == [0, 0, 0]
    assert _send_times((0, "out"), 1e4, nbytes=1 << 19) == [0, 0, 0]  # 52 s each at this rate, were they held


def test_the_next_large_send_is_issued_its_lead_before_the_links_clock_frees_the_link_with_no_other_wake_up():
    """4 MiB at 100 MB/s take 42 ms; with a 10 ms lead the second send goes at 32 ms, woken by the engine's
    own timer (nothing else happens on this rank then: the fake clock reaches 32 ms only because the engine
    asked to wake then), not at 42 ms when the first is counted done; the third its lead before the second's
    bytes can have left (84 ms by the link's clock)."""
    assert _send_times((0, "out"), 1e8, lead_s=LEAD * 1e-9) == [0, P - LEAD, 2 * P - LEAD]


def _as_ranks_0_and_1(run, timeout_s=15):
    """`run(rank)` for ranks 0 and 1 of one host, each in its own thread (a HostBoard waits for the other
    rank to attach): the errors either raised."""
    errors = []

    def rank(r):
        try:
            run(r)
        except BaseException as err:  # noqa: BLE001 - returned to the test
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return errors


def _on_one_board(tmp_path, clock, order, specs, wires, transfers, job_type, lead_s):
    """Ranks 0 and 1 of host 0, each an engine on one board (100 MB/s NIC, `lead_s`, the fake clock), run their
    jobs (`specs[rank]`: per boundary, microbatch 0) to the end: each rank's jobs. The board's own wake-ups
    are left to the timeline (_Timeline)."""
    path, engines = str(tmp_path / "store"), {}

    def build(r):
        store = dist.FileStore(path, 2)

        def board_for(transfers, wake):
            return HostBoard(
                order,
                r,
                2,
                1 << 20,
                store,
                "k",
                lambda _: None,
                timeout_s=10,
                nic_bytes_per_s=1e8,
                lead_s=lead_s,
                clock_ns=clock.now_ns,
            )

        engines[r] = CommEngine(
            r,
            wires[r],
            specs[r],
            2,
            transfers,
            board_for,
            overlap_bytes=1 << 20,
            nic_bytes_per_s=1e8,
            lead_s=lead_s,
            clock=clock,
        )

    errors = _as_ranks_0_and_1(build)
    assert not errors, errors
    jobs = {r: [job_type(key, 0, key_specs, 0) for key, key_specs in specs[r].items()] for r in (0, 1)}
    try:
        _run_on(clock, engines.values(), [(engines[r], job) for r in (0, 1) for job in jobs[r]], wires.values())
    finally:
        for engine in engines.values():
            engine.close(timeout_s=5)
    return jobs


def test_on_a_board_a_large_send_is_held_and_the_next_led_by_the_hosts_clock_not_the_ranks_own(tmp_path):
    """Two ranks of host 0 share its out-link (order: rank 0, rank 1, rank 0), 4 MiB each at 100 MB/s (42 ms),
    a 10 ms lead, sends done the moment they are issued. Rank 1's send goes its lead before rank 0's first is
    through by the host's clock (32 ms) and is held until both can have left (84 ms: the host's clock; its own
    bytes alone would free it at 74 ms); rank 0's second goes its lead before that (74 ms)."""
    link = (0, "out")
    order = HostLinkOrder(0, {link: ((0, KEY, 0, 0), (1, KEY, 0, 1), (0, KEY, 0, 2))})
    specs = {
        0: {KEY: (MessageSpec(0, 0, 5, True, link), MessageSpec(2, 2, 5, True, link))},
        1: {KEY: (MessageSpec(1, 1, 5, True, link),)},
    }
    clock = FakeClock()
    jobs = _on_one_board(
        tmp_path,
        clock,
        order,
        specs,
        {r: _Instant(clock) for r in (0, 1)},
        TransferOrder(((KEY, 0),)),
        _Sized,
        LEAD * 1e-9,
    )
    first, second = (jobs[0][0].messages[i] for i in (0, 2))
    other = jobs[1][0].messages[1]
    t0 = first.issued_s
    assert ns(other.issued_s - t0) == P - LEAD  # the lead, by the host's clock
    assert ns(first.done_s - t0) == P
    assert ns(other.done_s - t0) == 2 * P  # held by the host's clock, not its own (P - LEAD + P)
    assert ns(second.issued_s - t0) == 2 * P - LEAD
    assert ns(second.done_s - t0) == 3 * P


# --- the lead on an in-link: by the receive's own buffer -----------------------------------------


class _Trickle(_Instant):
    """A wire whose receives fill their buffer front to back at `rate` bytes/s, 64 KiB at a time (as gloo's TCP
    reads do), each sender starting `late_s[peer]` after its receive is posted (a sender busy elsewhere
    first), on the fake clock: the timeline writes each step at its instant (`next_s`, `write_until`) and
    finishes a receive once all of it is in (`finish`). `started` / `landed`: when each peer's bytes began
    and finished arriving; `written`: when each step of them was in (`in_by`)."""

    STEP = 1 << 16

    def __init__(self, clock: FakeClock, rate: float, late_s: dict[int, float]) -> None:
        super().__init__(clock)
        self.rate, self.late_s = rate, late_s
        self.started: dict[int, float] = {}
        self.landed: dict[int, float] = {}
        self.written: dict[int, list[tuple[float, int]]] = {}
        self._fills: list[list] = []  # [peer, bytes, start, offset of the next step, done]

    def irecv(self, tensor, peer, tag, message):
        self.log.append((self.clock.now(), message))
        done = threading.Event()
        self._fills.append(
            [peer, tensor.view(-1).view(torch.uint8), self.clock.now() + self.late_s.get(peer, 0.0), 0, done]
        )
        return done

    def next_s(self) -> float | None:
        """When the next step of any receive is in."""
        return min((start + at / self.rate for _, flat, start, at, _ in self._fills if at < flat.numel()), default=None)

    def write_until(self, t: float) -> None:
        for fill in self._fills:
            peer, flat, start, at, _ = fill
            while at < flat.numel() and start + at / self.rate <= t:
                end = min(at + self.STEP, flat.numel())
                flat[at:end] = 7
                self.started.setdefault(peer, start)
                self.written.setdefault(peer, []).append((start + at / self.rate, end))
                if end == flat.numel():
                    self.landed[peer] = start + at / self.rate
                at = fill[3] = end

    def finish(self) -> None:
        for _, flat, _, at, done in self._fills:
            if at == flat.numel():
                done.set()

    def wait(self, work):
        if not work.wait(30):
            raise TimeoutError("the trickle never finished")

    def in_by(self, peer: int, nbytes: float) -> float:
        """When the first `nbytes` of `peer`'s message were in its buffer."""
        return next(t for t, n in self.written[peer] if n >= nbytes)


class _Landing(_Sized):
    def target(self, spec):
        return torch.full((self.size // 4,), -1.0)

    def landed(self, spec, tensor):
        pass


def _receive_times(
    late_s: dict[int, float], rate: float = 1e8, lead_s: float = 10e-3, one_transfer: bool = True
) -> tuple[float, _Trickle]:
    """Two 4 MiB receives on one NIC in-link (from ranks 5 and 6), posted in that order, both of one transfer
    or each of its own (an activation's, then a skip's, in a planned order), their bytes arriving at `rate`:
    when the second was posted, and the wire (when each one's bytes began and landed), on the fake clock."""
    link, skip = (0, "in"), BoundaryKey(0, 1, "skip0")
    first, second = MessageSpec(0, 0, 5, False, link), MessageSpec(1, 1, 6, False, link)
    specs = {KEY: (first, second)} if one_transfer else {KEY: (first,), skip: (second,)}
    clock = FakeClock()
    wire = _Trickle(clock, rate, late_s)
    order = None if one_transfer else TransferOrder(((KEY, 0), (skip, 0)))
    engine = CommEngine(
        0, wire, specs, 2, order, None, overlap_bytes=1 << 20, nic_bytes_per_s=1e8, lead_s=lead_s, clock=clock
    )
    try:
        _run_on(clock, [engine], [(engine, _Landing(key, 0, key_specs, 0)) for key, key_specs in specs.items()], [wire])
    finally:
        engine.close(timeout_s=5)
    assert len(wire.log) == 2
    return wire.log[1][0], wire


LEAD_POINT = (4 << 20) - 1_000_000  # bytes of a 4 MiB receive before its last lead's (10 ms at 100 MB/s)


def test_the_next_large_receive_is_posted_its_lead_before_the_one_in_flight_has_landed():
    """Its sender on time: 4 MiB at 100 MB/s land in 42 ms (the last 64 KiB step at 41.3 ms), the second
    receive is posted its lead before the first's landing by the link's clock (32 ms), the first's buffer
    agreeing: its bytes up to its lead point are in (31.5 ms)."""
    second, wire = _receive_times({})
    assert ns(second - wire.log[0][0]) == P - LEAD
    assert wire.in_by(5, LEAD_POINT) <= second < wire.landed[5]


def test_a_receive_whose_sender_starts_late_holds_the_next_of_its_transfer_until_its_own_bytes_are_nearly_in():
    """Its sender starts 150 ms after the post (busy with an earlier message): by a clock started at the
    post the next receive would be posted at 32 ms, and its sender would share the in-link with the first's;
    by the first's buffer it is posted only once the first has at most its lead left to land. Its lead point
    is in at 181.46 ms (150 ms + 48 steps of 64 KiB); the engine looks at the markers every 31.9 ms while none
    is overwritten (the most the message can have left, less the lead), then as they go (180 ms), then every
    eighth of a lead (1.25 ms): the first look after that instant, at 182.22 ms, posts the next."""
    second, wire = _receive_times({5: 0.15})
    t0 = wire.log[0][0]
    assert ns(wire.in_by(5, LEAD_POINT) - t0) == 181_457_280
    assert ns(second - t0) == 182_215_280


def test_a_receive_landing_slower_than_the_nic_holds_the_next_of_its_transfer_as_long():
    """Its bytes come at half the NIC's rate (a sender sharing its cores or its link): posted by the buffer,
    the next receive waits until the first has at most its lead left at that rate: its lead point is in at
    62.91 ms (48 steps of 64 KiB at 50 MB/s), the engine's next look, at 63.19 ms, posts it; not at 32 ms."""
    second, wire = _receive_times({}, rate=5e7)
    t0 = wire.log[0][0]
    assert ns(wire.in_by(5, LEAD_POINT) - t0) == 62_914_560
    assert ns(second - t0) == 63_193_280


def test_the_next_transfers_receive_goes_by_the_links_clock_not_the_first_ones_buffer():
    """Between transfers (a pipeline's activations and skips, timed by the compute), the in-link does not wait
    for a late sender: the next transfer's receive is posted its lead before the clock's end (32 ms), before the
    first's sender has started (150 ms)."""
    second, wire = _receive_times({5: 0.15}, one_transfer=False)
    assert ns(second - wire.log[0][0]) == P - LEAD
    assert second < wire.started[5]


# --- the lead on a host's in-link shared by its ranks: the first rank reads its markers for the next ---


def _two_boards(order, path, lead_s=10e-3, wakes=None):
    """Ranks 0 and 1 of host 0 on one board."""
    boards = {}

    def attach(r):
        wake = (lambda why: wakes.append((r, why))) if wakes is not None else (lambda _: None)
        boards[r] = HostBoard(
            order, r, 2, 1 << 20, dist.FileStore(path, 2), "k", wake, timeout_s=10, nic_bytes_per_s=1e8, lead_s=lead_s
        )

    errors = _as_ranks_0_and_1(attach, timeout_s=10)
    assert not errors, errors
    return boards[0], boards[1]


SKIP = BoundaryKey(0, 1, "skip0")


def test_a_peers_watched_receive_holds_the_next_rank_of_its_transfer_until_it_says_its_bytes_are_nearly_in(tmp_path):
    link = (0, "in")
    order = HostLinkOrder(0, {link: ((0, KEY, 0, 0), (1, KEY, 0, 1))})
    wakes = []
    first, second = _two_boards(order, str(tmp_path / "store"), wakes=wakes)
    try:
        assert second.peer_landing_due_s(link) is None  # not its turn yet
        assert first.watch(link) == 0
        first.issued(link, 4 << 20)
        assert second.peer_landing_due_s(link) == float("inf")
        assert not second.ready(link, 4 << 20, second.peer_landing_due_s(link))
        first.landed_soon(link, 0)
        assert second.peer_landing_due_s(link) == 0.0
        assert second.ready(link, 4 << 20, 0.0)
        deadline = time.monotonic() + 5
        while (1, "board") not in wakes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (1, "board") in wakes  # the next rank is woken, it does not poll
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    "entries",
    [
        (
            (0, KEY, 0, 0),
            (0, KEY, 0, 1),
            (1, KEY, 0, 2),
        ),  # its own next: its own markers lead it (engine._in_link_due_s)
        ((0, KEY, 0, 0), (1, SKIP, 0, 0)),  # another transfer's: the host's clock leads, as between transfers
        ((1, KEY, 0, 0), (0, KEY, 0, 1)),  # its last on the link in the pass: the next is the next pass's
    ],
    ids=["own next", "another transfer", "next pass"],
)
def test_a_receive_is_watched_only_where_the_links_next_message_is_another_ranks_of_its_transfer(tmp_path, entries):
    link = (0, "in")
    first, second = _two_boards(HostLinkOrder(0, {link: entries}), str(tmp_path / "store"))
    try:
        if entries[0][0] == 1:
            second.issued(link, 4 << 20)  # rank 1 first: rank 0's receive is the link's last in the pass
        assert first.watch(link) is None
        first.issued(link, 4 << 20)
        if entries[1][0] == 1:
            assert second.peer_landing_due_s(link) is None
    finally:
        first.close()
        second.close()


def _board_receive_times(late_s, tmp_path, one_transfer=True, lead_s=10e-3):
    """Host 0's in-link takes rank 0's 4 MiB receive from rank 5, then rank 1's from rank 6 (100 MB/s), of one
    transfer or rank 1's of the next: when rank 1's was posted, and rank 0's wire (on the fake clock)."""
    link = (0, "in")
    key1 = KEY if one_transfer else SKIP
    order = HostLinkOrder(0, {link: ((0, KEY, 0, 0), (1, key1, 0, 1 if one_transfer else 0))})
    specs = {
        0: {KEY: (MessageSpec(0, 0, 5, False, link),)},
        1: {key1: (MessageSpec(1 if one_transfer else 0, 1, 6, False, link),)},
    }
    transfers = TransferOrder(((KEY, 0),) if one_transfer else ((KEY, 0), (SKIP, 0)))
    clock = FakeClock()
    wires = {0: _Trickle(clock, 1e8, late_s), 1: _Trickle(clock, 1e8, late_s)}
    _on_one_board(tmp_path, clock, order, specs, wires, transfers, _Landing, lead_s)
    return wires[1].log[0][0], wires[0]


def test_on_a_board_the_next_ranks_receive_waits_for_a_late_senders_bytes_not_the_hosts_clock(tmp_path):
    """Rank 0's sender starts 150 ms after the post: by the host's clock rank 1's receive would be posted at
    32 ms and its sender would share the in-link with rank 0's; rank 0 watches its markers and lets rank 1
    go once its own bytes have at most the lead left to land: at the same look as a rank's own next receive
    (182.22 ms, test_a_receive_whose_sender_starts_late_...), before rank 0's receive has landed (191.29 ms)."""
    second, wire = _board_receive_times({5: 0.15}, tmp_path)
    t0 = wire.log[0][0]
    assert ns(second - t0) == 182_215_280
    assert ns(wire.landed[5] - t0) == 191_287_680


def test_on_a_board_the_next_transfers_receive_of_another_rank_goes_by_the_hosts_clock(tmp_path):
    """Rank 1's receive of the next transfer goes its lead before the host's clock frees the in-link (32 ms),
    before rank 0's late sender has started (150 ms)."""
    second, wire = _board_receive_times({5: 0.15}, tmp_path, one_transfer=False)
    assert ns(second - wire.log[0][0]) == P - LEAD
    assert second < wire.started[5]
