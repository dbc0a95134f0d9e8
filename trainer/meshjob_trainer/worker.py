"""One trainer rank from start to finish, and one host's worth of ranks.

load_setup(settings): read the job and build its Plan; with the operator's rendered plan
(settings.plan_path) from exactly the inputs it rendered, refusing to run a plan whose digest differs.
run_worker(env, settings, setup): join the process group, check that every rank holds the same plan,
calibrate it (weightGradDelay: auto: measured stage costs, agreed by all ranks, re-planned and checked
again), assemble the WorkerContext and hand it to the training loop (meshjob_trainer.train.train).
run_host(...): fork the ranks the plan puts on one host, like torchrun --nproc-per-node.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import ComputeMode
from meshjob.plan import rendered
from meshjob.plan.build import Plan
from meshjob.plan.placement import load_hosts
from meshjob.schedule.actions import peak_stashed, stash_bound
from meshjob.spec.api import MASTER_PORT
from meshjob.spec.manifest import TrainingJob, load_job
from meshjob_trainer.checkpoint import Checkpointer, spec_fingerprint
from meshjob_trainer.dist import (
    DEFAULT_TIMEOUT_S,
    DistError,
    NodeEnv,
    WorkerContext,
    WorkerEnv,
    WorkerSettings,
    check_world_size,
    describe_transport,
    device_for_backend,
    init_distributed,
    shutdown_distributed,
    uses_cuda,
)
from meshjob_trainer.events import Fanout, MetricsSink, WeightDelay
from meshjob_trainer.heap import keep_freed_memory
from meshjob_trainer.launch import LaunchResult, RankContext, launch
from meshjob_trainer.metrics import TrainerMetrics
from meshjob_trainer.steplog import StepLog, print_line

if TYPE_CHECKING:  # it imports torch, which this module must not load (the CLI imports it before torch)
    from meshjob_trainer.train import TrainResult


@dataclass(frozen=True)
class RankSummary:
    """What a rank hands back to its host's launcher: the end of its run, not its tensors."""

    rank: int
    stage: int
    step: int  # steps done when it ended
    loss: float | None  # the last step's loss (ranks of the last stage; else None)


def summarize(result: TrainResult) -> RankSummary:
    return RankSummary(
        rank=result.rank,
        stage=result.stage,
        step=result.start_step + len(result.step_seconds),
        loss=result.losses[-1] if result.losses else None,
    )


def host_summary(ranks: Sequence[RankSummary]) -> dict[str, float | int]:
    """One host's end of training, as its pod's termination message says it: the step all its ranks
    reached and, where the host holds last-stage ranks, the final loss."""
    out: dict[str, float | int] = {"step": min(r.step for r in ranks)}
    losses = [r.loss for r in ranks if r.loss is not None]
    if losses:
        out["loss"] = losses[0]  # every last-stage rank holds the same global-batch mean
    return out


@dataclass(frozen=True)
class JobSetup:
    job: TrainingJob
    plan: Plan


def load_setup(settings: WorkerSettings) -> JobSetup:
    """Parse the job and check what it reads here (SpecError names bad fields: the manifest, its token
    files, its custom model) and build its plan; DistError when the plan is not the one the operator
    rendered, or the rendered plan it names is missing."""
    from meshjob_trainer.families import check_inputs  # torch: this module loads with the CLI, before torch

    if not settings.job_path:
        raise DistError("no job: pass --job job.yaml or set MESHJOB_JOB")
    if not settings.plan_path:
        hosts = load_hosts(settings.hosts_path) if settings.hosts_path else None
        inputs = rendered.PlanInputs.of(load_job(settings.job_path), hosts)
        check_inputs(inputs.job)  # SpecError: the token files or the custom model, before any rank starts
        return JobSetup(inputs.job, inputs.build())
    try:
        inputs, expected = rendered.load(settings.job_path, settings.hosts_path, settings.plan_path)
        check_inputs(inputs.job)
        plan = inputs.build()
        expected.check(plan)
    except rendered.PlanMismatch as err:
        raise DistError(str(err)) from err
    return JobSetup(inputs.job, plan)


