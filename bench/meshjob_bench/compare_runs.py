"""Recorded `bench resharding` runs side by side: each target's misses, broadcast K=auto, the simulator's agreement.

A target that misses on this machine may miss for the algorithm or for the machine; runs at other NIC rates on the
same cores tell which (the cores have 2x and 4x the time per byte at 500mbit and 250mbit). This reads runs already
recorded (their JSON: the rows, the targets as the bench checked them, each row's simulator error) and prints one
column per run, one row per measure, so such a sweep is read off the recorded runs, not copied by hand.

Run: `meshjob bench compare-runs bench/results/runs/resharding-250mbit-*.json bench/results/resharding.json`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob.errors import FieldError, SpecError
from meshjob_bench.resharding_cases import MAIN_BALANCER, Variant
from meshjob_bench.resimulate import TOLERANCE, read_run

AUTO_GREEDY = Variant("broadcast", "auto", MAIN_BALANCER).label  # the summary's row for broadcast K=auto


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="resharding.json files written by `meshjob bench resharding`")
    parser.add_argument("--json", default=None, help="also write the comparison to this file")
    parser.add_argument(
        "--png",
        default=None,
        help="also plot it to this file: time / L per section, and the share of each target's rows met",
    )


@dataclass(frozen=True)
class TargetCount:
    """One target in one run (resharding_targets.Target as recorded): rows (or pairs) checked, missed, bounded."""

    checked: int
    missed: int
    bounded: int

    def __add__(self, other: TargetCount) -> TargetCount:
        return TargetCount(self.checked + other.checked, self.missed + other.missed, self.bounded + other.bounded)

    def text(self) -> str:
        if not self.missed:
            return f"met ({self.checked})"
        return f"{self.missed} of {self.checked} missed" + (f" ({self.bounded} bounded)" if self.bounded else "")


@dataclass(frozen=True)
class RunSummary:
    """What one recorded run (or several runs of one NIC rate, one section each) measured, in the targets' terms."""

    paths: tuple[str, ...]
    nic_rate: str
    sections: frozenset[str]  # the sections the run measured
    auto_over_limit: dict[str, float]  # section -> broadcast K=auto (greedy) time / L, geometric mean over cases
    targets: dict[str, TargetCount]
    simulator_errors: tuple[float, ...]  # |simulated / measured - 1| of every non-signal row
    disturbed_probe: bool = False

    @property
    def simulator_within(self) -> int:
        return sum(e <= TOLERANCE for e in self.simulator_errors)

    def merged(self, other: RunSummary) -> RunSummary:
        """This run and another of the same NIC rate over other sections, as one."""
        return RunSummary(
            self.paths + other.paths,
            self.nic_rate,
            self.sections | other.sections,
            {**self.auto_over_limit, **other.auto_over_limit},
            {
                n: self.targets.get(n, TargetCount(0, 0, 0)) + other.targets.get(n, TargetCount(0, 0, 0))
                for n in target_names((self, other))
            },
            self.simulator_errors + other.simulator_errors,
            self.disturbed_probe or other.disturbed_probe,
        )

    def simulator_text(self) -> str:
        errors = self.simulator_errors
        if not errors:
            return ""
        return f"{self.simulator_within} of {len(errors)} ({statistics.median(errors):.1%})"

    def to_json(self) -> dict[str, Any]:
        errors = self.simulator_errors
        return {
            "paths": list(self.paths),
            "nic_rate": self.nic_rate,
            "auto_over_limit": self.auto_over_limit,
            "targets": {n: asdict(t) for n, t in self.targets.items()},
            "simulator_within": self.simulator_within,
            "simulator_rows": len(errors),
            "simulator_median_error": statistics.median(errors) if errors else None,
            "disturbed_probe": self.disturbed_probe,
        }


def summarize(path: str, run: dict[str, Any]) -> RunSummary:
    """One resharding run's summary (resimulate.read_run); KeyError where it lacks a field."""
    sections = sorted(run["summary"])
    return RunSummary(
        paths=(path,),
        nic_rate=run["nic_rate"],
        sections=frozenset(sections),
        auto_over_limit={
            s: run["summary"][s][AUTO_GREEDY]["over_limit"] for s in sections if AUTO_GREEDY in run["summary"][s]
        },
        targets={
            t["name"]: TargetCount(t["checked"], len(t["failures"]), len(t["bounded"]))
            for t in run["targets"]
            if t.get("checked")
        },
        simulator_errors=tuple(
            abs(r["simulator_error"])
            for r in run["rows"]
            if r["strategy"] != "signal" and r.get("simulator_error") is not None
        ),
        disturbed_probe=bool((run.get("message_costs") or {}).get("disturbed")),
    )


