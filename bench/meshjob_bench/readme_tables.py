"""The results tables of README.md and bench/README.md, generated from bench/results/*.json.

Every cell comes from a JSON a `meshjob bench` command wrote; no figure is typed by hand. Each table sits between
`<!-- NAME: begin -->` and `<!-- NAME: end -->` in its file. `python -m meshjob_bench.readme_tables` prints the
tables, `--write` puts them in the files; tests/test_readme_tables.py fails when a committed file differs.
Reads JSON only: no torch, nothing of the trainer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from meshjob_bench.pipeline_report import RECOMPUTE_HEADER, precision_line, recompute_table_rows

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"one_to_many": "one-to-many", "many_to_many": "many-to-many", "paper_scale": "paper scale"}
# summary key -> the name the tables print; the headline shows the first four
VARIANTS = {
    "broadcast K=auto greedy": "broadcast K=auto",
    "global_allgather": "global all-gather (Alpa's)",
    "alpa default": "Alpa's default (send/recv to host-sharded, all-gather in host)",
    "send_recv": "send/recv",
    "local_allgather": "local all-gather",
    "broadcast K=4 greedy": "broadcast K=4",
    "broadcast K=16 greedy": "broadcast K=16",
    "broadcast K=64 greedy": "broadcast K=64",
    "signal": "signal (1 byte: the bound)",
}
MODELS = {"gpt": "GPT", "utransformer": "U-Transformer"}
Table = Callable[[Path], str]


def load(results: Path, name: str) -> dict[str, Any]:
    """One benchmark's JSON."""
    data: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    return data


