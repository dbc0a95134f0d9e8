"""bench pipeline's report: the issue's targets on the measured rows, the table, and the figures (a
timeline per model like the paper's figure 4, throughput over signal like its figure 9).

The rows and Measured runs are meshjob_bench.pipeline's; the paper: "On Optimizing the Communication of
Model Parallelism" (Zhuang et al., 2022). The recompute part's report (recompute_section, precision_section,
their table and figure) reads its rows only (meshjob_bench.pipeline.section_row's).
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from meshjob.units import format_rate
from meshjob_bench.pipeline_rows import Measured

TARGET_SPEEDUP, TARGET_COMM, TARGET_OF_SIGNAL = 1.3, 0.3, 0.9  # the issue's, on the U-Transformer
# the recompute part's: the step with full recompute over the step without, at most, under this schedule
TARGET_RECOMPUTE_STEP, TARGET_RECOMPUTE_SCHEDULE = 1.4, "eager-1f1b+wdelay"
# boundary bytes bf16 / fp32: boundary tensors travel in the training dtype; the tolerance: counted bytes are exact
EXPECTED_BF16_BYTES, BYTES_TOLERANCE = 0.5, 0.005
INF = float("inf")


def print_table(rows: list[dict], title: str) -> None:
    t = Table(
        "model",
        "S",
        "comm",
        "NIC",
        "variant",
        "W delay",
        "step ms",
        "vs signal",
        "NICs' max vs signal",
        "vs 1f1b",
        "bubble",
        "overlap",
        "peak stash / 1f1b",
        "predicted / measured",
        title=title,
    )
    for r in rows:
        most = r.get("max_vs_signal")
        t.add_row(
            r["model"],
            str(r["stages_count"]),
            f"{r['comm_fraction']:.0%}",
            format_rate(r["nic_bytes_per_s"]),
            r["variant"],
            str(max(r["weight_delay"].values(), default=0)),
            f"{r['step_s'] * 1e3:.0f}",
            f"{r['vs_signal']:.2f}",
            "-" if most is None else f"{most:.2f}",
            f"{r['vs_1f1b']:.2f}",
            f"{r['bubble']:.1%}",
            f"{r['overlap']:.1%}",
            "/".join(f"{x:.2f}" for x in r["peak_stashed_vs_1f1b"]),
            f"{r['predicted_over_measured']:.3f}",
        )
    Console(width=180).print(t)


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        met = {True: "yes", False: "NO", None: "not measured"}[t["met"]]
        worst = f"; worst {t['worst']:.2f}" if t["worst"] is not None else ""
        allowed = ""
        if t.get("impossible_cases"):
            allowed = (
                f"; {t['impossible_cases']} case(s) bounded below it by the step bound, met on the rest: "
                f"{ {True: 'yes', False: 'NO', None: 'none left'}[t['met_where_the_nics_allow']] }"
            )
        print(f"target: {t['target']}: met {met} ({len(t['cases'])} cases{worst}{allowed})")


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets on the measured U-Transformer rows (none measured: met is None)."""
    wdelay = [r for r in rows if r["model"] == "utransformer" and r["variant"] == "eager-1f1b+wdelay"]
    heavy = [r for r in wdelay if r["comm_fraction"] >= TARGET_COMM]
    out = []
    for text, cases, key, bound in (
        (
            f"utransformer eager-1f1b+wdelay >= {TARGET_SPEEDUP}x 1f1b where communication >= "
            f"{TARGET_COMM:.0%} of compute",
            heavy,
            "vs_1f1b",
            TARGET_SPEEDUP,
        ),
        (
            f"utransformer eager-1f1b+wdelay >= {TARGET_OF_SIGNAL:.0%} of signal across the sweep",
            wdelay,
            "vs_signal",
            TARGET_OF_SIGNAL,
        ),
    ):
        values = [r[key] for r in cases]
        # of signal: a case whose step bound (max_vs_signal) is below the target cannot meet it by any schedule
        possible = [r[key] for r in cases if key != "vs_signal" or (r.get("max_vs_signal") or INF) >= bound]
        out.append(
            {
                "target": text,
                "metric": key,
                "bound": bound,
                "cases": [
                    {
                        "stages": r["stages_count"],
                        "comm_fraction": r["comm_fraction"],
                        key: r[key],
                        "max_vs_signal": r.get("max_vs_signal"),
                    }
                    for r in cases
                ],
                "worst": min(values) if values else None,
                "met": (min(values) >= bound) if values else None,
                "met_where_the_nics_allow": (min(possible) >= bound) if possible else None,
                "impossible_cases": len(values) - len(possible),
            }
        )
    return out


