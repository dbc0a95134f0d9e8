"""Checkpoints: each rank writes its own shards; the ranks resume together from the newest step
every one of them can load, and say which step that is.

Layout: <dir>/step-00000010/rank-00003.pt (model shards, optimizer state, step, data position,
RNG state) and, written after it, rank-00003.done (the marker, JSON: step, rank, size and sha256
of the .pt file, spec fingerprint). Both are written atomically (temp file + fsync + rename +
fsync of the directory), so a file with its final name is whole. A step is complete when every
rank's marker exists.

The .pt file carries its own identity and checksum: a header line
`meshjob-checkpoint 1 step=10 rank=3 world=4 bytes=N sha256=H` (H of the torch.save payload
after it), then the payload. Loading reads the file once, checks it against its marker and its
header, and unpickles exactly the bytes it checked.

Integrity: what is caught, and what is not (the threat model).
- Caught: a torn or truncated file; bytes flipped or lost after writing (bit rot, a partial copy);
  a marker that is missing, unreadable or not JSON (corruption, never "a different spec"); a marker
  whose hash was recomputed over a damaged file (the header's hash of the payload still fails); a
  file copied into another step's or rank's place (the header names its step, rank and world
  size); a checkpoint written for another spec (the marker's fingerprint, CheckpointMismatch).
- Not caught: someone with write access to the volume who writes a whole consistent checkpoint
  (payload, header and marker). A hash without a secret cannot tell them from the trainer. They
  can change weights and the step; they cannot run code in the trainer, because files are
  unpickled with torch.load(weights_only=True) (tensors and plain containers only). Guard the
  checkpoint volume as you guard the image.

Resume: every rank finds the newest complete step whose own file loads, the ranks agree (an
all-reduce) on the newest step all of them can load, and resume there. Complete checkpoints of
which no step loads on every rank are an error (CheckpointCorrupt), never a silent start from
step 0. Pruning: after every rank has written a step (a collective), each rank removes its own
files of every step older than the `keep` newest complete ones, complete or not, so no rank's
pruning can stop another's.

Failures: a save the file system refuses (a full disk, ENOSPC; a read-only volume) is one CheckpointError
line naming the folder, the step and the OS's reason, which `meshjob worker` quotes as the rank's failure.
A file (not a folder) with a step folder's name is no checkpoint: listing skips it, and the save of that
step moves it aside to <name>.not-a-checkpoint, saying so.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from meshjob.spec.manifest import ModelSpec, TrainingJob
from meshjob_trainer.errors import TrainerError

STEP_DIR = re.compile(r"^step-(\d{8})$")
MAGIC = "meshjob-checkpoint"
FORMAT = 1
MAX_HEADER_BYTES = 512
HEADER = re.compile(rb"^meshjob-checkpoint (\d+) step=(\d+) rank=(\d+) world=(\d+) bytes=(\d+) sha256=([0-9a-f]{64})$")


class CheckpointMismatch(ValueError):
    """A checkpoint written for a different spec; the message lists every differing field."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be written or resumed from; the message says where and why, for a person."""


class CheckpointCorrupt(CheckpointError):
    """Complete checkpoints exist, but no step can be loaded by every rank; the message says why."""


class Unloadable(Exception):
    """Why one rank's file of one step cannot be loaded (a sentence naming the file)."""


