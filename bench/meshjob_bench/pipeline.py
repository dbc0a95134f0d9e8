"""Pipeline schedules on the emulated cluster (the paper's §4, figures 4 and 9).

The paper: "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022).

A GPT and a U-Transformer (skip edges that cross stages) at paper-like shapes (hidden 2048, 4 layers
per stage, 1 MiB activations), 4 and 8 stages of one device on one emulated host each, under
emulated device compute (meshjob.costs.devices: every F, I, W and optimizer step waits the device's
modelled time, no math; the real tensors cross the real NICs). Each configuration runs as a real
training job under
  1f1b                 the synchronous baseline (no I/W split)
  eager-1f1b           more warm-up forwards (2(S-i)-1), so communication overlaps later compute
  eager-1f1b+wdelay    plus backward weight delaying (I first, W postponed: weightGradDelay auto,
                       sized by the plan from the device's modelled costs)
  signal               eager-1f1b with 1-byte transfers and weightGradDelay auto (the delays the
                       plan simulates fastest without communication): the communication-free bound
                       (with a smaller delay than eager-1f1b+wdelay's, eager-1f1b+wdelay beat it where
                       communication is cheap: a delayed W fills the drain's bubbles, zero-bubble style)
over a sweep of NIC rates, each chosen so that communication is a given fraction of compute: the
busiest NIC direction's bytes per microbatch over the rate, divided by a stage's F + I + W of one
microbatch (`--comm-fractions`, default 0.1, 0.3 and 1.0). Reported per run: throughput over 1f1b and over
signal, bubble and communication-overlap fractions, peak stashed microbatches against 1f1b, the
simulator's prediction of the same plan (predicted / measured step period: meshjob.simulate.steady), and the step bound
(meshjob.simulate.step_bound: from the NIC links' bytes and the compute chains before and after each transfer,
no schedule of the plan's transfers finishes a step sooner; max_vs_signal = signal's predicted step
over it, the most of signal any schedule can reach); the issue's targets,
checked on the measured rows; a table, JSON, a timeline PNG per model like figure 4 and a bar chart
like figure 9 (the targets, the table and the figures: meshjob_bench.pipeline_report).
Under emulated compute the JSON's `emulated_compute` also checks the device's waits themselves: one rank, no
network, its measured step and forward over the modelled ones (target: within 5%).

`--parts` picks what runs: `sweep` (the above; the JSON's top-level keys) and `recompute` (its keys `recompute`
and `precision`), both by default. The recompute part runs the GPT at 4 stages on NICs at 30% of compute
(`SECTION_*`) under gpipe, 1f1b, eager-1f1b and eager-1f1b+wdelay, each with spec.training.recompute none and
full (emulated compute waits full recompute's forward in I or B: meshjob.costs.device_costs), and reports per
schedule the step with recompute over the step without (the issue's target: at most 1.4x under
eager-1f1b+wdelay), the peak stashed microbatches, and the peak activations' ratio from `bench memory`'s
bench/results/memory.json where it is (real compute; not measured here: emulated compute keeps no activations).
Then eager-1f1b+wdelay without recompute again in bf16 (spec.training.precision): the boundary bytes the ranks
counted landing (meshjob_trainer.reshard's Resharded events), bf16's over fp32's (expected 0.5: boundary
tensors travel in the training dtype). A run of some parts only merges their keys into the existing
pipeline.json and keeps the others (the report: meshjob_bench.pipeline_report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_cost, emulated_costs
from meshjob.costs.devices import ComputeMode, DeviceProfile, parse_compute, parse_device
from meshjob.errors import FieldError, SpecError
from meshjob.network.model import EMULATED_MESSAGE_CPU_S, NetworkModel, with_alone
from meshjob.plan.build import build_plan
from meshjob.resharding.tasks import CROSS_HOST
from meshjob.simulate.simulator import simulate_plan
from meshjob.simulate.steady import plan_period_s
from meshjob.simulate.step_bound import nic_bytes, step_bound
from meshjob.spec.api import API_VERSION, KIND
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job
from meshjob_bench import parsed_arguments
from meshjob_bench.machine import machine, transport_here
from meshjob_bench.pipeline_report import (
    check_targets,
    plot_bars,
    plot_recompute,
    plot_timelines,
    precision_section,
    print_recompute,
    print_table,
    print_targets,
    recompute_section,
)
from meshjob_bench.pipeline_rows import Config, Measured, StageMeasured
from meshjob_trainer.commands.run import add_compute_arguments
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale
from meshjob_trainer.events import Event, Resharded
from meshjob_trainer.launch import RankContext, launch

VARIANTS: dict[str, dict[str, str | int]] = {  # name -> schedule kind, weight-grad delay, strategy
    "1f1b": {"kind": "1f1b", "delay": 0, "strategy": "broadcast"},
    "eager-1f1b": {"kind": "eager-1f1b", "delay": 0, "strategy": "broadcast"},
    "eager-1f1b+wdelay": {"kind": "eager-1f1b", "delay": "auto", "strategy": "broadcast"},
    "signal": {"kind": "eager-1f1b", "delay": "auto", "strategy": "signal"},
}
# the recompute part's schedules: bench memory's four (meshjob_bench.memory.SCHEDULES), broadcast transfers
SCHEDULES: dict[str, dict[str, str | int]] = {
    "gpipe": {"kind": "gpipe", "delay": 0, "strategy": "broadcast"},
    **{name: VARIANTS[name] for name in ("1f1b", "eager-1f1b", "eager-1f1b+wdelay")},
}
SECTION_MODEL, SECTION_STAGES, SECTION_COMM_FRACTION = "gpt", 4, 0.3  # the recompute part's one configuration
PRECISION_SCHEDULE = "eager-1f1b+wdelay"  # the schedule the recompute part runs in bf16 as well
PARTS = ("sweep", "recompute")
PART_KEYS = {"recompute": ("recompute", "precision")}  # pipeline.json's keys of each part but the sweep (the rest)
MODELS = ("gpt", "utransformer")
LAYERS_PER_STAGE = 4
SHAPES = {
    "full": {"hidden": 2048, "heads": 16, "seqLen": 128, "vocab": 1024},  # 1 MiB fp32 activations
    "quick": {"hidden": 512, "heads": 8, "seqLen": 128, "vocab": 256},
}
GLOBAL_BATCH, MICROBATCHES = 8, 8
DEFAULT_DEVICE = "3"  # TFLOP/s: see add_arguments
TBF_BURST_BYTES = 128 * 1024  # EmulatedCluster's default tbf burst "128kb" (tc counts k as 1024)
# tbf counts a packet's bytes at layer 2: a full TCP segment carries 1448 payload bytes (MTU 1500 less
# IP, TCP and timestamp headers) in a 1514-byte frame, so the emulated NIC moves payload at this
# fraction of its tc rate (the design notes measured one stream at 1.044 L)
TCP_PAYLOAD_PER_FRAME_BYTE = 1448 / 1514


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: hidden 512, the GPT, 4 stages, comm fractions 0.3 and 1.0, 2 steps",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default 3); the first is warm-up and not timed"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma separated, 1f1b and signal always included (default {','.join(VARIANTS)})",
    )
    parser.add_argument("--models", default=None, help="comma separated (default gpt,utransformer; quick gpt)")
    parser.add_argument("--stages", default=None, help="comma separated from 2, 4, 8 (default 4,8; quick 4)")
    parser.add_argument(
        "--comm-fractions",
        default=None,
        help="communication / compute per microbatch to set each NIC rate for (default 0.1,0.3,1.0; quick 0.3,1.0)",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma separated: sweep (schedules over NIC rates) and recompute (recompute none/full per schedule, "
        "bf16/fp32 boundary bytes); a run of some parts keeps the others' keys of an existing pipeline.json "
        f"(default {','.join(PARTS)})",
    )
    parser.add_argument("--out", default="bench/results", help="folder for pipeline.json and PNGs")
    parser.add_argument("--no-netns", action="store_true", help="loopback: no NIC emulation (results say so)")
    add_compute_arguments(parser, default="emulated")
    parser.set_defaults(device=None)
    parser.epilog = (
        f"With --compute emulated the device defaults to {DEFAULT_DEVICE} TFLOP/s (A100's bytes per "
        "FLOP): the emulated NICs reach about 2 gbit on these 2 cores, so the device is slowed as "
        "far as the NICs are (an A100 at 1/100 with 100x slower NICs keeps the same ratios)."
    )


def bench_job(
    model: str,
    variant: str,
    steps: int,
    quick: bool,
    stages: int = 4,
    recompute: str = "none",
    precision: str = "fp32",
) -> TrainingJob:
    """`stages` stages of LAYERS_PER_STAGE layers on as many hosts of one device: every boundary crosses a NIC.
    `variant`: one of VARIANTS or SCHEDULES; `recompute` and `precision`: spec.training's."""
    v = {**VARIANTS, **SCHEDULES}[variant]
    layers = LAYERS_PER_STAGE * stages
    suffix = "".join(f"-{x}" for x in (recompute, precision) if x not in ("none", "fp32"))
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": f"bench-{model}-{stages}-{variant.replace('+', '-')}{suffix}"},
        "spec": {
            "model": {"kind": model, "layers": layers, **SHAPES["quick" if quick else "full"]},
            "training": {
                "steps": steps,
                "globalBatch": GLOBAL_BATCH,
                "microbatches": MICROBATCHES,
                "learningRate": 1e-3,
                "seed": 0,
                "recompute": recompute,
                "precision": precision,
            },
            "topology": {"devicesPerHost": 1},
            "stages": [
                {"layers": [LAYERS_PER_STAGE * i, LAYERS_PER_STAGE * (i + 1)], "mesh": [1, 1]} for i in range(stages)
            ],
            "resharding": {"strategy": v["strategy"], "chunks": 4, "balancer": "greedy"},
            "schedule": {"kind": v["kind"], "weightGradDelay": v["delay"]},
        },
    }
    return parse_job(doc)


