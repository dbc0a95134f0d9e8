"""A model meshjob did not write: a causal convolution language model (no attention), as a user's
package brings it to `spec.model.kind: custom` with `entrypoint: "conv_lm:build"`.

build() returns meshjob_trainer.custom.CustomModel: the embedding, spec.model.layers blocks, the
head, and the shape of one sequence between blocks, (seqLen, hidden). meshjob cuts the blocks by
stages[].layers, computes the loss from the head's logits and keeps a weight the embedding and the
head share (tieEmbeddings in config) equal on the first and last stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq_len: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


class CausalConvBlock(nn.Module):
    """A depthwise convolution over the past `kernel` positions, then an MLP; both residual."""

    def __init__(self, hidden: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.norm_1 = nn.LayerNorm(hidden)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden)
        self.norm_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(self.norm_1(x).transpose(1, 2), (self.kernel - 1, 0))  # pad the past only: causal
        x = x + self.conv(y).transpose(1, 2)
        return x + self.mlp(self.norm_2(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int, tied: nn.Parameter | None):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        if tied is not None:
            self.out.weight = tied  # the same Parameter object as the token embedding's

    def forward(self, x: torch.Tensor):
        return self.out(self.norm(x))


def build(config: dict, model):
    """The entry point: config is spec.model.config ({kernel, tieEmbeddings}), model spec.model."""
    from meshjob_trainer.custom import CustomModel  # the trainer image provides it

    kernel = int(config.get("kernel", 4))
    embedding = Embedding(model.vocab, model.seq_len, model.hidden)
    blocks = [CausalConvBlock(model.hidden, kernel) for _ in range(model.layers)]
    tied = embedding.tokens.weight if config.get("tieEmbeddings", True) else None
    return CustomModel(embedding, blocks, Head(model.hidden, model.vocab, tied), (model.seq_len, model.hidden))
