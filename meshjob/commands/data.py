"""`meshjob data prepare TEXT --out train.bin [--val-out val.bin]`: a token file from a text file.

The byte-level tokenizer (meshjob.spec.tokens) needs no vocabulary and no download: 256 token ids, so a
model of spec.model.vocab >= 256 trains on the result with `spec.data: {kind: tokens, path: ...}`.
"""

from __future__ import annotations

import argparse

from meshjob.errors import FieldError, SpecError
from meshjob.spec.tokens import BYTE_VOCAB, TYPECODES, prepare

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
        done = prepare(args.text, args.out, args.val_out, args.val_fraction, args.dtype)
    except OSError as err:
        where = args.text if err.filename in (None, args.text) else err.filename
        field = "TEXT" if where == args.text else ("--out" if where == args.out else "--val-out")
        wanted = "a readable text file" if field == "TEXT" else "a path where a file can be written"
        raise SpecError([FieldError(field, where, f"{wanted} ({err.strerror})")]) from None
    print(
        f"{args.out}: {done.train_tokens:,} {args.dtype} tokens"
        + (f"; {args.val_out}: {done.val_tokens:,} tokens" if args.val_out else "")
    )
    val = f", valPath: {args.val_out}" if args.val_out else ""
    print(
        f"use: spec.data: {{kind: tokens, path: {args.out}{val}, dtype: {args.dtype}}} "
        f"with spec.model.vocab >= {BYTE_VOCAB}"
    )
    return 0
