"""`meshjob bench tune`, part 4 (`--parts hand`): the tuned plan against about 20 hand-written plans in simulated
step time, on the paper's GPT and U-Transformer shapes (bench e2e's: 16 layers, hidden 1024, 16 heads, sequence 512,
vocabulary 8192) at 8 and 64 hosts of 2 devices (global batch 32 at 8 hosts, 4 samples per host beyond), H100s
with 100 Gbit/s NICs (a cloud cluster) and with 1 Gbit/s NICs (the emulated cluster's, the paper's setting: there
compute is a hundredth of the transfers, and the best plans use few hosts).

Hand-written (`hand_written`): Megatron's usual plan, 1F1B with tensor parallelism inside a host and data
parallelism across the hosts of a stage, on the whole cluster and on 1, 2, 4, ... of its hosts, for every
pipeline depth S that divides those hosts and the layers and M in {S, 2S, 4S}; the same under eager-1F1B with
`weightGradDelay: auto`; the README's examples (examples/gpt-demo.yaml, examples/utransformer-demo.yaml, their cuts
scaled to the model); one layer per device (1F1B). The search may also fold the pipeline (spec.topology.stageOrder
fold: stage k beside stage S-1-k, so a U-Transformer's skip edges stay on a host); the hand-written plans keep the
default chain order.
Every plan, the tuned one included, is predicted by one model: meshjob.search.job_step on the same cluster (what
`meshjob simulate` says of a manifest with spec.tunedFor). Reported per case: the tuned step, the best hand-written
step and its name, best hand / tuned (target: >= 1, >= 1.2 on the U-Transformer), the search's optimality gap and
its time (the 64 x 8, 96-layer time is part 2's).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from meshjob.errors import PlacementError, SpecError
from meshjob.search.algorithm import Problem, default_space, search
from meshjob.search.cluster import Cluster
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.job_step import job_step
from meshjob.search.settings import Settings
from meshjob.spec.api import API_VERSION, KIND
from meshjob.spec.manifest import parse_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = {"gpt": "examples/gpt-demo.yaml", "utransformer": "examples/utransformer-demo.yaml"}
MODELS = ("gpt", "utransformer")
HOSTS = (8, 64)
DEVICES_PER_HOST = 2
LAYERS = 16
NIC_RATES = ("100gbit", "1gbit")  # a cloud cluster's; the emulated cluster's, the paper's setting
DEVICE = "h100"


def model_doc(model: str, hosts: int) -> dict[str, Any]:
    """The manifest every plan of the case shares (no stages: the search's input)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": f"hand-{model}-{hosts}"},
        "spec": {
            "model": {"kind": model, "layers": LAYERS, "hidden": 1024, "heads": 16, "vocab": 8192, "seqLen": 512},
            "training": {"globalBatch": max(32, 4 * hosts), "learningRate": 1e-4},
            "topology": {"devicesPerHost": DEVICES_PER_HOST},
        },
    }


