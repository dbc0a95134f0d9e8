"""Worker environment and settings, process-group formation and the gang launcher, with real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from meshjob_trainer.dist import (
    DistError,
    NodeEnv,
    WorkerEnv,
    WorkerSettings,
    backend_for_device,
    check_world_size,
    describe_transport,
    device_for_backend,
    init_distributed,
    nccl_host_id,
    shutdown_distributed,
    uses_cuda,
)
from meshjob_trainer.launch import RankContext, launch


def test_worker_env_reads_torchrun_variables():
    env = WorkerEnv.from_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "NODE_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 8, 1, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_worker_env_reads_the_number_of_ranks_on_its_host():
    env = WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert env.local_world_size == 4
    assert WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "8"}).local_world_size == 1


def test_the_launcher_tells_each_rank_how_many_ranks_share_its_host():
    result = launch(3, lambda ctx: (ctx.env.local_rank, ctx.env.local_world_size), timeout_s=20)
    assert result.raise_on_failure().values == [(0, 3), (1, 3), (2, 3)]


def test_ranks_that_outnumber_their_hosts_gpus_each_become_an_nccl_host_of_their_own():
    """NCCL refuses two ranks of one communicator on one GPU of one host; such ranks take its network transport."""
    crowded = WorkerEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert nccl_host_id(crowded, gpus=1, host="node-a") == "node-a-rank5"
    assert nccl_host_id(dataclasses.replace(crowded, rank=6), gpus=1, host="node-a") == "node-a-rank6"
    assert nccl_host_id(crowded, gpus=4, host="node-a") is None  # a GPU per rank: NVLink and shared memory stay


def test_only_a_cuda_device_ends_a_benchs_timed_region_with_a_sync():
    import torch

    from meshjob_trainer.dist import device_sync

    assert device_sync(torch.device("cpu")) is None
    assert callable(device_sync(torch.device("cuda", 0)))  # not called: no GPU here


def test_ranks_of_different_emulated_hosts_are_different_nccl_hosts_on_their_hosts_nic(monkeypatch):
    """So NCCL between emulated hosts crosses their emulated NICs, not NVLink or shared memory."""
    import socket

    from meshjob_trainer.emulate.netns import EmulatedHost

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_HOSTID"):
        monkeypatch.setenv(name, "before")  # restored after the test
    ids = []
    for index in (0, 1):
        EmulatedHost(index, None, "127.0.0.1", "lo").enter()
        assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
        ids.append(os.environ["NCCL_HOSTID"])
    assert ids == [f"{socket.gethostname()}-emulated-host0", f"{socket.gethostname()}-emulated-host1"]
    crowded = WorkerEnv(rank=3, world_size=4, local_rank=3, local_world_size=4)
    assert nccl_host_id(crowded, gpus=1, host=ids[1]) == f"{ids[1]}-rank3"  # sharing a GPU: a host of its own


def test_a_hosts_log_says_what_carries_its_tensors():
    env = WorkerEnv(rank=0, world_size=8, local_world_size=4)
    assert describe_transport(env, "gloo", 0) == "meshjob: 4 rank(s) here, CPU tensors over gloo"
    nccl = describe_transport(env, "cpu:gloo,cuda:nccl", 4)
    assert nccl == "meshjob: 4 rank(s) here on 4 GPU(s), CUDA tensors over NCCL"
    shared = describe_transport(env, "cpu:gloo,cuda:nccl", 1)
    assert "1 GPU(s)" in shared and "each is an NCCL host of its own" in shared


def test_worker_env_reads_kubeflow_pet_variables():
    env = WorkerEnv.from_env(
        {
            "PET_RANK": "1",
            "PET_WORLD_SIZE": "2",
            "PET_MASTER_ADDR": "job-master-0",
            "PET_MASTER_PORT": "23456",
            "PET_NODE_RANK": "1",
        }
    )
    assert (env.rank, env.world_size, env.node_rank, env.master_addr, env.master_port) == (
        1,
        2,
        1,
        "job-master-0",
        23456,
    )


def test_a_hosts_launcher_reads_its_node_and_the_rendezvous_without_a_rank():
    node = NodeEnv.from_env({"PET_NODE_RANK": "2", "WORLD_SIZE": "8", "MASTER_ADDR": "job-host-0"})
    assert node == NodeEnv(node_rank=2, world_size=8, master_addr="job-host-0", master_port=None)
    assert not NodeEnv.has_rank({"WORLD_SIZE": "8"}) and NodeEnv.has_rank({"PET_RANK": "0"})


def test_worker_settings_are_the_operators_meshjob_variables():
    settings = WorkerSettings.from_env(
        {
            "MESHJOB_JOB": "/etc/meshjob/job.yaml",
            "MESHJOB_PLAN": "/etc/meshjob/plan.json",
            "MESHJOB_METRICS_PORT": "9400",
            "MESHJOB_POD_NAME": "demo-host-0",
            "MESHJOB_NAMESPACE": "team-a",
            "UNRELATED": "x",
        }
    )
    assert settings == WorkerSettings(
        job_path="/etc/meshjob/job.yaml", plan_path="/etc/meshjob/plan.json", metrics_port=9400, step_log=True
    )


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_bad_metrics_port_variable_is_named_with_its_value(port):
    with pytest.raises(DistError, match=rf"MESHJOB_METRICS_PORT={port!r}|MESHJOB_METRICS_PORT={port} is invalid"):
        WorkerSettings.from_env({"MESHJOB_METRICS_PORT": port})


def test_missing_rank_variable_is_named():
    with pytest.raises(DistError, match="RANK or PET_RANK is not set"):
        WorkerEnv.from_env({"WORLD_SIZE": "2"})


def test_rank_outside_world_size_is_rejected_with_both_values():
    with pytest.raises(DistError, match=r"RANK=4 is invalid: must be in \[0, WORLD_SIZE=4\)"):
        WorkerEnv.from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_non_integer_variable_is_rejected_with_its_value():
    with pytest.raises(DistError, match=r"MASTER_PORT='http' is invalid: must be an integer"):
        WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"})


def test_wrong_world_size_names_both_sizes():
    env = WorkerEnv(rank=0, world_size=4)
    with pytest.raises(DistError, match=r"WORLD_SIZE=4 but the plan of job 'gpt' needs 6 ranks"):
        check_world_size(env, 6, "gpt")


def _join_and_sum(env: WorkerEnv):
    import torch
    import torch.distributed as dist

    init_distributed(env, timeout_s=10)
    try:
        t = torch.tensor([env.rank + 1.0])
        dist.all_reduce(t)
        return float(t.item())
    finally:
        shutdown_distributed()


def test_with_cuda_the_backend_is_gloo_for_cpu_tensors_and_nccl_for_cuda_tensors():
    """CUDA tensors (collectives, the engine's messages) go over NCCL; the CPU objects a rank still
    exchanges (the plan's digest, calibration figures) over gloo, in the same group."""
    assert backend_for_device(cuda_available=True) == "cpu:gloo,cuda:nccl"


# -- the engine's wire: gloo (or TCP) on the CPU, NCCL device to device on CUDA ----------------------


def test_cpu_ranks_get_the_gloo_wire_and_tcp_on_request():
    from meshjob_trainer.tcp_wire import TcpWire
    from meshjob_trainer.wire import GlooWire, wire_for

    assert isinstance(wire_for(torch_device("cpu"), 0, {(0, 1)}), GlooWire)
    assert isinstance(wire_for(torch_device("cpu"), 0, {(0, 1)}, cpu_wire="tcp"), TcpWire)


def test_an_unknown_cpu_wire_is_a_clear_error():
    from meshjob_trainer.wire import wire_for

    with pytest.raises(ValueError, match=r"cpu_wire 'mpi' is invalid: one of gloo, tcp"):
        wire_for(torch_device("cpu"), 0, {(0, 1)}, cpu_wire="mpi")


def torch_device(text: str):
    import torch

    return torch.device(text)


def test_a_communicator_per_directed_pair_is_created_in_one_sorted_order():
    from meshjob_trainer.wire import directed_groups

    made = []
    groups = directed_groups(
        [(3, 1), (1, 3), (0, 1), (3, 1)], new_group=lambda ranks, backend: made.append((ranks, backend)) or len(made)
    )
    assert made == [([0, 1], "nccl"), ([1, 3], "nccl"), ([1, 3], "nccl")]
    assert groups == {(0, 1): 1, (1, 3): 2, (3, 1): 3}  # (1, 3) and (3, 1): one direction each


def test_cuda_ranks_get_the_nccl_wire_over_every_pair_connected_at_once(monkeypatch):
    import meshjob_trainer.wire as wire_module

    class RecordingNccl:
        def __init__(self, rank, device, groups):
            self.rank, self.device, self.groups, self.connected = rank, device, groups, False

        def connect(self):
            self.connected = True

    monkeypatch.setattr(wire_module, "NcclWire", RecordingNccl)
    wire = wire_module.wire_for(torch_device("cuda:1"), 2, {(2, 5), (5, 2)}, new_group=lambda ranks, backend: ranks)
    assert isinstance(wire, RecordingNccl) and wire.connected
    assert wire.rank == 2 and str(wire.device) == "cuda:1" and wire.groups == {(2, 5): [2, 5], (5, 2): [2, 5]}


def test_nccl_completion_is_polled_with_growing_pauses_then_its_errors_are_raised(monkeypatch):
    import types

    from meshjob_trainer import wire as wire_module

    class Work:
        polls, waited = 0, False

        def is_completed(self):
            self.polls += 1
            return self.polls > 3

        def wait(self):
            self.waited = True

    pauses: list[float] = []
    monkeypatch.setattr(wire_module, "time", types.SimpleNamespace(sleep=pauses.append))
    work = Work()
    wire_module.wait_polling(work, 0.001, 0.002)
    assert work.polls == 4 and work.waited
    assert pauses == [0.001, 0.002, 0.002]  # doubling, at most the longest


def test_without_cuda_the_backend_is_gloo():
    assert backend_for_device(cuda_available=False) == "gloo"


def test_the_backend_chooser_asks_torch_when_not_told(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_for_device() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backend_for_device() == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(
    "backend,cuda", [("gloo", False), ("cpu:gloo", False), ("nccl", True), ("cpu:gloo,cuda:nccl", True)]
)
def test_a_backend_carries_cuda_tensors_only_with_nccl(backend, cuda):
    assert uses_cuda(backend) is cuda


def test_ranks_train_on_the_cpu_under_gloo():
    assert device_for_backend("gloo") == "cpu"


def test_ranks_form_a_gloo_group_and_all_reduce(gang):
    assert gang(4, _join_and_sum) == [10.0] * 4


@pytest.mark.slow
def test_a_peer_that_never_comes_is_named_with_the_timeout():
    # 4 s: ranks 1 and 3 must have joined by then even on a loaded machine, so only rank 2 is named
    result = launch(4, lambda ctx: init_distributed(ctx.env, timeout_s=4.0), ranks=[0, 1, 3], timeout_s=30)
    named = [r for r in result.ranks if "rank(s) 2 of WORLD_SIZE=4 never joined" in r.error]
    assert named and all("timed out after 4 s" in r.error for r in named)
    assert all(r in named or "another rank failed" in r.error for r in result.ranks)  # the gang goes down


@pytest.mark.slow
def test_a_missing_rank_zero_is_named_by_the_others():
    result = launch(2, lambda ctx: init_distributed(ctx.env, timeout_s=1.5), ranks=[1], timeout_s=30)
    assert "rank 0 never came" in result.ranks[0].error and "1.5 s" in result.ranks[0].error


@pytest.mark.slow
def test_pre_exec_runs_in_each_child_before_the_target():
    entered: list[int] = []  # each forked child appends to its own copy

    def target(ctx: RankContext) -> tuple[list[int], int, int]:
        return entered, ctx.rank, os.getpid()

    result = launch(3, target, pre_exec=entered.append, timeout_s=30).raise_on_failure()
    assert [(seen, rank) for seen, rank, _ in result.values] == [([0], 0), ([1], 1), ([2], 2)]
    assert len({pid for *_, pid in result.values} | {os.getpid()}) == 4  # three children, none of them us
    assert entered == []


def test_ranks_inherit_the_parents_objects_frozen_and_the_parent_keeps_collecting_its_own():
    """A rank's cyclic collections skip what it inherits (gc.freeze before the fork): unfrozen, each full
    collection of a rank walked the parent's whole heap (200-300 ms with 8 ranks on 2 cores)."""
    import gc

    inherited = [[] for _ in range(1000)]  # tracked by the parent's collector before the fork

    def target(ctx: RankContext) -> tuple[int, bool]:
        return gc.get_freeze_count(), any(o is inherited for o in gc.get_objects())

    result = launch(2, target, timeout_s=30).raise_on_failure()
    for frozen, seen in result.values:
        assert frozen > len(inherited) and not seen  # frozen in the rank: its collections skip them
    assert gc.get_freeze_count() == 0 and any(o is inherited for o in gc.get_objects())


def test_a_free_port_for_the_rendezvous_is_below_the_ports_outgoing_connections_take():
    import socket

    from meshjob_trainer.launch import ephemeral_ports, free_port

    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1
    for port in ports:  # and free: bindable now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_one_failing_rank_takes_the_gang_down():
    def target(ctx: RankContext):
        if ctx.rank == 1:
            raise ValueError("rank one broke")
        time.sleep(60)

    result = launch(3, target, timeout_s=30, kill_grace_s=0.5)
    assert not result.timed_out  # taken down by rank 1's failure, not at the timeout
    by_rank = {r.rank: r for r in result.ranks}
    assert by_rank[1].exit_code == 1 and "rank one broke" in by_rank[1].error
    assert by_rank[0].exit_code < 0 and by_rank[2].exit_code < 0
    assert "another rank failed" in by_rank[0].error
    assert result.first_failure is by_rank[1] and result.first_failure.describe() == "rank 1 exited with status 1"


class _SlowToPickle:
    """A returned value whose pickling takes long enough for the gang to be stopped meanwhile."""

    def __reduce__(self):
        time.sleep(30)
        return (_SlowToPickle, ())


@pytest.mark.slow
def test_a_rank_killed_while_writing_its_report_is_reported_killed_not_a_torn_file():
    def target(ctx: RankContext):
        if ctx.rank == 1:
            time.sleep(1.0)  # rank 0 is inside its report by now
            raise ValueError("rank one broke")
        return _SlowToPickle()

    result = launch(2, target, timeout_s=30, kill_grace_s=0.5)
    by_rank = {r.rank: r for r in result.ranks}
    assert "rank one broke" in by_rank[1].error
    assert by_rank[0].exit_code < 0 and "another rank failed" in by_rank[0].error


@pytest.mark.slow
def test_a_gang_past_its_timeout_is_killed():
    result = launch(2, lambda ctx: time.sleep(60), timeout_s=0.5, kill_grace_s=0.5)
    assert result.timed_out and not result.ok
    assert all("timed out after 0.5 s" in r.error for r in result.ranks)


def waiting_for_a_peer_that_never_comes(ctx):
    time.sleep(60)


@pytest.mark.slow
def test_a_gang_that_times_out_reports_where_each_ranks_threads_were():
    result = launch(2, waiting_for_a_peer_that_never_comes, timeout_s=1, kill_grace_s=0.5)
    assert result.timed_out
    for r in result.ranks:
        assert "timed out after 1 s; its threads were at" in r.error
        assert "in waiting_for_a_peer_that_never_comes" in r.error


def test_a_rank_that_fails_reports_its_traceback_without_stacks():
    def broken(ctx):
        raise ValueError("bad input")

    result = launch(1, broken, timeout_s=20)
    assert "ValueError: bad input" in result.ranks[0].error and "threads were at" not in result.ranks[0].error


# -- meshjob worker ----------------------------------------------------------------------------


def worker_cli(monkeypatch, *argv: str, **env: str) -> int:
    from meshjob.cli import main

    for name in (
        "RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "MASTER_PORT",
        "MESHJOB_JOB",
        "MESHJOB_HOSTS",
        "MESHJOB_CHECKPOINT_DIR",
        "MESHJOB_PLAN",
        "MESHJOB_METRICS_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(name, "")  # restored after the test, whatever the worker sets
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return main(["worker", *argv])


def test_worker_refuses_a_world_size_other_than_the_plans(monkeypatch, capsys, one_host_job):
    assert worker_cli(monkeypatch, "--job", one_host_job(), RANK="0", WORLD_SIZE="3") == 1
    assert "WORLD_SIZE=3 but the plan of job 'onehost' needs 4 ranks" in capsys.readouterr().err


def test_worker_refuses_an_nproc_other_than_the_hosts_ranks(monkeypatch, capsys, one_host_job):
    assert worker_cli(monkeypatch, "--job", one_host_job(), "--nproc", "3") == 1
    assert "--nproc 3 is invalid: the plan puts 4 rank(s) [0, 1, 2, 3] on node rank 0" in capsys.readouterr().err


def test_worker_refuses_a_node_rank_beyond_the_jobs_hosts(monkeypatch, capsys, one_host_job):
    assert worker_cli(monkeypatch, "--job", one_host_job(), "--node-rank", "1") == 1
    assert "--node-rank 1 is invalid: the job uses 1 host(s), node ranks 0..0" in capsys.readouterr().err


def test_worker_reports_checkpoints_no_rank_can_resume_from_as_a_message_not_a_traceback(
    monkeypatch, capsys, one_host_job
):
    from meshjob_trainer import worker
    from meshjob_trainer.checkpoint import CheckpointCorrupt

    def corrupt(*args, **kwargs):
        raise CheckpointCorrupt("rank 0: no checkpoint step loads on every rank: step 4: rank-00001.pt is damaged")

    monkeypatch.setattr(worker, "run_worker", corrupt)
    assert worker_cli(monkeypatch, "--job", one_host_job(), RANK="0", WORLD_SIZE="4") == 1
    err = capsys.readouterr().err
    assert err.startswith("meshjob worker: rank 0: no checkpoint step loads on every rank") and "Traceback" not in err


def test_worker_reports_an_invalid_spec_field_and_exits_2(monkeypatch, capsys, one_host_job):
    assert worker_cli(monkeypatch, "--job", one_host_job(microbatches=3)) == 2
    assert "spec.training.microbatches: 3 is invalid" in capsys.readouterr().err


def test_worker_refuses_to_run_without_the_rendered_plan_it_was_told_of(monkeypatch, capsys, one_host_job, tmp_path):
    missing = tmp_path / "plan.json"
    assert worker_cli(monkeypatch, "--job", one_host_job(), "--nproc", "4", MESHJOB_PLAN=str(missing)) == 1
    assert f"the rendered plan {missing} cannot be read" in capsys.readouterr().err


def test_worker_refuses_a_plan_other_than_the_rendered_one_naming_both_digests(
    monkeypatch, capsys, one_host_job, tmp_path
):
    from meshjob.plan import rendered
    from meshjob.spec.manifest import load_job

    job = one_host_job()
    inputs = rendered.PlanInputs.of(load_job(job), nic_bytes_per_s=1e9 / 8)
    theirs = json.loads(
        rendered.render(dataclasses.replace(inputs, hosts=inputs.build().placement.hosts), inputs.build())[
            rendered.PLAN_FILE
        ]
    )
    theirs["nic_bytes_per_s"] = 1e8 / 8  # the operator planned for another NIC than the one recorded
    (tmp_path / "plan.json").write_text(json.dumps(theirs))
    assert worker_cli(monkeypatch, "--job", job, "--nproc", "4", MESHJOB_PLAN=str(tmp_path / "plan.json")) == 1
    err = capsys.readouterr().err
    assert theirs["digest"] in err and "differs from the one the operator rendered" in err
    assert "nic_bytes_per_s" in err


@pytest.mark.slow
def test_worker_with_nproc_trains_the_hosts_ranks_and_checkpoints(monkeypatch, capfd, one_host_job, tmp_path):
    job = one_host_job(steps=2, checkpoint={"every": 2, "path": str(tmp_path / "unused")})
    assert (
        worker_cli(
            monkeypatch, "--job", job, "--nproc", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--timeout", "30"
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "ck" / "step-00000002").iterdir()) == [
        f"rank-{r:05d}.{ext}" for r in range(4) for ext in ("done", "pt")
    ]
    # the pod's log: one line per step from the first rank of each of the 2 stages
    logged = sorted(line.split(":")[0] for line in capfd.readouterr().out.splitlines() if line.startswith("step "))
    assert logged == ["step 1/2 stage 0", "step 1/2 stage 1", "step 2/2 stage 0", "step 2/2 stage 1"]


# -- the pod's log: a line per step ------------------------------------------------------------


def test_the_step_log_has_step_of_total_loss_throughput_and_step_time():
    from meshjob_trainer.events import CheckpointWritten, Fanout, StepFinished
    from meshjob_trainer.metrics import TrainerMetrics
    from meshjob_trainer.steplog import StepLog

    lines: list[str] = []
    metrics = TrainerMetrics(job="j", rank=0, host="h", stage=1)
    events = Fanout((metrics, StepLog(150, write=lines.append)))
    events.emit(StepFinished(stage=1, step=12, seconds=0.25, tokens=2048, loss=2.34567))
    events.emit(CheckpointWritten(stage=1, step=12, seconds=0.1))  # no line
    events.emit(StepFinished(stage=0, step=13, seconds=0.5, tokens=2048, loss=float("nan")))
    assert lines == [
        "step 12/150 stage 1: loss 2.3457, 8192 tokens/s, 0.250 s/step",
        "step 13/150 stage 0: loss -, 4096 tokens/s, 0.500 s/step",
    ]
    assert (
        metrics.registry.get_sample_value("meshjob_step", {"trainingjob": "j", "namespace": "default", "stage": "1"})
        == 12
    )


def test_the_step_log_has_a_line_per_evaluation_from_the_stage_that_holds_the_loss():
    from meshjob_trainer.events import Evaluated
    from meshjob_trainer.steplog import StepLog

    lines: list[str] = []
    log = StepLog(150, write=lines.append)
    log.emit(Evaluated(stage=0, step=50, loss=float("nan")))  # not the last stage: no line
    log.emit(Evaluated(stage=3, step=50, loss=2.64483))
    assert lines == ["step 50/150 stage 3: validation loss 2.6448"]


def test_meshjob_worker_logs_steps_and_meshjob_run_does_not():
    assert WorkerSettings.from_env({}).step_log and not WorkerSettings().step_log


def test_a_hosts_summary_is_the_step_its_ranks_reached_and_the_last_stages_loss():
    from meshjob_trainer.worker import RankSummary, host_summary

    last_stage = [RankSummary(rank=6, stage=3, step=150, loss=2.47), RankSummary(rank=7, stage=3, step=150, loss=2.47)]
    assert host_summary(last_stage) == {"step": 150, "loss": 2.47}
    first_stage = [RankSummary(rank=0, stage=0, step=150, loss=None), RankSummary(rank=1, stage=0, step=150, loss=None)]
    assert host_summary(first_stage) == {"step": 150}  # no loss on a host without the last stage
