"""meshjob's schedules in torch's pipeline runtime (meshjob.schedule.torch_csv), torch's schedules as data
(meshjob.schedule.torch_schedules), and torch's schedules on the emulated device (meshjob_trainer.torch_peer)."""

from __future__ import annotations

import functools

import pytest
from torch.distributed.pipelining.schedules import _Action, _simulate_comms_compute, _validate_schedule

from meshjob.costs.compute import StageCost
from meshjob.plan.build import build_plan
from meshjob.schedule.actions import ScheduleError, generate
from meshjob.schedule.boundary import BoundaryKey
from meshjob.schedule.torch_csv import csv_text, parse_rows, torch_row, torch_rows
from meshjob.schedule.torch_schedules import TORCH_SCHEDULES, torch_schedule
from meshjob.spec.manifest import TrainingJob, parse_job
from meshjob_trainer.launch import launch
from meshjob_trainer.reference import reference_for_job

CHAIN = [(0, 1, "activation"), (1, 2, "activation")]


def torch_order(rows: list[list[str]]) -> dict[int, list[_Action]]:
    return {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}


def test_rows_spell_each_action_as_torch_does_and_reduce_after_the_last_backward():
    schedules = generate("eager-1f1b", 3, 4, CHAIN, split_backward=True, weight_delay={0: 1, 1: 1})
    rows = torch_rows(schedules, 4)
    assert rows[1][:3] == ["1RECV_F0", "1F0", "1SEND_F0"]
    for stage, row in enumerate(rows):
        assert row[-1] == f"{stage}REDUCE_GRAD" and row[-2] == f"{stage}W3"
        assert [c for c in row if "REDUCE" not in c] == [f"{stage}{a.kind}{a.mb}" for a in schedules[stage]]
    assert torch_rows(generate("1f1b", 2, 2, CHAIN[:1]), 2)[1][-2:] == ["1SEND_B1", "1REDUCE_GRAD"]


def test_torch_validates_and_simulates_the_rows_without_a_deadlock():
    schedules = generate("eager-1f1b", 3, 4, CHAIN, split_backward=True, weight_delay={0: 2, 1: 1})
    rows = [[c for c in row if "REDUCE_GRAD" not in c] for row in torch_rows(schedules, 4)]  # not simulated there
    _simulate_comms_compute(torch_order(rows), lambda s: s, 3)  # raises if it cannot finish
    # torch's simulator blocks at a RECV, its runtime does not (an irecv posted): posted ahead, validated only
    depth = {BoundaryKey(0, 1, "activation"): 2, BoundaryKey(2, 1, "activation", grad=True): 1}
    assert _validate_schedule(torch_order(torch_rows(schedules, 4, depth)), 3, 3, 4) == {0: 0, 1: 1, 2: 2}


def test_receives_posted_ahead_keep_their_order_and_depth():
    schedules = generate("1f1b", 3, 6, CHAIN)
    row = torch_row(1, schedules[1], 6, {BoundaryKey(0, 1, "activation"): 2})
    recvs = [c for c in row if "RECV_F" in c]
    assert recvs == [f"1RECV_F{m}" for m in range(6)]
    assert row[:2] == ["1RECV_F0", "1RECV_F1"]  # two ahead before the first forward
    assert row.index("1RECV_F2") == row.index("1F0") + 1  # the next once microbatch 0 arrived and ran


def test_a_skip_edge_is_refused_by_name():
    schedules = generate("1f1b", 3, 2, CHAIN + [(0, 2, "skip0")])
    with pytest.raises(ScheduleError, match="SEND_F0@2:skip0.*no skip edges"):
        torch_rows(schedules, 2)


def test_rows_read_back():
    rows = torch_rows(generate("gpipe", 2, 2, CHAIN[:1]), 2)
    parsed = parse_rows(csv_text(rows))
    assert parsed[0][0] == (0, "F", 0) and parsed[0][-1] == (0, "REDUCE_GRAD", None)


def test_meshjob_plan_exports_the_plan_as_torch_csv(tmp_path, capsys):
    import json

    from meshjob.cli import main
    from meshjob.spec.manifest import job_to_dict

    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job_to_dict(csv_job())))  # JSON is YAML
    assert main(["plan", str(path), "--export", "torch-csv"]) == 0
    plan = build_plan(csv_job())
    assert capsys.readouterr().out == csv_text(torch_rows(plan.schedules, 4, plan.transfer_order.depth))


