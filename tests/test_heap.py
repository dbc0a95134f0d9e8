"""A rank keeps the memory of the tensors it frees, so its next step does not fault their pages in again
(meshjob_trainer.heap)."""

import os
import platform
import subprocess
import sys

import pytest

import meshjob_trainer.launch as launch_module
from meshjob_trainer.launch import launch

PAGES_PER_TENSOR = 16 * 1024 * 1024 // 4096
HELD = 3  # 16 MiB tensors a step holds at once
STEPS = 8

# A rank's pattern: its engine thread allocates the buffers transfers land in, the caller frees them.
STEP_LOOP = f"""
import queue, resource, threading, torch
torch.set_num_threads(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def steps():
    jobs, done = queue.Queue(), queue.Queue()
    def engine():
        for n in iter(jobs.get, None):
            done.put([torch.empty({PAGES_PER_TENSOR * 1024}).fill_(1.0) for _ in range(n)])
    threading.Thread(target=engine, daemon=True).start()
    out = []
    for _ in range({STEPS}):
        before = faults()
        jobs.put({HELD})
        held = done.get()
        del held
        out.append(faults() - before)
    jobs.put(None)
    return out
"""


def _faults_in_a_fresh_process(keep: bool) -> list[int]:
    code = STEP_LOOP + (
        "from meshjob_trainer.heap import keep_freed_memory\nassert keep_freed_memory()\n" if keep else ""
    )
    code += "print(*steps())\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return [int(x) for x in out.stdout.split()]


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; other C libraries unchanged")


@glibc
def test_steps_after_the_first_few_fault_no_pages_in():
    faults = _faults_in_a_fresh_process(keep=True)
    assert faults[0] >= HELD * PAGES_PER_TENSOR // 2, faults  # the first step maps its memory
    assert max(faults[4:]) < PAGES_PER_TENSOR // 10, faults


@glibc
def test_by_default_freed_buffers_are_faulted_in_again():
    faults = _faults_in_a_fresh_process(keep=False)
    assert sum(faults[4:]) >= PAGES_PER_TENSOR, faults  # the cause keep_freed_memory removes


def test_every_launched_rank_keeps_freed_memory_before_its_target_runs(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(launch_module, "keep_freed_memory", lambda: calls.append(os.getpid()))
    pids = launch(2, lambda ctx: (os.getpid(), list(calls))).raise_on_failure().values
    assert all(seen == [pid] for pid, seen in pids)  # each rank, in its own process
    assert calls == []  # not the launcher


@glibc
def test_a_rank_done_with_its_shapes_hands_the_kept_memory_back():
    code = (
        STEP_LOOP
        + """
from meshjob_trainer.heap import keep_freed_memory, release_freed_memory
assert keep_freed_memory()
def rss_kib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])
steps()
kept = rss_kib()
released = release_freed_memory()
print(kept, rss_kib(), released)
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    kept, after, released = out.stdout.split()
    assert released == "True"
    assert int(kept) - int(after) >= HELD * PAGES_PER_TENSOR * 4 // 2, out.stdout  # most of the 48 MiB goes back
