"""The gang launcher: fork one process per rank on this machine, watch them, collect their outcome.

One launcher for every local gang: `meshjob run` (all ranks of a job, inside emulated hosts),
`meshjob worker --nproc` (one host's ranks, like torchrun --nproc-per-node), the benchmarks and
the tests.

- fork, not torch.multiprocessing's spawn: 8 forked ranks start in under a second, spawned ones
  re-import torch each (15-23 s on 2 cores). A forked child must not use sockets the parent owns;
  each rank makes its own after fork.
- `pre_exec(rank)` runs in the child before the target: the emulated cluster enters the rank's host
  namespace there (setns(2) must come before any socket is made).
- A gang lives and dies together: when one rank exits non-zero or is killed, the others are killed
  (their collectives would hang); on timeout all are. Every rank dies with the launcher too
  (PR_SET_PDEATHSIG), whatever kills it.
- Each rank gets its WorkerEnv as a value and an event sink (`RankContext.events`) whose events
  arrive in the launcher as `on_event(rank, event)`; what the target returns comes back in
  `LaunchResult.values`, a traceback in `RankResult.error`.
- A gang that times out says where it hung: before killing them the launcher has every rank write its
  threads' Python stacks (faulthandler on SIGUSR1), and each rank's error carries them.
- `launch_with_restarts` starts a new gang after a failure (the target resumes from its checkpoint).
- The parent's objects are frozen for the fork (gc.freeze, as Python's documentation advises for fork
  without exec): a rank's cyclic collections then skip the ~180,000 objects it inherits (torch, the plan)
  and touch none of their pages. Unfrozen, every full collection in a rank walked them all: 200-300 ms a
  pause with 8 ranks on 2 cores, 2-3 pauses per rank in a few steps (traced with gc.callbacks in `bench
  pipeline`), each one stalling the pipeline or the transfer that rank was on; how many a rank got depended
  on the collector's counts it inherited, so on what the parent had run before.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import os
import pickle
import random
import select
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshjob_trainer.dist import WorkerEnv
from meshjob_trainer.errors import TrainerError
from meshjob_trainer.heap import keep_freed_memory

PR_SET_PDEATHSIG = 1
DUMP_STACKS = signal.SIGUSR1  # a rank writes its threads' stacks (the launcher asks before a timeout's kill)
STACKS_WAIT_S = 0.5
_FRAME = struct.Struct("!I")  # length prefix of one pickled (rank, event) in the event pipe


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for bind(port 0) and for every outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(addr: str = "127.0.0.1", tries: int = 64) -> int:
    """A port that is free now, chosen below the ephemeral range: the kernel gives ephemeral ports to
    outgoing connections too, and with gangs connecting all the time one of them could take the port
    before rank 0 binds it (a bind(0) port comes from that range)."""
    low, _ = ephemeral_ports()
    rng = random.Random()
    for _ in range(tries if low > 11000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below it: any free port
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: orphans are then reaped by the timeout only
        pass


def _exit_code(status: int) -> int:
    """os.waitpid's status as an exit code; a signal becomes its negative number."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class EventPipe:
    """A rank's end of the launcher's event pipe: `emit(event)` sends any picklable event.

    One write per event of at most PIPE_BUF bytes is atomic, so events of ranks writing at once
    never interleave. The launcher unpickles what its own forked children wrote: one program, one
    trust domain."""

    def __init__(self, fd: int, rank: int):
        self.fd, self.rank = fd, rank

    def emit(self, event: object) -> None:
        payload = pickle.dumps((self.rank, event))
        frame = _FRAME.pack(len(payload)) + payload
        if len(frame) > select.PIPE_BUF:
            raise ValueError(
                f"event {type(event).__name__} pickles to {len(frame)} bytes: at most "
                f"{select.PIPE_BUF} fit one atomic pipe write"
            )
        os.write(self.fd, frame)


class _EventReader:
    """The launcher's end: splits the byte stream into frames and hands each event on."""

    def __init__(self, fd: int, on_event: Callable[[int, Any], None] | None):
        self.fd, self.on_event, self.buffer, self.open = fd, on_event, b"", True

    def drain(self, timeout_s: float) -> None:
        """Read what arrived within `timeout_s`; `open` turns False once every writer has gone."""
        if not self.open:
            time.sleep(timeout_s)
            return
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.open = False  # a rank that died mid-write left at most a fragment: dropped
            return
        self.buffer += chunk
        while len(self.buffer) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(self.buffer)
            if len(self.buffer) < _FRAME.size + size:
                break
            rank, event = pickle.loads(self.buffer[_FRAME.size : _FRAME.size + size])
            self.buffer = self.buffer[_FRAME.size + size :]
            if self.on_event is not None:
                self.on_event(rank, event)


@dataclass(frozen=True)
class RankContext:
    """What a forked rank gets: its place in the gang, the attempt, and its event sink."""

    env: WorkerEnv
    attempt: int
    events: EventPipe

    @property
    def rank(self) -> int:
        return self.env.rank