def agree_on_plan(plan: Plan, rank: int) -> None:
    """Every rank must run the same plan (a time-budgeted balancer could differ between ranks)."""
    import torch.distributed as dist  # torch only in a rank: this module loads with the CLI, before torch

    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, plan.digest())
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise DistError(
            f"rank {rank}: ranks {differing} built a different plan than rank 0 from the same spec; "
            f"use a deterministic balancer (spec.resharding.balancer: greedy or load_balance)"
        )


def calibrated(
    setup: JobSetup, rank: int, device: str, events: MetricsSink, compute: ComputeMode | None = None
) -> JobSetup:
    """weightGradDelay auto: every rank profiles its stage, all agree on the figures and re-plan
    (meshjob_trainer.calibrate), and check that they hold the same plan; under emulated compute the
    device profile's modelled costs are the figures (nothing to profile). Then the delay each stage runs
    with is reported (an event; rank 0 also prints every stage's). Collective."""
    # torch: this module loads with the CLI, before torch
    from meshjob_trainer.calibrate import calibrate, calibrated_plan, needs_calibration

    if needs_calibration(setup.plan):
        if compute is not None and compute.emulated:
            if compute.device is None:
                raise DistError("emulated compute needs a device profile (meshjob.costs.devices.parse_compute)")
            from meshjob_trainer.flops import job_layer

            plan = calibrated_plan(setup.plan, emulated_costs(setup.job, compute.device, job_layer(setup.job)))
        else:
            plan = calibrate(setup.plan, rank, device)
        agree_on_plan(plan, rank)
        setup = JobSetup(setup.job, plan)
    delays = weight_delays(setup.plan)
    stage = setup.plan.placement.stage_of(rank)
    events.emit(delays[stage])
    if rank == 0:
        print(describe_delays(setup.plan, delays), file=sys.stderr, flush=True)
    return setup


def weight_delays(plan: Plan) -> dict[int, WeightDelay]:
    """Per stage, the WeightDelay event of `plan`."""
    peaks = peak_stashed(plan.schedules)
    bound = stash_bound(len(plan.job.stages), plan.job.training.microbatches)
    return {
        s: WeightDelay(
            stage=s,
            delay=plan.weight_delay.get(s, 0),
            forward_s=c.forward_s,
            input_grad_s=c.input_grad_s,
            weight_grad_s=c.weight_grad_s,
            peak_stash=peaks[s],
            stash_bound=bound,
            measured=plan.costs_measured,
        )
        for s, c in sorted(plan.stage_costs.items())
    }


def describe_delays(plan: Plan, delays: dict[int, WeightDelay]) -> str:
    """One line for the log: how the delays were sized, and each stage's delay, W time and peak stash."""
    how = "measured at start" if plan.costs_measured else "planner's formula"
    stages = "; ".join(
        f"stage {s}: delay {d.delay} (W {d.weight_grad_s * 1e3:.3g} ms, peak stash {d.peak_stash})"
        for s, d in delays.items()
    )
    mode = plan.job.schedule.weight_grad_delay
    bound = next(iter(delays.values())).stash_bound if delays else 0
    return f"meshjob: weightGradDelay {mode} (costs: {how}, stash bound {bound}): {stages}"


def serve_metrics(env: WorkerEnv, settings: WorkerSettings, setup: JobSetup) -> TrainerMetrics:
    """This rank's Prometheus exporter, serving on MESHJOB_METRICS_PORT + LOCAL_RANK when that is set."""
    job, plan = setup.job, setup.plan
    host = plan.placement.hosts[plan.placement.host_of(env.rank)].name
    metrics = TrainerMetrics(
        job=job.name, rank=env.rank, host=host, stage=plan.placement.stage_of(env.rank), namespace=job.namespace
    )
    metrics.set_info(
        job.resharding.strategy,
        job.schedule.kind,
        job.resharding.balancer,
        ",".join("x".join(map(str, s.mesh)) for s in job.stages),
    )
    if settings.metrics_port is not None:  # ranks sharing a pod (or a machine) take consecutive ports
        port = settings.metrics_port + env.local_rank
        try:
            metrics.serve(port)
        except (OSError, ValueError) as err:
            raise DistError(
                f"rank {env.rank}: cannot serve metrics on port {port} (MESHJOB_METRICS_PORT="
                f"{settings.metrics_port} + LOCAL_RANK={env.local_rank}): {err}"
            ) from err
    return metrics


