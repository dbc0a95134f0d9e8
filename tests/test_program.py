"""Per-rank communication programs: the ordered sends and receives an executor follows."""

from __future__ import annotations

import pytest

from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import simulate_transfer
from meshjob.spec.manifest import load_job, parse_job

CHAIN = {  # stage 1 replicated on two hosts: every forward task is a chain, cut into chunks
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "chain"},
    "spec": {
        "model": {"kind": "gpt", "layers": 4, "hidden": 1024, "heads": 2, "vocab": 64, "seqLen": 8},
        "training": {"steps": 1, "globalBatch": 8, "microbatches": 4, "seed": 0},
        "topology": {"devicesPerHost": 2},
        "stages": [
            {"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1},
            {"layers": [2, 4], "mesh": [2, 1], "tensorParallelDim": 0},
        ],
        "resharding": {"strategy": "broadcast", "chunks": "auto", "balancer": "greedy", "budgetSeconds": 0.2},
    },
}


@pytest.fixture(scope="module")
def plan():
    return build_plan(parse_job(CHAIN), network=NetworkModel(message_s=20e-6))


def programs(plan, b):
    ranks = plan.placement.world_size
    return {r: plan.program(b, r) for r in range(ranks)}


def test_every_step_is_sent_once_by_its_source_and_received_once_by_its_destination(plan):
    for b in plan.boundaries:
        progs = programs(plan, b)
        sent = sorted(s.id for p in progs.values() for s in p.sends)
        received = sorted(s.id for p in progs.values() for s in p.recvs)
        assert sent == received == sorted(s.id for s in b.steps)
        assert all(s.src == r for r, p in progs.items() for s in p.sends)
        assert all(s.dst == r for r, p in progs.items() for s in p.recvs)


def test_a_forwarding_rank_sends_each_chunk_after_it_lands_and_chunks_in_order(plan):
    forward = plan.boundaries[0]
    assert max(forward.schedule.chunks) > 1
    timed = simulate_transfer(forward.steps, plan.placement.host_of, plan.network)
    for prog in programs(plan, forward).values():
        landed = {s.id: timed.finish_s[s.id] for s in prog.recvs}
        for step in prog.sends:
            for dep in step.after:  # a forward waits for what this rank received
                assert dep in landed and landed[dep] <= timed.start_s[step.id] + 1e-12
        starts = [timed.start_s[s.id] for s in prog.sends]
        assert starts == sorted(starts)


def test_sends_name_the_link_they_use(plan):
    for b in plan.boundaries:
        for prog in programs(plan, b).values():
            for step, link in zip(prog.sends, prog.send_links):
                src, dst = plan.placement.host_of(step.src), plan.placement.host_of(step.dst)
                assert link == ((src, "local") if src == dst else (src, "out"))


def test_a_rank_outside_the_boundary_has_an_empty_program():
    plan = build_plan(load_job("examples/gpt-demo.yaml"))
    b = plan.boundary(BoundaryKey(0, 1, "activation"))
    outside = next(
        r for r in range(plan.placement.world_size) if r not in plan.mesh(0).ranks and r not in plan.mesh(1).ranks
    )
    prog = plan.program(b, outside)
    assert prog.sends == () and prog.recvs == () and prog.send_bytes == 0


def test_receives_name_the_link_they_arrive_on(plan):
    for b in plan.boundaries:
        for prog in programs(plan, b).values():
            assert len(prog.recv_links) == len(prog.recvs)
            for step, link in zip(prog.recvs, prog.recv_links):
                src, dst = plan.placement.host_of(step.src), plan.placement.host_of(step.dst)
                assert link == ((dst, "local") if src == dst else (dst, "in"))


def test_a_rank_posts_the_receives_from_each_peer_in_the_order_that_peer_sends_them(plan):
    """What NCCL needs, and what lets a receiver bound what it posts per link without a deadlock."""
    for b in plan.boundaries:
        progs = programs(plan, b)
        for rank, prog in progs.items():
            for peer in {s.src for s in prog.recvs}:
                received = [s.id for s in prog.recvs if s.src == peer]
                assert received == [s.id for s in progs[peer].sends if s.dst == rank]


def test_receives_are_in_planned_start_order(plan):
    for b in plan.boundaries:
        timed = simulate_transfer(b.steps, plan.placement.host_of, plan.network)
        for prog in programs(plan, b).values():
            starts = [timed.start_s[s.id] for s in prog.recvs]
            assert starts == sorted(starts)