def emulated_device(compute: ComputeMode) -> DeviceProfile:
    """The device whose modelled time emulated compute waits (parse_compute gives it one)."""
    if compute.device is None:
        raise ValueError(f"{compute.kind} compute models no device")
    return compute.device


def cost_model(job: TrainingJob, device, nic_bytes_per_s: float, emulated_nics: bool = True):
    """The plan's and the simulator's costs: the device's modelled compute, the emulated NICs (tc rate
    `nic_bytes_per_s`, of which TCP payload gets TCP_PAYLOAD_PER_FRAME_BYTE, and tbf's bucket), and
    what a message that runs alone on its link costs there (meshjob.network.model.with_alone: the turn-around
    after a held send, one message's CPU on the machine's shared cores, is on the link's path each time,
    and tbf's bucket does not shorten it. Measured: U-Transformer, 4 stages, comm fraction 1.0, 1 MiB in
    4 messages of 256 KiB: a held send's next one was issued 0.28-0.33 ms (median) after its bytes could
    have left)."""
    network = NetworkModel(
        nic_bytes_per_s=nic_bytes_per_s * TCP_PAYLOAD_PER_FRAME_BYTE,
        burst_bytes=TBF_BURST_BYTES if emulated_nics else 0.0,
    )
    return CostModel(
        network=with_alone(network, EMULATED_MESSAGE_CPU_S, os.cpu_count() or 1),
        stages=emulated_costs(job, device),
        measured=True,
    )


