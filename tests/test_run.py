"""`meshjob run`: a tiny job end to end on the emulated cluster and on loopback, cleanup after
success, failure and Ctrl-C, gang restart from a checkpoint, metrics while it runs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.emulate.netns import list_netns, netns_available
from meshjob_trainer.emulate.progress import RunStats
from meshjob_trainer.events import CheckpointRestored, LowerBoundRatio, NicBandwidth, StepFinished, UnitTasks

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny.yaml"
HAVE_NETNS, WHY_NOT = netns_available()
needs_netns = pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
FORWARD = BoundaryKey(0, 1, "activation")


def _ctrl_c_as_at_a_terminal() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python keeps an inherited SIG_IGN: a suite
    run in the background would start `meshjob run` deaf to Ctrl-C. Give it the terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """`meshjob run` in a subprocess, tagged so that every process it forks can be found."""

    def __init__(self, tmp_path: Path, *args: str, job: Path = TINY):
        self.tag = uuid.uuid4().hex
        self.json_path = tmp_path / "summary.json"
        env = {**os.environ, "MESHJOB_TEST_TAG": self.tag}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshjob.cli", "run", str(job), "--quiet", "--json", str(self.json_path), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_ctrl_c_as_at_a_terminal,
        )

    def wait(self, timeout: float = 150) -> int:
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # SIGTERM: the run still removes its namespaces
            self.out, self.err = self.proc.communicate(timeout=20)
            raise AssertionError(
                f"meshjob run still running after {timeout:g} s; stderr:\n{self.err[-3000:]}"
            ) from None
        return self.proc.returncode

    def summary(self) -> dict:
        return json.loads(self.json_path.read_text())

    def ranks(self) -> list[int]:
        """Live rank processes: forked children running Python (not the `ip` commands it runs)."""
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except FileNotFoundError:
            return []
        ranks = []
        for pid in map(int, text.split()):
            try:
                if os.readlink(f"/proc/{pid}/exe") == os.readlink(f"/proc/{self.proc.pid}/exe"):
                    ranks.append(pid)
            except OSError:
                pass
        return ranks

    def stop(self) -> None:
        """Teardown: SIGTERM lets the run remove its namespaces even when a test failed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def leftovers(self) -> tuple[list[str], list[int]]:
        """Namespaces and processes of this run that still exist."""
        namespaces = [n for n in list_netns() if n.startswith(f"mj{self.proc.pid}_")]
        pids = []
        for env_file in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"MESHJOB_TEST_TAG={self.tag}".encode() in env_file.read_bytes():
                    pids.append(int(env_file.parent.name))
            except OSError:
                pass
        return namespaces, pids

    def assert_clean(self) -> None:
        deadline = time.monotonic() + 5  # reaped processes vanish from /proc asynchronously
        while self.leftovers() != ([], []) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.leftovers() == ([], [])


@pytest.fixture
def start(tmp_path):
    runs: list[Run] = []

    def make(*args: str, job: Path = TINY) -> Run:
        runs.append(Run(tmp_path, *args, job=job))
        return runs[-1]

    yield make
    for run in runs:
        run.stop()


UNENDING = 100_000  # steps of a run that a test stops: it must not finish first, however fast the machine


def job_file(tmp_path: Path, steps: int, every: int = 0) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["training"]["steps"] = steps
    if every:
        doc["spec"]["training"]["checkpoint"] = {"every": every, "path": str(tmp_path / "ckpt")}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def complete_checkpoint(directory: Path, world_size: int) -> bool:
    return any(len(list(d.glob("rank-*.done"))) == world_size for d in directory.glob("step-*"))


@pytest.mark.slow
@pytest.mark.netns
@needs_netns
def test_tiny_job_trains_to_the_end_inside_network_namespaces(tmp_path, start):
    run = start()
    assert run.wait() == 0, run.err[-3000:]
    s = run.summary()
    assert s["ok"] and s["emulated"] and s["nic_rate"] == "1gbit"
    assert s["network_model"]["shared_cpu_cores"] == os.cpu_count()  # planned for the hosts' shared cores
    assert s["steps_completed"] == s["total_steps"] == 3
    assert math.isfinite(s["final_loss"]) and s["tokens_per_s_mean"] > 0
    assert s["resharding_bytes"] > 0 and s["resharding_gbytes_per_s"] > 0
    assert "succeeded" in run.err  # the summary table
    run.assert_clean()


