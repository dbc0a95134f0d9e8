"""The pipeline executor: runs one stage's action list (meshjob.schedule.Action) for one step.

  F<mb>        forward; inputs come from RECV_F handles (stage 0: the data); outputs are stashed
  B<mb>        full backward: weight gradients accumulate into .grad, input gradients are kept
  I<mb>        input gradients only (torch.autograd.grad w.r.t. the stage inputs, graph retained)
  W<mb>        weight gradients later (backward into the parameters' .grad), then the stash is freed
  SEND_F/RECV_F, SEND_B/RECV_B   start a transfer through the transport; a RECV's handle is waited
               by the compute that needs it, a SEND's at the end of the step

W re-walks the retained graph from the stage outputs to the parameters, so I + W costs about one
backward more than B; what it buys is the freedom to run W later (weight-grad delaying).

Per stage we record compute seconds, waiting seconds (blocked on a transfer) and the peak number
of stashed microbatches: forwarded but not yet fully backwarded (B, or W when split).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from meshjob.schedule import Action
from meshjob.trainer.data import Batch
from meshjob.trainer.model import StageModule


class Handle(Protocol):
    def wait(self) -> torch.Tensor | None: ...


class Transport(Protocol):
    """Moves one tensor of one microbatch across an edge. `grad` selects the backward direction
    (the gradient of `tensor` flowing from stage dst back to stage src)."""

    def start(self, tensor: str, src: int, dst: int, mb: int, grad: bool, local: torch.Tensor | None) -> Handle: ...


class PipelineError(RuntimeError):
    """An action list this executor cannot run; the message names the stage and the action."""


@dataclass
class StageStats:
    stage: int
    compute_s: float = 0.0  # F, B, I, W
    wait_s: float = 0.0  # blocked on transfers (RECV handles, and SEND handles at step end)
    peak_stashed: int = 0  # most microbatches forwarded and not yet fully backwarded
    steps: int = 0

    def merge_step(self, other: "StageStats") -> None:
        self.compute_s += other.compute_s
        self.wait_s += other.wait_s
        self.peak_stashed = max(self.peak_stashed, other.peak_stashed)
        self.steps += other.steps


@dataclass
class _Stash:
    inputs: dict[str, torch.Tensor]  # the stage inputs that need a gradient (leaves)
    outputs: dict[str, torch.Tensor]
    roots: list[torch.Tensor] = field(default_factory=list)  # set by I for W
    root_grads: list[torch.Tensor | None] = field(default_factory=list)


class PipelineExecutor:
    """Runs `actions` for stage `stage`; one instance per rank, reused every step."""

    def __init__(self, stage: int, module: StageModule, actions: Sequence[Action], transport: Transport,
                 loss_scale: float):
        self.stage, self.module, self.actions, self.transport = stage, module, list(actions), transport
        self.loss_scale = loss_scale  # 1 / tokens of the global batch: losses add up to its mean
        self.params = [p for p in module.parameters() if p.requires_grad]

    def run_step(self, local_batch: Callable[[int], Batch]) -> tuple[float, StageStats]:
        """Execute the action list once. Returns (the sum of this rank's scaled microbatch losses
        (0 except on the last stage), the step's stats)."""
        run = _StepRun(self, local_batch)
        for action in self.actions:
            run.do(action)
        run.finish()
        return run.loss, run.stats


class _StepRun:
    """The state of one step: stashes, in-flight handles, received gradients."""

    def __init__(self, ex: PipelineExecutor, local_batch: Callable[[int], Batch]):
        self.ex, self.local_batch = ex, local_batch
        self.stats = StageStats(ex.stage, steps=1)
        self.loss = 0.0
        self.stash: dict[int, _Stash] = {}
        self.recv_f: dict[tuple[str, int], Handle] = {}
        self.recv_b: dict[tuple[str, int], list[Handle]] = {}
        self.input_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.sends: list[Handle] = []

    def fail(self, action: Action, why: str) -> PipelineError:
        return PipelineError(f"stage {self.ex.stage}: action {action}: {why}")

    def wait(self, handle: Handle) -> torch.Tensor | None:
        start = time.perf_counter()
        value = handle.wait()
        self.stats.wait_s += time.perf_counter() - start
        return value

    def do(self, action: Action) -> None:
        kind = action.kind
        if kind in ("F", "B", "I", "W"):
            start = time.perf_counter()
            getattr(self, f"_{kind}")(action)
            self.stats.compute_s += time.perf_counter() - start
        elif kind == "RECV_F":
            self.recv_f[(action.tensor, action.mb)] = self.ex.transport.start(
                action.tensor, action.peer, self.ex.stage, action.mb, False, None)
        elif kind == "RECV_B":
            self.recv_b.setdefault((action.tensor, action.mb), []).append(self.ex.transport.start(
                action.tensor, self.ex.stage, action.peer, action.mb, True, None))
        elif kind == "SEND_F":
            stash = self.stash.get(action.mb)
            if stash is None or action.tensor not in stash.outputs:
                raise self.fail(action, f"no forward output {action.tensor!r} of microbatch {action.mb} to send")
            self.sends.append(self.ex.transport.start(
                action.tensor, self.ex.stage, action.peer, action.mb, False, stash.outputs[action.tensor].detach()))
        elif kind == "SEND_B":
            grads = self.input_grads.get(action.mb)
            if grads is None or action.tensor not in grads:
                raise self.fail(action, f"no input gradient {action.tensor!r} of microbatch {action.mb} "
                                        "(needs B or I first)")
            self.sends.append(self.ex.transport.start(
                action.tensor, action.peer, self.ex.stage, action.mb, True, grads[action.tensor]))
        else:
            raise self.fail(action, f"unknown action kind {kind!r}")

    # --- compute ---------------------------------------------------------------------------

    def _F(self, action: Action) -> None:
        mb, module = action.mb, self.ex.module
        batch = self.local_batch(mb) if (module.is_first or module.is_last) else None
        inputs: dict[str, torch.Tensor] = {}
        leaves: dict[str, torch.Tensor] = {}
        for name in module.input_names():
            if name == "tokens":
                inputs[name] = batch.tokens
                continue
            handle = self.recv_f.pop((name, mb), None)
            if handle is None:
                raise self.fail(action, f"input {name!r} of microbatch {mb} was never received (no RECV_F before F)")
            value = self.wait(handle)
            leaves[name] = inputs[name] = value.detach().requires_grad_(True)
        if module.is_last:
            inputs["targets"] = batch.targets
        outputs = module(inputs)
        if module.is_last:
            outputs["loss"] = outputs["loss"] * self.ex.loss_scale
            self.loss += outputs["loss"].item()
        self.stash[mb] = _Stash(leaves, outputs)
        self.stats.peak_stashed = max(self.stats.peak_stashed, len(self.stash))

    def _roots(self, action: Action, stash: _Stash) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What backward starts from: the loss, or every output whose gradient came back."""
        if self.ex.module.is_last:
            return [stash.outputs["loss"]], [None]
        roots, grads = [], []
        for name, output in stash.outputs.items():
            handles = self.recv_b.pop((name, action.mb), None)
            if handles is None:
                raise self.fail(action, f"gradient of output {name!r} of microbatch {action.mb} was never "
                                        "received (no RECV_B before the backward)")
            total = None
            for handle in handles:  # one per consumer stage; they add up
                grad = self.wait(handle)
                total = grad if total is None else total + grad
            roots.append(output)
            grads.append(total)
        return roots, grads

    def _stash_for(self, action: Action) -> _Stash:
        stash = self.stash.get(action.mb)
        if stash is None:
            raise self.fail(action, f"microbatch {action.mb} has no stashed forward")
        return stash

    def _keep_input_grads(self, mb: int, stash: _Stash, grads: Sequence[torch.Tensor | None]) -> None:
        self.input_grads[mb] = {name: (torch.zeros_like(leaf) if g is None else g)
                                for (name, leaf), g in zip(stash.inputs.items(), grads)}

    def _B(self, action: Action) -> None:
        stash = self._stash_for(action)
        roots, grads = self._roots(action, stash)
        torch.autograd.backward(roots, grads)
        self._keep_input_grads(action.mb, stash, [leaf.grad for leaf in stash.inputs.values()])
        del self.stash[action.mb]

    def _I(self, action: Action) -> None:
        stash = self._stash_for(action)
        roots, grads = self._roots(action, stash)
        leaves = list(stash.inputs.values())
        in_grads = (torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
                    if leaves else [])
        self._keep_input_grads(action.mb, stash, in_grads)
        stash.roots, stash.root_grads = roots, grads

    def _W(self, action: Action) -> None:
        stash = self._stash_for(action)
        if not stash.roots:
            raise self.fail(action, f"W before I for microbatch {action.mb}")
        torch.autograd.backward(stash.roots, stash.root_grads, inputs=self.ex.params)
        del self.stash[action.mb]  # frees the retained graph

    def finish(self) -> None:
        for handle in self.sends:
            self.wait(handle)
        leftovers = []
        if self.stash:
            leftovers.append(f"microbatches {sorted(self.stash)} forwarded but never fully backwarded")
        if self.recv_f or self.recv_b:
            keys = sorted(set(self.recv_f) | set(self.recv_b))
            leftovers.append(f"received but unused: {keys}")
        if leftovers:
            raise PipelineError(f"stage {self.ex.stage}: the action list ended with " + "; ".join(leftovers))