def busiest_link_bytes(job: TrainingJob) -> float:
    """Bytes through the busiest NIC direction in one microbatch (every boundary, forward and backward)."""
    plan = build_plan(job)
    per_link: dict = {}
    for b in plan.boundaries:
        for link, n in nic_bytes(plan, b, NetworkModel()).items():
            per_link[link] = per_link.get(link, 0) + n
    return max(per_link.values())


def nic_rate_for(job: TrainingJob, device, comm_fraction: float) -> float:
    """Bytes/s at which the busiest link's bytes of a microbatch take `comm_fraction` of a stage's
    compute of one microbatch (F + I + W, the slowest stage)."""
    compute = max(c.forward_s + c.backward_s for c in emulated_costs(job, device))
    return busiest_link_bytes(job) / (comm_fraction * compute)


class LandedBytes:
    """A rank's events sink that adds up, per scope, the boundary-tensor bytes its receives counted landing
    (meshjob_trainer.reshard's Resharded events: each message's elements times the element size of what
    arrived): summed over the receiving ranks, the bytes sent across the stages, as the run counted them."""

    def __init__(self) -> None:
        self.by_scope: dict[str, int] = {}

    def emit(self, event: Event) -> None:
        if isinstance(event, Resharded):
            self.by_scope[event.scope] = self.by_scope.get(event.scope, 0) + event.nbytes


def _rank_main(job: TrainingJob, plan, ctx: RankContext, compute: ComputeMode, count_bytes: bool = False) -> dict:
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    from meshjob_trainer.train import train_rank

    landed = LandedBytes() if count_bytes else None
    result = train_rank(ctx.env, job, timeout_s=120.0, compute=compute, plan=plan, events=landed)
    return {
        "rank": result.rank,
        "stage": result.stage,
        "step_seconds": result.step_seconds,
        "compute_s": result.stats.compute_s,
        "wait_s": result.stats.wait_s,
        "comm_s": result.comm_s,
        "steps": result.stats.steps,
        "peak_stashed": result.stats.peak_stashed,
        "timeline": result.stats.timeline,
        "origin": result.stats.timeline_origin,
        "losses": result.losses,
        "bytes_received": landed.by_scope if landed is not None else {},
    }


