"""Pipeline schedules on the emulated cluster (the paper's §4, figures 4, 7 and 9).

The paper: "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022).

For a GPT and a U-Transformer (skip edges that cross stages), the same job runs under
  1f1b                 the synchronous baseline (no I/W split)
  eager-1f1b           more warm-up forwards (2(S-i)-1), so communication overlaps later compute
  eager-1f1b+wdelay    plus backward weight delaying (I first, W postponed by the cost model)
  signal               eager-1f1b with 1-byte transfers: the communication-free upper bound (no I/W
                       split: on CPU the split backward costs extra compute, which is not communication)
side by side in one run, each as a real training job (torch.distributed ranks in network namespaces,
tbf NICs at --nic-rate). Reported: throughput as a ratio to `signal` and to 1f1b, bubble and
communication-overlap fractions per stage, peak stashed activations per stage vs 1f1b, the
simulator's prediction of the same plans (calibrated from the measured compute) and its error,
a table, JSON, and a PNG timeline per stage of the last step like the paper's figure 4.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass, replace

from meshjob_bench import parsed_arguments
from meshjob_trainer.commands.run import add_compute_arguments
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.launch import RankContext, launch
from meshjob.api import API_VERSION, KIND
from meshjob.devices import REAL, ComputeMode, parse_compute
from meshjob.spec import TrainingJob, parse_job
from meshjob.units import parse_rate

VARIANTS: dict[str, dict[str, str | int]] = {  # name -> schedule kind, weight-grad delay, strategy
    "1f1b": {"kind": "1f1b", "delay": 0, "strategy": "broadcast"},
    "eager-1f1b": {"kind": "eager-1f1b", "delay": 0, "strategy": "broadcast"},
    "eager-1f1b+wdelay": {"kind": "eager-1f1b", "delay": 1, "strategy": "broadcast"},
    "signal": {"kind": "eager-1f1b", "delay": 0, "strategy": "signal"},
}
MODELS = ("gpt", "utransformer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nic-rate", default="100mbit",
                        help="emulated NIC of every host; slow enough that communication matters (default 100mbit)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 timed steps, one model")
    parser.add_argument("--steps", type=int, default=None, help="training steps per variant (default 11, quick 3); "
                        "the first is warm-up and not timed")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma separated, 1f1b and signal always included (default {','.join(VARIANTS)})")
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated (default gpt,utransformer)")
    parser.add_argument("--stages", type=int, default=4, choices=(2, 4, 8),
                        help="pipeline stages, one device and one emulated host each (default 4)")
    parser.add_argument("--out", default="bench/results", help="folder for pipeline.json and PNGs")
    parser.add_argument("--no-netns", action="store_true", help="loopback: no NIC emulation (results say so)")
    add_compute_arguments(parser)


def bench_job(model: str, variant: str, steps: int, quick: bool, stages: int = 4) -> TrainingJob:
    """`stages` stages on as many hosts of one device each: every boundary crosses a NIC."""
    v = VARIANTS[variant]
    hidden, seq = (32, 16) if quick else (128, 64)
    doc = {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": f"bench-{model}-{variant.replace('+', '-')}"},
        "spec": {
            "model": {"kind": model, "layers": 8, "hidden": hidden, "heads": 4, "vocab": 256, "seqLen": seq},
            "training": {"steps": steps, "globalBatch": 16, "microbatches": 8, "learningRate": 1e-3, "seed": 0},
            "topology": {"devicesPerHost": 1},
            "stages": [{"layers": [8 * i // stages, 8 * (i + 1) // stages], "mesh": [1, 1]} for i in range(stages)],
            "resharding": {"strategy": v["strategy"], "chunks": 4, "balancer": "greedy"},
            "schedule": {"kind": v["kind"], "weightGradDelay": v["delay"]},
        },
    }
    return parse_job(doc)


def _rank_main(job: TrainingJob, ctx: RankContext, compute: ComputeMode) -> dict:
    from meshjob_trainer.train import train_rank

    result = train_rank(ctx.env, job, timeout_s=120.0, compute=compute)
    return {"rank": result.rank, "stage": result.stage, "step_seconds": result.step_seconds,
            "compute_s": result.stats.compute_s, "wait_s": result.stats.wait_s, "comm_s": result.comm_s,
            "steps": result.stats.steps, "peak_stashed": result.stats.peak_stashed,
            "timeline": result.stats.timeline, "origin": result.stats.timeline_origin, "losses": result.losses}


@dataclass
class Measured:
    model: str
    variant: str
    step_s: float  # median over timed steps of the slowest rank's step
    tokens_per_s: float
    stages: dict[int, dict[str, float]]
    timelines: dict[int, tuple[float, list]]  # stage -> (origin, last step's timeline)
    final_loss: float


def run_variant(job: TrainingJob, nic_rate: str, use_netns: bool, compute: ComputeMode = REAL
                ) -> tuple[Measured, str]:
    from meshjob.plan import build_plan

    plan = build_plan(job, nic_bytes_per_s=parse_rate(nic_rate))
    rank_hosts = [plan.placement.host_of(r) for r in range(plan.placement.world_size)]
    used = sorted(set(rank_hosts))
    compact = [used.index(h) for h in rank_hosts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with EmulatedCluster(len(used), nic_rate, use_netns=use_netns) as cluster:
            network = cluster.describe()
            result = launch(len(compact), lambda ctx: _rank_main(job, ctx, compute), **cluster.gang(compact).launch_args())
    if not result.ok:
        raise RuntimeError(f"{job.name}: {result.first_failure.describe() if result.first_failure else 'failed'}")
    return measure(job, result.values), network


def measure(job: TrainingJob, records: list[dict]) -> Measured:
    timed = range(1, len(records[0]["step_seconds"]))  # step 0 warms up (allocations, first sends)
    step_s = statistics.median(max(r["step_seconds"][i] for r in records) for i in timed)
    stages: dict[int, dict[str, float]] = {}
    timelines: dict[int, tuple[float, list]] = {}
    for r in records:  # one device per stage in the bench jobs; several would be averaged here
        busy = sum(r["step_seconds"])
        stages[r["stage"]] = {
            "bubble": max(0.0, 1.0 - r["compute_s"] / busy) if busy else 0.0,
            "overlap": max(0.0, 1.0 - r["wait_s"] / r["comm_s"]) if r["comm_s"] > 0 else 1.0,
            "peak_stashed": r["peak_stashed"],
            "compute_s_per_step": r["compute_s"] / max(1, r["steps"]),
        }
        timelines[r["stage"]] = (r["origin"], r["timeline"])
    losses = [x for r in records for x in r["losses"]]
    tokens = job.training.global_batch * job.model.seq_len
    return Measured("", "", step_s, tokens / step_s, stages, timelines, losses[-1] if losses else float("nan"))


TBF_BURST_BYTES = 128 * 1024  # EmulatedCluster's default tbf burst "128kb" (tc counts k as 1024)


def simulate_measured(job: TrainingJob, m: Measured, nic_rate: str, emulated: bool) -> float:
    """The simulator's step time for the same plan, its compute cost calibrated from this run's
    measured per-stage compute, its NICs the emulated ones (rate and tbf burst)."""
    from meshjob.network import NetworkModel
    from meshjob.plan import build_plan
    from meshjob.simulate import CostModel, simulate_plan

    network = NetworkModel(nic_bytes_per_s=parse_rate(nic_rate), burst_bytes=TBF_BURST_BYTES if emulated else 0.0)
    cost = CostModel(network=network)
    per_layer = []
    for i, st in enumerate(job.stages):
        work = (st.layers[1] - st.layers[0]) * job.training.microbatch_size / (st.tensor_parallel * st.data_parallel)
        per_mb = m.stages[i]["compute_s_per_step"] / job.training.microbatches
        per_layer.append(per_mb / (1 + cost.backward_factor) / work)
    cost = replace(cost, layer_forward_s=statistics.mean(per_layer), measured=True)
    plan = build_plan(job, nic_bytes_per_s=cost.nic_bytes_per_s)  # the plan that ran (default costs)
    return simulate_plan(plan, cost).step_s


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("model", "variant", "step ms", "tokens/s", "vs signal", "vs 1f1b", "bubble", "overlap",
              "peak stash / 1f1b", "sim step ms", "sim error", title=title)
    for r in rows:
        t.add_row(r["model"], r["variant"], f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['vs_signal']:.2f}", f"{r['vs_1f1b']:.2f}", f"{r['bubble']:.1%}", f"{r['overlap']:.1%}",
                  "/".join(f"{x:.2f}" for x in r["peak_stashed_vs_1f1b"]),
                  f"{r['simulated_step_s'] * 1e3:.1f}", f"{r['simulator_error']:+.0%}")
    Console(width=170).print(t)


def plot(measured: list[Measured], out_dir: str, subtitle: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868", "wait": "#dddddd"}
    paths = []
    for model in sorted({m.model for m in measured}):
        ms = [m for m in measured if m.model == model]
        fig, axes = plt.subplots(len(ms), 1, figsize=(12, 2.2 * len(ms)), squeeze=False)
        for ax, m in zip(axes[:, 0], ms):
            origin = min(o for o, _ in m.timelines.values())
            for stage, (o, timeline) in sorted(m.timelines.items()):
                for name, start, end in timeline:
                    kind = "wait" if name == "wait" else name.rstrip("0123456789")
                    x0 = (o - origin + start) * 1e3
                    ax.barh(stage, (end - start) * 1e3, left=x0, color=colors.get(kind, "#999999"),
                            edgecolor="white" if kind != "wait" else "none", height=0.8)
                    if kind != "wait" and (end - start) * 1e3 > 0.04 * m.step_s * 1e3:
                        ax.text(x0 + (end - start) * 5e2, stage, name[len(kind):], ha="center", va="center",
                                fontsize=6, color="white")
            ax.set_yticks(sorted(m.timelines))
            ax.set_yticklabels([f"stage {s}" for s in sorted(m.timelines)])
            ax.invert_yaxis()
            ax.set_title(f"{m.variant}: step {m.step_s * 1e3:.0f} ms", fontsize=9, loc="left")
            ax.set_xlabel("ms since the step began")
        fig.suptitle(f"{model}: last step per stage (F blue, B/I orange, W green, waiting grey) — {subtitle}",
                     fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"pipeline_timeline_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench pipeline", __doc__, add_arguments)
    steps = args.steps or (3 if args.quick else 11)
    if steps < 2:
        raise SystemExit(f"--steps: {steps} is invalid: at least 2 (the first step is not timed)")
    parse_rate(args.nic_rate)
    compute = parse_compute(args.compute, args.device)
    variants = [v for v in VARIANTS if v in {"1f1b", "signal", *args.variants.split(",")}]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    models = [m for m in args.models.split(",") if m]
    if unknown or not models or set(models) - set(MODELS):
        raise SystemExit(f"--variants/--models: {sorted(unknown) or models} is invalid: variants from "
                         f"{', '.join(VARIANTS)}; models from {', '.join(MODELS)}")
    if args.quick and args.models == ",".join(MODELS):
        models = models[:1]
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    cleanup_stale()
    measured: list[Measured] = []
    rows: list[dict] = []
    network = ""
    t0 = time.monotonic()
    for model in models:
        per_variant: dict[str, Measured] = {}
        for variant in variants:
            job = bench_job(model, variant, steps, args.quick, args.stages)
            m, network = run_variant(job, args.nic_rate, not args.no_netns, compute)
            m.model, m.variant = model, variant
            per_variant[variant] = m
            measured.append(m)
            sim = simulate_measured(job, m, args.nic_rate, "namespaces" in network)
            rows.append({"model": model, "variant": variant, "step_s": m.step_s, "tokens_per_s": m.tokens_per_s,
                         "simulated_step_s": sim, "simulator_error": sim / m.step_s - 1.0,
                         "final_loss": m.final_loss, "stages": m.stages, **compute.to_json()})
        base, bound = per_variant["1f1b"], per_variant["signal"]
        for r in rows:
            if r["model"] != model:
                continue
            st = r["stages"]
            r["vs_signal"] = r["tokens_per_s"] / bound.tokens_per_s
            r["vs_1f1b"] = r["tokens_per_s"] / base.tokens_per_s
            r["bubble"] = statistics.mean(s["bubble"] for s in st.values())
            r["overlap"] = statistics.mean(s["overlap"] for s in st.values())
            r["peak_stashed_vs_1f1b"] = [st[i]["peak_stashed"] / base.stages[i]["peak_stashed"] for i in sorted(st)]
    emulated = "netns + tbf" if "namespaces" in network else "loopback, NOT rate-limited"
    subtitle = f"NIC {args.nic_rate} ({emulated}), {args.stages} stages x 1 device, M=8, broadcast K=4"
    print_table(rows, f"meshjob bench pipeline — {subtitle}")
    pngs = plot(measured, args.out, subtitle)
    out = {"nic_rate": args.nic_rate, "network": network, "emulated": emulated, "steps": steps, "timed_steps": steps - 1,
           "quick": bool(args.quick), "wall_seconds": time.monotonic() - t0, "rows": rows, "plots": pngs,
           "note": "throughput = global-batch tokens / median step time of the slowest rank; "
                   "vs_signal = fraction of the 1-byte-transfer upper bound; the simulator is calibrated "
                   "with this run's measured compute, so its error is the network and schedule model's"}
    path = os.path.join(args.out, "pipeline.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path} and {', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
