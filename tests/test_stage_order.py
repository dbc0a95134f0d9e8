"""spec.topology.stageOrder: the order placement lays stages on hosts. `chain` (the default) keeps neighbours
in the chain together; `fold` puts stage k beside stage S-1-k, so a U-Transformer's skip edges stay on a host.
The trainer follows the plan's placement, so a folded job trains to the chained job's losses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from conftest import run_losses

from meshjob.cli import main as cli_main
from meshjob.errors import SpecError
from meshjob.layout.stage_order import STAGE_ORDERS
from meshjob.plan.build import build_plan
from meshjob.plan.placement import Host, place
from meshjob.spec.manifest import StageSpec, TopologySpec, TrainingJob, parse_job

DOC: dict[str, Any] = {
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "folded"},
    "spec": {
        "model": {"kind": "utransformer", "layers": 4, "hidden": 16, "heads": 2, "vocab": 32, "seqLen": 8},
        "training": {"steps": 3, "globalBatch": 4, "microbatches": 2, "learningRate": 1.0e-2, "seed": 0},
        "topology": {"devicesPerHost": 2, "stageOrder": "fold"},
        "stages": [{"layers": [i, i + 1], "mesh": [1, 1]} for i in range(4)],
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy"},
        "schedule": {"kind": "1f1b", "weightGradDelay": 0},
    },
}


def with_order(order: str) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["spec"]["topology"]["stageOrder"] = order
    return doc


def hosts_by_stage(job: TrainingJob, hosts: list[Host]) -> list[int]:
    placement = place(job, hosts)
    return [placement.host_of(placement.stage_ranks(s)[0]) for s in range(len(job.stages))]


def test_fold_orders_stage_k_next_to_its_mirror_and_chain_keeps_the_stage_order():
    assert STAGE_ORDERS["fold"].order(5) == (0, 4, 1, 3, 2)
    assert STAGE_ORDERS["fold"].order(4) == (0, 3, 1, 2)
    assert STAGE_ORDERS["chain"].order(4) == (0, 1, 2, 3)


@pytest.mark.parametrize("order,expected", [("chain", [0, 0, 1, 1]), ("fold", [0, 1, 1, 0])])
def test_placement_puts_stages_on_hosts_in_the_jobs_stage_order(order: str, expected: list[int]):
    stages = tuple(StageSpec(layers=(i, i + 1), mesh=(1, 1)) for i in range(4))
    job = TrainingJob(name="demo", stages=stages, topology=TopologySpec(devices_per_host=2, stage_order=order))
    assert hosts_by_stage(job, [Host("a", 2), Host("b", 2)]) == expected
    placement = place(job, [Host("a", 2), Host("b", 2)])
    assert [(s.rank, s.stage) for s in placement.slots] == [(0, 0), (1, 1), (2, 2), (3, 3)]  # ranks stage by stage


def test_a_folded_job_with_multi_host_stages_keeps_every_placement_rule():
    stages = (
        StageSpec(layers=(0, 1), mesh=(2, 1), data_parallel_dim=0),
        StageSpec(layers=(1, 2), mesh=(1, 2), tensor_parallel_dim=1),
        StageSpec(layers=(2, 3), mesh=(2, 1), data_parallel_dim=0),
    )
    job = TrainingJob(name="demo", stages=stages, topology=TopologySpec(devices_per_host=2, stage_order="fold"))
    placement = place(job, [Host(f"h{i}", 2) for i in range(3)])
    for stage in range(3):
        rows = [placement.host_of(r) for r in placement.stage_ranks(stage)]
        assert len(set(rows)) == stages[stage].mesh[0]  # the rows of a stage on distinct hosts
    for host in range(3):
        assert len(placement.ranks_on(host)) <= 2
    first, last = set(placement.mesh(0).hosts), set(placement.mesh(2).hosts)
    assert first == last  # the mirror stage on the first stage's hosts


def test_a_folded_u_transformer_keeps_its_skip_edges_within_a_host():
    plan = build_plan(parse_job(DOC), [Host("a", 2), Host("b", 2)])
    skips = [e for e in plan.job.edges if e.tensor.startswith("skip")]
    assert skips, "the U-Transformer's skip edge 0 -> 3 crosses stages"
    for e in skips:
        assert set(plan.placement.mesh(e.src).hosts) == set(plan.placement.mesh(e.dst).hosts)


def test_an_unknown_stage_order_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(SpecError) as err:
        parse_job(with_order("zigzag"))
    assert "spec.topology.stageOrder" in str(err.value)
    assert "zigzag" in str(err.value) and "chain" in str(err.value) and "fold" in str(err.value)


def test_the_cli_exits_2_on_an_unknown_stage_order(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_order("zigzag")))
    assert cli_main(["plan", str(path)]) == 2
    assert "spec.topology.stageOrder" in capsys.readouterr().err


@pytest.mark.slow
def test_a_folded_job_trains_to_the_chained_jobs_losses(tmp_path):
    folded = run_losses(tmp_path, "fold", with_order("fold"))
    chained = run_losses(tmp_path, "chain", with_order("chain"))
    assert [step for step, _ in folded] == [1, 2, 3]
    assert [loss for _, loss in folded] == pytest.approx([loss for _, loss in chained], abs=1e-6)


@pytest.mark.slow
def test_folded_stages_on_one_device_of_each_of_two_hosts_train_to_the_one_host_jobs_losses(tmp_path):
    """`meshjob tune`'s strided submeshes: stage 0 and its mirror each take one device of the same two hosts (the
    skip edge stays on each host); data parallel over the hosts, they train as stages on both devices of one host."""

    def two_stages(mesh: list[int], dp_dim: int) -> dict[str, Any]:
        doc = with_order("fold")
        doc["spec"]["stages"] = [
            {"layers": [2 * i, 2 * i + 2], "mesh": mesh, "dataParallelDim": dp_dim} for i in (0, 1)
        ]
        return doc

    strided = run_losses(tmp_path, "strided", two_stages([2, 1], 0))
    one_host = run_losses(tmp_path, "one-host", two_stages([1, 2], 1))
    assert [loss for _, loss in strided] == pytest.approx([loss for _, loss in one_host], abs=1e-5)
