"""A custom model's layer as the roofline (meshjob.costs.device_costs) counts it, measured: the FLOPs of its
forward, input gradient and weight gradient by torch's FLOP counter, and its parameters (the plan layer
cannot see inside a user's modules, so it would count a GPT layer of the same width)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshjob.costs.device_costs import LayerShape
from meshjob.spec.manifest import ModelSpec, TrainingJob
from meshjob_trainer.custom import build_custom

# items per token the layer's elementwise kernels move: GPT's norms and residual adds (10 h), an estimate
ELEMENTWISE_ITEMS_PER_HIDDEN = 10


def _flops(run: Callable[[], object]) -> int:
    # the math attention: its matrix products are what the counter sees (CPU's fused kernel is not counted)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        run()
    return counter.get_total_flops()


def block_flops(block: nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """FLOPs of block(x)'s forward, input gradient and weight gradient (x requires a gradient)."""
    params = [p for p in block.parameters() if p.requires_grad]
    out: list[torch.Tensor] = []
    forward = _flops(lambda: out.append(block(x)))
    y, dy = out[0], torch.ones_like(out[0])
    # I alone (autograd computes only what the input's gradient needs: every inner input gradient); W is the
    # rest of the whole backward, as the split backward runs it (W alone would redo I's inner products)
    input_grad = _flops(lambda: torch.autograd.grad(y, [x], dy, retain_graph=True))
    backward = _flops(lambda: torch.autograd.grad(y, [x, *params], dy, allow_unused=True))
    return forward, input_grad, backward - input_grad


@functools.lru_cache(maxsize=4)
def measured_layer(model: ModelSpec, seed: int) -> LayerShape:
    """The mean of the model's blocks on one sequence, per token: every rank measures the same (same seed)."""
    parts = build_custom(model, seed)
    s, n = model.seq_len, len(parts.blocks)
    x = torch.randn(1, s, model.hidden, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    passes = [block_flops(block, x) for block in parts.blocks]
    forward, input_grad, weight_grad = (sum(p[i] for p in passes) / n / s for i in range(3))
    params = sum(p.numel() for block in parts.blocks for p in block.parameters()) / n
    return LayerShape(forward, input_grad, weight_grad, params, params, ELEMENTWISE_ITEMS_PER_HIDDEN * model.hidden)


def job_layer(job: TrainingJob) -> LayerShape | None:
    """One layer of the job's model as measured (a custom model), or None: the cost model counts the
    built-in families itself."""
    return measured_layer(job.model, job.training.seed) if job.model.kind == "custom" else None
