"""Token files: the flat binary format nanoGPT and Megatron users already have, a byte-level
tokenizer that writes it (`meshjob data prepare`), and the checks of a job's token files that run
before any rank starts (`meshjob plan`, `meshjob run`, `meshjob worker`).

Format: a headerless array of token ids, little-endian uint16 or uint32 (what nanoGPT's prepare
scripts write with numpy's `tofile` on x86 and ARM, and Megatron's `.bin` without its `.idx`).
The byte-level tokenizer maps each UTF-8 byte to its value: 256 token ids, no vocabulary file, no
download, and decoding is exact. `--tokenizer tokenizer.json` uses a Hugging Face `tokenizers` file
instead (a local file: nothing is downloaded; the package is imported only then).
"""

from __future__ import annotations

import array
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from meshjob.errors import FieldError, SpecError
from meshjob.spec.model import TrainingJob

TYPECODES = {"uint16": "H", "uint32": "I"}  # array module typecodes of 2 and 4 bytes
BYTE_VOCAB = 256  # token ids of the byte-level tokenizer
SCAN_BYTES = 4 << 20  # how much of a file the checks read: fast enough for `meshjob plan`
SCAN_MIN_TOKENS = 64  # fewer scanned tokens tell nothing about the element type


def itemsize(dtype: str) -> int:
    return array.array(TYPECODES[dtype]).itemsize


def _little_endian(values: array.array[int]) -> array.array[int]:
    if sys.byteorder == "big":
        values = array.array(values.typecode, values)
        values.byteswap()
    return values


def byte_tokens(text: bytes, dtype: str = "uint16") -> array.array[int]:
    """The byte-level tokenization of `text`: one token per byte, its value."""
    return array.array(TYPECODES[dtype], iter(text))  # iter: a bytes initializer would be read as raw memory


def decode_bytes(tokens: array.array[int]) -> bytes:
    """The inverse of byte_tokens (every id must be a byte)."""
    return bytes(tokens.tolist())


def write_tokens(path: str | Path, tokens: array.array[int]) -> None:
    with open(path, "wb") as fh:
        _little_endian(tokens).tofile(fh)


def read_tokens(path: str | Path, dtype: str, max_bytes: int | None = None) -> array.array[int]:
    """The ids of a token file (its first `max_bytes`, rounded down to whole tokens, when given)."""
    size = itemsize(dtype)
    with open(path, "rb") as fh:
        raw = fh.read() if max_bytes is None else fh.read(max_bytes)
    values = array.array(TYPECODES[dtype])
    values.frombytes(raw[: len(raw) - len(raw) % size])
    return _little_endian(values)


