"""The step's transfer order every rank derives from the plan (meshjob.plan.comm_order): complete, causal,
and with receive depths that cover the run it comes from while holding fewer buffers than every
microbatch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import parse_device
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan
from meshjob.plan.comm_order import TransferOrder, need_order, recv_depths, transfer_order
from meshjob.schedule.actions import SCHEDULE_KINDS, Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import plan_cost, simulate_plan
from meshjob.spec.manifest import load_job, parse_job

EXAMPLES = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def plan_of(example: str, kind: str, microbatches: int | None = None, delay: str | int = "off"):
    job = load_job(example)
    training = (
        job.training
        if microbatches is None
        else dataclasses.replace(
            job.training, microbatches=microbatches, global_batch=microbatches * 2 * job.training.microbatch_size
        )
    )
    job = dataclasses.replace(
        job, training=training, schedule=dataclasses.replace(job.schedule, kind=kind, weight_grad_delay=delay)
    )
    return build_plan(job)


def sends_of(plan) -> list[tuple[BoundaryKey, int]]:
    return [
        (BoundaryKey.of_action(s, a), a.mb)
        for s, acts in plan.schedules.items()
        for a in acts
        if a.kind.startswith("SEND")
    ]


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_every_transfer_of_the_step_is_ordered_once(example, kind):
    plan = plan_of(example, kind)
    order = transfer_order(plan)
    assert sorted(order.transfers) == sorted(sends_of(plan))


def assert_causal(plan, order: TransferOrder) -> None:
    """Every send comes after what its stage received before it in its list, and the transfers between
    two stages keep their sender's list order (the order both ends of a pair issue them in)."""
    for stage, actions in plan.schedules.items():
        received: list[tuple[BoundaryKey, int]] = []
        last_to: dict[int, int] = {}  # receiving stage -> position of the last send to it
        for a in actions:
            if not a.is_comm:
                continue
            transfer = (BoundaryKey.of_action(stage, a), a.mb)
            if a.kind.startswith("RECV"):
                received.append(transfer)
                continue
            at = order.position(*transfer)
            assert at > last_to.get(a.peer, -1), (
                f"stage {stage} sends {transfer} before a send to its peer listed earlier"
            )
            assert all(order.position(*r) < at for r in received), (
                f"stage {stage} sends {transfer} before one it received earlier in its list"
            )
            last_to[a.peer] = at


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: Path(p).stem)
def test_the_order_is_causal_a_stage_sends_after_what_it_received_before(example, kind):
    plan = plan_of(example, kind, delay="on")
    assert_causal(plan, transfer_order(plan))


def heavy_skip_plan(kind: str = "eager-1f1b", delay: int | str = "auto"):
    """The bench's U-Transformer shape in small: skips from stage 0 to the last stage share stage 0's
    out-link with its activations, on NICs about as slow as the compute."""
    job = parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "heavy-skips"},
            "spec": {
                "model": {"kind": "utransformer", "layers": 16, "hidden": 256, "heads": 8, "vocab": 256, "seqLen": 64},
                "training": {"globalBatch": 8, "microbatches": 8},
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [4 * i, 4 * i + 4], "mesh": [1, 1]} for i in range(4)],
                "schedule": {"kind": kind, "weightGradDelay": delay},
            },
        }
    )
    cost = CostModel(
        network=NetworkModel(nic_bytes_per_s=4e6), stages=emulated_costs(job, parse_device("1")), measured=True
    )
    return build_plan(job, cost=cost, network=cost.network)


def test_links_take_transfers_in_need_order_where_the_send_order_runs_slower():
    plan = heavy_skip_plan()
    cost = plan_cost(plan)
    sent_first = simulate_plan(plan, cost, follow_plan_order=False)
    order = transfer_order(plan)
    assert order.transfers != TransferOrder.of_run(sent_first.order).transfers
    assert simulate_plan(plan, cost).step_s < 0.97 * sent_first.step_s
    assert_causal(plan, order)


def test_the_send_order_stands_where_no_need_order_runs_faster():
    plan = plan_of(EXAMPLES[0], "1f1b")
    sent_first = simulate_plan(plan, plan_cost(plan), follow_plan_order=False)
    assert transfer_order(plan).transfers == TransferOrder.of_run(sent_first.order).transfers


def test_a_need_order_puts_a_transfer_needed_now_before_ones_sent_earlier_but_needed_later():
    plan = heavy_skip_plan()
    sent_first = simulate_plan(plan, plan_cost(plan), follow_plan_order=False)
    order = need_order(sent_first)
    first_activation = (BoundaryKey(2, 3, "activation"), 0)
    late_skip = (BoundaryKey(0, 3, "skip0"), 6)
    sends = TransferOrder.of_run(sent_first.order).transfers
    assert sends.index(late_skip) < sends.index(first_activation)
    assert order.index(first_activation) < order.index(late_skip)


