"""`meshjob tune`'s search: stage cuts, submeshes, parallel splits, microbatches, schedule and resharding
settings that minimise the predicted step time within each device's memory.

Objective (`predict`): the job's plan (meshjob.plan) run through meshjob.simulate's pipeline model with
each stage's compute from meshjob.stage_model (meshjob.device_costs' roofline, tensor-parallel all-reduces
included), then each stage's tail after its last action (meshjob.gradient_sync: its gradient all-reduce,
sharing NICs with the other stages' on the same hosts, then its optimizer step): step = the last tail's end.
Constraint: every stage's bytes per device (meshjob.memory_model, with the stash its schedule keeps:
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
same result in every process.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from meshjob.costs import CostModel, StageCost
from meshjob.tune_cluster import Cluster
from meshjob.errors import PlacementError, UsageError
from meshjob.gradient_sync import stage_hosts, tail_ends
from meshjob.schedule import SCHEDULE_KINDS, stash_bound, warmup_forwards
from meshjob.spec import MAX_SCHEDULE_CELLS, job_to_dict, parse_job
from meshjob.memory_model import FLOAT32
from meshjob.stage_model import StageChoice, StageFigures, stage_bytes, stage_choices, stage_figures

STRATEGIES = ("broadcast", "global_allgather", "local_allgather", "send_recv")  # not `signal`: a baseline
BALANCERS = ("greedy", "load_balance")  # dfs: the same answers as greedy here, at many times the work
SCHEDULES = (("gpipe", 0), ("1f1b", 0), ("1f1b", "auto"), ("eager-1f1b", 0), ("eager-1f1b", "auto"))
DEFAULT_MAX_STAGES = 16
DEFAULT_MAX_MICROBATCHES = 64
DEFAULT_MAX_EVALUATIONS = 100
DEFAULT_MAX_CANDIDATES = 20000
WALK_NODES = 4000  # stage choices one walk (microbatches, schedule, stage count) may try
INF = math.inf


# ------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class StageFix:
    """What the user wrote for one stage: its layer range, or its mesh with the dims as written."""

    layers: tuple[int, int] | None = None
    choice: StageChoice | None = None


@dataclass(frozen=True)
class Fixed:
    """The fields the user set: the search keeps them."""

    stages: int | None = None
    per_stage: tuple[StageFix, ...] = ()
    microbatches: int | None = None
    kind: str | None = None
    weight_grad_delay: int | str | None = None
    strategy: str | None = None
    balancer: str | None = None
    chunks: int | str = "auto"


@dataclass(frozen=True)
class Space:
    """The choices the search enumerates (after the fixed fields narrowed them)."""

    microbatches: tuple[int, ...]
    schedules: tuple[tuple[str, int | str], ...]
    strategies: tuple[str, ...]
    balancers: tuple[str, ...]
    max_stages: int
    chunks: int | str = "auto"


def default_space(job, fixed: Fixed, cluster: Cluster, max_stages: int = DEFAULT_MAX_STAGES,
                  max_microbatches: int = DEFAULT_MAX_MICROBATCHES) -> Space:
    batch = job.training.global_batch
    ms = (fixed.microbatches,) if fixed.microbatches else \
        tuple(m for m in range(1, min(batch, max_microbatches) + 1) if batch % m == 0)
    schedules = tuple((k, d) for k, d in SCHEDULES if fixed.kind in (None, k)
                      and (fixed.weight_grad_delay is None or d == fixed.weight_grad_delay))
    if not schedules:  # a fixed pair outside the defaults (e.g. gpipe with a delay of 2)
        schedules = ((fixed.kind or "eager-1f1b",
                      "auto" if fixed.weight_grad_delay is None else fixed.weight_grad_delay),)
    stages = min(job.model.layers, cluster.devices, max_stages) if fixed.stages is None else fixed.stages
    return Space(ms, schedules, (fixed.strategy,) if fixed.strategy else STRATEGIES,
                 (fixed.balancer,) if fixed.balancer else BALANCERS, stages, fixed.chunks)


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True, order=True)
class Candidate:
    microbatches: int
    kind: str
    delay: str  # "auto" or the number of delayed W's, as text (sortable)
    layers: tuple[int, ...]  # layers per stage
    choices: tuple[StageChoice, ...]
    strategy: str = "broadcast"
    balancer: str = "greedy"

    @property
    def weight_grad_delay(self) -> int | str:
        return self.delay if self.delay == "auto" else int(self.delay)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.layers:
            out.append((start, start + n))
            start += n
        return out

    @property
    def devices(self) -> int:
        return sum(c.devices for c in self.choices)

    def label(self) -> str:
        stages = " | ".join(f"{a}-{b} {c.label()}" for (a, b), c in zip(self.ranges, self.choices))
        return (f"{len(self.layers)} stages [{stages}], M={self.microbatches}, {self.kind} "
                f"delay {self.delay}, {self.strategy}/{self.balancer}")


def stashed(kind: str, split: bool, stage: int, num_stages: int, microbatches: int) -> int:
    """Microbatches a stage keeps at its peak: its warm-up forwards; with split backward also up to
    eager-1F1B's bound min(M, 2S - 1), the most meshjob.plan lets the weight delay stash."""
    warm = warmup_forwards(kind, stage, num_stages, microbatches)
    return max(warm, stash_bound(num_stages, microbatches)) if split else warm


