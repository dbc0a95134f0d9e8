"""Token files (meshjob.spec.tokens): the byte-level tokenizer, `meshjob data prepare`, the shipped
Shakespeare files, and the checks that turn a bad spec.data into exit 2 naming the field, from
`meshjob plan` and `meshjob run` before any rank starts."""

from __future__ import annotations

import array
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshjob.spec import tokens
from meshjob.spec.manifest import load_job

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
TINY = ROOT / "examples" / "tiny.yaml"


def meshjob(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def write(path: Path, values: list[int], typecode: str) -> Path:
    path.write_bytes(array.array(typecode, values).tobytes())  # little-endian on this machine
    return path


def tokens_job(tmp_path: Path, path: str, dtype: str = "uint16", vocab: int = 256, **extra) -> Path:
    """examples/tiny.yaml (seqLen 16) reading `path`."""
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["model"]["vocab"] = vocab
    doc["spec"]["data"] = {"kind": "tokens", "path": path, "dtype": dtype, **extra}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return job


# --- the tokenizer and the file format ------------------------------------------------------


def test_byte_tokens_are_the_utf8_bytes_and_decode_exactly():
    text = "Ça va? — 5 €".encode()
    ids = tokens.byte_tokens(text)
    assert list(ids) == list(text) and max(ids) < tokens.BYTE_VOCAB
    assert tokens.decode_bytes(ids).decode() == "Ça va? — 5 €"


def test_files_are_little_endian_arrays_of_the_dtype(tmp_path):
    tokens.write_tokens(tmp_path / "a.bin", array.array("I", [1, 70000]))
    assert (tmp_path / "a.bin").read_bytes() == bytes([1, 0, 0, 0, 0x70, 0x11, 0x01, 0])
    assert list(tokens.read_tokens(tmp_path / "a.bin", "uint32")) == [1, 70000]


def test_prepare_splits_the_last_fraction_off_for_validation(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(100)))
    done = tokens.prepare(text, tmp_path / "train.bin", tmp_path / "val.bin", val_fraction=0.1)
    assert (done.train_tokens, done.val_tokens) == (90, 10)
    assert list(tokens.read_tokens(tmp_path / "val.bin", "uint16")) == list(range(90, 100))


def test_the_shipped_token_files_are_the_shipped_text_prepared(tmp_path):
    tokens.prepare(DATA / "shakespeare.txt", tmp_path / "train.bin", tmp_path / "val.bin")
    assert (tmp_path / "train.bin").read_bytes() == (DATA / "shakespeare-train.bin").read_bytes()
    assert (tmp_path / "val.bin").read_bytes() == (DATA / "shakespeare-val.bin").read_bytes()
    assert (DATA / "shakespeare.txt").stat().st_size < 300_000  # a few hundred KB at most


