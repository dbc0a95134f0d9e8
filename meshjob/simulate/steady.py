"""The steady-state step period: a step's action lists run over and over, as a training job runs them.

meshjob.simulate.simulator runs one step from an empty pipeline. A job runs step after step, and no collective
ends a step across stages: a stage starts its next step once its own last action and optimizer step
are done, while later stages may still drain the step before. So a stage whose tail is long (the W's
it delays, most on the last stages) overlaps the next step's warm-up, in which later stages wait for
their first forward anyway; one isolated step counts that tail in full, so it overestimates a running job's
period where stages delay many W's, and can rank the delays differently (`meshjob bench pipeline` measures the
period, bench/results/pipeline.json).

`steady_period_s` repeats the lists `steps` times (each step's microbatches numbered on, so every
transfer stays distinct), with each stage's `tail_s` (its optimizer step) after its last action of
each step, and each link taking the repeated steps' transfers in the step's order. The period: over
stages, the median of (end of the last step - end of the first) / (steps - 1), the way bench pipeline
and bench e2e measure a run (per rank the mean of its steps after the first, the median over ranks).
With the step's transfer order the links follow (the plan's), the steps after the first run on from
where the first ended (meshjob.simulate.simulator.PipelineRun.extend): `step_and_period` gives the one step
and the period for the work of `steps` steps, not of 1 + `steps`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from meshjob.costs.compute import CostModel
from meshjob.schedule.actions import Action, shared_action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import (
    PipelineResult,
    PipelineRun,
    PlanView,
    TransferInput,
    compute_costs,
    transfer_costs,
)

STEADY_STEPS = 3  # the first step fills the pipeline; the two after it give the period


def repeated(
    schedules: Mapping[int, Sequence[Action]], microbatches: int, steps: int, first: int = 0
) -> dict[int, list[Action]]:
    """Each stage's list `steps` times over, step k's microbatches numbered from k * microbatches (k from
    `first`)."""
    return {
        stage: [
            shared_action(a.kind, a.mb + k * microbatches, a.peer, a.tensor)
            for k in range(first, first + steps)
            for a in actions
        ]
        for stage, actions in schedules.items()
    }


def steady_period_s(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel | None,
    microbatches: int,
    order: Sequence[tuple[BoundaryKey, int]] | None = None,
    tail_s: Mapping[int, float] | None = None,
    steps: int = STEADY_STEPS,
) -> float:
    """The period of `schedules` run `steps` times (arguments as meshjob.simulate.simulator.simulate_pipeline
    takes them; `order`: one step's transfer order; `tail_s`: per stage, seconds after each step's
    last action, e.g. its optimizer step)."""
    if order is not None:
        return step_and_period(schedules, compute_s, transfers, cost, microbatches, order, tail_s, steps)[1]
    _check(steps)
    # Without an order each link takes transfers as they are sent, a later step's maybe before an
    # earlier's: the steps run together from the start.
    tail_s = tail_s or {}
    pause = {
        (stage, (k + 1) * len(actions) - 1): tail_s.get(stage, 0.0)
        for stage, actions in schedules.items()
        if actions
        for k in range(steps)
    }
    run = PipelineRun(compute_s, transfers, cost)
    run.extend(repeated(schedules, microbatches, steps), (), pause)
    return _period(run, schedules, steps)


def step_and_period(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel | None,
    microbatches: int,
    order: Sequence[tuple[BoundaryKey, int]],
    tail_s: Mapping[int, float] | None = None,
    steps: int = STEADY_STEPS,
) -> tuple[PipelineResult, float]:
    """(one step from an empty pipeline, as simulate_pipeline runs it in `order`; the period of `steps` steps,
    as steady_period_s) from one run: the steps after the first run on from where it ended. With a planned
    order that gives the times of the steps run together from the start (PipelineRun)."""
    _check(steps)
    run = PipelineRun(compute_s, transfers, cost, planned=True)
    run.extend(schedules, order)
    first = run.result()
    return first, period_on(run, schedules, microbatches, order, tail_s, steps)


def period_on(
    run: PipelineRun,
    schedules: Mapping[int, Sequence[Action]],
    microbatches: int,
    order: Sequence[tuple[BoundaryKey, int]],
    tail_s: Mapping[int, float] | None = None,
    steps: int = STEADY_STEPS,
) -> float:
    """step_and_period's period, from `run`: a fresh planned PipelineRun that ran one step of `schedules` in
    `order` and nothing else (e.g. the fastest of meshjob.plan.comm_order's runs). Runs the steps after it on."""
    _check(steps)
    tail_s = tail_s or {}
    for stage, actions in schedules.items():
        if actions:  # the optimizer step after the step's last action
            run.pause(stage, tail_s.get(stage, 0.0))
    pause = {
        (stage, (k + 1) * len(actions) - 1): tail_s.get(stage, 0.0)
        for stage, actions in schedules.items()
        if actions
        for k in range(1, steps)
    }
    later = [(key, mb + k * microbatches) for k in range(1, steps) for key, mb in order]
    run.extend(repeated(schedules, microbatches, steps - 1, first=1), later, pause)
    return _period(run, schedules, steps)


def _check(steps: int) -> None:
    if steps < 2:
        raise ValueError(f"steps {steps!r} is invalid: at least 2 (the first fills the pipeline)")


def _period(run: PipelineRun, schedules: Mapping[int, Sequence[Action]], steps: int) -> float:
    """The median over stages of (end of the last step - end of the first) / (steps - 1)."""
    # a stage's step k ends when its step k + 1 begins (its next action starts when it is free); the last
    # step ends when the stage is done
    starts: dict[int, list[float]] = {stage: [] for stage in schedules}
    for (stage, _), started in zip(run.order, run.started):
        starts[stage].append(started)
    periods = []
    for stage, stats in run.stats.items():
        n = len(schedules[stage])
        if n:  # the first step ends as the second begins, with the stage's action n
            periods.append((stats.busy_until_s - starts[stage][n]) / (steps - 1))
    return statistics.median(periods) if periods else 0.0


def plan_step_and_period(
    plan: PlanView, cost: CostModel | None = None, tail_s: Mapping[int, float] | None = None
) -> tuple[PipelineResult, float]:
    """meshjob.simulate.simulator.simulate_plan's step of `plan` on `cost` (default: the plan's own) and its
    period, its links in the plan's transfer order, from one run (step_and_period)."""
    cost = cost or CostModel(network=plan.network)
    return step_and_period(
        plan.schedules,
        compute_costs(plan, cost),
        transfer_costs(plan, cost),
        cost,
        plan.job.training.microbatches,
        plan.transfer_order.transfers,
        tail_s,
    )


def plan_period_s(plan: PlanView, cost: CostModel, tail_s: Mapping[int, float] | None = None) -> float:
    """`plan`'s period on `cost`, its links in the plan's transfer order (as meshjob.simulate.simulator.simulate_plan
    runs one step of it)."""
    return plan_step_and_period(plan, cost, tail_s)[1]
