"""Checkpoints: atomic per-rank files, completeness, resume from the newest step every rank can
load (or a clear error, never a silent fresh start), refusal of a checkpoint written for another
spec, pruning that leaves `keep` steps of every rank on disk."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from meshjob.spec.manifest import load_job
from meshjob_trainer.checkpoint import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointMismatch,
    atomic_write,
    spec_fingerprint,
    survey,
)
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


def test_a_zero_1_checkpoint_is_refused_by_a_run_without_zero_naming_the_field(tmp_path):
    """ZeRO-1 saves each rank's shard of the optimizer state: a run that holds it whole cannot load it."""
    job = load_job(str(EXAMPLE))
    training = dataclasses.replace(job.training, optimizer=dataclasses.replace(job.training.optimizer, zero_stage=1))
    sharded = dataclasses.replace(job, training=training)
    module, opt = model_and_optimizer(1)
    Checkpointer(tmp_path, 0, 1, spec_fingerprint(sharded, 1)).save(3, module, opt)
    with pytest.raises(
        CheckpointMismatch,
        match=r"spec.training.optimizer.zeroStage: 1 in the checkpoint, "
        r"'\(absent\)' now",
    ):
        Checkpointer(tmp_path, 0, 1, spec_fingerprint(job, 1)).restore(module, opt)
    assert "spec.training.optimizer.zeroStage" not in spec_fingerprint(job, 1)  # older checkpoints still load


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
    return launch(
        setup.plan.placement.world_size,
        lambda ctx: run_worker(ctx.env, settings, setup, 30, listeners(ctx.rank)),
        timeout_s=50,
        **launch_args,
    )


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


# --- pruning ---------------------------------------------------------------------------------


def bytes_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_pruning_leaves_keep_steps_of_every_rank_on_disk_after_200_steps(tmp_path):
    """4 ranks, 200 steps, a checkpoint every 5, keep 3: what stays on disk is exactly the 3 newest
    steps' files of every rank, however the ranks interleave (each prunes once all have written)."""
    module, opt = model_and_optimizer(1)
    ranks = [dataclasses.replace(checkpointer(tmp_path, r, 4), keep=3) for r in range(4)]
    step_bytes: dict[int, int] = {}
    for step in range(5, 201, 5):
        first = step // 5 % 4
        order = ranks[first:] + ranks[:first]  # a different rank writes and prunes first each time
        for ck in order:
            ck.write(step, module, opt)
        step_bytes[step] = bytes_on_disk(ranks[0].step_dir(step))
        for ck in order:
            ck.prune()
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000190", "step-00000195", "step-00000200"]
    assert bytes_on_disk(root) == step_bytes[190] + step_bytes[195] + step_bytes[200]


def test_pruning_removes_an_old_step_a_crash_left_incomplete(tmp_path):
    module, opt = model_and_optimizer(1)
    rank0, rank1 = (dataclasses.replace(checkpointer(tmp_path, r, 2), keep=1) for r in (0, 1))
    rank0.write(2, module, opt)  # rank 1 died before writing step 2
    for step in (4, 6):
        for ck in (rank0, rank1):
            ck.write(step, module, opt)
        for ck in (rank0, rank1):
            ck.prune()
    assert rank0.steps() == [6]


@pytest.mark.slow
def test_pruning_in_a_gang_leaves_keep_steps_of_every_rank_on_disk(gang, tmp_path):
    """The real thing: 2 ranks with a process group save 200 steps' checkpoints every 5, keep 2."""

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            module, opt = model_and_optimizer(env.rank)
            ck = dataclasses.replace(checkpointer(tmp_path, env.rank, 2), keep=2)
            for step in range(5, 201, 5):
                ck.save(step, module, opt)
        finally:
            shutdown_distributed()

    gang(2, target)  # (while it runs, a step's folder goes when the last rank has pruned it)
    ck = checkpointer(tmp_path, 0, 2)
    assert ck.steps() == [200, 195]
    files = sorted(p.name for p in ck.step_dir(200).iterdir())
    assert files == ["rank-00000.done", "rank-00000.pt", "rank-00001.done", "rank-00001.pt"]
    assert bytes_on_disk(tmp_path / "ckpt") == bytes_on_disk(ck.step_dir(200)) + bytes_on_disk(ck.step_dir(195))


# --- corruption: every case resumes from the right step or fails clearly, and says which ---------


def saved_steps(tmp_path: Path, steps=(2, 4), world_size: int = 1) -> list[Checkpointer]:
    """Every rank's checkpoints of `steps`, each step with different weights."""
    ranks = [checkpointer(tmp_path, r, world_size) for r in range(world_size)]
    for step in steps:
        module, opt = model_and_optimizer(step)
        for ck in ranks:
            ck.write(step, module, opt)
    return ranks


def flip_a_payload_byte(path: Path) -> None:
    """Bit rot: same size, one byte of the tensors' bytes changed."""
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_marker_hash(ck: Checkpointer, step: int) -> None:
    """What a careless `fix` does: recompute the marker's size and hash over the file as it is now."""
    marker = json.loads(ck.marker_path(step).read_text())
    data = ck.data_path(step).read_bytes()
    marker.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    ck.marker_path(step).write_text(json.dumps(marker))


