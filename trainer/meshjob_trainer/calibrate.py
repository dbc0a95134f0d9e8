"""Compute costs measured on this machine: for the planner's formula, and per stage at the start of a run.

measure_costs(job): the whole model as one stage in this process (no distribution): forward seconds per
layer and sample, and backward over forward; `meshjob plan|simulate --calibrate` feed them to the plan.

calibrate(plan, rank, device): what a run plans its weight-gradient delay with (weightGradDelay: auto).
Every rank profiles its own stage (forward, input gradient and weight gradient of a few microbatches,
through the pipeline executor itself, on inputs of the stage's real shapes; tensor-parallel collectives
included, so a stage's ranks profile together), the ranks agree on one figure per stage (the slowest
rank of the stage: an all-reduce of the maximum, so every rank holds the same numbers), and every rank
re-plans with them (meshjob.plan.build: the smallest delay whose W compute covers the stage's gradient
transfers, never above the stash bound). The worker then checks that every rank built the same plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshjob.costs.compute import CostModel, StageCost
from meshjob.layout.sharding import ShardingSpec, slice_shape, tile
from meshjob.plan.build import Plan, build_plan
from meshjob.schedule.actions import stage_actions
from meshjob.schedule.boundary import BoundaryKey
from meshjob.spec.manifest import TrainingJob, natural_layout
from meshjob_trainer.data import Batch
from meshjob_trainer.families import build_stage
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.parallel import build_groups
from meshjob_trainer.pipeline import PipelineExecutor
from meshjob_trainer.step_clock import clock_for

PROFILED_MICROBATCHES = 3  # timed, after one that warms up allocators and kernels


def measure_costs(job: TrainingJob, repeats: int = 3) -> dict[str, float]:
    """{"layer_forward_s": forward seconds per layer per sample, "backward_factor": backward / forward}."""
    torch.set_num_threads(1)
    config = job.model
    module = build_stage(config, 0, config.layers, job.training.seed, numerics=Numerics(job.training.precision))
    samples = job.training.microbatch_size
    gen = torch.Generator().manual_seed(job.training.seed)
    tokens = torch.randint(config.vocab, (samples, config.seq_len), generator=gen)
    inputs = {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1)}
    forward, backward = [], []
    for i in range(repeats + 1):  # the first round warms up allocators and kernels
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = module(inputs)["loss"]
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    f, b = statistics.median(forward), statistics.median(backward)
    return {"layer_forward_s": f / (config.layers * samples), "backward_factor": b / f}


def needs_calibration(plan: Plan) -> bool:
    """Only weightGradDelay: auto reads compute costs, and only when some stage sends gradients."""
    return plan.job.schedule.weight_grad_delay == "auto" and plan.split_backward


class Arrived:
    """A transfer that is already done (a transport without peers hands these out)."""

    def __init__(self, value: torch.Tensor | None) -> None:
        self.value = value

    def result(self) -> torch.Tensor | None:
        return self.value

    def wait(self) -> torch.Tensor | None:
        return self.value


class _Synthetic:
    """A pipeline transport for profiling: receives return random tensors of the stage's natural tile
    (what resharding would deliver), sends go nowhere."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.shape, self.device = shape, device

    def start(self, key: BoundaryKey, mb: int, local: torch.Tensor | None) -> Arrived:
        return Arrived(None if local is not None else torch.randn(self.shape, device=self.device))


def natural_shape(plan: Plan, stage: int, rank: int) -> tuple[int, ...]:
    """This rank's tile of an activation in its stage's natural layout (what its stage sends and receives)."""
    mesh, shape = plan.mesh(stage), plan.job.activation_shape()
    spec = ShardingSpec.parse(natural_layout(plan.job.stages[stage]), len(shape))
    return slice_shape(tile(spec, mesh.shape, shape, mesh.index_of(rank)))


def profile_stage(
    plan: Plan, rank: int, device: torch.device | str = "cpu", microbatches: int = PROFILED_MICROBATCHES
) -> StageCost:
    """This rank's stage: median F, I and W seconds of one microbatch.
    Collective: every rank of the job calls it (process groups are created, stages profile at once)."""
    job, device = plan.job, torch.device(device)
    stage = plan.placement.stage_of(rank)
    groups = build_groups(job.stages, [plan.mesh(s) for s in range(len(job.stages))], rank)
    first, last = job.stages[stage].layers
    module = build_stage(job.model, first, last, job.training.seed, groups.tp, Numerics.of(job, stage)).to(device)
    edges = [(e.src, e.dst, e.tensor) for e in job.edges]
    n = microbatches + 1
    actions = stage_actions("gpipe", stage, len(job.stages), n, edges, True, 0)
    local = natural_shape(plan, stage, rank)
    executor = PipelineExecutor(
        stage, module, actions, _Synthetic(local, device), loss_scale=1.0, clock=clock_for(device)
    )
    gen = torch.Generator().manual_seed(job.training.seed)
    tokens = torch.randint(job.model.vocab, local[:2], generator=gen).to(device)
    _, stats = executor.run_step(lambda mb: Batch(tokens, tokens))
    seconds: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for action, start, end in stats.timeline:
        if action[0] in seconds and int(action[1:]) > 0:  # microbatch 0 warms up
            seconds[action[0]].append(end - start)
    module.zero_grad(set_to_none=True)
    return StageCost(*(statistics.median(seconds[k]) for k in ("F", "I", "W")))


def agree(cost: StageCost, stage: int, num_stages: int) -> tuple[StageCost, ...]:
    """Every stage's figures, the same on every rank: the slowest rank of each stage (all-reduce of the
    maximum over the job; a CPU tensor, so gloo carries it whatever the device)."""
    table = torch.zeros(num_stages, 3, dtype=torch.float64)
    table[stage] = torch.tensor([cost.forward_s, cost.input_grad_s, cost.weight_grad_s], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return tuple(StageCost(*(float(v) for v in row)) for row in table)


def calibrated_plan(plan: Plan, costs: Sequence[StageCost]) -> Plan:
    """The plan re-built with measured per-stage costs (only its weight-gradient delays can change)."""
    cost = CostModel(network=plan.network, stages=tuple(costs), measured=True)
    return build_plan(plan.job, plan.placement.hosts, network=plan.network, cost=cost)


def calibrate(plan: Plan, rank: int, device: torch.device | str = "cpu") -> Plan:
    """Profile this rank's stage, agree with every rank, re-plan. Collective."""
    stage = plan.placement.stage_of(rank)
    costs = agree(profile_stage(plan, rank, device), stage, len(plan.job.stages))
    return calibrated_plan(plan, costs)
