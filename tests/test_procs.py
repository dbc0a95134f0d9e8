import os
import subprocess
import time

from meshjob_trainer.procs import pid_alive


def test_a_running_process_is_alive():
    assert pid_alive(os.getpid())


def test_a_dead_unreaped_process_a_zombie_is_not_alive():
    child = subprocess.Popen(["true"])
    for _ in range(200):  # until it has exited; not reaped: Popen reaps only in wait/poll
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)  # reaped: gone