def _directions(first: bool, last: bool) -> int:
    """Boundary directions of a chain stage: forward in and gradient out, forward out and gradient in."""
    return 2 * (not first) + 2 * (not last)


# ------------------------------------------------------------------------------ the tables
@dataclass(frozen=True)
class Option:
    choice: StageChoice
    figures: StageFigures
    compute_s: float  # M (F + B) + all-reduce + optimizer: this stage's term of LB, without the forwards ahead
    nic_s: float  # the least time its hosts' NICs take to receive its inputs and gradients (whole hosts only)
    mem_fixed: int  # bytes without activations stashed
    mem_per_stash: int  # bytes per stashed microbatch

    def memory(self, stash: int) -> int:
        return self.mem_fixed + stash * self.mem_per_stash

    @property
    def bound_s(self) -> float:
        """This stage's term of LB without the forwards ahead (what the DP bounds)."""
        return max(self.compute_s, self.nic_s)

    def term_s(self, ahead_s: float) -> float:
        return max(ahead_s + self.compute_s, self.nic_s)


@dataclass(frozen=True)
class PerLayer:
    forward_s: float
    bound_s: float


class Tables:
    """Per microbatch count: every (layers, first?, last?) -> its options, and the DP over them."""

    def __init__(self, job, cluster: Cluster, microbatches: int, extra: Sequence[StageChoice] = ()):
        self.job = replace(job, training=replace(job.training, microbatches=microbatches))
        self.cluster = cluster
        self.m = microbatches
        self.layers = job.model.layers
        self.choices = sorted(set(stage_choices(self.job.model, self.job.training, cluster)) | set(extra))
        self._options: dict[tuple[int, bool, bool], list[Option]] = {}
        self._frontiers: dict[tuple[int, bool, bool, int, str], tuple[list[float], list[int]]] = {}
        self._fewest: dict[tuple[str, float, int, str], list[list[float]]] = {}

    def options(self, layers: int, first: bool, last: bool) -> list[Option]:
        key = (layers, first, last)
        if key not in self._options:
            self._options[key] = sorted((self._option(layers, first, last, c) for c in self.choices),
                                        key=lambda o: (o.bound_s, o.choice))
        return self._options[key]

    def _option(self, layers: int, first: bool, last: bool, c: StageChoice) -> Option:
        m, t = self.job.model, self.job.training
        a = 0 if first else (self.layers - layers if last else 1)  # any range with these ends costs the same
        d = _directions(first, last)
        one, two = (stage_bytes(m, t, a, a + layers, c, n, d) for n in (1, 2))  # linear in the stash
        fig = stage_figures(m, t, self.cluster, a, a + layers, c)
        return Option(c, fig, self.m * fig.per_microbatch_s + fig.tail_s, self._nic_s(first, last, c),
                      one - (two - one), two - one)

    def _nic_s(self, first: bool, last: bool, c: StageChoice) -> float:
        """A stage on whole hosts has them to itself: every activation and gradient it receives crosses
        their NICs, each host at least its share (1/hosts of the batch when data parallel runs across
        hosts, else all of it), M times per step. Stages inside one host may share it with a neighbour: 0."""
        if c.mesh[1] < self.cluster.devices_per_host:
            return 0.0
        t, m = self.job.training, self.job.model
        share = FLOAT32 * t.microbatch_size * m.seq_len * m.hidden / (c.mesh[0] if c.dp_dim == 0 else 1)
        return self.m * (2 - first - last) * share / self.cluster.network.nic_bytes_per_s

    def least_per_layer(self) -> "PerLayer":
        """The least forward and the least M (F + B) one middle layer takes on any choice: all the layers
        ahead of a stage add at least their forwards to its term, and it holds at least one layer."""
        if self.layers < 3:
            return PerLayer(0.0, 0.0)
        options = self.options(1, False, False)
        return PerLayer(min(o.figures.cost.forward_s for o in options),
                        min(self.m * o.figures.per_microbatch_s for o in options))

    def frontier(self, layers: int, first: bool, last: bool, stash: int, key: str
                 ) -> tuple[list[float], list[int]]:
        """Options sorted by `key` (time: bound_s among those that fit; overflow: bytes over the device's
        memory) with the fewest devices among the first i: nmin(threshold) is one bisection."""
        k = (layers, first, last, stash, key)
        if k not in self._frontiers:
            cap = self.cluster.memory
            rows = []
            for o in self.options(layers, first, last):
                mem = o.memory(stash)
                if key == "time":
                    if mem <= cap:
                        rows.append((o.bound_s, o.choice.devices))
                else:
                    rows.append((float(mem - cap), o.choice.devices))
            rows.sort()
            keys, best, low = [], [], 1 << 60
            for value, devices in rows:
                low = min(low, devices)
                keys.append(value)
                best.append(low)
            self._frontiers[k] = (keys, best)
        return self._frontiers[k]

    def nmin(self, layers: int, first: bool, last: bool, stash: int, threshold: float, key: str) -> float:
        keys, best = self.frontier(layers, first, last, stash, key)
        i = bisect.bisect_right(keys, threshold)
        return best[i - 1] if i else INF

    def fewest_devices(self, kind: str, threshold: float, stages: int, key: str = "time") -> list[list[float]]:
        """G[s][a]: fewest devices for layers [a, L) in s stages, each stage's key <= threshold, each stage
        with the stash it keeps as stage S - s of S without split backward (split only adds: a relaxation)."""
        memo = (kind, threshold, stages, key)
        if memo not in self._fewest:
            self._fewest[memo] = self._fewest_devices(kind, threshold, stages, key)
        return self._fewest[memo]

    def _fewest_devices(self, kind: str, threshold: float, stages: int, key: str) -> list[list[float]]:
        n = self.layers
        g = [[INF] * (n + 1) for _ in range(stages + 1)]
        for a in range(n):
            g[1][a] = self.nmin(n - a, a == 0, True, _stash_from_end(kind, 1, self.m), threshold, key)
        for s in range(2, stages + 1):
            stash = _stash_from_end(kind, s, self.m)
            # fewest devices per stage size (index: layers), as the first stage and as a middle one
            first = [INF] + [self.nmin(size, True, False, stash, threshold, key) for size in range(1, n)]
            middle = [INF] + [self.nmin(size, False, False, stash, threshold, key) for size in range(1, n)]
            prev = g[s - 1]
            for a in range(n - s + 1):
                most = n - a - s + 1  # the largest stage that leaves a layer to each later stage
                own = first if a == 0 else middle
                g[s][a] = min(map(operator.add, own[1:most + 1], prev[a + 1:a + most + 1]), default=INF)
        return g