def test_a_damaged_newest_file_resumes_from_the_step_before_saying_why(tmp_path):
    (ck,) = saved_steps(tmp_path)
    flip_a_payload_byte(ck.data_path(4))
    assert "rank-00000.pt does not match the sha256 in its marker" in ck.problem(4)
    module, opt = model_and_optimizer(9)
    assert ck.restore(module, opt) == 2
    assert torch.equal(module.weight, model_and_optimizer(2)[0].weight)


def test_an_unparseable_marker_is_corruption_not_a_different_spec(tmp_path):
    (ck,) = saved_steps(tmp_path)
    ck.marker_path(4).write_text('{"step": 4, "rank": 0, "fingerp')
    assert ck.problem(4) == "rank-00000.done is unreadable (JSONDecodeError): the marker is corrupted"
    assert ck.restore(*model_and_optimizer(9)) == 2  # no CheckpointMismatch


def test_a_marker_whose_hash_was_recomputed_over_a_damaged_file_does_not_load(tmp_path):
    (ck,) = saved_steps(tmp_path)
    flip_a_payload_byte(ck.data_path(4))
    rewrite_marker_hash(ck, 4)
    assert "its payload does not match the sha256 it was written with" in ck.problem(4)
    assert ck.restore(*model_and_optimizer(9)) == 2


def test_a_file_copied_into_another_steps_place_does_not_load(tmp_path):
    (ck,) = saved_steps(tmp_path)
    ck.data_path(4).write_bytes(ck.data_path(2).read_bytes())
    rewrite_marker_hash(ck, 4)
    assert "rank-00000.pt was written as step 2, rank 0 of 1, not step 4, rank 0 of 1" in ck.problem(4)
    assert ck.restore(*model_and_optimizer(9)) == 2


def test_a_file_without_the_checkpoint_header_does_not_load(tmp_path):
    (ck,) = saved_steps(tmp_path)
    ck.data_path(4).write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a bare torch.save zip, say
    rewrite_marker_hash(ck, 4)
    assert "has no meshjob-checkpoint header" in ck.problem(4)


def test_checkpoints_none_of_which_load_are_a_clear_error_not_a_fresh_start(tmp_path):
    (ck,) = saved_steps(tmp_path)
    for step in (2, 4):
        flip_a_payload_byte(ck.data_path(step))
    with pytest.raises(CheckpointCorrupt) as err:
        ck.restore(*model_and_optimizer(9))
    message = str(err.value)
    assert "no checkpoint in" in message and "does not start again from step 0" in message
    assert "step 4: rank-00000.pt does not match the sha256 in its marker" in message
    assert "step 2: rank-00000.pt does not match" in message


def test_survey_finds_the_step_every_rank_can_load_and_why_newer_ones_cannot(tmp_path):
    ranks = saved_steps(tmp_path, steps=(2, 4, 6), world_size=2)
    flip_a_payload_byte(ranks[1].data_path(6))
    ranks[0].marker_path(4).write_text("")
    found = survey(tmp_path / "ckpt", 2)
    assert found.resume_step == 2 and not found.corrupt
    assert found.skipped == (
        "step 6: rank-00001.pt does not match the sha256 in its marker (damaged after writing)",
        "step 4: rank-00000.done is unreadable (JSONDecodeError): the marker is corrupted",
    )


def test_survey_of_checkpoints_no_step_of_which_loads_everywhere_is_corrupt(tmp_path):
    ranks = saved_steps(tmp_path, world_size=2)
    for step in (2, 4):
        flip_a_payload_byte(ranks[1].data_path(step))
    found = survey(tmp_path / "ckpt", 2)
    assert found.corrupt and found.resume_step is None and len(found.skipped) == 2


def test_no_complete_checkpoint_is_a_fresh_start(tmp_path):
    rank0, _ = saved_steps(tmp_path, steps=(), world_size=2)
    rank0.write(2, *model_and_optimizer(1))  # rank 1 never wrote one
    assert rank0.restore(*model_and_optimizer(9)) is None
    assert not survey(tmp_path / "ckpt", 2).corrupt


@pytest.mark.slow
def test_one_ranks_files_damaged_in_every_step_fail_every_rank_clearly(tmp_path):
    """Rank 1 cannot load any step; rank 0 could load them all: neither starts again from step 0."""
    from meshjob_trainer.launch import launch

    ranks = saved_steps(tmp_path, world_size=2)
    for step in (2, 4):
        flip_a_payload_byte(ranks[1].data_path(step))

    def target(ctx):
        init_distributed(ctx.env, timeout_s=20)
        try:
            return checkpointer(tmp_path, ctx.env.rank, 2).restore(*model_and_optimizer(9))
        finally:
            shutdown_distributed()

    result = launch(2, target, timeout_s=45)
    assert not result.ok and result.first_failure is not None
    assert all(r.value is None for r in result.ranks)  # no rank resumed, nor started from step 0
    error = result.first_failure.error  # the launcher stops the other rank once one has failed
    assert "CheckpointCorrupt: no checkpoint in" in error
    assert {
        0: "step 4: rank 0 can load it; another rank cannot",
        1: "step 4: rank-00001.pt does not match the sha256 in its marker",
    }[result.first_failure.rank] in error
