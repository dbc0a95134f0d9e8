"""The pipeline executor: runs one stage's action list (meshjob.schedule.actions.Action) for one step.

  F<mb>        forward; inputs come from RECV_F handles (stage 0: the data); outputs are stashed
  B<mb>        full backward: weight gradients accumulate into .grad, input gradients are kept
  I<mb>        input gradients only (torch.autograd.grad w.r.t. the stage inputs, graph retained)
  W<mb>        weight gradients later (backward into the parameters' .grad), then the stash is freed
  SEND_F/RECV_F, SEND_B/RECV_B   start a transfer through the transport; a RECV's result is taken
               by the compute that needs it; every handle is finished at the end of the step

Receives are posted ahead of the actions that consume them, up to `recv_depth[boundary]` per
boundary (meshjob.plan.comm_order: enough that, as planned, each is posted before its sender sends;
default: every receive of the step at its start). gloo moves data only once the receiver has
posted, so a receive posted at its action (right before the compute that needs it) would expose the
whole transfer; posted early, it overlaps the computation of other microbatches, which is what
eager-1F1B's earlier forwards are for. The depth bounds the receive buffers a stage holds (they
hold no autograd graph and are not counted as stashed activations).

I/W split as in zero-bubble pipelining (torch.distributed.pipelining._backward, pinned torch):
I computes the input gradients and keeps the gradients arriving at the graph nodes where the
weights join; W resumes from those nodes, so I + W costs what B costs and no collective of the
backward (tensor-parallel all-reduces) runs twice. A stage without differentiable inputs (stage
0) has nothing to do in I; its W is then the whole backward.

The math itself is the `compute` strategy's (meshjob_trainer.compute): the module's (RealCompute),
or waits of a device profile's modelled time with tensors of the real shapes (EmulatedCompute); this
executor does the bookkeeping either way (stash, receives, sends, gradients taken and kept).

With data parallelism the step's last backward action (B, or the last W) tells the optimizer's gradient
reduction (meshjob_trainer.optim) which weight gradients are complete, so each bucket's reduction starts
during that backward; a split W computes its weights group by group for that.

Per stage we record compute seconds, waiting seconds (blocked on a transfer) and the peak number
of stashed microbatches: forwarded but not yet fully backwarded (B, or W when split). Times are read
on the step's clock (meshjob_trainer.step_clock): the host's on a CPU, the compute stream's on a GPU,
where the host only launches kernels; either way at the step's end, like the last microbatch's loss
(reading a loss on a GPU waits for the device: once a step, not once a microbatch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.compute import RealCompute, StageCompute
from meshjob_trainer.data import Batch
from meshjob_trainer.model import PipelineStage
from meshjob_trainer.recompute import WeightGrad
from meshjob_trainer.step_clock import HostClock, StepClock


class Handle(Protocol):
    def result(self) -> torch.Tensor | None:
        """The transferred tensor (None on a sender) as soon as it has arrived."""

    def wait(self) -> torch.Tensor | None:
        """The same, once the transfer is over on this rank (a chain's forwards too)."""


class Transport(Protocol):
    """Moves one tensor of one microbatch across a boundary (a source passes its tile, a receiver None)."""

    def start(self, key: BoundaryKey, mb: int, local: torch.Tensor | None) -> Handle: ...


class GradientReady(Protocol):
    """The data-parallel gradient reduction as the executor drives it (meshjob_trainer.optim.StageOptimizer)."""

    def arm(self, on_start: Callable[[str], None] | None = None) -> None:
        """The step's last backward action begins: complete buckets start reducing (on_start(name) each)."""

    def ready(self, params: Iterable[torch.Tensor]) -> None:
        """These parameters' gradients are complete (a B's are reported by the optimizer's own hooks)."""

    def flush(self) -> None:
        """The last backward action ended: start what has not started."""


class PipelineError(RuntimeError):
    """An action list this executor cannot run; the message names the stage and the action."""


@dataclass
class StageStats:
    stage: int
    compute_s: float = 0.0  # F, B, I, W (less the waits for their inputs)
    wait_s: float = 0.0  # blocked on transfers (RECV handles, and SEND handles at step end)
    peak_stashed: int = 0  # most microbatches forwarded and not yet fully backwarded
    steps: int = 0
    # (action or "wait", start, end) in seconds from the step's start; merged stats keep the last step's
    timeline: list[tuple[str, float, float]] = field(default_factory=list)
    timeline_origin: float = 0.0  # the host's time.perf_counter() at the step's start (one for all processes)
    # (bucket, seconds from the step's start) at which each data-parallel gradient reduction started
    reductions: list[tuple[str, float]] = field(default_factory=list)

    def merge_step(self, other: StageStats) -> None:
        self.compute_s += other.compute_s
        self.wait_s += other.wait_s
        self.peak_stashed = max(self.peak_stashed, other.peak_stashed)
        self.steps += other.steps
        self.timeline, self.timeline_origin = other.timeline, other.timeline_origin
        self.reductions = other.reductions


@dataclass
class _Stash:
    inputs: dict[str, torch.Tensor]  # the stage inputs that need a gradient (leaves)
    outputs: dict[str, torch.Tensor]
    split_done: bool = False  # I has run
    param_groups: list[dict[str, Any]] | None = None  # what I kept for W (None: W runs the whole backward)
    weight_grads: list[WeightGrad] = field(default_factory=list)  # what I deferred of recomputed blocks
    roots: list[torch.Tensor] = field(default_factory=list)
    root_grads: list[torch.Tensor | None] = field(default_factory=list)


class PipelineExecutor:
    """Runs `actions` for stage `stage`; one instance per rank, reused every step."""

    def __init__(
        self,
        stage: int,
        module: PipelineStage,
        actions: Sequence[Action],
        transport: Transport,
        loss_scale: float,
        recv_depth: Mapping[BoundaryKey, int] | None = None,
        compute: StageCompute | None = None,
        clock: StepClock | None = None,
        gradients: GradientReady | None = None,
    ):
        self.gradients = gradients  # the data-parallel reduction to start during the last backward (None: none)
        self.stage, self.module, self.actions, self.transport = stage, module, list(actions), transport
        self.clock = clock or HostClock()  # meshjob_trainer.step_clock.clock_for(device) on a GPU
        self.loss_scale = loss_scale  # 1 / tokens of the global batch: losses add up to its mean
        self.recv_depth = dict(recv_depth or {})  # receives posted ahead per boundary; absent: all of them
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.split = any(a.kind == "I" for a in self.actions)
        self.compute = compute or RealCompute(module, self.params, self.split)

    def run_step(self, local_batch: Callable[[int], Batch]) -> tuple[float, StageStats]:
        """Execute the action list once. Returns (the sum of this rank's scaled microbatch losses
        (0 except on the last stage), the step's stats)."""
        run = _StepRun(self, local_batch)
        run.run(self.actions)
        return run.loss, run.stats

    def run_forward(self, local_batch: Callable[[int], Batch]) -> float:
        """Forward only, without autograd (evaluation): the list's F, SEND_F and RECV_F actions in
        their order, which stays a valid schedule (a forward needs only forwards). Returns the sum of
        this rank's scaled microbatch losses (0 except on the last stage)."""
        run = _StepRun(self, local_batch, training=False)
        with torch.no_grad():
            run.run([a for a in self.actions if a.kind in ("F", "SEND_F", "RECV_F")])
        return run.loss


class _StepRun:
    """The state of one step: stashes, in-flight handles, received gradients."""

    def __init__(self, ex: PipelineExecutor, local_batch: Callable[[int], Batch], training: bool = True):
        self.ex, self.local_batch, self.training = ex, local_batch, training
        self.stats = StageStats(ex.stage, steps=1)
        self.loss = 0.0  # summed at the step's end from `losses` (read there: on a GPU, reading one waits)
        self.losses: list[torch.Tensor] = []
        self.stash: dict[int, _Stash] = {}
        self.recv_f: dict[tuple[str, int], tuple[BoundaryKey, Handle]] = {}
        self.recv_b: dict[tuple[str, int], list[tuple[BoundaryKey, Handle]]] = {}
        self.input_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.handles: list[Handle] = []  # every transfer started this step, finished at its end
        self.unposted: dict[BoundaryKey, collections.deque[Action]] = collections.defaultdict(collections.deque)
        # what the step's clock marked, in order, and what each (name, start, end) pair of marks was: a compute
        # action or a "wait"; read into stats at the step's end, when the device (if any) has run it all
        self.marks: list[Any] = []  # the clock's own kind of mark (StepClock.mark)
        self.spans: list[tuple[str, int, int]] = []
        self.started: list[tuple[str, int]] = []  # (bucket, mark) of each gradient reduction started
        self.last_backward: Action | None = None  # the action after which every weight gradient is complete
        self.stats.timeline_origin = ex.clock.start()

    def run(self, actions: Sequence[Action]) -> None:
        if self.training and self.ex.gradients is not None:
            self.last_backward = next((a for a in reversed(actions) if a.kind in ("B", "W")), None)
        self.post_receives(actions)
        for action in actions:
            if action.kind not in ("RECV_F", "RECV_B"):
                self.do(action)
        self.finish()

    def read_clock(self) -> None:
        """Stats from the marks. An action first takes its inputs (the waits inside its span, recorded as
        such), then computes: its compute starts where it began plus those waits."""
        at = self.ex.clock.seconds(self.marks)
        waits: list[tuple[int, float]] = []  # (start mark, seconds) since the last compute action's span
        for name, start, end in self.spans:  # an action's span comes after the waits inside it
            if name == "wait":
                waited = at[end] - at[start]
                waits.append((start, waited))
                self.stats.wait_s += waited
                self.stats.timeline.append(("wait", at[start], at[end]))
                continue
            begin = at[start] + sum(seconds for mark, seconds in waits if mark > start)
            self.stats.compute_s += at[end] - begin
            self.stats.timeline.append((name, begin, at[end]))
            waits.clear()
        self.stats.reductions = [(name, at[mark]) for name, mark in self.started]

    def fail(self, action: Action, why: str) -> PipelineError:
        return PipelineError(f"stage {self.ex.stage}: action {action}: {why}")

    def post_receives(self, actions: Sequence[Action]) -> None:
        """The first recv_depth receives of each boundary, in action order; the rest as those are consumed.
        Posted early because gloo moves data only once the receiver has posted: a receive posted at its
        action (right before the compute that needs it) would expose the whole transfer."""
        for action in actions:
            if action.kind in ("RECV_F", "RECV_B"):
                self.unposted[BoundaryKey.of_action(self.ex.stage, action)].append(action)
        for key, pending in self.unposted.items():
            for _ in range(min(len(pending), self.ex.recv_depth.get(key, len(pending)))):
                self.do(pending.popleft())

    def consumed(self, key: BoundaryKey) -> None:
        """One receive of `key` was taken: post its next one."""
        pending = self.unposted.get(key)
        if pending:
            self.do(pending.popleft())

    def mark(self) -> int:
        self.marks.append(self.ex.clock.mark())
        return len(self.marks) - 1

    def wait(self, handle: Handle, finish: bool = False) -> torch.Tensor | None:
        start = self.mark()
        value = handle.wait() if finish else handle.result()
        self.spans.append(("wait", start, self.mark()))
        return value

    def do(self, action: Action) -> None:
        kind = action.kind
        if kind in ("F", "B", "I", "W"):
            gradients = self.ex.gradients if action is self.last_backward else None
            if gradients is not None:
                gradients.arm(lambda name: self.started.append((name, self.mark())))
            start = self.mark()
            getattr(self, f"_{kind}")(action)
            self.spans.append((str(action), start, self.mark()))
            if gradients is not None:
                gradients.flush()
        elif kind == "RECV_F":
            self.recv_f[(action.tensor, action.mb)] = self._start(action, None)
        elif kind == "RECV_B":
            self.recv_b.setdefault((action.tensor, action.mb), []).append(self._start(action, None))
        elif kind == "SEND_F":
            stash = self.stash.get(action.mb)
            if stash is None or action.tensor not in stash.outputs:
                raise self.fail(action, f"no forward output {action.tensor!r} of microbatch {action.mb} to send")
            self._start(action, stash.outputs[action.tensor].detach())
        elif kind == "SEND_B":
            grads = self.input_grads.get(action.mb)
            if grads is None or action.tensor not in grads:
                raise self.fail(
                    action, f"no input gradient {action.tensor!r} of microbatch {action.mb} (needs B or I first)"
                )
            self._start(action, grads[action.tensor])
        else:
            raise self.fail(action, f"unknown action kind {kind!r}")

    def _start(self, action: Action, local: torch.Tensor | None) -> tuple[BoundaryKey, Handle]:
        key = BoundaryKey.of_action(self.ex.stage, action)
        handle = self.ex.transport.start(key, action.mb, local)
        self.handles.append(handle)
        return key, handle

    def _take(self, received: tuple[BoundaryKey, Handle]) -> torch.Tensor | None:
        key, handle = received
        value = self.wait(handle)
        self.consumed(key)
        return value

    # --- compute ---------------------------------------------------------------------------

    def _F(self, action: Action) -> None:
        mb, module = action.mb, self.ex.module
        batch = self.local_batch(mb) if (module.is_first or module.is_last) else None
        inputs: dict[str, torch.Tensor] = {}
        leaves: dict[str, torch.Tensor] = {}
        for name in module.input_names():
            if name == "tokens":
                assert batch is not None  # the first stage's
                inputs[name] = batch.tokens
                continue
            received = self.recv_f.pop((name, mb), None)
            if received is None:
                raise self.fail(action, f"input {name!r} of microbatch {mb} was never received (no RECV_F before F)")
            value = self._take(received)
            if value is None:
                raise self.fail(action, f"input {name!r} of microbatch {mb}: its receive delivered nothing")
            leaves[name] = inputs[name] = value.detach().requires_grad_(True)
        if module.is_last:
            assert batch is not None  # the last stage's
            inputs["targets"] = batch.targets
        outputs = self.ex.compute.forward(inputs)
        if module.is_last:
            outputs["loss"] = outputs["loss"] * self.ex.loss_scale
            self.losses.append(outputs["loss"].detach())
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
                raise self.fail(
                    action,
                    f"gradient of output {name!r} of microbatch {action.mb} was never "
                    "received (no RECV_B before the backward)",
                )
            total: torch.Tensor | None = None
            for received in handles:  # one per consumer stage; they add up
                grad = self._take(received)
                if grad is None:
                    raise self.fail(action, f"gradient of output {name!r} of microbatch {action.mb}: delivered nothing")
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
        self.input_grads[mb] = {
            name: (torch.zeros_like(leaf) if g is None else g) for (name, leaf), g in zip(stash.inputs.items(), grads)
        }

    def _B(self, action: Action) -> None:
        stash = self._stash_for(action)
        roots, grads = self._roots(action, stash)
        self._keep_input_grads(action.mb, stash, self.ex.compute.backward(roots, grads, list(stash.inputs.values())))
        del self.stash[action.mb]

    def _I(self, action: Action) -> None:
        stash = self._stash_for(action)
        roots, grads = self._roots(action, stash)
        stash.split_done = True
        self._keep_input_grads(action.mb, stash, self.ex.compute.input_grad(stash, roots, grads))

    def _W(self, action: Action) -> None:
        stash = self._stash_for(action)
        if not stash.split_done:
            raise self.fail(action, f"W before I for microbatch {action.mb}")
        groups = stash.param_groups
        if action is self.last_backward and groups is not None and self.ex.gradients is not None:
            # group by group, so each bucket starts reducing as soon as its weights are done
            weights = {_get_grad_fn_or_grad_acc(p): p for p in self.ex.params}
            if stash.weight_grads:  # recomputed blocks' weights are in no group: I deferred them
                done = [p for work in stash.weight_grads for p in work.params()]
                stash.param_groups = []
                self.ex.compute.weight_grad(stash)
                self.ex.gradients.ready(done)
            for group in groups:
                stash.param_groups = [group]
                done = [weights[node] for node in group["params"] if node in weights]
                self.ex.compute.weight_grad(stash)
                self.ex.gradients.ready(done)
        else:
            self.ex.compute.weight_grad(stash)
        del self.stash[action.mb]  # frees the retained graph

    def finish(self) -> None:
        for handle in self.handles:
            self.wait(handle, finish=True)
        self.read_clock()
        for loss in self.losses:
            self.loss += loss.item()
        if not self.training:  # forward only: the stash held the outputs until they were sent
            self.stash.clear()
        leftovers = []
        if self.stash:
            leftovers.append(f"microbatches {sorted(self.stash)} forwarded but never fully backwarded")
        if self.recv_f or self.recv_b:
            keys = sorted(set(self.recv_f) | set(self.recv_b))
            leftovers.append(f"received but unused: {keys}")
        if leftovers:
            raise PipelineError(f"stage {self.ex.stage}: the action list ended with " + "; ".join(leftovers))
