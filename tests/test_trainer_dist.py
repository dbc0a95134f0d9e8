"""Worker environment, process-group formation and the local gang launcher, with real processes."""
from __future__ import annotations

import os
import time

import pytest

from meshjob.trainer.dist import DistError, WorkerEnv, check_world_size, init_distributed, shutdown_distributed
from meshjob.trainer.launch import launch_local


def test_worker_env_reads_torchrun_variables():
    env = WorkerEnv.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1",
                              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "MESHJOB_JOB": "/j.yaml"})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 8, 1, 1)
    assert (env.master_addr, env.master_port, env.job_path) == ("10.0.0.1", 1234, "/j.yaml")


def test_worker_env_reads_kubeflow_pet_variables():
    env = WorkerEnv.from_env({"PET_RANK": "1", "PET_WORLD_SIZE": "2", "PET_MASTER_ADDR": "job-master-0",
                              "PET_MASTER_PORT": "23456", "PET_NODE_RANK": "1"})
    assert (env.rank, env.world_size, env.node_rank, env.master_addr, env.master_port) == \
        (1, 2, 1, "job-master-0", 23456)


def test_worker_env_round_trips_through_to_env():
    env = WorkerEnv(rank=2, world_size=4, local_rank=0, node_rank=1, master_port=4000, checkpoint_dir="/c")
    assert WorkerEnv.from_env(env.to_env()) == env


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


@pytest.mark.slow
def test_ranks_form_a_gloo_group_and_all_reduce(gang):
    assert gang(4, _join_and_sum) == [10.0] * 4


@pytest.mark.slow
def test_a_peer_that_never_comes_is_named_with_the_timeout():
    result = launch_local(4, lambda env: init_distributed(env, timeout_s=1.5), ranks=[0, 1, 3], timeout_s=30)
    named = [r for r in result.ranks if "rank(s) 2 of WORLD_SIZE=4 never joined" in r.error]
    assert named and all("timed out after 1.5 s" in r.error for r in named)
    assert all(r in named or "another rank failed" in r.error for r in result.ranks)  # the gang goes down


@pytest.mark.slow
def test_a_missing_rank_zero_is_named_by_the_others():
    result = launch_local(2, lambda env: init_distributed(env, timeout_s=1.5), ranks=[1], timeout_s=30)
    assert "rank 0 never came" in result.ranks[0].error and "1.5 s" in result.ranks[0].error


@pytest.mark.slow
def test_pre_exec_runs_in_each_child_before_the_target():
    def pre_exec(rank: int) -> None:
        os.environ["PRE_EXEC_SAW"] = f"{rank}:{os.environ['RANK']}"

    result = launch_local(3, lambda env: os.environ["PRE_EXEC_SAW"], pre_exec=pre_exec, timeout_s=30)
    assert result.raise_on_failure().values == ["0:0", "1:1", "2:2"]


@pytest.mark.slow
def test_one_failing_rank_takes_the_gang_down():
    def target(env: WorkerEnv):
        if env.rank == 1:
            raise ValueError("rank one broke")
        time.sleep(60)

    started = time.monotonic()
    result = launch_local(3, target, timeout_s=30, kill_grace_s=0.5)
    assert time.monotonic() - started < 10
    by_rank = {r.rank: r for r in result.ranks}
    assert by_rank[1].exit_code == 1 and "rank one broke" in by_rank[1].error
    assert by_rank[0].exit_code < 0 and by_rank[2].exit_code < 0
    assert "another rank failed" in by_rank[0].error


@pytest.mark.slow
def test_a_gang_past_its_timeout_is_killed():
    result = launch_local(2, lambda env: time.sleep(60), timeout_s=0.5, kill_grace_s=0.5)
    assert result.timed_out and not result.ok
    assert all("timed out after 0.5 s" in r.error for r in result.ranks)
