"""A written job's step on a cluster, the one model `meshjob tune` ranks plans by and `meshjob simulate` reports
for a tuned manifest: the job's plan (meshjob.plan.build) simulated with each stage's compute from the search's
stage model (meshjob.search.stage_model: the device's roofline, tensor-parallel all-reduces, recompute), in the
plan's transfer order, then each stage's tail (meshjob.search.gradient_sync: its gradient all-reduce, sharing
NICs with the other stages' on the same hosts, then its optimizer step). step = the last tail's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshjob.costs.compute import CostModel
from meshjob.network.model import NetworkModel
from meshjob.plan.build import Plan, build_plan
from meshjob.search.cluster import Cluster
from meshjob.search.gradient_sync import stage_hosts, tail_ends
from meshjob.search.stage_model import StageFigures, job_figures
from meshjob.simulate.simulator import PipelineResult, simulate_plan
from meshjob.spec.model import TrainingJob


@dataclass(frozen=True)
class JobStep:
    plan: Plan
    pipeline: PipelineResult  # one step from an empty pipeline, up to each stage's last action
    figures: tuple[StageFigures, ...]
    ends: tuple[float, ...]  # per stage: when its tail (gradient all-reduce, optimizer step) ends

    @property
    def step_s(self) -> float:
        return max(self.ends)

    @property
    def cost(self) -> CostModel:
        return job_cost(self.plan.network, self.figures)


def job_cost(network: NetworkModel, figures: Sequence[StageFigures]) -> CostModel:
    """The CostModel the plan is built and simulated with: the stage model's F, I, W per stage."""
    return CostModel(network=network, stages=tuple(f.cost for f in figures), measured=True)


def job_step(
    job: TrainingJob,
    cluster: Cluster,
    figures: Sequence[StageFigures] | None = None,
    simulate_delays: bool = True,
) -> JobStep:
    """`job`'s step on `cluster`'s hosts (`figures`: the stages' figures when the caller has them;
    `simulate_delays` False: an auto weight delay by the ratio rule alone, as meshjob.plan.build allows).
    Raises meshjob.errors.PlacementError when the hosts cannot hold the job."""
    figs = tuple(job_figures(job, cluster) if figures is None else figures)
    cost = job_cost(cluster.network, figs)
    plan = build_plan(job, cluster.host_list(), network=cluster.network, cost=cost, simulate_delays=simulate_delays)
    result = simulate_plan(plan, cost)
    starts = [result.stages[k].busy_until_s for k in range(len(figs))]
    ends = tail_ends(starts, [f.sync for f in figs], stage_hosts(plan.placement))
    return JobStep(plan, result, figs, tuple(ends))