def _stash_from_end(kind: str, from_end: int, microbatches: int) -> int:
    """warmup_forwards of the stage `from_end` stages from the last (it depends on S - stage only)."""
    return warmup_forwards(kind, 0, from_end, microbatches)


# ------------------------------------------------------------------------------ prediction
@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    bound_s: float
    tokens_per_s: float
    bubble: float
    resharding_s: float  # one microbatch of every boundary, summed
    exposed_comm_s: float  # the most any stage waited on a transfer
    allreduce_s: float  # the largest gradient all-reduce
    compute_s: float  # the busiest stage's compute
    memory: tuple[int, ...]  # bytes per device, per stage
    weight_delay: Mapping[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.candidate.label(), "step_s": self.step_s, "lower_bound_s": self.bound_s,
                "tokens_per_s": self.tokens_per_s, "bubble": self.bubble, "resharding_s": self.resharding_s,
                "exposed_comm_s": self.exposed_comm_s, "allreduce_s": self.allreduce_s,
                "compute_s": self.compute_s, "memory_bytes": list(self.memory),
                "max_memory_bytes": max(self.memory), "weight_delay": {str(k): v for k, v in
                                                                     sorted(self.weight_delay.items())}}


class Problem:
    """A job, a cluster and the fixed fields: builds candidates' manifests, checks and predicts them."""

    def __init__(self, doc: Mapping[str, Any], job, cluster: Cluster, fixed: Fixed, space: Space):
        self.doc, self.job, self.cluster, self.fixed, self.space = doc, job, cluster, fixed, space
        self._tables: dict[int, Tables] = {}

    def tables(self, microbatches: int) -> Tables:
        if microbatches not in self._tables:
            extra = [f.choice for f in self.fixed.per_stage if f.choice is not None]  # the user's meshes
            self._tables[microbatches] = Tables(self.job, self.cluster, microbatches, extra)
        return self._tables[microbatches]

    def manifest(self, c: Candidate) -> dict[str, Any]:
        """The job's document with the candidate's choices: the manifest `meshjob tune --out` writes."""
        doc = _copy(self.doc)
        spec = doc.setdefault("spec", {})
        spec["stages"] = [ch.to_stage(a, b) for (a, b), ch in zip(c.ranges, c.choices)]
        spec.pop("edges", None)  # the defaults follow the chosen natural layouts
        spec.setdefault("training", {})["microbatches"] = c.microbatches
        topology = spec.setdefault("topology", {})
        topology["devicesPerHost"] = self.cluster.devices_per_host
        spec["schedule"] = {**spec.get("schedule", {}), "kind": c.kind, "weightGradDelay": c.weight_grad_delay}
        spec["resharding"] = {**spec.get("resharding", {}), "strategy": c.strategy, "balancer": c.balancer,
                              "chunks": self.space.chunks}
        return doc

    def memory(self, c: Candidate) -> tuple[int, ...]:
        """Bytes per device of each stage (the real stash: with split backward, eager-1F1B's bound)."""
        t = self.tables(c.microbatches)
        split = c.weight_grad_delay != 0
        out = []
        for k, ((a, b), ch) in enumerate(zip(c.ranges, c.choices)):
            opt = _find(t.options(b - a, a == 0, b == self.job.model.layers), ch)
            out.append(opt.memory(stashed(c.kind, split, k, len(c.layers), c.microbatches)))
        return tuple(out)

    def figures(self, c: Candidate) -> list[StageFigures]:
        t = self.tables(c.microbatches)
        return [_find(t.options(b - a, a == 0, b == self.job.model.layers), ch).figures
                for (a, b), ch in zip(c.ranges, c.choices)]

    def bound(self, c: Candidate) -> float:
        t = self.tables(c.microbatches)
        ahead, out = 0.0, 0.0
        for (a, b), ch in zip(c.ranges, c.choices):
            o = _find(t.options(b - a, a == 0, b == self.job.model.layers), ch)
            out = max(out, o.term_s(ahead))
            ahead += o.figures.cost.forward_s
        return out

    def estimate(self, c: Candidate) -> float:
        """Alpa's pipeline estimate, the order candidates are simulated in (not a bound): sum of the
        stages' per-microbatch times + (M - 1) x the largest, a stage's time counting its inputs and
        gradients over one host's NIC per host it spans, plus the largest gradient all-reduce and optimizer step."""
        t = self.tables(c.microbatches)
        m = self.job.model
        act = FLOAT32 * t.job.training.microbatch_size * m.seq_len * m.hidden
        times, ar = [], 0.0
        for k, ((a, b), ch) in enumerate(zip(c.ranges, c.choices)):
            o = _find(t.options(b - a, a == 0, b == m.layers), ch)
            comm = (2 - (k == 0) - (k == len(c.layers) - 1)) * act / ch.mesh[0] / self.cluster.network.nic_bytes_per_s
            times.append(o.figures.per_microbatch_s + comm)
            ar = max(ar, o.figures.tail_s)
        return sum(times) + (c.microbatches - 1) * max(times) + ar

    def predict(self, c: Candidate) -> Prediction | None:
        """Simulate the candidate's plan; None when its meshes do not fit on the cluster's hosts."""
        from meshjob.plan import build_plan
        from meshjob.simulate import compute_costs, simulate_pipeline, transfer_costs

        figures = self.figures(c)
        job = parse_job(self.manifest(c))
        cost = CostModel(network=self.cluster.network, stages=tuple(f.cost for f in figures))
        try:
            # the ratio rule sizes an auto delay here: simulating delay candidates per candidate plan made the
            # 96-layer search 8x slower; the job's own plan (build_plan) then simulates them, never slower
            plan = build_plan(job, self.cluster.host_list(), network=self.cluster.network, cost=cost,
                              simulate_delays=False)
        except PlacementError:
            return None
        result = simulate_pipeline(plan.schedules, compute_costs(plan, cost), transfer_costs(plan, cost), cost)
        ends = tail_ends([result.stages[k].busy_until_s for k in range(len(figures))], [f.sync for f in figures],
                         stage_hosts(plan.placement))
        step = max(ends)
        tokens = job.training.global_batch * job.model.seq_len
        return Prediction(
            candidate=c, step_s=step, bound_s=self.bound(c), tokens_per_s=tokens / step if step > 0 else INF,
            bubble=sum(max(0.0, 1 - s.compute_s / step) for s in result.stages.values()) / len(ends),
            resharding_s=sum(result.transfer_s.values()),
            exposed_comm_s=max((s.exposed_comm_s for s in result.stages.values()), default=0.0),
            allreduce_s=max(f.allreduce_s for f in figures),
            compute_s=max(s.compute_s for s in result.stages.values()),
            memory=self.memory(c), weight_delay=dict(plan.weight_delay))

    def expand(self, m: int, kind: str, delay: int | str, layers: Sequence[int],
               choices: Sequence[StageChoice]) -> list[Candidate]:
        """The structure with every strategy and balancer of the space."""
        return [Candidate(m, kind, str(delay), tuple(layers), tuple(choices), s, b)
                for s in self.space.strategies for b in self.space.balancers]

    def stage_allowed(self, index: int, stages: int, first: int, last: int, choice: StageChoice) -> bool:
        if self.fixed.stages is None or index >= len(self.fixed.per_stage):
            return True
        fix = self.fixed.per_stage[index]
        return (fix.layers is None or fix.layers == (first, last)) and (fix.choice is None or fix.choice == choice)

    def stage_counts(self) -> list[int]:
        if self.fixed.stages is not None:
            return [self.fixed.stages]
        return list(range(1, self.space.max_stages + 1))