def test_depth_is_one_more_than_the_most_transfers_of_a_boundary_in_flight():
    key = BoundaryKey(0, 1, "activation")
    run = [
        (0, Action("SEND_F", 0, 1)),
        (0, Action("SEND_F", 1, 1)),
        (1, Action("RECV_F", 0, 0)),
        (0, Action("SEND_F", 2, 1)),
        (1, Action("RECV_F", 1, 0)),
        (1, Action("RECV_F", 2, 0)),
    ]
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


def test_a_need_order_times_every_receive_a_compute_takes_by_the_first_of_them():
    """Stage 2's F takes stage 0's activation (sent at 2) and stage 1's (sent at 0.5) through one in-link;
    the list-scheduled run reaches stage 1's RECV only once stage 0's transfer has landed, but stage 2
    needs both from the start: stage 1's, sent first, goes first and the in-link does not idle."""
    from meshjob.simulate.simulator import simulate_pipeline

    keys = {0: BoundaryKey(0, 2, "activation"), 1: BoundaryKey(1, 2, "skip")}
    schedules = {
        0: [Action("F", 0, None), Action("SEND_F", 0, 2)],
        1: [Action("F", 0, None), Action("SEND_F", 0, 2, "skip")],
        2: [Action("RECV_F", 0, 0), Action("RECV_F", 0, 1, "skip"), Action("F", 0, None)],
    }
    compute = {(0, "F"): 2.0, (1, "F"): 0.5, (2, "F"): 1.0}
    nbytes = CostModel().nic_bytes_per_s  # one second on the default NIC
    transfers = {key: (1.0, {(src, "out"): nbytes, (2, "in"): nbytes}) for src, key in keys.items()}
    run = simulate_pipeline(schedules, compute, transfers)
    order = need_order(run)
    assert order.index((keys[1], 0)) < order.index((keys[0], 0))
    assert simulate_pipeline(schedules, compute, transfers, order=order).step_s == pytest.approx(4.0)


def two_waiting_receivers():
    """Stage 2 sends, at one instant, a skip gradient to stage 0 and then an activation gradient to
    stage 1, over its one out-link; both receivers wait already, but stage 0 also needs stage 1's
    gradient, which stage 1 computes only once its own has landed (the U-Transformer's last stage
    after its first I)."""
    schedules = {
        0: [Action("RECV_B", 0, 2, "skip"), Action("RECV_B", 0, 1), Action("I", 0, None)],
        1: [Action("RECV_B", 0, 2), Action("I", 0, None), Action("SEND_B", 0, 0)],
        2: [Action("I", 0, None), Action("SEND_B", 0, 0, "skip"), Action("SEND_B", 0, 1)],
    }
    compute = {(s, "I"): 1.0 for s in range(3)}
    nbytes = CostModel().nic_bytes_per_s  # one second on the default NIC
    skip, chain = BoundaryKey(2, 0, "skip", grad=True), BoundaryKey(2, 1, "activation", grad=True)
    transfers = {
        skip: (1.0, {(2, "out"): nbytes, (0, "in"): nbytes}),
        chain: (1.0, {(2, "out"): nbytes, (1, "in"): nbytes}),
        BoundaryKey(1, 0, "activation", grad=True): (1.0, {(1, "out"): nbytes, (0, "in"): nbytes}),
    }
    return schedules, compute, transfers, skip, chain


def test_need_order_ties_go_in_the_send_order_or_to_the_transfer_its_receiver_uses_first():
    from meshjob.simulate.simulator import simulate_pipeline

    schedules, compute, transfers, skip, chain = two_waiting_receivers()
    run = simulate_pipeline(schedules, compute, transfers)
    sent, used = need_order(run, "sent"), need_order(run, "used")
    assert sent.index((skip, 0)) < sent.index((chain, 0))
    assert used.index((chain, 0)) < used.index((skip, 0))
    # the chain's gradient first: stage 1 computes while the skip crosses, and stage 0 starts a second sooner
    assert simulate_pipeline(schedules, compute, transfers, order=used).step_s == pytest.approx(5.0)
    assert simulate_pipeline(schedules, compute, transfers, order=sent).step_s == pytest.approx(6.0)


def test_the_fastest_order_tries_both_tie_rules():
    from meshjob.plan.comm_order import TIES, fastest_order

    schedules, compute, transfers, *_ = two_waiting_receivers()
    alone = {rule: fastest_order(schedules, compute, transfers, None, ties=(rule,))[1] for rule in TIES}
    assert alone["used"] < alone["sent"]
    assert fastest_order(schedules, compute, transfers, None)[1] == min(alone.values())


def test_an_unknown_tie_rule_is_named():
    from meshjob.simulate.simulator import simulate_pipeline

    schedules, compute, transfers, *_ = two_waiting_receivers()
    with pytest.raises(ValueError, match=r"ties 'random' is invalid: one of sent, used"):
        need_order(simulate_pipeline(schedules, compute, transfers), "random")
