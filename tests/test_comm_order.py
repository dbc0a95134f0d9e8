"""The step's transfer order every rank derives from the plan (meshjob.comm_order): complete, causal,
and with receive depths that cover the run it comes from while holding fewer buffers than every
microbatch."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshjob.boundary import BoundaryKey
from meshjob.comm_order import TransferOrder, recv_depths, transfer_order
from meshjob.plan import build_plan
from meshjob.schedule import SCHEDULE_KINDS, Action
from meshjob.spec import load_job

EXAMPLES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def plan_of(example: str, kind: str, microbatches: int | None = None, delay: str | int = "off"):
    job = load_job(example)
    training = job.training if microbatches is None else dataclasses.replace(
        job.training, microbatches=microbatches, global_batch=microbatches * 2 * job.training.microbatch_size)
    job = dataclasses.replace(job, training=training,
                              schedule=dataclasses.replace(job.schedule, kind=kind, weight_grad_delay=delay))
    return build_plan(job)


def sends_of(plan) -> list[tuple[BoundaryKey, int]]:
    return [(BoundaryKey.of_action(s, a), a.mb) for s, acts in plan.schedules.items() for a in acts
            if a.kind.startswith("SEND")]


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_every_transfer_of_the_step_is_ordered_once(example, kind):
    plan = plan_of(example, kind)
    order = transfer_order(plan)
    assert sorted(order.transfers) == sorted(sends_of(plan))


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_the_order_is_causal_a_stage_sends_after_what_it_received_before(example, kind):
    plan = plan_of(example, kind, delay="on")
    order = transfer_order(plan)
    for stage, actions in plan.schedules.items():
        received: list[tuple[BoundaryKey, int]] = []
        last_send = -1
        for a in actions:
            if not a.is_comm:
                continue
            transfer = (BoundaryKey.of_action(stage, a), a.mb)
            if a.kind.startswith("RECV"):
                received.append(transfer)
                continue
            at = order.position(*transfer)
            assert at > last_send, f"stage {stage} sends {transfer} before a send listed earlier"
            assert all(order.position(*r) < at for r in received), \
                f"stage {stage} sends {transfer} before one it received earlier in its list"
            last_send = at


def test_depth_is_one_more_than_the_most_transfers_of_a_boundary_in_flight():
    key = BoundaryKey(0, 1, "activation")
    run = [(0, Action("SEND_F", 0, 1)), (0, Action("SEND_F", 1, 1)), (1, Action("RECV_F", 0, 0)),
           (0, Action("SEND_F", 2, 1)), (1, Action("RECV_F", 1, 0)), (1, Action("RECV_F", 2, 0))]
    order = TransferOrder.of_run(run)
    assert order.transfers == ((key, 0), (key, 1), (key, 2))
    assert order.depth == {key: 3}


def test_eager_1f1b_keeps_fewer_receives_posted_than_microbatches():
    plan = plan_of(EXAMPLES[0], "eager-1f1b", microbatches=8)
    depths = recv_depths(plan.schedules, transfer_order(plan))
    assert depths[1] and all(1 <= d < 8 for d in depths[1].values())
    assert set(depths[1]) == {BoundaryKey.of_action(1, a) for a in plan.schedules[1] if a.kind.startswith("RECV")}


def test_a_transfer_the_step_lacks_is_named():
    with pytest.raises(KeyError, match=r"transfer 0->1:activation of microbatch 9 is not in the step's order"):
        TransferOrder(((BoundaryKey(0, 1, "activation"), 0),)).position(BoundaryKey(0, 1, "activation"), 9)


def test_a_forward_only_pass_keeps_the_steps_forwards_in_order_and_drops_the_gradients():
    forward, grad = BoundaryKey(0, 1, "activation"), BoundaryKey(1, 0, "activation", grad=True)
    order = TransferOrder(((forward, 0), (forward, 1), (grad, 0), (forward, 2), (grad, 1)), {forward: 2, grad: 1})
    only = order.forward_only()
    assert only.transfers == ((forward, 0), (forward, 1), (forward, 2))
    assert dict(only.depth) == {forward: 2}