@pytest.mark.slow
def test_tiny_job_runs_on_loopback_with_a_clear_warning(tmp_path, start):
    run = start("--no-netns")
    assert run.wait() == 0, run.err[-3000:]
    s = run.summary()
    assert s["ok"] and not s["emulated"] and s["steps_completed"] == 3
    assert "NIC rate 1gbit is NOT applied" in run.err
    run.assert_clean()


@pytest.mark.slow
@pytest.mark.netns
@needs_netns
def test_a_killed_worker_fails_the_run_and_leaves_nothing_behind(tmp_path, start):
    run = start(job=job_file(tmp_path, steps=UNENDING))
    wait_for(lambda: len(run.ranks()) == 4, 90, "the ranks to start")
    victim = run.ranks()[-1]
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    assert run.wait() == 1
    s = run.summary()
    assert not s["ok"] and "killed by SIGKILL" in s["failure"] and s["attempts"] == 1
    run.assert_clean()


@pytest.mark.slow
@pytest.mark.netns
@needs_netns
def test_a_killed_worker_restarts_the_gang_from_the_last_checkpoint(tmp_path, start):
    job = job_file(tmp_path, steps=12, every=2)
    run = start("--max-restarts", "1", job=job)
    wait_for(lambda: complete_checkpoint(tmp_path / "ckpt", 4), 120, "a complete checkpoint")
    os.kill(run.ranks()[1], signal.SIGKILL)
    assert run.wait(timeout=150) == 0, run.err[-3000:]
    s = run.summary()
    assert s["ok"] and s["attempts"] == 2 and s["restarts"] == 1
    assert s["resumed_from_steps"][0] >= 2  # not from scratch
    assert s["steps_completed"] == 12
    assert "restarting the gang from the last checkpoint" in run.err
    run.assert_clean()


@pytest.mark.slow
@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_and_removes_namespaces_and_ranks(tmp_path, start, signum, status):
    run = start(job=job_file(tmp_path, steps=UNENDING))
    wait_for(lambda: len(run.ranks()) == 4, 90, "the ranks to start")
    time.sleep(1.0)
    run.proc.send_signal(signum)
    assert run.wait() == status
    run.assert_clean()


