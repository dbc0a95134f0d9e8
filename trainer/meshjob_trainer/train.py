"""The training loop of one rank: build its stage, run the plan's action list every step,
reduce gradients, step the optimizer, report, checkpoint.

Loss convention: each microbatch's loss is the token cross-entropy SUM of the rank's rows times
1 / (tokens of the global batch), so the sum over microbatches and data-parallel ranks is the
global-batch mean (what the single-process reference reports), and gradients add up exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshjob.boundary import BoundaryKey
from meshjob_trainer.data import Batch, BigramData
from meshjob_trainer.events import CheckpointRestored, CheckpointWritten, PipelineFractions, StepFinished
from meshjob_trainer.model import StageModule, local_shards
from meshjob_trainer.parallel import ShardInfo, StageGroups, build_groups, reduce_gradients
from meshjob_trainer.pipeline import Handle, PipelineExecutor, StageStats
from meshjob_trainer.reference import make_optimizer
from meshjob_trainer.reshard import ReshardExecutor


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


class ReshardTransport:
    """pipeline.Transport over the rank's ReshardExecutor, timing the transfers it started."""

    def __init__(self, reshard: ReshardExecutor):
        self.reshard = reshard
        self.comm_s = 0.0
        self._handles: list[Any] = []

    def start(self, key: BoundaryKey, mb: int, local: torch.Tensor | None) -> Handle:
        handle = self.reshard.start(key, mb, local)
        self._handles.append(handle)
        return handle

    def collect_seconds(self) -> float:
        """Transfer wall time of the handles started since the last call (all already waited)."""
        seconds = sum(h.stats.seconds for h in self._handles if getattr(h, "stats", None) is not None)
        self._handles = []
        self.comm_s += seconds
        return seconds


def check_edges(module: StageModule, stage: int, edges: Sequence[Any]) -> None:
    """The plan's edges must carry exactly the tensors this stage's layers consume and produce."""
    incoming = sorted(e.tensor for e in edges if e.dst == stage)
    outgoing = sorted({e.tensor for e in edges if e.src == stage})
    want_in = sorted(n for n in module.input_names() if n != "tokens")
    want_out = sorted(n for n in module.output_names() if n != "loss")
    if incoming != want_in or outgoing != want_out:
        raise ValueError(
            f"spec.edges: stage {stage} receives {incoming} and sends {outgoing}, but its layers "
            f"[{module.first}, {module.last}) of the {module.config.kind} model need inputs {want_in} "
            f"and outputs {want_out}")


@dataclass
class StageRuntime:
    """Everything one rank builds once before the first step."""

    stage: int
    module: StageModule
    groups: StageGroups
    optimizer: torch.optim.Optimizer
    executor: PipelineExecutor
    transport: ReshardTransport
    data: BigramData
    microbatches: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def build_runtime(ctx: Any) -> StageRuntime:
    job, plan, stage = ctx.job, ctx.plan, ctx.stage
    torch.manual_seed(job.training.seed)
    meshes = [plan.mesh(s) for s in range(len(job.stages))]
    groups = build_groups(job.stages, meshes, ctx.rank)  # collective: all ranks, same order
    config = job.model
    first, last = job.stages[stage].layers
    # weights are created on the CPU from the seed (identical everywhere), then moved
    module = StageModule(config, first, last, job.training.seed, groups.tp).to(ctx.device)
    check_edges(module, stage, job.edges)
    optimizer = make_optimizer(module.parameters(), job.training.learning_rate)
    transport = ReshardTransport(ctx.reshard)
    tokens = job.training.global_batch * config.seq_len
    executor = PipelineExecutor(stage, module, plan.schedules[stage], transport, loss_scale=1.0 / tokens)
    data = BigramData(config.vocab, config.seq_len, job.training.global_batch, job.training.seed)
    return StageRuntime(stage, module, groups, optimizer, executor, transport, data, job.training.microbatches,
                        torch.device(ctx.device))


def global_loss(rt: StageRuntime, local: float) -> float:
    """The last stage's data-parallel ranks each hold part of the global-batch mean: add them."""
    value = torch.tensor([local], dtype=torch.float64, device=rt.device)
    if rt.groups.dp_group is not None:
        dist.all_reduce(value, group=rt.groups.dp_group)
    return float(value.item())


