"""How a stage computes: the strategy the pipeline executor and the training loop call for the math.

RealCompute runs the module (autograd, the I/W split of zero-bubble pipelining, AdamW).
EmulatedCompute (`--compute emulated --device ...`, meshjob.costs.devices) does no math: each forward, input
gradient (with full recompute's forward), weight gradient and optimizer step waits the time
meshjob.costs.device_costs gives the stage on the device, and hands back tensors of the real shapes and
dtype, so the transfers that follow move the real bytes through the real resharding and pipeline
executors. A tensor-parallel stage also all-reduces what Megatron's layers all-reduce
(meshjob.costs.device_costs.tp_reductions) over its real group, so a stage split across hosts loads their
NICs. Contents are meaningless, and so are the losses of this mode.

The waits go to deadlines on a per-rank clock (DeadlineClock), not one time.sleep each: a sleep overshoots
(a 2 us sleep takes ~73 us on a loaded host), and the next deadline makes the overshoot up, so a run of
waits takes the modelled time, not the modelled time plus one overshoot per wait.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshjob.costs.device_costs import AllReduce, EmulatedCost, TPReductions
from meshjob.spec.manifest import TrainingJob, TrainingSpec
from meshjob_trainer.model import PipelineStage
from meshjob_trainer.optim import StageOptimizer, clip_global_norm, lr_at
from meshjob_trainer.parallel import StageGroups, TPGroup, tie_gradients
from meshjob_trainer.recompute import WeightGrad, deferring_weight_grads, run_weight_grads


class SplitStash(Protocol):
    """A microbatch's stash as I and W see it (meshjob_trainer.pipeline keeps one per forwarded microbatch)."""

    inputs: dict[str, torch.Tensor]  # the stage inputs that need a gradient
    param_groups: list[dict[str, Any]] | None  # what I kept for W (None: W runs the whole backward)
    weight_grads: list[WeightGrad]  # what I deferred of recomputed blocks (meshjob_trainer.recompute)
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
        # recomputed blocks run once here and keep for W only their linear layers' inputs and output gradients
        with deferring_weight_grads() as deferred:
            in_grads, stash.param_groups = stage_backward_input(roots, out_grads, leaves, iter(self.params))
        stash.weight_grads = deferred
        return list(in_grads)

    def weight_grad(self, stash: SplitStash) -> None:
        if stash.param_groups is not None:
            stage_backward_weight(iter(self.params), stash.param_groups)
            run_weight_grads(stash.weight_grads)
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


