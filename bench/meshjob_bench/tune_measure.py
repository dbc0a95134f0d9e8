"""`meshjob bench tune`, part 3: the tuned manifest against hand-written ones, measured on the emulated
cluster with emulated device compute (issue 14's third target).

For each model (a GPT and a U-Transformer; 8 layers, hidden 1024, sequence 512, vocabulary 8192, global
batch 16) on `--measure-hosts` x `--measure-devices-per-host` emulated hosts (default 4 x 2, NIC 1gbit,
tbf burst 128kb) with emulated devices of `--measure-device` (default 1 TFLOP/s: one sample's activation
crosses a 1gbit NIC in about 0.6 of a layer's forward on it):
  tuned           meshjob.search.algorithm on a cluster model of that emulated cluster (its hosts, devices per host,
                  NIC rate and tbf bucket, the emulated device's profile), as `meshjob tune` runs it
  example         the repository's example for the model (examples/gpt-demo.yaml,
                  examples/utransformer-demo.yaml): its stage cuts, meshes, parallel dims, microbatches,
                  schedule and resharding, on this model and these hosts
  pipeline-1f1b   one layer per device (8 stages of a 1x1 mesh), 1F1B, a microbatch per sample
  data-parallel   one stage on every device: data parallel across hosts, tensor parallel inside them
Each runs `--steps` steps (the first not timed) through bench e2e's gang launch (meshjob_bench.e2e.run:
the real executors, tensors of the real sizes over tbf-shaped NICs, compute as waits); the measured step
is the median over timed steps of the slowest rank's step. The prediction is the simulator's for the same
plan (the emulated device's costs, the NICs' rate and tbf bucket, as bench e2e predicts) plus what the
simulator's pipeline leaves out and an emulated step does: each stage's tail (meshjob.search.gradient_sync: its
gradient all-reduce, sharing NICs with other stages' on the same hosts, then its optimizer step). Every row
also records the search's own objective for its manifest (meshjob.search.algorithm's predict on the search's cluster
model: what `meshjob tune` prints), measured against the same step.
The search's cluster model is the prediction's (the same NICs, intra-host rate and device) with the device's
own link NVLink-fast: emulated compute runs no tensor-parallel all-reduces (a stage's forward is one wait), so
the search must not charge those inside a host, while the gradient rings inside a host and the local
resharding hops do run, at the intra-host rate.
Targets: the tuned manifest's measured throughput >= the best hand-written one's, and every prediction
(the bench's and the search's) within 10% of its measurement.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import ComputeMode, DeviceProfile, parse_compute
from meshjob.errors import UsageError
from meshjob.network.model import NetworkModel
from meshjob.plan.build import build_plan
from meshjob.search.algorithm import Candidate, Problem, default_space, search
from meshjob.search.cluster import Cluster, GiB, TuneDevice
from meshjob.search.gradient_sync import stage_hosts, tail_ends
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.stage_model import job_figures
from meshjob.simulate.simulator import CostModel, simulate_plan
from meshjob.spec.api import API_VERSION, KIND
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job
from meshjob.units import parse_rate
from meshjob_bench import e2e
from meshjob_bench.pipeline import TBF_BURST_BYTES
from meshjob_trainer.emulate.netns import cleanup_stale

MODELS = ("gpt", "utransformer")
EXAMPLES = {"gpt": "examples/gpt-demo.yaml", "utransformer": "examples/utransformer-demo.yaml"}
HAND_WRITTEN = ("example", "pipeline-1f1b", "data-parallel")
CONFIGS = ("tuned",) + HAND_WRITTEN
NVLINK_BYTES_PER_S = 450e9  # the emulated device's own link as the search sees it (see above)
EMULATED_MEMORY_BYTES = 80 * GiB
PREDICTION_TOLERANCE = 0.10
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Setting:
    """The emulated cluster and the model size of one measurement."""

    hosts: int = 4
    devices_per_host: int = 2
    nic_rate: str = "1gbit"
    device: str = "1"  # a100, h100 or TFLOP/s (meshjob.costs.devices.parse_device)
    steps: int = 5
    quick: bool = False

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Setting()
    parser.add_argument("--measure-hosts", type=int, default=d.hosts, help=f"emulated hosts (default {d.hosts})")
    parser.add_argument(
        "--measure-devices-per-host",
        type=int,
        default=d.devices_per_host,
        help=f"devices per emulated host (default {d.devices_per_host})",
    )
    parser.add_argument("--measure-nic-rate", default=d.nic_rate, help=f"emulated NIC (default {d.nic_rate})")
    parser.add_argument(
        "--measure-device", default=d.device, help=f"emulated device: a100, h100 or TFLOP/s (default {d.device})"
    )
    parser.add_argument(
        "--measure-steps", type=int, default=None, help="steps per run, the first not timed (default 5, quick 2)"
    )
    parser.add_argument(
        "--measure-models", default=",".join(MODELS), help="comma separated (default gpt,utransformer; quick: gpt)"
    )


def setting_from_args(args: argparse.Namespace) -> Setting:
    steps = args.measure_steps or (2 if args.quick else 5)
    if steps < 2:
        raise UsageError(f"--measure-steps: {steps} is invalid: at least 2 (the first step is not timed)")
    for flag, value in (
        ("--measure-hosts", args.measure_hosts),
        ("--measure-devices-per-host", args.measure_devices_per_host),
    ):
        if value < 1:
            raise UsageError(f"{flag}: {value} is invalid: a positive integer")
    try:
        parse_rate(args.measure_nic_rate, "--measure-nic-rate")
    except ValueError as err:
        raise UsageError(str(err)) from None
    parse_compute("emulated", args.measure_device, "--measure-device")
    return Setting(
        args.measure_hosts,
        args.measure_devices_per_host,
        args.measure_nic_rate,
        args.measure_device,
        steps,
        bool(args.quick),
    )


def models_from_args(args: argparse.Namespace) -> list[str]:
    models = [m for m in args.measure_models.split(",") if m]
    if not models or set(models) - set(MODELS):
        raise UsageError(
            f"--measure-models: {args.measure_models!r} is invalid: comma separated, from {', '.join(MODELS)}"
        )
    return models[:1] if args.quick else models


# ------------------------------------------------------------------------------ the jobs
def model_doc(model: str, setting: Setting) -> dict[str, Any]:
    """The manifest every configuration of `model` shares; no stages (the search's input)."""
    hidden, seq, vocab, heads = (128, 64, 256, 4) if setting.quick else (1024, 512, 8192, 16)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": f"tune-{model}"},
        "spec": {
            "model": {"kind": model, "layers": 8, "hidden": hidden, "heads": heads, "vocab": vocab, "seqLen": seq},
            "training": {"steps": setting.steps, "globalBatch": 16, "learningRate": 1e-4, "seed": 0},
            "topology": {"devicesPerHost": setting.devices_per_host},
        },
    }


