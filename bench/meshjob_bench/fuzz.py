"""Fuzz benchmark: generated and mutated manifests through `meshjob plan` and the operator's validation.

Every case starts from one of examples/*.yaml (seeded, reproducible) and applies one mutation:
  valid        valid tweaks only (steps, seed, chunks, balancer, strategy, schedule, weightGradDelay)
  set          1-3 locations set to a random value: wrong types, huge numbers, unicode, null, nests
  delete       1-3 keys removed (missing fields)
  add          1-3 unknown keys added
  bound        a bounded count set to its maximum, one past it, or far past it
  words        a value written as a YAML word kubectl reads specially (on, no, y, 1e-3, 0777, ~ ...)
  nesting      a value replaced by 10 to 100,000 levels of flow nesting (some unclosed)
  alias-bomb   "billion laughs" anchors prepended (2-10 levels of 2-10 aliases), sometimes used
  duplicate    a key line given twice
  unicode      control, zero-width, right-to-left, non-BMP and NUL characters inserted
  bytes        random bytes, or random bytes spliced into the text
  edit         spans of the text cut, repeated or replaced
Each case is written to a file and run through `meshjob plan FILE --json` in this process
(meshjob.cli.main, output captured) and, when its YAML is something the API server could hand the
operator (a mapping JSON can carry), through meshjob_operator.reconcile.validate (imported only:
no kopf, no server). A nesting case also gives the operator the nesting as parsed JSON.
Outcomes: ok (exit 0, or a job), clear error (exit 2 with a message, or SpecError), traceback (any
other exception or exit code) and overrun (more than --budget CPU seconds: SIGPROF interrupts it;
or ten times that in wall time, for a case that waits without computing): the budget counts the
work, not what else the shared machine runs. Times in the tables are wall time (what a user waits).
Target: 0 tracebacks, 0 overruns, p99 under 1 s.

Run: `meshjob bench fuzz --cases 10000` or `python -m meshjob_bench.fuzz`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

import meshjob.commands.plan  # noqa: F401 - meshjob.cli imports it on first use: here, so no case's time includes it
from meshjob.cli import main as meshjob_main
from meshjob.errors import SpecError
from meshjob.spec.manifest import bounded_fields
from meshjob.spec.safeyaml import load_documents
from meshjob_bench import parsed_arguments
from meshjob_operator.reconcile import validate

ROOT = Path(__file__).resolve().parents[2]
MUTATIONS = (
    "valid",
    "set",
    "delete",
    "add",
    "bound",
    "words",
    "nesting",
    "alias-bomb",
    "duplicate",
    "unicode",
    "bytes",
    "edit",
)
HOLE = "__meshjob_fuzz_hole__"  # placeholder for raw YAML text that a dump could not write
OUTCOMES = ("ok", "error", "traceback", "overrun")
PATHS = ("meshjob plan", "operator validate")
WORDS = (
    "on",
    "off",
    "yes",
    "no",
    "y",
    "n",
    "On",
    "NO",
    "true",
    "1e-3",
    "1E3",
    ".5",
    "0x10",
    "0o17",
    "0777",
    "08",
    "1_000",
    "~",
    "null",
    "",
    ".inf",
    ".nan",
    "-.inf",
    "2001-12-14",
    "1:30",
    "auto",
    "'0'",
    "9223372036854775808",
    "1e400",
    "-0",
    "+12",
    "!!str 12",
    "!!binary aGk=",
    "!!python/none ''",
)
ODD_CHARS = (
    "\x00",
    "\x07",
    "\x1b",
    "\u0085",
    "\u200b",
    "\u202e",
    "\u2028",
    "\ufeff",
    "\U0001f600",
    "é",
    "\u0301",
    "\t",
    "\r",
    "\\",
    '"',
    "'",
    ":",
    "#",
    "&",
    "*",
    "!",
    "|",
    ">",
    "{",
    "[",
    "-",
    "%",
    "@",
)


@dataclass(frozen=True)
class Case:
    index: int
    mutation: str
    data: bytes  # the manifest file's bytes
    operator_body: Any = None  # what the API server could hand the operator, or None


@dataclass(frozen=True)
class Result:
    case: int
    mutation: str
    path: str
    outcome: str  # ok | error | traceback | overrun
    seconds: float
    detail: str = ""  # the exception of a traceback, the first line of an error


# ---------------------------------------------------------------------------------------------
# Generation


def examples() -> list[tuple[str, dict[str, Any]]]:
    paths = sorted((ROOT / "examples").glob("*.yaml"))
    return [(p.read_text(), load_documents(p.read_text())[0]) for p in paths]


def locations(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) inside a document."""
    out: list[tuple[Any, Any]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in items:
        out.append((node, key))
        out.extend(locations(child))
    return out


def random_text(rng: random.Random, size: int) -> str:
    pool = "abcXYZ019 -_./:" + "".join(c for c in ODD_CHARS if c != "\x00")
    return "".join(rng.choice(pool) for _ in range(size))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-3, 12)
    if kind == 3:
        return rng.choice([2**31, 2**63, 2**64, -(2**63) - 1, 10**39, 10 ** rng.randint(10, 400), 10**9, 10**7])
    if kind == 4:
        return rng.choice([1e-3, 1e39, float("nan"), float("inf"), -0.0, 1e308, 0.5, 2.0, -1.5])
    if kind == 5:
        return random_text(rng, rng.randint(0, 12))
    if kind == 6:
        return rng.choice(
            [
                "S0RR",
                "RRR",
                "S01RR",
                "RS0R",
                "gpt",
                "utransformer",
                "auto",
                "off",
                "on",
                "skip0",
                "broadcast",
                "greedy",
                "",
                "x" * rng.choice([100, 10_000, 1_000_000]),
            ]
        )
    if kind == 7:
        return "".join(rng.choice(ODD_CHARS) for _ in range(rng.randint(1, 8)))
    if kind == 8:
        return [rng.randint(0, 4096) for _ in range(rng.randint(0, 5))]
    if kind in (9, 10):
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {random_text(rng, rng.randint(1, 8)): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def normalized(path: str) -> str:
    """spec.stages[3].mesh[1] -> spec.stages[0].mesh[0]: the form bounded_fields() uses."""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
            out.append("[0")
        elif ch == "]":
            depth -= 1
            out.append("]")
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def paths_of(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, container, key) of every location, paths as in error messages."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in items:
        sub = f"{path}[{key}]" if isinstance(node, list) else (f"{path}.{key}" if path else str(key))
        yield sub, node, key
        yield from paths_of(child, sub)


BOUNDS = dict(bounded_fields())


def mutate_document(rng: random.Random, doc: dict[str, Any], mutation: str) -> None:
    for _ in range(rng.randint(1, 3)):
        places = locations(doc)
        container, key = rng.choice(places)
        if mutation == "set":
            container[key] = random_value(rng)
        elif mutation == "delete":
            del container[key]
        elif mutation == "add":
            target = container[key] if isinstance(container[key], dict) else doc
            target[random_text(rng, rng.randint(1, 10))] = random_value(rng)
        if not locations(doc):
            return


def set_bound(rng: random.Random, doc: dict[str, Any]) -> None:
    places = [(p, c, k) for p, c, k in paths_of(doc) if normalized(p) in BOUNDS]
    path, container, key = rng.choice(places)
    field = BOUNDS[normalized(path)]
    if field.maximum is not None:
        top = int(field.maximum)
        container[key] = rng.choice([top, top + 1, top * 2, top * 1000, 2**63, -1, top // 2])
    elif field.max_length is not None:  # a string's length is its only bound
        container[key] = "x" * (field.max_length + rng.choice([0, 1, 1000]))


def valid_tweak(rng: random.Random, doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    spec["training"]["steps"] = rng.randint(1, 1000)
    spec["training"]["seed"] = rng.randint(0, 2**32 - 1)
    resharding = spec.setdefault("resharding", {})
    resharding["chunks"] = rng.choice([1, 2, 4, 16, 64, 4096])
    resharding["balancer"] = rng.choice(["naive", "load_balance", "dfs", "greedy"])
    resharding["strategy"] = rng.choice(["send_recv", "local_allgather", "global_allgather", "broadcast", "signal"])
    resharding["budgetSeconds"] = 0.05  # dfs may use its whole budget: keep a valid case short
    spec["schedule"] = {
        "kind": rng.choice(["gpipe", "1f1b", "eager-1f1b"]),
        "weightGradDelay": rng.choice([0, 1, 2, "auto"]),
    }


def nested(depth: int) -> list[Any]:
    """`depth` levels of lists, built without recursion."""
    root: list[Any] = []
    node = root
    for _ in range(depth - 1):
        node.append([])
        node = node[0]
    return root


def alias_bomb(rng: random.Random) -> tuple[str, str]:
    """(anchor lines to put first, an alias of the last level)."""
    levels, width = rng.randint(2, 10), rng.randint(2, 10)
    lines = ["b0: &b0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"b{i}: &b{i} [" + ", ".join([f"*b{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n", f"*b{levels - 1}"


def edit_text(rng: random.Random, text: str, mutation: str) -> str:
    if mutation == "duplicate":
        lines = text.splitlines(keepends=True)
        keyed = [i for i, line in enumerate(lines) if ":" in line and not line.lstrip().startswith("#")]
        i = rng.choice(keyed)
        return "".join(lines[: i + 1] + [lines[i]] + lines[i + 1 :])
    if mutation == "unicode":
        for _ in range(rng.randint(1, 6)):
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(ODD_CHARS) * rng.randint(1, 3) + text[at:]
        return text
    for _ in range(rng.randint(1, 3)):  # edit
        at, cut = rng.randint(0, len(text)), rng.randint(0, 40)
        insert = rng.choice(["", text[at : at + cut] * rng.randint(1, 3), random_text(rng, rng.randint(1, 20))])
        text = text[:at] + insert + text[at + cut :]
    return text


def dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120)


def operator_body(text: str) -> Any:
    """The object the API server would give the operator for this text, or None when kubectl could
    not send it (not YAML, not a mapping, NaN or infinity, which JSON cannot carry)."""
    try:
        docs = load_documents(text)
    except SpecError:
        return None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        return None
    try:
        body = json.loads(json.dumps(docs[0], allow_nan=False))
    except (ValueError, TypeError):
        return None
    return server_side(body)


def server_side(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with the metadata the API server always sets: a mapping with a string name."""
    meta = body.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    body["metadata"] = {
        "name": name if isinstance(name, str) else "fuzz",
        "namespace": "default",
        "uid": "00000000-0000-0000-0000-000000000000",
        "generation": 1,
    }
    return body


def make_case(rng: random.Random, index: int, sources: Sequence[tuple[str, dict[str, Any]]]) -> Case:
    mutation = MUTATIONS[index % len(MUTATIONS)]
    text, original = rng.choice(sources)
    doc = copy.deepcopy(original)
    if mutation == "bytes":
        noise = rng.randbytes(rng.randint(1, 2000))
        data = noise if rng.random() < 0.5 else text.encode()[: rng.randint(0, len(text))] + noise
        return Case(index, mutation, data)
    body = None
    if mutation == "valid":
        valid_tweak(rng, doc)
    elif mutation in ("set", "delete", "add"):
        mutate_document(rng, doc, mutation)
    elif mutation == "bound":
        set_bound(rng, doc)
    prefix, raw = "", None
    if mutation in ("words", "nesting", "alias-bomb"):
        container, key = rng.choice(locations(doc))
        container[key] = HOLE
        if mutation == "words":
            raw = rng.choice(WORDS)
        elif mutation == "nesting":
            depth = rng.choice([10, 50, 63, 64, 65, 100, 500, 5000, 100_000])
            raw = "[" * depth + ("]" * depth if rng.random() < 0.8 else "")
            body = server_side(copy.deepcopy(doc))
            _replace_hole(body, nested(depth))
        else:
            prefix, raw = alias_bomb(rng)
            raw = raw if rng.random() < 0.7 else "x"
    text = prefix + dump(doc).replace(HOLE, raw if raw is not None else HOLE)
    if mutation in ("duplicate", "unicode", "edit"):
        text = edit_text(rng, text, mutation)
    data = text.encode("utf-8")
    return Case(index, mutation, data, body if body is not None else operator_body(text))


def _replace_hole(doc: Any, value: Any) -> None:
    for container, key in locations(doc):
        if container[key] == HOLE:
            container[key] = value
            return


def generate_cases(count: int, seed: int = 0) -> Iterator[Case]:
    rng = random.Random(seed)
    sources = examples()
    for index in range(count):
        yield make_case(rng, index, sources)


# ---------------------------------------------------------------------------------------------
# Running


class Overrun(BaseException):
    """Raised by SIGPROF (or SIGALRM) in a case that ran past its budget (BaseException: no `except
    Exception` on the way may swallow it)."""


WALL_FACTOR = 10  # wall-time backstop, in budgets: catches a case that waits instead of computing


@contextlib.contextmanager
def deadline(cpu_seconds: float) -> Iterator[None]:
    """Overrun after `cpu_seconds` of CPU time (user + system), or WALL_FACTOR times that in wall time."""

    def expire(signum: int, frame: Any) -> None:
        raise Overrun()

    timers = (
        (signal.SIGPROF, signal.ITIMER_PROF, cpu_seconds),
        (signal.SIGALRM, signal.ITIMER_REAL, cpu_seconds * WALL_FACTOR),
    )
    previous = [signal.signal(signum, expire) for signum, _, _ in timers]
    for _, timer, seconds in timers:
        signal.setitimer(timer, seconds)
    try:
        yield
    finally:
        for (signum, timer, _), handler in zip(timers, previous):
            signal.setitimer(timer, 0)
            signal.signal(signum, handler)


def timed(case: Case, path: str, budget_s: float, call: Callable[[], tuple[str, str]]) -> Result:
    began = time.perf_counter()
    try:
        with deadline(budget_s):
            outcome, detail = call()
    except Overrun:
        outcome, detail = "overrun", f"over {budget_s} CPU s (or {budget_s * WALL_FACTOR:g} s wall)"
    except Exception as err:  # the finding this benchmark exists for: report it, don't stop
        outcome, detail = "traceback", "".join(traceback.format_exception_only(err)).strip()[:500]
    return Result(case.index, case.mutation, path, outcome, time.perf_counter() - began, detail)


def plan_file(path: str) -> tuple[str, str]:
    """`meshjob plan PATH --json` in this process: (outcome, first line of stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = meshjob_main(["plan", path, "--json"])
    message = err.getvalue().strip()
    if code == 0 and out.getvalue().strip():
        return "ok", ""
    if code == 2 and message and "Traceback" not in message:
        return "error", message.splitlines()[-1][:300]
    return "traceback", f"exit {code}: {message[-500:]}"


def validate_body(body: Any) -> tuple[str, str]:
    try:
        validate(body)
    except SpecError as err:
        if not str(err).strip():
            return "traceback", "SpecError without a message"
        return "error", str(err).splitlines()[0][:300]
    return "ok", ""


def run_case(case: Case, budget_s: float, folder: str) -> list[Result]:
    path = os.path.join(folder, f"case-{case.index}.yaml")
    with open(path, "wb") as fh:
        fh.write(case.data)
    results = [timed(case, PATHS[0], budget_s, lambda: plan_file(path))]
    os.unlink(path)
    if case.operator_body is not None:
        results.append(timed(case, PATHS[1], budget_s, lambda: validate_body(case.operator_body)))
    return results


def run_cases(cases: Iterator[Case], budget_s: float, progress: Callable[[int], None] | None = None) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="meshjob-fuzz-") as folder:
        for n, case in enumerate(cases):
            results += run_case(case, budget_s, folder)
            if progress is not None:
                progress(n + 1)
    return results


# ---------------------------------------------------------------------------------------------
# Reporting


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: Sequence[Result], key: Callable[[Result], str]) -> list[dict[str, Any]]:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    rows = []
    for name, group in groups.items():
        times = [r.seconds for r in group]
        counts = {o: sum(1 for r in group if r.outcome == o) for o in OUTCOMES}
        rows.append(
            {
                "group": name,
                "cases": len(group),
                **counts,
                "p50_ms": percentile(times, 0.50) * 1e3,
                "p99_ms": percentile(times, 0.99) * 1e3,
                "max_ms": max(times) * 1e3,
                "mean_ms": statistics.fmean(times) * 1e3,
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]], title: str, first: str) -> None:
    table = Table(title=title)
    for col in (first, "cases", "ok", "clear errors", "tracebacks", "overruns", "p50 ms", "p99 ms", "max ms"):
        table.add_column(col, justify="left" if col == first else "right")
    for r in rows:
        table.add_row(
            r["group"],
            str(r["cases"]),
            str(r["ok"]),
            str(r["error"]),
            str(r["traceback"]),
            str(r["overrun"]),
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['max_ms']:.1f}",
        )
    Console(width=120).print(table)


def plot(results: Sequence[Result], path: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np  # with matplotlib: only the plot needs it

    fig, ax = plt.subplots(figsize=(8, 4.5))
    times = [max(r.seconds, 1e-5) for r in results]
    bins = np.logspace(np.log10(min(times)), np.log10(max(times) * 1.01), 50)
    for name in PATHS:
        mine = [max(r.seconds, 1e-5) * 1e3 for r in results if r.path == name]
        if mine:
            ax.hist(mine, bins=(bins * 1e3).tolist(), alpha=0.6, label=f"{name} ({len(mine)})")
    ax.set_xscale("log")
    ax.set_xlabel("time per case (ms, log scale)")
    ax.set_ylabel("cases")
    ax.axvline(1000, color="red", linestyle="--", linewidth=1, label="1 s target (p99)")
    ax.set_title("meshjob bench fuzz: time per generated/mutated manifest")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=int, default=1000, help="manifests to generate (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--budget",
        type=float,
        default=10.0,
        help="CPU seconds a case may take before it counts as an overrun (default 10)",
    )
    parser.add_argument(
        "--out", default=os.path.join("bench", "results"), help="folder for fuzz.json and fuzz_times.png"
    )


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    args = parsed_arguments(argv, "meshjob_bench.fuzz", __doc__, add_arguments)
    if args.cases < 1 or args.budget <= 0:
        raise SystemExit("bench fuzz: --cases must be >= 1 and --budget > 0")

    def progress(done: int) -> None:
        if done % 500 == 0 or done == args.cases:
            print(f"  {done}/{args.cases} cases", file=sys.stderr, flush=True)

    began = time.perf_counter()
    results = run_cases(generate_cases(args.cases, args.seed), args.budget, progress)
    elapsed = time.perf_counter() - began
    by_path = summarize(results, lambda r: r.path)
    by_mutation = summarize(results, lambda r: f"{r.mutation} / {'plan' if r.path == PATHS[0] else 'validate'}")
    by_mutation.sort(key=lambda row: (MUTATIONS.index(row["group"].split(" / ")[0]), row["group"]))
    print_table(by_path, f"fuzz: {args.cases} cases (seed {args.seed}), budget {args.budget:g} CPU s per case", "path")
    print_table(by_mutation, "by mutation", "mutation / path")
    failures = [asdict(r) for r in results if r.outcome in ("traceback", "overrun")]
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "fuzz.json"), os.path.join(args.out, "fuzz_times.png")
    config = {
        "cases": args.cases,
        "seed": args.seed,
        "budget_s": args.budget,
        "elapsed_s": elapsed,
        "mutations": list(MUTATIONS),
        "python": sys.version.split()[0],
    }
    with open(json_path, "w") as fh:
        json.dump(
            {"config": config, "by_path": by_path, "by_mutation": by_mutation, "failures": failures[:100]}, fh, indent=1
        )
    plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
