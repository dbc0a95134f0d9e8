"""`meshjob bench peers`: meshjob's pipeline schedules against torch.distributed.pipelining's, side by side.

The same model shapes, devices, microbatches, emulated NICs (network namespaces, tbf at the rate that makes
communication a given fraction of compute) and emulated device as `meshjob bench pipeline` (whose sweep runs
meshjob's rows: 1f1b, eager-1f1b, eager-1f1b+wdelay and signal, the 1-byte bound). Torch's seven schedules run
in torch's own runtime (meshjob_trainer.torch_peer): its stages wait the device's modelled F, I and W through
hooks, and real tensors of the activation's size cross the NICs. Schedules of two stages per rank run the same
layers on the same ranks cut in twice as many stages. Torch's stages carry no skip edges: for the U-Transformer
torch's rows run without them (labelled "utransformer (no skips)"), meshjob's with them.

Reported per row: throughput over signal (same fraction, same run), peak stashed activations per rank (in
microbatches of a rank's layers) and bytes sent per step; the issue's target: eager-1f1b+wdelay at least
1.0x torch's best at 30% and 100% communication, 0.95x at 10%, with peak stash not above ZBV's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.costs.compute import StageCost
from meshjob.costs.device_costs import emulated_cost, emulated_costs
from meshjob.costs.devices import ComputeMode, DeviceProfile, parse_compute
from meshjob.plan.build import build_plan
from meshjob.schedule.boundary import BoundaryKey
from meshjob.schedule.torch_schedules import TORCH_SCHEDULES, TorchSchedule
from meshjob.simulate.simulator import transfer_costs
from meshjob.simulate.torch_peers import simulate_torch
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job
from meshjob_bench import parsed_arguments
from meshjob_bench.machine import machine
from meshjob_bench.pipeline import (
    DEFAULT_DEVICE,
    GLOBAL_BATCH,
    LAYERS_PER_STAGE,
    MICROBATCHES,
    MODELS,
    bench_job,
    cost_model,
    nic_rate_for,
    run_config,
)
from meshjob_bench.pipeline_report import _plt
from meshjob_bench.pipeline_rows import Config
from meshjob_trainer.emulate.netns import DEFAULT_BURST, EmulatedCluster, cleanup_stale
from meshjob_trainer.launch import RankContext, launch

MESHJOB_VARIANTS = ("1f1b", "eager-1f1b", "eager-1f1b+wdelay", "signal")
OURS = "eager-1f1b+wdelay"
# the targets: ours over torch's best, per communication fraction (at least)
TARGETS = {0.1: 0.95, 0.3: 1.0, 1.0: 1.0}
STAGES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the GPT at 30%% communication, hidden 512")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 4); the first untimed")
    parser.add_argument("--models", default=None, help="comma separated (default gpt,utransformer; quick gpt)")
    parser.add_argument("--comm-fractions", default=None, help="comma separated (default 0.1,0.3,1.0; quick 0.3)")
    parser.add_argument(
        "--schedules", default=",".join(TORCH_SCHEDULES), help="torch's schedules to run (class names, comma separated)"
    )
    parser.add_argument("--out", default="bench/results", help="folder for peers.json and peers.png")
    parser.add_argument("--no-netns", action="store_true", help="loopback: no NIC emulation (results say so)")
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=f"emulated device (default {DEFAULT_DEVICE} TFLOP/s)")


def split_job(job: TrainingJob, per_rank: int) -> TrainingJob:
    """The same layers cut into `per_rank` times as many stages (torch's interleaved and V schedules)."""
    doc = job_to_dict(job)
    width = LAYERS_PER_STAGE // per_rank
    count = len(job.stages) * per_rank
    doc["spec"]["stages"] = [{"layers": [width * i, width * (i + 1)], "mesh": [1, 1]} for i in range(count)]
    doc["spec"].pop("edges", None)  # the old cut's edges name its stages: the new cut's are derived afresh
    return parse_job(doc)


def _torch_rank(
    ctx: RankContext,
    spec: TorchSchedule,
    ranks: int,
    costs: list[StageCost],
    optimizer_s: list[float],
    shape: tuple[int, ...],
    steps: int,
) -> dict[str, Any]:
    # in the forked rank only: the benchmark imports without torch (`meshjob bench --help`)
    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.torch_peer import run_emulated_rank

    init_distributed(ctx.env, timeout_s=120, backend="gloo")
    try:
        r = run_emulated_rank(spec, ctx.rank, ranks, costs, optimizer_s[ctx.rank], shape, MICROBATCHES, steps)
        return {"step_seconds": r.step_seconds, "peak_stash": r.peak_stash, "modelled": r.modelled}
    finally:
        shutdown_distributed()


def torch_row(
    model: str, spec: TorchSchedule, config: Config, device: DeviceProfile, steps: int, quick: bool, netns: bool
) -> dict[str, Any]:
    """One torch schedule on `STAGES` ranks at the NIC rate of `config`: measured as meshjob's rows are."""
    job = split_job(bench_job(model, "1f1b", steps, quick, STAGES), spec.stages_per_rank)
    costs = list(emulated_costs(job, device))
    optimizer_s = [
        sum(emulated_cost(job, s, device).optimizer_s for s in spec.stages_of(r, STAGES)) for r in range(STAGES)
    ]
    shape = (GLOBAL_BATCH // MICROBATCHES, job.model.seq_len, job.model.hidden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with EmulatedCluster(STAGES, config.nic_rate, use_netns=netns) as cluster:
            result = launch(
                STAGES,
                lambda ctx: _torch_rank(ctx, spec, STAGES, costs, optimizer_s, shape, steps),
                timeout_s=300,
                **cluster.gang(list(range(STAGES))).launch_args(),
            )
    label = f"{model} (no skips)" if model == "utransformer" else model
    predicted = predict(model, spec, config, device, steps, quick, costs, optimizer_s)
    if not result.ok:
        failure = result.first_failure.error.strip().splitlines()[-1] if result.first_failure else "failed"
        return {"runtime": "torch", "schedule": spec.name, "model": label, "error": failure}
    records = result.values
    step_s = statistics.median(statistics.mean(r["step_seconds"][1:]) for r in records)
    activation = shape[0] * shape[1] * shape[2] * 4
    crossing = sum(spec.rank_of(s, STAGES) != spec.rank_of(s + 1, STAGES) for s in range(len(costs) - 1))
    return {
        "runtime": "torch",
        "schedule": spec.name,
        "model": label,
        "comm_fraction": config.comm_fraction,
        "nic_rate": config.nic_rate,
        "stages_per_rank": spec.stages_per_rank,
        "step_s": step_s,
        "tokens_per_s": GLOBAL_BATCH * job.model.seq_len / step_s,
        "peak_stash": max(max(r["peak_stash"][1:]) for r in records),
        "bytes_sent": 2 * crossing * MICROBATCHES * activation,
        "predicted_one_step_s": predicted,
    }


def predict(
    model: str,
    spec: TorchSchedule,
    config: Config,
    device: DeviceProfile,
    steps: int,
    quick: bool,
    costs: list[StageCost],
    optimizer_s: list[float],
) -> float:
    """The simulator's one step of torch's schedule (meshjob.simulate.torch_peers), each rank's optimizer step
    after its last action (as meshjob's rows' predicted_one_step_s), on the costs meshjob's plan is made with:
    the device's modelled compute, one activation's transfer between two hosts on the emulated NICs."""
    job = bench_job(model, "1f1b", steps, quick, STAGES)
    cost = cost_model(job, device, config.nic_bytes_per_s)
    plan = build_plan(job, cost=cost, network=cost.network)
    hop = transfer_costs(plan, cost)[BoundaryKey(0, 1, "activation")]
    result = simulate_torch(spec, STAGES, MICROBATCHES, costs, hop, cost)
    return max(s.busy_until_s + optimizer_s[rank] for rank, s in result.stages.items())


def meshjob_rows(model: str, fraction: float, args: argparse.Namespace, compute: ComputeMode, steps: int) -> list:
    """meshjob's variants at one fraction, run by `meshjob bench pipeline`'s own sweep."""
    _, rows, _ = run_config(model, STAGES, [fraction], list(MESHJOB_VARIANTS), args, compute, steps)
    out = []
    for r in rows:
        job = bench_job(model, r["variant"], steps, args.quick, STAGES)
        sent = sum(egress for egress, _ in build_plan(job).host_bytes_per_step().values())
        out.append(
            {
                "runtime": "meshjob",
                "schedule": r["variant"],
                "model": model,
                "comm_fraction": fraction,
                "nic_rate": r["nic_rate"],
                "stages_per_rank": 1,
                "step_s": r["step_s"],
                "tokens_per_s": r["tokens_per_s"],
                "peak_stash": max(s["peak_stashed"] for s in r["stages"].values()),
                "bytes_sent": sent,
                "weight_delay": r["weight_delay"],
                "predicted_one_step_s": r["predicted_one_step_s"],
            }
        )
    return out


# The real-compute check: a small GPT (untied head: torch's stages cannot sum a tied copy's gradient) whose
# losses every runtime must reproduce, meshjob's reference being the oracle.
SMALL_RANKS, SMALL_LAYERS = 2, 4


def small_job(stages: int, steps: int = 3) -> TrainingJob:
    """The small GPT cut into `stages` equal stages of one device each, eager-1F1B with a delayed W."""
    width = SMALL_LAYERS // stages
    model = {"kind": "gpt", "layers": SMALL_LAYERS, "hidden": 16, "heads": 2, "vocab": 32, "seqLen": 8}
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": f"peers-small-{stages}"},
            "spec": {
                "model": {**model, "tieEmbeddings": False},
                "training": {"steps": steps, "globalBatch": 8, "microbatches": 4, "learningRate": 1e-2, "seed": 0},
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [width * i, width * (i + 1)], "mesh": [1, 1]} for i in range(stages)],
                "schedule": {"kind": "eager-1f1b", "weightGradDelay": 1},
            },
        }
    )


