"""`meshjob data prepare TEXT --out train.bin [--val-out val.bin] [--tokenizer tokenizer.json]`: a token file
from a text file.

The byte-level tokenizer (meshjob.spec.tokens) needs no vocabulary and no download: 256 token ids, so a
model of spec.model.vocab >= 256 trains on the result with `spec.data: {kind: tokens, path: ...}`.
--tokenizer takes a local Hugging Face `tokenizers` file instead; spec.model.vocab then covers its ids.
"""

from __future__ import annotations

import argparse

from meshjob.errors import FieldError, SpecError
from meshjob.spec.tokens import TYPECODES, prepare

HELP = "prepare token files: meshjob data prepare TEXT --out train.bin [--val-out val.bin]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser(
        "prepare",
        help="tokenize a text file byte by byte into nanoGPT's flat binary format",
        description="tokenize a text file byte by byte into nanoGPT's flat binary format",
    )
    p.add_argument("text", help="a text file (any bytes; UTF-8 text gives one token per byte)")
    p.add_argument("--out", required=True, help="the training token file to write")
    p.add_argument("--val-out", help="also write a validation token file: the text's last --val-fraction")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the text for --val-out (default 0.1)")
    p.add_argument("--dtype", default="uint16", help="uint16 (default) or uint32 token ids")
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizers file (tokenizer.json, local: no download) instead of the byte-level "
        "tokenizer; needs the tokenizers package",
    )


def _check(args: argparse.Namespace) -> None:
    errors: list[FieldError] = []
    if args.dtype not in TYPECODES:
        errors.append(FieldError("--dtype", args.dtype, f"one of {', '.join(TYPECODES)}"))
    if not 0 < args.val_fraction < 1:
        errors.append(FieldError("--val-fraction", args.val_fraction, "a fraction strictly between 0 and 1"))
    if errors:
        raise SpecError(errors)


def run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        done = prepare(args.text, args.out, args.val_out, args.val_fraction, args.dtype, args.tokenizer)
    except OSError as err:
        where = args.text if err.filename in (None, args.text) else err.filename
        fields = {args.text: "TEXT", args.out: "--out", args.tokenizer: "--tokenizer"}
        field = fields.get(where, "--val-out")
        wanted = "a path where a file can be written" if field in ("--out", "--val-out") else "a readable file"
        raise SpecError([FieldError(field, where, f"{wanted} ({err.strerror})")]) from None
    print(
        f"{args.out}: {done.train_tokens:,} {args.dtype} tokens"
        + (f"; {args.val_out}: {done.val_tokens:,} tokens" if args.val_out else "")
    )
    val = f", valPath: {args.val_out}" if args.val_out else ""
    print(
        f"use: spec.data: {{kind: tokens, path: {args.out}{val}, dtype: {args.dtype}}} "
        f"with spec.model.vocab >= {done.vocab}"
    )
    return 0
