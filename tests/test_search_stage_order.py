"""`meshjob tune` searches the stage order (spec.topology.stageOrder) where the model has skip edges, and bounds
each candidate by its busiest ingress link as placement lays it out (Problem.nic_floor_s): the bound stays below
the simulated step, and the search still equals exhaustive enumeration. For such models the space also holds
strided submeshes (one device on each of n hosts), so that a folded stage's mirror takes the hosts' other devices."""

from __future__ import annotations

import random

import pytest
from test_search import manifest, problem

from meshjob.plan.placement import Host, place
from meshjob.search.algorithm import exhaustive, search
from meshjob.search.inputs import read_fixed
from meshjob.search.stage_model import StageChoice
from meshjob.spec.manifest import parse_job


def u_manifest(layers: int, **kw) -> dict:
    doc = manifest(layers, **kw)
    doc["spec"]["model"]["kind"] = "utransformer"
    return doc


def random_u_case(seed: int):
    rng = random.Random(seed)
    hosts, per_host = rng.choice([(2, 2), (4, 1), (2, 1)])
    doc = u_manifest(rng.choice([2, 4]), hidden=rng.choice([64, 128]), batch=rng.choice([4, 8]), seq=64)
    return problem(
        doc,
        hosts,
        per_host,
        nic=rng.choice([1e7, 1e8, 1e9]) / 8,
        microbatches=(2, 4),
        schedules=(("1f1b", 0), ("eager-1f1b", "auto")),
        strategies=("broadcast",),
        balancers=("greedy",),
    )


def test_the_space_has_both_orders_for_skip_edges_and_keeps_an_order_the_manifest_fixes():
    assert problem(u_manifest(4), 2, 2).space.stage_orders == ("chain", "fold")
    assert problem(manifest(4), 2, 2).space.stage_orders == ("chain",)  # no skip edges: fold only cuts the chain
    fixed = u_manifest(4)
    fixed["spec"]["topology"] = {"stageOrder": "chain"}
    assert read_fixed(fixed).stage_order == "chain"
    assert problem(fixed, 2, 2).space.stage_orders == ("chain",)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_stage_orders_the_search_equals_exhaustive_enumeration(seed):
    p = random_u_case(seed)
    found = search(p, max_evaluations=10**6)
    assert found.proven
    assert found.best.step_s == pytest.approx(exhaustive(p).step_s, rel=1e-9)


def test_the_ingress_bound_stays_below_the_simulated_step_and_decides_the_deep_pipelines_bounds():
    p = problem(u_manifest(4, hidden=128, batch=8, seq=64), 4, 1, nic=1e7 / 8, microbatches=(4,))
    for c in _four_stage_candidates(p):  # four hosts of one device: every edge, skip edges too, crosses a NIC
        step = p.predict(c).step_s
        assert p.nic_floor_s(c) > p.pipeline_bound(c)
        assert p.bound(c) <= step * (1 + 1e-9)
    for prediction in search(p, top=50, max_evaluations=10**6).ranked:
        assert prediction.bound_s <= prediction.step_s * (1 + 1e-9)


def test_on_a_slow_network_a_folded_u_transformer_wins_and_its_manifest_says_fold():
    """Four one-device stages on two hosts of two: folded, the skip edge 0 -> 3 stays on a host."""
    p = problem(
        u_manifest(4, hidden=128, batch=8, seq=64),
        2,
        2,
        nic=1e7 / 8,
        microbatches=(4,),
        schedules=(("1f1b", 0),),
        strategies=("broadcast",),
        balancers=("greedy",),
        max_stages=4,
    )
    chain = [c for c in _four_stage_candidates(p) if c.stage_order == "chain"][0]
    fold = [c for c in _four_stage_candidates(p) if c.stage_order == "fold"][0]
    assert p.nic_floor_s(fold) < p.nic_floor_s(chain)
    assert p.predict(fold).step_s < p.predict(chain).step_s
    assert p.manifest(fold)["spec"]["topology"]["stageOrder"] == "fold"
    assert "stageOrder" not in p.manifest(chain)["spec"]["topology"]


def _four_stage_candidates(p):
    one = next(ch for ch in p.tables(4).choices if ch.devices == 1)
    return p.expand(4, "1f1b", 0, (1, 1, 1, 1), (one,) * 4)


def test_strided_submeshes_are_offered_only_where_skip_edges_can_share_the_hosts():
    meshes = lambda doc: {ch.mesh for ch in problem(doc, 4, 2).tables(2).choices}  # noqa: E731
    assert {(2, 1), (4, 1)} <= meshes(u_manifest(4))
    assert not {(2, 1), (4, 1)} & meshes(manifest(4))  # a chain gains nothing from half-used hosts


def test_a_folded_stage_on_one_device_of_two_hosts_shares_those_hosts_with_its_mirror():
    doc = u_manifest(4, hidden=128, batch=8, seq=64)
    doc["spec"]["topology"] = {"devicesPerHost": 2, "stageOrder": "fold"}
    doc["spec"]["stages"] = [{"layers": [i, i + 1], "mesh": [2, 1], "dataParallelDim": 0} for i in range(4)]
    doc["spec"]["training"]["microbatches"] = 2
    placement = place(parse_job(doc), [Host(name, 2) for name in "abcd"])
    hosts = [set(placement.mesh(k).hosts) for k in range(4)]
    assert hosts[0] == hosts[3] and hosts[1] == hosts[2] and not hosts[0] & hosts[1]


def test_folded_strided_stages_keep_the_skip_edges_off_the_nics_and_beat_the_chained_ones():
    """Four hosts of two devices, four stages of one device on each of two hosts: folded, the skip edges 0 -> 3
    and 1 -> 2 stay on their hosts; chained, they cross the NICs."""
    p = problem(u_manifest(4, hidden=128, batch=8, seq=64), 4, 2, nic=1e8 / 8, microbatches=(2,))
    strided = StageChoice((2, 1), (0,), None)
    assert strided in p.tables(2).choices
    by_order = {c.stage_order: c for c in p.expand(2, "1f1b", 0, (1, 1, 1, 1), (strided,) * 4)}
    fold, chain = by_order["fold"], by_order["chain"]
    assert p.nic_floor_s(fold) < p.nic_floor_s(chain)
    assert p.predict(fold).step_s < p.predict(chain).step_s
    assert p.bound(fold) <= p.predict(fold).step_s * (1 + 1e-9)
