"""Start a gang of ranks on this machine as forked processes and collect their outcome.

fork, not torch.multiprocessing's spawn: 8 forked ranks start in under a second, spawned ones
re-import torch each (15-23 s on 2 cores). A forked child must not have touched sockets the
parent owns; each rank makes its own after fork. `pre_exec(rank)` runs in the child before the
target (the emulated cluster uses it to setns(2) into the rank's host namespace).
If one rank fails, the others are killed: a gang with a dead member would only hang.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from meshjob_trainer.dist import WorkerEnv

PR_SET_PDEATHSIG = 1


@dataclass
class RankResult:
    rank: int
    exit_code: int  # negative: killed by that signal
    value: Any = None  # what the target returned (pickled back), when it returned
    error: str = ""  # the child's traceback, or why the launcher killed it


@dataclass
class LaunchResult:
    ranks: list[RankResult] = field(default_factory=list)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def values(self) -> list[Any]:
        return [r.value for r in self.ranks]

    def failures(self) -> list[RankResult]:
        return [r for r in self.ranks if r.exit_code != 0]

    def raise_on_failure(self) -> "LaunchResult":
        if not self.ok:
            lines = [f"rank {r.rank} exited {r.exit_code}: {r.error.strip() or '(no traceback)'}"
                     for r in self.failures()]
            raise RuntimeError("local launch failed" + (" (timed out)" if self.timed_out else "") + ":\n"
                               + "\n".join(lines))
        return self


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: orphans are then reaped by the timeout only
        pass


def _run_child(rank_env: Mapping[str, str], rank: int, target: Callable[[WorkerEnv], Any],
               pre_exec: Callable[[int], None] | None, result_path: str, threads: int | None) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    outcome: tuple[str, Any] = ("error", "child ended before reporting")
    try:
        _die_with_parent()
        os.environ.update(rank_env)
        if threads is not None and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        if pre_exec is not None:
            pre_exec(rank)
        value = target(WorkerEnv.from_env())
        outcome, code = ("ok", value), 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        outcome = ("ok", None) if code == 0 else ("error", f"SystemExit({exc.code!r})")
    except BaseException:  # noqa: BLE001 - report everything to the parent
        outcome = ("error", traceback.format_exc())
        traceback.print_exc()
    try:
        with open(result_path, "wb") as f:
            pickle.dump(outcome, f)
    except Exception:  # noqa: BLE001 - an unpicklable value: report that instead
        with open(result_path, "wb") as f:
            pickle.dump(("error", f"rank {rank}: result not picklable:\n{traceback.format_exc()}"), f)
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def launch_local(world_size: int, target: Callable[[WorkerEnv], Any], *, ranks: Sequence[int] | None = None,
                 env: Mapping[str, str] | None = None, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, node_rank: int = 0,
                 pre_exec: Callable[[int], None] | None = None, timeout_s: float | None = None,
                 kill_grace_s: float = 2.0, threads_per_rank: int | None = 1) -> LaunchResult:
    """Fork one process per rank in `ranks` (default: all of range(world_size)) running
    target(WorkerEnv.from_env()) with torchrun's variables set; wait for all of them.

    On the first failure (nonzero exit or signal) the rest of the gang is killed; on timeout all
    are. Returns every rank's exit code, returned value and traceback.
    """
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks={bad}: must be in [0, world_size={world_size})")
    port = master_port or free_port(master_addr)
    results = {r: RankResult(rank=r, exit_code=0) for r in ranks}
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="meshjob-launch-") as tmp:
        pids: dict[int, int] = {}  # pid -> rank
        sys.stdout.flush()
        sys.stderr.flush()
        for local_rank, rank in enumerate(ranks):
            rank_env = dict(env or {})
            rank_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                            LOCAL_WORLD_SIZE=str(len(ranks)), NODE_RANK=str(node_rank),
                            MASTER_ADDR=master_addr, MASTER_PORT=str(port))
            pid = os.fork()
            if pid == 0:
                _run_child(rank_env, rank, target, pre_exec, os.path.join(tmp, f"{rank}.pkl"), threads_per_rank)
            pids[pid] = rank
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(pids)
        while pending:
            for pid in list(pending):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    results[pending.pop(pid)].exit_code = _exit_code(status)
            failed = any(results[pids[p]].exit_code != 0 for p in pids if p not in pending)
            if deadline is not None and time.monotonic() > deadline and pending:
                timed_out = True
            if pending and (failed or timed_out):
                reason = f"timed out after {timeout_s:g} s" if timed_out else "killed: another rank failed"
                for pid, status in _kill(list(pending), kill_grace_s).items():
                    res = results[pending.pop(pid)]
                    res.exit_code = _exit_code(status)
                    res.error = reason if res.exit_code != 0 else ""
                break
            if pending:
                time.sleep(0.02)
        for rank, res in results.items():
            path = os.path.join(tmp, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    kind, payload = pickle.load(f)
                if kind == "ok":
                    res.value = payload
                else:
                    res.error = payload
    return LaunchResult(ranks=[results[r] for r in ranks], timed_out=timed_out)


def launch_job(job_path: str, *, hosts_path: str = "", env: Mapping[str, str] | None = None,
               pre_exec: Callable[[int], None] | None = None, timeout_s: float | None = None,
               rank_timeout_s: float = 300.0, **kwargs: Any) -> LaunchResult:
    """Every rank of a TrainingJob on this machine; each returns its TrainResult.
    The plan is built once here (and checked again by every rank against its own)."""
    from meshjob_trainer.worker import load_setup, run_worker

    child_env = dict(env or {})
    child_env["MESHJOB_JOB"] = os.path.abspath(job_path)
    if hosts_path:
        child_env["MESHJOB_HOSTS"] = os.path.abspath(hosts_path)
    setup = load_setup(child_env["MESHJOB_JOB"], hosts_path, child_env)
    return launch_local(setup.plan.placement.world_size, lambda e: run_worker(e, rank_timeout_s, setup),
                        env=child_env, pre_exec=pre_exec, timeout_s=timeout_s, **kwargs)
