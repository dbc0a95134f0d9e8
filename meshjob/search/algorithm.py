"""`meshjob tune`'s search: stage cuts, submeshes, parallel splits, microbatches, schedule and resharding
settings that minimise the predicted step time within each device's memory.

Objective (`predict`): the job's plan (meshjob.plan.build) run through meshjob.simulate.simulator's pipeline model with
each stage's compute from meshjob.search.stage_model (meshjob.costs.device_costs' roofline, tensor-parallel all-reduces
included), then each stage's tail after its last action (meshjob.search.gradient_sync: its gradient all-reduce,
sharing NICs with the other stages' on the same hosts, then its optimizer step): step = the last tail's end.
Constraint: every stage's bytes per device (meshjob.search.memory_model, with the stash its schedule keeps:
the warm-up forwards, and with split backward eager-1F1B's bound min(M, 2S - 1), the most the weight
delay may stash) at most the device's memory.

Structure (Alpa's stage construction, then a full simulation to rank):
1. a lower bound every candidate's simulated step keeps: stage k cannot finish before the forwards of
   the stages ahead of it reach it and it has computed all M microbatches, so
   step >= LB = max_k max(sum_{j<k} F_j + M (F_k + B_k) + tail_k, NIC_k), where tail_k (all-reduce with its
   hosts to itself, optimizer step) only grows when stages share NICs, and NIC_k is the time a
   stage on whole hosts (they are its own) needs to receive its M inputs and gradients through them;
2. dynamic programming over (stages left, first layer) with the submesh and split enumerated per layer
   range: the fewest devices that cover the remaining layers with every stage's M (F + B) + allreduce
   at most a threshold T. Bisecting T gives, per microbatch count and schedule, the least bottleneck
   any plan reaches on the cluster's devices;
3. branch and bound: every candidate (cuts, submeshes, splits, microbatches, schedule, strategy,
   balancer) whose LB is at most T is listed by a depth-first walk that the DP prunes (the rest must fit
   the devices left), then simulated in the order of Alpa's estimate (sum of stage times + (M - 1) x the
   largest, with their NIC time; `Problem.estimate`); a candidate whose LB is not below the best step
   found is skipped. If the best step exceeds T, T rises to it and the walk repeats, so every candidate
   that could beat the winner was simulated: the result equals exhaustive enumeration of the same space
   (`exhaustive`, for tests and `meshjob bench tune`). Large spaces stop at `max_evaluations`
   simulations, `max_candidates` listed or WALK_NODES stage choices tried per walk, and say so
   (`Result.proven` False, with the least lower bound of what was not simulated).
Everything iterates in sorted order and ties break on the candidate's key: the same inputs give the
same result in every process. The space, its candidates and the objective: meshjob.search.problem; the
per-stage tables and the DP over them: meshjob.search.tables.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from meshjob.errors import UsageError
from meshjob.search.problem import (
    DEFAULT_MAX_MICROBATCHES,
    DEFAULT_MAX_STAGES,
    Candidate,
    Fixed,
    Prediction,
    Problem,
    Space,
    StageFix,
    default_space,
)
from meshjob.search.stage_model import StageChoice
from meshjob.search.tables import INF, stash_from_end, stashed
from meshjob.spec.manifest import MAX_SCHEDULE_CELLS

# what callers of the search import from here with it
__all__ = [
    "DEFAULT_MAX_CANDIDATES",
    "DEFAULT_MAX_EVALUATIONS",
    "DEFAULT_MAX_MICROBATCHES",
    "DEFAULT_MAX_STAGES",
    "Candidate",
    "Fixed",
    "Infeasible",
    "Prediction",
    "Problem",
    "Result",
    "Space",
    "StageFix",
    "default_space",
    "exhaustive",
    "search",
]

DEFAULT_MAX_EVALUATIONS = 100
DEFAULT_MAX_CANDIDATES = 20000
WALK_NODES = 4000  # stage choices one walk (microbatches, schedule, stage count) may try

Group = tuple[int, str, int | str]  # (microbatches, schedule kind, weight-gradient delay)
Listed = tuple[float, int, float, Candidate]  # (estimate, strategy/balancer index, lower bound, candidate)


# ------------------------------------------------------------------------------ the search
@dataclass(frozen=True)
class Result:
    ranked: tuple[Prediction, ...]  # best first
    evaluated: int  # simulations run
    listed: int  # candidates the walk listed
    proven: bool  # every candidate that could beat the winner was simulated
    threshold_s: float  # every candidate not simulated has a lower bound at least this (INF: none left)
    best_bound_s: float  # the least lower bound of any candidate (the DP's)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


class Infeasible(UsageError):
    """No candidate fits in the devices' memory."""


