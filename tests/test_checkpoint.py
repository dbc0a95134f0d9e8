"""Checkpoints: atomic per-rank files, completeness, resume from the newest loadable step,
refusal of a checkpoint written for another spec."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from meshjob.spec import load_job
from meshjob_trainer.checkpoint import Checkpointer, CheckpointMismatch, atomic_write, spec_fingerprint
from meshjob_trainer.dist import WorkerSettings, init_distributed, shutdown_distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny.yaml"


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def checkpointer(tmp_path: Path, rank: int = 0, world_size: int = 1, fingerprint=None) -> Checkpointer:
    return Checkpointer(tmp_path / "ckpt", rank, world_size, fingerprint or {"spec.model.hidden": 32})


def test_restore_returns_the_saved_weights_optimizer_state_step_and_rng(tmp_path):
    saved_module, saved_opt = model_and_optimizer(1)
    ck = checkpointer(tmp_path)
    ck.save(5, saved_module, saved_opt)
    draw_after_save = torch.rand(3)
    module, opt = model_and_optimizer(2)
    assert ck.restore(module, opt) == 5
    assert torch.equal(module.weight, saved_module.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), draw_after_save)  # the RNG continues where it was saved


def test_nothing_to_restore_starts_fresh(tmp_path):
    module, opt = model_and_optimizer(1)
    assert checkpointer(tmp_path).restore(module, opt) is None


def test_a_step_missing_one_ranks_marker_is_incomplete_and_skipped(tmp_path):
    module, opt = model_and_optimizer(1)
    rank0, rank1 = checkpointer(tmp_path, 0, 2), checkpointer(tmp_path, 1, 2)
    for step in (2, 4):
        rank0.save(step, module, opt)
    rank1.save(2, module, opt)  # rank 1 died before writing step 4
    assert not rank0.is_complete(4)
    assert rank0.newest_loadable() == 2


def test_a_torn_data_file_is_ignored_in_favour_of_an_older_step(tmp_path):
    module, opt = model_and_optimizer(1)
    ck = checkpointer(tmp_path)
    ck.save(2, module, opt)
    ck.save(4, module, opt)
    data = ck.data_path(4).read_bytes()
    ck.data_path(4).write_bytes(data[: len(data) // 2])  # torn: half written
    assert ck.newest_loadable() == 2
    assert ck.restore(*model_and_optimizer(3)) == 2


def test_atomic_write_leaves_no_file_under_the_final_name_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "rank-00000.pt"

    def crash(*_args):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"x" * 1000)
    assert list(tmp_path.iterdir()) == []  # neither the final file nor the temp file remains


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    module, opt = model_and_optimizer(1)
    ck = dataclasses.replace(checkpointer(tmp_path), keep=2)
    for step in (1, 2, 3, 4):
        ck.save(step, module, opt)
    assert ck.steps() == [4, 3]


def test_a_checkpoint_for_a_different_spec_is_refused_naming_every_difference(tmp_path):
    job = load_job(str(EXAMPLE))
    wider = dataclasses.replace(job, model=dataclasses.replace(job.model, hidden=64))
    restaged = dataclasses.replace(wider, stages=(dataclasses.replace(job.stages[0], mesh=(2, 1)),) + job.stages[1:])
    module, opt = model_and_optimizer(1)
    Checkpointer(tmp_path, 0, 1, spec_fingerprint(job, 1)).save(3, module, opt)
    with pytest.raises(CheckpointMismatch) as err:
        Checkpointer(tmp_path, 0, 1, spec_fingerprint(restaged, 1)).restore(module, opt)
    message = str(err.value)
    assert "spec.model.hidden: 32 in the checkpoint, 64 now" in message
    assert "spec.stages[0].mesh: [1, 2] in the checkpoint, [2, 1] now" in message
    assert "step-00000003" in message


def test_a_different_world_size_is_part_of_the_fingerprint(tmp_path):
    job = load_job(str(EXAMPLE))
    assert spec_fingerprint(job, 4) != spec_fingerprint(job, 8)


@pytest.mark.slow
def test_ranks_agree_on_the_newest_step_every_rank_can_load(gang, tmp_path):
    """Rank 1's file of step 4 is torn: both ranks must resume from step 2, not rank 0 from 4."""
    module, opt = model_and_optimizer(1)
    for rank in (0, 1):
        ck = checkpointer(tmp_path, rank, 2)
        ck.save(2, module, opt)
        ck.save(4, module, opt)
    torn = checkpointer(tmp_path, 1, 2).data_path(4)
    torn.write_bytes(torn.read_bytes()[:100])

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            return checkpointer(tmp_path, env.rank, 2).restore(*model_and_optimizer(5))
        finally:
            shutdown_distributed()

    assert gang(2, target) == [2, 2]


def train_job(job_path: str, listeners=lambda rank: (), **launch_args):
    """Every rank of the job on this machine, as `meshjob worker --nproc` starts them; each returns its
    TrainResult. listeners(rank): more listeners of that rank's events."""
    from meshjob_trainer.launch import launch
    from meshjob_trainer.worker import load_setup, run_worker

    settings = WorkerSettings(job_path=job_path)
    setup = load_setup(settings)
    return launch(setup.plan.placement.world_size,
                  lambda ctx: run_worker(ctx.env, settings, setup, 30, listeners(ctx.rank)), timeout_s=50,
                  **launch_args)


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(one_host_job, tmp_path):
    """4 steps with checkpoints, then a fresh gang asked for 6 resumes at 4: same final weights
    and losses as 6 steps in one go."""
    def run(job_path: str):
        return train_job(job_path).raise_on_failure().values

    straight = run(one_host_job("straight", steps=6))
    ckpt = str(tmp_path / "ckpt")
    first = run(one_host_job("first", steps=4, checkpoint={"every": 2, "path": ckpt}))
    resumed = run(one_host_job("resumed", steps=6, checkpoint={"every": 2, "path": ckpt}))
    assert [r.start_step for r in first] == [0] * 4 and [r.start_step for r in resumed] == [4] * 4
    last = [r.rank for r in straight if r.losses]
    assert all(first[r].losses + resumed[r].losses == straight[r].losses for r in last)
    for a, b in zip(straight, resumed):
        assert a.params.keys() == b.params.keys()
        assert all(torch.equal(a.params[k][0], b.params[k][0]) for k in a.params)


@pytest.mark.slow
def test_after_kill_9_of_one_rank_the_restarted_gang_ends_with_uninterrupted_weights(one_host_job, tmp_path):
    import os
    import signal

    from meshjob_trainer.events import StepFinished

    ckpt = str(tmp_path / "ckpt")
    job = one_host_job("job", steps=6, checkpoint={"every": 2, "path": ckpt})
    straight = train_job(one_host_job("straight", steps=6)).raise_on_failure().values

    class DiesAfterStep3:  # a listener: kill -9 its rank once step 3 is done (checkpoint 2 is complete, 4 never comes)
        def emit(self, event) -> None:
            if isinstance(event, StepFinished) and event.step == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    crashed = train_job(job, listeners=lambda rank: (DiesAfterStep3(),) if rank == 1 else (), kill_grace_s=0.5)
    assert {r.rank: r.exit_code for r in crashed.ranks}[1] == -signal.SIGKILL
    resumed = train_job(job).raise_on_failure().values
    assert [r.start_step for r in resumed] == [2] * 4
    for a, b in zip(straight, resumed):
        assert all(torch.equal(a.params[k][0], b.params[k][0]) for k in a.params)
