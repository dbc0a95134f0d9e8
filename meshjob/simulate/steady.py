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
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from meshjob.costs.compute import CostModel
from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import PlanView, TransferInput, compute_costs, simulate_pipeline, transfer_costs

STEADY_STEPS = 3  # the first step fills the pipeline; the two after it give the period


def repeated(schedules: Mapping[int, Sequence[Action]], microbatches: int, steps: int) -> dict[int, list[Action]]:
    """Each stage's list `steps` times over, step k's microbatches numbered from k * microbatches."""
    return {
        stage: [replace(a, mb=a.mb + k * microbatches) for k in range(steps) for a in actions]
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
    if steps < 2:
        raise ValueError(f"steps {steps!r} is invalid: at least 2 (the first fills the pipeline)")
    tail_s = tail_s or {}
    pause = {
        (stage, (k + 1) * len(actions) - 1): tail_s.get(stage, 0.0)
        for stage, actions in schedules.items()
        if actions
        for k in range(steps)
    }
    lists = repeated(schedules, microbatches, steps)
    steps_order = None if order is None else [(key, mb + k * microbatches) for k in range(steps) for key, mb in order]
    run = simulate_pipeline(lists, compute_s, transfers, cost, steps_order, pause)
    # a stage's step k ends when its step k + 1 begins (its next action starts when it is free); the last
    # step ends when the stage is done
    starts: dict[int, list[float]] = {stage: [] for stage in schedules}
    for (stage, _), started in zip(run.order, run.started_s):
        starts[stage].append(started)
    periods = []
    for stage, stats in run.stages.items():
        n = len(schedules[stage])
        if n:  # the first step ends as the second begins, with the stage's action n
            periods.append((stats.busy_until_s - starts[stage][n]) / (steps - 1))
    return statistics.median(periods) if periods else 0.0


def plan_period_s(plan: PlanView, cost: CostModel, tail_s: Mapping[int, float] | None = None) -> float:
    """`plan`'s period on `cost`, its links in the plan's transfer order (as meshjob.simulate.simulator.simulate_plan
    runs one step of it)."""
    return steady_period_s(
        plan.schedules,
        compute_costs(plan, cost),
        transfer_costs(plan, cost),
        cost,
        plan.job.training.microbatches,
        plan.transfer_order.transfers,
        tail_s,
    )
