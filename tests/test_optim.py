"""The optimizer step's parts that need no process group: the learning-rate schedule, the clipping
coefficient, ZeRO-1's flat layout, and the refusal of optimizer state laid out for another run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshjob.spec.manifest import LrScheduleSpec, TrainingSpec
from meshjob_trainer.checkpoint import CheckpointMismatch
from meshjob_trainer.optim import FlatLayout, StageOptimizer, clip_coefficient, lr_at
from meshjob_trainer.parallel import StageGroups, TPGroup


def test_without_a_schedule_the_learning_rate_is_constant():
    t = TrainingSpec(steps=10, learning_rate=0.1)
    assert {lr_at(s, t) for s in range(10)} == {0.1}


def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine_to_the_floor():
    t = TrainingSpec(steps=105, learning_rate=1.0, lr_schedule=LrScheduleSpec(warmup_steps=4, min_lr=0.1))
    lrs = [lr_at(s, t) for s in range(105)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # step 4 is the first after warm-up: the peak
    assert lrs[-1] == pytest.approx(0.1)  # the last step reaches the floor
    assert lrs[54] == pytest.approx(0.55)  # half-way through the decay: the middle
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_clipping_follows_torch_clip_grad_norm():
    grads = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    assert float(torch.nn.utils.clip_grad_norm_(params, 1.5)) == pytest.approx(norm)
    assert float(params[0].grad[0]) == pytest.approx(2.0 * clip_coefficient(norm, 1.5))
    assert clip_coefficient(0.5, 1.5) == 1.0  # below the limit: unchanged


def test_zero_cuts_the_flat_buffer_into_equal_padded_shards():
    layouts = [FlatLayout(10, 4, r) for r in range(4)]
    assert [layout.shard for layout in layouts] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert layouts[0].padded == 12


def single_rank_optimizer() -> StageOptimizer:
    groups = StageGroups(TPGroup(), None, 0, 1, None, 1)
    return StageOptimizer([nn.Parameter(torch.zeros(3))], groups, 0.1, zero_stage=1)  # DP 1: no sharding


def test_optimizer_state_sharded_by_zero_1_is_refused_by_an_unsharded_run_naming_both_layouts():
    state = {"zero": {"numel": 6, "dp_size": 2, "dp_rank": 1}, "adamw": single_rank_optimizer().state_dict()}
    with pytest.raises(
        CheckpointMismatch,
        match=r"sharded by ZeRO-1 over 2 data-parallel ranks .*this run's is "
        r"whole on every rank \(zeroStage 0\).*zeroStage",
    ):
        single_rank_optimizer().load_state_dict(state)


def test_unsharded_optimizer_state_loads_back():
    opt = single_rank_optimizer()
    opt.params[0].grad = torch.ones(3)
    opt.step()
    again = single_rank_optimizer()
    again.load_state_dict(opt.state_dict())
    assert again.optimizer.state_dict()["state"][0]["exp_avg"].tolist() == pytest.approx([0.1] * 3)