def tokenizer_tokens(text: bytes, tokenizer_path: str | Path, dtype: str = "uint16") -> tuple[array.array[int], int]:
    """The tokens of UTF-8 `text` by a `tokenizers` file (tokenizer.json), without special tokens, and
    the tokenizer's vocabulary size; a SpecError names the option at fault."""
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise SpecError(
            [
                FieldError(
                    "--tokenizer", str(tokenizer_path), "usable with tokenizers installed (pip install tokenizers)"
                )
            ]
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as err:  # tokenizers raises its own Exception subclass for unreadable or bad files
        raise SpecError(
            [FieldError("--tokenizer", str(tokenizer_path), f"a tokenizers file, tokenizer.json ({err})")]
        ) from None
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab > 1 << (8 * itemsize(dtype)):
        raise SpecError([FieldError("--dtype", dtype, f"uint32: the tokenizer's {vocab} token ids do not fit {dtype}")])
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(
            [FieldError("TEXT", f"byte {err.start}", "UTF-8 text (a tokenizer reads characters)")]
        ) from None
    ids: list[int] = tokenizer.encode(decoded, add_special_tokens=False).ids
    return array.array(TYPECODES[dtype], ids), vocab


@dataclass(frozen=True)
class Prepared:
    train_tokens: int
    val_tokens: int
    vocab: int = BYTE_VOCAB  # token ids run below it: spec.model.vocab must be at least this


def prepare(
    text_path: str | Path,
    out: str | Path,
    val_out: str | Path | None = None,
    val_fraction: float = 0.1,
    dtype: str = "uint16",
    tokenizer: str | Path | None = None,
) -> Prepared:
    """Tokenize a text file byte by byte (or with a `tokenizers` file) into `out`; with `val_out`, its last
    `val_fraction` goes there instead (nanoGPT's split: the first 90% trains, the last 10% validates)."""
    text = Path(text_path).read_bytes()
    tokens, vocab = byte_tokens(text, dtype), BYTE_VOCAB
    if tokenizer is not None:
        tokens, vocab = tokenizer_tokens(text, tokenizer, dtype)
    cut = len(tokens) - round(len(tokens) * val_fraction) if val_out is not None else len(tokens)
    write_tokens(out, tokens[:cut])
    if val_out is not None:
        write_tokens(val_out, tokens[cut:])
    return Prepared(cut, len(tokens) - cut, vocab)


# --- checks before any rank starts ------------------------------------------------------------


def check_token_file(field: str, path: str, dtype: str, vocab: int, min_tokens: int) -> list[FieldError]:
    """Problems of one token file, each naming the field to change: a missing or unreadable file or
    one too short (`field`), a size or content that fits the other element type (spec.data.dtype),
    token ids the model's vocabulary cannot hold (spec.model.vocab). Reads at most SCAN_BYTES."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb"):
            pass
    except OSError as err:
        return [
            FieldError(
                field,
                path,
                f"a readable token file ({err.strerror}; relative paths are read "
                f"from the working directory {os.getcwd()})",
            )
        ]
    if os.path.isdir(path):
        return [FieldError(field, path, "a token file, not a directory")]
    width = itemsize(dtype)
    if size % width:
        return [
            FieldError(
                "spec.data.dtype",
                dtype,
                f"the element type of {path}: its {size} bytes are no "
                f"whole number of {dtype} tokens ({width} bytes each)",
            )
        ]
    if size // width < min_tokens:
        return [
            FieldError(
                field,
                path,
                f"a file of at least {min_tokens} tokens (one sequence of spec.model."
                f"seqLen and the token after it); it holds {size // width}",
            )
        ]
    return _check_ids(field, path, dtype, vocab)


def _check_ids(field: str, path: str, dtype: str, vocab: int) -> list[FieldError]:
    ids = read_tokens(path, dtype, SCAN_BYTES)
    other = "uint16" if dtype == "uint32" else "uint32"
    if max(ids) >= vocab:
        hint = f"; read as {other} they would fit" if _plausible(path, other, vocab) else ""
        if hint:
            return [
                FieldError(
                    "spec.data.dtype",
                    dtype,
                    f"the element type of {path}: read as {dtype} its "
                    f"ids reach {max(ids)}, beyond spec.model.vocab "
                    f"({vocab}){hint}",
                )
            ]
        return [
            FieldError(
                "spec.model.vocab",
                vocab,
                f"more than the largest token id of {path} ({max(ids)} in its first {len(ids)} tokens)",
            )
        ]
    if dtype == "uint16" and _looks_like_uint32(ids):
        return [
            FieldError(
                "spec.data.dtype",
                dtype,
                f"the element type of {path}: every second uint16 is 0, as in a uint32 file; write uint32",
            )
        ]
    return []


def _plausible(path: str, dtype: str, vocab: int) -> bool:
    ids = read_tokens(path, dtype, SCAN_BYTES)
    return bool(ids) and max(ids) < vocab and not (dtype == "uint16" and _looks_like_uint32(ids))


def _looks_like_uint32(ids: array.array[int]) -> bool:
    """uint32 ids below 65536 read as uint16: every high half (odd position) is zero."""
    return len(ids) >= SCAN_MIN_TOKENS and not any(ids[1::2]) and any(ids[0::2])


def check_data_files(job: TrainingJob) -> list[FieldError]:
    """Problems of a job's token files (none for synthetic data): meshjob.spec.manifest.TrainingJob."""
    data, model = job.data, job.model
    if data.kind != "tokens":
        return []
    errors: list[FieldError] = []
    for field, path in (("spec.data.path", data.path), ("spec.data.valPath", data.val_path)):
        if path:
            errors += check_token_file(field, path, data.dtype, model.vocab, model.seq_len + 1)
    return errors
