"""Synthetic but learnable data: sequences from a fixed random bigram chain.

Each token has one likely successor (a fixed random permutation of the vocabulary, chosen by the
seed); with probability `noise` the next token is uniform instead. A model can learn the
permutation, so the loss falls from ln(vocab) toward the chain's entropy. A batch depends only on
(seed, step): a resumed run reads exactly the data an uninterrupted run would.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # (rows, seq) int64: model input
    targets: torch.Tensor  # (rows, seq) int64: the next token of each position

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop], self.targets[start:stop])


@dataclass(frozen=True)
class BigramData:
    vocab: int
    seq_len: int
    global_batch: int
    seed: int = 0
    noise: float = 0.1

    def successor(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randperm(self.vocab, generator=gen)

    @functools.lru_cache(maxsize=2)  # every microbatch of a step slices the same batch
    def batch(self, step: int) -> Batch:
        """The global batch of training step `step` (0-based); callers must not modify it."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        succ = self.successor()
        seq = torch.empty(self.global_batch, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (self.global_batch,), generator=gen)
        noisy = torch.rand(self.global_batch, self.seq_len, generator=gen) < self.noise
        random = torch.randint(self.vocab, (self.global_batch, self.seq_len), generator=gen)
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.where(noisy[:, t], random[:, t], succ[seq[:, t]])
        return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    def microbatch(self, step: int, index: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """Rows of microbatch `index` that data-parallel rank `dp_rank` of `dp_size` holds
        (natural layout: the microbatch's rows split in contiguous equal blocks)."""
        rows = self.global_batch // microbatches
        if rows * microbatches != self.global_batch or rows % dp_size:
            raise ValueError(
                f"training.globalBatch: {self.global_batch} is invalid: must split into {microbatches} "
                f"microbatches of rows divisible by the data-parallel size {dp_size}")
        local = rows // dp_size
        start = index * rows + dp_rank * local
        return self.batch(step).rows(start, start + local)