def _with(
    doc: Mapping[str, Any],
    name: str,
    stages: list[dict[str, Any]],
    microbatches: int,
    schedule: Mapping[str, Any],
    resharding: Mapping[str, Any],
) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    out["metadata"] = {"name": f"{doc['metadata']['name']}-{name}"}
    spec = out["spec"]
    spec["stages"] = stages
    spec["training"]["microbatches"] = microbatches
    spec["schedule"] = dict(schedule)
    spec["resharding"] = dict(resharding)
    return out


def scale_layers(stages: list[Mapping[str, Any]], from_layers: int, to_layers: int) -> list[dict[str, Any]]:
    """An example's stages with their layer cuts moved to a model of `to_layers` layers (cuts scale in
    proportion; each stage keeps at least one layer)."""
    if to_layers < len(stages):
        raise ValueError(f"layers {to_layers} is invalid: at least the example's {len(stages)} stages")
    cuts = [round(s["layers"][1] * to_layers / from_layers) for s in stages]
    out, start = [], 0
    for i, (stage, cut) in enumerate(zip(stages, cuts)):
        end = to_layers if i == len(stages) - 1 else max(start + 1, min(cut, to_layers - (len(stages) - 1 - i)))
        out.append({**{k: copy.deepcopy(v) for k, v in stage.items()}, "layers": [start, end]})
        start = end
    return out