def train_step(rt: StageRuntime, step: int) -> tuple[float, StageStats]:
    rt.optimizer.zero_grad(set_to_none=True)
    dp = rt.groups

    def local_batch(mb: int) -> Batch:
        batch = rt.data.microbatch(step, mb, rt.microbatches, dp.dp_rank, dp.dp_size)
        return Batch(batch.tokens.to(rt.device), batch.targets.to(rt.device))

    local, stats = rt.executor.run_step(local_batch)
    reduce_gradients(rt.module.parameters(), rt.groups, rt.module.tied_weight())
    rt.optimizer.step()
    return local, stats


def _restore(ctx: Any, rt: StageRuntime) -> int:
    """The step to start from: after the newest complete checkpoint, else 0."""
    if ctx.checkpoints is None:
        return 0
    restored = ctx.checkpoints.restore(rt.module, rt.optimizer)
    if restored is None:
        return 0
    ctx.events.emit(CheckpointRestored(rt.stage, int(restored)))
    return int(restored)


def _save(ctx: Any, rt: StageRuntime, steps_done: int) -> None:
    every = ctx.job.training.checkpoint.every
    if ctx.checkpoints is None or every <= 0 or steps_done % every:
        return
    start = time.perf_counter()
    ctx.checkpoints.save(steps_done, rt.module, rt.optimizer)
    ctx.events.emit(CheckpointWritten(rt.stage, steps_done, time.perf_counter() - start))


def train(ctx: Any) -> TrainResult:
    """Run the job's training steps on this rank (ctx: meshjob_trainer.dist.WorkerContext)."""
    rt = build_runtime(ctx)
    job = ctx.job
    start_step = _restore(ctx, rt)
    total = StageStats(rt.stage)
    losses: list[float] = []
    step_seconds: list[float] = []
    tokens = job.training.global_batch * job.model.seq_len
    for step in range(start_step, job.training.steps):
        t0 = time.perf_counter()
        local, stats = train_step(rt, step)
        loss = global_loss(rt, local) if rt.module.is_last else math.nan
        seconds = time.perf_counter() - t0
        step_seconds.append(seconds)
        comm = rt.transport.collect_seconds()
        total.merge_step(stats)
        if rt.module.is_last:
            losses.append(loss)
        ctx.events.emit(StepFinished(rt.stage, step + 1, seconds, tokens, loss))
        bubble = min(1.0, max(0.0, 1.0 - stats.compute_s / seconds)) if seconds > 0 else 0.0
        overlap = min(1.0, max(0.0, 1.0 - stats.wait_s / comm)) if comm > 0 else 0.0
        ctx.events.emit(PipelineFractions(rt.stage, bubble, overlap))
        _save(ctx, rt, step + 1)
    return TrainResult(ctx.rank, rt.stage, losses, local_shards(rt.module), total, start_step,
                       job.training.steps, rt.transport.comm_s, step_seconds)


def train_rank(env: Any, job: Any, schedules: dict[int, Sequence[Any]] | None = None,
               timeout_s: float = 60.0, checkpoint_dir: str | None = None) -> TrainResult:
    """One rank of a local run without the worker's extras (no metrics, no pod status): join the
    process group, build the plan (optionally with other action lists), train, leave.
    For tests and benchmarks that launch ranks with meshjob_trainer.launch."""
    import dataclasses

    from meshjob.plan import build_plan
    from meshjob_trainer.checkpoint import Checkpointer, spec_fingerprint
    from meshjob_trainer.dist import WorkerContext, device_for_backend, init_distributed, shutdown_distributed

    plan = build_plan(job)
    if schedules is not None:
        plan = dataclasses.replace(plan, schedules={s: tuple(a) for s, a in schedules.items()})
    backend = init_distributed(env, timeout_s=timeout_s, expected_world_size=plan.placement.world_size)
    device = device_for_backend(backend)
    try:
        checkpoints = None if checkpoint_dir is None else Checkpointer(
            checkpoint_dir, env.rank, env.world_size, spec_fingerprint(job, env.world_size))
        ctx = WorkerContext(env=env, job=job, plan=plan, stage=plan.placement.stage_of(env.rank),
                            reshard=ReshardExecutor(plan, env.rank, device=device), checkpoints=checkpoints,
                            device=device)
        return train(ctx)
    finally:
        shutdown_distributed()