def _plt():
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(measured: list[Measured], out_dir: str, subtitle: str) -> list[str]:
    """Figure 4: per model, the last step of every variant at the first stage count and the comm
    highest comm fraction, one row of bars per stage."""
    plt = _plt()
    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868", "wait": "#dddddd"}
    paths = []
    for model in sorted({m.config.model for m in measured}):
        ms = [m for m in measured if m.config.model == model]
        stages = ms[0].config.stages
        fraction = max(m.config.comm_fraction for m in ms if m.config.stages == stages)
        ms = [
            m for m in ms if m.config.stages == stages and (m.config.comm_fraction == fraction or m.variant == "signal")
        ]
        fig, axes = plt.subplots(len(ms), 1, figsize=(12, 0.5 * stages * len(ms) + 1), squeeze=False)
        for ax, m in zip(axes[:, 0], ms):
            origin = min(o for o, _ in m.timelines.values())
            for stage, (o, timeline) in sorted(m.timelines.items()):
                for name, start, end in timeline:
                    kind = "wait" if name == "wait" else name.rstrip("0123456789")
                    x0 = (o - origin + start) * 1e3
                    ax.barh(
                        stage,
                        (end - start) * 1e3,
                        left=x0,
                        color=colors.get(kind, "#999999"),
                        edgecolor="white" if kind != "wait" else "none",
                        height=0.8,
                    )
                    if kind != "wait" and (end - start) * 1e3 > 0.02 * m.step_s * 1e3:
                        ax.text(
                            x0 + (end - start) * 5e2,
                            stage,
                            name[len(kind) :],
                            ha="center",
                            va="center",
                            fontsize=5,
                            color="white",
                        )
            ax.set_yticks(sorted(m.timelines))
            ax.set_yticklabels([f"stage {s}" for s in sorted(m.timelines)], fontsize=7)
            ax.invert_yaxis()
            nic = "1-byte transfers" if m.variant == "signal" else f"NIC {m.config.nic_rate}"
            ax.set_title(f"{m.variant} ({nic}): step {m.step_s * 1e3:.0f} ms", fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("ms since the step began")
        fig.suptitle(
            f"{model}, {stages} stages, communication {fraction:.0%} of compute: last step per stage "
            f"(F blue, B/I orange, W green, waiting grey) — {subtitle}",
            fontsize=9,
        )
        fig.tight_layout()
        path = os.path.join(out_dir, f"pipeline_timeline_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_bars(rows: list[dict], out_dir: str, subtitle: str) -> str:
    """Figure 9: throughput over signal per variant, grouped by communication fraction, one panel per
    model and stage count; the simulator's prediction as a tick on each bar."""
    plt = _plt()
    panels = sorted({(r["model"], r["stages_count"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "signal"))  # VARIANTS' order
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (model, stages) in zip(axes[0], panels):
        mine = [r for r in rows if r["model"] == model and r["stages_count"] == stages and r["variant"] != "signal"]
        fractions = sorted({r["comm_fraction"] for r in mine})
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            xs, ys, ps = [], [], []
            for j, f in enumerate(fractions):
                r = next((r for r in mine if r["variant"] == v and r["comm_fraction"] == f), None)
                if r is not None:
                    xs.append(j + (k - (len(variants) - 1) / 2) * width)
                    ys.append(r["vs_signal"])
                    ps.append(r["vs_signal"] / r["predicted_over_measured"])  # the predicted throughput's
            ax.bar(xs, ys, width, label=v)
            ax.scatter(xs, ps, marker="_", color="black", s=60, zorder=3)
        ax.axhline(TARGET_OF_SIGNAL, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(fractions)))
        ax.set_xticklabels([f"{f:.0%}" for f in fractions])
        ax.set_xlabel("communication / compute")
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{model}, {stages} stages", fontsize=9)
    axes[0, 0].set_ylabel("throughput / signal")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"throughput over the 1-byte bound (black tick: simulator) — {subtitle}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "pipeline_fig9.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _runs(rows: list[dict], precision: str = "fp32") -> dict[tuple[str, str], dict]:
    """(schedule, recompute) -> the row of that run in `precision`."""
    return {(r["schedule"], r["recompute"]): r for r in rows if r["precision"] == precision}


def recompute_section(rows: list[dict], memory: dict | None = None) -> dict:
    """The recompute part's JSON: its fp32 rows and, per schedule run with recompute none and full, full over
    none of the measured step, the simulator's predicted step and the peak stashed microbatches (the busiest
    stage's), beside bench memory's peak activations full / none where `memory` (pipeline.memory_activations)
    has the schedule; and the issue's target on the measured step of TARGET_RECOMPUTE_SCHEDULE."""
    runs = _runs(rows)
    ratios: dict[str, dict] = {}
    for schedule in dict.fromkeys(r["schedule"] for r in rows if r["precision"] == "fp32"):
        none, full = runs.get((schedule, "none")), runs.get((schedule, "full"))
        if none is None or full is None:
            continue
        activations = ((memory or {}).get("activations_full_over_none") or {}).get(schedule)
        ratios[schedule] = {
            "step_none_s": none["step_s"],
            "step_full_s": full["step_s"],
            "step": full["step_s"] / none["step_s"],
            "predicted_step": full["predicted_step_s"] / none["predicted_step_s"],
            "peak_stashed_none": max(none["peak_stashed"]),
            "peak_stashed_full": max(full["peak_stashed"]),
            "activations": activations,
        }
    value = ratios.get(TARGET_RECOMPUTE_SCHEDULE, {}).get("step")
    return {
        "rows": [r for r in rows if r["precision"] == "fp32"],
        "ratios": ratios,
        "target": {
            "target": f"{TARGET_RECOMPUTE_SCHEDULE}: step with recompute full <= {TARGET_RECOMPUTE_STEP}x the step "
            "without",
            "schedule": TARGET_RECOMPUTE_SCHEDULE,
            "metric": "step",
            "bound": TARGET_RECOMPUTE_STEP,
            "value": value,
            "met": None if value is None else value <= TARGET_RECOMPUTE_STEP,
        },
        "activations_from": memory and {k: v for k, v in memory.items() if k != "activations_full_over_none"},
        "note": "step = the steady-state period (as the sweep's rows); step = full / none of the same schedule on "
        "the same NICs (set from 1f1b without recompute), run one after the other; predicted_step: the "
        "simulator's on the plans that ran; peak_stashed: the busiest stage's microbatches forwarded and not "
        "yet backwarded; activations: bench memory's (real compute, its own model) where memory.json has it, "
        "none measured here: emulated compute keeps no activations",
    }


def precision_section(rows: list[dict], schedule: str) -> dict:
    """The recompute part's bf16 check: `schedule` without recompute in fp32 and in bf16, the boundary bytes
    per step the ranks counted landing, bf16's over fp32's against EXPECTED_BF16_BYTES, and each run's counted
    cross-host bytes over the plan's NIC bytes (1: the count saw every byte the plan sends)."""
    fp32, bf16 = _runs(rows, "fp32").get((schedule, "none")), _runs(rows, "bf16").get((schedule, "none"))
    if fp32 is None or bf16 is None:
        raise ValueError(f"{schedule} without recompute must have run in fp32 and bf16")
    ratio = bf16["bytes_per_step"] / fp32["bytes_per_step"] if fp32["bytes_per_step"] else None
    counted = {
        r["precision"]: r["cross_host_bytes_per_step"] / r["planned_nic_bytes_per_step"]
        for r in (fp32, bf16)
        if r["planned_nic_bytes_per_step"]
    }
    fp32_bytes = {r["bytes_per_step"] for r in rows if r["precision"] == "fp32"}
    return {
        "schedule": schedule,
        "rows": [fp32, bf16],
        "fp32_bytes_per_step": fp32["bytes_per_step"],
        "bf16_bytes_per_step": bf16["bytes_per_step"],
        "bf16_over_fp32": ratio,
        "expected": EXPECTED_BF16_BYTES,
        "met": None if ratio is None else abs(ratio - EXPECTED_BF16_BYTES) <= BYTES_TOLERANCE,
        "counted_over_planned": counted,
        "fp32_runs_moved_the_same_bytes": len(fp32_bytes) == 1,  # recompute and the schedule move no other bytes
        "bf16_step_over_fp32": bf16["step_s"] / fp32["step_s"],
        "note": "bytes_per_step: the boundary-tensor bytes every receiving rank counted landing over the run "
        "(meshjob_trainer.reshard's Resharded events), summed over ranks, over the steps run; counted_over_planned: "
        "their cross-host part over the plan's NIC bytes per step (Plan.host_bytes_per_step)",
    }


def recompute_table_rows(recompute: dict) -> list[list[str]]:
    """One row per schedule: W delay (none -> full), step ms (none -> full), full / none measured and predicted,
    peak stash (none -> full), bench memory's activations full / none ('-' where it has none)."""
    runs = _runs(recompute["rows"])
    out: list[list[str]] = []
    for schedule, r in recompute["ratios"].items():
        delays = [max(runs[(schedule, x)]["weight_delay"].values(), default=0) for x in ("none", "full")]
        activations = r.get("activations")
        out.append(
            [
                schedule,
                " -> ".join(str(d) for d in delays) if delays[0] != delays[1] else str(delays[0]),
                f"{r['step_none_s'] * 1e3:.0f} -> {r['step_full_s'] * 1e3:.0f}",
                f"{r['step']:.2f}",
                f"{r['predicted_step']:.2f}",
                f"{r['peak_stashed_none']} -> {r['peak_stashed_full']}",
                "-" if activations is None else f"{activations:.2f}",
            ]
        )
    return out


RECOMPUTE_HEADER = (
    "schedule",
    "W delay",
    "step ms (none -> full)",
    "step full / none",
    "predicted full / none",
    "peak stash",
    "activations full / none (bench memory)",
)


def precision_line(precision: dict) -> str:
    """The bf16 check in one sentence."""
    ratio = precision["bf16_over_fp32"]
    met = {True: "met", False: "NOT met", None: "not measured"}[precision["met"]]
    return (
        f"{precision['schedule']}: boundary bytes per step {precision['fp32_bytes_per_step'] / 2**20:.1f} MiB fp32, "
        f"{precision['bf16_bytes_per_step'] / 2**20:.1f} MiB bf16 (counted by the run): bf16 / fp32 "
        f"{'-' if ratio is None else f'{ratio:.3f}'} (expected {precision['expected']:g}: {met}); "
        f"step bf16 / fp32 {precision['bf16_step_over_fp32']:.2f}"
    )


def print_recompute(recompute: dict, precision: dict, title: str) -> None:
    t = Table(*RECOMPUTE_HEADER, title=title)
    for cells in recompute_table_rows(recompute):
        t.add_row(*cells)
    Console(width=180).print(t)
    target = recompute["target"]
    met = {True: "yes", False: "NO", None: "not measured"}[target["met"]]
    value = "-" if target["value"] is None else f"{target['value']:.2f}"
    print(f"target: {target['target']}: met {met} ({value})")
    print(precision_line(precision))


def plot_recompute(recompute: dict, precision: dict, out_dir: str, subtitle: str) -> str:
    """The recompute part's figure: per schedule the step without and with recompute (full / none above the
    pair, the target as a note), and the boundary bytes per step in fp32 and bf16."""
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    ratios = recompute["ratios"]
    names = list(ratios)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ratios[n]["step_none_s"] * 1e3 for n in names], 0.4, label="recompute none")
    ax.bar([x + 0.2 for x in xs], [ratios[n]["step_full_s"] * 1e3 for n in names], 0.4, label="recompute full")
    for x, n in zip(xs, names):
        ax.text(x, ratios[n]["step_full_s"] * 1e3, f"{ratios[n]['step']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylim(0, 1.15 * max((r["step_full_s"] for r in ratios.values()), default=1.0) * 1e3)
    ax.set_ylabel("step ms (steady state)")
    target = recompute["target"]
    ax.set_title(f"step with / without recompute (target: {target['target']})", fontsize=8)
    ax.legend(fontsize=7, loc="lower left")
    mib = [precision["fp32_bytes_per_step"] / 2**20, precision["bf16_bytes_per_step"] / 2**20]
    bx.bar(["fp32", "bf16"], mib, color=["#4c72b0", "#55a868"])
    ratio = precision["bf16_over_fp32"]
    bx.set_title(f"boundary MiB per step: bf16 / fp32 {'-' if ratio is None else f'{ratio:.3f}'}", fontsize=8)
    bx.set_ylabel("MiB landed per step (counted)")
    fig.suptitle(subtitle, fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "pipeline_recompute.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
