"""meshjob.search.memory_model against the peaks `meshjob bench memory` measured (bench/results/memory.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshjob.search.memory_model import activation_bytes, stage_memory, stage_parameters
from meshjob.spec.manifest import ModelSpec, TrainingSpec

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "memory.json"


def measured() -> dict:
    return json.loads(RESULTS.read_text())


def model(doc: dict) -> ModelSpec:
    keys = {"kind", "layers", "hidden", "heads", "vocab", "seq_len", "kv_heads", "ffn_hidden", "tie_embeddings"}
    return ModelSpec(**{k: v for k, v in doc["model"].items() if k in keys})


def test_parameters_match_the_measured_bytes():
    doc = measured()
    m = model(doc)
    for row in doc["rows"]:
        assert stage_parameters(m, 0, m.layers) * 4 == pytest.approx(row["measured"]["parameters"], rel=0.01)


@pytest.mark.parametrize("index", range(8))
def test_activations_are_within_15_percent_of_the_measured_peak(index):
    doc = measured()
    m, row = model(doc), doc["rows"][index]
    predicted = activation_bytes(
        m, m.layers, 1, 1, row["measured"]["stashed"], row["recompute"], row["precision"], True, True
    )
    assert predicted == pytest.approx(row["measured"]["activations"], rel=0.15)


def test_zero1_shards_the_optimizer_state_over_data_parallel_ranks():
    m = ModelSpec(kind="llama", layers=4, hidden=128, heads=4, vocab=256, seq_len=64, kv_heads=2)
    plain = stage_memory(m, TrainingSpec(global_batch=16, microbatches=4), 0, 4, 4, 1, 4, "none", 0)
    from meshjob.spec.manifest import OptimizerSpec

    zero = stage_memory(
        m,
        TrainingSpec(global_batch=16, microbatches=4, optimizer=OptimizerSpec(zero_stage=1)),
        0,
        4,
        4,
        1,
        4,
        "none",
        0,
    )
    assert zero.optimizer == pytest.approx(plain.optimizer / 4, rel=1e-6)


def test_boundary_buffers_are_counted_in_the_dtype_that_crosses_stages():
    m = ModelSpec(kind="llama", layers=4, hidden=128, heads=4, vocab=256, seq_len=64, kv_heads=2)
    fp32, bf16 = (
        stage_memory(m, TrainingSpec(global_batch=16, microbatches=4, precision=p), 0, 2, 1, 1, 4, "none", 2)
        for p in ("fp32", "bf16")
    )
    assert fp32.buffers == 2 * 4 * 4 * 64 * 128  # two directions of one microbatch (4 samples), fp32
    assert bf16.buffers * 2 == fp32.buffers
    assert bf16.parameters == fp32.parameters  # fp32 master weights either way


def test_a_replicated_key_value_head_costs_each_rank_a_whole_head():
    """kvHeads 1 at tensor parallel 4: every rank holds one whole key/value head, as with kvHeads 4."""
    shared, replicated = (
        stage_memory(
            ModelSpec(kind="llama", layers=4, hidden=128, heads=4, vocab=256, seq_len=64, kv_heads=kv),
            TrainingSpec(global_batch=16, microbatches=4),
            1,
            3,
            1,
            4,
            4,
            "none",
            0,
        )
        for kv in (4, 1)
    )
    assert replicated.parameters == pytest.approx(shared.parameters, abs=4 * 4)  # rounding of the split only