def _find(options: Sequence[Option], choice: StageChoice) -> Option:
    for o in options:
        if o.choice == choice:
            return o
    raise UsageError(f"stage mesh {list(choice.mesh)} (dataParallelDim {choice.dp_dim}, tensorParallelDim "
                     f"{choice.tp_dim}) is not one the search may use on this cluster and model")


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


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


def search(problem: Problem, top: int = 5, max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
           max_candidates: int = DEFAULT_MAX_CANDIDATES, progress: Progress | None = None) -> Result:
    groups = _groups(problem)
    best_bounds = _least_bottlenecks(problem, groups, progress)
    finite = [b for b in best_bounds.values() if b < INF]
    if not finite:
        raise _infeasible(problem, groups)
    floor = min(finite)
    threshold = floor * (1 + 1e-9)
    seen: dict[Candidate, Prediction | None] = {}
    listed, proven, listing = 0, False, []
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
        raise Infeasible(f"no plan keeps the fields the manifest fixed ({_fixed_text(problem.fixed)}) on "
                         f"{problem.cluster.hosts} hosts x {problem.cluster.devices_per_host} devices within "
                         f"{_gib(problem.cluster.memory)} per device: leave more of them to the search")
    rest = min([lb for _, _, lb, c in listing if c not in seen] + [threshold])
    return Result(tuple(_distinct(found)[:top]), len(seen), listed, proven, INF if proven else rest, floor)