Progress = Callable[[str, int, int], None]  # (phase, done, total)


def search(
    problem: Problem,
    top: int = 5,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    progress: Progress | None = None,
) -> Result:
    groups = _groups(problem)
    best_bounds = _least_bottlenecks(problem, groups, progress)
    finite = [b for b in best_bounds.values() if b < INF]
    if not finite:
        raise _infeasible(problem, groups)
    floor = min(finite)
    threshold = floor * (1 + 1e-9)
    seen: dict[Candidate, Prediction | None] = {}
    listed, proven = 0, False
    listing: list[Listed] = []
    while True:
        listing, complete = _list(problem, groups, best_bounds, threshold, max_candidates)
        listed = max(listed, len(listing))
        budget_hit = _evaluate(problem, listing, seen, max_evaluations, progress)
        best = min((p.step_s for p in seen.values() if p is not None), default=INF)
        if budget_hit or (not complete and best < INF):
            break
        if best <= threshold:
            proven = True
            break
        # nothing simulated beats T yet: raise T to the best step (every candidate that could still win
        # has LB below it), or, before any candidate was found, by 25% (LB adds the forwards ahead)
        threshold = best * (1 + 1e-9) if best < INF else threshold * 1.25
        if threshold > floor * 1e6:  # nothing placeable within a million times the bound
            break
    found = sorted((p for p in seen.values() if p is not None), key=lambda p: (p.step_s, p.candidate))
    if not found:
        if seen:
            raise Infeasible("no candidate plan fits the cluster's hosts (placement failed for every one tried)")
        raise Infeasible(
            f"no plan keeps the fields the manifest fixed ({_fixed_text(problem.fixed)}) on "
            f"{problem.cluster.hosts} hosts x {problem.cluster.devices_per_host} devices within "
            f"{_gib(problem.cluster.memory)} per device: leave more of them to the search"
        )
    rest = min([lb for _, _, lb, c in listing if c not in seen] + [threshold])
    return Result(tuple(_distinct(found)[:top]), len(seen), listed, proven, INF if proven else rest, floor)


def _distinct(ranked: Sequence[Prediction]) -> list[Prediction]:
    """The best strategy and balancer of each structure (stages, meshes, microbatches, schedule)."""
    out: list[Prediction] = []
    shown: set[tuple[int, str, str, tuple[int, ...], tuple[StageChoice, ...]]] = set()
    for p in ranked:
        c = p.candidate
        key = (c.microbatches, c.kind, c.delay, c.layers, c.choices)
        if key not in shown:
            shown.add(key)
            out.append(p)
    return out


def _fixed_text(fixed: Fixed) -> str:
    parts = []
    if fixed.stages is not None:
        parts.append(f"{fixed.stages} stages")
        parts += [f"stages[{i}].layers {list(f.layers)}" for i, f in enumerate(fixed.per_stage) if f.layers]
        parts += [f"stages[{i}].mesh {list(f.choice.mesh)}" for i, f in enumerate(fixed.per_stage) if f.choice]
    for name in ("microbatches", "kind", "weight_grad_delay", "strategy", "balancer"):
        if getattr(fixed, name) is not None:
            parts.append(f"{name} {getattr(fixed, name)}")
    return ", ".join(parts) or "none"


def _groups(problem: Problem) -> list[Group]:
    out: list[Group] = []
    for m in problem.space.microbatches:
        for kind, delay in problem.space.schedules:
            out.append((m, kind, delay))
    return out


def _least_bottlenecks(problem: Problem, groups: Sequence[Group], progress: Progress | None) -> dict[Group, float]:
    """Per group (microbatches, schedule): the least max-stage term any plan reaches (bisection on the DP)."""
    out: dict[Group, float] = {}
    by_stash: dict[tuple[int, str], float] = {}
    hi = INF
    for i, (m, kind, delay) in enumerate(groups):
        key = (m, kind)
        if key not in by_stash:
            by_stash[key] = _bisect_bottleneck(problem, m, kind, hi)
            hi = min(hi, by_stash[key]) if by_stash[key] < INF else hi
        out[(m, kind, delay)] = by_stash[key]
        if progress:
            progress("bounds", i + 1, len(groups))
    return out


