"""`meshjob bench resharding|pipeline|planner|operator`: dispatch to the modules in bench/.

bench/ sits beside the meshjob package in the repository (it is not installed), so the
repository root is put on sys.path when `bench` is not importable already.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

HELP = "benchmarks: resharding strategies, pipeline schedules, planner, operator"
BENCHMARKS: dict[str, str] = {
    "resharding": "cross-mesh resharding strategies and balancers on the emulated cluster (seed 000 §5.1)",
    "pipeline": "pipeline schedules: 1f1b, eager-1f1b, weight-grad delay, signal upper bound",
    "planner": "sender balancers: makespan over lower bound and planning time",
    "operator": "the operator: reconcile latency and throughput against an API server",
}


def _bench_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as err:
        if err.name not in ("bench", f"bench.{name}"):
            raise
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.isdir(os.path.join(root, "bench")):
            raise SystemExit(f"meshjob bench {name}: bench/ not found beside the meshjob package "
                             f"({root}); run from a source checkout") from err
        if not os.path.exists(os.path.join(root, "bench", f"{name}.py")):
            raise SystemExit(f"meshjob bench {name}: {os.path.join(root, 'bench', name + '.py')} "
                             f"does not exist in this checkout") from err
        sys.path.insert(0, root)
        sys.modules.pop("bench", None)
        return importlib.import_module(f"bench.{name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    # import only the benchmark that will run (cli.main(argv) called in-process: all of them)
    wanted = next((a for a in sys.argv[1:] if a in BENCHMARKS), None)
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted or wanted is None:
            try:
                _bench_module(name).add_arguments(p)
            except (ImportError, AttributeError, SystemExit):  # a benchmark not written yet
                if name == wanted:
                    raise


def run(args: argparse.Namespace) -> int:
    return int(_bench_module(args.benchmark).main(args) or 0)