def test_torch_schedules_place_their_stages_as_torch_does():
    assert torch_schedule("ScheduleInterleaved1F1B").stages_of(1, 4) == (1, 5)
    assert torch_schedule("ScheduleZBVZeroBubble").stages_of(1, 4) == (1, 6)
    assert torch_schedule("Schedule1F1B").stages_of(3, 4) == (3,)
    with pytest.raises(ScheduleError, match="ScheduleGPipe"):
        torch_schedule("gpipe")
    assert len(TORCH_SCHEDULES) == 7


# --- processes: gloo on this machine -------------------------------------------------------------


def csv_job(steps: int = 3) -> TrainingJob:
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "torch-csv"},
            "spec": {
                "model": {
                    "kind": "gpt",
                    "layers": 6,
                    "hidden": 16,
                    "heads": 2,
                    "vocab": 32,
                    "seqLen": 8,
                    "tieEmbeddings": False,
                },
                "training": {"steps": steps, "globalBatch": 8, "microbatches": 4, "learningRate": 1e-2, "seed": 0},
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [2 * i, 2 * i + 2], "mesh": [1, 1]} for i in range(3)],
                "schedule": {"kind": "eager-1f1b", "weightGradDelay": 1},
            },
        }
    )


@functools.cache
def reference_losses() -> list[float]:
    return reference_for_job(csv_job()).losses


def _torch_rank(ctx, job: TrainingJob, path: str) -> list[float]:
    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.torch_peer import train_csv_rank

    init_distributed(ctx.env, timeout_s=30, backend="gloo")
    try:
        return train_csv_rank(job, ctx.env.rank, path)
    finally:
        shutdown_distributed()


@pytest.mark.slow
def test_the_exported_plan_trains_in_torchs_runtime_to_meshjobs_losses(tmp_path):
    job = csv_job()
    plan = build_plan(job)
    assert plan.split_backward and any(d > 0 for d in plan.weight_delay.values())
    path = tmp_path / "schedule.csv"
    path.write_text(csv_text(torch_rows(plan.schedules, 4, plan.transfer_order.depth)))

    torch_run = launch(3, lambda ctx: _torch_rank(ctx, job, str(path)), timeout_s=90).raise_on_failure().values
    from meshjob_trainer.train import train_rank

    own = launch(3, lambda ctx: train_rank(ctx.env, job=job, plan=plan), timeout_s=90).raise_on_failure().values
    own_losses = [r.losses for r in own if r.losses]
    assert torch_run[2] == pytest.approx(reference_losses(), abs=1e-5)
    assert torch_run[2] == pytest.approx(own_losses[0], abs=1e-5)
    assert torch_run[0] == torch_run[1] == []


def _emulated_rank(ctx, name: str, costs: list[StageCost], steps: int):
    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.torch_peer import run_emulated_rank

    init_distributed(ctx.env, timeout_s=30, backend="gloo")
    try:
        return run_emulated_rank(torch_schedule(name), ctx.env.rank, 2, costs, 0.003, (1, 8, 16), 4, steps)
    finally:
        shutdown_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Schedule1F1B", "ScheduleZBVZeroBubble"])
def test_the_hooks_wait_each_stages_modelled_forward_input_and_weight_gradient(name):
    """Every step after torch's first (which also infers shapes) waits, on each rank, M times each of its
    stages' F, I and W (the first stage's I inside its W: torch runs its whole backward there)."""
    spec = torch_schedule(name)
    costs = [StageCost(0.001 * (s + 1), 0.0015, 0.0005 * (s + 1)) for s in range(2 * spec.stages_per_rank)]
    results = launch(2, lambda ctx: _emulated_rank(ctx, name, costs, 3), timeout_s=60).raise_on_failure().values
    for r in results:
        for step in r.modelled[1:]:
            assert step["F"] == pytest.approx(4 * sum(costs[s].forward_s for s in r.stages))
            assert step["I"] == pytest.approx(4 * sum(costs[s].input_grad_s for s in r.stages))
            assert step["W"] == pytest.approx(4 * sum(costs[s].weight_grad_s for s in r.stages))
            assert step["optimizer"] == pytest.approx(0.003)
        # and the clock really waited them: a step takes at least its own rank's modelled compute
        assert min(r.step_seconds[1:]) >= sum(r.modelled[-1].values()) * 0.95
    assert [r.stages for r in results] == [spec.stages_of(0, 2), spec.stages_of(1, 2)]


# --- torch's schedules on the simulator ------------------------------------------------------------