def _real_rank(ctx: RankContext, job: TrainingJob, spec: TorchSchedule | None, csv_path: str) -> list[float]:
    from meshjob_trainer.dist import init_distributed, shutdown_distributed
    from meshjob_trainer.torch_peer import train_csv_rank, train_torch_rank

    init_distributed(ctx.env, timeout_s=60, backend="gloo")
    try:
        if spec is None:
            return train_csv_rank(job, ctx.rank, csv_path)
        return train_torch_rank(job, spec, ctx.rank, SMALL_RANKS)
    finally:
        shutdown_distributed()


def loss_check(specs: list[TorchSchedule]) -> dict[str, Any]:
    """Every runtime's losses on the small GPT against meshjob's reference: meshjob's own run, its plan exported
    to torch's runtime (torch-csv), and each torch schedule; the largest difference of each."""
    from meshjob.schedule.torch_csv import csv_text, torch_rows
    from meshjob_trainer.reference import reference_for_job
    from meshjob_trainer.train import train_rank

    reference = reference_for_job(small_job(SMALL_RANKS)).losses
    job = small_job(SMALL_RANKS)
    plan = build_plan(job)
    runs: dict[str, Any] = {}
    folder = tempfile.mkdtemp(prefix="meshjob-peers-")
    path = os.path.join(folder, "schedule.csv")
    with open(path, "w") as f:
        f.write(csv_text(torch_rows(plan.schedules, job.training.microbatches, plan.transfer_order.depth)))
    own = launch(SMALL_RANKS, lambda ctx: train_rank(ctx.env, job=job, plan=plan), timeout_s=120)
    runs["meshjob eager-1f1b+wdelay"] = own.values[-1].losses if own.ok else None
    exported = launch(SMALL_RANKS, lambda ctx: _real_rank(ctx, job, None, path), timeout_s=120)
    runs["torch runtime, meshjob's plan (torch-csv)"] = exported.values[-1] if exported.ok else None
    for spec in specs:
        cut = small_job(SMALL_RANKS * spec.stages_per_rank)
        result = launch(SMALL_RANKS, functools.partial(_real_rank, job=cut, spec=spec, csv_path=path), timeout_s=120)
        last = spec.rank_of(len(cut.stages) - 1, SMALL_RANKS)
        runs[spec.name] = result.values[last] if result.ok else None
    shutil.rmtree(folder)
    diffs = {
        name: None if losses is None else max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        for name, losses in runs.items()
    }
    return {"reference": reference, "losses": runs, "max_abs_diff": diffs, "tolerance": 1e-5}


