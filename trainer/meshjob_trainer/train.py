"""The training loop of one rank: build its stage, run the plan's action list every step,
reduce gradients, clip them, step the optimizer, evaluate, report, checkpoint.

Loss convention: each microbatch's loss is the token cross-entropy SUM of the rank's rows times
1 / (tokens of the global batch), so the sum over microbatches and data-parallel ranks is the
global-batch mean (what the single-process reference reports), and gradients add up exactly.

A step: the action list (forward and backward of every microbatch; during its last backward pass the
data-parallel reduction's buckets start as their gradients complete), then the tied embedding's
gradient (parallel.tie_gradients), the wait for the data-parallel reduction (all-reduce, or ZeRO-1's
reduce-scatter), clipping to spec.training.gradClip by the global norm, and AdamW at the
schedule's learning rate (optim). Every spec.training.evalEvery steps the validation loss: the
forward actions of the same list over spec.training.evalBatches validation batches.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshjob.costs.device_costs import emulated_cost, tp_reductions
from meshjob.costs.devices import REAL, ComputeMode
from meshjob.plan.build import Plan, build_plan
from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.spec.manifest import EdgeSpec, TrainingJob
from meshjob_trainer.calibrate import natural_shape
from meshjob_trainer.checkpoint import Checkpointer, spec_fingerprint
from meshjob_trainer.compute import DPSync, EmulatedCompute, StageCompute
from meshjob_trainer.data import TRAIN, VAL, Batch, Dataset, make_data
from meshjob_trainer.dist import WorkerContext, WorkerEnv, device_for_backend, init_distributed, shutdown_distributed
from meshjob_trainer.engine_job import Handle
from meshjob_trainer.events import (
    CheckpointRestored,
    CheckpointWritten,
    Evaluated,
    GradientNorm,
    MetricsSink,
    PayloadMemory,
    PipelineFractions,
    StepFinished,
)
from meshjob_trainer.families import build_stage
from meshjob_trainer.flops import job_layer
from meshjob_trainer.model import PipelineStage, local_shards
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.optim import GRAD_REDUCE_DTYPES, StageOptimizer, no_decay_parameters
from meshjob_trainer.parallel import ShardInfo, StageGroups, build_groups
from meshjob_trainer.pipeline import PipelineExecutor, StageStats
from meshjob_trainer.reshard import ReshardExecutor, wire_dtype
from meshjob_trainer.step_clock import HostClock, clock_for


@dataclass
class TrainResult:
    rank: int
    stage: int
    losses: list[float]  # per step run, the global-batch mean loss (last stage only; else empty)
    params: dict[str, tuple[torch.Tensor, ShardInfo]]  # this rank's final parameters (model.full_parameters)
    stats: StageStats  # summed over the steps run here
    start_step: int = 0  # first step this process ran (> 0 after a resume)
    steps: int = 0  # the job's total steps
    comm_s: float = 0.0  # summed wall time of the transfers this rank took part in
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step run here
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, loss); last stage only
    grad_norms: list[float] = field(default_factory=list)  # per step run, before clipping (with gradClip)
    payload_peak_bytes: int = 0  # most in-flight payload memory the communication engine held in a step
    payload_bound_bytes: int = 0  # the plan's bound on it


class WidenedHandle:
    """A transfer that crosses in a narrower dtype (bf16) than the stage computes its boundary tensors in
    (fp32: the residual stream stays fp32): what arrives is widened back once."""

    def __init__(self, handle: Handle, dtype: torch.dtype):
        self.handle, self.dtype = handle, dtype
        self._value: torch.Tensor | None = None

    def _widen(self, value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None or self._value is not None:
            return value if value is None else self._value
        self._value = value.to(self.dtype)
        return self._value

    def result(self) -> torch.Tensor | None:
        return self._widen(self.handle.result())

    def wait(self) -> torch.Tensor | None:
        return self._widen(self.handle.wait())


class ReshardTransport:
    """pipeline.Transport over the rank's ReshardExecutor, timing the transfers it started. Tensors cross
    in the executor's dtype (the training dtype, meshjob_trainer.reshard.wire_dtype), arrive in fp32."""

    def __init__(self, reshard: ReshardExecutor, widen: bool = True):
        self.reshard, self.widen = reshard, widen  # widen False: emulated compute never reads the numbers
        self.comm_s = 0.0
        self._handles: list[Handle] = []

    def start(self, key: BoundaryKey, mb: int, local: torch.Tensor | None) -> Handle | WidenedHandle:
        wire = self.reshard.dtype
        if local is not None and local.is_floating_point() and local.dtype != wire:
            local = local.to(wire)
        handle = self.reshard.start(key, mb, local)
        self._handles.append(handle)
        return handle if wire == torch.float32 or not self.widen else WidenedHandle(handle, torch.float32)

    def collect_seconds(self) -> float:
        """Transfer wall time of the handles started since the last call (all already waited)."""
        seconds = sum(h.stats.seconds for h in self._handles if getattr(h, "stats", None) is not None)
        self._handles = []
        self.comm_s += seconds
        return seconds