def _feasible(problem: Problem, m: int, kind: str, threshold: float, key: str = "time") -> bool:
    t = problem.tables(m)
    counts = [s for s in problem.stage_counts() if s * m <= MAX_SCHEDULE_CELLS and s <= problem.job.model.layers]
    if not counts:
        return False
    g = t.fewest_devices(kind, threshold, max(counts), key)
    return any(g[s][0] <= problem.cluster.devices for s in counts)


def _bisect_bottleneck(problem: Problem, m: int, kind: str, hi: float) -> float:
    """The least threshold at which the DP fits the devices, to a relative 1e-6; INF if none does."""
    values = sorted({o.bound_s for key in _option_keys(problem, m) for o in problem.tables(m).options(*key)})
    if not values or not _feasible(problem, m, kind, values[-1]):
        return INF
    if hi < INF and not _feasible(problem, m, kind, hi):
        return hi  # worse than a group already found: hi is a lower bound of its own, all the listing needs
    lo_i, hi_i = 0, len(values) - 1  # the answer is one of the option values
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if _feasible(problem, m, kind, values[mid]):
            hi_i = mid
        else:
            lo_i = mid + 1
    return values[lo_i]


def _option_keys(problem: Problem, m: int) -> list[tuple[int, bool, bool]]:
    n = problem.job.model.layers
    keys = [(n, True, True)]
    for layers in range(1, n):
        keys += [(layers, True, False), (layers, False, True), (layers, False, False)]
    return keys


