"""Data-parallel gradient sync overlapped with the backward against one sync after the step (issue 49).

The same job runs alternately with `training.overlapGradReduce` true (buckets all-reduced as their weight
gradients finish, DDP's and Megatron's design) and false (one reduction after the whole backward): one
stage of 4 layers on a (2, 1) mesh, data parallel across 2 emulated hosts with real compute and NICs of
`--nic-rate` (250mbit: where the gradient all-reduce costs about what the backward does). Reported per mode:
the median of the runs' mean tokens/s, every run's figure, and overlapped over after-the-step. Losses of the
two modes must agree (the same reduction, only when it runs): a run whose losses differ is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from meshjob_bench import parsed_arguments
from meshjob_bench.machine import machine

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "grad_sync.json"
MODES = {"overlapped": True, "after the step": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nic-rate", default="250mbit", help="each emulated host's NIC rate (default 250mbit)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating (the median is kept)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")


def job(overlap: bool, steps: int) -> dict[str, Any]:
    """A 4-layer GPT on one stage, data parallel over 2 hosts of 1 device; 1 MiB buckets (a few per step)."""
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "grad-sync"},
        "spec": {
            "model": {"kind": "gpt", "layers": 4, "hidden": 256, "heads": 4, "vocab": 256, "seqLen": 128},
            "training": {
                "steps": steps,
                "globalBatch": 48,
                "microbatches": 1,
                "gradBucketMiB": 1,
                "overlapGradReduce": overlap,
            },
            "topology": {"devicesPerHost": 1},
            "stages": [{"layers": [0, 4], "mesh": [2, 1], "dataParallelDim": 0}],
        },
    }


def run_once(overlap: bool, steps: int, nic_rate: str, folder: Path) -> dict[str, Any]:
    """`meshjob run` of the job in one mode: its --json summary."""
    manifest, out = folder / f"job-{overlap}.yaml", folder / f"out-{overlap}.json"
    manifest.write_text(yaml.safe_dump(job(overlap, steps)))
    cmd = [sys.executable, "-m", "meshjob.cli", "run", str(manifest), "--nic-rate", nic_rate, "--quiet"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"meshjob run (overlapGradReduce {overlap}) exited {done.returncode}: {done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def run_bench(nic_rate: str, repeats: int, steps: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    losses: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for mode, overlap in MODES.items():  # alternating: a drift of the machine's load hits both modes
                summary = run_once(overlap, steps, nic_rate, Path(tmp))
                runs[mode].append(round(summary["tokens_per_s_mean"], 1))
                losses.setdefault(mode, summary["losses"])
    if losses["overlapped"] != losses["after the step"]:
        raise RuntimeError(f"the two modes trained differently: {losses}")
    median = {mode: statistics.median(values) for mode, values in runs.items()}
    return {
        "nic_rate": nic_rate,
        "steps": steps,
        "repeats": repeats,
        "job": job(True, steps)["spec"],
        "tokens_per_s": {mode: {"median": median[mode], "runs": runs[mode]} for mode in MODES},
        "overlapped_over_after_the_step": round(median["overlapped"] / median["after the step"], 3),
        "machine": machine(),
        "note": "tokens/s are the mean over each run's steps; compare the ratio, absolute figures are the machine's",
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"data-parallel gradient sync, DP=2 over {result['nic_rate']} NICs ({result['repeats']} runs per mode)")
    for mode, figures in result["tokens_per_s"].items():
        print(f"  {mode:15s} {figures['median']:10.0f} tokens/s   runs {figures['runs']}")
    print(f"  overlapped / after the step: {result['overlapped_over_after_the_step']:.2f}x")


def plot(result: dict[str, Any], path: Path) -> None:
    """Each mode's runs (dots) and median (bar), tokens/s."""
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(modes, [result["tokens_per_s"][m]["median"] for m in modes], color=["tab:green", "tab:gray"])
    for i, mode in enumerate(modes):
        runs = result["tokens_per_s"][mode]["runs"]
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
    ax.set_ylabel("tokens/s (median of runs; dots: each run)")
    ax.set_title(
        f"DP=2 gradient sync at {result['nic_rate']}: overlapped {result['overlapped_over_after_the_step']:.2f}x",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench grad-sync", __doc__, add_arguments)
    if args.repeats < 1 or args.steps < 2:
        raise SystemExit(f"--repeats={args.repeats} / --steps={args.steps} are invalid: repeats >= 1, steps >= 2")
    result = run_bench(args.nic_rate, args.repeats, args.steps)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"written: {out} and {out.with_suffix('.png')}")
    return 0
