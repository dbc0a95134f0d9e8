"""The models, the data and the tensor-parallel layers, against the single-process model."""

from __future__ import annotations

import pytest
import torch

from meshjob.spec.manifest import ModelSpec, StageSpec, TrainingSpec, default_edges, skip_pairs
from meshjob_trainer.data import BigramData
from meshjob_trainer.model import StageModule, full_parameters
from meshjob_trainer.reference import train_reference

TINY = dict(layers=6, hidden=16, heads=2, vocab=32, seq_len=8)


def run_stages(config: ModelSpec, cuts: list[tuple[int, int]], tokens, targets) -> torch.Tensor:
    """Chain stage modules by hand, routing every output to the stage that consumes it."""
    carried: dict[str, torch.Tensor] = {"tokens": tokens, "targets": targets}
    for first, last in cuts:
        stage = StageModule(config, first, last, seed=3)
        wanted = stage.input_names() + (["targets"] if stage.is_last else [])
        carried.update(stage({name: carried[name] for name in wanted}))
    return carried["loss"]


@pytest.mark.parametrize("kind", ["gpt", "utransformer"])
def test_stages_chained_compute_the_whole_models_loss(kind):
    config = ModelSpec(kind, **TINY)
    batch = BigramData(32, 8, 4, seed=1).batch(0)
    whole = StageModule(config, 0, 6, seed=3)({"tokens": batch.tokens, "targets": batch.targets})["loss"]
    cut = run_stages(config, [(0, 1), (1, 3), (3, 5), (5, 6)], batch.tokens, batch.targets)
    torch.testing.assert_close(cut, whole, rtol=1e-6, atol=1e-6)


def test_utransformer_skips_join_layer_i_to_layer_L_minus_1_minus_i():
    assert skip_pairs(ModelSpec("utransformer", **TINY)) == [(0, 5), (1, 4), (2, 3)]
    assert skip_pairs(ModelSpec("utransformer", **{**TINY, "layers": 5})) == [(0, 4), (1, 3)]
    assert skip_pairs(ModelSpec("gpt", **TINY)) == []


def test_utransformer_stage_inputs_and_outputs_match_the_specs_default_edges():
    cuts = [(0, 2), (2, 3), (3, 5), (5, 6)]
    spec_model = ModelSpec(kind="utransformer", **{"layers": 6, "hidden": 16, "heads": 2, "vocab": 32, "seq_len": 8})
    stages = tuple(StageSpec(layers=c, mesh=(1, 1)) for c in cuts)
    edges = default_edges(spec_model, stages)
    config = spec_model
    for s, (first, last) in enumerate(cuts):
        module = StageModule(config, first, last, seed=0)
        assert sorted(e.tensor for e in edges if e.dst == s) == sorted(n for n in module.input_names() if n != "tokens")
        assert sorted({e.tensor for e in edges if e.src == s}) == sorted(
            n for n in module.output_names() if n != "loss"
        )


def test_initial_weights_do_not_depend_on_how_the_model_is_cut():
    config = ModelSpec("gpt", **TINY)
    whole = dict(StageModule(config, 0, 6, seed=5).named_parameters())
    middle = dict(StageModule(config, 2, 4, seed=5).named_parameters())
    for name, p in middle.items():
        assert torch.equal(p, whole[name]), name


def test_different_seeds_give_different_weights():
    config = ModelSpec("gpt", **TINY)
    a = StageModule(config, 0, 1, seed=0).blocks["0"].attn.q.weight
    b = StageModule(config, 0, 1, seed=1).blocks["0"].attn.q.weight
    assert not torch.equal(a, b)


def test_first_and_last_stage_hold_the_same_tied_embedding():
    config = ModelSpec("gpt", **TINY)
    first, last = StageModule(config, 0, 3, seed=0), StageModule(config, 3, 6, seed=0)
    [a], [b] = first.tied_weights(), last.tied_weights()
    assert torch.equal(a, b)
    assert StageModule(config, 0, 6, seed=0).tied_weights() == []  # one copy: nothing to tie


def test_an_untied_head_is_its_own_parameter_on_the_last_stage_only():
    config = ModelSpec("gpt", **TINY, tie_embeddings=False)
    first, last = StageModule(config, 0, 3, seed=0), StageModule(config, 3, 6, seed=0)
    assert first.tied_weights() == last.tied_weights() == []
    assert "wte.weight" not in dict(last.named_parameters()) and "lm_head.weight" in dict(last.named_parameters())