def _list(
    problem: Problem, groups: Sequence[Group], best_bounds: Mapping[Group, float], threshold: float, max_candidates: int
) -> tuple[list[Listed], bool]:
    """Every candidate with LB <= threshold (up to max_candidates) as (estimate, strategy/balancer index,
    LB, candidate), sorted: the order they are simulated in."""
    out: list[Listed] = []
    complete = True
    live = [g for g in groups if best_bounds[g] <= threshold]
    per_stage_count = max(8, max_candidates // max(1, len(live) * len(problem.stage_counts())))
    for m, kind, delay in live:
        for stages in problem.stage_counts():
            for n, structure in enumerate(_walk(problem, m, kind, delay, threshold, stages)):
                if n == per_stage_count or structure is None:
                    complete = False  # this stage count has more: listed the first (balanced cuts first)
                    break
                lb, est = problem.bound(structure), problem.estimate(structure)
                for i, c in enumerate(problem.expand(m, kind, delay, structure.layers, structure.choices)):
                    out.append((est, i, lb, c))
    out.sort()
    return out, complete


def _walk(
    problem: Problem, m: int, kind: str, delay: int | str, threshold: float, stages: int
) -> Iterator[Candidate | None]:
    """Depth-first over cuts and choices of `stages` stages with LB <= threshold, pruned by the DP's device
    count; stage sizes nearest an even split first, options by their bound; None last where the walk stopped
    at its budget."""
    t = problem.tables(m)
    n, devices, cap = problem.job.model.layers, problem.cluster.devices, problem.cluster.memory
    split = delay != 0
    if stages > n or stages * m > MAX_SCHEDULE_CELLS:
        return
    g = t.fewest_devices(kind, threshold, max(problem.stage_counts()))
    if g[stages][0] > devices:
        return
    per_layer = t.least_per_layer()
    tried = [0]

    def step(
        k: int, a: int, used: int, prefix: float, layers: list[int], chosen: list[StageChoice]
    ) -> Iterator[Candidate]:
        left = stages - k
        if left == 0:
            yield Candidate(m, kind, str(delay), tuple(layers), tuple(chosen))
            return
        even = (n - a) / left
        sizes = [n - a] if left == 1 else sorted(range(1, n - a - left + 2), key=lambda x: (abs(x - even), x))
        for size in sizes:
            first, last = a == 0, a + size == n
            rest = g[left - 1][a + size] if left > 1 else 0
            if used + rest >= devices + 1:
                continue
            if left > 1 and prefix + per_layer.forward_s * (n - a - 1) + per_layer.bound_s > threshold:
                continue  # the last stage's term: the forwards ahead of it, then at least one layer M times
            stash = stashed(kind, split, k, stages, m)
            for o in t.options(size, first, last):
                tried[0] += 1
                if tried[0] > WALK_NODES:
                    raise _WalkBudget
                if o.bound_s > threshold:
                    break  # options are sorted by bound_s
                if o.term_s(prefix) > threshold:
                    continue
                nd = o.choice.devices
                if used + nd + rest > devices or o.memory(stash) > cap:
                    continue
                if not problem.stage_allowed(k, stages, a, a + size, o.choice):
                    continue
                layers.append(size)
                chosen.append(o.choice)
                yield from step(k + 1, a + size, used + nd, prefix + o.figures.cost.forward_s, layers, chosen)
                layers.pop()
                chosen.pop()

    try:
        yield from step(0, 0, 0, 0.0, [], [])
    except _WalkBudget:
        yield None  # the walk stopped at its budget: what it did not reach is not listed


class _WalkBudget(Exception):
    """A walk tried WALK_NODES stage choices."""


def _evaluate(
    problem: Problem,
    listing: Sequence[Listed],
    seen: dict[Candidate, Prediction | None],
    max_evaluations: int,
    progress: Progress | None,
) -> bool:
    """Simulate in the listing's order, skipping what cannot beat the best (LB >= best step); True if the
    budget ran out."""
    best = min((p.step_s for p in seen.values() if p is not None), default=INF)
    todo = [(lb, c) for _, _, lb, c in listing if c not in seen]
    for i, (lb, c) in enumerate(todo):
        if lb >= best:
            continue
        if len(seen) >= max_evaluations:
            return True
        p = problem.predict(c)
        seen[c] = p
        if p is not None and p.step_s < best:
            best = p.step_s
        if progress:
            progress("simulate", len(seen), min(max_evaluations, len(seen) + len(todo) - i - 1))
    return False


def _infeasible(problem: Problem, groups: Sequence[Group]) -> Infeasible:
    """The smallest memory overflow any plan reaches: bisection of the DP keyed by bytes over capacity."""
    least = INF
    for m, kind in sorted({(m, k) for m, k, _ in groups}):
        t = problem.tables(m)
        values = sorted(
            {
                float(o.memory(s) - problem.cluster.memory)
                for key in _option_keys(problem, m)
                for o in t.options(*key)
                for s in {stash_from_end(kind, j, m) for j in range(1, problem.space.max_stages + 1)}
            }
        )
        ok = [v for v in values if _feasible(problem, m, kind, v, "overflow")]
        if ok:
            least = min(least, ok[0])
    if least == INF:
        return Infeasible(
            f"no plan fits: the model needs more devices than the cluster's {problem.cluster.devices} "
            f"even before memory (each stage needs at least one device)"
        )
    return Infeasible(
        f"the model does not fit in memory on {problem.cluster.hosts} hosts x "
        f"{problem.cluster.devices_per_host} devices with {_gib(problem.cluster.memory)} each: the "
        f"smallest overflow found is {_gib(least)} on the fullest device (of every plan of the space); "
        f"use more hosts, devices with more memory, bf16 is no help (fp32 master weights), "
        f"training.recompute: full, or optimizer.zeroStage: 1"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------ exhaustive
def exhaustive(problem: Problem) -> Prediction:
    """Every candidate of the space, simulated: what the search must equal (small spaces only)."""
    best: Prediction | None = None
    n, devices, cap = problem.job.model.layers, problem.cluster.devices, problem.cluster.memory
    for m, kind, delay in _groups(problem):
        t = problem.tables(m)
        for stages in problem.stage_counts():
            if stages > n or stages * m > MAX_SCHEDULE_CELLS:
                continue
            for cuts in itertools.combinations(range(1, n), stages - 1):
                bounds = (0,) + cuts + (n,)
                sizes = [bounds[i + 1] - bounds[i] for i in range(stages)]
                for choices in itertools.product(t.choices, repeat=stages):
                    if sum(c.devices for c in choices) > devices:
                        continue
                    for c in problem.expand(m, kind, delay, sizes, choices):
                        if not all(
                            problem.stage_allowed(k, stages, bounds[k], bounds[k + 1], ch)
                            for k, ch in enumerate(choices)
                        ):
                            continue
                        if max(problem.memory(c)) > cap:
                            continue
                        p = problem.predict(c)
                        if p is not None and (best is None or (p.step_s, c) < (best.step_s, best.candidate)):
                            best = p
    if best is None:
        raise Infeasible("no candidate fits")
    return best
