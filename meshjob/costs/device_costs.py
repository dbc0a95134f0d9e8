"""What one stage's work costs on a device profile (meshjob.costs.devices): FLOPs and bytes from the model
config, then time = max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) (a roofline).

Per transformer layer, one microbatch of b samples of s tokens, hidden h, MLP width f, on one device
of a stage with tensor-parallel degree t (data parallel splits the samples):
  matmul FLOPs   2 b s (4 h^2 + 2 h f) / t        (QKV and output projections, the MLP)
  attention      4 b s^2 h / t                    (scores and their product with the values)
  bytes          weights (4 h^2 + 2 h f) / t x itemsize, plus the elementwise traffic in items:
                 two layer norms (read + write, 4 b s h), two residual adds (6 b s h), the MLP's
                 activation function (read + write, 2 b s f / t); attention is taken as fused (its
                 s x s scores stay on chip, as flash attention keeps them)
The first stage adds the embedding lookup (bytes only), the last the head (2 b s h V FLOPs) and
the loss. Backward: the input gradient (I) costs the matmuls again plus the attention twice (its
backward has no weights), the weight gradient (W) the matmuls again; I + W is the usual 2x forward.
The optimizer step (AdamW, fp32 master weights) reads and writes 28 bytes per local parameter.
Grouped-query attention (llama's kvHeads) and SwiGLU are counted as the GPT block of the same
widths; a custom model is counted as GPT blocks of its hidden size (an estimate: its modules are opaque).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshjob.costs.compute import StageCost
from meshjob.costs.devices import DeviceProfile
from meshjob.spec.model import ModelSpec, TrainingJob, TrainingSpec

ADAMW_BYTES_PER_PARAM = 28  # param, grad, two moments read (16) and param and moments written (12), fp32


@dataclass(frozen=True)
class StageWork:
    """One microbatch on one device of a stage."""

    forward_flops: float
    forward_bytes: float
    input_grad_flops: float
    weight_grad_flops: float
    params: int  # parameters this device holds (its tensor-parallel share)


@dataclass(frozen=True)
class EmulatedCost:
    """Seconds of one microbatch (F, I, W) and of one optimizer step on one device of a stage."""

    stage: StageCost
    optimizer_s: float
    params: int  # parameters on the device (what its data-parallel gradient reduction moves)


def _itemsize(training: TrainingSpec) -> int:
    return 2 if training.precision == "bf16" else 4


def stage_work(job: TrainingJob, stage: int) -> StageWork:
    """The FLOPs and bytes of one microbatch on one device of `stage` of `job` (a meshjob.spec.manifest.TrainingJob)."""
    st = job.stages[stage]
    return range_work(job.model, job.training, *st.layers, st.data_parallel, st.tensor_parallel)


def range_work(
    model: ModelSpec, training: TrainingSpec, first: int, last: int, data_parallel: int, tensor_parallel: int
) -> StageWork:
    """The FLOPs and bytes of one microbatch on one device of a stage holding layers [first, last) of `model`
    (meshjob.spec.manifest.ModelSpec) with these parallel degrees: what `meshjob tune` costs a stage it has not
    written yet by, and what stage_work costs a written one by."""
    m = model
    layers, t = last - first, tensor_parallel
    b, s, h, f = training.microbatch_size / data_parallel, m.seq_len, m.hidden, m.ffn_width
    layer_params = (4 * h * h + 2 * h * f) / t
    matmul = 2 * b * s * layer_params * layers
    attention = 4 * b * s * s * h / t * layers
    size = _itemsize(training)
    nbytes = layers * (layer_params + 10 * b * s * h + 2 * b * s * f / t) * size
    params = layer_params * layers
    head = 0.0
    if first == 0:
        nbytes += b * s * h * size  # the embedding rows looked up
        params += (m.vocab + m.seq_len) * h
    if last == m.layers:
        head = 2 * b * s * h * m.vocab
        nbytes += m.vocab * h * size + 2 * b * s * m.vocab * 4  # head weights; logits out and into the loss
        params += 0 if m.tie_embeddings and first == 0 else m.vocab * h
    return StageWork(
        forward_flops=matmul + attention + head,
        forward_bytes=nbytes,
        input_grad_flops=matmul + 2 * attention + head,
        weight_grad_flops=matmul + head,
        params=int(params),
    )


def _seconds(flops: float, nbytes: float, device: DeviceProfile) -> float:
    return max(flops / device.flops_per_s, nbytes / device.bytes_per_s)


def emulated_cost(job: TrainingJob, stage: int, device: DeviceProfile) -> EmulatedCost:
    """What `stage` of `job` takes on `device`: F, I, W of one microbatch, and one optimizer step."""
    return work_cost(stage_work(job, stage), device)


def work_cost(w: StageWork, device: DeviceProfile) -> EmulatedCost:
    """F, I, W and the optimizer step of `w` on `device`. Both backward halves read what the forward read
    (weights and saved activations)."""
    cost = StageCost(
        _seconds(w.forward_flops, w.forward_bytes, device),
        _seconds(w.input_grad_flops, w.forward_bytes, device),
        _seconds(w.weight_grad_flops, w.forward_bytes, device),
    )
    return EmulatedCost(cost, w.params * ADAMW_BYTES_PER_PARAM / device.bytes_per_s, w.params)


def emulated_costs(job: TrainingJob, device: DeviceProfile) -> tuple[StageCost, ...]:
    """Every stage's F, I, W on `device`: what meshjob.costs.compute.CostModel(stages=...) plans and simulates with."""
    return tuple(emulated_cost(job, i, device).stage for i in range(len(job.stages)))