class Stateful(Protocol):
    """What a checkpoint holds the state of: the stage's module, its optimizer."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def spec_fingerprint(job: TrainingJob, world_size: int) -> dict[str, Any]:
    """The spec fields that shape this job's tensors and their placement on ranks."""
    m = job.model
    fp: dict[str, Any] = {
        "spec.model.kind": m.kind,
        "spec.model.layers": m.layers,
        "spec.model.hidden": m.hidden,
        "spec.model.heads": m.heads,
        "spec.model.vocab": m.vocab,
        "spec.model.seqLen": m.seq_len,
        "spec.stages": len(job.stages),
        "worldSize": world_size,
        **_model_shape_fields(m),
        **optimizer_layout_fields(job),
    }
    for i, st in enumerate(job.stages):
        fp[f"spec.stages[{i}].layers"] = list(st.layers)
        fp[f"spec.stages[{i}].mesh"] = list(st.mesh)
        # by what they mean, not how they are written: dataParallelDim d is dataParallelDims [d], and a job with
        # at most one data-parallel dim keeps the fingerprint its checkpoints were written with
        dp = st.dp_dims
        fp[f"spec.stages[{i}].dataParallelDim"] = dp[0] if len(dp) == 1 else None
        if len(dp) > 1:
            fp[f"spec.stages[{i}].dataParallelDims"] = list(dp)
        fp[f"spec.stages[{i}].tensorParallelDim"] = st.tensor_parallel_dim
    return fp


def _model_shape_fields(m: ModelSpec) -> dict[str, Any]:
    """Model fields beyond the original six that shape tensors, only where they differ from their
    defaults, so the checkpoints of jobs that leave them unset keep their fingerprint."""
    fields = {
        "spec.model.kvHeads": (m.kv_heads, None),
        "spec.model.ffnHidden": (m.ffn_hidden, None),
        "spec.model.tieEmbeddings": (m.tie_embeddings, True),
        "spec.model.entrypoint": (m.entrypoint, ""),
    }
    return {key: value for key, (value, default) in fields.items() if value != default}


def optimizer_layout_fields(job: TrainingJob) -> dict[str, Any]:
    """How optimizer state is split over ranks: ZeRO-1 shards it over each stage's data-parallel ranks
    (a checkpoint written one way cannot be read the other way). Absent for the default (zeroStage 0)."""
    stage = job.training.optimizer.zero_stage
    return {"spec.training.optimizer.zeroStage": stage} if stage else {}


def fingerprint_diff(written: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(written) | set(current))
    return [
        f"{k}: {written.get(k, '(absent)')!r} in the checkpoint, {current.get(k, '(absent)')!r} now"
        for k in keys
        if written.get(k) != current.get(k)
    ]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Whole or not at all under `path`: a crash leaves at most a hidden temp file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


# ---------------------------------------------------------------------------- the file format
@dataclass(frozen=True)
class Identity:
    """Whose file this is: a file is only ever loaded in the place it was written for."""

    step: int
    rank: int
    world_size: int


def encode(identity: Identity, payload: bytes) -> bytes:
    """The .pt file: a header naming the file's identity and its payload's size and hash, then the payload."""
    header = (
        f"{MAGIC} {FORMAT} step={identity.step} rank={identity.rank} world={identity.world_size} "
        f"bytes={len(payload)} sha256={hashlib.sha256(payload).hexdigest()}\n"
    )
    return header.encode() + payload


def decode(data: bytes, expected: Identity, name: str) -> bytes:
    """The payload of a .pt file, after checking its header, identity, size and hash; raises Unloadable."""
    end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    match = HEADER.match(data[:end]) if end >= 0 else None
    if match is None:
        raise Unloadable(f"{name} has no {MAGIC} header (not written by this trainer, or damaged at its start)")
    version, step, rank, world, size, digest = match.groups()
    if int(version) != FORMAT:
        raise Unloadable(f"{name} is in checkpoint format {int(version)}; this trainer reads format {FORMAT}")
    found = Identity(int(step), int(rank), int(world))
    if found != expected:
        raise Unloadable(
            f"{name} was written as step {found.step}, rank {found.rank} of {found.world_size}, "
            f"not step {expected.step}, rank {expected.rank} of {expected.world_size} (moved or copied)"
        )
    payload = data[end + 1 :]
    if len(payload) != int(size):
        raise Unloadable(f"{name} holds {len(payload)} payload bytes, its header says {int(size)} (truncated)")
    if hashlib.sha256(payload).hexdigest() != digest.decode():
        raise Unloadable(f"{name}: its payload does not match the sha256 it was written with (damaged after writing)")
    return payload


