"""What `meshjob tune`'s search (meshjob.search.algorithm) searches: the space, its candidates, and the objective.

The fields the user fixed (Fixed) narrow the space (Space: microbatch counts, schedules, strategies,
balancers, stage counts). A Candidate is one point of it: layers and a stage choice per stage, the
microbatches, the schedule, the resharding strategy and balancer. The Problem writes a candidate's
manifest, its bytes per device, its lower bound and Alpa's estimate (the order the search simulates in),
and predicts it: the job's plan through meshjob.simulate.simulator, then each stage's gradient all-reduce and
optimizer step (Prediction).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshjob.errors import PlacementError, UsageError
from meshjob.layout.stage_order import DEFAULT_STAGE_ORDER, STAGE_ORDERS
from meshjob.plan.placement import place
from meshjob.resharding.strategies import SEARCHED
from meshjob.schedule.actions import Action, peak_stashed_stage
from meshjob.search.cluster import Cluster
from meshjob.search.job_step import job_step
from meshjob.search.memory_model import FLOAT32
from meshjob.search.settings import Settings
from meshjob.search.stage_model import StageChoice, StageFigures, stage_figures
from meshjob.search.tables import INF, Option, Tables, stashed
from meshjob.spec.manifest import StageSpec, TrainingJob, parse_job, skip_pairs
from meshjob.units import format_rate

BALANCERS = ("greedy", "load_balance")  # dfs: the same answers as greedy here, at many times the work
SCHEDULES = (("gpipe", 0), ("1f1b", 0), ("1f1b", "auto"), ("eager-1f1b", 0), ("eager-1f1b", "auto"))
DEFAULT_MAX_STAGES = 16
DEFAULT_MAX_MICROBATCHES = 64


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
    stage_order: str | None = None  # spec.topology.stageOrder


@dataclass(frozen=True)
class Space:
    """The choices the search enumerates (after the fixed fields narrowed them)."""

    microbatches: tuple[int, ...]
    schedules: tuple[tuple[str, int | str], ...]
    strategies: tuple[str, ...]
    balancers: tuple[str, ...]
    max_stages: int
    chunks: int | str = "auto"
    stage_orders: tuple[str, ...] = (DEFAULT_STAGE_ORDER,)


def default_space(
    job: TrainingJob,
    fixed: Fixed,
    cluster: Cluster,
    max_stages: int = DEFAULT_MAX_STAGES,
    max_microbatches: int = DEFAULT_MAX_MICROBATCHES,
) -> Space:
    batch = job.training.global_batch
    ms = (
        (fixed.microbatches,)
        if fixed.microbatches
        else tuple(m for m in range(1, min(batch, max_microbatches) + 1) if batch % m == 0)
    )
    schedules = tuple(
        (k, d)
        for k, d in SCHEDULES
        if fixed.kind in (None, k) and (fixed.weight_grad_delay is None or d == fixed.weight_grad_delay)
    )
    if not schedules:  # a fixed pair outside the defaults (e.g. gpipe with a delay of 2)
        schedules = (
            (fixed.kind or "eager-1f1b", "auto" if fixed.weight_grad_delay is None else fixed.weight_grad_delay),
        )
    stages = min(job.model.layers, cluster.devices, max_stages) if fixed.stages is None else fixed.stages
    # fold pays where stage k and S-1-k exchange tensors: the skip edges; elsewhere it only splits the chain
    orders = tuple(STAGE_ORDERS) if skip_pairs(job.model) else (DEFAULT_STAGE_ORDER,)
    return Space(
        ms,
        schedules,
        (fixed.strategy,) if fixed.strategy else SEARCHED,
        (fixed.balancer,) if fixed.balancer else BALANCERS,
        stages,
        fixed.chunks,
        (fixed.stage_order,) if fixed.stage_order else orders,
    )


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
    stage_order: str = DEFAULT_STAGE_ORDER

    @property
    def weight_grad_delay(self) -> int | str:
        return self.delay if self.delay == "auto" else int(self.delay)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        start = 0
        for n in self.layers:
            out.append((start, start + n))
            start += n
        return out

    @property
    def devices(self) -> int:
        return sum(c.devices for c in self.choices)

    def label(self) -> str:
        stages = " | ".join(f"{a}-{b} {c.label()}" for (a, b), c in zip(self.ranges, self.choices))
        return (
            f"{len(self.layers)} stages [{stages}], M={self.microbatches}, {self.kind} "
            f"delay {self.delay}, {self.strategy}/{self.balancer}"
            + ("" if self.stage_order == DEFAULT_STAGE_ORDER else f", {self.stage_order} order")
        )


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
        return {
            "label": self.candidate.label(),
            "step_s": self.step_s,
            "lower_bound_s": self.bound_s,
            "tokens_per_s": self.tokens_per_s,
            "bubble": self.bubble,
            "resharding_s": self.resharding_s,
            "exposed_comm_s": self.exposed_comm_s,
            "allreduce_s": self.allreduce_s,
            "compute_s": self.compute_s,
            "memory_bytes": list(self.memory),
            "max_memory_bytes": max(self.memory),
            "weight_delay": {str(k): v for k, v in sorted(self.weight_delay.items())},
        }


class Problem:
    """A job, a cluster and the fixed fields: builds candidates' manifests, checks and predicts them."""

    def __init__(
        self,
        doc: Mapping[str, Any],
        job: TrainingJob,
        cluster: Cluster,
        fixed: Fixed,
        space: Space,
        settings: Settings | None = None,
        simulate_delays: bool = True,
    ) -> None:
        self.doc, self.job, self.cluster, self.fixed, self.space = doc, job, cluster, fixed, space
        # what the written manifest records (spec.tunedFor): the settings the cluster was made from
        self.settings = settings or Settings(
            cluster.hosts,
            format_rate(cluster.network.nic_bytes_per_s),
            cluster.device.name,
            "" if cluster.memory_bytes is None else str(cluster.memory_bytes),
        )
        # False: an auto weight delay by the ratio rule alone (faster; no longer what `meshjob simulate` says)
        self.simulate_delays = simulate_delays
        self._tables: dict[int, Tables] = {}
        self._nic_floors: dict[tuple[tuple[int, ...], tuple[StageChoice, ...], str], float] = {}

    def tables(self, microbatches: int) -> Tables:
        if microbatches not in self._tables:
            extra = [f.choice for f in self.fixed.per_stage if f.choice is not None]  # the user's meshes
            self._tables[microbatches] = Tables(self.job, self.cluster, microbatches, extra)
        return self._tables[microbatches]

    def manifest(self, c: Candidate) -> dict[str, Any]:
        """The job's document with the candidate's choices: the manifest `meshjob tune --out` writes."""
        doc: dict[str, Any] = _copy(self.doc)
        spec = doc.setdefault("spec", {})
        spec["stages"] = [ch.to_stage(a, b) for (a, b), ch in zip(c.ranges, c.choices)]
        spec.pop("edges", None)  # the defaults follow the chosen natural layouts
        spec.setdefault("training", {})["microbatches"] = c.microbatches
        topology = spec.setdefault("topology", {})
        topology["devicesPerHost"] = self.cluster.devices_per_host
        if c.stage_order != DEFAULT_STAGE_ORDER or "stageOrder" in topology:
            topology["stageOrder"] = c.stage_order
        spec["schedule"] = {**spec.get("schedule", {}), "kind": c.kind, "weightGradDelay": c.weight_grad_delay}
        spec["tunedFor"] = self.settings.to_spec()
        spec["resharding"] = {
            **spec.get("resharding", {}),
            "strategy": c.strategy,
            "balancer": c.balancer,
            "chunks": self.space.chunks,
        }
        return doc

    def memory(self, c: Candidate, schedules: Mapping[int, Sequence[Action]] | None = None) -> tuple[int, ...]:
        """Bytes per device of each stage, with the microbatches its schedule holds at its peak: counted on
        the plan's action lists (`schedules`), else on the candidate's own (tables.stashed)."""
        t = self.tables(c.microbatches)
        out = []
        for k, ((a, b), ch) in enumerate(zip(c.ranges, c.choices)):
            opt = _find(t.options(b - a, a == 0, b == self.job.model.layers), ch)
            stash = (
                peak_stashed_stage(schedules[k])
                if schedules is not None
                else stashed(c.kind, c.weight_grad_delay, k, len(c.layers), c.microbatches)
            )
            out.append(opt.memory(stash))
        return tuple(out)

    def figures(self, c: Candidate) -> list[StageFigures]:
        """Each stage's figures at its own layers (a U-Transformer's skip adds depend on where a stage sits;
        the tables cost a range by its ends alone, a lower bound the search's bounds use)."""
        training = self.tables(c.microbatches).job.training
        return [
            stage_figures(self.job.model, training, self.cluster, a, b, ch) for (a, b), ch in zip(c.ranges, c.choices)
        ]

    def bound(self, c: Candidate) -> float:
        """A lower bound of the candidate's predicted step: the pipeline's (pipeline_bound) or the busiest
        ingress link's (nic_floor_s), whichever is more."""
        return max(self.pipeline_bound(c), self.nic_floor_s(c))

    def nic_floor_s(self, c: Candidate) -> float:
        """The least time the busiest host's ingress link takes for what its stages must receive from other
        hosts in a step, beyond one burst: each edge's activations (chain and skip edges) into every host of
        its destination that holds none of its source, and their gradients back the same way. It depends on
        where placement puts the stages (the candidate's stage order), not on microbatches or schedule; INF
        where the stages cannot be placed."""
        key = (c.layers, c.choices, c.stage_order)
        if key not in self._nic_floors:
            self._nic_floors[key] = self._nic_floor(c)
        return self._nic_floors[key]

    def _nic_floor(self, c: Candidate) -> float:
        ranges = c.ranges
        stages = tuple(StageSpec(layers=r, mesh=ch.mesh) for r, ch in zip(ranges, c.choices))
        topology = replace(self.job.topology, devices_per_host=self.cluster.devices_per_host, stage_order=c.stage_order)
        try:
            placement = place(
                TrainingJob(name=self.job.name, stages=stages, topology=topology), self.cluster.host_list()
            )
        except PlacementError:
            return INF
        hosts = [set(placement.mesh(k).hosts) for k in range(len(stages))]
        stage_of = [k for k, (a, b) in enumerate(ranges) for _ in range(a, b)]
        edges = [(k, k + 1) for k in range(len(stages) - 1)]
        edges += [(stage_of[i], stage_of[j]) for i, j in skip_pairs(self.job.model) if stage_of[i] != stage_of[j]]
        training, model = self.job.training, self.job.model
        sample = training.activation_itemsize * model.seq_len * model.hidden
        into: dict[int, float] = {}
        for src, dst in edges:  # activations forward into dst's hosts, their gradients back into src's
            for to, frm in ((dst, src), (src, dst)):
                share = training.global_batch / c.choices[to].dp_hosts * sample  # one mesh row's samples
                for h in hosts[to] - hosts[frm]:
                    into[h] = into.get(h, 0.0) + share
        net = self.cluster.network
        return max((max(0.0, b - net.burst_bytes) / net.nic_bytes_per_s for b in into.values()), default=0.0)

    def pipeline_bound(self, c: Candidate) -> float:
        """A lower bound of the candidate's predicted step. Stage k cannot start before microbatch 0's forwards
        and transfers ahead of it reached it (`ahead`), nor its first backward before that microbatch went
        down the rest of the pipeline and its gradient came back (`trip`: forwards, input gradients and a
        transfer each way per boundary, each transfer at least transfer_floor_s); it computes M (F + B) in
        all, then its tail (all-reduce with its hosts to itself, optimizer step) follows its last action."""
        t = self.tables(c.microbatches)
        m, split = c.microbatches, c.weight_grad_delay != 0
        opts = [
            _find(t.options(b - a, a == 0, b == self.job.model.layers), ch) for (a, b), ch in zip(c.ranges, c.choices)
        ]
        hops = [self.transfer_floor_s(x, y, m) for x, y in zip(c.choices, c.choices[1:])]  # forward
        backs = [self.transfer_floor_s(y, x, m) for x, y in zip(c.choices, c.choices[1:])]  # gradient
        costs = [o.figures.cost for o in opts]
        back = [x.input_grad_s if split else x.backward_s for x in costs]  # what a gradient waits for per stage
        ahead, out = 0.0, 0.0
        for k, (o, x) in enumerate(zip(opts, costs)):
            trip = sum(costs[j].forward_s + back[j] + hops[j - 1] + backs[j - 1] for j in range(k + 1, len(opts)))
            finish = ahead + max(m * x.forward_s, x.forward_s + trip) + m * x.backward_s
            out = max(out, finish + o.figures.tail_s, o.nic_s)
            ahead += x.forward_s + (hops[k] if k < len(hops) else 0.0)
        return out

    def transfer_floor_s(self, src: StageChoice, dst: StageChoice, microbatches: int) -> float:
        """The least one microbatch's transfer from a stage on `src` to the next on `dst` takes in the
        simulator: a message with a destination host's share of the activation, through its NIC, or, where
        both stages may sit on one host (neither on whole hosts), through the host's link if that is less."""
        net, per_host = self.cluster.network, self.cluster.devices_per_host
        training, model = self.job.training, self.job.model
        samples = training.global_batch // microbatches / dst.dp_hosts
        share = samples * training.activation_itemsize * model.seq_len * model.hidden
        rate = net.nic_bytes_per_s if net.burst_bytes <= 0 else max(net.nic_bytes_per_s, net.line_bytes_per_s)
        between = net.message_s + share / rate
        if src.mesh[1] < per_host and dst.mesh[1] < per_host:
            return min(between, net.intra_message_s + share / dst.mesh[1] / net.intra_host_bytes_per_s)
        return between

    def hop_floor_s(self) -> float:
        """The least any transfer takes (transfer_floor_s of any two choices)."""
        return min(self.cluster.network.message_s, self.cluster.network.intra_message_s)

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
        """The candidate's written manifest on the cluster, as `meshjob simulate` predicts it
        (meshjob.search.job_step); None when its meshes do not fit on the cluster's hosts, or its plan's
        schedule holds more than a device's memory."""
        job = parse_job(self.manifest(c))
        try:
            run = job_step(job, self.cluster, self.figures(c), simulate_delays=self.simulate_delays)
        except PlacementError:
            return None
        memory = self.memory(c, run.plan.schedules)
        if max(memory) > self.cluster.memory:
            return None
        result, step = run.pipeline, run.step_s
        tokens = job.training.global_batch * job.model.seq_len
        return Prediction(
            candidate=c,
            step_s=step,
            bound_s=self.bound(c),
            tokens_per_s=tokens / step if step > 0 else INF,
            bubble=sum(max(0.0, 1 - s.compute_s / step) for s in result.stages.values()) / len(run.ends),
            resharding_s=sum(result.transfer_s.values()),
            exposed_comm_s=max((s.exposed_comm_s for s in result.stages.values()), default=0.0),
            allreduce_s=max(f.allreduce_s for f in run.figures),
            compute_s=max(s.compute_s for s in result.stages.values()),
            memory=memory,
            weight_delay=dict(run.plan.weight_delay),
        )

    def expand(
        self, m: int, kind: str, delay: int | str, layers: Sequence[int], choices: Sequence[StageChoice]
    ) -> list[Candidate]:
        """The structure with every stage order, strategy and balancer of the space."""
        return [
            Candidate(m, kind, str(delay), tuple(layers), tuple(choices), s, b, o)
            for o in self.space.stage_orders
            for s in self.space.strategies
            for b in self.space.balancers
        ]

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
    raise UsageError(
        f"stage mesh {list(choice.mesh)} (dataParallelDims {list(choice.dp_dims)}, tensorParallelDim "
        f"{choice.tp_dim}) is not one the search may use on this cluster and model"
    )


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
