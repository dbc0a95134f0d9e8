"""The Llama family (spec.model.kind: llama), one readable file: RMSNorm, rotary position
embeddings, a SwiGLU MLP and grouped-query attention (spec.model.kvHeads key/value heads shared
by groups of query heads), with the output head tied to the token embedding or not
(spec.model.tieEmbeddings). No biases, as in Llama.

Megatron-style tensor parallelism for every part: q, k, v, gate and up are column-parallel (each
rank holds heads / tp query heads, kvHeads / tp key/value heads and ffn / tp MLP units), o and
down row-parallel; the token embedding is vocab-parallel (each rank holds vocab / tp rows, looks up
the tokens that fall in them and the partial embeddings are summed), and so are the head and the
loss: each rank computes the logits of its vocabulary slice and the cross-entropy is assembled
from per-slice maxima, sums of exponentials and target logits (VocabParallelCrossEntropy), so no
rank ever holds the full logits. Query head j reads key/value head j // (heads / kvHeads); slicing
both by rank keeps every group on one rank. With fewer key/value heads than ranks each rank holds
the one its query heads read, replicated on tp / kvHeads ranks, and the gradients of those copies
are summed over them (ReplicatedGrad), as Megatron does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshjob.spec.manifest import ModelSpec, kv_heads_split
from meshjob.spec.model import RMS_NORM_EPS
from meshjob_trainer.model import Initializer, PipelineStage, PreNormBlock
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardInfo,
    TPGroup,
    copy_to_tp,
    reduce_from_tp,
    shard_info,
    sharded,
)


def check_llama(config: ModelSpec, tp: TPGroup) -> None:
    """A model spec that did not come through the manifest parser (tests, benchmarks) fails here, clearly."""
    if config.hidden % config.heads or (config.hidden // config.heads) % 2:
        raise ValueError(
            f"model.heads: {config.heads} is invalid: must divide model.hidden ({config.hidden}) into an even head size"
        )
    if config.heads % config.key_value_heads:
        raise ValueError(f"model.kvHeads: {config.kv_heads} is invalid: must divide model.heads ({config.heads})")
    for name, size in (("heads", config.heads), ("ffnHidden", config.ffn_width), ("vocab", config.vocab)):
        if size % tp.size:
            raise ValueError(
                f"model.{name}: {size} is invalid: must be divisible by the tensor-parallel size {tp.size}"
            )
    if not kv_heads_split(config, tp.size):
        raise ValueError(
            f"model.kvHeads: {config.key_value_heads} is invalid: must divide the tensor-parallel size {tp.size} "
            f"or be divisible by it"
        )


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the statistics in fp32 whatever the compute precision
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq, head_dim), for the half-split rotation below."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of x (batch, heads, seq, d) by their position's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class ReplicatedGrad(torch.autograd.Function):
    """Identity forward; backward, the sum of the gradients of the copies of one key/value weight slice
    held by several TP ranks: each rank's slice goes into a zero buffer of the full weight, the
    buffer is all-reduced over the TP group, and each rank keeps its slice (the key/value weights are
    small: the full buffer costs little)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp, ctx.info = tp, shard_info(weight)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        info = ctx.info
        full = torch.zeros((grad.shape[0] * info.parts, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
        full.chunk(info.parts, dim=0)[info.index].copy_(grad)
        dist.all_reduce(full, group=ctx.tp.group)
        return full.chunk(info.parts, dim=0)[info.index].to(grad.dtype), None


class KeyValueLinear(nn.Module):
    """k or v: column-parallel over the key/value heads when the TP ranks are at most kvHeads; with more
    ranks, rank r holds head r * kvHeads // tp (the one its query heads read), a copy on tp / kvHeads ranks."""

    def __init__(self, weight: torch.Tensor, kv_heads: int, tp: TPGroup):
        super().__init__()
        parts = min(kv_heads, tp.size)
        self.tp, self.replicated = tp, parts < tp.size
        self.weight = sharded(weight, ShardInfo(0, tp.rank * parts // tp.size, parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = ReplicatedGrad.apply(self.weight, self.tp) if self.replicated else self.weight
        return F.linear(x, weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; this rank's heads / tp query heads."""

    def __init__(self, config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup):
        super().__init__()
        hidden, heads, kv_heads = config.hidden, config.heads, config.key_value_heads
        self.tp, self.theta = tp, config.rope_theta
        self.head_dim = hidden // heads
        self.local_heads, self.local_kv = heads // tp.size, max(1, kv_heads // tp.size)
        kv_width = kv_heads * self.head_dim
        self.q = ColumnParallelLinear(init.normal(f"{prefix}.q.weight", (hidden, hidden)), None, tp)
        self.k = KeyValueLinear(init.normal(f"{prefix}.k.weight", (kv_width, hidden)), kv_heads, tp)
        self.v = KeyValueLinear(init.normal(f"{prefix}.v.weight", (kv_width, hidden)), kv_heads, tp)
        self.o = RowParallelLinear(init.normal(f"{prefix}.o.weight", (hidden, hidden), True), None, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        x = copy_to_tp(x, self.tp)  # one backward all-reduce for q, k and v together

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, seq, n, self.head_dim).transpose(1, 2)

        cos, sin = rotary_tables(seq, self.head_dim, self.theta, x.device)
        q = apply_rotary(heads(self.q(x), self.local_heads), cos, sin)
        k = apply_rotary(heads(self.k(x), self.local_kv), cos, sin)
        group = self.local_heads // self.local_kv
        k = k.repeat_interleave(group, dim=1)
        v = heads(self.v(x), self.local_kv).repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup):
        super().__init__()
        hidden, inner = config.hidden, config.ffn_width
        self.tp = tp
        self.gate = ColumnParallelLinear(init.normal(f"{prefix}.gate.weight", (inner, hidden)), None, tp)
        self.up = ColumnParallelLinear(init.normal(f"{prefix}.up.weight", (inner, hidden)), None, tp)
        self.down = RowParallelLinear(init.normal(f"{prefix}.down.weight", (hidden, inner), True), None, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return self.down(F.silu(self.gate(x)) * self.up(x))


def llama_block(config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup) -> PreNormBlock:
    return PreNormBlock(
        RMSNorm(config.hidden),
        Attention(config, f"{prefix}.attn", init, tp),
        RMSNorm(config.hidden),
        SwiGLU(config, f"{prefix}.mlp", init, tp),
    )


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * vocab / tp, (rank + 1) * vocab / tp) of the token embedding: a rank looks up the
    tokens in its rows, zeroes the others, and the partial embeddings are summed over the TP group."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = sharded(weight, ShardInfo(0, tp.rank, tp.size))
        rows = self.weight.shape[0]
        self.start, self.stop = tp.rank * rows, (tp.rank + 1) * rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.stop)
        local = F.embedding((tokens - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from_tp(local.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Token cross-entropies from vocab-sharded logits (Megatron's): the global max, the sum of
    exponentials and the target's logit are each all-reduced in fp32; the gradient is this slice of
    softmax - one_hot(target)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup,
        start: int,
    ) -> torch.Tensor:
        logits32 = logits.float()
        top = logits32.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits32 - top.unsqueeze(-1)
        outside = (targets < start) | (targets >= start + logits.shape[-1])
        local = (targets - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        ctx.dtype = logits.dtype
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        hit = (~outside).to(softmax.dtype)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return (grad_logits * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


class LlamaStage(PipelineStage):
    """Layers [first, last) of a Llama model: the embedding on the first stage, the final RMSNorm,
    head and loss on the last."""

    def __init__(
        self,
        config: ModelSpec,
        first: int,
        last: int,
        seed: int,
        tp: TPGroup = TPGroup(),
        numerics: Numerics = Numerics(),
    ):
        check_llama(config, tp)
        super().__init__(config, first, last, numerics)
        init = Initializer(config, seed)
        self.tp, self.tied = tp, config.tie_embeddings
        if self.is_first or (self.is_last and self.tied):
            self.embed_tokens = VocabParallelEmbedding(
                init.normal("embed_tokens.weight", (config.vocab, config.hidden)), tp
            )
        self.blocks = nn.ModuleDict({str(i): llama_block(config, f"blocks.{i}", init, tp) for i in range(first, last)})
        if self.is_last:
            self.norm = RMSNorm(config.hidden)
            if not self.tied:
                self.head = ColumnParallelLinear(init.normal("head.weight", (config.vocab, config.hidden)), None, tp)

    def tied_weights(self) -> list[nn.Parameter]:
        cut = (self.is_first or self.is_last) and not (self.is_first and self.is_last)
        return [self.embed_tokens.weight] if cut and self.tied else []

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's vocabulary slice, from the last block's output x."""
        weight = self.embed_tokens.weight if self.tied else self.head.weight
        return F.linear(copy_to_tp(self.norm(x), self.tp), weight)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)  # this rank's vocabulary slice
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if self.tp.size == 1:
            return F.cross_entropy(logits.float(), targets, reduction="sum")
        start = self.tp.rank * logits.shape[-1]
        return VocabParallelCrossEntropy.apply(logits, targets, self.tp.group, start).sum()
