"""The guard of the engine-cost probe (meshjob_bench.engine_costs): was a probe disturbed, and which attempt to use.

The overlap threshold and `chunks: auto` follow the probe's figures, so one probe disturbed by another
process reshapes a whole run (one measured 1240 µs per message, all five rounds
0.85-1.78 ms, while a helper's process was still finishing; quiet runs 76-182 µs). Around each probe the
bench reads the machine's busy CPU (/proc/stat: user, nice, system, irq, softirq, steal, all cores) and its
own (this process and its waited children, the gang's ranks: getrusage); the rest is foreign CPU, the
direct measure of what else ran (the 1-minute load average at the start is recorded beside it). `judge`
finds a probe disturbed when any of these is over its limit (each check is its measure over its limit, the
severity the largest; above 1 is disturbed):
- foreign CPU above FOREIGN_CPU_MAX (0.25) of the cores over the probe: one other busy process is 0.5 of
  2 cores; a burst short enough for the median over the rounds to absorb (under two rounds' worth) stays
  below it.
- per-message link time between hosts outside EMULATED_MESSAGE_S (120 µs, nominal) / MESSAGE_S_FACTOR .. *
  MESSAGE_S_FACTOR (4: 30-480 µs): quiet probes measured 76-182 µs (0.6-1.5x nominal), the disturbed one
  1240 µs (10x); 4x leaves 2.6x headroom over the quiet ones and 2.6x under it.
- rounds disagreeing: EngineCosts.spread_ratio of message_s or message_cpu_s above SPREAD_MAX (8): quiet
  runs spread 2.4-5.5x (one bad round; the median leaves it out) and 1.2x; above 8x (or a round fitted 0)
  the median is a draw between rounds. (A probe slowed throughout, as the 1240 µs one, agrees with itself:
  the other two checks catch it.)
Through the TCP wire (`--transport tcp`) a message has next to no link time of its own (a 16-byte header,
an 8-byte grant back): rounds fit it anywhere from 0 to 40 µs, so the two checks on it are left out and
its rounds are judged by their CPU alone. The same at any NIC rate but the nominal one (NOMINAL_NIC_RATE, where
EMULATED_MESSAGE_S was measured; `nominal_message_s_for`): at 250mbit every round of a quiet probe fitted 0 µs (a
16 KiB message's bytes take 0.5 ms there and the messages in flight hide the gap between them), which the
link-time checks took for a disturbance, three attempts in a row.
A disturbed probe is retried after waiting up to QUIET_WAIT_S for the machine to quiet down (foreign CPU
below the limit over a QUIET_WINDOW_S window), up to PROBE_ATTEMPTS attempts in all (one in --quick runs);
the first undisturbed attempt is used, else the least severe one, said loudly on stdout and in the JSON
(message_costs: `attempts`, each with its costs, machine, verdict and reasons, `used_attempt`, `disturbed`).
A probe that fails (its gang did not finish) is not retried: that is an error, not a disturbance.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshjob.network.model import EMULATED_MESSAGE_S
from meshjob_bench.engine_costs import EngineCosts

# Limits and retries (module docstring)
FOREIGN_CPU_MAX = 0.25  # foreign CPU over the probe, fraction of the machine's cores
MESSAGE_S_FACTOR = 4.0  # sane per-message link time: EMULATED_MESSAGE_S / 4 .. * 4
SPREAD_MAX = 8.0  # most over least over the rounds, of each SPREAD_TERMS
SPREAD_TERMS = ("message_s", "message_cpu_s")
PROBE_ATTEMPTS = 3  # in all, the first included (--quick: 1)
QUIET_WAIT_S = 15.0  # longest wait for the machine to quiet down before a retry
QUIET_WINDOW_S = 1.0
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu line: user nice system [idle iowait] irq softirq steal
NOMINAL_NIC_RATE = 1e9 / 8  # bytes per second: the NIC rate EMULATED_MESSAGE_S holds at (1gbit)


def nominal_message_s_for(transport: str, nic_bytes_per_s: float) -> float | None:
    """The per-message link time a quiet probe measures near (judge), or None where none is known: the TCP
    wire, or a NIC rate other than NOMINAL_NIC_RATE (the module docstring)."""
    if transport == "tcp" or not math.isclose(nic_bytes_per_s, NOMINAL_NIC_RATE, rel_tol=0.01):
        return None
    return EMULATED_MESSAGE_S


@dataclass(frozen=True)
class CpuSnapshot:
    at_s: float  # time.monotonic()
    machine_busy_s: float  # busy CPU of every core since boot (/proc/stat, BUSY_FIELDS)
    own_s: float  # CPU of this process and its waited children (user + system)


def machine_busy_s(proc_stat: str, ticks_per_s: float) -> float:
    """Busy CPU seconds of all cores together from the text of /proc/stat (its first, "cpu", line)."""
    first = proc_stat.splitlines()[0].split()
    if not first or first[0] != "cpu":
        raise ValueError(f"/proc/stat: first line {' '.join(first[:3])!r} is not the 'cpu' total")
    values = [int(v) for v in first[1:]]
    return sum(values[i] for i in BUSY_FIELDS if i < len(values)) / ticks_per_s


def cpu_snapshot() -> CpuSnapshot:
    with open("/proc/stat") as f:
        busy = machine_busy_s(f.read(), os.sysconf("SC_CLK_TCK"))
    own = sum(
        u.ru_utime + u.ru_stime
        for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    return CpuSnapshot(time.monotonic(), busy, own)


@dataclass(frozen=True)
class Machine:
    """What the machine did while the probe ran."""

    wall_s: float
    machine_cpu_s: float  # busy CPU of every core
    own_cpu_s: float  # the bench's own: this process and the gang's ranks
    cores: int
    load_1m_at_start: float

    @property
    def foreign_cpu_s(self) -> float:
        return max(0.0, self.machine_cpu_s - self.own_cpu_s)

    @property
    def foreign_fraction(self) -> float:
        """Foreign CPU over the interval's capacity (wall time x cores)."""
        return self.foreign_cpu_s / (self.wall_s * self.cores) if self.wall_s > 0 and self.cores > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "machine_cpu_s": self.machine_cpu_s,
            "own_cpu_s": self.own_cpu_s,
            "foreign_cpu_s": self.foreign_cpu_s,
            "foreign_fraction": self.foreign_fraction,
            "cores": self.cores,
            "load_1m_at_start": self.load_1m_at_start,
        }