def _distinct(ranked: Sequence[Prediction]) -> list[Prediction]:
    """The best strategy and balancer of each structure (stages, meshes, microbatches, schedule)."""
    out, shown = [], set()
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


def _groups(problem: Problem) -> list[tuple[int, str, int | str]]:
    out = []
    for m in problem.space.microbatches:
        for kind, delay in problem.space.schedules:
            out.append((m, kind, delay))
    return out


def _least_bottlenecks(problem: Problem, groups, progress: Progress | None) -> dict[tuple, float]:
    """Per group (microbatches, schedule): the least max-stage term any plan reaches (bisection on the DP)."""
    out: dict[tuple, float] = {}
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


def _list(problem: Problem, groups, best_bounds, threshold: float, max_candidates: int
          ) -> tuple[list[tuple[float, Candidate]], bool]:
    """Every candidate with LB <= threshold (up to max_candidates) as (estimate, strategy/balancer index,
    LB, candidate), sorted: the order they are simulated in."""
    out: list[tuple[float, int, float, Candidate]] = []
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


def _walk(problem: Problem, m: int, kind: str, delay: int | str, threshold: float, stages: int
          ) -> Iterator[Candidate]:
    """Depth-first over cuts and choices of `stages` stages with LB <= threshold, pruned by the DP's device
    count; stage sizes nearest an even split first, options by their bound."""
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
    if True:

        def step(k: int, a: int, used: int, prefix: float, layers: list[int], chosen: list[StageChoice]
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


def _evaluate(problem: Problem, listing, seen: dict, max_evaluations: int, progress: Progress | None) -> bool:
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


def _infeasible(problem: Problem, groups) -> Infeasible:
    """The smallest memory overflow any plan reaches: bisection of the DP keyed by bytes over capacity."""
    least = INF
    for m, kind in sorted({(m, k) for m, k, _ in groups}):
        t = problem.tables(m)
        values = sorted({float(o.memory(s) - problem.cluster.memory) for key in _option_keys(problem, m)
                         for o in t.options(*key) for s in {_stash_from_end(kind, j, m)
                                                              for j in range(1, problem.space.max_stages + 1)}})
        ok = [v for v in values if _feasible(problem, m, kind, v, "overflow")]
        if ok:
            least = min(least, ok[0])
    if least == INF:
        return Infeasible(f"no plan fits: the model needs more devices than the cluster's {problem.cluster.devices} "
                          f"even before memory (each stage needs at least one device)")
    return Infeasible(f"the model does not fit in memory on {problem.cluster.hosts} hosts x "
                      f"{problem.cluster.devices_per_host} devices with {_gib(problem.cluster.memory)} each: the "
                      f"smallest overflow found is {_gib(least)} on the fullest device (of every plan of the space); "
                      f"use more hosts, devices with more memory, bf16 is no help (fp32 master weights), "
                      f"training.recompute: full, or optimizer.zeroStage: 1")


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
                        if not all(problem.stage_allowed(k, stages, bounds[k], bounds[k + 1], ch)
                                   for k, ch in enumerate(choices)):
                            continue
                        if max(problem.memory(c)) > cap:
                            continue
                        p = problem.predict(c)
                        if p is not None and (best is None or (p.step_s, c) < (best.step_s, best.candidate)):
                            best = p
    if best is None:
        raise Infeasible("no candidate fits")
    return best
