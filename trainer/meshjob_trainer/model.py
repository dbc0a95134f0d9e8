"""The models, nanoGPT-style: GPT and U-Transformer, cut into pipeline stages by layer range, and
PipelineStage, the stage skeleton every family (these two, meshjob_trainer.llama, a custom model
from meshjob_trainer.custom) shares; build_stage picks the family of a job.

A StageModule holds layers [first, last) of the model. Stage 0 also embeds (token + position);
the last stage also does the final LayerNorm, the head and the loss. The head is tied to the
token embedding (unless spec.model.tieEmbeddings is false): when the model is cut into several
stages, the first and the last stage each hold a copy of it and their gradients are summed
between them (parallel.tie_gradients), so the copies stay equal; in one process (the reference)
they are one parameter.

U-Transformer: the same blocks plus long skip connections from the output of layer i to the
input of layer L-1-i for every i < L-1-i, added to the residual stream. A skip whose ends lie in
different stages is a stage output/input named skip_tensor(i) ("skip<i>"), i.e. a DAG edge that
may cross several stages.

Tensor parallelism (Megatron): attention heads and the MLP's hidden units are split over the
TP group; every rank creates the same full initial weights from the seed and keeps its shard, so
a sharded model computes what the single-process model does.
"""

from __future__ import annotations

import zlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from meshjob.spec.manifest import MODEL_KINDS, ModelSpec, skip_pairs, skip_tensor
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardInfo,
    TPGroup,
    copy_to_tp,
    init_std,
    shard_info,
    sharded,
)


def check_model(config: ModelSpec) -> None:
    """A model spec that did not come through the manifest parser (tests, benchmarks) fails here, clearly."""
    if config.kind not in ("gpt", "utransformer"):
        raise ValueError(
            f"model.kind: {config.kind!r} is invalid: allowed are gpt, utransformer (this module); "
            f"all kinds: {', '.join(MODEL_KINDS)}"
        )
    if config.hidden % config.heads:
        raise ValueError(f"model.hidden: {config.hidden} is invalid: must be divisible by model.heads ({config.heads})")


class Initializer:
    """Full-size initial weights that depend only on (seed, parameter name): identical on every
    rank and independent of how the model is cut or sharded."""

    def __init__(self, config: ModelSpec, seed: int):
        self.config, self.seed = config, seed

    def normal(self, name: str, shape: tuple[int, ...], residual_proj: bool = False) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        std = init_std(self.config.hidden, self.config.layers, residual_proj)
        return torch.randn(shape, generator=gen) * std


def _layer_norm(hidden: int) -> nn.LayerNorm:
    return nn.LayerNorm(hidden)  # weight 1, bias 0: deterministic without a seed


class Attention(nn.Module):
    """Causal self-attention; this rank computes heads / tp.size of the heads."""

    def __init__(self, config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup):
        super().__init__()
        hidden, heads = config.hidden, config.heads
        if heads % tp.size:
            raise ValueError(
                f"model.heads: {heads} is invalid: must be divisible by the tensor-parallel size {tp.size}"
            )
        self.tp, self.local_heads, self.head_dim = tp, heads // tp.size, hidden // heads
        zeros = torch.zeros(hidden)
        self.q = ColumnParallelLinear(init.normal(f"{prefix}.q.weight", (hidden, hidden)), zeros, tp)
        # no key bias: it shifts every score of a query row equally, so softmax cancels it and its
        # gradient is exactly zero; Adam would turn the rounding noise of that zero into updates
        self.k = ColumnParallelLinear(init.normal(f"{prefix}.k.weight", (hidden, hidden)), None, tp)
        self.v = ColumnParallelLinear(init.normal(f"{prefix}.v.weight", (hidden, hidden)), zeros, tp)
        self.proj = RowParallelLinear(init.normal(f"{prefix}.proj.weight", (hidden, hidden), True), zeros, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        x = copy_to_tp(x, self.tp)  # one backward all-reduce for q, k and v together

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup):
        super().__init__()
        hidden, inner = config.hidden, config.ffn_width
        self.tp = tp
        self.fc = ColumnParallelLinear(init.normal(f"{prefix}.fc.weight", (inner, hidden)), torch.zeros(inner), tp)
        self.proj = RowParallelLinear(
            init.normal(f"{prefix}.proj.weight", (hidden, inner), True), torch.zeros(hidden), tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(copy_to_tp(x, self.tp))))


