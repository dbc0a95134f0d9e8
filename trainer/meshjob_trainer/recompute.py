"""Activation recomputation that costs one extra forward per block and microbatch, split backward included.

recompute_block(block, x) keeps only x in the forward. Its backward recomputes block(x) once and
backpropagates through it right away. Outside a split backward (B, or W running the whole backward)
that gives every gradient. Inside I (deferring_weight_grads()), each linear layer of the recomputed
block hands back its input gradient and leaves its weight gradient as deferred work: its input and
its output gradient, all W needs (as Megatron's and zero-bubble's deferred weight gradients do). The
rest of the recomputed block (attention, activations, norms) is freed when I ends. The norms' few
weights take their gradients in I. W then runs the deferred work (run_weight_grads) and recomputes
nothing. torch's checkpoint recomputed the block again in W, once per weight group: 11 forwards per
block instead of 2, and a delayed W held more than without recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint


@dataclass
class WeightGrad:
    """A linear layer's deferred weight (and bias) gradient: its input and its output gradient."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor  # the input the product used (autocast's low-precision copy under bf16)
    dy: torch.Tensor

    def params(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def run(self) -> None:
        x, dy = self.x.reshape(-1, self.x.shape[-1]), self.dy.reshape(-1, self.dy.shape[-1])
        _accumulate(self.weight, (dy.t() @ x).to(self.weight.dtype))
        if self.bias is not None:
            _accumulate(self.bias, dy.sum(0).to(self.bias.dtype))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    # like torch's stage_backward_weight: in place, so a .grad that views a flat buffer stays one
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


# The deferred work of the I pass running now (None: no I pass, weight gradients are computed at once).
# Module-level, not thread-local: on a GPU the backward runs on autograd's device thread.
_deferring: list[WeightGrad] | None = None


@contextlib.contextmanager
def deferring_weight_grads() -> Iterator[list[WeightGrad]]:
    """The block of the with statement is an I pass: recomputed blocks' linear layers defer their
    weight gradients into the list it yields, for W's run_weight_grads."""
    global _deferring
    outer, _deferring = _deferring, []
    try:
        yield _deferring
    finally:
        _deferring = outer


def run_weight_grads(work: list[WeightGrad]) -> None:
    """W: the deferred weight gradients, accumulated into .grad; frees what they held."""
    while work:
        work.pop().run()


def recompute_block(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """block(x), keeping only x for the backward, which recomputes block(x) exactly once."""
    if not x.requires_grad:  # no backward would reach our node to compute the block's weights: torch's checkpoint
        return checkpoint(block, x, use_reentrant=False)  # type: ignore[no-any-return]
    return _Recompute.apply(block, x)  # type: ignore[no-any-return]


class _Recompute(torch.autograd.Function):
    """The block's forward without a graph; the backward recomputes it under the forward's autocast
    and random state, and backpropagates through it (its parameters are not inputs of this node, so
    no other backward pass reaches them here)."""

    @staticmethod
    def forward(ctx: Any, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        ctx.block, ctx.device = block, x.device
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        enabled, dtype = ctx.autocast
        devices = [ctx.device] if ctx.device_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, ctx.device)
            defer = _DeferLinears(_deferring) if _deferring is not None else contextlib.nullcontext()
            with torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled), defer:
                y = ctx.block(x)
        torch.autograd.backward(y, dy)  # frees the recomputed graph: deferred work keeps what W needs
        return None, x.grad


class _DeferLinears(TorchFunctionMode):
    """While the block is recomputed in an I pass: every F.linear with a trainable parameter as weight
    becomes a _DeferredLinear whose weight gradient goes to `work`."""

    def __init__(self, work: list[WeightGrad]) -> None:
        super().__init__()
        self.work = work

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            # parameters only: a weight computed from one (a replicated KV head) takes its gradient in I
            if weight.requires_grad and weight.is_leaf and (bias is None or (bias.requires_grad and bias.is_leaf)):
                return _DeferredLinear.apply(x, weight, bias, self.work)
        return func(*args, **kwargs)


def _linear_args(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return input, weight, bias


class _DeferredLinear(torch.autograd.Function):
    """F.linear whose backward returns the input gradient only and queues the weight's (autocast's
    casts are done here, so the deferred product runs in the same precision as autograd's)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, work: list[WeightGrad]
    ) -> torch.Tensor:
        device = x.device.type
        ctx.x_dtype, ctx.weight, ctx.bias, ctx.work = x.dtype, weight, bias, work
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        with torch.autocast(device, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.work.append(WeightGrad(ctx.weight, ctx.bias, x.detach(), dy))
        dx = (dy @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None, None
