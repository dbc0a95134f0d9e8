"""Benchmarks: the paper's experiments on this machine, reported as ratios (table, JSON, PNG).

One module per benchmark, each with add_arguments(parser) and main(args) -> int; `meshjob bench NAME`
runs them (cli.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def parsed_arguments(
    argv: Sequence[str] | argparse.Namespace | None,
    prog: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
) -> argparse.Namespace:
    """The namespace `meshjob bench` already parsed, or argv parsed by the module's own arguments
    (a benchmark run as `python -m meshjob_bench.NAME` or called from a test with a list)."""
    if isinstance(argv, argparse.Namespace):
        return argv
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0] if doc else None)
    add_arguments(parser)
    return parser.parse_args(argv)
