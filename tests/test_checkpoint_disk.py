"""Checkpoints on a file system that refuses them: a full disk is one CheckpointError line naming the
folder, the step and the OS's reason; a file with a step folder's name is skipped and moved aside."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from meshjob_trainer.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointError, survey


def model_and_optimizer(size: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Linear(size, size)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(2, size)).sum().backward()
    optimizer.step()
    return module, optimizer


def checkpointer(directory: Path, rank: int = 0, world_size: int = 1) -> Checkpointer:
    return Checkpointer(directory, rank, world_size, {"spec.model.hidden": 32})


class _FullDisk:
    """A file whose writes fail as on a full disk (what the kernel says to write(2): ENOSPC)."""

    def __init__(self, f):
        self._f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def full_disk(monkeypatch) -> None:
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **kw: _FullDisk(real_fdopen(*a, **kw)))


def test_a_full_disk_is_one_line_naming_the_folder_the_step_and_the_os_error(tmp_path, full_disk):
    ck = checkpointer(tmp_path / "ckpt", rank=2, world_size=4)
    with pytest.raises(CheckpointError) as info:
        ck.write(7, *model_and_optimizer())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot write the checkpoint of step 7 in {tmp_path / 'ckpt'} (rank 2): ")
    assert "No space left on device [ENOSPC]" in message and "free space there" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    # nothing half-written is left: no temp file, no marker, so the step is not complete
    assert list(ck.step_dir(7).iterdir()) == [] and ck.complete_steps() == []


def test_a_failed_save_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    ck = checkpointer(tmp_path / "ckpt")
    module, opt = model_and_optimizer()
    ck.save(2, module, opt)
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **kw: _FullDisk(real_fdopen(*a, **kw)))
    with pytest.raises(CheckpointError, match="step 4 .*No space left on device"):
        ck.save(4, module, opt)
    monkeypatch.undo()
    assert ck.restore(*model_and_optimizer()) == 2


def test_any_os_error_is_a_checkpoint_error_saying_what_to_do(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    ck = checkpointer(blocker / "ckpt")  # its parent is a file: mkdir fails with ENOTDIR
    with pytest.raises(CheckpointError) as info:
        ck.write(1, *model_and_optimizer())
    assert "step 1" in str(info.value) and "[ENOTDIR]" in str(info.value) and "make it writable" in str(info.value)


def test_corrupt_checkpoints_are_checkpoint_errors_too():
    assert issubclass(CheckpointCorrupt, CheckpointError)


def test_a_forked_ranks_failure_is_the_one_line(tmp_path, capfd):
    """A rank reports a failed save as its one line (no traceback); `meshjob worker` quotes its last line."""
    from meshjob_trainer.launch import launch

    def target(ctx):
        real_fdopen = os.fdopen
        os.fdopen = lambda *a, **kw: _FullDisk(real_fdopen(*a, **kw))  # in the forked child only
        checkpointer(tmp_path / "ckpt", ctx.rank, 1).save(3, *model_and_optimizer())

    result = launch(1, target, timeout_s=30)
    (failure,) = result.failures()
    (last,) = failure.error.strip().splitlines()
    assert last.startswith("CheckpointError: cannot write the checkpoint of step 3")
    assert str(tmp_path / "ckpt") in last and "No space left on device" in last
    assert "Traceback" not in capfd.readouterr().err


# ---------------------------------------------------------------------------- a file named like a step
def test_a_file_named_like_a_step_folder_is_not_a_checkpoint(tmp_path):
    ck = checkpointer(tmp_path / "ckpt")
    module, opt = model_and_optimizer()
    ck.save(2, module, opt)
    (ck.directory / "step-00000009").write_text("not a checkpoint")
    assert ck.steps() == [2] and ck.complete_steps() == [2]
    assert ck.restore(*model_and_optimizer()) == 2
    found = survey(ck.directory, 1)
    assert found.resume_step == 2 and not found.skipped


def test_saving_the_step_a_stray_file_is_named_after_moves_it_aside_saying_so(tmp_path, capsys):
    ck = checkpointer(tmp_path / "ckpt")
    ck.directory.mkdir()
    stray = ck.directory / "step-00000004"
    stray.write_text("someone's notes")
    module, opt = model_and_optimizer()
    ck.save(4, module, opt)
    aside = ck.directory / "step-00000004.not-a-checkpoint"
    assert aside.read_text() == "someone's notes"  # kept, not removed
    assert f"{stray} is a file, not a step folder: moved to {aside}" in capsys.readouterr().err
    assert ck.complete_steps() == [4] and ck.restore(*model_and_optimizer()) == 4


def test_pruning_passes_over_a_stray_file_named_like_an_old_step(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", 0, 1, {}, keep=1)
    ck.directory.mkdir()
    (ck.directory / "step-00000000").write_text("")
    module, opt = model_and_optimizer()
    for step in (1, 2, 3):
        ck.save(step, module, opt)
    assert ck.steps() == [3] and (ck.directory / "step-00000000").is_file()


def test_two_ranks_moving_the_same_stray_file_leave_one_folder_with_both_files(tmp_path):
    """The second rank to reach the file finds a folder there already; it must not move that aside."""
    ranks = [checkpointer(tmp_path / "ckpt", r, 2) for r in (0, 1)]
    ranks[0].directory.mkdir()
    (ranks[0].directory / "step-00000005").write_text("")
    module, opt = model_and_optimizer()
    for ck in ranks:
        ck.write(5, module, opt)
    assert ranks[0].complete_steps() == [5]
    ranks[1]._make_step_dir(5)  # a late rank: the folder stays where it is
    assert ranks[0].complete_steps() == [5]


# ---------------------------------------------------------------------------- a real full disk (root only)
@pytest.fixture
def tiny_tmpfs(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs, unmounted afterwards whatever happens; skipped unless this process may mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_real_full_disk_is_one_clear_error(tiny_tmpfs):
    ck = checkpointer(tiny_tmpfs / "ckpt")
    module, opt = model_and_optimizer(size=128)  # weights and Adam state: about 200 KB, over 64 KiB
    with pytest.raises(CheckpointError) as info:
        ck.save(10, module, opt)
    message = str(info.value)
    assert f"step 10 in {tiny_tmpfs / 'ckpt'}" in message and "No space left on device [ENOSPC]" in message
    assert ck.complete_steps() == [] and not list(ck.step_dir(10).glob(".*.tmp"))