@pytest.mark.slow
def test_metrics_port_serves_the_aggregated_step_and_loss_while_running(tmp_path, start):
    port = 19400 + os.getpid() % 500
    run = start("--no-netns", "--metrics-port", str(port), job=job_file(tmp_path, steps=UNENDING))

    def scrape() -> str:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return ""
        steps = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("meshjob_step{")]
        return text if steps and steps[0] >= 2 else ""

    try:
        text = wait_for(scrape, 120, "meshjob_step >= 2 on the metrics port")
    finally:
        run.proc.send_signal(signal.SIGINT)
        run.wait()
    assert 'meshjob_loss{namespace="default",stage="1",trainingjob="tiny"}' in text
    assert "meshjob_tokens_total" in text
    nic_hosts = {
        line.split('host="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("meshjob_nic_bandwidth_bytes_per_second{")
    }
    assert nic_hosts and all(h.startswith("host-") for h in nic_hosts), nic_hosts  # the plan's names
    run.assert_clean()


@pytest.mark.slow
def test_bad_nic_rate_is_rejected_naming_the_option(tmp_path, start):
    run = start("--nic-rate", "fast")
    assert run.wait() == 2
    assert "--nic-rate: 'fast' is invalid" in run.err


def step_event_of(
    rank: int, step: int, seconds: float, loss: float = math.nan, tokens: int = 1000
) -> tuple[int, StepFinished]:
    """(rank, its step event): rank r runs stage r here."""
    return rank, StepFinished(stage=rank, step=step, seconds=seconds, tokens=tokens, loss=loss)


def test_a_step_counts_once_every_rank_reported_it_timed_by_the_slowest_rank():
    stats = RunStats(world_size=2, total_steps=10)
    stats.add(*step_event_of(0, 1, 0.5))
    assert stats.step == 0
    stats.add(*step_event_of(1, 1, 0.25, loss=3.5))
    assert stats.step == 1 and stats.loss == 3.5
    assert stats.tokens_per_s == pytest.approx(1000 / 0.5)


def test_the_summary_lists_each_steps_loss_once_whatever_the_last_stages_ranks():
    stats = RunStats(world_size=3, total_steps=2)
    for step in (1, 2):
        stats.add(*step_event_of(0, step, 0.1))
        for rank in (1, 2):  # the last stage's two data-parallel ranks report the same loss
            stats.add(*step_event_of(rank, step, 0.1, loss=3.0 - step))
    assert stats.to_json()["losses"] == [(1, 2.0), (2, 1.0)]


def test_a_restarted_gang_records_the_step_it_resumed_from():
    stats = RunStats(world_size=1, total_steps=10)
    for step in (1, 2, 3):
        stats.add(*step_event_of(0, step, 0.1, loss=2.0))
    stats.restart()
    stats.add(*step_event_of(0, 3, 0.1, loss=1.9))  # the checkpoint held 2 steps
    assert stats.restarts == 1 and stats.resumed_from == [2] and stats.step == 3


def test_the_resume_step_is_the_one_the_ranks_restored():
    stats = RunStats(world_size=2, total_steps=20, resume_step=6)  # what was found before the ranks ran
    for rank in (0, 1):
        stats.add(rank, CheckpointRestored(stage=rank, step=4))
    assert stats.resume_step == 4 and stats.to_json()["resume_step"] == 4


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # bit rot: same size
    path.write_bytes(bytes(data))


def test_run_refuses_checkpoints_none_of_which_every_rank_can_load_naming_the_damage(tmp_path, start):
    import torch

    from meshjob_trainer.checkpoint import Checkpointer

    module = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ranks = [Checkpointer(tmp_path / "ckpt", rank, 4, {}) for rank in range(4)]
    for ck in ranks:
        ck.write(2, module, optimizer)
    damage(ranks[3].data_path(2))
    run = start(job=job_file(tmp_path, steps=4, every=2))
    assert run.wait() == 2
    assert "none can be loaded by every rank, and the run does not start again from step 0" in run.err
    assert "step 2: rank-00003.pt does not match the sha256 in its marker" in run.err
    run.assert_clean()


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_and_reports_that_step(tmp_path, start):
    first = start("--no-netns", job=job_file(tmp_path, steps=4, every=2))
    assert first.wait() == 0, first.err[-3000:]
    damage(tmp_path / "ckpt" / "step-00000004" / "rank-00001.pt")
    run = start("--no-netns", job=job_file(tmp_path, steps=6, every=2))
    assert run.wait() == 0, run.err[-3000:]
    s = run.summary()
    assert s["ok"] and s["resume_step"] == 2 and s["steps_completed"] == 6
    err = " ".join(run.err.split())  # the console wraps long lines
    assert "skipping a checkpoint that cannot be loaded: step 4: rank-00001.pt does not match" in err
    assert "resuming from the checkpoint of step 2" in err and "resumed at step 2" in err
    run.assert_clean()


def test_steps_a_checkpoint_holds_count_as_completed():
    stats = RunStats(world_size=2, total_steps=20, resume_step=20)
    assert stats.step == 20 and stats.mean_tokens_per_s == 0.0


def test_hosts_that_cannot_hold_the_job_are_rejected_before_anything_starts(tmp_path, start):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump([{"name": "only", "devices": 1}]))
    run = start("--hosts", str(hosts))
    assert run.wait() == 2
    assert "invalid input" in run.err
    run.assert_clean()


@pytest.mark.slow
def test_a_hosts_file_places_the_job_and_only_used_hosts_are_emulated(tmp_path, start):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump([{"name": f"n{i}", "devices": 2} for i in range(5)]))
    run = start("--no-netns", "--hosts", str(hosts))
    assert run.wait() == 0, run.err[-3000:]
    s = run.summary()
    assert s["ok"] and s["hosts"] == 3 and s["world_size"] == 4