@dataclass
class RankResult:
    rank: int
    exit_code: int  # negative: killed by that signal
    value: Any = None  # what the target returned (pickled back), when it returned
    error: str = ""  # the child's traceback, or why the launcher killed it

    def describe(self) -> str:
        if self.exit_code < 0:
            return f"rank {self.rank} killed by {signal.Signals(-self.exit_code).name}"
        return f"rank {self.rank} exited with status {self.exit_code}"


@dataclass
class LaunchResult:
    ranks: list[RankResult] = field(default_factory=list)
    timed_out: bool = False
    attempt: int = 0
    first_failure: RankResult | None = None  # the rank whose failure brought the gang down
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def values(self) -> list[Any]:
        return [r.value for r in self.ranks]

    def failures(self) -> list[RankResult]:
        return [r for r in self.ranks if r.exit_code != 0]

    def raise_on_failure(self) -> LaunchResult:
        if not self.ok:
            lines = [
                f"rank {r.rank} exited {r.exit_code}: {r.error.strip() or '(no traceback)'}" for r in self.failures()
            ]
            raise RuntimeError(
                "local launch failed" + (" (timed out)" if self.timed_out else "") + ":\n" + "\n".join(lines)
            )
        return self


def _run_child(
    ctx: RankContext,
    target: Callable[[RankContext], Any],
    pre_exec: Callable[[int], None] | None,
    result_path: str,
    threads: int,
) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    outcome: tuple[str, Any] = ("error", "child ended before reporting")
    stacks = open(_stacks_path(result_path), "w")  # open for the child's life: faulthandler writes to its fd
    faulthandler.register(DUMP_STACKS, file=stacks, all_threads=True)
    try:
        _die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (e.g. the cluster's cleanup)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops the gang
        keep_freed_memory()  # a rank's next step reuses its tensors' pages (meshjob_trainer.heap)
        if "torch" in sys.modules:
            # ranks share the cores, so more threads only contend; and a rank must not use the thread pool it
            # inherits from a parent that ran torch before forking: its first parallel op would hang (seen)
            sys.modules["torch"].set_num_threads(threads)
        if pre_exec is not None:
            pre_exec(ctx.rank)
        value = target(ctx)
        outcome, code = ("ok", value), 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        outcome = ("ok", None) if code == 0 else ("error", f"SystemExit({exc.code!r})")
    except TrainerError as exc:  # its message is the report: one line, not a traceback per rank
        outcome = ("error", f"{type(exc).__name__}: {exc}")
        print(f"meshjob: rank {ctx.rank}: {exc}", file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        outcome = ("error", traceback.format_exc())
        traceback.print_exc()
    try:
        _write_outcome(result_path, outcome)
    except Exception:  # noqa: BLE001 - an unpicklable value: report that instead
        _write_outcome(result_path, ("error", f"rank {ctx.rank}: result not picklable:\n{traceback.format_exc()}"))
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stacks_path(result_path: str) -> str:
    return result_path.removesuffix(".pkl") + ".stacks"


def _write_outcome(path: str, outcome: tuple[str, Any]) -> None:
    """Write then rename: a rank killed mid-write (another rank failed first) leaves no half file."""
    partial = path + ".partial"
    with open(partial, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(partial, path)


def _kill(pids: Sequence[int], grace_s: float) -> dict[int, int]:
    """SIGTERM, then SIGKILL after `grace_s`; reaps them all and returns pid -> wait status."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + grace_s
    while len(statuses) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
    for pid in pids:
        if pid not in statuses:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            statuses[pid] = os.waitpid(pid, 0)[1]
    return statuses


@dataclass
class _Gang:
    """The parent's view of one running gang: pid -> rank, results, the event reader."""

    pids: dict[int, int]
    results: dict[int, RankResult]
    events: _EventReader
    timeout_s: float | None
    kill_grace_s: float
    first_failure: RankResult | None = None
    timed_out: bool = False

    def reap(self) -> None:
        for pid in list(self.pids):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                result = self.results[self.pids.pop(pid)]
                result.exit_code = _exit_code(status)
                if result.exit_code != 0 and self.first_failure is None:
                    self.first_failure = result

    def dump_stacks(self) -> None:
        """Every live rank writes its threads' stacks (read back with its outcome)."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, DUMP_STACKS)
        time.sleep(STACKS_WAIT_S)

    def stop(self, reason: str) -> None:
        for pid, status in _kill(list(self.pids), self.kill_grace_s).items():
            result = self.results[self.pids.pop(pid)]
            result.exit_code = _exit_code(status)
            result.error = reason if result.exit_code != 0 else ""

    def wait(self, started: float) -> None:
        deadline = None if self.timeout_s is None else started + self.timeout_s
        while self.pids:
            self.events.drain(0.02)
            self.reap()
            if self.pids and deadline is not None and time.monotonic() > deadline:
                self.timed_out = True
                self.dump_stacks()
                self.stop(f"timed out after {self.timeout_s:g} s")
            elif self.pids and self.first_failure is not None:
                self.stop("killed: another rank failed")
        grace = time.monotonic() + 2.0  # events written just before exiting are still in the pipe
        while self.events.open and time.monotonic() < grace:
            self.events.drain(0.05)


def _load_outcomes(results: dict[int, RankResult], folder: str, timed_out: bool = False) -> None:
    for rank, res in results.items():
        path = os.path.join(folder, f"{rank}.pkl")
        stacks = _stacks_path(path)
        if timed_out and res.exit_code != 0 and os.path.exists(stacks):
            with open(stacks) as f:
                where = f.read().strip()
            if where:
                res.error += f"; its threads were at (most recent call first):\n{where}"
        if os.path.exists(path):
            with open(path, "rb") as f:
                kind, payload = pickle.load(f)
            if kind == "ok":
                res.value = payload
            elif not res.error:
                res.error = payload
            else:
                res.error = payload + "\n" + res.error


@contextlib.contextmanager
def _frozen_for_fork() -> Iterator[None]:
    """The parent's objects frozen while ranks are forked: each rank inherits them frozen, so its collections
    skip them (module docstring); the parent's own are its collector's again afterwards."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def launch(
    world_size: int,
    target: Callable[[RankContext], Any],
    *,
    ranks: Sequence[int] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    node_rank: int = 0,
    attempt: int = 0,
    pre_exec: Callable[[int], None] | None = None,
    on_event: Callable[[int, Any], None] | None = None,
    timeout_s: float | None = None,
    kill_grace_s: float = 2.0,
    threads_per_rank: int = 1,
) -> LaunchResult:
    """Fork one process per rank in `ranks` (default: all of range(world_size)), each running
    target(RankContext) with its WorkerEnv (master_port None: a free port here); wait for all.

    On the first failure (nonzero exit or signal) the rest of the gang is killed; on timeout all
    are. Returns every rank's exit code, returned value and traceback."""
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks={bad}: must be in [0, world_size={world_size})")
    port = master_port or free_port(master_addr)
    started = time.monotonic()
    read_fd, write_fd = os.pipe()
    gang = _Gang(
        {},
        {r: RankResult(rank=r, exit_code=0) for r in ranks},
        _EventReader(read_fd, on_event),
        timeout_s,
        kill_grace_s,
    )
    with tempfile.TemporaryDirectory(prefix="meshjob-launch-") as tmp:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with _frozen_for_fork():
                for local_rank, rank in enumerate(ranks):
                    env = WorkerEnv(
                        rank=rank,
                        world_size=world_size,
                        local_rank=local_rank,
                        node_rank=node_rank,
                        master_addr=master_addr,
                        master_port=port,
                        local_world_size=len(ranks),
                    )
                    ctx = RankContext(env, attempt, EventPipe(write_fd, rank))
                    pid = os.fork()
                    if pid == 0:
                        os.close(read_fd)
                        _run_child(ctx, target, pre_exec, os.path.join(tmp, f"{rank}.pkl"), threads_per_rank)
                    gang.pids[pid] = rank
            os.close(write_fd)
            write_fd = -1
            gang.wait(started)
        finally:
            if gang.pids:  # interrupted (Ctrl-C, an exception in on_event): take the gang down with us
                gang.stop("killed: the launcher stopped")
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
        _load_outcomes(gang.results, tmp, gang.timed_out)
    return LaunchResult(
        ranks=[gang.results[r] for r in ranks],
        timed_out=gang.timed_out,
        attempt=attempt,
        first_failure=gang.first_failure,
        seconds=time.monotonic() - started,
    )


def launch_with_restarts(
    world_size: int,
    target: Callable[[RankContext], Any],
    *,
    max_restarts: int = 0,
    on_restart: Callable[[LaunchResult], None] | None = None,
    **kwargs: Any,
) -> list[LaunchResult]:
    """launch(); after a failure start a new gang (the target resumes from its checkpoint), at most
    `max_restarts` times. Each attempt rendezvouses on a fresh port: master_port + attempt when a port
    is given (the old store's may linger in TIME_WAIT), else a free one. Returns every attempt's result;
    the last one decides."""
    if max_restarts < 0:
        raise ValueError(f"max_restarts: {max_restarts!r} is invalid: an integer >= 0")
    base_port = kwargs.pop("master_port", None)
    results: list[LaunchResult] = []
    for attempt in range(max_restarts + 1):
        port = None if base_port is None else base_port + attempt
        results.append(launch(world_size, target, master_port=port, attempt=attempt, **kwargs))
        if results[-1].ok:
            break
        if attempt < max_restarts and on_restart is not None:
            on_restart(results[-1])
    return results
