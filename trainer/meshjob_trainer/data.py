"""Training and validation data: token files (spec.data.kind: tokens) or a synthetic bigram chain.

Every batch depends only on (seed, stream, step), never on what was read before, so a resumed run
reads exactly the data an uninterrupted run would, and every rank computes the same global batch
and keeps its own rows (microbatch, data-parallel rank).

Token files (meshjob.spec.tokens: nanoGPT's flat little-endian uint16/uint32 arrays) are memory-mapped;
a batch is globalBatch windows of seqLen + 1 tokens at offsets drawn from a generator seeded by
(seed, stream, step), as nanoGPT samples: inputs are a window's first seqLen tokens, targets its
last seqLen. Validation batches come from the validation file (stream VAL) at fixed indices
0..evalBatches-1, so every evaluation scores the same sequences.

Synthetic: each token has one likely successor (a fixed random permutation of the vocabulary,
chosen by the seed); with probability `noise` the next token is uniform instead. A model can learn
the permutation, so the loss falls from ln(vocab) toward the chain's entropy. Its validation
stream samples the same chain with other generator seeds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from meshjob.spec.manifest import TrainingJob

TRAIN, VAL = 0, 1  # streams of batches
# torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: streams half a period apart
# never meet for one job's seed, since steps and evaluation batches stay below 2^31.
STREAM_STRIDE = 1 << 31


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # (rows, seq) int64: model input
    targets: torch.Tensor  # (rows, seq) int64: the next token of each position

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.tokens[start:stop], self.targets[start:stop])


def batch_seed(seed: int, stream: int, step: int) -> int:
    return seed * 1_000_003 + stream * STREAM_STRIDE + step + 1


class Dataset(Protocol):
    @property
    def global_batch(self) -> int: ...

    def batch(self, step: int) -> Batch: ...

    def microbatch(self, step: int, index: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1) -> Batch: ...


def microbatch(data: Dataset, step: int, index: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
    """Rows of microbatch `index` of the global batch of `step` that data-parallel rank `dp_rank`
    of `dp_size` holds (natural layout: the microbatch's rows split in contiguous equal blocks)."""
    rows = data.global_batch // microbatches
    if rows * microbatches != data.global_batch or rows % dp_size:
        raise ValueError(
            f"training.globalBatch: {data.global_batch} is invalid: must split into {microbatches} "
            f"microbatches of rows divisible by the data-parallel size {dp_size}"
        )
    local = rows // dp_size
    start = index * rows + dp_rank * local
    return data.batch(step).rows(start, start + local)


@dataclass(frozen=True)
class TokenData:
    """Windows of a token file (see the module docstring)."""

    path: str
    dtype: str  # meshjob.spec.manifest.TOKEN_DTYPES
    vocab: int
    seq_len: int
    global_batch: int
    seed: int = 0
    stream: int = TRAIN

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """The file, memory-mapped read-only (opened in each process that reads it)."""
        return np.memmap(self.path, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r")

    @functools.lru_cache(maxsize=2)  # noqa: B019 - every microbatch of a step slices the same batch
    def batch(self, step: int) -> Batch:
        """The global batch of step `step` (0-based); callers must not modify it."""
        tokens = self.tokens
        span = len(tokens) - self.seq_len
        if span < 1:
            raise ValueError(
                f"spec.data.path: {self.path!r} is invalid: it holds {len(tokens)} tokens, fewer than "
                f"spec.model.seqLen + 1 ({self.seq_len + 1})"
            )
        gen = torch.Generator().manual_seed(batch_seed(self.seed, self.stream, step))
        starts = torch.randint(span, (self.global_batch,), generator=gen).tolist()
        windows = torch.from_numpy(np.stack([tokens[s : s + self.seq_len + 1].astype(np.int64) for s in starts]))
        top = int(windows.max())
        if top >= self.vocab:
            raise ValueError(
                f"spec.model.vocab: {self.vocab} is invalid: {self.path} holds token id {top} (batch of "
                f"step {step}); the vocabulary must exceed every id"
            )
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def microbatch(self, step: int, index: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        return microbatch(self, step, index, microbatches, dp_rank, dp_size)


@dataclass(frozen=True)
class BigramData:
    vocab: int
    seq_len: int
    global_batch: int
    seed: int = 0
    noise: float = 0.1
    stream: int = TRAIN

    def successor(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randperm(self.vocab, generator=gen)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - every microbatch of a step slices the same batch
    def batch(self, step: int) -> Batch:
        """The global batch of training step `step` (0-based); callers must not modify it."""
        gen = torch.Generator().manual_seed(batch_seed(self.seed, self.stream, step))
        succ = self.successor()
        seq = torch.empty(self.global_batch, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (self.global_batch,), generator=gen)
        noisy = torch.rand(self.global_batch, self.seq_len, generator=gen) < self.noise
        random = torch.randint(self.vocab, (self.global_batch, self.seq_len), generator=gen)
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.where(noisy[:, t], random[:, t], succ[seq[:, t]])
        return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    def microbatch(self, step: int, index: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        return microbatch(self, step, index, microbatches, dp_rank, dp_size)


def make_data(job: TrainingJob, stream: int = TRAIN) -> TokenData | BigramData:
    """The training (TRAIN) or validation (VAL) data of a meshjob.spec.manifest.TrainingJob."""
    m, t, d = job.model, job.training, job.data
    if d.kind == "tokens":
        path = d.path if stream == TRAIN else d.val_path
        return TokenData(path, d.dtype, m.vocab, m.seq_len, t.global_batch, t.seed, stream)
    return BigramData(m.vocab, m.seq_len, t.global_batch, t.seed, stream=stream)