def make_context(
    env: WorkerEnv, settings: WorkerSettings, setup: JobSetup, events: MetricsSink, device: str = "cpu"
) -> WorkerContext:
    from meshjob_trainer.reshard import ReshardExecutor  # torch: this module loads with the CLI, before torch

    job, plan = setup.job, setup.plan
    directory = settings.checkpoint_dir or job.training.checkpoint.path
    if settings.compute is not None and settings.compute.emulated:
        directory = ""  # emulated compute holds no weights: nothing to checkpoint
    checkpoints = (
        Checkpointer(Path(directory), env.rank, env.world_size, spec_fingerprint(job, env.world_size))
        if directory
        else None
    )
    reshard = ReshardExecutor(plan, env.rank, events, device=device)
    return WorkerContext(
        env=env,
        job=job,
        plan=plan,
        stage=plan.placement.stage_of(env.rank),
        reshard=reshard,
        events=events,
        checkpoints=checkpoints,
        device=device,
        compute=settings.compute,
    )


def run_worker(
    env: WorkerEnv,
    settings: WorkerSettings,
    setup: JobSetup,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    listeners: Sequence[MetricsSink] = (),
) -> TrainResult:
    """One rank: returns what the training loop returns (meshjob_trainer.train.TrainResult). Its events
    go to its Prometheus exporter, to a log line per step (the first rank of each stage, with
    settings.step_log) and to `listeners`."""
    from meshjob_trainer.train import train  # torch: this module loads with the CLI, before torch

    check_world_size(env, setup.plan.placement.world_size, setup.job.name)
    keep_freed_memory()  # each step reuses the last one's tensor pages (meshjob_trainer.heap)
    backend = init_distributed(env, timeout_s)
    metrics = None
    try:
        if env.local_rank == 0:
            print_line(describe_transport(env, backend, _gpus(backend)))
        agree_on_plan(setup.plan, env.rank)
        metrics = serve_metrics(env, settings, setup)
        placement = setup.plan.placement
        logs = settings.step_log and placement.stage_ranks(placement.stage_of(env.rank))[0] == env.rank
        events = Fanout((metrics, *([StepLog(setup.job.training.steps)] if logs else []), *listeners))
        device = device_for_backend(backend)
        setup = calibrated(setup, env.rank, device, events, settings.compute)
        return train(make_context(env, settings, setup, events, device))
    finally:
        if metrics is not None:
            metrics.close()
        shutdown_distributed()


def _gpus(backend: str) -> int:
    if not uses_cuda(backend):
        return 0
    import torch  # torch only in a rank: this module loads with the CLI, before torch

    return torch.cuda.device_count()


def host_ranks(plan: Plan, node_rank: int) -> tuple[int, ...]:
    """Global ranks on the node_rank-th host the job uses (the operator's pod index)."""
    used = plan.placement.hosts_used()
    if not 0 <= node_rank < len(used):
        raise DistError(
            f"--node-rank {node_rank} is invalid: the job uses {len(used)} host(s), node ranks 0..{len(used) - 1}"
        )
    return tuple(plan.placement.ranks_on(used[node_rank]))


def run_host(
    setup: JobSetup,
    settings: WorkerSettings,
    node: NodeEnv,
    nproc: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pre_exec: Callable[[int], None] | None = None,
) -> LaunchResult:
    """Fork this host's ranks (meshjob_trainer.launch) and wait; returns the LaunchResult."""
    ranks: Sequence[int] = host_ranks(setup.plan, node.node_rank)
    if nproc is not None and nproc != len(ranks):
        raise DistError(
            f"--nproc {nproc} is invalid: the plan puts {len(ranks)} rank(s) {list(ranks)} on "
            f"node rank {node.node_rank}"
        )
    world_size = setup.plan.placement.world_size
    if node.world_size is not None:
        check_world_size(WorkerEnv(rank=0, world_size=node.world_size), world_size, setup.job.name)
    single_host = len(setup.plan.placement.hosts_used()) == 1
    port = node.master_port or (None if single_host else MASTER_PORT)  # one host: any free port will do

    def target(ctx: RankContext) -> RankSummary:
        return summarize(run_worker(ctx.env, settings, setup, timeout_s))  # its tensors stay in the child

    return launch(
        world_size,
        target,
        ranks=ranks,
        master_addr=node.master_addr,
        master_port=port,
        node_rank=node.node_rank,
        pre_exec=pre_exec,
    )
