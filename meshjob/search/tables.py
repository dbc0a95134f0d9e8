"""The search's per-stage tables (meshjob.search.algorithm): every way one stage may run, and a DP over them.

For a microbatch count, every (layers, first stage?, last stage?) has its options: each stage choice
(submesh, data and tensor parallel split) with its compute term of the search's lower bound, the time
its hosts' NICs need for its inputs and gradients, and its bytes per device as a function of the stash.
Sorted by bound, each gives a frontier of the fewest devices under a threshold, and the DP over
(stages left, first layer) the fewest devices any cut reaches with every stage under it (Alpa's stage
construction). Pure: data in, data out.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshjob.schedule.actions import peak_stashed_stage, stage_actions, warmup_forwards
from meshjob.search.cluster import Cluster
from meshjob.search.memory_model import FLOAT32
from meshjob.search.stage_model import StageChoice, StageFigures, stage_bytes, stage_choices, stage_figures
from meshjob.spec.manifest import AUTO, TrainingJob

INF = math.inf


@functools.cache
def stashed(kind: str, delay: int | str, stage: int, num_stages: int, microbatches: int) -> int:
    """Microbatches a stage holds at its peak, counted on its action list: from a microbatch's F to its W (or
    B), so a delayed W keeps its microbatch's activations. Exact for a fixed weight delay (each stage that
    sends gradients delays it, as meshjob.plan.build does); for `auto` the undelayed list's, a lower bound: the
    plan's delays are counted on its own lists once it is built (Problem.predict)."""
    split = delay != 0
    delay_w = 0 if delay == AUTO or stage == 0 else min(int(delay), max(0, microbatches - 1))
    chain = [(i, i + 1, "activation") for i in range(num_stages - 1)]
    return peak_stashed_stage(stage_actions(kind, stage, num_stages, microbatches, chain, split, delay_w))


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

    def __init__(
        self, job: TrainingJob, cluster: Cluster, microbatches: int, extra: Sequence[StageChoice] = ()
    ) -> None:
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
            self._options[key] = sorted(
                (self._option(layers, first, last, c) for c in self.choices), key=lambda o: (o.bound_s, o.choice)
            )
        return self._options[key]

    def _option(self, layers: int, first: bool, last: bool, c: StageChoice) -> Option:
        m, t = self.job.model, self.job.training
        a = 0 if first else (self.layers - layers if last else 1)  # any range with these ends costs the same
        d = _directions(first, last)
        one, two = (stage_bytes(m, t, a, a + layers, c, n, d) for n in (1, 2))  # linear in the stash
        fig = stage_figures(m, t, self.cluster, a, a + layers, c)
        return Option(
            c,
            fig,
            self.m * fig.per_microbatch_s + fig.tail_s,
            self._nic_s(first, last, c),
            one - (two - one),
            two - one,
        )

    def _nic_s(self, first: bool, last: bool, c: StageChoice) -> float:
        """A stage on whole hosts has them to itself: every activation and gradient it receives crosses
        their NICs, each host at least its share (1/hosts of the batch when data parallel runs across
        hosts, else all of it), M times per step. Stages inside one host may share it with a neighbour: 0."""
        if c.mesh[1] < self.cluster.devices_per_host:
            return 0.0
        t, m = self.job.training, self.job.model
        share = FLOAT32 * t.microbatch_size * m.seq_len * m.hidden / (c.mesh[0] if c.dp_dim == 0 else 1)
        return self.m * (2 - first - last) * share / self.cluster.network.nic_bytes_per_s

    def least_per_layer(self) -> PerLayer:
        """The least forward and the least M (F + B) one middle layer takes on any choice: all the layers
        ahead of a stage add at least their forwards to its term, and it holds at least one layer."""
        if self.layers < 3:
            return PerLayer(0.0, 0.0)
        options = self.options(1, False, False)
        return PerLayer(
            min(o.figures.cost.forward_s for o in options), min(self.m * o.figures.per_microbatch_s for o in options)
        )

    def frontier(self, layers: int, first: bool, last: bool, stash: int, key: str) -> tuple[list[float], list[int]]:
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
            g[1][a] = self.nmin(n - a, a == 0, True, stash_from_end(kind, 1, self.m), threshold, key)
        for s in range(2, stages + 1):
            stash = stash_from_end(kind, s, self.m)
            # fewest devices per stage size (index: layers), as the first stage and as a middle one
            first = [INF] + [self.nmin(size, True, False, stash, threshold, key) for size in range(1, n)]
            middle = [INF] + [self.nmin(size, False, False, stash, threshold, key) for size in range(1, n)]
            prev = g[s - 1]
            for a in range(n - s + 1):
                most = n - a - s + 1  # the largest stage that leaves a layer to each later stage
                own = first if a == 0 else middle
                g[s][a] = min(map(operator.add, own[1 : most + 1], prev[a + 1 : a + most + 1]), default=INF)
        return g


def stash_from_end(kind: str, from_end: int, microbatches: int) -> int:
    """warmup_forwards of the stage `from_end` stages from the last (it depends on S - stage only)."""
    return warmup_forwards(kind, 0, from_end, microbatches)