def _plan(doc: Mapping[str, Any], stages: list[dict[str, Any]], m: int, schedule: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    spec = out["spec"]
    spec["stages"] = stages
    spec["training"]["microbatches"] = m
    spec["schedule"] = schedule
    spec["resharding"] = {"strategy": "broadcast", "chunks": "auto", "balancer": "greedy"}
    return out


def megatron_stages(hosts: int, per_host: int, depth: int) -> list[dict[str, Any]]:
    """`depth` stages of equal layers, each on hosts / depth whole hosts (of the first `hosts`): TP inside a
    host, DP across them."""
    per, rows = LAYERS // depth, hosts // depth
    stage: dict[str, Any] = {"mesh": [rows, per_host]}
    if per_host > 1:
        stage["tensorParallelDim"] = 1
    if rows > 1:
        stage["dataParallelDim"] = 0
    return [{**stage, "layers": [per * i, per * (i + 1)]} for i in range(depth)]


def hand_written(model: str, hosts: int) -> dict[str, dict[str, Any]]:
    """The hand-written plans of one case, by name."""
    doc = model_doc(model, hosts)
    batch = doc["spec"]["training"]["globalBatch"]
    out: dict[str, dict[str, Any]] = {}
    for used in sorted({1 << k for k in range(hosts.bit_length()) if hosts % (1 << k) == 0} | {hosts}):
        on = "" if used == hosts else f" on {used} hosts"
        for depth in (d for d in (1, 2, 4, 8, 16) if used % d == 0 and LAYERS % d == 0):
            stages = megatron_stages(used, DEVICES_PER_HOST, depth)
            dp = stages[0]["mesh"][0]
            for m in sorted({depth, 2 * depth, 4 * depth}):
                if batch % m or (batch // m) % dp:
                    continue
                one_f = {"kind": "1f1b", "weightGradDelay": 0}
                out[f"megatron-1f1b S={depth} M={m}{on}"] = _plan(doc, stages, m, one_f)
                if depth > 1:
                    eager = {"kind": "eager-1f1b", "weightGradDelay": "auto"}
                    out[f"megatron-eager S={depth} M={m}{on}"] = _plan(doc, stages, m, eager)
    with open(os.path.join(REPO, EXAMPLES[model])) as f:
        example = yaml.safe_load(f)["spec"]
    from meshjob_bench.tune_measure import scale_layers

    ex_stages = scale_layers(example["stages"], example["model"]["layers"], LAYERS)
    out["readme example"] = _plan(doc, ex_stages, example["training"]["microbatches"], dict(example["schedule"]))
    devices = hosts * DEVICES_PER_HOST
    if devices <= LAYERS:
        per = LAYERS // devices
        chain = [{"layers": [per * i, per * (i + 1)], "mesh": [1, 1]} for i in range(devices)]
        out["one layer per device, 1f1b"] = _plan(doc, chain, devices, {"kind": "1f1b", "weightGradDelay": 0})
    return out


def predicted(doc: Mapping[str, Any], cluster: Cluster, settings: Settings) -> float | None:
    """The one model's step of a written plan on the case's cluster; None when it cannot be placed or is invalid."""
    spec = {**doc["spec"], "tunedFor": settings.to_spec()}
    try:
        return job_step(parse_job({**doc, "spec": spec}), cluster).step_s
    except (PlacementError, SpecError):
        return None


def run_case(model: str, hosts: int, nic_rate: str) -> dict[str, Any]:
    settings = Settings(hosts, nic_rate, DEVICE)
    cluster = settings.cluster(DEVICES_PER_HOST)
    doc = model_doc(model, hosts)
    fixed = read_fixed(doc)
    job = base_job(doc, DEVICES_PER_HOST)
    problem = Problem(doc, job, cluster, fixed, default_space(job, fixed, cluster), settings)
    t0 = time.perf_counter()
    result = search(problem)
    seconds = time.perf_counter() - t0
    tuned = result.best.step_s
    written = problem.manifest(result.best.candidate)
    assert predicted(written, cluster, settings) == tuned  # one model: the search's prediction is simulate's
    hand = {name: predicted(d, cluster, settings) for name, d in hand_written(model, hosts).items()}
    valid = {k: v for k, v in hand.items() if v is not None}
    best_name = min(valid, key=lambda k: valid[k])
    return {
        "model": model,
        "hosts": hosts,
        "devices_per_host": DEVICES_PER_HOST,
        "nic_rate": nic_rate,
        "device": DEVICE,
        "tuned_step_s": tuned,
        "tuned": result.best.candidate.label(),
        "proven": result.proven,
        "optimality_gap": result.gap,
        "search_seconds": seconds,
        "evaluated": result.evaluated,
        "hand_written": hand,
        "best_hand_written": best_name,
        "best_hand_written_step_s": valid[best_name],
        "hand_over_tuned": valid[best_name] / tuned,
    }


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    never_worse = all(r["hand_over_tuned"] >= 1 - 1e-9 for r in rows)
    u = [r["hand_over_tuned"] for r in rows if r["model"] == "utransformer"]
    return {"never_worse": never_worse, "utransformer_at_least_1_2x": bool(u) and min(u) >= 1.2}


def run(
    models: tuple[str, ...] = MODELS, hosts: tuple[int, ...] = HOSTS, nic_rates: tuple[str, ...] = NIC_RATES
) -> dict[str, Any]:
    rows = [run_case(m, h, r) for r in nic_rates for m in models for h in hosts]
    return {"cases": rows, "targets": targets(rows)}


def print_table(part: Mapping[str, Any]) -> None:
    con = Console(width=160)
    t = Table(
        "NIC",
        "model",
        "hosts",
        "tuned ms",
        "best hand ms",
        "best hand-written",
        "hand / tuned",
        "gap",
        "search s",
        title=f"tuned vs hand-written plans (simulated step, {DEVICE})",
    )
    for r in part["cases"]:
        t.add_row(
            r["nic_rate"],
            r["model"],
            f"{r['hosts']}x{r['devices_per_host']}",
            f"{r['tuned_step_s'] * 1e3:.2f}",
            f"{r['best_hand_written_step_s'] * 1e3:.2f}",
            r["best_hand_written"],
            f"{r['hand_over_tuned']:.2f}",
            "proven" if r["proven"] else f"{r['optimality_gap']:.1%}",
            f"{r['search_seconds']:.1f}",
        )
    con.print(t)
    tg = part["targets"]
    con.print(
        f"targets: never worse than the best hand-written plan: {'met' if tg['never_worse'] else 'MISSED'}; "
        f">= 1.2x on the U-Transformer: {'met' if tg['utransformer_at_least_1_2x'] else 'MISSED'}"
    )
