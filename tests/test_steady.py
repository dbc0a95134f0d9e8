"""The steady-state period: a step's action lists run over and over, each stage starting its next step
once its own last action and tail (the optimizer step) are done."""

from __future__ import annotations

import pytest
from test_simulate import chain_edges, free_transfers

from meshjob.schedule.actions import generate
from meshjob.simulate.simulator import simulate_pipeline
from meshjob.simulate.steady import repeated, steady_period_s


def costs(stages: int, f: float = 1.0) -> dict:
    return {(s, k): v for s in range(stages) for k, v in (("F", f), ("B", 2 * f), ("I", f), ("W", f))}


def test_repeated_steps_number_their_microbatches_on() -> None:
    lists = repeated(generate("1f1b", 2, 2, chain_edges(2)), 2, 3)
    assert sorted({a.mb for a in lists[0]}) == [0, 1, 2, 3, 4, 5]
    assert len(lists[1]) == 3 * len(generate("1f1b", 2, 2, chain_edges(2))[1])


def test_one_stage_runs_its_compute_then_its_tail_each_step() -> None:
    schedules = generate("1f1b", 1, 4, [])
    assert steady_period_s(schedules, costs(1), {}, None, 4) == pytest.approx(4 * 3.0)
    assert steady_period_s(schedules, costs(1), {}, None, 4, tail_s={0: 0.5}) == pytest.approx(4 * 3.0 + 0.5)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8)])
def test_a_1f1b_period_is_its_one_step_makespan_since_stage_0_ends_last_and_begins_the_next(stages, microbatches):
    schedules = generate("1f1b", stages, microbatches, chain_edges(stages))
    one = simulate_pipeline(schedules, costs(stages), free_transfers(stages)).step_s
    assert one == pytest.approx((microbatches + stages - 1) * 3.0)
    assert steady_period_s(schedules, costs(stages), free_transfers(stages), None, microbatches) == pytest.approx(one)


def test_w_delayed_on_the_last_stage_overlap_the_next_steps_warm_up() -> None:
    stages, microbatches = 4, 8
    schedules = generate("eager-1f1b", stages, microbatches, chain_edges(stages), True, {1: 2, 2: 4, 3: 6})
    one = simulate_pipeline(schedules, costs(stages), free_transfers(stages))
    period = steady_period_s(schedules, costs(stages), free_transfers(stages), None, microbatches)
    assert one.stages[3].busy_until_s > one.stages[0].busy_until_s  # the last stage's delayed W's end the step
    assert period < one.step_s
    assert period >= microbatches * 3.0  # no stage does its step's compute faster than it takes


def test_fewer_than_two_steps_give_no_period() -> None:
    with pytest.raises(ValueError, match="steps 1 is invalid: at least 2"):
        steady_period_s(generate("1f1b", 1, 2, []), costs(1), {}, None, 2, steps=1)
