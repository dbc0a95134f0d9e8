"""What one stage's work costs on a device profile (meshjob.costs.devices): FLOPs and bytes from the model
config, then time = max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) (a roofline).

The FLOPs are those of the family's own blocks (meshjob_trainer.model, meshjob_trainer.llama), per device of
a stage with tensor-parallel degree t, one microbatch of b samples (data parallel splits them) of s tokens:
  matmuls     2 b s x (the weights of the block's linear layers on the device), per layer:
              gpt, utransformer: q, k, v, proj (4 h^2) and the GELU MLP (2 h f), all / t
              llama: q, o (2 h^2 / t), k, v (2 h kv_local: the device's key/value heads, one replicated head
              when kvHeads < t) and SwiGLU's gate, up, down (3 h f / t)
  attention   4 b s^2 h / t (scores and their product with the values, every query head; counted over the
              whole s x s square, as torch's FLOP counter and Megatron's MFU count it)
  head        2 b s h V on the last stage (llama's vocab-parallel head: V / t)
Backward: the input gradient (I) costs the matmuls again plus the attention twice (its backward has no
weights), the weight gradient (W) the matmuls again. Full recompute adds the blocks' forward to I (the
embedding and head are not recomputed). The first stage's input takes no gradient, so its I is empty and
its W runs the whole backward, as the trainer runs it. tests/test_cost_flops.py checks all of it against
torch's FLOP counter over the real modules.
Bytes: the device's weights x itemsize plus the elementwise traffic in items, taken as fused kernels: two
norms (read + write, 4 b s h), two residual adds (6 b s h), the MLP's activation (GELU read + write,
2 b s f / t; SwiGLU reads two and writes one, 3 b s f / t), llama's rotary embedding of q and k (read +
write), a U-Transformer's skip adds (3 b s h each); attention is taken as fused (its s x s scores stay
on chip, as flash attention keeps them). The first stage adds the embedding lookup, the last the head's
weights and the logits into the loss.
The optimizer step (AdamW, fp32 master weights) reads and writes 28 bytes per local parameter.
A custom model's layers are opaque here: counted as GPT layers of its hidden size, unless the trainer hands
in one layer as it measured it (meshjob_trainer.custom.measured_layer; emulated compute does).
Tensor parallelism: tp_reductions lists the all-reduces Megatron's layers issue per pass (what emulated
compute sends over the stage's tensor-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshjob.costs.compute import StageCost
from meshjob.costs.devices import DeviceProfile
from meshjob.spec.model import ModelSpec, TrainingJob, TrainingSpec, skip_pairs

ADAMW_BYTES_PER_PARAM = 28  # param, grad, two moments read (16) and param and moments written (12), fp32
FP32_BYTES = 4


@dataclass(frozen=True)
class StageWork:
    """One microbatch on one device of a stage."""

    forward_flops: float
    forward_bytes: float
    input_grad_flops: float  # without recompute's forward (recompute_flops)
    weight_grad_flops: float
    params: int  # parameters this device holds (its tensor-parallel share)
    recompute_flops: float = 0.0  # full recompute: the blocks' forward again, in the backward's first pass
    recompute_bytes: float = 0.0
    # the first stage's input (tokens) takes no gradient: the trainer's I has nothing to do and its W runs
    # the whole backward (meshjob_trainer.compute.RealCompute.input_grad)
    whole_backward_in_weight_grad: bool = False


@dataclass(frozen=True)
class EmulatedCost:
    """Seconds of one microbatch (F, I, W) and of one optimizer step on one device of a stage; the stage's
    input_grad_s includes recompute_s, the blocks' forward that full recompute runs again."""

    stage: StageCost
    optimizer_s: float
    params: int  # parameters on the device (what its data-parallel gradient reduction moves)
    recompute_s: float = 0.0


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer on one device of a stage, per token of a sequence of the model's length."""

    forward_flops: float
    input_grad_flops: float
    weight_grad_flops: float
    weights: float  # items of the weights its passes read (its matrix products')
    params: float  # every parameter of the layer on the device (linears, biases, norms)
    elementwise_items: float  # items the layer's elementwise kernels read and write, fused


def _layer(linear_params: float, attention_width: float, s: int, params: float, elementwise: float) -> LayerShape:
    # a weight takes 2 FLOPs per token in each pass; attention's scores and values 4 s per query width
    # forward, twice that for the input gradient, none for the weights
    matmul, attention = 2 * linear_params, 4 * s * attention_width
    return LayerShape(matmul + attention, matmul + 2 * attention, matmul, linear_params, params, elementwise)