def compare(rows: list[dict]) -> list[dict]:
    """Per model and fraction: ours over torch's best, and ours' peak stash against ZBV's."""
    out = []
    for model, fraction in sorted({(r["model"].split(" ")[0], r["comm_fraction"]) for r in rows if "error" not in r}):
        same = [r for r in rows if r["model"].split(" ")[0] == model and r.get("comm_fraction") == fraction]
        ours = next((r for r in same if r["runtime"] == "meshjob" and r["schedule"] == OURS), None)
        torch_rows = [r for r in same if r["runtime"] == "torch" and "error" not in r]
        if ours is None or not torch_rows:
            continue
        best = max(torch_rows, key=lambda r: r["tokens_per_s"])
        zbv = next((r for r in torch_rows if r["schedule"] == "ScheduleZBVZeroBubble"), None)
        ratio = ours["tokens_per_s"] / best["tokens_per_s"]
        target = TARGETS.get(fraction, 1.0)
        out.append(
            {
                "model": model,
                "comm_fraction": fraction,
                "torch_best": best["schedule"],
                "ours_over_torch_best": ratio,
                "target": target,
                "throughput_met": ratio >= target,
                "stash_met": zbv is None or ours["peak_stash"] <= zbv["peak_stash"],
                "peak_stash_ours": ours["peak_stash"],
                "peak_stash_zbv": zbv and zbv["peak_stash"],
            }
        )
    return out


