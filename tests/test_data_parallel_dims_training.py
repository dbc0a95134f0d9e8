"""The trainer's side of `dataParallelDims` (the manifest and the search: test_data_parallel_dims.py): one
data-parallel group over several mesh dims, ranked in the order of the batch's tiles (S01: along dim 0, then
dim 1), the checkpoint fingerprint, and a real `meshjob run` of an all-data-parallel [2, 2] stage that trains
to the losses of the same job with the stage on a [4, 1] mesh."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from conftest import run_losses
from test_data_parallel_dims import DOC as MANIFEST

from meshjob.layout.mesh import Mesh
from meshjob.spec.manifest import StageSpec, parse_job
from meshjob_trainer.checkpoint import spec_fingerprint

DOC: dict[str, Any] = copy.deepcopy(MANIFEST)  # the manifest tests' job, trained: a learning rate and a seed
DOC["spec"]["training"].update({"learningRate": 1.0e-2, "seed": 0})


def with_stage1(stage: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["spec"]["stages"][1] = stage
    return doc


def test_the_fingerprint_reads_what_the_dims_mean_not_how_they_are_written():
    one = parse_job(with_stage1({"layers": [1, 2], "mesh": [2, 2], "dataParallelDim": 0}))
    listed = parse_job(with_stage1({"layers": [1, 2], "mesh": [2, 2], "dataParallelDims": [0]}))
    both = parse_job(DOC)
    assert spec_fingerprint(one, 5) == spec_fingerprint(listed, 5)
    assert "spec.stages[1].dataParallelDims" not in spec_fingerprint(one, 5)  # older checkpoints still load
    fp = spec_fingerprint(both, 5)
    assert fp["spec.stages[1].dataParallelDims"] == [0, 1] and fp["spec.stages[1].dataParallelDim"] is None


def _groups_worker(env) -> tuple[int, int, int, float]:
    """(dp_rank, dp_size, replica_rank, the sum of every rank's number over the DP group) on one [2, 2] stage
    all data parallel, then data parallel over dim 0 alone (dim 1 then holds redundant replicas)."""
    import torch
    import torch.distributed as dist

    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.parallel import build_groups

    init_distributed(env, timeout_s=30)
    try:
        out = []
        for dims in ((0, 1), (0,)):
            spec = StageSpec(layers=(0, 1), mesh=(2, 2), data_parallel_dims=dims)
            g = build_groups([spec], [Mesh.grid((2, 2))], env.rank)
            total = torch.tensor([float(env.rank)])
            dist.all_reduce(total, group=g.dp_group)
            out.append((g.dp_rank, g.dp_size, g.replica_rank, total.item()))
        return out
    finally:
        shutdown_distributed()


@pytest.mark.slow
def test_a_data_parallel_group_spans_both_dims_ranked_as_the_batchs_tiles(gang):
    """Rank r sits at mesh index (r // 2, r % 2); S01 gives it batch part 2 (r // 2) + r % 2 = r."""
    results = gang(4, _groups_worker)
    for rank, (all_dp, over_hosts) in enumerate(results):
        assert all_dp == (rank, 4, 0, 0.0 + 1 + 2 + 3)
        row, column = divmod(rank, 2)
        assert over_hosts == (row, 2, column, float(column + (2 + column)))


@pytest.mark.slow
def test_an_all_data_parallel_stage_on_two_hosts_trains_as_one_data_parallel_over_four_hosts(tmp_path):
    """The same 4 data-parallel ranks, the batch split in the same 4 parts: [2, 2] over dims 0 and 1 (two hosts
    of two devices), [4, 1] over dim 0 (four hosts of one), both behind a one-device stage, so the edge into
    the stage (S01RR / S0RR) and its gradient back are resharded, and the last stage's targets are sliced by
    its data-parallel rank."""
    two_by_two = run_losses(tmp_path, "all-dp", DOC)
    four_by_one = run_losses(tmp_path, "dp0", with_stage1({"layers": [1, 2], "mesh": [4, 1], "dataParallelDim": 0}))
    assert [step for step, _ in two_by_two] == [1, 2]
    assert [step for step, _ in four_by_one] == [1, 2]
    assert [loss for _, loss in two_by_two] == pytest.approx([loss for _, loss in four_by_one], abs=1e-5)
