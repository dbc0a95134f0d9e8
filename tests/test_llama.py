"""The Llama family against itself in one process, and its tensor-parallel stage (vocab-parallel
embedding and loss, grouped-query attention split by rank) against the single-process model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshjob.spec.manifest import ModelSpec, StageSpec
from meshjob_trainer.data import BigramData
from meshjob_trainer.llama import LlamaStage, apply_rotary, rotary_tables
from meshjob_trainer.model import full_parameters

CONFIG = ModelSpec("llama", layers=4, hidden=32, heads=4, vocab=64, seq_len=8, kv_heads=2)


def batch():
    return BigramData(64, 8, 4, seed=1).batch(0)


def loss_of(module, b=None):
    b = b or batch()
    return module({"tokens": b.tokens, "targets": b.targets})["loss"]


def test_stages_chained_compute_the_whole_models_loss():
    b = batch()
    carried = {"tokens": b.tokens, "targets": b.targets}
    for first, last in [(0, 1), (1, 3), (3, 4)]:
        stage = LlamaStage(CONFIG, first, last, seed=3)
        wanted = stage.input_names() + (["targets"] if stage.is_last else [])
        carried.update(stage({name: carried[name] for name in wanted}))
    torch.testing.assert_close(carried["loss"], loss_of(LlamaStage(CONFIG, 0, 4, seed=3)), rtol=1e-6, atol=1e-6)


def test_grouped_query_attention_has_kv_heads_key_value_projections():
    attn = LlamaStage(CONFIG, 0, 1, seed=0).blocks["0"].attn
    assert attn.q.weight.shape == (32, 32) and attn.k.weight.shape == attn.v.weight.shape == (16, 32)


def test_one_kv_head_per_query_head_is_multi_head_attention_and_differs_from_grouped():
    mha = dataclasses.replace(CONFIG, kv_heads=4)
    assert LlamaStage(mha, 0, 1, seed=0).blocks["0"].attn.k.weight.shape == (32, 32)
    assert loss_of(LlamaStage(mha, 0, 4, seed=0)) != loss_of(LlamaStage(CONFIG, 0, 4, seed=0))


def test_an_untied_head_has_its_own_weight_and_a_tied_one_ties_first_and_last_stage():
    untied = dataclasses.replace(CONFIG, tie_embeddings=False)
    assert "head.weight" in dict(LlamaStage(untied, 0, 4, seed=0).named_parameters())
    assert LlamaStage(untied, 3, 4, seed=0).tied_weights() == []
    [a], [b] = LlamaStage(CONFIG, 0, 2, seed=0).tied_weights(), LlamaStage(CONFIG, 2, 4, seed=0).tied_weights()
    assert torch.equal(a, b) and a.shape == (64, 32)


def test_rotary_embeddings_rotate_by_position_and_keep_the_norm():
    cos, sin = rotary_tables(8, 8, 10000.0, torch.device("cpu"))
    x = torch.randn(1, 1, 8, 8)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[..., 0, :], x[..., 0, :])  # position 0: angle 0
    # attention scores depend on relative positions only: q_i . k_j == q_(i+1) . k_(j+1)
    q = apply_rotary(torch.ones(1, 1, 8, 8), cos, sin)
    torch.testing.assert_close(q[0, 0, 2] @ q[0, 0, 1], q[0, 0, 5] @ q[0, 0, 4])


def test_a_spec_that_skipped_the_parser_fails_naming_the_field():
    with pytest.raises(ValueError, match="model.kvHeads: 3 is invalid: must divide model.heads"):
        LlamaStage(dataclasses.replace(CONFIG, kv_heads=3), 0, 4, seed=0)


def _tp_worker(env):
    """Two ranks, one TP group: loss and reassembled gradients of a sharded whole-model stage."""
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.parallel import build_groups, shard_info

    init_distributed(env, timeout_s=30)
    groups = build_groups([StageSpec(layers=(0, 4), mesh=(1, 2), tensor_parallel_dim=1)], [Mesh.grid((1, 2))], env.rank)
    module = LlamaStage(CONFIG, 0, 4, seed=4, tp=groups.tp)
    loss = loss_of(module)
    loss.backward()
    grads = {name: (p.grad.clone(), shard_info(p)) for name, p in module.named_parameters()}
    dist.destroy_process_group()
    return loss.item(), grads


@pytest.mark.slow
def test_tensor_parallel_stage_matches_the_single_process_model(gang):
    """Every weight is split (q, k, v, gate, up by rows; o, down by columns; the embedding and the
    head by vocabulary rows); the loss is assembled from the vocabulary halves."""
    results = gang(2, _tp_worker, timeout_s=60)
    module = LlamaStage(CONFIG, 0, 4, seed=4)
    loss = loss_of(module)
    loss.backward()
    for rank_loss, grads in results:
        assert rank_loss == pytest.approx(loss.item(), rel=1e-6)
        assert grads["embed_tokens.weight"][0].shape == (32, 32)  # half the vocabulary
    grads = full_parameters([g for _, g in results])
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