def check_edges(module: PipelineStage, stage: int, edges: Sequence[EdgeSpec]) -> None:
    """The plan's edges must carry exactly the tensors this stage's layers consume and produce."""
    incoming = sorted(e.tensor for e in edges if e.dst == stage)
    outgoing = sorted({e.tensor for e in edges if e.src == stage})
    want_in = sorted(n for n in module.input_names() if n != "tokens")
    want_out = sorted(n for n in module.output_names() if n != "loss")
    if incoming != want_in or outgoing != want_out:
        raise ValueError(
            f"spec.edges: stage {stage} receives {incoming} and sends {outgoing}, but its layers "
            f"[{module.first}, {module.last}) of the {module.config.kind} model need inputs {want_in} "
            f"and outputs {want_out}"
        )


@dataclass
class StageRuntime:
    """Everything one rank builds once before the first step."""

    stage: int
    module: PipelineStage
    groups: StageGroups
    optimizer: StageOptimizer | None  # None under emulated compute (the stage holds no weights)
    executor: PipelineExecutor
    transport: ReshardTransport
    data: Dataset
    val_data: Dataset | None  # None: no evaluation
    job: TrainingJob
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def build_runtime(ctx: WorkerContext) -> StageRuntime:
    job, plan, stage = ctx.job, ctx.plan, ctx.stage
    t = job.training
    torch.manual_seed(t.seed)
    meshes = [plan.mesh(s) for s in range(len(job.stages))]
    # collective: all ranks, same order; tensor-parallel reductions in the training dtype, as boundary tensors
    groups = build_groups(job.stages, meshes, ctx.rank, wire_dtype(t.activation_itemsize))
    module, compute = _stage_and_compute(ctx, groups)
    check_edges(module, stage, job.edges)
    optimizer = (
        None
        if compute is not None
        else StageOptimizer(
            list(module.parameters()),
            groups,
            t.learning_rate,
            t.optimizer.weight_decay,
            t.optimizer.zero_stage,
            tied=module.tied_weights(),
            no_decay=no_decay_parameters(module, t.weight_decay_embeddings),
            overlap=t.overlap_grad_reduce,
            bucket_mib=t.grad_bucket_mib,
            reduce_dtype=GRAD_REDUCE_DTYPES[t.grad_reduce_dtype],
        )
    )
    transport = ReshardTransport(ctx.reshard, widen=compute is None)
    tokens = t.global_batch * job.model.seq_len
    # emulated compute waits on the host: its time is the host's, whatever the device
    clock = clock_for(ctx.device) if compute is None else HostClock()
    executor = PipelineExecutor(
        stage,
        module,
        plan.schedules[stage],
        transport,
        loss_scale=1.0 / tokens,
        recv_depth=ctx.reshard.recv_depth,
        compute=compute,
        clock=clock,
        gradients=optimizer if optimizer is not None and optimizer.buckets else None,
    )
    val = make_data(job, VAL) if t.eval_every > 0 else None
    return StageRuntime(
        stage=stage,
        module=module,
        groups=groups,
        optimizer=optimizer,
        executor=executor,
        transport=transport,
        data=make_data(job, TRAIN),
        val_data=val,
        job=job,
        device=torch.device(ctx.device),
    )