def print_table(rows: list[dict], title: str) -> None:
    t = Table(
        "model",
        "comm",
        "runtime",
        "schedule",
        "step ms",
        "vs signal",
        "peak stash",
        "MB sent",
        "simulated ms",
        title=title,
    )
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], "", r["runtime"], r["schedule"], "failed", r["error"][:40], "", "", "")
            continue
        t.add_row(
            r["model"],
            f"{r['comm_fraction']:.0%}",
            r["runtime"],
            r["schedule"],
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['throughput_over_signal']:.3f}",
            f"{r['peak_stash']:g}",
            f"{r['bytes_sent'] / 1e6:.1f}",
            f"{r['predicted_one_step_s'] * 1e3:.1f}",
        )
    Console(width=160).print(t)


def plot(rows: list[dict], out_dir: str, subtitle: str) -> str:
    """Throughput over signal per schedule, one panel per model and fraction; peak stash over each bar."""
    plt = _plt()
    panels = sorted({(r["model"].split(" ")[0], r["comm_fraction"]) for r in rows if "error" not in r})
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (model, fraction) in zip(axes[0], panels):
        mine = [
            r
            for r in rows
            if "error" not in r and r["model"].split(" ")[0] == model and r["comm_fraction"] == fraction
            if r["schedule"] != "signal"
        ]
        names = [r["schedule"].replace("Schedule", "torch ") for r in mine]
        bars = ax.bar(range(len(mine)), [r["throughput_over_signal"] for r in mine])
        for bar, r in zip(bars, mine):
            bar.set_color("tab:blue" if r["runtime"] == "meshjob" else "tab:orange")
            ax.annotate(
                f"{r['peak_stash']:g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", fontsize=7
            )
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("throughput / signal (label: peak stash)")
        ax.set_title(f"{model}, {STAGES} devices, communication {fraction:.0%}", fontsize=9)
    fig.suptitle(f"meshjob (blue) vs torch.distributed.pipelining (orange) — {subtitle}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "peers.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench peers", __doc__, add_arguments)
    steps = args.steps or 4  # three timed: one step of a loaded machine's noise is too much to rank on
    models = (args.models or ("gpt" if args.quick else ",".join(MODELS))).split(",")
    fractions = [float(f) for f in (args.comm_fractions or ("0.3" if args.quick else "0.1,0.3,1.0")).split(",")]
    specs = [TORCH_SCHEDULES[name] for name in args.schedules.split(",")]
    compute = parse_compute("emulated", args.device)
    device = compute.device
    assert device is not None
    os.makedirs(args.out, exist_ok=True)
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    cleanup_stale()
    t0 = time.monotonic()
    rows: list[dict] = []
    for model in models:
        for fraction in fractions:
            config = Config(
                model,
                STAGES,
                fraction,
                nic_rate_for(bench_job(model, "1f1b", steps, args.quick, STAGES), device, fraction),
            )
            mine = meshjob_rows(model, fraction, args, compute, steps)
            signal = next(r for r in mine if r["schedule"] == "signal")
            theirs = [torch_row(model, spec, config, device, steps, args.quick, not args.no_netns) for spec in specs]
            for r in mine + theirs:
                if "error" not in r:
                    r["throughput_over_signal"] = r["tokens_per_s"] / signal["tokens_per_s"]
            rows += mine + theirs
    targets = compare(rows)
    check = loss_check(specs)
    worst = max((d for d in check["max_abs_diff"].values() if d is not None), default=float("nan"))
    failed = [n for n, d in check["max_abs_diff"].items() if d is None or d > check["tolerance"]]
    print(f"real compute, small GPT: every runtime's losses within {worst:.1e} of meshjob's reference; off: {failed}")
    subtitle = f"device {args.device} TFLOP/s emulated, M={MICROBATCHES}, {'quick' if args.quick else 'full'} shapes"
    print_table(rows, f"meshjob bench peers — {subtitle}")
    for t in targets:
        print(
            f"{t['model']} at {t['comm_fraction']:.0%}: {OURS} / torch's best ({t['torch_best']}) = "
            f"{t['ours_over_torch_best']:.3f} (target {t['target']}); peak stash {t['peak_stash_ours']:g} vs ZBV "
            f"{t['peak_stash_zbv']}: throughput {'met' if t['throughput_met'] else 'NOT met'}, stash "
            f"{'met' if t['stash_met'] else 'NOT met'}"
        )
    png = plot(rows, args.out, subtitle)
    out = {
        "machine": machine(),
        "steps": steps,
        "quick": bool(args.quick),
        "device": args.device,
        "netns": not args.no_netns,
        "network": (
            f"{STAGES} emulated hosts (network namespaces), NIC rate per row (tbf, burst {DEFAULT_BURST})"
            if not args.no_netns
            else "loopback (no NIC emulation)"
        ),
        "transport": "gloo",
        "wall_seconds": time.monotonic() - t0,
        "rows": rows,
        "targets": targets,
        "loss_check": check,
        "plots": [png],
        "note": "throughput_over_signal: tokens/s over meshjob's signal run (1-byte transfers) at the same fraction; "
        "peak_stash: most microbatches of activations a rank holds at once, in units of one microbatch through all "
        "of a rank's layers (torch's two-stage schedules: each stage counts one half); bytes_sent: per step, all "
        "ranks; torch's U-Transformer rows run without the skip edges its stages cannot carry",
    }
    path = os.path.join(args.out, "peers.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