def target_names(cols: Sequence[RunSummary]) -> list[str]:
    """Every target any of `cols` checked, in the order they first appear."""
    return list(dict.fromkeys(name for c in cols for name in c.targets))


def all_sections(cols: Sequence[RunSummary]) -> list[str]:
    return sorted({sec for c in cols for sec in c.sections})


def columns(summaries: Sequence[RunSummary]) -> list[RunSummary]:
    """Runs of one NIC rate over different sections (`--section` runs) merged into one column, in order."""
    out: list[RunSummary] = []
    for s in summaries:
        i = next((i for i, c in enumerate(out) if c.nic_rate == s.nic_rate and not c.sections & s.sections), None)
        if i is None:
            out.append(s)
        else:
            out[i] = out[i].merged(s)
    return out


def print_comparison(cols: Sequence[RunSummary]) -> None:
    console = Console(width=None if Console().is_terminal else 160)
    table = Table(
        title="recorded resharding runs side by side (time / L: broadcast K=auto greedy, geometric mean "
        "over a section's cases; each column's files below the table)",
        title_justify="left",
    )
    table.add_column("measure")
    for i, c in enumerate(cols):
        table.add_column(f"[{i + 1}] {c.nic_rate}" + (" (a probe disturbed)" if c.disturbed_probe else ""))
    for sec in all_sections(cols):
        table.add_row(
            f"{sec}: time / L", *[f"{c.auto_over_limit[sec]:.3f}" if sec in c.auto_over_limit else "" for c in cols]
        )
    for name in target_names(cols):
        table.add_row(name, *[c.targets[name].text() if name in c.targets else "" for c in cols])
    table.add_row(f"simulator within {TOLERANCE:.0%} (median |error|)", *[c.simulator_text() for c in cols])
    console.print(table)
    for i, c in enumerate(cols):
        console.print(f"[{i + 1}] " + ", ".join(os.path.basename(p) for p in c.paths))


def plot(cols: Sequence[RunSummary], path: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"[{i + 1}] {c.nic_rate}" for i, c in enumerate(cols)]
    width = 0.8 / len(cols)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [2, 3]})
    sections = all_sections(cols)
    for j, (label, c) in enumerate(zip(labels, cols)):
        left.bar(
            [i + j * width for i in range(len(sections))],
            [c.auto_over_limit.get(sec, float("nan")) for sec in sections],
            width,
            label=label,
        )
    left.axhline(1.15, color="black", lw=0.8, ls="--")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(sections))], sections)
    left.set_ylim(1.0, None)
    left.set_ylabel("broadcast K=auto time / L (geometric mean)")
    left.set_title("time over the physical limit (dashed: 1.15)", fontsize=9)
    left.legend(fontsize=8)
    names = target_names(cols)
    for j, (label, c) in enumerate(zip(labels, cols)):
        shares = [1 - c.targets[n].missed / c.targets[n].checked if n in c.targets else float("nan") for n in names]
        right.bar([i + j * width for i in range(len(names))], shares, width, label=label)
    right.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(names))], [textwrap.fill(n, 20) for n in names], fontsize=6.5
    )
    right.set_ylim(0, 1.05)
    right.set_ylabel("share of the target's rows (pairs) met")
    right.set_title("the issues' targets (no bar: none met)", fontsize=9)
    fig.suptitle("recorded bench resharding runs side by side", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    summaries, problems = [], []
    for path in args.runs:
        try:
            summaries.append(summarize(path, read_run(path)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(
                FieldError(
                    "runs",
                    path,
                    f"a resharding.json written by `meshjob bench resharding` ({type(err).__name__}: {err})",
                )
            )
    if problems:
        raise SpecError(problems)
    cols = columns(summaries)
    print_comparison(cols)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.to_json() for c in cols], f, indent=2)
    if args.png:
        plot(cols, args.png)
    return 0