def _stage_and_compute(ctx: WorkerContext, groups: StageGroups) -> tuple[PipelineStage, StageCompute | None]:
    """This rank's stage, and the compute strategy when it is not the module's own (None): under
    emulated compute a stage without weights (its input and output names) and EmulatedCompute on the
    stage's natural activation tile."""
    job, stage = ctx.job, ctx.stage
    first, last = job.stages[stage].layers
    mode = ctx.compute or REAL
    if not mode.emulated:
        # weights are created on the CPU from the seed (identical everywhere), then moved
        return build_stage(job.model, first, last, job.training.seed, groups.tp, Numerics.of(job, stage)).to(
            ctx.device
        ), None
    if mode.device is None:
        raise ValueError("emulated compute needs a device profile (meshjob.costs.devices.parse_compute)")
    module = PipelineStage(job.model, first, last)
    shape = natural_shape(ctx.plan, stage, ctx.rank)
    return module, EmulatedCompute(
        module,
        emulated_cost(job, stage, mode.device, job_layer(job)),
        shape,
        ctx.reshard.dtype,
        ctx.device,
        groups.dp_group,
        groups.tp,
        tp_reductions(job, stage),
        dp_sync=DPSync.of(job.training),
    )


def global_loss(rt: StageRuntime, local: float) -> float:
    """The last stage's data-parallel ranks each hold part of the global-batch mean: add them."""
    value = torch.tensor([local], dtype=torch.float64, device=rt.device)
    if rt.groups.dp_group is not None:
        dist.all_reduce(value, group=rt.groups.dp_group)
    return float(value.item())


def _batches(rt: StageRuntime, data: Dataset, step: int) -> Callable[[int], Batch]:
    """local_batch(mb) for the executor: this rank's rows of microbatch mb of `step`'s global batch."""
    g, microbatches = rt.groups, rt.job.training.microbatches

    def local_batch(mb: int) -> Batch:
        batch = data.microbatch(step, mb, microbatches, g.dp_rank, g.dp_size)
        return Batch(batch.tokens.to(rt.device), batch.targets.to(rt.device))

    return local_batch


def train_step(rt: StageRuntime, step: int) -> tuple[float, StageStats, float]:
    """One optimizer step; returns (this rank's share of the loss, stats, the global gradient norm
    before clipping, or NaN without spec.training.gradClip)."""
    if rt.optimizer is not None:
        rt.optimizer.zero_grad()  # bucketed gradients: zeroed views of the reduction's buffer
    else:
        rt.module.zero_grad(set_to_none=True)
    local, stats = rt.executor.run_step(_batches(rt, rt.data, step))
    norm = rt.executor.compute.update(rt, step)
    return local, stats, norm


def evaluate(rt: StageRuntime) -> float:
    """The mean loss over spec.training.evalBatches validation batches (NaN off the last stage)."""
    assert rt.val_data is not None
    batches = rt.job.training.eval_batches
    with rt.transport.reshard.forward_only():  # the engine's order: the step's, less its gradients
        local = sum(rt.executor.run_forward(_batches(rt, rt.val_data, i)) for i in range(batches)) / batches
    return global_loss(rt, local) if rt.module.is_last else math.nan


def _restore(ctx: WorkerContext, rt: StageRuntime) -> int:
    """The step to start from: after the newest complete checkpoint, else 0."""
    if ctx.checkpoints is None or rt.optimizer is None:  # no optimizer: emulated compute, nothing to restore
        return 0
    restored = ctx.checkpoints.restore(rt.module, rt.optimizer)
    if restored is None:
        return 0
    ctx.events.emit(CheckpointRestored(rt.stage, int(restored)))
    return int(restored)


def _save(ctx: WorkerContext, rt: StageRuntime, steps_done: int) -> None:
    every = ctx.job.training.checkpoint.every
    if ctx.checkpoints is None or rt.optimizer is None or every <= 0 or steps_done % every:
        return
    start = time.perf_counter()
    ctx.checkpoints.save(steps_done, rt.module, rt.optimizer)
    ctx.events.emit(CheckpointWritten(rt.stage, steps_done, time.perf_counter() - start))


