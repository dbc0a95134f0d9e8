"""`meshjob crd [--check FILE...]`: print the TrainingJob CRD generated from the spec model.

With --check, compare each FILE with the generated text instead and exit 1 (with a unified diff)
when any differs, so CI notices a committed CRD that lags behind the field table (meshjob/spec/table.py).
"""

from __future__ import annotations

import argparse
import difflib
import sys

from meshjob.spec.crd import crd_yaml

HELP = "print the TrainingJob CustomResourceDefinition generated from the spec model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check", nargs="+", metavar="FILE", help="exit 1 when FILE differs from the generated CRD (prints a diff)"
    )


def check(paths: list[str], generated: str) -> int:
    """0 when every file equals `generated`, else 1 after printing what differs."""
    status = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                committed = fh.read()
        except OSError as err:
            print(f"meshjob crd: cannot read {path}: {err.strerror}", file=sys.stderr)
            status = 1
            continue
        if committed != generated:
            diff = difflib.unified_diff(
                committed.splitlines(keepends=True),
                generated.splitlines(keepends=True),
                fromfile=path,
                tofile="generated (meshjob crd)",
            )
            sys.stdout.writelines(diff)
            print(
                f"meshjob crd: {path} differs from the generated CRD; regenerate with `meshjob crd > {path}`",
                file=sys.stderr,
            )
            status = 1
    return status


def run(args: argparse.Namespace) -> int:
    generated = crd_yaml()
    if args.check:
        return check(args.check, generated)
    sys.stdout.write(generated)
    return 0
