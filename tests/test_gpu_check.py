"""bench/gpu_check.sh runs only on a lent GPU machine; here: it parses, and every step has a limit that can skip it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def test_the_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_every_step_of_the_gpu_check_runs_under_its_own_time_limit():
    text = SCRIPT.read_text()
    limits = set(re.findall(r'timeout (?:-s INT -k 20 )?"\$\{(\w+_S):-\d+\}"', text))
    assert limits == {"TESTS_S", "RUN_S", "RESHARD_S", "BENCH_S", "CPU_S"}
    for name in limits - {"TESTS_S"}:  # the tests always run; the other steps are skipped by a limit of 0
        assert f'if [ "${{{name}:-' in text


def test_cuda_mps_is_opt_in_and_its_daemon_is_stopped_when_the_check_exits():
    text = SCRIPT.read_text()
    assert 'if [ "${MPS:-0}" != 0 ]' in text
    assert "nvidia-cuda-mps-control -d" in text and "trap 'echo quit | nvidia-cuda-mps-control' EXIT" in text
