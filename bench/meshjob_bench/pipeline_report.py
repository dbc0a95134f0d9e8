"""bench pipeline's report: the issue's targets on the measured rows, the table, and the figures (a
timeline per model like the paper's figure 4, throughput over signal like its figure 9).

The rows and Measured runs are meshjob_bench.pipeline's; the paper: "On Optimizing the Communication of
Model Parallelism" (Zhuang et al., 2022).
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from meshjob.units import format_rate
from meshjob_bench.pipeline_rows import Measured

TARGET_SPEEDUP, TARGET_COMM, TARGET_OF_SIGNAL = 1.3, 0.3, 0.9  # the issue's, on the U-Transformer
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