def rate(text: str) -> str:
    """A tc rate ("615807kbit", "1gbit") in mbit or gbit, as a reader compares them."""
    match = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", text.strip().lower())
    if match is None:
        return text
    bits = float(match.group(1)) * {"": 1e0, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return f"{bits / 1e9:g} gbit" if bits >= 1e9 and bits % 1e8 == 0 else f"{bits / 1e6:.0f} mbit"


def rates(texts: Sequence[str]) -> str:
    """Several tc rates, their unit said once where they share it: "616 / 205 / 62 mbit"."""
    shown = [rate(text).split(" ") for text in texts]
    if all(len(s) == 2 and s[1] == shown[0][1] for s in shown):
        return " / ".join(s[0] for s in shown) + " " + shown[0][1]
    return " / ".join(" ".join(s) for s in shown)


def emulation(data: dict[str, Any]) -> str:
    """How the run emulated its NICs: tc tbf and its burst, or what it fell back to."""
    network = str(data.get("network", ""))
    burst = re.search(r"burst (\w+)", network)
    if "tbf" in network:
        return f"tbf, burst {burst.group(1)}" if burst else "tbf"
    return network or "not emulated"


def nic(data: dict[str, Any], *nic_rates: str) -> str:
    """The NIC rate(s) and how the run emulated them."""
    return f"{rates(nic_rates)} ({emulation(data)})"


def machine(data: dict[str, Any]) -> str:
    """The machine a JSON records: cores, torch, GPUs, and the transport the ranks used."""
    info: dict[str, Any] = data.get("machine", {})
    parts = [f"{info.get('cpus', '?')} CPUs", f"torch {info.get('torch', '?')}"]
    if info.get("gpus"):
        parts.append(f"{info['gpus']}x {info.get('gpu', 'GPU')}")
    if data.get("transport"):
        parts.append(str(data["transport"]))
    return ", ".join(parts) + (" (quick run)" if data.get("quick") else "")


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def hosts_of(case: dict[str, Any]) -> int:
    return int(case["hosts"])


def headline(results: Path) -> str:
    """README's one table: resharding as time over L, eager-1F1B + W delay over 1F1B, end to end over Alpa's."""
    rows: list[list[str]] = []
    resharding = load(results, "resharding")
    shown = list(VARIANTS)[:4]
    for section, name in SECTIONS.items():
        summary = resharding["summary"][section]
        cases = len({row["case"] for row in resharding["rows"] if row["section"] == section})
        figure = "time / L: " + " / ".join(VARIANTS[v].split(" (")[0] for v in shown)
        value = " / ".join(f"{summary[v]['over_limit']:.2f}" if v in summary else "-" for v in shown)
        bench = f"`bench resharding`, {name} ({cases} cases, {resharding['tensor_mib']:g} MiB)"
        rows.append([bench, figure, value, nic(resharding, resharding["nic_rate"]), machine(resharding)])
    pipeline = load(results, "pipeline")
    for model, stages in sorted({(r["model"], r["stages_count"]) for r in pipeline["rows"]}, key=str):
        case = [r for r in pipeline["rows"] if (r["model"], r["stages_count"]) == (model, stages)]
        delayed = sorted((r for r in case if r["variant"] == "eager-1f1b+wdelay"), key=lambda r: r["comm_fraction"])
        shares = " / ".join(f"{r['comm_fraction']:.0%}" for r in delayed)
        figure = f"eager-1F1B + W delay over 1F1B, communication {shares} of compute"
        value = " / ".join(f"{r['vs_1f1b']:.2f}x" for r in delayed)
        bench = f"`bench pipeline`, {MODELS.get(model, model)}, {stages} stages"
        rows.append([bench, figure, value, nic(pipeline, *(r["nic_rate"] for r in delayed)), machine(pipeline)])
    peers = load(results, "peers")
    for model in dict.fromkeys(t["model"] for t in peers["targets"]):
        targets = sorted((t for t in peers["targets"] if t["model"] == model), key=lambda t: t["comm_fraction"])
        shares = " / ".join(f"{t['comm_fraction']:.0%}" for t in targets)
        carried = " (meshjob carries the skip edges, torch cannot)" if model == "utransformer" else ""
        figure = f"eager-1F1B + W delay over torch's best schedule{carried}, communication {shares}; peak stash vs ZBV"
        stash = {(t["peak_stash_ours"], t["peak_stash_zbv"]) for t in targets}
        value = (
            " / ".join(f"{t['ours_over_torch_best']:.3f}x" for t in targets)
            + "; "
            + ", ".join(f"{ours:g} vs {zbv:g}" for ours, zbv in sorted(stash))
        )
        bench = f"`bench peers`, {MODELS.get(model, model)}, 4 ranks"
        fractions = {t["comm_fraction"] for t in targets}
        used = [r["nic_rate"] for r in peers["rows"] if r["model"] == model and r["comm_fraction"] in fractions]
        rows.append([bench, figure, value, nic(peers, *dict.fromkeys(used)), machine(peers)])
    tuned: list[dict[str, Any]] = (load(results, "tune").get("hand_written") or {}).get("cases", [])
    for nic_rate, model in dict.fromkeys((c["nic_rate"], c["model"]) for c in tuned):
        sized = sorted((c for c in tuned if (c["nic_rate"], c["model"]) == (nic_rate, model)), key=hosts_of)
        sizes = " / ".join(f"{c['hosts']}x{c['devices_per_host']}" for c in sized)
        figure = f"the tuned plan over the best hand-written one (simulated, H100s), {sizes} hosts"
        value = " / ".join(f"{c['hand_over_tuned']:.2f}x" for c in sized)
        rows.append([f"`bench tune`, {MODELS.get(model, model)}", figure, value, rate(nic_rate), "simulated"])
    e2e = load(results, "e2e")
    for row in e2e["rows"]:
        if row["config"] == "meshjob":
            bench = f"`bench e2e`, {MODELS.get(row['model'], row['model'])}, {e2e['hosts']}x{e2e['devices_per_host']}"
            figure = "meshjob over Alpa's defaults (meshjob / signal bound)"
            value = f"{row['vs_alpa']:.2f}x ({row['vs_signal']:.2f})"
            rows.append([bench, figure, value, nic(e2e, e2e["nic_rate"]), machine(e2e)])
    machines = {row[-1] for row in rows if row[-1] != "simulated"}
    if len(machines) == 1:  # one machine ran them all: said once, under the table
        return markdown(["benchmark", "figure", "measured", "NIC"], [row[:-1] for row in rows]) + (
            f"\n\nMachine: {machines.pop()}."
        )
    return markdown(["benchmark", "figure", "measured", "NIC", "machine"], rows)


def resharding_variants(results: Path) -> str:
    """bench/README.md: every strategy's geometric mean time over L per section, and its ratio to global all-gather."""
    data = load(results, "resharding")
    header = ["variant"]
    for name in SECTIONS.values():
        header += [f"{name}: time / L", "x vs global all-gather"]
    rows = []
    for variant, label in VARIANTS.items():
        row = [label]
        for section in SECTIONS:
            got = data["summary"][section].get(variant)
            row += [f"{got['over_limit']:.2f}", f"{got['speedup_vs_global_allgather']:.2f}"] if got else ["-", "-"]
        rows.append(row)
    setup = f"{data['tensor_mib']:g} MiB, median of {data['repeats']}"
    return markdown(header, rows) + f"\n\nNIC {nic(data, data['nic_rate'])}, {setup}. Machine: {machine(data)}."


def pipeline_cases(results: Path) -> str:
    """bench/README.md: every pipeline case, its schedules against 1F1B and the signal bound."""
    data = load(results, "pipeline")
    by_case: dict[tuple[str, int, float], dict[str, dict[str, Any]]] = {}
    for row in data["rows"]:
        by_case.setdefault((row["model"], row["stages_count"], row["comm_fraction"]), {})[row["variant"]] = row
    rows = []
    for (model, stages, share), variants in sorted(by_case.items(), key=str):
        base, eager, delayed = variants["1f1b"], variants["eager-1f1b"], variants["eager-1f1b+wdelay"]
        predicted = [v["predicted_over_measured"] for v in variants.values()]
        rows.append(
            [
                MODELS.get(model, model),
                str(stages),
                f"{share:.0%} ({rate(base['nic_rate'])})",
                f"{base['vs_signal']:.2f}",
                f"{eager['vs_1f1b']:.2f}",
                f"{delayed['vs_1f1b']:.2f}",
                f"{delayed['vs_signal']:.2f}",
                f"{delayed['max_vs_signal']:.2f}",
                f"{min(predicted):.2f}-{max(predicted):.2f}",
            ]
        )
    header = [
        "model",
        "stages",
        "comm / compute (NIC)",
        "1f1b / signal",
        "eager-1f1b / 1f1b",
        "eager-1f1b+wdelay / 1f1b",
        "eager-1f1b+wdelay / signal",
        "step bound / signal",
        "predicted / measured",
    ]
    table = markdown(header, rows) + f"\n\nNICs at the rate shown ({emulation(data)}). Machine: {machine(data)}."
    if "recompute" in data and "precision" in data:
        table += "\n\n" + pipeline_recompute(data["recompute"], data["precision"])
    return table


def pipeline_recompute(recompute: dict[str, Any], precision: dict[str, Any]) -> str:
    """`bench pipeline --parts recompute`: per schedule the step with recompute over the step without on the
    emulated cluster; bf16's boundary bytes over fp32's."""
    target = recompute["target"]
    met = {True: "met", False: "not met", None: "not measured"}[target["met"]]
    value = "-" if target["value"] is None else f"{target['value']:.2f}x"
    setup = (
        f"{MODELS.get(recompute['model'], recompute['model'])}, {recompute['stages_count']} stages, hidden "
        f"{recompute['hidden']}, M={recompute['microbatches']}, emulated compute, NICs {rate(recompute['nic_rate'])} "
        f"({recompute['comm_fraction']:.0%} of compute; {emulation(recompute)})"
    )
    activations = recompute.get("activations_from")
    source = f"; activations: {activations['what']}" if activations else ""
    return (
        markdown(RECOMPUTE_HEADER, recompute_table_rows(recompute))
        + f"\n\n{setup}{source}. Target: {target['target']}: {met} ({value}). {precision_line(precision)}. "
        f"Machine: {machine(recompute)}."
    )


def recompute_schedules(results: Path) -> str:
    """`bench memory`: full recompute against none per schedule: peak activations and step compute."""
    data = load(results, "memory")
    pipeline = data["pipeline"]
    by = {(r["schedule"], str(r["weight_grad_delay"]), r["recompute"]): r for r in pipeline["rows"]}
    rows = []
    for (schedule, delay, recompute), full in by.items():
        if recompute != "full":
            continue
        none = by[(schedule, delay, "none")]
        name = schedule if delay == "0" else f"{schedule}, W delay {delay}"
        default = " (default)" if (schedule, delay) == ("eager-1f1b", "auto") else ""
        rows.append(
            [
                name + default,
                f"{none['activations'] / 2**20:.2f} -> {full['activations'] / 2**20:.2f}",
                f"{full['activations'] / none['activations']:.2f}",
                f"{full['step_s'] / none['step_s']:.2f}",
                f"{full['forwards_per_block_microbatch']:.0f}",
            ]
        )
    header = ["schedule", "peak activations, MiB (none -> full)", "full / none", "step compute full / none", "forwards"]
    m = pipeline["model"]
    return markdown(header, rows) + (
        f"\n\nLlama, hidden {m['hidden']}, {m['layers']} layers in {pipeline['stages']} stages of one device, "
        f"{len(pipeline['rows'][0]['stage_activations'])} stages each run alone in one process and thread (a "
        f"loopback for its neighbours): the busiest stage's peak, the step's compute summed over the stages; "
        f"forwards per block and microbatch with recompute."
    )


def cluster_sizes(results: Path) -> str:
    """`bench cluster`: apply -> pods Running -> first step, and API requests per job, per Node count."""
    data = load(results, "cluster")
    rows = [
        [
            str(r["nodes"]),
            f"{r['apply_to_running_s']:.1f} s ({r['apply_to_running_over_smallest']:.2f}x)",
            f"{r['apply_to_first_step_s']:.1f} s ({r['apply_to_first_step_over_smallest']:.2f}x)",
            f"{r['apply_to_succeeded_s']:.1f} s",
            f"{r['api_requests_per_job']} ({r['api_requests_per_job_over_smallest']:.2f}x)",
        ]
        for r in data["rows"]
    ]
    header = ["Nodes = hosts", "apply -> all pods Running", "apply -> first step", "apply -> Succeeded", "API requests"]
    return markdown(header, rows) + (
        f"\n\nOne job of N hosts x 1 device, {data['steps']} steps, pods {data['pods']}; API requests: the API "
        f"server's count while it ran, less the idle cluster's. Machine: {data['machine']['cpus']} CPUs."
    )


def peer_schedules(results: Path) -> str:
    """bench/README.md: meshjob's schedules and torch.distributed.pipelining's, side by side (`bench peers`)."""
    data = load(results, "peers")
    rows = []
    for r in data["rows"]:
        if "error" in r:
            rows.append([MODELS.get(r["model"], r["model"]), "", r["runtime"], r["schedule"], "failed", "", ""])
            continue
        rows.append(
            [
                MODELS.get(r["model"], r["model"]),
                f"{r['comm_fraction']:.0%}",
                r["runtime"],
                r["schedule"],
                f"{r['throughput_over_signal']:.2f}",
                f"{r['peak_stash']:g}",
                f"{r['bytes_sent'] / 2**20:.1f}",
            ]
        )
    header = ["model", "comm / compute", "runtime", "schedule", "throughput / signal", "peak stash", "MiB sent"]
    verdicts = [
        f"{MODELS.get(t['model'], t['model'])} at {t['comm_fraction']:.0%}: eager-1f1b+wdelay is "
        f"{t['ours_over_torch_best']:.3f}x torch's best ({t['torch_best']}; target {t['target']:g}x), peak stash "
        f"{t['peak_stash_ours']:g} against ZBV's {t['peak_stash_zbv'] if t['peak_stash_zbv'] is not None else 'n/a'} "
        f"(throughput target {'met' if t['throughput_met'] else 'not met'}, stash target "
        f"{'met' if t['stash_met'] else 'not met'})"
        for t in data["targets"]
    ]
    check = data["loss_check"]
    worst = max(d for d in check["max_abs_diff"].values() if d is not None)
    return (
        markdown(header, rows)
        + "\n\n"
        + ". ".join(verdicts)
        + f". Real compute (a small GPT, every runtime and torch schedule): losses within {worst:.0e} of the "
        f"reference. {data['steps'] - 1} timed steps. Machine: {machine(data)}."
    )


def grad_sync_modes(results: Path) -> str:
    """`bench grad-sync`: DP gradient sync overlapped with the backward against one sync after the step."""
    data = load(results, "grad_sync")
    after = data["tokens_per_s"]["after the step"]["median"]
    rows = [
        [mode, f"{f['median']:,.0f}", f"{f['median'] / after:.2f}x", ", ".join(f"{v:,.0f}" for v in f["runs"])]
        for mode, f in data["tokens_per_s"].items()
    ]
    header = ["gradient sync", "tokens/s (median)", "over after the step", "runs"]
    return markdown(header, rows) + (
        f"\n\nGPT, {data['job']['model']['layers']} layers, hidden {data['job']['model']['hidden']}, one stage data "
        f"parallel over 2 emulated hosts at {rate(data['nic_rate'])}, real compute, {data['steps']} steps, "
        f"{data['repeats']} runs per mode alternating; equal losses. Machine: {machine(data)}."
    )


def operator_crowds(results: Path) -> str:
    """`bench operator`: many jobs at once (50 small on 128 nodes; 16 large planning and a small one)."""
    data = load(results, "operator")
    crowd, large = data["crowd"], data["large"]
    rows = [
        [
            f"{crowd['jobs']} small jobs at once, {crowd['nodes']} free nodes",
            f"{crowd['placed']} placed, {crowd['went_unschedulable']} went Unschedulable; create -> pods p50 "
            f"{crowd['create_to_pods_p50_seconds']:.1f} s, max {crowd['create_to_pods_max_seconds']:.1f} s",
            "all placed, none Unschedulable, p50 < 5 s",
        ],
        [
            f"{large['large_jobs']} large jobs planning, then a small one",
            f"its pods after {large['other_job_to_pods_seconds']:.2f} s; admission p99 "
            f"{large['admission_p99_seconds']:.2f} s, /healthz p99 {large['healthz_p99_seconds']:.2f} s",
            "each < 1 s",
        ],
    ]
    return markdown(["case", "measured", "target"], rows) + f"\n\nAPI server: {data['server']}."


TABLES: dict[str, dict[str, Table]] = {
    "README.md": {"results": headline},
    "bench/README.md": {
        "resharding": resharding_variants,
        "pipeline": pipeline_cases,
        "recompute": recompute_schedules,
        "cluster": cluster_sizes,
        "peers": peer_schedules,
        "grad-sync": grad_sync_modes,
        "operator-crowds": operator_crowds,
    },
}


def fill(text: str, name: str, table: str) -> str:
    """text with the table between its markers; an error naming the marker when it is missing."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no '{begin}' ... '{end}' markers")
    return text[: start + len(begin)] + "\n" + table + "\n" + text[stop:]


def generated(root: Path = ROOT) -> dict[Path, str]:
    """Each file's text with its tables as the JSON under root/bench/results say."""
    results = root / "bench" / "results"
    out = {}
    for name, tables in TABLES.items():
        text = (root / name).read_text()
        for marker, table in tables.items():
            text = fill(text, marker, table(results))
        out[root / name] = text
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshjob_bench.readme_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the tables into README.md and bench/README.md")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this checkout)")
    args = parser.parse_args(argv)
    if not args.write:
        for tables in TABLES.values():
            for marker, table in tables.items():
                print(f"<!-- {marker} -->\n{table(args.root / 'bench' / 'results')}\n")
        return 0
    for path, text in generated(args.root).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"updated {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
