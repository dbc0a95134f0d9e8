"""Alpa's all-data-parallel stage: `dataParallelDims` shards the batch over several mesh dims (major first), so
pure data parallelism over a multi-host submesh ([2, 2], the batch split across hosts and then over each
host's devices) can be written, planned and searched. `dataParallelDim: d` stays and means `dataParallelDims: [d]`.
(The trainer's side, and a real run against mesh [4, 1]: test_data_parallel_dims_training.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from meshjob.cli import main as cli_main
from meshjob.costs.device_costs import range_work, work_cost
from meshjob.errors import SpecError, UsageError
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan
from meshjob.schedule.boundary import BoundaryKey
from meshjob.search.algorithm import Candidate, Problem, default_space, search
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.stage_model import StageChoice, job_figures, stage_choices, stage_figures
from meshjob.spec.manifest import StageSpec, job_to_dict, natural_layout, parse_job

ALL_DP = {"layers": [1, 2], "mesh": [2, 2], "dataParallelDims": [0, 1]}
DOC: dict[str, Any] = {
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "all-dp"},
    "spec": {
        "model": {"kind": "gpt", "layers": 2, "hidden": 16, "heads": 2, "vocab": 32, "seqLen": 8},
        "training": {"steps": 2, "globalBatch": 8, "microbatches": 2},
        "topology": {"devicesPerHost": 2},
        "stages": [{"layers": [0, 1], "mesh": [1, 1]}, ALL_DP],
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy"},
        "schedule": {"kind": "1f1b", "weightGradDelay": 0},
    },
}


def doc_with(**stage1: Any) -> dict[str, Any]:
    """DOC with stage 1's entry replaced by `stage1` (keys in YAML spelling; None deletes one)."""
    doc = copy.deepcopy(DOC)
    stage = {**ALL_DP, **stage1}
    doc["spec"]["stages"][1] = {k: v for k, v in stage.items() if v is not None}
    return doc


