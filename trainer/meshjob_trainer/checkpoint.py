"""Checkpoints: each rank writes its own shards; resume from the newest complete checkpoint.

Layout: <dir>/step-00000010/rank-00003.pt (model shards, optimizer state, step, data position,
RNG state) and, written after it, rank-00003.done (JSON: size, sha256, spec fingerprint).
Both are written atomically (temp file + fsync + rename + fsync of the directory), so a file with
its final name is whole; the .done marker holding the data file's hash also catches a data file
damaged after the fact. A step is complete when every rank's marker exists; a rank whose own
file does not verify (torn) ignores that step, and the ranks agree on the newest step all of
them can load.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointMismatch(ValueError):
    """A checkpoint written for a different spec; the message lists every differing field."""


def spec_fingerprint(job: Any, world_size: int) -> dict[str, Any]:
    """The spec fields that shape this job's tensors and their placement on ranks."""
    m = job.model
    fp: dict[str, Any] = {
        "spec.model.kind": m.kind, "spec.model.layers": m.layers, "spec.model.hidden": m.hidden,
        "spec.model.heads": m.heads, "spec.model.vocab": m.vocab, "spec.model.seqLen": m.seq_len,
        "spec.stages": len(job.stages), "worldSize": world_size,
    }
    for i, st in enumerate(job.stages):
        fp[f"spec.stages[{i}].layers"] = list(st.layers)
        fp[f"spec.stages[{i}].mesh"] = list(st.mesh)
        fp[f"spec.stages[{i}].dataParallelDim"] = st.data_parallel_dim
        fp[f"spec.stages[{i}].tensorParallelDim"] = st.tensor_parallel_dim
    return fp


def fingerprint_diff(written: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(written) | set(current))
    return [f"{k}: {written.get(k, '(absent)')!r} in the checkpoint, {current.get(k, '(absent)')!r} now"
            for k in keys if written.get(k) != current.get(k)]


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


@dataclass
class Checkpointer:
    directory: Path
    rank: int
    world_size: int
    fingerprint: dict[str, Any]
    keep: int = 3  # complete checkpoints kept; older ones this rank's files are removed

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
        """Steps with a checkpoint directory, newest first (complete or not)."""
        if not self.directory.is_dir():
            return []
        found = (STEP_DIR.match(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def is_complete(self, step: int) -> bool:
        return all(self.marker_path(step, r).exists() for r in range(self.world_size))

    # -- writing ---------------------------------------------------------------------------
    def save(self, step: int, module: Any, optimizer: Any, extra: Mapping[str, Any] | None = None) -> Path:
        """Write this rank's part of the checkpoint after `step` steps (data position = step)."""
        import io

        import torch

        state = {
            "step": step, "data_position": step, "rank": self.rank, "world_size": self.world_size,
            "model": module.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "extra": dict(extra or {}),
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        self.step_dir(step).mkdir(parents=True, exist_ok=True)
        atomic_write(self.data_path(step), data)
        marker = {"step": step, "rank": self.rank, "bytes": len(data),
                  "sha256": hashlib.sha256(data).hexdigest(), "fingerprint": self.fingerprint}
        atomic_write(self.marker_path(step), json.dumps(marker, sort_keys=True).encode())
        self._prune()
        return self.data_path(step)

    def _prune(self) -> None:
        complete = [s for s in self.steps() if self.is_complete(s)]
        for step in complete[self.keep:]:
            for path in (self.marker_path(step), self.data_path(step)):  # marker first: never a marker alone
                path.unlink(missing_ok=True)
            try:
                self.step_dir(step).rmdir()  # the last rank to prune removes the directory
            except OSError:
                pass

    # -- reading ---------------------------------------------------------------------------
    def _marker(self, step: int, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.marker_path(step, rank).read_text())
        except (OSError, ValueError):
            return None

    def verifies(self, step: int) -> bool:
        """This rank's file for `step` is whole: its size and hash match its marker."""
        marker = self._marker(step, self.rank)
        try:
            data = self.data_path(step).read_bytes()
        except OSError:
            return False
        return (marker is not None and len(data) == marker.get("bytes")
                and hashlib.sha256(data).hexdigest() == marker.get("sha256"))

    def check_fingerprint(self, step: int) -> None:
        marker = self._marker(step, self.rank) or {}
        diff = fingerprint_diff(marker.get("fingerprint", {}), self.fingerprint)
        if diff:
            raise CheckpointMismatch(
                f"checkpoint {self.step_dir(step)} was written for a different spec:\n  " + "\n  ".join(diff)
                + f"\nresume needs the same model, stages and world size; point spec.training.checkpoint.path "
                  f"(or MESHJOB_CHECKPOINT_DIR) elsewhere or remove {self.directory}")

    def newest_loadable(self, below: int | None = None) -> int | None:
        """Newest complete step (< `below`) whose file for this rank verifies; refuses a foreign spec."""
        for step in self.steps():
            if below is not None and step >= below or not self.is_complete(step):
                continue
            self.check_fingerprint(step)
            if self.verifies(step):
                return step
        return None

    def agree(self, propose: Any) -> int | None:
        """The newest step every rank can load: propose, take the minimum, repeat until all agree.
        Without a process group (a single process) this rank's own choice stands."""
        import torch
        import torch.distributed as dist

        step = propose(None)
        if not (dist.is_available() and dist.is_initialized()):
            return step
        device = "cpu"  # a CPU tensor goes through gloo under both "gloo" and "cpu:gloo,cuda:nccl"
        while True:
            mine = -1 if step is None else step
            t = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)  # [min, -max]
            low, high = int(t[0]), -int(t[1])
            if low == high:
                return None if low < 0 else low
            step = None if low < 0 else (low if self.verifies(low) else propose(low))

    def restore(self, module: Any, optimizer: Any) -> int | None:
        """Load the newest checkpoint all ranks can load; returns its step (None: start fresh).
        Collective when a process group exists: every rank calls it at the same point."""
        import torch

        step = self.agree(lambda below: self.newest_loadable(below))
        if step is None:
            return None
        state = torch.load(self.data_path(step), map_location="cpu", weights_only=True)
        if state["rank"] != self.rank or state["world_size"] != self.world_size:
            raise CheckpointMismatch(f"{self.data_path(step)} holds rank {state['rank']} of {state['world_size']}, "
                                     f"not rank {self.rank} of {self.world_size}")
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return int(state["data_position"])

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