def test_bad_layer_range_names_the_range_and_the_rule():
    with pytest.raises(ValueError, match=r"\[4, 2\).*0 <= first < last <= 6"):
        StageModule(ModelSpec("gpt", **TINY), 4, 2, seed=0)


def test_unknown_model_kind_names_the_allowed_kinds():
    with pytest.raises(ValueError, match="model.kind: 'bert'.*gpt, utransformer"):
        StageModule(ModelSpec("bert", **TINY), 0, 6, seed=0)


def test_data_is_deterministic_given_seed_and_step():
    data = BigramData(32, 8, 4, seed=2)
    assert torch.equal(data.batch(7).tokens, BigramData(32, 8, 4, seed=2).batch(7).tokens)
    assert not torch.equal(data.batch(7).tokens, data.batch(8).tokens)
    assert torch.equal(data.batch(7).targets[:, :-1], data.batch(7).tokens[:, 1:])


def test_data_parallel_shards_tile_each_microbatch_in_order():
    data = BigramData(32, 8, 8, seed=2)
    halves = [data.microbatch(3, 1, 2, dp_rank=r, dp_size=2).tokens for r in range(2)]
    assert torch.equal(torch.cat(halves), data.batch(3).tokens[4:8])


def test_data_rejects_a_batch_that_does_not_split_naming_the_field():
    with pytest.raises(ValueError, match="training.globalBatch: 6.*4 microbatches"):
        BigramData(32, 8, 6).microbatch(0, 0, 4)


@pytest.mark.parametrize("kind", ["gpt", "utransformer"])
def test_reference_loss_goes_down(kind):
    config = ModelSpec(kind, **TINY)
    training = TrainingSpec(steps=12, global_batch=8, microbatches=2, learning_rate=1e-2)
    result = train_reference(StageModule(config, 0, 6, seed=0), BigramData(32, 8, 8, seed=0), training)
    assert result.losses[0] == pytest.approx(torch.log(torch.tensor(32.0)).item(), abs=0.3)
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.2


def test_full_parameters_reassembles_shards_along_their_dim():
    from meshjob_trainer.parallel import ShardInfo

    full = torch.arange(12.0).reshape(3, 4)
    parts = [{"w": (full[:, 2:], ShardInfo(1, 1, 2))}, {"w": (full[:, :2], ShardInfo(1, 0, 2))}]
    assert torch.equal(full_parameters(parts)["w"], full)
    with pytest.raises(ValueError, match="parameter w: shards \\[1\\] of 2 are missing"):
        full_parameters(parts[1:])


def _tp_worker(env):
    """Two ranks, one TP group: forward loss and reassembled gradients of a sharded stage."""
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.parallel import build_groups, shard_info

    init_distributed(env, timeout_s=30)
    groups = build_groups([StageSpec(layers=(0, 6), mesh=(1, 2), tensor_parallel_dim=1)], [Mesh.grid((1, 2))], env.rank)
    config = ModelSpec("gpt", **TINY)
    module = StageModule(config, 0, 6, seed=4, tp=groups.tp)
    batch = BigramData(32, 8, 4, seed=1).batch(0)
    loss = module({"tokens": batch.tokens, "targets": batch.targets})["loss"]
    loss.backward()
    grads = {name: (p.grad.clone(), shard_info(p)) for name, p in module.named_parameters()}
    dist.destroy_process_group()
    return loss.item(), grads


@pytest.mark.slow
def test_tensor_parallel_stage_matches_the_single_process_model():
    from meshjob_trainer.launch import launch

    result = launch(2, lambda ctx: _tp_worker(ctx.env), timeout_s=50).raise_on_failure()
    config = ModelSpec("gpt", **TINY)
    module = StageModule(config, 0, 6, seed=4)
    batch = BigramData(32, 8, 4, seed=1).batch(0)
    loss = module({"tokens": batch.tokens, "targets": batch.targets})["loss"]
    loss.backward()
    for rank_loss, _ in result.values:
        assert rank_loss == pytest.approx(loss.item(), rel=1e-6)
    grads = full_parameters([g for _, g in result.values])
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
