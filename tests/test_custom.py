"""User models (spec.model.kind: custom): the entry point is loaded, built and run on one sequence
before any rank starts, and every way it can be wrong is one error naming the field."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from meshjob.errors import SpecError
from meshjob.spec.manifest import ModelSpec
from meshjob_trainer.custom import CustomStage, check_custom

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelSpec(
    "custom",
    layers=4,
    hidden=16,
    heads=1,
    vocab=64,
    seq_len=8,
    entrypoint="custom_entrypoints:good",
    config={"kernel": 3},
)


@pytest.fixture(autouse=True)
def packages(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom_model"))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def problem(entrypoint: str) -> tuple[str, str]:
    with pytest.raises(SpecError) as info:
        check_custom(dataclasses.replace(MODEL, entrypoint=entrypoint), seed=0)
    [error] = info.value.errors
    return error.path, error.allowed


@pytest.mark.parametrize(
    "entrypoint,field,words",
    [
        ("no_such_package.models:build", "spec.model.entrypoint", "importing 'no_such_package.models' raised"),
        ("custom_entrypoints:missing", "spec.model.entrypoint", "has no callable 'missing'"),
        ("custom_entrypoints:NOT_CALLABLE", "spec.model.entrypoint", "has no callable 'NOT_CALLABLE'"),
        ("custom_entrypoints:raises", "spec.model.entrypoint", "it raised KeyError: 'depth'"),
        ("custom_entrypoints:returns_a_dict", "spec.model.entrypoint", "dict lacks embedding, blocks, head, boundary"),
        ("custom_entrypoints:too_few_blocks", "spec.model.layers", "the number of blocks"),
        ("custom_entrypoints:wrong_boundary", "spec.model.entrypoint", "it returned (8, 32)"),
        ("custom_entrypoints:block_is_no_module", "spec.model.entrypoint", "blocks[0] is a torch.nn.Module"),
        ("custom_entrypoints:forward_fails", "spec.model.entrypoint", "forward runs on one sequence"),
        ("custom_entrypoints:head_too_narrow", "spec.model.entrypoint", "it returned (1, 8, 63)"),
    ],
)
def test_a_bad_entry_point_is_one_error_naming_the_field(entrypoint, field, words):
    path, allowed = problem(entrypoint)
    assert path == field and words in allowed, allowed


def test_a_good_entry_point_passes_and_every_rank_builds_the_same_weights():
    check_custom(MODEL, seed=0)
    a, b = CustomStage(MODEL, 0, 4, seed=7), CustomStage(MODEL, 0, 4, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(CustomStage(MODEL, 0, 4, seed=8).parameters()))


def test_stages_of_a_custom_model_chain_to_the_whole_model_and_tie_the_shared_weight():
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    whole = CustomStage(MODEL, 0, 4, seed=1)({"tokens": tokens, "targets": tokens})["loss"]
    first, last = CustomStage(MODEL, 0, 2, seed=1), CustomStage(MODEL, 2, 4, seed=1)
    cut = last({"activation": first({"tokens": tokens})["activation"], "targets": tokens})["loss"]
    torch.testing.assert_close(cut, whole)
    [a], [b] = first.tied_weights(), last.tied_weights()
    assert torch.equal(a, b) and a.shape == (64, 16)


def custom_job(tmp_path: Path, entrypoint: str) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "custom_model" / "job.yaml").read_text())
    doc["spec"]["model"]["entrypoint"] = entrypoint
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def meshjob(*args: str) -> subprocess.CompletedProcess[str]:
    paths = [str(ROOT / "examples" / "custom_model"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )


def test_run_exits_2_naming_the_entry_point_before_any_rank_starts(tmp_path):
    result = meshjob("run", str(custom_job(tmp_path, "custom_entrypoints:raises")), "--no-netns", "--quiet")
    assert result.returncode == 2 and "spec.model.entrypoint: 'custom_entrypoints:raises' is invalid" in result.stderr
    assert "Traceback" not in result.stderr and "ranks on" not in result.stderr


def test_plan_exits_2_when_the_entry_points_package_is_not_installed(tmp_path):
    result = meshjob("plan", str(custom_job(tmp_path, "not_installed_anywhere:build")))
    assert result.returncode == 2 and "no package 'not_installed_anywhere' on this machine" in result.stderr
    assert meshjob("plan", str(custom_job(tmp_path, "conv_lm:build")), "--json").returncode == 0
