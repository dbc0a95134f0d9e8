"""Token-file data (spec.data.kind: tokens): batches are windows of the file chosen by (seed, stream,
step) alone, so a resumed run reads what an uninterrupted one would; validation reads its own file."""

from __future__ import annotations

import array
from pathlib import Path

import numpy as np
import pytest
import torch

from meshjob.spec.manifest import parse_job
from meshjob_trainer.data import TRAIN, VAL, BigramData, TokenData, make_data

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
TRAIN_FILE = str(DATA / "shakespeare-train.bin")


def data(**kw) -> TokenData:
    return TokenData(
        **{"path": TRAIN_FILE, "dtype": "uint16", "vocab": 256, "seq_len": 16, "global_batch": 8, "seed": 0, **kw}
    )


def test_a_batch_is_windows_of_the_file_with_targets_one_token_ahead():
    batch = data().batch(3)
    file = np.fromfile(TRAIN_FILE, dtype="<u2")
    assert batch.tokens.shape == batch.targets.shape == (8, 16) and batch.tokens.dtype == torch.int64
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    for row in range(8):  # each row is a window of the file
        text = file.tobytes().decode("utf-16-le")
        assert bytes(batch.tokens[row].tolist()).decode() in text


def test_batches_depend_only_on_seed_stream_and_step():
    assert torch.equal(data().batch(5).tokens, data().batch(5).tokens)  # a fresh reader: a resumed run
    assert not torch.equal(data().batch(5).tokens, data().batch(6).tokens)
    assert not torch.equal(data().batch(5).tokens, data(seed=1).batch(5).tokens)
    assert not torch.equal(data().batch(5).tokens, data(stream=VAL).batch(5).tokens)


def test_data_parallel_ranks_tile_each_microbatch_in_order():
    d = data()
    halves = [d.microbatch(2, 1, 2, dp_rank=r, dp_size=2).tokens for r in range(2)]
    assert torch.equal(torch.cat(halves), d.batch(2).tokens[4:8])


def test_a_token_beyond_the_vocabulary_is_an_error_naming_the_vocab():
    with pytest.raises(ValueError, match=r"spec.model.vocab: 100 is invalid: .* holds token id 1\d\d"):
        data(vocab=100).batch(0)


def test_uint32_files_are_read_little_endian(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(array.array("I", [70000 + i % 7 for i in range(64)]).tobytes())
    batch = TokenData(str(path), "uint32", 70007, 8, 2).batch(0)
    assert int(batch.tokens.min()) >= 70000 and int(batch.tokens.max()) < 70007


def job(kind: str):
    spec = {
        "model": {"kind": "gpt", "layers": 2, "hidden": 16, "heads": 2, "vocab": 256, "seqLen": 8},
        "training": {"globalBatch": 4, "microbatches": 2, "evalEvery": 1},
        "stages": [{"layers": [0, 2], "mesh": [1]}],
    }
    if kind == "tokens":
        spec["data"] = {"kind": "tokens", "path": TRAIN_FILE, "valPath": str(DATA / "shakespeare-val.bin")}
    return parse_job(
        {"apiVersion": "meshjob.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "d"}, "spec": spec}
    )


def test_the_job_picks_its_files_or_the_bigram_chain_with_a_validation_stream():
    train, val = make_data(job("tokens"), TRAIN), make_data(job("tokens"), VAL)
    assert (train.path, val.path) == (TRAIN_FILE, str(DATA / "shakespeare-val.bin"))
    chain, held_out = make_data(job("synthetic"), TRAIN), make_data(job("synthetic"), VAL)
    assert isinstance(chain, BigramData) and torch.equal(chain.successor(), held_out.successor())
    assert not torch.equal(chain.batch(0).tokens, held_out.batch(0).tokens)
