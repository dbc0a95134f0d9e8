"""meshjob.search.gradient_sync: the step's tail after the pipeline (gradient all-reduce, then optimizer step), with
stages whose rings cross the same hosts sharing those hosts' NICs."""

from __future__ import annotations

import pytest

from meshjob.plan.build import build_plan
from meshjob.search.gradient_sync import GradientSync, stage_hosts, tail_ends
from meshjob.spec.manifest import parse_job


def test_a_stage_alone_on_its_hosts_takes_its_ring_then_its_fixed_part():
    assert tail_ends([2.0], [GradientSync(1.0, 1, 0.25)], [{1, 2}]) == pytest.approx([3.25])


def test_two_stages_whose_rings_cross_the_same_hosts_share_the_nics():
    syncs = [GradientSync(1.0, 1, 0.0), GradientSync(1.0, 1, 0.0)]
    assert tail_ends([0.0, 0.0], syncs, [{1, 2}, {1, 2}]) == pytest.approx([2.0, 2.0])
    assert tail_ends([0.0, 0.0], syncs, [{1, 2}, {3, 4}]) == pytest.approx([1.0, 1.0])


def test_a_later_ring_shares_only_while_both_run():
    # the first runs alone for 0.5 s (half done), both then share until it ends at 1.5, the second ends alone
    ends = tail_ends([0.0, 0.5], [GradientSync(1.0, 1, 0.1), GradientSync(1.0, 1, 0.0)], [{0, 1}, {1, 2}])
    assert ends == pytest.approx([1.6, 2.0])


def test_a_host_shares_its_nic_per_ring_and_a_stage_runs_at_its_busiest_hosts_pace():
    # stage 0 runs 2 rings through host 1 (alone each gets half: nic_s counts that), stage 1 one ring:
    # together host 1 carries 3 rings, stage 0 goes at 2/3 of its own pace, stage 1 at 1/3 (done at 0.75),
    # then stage 0 alone finishes its last half
    ends = tail_ends([0.0, 0.0], [GradientSync(1.0, 2, 0.0), GradientSync(0.25, 1, 0.0)], [{1}, {1, 2}])
    assert ends == pytest.approx([1.25, 0.75])


def test_a_ring_inside_one_host_and_the_optimizer_step_are_not_slowed_by_other_stages():
    syncs = [GradientSync(0.0, 0, 0.3), GradientSync(1.0, 1, 0.0)]
    assert tail_ends([1.0, 0.0], syncs, [{1}, {1, 2}]) == pytest.approx([1.3, 1.0])


def test_stage_hosts_are_where_the_placement_puts_each_stages_devices():
    doc = {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"kind": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 16},
            "training": {"globalBatch": 4, "microbatches": 2},
            "topology": {"devicesPerHost": 2},
            "stages": [
                {"layers": [0, 1], "mesh": [1, 2], "tensorParallelDim": 1},
                {"layers": [1, 2], "mesh": [2, 1], "dataParallelDim": 0},
                {"layers": [2, 3], "mesh": [1, 2], "tensorParallelDim": 1},
                {"layers": [3, 4], "mesh": [2, 1], "dataParallelDim": 0},
            ],
        },
    }
    hosts = stage_hosts(build_plan(parse_job(doc)).placement)
    assert len(hosts[0]) == len(hosts[2]) == 1 and len(hosts[1]) == 2 and hosts[1] == hosts[3]
