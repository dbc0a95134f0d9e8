"""`meshjob bench <benchmark>`: dispatch to the benchmark modules of this package (resharding, resimulate,
compare-runs, pipeline, schedule-search, planner, message-cost, operator, fuzz, memory, e2e, tune, cluster,
grad-sync, peers).

Only the benchmark that runs is imported (the operator benchmark needs kopf, the others torch); an
import error in it is a real error and surfaces as one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

HELP = (
    "benchmarks: resharding strategies (and their re-simulation and comparison), pipeline schedules, planner, "
    "operator, input fuzzing, memory, end to end, tune"
)
BENCHMARKS: dict[str, str] = {
    "resharding": "cross-mesh resharding strategies and balancers on the emulated cluster",
    "resimulate": "a recorded resharding run's plans simulated again, on its network model or a changed one",
    "compare-runs": "recorded resharding runs side by side: targets, broadcast K=auto, the simulator's agreement",
    "pipeline": "pipeline schedules: 1f1b, eager-1f1b, weight-grad delay, signal upper bound",
    "schedule-search": "eager-1F1B's neighbourhood on the simulator: warm-ups, W delays, transfer order",
    "planner": "sender balancers: makespan over lower bound, full vs half duplex, joint vs per boundary",
    "message-cost": "the network model's per-message cost, measured on the emulated cluster",
    "operator": "the operator: reconcile latency and throughput against an API server",
    "fuzz": "generated and mutated manifests through meshjob plan and the operator's validation",
    "memory": "memory per rank: parameters, optimizer, activations for fp32/bf16, recompute, ZeRO 0/1",
    "e2e": "end to end on emulated devices: meshjob against Alpa's defaults and the signal bound",
    "tune": "meshjob tune's search against exhaustive enumeration, and its time on 64 hosts x 8 devices",
    "cluster": "the local cluster where pods run: apply -> pods Running -> first step, API requests per job",
    "grad-sync": "data-parallel gradient sync overlapped with the backward against one sync after the step",
    "peers": "meshjob's schedules against torch.distributed.pipelining's on the same emulated cluster and device",
}


def _bench_module(name: str) -> ModuleType:
    return importlib.import_module(f"meshjob_bench.{name.replace('-', '_')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    # import only the benchmark that will run (every one when none is named, e.g. for --help)
    wanted = next((a for a in sys.argv[1:] if a in BENCHMARKS), None)
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if wanted in (name, None):
            _bench_module(name).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return int(_bench_module(args.benchmark).main(args) or 0)