@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_the_ported_orders_are_torchs_and_run_each_stages_compute_once(name):
    from meshjob_trainer.torch_peer import torch_rows as generated

    spec = torch_schedule(name)
    for ranks, microbatches in ((2, 4), (3, 6), (4, 8), (4, 12), (8, 16)):
        assert spec.orders(ranks, microbatches) == generated(spec, ranks, microbatches), (ranks, microbatches)
    rows = spec.orders(4, 8)
    done: dict[tuple[int, int], list[str]] = {}
    for cells in rows.values():
        for s, k, m in cells:
            done.setdefault((s, m), []).append(k)
    assert set(done) == {(s, m) for s in range(4 * spec.stages_per_rank) for m in range(8)}
    # a full backward, or (a split schedule's) input then weight gradient; DualPipeV mixes both
    allowed = [["F", "B"], ["F", "I", "W"]] if spec.split_backward else [["F", "B"]]
    assert all(kinds in allowed for kinds in done.values())
    for rank, cells in rows.items():
        assert {s for s, _, _ in cells} == set(spec.stages_of(rank, 4))


@pytest.mark.parametrize(
    "name,bubble",
    [("ScheduleGPipe", 3.0), ("Schedule1F1B", 3.0), ("ScheduleInterleaved1F1B", 1.5), ("ScheduleLoopedBFS", 1.5)],
)
def test_the_simulator_gives_torchs_schedules_their_textbook_bubbles(name, bubble):
    """Free transfers, F = I = W = 1 on a rank's layers: a step is M + bubble times F + B (bubble: R - 1, and
    (R - 1) / 2 with two stages per rank); the zero-bubble ones come closer to M than any of these."""
    from meshjob.simulate.simulator import TransferCost
    from meshjob.simulate.torch_peers import simulate_torch

    free = TransferCost(0.0, {(0, "out"): 1.0, (1, "in"): 1.0})

    def step(spec_name: str) -> float:
        spec = torch_schedule(spec_name)
        share = 1 / spec.stages_per_rank
        costs = [StageCost(share, share, share)] * (4 * spec.stages_per_rank)
        return simulate_torch(spec, 4, 8, costs, free).step_s

    assert step(name) == pytest.approx((8 + bubble) * 3)
    for zero_bubble in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        assert 8 * 3 <= step(zero_bubble) < (8 + 1.5) * 3


@pytest.mark.slow
def test_every_runtime_trains_the_small_gpt_to_the_reference_losses():
    """bench peers' real-compute check: meshjob's run, its plan in torch's runtime, and torch's seven schedules."""
    from meshjob_bench.peers import loss_check

    check = loss_check(list(TORCH_SCHEDULES.values()))
    assert len(check["max_abs_diff"]) == 2 + len(TORCH_SCHEDULES)
    for name, diff in check["max_abs_diff"].items():
        assert diff is not None and diff <= 1e-5, name


def test_meshjob_simulate_says_which_schedule_family_wins(tmp_path, capsys):
    import json

    from meshjob.cli import main

    path = tmp_path / "job.yaml"
    from meshjob.spec.manifest import job_to_dict

    path.write_text(json.dumps(job_to_dict(csv_job())))
    assert main(["simulate", str(path), "--torch-schedules", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = out["torch_schedules_step_s"]
    assert set(steps) == set(TORCH_SCHEDULES) - {"ScheduleDualPipeV"}  # torch's: M >= stages (4 < 6)
    # the textbook order on the same pipeline: GPipe no faster than interleaving, interleaving than zero bubble
    assert steps["ScheduleGPipe"] >= steps["ScheduleInterleaved1F1B"] >= steps["ScheduleZBVZeroBubble"] > 0


@pytest.mark.parametrize("model", ["gpt", "utransformer"])
def test_the_interleaved_rows_cut_the_same_layers_into_twice_the_stages(model):
    """torch's two-stages-per-rank schedules run the job cut in twice as many stages; the U-Transformer's skip
    edges are derived for the new cut (the old cut's named stages that no longer exist)."""
    from meshjob_bench.peers import split_job
    from meshjob_bench.pipeline import bench_job

    job = bench_job(model, "eager-1f1b", 2, quick=True)
    split = split_job(job, 2)
    assert len(split.stages) == 2 * len(job.stages)
    assert [s.layers for s in split.stages][0][0] == 0 and split.stages[-1].layers[1] == job.model.layers
    if model == "utransformer":
        assert any(e.tensor != "activation" for e in split.edges)  # skip edges kept, between the new stages