def example_doc(doc: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, Any]:
    """`doc`'s model and batch with the example's stage cuts, meshes, parallel dims, microbatches, schedule
    and resharding (its explicit edges dropped: they are the defaults for its layouts)."""
    spec = example["spec"]
    stages = scale_layers(spec["stages"], spec["model"]["layers"], doc["spec"]["model"]["layers"])
    resharding = {k: v for k, v in (spec.get("resharding") or {}).items() if k != "budgetSeconds"}
    return _with(doc, "example", stages, spec["training"]["microbatches"], spec.get("schedule") or {}, resharding)


def hand_written(
    doc: Mapping[str, Any], model: str, setting: Setting, load: Callable[[str], Mapping[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """The hand-written configurations of `doc` on the setting's hosts, by name (HAND_WRITTEN)."""
    load = load or _load_example
    layers = doc["spec"]["model"]["layers"]
    batch = doc["spec"]["training"]["globalBatch"]
    devices = setting.devices
    if layers % devices:
        raise ValueError(f"layers {layers} is invalid for pipeline-1f1b: a multiple of the {devices} devices")
    per = layers // devices
    chain = [{"layers": [per * i, per * (i + 1)], "mesh": [1, 1]} for i in range(devices)]
    broadcast = {"strategy": "broadcast", "chunks": "auto", "balancer": "greedy"}
    one_stage = [
        {
            "layers": [0, layers],
            "mesh": [setting.hosts, setting.devices_per_host],
            "dataParallelDim": 0,
            **({"tensorParallelDim": 1} if setting.devices_per_host > 1 else {}),
        }
    ]
    return {
        "example": example_doc(doc, load(EXAMPLES[model])),
        "pipeline-1f1b": _with(doc, "pipeline-1f1b", chain, batch, {"kind": "1f1b", "weightGradDelay": 0}, broadcast),
        "data-parallel": _with(doc, "data-parallel", one_stage, 1, {"kind": "1f1b", "weightGradDelay": 0}, broadcast),
    }


def _load_example(path: str) -> Mapping[str, Any]:
    with open(os.path.join(REPO, path)) as f:
        return yaml.safe_load(f)


# ------------------------------------------------------------------------------ the cluster model
def emulated_device(setting: Setting) -> DeviceProfile:
    device = parse_compute("emulated", setting.device, "--measure-device").device
    assert device is not None
    return device


def prediction_network(setting: Setting) -> NetworkModel:
    """The emulated NICs as this bench predicts them and the search plans on them: the tbf rate and bucket,
    the default intra-host rate (bench e2e's model also charges TCP's payload share and the shared cores' CPU
    per message; this one does not)."""
    return NetworkModel(nic_bytes_per_s=parse_rate(setting.nic_rate), burst_bytes=TBF_BURST_BYTES)


def prediction_cluster(setting: Setting) -> Cluster:
    """The emulated cluster as the prediction sees it: the prediction network, the emulated device."""
    network = prediction_network(setting)
    return Cluster(
        setting.hosts,
        setting.devices_per_host,
        TuneDevice(emulated_device(setting), EMULATED_MEMORY_BYTES, network.intra_host_bytes_per_s),
        network,
    )


def search_cluster(setting: Setting) -> Cluster:
    """What meshjob.search.algorithm plans on: the emulated hosts, NICs and device as the prediction sees them, the
    device's own link NVLink-fast (see above)."""
    c = prediction_cluster(setting)
    return replace(c, device=replace(c.device, link_bytes_per_s=NVLINK_BYTES_PER_S))


def tune(doc: Mapping[str, Any], setting: Setting) -> tuple[dict[str, Any], Any]:
    """The search's manifest for `doc` on the setting's cluster, and the search's result."""
    cluster = search_cluster(setting)
    fixed = read_fixed(doc)
    job = base_job(doc, cluster.devices_per_host)
    problem = Problem(doc, job, cluster, fixed, default_space(job, fixed, cluster))
    result = search(problem)
    manifest = problem.manifest(result.best.candidate)
    manifest["metadata"] = {"name": f"{doc['metadata']['name']}-tuned"}
    return manifest, result


# ------------------------------------------------------------------------------ prediction
def stage_tail_s(job: TrainingJob, stage: int, setting: Setting) -> float:
    """What an emulated step adds after a stage's last action when no other stage shares its NICs: its
    gradient all-reduce (meshjob.search.gradient_sync's ring model on the prediction network) and its optimizer
    step (the emulated device's wait)."""
    return job_figures(job, prediction_cluster(setting))[stage].tail_s


def planned(job: TrainingJob, setting: Setting):
    """(plan, costs): the plan the ranks run and the simulator predicts, made with the emulated devices'
    costs on the emulated cluster (so its W delay and transfer order are those of the run)."""
    network = prediction_network(setting)
    cost = CostModel(network=network, stages=emulated_costs(job, emulated_device(setting)), measured=True)
    return build_plan(job, nic_bytes_per_s=network.nic_bytes_per_s, cost=cost), cost


def predicted_step_s(job: TrainingJob, setting: Setting, plan_and_cost=None) -> float:
    """The simulator's step for the job's plan on the emulated cluster: every stage's last action, then its
    tail (meshjob.search.gradient_sync: stages on the same hosts share their NICs); the last tail's end. The plan is
    `planned(job, setting)` unless given."""
    plan, cost = plan_and_cost or planned(job, setting)
    result = simulate_plan(plan, cost)
    syncs = [f.sync for f in job_figures(job, prediction_cluster(setting))]
    return max(
        tail_ends([result.stages[k].busy_until_s for k in range(len(syncs))], syncs, stage_hosts(plan.placement))
    )


def search_step_s(doc: Mapping[str, Any], setting: Setting) -> float:
    """The search's own objective (what `meshjob tune` prints as the predicted step) for a written manifest,
    on the cluster model the search plans on."""
    cluster = search_cluster(setting)
    fixed = read_fixed(doc)
    job = base_job(doc, cluster.devices_per_host)
    problem = Problem(doc, job, cluster, fixed, default_space(job, fixed, cluster))
    written = parse_job(doc)
    meshes = tuple(f.choice for f in fixed.per_stage if f.choice is not None)
    if not fixed.per_stage or len(meshes) != len(fixed.per_stage):
        raise ValueError(f"{doc['metadata']['name']}: a written manifest, every stage's mesh given")
    candidate = Candidate(
        written.training.microbatches,
        written.schedule.kind,
        str(written.schedule.weight_grad_delay),
        tuple(b - a for a, b in (s.layers for s in written.stages)),
        meshes,
        written.resharding.strategy,
        written.resharding.balancer,
    )
    prediction = problem.predict(candidate)
    if prediction is None:
        raise RuntimeError(f"{doc['metadata']['name']}: the search cannot place its stages on {cluster.hosts} hosts")
    return prediction.step_s


# ------------------------------------------------------------------------------ rows and targets
@dataclass
class Row:
    model: str
    config: str
    plan: str  # stages, meshes, microbatches, schedule, resharding
    hosts_used: int
    predicted_step_s: float
    measured_step_s: float
    predicted_over_measured: float
    tokens_per_s: float
    over_best_hand_written: float = 0.0  # this config's throughput / the best hand-written one's
    search_step_s: float = 0.0  # the search's own objective (meshjob.search.algorithm's predict) for the same manifest
    search_over_measured: float = 0.0


def describe(job: TrainingJob) -> str:
    stages = " | ".join(
        f"{a}-{b} {'x'.join(map(str, s.mesh))} dp{s.data_parallel} tp{s.tensor_parallel}"
        for s in job.stages
        for a, b in [s.layers]
    )
    return (
        f"{len(job.stages)} stages [{stages}], M={job.training.microbatches}, {job.schedule.kind} delay "
        f"{job.schedule.weight_grad_delay}, {job.resharding.strategy}/{job.resharding.balancer}"
    )


def hosts_used(job: TrainingJob) -> int:
    placement = build_plan(job).placement
    return len({placement.host_of(r) for r in range(placement.world_size)})


def rank_rows(rows: list[Row]) -> None:
    """Fill over_best_hand_written per model."""
    for model in {r.model for r in rows}:
        mine = [r for r in rows if r.model == model]
        best = max((r.tokens_per_s for r in mine if r.config in HAND_WRITTEN), default=0.0)
        for r in mine:
            r.over_best_hand_written = r.tokens_per_s / best if best > 0 else 0.0


def _within(errors: Mapping[str, float]) -> dict[str, Any]:
    worst = max(errors, key=lambda k: abs(errors[k])) if errors else None
    return {
        "worst": {"run": worst, "error": errors[worst] if worst else None},
        "count": f"{sum(abs(e) <= PREDICTION_TOLERANCE for e in errors.values())} of {len(errors)}",
        "all": bool(errors) and all(abs(e) <= PREDICTION_TOLERANCE for e in errors.values()),
    }


def targets(rows: list[Row]) -> dict[str, Any]:
    """The throughput target, and the 10% target for the bench's prediction and for the search's objective."""
    tuned = {r.model: r.over_best_hand_written for r in rows if r.config == "tuned"}
    bench = _within({f"{r.model}/{r.config}": r.predicted_over_measured - 1 for r in rows})
    search = _within({f"{r.model}/{r.config}": r.search_over_measured - 1 for r in rows})
    return {
        "tuned_over_best_hand_written": tuned,
        "tuned_at_least_best_hand_written": bool(tuned) and all(v >= 1.0 for v in tuned.values()),
        "worst_prediction_error": bench["worst"],
        "predictions_within_10_percent": bench["count"],
        "prediction_within_10_percent": bench["all"],
        "worst_search_prediction_error": search["worst"],
        "search_predictions_within_10_percent": search["count"],
        "search_prediction_within_10_percent": search["all"],
    }


# ------------------------------------------------------------------------------ running
def configurations(model: str, setting: Setting) -> tuple[dict[str, dict[str, Any]], Any]:
    doc = model_doc(model, setting)
    tuned_doc, result = tune(doc, setting)
    return {"tuned": tuned_doc, **hand_written(doc, model, setting)}, result


def measure(models: list[str], setting: Setting, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every configuration of every model; the JSON part `measured` of tune.json."""
    import torch  # noqa: F401 - imported once here, so forked ranks start without importing it

    compute = ComputeMode("emulated", emulated_device(setting))
    cleanup_stale()
    t0 = time.monotonic()
    rows: list[Row] = []
    jobs: dict[str, Any] = {}
    network = ""
    for model in models:
        docs, result = configurations(model, setting)
        for config, doc in docs.items():
            job = parse_job(doc)
            used = hosts_used(job)
            if used > setting.hosts:
                raise RuntimeError(f"{model}/{config}: needs {used} hosts, the setting has {setting.hosts}")
            log(f"{model}/{config}: {describe(job)}")
            plan_and_cost = planned(job, setting)  # the ranks run the plan the prediction simulates
            step_s, network = e2e.run(job, setting.nic_rate, compute, plan=plan_and_cost[0])
            predicted = predicted_step_s(job, setting, plan_and_cost)
            searched = result.best.step_s if config == "tuned" else search_step_s(doc, setting)
            tokens = job.training.global_batch * job.model.seq_len
            rows.append(
                Row(
                    model,
                    config,
                    describe(job),
                    used,
                    predicted,
                    step_s,
                    predicted / step_s,
                    tokens / step_s,
                    search_step_s=searched,
                    search_over_measured=searched / step_s,
                )
            )
            jobs[f"{model}/{config}"] = job_to_dict(job)
    rank_rows(rows)
    return {
        "setting": asdict(setting),
        "network": network,
        **compute.to_json(),
        "timed_steps": setting.steps - 1,
        "wall_seconds": time.monotonic() - t0,
        "load_average_1m_at_end": os.getloadavg()[0],
        "rows": [asdict(r) for r in rows],
        "jobs": jobs,
        "targets": targets(rows),
    }


def print_table(part: Mapping[str, Any]) -> None:
    s = part["setting"]
    t = Table(
        "model",
        "config",
        "predicted ms",
        "measured ms",
        "predicted / measured",
        "search / measured",
        "tokens/s",
        "over best hand-written",
        "plan",
        title=f"tuned vs hand-written, measured: {s['hosts']} hosts x {s['devices_per_host']}, NIC "
        f"{s['nic_rate']} (tbf burst 128kb), emulated device {part['device']['name']}, "
        f"{part['timed_steps']} timed steps",
    )
    for r in part["rows"]:
        t.add_row(
            r["model"],
            r["config"],
            f"{r['predicted_step_s'] * 1e3:.0f}",
            f"{r['measured_step_s'] * 1e3:.0f}",
            f"{r['predicted_over_measured']:.2f}",
            f"{r['search_over_measured']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['over_best_hand_written']:.2f}",
            r["plan"],
        )
    con = Console(width=200)
    con.print(t)
    g = part["targets"]
    ratios = ", ".join(f"{m} {v:.2f}x" for m, v in g["tuned_over_best_hand_written"].items())
    con.print(
        f"target 3a: tuned measured throughput >= best hand-written: {ratios} -> "
        f"{'met' if g['tuned_at_least_best_hand_written'] else 'MISSED'}"
    )
    w = g["worst_prediction_error"]
    con.print(
        f"target 3b: prediction within 10% of measurement: {g['predictions_within_10_percent']} "
        f"(worst {w['run']}: {w['error']:+.1%}) -> {'met' if g['prediction_within_10_percent'] else 'MISSED'}"
    )
    w = g["worst_search_prediction_error"]
    con.print(
        f"           the search's own objective: {g['search_predictions_within_10_percent']} "
        f"(worst {w['run']}: {w['error']:+.1%}) -> {'met' if g['search_prediction_within_10_percent'] else 'MISSED'}"
    )


def plot(part: Mapping[str, Any], path: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = part["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {m: k for m, k in zip(MODELS, "os")}
    for r in rows:  # colour: the configuration (as in the bars), marker: the model
        left.scatter(
            r["measured_step_s"],
            r["predicted_step_s"],
            marker=markers.get(r["model"], "o"),
            color=f"C{CONFIGS.index(r['config'])}",
            label=f"{r['model']}/{r['config']}",
            alpha=0.8,
        )
        if r.get("search_step_s"):  # hollow: the search's own objective for the same manifest
            left.scatter(
                r["measured_step_s"],
                r["search_step_s"],
                marker=markers.get(r["model"], "o"),
                facecolors="none",
                edgecolors=f"C{CONFIGS.index(r['config'])}",
                s=70,
            )
    values = [
        v
        for r in rows
        for v in (r["measured_step_s"], r["predicted_step_s"], r.get("search_step_s") or r["predicted_step_s"])
    ]
    lo, hi = min(values) / 1.2, max(values) * 1.2
    left.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="equal")
    left.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2, label="±10%")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("measured step (s)")
    left.set_ylabel("predicted step (s)")
    left.set_title("bench prediction (filled), search objective (hollow) vs emulated cluster", fontsize=9)
    left.legend(fontsize=7)
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    width = 0.8 / len(CONFIGS)
    for j, config in enumerate(CONFIGS):
        vals = [
            next((r["over_best_hand_written"] for r in rows if r["model"] == m and r["config"] == config), 0.0)
            for m in models
        ]
        bars = right.bar([i + j * width for i in range(len(models))], vals, width, label=config, color=f"C{j}")
        right.bar_label(bars, fmt="%.2f", fontsize=7)
    right.set_xticks([i + width * (len(CONFIGS) - 1) / 2 for i in range(len(models))], models)
    right.set_ylabel("measured throughput / best hand-written")
    right.legend(fontsize=8)
    s = part["setting"]
    right.set_title(
        f"{s['hosts']}x{s['devices_per_host']} hosts, NIC {s['nic_rate']}, device {part['device']['name']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