def run_variant(
    job: TrainingJob,
    plan,
    config: Config,
    variant: str,
    use_netns: bool,
    compute: ComputeMode,
    count_bytes: bool = False,
) -> tuple[Measured, str]:
    """One training job on a fresh emulated cluster; `count_bytes`: the Measured's bytes_received too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with EmulatedCluster(len(job.stages), config.nic_rate, use_netns=use_netns) as cluster:
            network = cluster.describe()
            ranks = [plan.placement.host_of(r) for r in range(plan.placement.world_size)]
            used = sorted(set(ranks))
            result = launch(
                len(ranks),
                lambda ctx: _rank_main(job, plan, ctx, compute, count_bytes),
                **cluster.gang([used.index(h) for h in ranks]).launch_args(),
            )
    if not result.ok:
        raise RuntimeError(f"{job.name}: {result.first_failure.describe() if result.first_failure else 'failed'}")
    return measure(job, result.values, config, variant), network


def measure(job: TrainingJob, records: list[dict], config: Config, variant: str) -> Measured:
    # Step 0 warms up (allocations, first sends). Ranks are not synchronised between steps (no
    # collective ends a step here): a later stage starts its next step while the first one drains,
    # so one step's durations differ across ranks by their skew, while every rank's mean over the
    # timed steps tends to the pipeline's period
    step_s = statistics.median(statistics.mean(r["step_seconds"][1:]) for r in records)
    stages: dict[int, StageMeasured] = {}
    timelines: dict[int, tuple[float, list]] = {}
    origin = min(r["origin"] for r in records)
    for r in records:  # one device per stage in the bench jobs; several would be averaged here
        busy = sum(r["step_seconds"])
        o = r["origin"]
        stages[r["stage"]] = {
            "bubble": max(0.0, 1.0 - r["compute_s"] / busy) if busy else 0.0,
            "overlap": max(0.0, 1.0 - r["wait_s"] / r["comm_s"]) if r["comm_s"] > 0 else 1.0,
            "peak_stashed": r["peak_stashed"],
            "compute_s_per_step": r["compute_s"] / max(1, r["steps"]),
            # compute actions from the earliest rank's step start
            "timeline": [
                (name, round(o - origin + a, 6), round(o - origin + b, 6))
                for name, a, b in r["timeline"]
                if name != "wait"
            ],
        }
        timelines[r["stage"]] = (o, r["timeline"])
    losses = [x for r in records for x in r["losses"]]
    tokens = job.training.global_batch * job.model.seq_len
    landed: dict[str, int] = {}
    for r in records:
        for scope, nbytes in r.get("bytes_received", {}).items():
            landed[scope] = landed.get(scope, 0) + nbytes
    return Measured(
        config,
        variant,
        step_s,
        tokens / step_s,
        stages,
        timelines,
        losses[-1] if losses else float("nan"),
        landed,
    )


def calibrated_cost(job: TrainingJob, m: Measured, nic_bytes_per_s: float, emulated_nics: bool):
    """Real compute: the formula's costs with its one constant taken from this run's measured compute."""
    base = CostModel(
        network=NetworkModel(
            nic_bytes_per_s=nic_bytes_per_s * TCP_PAYLOAD_PER_FRAME_BYTE,
            burst_bytes=TBF_BURST_BYTES if emulated_nics else 0.0,
        )
    )
    per_layer = []
    for i, st in enumerate(job.stages):
        work = (st.layers[1] - st.layers[0]) * job.training.microbatch_size
        per_mb = m.stages[i]["compute_s_per_step"] / job.training.microbatches
        per_layer.append(per_mb / (1 + base.backward_factor) / work)
    return CostModel(network=base.network, layer_forward_s=statistics.mean(per_layer), measured=True)


def predict(job: TrainingJob, plan, m: Measured, config: Config, compute: ComputeMode, emulated_nics: bool) -> dict:
    """The simulator on the plan that ran. Emulated compute: the device's modelled costs (the same the
    ranks waited), plus each stage's optimizer step after its last action. Real compute: the costs
    calibrated from this run's measured compute (the formula's shape, one constant). The prediction is
    the steady-state period (meshjob.simulate.steady: steps run over and over, as measured); one isolated step
    beside it, and the step bound (meshjob.simulate.step_bound) on the same costs: no schedule of this plan's
    transfers runs one step faster."""
    if compute.emulated:
        cost = cost_model(job, compute.device, config.nic_bytes_per_s, emulated_nics)
        optimizer = [emulated_cost(job, i, emulated_device(compute)).optimizer_s for i in range(len(job.stages))]
    else:
        cost, optimizer = calibrated_cost(job, m, config.nic_bytes_per_s, emulated_nics), [0.0] * len(job.stages)
    result = simulate_plan(plan, cost)
    one_step = one_step_s(result, optimizer)
    step = plan_period_s(plan, cost, dict(enumerate(optimizer)))
    bound = step_bound(plan, cost, optimizer)
    return {
        "predicted_step_s": step,
        "predicted_over_measured": step / m.step_s,
        "predicted_one_step_s": one_step,
        "step_bound": bound and bound.to_json(),
        "predicted_stages": {
            str(i): {"bubble": s.bubble_fraction(result.step_s), "overlap": s.overlap_fraction()}
            for i, s in result.stages.items()
        },
    }


def one_step_s(result: Any, optimizer: Sequence[float] | Mapping[int, float]) -> float:
    """One isolated step of a simulated plan (meshjob.simulate.simulator.simulate_plan's result): every stage's last
    action, then its optimizer step (`optimizer`, per stage), the unit of the step bound."""
    return max(s.busy_until_s + optimizer[i] for i, s in result.stages.items())


def _list(text: str | None, default: str, kind, flag: str, allowed: str, ok) -> list:
    values = []
    for item in (text if text is not None else default).split(","):
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise SpecError([FieldError(flag, item, allowed)])
        values.append(value)
    return values


def parse_sweep(args: argparse.Namespace) -> tuple[list[str], list[int], list[float], list[str]]:
    quick = args.quick
    models = _list(
        args.models,
        "gpt" if quick else ",".join(MODELS),
        str,
        "--models",
        f"one of {', '.join(MODELS)}",
        lambda m: m in MODELS,
    )
    stages = _list(args.stages, "4" if quick else "4,8", int, "--stages", "one of 2, 4, 8", lambda s: s in (2, 4, 8))
    fractions = _list(
        args.comm_fractions,
        "0.3,1.0" if quick else "0.1,0.3,1.0",
        float,
        "--comm-fractions",
        "a number in (0, 10]",
        lambda f: 0 < f <= 10,
    )
    variants = _list(
        args.variants, ",".join(VARIANTS), str, "--variants", f"one of {', '.join(VARIANTS)}", lambda v: v in VARIANTS
    )
    return models, stages, fractions, [v for v in VARIANTS if v in {"1f1b", "signal", *variants}]


def run_config(
    model: str, stages: int, fractions: list[float], variants: list[str], args, compute: ComputeMode, steps: int
) -> tuple[list[Measured], list[dict], str]:
    """Every variant at every fraction of one model and stage count (signal once: it sends 1 byte)."""
    device = compute.device or parse_compute("emulated", None).device
    measured, rows, network = [], [], ""
    signal = None
    for fraction in fractions:
        for variant in variants:
            if variant == "signal" and signal is not None:
                continue
            job = bench_job(model, variant, steps, args.quick, stages)
            config = Config(
                model,
                stages,
                fraction,
                nic_rate_for(bench_job(model, "1f1b", steps, args.quick, stages), device, fraction),
            )
            cost = cost_model(job, device, config.nic_bytes_per_s)
            # planned for the NICs it runs on: transfer order, receives posted ahead, W delay
            plan = build_plan(job, cost=cost, network=cost.network)
            m, network = run_variant(job, plan, config, variant, not args.no_netns, compute)
            measured.append(m)
            rows.append(row(job, plan, m, compute, predict(job, plan, m, config, compute, "namespaces" in network)))
            if variant == "signal":
                signal = rows[-1]
    assert signal is not None, "parse_sweep always runs signal"
    for r in rows:  # ratios at the same fraction; signal's is the same at every fraction
        base = next(b for b in rows if b["variant"] == "1f1b" and b["comm_fraction"] == r["comm_fraction"])
        r["vs_1f1b"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["vs_signal"] = r["tokens_per_s"] / signal["tokens_per_s"]
        bound = (r["step_bound"] or {}).get("step_s")
        # the most of signal any schedule of this plan reaches: both sides one step on the simulator's costs
        r["max_vs_signal"] = signal["predicted_one_step_s"] / bound if bound else None
        r["peak_stashed_vs_1f1b"] = [
            r["stages"][i]["peak_stashed"] / base["stages"][i]["peak_stashed"] for i in sorted(r["stages"])
        ]
    return measured, rows, network


def run_recompute(args, compute: ComputeMode, steps: int) -> tuple[list[dict], str]:
    """The recompute part: SECTION_MODEL at SECTION_STAGES on NICs at SECTION_COMM_FRACTION of compute (the rate
    set from 1f1b without recompute, kept for every run), every schedule with recompute none then full (one
    after the other: a drift of the machine's load hits both), then PRECISION_SCHEDULE without recompute in
    bf16. Every run counts the boundary bytes that landed. One row per run (section_row)."""
    device = compute.device or parse_compute("emulated", None).device
    model, stages, fraction = SECTION_MODEL, SECTION_STAGES, SECTION_COMM_FRACTION
    base = bench_job(model, "1f1b", steps, args.quick, stages)
    config = Config(model, stages, fraction, nic_rate_for(base, device, fraction))
    runs = [(s, r, "fp32") for s in SCHEDULES for r in ("none", "full")] + [(PRECISION_SCHEDULE, "none", "bf16")]
    rows: list[dict] = []
    network = ""
    for schedule, recompute, precision in runs:
        job = bench_job(model, schedule, steps, args.quick, stages, recompute, precision)
        cost = cost_model(job, device, config.nic_bytes_per_s)
        plan = build_plan(job, cost=cost, network=cost.network)
        m, network = run_variant(job, plan, config, schedule, not args.no_netns, compute, count_bytes=True)
        prediction = predict(job, plan, m, config, compute, "namespaces" in network)
        rows.append(section_row(job, plan, m, prediction))
        print(
            f"{schedule} recompute {recompute} {precision}: step {m.step_s * 1e3:.0f} ms, "
            f"{rows[-1]['bytes_per_step'] / 2**20:.1f} MiB landed per step"
        )
    return rows, network


def section_row(job: TrainingJob, plan, m: Measured, prediction: dict) -> dict:
    """One run of the recompute part: its schedule, recompute and precision, the measured step, the peak stashed
    microbatches per stage, the boundary bytes the ranks counted landing per step (every step moves the same:
    the run's total over its steps) and the plan's NIC bytes per step beside them."""
    t, steps = job.training, job.training.steps
    return {
        "schedule": m.variant,
        "recompute": t.recompute,
        "precision": t.precision,
        "nic_rate": m.config.nic_rate,
        "weight_delay": {str(s): d for s, d in sorted(plan.weight_delay.items())},
        "step_s": m.step_s,
        "tokens_per_s": m.tokens_per_s,
        "bubble": statistics.mean(s["bubble"] for s in m.stages.values()),
        "peak_stashed": [m.stages[i]["peak_stashed"] for i in sorted(m.stages)],
        "bytes_per_step": sum(m.bytes_received.values()) / steps,
        "cross_host_bytes_per_step": m.bytes_received.get(CROSS_HOST, 0) / steps,
        "planned_nic_bytes_per_step": sum(egress for egress, _ in plan.host_bytes_per_step().values()),
        "predicted_step_s": prediction["predicted_step_s"],
        "predicted_over_measured": prediction["predicted_over_measured"],
    }


def memory_activations(folder: str) -> dict[str, Any] | None:
    """`bench memory`'s per-schedule peak activations, recompute full over none (real compute), from
    memory.json in `folder`; None where there is none."""
    path = os.path.join(folder, "memory.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    pipeline, quick = data.get("pipeline") or {}, bool(data.get("quick"))
    ratios = {name: r["activations"] for name, r in (pipeline.get("ratios") or {}).items() if "activations" in r}
    model = pipeline.get("model") or {}
    return {
        "file": "memory.json",
        "quick": quick,
        "what": f"bench memory: {model.get('kind', '?')}, hidden {model.get('hidden', '?')}, "
        f"{pipeline.get('stages', '?')} stages each alone in one process, real compute; the busiest stage's peak",
        "activations_full_over_none": ratios,
    }


def merge_results(old: Mapping[str, Any], new: Mapping[str, Any], parts: Sequence[str]) -> dict[str, Any]:
    """pipeline.json after a run of `parts`: `new` (the keys the run wrote) over `old` (the file before it). A
    run of the sweep replaces every key but the other parts' (PART_KEYS); a run without it keeps old's."""
    others = {k for p in PARTS if p != "sweep" and p not in parts for k in PART_KEYS[p]}
    kept = {k: v for k, v in old.items() if "sweep" not in parts or k in others}
    section = {k for p in parts if p != "sweep" for k in PART_KEYS[p]}
    return {
        **{k: v for k, v in new.items() if k not in section},  # the sweep's keys first, as a full run writes them
        **kept,
        **{k: v for k, v in new.items() if k in section},
    }


def row(job: TrainingJob, plan, m: Measured, compute: ComputeMode, prediction: dict) -> dict:
    """One JSON row: the exact configuration, the measurement and the simulator's prediction."""
    st = m.stages
    out = {
        "model": m.config.model,
        "stages_count": m.config.stages,
        "variant": m.variant,
        "comm_fraction": m.config.comm_fraction,
        "nic_rate": m.config.nic_rate,
        "nic_bytes_per_s": m.config.nic_bytes_per_s,
        **compute.to_json(),
        "weight_delay": {str(s): d for s, d in sorted(plan.weight_delay.items())},
        "delay_choice": plan.delay_choice and plan.delay_choice.to_json(),  # auto: the candidates simulated
        "job": job_to_dict(job)["spec"],
        "step_s": m.step_s,
        "tokens_per_s": m.tokens_per_s,
        "bubble": statistics.mean(s["bubble"] for s in st.values()),
        "overlap": statistics.mean(s["overlap"] for s in st.values()),
        "stages": st,
        **prediction,
    }
    if not compute.emulated:
        out["final_loss"] = m.final_loss
    return out


# The emulated device's own check: one rank of one stage, no network, so a step is M x (F + B) + the optimizer
# step of waits plus the executor's own time between them (about fixed: ~25 ms a step on a slow shared machine).
# At 2 TFLOP/s each F waits ~0.12 s, long enough that this time is a few percent of the step.
EMULATED_CHECK_DEVICE = "2"
EMULATED_CHECK_STEPS = 4


def emulated_compute_job(microbatches: int = 4, samples: int = 2, steps: int = EMULATED_CHECK_STEPS) -> TrainingJob:
    """One stage of a 2-layer GPT on one device: the job of the emulated-compute check."""
    return parse_job(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "one-rank"},
            "spec": {
                "model": {"kind": "gpt", "layers": 2, "hidden": 1024, "heads": 8, "vocab": 512, "seqLen": 1024},
                "training": {
                    "steps": steps,
                    "globalBatch": samples * microbatches,
                    "microbatches": microbatches,
                    "learningRate": 1e-3,
                    "seed": 0,
                },
                "topology": {"devicesPerHost": 1},
                "stages": [{"layers": [0, 2], "mesh": [1, 1]}],
                "schedule": {"kind": "1f1b", "weightGradDelay": 0},
            },
        }
    )


def _emulated_compute_rank(
    job: TrainingJob, device: DeviceProfile, ctx: RankContext
) -> tuple[list[float], list[float]]:
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    from meshjob_trainer.train import train_rank

    result = train_rank(ctx.env, job, compute=ComputeMode("emulated", device))
    forwards = [end - start for name, start, end in result.stats.timeline if name.startswith("F")]
    return result.step_seconds, forwards


def emulated_compute_check() -> dict[str, Any]:
    """How long the emulated device's waits take against the modelled time, as measured/modelled ratios: the
    median timed step against M x (F + B) + the optimizer step, the median forward against F."""
    job, device = emulated_compute_job(), parse_device(EMULATED_CHECK_DEVICE)
    cost = emulated_cost(job, 0, device)
    result = launch(1, lambda ctx: _emulated_compute_rank(job, device, ctx), timeout_s=120)
    if not result.ok:
        raise RuntimeError(f"emulated compute: {result.first_failure.describe() if result.first_failure else 'failed'}")
    step_seconds, forwards = result.values[0]
    modelled_step_s = job.training.microbatches * (cost.stage.forward_s + cost.stage.backward_s) + cost.optimizer_s
    step_s, forward_s = statistics.median(step_seconds[1:]), statistics.median(forwards)
    return {
        "device": device.to_json(),
        "microbatches": job.training.microbatches,
        "timed_steps": len(step_seconds) - 1,
        "modelled_step_s": modelled_step_s,
        "measured_step_s": step_s,
        "step_over_modelled": step_s / modelled_step_s,
        "modelled_forward_s": cost.stage.forward_s,
        "measured_forward_s": forward_s,
        "forward_over_modelled": forward_s / cost.stage.forward_s,
        "note": "one rank, no network: the median timed step over M x (F + B) + the optimizer step and the "
        "median F over the modelled F; above 1 by the executor's own time between the waits (target: within 5%)",
    }


def nic_emulation(network: str) -> str:
    """How a run's network description says its NICs were emulated."""
    return "netns + tbf" if "namespaces" in network else "loopback, NOT rate-limited"


def run_record(args: argparse.Namespace, compute: ComputeMode, network: str, steps: int, t0: float) -> dict[str, Any]:
    """What every part of pipeline.json says of its run: compute, network and its emulation, machine, steps."""
    return {
        "compute": compute.to_json(),
        "network": network,
        "emulated": nic_emulation(network),
        "transport": transport_here(),
        "machine": machine(),
        "steps": steps,
        "timed_steps": steps - 1,
        "quick": bool(args.quick),
        "wall_seconds": time.monotonic() - t0,
    }


def sweep_part(args: argparse.Namespace, compute: ComputeMode, steps: int) -> dict[str, Any]:
    """The sweep: every model, stage count, fraction and variant; its table, targets and figures; its
    keys of pipeline.json."""
    models, stage_counts, fractions, variants = parse_sweep(args)
    measured: list[Measured] = []
    rows: list[dict] = []
    network = ""
    t0 = time.monotonic()
    for model in models:
        for stages in stage_counts:
            ms, rs, network = run_config(model, stages, fractions, variants, args, compute, steps)
            measured += ms
            rows += rs
    emulated = nic_emulation(network)
    subtitle = (
        f"compute {compute.describe()}, NICs {emulated}, M={MICROBATCHES}, {LAYERS_PER_STAGE} layers/stage, "
        f"hidden {SHAPES['quick' if args.quick else 'full']['hidden']}"
    )
    targets = check_targets(rows)
    print_table(rows, f"meshjob bench pipeline — {subtitle}")
    print_targets(targets)
    pngs = plot_timelines(measured, args.out, subtitle) + [plot_bars(rows, args.out, subtitle)]
    errors = [abs(r["predicted_over_measured"] - 1) for r in rows]
    check = emulated_compute_check() if compute.emulated else None
    if check is not None:
        print(
            f"emulated compute on one rank: step {check['step_over_modelled']:.3f} x modelled, "
            f"forward {check['forward_over_modelled']:.3f} x modelled"
        )
    print(
        f"sweep: {', '.join(pngs)}; simulator |predicted/measured - 1|: max {max(errors):.1%}, "
        f"median {statistics.median(errors):.1%}"
    )
    return {
        **run_record(args, compute, network, steps, t0),
        "rows": rows,
        "targets": targets,
        "plots": pngs,
        "simulator": {"max_abs_error": max(errors), "median_abs_error": statistics.median(errors)},
        "emulated_compute": check,
        "note": "throughput = global-batch tokens / the steady-state step period (over ranks, the median of "
        "each rank's mean timed step); vs_signal = fraction "
        "of the 1-byte-transfer bound; comm_fraction = the busiest NIC direction's bytes of one "
        "microbatch at nic_rate over a stage's F+I+W of one microbatch; predicted = meshjob.simulate.steady's "
        "period (the step run three times, as measured) of the plan that ran with the device's modelled "
        "costs (no constants fitted to the run); predicted_one_step_s: one isolated step, which "
        "step_bound bounds"
        + ("" if compute.emulated else "; real compute: the costs calibrated from the measured compute"),
    }


def recompute_part(args: argparse.Namespace, compute: ComputeMode, steps: int) -> dict[str, Any]:
    """The recompute part (run_recompute): its table and figure; its keys of pipeline.json (PART_KEYS)."""
    t0 = time.monotonic()
    rows, network = run_recompute(args, compute, steps)
    emulated = nic_emulation(network)
    shape = SHAPES["quick" if args.quick else "full"]
    common = {
        "model": SECTION_MODEL,
        "stages_count": SECTION_STAGES,
        "comm_fraction": SECTION_COMM_FRACTION,
        "nic_rate": rows[0]["nic_rate"],
        "hidden": shape["hidden"],
        "microbatches": MICROBATCHES,
        **run_record(args, compute, network, steps, t0),
    }
    recompute = {**common, **recompute_section(rows, memory_activations(args.out))}
    precision = {**common, **precision_section(rows, PRECISION_SCHEDULE)}
    subtitle = (
        f"{SECTION_MODEL}, {SECTION_STAGES} stages, hidden {shape['hidden']}, M={MICROBATCHES}, compute "
        f"{compute.describe()}, NICs {rows[0]['nic_rate']} ({emulated}, {SECTION_COMM_FRACTION:.0%} of compute)"
    )
    print_recompute(recompute, precision, f"meshjob bench pipeline: recompute — {subtitle}")
    plot = plot_recompute(recompute, precision, args.out, subtitle)
    recompute["plot"] = precision["plot"] = plot
    return {"recompute": recompute, "precision": precision}


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    args = parsed_arguments(args, "meshjob bench pipeline", __doc__, add_arguments)
    steps = args.steps or (2 if args.quick else 3)
    if steps < 2:
        raise SpecError([FieldError("--steps", steps, "at least 2 (the first step is not timed)")])
    compute = parse_compute(
        args.compute, args.device if args.device is not None or args.compute == "real" else DEFAULT_DEVICE
    )
    parts = _list(args.parts, ",".join(PARTS), str, "--parts", f"one of {', '.join(PARTS)}", lambda p: p in PARTS)
    if "sweep" in parts:
        parse_sweep(args)  # its flags checked before anything runs
    os.makedirs(args.out, exist_ok=True)
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    cleanup_stale()
    new: dict[str, Any] = {}
    if "sweep" in parts:
        new.update(sweep_part(args, compute, steps))
    if "recompute" in parts:
        new.update(recompute_part(args, compute, steps))
    path = os.path.join(args.out, "pipeline.json")
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = {}
    with open(path, "w") as f:
        json.dump(merge_results(old, new, parts), f, indent=2)
    kept = sorted(set(old) - set(new)) if "sweep" not in parts else []
    print(f"wrote {path}" + (f" (kept its other keys: {', '.join(kept)})" if kept else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
