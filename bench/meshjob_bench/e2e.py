"""End to end on emulated devices (the paper's §5.2, figure 7): whole training steps of a GPT and a
U-Transformer on 8 emulated hosts of 2 devices, tensor parallel inside each host and pipeline parallel
across them ((data, tensor, pipeline) = (1, 2, 8): a data-parallel degree across hosts would put a
gradient all-reduce of every stage's weights on the same 1 Gbit NICs, which this benchmark is not
about), under three configurations of the same job:
  meshjob   broadcast resharding (chunks auto, greedy balancer), eager-1F1B with weightGradDelay auto
  alpa      Alpa's defaults: send/recv + all-gather inside the destination hosts, naive balancer, 1F1B
  signal    meshjob's schedule with 1-byte transfers: the communication-free upper bound
Ranks run emulated compute (--compute emulated --device ...: every F, I, W and optimizer step waits
the device's modelled time, no math) so the host CPU is left to the communication; activations of the
real sizes and layouts cross tbf-shaped NICs through the real resharding and pipeline executors.
Every rank runs the plan made for the NICs and devices it runs on, the one the simulator predicts.
Reported: throughput (global-batch tokens / median step time of the slowest rank), meshjob over alpa,
each over signal, and the simulator's predicted step time for each run (predicted / measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

from rich.console import Console
from rich.table import Table

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_cost, emulated_costs
from meshjob.costs.devices import ComputeMode, parse_compute
from meshjob.network.model import emulated_network
from meshjob.plan.build import build_plan
from meshjob.simulate.steady import plan_period_s
from meshjob.spec.api import API_VERSION, KIND
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job
from meshjob.units import parse_rate
from meshjob_bench import parsed_arguments
from meshjob_bench.machine import machine, transport_here
from meshjob_bench.pipeline import TBF_BURST_BYTES, TCP_PAYLOAD_PER_FRAME_BYTE, emulated_device
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.launch import RankContext, launch

CONFIGS: dict[str, dict[str, object]] = {
    "meshjob": {"strategy": "broadcast", "chunks": "auto", "balancer": "greedy", "kind": "eager-1f1b", "delay": "auto"},
    "alpa": {"strategy": "local_allgather", "chunks": 1, "balancer": "naive", "kind": "1f1b", "delay": 0},
    "signal": {"strategy": "signal", "chunks": 1, "balancer": "greedy", "kind": "eager-1f1b", "delay": "auto"},
}
MODELS = ("gpt", "utransformer")
HOSTS, DEVICES_PER_HOST, STAGES = 8, 2, 8  # each stage a (1, 2) mesh on its own host: tensor parallel inside


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nic-rate", default="1gbit", help="emulated NIC of every host (default 1gbit)")
    parser.add_argument(
        "--device",
        default="1",
        help="emulated device: a100, h100 or TFLOP/s; the default (1) "
        "makes an activation's transfer at 1gbit about 2/3 of a stage's forward",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run, the first not timed (default 5, quick 2)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma separated (default gpt,utransformer)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, one model, 2 steps")
    parser.add_argument("--out", default="bench/results", help="folder for e2e.json and e2e.png")


def bench_job(model: str, config: str, steps: int, quick: bool) -> TrainingJob:
    """8 stages, each a (1, 2) mesh on its own host: (data, tensor, pipeline) = (1, 2, 8), every
    boundary crosses NICs."""
    c = CONFIGS[config]
    layers = 8 if quick else 16
    hidden, seq, vocab = (128, 64, 256) if quick else (1024, 512, 8192)
    per = layers // STAGES
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": f"e2e-{model}-{config}"},
        "spec": {
            "model": {
                "kind": model,
                "layers": layers,
                "hidden": hidden,
                "heads": 16 if not quick else 4,
                "vocab": vocab,
                "seqLen": seq,
            },
            "training": {"steps": steps, "globalBatch": 32, "microbatches": 8, "learningRate": 1e-4, "seed": 0},
            "topology": {"devicesPerHost": DEVICES_PER_HOST},
            "stages": [
                {"layers": [per * i, per * (i + 1)], "mesh": [1, DEVICES_PER_HOST], "tensorParallelDim": 1}
                for i in range(STAGES)
            ],
            "resharding": {"strategy": c["strategy"], "chunks": c["chunks"], "balancer": c["balancer"]},
            "schedule": {"kind": c["kind"], "weightGradDelay": c["delay"]},
        },
    }
    return parse_job(doc)


def cost_model(job: TrainingJob, device, nic_bytes_per_s: float):
    """The plan's and the simulator's costs: the device's modelled compute and the emulated cluster's
    network (tc rate `nic_bytes_per_s`, of which TCP payload gets TCP_PAYLOAD_PER_FRAME_BYTE, tbf's
    bucket, and the messages' work on the machine's shared cores)."""
    network = replace(
        emulated_network(nic_bytes_per_s * TCP_PAYLOAD_PER_FRAME_BYTE, os.cpu_count() or 1), burst_bytes=TBF_BURST_BYTES
    )
    return CostModel(network=network, stages=emulated_costs(job, device), measured=True)


def planned(job: TrainingJob, compute: ComputeMode, nic_rate: str):
    """The plan every rank runs and the simulator predicts: planned for the NICs and devices it runs on
    (transfer order, receives posted ahead, W delay), and its costs."""
    cost = cost_model(job, compute.device, parse_rate(nic_rate))
    return build_plan(job, cost=cost, network=cost.network), cost


def _rank_main(job: TrainingJob, plan, compute: ComputeMode, ctx: RankContext) -> dict:
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    from meshjob_trainer.train import train_rank

    result = train_rank(ctx.env, job, timeout_s=180.0, compute=compute, plan=plan)
    return {
        "rank": result.rank,
        "stage": result.stage,
        "step_seconds": result.step_seconds,
        "timeline": result.stats.timeline,
        "origin": result.stats.timeline_origin,
    }


@dataclass
class Row:
    model: str
    config: str
    strategy: str
    balancer: str
    schedule: str
    weight_grad_delay: str
    step_s: float  # median over timed steps of the slowest rank's step
    tokens_per_s: float
    simulated_step_s: float
    simulated_over_measured: float
    vs_alpa: float = 0.0
    vs_signal: float = 0.0
    weight_delay: dict[str, int] = field(default_factory=dict)  # the W's each stage delays in the plan run
    delay_choice: dict | None = None  # auto: the candidates the plan simulated and the one it took


def run(
    job: TrainingJob, nic_rate: str, compute: ComputeMode, plan=None, records: list[dict] | None = None
) -> tuple[float, str]:
    """Median step time of the slowest rank over the timed steps, and the cluster's description. The
    ranks run `plan` (default: each builds build_plan(job)); `records`, when given, gets each rank's
    record (its step times and last step's timeline)."""
    ranks_plan, plan = plan, plan or build_plan(job)
    hosts = [plan.placement.host_of(r) for r in range(plan.placement.world_size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with EmulatedCluster(max(hosts) + 1, nic_rate) as cluster:
            network = cluster.describe()
            result = launch(
                len(hosts), lambda ctx: _rank_main(job, ranks_plan, compute, ctx), **cluster.gang(hosts).launch_args()
            )
    if not result.ok:
        raise RuntimeError(f"{job.name}: {result.first_failure.describe() if result.first_failure else 'failed'}")
    values = result.values
    if records is not None:
        records.extend(values)
    timed = range(1, len(values[0]["step_seconds"]))
    return statistics.median(max(r["step_seconds"][i] for r in values) for i in timed), network


def stage_timelines(records: list[dict]) -> dict[str, list]:
    """Each rank's last step: its compute actions from the earliest rank's step start (to diff against
    `meshjob simulate --json`)."""
    origin = min(r["origin"] for r in records)
    return {
        str(r["rank"]): [
            [name, round(r["origin"] - origin + a, 6), round(r["origin"] - origin + b, 6)]
            for name, a, b in r["timeline"]
            if name != "wait"
        ]
        for r in records
    }


def predicted_step_s(job: TrainingJob, plan, cost, compute: ComputeMode) -> float:
    """The simulator's steady-state step period for the plan that ran (meshjob.simulate.steady: steps run over
    and over, as measured), on the same NICs and costs, each stage's optimizer step after its last
    action of each step (the ranks wait it too)."""
    return plan_period_s(
        plan, cost, {i: emulated_cost(job, i, emulated_device(compute)).optimizer_s for i in range(len(job.stages))}
    )


def print_table(rows: list[Row], title: str) -> None:
    t = Table(
        "model",
        "config",
        "resharding",
        "schedule",
        "step ms",
        "tokens/s",
        "vs alpa",
        "vs signal",
        "simulated / measured",
        title=title,
    )
    for r in rows:
        t.add_row(
            r.model,
            r.config,
            f"{r.strategy}, {r.balancer}",
            f"{r.schedule}, delay {_delays(r)}",
            f"{r.step_s * 1e3:.0f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.vs_alpa:.2f}",
            f"{r.vs_signal:.2f}",
            f"{r.simulated_over_measured:.2f}",
        )
    Console(width=150).print(t)


def _delays(r: Row) -> str:
    """The delay asked for, and for auto the most W's a stage delays in the plan run."""
    if r.weight_grad_delay != "auto" or not r.weight_delay:
        return r.weight_grad_delay
    return f"auto ({max(r.weight_delay.values())})"


def plot(rows: list[Row], path: str, subtitle: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.model for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(CONFIGS)
    for j, config in enumerate(CONFIGS):
        values = [next((r.vs_signal for r in rows if r.model == m and r.config == config), 0.0) for m in models]
        bars = ax.bar([i + j * width for i in range(len(models))], values, width, label=config)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + width * (len(CONFIGS) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("throughput / signal bound")
    ax.set_ylim(0, 1.15)
    ax.legend(fontsize=8)
    ax.set_title(f"End to end, emulated devices — {subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench e2e", __doc__, add_arguments)
    steps = args.steps or (2 if args.quick else 5)
    if steps < 2:
        raise SystemExit(f"--steps: {steps} is invalid: at least 2 (the first step is not timed)")
    parse_rate(args.nic_rate, "--nic-rate")
    compute = parse_compute("emulated", args.device)
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(MODELS):
        raise SystemExit(f"--models: {args.models!r} is invalid: comma separated, from {', '.join(MODELS)}")
    models = models[:1] if args.quick else models
    os.makedirs(args.out, exist_ok=True)
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    cleanup_stale()
    t0 = time.monotonic()
    rows: list[Row] = []
    timelines: dict[str, dict[str, list]] = {}
    network = ""
    for model in models:
        for config, c in CONFIGS.items():
            job = bench_job(model, config, steps, args.quick)
            plan, cost = planned(job, compute, args.nic_rate)
            records: list[dict] = []
            step_s, network = run(job, args.nic_rate, compute, plan, records)
            predicted = predicted_step_s(job, plan, cost, compute)
            timelines[f"{model}/{config}"] = stage_timelines(records)
            tokens = job.training.global_batch * job.model.seq_len
            rows.append(
                Row(
                    model,
                    config,
                    str(c["strategy"]),
                    str(c["balancer"]),
                    str(c["kind"]),
                    str(c["delay"]),
                    step_s,
                    tokens / step_s,
                    predicted,
                    predicted / step_s,
                    weight_delay={str(s): d for s, d in sorted(plan.weight_delay.items())},
                    delay_choice=plan.delay_choice and plan.delay_choice.to_json(),
                )
            )
        mine = {r.config: r for r in rows if r.model == model}
        for r in mine.values():
            r.vs_alpa = r.tokens_per_s / mine["alpa"].tokens_per_s
            r.vs_signal = r.tokens_per_s / mine["signal"].tokens_per_s
    subtitle = (
        f"{HOSTS} hosts x {DEVICES_PER_HOST} devices, (dp, tp, pp) = (1, {DEVICES_PER_HOST}, {STAGES}), "
        f"NIC {args.nic_rate}, "
        f"{compute.describe()}"
    )
    print_table(rows, f"meshjob bench e2e — {subtitle}")
    png = os.path.join(args.out, "e2e.png")
    plot(rows, png, subtitle)
    doc = {
        "benchmark": "e2e",
        "nic_rate": args.nic_rate,
        "network": network,
        **compute.to_json(),
        "transport": transport_here(),
        "machine": machine(),
        "hosts": HOSTS,
        "devices_per_host": DEVICES_PER_HOST,
        "stages": STAGES,
        "steps": steps,
        "timed_steps": steps - 1,
        "quick": bool(args.quick),
        "wall_seconds": time.monotonic() - t0,
        "load_average_1m_at_end": os.getloadavg()[0],  # what else ran on the shared cores
        "jobs": {f"{r.model}/{r.config}": job_to_dict(bench_job(r.model, r.config, steps, args.quick)) for r in rows},
        "rows": [asdict(r) for r in rows],
        "timelines": timelines,
        "plots": [png],
    }
    path = os.path.join(args.out, "e2e.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path} and {png}")
    return 0
