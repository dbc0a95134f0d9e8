"""How a stage computes: the strategy the pipeline executor and the training loop call for the math.

RealCompute runs the module (autograd, the I/W split of zero-bubble pipelining, AdamW).
EmulatedCompute (`--compute emulated --device ...`, meshjob.costs.devices) does no math: each forward, input
gradient, weight gradient and optimizer step waits the time meshjob.costs.device_costs gives the stage on
the device (time.sleep: no CPU), and hands back tensors of the real shapes and dtype, so the transfers
that follow move the real bytes through the real resharding and pipeline executors. Their contents are
meaningless, and so are the losses of this mode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshjob.costs.device_costs import EmulatedCost
from meshjob.spec.manifest import TrainingJob
from meshjob_trainer.model import PipelineStage
from meshjob_trainer.optim import StageOptimizer, clip_global_norm, lr_at
from meshjob_trainer.parallel import StageGroups, tie_gradients


class SplitStash(Protocol):
    """A microbatch's stash as I and W see it (meshjob_trainer.pipeline keeps one per forwarded microbatch)."""

    inputs: dict[str, torch.Tensor]  # the stage inputs that need a gradient
    param_groups: list[dict[str, Any]] | None  # what I kept for W (None: W runs the whole backward)
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]


class StepState(Protocol):
    """What update() reads of the rank's runtime (meshjob_trainer.train.StageRuntime)."""

    @property
    def job(self) -> TrainingJob: ...

    @property
    def module(self) -> PipelineStage: ...

    @property
    def groups(self) -> StageGroups: ...

    @property
    def optimizer(self) -> StageOptimizer | None: ...


class StageCompute(Protocol):
    emulated: bool

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's outputs by name; the last stage's "loss" is its unscaled loss sum."""

    def backward(
        self, roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """B: weight gradients accumulate, the input gradients (one per leaf) are returned."""

    def input_grad(
        self, stash: SplitStash, roots: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """I: the input gradients of stash.inputs; keeps on `stash` what W resumes from."""

    def weight_grad(self, stash: SplitStash) -> None:
        """W: the weight gradients from what I kept."""

    def update(self, rt: StepState, step: int) -> float:
        """After the action list of `step`: reduce the gradients, clip, step the optimizer (rt: the
        rank's runtime). Returns the global gradient norm before clipping, or NaN without
        spec.training.gradClip (or when there are no real gradients). Collective."""


class RealCompute:
    """The module's own math. `split`: the action list has I/W, so I detaches stage outputs in place,
    and a skip output (also saved by later layers) gets its own copy."""

    emulated = False

    def __init__(self, module: PipelineStage, params: list[torch.nn.Parameter], split: bool) -> None:
        self.module, self.params, self.split = module, params, split

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = self.module(inputs)
        if self.split and not self.module.is_last:
            outputs = {name: t.clone() for name, t in outputs.items()}
        return outputs

    def backward(
        self, roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        torch.autograd.backward(roots, grads)
        return [leaf.grad for leaf in leaves]

    def input_grad(
        self, stash: SplitStash, roots: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        leaves = list(stash.inputs.values())
        if not leaves:  # nothing to differentiate for: W does it all
            stash.roots, stash.root_grads = roots, grads
            return []
        # off the last stage every output's gradient came back (pipeline: the roots are those outputs)
        out_grads = None if self.module.is_last else cast(list[torch.Tensor], grads)
        in_grads, stash.param_groups = stage_backward_input(roots, out_grads, leaves, iter(self.params))
        return list(in_grads)

    def weight_grad(self, stash: SplitStash) -> None:
        if stash.param_groups is not None:
            stage_backward_weight(iter(self.params), stash.param_groups)
        else:
            torch.autograd.backward(stash.roots, stash.root_grads, inputs=self.params)

    def update(self, rt: StepState, step: int) -> float:
        t, optimizer = rt.job.training, rt.optimizer
        if optimizer is None:
            raise ValueError(f"layers [{rt.module.first}, {rt.module.last}): real compute needs the stage's optimizer")
        tie_gradients(rt.module.tied_weights(), rt.groups)
        optimizer.reduce_gradients()
        norm = clip_global_norm(optimizer, t.grad_clip) if t.grad_clip is not None else math.nan
        optimizer.set_lr(lr_at(step, t))
        optimizer.step()
        return norm


class EmulatedCompute:
    """Waits the modelled time of each compute; outputs are uninitialised tensors of the stage's
    natural activation tile (`shape`, `dtype`), one buffer per output name reused for every microbatch
    (the contents are never read as numbers), input gradients likewise one per input name."""

    emulated = True

    def __init__(
        self,
        module: PipelineStage,
        cost: EmulatedCost,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module, self.cost, self.dp_group = module, cost, dp_group
        self._grads: torch.Tensor | None = None
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str) -> torch.Tensor:
        if name not in self._buffers:
            self._buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._buffers[name]

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(self.cost.stage.forward_s)
        if self.module.is_last:
            return {"loss": torch.full((), math.nan, device=self.device)}  # not a loss: reported as NaN
        return {name: self._buffer(name) for name in self.module.output_names()}

    def _input_grads(self, count: int) -> list[torch.Tensor | None]:
        names = [n for n in self.module.input_names() if n != "tokens"]
        return [self._buffer(f"grad:{name}") for name in names[:count]]

    def backward(
        self, roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        time.sleep(self.cost.stage.backward_s)
        return self._input_grads(len(leaves))

    def input_grad(
        self, stash: SplitStash, roots: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        time.sleep(self.cost.stage.input_grad_s)
        return self._input_grads(len(stash.inputs))

    def weight_grad(self, stash: SplitStash) -> None:
        time.sleep(self.cost.stage.weight_grad_s)

    def update(self, rt: StepState, step: int) -> float:
        """The data-parallel reduction's bytes really cross the network (one all-reduce of a buffer
        as large as the stage's local gradients); the optimizer step is a wait."""
        if self.dp_group is not None:
            if self._grads is None:
                self._grads = torch.empty(self.cost.params, dtype=torch.float32, device=self.device)
            dist.all_reduce(self._grads, group=self.dp_group)
        time.sleep(self.cost.optimizer_s)
        return math.nan
