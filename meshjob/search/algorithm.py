"""`meshjob tune`'s search: stage cuts, submeshes, parallel splits, microbatches, schedule and resharding
settings that minimise the predicted step time within each device's memory.

Objective (`predict`): the candidate's written manifest predicted as `meshjob simulate` predicts it
(meshjob.search.job_step: its plan simulated with each stage's compute from meshjob.search.stage_model, then each
stage's gradient all-reduce and optimizer step): step = the last tail's end.
Constraint: every stage's bytes per device (meshjob.search.memory_model, ZeRO-1's sharded optimizer state
included) with the microbatches its schedule holds at its peak, counted on the action list (a delayed W keeps its
microbatch's activations: meshjob.search.tables.stashed before the plan, the plan's own lists after) at most the
device's memory.

Structure (Alpa's stage construction, shallow seeds, then simulation in the order of a bound):
1. a lower bound every candidate's predicted step keeps (`Problem.bound`): stage k cannot start before
   microbatch 0's forwards and transfers ahead of it reached it, nor its first backward before that
   microbatch's round trip through the later stages (their forwards, input gradients and a transfer each way
   per boundary, each at least one message with its bytes: `Problem.transfer_floor_s`); it computes
   M (F + B), then its tail (all-reduce with its hosts to itself, optimizer step); and a stage on whole hosts
   needs its NICs for its M inputs and gradients (NIC_k);
2. dynamic programming over (stages left, first layer) with the submesh and split enumerated per layer
   range: the fewest devices that cover the remaining layers with every stage's M (F + B) + allreduce
   at most a threshold T. Bisecting T gives, per microbatch count and schedule, the least bottleneck
   any plan reaches on the cluster's devices (the floor of every bound);
3. seeds: per microbatch count and schedule, the most even cut of 1 to SEED_STAGES stages, each stage its
   best option, simulated least bound first (the DP's bottleneck favours deep pipelines, whose transfers
   and bubbles it does not see); T starts at the best seed's step;
4. branch and bound: every candidate (cuts, submeshes, splits, microbatches, schedule, strategy,
   balancer) whose stage terms fit under T is listed by a depth-first walk that the DP prunes (the rest
   must fit the devices left), then simulated least bound first until the bound reaches the best step found.
   If the best step exceeds T, T rises to it and the walk repeats, so every candidate that could beat the
   winner was simulated: the result equals exhaustive enumeration of the same space (`exhaustive`, for tests
   and `meshjob bench tune`). Large spaces stop at `max_evaluations` simulations, `max_candidates` listed
   or WALK_NODES stage choices tried per walk, and say so (`Result.proven` False, `Result.gap`: the best
   step over the least lower bound of what was not simulated).
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
SEED_STAGES = 3  # the stage counts of the seeds: shallow pipelines, which the DP's bottleneck overlooks
SEEDS = 12  # seeds simulated before the listing (the best by bound)

Group = tuple[int, str, int | str]  # (microbatches, schedule kind, weight-gradient delay)
Listed = tuple[float, float, int, Candidate]  # (lower bound, estimate, strategy/balancer index, candidate)


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

    @property
    def gap(self) -> float:
        """The optimality gap: how much slower the best found may be than the best of the space (0: proven)."""
        if self.proven or self.threshold_s >= self.best.step_s:
            return 0.0
        return self.best.step_s / self.threshold_s - 1 if self.threshold_s > 0 else INF


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
    seen: dict[Candidate, Prediction | None] = {}
    # shallow, balanced pipelines first: a good step early prunes every deep plan whose bound passes it
    _evaluate(problem, _seeds(problem, groups), seen, min(max_evaluations, SEEDS), progress)
    budget_hit = len(seen) >= max_evaluations
    best = _best(seen)
    threshold = (best if best < INF else floor) * (1 + 1e-9)
    listed, proven, complete = 0, False, False  # complete: the last listing had every candidate under T
    listing: list[Listed] = []
    while not budget_hit:
        listing, complete = _list(problem, groups, best_bounds, threshold, max_candidates)
        listed = max(listed, len(listing))
        budget_hit = _evaluate(problem, listing, seen, max_evaluations, progress)
        best = _best(seen)
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
    # what was not simulated: the listed by their bounds, the unlisted above T (or, where the listing was
    # cut short, anywhere above the DP's least bottleneck)
    rest = min([lb for lb, _, _, c in listing if c not in seen] + [threshold if complete else floor])
    return Result(tuple(_distinct(found)[:top]), len(seen), listed, proven, INF if proven else rest, floor)


def _best(seen: Mapping[Candidate, Prediction | None]) -> float:
    return min((p.step_s for p in seen.values() if p is not None), default=INF)


def _seeds(problem: Problem, groups: Sequence[Group]) -> list[Listed]:
    """Per group (microbatches, schedule): the walk's first structure of 1 to SEED_STAGES stages (the most
    even cut, each stage its best-bound option), and uniform pipelines: every stage count and stage choice,
    the layers cut evenly, every stage on the same choice (Megatron's layouts among them); each with the
    first strategy and balancer in each stage order, sorted by bound, as the search simulates them."""
    out: dict[Candidate, Listed] = {}
    n, devices = problem.job.model.layers, problem.cluster.devices

    def add(m: int, kind: str, delay: int | str, layers: Sequence[int], choices: Sequence[StageChoice]) -> None:
        first = {c.stage_order: c for c in reversed(problem.expand(m, kind, delay, layers, choices))}
        for c in first.values():  # each stage order with the first strategy and balancer
            if c not in out and max(problem.memory(c)) <= problem.cluster.memory:
                out[c] = (problem.bound(c), problem.estimate(c), 0, c)

    for m, kind, delay in groups:
        for stages in problem.stage_counts():
            if stages > n or stages * m > MAX_SCHEDULE_CELLS:
                continue
            if stages <= SEED_STAGES:
                structure = next(_walk(problem, m, kind, delay, INF, stages), None)
                if structure is not None:
                    add(m, kind, delay, structure.layers, structure.choices)
            if problem.fixed.stages is not None:
                continue  # uniform layouts ignore the stages the manifest fixed
            even = [n // stages + (k < n % stages) for k in range(stages)]
            for choice in problem.tables(m).choices:
                if stages * choice.devices <= devices:
                    add(m, kind, delay, even, [choice] * stages)
    return sorted(out.values())


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
    """Every candidate with LB <= threshold (up to max_candidates) as (LB, estimate, strategy/balancer
    index, candidate), sorted: the order they are simulated in, least bound first."""
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
                lb, est = problem.pipeline_bound(structure), problem.estimate(structure)
                for i, c in enumerate(problem.expand(m, kind, delay, structure.layers, structure.choices)):
                    out.append((max(lb, problem.nic_floor_s(c)), est, i, c))
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
    if stages > n or stages * m > MAX_SCHEDULE_CELLS:
        return
    g = t.fewest_devices(kind, threshold, max(problem.stage_counts()))
    if g[stages][0] > devices:
        return
    per_layer, hop = t.least_per_layer(), problem.hop_floor_s()
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
            if (
                left > 1
                and prefix + per_layer.forward_s * (n - a - 1) + hop * (left - 1) + per_layer.bound_s > threshold
            ):
                continue  # the last stage's term: the forwards and transfers ahead of it, then a layer M times
            stash = stashed(kind, delay, k, stages, m)
            for o in t.options(size, first, last):
                tried[0] += 1
                if tried[0] > WALK_NODES:
                    raise _WalkBudget
                if o.bound_s > threshold:
                    break  # options are sorted by bound_s
                x = o.figures.cost  # Problem.bound's term of this stage, the stages after it at their least
                trip = 2 * hop * (left - 1) + per_layer.forward_s * (n - a - size)
                head = max(m * x.forward_s, x.forward_s + trip) + m * x.backward_s + o.figures.tail_s
                if o.term_s(prefix) > threshold or prefix + head > threshold:
                    continue
                nd = o.choice.devices
                if used + nd + rest > devices or o.memory(stash) > cap:
                    continue
                if not problem.stage_allowed(k, stages, a, a + size, o.choice):
                    continue
                layers.append(size)
                chosen.append(o.choice)
                yield from step(k + 1, a + size, used + nd, prefix + x.forward_s + hop, layers, chosen)
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
    """Simulate in the listing's order (least bound first) until the bound reaches the best step: nothing
    after it can beat the best. True if the budget ran out."""
    best = _best(seen)
    todo = [(lb, c) for lb, _, _, c in listing if c not in seen]
    for i, (lb, c) in enumerate(todo):
        if lb >= best:
            break
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