def between(start: CpuSnapshot, end: CpuSnapshot, cores: int, load_1m_at_start: float = math.nan) -> Machine:
    return Machine(
        end.at_s - start.at_s,
        end.machine_busy_s - start.machine_busy_s,
        end.own_s - start.own_s,
        cores,
        load_1m_at_start,
    )


@dataclass(frozen=True)
class Verdict:
    disturbed: bool
    severity: float  # the largest check; above 1 is disturbed
    checks: dict[str, float]  # each check's measure over its limit
    reasons: tuple[str, ...]  # one line per check above its limit

    def to_json(self) -> dict[str, Any]:
        return {
            "disturbed": self.disturbed,
            "severity": self.severity,
            "checks": dict(self.checks),
            "reasons": list(self.reasons),
        }


def judge(costs: EngineCosts, machine: Machine, nominal_message_s: float | None = EMULATED_MESSAGE_S) -> Verdict:
    """Was this probe disturbed? (the module docstring: foreign CPU, per-message link time, rounds).
    `nominal_message_s` None: no per-message link time is known for the wire and NIC rate (the TCP wire: a
    few µs, which rounds fit anywhere from 0 to 40 µs; a NIC slower than nominal: 0 µs, the gaps hidden), so
    neither it nor its spread is checked, only the CPU (`nominal_message_s_for` says which)."""
    checks: dict[str, float] = {}
    reasons = []
    checks["foreign_cpu"] = machine.foreign_fraction / FOREIGN_CPU_MAX
    if checks["foreign_cpu"] > 1:
        reasons.append(
            f"foreign CPU {machine.foreign_cpu_s:.1f} s in {machine.wall_s:.0f} s = "
            f"{machine.foreign_fraction:.2f} of the {machine.cores} cores (limit {FOREIGN_CPU_MAX:g})"
        )
    m = costs.message_s
    if nominal_message_s is not None:
        off = max(m / nominal_message_s, nominal_message_s / m) if m > 0 else math.inf
        checks["message_s"] = off / MESSAGE_S_FACTOR
        if checks["message_s"] > 1:
            reasons.append(
                f"per-message link time {m * 1e6:.0f} µs is {m / nominal_message_s:.2g}x the nominal "
                f"EMULATED_MESSAGE_S {nominal_message_s * 1e6:.0f} µs (sane: 1/{MESSAGE_S_FACTOR:g} to "
                f"{MESSAGE_S_FACTOR:g}x)"
            )
    for term in SPREAD_TERMS if nominal_message_s is not None else ("message_cpu_s",):
        checks[f"spread_{term}"] = costs.spread_ratio(term) / SPREAD_MAX
        if checks[f"spread_{term}"] > 1:
            reasons.append(
                f"rounds disagree: {term} {costs.range_text(term, 1e6)} µs over the {costs.rounds} rounds, "
                f"{costs.spread_ratio(term):.3g}x (limit {SPREAD_MAX:g}x)"
            )
    severity = max(checks.values())
    return Verdict(severity > 1, severity, checks, tuple(reasons))


@dataclass(frozen=True)
class Attempt:
    costs: EngineCosts
    machine: Machine
    verdict: Verdict
    waited_s: float = 0.0  # waiting for quiet before it
    quiet_fraction: float = math.nan  # foreign CPU of the last window waited (fraction of the cores)

    def to_json(self) -> dict[str, Any]:
        return {
            "costs": self.costs.to_json(),
            "machine": self.machine.to_json(),
            "verdict": self.verdict.to_json(),
            "waited_s": self.waited_s,
            "quiet_fraction": self.quiet_fraction,
        }