# ---------------------------------------------------------------------------- one rank's checkpoints
@dataclass
class Checkpointer:
    directory: Path
    rank: int
    world_size: int
    fingerprint: dict[str, Any]
    keep: int = 3  # complete checkpoints kept; every rank removes its own files of older steps

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: must be >= 1 (the newest checkpoint is needed to resume)")

    # -- paths -----------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def data_path(self, step: int, rank: int | None = None) -> Path:
        return self.step_dir(step) / f"rank-{self.rank if rank is None else rank:05d}.pt"

    def marker_path(self, step: int, rank: int | None = None) -> Path:
        return self.step_dir(step) / f"rank-{self.rank if rank is None else rank:05d}.done"

    def steps(self) -> list[int]:
        """Steps with a checkpoint directory, newest first (complete or not). A file with a step's
        name is skipped: it holds no rank's files (looking inside it would fail with ENOTDIR)."""
        if not self.directory.is_dir():
            return []
        found = (STEP_DIR.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def is_complete(self, step: int) -> bool:
        return all(self.marker_path(step, r).exists() for r in range(self.world_size))

    def complete_steps(self) -> list[int]:
        """Steps every rank finished writing, newest first."""
        return [s for s in self.steps() if self.is_complete(s)]

    # -- writing ---------------------------------------------------------------------------
    def save(self, step: int, module: Stateful, optimizer: Stateful, extra: Mapping[str, Any] | None = None) -> Path:
        """Write this rank's part of the checkpoint after `step` steps (data position = step), then,
        once every rank has written it (collective under a process group), prune. Every rank
        calls it at the same step."""
        path = self.write(step, module, optimizer, extra)
        self.wait_for_every_rank(step)
        self.prune()
        return path

    def write(self, step: int, module: Stateful, optimizer: Stateful, extra: Mapping[str, Any] | None = None) -> Path:
        """This rank's file of `step`, then its marker."""
        import torch  # torch only in a rank: `meshjob worker` and `meshjob run` import this module before it

        state = {
            "step": step,
            "data_position": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "extra": dict(extra or {}),
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        data = encode(Identity(step, self.rank, self.world_size), buf.getvalue())
        marker = {
            "step": step,
            "rank": self.rank,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "fingerprint": self.fingerprint,
        }
        try:
            self._make_step_dir(step)
            atomic_write(self.data_path(step), data)
            atomic_write(self.marker_path(step), json.dumps(marker, sort_keys=True).encode())
        except OSError as err:  # every rank of a full disk fails alike: one line each, not a traceback's worth
            raise CheckpointError(self._write_failure(step, err)) from err
        return self.data_path(step)

    def _write_failure(self, step: int, err: OSError) -> str:
        reason = err.strerror or str(err)
        name = f" [{errno.errorcode[err.errno]}]" if err.errno is not None and err.errno in errno.errorcode else ""
        where = f" ({err.filename})" if err.filename else ""
        fix = "free space there" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
        return (
            f"cannot write the checkpoint of step {step} in {self.directory} (rank {self.rank}): "
            f"{reason}{name}{where}; {fix}, or point spec.training.checkpoint.path (or MESHJOB_CHECKPOINT_DIR) "
            f"elsewhere"
        )

    def _make_step_dir(self, step: int) -> None:
        """The step's folder; a file in its place (not written by a trainer) is moved aside, never removed."""
        path = self.step_dir(step)
        try:
            path.mkdir(parents=True, exist_ok=True)
            return
        except FileExistsError:
            if path.is_dir():  # another rank moved the file aside and made the folder meanwhile
                return
        aside = path.with_name(path.name + ".not-a-checkpoint")
        try:
            # one fixed name: a rank late to this finds the file gone, or renaming the new folder over
            # the moved file fails (ENOTDIR), so no rank moves another rank's folder aside
            os.rename(path, aside)
            print(
                f"checkpoint: {path} is a file, not a step folder: moved to {aside} to write step {step}",
                file=sys.stderr,
                flush=True,
            )
        except (FileNotFoundError, NotADirectoryError):
            pass  # another rank moved it
        path.mkdir(exist_ok=True)

    def wait_for_every_rank(self, step: int) -> None:
        """Return once every rank has written `step` (its marker exists): an all-reduce under a
        process group, so each rank prunes seeing the step complete; nothing without one."""
        if _in_process_group():
            _all_reduce_min([step])

    def prune(self) -> None:
        """Remove this rank's files of every step older than the `keep` newest complete steps.
        Older steps go whether still complete or not: another rank having pruned first never makes
        this rank keep its files (and a step a crash left incomplete goes too)."""
        complete = self.complete_steps()
        if len(complete) < self.keep:
            return
        oldest_kept = complete[self.keep - 1]
        for step in self.steps():
            if step < oldest_kept:
                self._remove_own_files(step)

    def _remove_own_files(self, step: int) -> None:
        """This rank's marker (first: never a marker without its file), file and leftover temp files;
        the step's directory once it is empty (the last rank to prune removes it)."""
        directory = self.step_dir(step)
        own = f"rank-{self.rank:05d}"
        self.marker_path(step).unlink(missing_ok=True)
        self.data_path(step).unlink(missing_ok=True)
        try:
            leftovers = list(directory.glob(f".{own}.*.tmp"))
        except FileNotFoundError:  # another rank removed the emptied directory: nothing of ours is left
            return
        for tmp in leftovers:
            tmp.unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass  # other ranks' files are still there

    # -- checking --------------------------------------------------------------------------
    def read_marker(self, step: int, rank: int | None = None) -> dict[str, Any]:
        """The marker of `rank`'s file of `step`; a missing, unreadable or malformed one raises Unloadable."""
        rank = self.rank if rank is None else rank
        path = self.marker_path(step, rank)
        try:
            marker = json.loads(path.read_text())
        except FileNotFoundError:
            raise Unloadable(f"{path.name} is missing (rank {rank} did not finish writing step {step})") from None
        except (OSError, ValueError) as err:
            raise Unloadable(f"{path.name} is unreadable ({type(err).__name__}): the marker is corrupted") from None
        if not (
            isinstance(marker, dict)
            and isinstance(marker.get("bytes"), int)
            and isinstance(marker.get("sha256"), str)
            and isinstance(marker.get("fingerprint"), dict)
        ):
            raise Unloadable(f"{path.name} is not a checkpoint marker (bytes, sha256, fingerprint): it is corrupted")
        return marker

    def read_payload(self, step: int, rank: int | None = None) -> bytes:
        """`rank`'s payload of `step`, read once and checked against its marker and its own header."""
        rank = self.rank if rank is None else rank
        marker = self.read_marker(step, rank)
        path = self.data_path(step, rank)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise Unloadable(f"{path.name} cannot be read ({type(err).__name__})") from None
        if len(data) != marker["bytes"]:
            raise Unloadable(f"{path.name} is {len(data)} bytes, its marker says {marker['bytes']} (torn or truncated)")
        if hashlib.sha256(data).hexdigest() != marker["sha256"]:
            raise Unloadable(f"{path.name} does not match the sha256 in its marker (damaged after writing)")
        return decode(data, Identity(step, rank, self.world_size), path.name)

    def problem(self, step: int, rank: int | None = None) -> str | None:
        """Why `rank` (default: this rank) cannot load its file of `step`, or None when it can."""
        try:
            self.read_payload(step, rank)
        except Unloadable as why:
            return str(why)
        return None

    def check_fingerprint(self, step: int) -> None:
        diff = fingerprint_diff(self.read_marker(step)["fingerprint"], self.fingerprint)
        if diff:
            raise CheckpointMismatch(
                f"checkpoint {self.step_dir(step)} was written for a different spec:\n  "
                + "\n  ".join(diff)
                + f"\nresume needs the same model, stages and world size; point spec.training.checkpoint.path "
                f"(or MESHJOB_CHECKPOINT_DIR) elsewhere or remove {self.directory}"
            )

    def verifies(self, step: int) -> bool:
        """This rank's file of `step` loads: its marker, size, hashes and identity check out."""
        return self.problem(step) is None

    def newest_loadable(self, below: int | None = None) -> int | None:
        """Newest complete step (< `below`) whose file this rank can load; refuses a foreign spec."""
        for step in self.complete_steps():
            if below is not None and step >= below or not self.verifies(step):
                continue
            self.check_fingerprint(step)
            return step
        return None

    # -- resuming --------------------------------------------------------------------------
    def agree(self, propose: Callable[[int | None], int | None]) -> int | None:
        """The newest step every rank can load: propose, take the minimum, repeat until all agree.
        Without a process group (a single process) this rank's own choice stands."""
        step = propose(None)
        if not _in_process_group():
            return step
        while True:
            mine = -1 if step is None else step
            low, neg_high = _all_reduce_min([mine, -mine])
            if low == -neg_high:
                return None if low < 0 else low
            step = None if low < 0 else (low if self.verifies(low) else propose(low))

    def unloadable_report(self) -> str:
        """Every complete step, newest first, with this rank's reason it cannot load it."""
        lines = [
            f"step {step}: " + (self.problem(step) or f"rank {self.rank} can load it; another rank cannot")
            for step in self.complete_steps()
        ]
        return "\n  ".join(lines)

    def resume_step(self) -> int | None:
        """The step every rank resumes from (None: no complete checkpoint, start fresh). Complete
        checkpoints none of which every rank can load raise CheckpointCorrupt on every rank.
        Collective under a process group: every rank calls it at the same point."""
        step = self.agree(self.newest_loadable)
        if step is None and self.complete_steps():
            raise CheckpointCorrupt(
                f"no checkpoint in {self.directory} can be loaded by every rank, so training does not "
                f"start again from step 0 over them. Rank {self.rank} found:\n  {self.unloadable_report()}\n"
                f"Restore the damaged files from a copy, or move {self.directory} away to start afresh."
            )
        return step

    def restore(self, module: Stateful, optimizer: Stateful) -> int | None:
        """Load the newest checkpoint all ranks can load; returns its step (None: start fresh)."""
        import torch  # torch only in a rank: `meshjob worker` and `meshjob run` import this module before it

        step = self.resume_step()
        if step is None:
            return None
        state = torch.load(io.BytesIO(self.read_payload(step)), map_location="cpu", weights_only=True)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return int(state["data_position"])

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ---------------------------------------------------------------------------- all ranks, from outside
@dataclass(frozen=True)
class Survey:
    """What a resume will find in a checkpoint folder, seen from outside the ranks (meshjob run)."""

    resume_step: int | None  # newest complete step every rank's file of which loads
    skipped: tuple[str, ...]  # newer complete steps that cannot be loaded, with the reason
    complete: tuple[int, ...]

    @property
    def corrupt(self) -> bool:
        """Complete checkpoints exist, none of which every rank can load."""
        return bool(self.complete) and self.resume_step is None


def survey(directory: Path | str, world_size: int) -> Survey:
    """Check every rank's file of each complete step, newest first, until one step loads on all."""
    ck = Checkpointer(Path(directory), rank=0, world_size=world_size, fingerprint={})
    complete = ck.complete_steps()
    skipped: list[str] = []
    for step in complete:
        problems = [p for p in (ck.problem(step, r) for r in range(world_size)) if p]
        if not problems:
            return Survey(step, tuple(skipped), tuple(complete))
        skipped.append(f"step {step}: " + "; ".join(problems))
    return Survey(None, tuple(skipped), tuple(complete))


# ---------------------------------------------------------------------------- collectives
def _in_process_group() -> bool:
    """Whether a torch.distributed process group is up."""
    import torch.distributed as dist  # torch only in a rank: the CLI imports this module before it

    return dist.is_available() and dist.is_initialized()


def _all_reduce_min(values: list[int]) -> list[int]:
    """The element-wise minimum over all ranks. A CPU tensor goes through gloo under both "gloo"
    and "cpu:gloo,cuda:nccl"."""
    import torch  # torch only in a rank: the CLI imports this module before it
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t]
