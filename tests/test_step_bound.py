"""The step bound: no schedule of a plan's transfers and compute finishes a step sooner."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import parse_device
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan
from meshjob.simulate.simulator import simulate_plan
from meshjob.simulate.step_bound import single_link_bound, step_bound
from meshjob.spec.manifest import parse_job

KINDS = [("1f1b", 0), ("eager-1f1b", 0), ("eager-1f1b", "auto")]


def subsets_bound(jobs: list[tuple[float, float, float]]) -> float:
    """Carlier: the preemptive one-machine optimum is the largest min head + total time + min tail of a subset."""
    return max(
        min(j[0] for j in s) + sum(j[1] for j in s) + min(j[2] for j in s)
        for n in range(1, len(jobs) + 1)
        for s in itertools.combinations(jobs, n)
    )


def pipeline_job(model: str, stages: int, kind: str, delay: Any) -> Any:
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": f"bound-{model}"},
            "spec": {
                "model": {"kind": model, "layers": 2 * stages, "hidden": 256, "heads": 8, "vocab": 256, "seqLen": 64},
                "training": {"globalBatch": 8, "microbatches": 8},
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [2 * i, 2 * i + 2], "mesh": [1, 1]} for i in range(stages)],
                "schedule": {"kind": kind, "weightGradDelay": delay},
            },
        }
    )


def cost_at(job: Any, nic_bytes_per_s: float) -> CostModel:
    return CostModel(
        network=NetworkModel(nic_bytes_per_s=nic_bytes_per_s),
        stages=emulated_costs(job, parse_device("1")),
        measured=True,
    )


def test_one_link_bound_is_the_best_subset_of_heads_bytes_and_tails() -> None:
    rng = random.Random(7)
    for _ in range(200):
        jobs = [(rng.uniform(0, 5), rng.uniform(0.1, 2), rng.uniform(0, 5)) for _ in range(rng.randint(1, 6))]
        assert single_link_bound(jobs) == pytest.approx(subsets_bound(jobs))


@pytest.mark.parametrize("model", ["gpt", "utransformer"])
@pytest.mark.parametrize("kind,delay", KINDS)
def test_no_simulated_schedule_beats_the_bound(model: str, kind: str, delay: Any) -> None:
    for rate in (2e6, 2e7, 2e8):  # communication from several times compute to a small share of it
        job = pipeline_job(model, 4, kind, delay)
        cost = cost_at(job, rate)
        plan = build_plan(job, cost=cost, network=cost.network)
        bound = step_bound(plan, cost)
        assert bound is not None and bound.link is not None
        assert bound.step_s <= simulate_plan(plan, cost).step_s * (1 + 1e-9)


def test_heavy_communication_bounds_the_step_above_the_communication_free_one() -> None:
    job = pipeline_job("utransformer", 4, "eager-1f1b", "auto")
    cost = cost_at(job, 2e6)
    free = simulate_plan(
        build_plan(job, cost=cost_at(job, 1e15), network=cost_at(job, 1e15).network), cost_at(job, 1e15)
    ).step_s
    bound = step_bound(build_plan(job, cost=cost, network=cost.network), cost)
    assert bound is not None and bound.step_s > 1.2 * free


def test_each_stage_optimizer_step_lengthens_the_bound() -> None:
    job = pipeline_job("gpt", 4, "eager-1f1b", 0)
    cost = cost_at(job, 2e7)
    plan = build_plan(job, cost=cost, network=cost.network)
    plain, with_optimizer = step_bound(plan, cost), step_bound(plan, cost, [0.5] * 4)
    assert plain is not None and with_optimizer is not None
    assert with_optimizer.step_s == pytest.approx(plain.step_s + 0.5)