def test_data_prepare_command_writes_both_files_and_says_how_to_use_them(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be\n" * 10)
    result = meshjob(
        "data", "prepare", str(text), "--out", str(tmp_path / "a.bin"), "--val-out", str(tmp_path / "b.bin")
    )
    assert result.returncode == 0, result.stderr
    assert "kind: tokens" in result.stdout and "vocab >= 256" in result.stdout
    assert (tmp_path / "a.bin").stat().st_size + (tmp_path / "b.bin").stat().st_size == 2 * 190


def test_data_prepare_names_a_missing_text_and_bad_options(tmp_path):
    result = meshjob("data", "prepare", str(tmp_path / "none.txt"), "--out", str(tmp_path / "a.bin"))
    assert result.returncode == 2 and "TEXT" in result.stderr and "No such file" in result.stderr
    result = meshjob(
        "data", "prepare", str(TINY), "--out", str(tmp_path / "a.bin"), "--dtype", "int8", "--val-fraction", "1.5"
    )
    assert result.returncode == 2
    assert "--dtype: 'int8' is invalid: one of uint16, uint32" in result.stderr
    assert "--val-fraction: 1.5 is invalid" in result.stderr


# --- the checks ---------------------------------------------------------------------------


def check(path: Path, dtype: str = "uint16", vocab: int = 256, min_tokens: int = 17):
    return [(e.path, e.allowed) for e in tokens.check_token_file("spec.data.path", str(path), dtype, vocab, min_tokens)]


def test_a_good_file_passes(tmp_path):
    assert check(write(tmp_path / "ok.bin", list(range(200)), "H")) == []


def test_a_missing_file_names_the_path_field(tmp_path):
    [(field, allowed)] = check(tmp_path / "missing.bin")
    assert field == "spec.data.path" and "No such file" in allowed and "working directory" in allowed


def test_a_file_shorter_than_one_sequence_names_the_path_field(tmp_path):
    [(field, allowed)] = check(write(tmp_path / "short.bin", list(range(16)), "H"))
    assert field == "spec.data.path" and "at least 17 tokens" in allowed and "holds 16" in allowed


def test_a_size_that_is_no_whole_number_of_tokens_names_the_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(102))
    [(field, allowed)] = check(path, dtype="uint32")
    assert field == "spec.data.dtype" and "102 bytes are no whole number of uint32 tokens" in allowed


def test_a_uint16_file_read_as_uint32_names_the_dtype(tmp_path):
    [(field, allowed)] = check(write(tmp_path / "u16.bin", [100 + i % 50 for i in range(400)], "H"), dtype="uint32")
    assert field == "spec.data.dtype" and "read as uint16 they would fit" in allowed


def test_a_uint32_file_read_as_uint16_names_the_dtype(tmp_path):
    [(field, allowed)] = check(write(tmp_path / "u32.bin", [100 + i % 50 for i in range(400)], "I"))
    assert field == "spec.data.dtype" and "every second uint16 is 0" in allowed


def test_ids_beyond_the_vocabulary_name_the_vocab(tmp_path):
    [(field, allowed)] = check(write(tmp_path / "big.bin", list(range(300)), "H"))
    assert field == "spec.model.vocab" and "299" in allowed


@pytest.mark.parametrize("case", ["missing", "dtype", "short"])
def test_plan_and_run_exit_2_naming_the_field_before_any_rank_starts(tmp_path, case):
    path, field = {
        "missing": (tmp_path / "none.bin", "spec.data.path: "),
        "dtype": (write(tmp_path / "u16.bin", [65 + i % 26 for i in range(400)], "H"), "spec.data.dtype: "),
        "short": (write(tmp_path / "s.bin", [65] * 10, "H"), "spec.data.path: "),
    }[case]
    job = tokens_job(tmp_path, str(path), dtype="uint32" if case == "dtype" else "uint16")
    for command in (["plan", str(job)], ["run", str(job), "--no-netns", "--quiet"]):
        result = meshjob(*command)
        assert result.returncode == 2, (command, result.stderr)
        assert field in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_plan_skip_files_plans_a_job_whose_data_lives_elsewhere(tmp_path):
    job = tokens_job(tmp_path, "/data/on/the/cluster.bin")
    assert meshjob("plan", str(job), "--json", "--skip-files").returncode == 0


def test_relative_paths_are_read_from_the_working_directory(tmp_path):
    write(tmp_path / "rel.bin", list(range(100)), "H")
    job = tokens_job(tmp_path, "rel.bin")
    assert meshjob("plan", str(job), "--json", cwd=tmp_path).returncode == 0
    assert meshjob("plan", str(job), "--json", cwd=ROOT).returncode == 2


def test_the_readme_job_trains_on_the_shipped_text():
    job = load_job(str(ROOT / "examples" / "gpt-demo.yaml"))
    assert job.data.kind == "tokens" and job.data.path == "examples/data/shakespeare-train.bin"
    assert job.training.eval_every > 0 and job.data.val_path
    assert tokens.check_data_files(job) == []  # run from the repository root, as the README does