def test_nic_ratio_and_unit_task_events_are_summarised_per_host_boundary_and_balancer():
    stats = RunStats(world_size=2, total_steps=1)
    for rank, event in (
        (0, NicBandwidth("host-1", 2e6)),
        (1, NicBandwidth("host-1", 5e6)),
        (1, LowerBoundRatio(FORWARD, 3.0)),
        (1, LowerBoundRatio(FORWARD, 1.5)),
        (0, UnitTasks("greedy", 2)),
        (1, UnitTasks("greedy", 3)),
    ):
        stats.add(rank, event)
    summary = stats.to_json()
    assert summary["nic_bytes_per_s_max"] == {"host-1": 5e6}
    assert summary["resharding_lower_bound_ratio"] == {"0->1:activation": 1.5}
    assert summary["unit_tasks"] == {"greedy": 5}


@pytest.fixture
def feed():
    from meshjob.plan.build import build_plan
    from meshjob.plan.placement import default_hosts
    from meshjob.spec.manifest import load_job
    from meshjob_trainer.commands.run import MetricsFeed

    job = load_job(str(TINY))
    plan = build_plan(job, default_hosts(job))
    feed = MetricsFeed(job, plan, 0)
    yield feed
    feed.close()


def test_metrics_feed_labels_nic_bandwidth_with_the_ranks_host_names(feed):
    stats = RunStats(world_size=2, total_steps=1)
    for host, rate in (("host-0", 1e6), ("host-1", 3e6)):
        feed.on_event(NicBandwidth(host, rate), stats)
    get = feed.metrics.registry.get_sample_value
    assert (
        get("meshjob_nic_bandwidth_bytes_per_second", {"trainingjob": "tiny", "namespace": "default", "host": "host-0"})
        == 1e6
    )
    assert (
        get("meshjob_nic_bandwidth_bytes_per_second", {"trainingjob": "tiny", "namespace": "default", "host": "host-1"})
        == 3e6
    )
    assert (
        get(
            "meshjob_nic_bandwidth_bytes_per_second",
            {"trainingjob": "tiny", "namespace": "default", "host": "launcher"},
        )
        is None
    )


def test_metrics_feed_passes_on_lower_bound_ratio_and_unit_tasks(feed):
    stats = RunStats(world_size=2, total_steps=1)
    feed.on_event(LowerBoundRatio(FORWARD, 1.25), stats)
    feed.on_event(UnitTasks("greedy", 4), stats)
    feed.on_event(UnitTasks("greedy", 2), stats)
    get = feed.metrics.registry.get_sample_value
    assert (
        get(
            "meshjob_resharding_lower_bound_ratio",
            {"trainingjob": "tiny", "namespace": "default", "boundary": "0->1:activation"},
        )
        == 1.25
    )
    assert get("meshjob_unit_tasks_total", {"trainingjob": "tiny", "namespace": "default", "balancer": "greedy"}) == 6


def test_the_feed_reports_a_step_once_every_rank_finished_it_as_the_last_stage(feed):
    stats = RunStats(world_size=2, total_steps=3)
    for rank, event in ((0, StepFinished(0, 1, 0.5, 128, math.nan)), (1, StepFinished(1, 1, 0.25, 128, 3.5))):
        stats.add(rank, event)
        feed.on_event(event, stats)
    get = feed.metrics.registry.get_sample_value
    assert get("meshjob_step", {"trainingjob": "tiny", "namespace": "default", "stage": "1"}) == 1
    assert get("meshjob_step", {"trainingjob": "tiny", "namespace": "default", "stage": "0"}) is None
    assert (
        get("meshjob_step_seconds_sum", {"trainingjob": "tiny", "namespace": "default", "stage": "1"}) == 0.5
    )  # the slowest rank's time
    assert get("meshjob_loss", {"trainingjob": "tiny", "namespace": "default", "stage": "1"}) == 3.5
