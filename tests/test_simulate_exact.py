"""The pipeline simulator against a straightforward reference (tests/pipeline_reference.py) on generated
small jobs: every time identical, not approximately; and the work a step and its period take."""

from __future__ import annotations

import random

import pipeline_reference as reference
import pytest

from meshjob.costs.compute import CostModel
from meshjob.network.model import NetworkModel
from meshjob.plan.comm_order import need_order
from meshjob.schedule.actions import generate
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate import steady
from meshjob.simulate.simulator import PipelineRun, TransferCost, simulate_pipeline
from meshjob.simulate.steady import steady_period_s, step_and_period

CASES = 60


def generated_job(seed: int) -> tuple:
    """Schedules (chain or with a skip edge), compute costs with ties, transfers over a few hosts' NIC links
    (some paced, some on no link), a network with or without a token bucket, full or half duplex."""
    rng = random.Random(seed)
    stages, microbatches = rng.randint(1, 5), rng.randint(1, 6)
    edges = [(i, i + 1, "activation") for i in range(stages - 1)]
    if stages >= 3 and rng.random() < 0.4:
        edges.append((0, stages - 1, "skip0"))
    kind = rng.choice(["gpipe", "1f1b", "eager-1f1b"])
    split = kind == "eager-1f1b" and rng.random() < 0.7
    delays = {s: rng.randint(0, 2) for s in range(stages)} if split else None
    try:
        schedules = generate(kind, stages, microbatches, edges, split, delays)
    except ValueError:  # a delay the schedule does not allow
        schedules = generate(kind, stages, microbatches, edges, split)
    ties = [0.5, 1.0, 1.0, 2.0]  # equal times: the tie rules must agree too
    compute = {
        (s, k): rng.choice(ties) if rng.random() < 0.5 else rng.uniform(0.1, 2.0) for s in range(stages) for k in "FBIW"
    }
    duplex = rng.choice(["full", "full", "half"])
    network = NetworkModel(
        nic_bytes_per_s=rng.choice([1e6, 3e6]),
        burst_bytes=rng.choice([0.0, 0.0, 2e5, 1e6]),
        duplex=duplex,
    )
    hosts = rng.randint(1, 6)
    keys = {BoundaryKey(src, dst, tensor) for src, dst, tensor in edges}
    keys |= {k.backward() for k in keys}
    transfers: dict = {}
    for key in sorted(keys):
        per_link = {}
        for _ in range(rng.randint(0, 4)):  # on no link: intra-host only
            side = rng.choice(["out", "in"])
            per_link[network.link(rng.randrange(hosts), side)] = rng.choice([1e5, 5e5, rng.uniform(1e4, 2e6)])
        seconds = max(per_link.values(), default=0.0) / network.nic_bytes_per_s + rng.choice([0.0, 0.01, 0.3])
        early = rng.choice([None, None, 0.0, 0.05]) if per_link else None
        transfers[key] = TransferCost(seconds, per_link, early) if rng.random() < 0.8 else (seconds, per_link)
    return schedules, compute, transfers, CostModel(network=network), microbatches, rng


def orders(schedules, compute, transfers, cost) -> list:
    """None (as sent), the send order, the need orders of both tie rules, and a shuffled one (may deadlock)."""
    run = reference.simulate_pipeline(schedules, compute, transfers, cost)
    sent = [(BoundaryKey.of_action(s, a), a.mb) for s, a in run.order if a.kind.startswith("SEND")]
    shuffled = list(sent)
    random.Random(len(sent)).shuffle(shuffled)
    return [None, sent, need_order(run, "sent"), need_order(run, "used"), shuffled]


def outcome(f, *args):
    """f(*args), or the error's type: both sides must deadlock alike."""
    try:
        return f(*args)
    except ValueError:
        return ValueError


@pytest.mark.parametrize("seed", range(CASES))
def test_every_simulated_time_equals_the_reference(seed):
    schedules, compute, transfers, cost, microbatches, rng = generated_job(seed)
    for order in orders(schedules, compute, transfers, cost):
        expected = outcome(reference.simulate_pipeline, schedules, compute, transfers, cost, order)
        got = outcome(simulate_pipeline, schedules, compute, transfers, cost, order)
        if expected is ValueError:
            assert got is ValueError
            continue
        assert got.step_s == expected.step_s
        assert got.stages == expected.stages  # compute, busy, comm and exposed seconds, every timeline
        assert (got.order, got.started_s, got.transfer_s) == (expected.order, expected.started_s, expected.transfer_s)


@pytest.mark.parametrize("seed", range(CASES))
def test_the_step_and_the_period_run_on_equal_the_reference_run_from_scratch(seed):
    schedules, compute, transfers, cost, microbatches, rng = generated_job(seed)
    tail = {s: rng.choice([0.0, 0.25, 1.0]) for s in schedules}
    for order in orders(schedules, compute, transfers, cost):
        args = (schedules, compute, transfers, cost, microbatches, order, tail)
        expected, got = outcome(reference.steady_period_s, *args), outcome(steady_period_s, *args)
        assert got == expected
        if order is None or expected is ValueError:
            continue
        one, period = step_and_period(schedules, compute, transfers, cost, microbatches, order, tail)
        alone = reference.simulate_pipeline(schedules, compute, transfers, cost, order)
        assert (one.step_s, one.stages, one.order, one.started_s) == (
            alone.step_s,
            alone.stages,
            alone.order,
            alone.started_s,
        )
        assert period == expected


def test_a_step_and_its_period_take_the_work_of_the_period_alone(monkeypatch):
    """The steady period runs on from the step's run, not from scratch: three steps' bookings for the
    step and the period together, each transfer booked once per step."""
    schedules, compute, transfers, cost, microbatches, _ = generated_job(3)
    stages = {s: a for s, a in schedules.items()}
    runs: list[PipelineRun] = []

    class Counted(PipelineRun):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self)

    monkeypatch.setattr(steady, "PipelineRun", Counted)
    order = orders(schedules, compute, transfers, cost)[1]
    step_and_period(schedules, compute, transfers, cost, microbatches, order)
    actions = sum(len(a) for a in stages.values())
    assert len(runs) == 1
    assert len(runs[0].order) == steady.STEADY_STEPS * actions  # every action run once per step
    assert runs[0].bookings == steady.STEADY_STEPS * len(order)  # every transfer booked once per step


@pytest.mark.parametrize("example", ["gpt-demo", "utransformer-demo"])
def test_a_plans_step_and_period_from_one_run_equal_the_reference(example):
    from pathlib import Path

    from meshjob.plan.build import build_plan
    from meshjob.simulate.simulator import compute_costs, simulate_plan, transfer_costs
    from meshjob.simulate.steady import plan_step_and_period
    from meshjob.spec.manifest import load_job

    plan = build_plan(load_job(Path(__file__).parents[1] / "examples" / f"{example}.yaml"))
    cost = CostModel(network=plan.network)
    tail = {s: 1e-3 * (s + 1) for s in plan.schedules}
    one, period = plan_step_and_period(plan, cost, tail)
    args = (plan.schedules, compute_costs(plan, cost), transfer_costs(plan, cost), cost)
    order = plan.transfer_order.transfers
    alone = reference.simulate_pipeline(*args, order)
    assert (one.step_s, one.stages, one.order) == (alone.step_s, alone.stages, alone.order)
    assert one.step_s == simulate_plan(plan, cost).step_s
    assert period == reference.steady_period_s(*args, plan.job.training.microbatches, order, tail)
