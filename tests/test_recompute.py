"""Full recompute costs one extra forward per block and microbatch under every schedule, the split
backward (I, then a delayed W) included, gives the gradients of no recompute, and lowers the peak
activations: each stage of a 3-stage Llama runs its plan's action list alone in this process
(meshjob_bench.memory.run_stage, a loopback for its neighbours), measured as `bench memory` measures."""

from __future__ import annotations

import pytest
import torch

from meshjob.plan.build import build_plan
from meshjob_bench.memory import PIPELINE_STAGES, pipeline_job, run_stage

SCHEDULES = [("gpipe", 0), ("1f1b", 0), ("eager-1f1b", 0), ("eager-1f1b", "auto")]


@pytest.mark.parametrize("schedule,delay", SCHEDULES)
def test_recompute_runs_each_block_twice_per_microbatch_and_gives_the_same_gradients(schedule, delay):
    plain, full = (pipeline_job(schedule, delay, r, quick=True) for r in ("none", "full"))
    if delay == "auto":
        assert build_plan(full).split_backward and any(d > 0 for d in build_plan(full).weight_delay.values())
    for stage in range(PIPELINE_STAGES):  # the first stage's W runs its whole backward; the others split
        expected, got = run_stage(plain, stage, 0, keep_sent=True), run_stage(full, stage, 0, keep_sent=True)
        assert expected.forwards == 1.0
        assert got.forwards == 2.0, f"stage {stage}: {got.forwards} forwards per block and microbatch"
        for name, p in expected.module.named_parameters():
            torch.testing.assert_close(dict(got.module.named_parameters())[name].grad, p.grad, msg=name)
        assert got.sent.keys() == expected.sent.keys()
        for key, tensor in expected.sent.items():
            torch.testing.assert_close(got.sent[key], tensor, msg=str(key))


def test_bf16_recompute_under_the_split_backward_gives_the_same_gradients():
    plain, full = (pipeline_job("eager-1f1b", "auto", r, quick=True, precision="bf16") for r in ("none", "full"))
    expected, got = run_stage(plain, 1, 0), run_stage(full, 1, 0)
    assert got.forwards == 2.0
    for name, p in expected.module.named_parameters():
        torch.testing.assert_close(dict(got.module.named_parameters())[name].grad, p.grad, msg=name)


def test_recompute_lowers_the_peak_activations_with_delayed_weight_gradients():
    """What a delayed W holds with recompute is each linear layer's input and output gradient, not the
    whole block: torch's checkpoint held more than no recompute here (it recomputed in W)."""
    plain, full = (pipeline_job("eager-1f1b", "auto", r, quick=True) for r in ("none", "full"))
    delays = build_plan(full).weight_delay
    for stage in (s for s in range(PIPELINE_STAGES) if delays.get(s, 0) > 0):
        without, with_recompute = run_stage(plain, stage, 0), run_stage(full, stage, 0)
        assert with_recompute.activations < 0.8 * without.activations, f"stage {stage}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_deferred_block_gives_autograds_gradients_with_biases_and_its_weights_only_in_w(precision):
    """recompute_block on its own: I (input gradients only, under deferring_weight_grads) then W
    (run_weight_grads) against a plain backward; linear layers with biases, a norm's weights."""
    from meshjob_trainer.numerics import Numerics
    from meshjob_trainer.recompute import deferring_weight_grads, run_weight_grads

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 4, 8, requires_grad=True)
    dy = torch.randn(2, 4, 8)

    def grads(recompute: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        block.zero_grad(set_to_none=True)
        numerics = Numerics(precision, recompute)
        with numerics.autocast("cpu"):
            y = numerics.run_block(block, x)
        if not recompute:
            (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
            y.backward(dy)
            return dx, {n: p.grad for n, p in block.named_parameters()}
        with deferring_weight_grads() as deferred:
            (dx,) = torch.autograd.grad(y, x, dy)
        assert len(deferred) == 2 and block[1].weight.grad is None and block[0].weight.grad is not None
        run_weight_grads(deferred)
        assert not deferred
        return dx, {n: p.grad for n, p in block.named_parameters()}

    (dx_plain, plain), (dx_rc, rc) = grads(False), grads(True)
    torch.testing.assert_close(dx_rc, dx_plain)
    for name, grad in plain.items():
        torch.testing.assert_close(rc[name], grad, msg=name)