def train(ctx: WorkerContext) -> TrainResult:
    """Run the job's training steps on this rank."""
    rt = build_runtime(ctx)
    job = ctx.job
    start_step = _restore(ctx, rt)
    total = StageStats(rt.stage)
    losses: list[float] = []
    step_seconds: list[float] = []
    val_losses: list[tuple[int, float]] = []
    norms: list[float] = []
    tokens = job.training.global_batch * job.model.seq_len
    bound = ctx.reshard.memory_bound_bytes()
    peak = 0
    for step in range(start_step, job.training.steps):
        t0 = time.perf_counter()
        local, stats, norm = train_step(rt, step)
        loss = global_loss(rt, local) if rt.module.is_last else math.nan
        seconds = time.perf_counter() - t0
        step_seconds.append(seconds)
        comm = rt.transport.collect_seconds()
        total.merge_step(stats)
        if rt.module.is_last:
            losses.append(loss)
        if not math.isnan(norm):
            norms.append(norm)
            ctx.events.emit(GradientNorm(rt.stage, step + 1, norm))
        ctx.events.emit(StepFinished(rt.stage, step + 1, seconds, tokens, loss))
        bubble = min(1.0, max(0.0, 1.0 - stats.compute_s / seconds)) if seconds > 0 else 0.0
        overlap = min(1.0, max(0.0, 1.0 - stats.wait_s / comm)) if comm > 0 else 0.0
        ctx.events.emit(PipelineFractions(rt.stage, bubble, overlap))
        step_peak = ctx.reshard.engine.memory.reset_peak()
        peak = max(peak, step_peak)
        ctx.events.emit(PayloadMemory(rt.stage, step_peak, bound))
        _maybe_evaluate(ctx, rt, step + 1, val_losses)
        _save(ctx, rt, step + 1)
        if step == start_step:  # what outlives the first step (model, optimizer, plan, engine) lives as long as
            gc.freeze()  # the job: the collector's full passes skip it (meshjob_trainer.launch: each was a stall)
    gc.unfreeze()  # the caller's objects are its collector's again (in-process tests call this function)
    ctx.reshard.close()  # the last forwards of a chain may still be on their way to a peer
    return TrainResult(
        rank=ctx.rank,
        stage=rt.stage,
        losses=losses,
        params=local_shards(rt.module),
        stats=total,
        start_step=start_step,
        steps=job.training.steps,
        comm_s=rt.transport.comm_s,
        step_seconds=step_seconds,
        val_losses=val_losses,
        grad_norms=norms,
        payload_peak_bytes=peak,
        payload_bound_bytes=bound,
    )


def _maybe_evaluate(ctx: WorkerContext, rt: StageRuntime, steps_done: int, val_losses: list[tuple[int, float]]) -> None:
    every = rt.job.training.eval_every
    if every <= 0 or steps_done % every:
        return
    loss = evaluate(rt)
    ctx.events.emit(Evaluated(rt.stage, steps_done, loss))
    if rt.module.is_last:
        val_losses.append((steps_done, loss))


def train_rank(
    env: WorkerEnv,
    job: TrainingJob,
    schedules: dict[int, Sequence[Action]] | None = None,
    timeout_s: float = 60.0,
    checkpoint_dir: str | None = None,
    events: MetricsSink | None = None,
    compute: ComputeMode = REAL,
    plan: Plan | None = None,
) -> TrainResult:
    """One rank of a local run without the worker's extras (no metrics, no pod status): join the
    process group, build the plan (optionally with other action lists), train, leave; its events go
    to `events` (a MetricsSink) when given; `compute` a meshjob.costs.devices.ComputeMode; `plan` the plan to run
    (default: build_plan(job)). For tests and benchmarks that launch ranks with
    meshjob_trainer.launch."""
    plan = plan or build_plan(job)
    if schedules is not None:
        plan = dataclasses.replace(plan, schedules={s: tuple(a) for s, a in schedules.items()})
    backend = init_distributed(env, timeout_s=timeout_s, expected_world_size=plan.placement.world_size)
    device = device_for_backend(backend)
    try:
        checkpoints = (
            None
            if checkpoint_dir is None or compute.emulated
            else Checkpointer(Path(checkpoint_dir), env.rank, env.world_size, spec_fingerprint(job, env.world_size))
        )
        ctx = WorkerContext(
            env=env,
            job=job,
            plan=plan,
            stage=plan.placement.stage_of(env.rank),
            reshard=ReshardExecutor(plan, env.rank, events, device=device),
            checkpoints=checkpoints,
            device=device,
            compute=compute,
            **({} if events is None else {"events": events}),
        )
        return train(ctx)
    finally:
        shutdown_distributed()