class DeadlineClock:
    """A rank's modelled compute, waited on the host clock to deadlines: each wait ends `seconds` after the
    later of the previous deadline and now less the previous wait's overshoot, so an overshoot is made up
    by the next wait while time the rank spent elsewhere (a transfer it waited for) still counts."""

    def __init__(
        self, now: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.now, self.sleep = now, sleep
        self.late = 0.0  # how far past its deadline the last wait ended
        self.deadline = now()  # the last wait's deadline
        self.modelled = 0.0  # seconds of modelled compute waited for so far

    def wait(self, seconds: float) -> None:
        """Wait until `seconds` of modelled compute past where the rank's clock stands (no CPU used)."""
        now = self.now()
        self.deadline = max(self.deadline, now - self.late) + seconds
        self.modelled += seconds
        if self.deadline > now:
            self.sleep(self.deadline - now)
        self.late = max(0.0, self.now() - self.deadline)


class EmulatedCompute:
    """Waits the modelled time of each compute; outputs are uninitialised tensors of the stage's
    natural activation tile (`shape`, `dtype`), one buffer per output name reused for every microbatch
    (the contents are never read as numbers), input gradients likewise one per input name. With
    tensor parallelism (`tp`) each pass's modelled time is split evenly between its all-reduces
    (`reductions`), each issued after its share: Megatron's layers compute, then reduce."""

    emulated = True

    def __init__(
        self,
        module: PipelineStage,
        cost: EmulatedCost,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dp_group: dist.ProcessGroup | None = None,
        tp: TPGroup = TPGroup(),
        reductions: TPReductions | None = None,
        clock: DeadlineClock | None = None,
        dp_sync: DPSync | None = None,
    ) -> None:
        self.module, self.cost, self.dp_group = module, cost, dp_group
        self.dp_sync = dp_sync or DPSync()
        self._weight_passes = 0  # B or W passes this step: the last one of the step starts the buckets
        self._dp_pending: list[dist.Work] = []
        self.dp_started: list[float] = []  # modelled compute (clock.modelled) when each bucket's reduction started
        self.tp = tp
        self.reductions = reductions if reductions is not None and tp.size > 1 else TPReductions()
        self.clock = clock or DeadlineClock()
        self._grads: torch.Tensor | None = None
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}
        self._reduce_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.modelled: dict[str, float] = {}  # seconds waited for per compute kind: what a test adds up
        self.tp_bytes = 0  # bytes all-reduced over the tensor-parallel group

    def _buffer(self, name: str) -> torch.Tensor:
        if name not in self._buffers:
            self._buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._buffers[name]

    def _run(self, kind: str, seconds: float, reductions: tuple[AllReduce, ...] = (), buckets: int = 0) -> None:
        """Wait `seconds` of modelled compute, issuing `reductions` over the TP group between its shares and
        starting `buckets` data-parallel gradient buckets evenly over it (the step's last weight pass)."""
        self.modelled[kind] = self.modelled.get(kind, 0.0) + seconds
        events = sorted(
            [((i + 1) / len(reductions), 0, i) for i in range(len(reductions))]
            + [((j + 1) / buckets, 1, j) for j in range(buckets)]
        )
        done = 0.0
        for at, what, index in events:
            self.clock.wait(seconds * (at - done))
            done = at
            if what == 0:
                self._all_reduce(reductions[index])
            else:
                self._start_bucket(index, buckets)
        self.clock.wait(seconds * (1.0 - done))

    def _grad_buffer(self, itemsize: int) -> torch.Tensor:
        if self._grads is None:
            dtype = torch.bfloat16 if itemsize == 2 else torch.float32
            self._grads = torch.zeros(self.cost.params, dtype=dtype, device=self.device)
        return self._grads

    def _start_bucket(self, index: int, buckets: int) -> None:
        grads = self._grad_buffer(self.dp_sync.itemsize)
        size = -(-grads.numel() // buckets)
        work = dist.all_reduce(grads[index * size : (index + 1) * size], group=self.dp_group, async_op=True)
        assert work is not None
        self._dp_pending.append(work)
        self.dp_started.append(self.clock.modelled)

    def _weight_pass(self) -> int:
        """Buckets the data-parallel sync starts during this B or W pass: all of them during the step's last one
        when the sync overlaps the backward (DDP's and Megatron's design), else none."""
        self._weight_passes += 1
        last = self._weight_passes == self.dp_sync.microbatches
        return self.dp_sync.buckets(self.cost.params) if last and self.dp_sync.overlap and self.dp_group else 0

    def _all_reduce(self, r: AllReduce) -> None:
        key = (r.elements, r.itemsize)
        if key not in self._reduce_buffers:  # zeros: no denormal arithmetic in the reduction
            dtype = torch.bfloat16 if r.itemsize == 2 else torch.float32
            self._reduce_buffers[key] = torch.zeros(r.elements, dtype=dtype, device=self.device)
        dist.all_reduce(self._reduce_buffers[key], group=self.tp.group)
        self.tp_bytes += r.nbytes

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._run("F", self.cost.stage.forward_s, self.reductions.forward)
        if self.module.is_last:
            return {"loss": torch.full((), math.nan, device=self.device)}  # not a loss: reported as NaN
        return {name: self._buffer(name) for name in self.module.output_names()}

    def _input_grads(self, count: int) -> list[torch.Tensor | None]:
        names = [n for n in self.module.input_names() if n != "tokens"]
        return [self._buffer(f"grad:{name}") for name in names[:count]]

    def backward(
        self, roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        r = self.reductions
        self._run("B", self.cost.stage.backward_s, r.input_grad + r.weight_grad, self._weight_pass())
        return self._input_grads(len(leaves))

    def input_grad(
        self, stash: SplitStash, roots: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        self._run("I", self.cost.stage.input_grad_s, self.reductions.input_grad)
        return self._input_grads(len(stash.inputs))

    def weight_grad(self, stash: SplitStash) -> None:
        self._run("W", self.cost.stage.weight_grad_s, self.reductions.weight_grad, self._weight_pass())

    def update(self, rt: StepState, step: int) -> float:
        """The data-parallel reduction's bytes really cross the network (a buffer as large as the stage's local
        gradients, in the gradients' reduction dtype): the buckets started during the last weight pass are
        waited for, or, with overlapGradReduce off, one all-reduce runs now. The optimizer step is a wait."""
        if self.dp_group is not None:
            if self._dp_pending:
                for work in self._dp_pending:
                    work.wait()
            else:
                dist.all_reduce(self._grad_buffer(self.dp_sync.itemsize), group=self.dp_group)
        self._dp_pending, self._weight_passes = [], 0
        self._run("optimizer", self.cost.optimizer_s)
        return math.nan


@dataclass(frozen=True)
class DPSync:
    """How emulated compute reduces data-parallel gradients: spec.training's overlapGradReduce, gradBucketMiB
    and gradReduceDtype, and the step's microbatches (its last weight pass starts the buckets)."""

    microbatches: int = 1
    overlap: bool = False
    bucket_bytes: int = 25 * 2**20
    itemsize: int = 4

    @classmethod
    def of(cls, training: TrainingSpec) -> DPSync:
        return cls(
            microbatches=training.microbatches,
            overlap=training.overlap_grad_reduce,
            bucket_bytes=max(1, int(training.grad_bucket_mib * 2**20)),
            itemsize=training.grad_reduce_itemsize,
        )

    def buckets(self, params: int) -> int:
        return max(1, -(-params * self.itemsize // self.bucket_bytes))
