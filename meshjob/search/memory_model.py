"""Bytes one device of a pipeline stage holds at its peak: what `meshjob tune` keeps under a device's memory.

Four parts, each from the model's shapes (pure arithmetic, no torch):
- parameters: the stage's blocks (plus the embedding on the first stage, the final norm and the output
  head on the last), split over its tensor-parallel degree, in fp32 (bf16 runs keep fp32 master weights);
- gradients and optimizer state: one fp32 gradient and AdamW's two fp32 moments per parameter; ZeRO-1
  shards the moments over the stage's data-parallel degree;
- activations: per stashed microbatch, each block's saved tensors (Korthikanti et al., 2022, "Reducing
  Activation Recomputation in Large Transformer Models", eq. 2 without sequence parallelism, in fp32
  elements: s*b*h*(5 + 12/t + 2.5*a*s/(h*t))), or with full recompute only each block's input plus the
  block being recomputed with its backward's temporaries (RECOMPUTE_LIVE_BLOCKS); the first stage's embedding
  output and the last stage's logits;
- resharding buffers: one activation-sized buffer per boundary direction the stage sends or receives, in the
  training dtype (what crosses stages: bf16 under precision bf16).

bf16 with autocast saves low-precision copies beside the fp32 tensors (BF16_ACTIVATION_FACTOR). Both factors are
measured by `meshjob bench memory` (bench/results/memory.json; tests/test_memory_model.py checks them against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshjob.spec.model import ModelSpec, TrainingSpec

FLOAT32 = 4
BF16_ACTIVATION_FACTOR = 1.2  # bf16 autocast activations / fp32's, measured by `meshjob bench memory`
# blocks' activations a step holds beyond its stash with full recompute (the block recomputed and its backward's
# temporaries), measured by `meshjob bench memory` (recompute_live_blocks_beyond_stash)
RECOMPUTE_LIVE_BLOCKS = 1.7


@dataclass(frozen=True)
class Memory:
    """Bytes per device of one stage, by part."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def to_json(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
        }


def block_parameters(model: ModelSpec) -> int:
    """Parameters of one transformer block of a built-in family (meshjob.spec.manifest.ModelSpec)."""
    h, ffn = model.hidden, model.ffn_width
    if model.kind == "llama":
        kv = model.key_value_heads * (h // model.heads)
        return 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # attention, MLP, two layer norms


def stage_parameters(model: ModelSpec, first: int, last: int) -> int:
    """Parameters of the stage holding blocks [first, last): the embedding rides with block 0, the final
    norm and the output head with the last block (a copy of a tied embedding when they are on different stages)."""
    n = (last - first) * block_parameters(model)
    if first == 0:
        n += model.vocab * model.hidden + (model.seq_len * model.hidden if model.kind != "llama" else 0)
    if last == model.layers and (first != 0 or not model.tie_embeddings):
        n += model.vocab * model.hidden
    if last == model.layers:
        n += model.hidden if model.kind == "llama" else 2 * model.hidden  # the final RMSNorm / LayerNorm
    return n


def replicated_kv_parameters(model: ModelSpec, tp: int) -> int:
    """Per device and block, what replicated key/value heads add to an even split over tp: with fewer kvHeads
    than the degree every rank holds a whole head's key and value weights."""
    if model.kind != "llama" or model.key_value_heads >= tp:
        return 0
    head = model.hidden // model.heads
    return 2 * model.hidden * head - 2 * model.hidden * model.key_value_heads * head // tp


def block_activation_bytes(model: ModelSpec, samples: float, tp: int) -> float:
    """Bytes one block saves for its backward, for `samples` samples on one device of tensor-parallel degree tp."""
    s, h, a = model.seq_len, model.hidden, model.heads
    return FLOAT32 * samples * s * h * (5 + 12 / tp + 2.5 * a * s / (h * tp))


def rest_activation_bytes(model: ModelSpec, samples: float, tp: int, first: bool, last: bool) -> float:
    """The embedding's output (first stage) and the logits with their softmax (last stage)."""
    s = model.seq_len
    out = FLOAT32 * samples * s * model.hidden if first else 0.0
    if last:
        out += 2 * FLOAT32 * samples * s * model.vocab / tp
    return out


def activation_bytes(
    model: ModelSpec,
    layers: int,
    samples: float,
    tp: int,
    stashed: int,
    recompute: str,
    precision: str,
    first: bool,
    last: bool,
) -> float:
    """Peak activation bytes: `stashed` microbatches of `samples` each through `layers` blocks."""
    block = block_activation_bytes(model, samples, tp)
    rest = rest_activation_bytes(model, samples, tp, first, last)
    if recompute == "full":
        per_mb = layers * FLOAT32 * samples * model.seq_len * model.hidden + rest
        out = stashed * per_mb + RECOMPUTE_LIVE_BLOCKS * block
    else:
        out = stashed * (layers * block + rest)
    return out * (BF16_ACTIVATION_FACTOR if precision == "bf16" else 1.0)


def stage_memory(
    model: ModelSpec,
    training: TrainingSpec,
    first: int,
    last: int,
    dp: int,
    tp: int,
    stashed: int,
    recompute: str,
    boundary_directions: int,
) -> Memory:
    """Peak bytes on one device of the stage holding blocks [first, last)
    (training: meshjob.spec.manifest.TrainingSpec)."""
    params = -(-stage_parameters(model, first, last) // tp) + (last - first) * replicated_kv_parameters(model, tp)
    moments = 2 * params * FLOAT32
    if training.optimizer.zero_stage == 1:
        moments = -(-moments // dp)
    samples = training.microbatch_size / dp
    acts = activation_bytes(
        model, last - first, samples, tp, stashed, recompute, training.precision, first == 0, last == model.layers
    )
    # boundary tensors travel in the training dtype (bf16 under precision bf16)
    buffers = boundary_directions * training.activation_itemsize * samples * model.seq_len * model.hidden
    return Memory(params * FLOAT32, params * FLOAT32, int(moments), int(acts), int(buffers))