def errors(doc: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return {e.path: (e.value, e.allowed) for e in info.value.errors}


# --- the manifest ---------------------------------------------------------------------------


def test_a_stage_shards_its_batch_over_both_dims_of_a_multi_host_mesh():
    st = parse_job(DOC).stages[1]
    assert st.dp_dims == (0, 1) and st.data_parallel == 4 and st.tensor_parallel == 1
    assert natural_layout(st) == "S01RR"


def test_data_parallel_dim_d_means_data_parallel_dims_d():
    one = parse_job(doc_with(mesh=[2, 1], dataParallelDims=None, dataParallelDim=0)).stages[1]
    listed = parse_job(doc_with(mesh=[2, 1], dataParallelDims=[0])).stages[1]
    assert one.dp_dims == listed.dp_dims == (0,)
    assert one.data_parallel == listed.data_parallel == 2
    assert natural_layout(one) == natural_layout(listed) == "S0RR"


def test_the_manifest_is_written_back_as_the_user_wrote_it():
    job = parse_job(DOC)
    written = job_to_dict(job)
    assert written["spec"]["stages"][1] == {"layers": [1, 2], "mesh": [2, 2], "dataParallelDims": [0, 1]}
    assert parse_job(yaml.safe_load(yaml.safe_dump(written))) == job


@pytest.mark.parametrize(
    "mesh, dims, expected",
    [
        ((2, 2), (0, 1), "S01RR"),
        ((1, 2), (0, 1), "S1RR"),  # a dim of size 1 splits nothing
        ((2, 1), (0, 1), "S0RR"),
        ((2, 2, 2), (0, 2), "S02RR"),
        ((2, 2, 2), (0, 1, 2), "S012RR"),
        ((1, 1), (0, 1), "RRR"),
    ],
)
def test_natural_layout_lists_the_data_parallel_dims_major_first(mesh, dims, expected):
    assert natural_layout(StageSpec(layers=(0, 1), mesh=mesh, data_parallel_dims=dims)) == expected


def test_edges_into_and_out_of_the_stage_use_its_layout_and_each_rank_gets_its_tile():
    """S01: the batch in 4 contiguous parts, part k on mesh index (k // 2, k % 2): host 0 holds the first half."""
    job = parse_job(DOC)
    assert [(e.send, e.recv) for e in job.edges] == [("RRR", "S01RR")]
    plan = build_plan(job)
    mesh = plan.mesh(1)
    forward = plan.boundary(BoundaryKey(0, 1, "activation"))
    rows = job.training.microbatch_size
    got = {task.receivers: task.slice[0] for task in forward.tasks}
    assert got == {(mesh.rank_at((k // 2, k % 2)),): (k * rows // 4, (k + 1) * rows // 4) for k in range(4)}
    gradient = plan.boundary(BoundaryKey(1, 0, "activation", grad=True))
    assert sorted(task.slice[0] for task in gradient.tasks) == sorted(got.values())
    assert {task.senders for task in gradient.tasks} == set(got)


@pytest.mark.parametrize(
    "stage1, path, value, allowed",
    [
        (
            {"dataParallelDim": 0},
            "spec.stages[1].dataParallelDims",
            [0, 1],
            "unset when dataParallelDim is set (0): write one of them",
        ),
        ({"dataParallelDims": [0, 2]}, "spec.stages[1].dataParallelDims", [0, 2], "mesh dims in 0..1"),
        ({"dataParallelDims": [1, 0]}, "spec.stages[1].dataParallelDims", [1, 0], "increasing order"),
        ({"dataParallelDims": [1, 1]}, "spec.stages[1].dataParallelDims", [1, 1], "distinct mesh dims"),
        ({"dataParallelDims": []}, "spec.stages[1].dataParallelDims", [], "a list of 1 to 3 items"),
        ({"dataParallelDims": [3]}, "spec.stages[1].dataParallelDims[0]", 3, "an integer in 0..2"),
        ({"dataParallelDims": 0}, "spec.stages[1].dataParallelDims", 0, "a list of 1 to 3 items"),
        (
            {"tensorParallelDim": 1},
            "spec.stages[1].tensorParallelDim",
            1,
            "a mesh dim other than dataParallelDims ([0, 1])",
        ),
    ],
)
def test_refusals_name_the_field_the_value_and_what_is_allowed(stage1, path, value, allowed):
    found = errors(doc_with(**stage1))
    assert path in found, found
    assert found[path][0] == value and allowed in found[path][1]


def test_the_data_parallel_degree_is_the_product_of_the_dims_and_must_divide_the_microbatch():
    doc = copy.deepcopy(DOC)
    doc["spec"]["training"]["globalBatch"] = 4  # microbatches of 2 rows on 4 data-parallel ranks
    value, allowed = errors(doc)["spec.stages[1].mesh"]
    assert value == [2, 2] and "(mesh dims [0, 1] multiply to 4) dividing the microbatch size 2" in allowed


def test_the_cli_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc_with(dataParallelDim=1)))
    assert cli_main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.stages[1].dataParallelDims: [0, 1] is invalid: unset when dataParallelDim is set (1)" in err


# --- the search -------------------------------------------------------------------------------


def search_doc(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"kind": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32},
            "training": {"globalBatch": 8},
            **spec,
        },
    }


def cluster(nic: float = 1e9 / 8, intra: float | None = None) -> Cluster:
    device = DEVICES["h100"]
    network = NetworkModel(nic_bytes_per_s=nic, intra_host_bytes_per_s=intra or device.link_bytes_per_s)
    return Cluster(2, 2, device, network)


def test_the_search_enumerates_the_all_data_parallel_choice_on_whole_hosts_only():
    job = base_job(search_doc(), 2)
    choices = stage_choices(job.model, job.training, cluster())
    all_dp = [c for c in choices if len(c.dp_dims) > 1]
    assert all_dp == [StageChoice((2, 2), (0, 1), None)]
    assert (all_dp[0].dp, all_dp[0].tp, all_dp[0].label()) == (4, 1, "2x2 dp4 tp1")


def test_the_all_data_parallel_ring_crosses_each_nic_once_at_the_nic_rate():
    """One ring over the 4 devices, host by host: each host's NIC carries 2 (n - 1) / n of the gradients once
    each way (one flow); the hops inside a host run beside it unless the intra-host link is the slower."""
    job = base_job(search_doc(), 2)
    c = cluster()
    choice = StageChoice((2, 2), (0, 1), None)
    fig = stage_figures(job.model, job.training, c, 0, 4, choice)
    params = work_cost(range_work(job.model, job.training, 0, 4, 4, 1), c.device.profile).params
    share = 2 * 3 / 4 * job.training.grad_reduce_itemsize * params  # what each device sends and receives
    assert fig.sync.flows == 1
    assert fig.sync.nic_s == pytest.approx(share / c.network.nic_bytes_per_s)
    assert fig.allreduce_s == pytest.approx(share / c.network.nic_bytes_per_s + 2 * 3 * c.network.message_s)
    slow_inside = cluster(intra=c.network.nic_bytes_per_s / 10)
    slow = stage_figures(job.model, job.training, slow_inside, 0, 4, choice)
    assert slow.allreduce_s == pytest.approx(
        share / slow_inside.network.intra_host_bytes_per_s + 6 * c.network.message_s
    )


def test_tensor_parallelism_across_hosts_runs_at_the_nic_rate_inside_a_host_at_the_device_link():
    job = base_job(search_doc(), 2)
    across, inside = StageChoice((2, 2), (1,), 0), StageChoice((2, 2), (0,), 1)
    slow, fast = cluster(nic=1e9 / 8), cluster(nic=1e11 / 8)

    def forward(c: Cluster, choice: StageChoice) -> float:
        return stage_figures(job.model, job.training, c, 1, 3, choice).cost.forward_s

    assert forward(slow, inside) == forward(fast, inside)
    # Megatron's two all-reduces per block, each a ring of 2 ranks through the NIC, which the host's 2 rings share
    act = job.training.activation_itemsize * job.training.microbatch_size / 2 * 32 * 64
    ring = 2 * 1 / 2 * act / (slow.network.nic_bytes_per_s / 2) + 2 * slow.network.message_s
    fast_ring = 2 * 1 / 2 * act / (fast.network.nic_bytes_per_s / 2) + 2 * fast.network.message_s
    assert forward(slow, across) - forward(fast, across) == pytest.approx(2 * 2 * (ring - fast_ring))


def test_a_manifest_the_search_writes_with_the_choice_round_trips():
    doc = search_doc(schedule={"kind": "gpipe", "weightGradDelay": 0})
    doc["spec"]["training"]["microbatches"] = 2
    c = cluster()
    job = base_job(doc, c.devices_per_host)
    fixed = read_fixed(doc)
    p = Problem(doc, job, c, fixed, default_space(job, fixed, c))
    choice = StageChoice((2, 2), (0, 1), None)
    candidate = Candidate(2, "gpipe", "0", (4,), (choice,))
    written = p.manifest(candidate)
    assert written["spec"]["stages"] == [{"layers": [0, 4], "mesh": [2, 2], "dataParallelDims": [0, 1]}]
    reread = yaml.safe_load(yaml.safe_dump(written))
    assert read_fixed(reread).per_stage[0].choice == choice  # a fixed stage the search matches again
    tuned = parse_job(reread)
    assert natural_layout(tuned.stages[0]) == "S01RR"
    assert job_figures(tuned, c) == p.figures(candidate)
    prediction = p.predict(candidate)  # priced end to end: plan, simulation, gradient ring
    assert prediction is not None and prediction.allreduce_s == pytest.approx(p.figures(candidate)[0].allreduce_s)


def test_a_fixed_all_data_parallel_stage_is_searched_as_written():
    stage = {"layers": [0, 4], "mesh": [2, 2], "dataParallelDims": [0, 1]}
    doc = search_doc(stages=[stage], schedule={"kind": "gpipe", "weightGradDelay": 0})
    doc["spec"]["training"]["microbatches"] = 2  # 4 rows per microbatch, one per data-parallel rank
    c = cluster()
    job = base_job(doc, c.devices_per_host)
    fixed = read_fixed(doc)
    space = default_space(job, fixed, c)
    p = Problem(doc, job, c, fixed, space)
    best = search(p, max_evaluations=10**5).best
    assert best.candidate.choices == (StageChoice((2, 2), (0, 1), None),)
    assert best.candidate.choices[0].to_stage(0, 4) == stage


def test_the_search_refuses_both_spellings_on_one_stage():
    stage = {"layers": [0, 4], "mesh": [2, 2], "dataParallelDim": 0, "dataParallelDims": [0, 1]}
    with pytest.raises(UsageError, match=r"spec.stages\[0\].dataParallelDims: \[0, 1\] is invalid: unset when"):
        read_fixed(search_doc(stages=[stage]))
