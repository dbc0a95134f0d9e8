"""The Plan: placement + boundaries + schedules, and its JSON contract (`meshjob plan --json`)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meshjob.errors import PlacementError
from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan, plan_boundary
from meshjob.plan.placement import Host
from meshjob.resharding.strategies import task_cost
from meshjob.schedule.actions import Action, validate, warmup_forwards
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import simulate_transfer
from meshjob.spec.manifest import load_job, parse_job
from meshjob.spec.model import ReshardingSpec

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "plan-test"},
    "spec": {
        "model": {"kind": "gpt", "layers": 4, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 8},
        "training": {"steps": 2, "globalBatch": 8, "microbatches": 4, "seed": 3},
        "topology": {"devicesPerHost": 2},
        "stages": [
            {"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1},
            {"layers": [2, 4], "mesh": [2, 1], "dataParallelDim": 0},
        ],
        "resharding": {"strategy": "broadcast", "chunks": 4, "balancer": "greedy", "budgetSeconds": 0.2},
        "schedule": {"kind": "eager-1f1b", "weightGradDelay": 0},
    },
}


def make_job(**spec_changes: Any):
    doc = copy.deepcopy(BASE)
    for key, value in spec_changes.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key].update(value)
        else:
            doc["spec"][key] = value
    return parse_job(doc)


def utransformer_job(**spec_changes: Any):
    changes: dict[str, Any] = {
        "model": {"kind": "utransformer", "layers": 6},
        "stages": [
            {"layers": [0, 2], "mesh": [1, 2], "dataParallelDim": 1},
            {"layers": [2, 4], "mesh": [2, 1], "dataParallelDim": 0},
            {"layers": [4, 6], "mesh": [1, 2], "tensorParallelDim": 1},
        ],
    }
    changes.update(spec_changes)
    return make_job(**changes)


# --- the JSON contract -------------------------------------------------------------------------


def assert_contract(doc: dict[str, Any], num_stages: int) -> None:
    assert isinstance(doc["placement"], list) and doc["placement"]
    for row in doc["placement"]:
        assert isinstance(row["stage"], int)
        assert isinstance(row["host"], str)
        assert isinstance(row["devices"], list) and all(isinstance(d, int) for d in row["devices"])
    assert isinstance(doc["boundaries"], list) and doc["boundaries"]
    for b in doc["boundaries"]:
        for key in ("from", "to"):
            assert isinstance(b[key], int)
        for key in ("tensor", "send", "recv", "strategy", "balancer"):
            assert isinstance(b[key], str)
        for key in ("makespan_s", "lower_bound_s"):
            assert isinstance(b[key], float) and b[key] >= 0
        assert b["tasks"]
        for task in b["tasks"]:
            assert all(isinstance(iv, list) and len(iv) == 2 and iv[0] < iv[1] for iv in task["slice"])
            assert isinstance(task["sender"], int) and task["sender"] in task["senders"]
            assert task["receivers"] and all(isinstance(r, int) for r in task["receivers"])
            assert isinstance(task["bytes"], int) and task["bytes"] > 0
            assert isinstance(task["start_s"], float) and task["start_s"] >= 0
    assert set(doc["schedules"]) == {str(s) for s in range(num_stages)}
    for actions in doc["schedules"].values():
        assert all(isinstance(a, str) for a in actions)
        assert [str(Action.parse(a)) for a in actions] == actions


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_plans_follow_the_json_contract(path: Path) -> None:
    job = load_job(str(path))
    doc = json.loads(json.dumps(build_plan(job).to_json()))
    assert_contract(doc, len(job.stages))
    assert doc["world_size"] == job.world_size


def test_handmade_job_plan_follows_the_json_contract() -> None:
    job = utransformer_job()
    doc = json.loads(json.dumps(build_plan(job).to_json()))
    assert_contract(doc, 3)


def test_same_job_gives_the_same_json() -> None:
    first = json.dumps(build_plan(utransformer_job()).to_json(), sort_keys=True)
    second = json.dumps(build_plan(utransformer_job()).to_json(), sort_keys=True)
    assert first == second


def test_digest_identifies_the_plan() -> None:
    assert build_plan(make_job()).digest() == build_plan(make_job()).digest()
    assert build_plan(make_job()).digest() != build_plan(make_job(), nic_bytes_per_s=1e6).digest()
    assert build_plan(make_job()).digest() != build_plan(make_job(schedule={"kind": "1f1b"})).digest()


def test_placement_json_lists_every_rank_once_stage_by_stage() -> None:
    doc = build_plan(make_job()).to_json()
    assert [(row["stage"], row["devices"]) for row in doc["placement"]] == [(0, [0, 1]), (1, [2]), (1, [3])]
    hosts_of_stage1 = [row["host"] for row in doc["placement"] if row["stage"] == 1]
    assert len(set(hosts_of_stage1)) == 2


# --- boundaries --------------------------------------------------------------------------------


def test_every_edge_has_a_forward_and_a_backward_boundary() -> None:
    job = utransformer_job()
    plan = build_plan(job)
    keys = {(b.key, str(b.send), str(b.recv)) for b in plan.boundaries}
    assert len(plan.boundaries) == 2 * len(job.edges)
    for e in job.edges:
        assert (BoundaryKey(e.src, e.dst, e.tensor), e.send, e.recv) in keys
        assert (BoundaryKey(e.dst, e.src, e.tensor, grad=True), e.recv, e.send) in keys
    assert any(e.dst - e.src > 1 for e in job.edges)  # a skip edge crosses stages


def test_boundary_tasks_carry_the_whole_activation_between_the_right_meshes() -> None:
    job = make_job()
    plan = build_plan(job)
    numel = math.prod(job.activation_shape())
    for b in plan.boundaries:
        src, dst = set(plan.mesh(b.src).ranks), set(plan.mesh(b.dst).ranks)
        assert sum(t.bytes for t in b.tasks) == numel * 4  # slices partition the tensor
        for task, sender in zip(b.tasks, b.senders):
            assert sender in task.senders and set(task.senders) <= src
            assert set(task.receivers) <= dst


def test_steps_are_lowered_in_task_start_order_from_the_chosen_senders() -> None:
    plan = build_plan(utransformer_job(resharding={"chunks": 2}))
    for b in plan.boundaries:
        starts = [b.schedule.start_s[s.task] for s in b.steps]
        assert starts == sorted(starts)
        assert [s.id for s in b.steps] == list(range(len(b.steps)))
        first_of_task = {}
        for s in b.steps:
            first_of_task.setdefault(s.task, s)
        for task, step in first_of_task.items():
            assert step.src == b.senders[task]


def test_makespan_is_at_least_the_lower_bound() -> None:
    for strategy in ("send_recv", "local_allgather", "global_allgather", "broadcast"):
        plan = build_plan(make_job(resharding={"strategy": strategy}))
        for b in plan.boundaries:
            assert b.makespan_s >= b.lower_bound_s * (1 - 1e-9) > 0
            assert b.strategy == strategy


def _mesh_4x2(first_rank: int) -> Mesh:
    """Four hosts of two devices, host = rank // 2."""
    ranks = tuple(range(first_rank, first_rank + 8))
    return Mesh((4, 2), ranks, tuple(r // 2 for r in ranks))


def test_an_allgather_boundary_is_timed_message_by_message_where_its_tasks_rings_interleave() -> None:
    # 4x2 -> 4x2 meshes, S0R -> RR: four tasks, each a ring over all eight receiving devices. The balancer
    # holds each task's links from its first message to its last and so serialises them; the executor
    # (and meshjob.simulate.simulator) interleaves their messages on the links.
    src, dst = _mesh_4x2(0), _mesh_4x2(8)
    boundary = plan_boundary(
        BoundaryKey(0, 1, "x"),
        (256, 1024),
        (src, ShardingSpec.parse("S0R")),
        (dst, ShardingSpec.parse("RR")),
        ReshardingSpec("global_allgather", 1, "greedy"),
        lambda rank: rank // 2,
    )
    timed = simulate_transfer(boundary.steps, lambda rank: rank // 2, NetworkModel()).makespan_s
    assert len(boundary.tasks) == 4
    assert boundary.makespan_s == boundary.timed_s == timed
    assert boundary.makespan_s < boundary.schedule.makespan_s / 1.2
    assert boundary.to_json()["makespan_s"] == timed


def test_an_allgather_window_times_its_boundaries_steps_together_in_the_joint_schedules_order() -> None:
    job = load_job(next(p for p in EXAMPLES if p.name == "utransformer-demo.yaml"))
    plan = build_plan(replace(job, resharding=replace(job.resharding, strategy="global_allgather")))
    (window,) = plan.windows
    members = [plan.boundaries[b] for b in window.boundaries]
    keyed, first = [], 0
    for k, boundary in enumerate(members):  # ids apart: each boundary numbers its steps from 0
        keyed += [
            (
                window.schedule.start_s[window.offsets[k] + s.task],
                first + s.id,
                replace(s, id=s.id + first, after=tuple(a + first for a in s.after)),
            )
            for s in boundary.steps
        ]
        first += max(s.id for s in boundary.steps) + 1
    steps = [s for _, _, s in sorted(keyed, key=lambda x: x[:2])]
    together = simulate_transfer(steps, plan.placement.host_of, plan.network).makespan_s
    assert window.makespan_s == window.timed_s == pytest.approx(together)
    assert max(b.makespan_s for b in members) <= window.makespan_s <= window.schedule.makespan_s * (1 + 1e-9)
    assert window.to_json()["makespan_s"] == window.makespan_s


def test_a_broadcast_window_keeps_its_joint_schedules_makespan() -> None:
    plan = build_plan(make_job())
    assert all(w.timed_s is None and w.makespan_s == w.schedule.makespan_s for w in plan.windows)


def test_a_broadcast_boundary_keeps_its_schedules_makespan() -> None:
    src, dst = _mesh_4x2(0), _mesh_4x2(8)
    boundary = plan_boundary(
        BoundaryKey(0, 1, "x"),
        (256, 1024),
        (src, ShardingSpec.parse("S0R")),
        (dst, ShardingSpec.parse("RR")),
        ReshardingSpec("broadcast", 4, "greedy"),
        lambda rank: rank // 2,
    )
    assert boundary.timed_s is None
    assert boundary.makespan_s == boundary.schedule.makespan_s


def test_a_cpu_bound_broadcast_on_shared_cores_is_planned_as_the_simulator_times_it() -> None:
    # 4x2 -> 4x2, RS1 -> S1R with K=64 on an emulated cluster (two shared cores): the chains' CPU on the
    # shared cores is as long as their link time, so the two contend; the plan's makespan takes that
    # into account as the simulator does, not only the larger of the two.
    from meshjob.network.model import emulated_network

    network = emulated_network(1.25e8, 2)
    src, dst = _mesh_4x2(0), _mesh_4x2(8)
    boundary = plan_boundary(
        BoundaryKey(0, 1, "x"),
        (2048, 2048),
        (src, ShardingSpec.parse("RS1")),
        (dst, ShardingSpec.parse("S1R")),
        ReshardingSpec("broadcast", 64, "greedy"),
        lambda rank: rank // 2,
        network=network,
    )
    schedule = boundary.schedule
    timed = simulate_transfer(boundary.steps, lambda rank: rank // 2, network).makespan_s
    assert schedule.makespan_s > max(b + d for b, d in zip(schedule.start_s, schedule.seconds)) * 1.05
    assert boundary.makespan_s == pytest.approx(timed, rel=0.02)


def test_chunks_auto_takes_each_tasks_k_from_the_network_model_and_an_integer_forces_it() -> None:
    from meshjob.network.model import NetworkModel
    from meshjob.plan.build import host_task
    from meshjob.resharding.window import with_shares

    network = NetworkModel(message_s=20e-6)
    job = make_job(
        model={"hidden": 1024},
        stages=[
            {"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1},
            {"layers": [2, 4], "mesh": [2, 1], "tensorParallelDim": 0},
        ],  # replicated on 2 hosts
        resharding={"chunks": "auto"},
    )
    auto = build_plan(job, network=network)
    (step,) = auto.windows
    balanced = with_shares([host_task(t, auto.placement.host_of) for b in auto.boundaries for t in b.tasks])
    for i, task in enumerate(balanced):
        best = task_cost(network, task, step.schedule.sender_host[i], "broadcast", "auto").chunks
        assert step.schedule.chunks[i] == best
    assert all(b.chunks == "auto" for b in auto.boundaries)
    # a chain to 2 hosts is cut finer than one hop whose head copies to its host's other device
    assert set(step.schedule.chunks) == {5, 2}
    forced = build_plan(utransformer_job(resharding={"chunks": 3}))
    assert {k for b in forced.boundaries for k in b.schedule.chunks} == {3}
    assert all(
        len({s.region for s in b.steps if s.task == 0 and s.src == b.senders[0]}) == 3 for b in forced.boundaries
    )


def test_a_slower_nic_scales_the_makespan() -> None:
    from meshjob.network.model import NetworkModel

    bytes_only = {"message_s": 0.0, "intra_message_s": 0.0, "intra_host_bytes_per_s": 1e18}
    fast = build_plan(make_job(), network=NetworkModel(nic_bytes_per_s=1e9, **bytes_only))
    slow = build_plan(make_job(), network=NetworkModel(nic_bytes_per_s=1e8, **bytes_only))
    for f, s in zip(fast.boundaries, slow.boundaries):
        assert s.makespan_s == pytest.approx(10 * f.makespan_s)


def test_explicit_hosts_are_used_and_too_few_raise_placement_error() -> None:
    hosts = [Host("a", 4, "r0"), Host("b", 4, "r0")]
    plan = build_plan(make_job(), hosts)
    assert {row["host"] for row in plan.to_json()["placement"]} <= {"a", "b"}
    with pytest.raises(PlacementError, match="missing 1 host"):
        build_plan(make_job(), [Host("a", 4)])


# --- schedules ---------------------------------------------------------------------------------


def edges_of(job) -> list[tuple[int, int, str]]:
    return [(e.src, e.dst, e.tensor) for e in job.edges]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("delay", [0, 1, 2, "auto"])
def test_plan_schedules_validate_for_every_kind_and_delay_mode(kind: str, delay: int | str) -> None:
    job = utransformer_job(schedule={"kind": kind, "weightGradDelay": delay})
    plan = build_plan(job)
    validate(plan.schedules, edges_of(job), job.training.microbatches, plan.split_backward)
    assert plan.split_backward == (delay != 0)


def test_eager_schedule_warmup_follows_the_formula_in_the_plan() -> None:
    job = utransformer_job()
    plan = build_plan(job)
    for stage, actions in plan.schedules.items():
        computes = [a.kind for a in actions if not a.is_comm]
        assert computes.index("B") == warmup_forwards("eager-1f1b", stage, 3, job.training.microbatches)


def test_weight_delay_n_delays_n_ws_on_stages_that_send_gradients() -> None:
    plan = build_plan(make_job(schedule={"weightGradDelay": 1}))
    assert plan.weight_delay == {0: 0, 1: 1}
    assert build_plan(make_job(schedule={"weightGradDelay": 2})).weight_delay == {0: 0, 1: 2}


def test_weight_delay_n_is_capped_at_microbatches_minus_one() -> None:
    job = make_job(schedule={"weightGradDelay": 4000})
    assert build_plan(job).weight_delay == {0: 0, 1: job.training.microbatches - 1}


def test_weight_delay_0_does_not_split_the_backward() -> None:
    plan = build_plan(make_job(schedule={"weightGradDelay": 0}))
    assert plan.split_backward is False and plan.weight_delay == {}


def test_weight_delay_auto_by_the_ratio_rule_grows_with_communication_time() -> None:
    job = make_job(schedule={"weightGradDelay": "auto"})
    fast = build_plan(job, nic_bytes_per_s=1e15, simulate_delays=False)
    slow = build_plan(job, nic_bytes_per_s=1e3, simulate_delays=False)
    assert fast.weight_delay == {0: 0, 1: 1}  # any communication at all needs one W to cover it
    # capped where stage 1's stash would pass eager-1F1B's stage-0 bound min(M, 2S-1) = 3:
    # it warms up with 1 forward, so it may keep 2 delayed W's
    assert slow.weight_delay == {0: 0, 1: 2}
    doc = slow.to_json()["schedule"]
    assert doc["weight_delay"] == {"0": 0, "1": 2}
    assert doc["split_backward"] is True and doc["stash_bound"] == 3
    assert doc["peak_stashed"] == {"0": 3, "1": 3}