class PreNormBlock(nn.Module):
    """A pre-norm transformer block, x + attn(ln_1(x)) then + mlp(ln_2(x)): GPT's with LayerNorms,
    Llama's with RMSNorms (meshjob_trainer.llama)."""

    def __init__(self, ln_1: nn.Module, attn: nn.Module, ln_2: nn.Module, mlp: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def gpt_block(config: ModelSpec, prefix: str, init: Initializer, tp: TPGroup) -> PreNormBlock:
    return PreNormBlock(
        _layer_norm(config.hidden),
        Attention(config, f"{prefix}.attn", init, tp),
        _layer_norm(config.hidden),
        MLP(config, f"{prefix}.mlp", init, tp),
    )


class PipelineStage(nn.Module):
    """Layers [first, last) of a model cut into pipeline stages: the part every family shares.

    forward(inputs) -> outputs, both dicts of tensors named as on the plan's edges:
      inputs:  "tokens" (stage 0) or "activation", plus incoming "skip<i>"; the last stage also
               takes "targets"
      outputs: "activation" and outgoing "skip<i>", or on the last stage "loss": the SUM of the
               token cross-entropies of the local rows (the caller scales it)

    A family (GPT, Llama, a custom model) supplies `blocks` (a ModuleDict keyed by layer index),
    embed(tokens) on the first stage and head_loss(x, targets) on the last. Precision and
    recomputation (numerics.Numerics) apply to every family alike.
    """

    blocks: nn.ModuleDict  # the family's layers [first, last), keyed by str(layer index)

    def __init__(self, config: ModelSpec, first: int, last: int, numerics: Numerics = Numerics()):
        super().__init__()
        if not 0 <= first < last <= config.layers:
            raise ValueError(f"stage layers: [{first}, {last}) is invalid: need 0 <= first < last <= {config.layers}")
        self.config, self.first, self.last, self.numerics = config, first, last, numerics
        self.is_first, self.is_last = first == 0, last == config.layers
        pairs = skip_pairs(config)
        self.skip_into = {dst: src for src, dst in pairs if first <= dst < last}  # layer -> source layer
        self.skip_sources = {src for src, dst in pairs if first <= src < last}
        self.skip_outputs = [skip_tensor(src) for src, dst in pairs if first <= src < last <= dst]
        self.skip_inputs = [skip_tensor(src) for src, dst in pairs if src < first <= dst < last]

    def input_names(self) -> list[str]:
        return (["tokens"] if self.is_first else ["activation"]) + self.skip_inputs

    def output_names(self) -> list[str]:
        return ["loss"] if self.is_last else ["activation"] + self.skip_outputs

    def tied_weights(self) -> list[nn.Parameter]:
        """Parameters this stage shares with another stage (the first and the last stage each hold a
        copy of a tied token embedding; parallel.tie_gradients sums their gradients)."""
        return []

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = next(iter(inputs.values())).device.type
        with self.numerics.autocast(device):
            return self._forward(inputs)

    def _forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = self.embed(inputs["tokens"]) if self.is_first else inputs["activation"]
        saved: dict[int, torch.Tensor] = {}
        for i in range(self.first, self.last):
            if i in self.skip_into:
                src = self.skip_into[i]
                x = x + (saved[src] if src >= self.first else inputs[skip_tensor(src)])
            x = self.numerics.run_block(self.blocks[str(i)], x)
            if i in self.skip_sources:
                saved[i] = x
        if not self.is_last:
            return {"activation": x, **{name: saved[int(name[4:])] for name in self.skip_outputs}}
        return {"loss": self.head_loss(x, inputs["targets"])}


class StageModule(PipelineStage):
    """Layers [first, last) of a GPT or U-Transformer. Stage 0 embeds (token + position); the last
    stage does the final LayerNorm, the head (tied to the token embedding unless
    spec.model.tieEmbeddings is false) and the loss."""

    def __init__(
        self,
        config: ModelSpec,
        first: int,
        last: int,
        seed: int,
        tp: TPGroup = TPGroup(),
        numerics: Numerics = Numerics(),
    ):
        check_model(config)
        super().__init__(config, first, last, numerics)
        init = Initializer(config, seed)
        replicated = ShardInfo(None)
        self.tied = config.tie_embeddings
        if self.is_first or (self.is_last and self.tied):
            self.wte = nn.Embedding(config.vocab, config.hidden)
            self.wte.weight = sharded(init.normal("wte.weight", (config.vocab, config.hidden)), replicated)
        if self.is_first:
            self.wpe = nn.Embedding(config.seq_len, config.hidden)
            self.wpe.weight = sharded(init.normal("wpe.weight", (config.seq_len, config.hidden)), replicated)
        self.blocks = nn.ModuleDict({str(i): gpt_block(config, f"blocks.{i}", init, tp) for i in range(first, last)})
        if self.is_last:
            self.ln_f = _layer_norm(config.hidden)
            if not self.tied:
                self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
                self.lm_head.weight = sharded(init.normal("lm_head.weight", (config.vocab, config.hidden)), replicated)

    def tied_weights(self) -> list[nn.Parameter]:
        cut = (self.is_first or self.is_last) and not (self.is_first and self.is_last)
        # torch types nn.Embedding.weight as a Tensor: here it is the Parameter sharded() made
        return [cast(nn.Parameter, self.wte.weight)] if cut and self.tied else []

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.ln_f(x), self.wte.weight if self.tied else self.lm_head.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


def full_parameters(shards: list[dict[str, tuple[torch.Tensor, ShardInfo]]]) -> dict[str, torch.Tensor]:
    """Reassemble full weights from the shards of several ranks (any order, duplicates allowed):
    a sharded parameter is the concatenation of its parts along its dim, by part index."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    infos: dict[str, ShardInfo] = {}
    for state in shards:
        for name, (tensor, info) in state.items():
            parts.setdefault(name, {})[info.index] = tensor
            infos[name] = info
    full = {}
    for name, info in infos.items():
        got = parts[name]
        if info.dim is None:
            full[name] = got[0]
            continue
        missing = sorted(set(range(info.parts)) - set(got))
        if missing:
            raise ValueError(f"parameter {name}: shards {missing} of {info.parts} are missing")
        full[name] = torch.cat([got[i] for i in range(info.parts)], dim=info.dim)
    return full


def local_shards(module: nn.Module) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    """This rank's parameters with their ShardInfo, detached copies in CPU memory (for full_parameters;
    a CUDA tensor returned to a launcher would initialise CUDA there, and a process that forks ranks must not)."""
    return {name: (p.detach().to("cpu", copy=True), shard_info(p)) for name, p in module.named_parameters()}