def choose(attempts: Sequence[Attempt]) -> int:
    """The attempt to plan with: the last undisturbed one, else the least severe (the earliest of equals)."""
    if not attempts:
        raise ValueError("attempts: empty; the probe ran at least once")
    quiet = [i for i, a in enumerate(attempts) if not a.verdict.disturbed]
    if quiet:
        return quiet[-1]
    return min(range(len(attempts)), key=lambda i: attempts[i].verdict.severity)


@dataclass(frozen=True)
class GuardedCosts:
    attempts: tuple[Attempt, ...]
    used: int  # index into attempts
    nominal_message_s: float | None = EMULATED_MESSAGE_S  # what judge held the link time to (None: not judged)

    @property
    def costs(self) -> EngineCosts:
        return self.attempts[self.used].costs

    @property
    def disturbed(self) -> bool:
        return self.attempts[self.used].verdict.disturbed

    def to_json(self) -> dict[str, Any]:
        """The used attempt's costs (EngineCosts.to_json) with every attempt and the guard's limits."""
        return {
            **self.costs.to_json(),
            "used_attempt": self.used,
            "disturbed": self.disturbed,
            "attempts": [a.to_json() for a in self.attempts],
            "guard": {
                "foreign_cpu_max": FOREIGN_CPU_MAX,
                "message_s_factor": MESSAGE_S_FACTOR,
                "nominal_message_s": self.nominal_message_s,
                "spread_max": SPREAD_MAX,
                "spread_terms": list(SPREAD_TERMS),
            },
        }

    def describe(self) -> str:
        """One line for stdout: which attempt is used and why; loud when it was disturbed."""
        used = self.attempts[self.used]
        of = f"attempt {self.used + 1} of {len(self.attempts)}"
        if not self.disturbed:
            m = used.machine
            return (
                f"engine probe: {of} used, undisturbed (foreign CPU {m.foreign_fraction:.2f} of "
                f"{m.cores} cores, load {m.load_1m_at_start:.2f} at its start"
                + (
                    f"; {self.used} disturbed before it: "
                    + "; ".join(
                        f"{i + 1}: {', '.join(a.verdict.reasons)}" for i, a in enumerate(self.attempts[: self.used])
                    )
                    if self.used
                    else ""
                )
                + ")"
            )
        return (
            f"WARNING: engine probe DISTURBED on all {len(self.attempts)} attempt(s); planning with the least "
            f"disturbed, {of}: {'; '.join(used.verdict.reasons)}. The figures below and every plan of this "
            f"run follow a disturbed probe (message_costs.disturbed in the JSON)"
        )


def wait_for_quiet(
    max_s: float,
    cores: int,
    snapshot: Callable[[], CpuSnapshot] = cpu_snapshot,
    sleep: Callable[[float], None] = time.sleep,
    window_s: float = QUIET_WINDOW_S,
) -> tuple[float, float]:
    """Wait, window by window, until the foreign CPU of a window is at most FOREIGN_CPU_MAX of the cores, or
    `max_s` has passed; (seconds waited, the last window's foreign fraction)."""
    first = last = snapshot()
    fraction = math.nan
    while last.at_s - first.at_s < max_s:
        sleep(window_s)
        now = snapshot()
        fraction = between(last, now, cores).foreign_fraction
        last = now
        if fraction <= FOREIGN_CPU_MAX:
            break
    return last.at_s - first.at_s, fraction


def guarded_probe(
    probe: Callable[[], EngineCosts | None],
    attempts: int = PROBE_ATTEMPTS,
    cores: int | None = None,
    snapshot: Callable[[], CpuSnapshot] = cpu_snapshot,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
    sleep: Callable[[float], None] = time.sleep,
    nominal_message_s: float | None = EMULATED_MESSAGE_S,
) -> GuardedCosts | None:
    """Run `probe` (None: it failed) until an attempt is undisturbed or `attempts` ran, waiting for quiet
    before each retry; None if a probe failed. `nominal_message_s`: see judge."""
    if attempts < 1:
        raise ValueError(f"attempts: {attempts} is invalid: an integer >= 1")
    cores = cores or os.cpu_count() or 1
    done: list[Attempt] = []
    for i in range(attempts):
        waited, quiet = wait_for_quiet(QUIET_WAIT_S, cores, snapshot, sleep) if i else (0.0, math.nan)
        at_start, start = load(), snapshot()
        costs = probe()
        machine = between(start, snapshot(), cores, at_start)
        if costs is None:
            return None
        done.append(Attempt(costs, machine, judge(costs, machine, nominal_message_s), waited, quiet))
        if not done[-1].verdict.disturbed:
            break
    return GuardedCosts(tuple(done), choose(done), nominal_message_s)