def _gpt_layer(m: ModelSpec, t: int) -> LayerShape:
    h, f = m.hidden, m.ffn_width
    linears = (4 * h * h + 2 * h * f) / t
    # biases: q and v (h / t each, no key bias), fc (f / t), and the two row-parallel outputs (h each,
    # replicated); two LayerNorms (2 h each)
    biases_norms = 2 * h / t + f / t + 2 * h + 4 * h
    return _layer(linears, h / t, m.seq_len, linears + biases_norms, 10 * h + 2 * f / t)


def _llama_layer(m: ModelSpec, t: int) -> LayerShape:
    h, f = m.hidden, m.ffn_width
    head_dim = h // m.heads
    kv_local = head_dim * max(1, m.key_value_heads // t)  # one replicated head when kvHeads < t
    linears = 2 * h * h / t + 2 * h * kv_local + 3 * h * f / t
    rotary = 2 * (h / t + kv_local)  # q and k read and written
    return _layer(linears, h / t, m.seq_len, linears + 2 * h, 10 * h + rotary + 3 * f / t)


def layer_shape(model: ModelSpec, tensor_parallel: int) -> LayerShape:
    """One layer of `model` on one device of a stage of this tensor-parallel degree. A custom model's
    layers are opaque here: a GPT layer of its hidden size (the trainer measures the real one:
    meshjob_trainer.custom.measured_layer)."""
    if model.kind == "llama":
        return _llama_layer(model, tensor_parallel)
    return _gpt_layer(model, tensor_parallel)


def _skips_into(model: ModelSpec, first: int, last: int) -> int:
    """Skip connections added into layers [first, last) (a U-Transformer's)."""
    return sum(1 for _, dst in skip_pairs(model) if first <= dst < last)


def _itemsize(training: TrainingSpec) -> int:
    return 2 if training.precision == "bf16" else 4


def stage_work(job: TrainingJob, stage: int, layer: LayerShape | None = None) -> StageWork:
    """The FLOPs and bytes of one microbatch on one device of `stage` of `job` (a meshjob.spec.manifest.TrainingJob;
    `layer`: one layer as measured, see range_work)."""
    st = job.stages[stage]
    recompute = job.recompute(stage) == "full"
    return range_work(job.model, job.training, *st.layers, st.data_parallel, st.tensor_parallel, recompute, layer)


def range_work(
    model: ModelSpec,
    training: TrainingSpec,
    first: int,
    last: int,
    data_parallel: int,
    tensor_parallel: int,
    recompute: bool = False,
    layer: LayerShape | None = None,
) -> StageWork:
    """The FLOPs and bytes of one microbatch on one device of a stage holding layers [first, last) of `model`
    (meshjob.spec.manifest.ModelSpec) with these parallel degrees (and full recompute or not): what `meshjob
    tune` costs a stage it has not written yet by, and what stage_work costs a written one by. `layer`:
    one layer as measured (a custom model's), else layer_shape's."""
    m, t = model, tensor_parallel
    layers, layer = last - first, layer or layer_shape(model, t)
    b, h = training.microbatch_size / data_parallel, m.hidden
    tokens, size = b * m.seq_len, _itemsize(training)
    blocks_forward = tokens * layer.forward_flops * layers
    elementwise = layers * tokens * layer.elementwise_items + 3 * tokens * h * _skips_into(m, first, last)
    blocks_bytes = (layers * layer.weights + elementwise) * size
    nbytes, params, head = blocks_bytes, layer.params * layers, 0.0
    vocab_local = m.vocab / t if m.kind == "llama" else m.vocab  # llama's embedding and head are vocab-parallel
    if first == 0:
        nbytes += tokens * h * size  # the embedding rows looked up
        params += vocab_local * h + (0 if m.kind == "llama" else m.seq_len * h)  # gpt's position embedding
    if last == m.layers:
        head = 2 * tokens * h * vocab_local
        # the final norm; the head's weights; its logits written, and read into the loss in fp32
        nbytes += 2 * tokens * h * size + vocab_local * h * size + 2 * tokens * vocab_local * FP32_BYTES
        norm_params = h if m.kind == "llama" else 2 * h
        params += norm_params + (0 if m.tie_embeddings and first == 0 else vocab_local * h)
    return StageWork(
        forward_flops=blocks_forward + head,
        forward_bytes=nbytes,
        input_grad_flops=tokens * layer.input_grad_flops * layers + head,
        weight_grad_flops=tokens * layer.weight_grad_flops * layers + head,
        params=int(params),
        recompute_flops=blocks_forward if recompute else 0.0,
        recompute_bytes=blocks_bytes if recompute else 0.0,
        whole_backward_in_weight_grad=first == 0,
    )


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce of `elements` items of `itemsize` bytes over a stage's tensor-parallel group."""

    elements: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


@dataclass(frozen=True)
class TPReductions:
    """The tensor-parallel all-reduces of one microbatch on one device of a stage, per pass, in the order
    the trainer's layers issue them (Megatron's: two per block forward, two per block input gradient)."""

    forward: tuple[AllReduce, ...] = ()
    input_grad: tuple[AllReduce, ...] = ()
    weight_grad: tuple[AllReduce, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.forward + self.input_grad + self.weight_grad)


def tp_reductions(job: TrainingJob, stage: int) -> TPReductions:
    """What the trainer's tensor-parallel layers all-reduce for one microbatch of `stage` (none without
    tensor parallelism): activations and their gradients in the training dtype; llama's vocab-parallel
    loss (three fp32 values per token) and, with fewer key/value heads than ranks, the replicated key and
    value weights' gradients (fp32, full size) in W. Full recompute runs the blocks' forward reductions
    again in I."""
    st, m = job.stages[stage], job.model
    t = st.tensor_parallel
    if t == 1:
        return TPReductions()
    first, last = st.layers
    tokens = job.training.microbatch_size // st.data_parallel * m.seq_len
    act = AllReduce(tokens * m.hidden, job.training.activation_itemsize)
    llama = m.kind == "llama"
    blocks = (act, act) * (last - first)
    forward = ((act,) if llama and first == 0 else ()) + blocks  # the vocab-parallel embedding's sum
    if llama and last == m.layers:
        forward += (AllReduce(tokens, FP32_BYTES),) * 3  # the loss: max, target logit, sum of exponentials
    recomputed = blocks if job.recompute(stage) == "full" else ()
    head = (act,) if llama and last == m.layers else ()  # the gradient of the head's (replicated) input
    input_grad = head + recomputed + blocks
    weight_grad: tuple[AllReduce, ...] = ()
    if llama and m.key_value_heads < t:
        kv_weight = AllReduce(m.key_value_heads * (m.hidden // m.heads) * m.hidden, FP32_BYTES)
        weight_grad = (kv_weight, kv_weight) * (last - first)
    if first == 0:  # the whole backward runs in W (StageWork.whole_backward_in_weight_grad)
        return TPReductions(forward, (), input_grad + weight_grad)
    return TPReductions(forward, input_grad, weight_grad)


def _seconds(flops: float, nbytes: float, device: DeviceProfile) -> float:
    return max(flops / device.flops_per_s, nbytes / device.bytes_per_s)


def emulated_cost(job: TrainingJob, stage: int, device: DeviceProfile, layer: LayerShape | None = None) -> EmulatedCost:
    """What `stage` of `job` takes on `device`: F, I (with full recompute's forward), W of one microbatch,
    and one optimizer step (`layer`: one layer as measured, see range_work)."""
    return work_cost(stage_work(job, stage, layer), device)


def work_cost(w: StageWork, device: DeviceProfile) -> EmulatedCost:
    """F, I, W and the optimizer step of `w` on `device`. Both backward halves read what the forward read
    (weights and saved activations); a recomputed forward reads what the blocks' forward read and runs in
    the backward's first pass."""
    recompute = _seconds(w.recompute_flops, w.recompute_bytes, device)
    input_grad = _seconds(w.input_grad_flops, w.forward_bytes, device) + recompute
    weight_grad = _seconds(w.weight_grad_flops, w.forward_bytes, device)
    if w.whole_backward_in_weight_grad:
        input_grad, weight_grad = 0.0, input_grad + weight_grad
    cost = StageCost(_seconds(w.forward_flops, w.forward_bytes, device), input_grad, weight_grad)
    return EmulatedCost(cost, w.params * ADAMW_BYTES_PER_PARAM / device.bytes_per_s, w.params, recompute)


def emulated_costs(job: TrainingJob, device: DeviceProfile, layer: LayerShape | None = None) -> tuple[StageCost, ...]:
    """Every stage's F, I, W on `device`: what meshjob.costs.compute.CostModel(stages=...) plans and simulates with."""
    return tuple(emulated_cost(job, i, device, layer).stage for i in range(len(job.stages)))
