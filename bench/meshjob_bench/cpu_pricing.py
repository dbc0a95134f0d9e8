"""The CPU the ranks measured against the CPU the plan priced, per section and variant of `bench resharding`.

The network model charges every message and byte its CPU on the shared cores at what the engine-cost probe
measured between two ranks and nothing else running (meshjob_bench.engine_costs); the simulator adds it up per
transfer (meshjob.simulate.simulator.TransferResult.cpu_work_s, each row's `simulated_cpu_seconds`). A case runs up to
17 ranks on the same cores, and where the cores decide its time, the simulator is only as right as that price.
This table says where it is off and which way: measured CPU seconds over priced ones (median over the rows of a
section and variant; least and most), e.g. a chain cut in 64 chunks priced too dear and one cut in 4 too cheap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from meshjob_bench.resharding_cases import ALPA_DEFAULT


def variant_kind(row: Any) -> str:
    """The row's variant with its balancer left out: broadcast rows by K, the others by strategy."""
    if row.label == ALPA_DEFAULT:
        return ALPA_DEFAULT
    return f"broadcast K={row.chunks}" if row.strategy == "broadcast" else row.strategy


def cpu_pricing(rows: Sequence[Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per section and variant kind: measured over priced CPU (median, least, most) and how many rows;
    rows the model prices no CPU for (no shared cores modelled, signal) are left out."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r.strategy == "signal" or not r.simulated_cpu_seconds > 0 or not math.isfinite(r.cpu_seconds):
            continue
        ratios.setdefault(r.section, {}).setdefault(variant_kind(r), []).append(r.cpu_seconds / r.simulated_cpu_seconds)
    return {
        section: {
            kind: {"median": statistics.median(xs), "least": min(xs), "most": max(xs), "rows": len(xs)}
            for kind, xs in by_kind.items()
        }
        for section, by_kind in ratios.items()
    }


def print_cpu_pricing(pricing: dict[str, dict[str, dict[str, float]]]) -> None:
    if not pricing:
        return
    console = Console(width=None if Console().is_terminal else 150)
    table = Table(
        title="CPU measured over the CPU the model priced (all ranks; 1 = priced right)", title_justify="left"
    )
    for col in ("section", "variant", "median", "least-most", "rows"):
        table.add_column(col, justify="left" if col in ("section", "variant") else "right")
    for section, by_kind in pricing.items():
        for i, (kind, m) in enumerate(by_kind.items()):
            table.add_row(
                section if i == 0 else "",
                kind,
                f"{m['median']:.2f}",
                f"{m['least']:.2f}-{m['most']:.2f}",
                str(m["rows"]),
            )
    console.print(table)
