"""Llama's key/value heads on more tensor-parallel ranks than there are heads: each rank holds the head its
query heads read, replicated on tp / kvHeads ranks, and the gradients of the copies are summed over them,
so the sharded stage computes the loss, gradients and training of the single-process model."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from meshjob.spec.manifest import ModelSpec, SpecError, StageSpec, parse_job
from meshjob_trainer.data import BigramData
from meshjob_trainer.launch import launch
from meshjob_trainer.llama import LlamaStage
from meshjob_trainer.model import full_parameters
from meshjob_trainer.reference import reference_for_job
from meshjob_trainer.train import train_rank

CONFIG = ModelSpec("llama", layers=2, hidden=32, heads=4, vocab=64, seq_len=8, kv_heads=1)


def loss_of(module):
    """The mean token cross-entropy of one batch of 4 sequences (the stage returns the sum)."""
    b = BigramData(64, 8, 4, seed=1).batch(0)
    return module({"tokens": b.tokens, "targets": b.targets})["loss"] / b.tokens.numel()


def _tp_worker(env, config: ModelSpec, tp: int):
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.parallel import build_groups, shard_info

    init_distributed(env, timeout_s=30)
    groups = build_groups(
        [StageSpec(layers=(0, 2), mesh=(1, tp), tensor_parallel_dim=1)], [Mesh.grid((1, tp))], env.rank
    )
    module = LlamaStage(config, 0, 2, seed=4, tp=groups.tp)
    loss = loss_of(module)
    loss.backward()
    grads = {name: (p.grad.clone(), shard_info(p)) for name, p in module.named_parameters()}
    dist.destroy_process_group()
    return loss.item(), grads


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads,tp", [(1, 2), (1, 4), (2, 4)])
def test_replicated_key_value_heads_give_the_single_process_loss_and_gradients(gang, kv_heads, tp):
    config = dataclasses.replace(CONFIG, kv_heads=kv_heads)
    results = gang(tp, functools.partial(_tp_worker, config=config, tp=tp), timeout_s=60)
    module = LlamaStage(config, 0, 2, seed=4)
    loss = loss_of(module)
    loss.backward()
    for rank_loss, grads in results:
        assert rank_loss == pytest.approx(loss.item(), abs=1e-5)
        assert grads["blocks.0.attn.k.weight"][0].shape == (8, 32)  # one head of 8 channels per rank
    grads = full_parameters([g for _, g in results])
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    copies = [g["blocks.1.attn.v.weight"][0] for _, g in results[: tp // kv_heads]]  # the ranks sharing head 0
    assert all(torch.equal(c, copies[0]) for c in copies)


def job_doc(kv_heads: int, tp: int) -> dict:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "kv"},
        "spec": {
            "model": {
                "kind": "llama",
                "layers": 2,
                "hidden": 32,
                "heads": 4,
                "kvHeads": kv_heads,
                "vocab": 64,
                "seqLen": 8,
            },
            "training": {
                "steps": 3,
                "globalBatch": 4,
                "microbatches": 2,
                "learningRate": 1e-2,
                "seed": 0,
                "gradClip": 0.5,
            },
            "topology": {"devicesPerHost": 4},
            "stages": [{"layers": [0, 1], "mesh": [1, tp], "tensorParallelDim": 1}, {"layers": [1, 2], "mesh": [1]}],
            "resharding": {"strategy": "broadcast", "chunks": 1, "balancer": "greedy"},
            "schedule": {"kind": "1f1b", "weightGradDelay": 0},
        },
    }


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_job_with_replicated_key_value_heads_trains_like_the_reference(recompute):
    """Three steps with clipping: the global gradient norm counts each replicated head once. With recompute under
    the split backward (W delayed) the replicated heads' weights still get their gradients."""
    doc = job_doc(kv_heads=1, tp=4)
    if recompute == "full":
        doc["spec"]["training"]["recompute"] = "full"
        doc["spec"]["schedule"] = {"kind": "eager-1f1b", "weightGradDelay": 1}
        first, second = doc["spec"]["stages"]  # the sharded stage second: the first one's W does its whole backward
        doc["spec"]["stages"] = [{**second, "layers": [0, 1]}, {**first, "layers": [1, 2]}]
    job = parse_job(doc)
    target = functools.partial(train_rank, job=job)
    results = launch(job.world_size, lambda ctx: target(ctx.env), timeout_s=90).raise_on_failure().values
    ref = reference_for_job(job)
    [losses] = {tuple(r.losses) for r in results if r.losses}  # every rank of the last stage: the same losses
    assert list(losses) == pytest.approx(ref.losses, abs=1e-5)
    [norms] = {tuple(r.grad_norms) for r in results if r.grad_norms}
    assert list(norms) == pytest.approx(ref.grad_norms, rel=1e-5)
    weights = full_parameters([r.params for r in results])
    for name, expected in ref.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-4, atol=1e-4, msg=name)


def test_the_spec_takes_a_multiple_of_the_key_value_heads_and_refuses_other_degrees():
    assert parse_job(job_doc(kv_heads=1, tp=4)).stages[0].tensor_parallel == 4
    doc = job_doc(kv_heads=1, tp=4)
    doc["spec"]["model"] |= {"hidden": 48, "heads": 6, "kvHeads": 3}
    doc["spec"]["stages"][0]["mesh"] = [1, 2]
    with pytest.raises(
        SpecError, match=r"spec.stages\[0\].mesh\[1\]: 2 is invalid: .*dividing spec.model.kvHeads \(3\)"
    ):
        parse_job(doc)
