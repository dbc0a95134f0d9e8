"""The Plan: everything decided before a process starts (placement, boundaries, schedules).

build_plan(job) places the stage meshes on hosts, then for every edge builds two Boundaries:
the forward one (the edge's tensor, src mesh in the `send` layout -> dst mesh in the `recv`
layout) and the backward one (its gradient, dst mesh in `recv` -> src mesh in `send`), each named
by a BoundaryKey. Each boundary is decomposed into unit tasks, balanced at host level (sender host and start time per
task), and lowered task by task, in start order, into point-to-point steps from the chosen sender
rank. Schedules come from job.schedule; the plan is validated and deterministic.

Weight-grad delay (job.schedule.weightGradDelay):
  off   backward not split (B)
  on    split into I and W; each stage that sends gradients delays one W
  auto  split; each stage delays ceil(comm / W) W's (§4 of
        "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022):
        the least delay that covers the communication), where comm = the summed balanced makespans of the gradient
        boundaries the stage sends and W = the weight-grad time of one microbatch from the
        simulator's cost model (layer_forward_s x layers x samples / (tp x dp) x backward_factor / 2),
        capped at M - 1.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from meshjob import balance as bal
from meshjob.boundary import BoundaryKey
from meshjob.mesh import Mesh
from meshjob.network import auto_chunks
from meshjob.placement import Host, Placement, default_hosts, place
from meshjob.resharding import Step, UnitTask, decompose, lower
from meshjob.schedule import Action, generate, peak_stashed, validate, weight_delay_for
from meshjob.sharding import ShardingSpec
from meshjob.simulate import CostModel
from meshjob.spec import ReshardingSpec, TrainingJob

ITEMSIZE = 4  # float32 activations


@dataclass(frozen=True)
class Boundary:
    key: BoundaryKey  # sending stage -> receiving stage, tensor, direction
    shape: tuple[int, ...]
    send: ShardingSpec  # layout on the src mesh
    recv: ShardingSpec  # layout on the dst mesh
    strategy: str
    balancer: str
    chunks: int
    tasks: tuple[UnitTask, ...]
    schedule: bal.Schedule
    senders: tuple[int, ...]  # chosen sender rank per task
    steps: tuple[Step, ...]  # lowered, ordered by task start

    @property
    def src(self) -> int:
        return self.key.src

    @property
    def dst(self) -> int:
        return self.key.dst

    @property
    def tensor(self) -> str:
        return self.key.tensor

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan_s

    @property
    def lower_bound_s(self) -> float:
        return self.schedule.lower_bound_s

    @property
    def is_backward(self) -> bool:
        return self.key.grad

    def task_order(self) -> list[int]:
        """Task indices by start time (ties by index): the order the steps were lowered in."""
        return sorted(range(len(self.tasks)), key=lambda i: (self.schedule.start_s[i], i))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": str(self.key),
            "from": self.src,
            "to": self.dst,
            "tensor": self.tensor,
            "grad": self.key.grad,
            "shape": list(self.shape),
            "send": str(self.send),
            "recv": str(self.recv),
            "strategy": self.strategy,
            "balancer": self.balancer,
            "chunks": self.chunks,
            "makespan_s": self.makespan_s,
            "lower_bound_s": self.lower_bound_s,
            "num_steps": len(self.steps),
            "tasks": [
                {
                    "slice": [list(interval) for interval in task.slice],
                    "senders": list(task.senders),
                    "receivers": list(task.receivers),
                    "sender": self.senders[i],
                    "bytes": task.bytes,
                    "start_s": self.schedule.start_s[i],
                    "seconds": self.schedule.seconds[i],
                }
                for i, task in enumerate(self.tasks)
            ],
        }


@dataclass(frozen=True)
class Plan:
    job: TrainingJob
    placement: Placement
    boundaries: tuple[Boundary, ...]
    schedules: dict[int, tuple[Action, ...]]
    nic_bytes_per_s: float
    split_backward: bool = False
    weight_delay: dict[int, int] = field(default_factory=dict)

    def mesh(self, stage: int) -> Mesh:
        return self.placement.mesh(stage)

    def boundary(self, key: BoundaryKey) -> Boundary:
        for b in self.boundaries:
            if b.key == key:
                return b
        raise KeyError(f"no boundary {key} in plan {self.job.name!r}")

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: the plan's one fingerprint. Ranks that built their plan on
        their own compare it before any transfer can hang, and workers compare it with the digest
        the operator rendered (meshjob.rendered)."""
        return _sha256(self.to_json())

    def section_digests(self) -> dict[str, str]:
        """The digest of each top-level key of the JSON: says where two plans differ."""
        return {key: _sha256(value) for key, value in self.to_json().items()}

    def to_json(self) -> dict[str, Any]:
        """The `meshjob plan --json` contract (placement, boundaries, schedules) plus hosts, meshes,
        world size and the schedule settings."""
        placement = self.placement
        return {
            "job": self.job.name,
            "world_size": placement.world_size,
            "nic_bytes_per_s": self.nic_bytes_per_s,
            "hosts": [
                {"name": h.name, "devices": h.devices, "rack": h.rack, "ranks": list(placement.ranks_on(i))}
                for i, h in enumerate(placement.hosts)
            ],
            "meshes": [
                {"stage": s, "shape": list(m.shape), "ranks": list(m.ranks), "hosts": list(m.hosts)}
                for s, m in ((s, self.mesh(s)) for s in range(len(self.job.stages)))
            ],
            "placement": placement.to_json(),
            "boundaries": [b.to_json() for b in self.boundaries],
            "schedule": {
                "kind": self.job.schedule.kind,
                "weight_grad_delay": self.job.schedule.weight_grad_delay,
                "split_backward": self.split_backward,
                "weight_delay": {str(s): d for s, d in sorted(self.weight_delay.items())},
                "peak_stashed": {str(s): n for s, n in peak_stashed(self.schedules).items()},
            },
            "schedules": {str(s): [str(a) for a in actions] for s, actions in sorted(self.schedules.items())},
        }


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _host_tasks(tasks: Sequence[UnitTask], host_of: Callable[[int], int]) -> list[bal.HostTask]:
    def hosts(ranks: Sequence[int]) -> tuple[int, ...]:
        return tuple(dict.fromkeys(host_of(r) for r in ranks))

    return [bal.HostTask(hosts(t.senders), hosts(t.receivers), t.bytes) for t in tasks]


def _receivers_per_host(tasks: Sequence[UnitTask], host_of: Callable[[int], int]) -> int:
    most = 1
    for task in tasks:
        counts: dict[int, int] = {}
        for rank in task.receivers:
            counts[host_of(rank)] = counts.get(host_of(rank), 0) + 1
        most = max([most] + list(counts.values()))
    return most


def lower_in_start_order(tasks: Sequence[UnitTask], schedule: bal.Schedule, host_of: Callable[[int], int],
                         strategy: str, chunks: int) -> tuple[tuple[int, ...], tuple[Step, ...]]:
    """(sender rank per task, the lowered steps in task-start order). On the balancer's sender host the
    holder with the fewest bytes to send so far sends: spreads a host's sends over its devices.
    Decided in start order, so it is deterministic."""
    load: dict[int, int] = {}
    chosen: dict[int, int] = {}
    steps: list[Step] = []
    for i in sorted(range(len(tasks)), key=lambda i: (schedule.start_s[i], i)):
        host = schedule.sender_host[i]
        holders = [r for r in tasks[i].senders if host_of(r) == host]
        if not holders:
            raise ValueError(f"balancer chose host {host} for task {i}, which holds none of its senders")
        rank = min(holders, key=lambda r: (load.get(r, 0), r))
        load[rank] = load.get(rank, 0) + tasks[i].bytes
        chosen[i] = rank
        steps += lower(tasks[i], i, rank, strategy, chunks, host_of, len(steps))
    return tuple(chosen[i] for i in range(len(tasks))), tuple(steps)


def plan_boundary(
    key: BoundaryKey,
    shape: tuple[int, ...],
    src: tuple[Mesh, ShardingSpec],
    dst: tuple[Mesh, ShardingSpec],
    resharding: ReshardingSpec,
    host_of: Callable[[int], int],
    nic_bytes_per_s: float,
    seed: int = 0,
) -> Boundary:
    """Decompose, balance and lower one transfer of a tensor of `shape` from (mesh, layout) `src` to `dst`.
    The plan's boundaries come from here, and so do the benchmarks' and tests' that need no whole job."""
    (src_mesh, send), (dst_mesh, recv) = src, dst
    tasks = tuple(decompose(shape, src_mesh, send, dst_mesh, recv, ITEMSIZE))
    host_tasks = _host_tasks(tasks, host_of)
    chunks = resharding.chunks if isinstance(resharding.chunks, int) else auto_chunks(
        max((t.bytes for t in tasks), default=1), max((len(t.receiver_hosts) for t in host_tasks), default=1),
        nic_bytes_per_s)
    schedule = bal.balance(
        host_tasks,
        resharding.balancer,
        resharding.strategy,
        chunks,
        nic_bytes_per_s,
        budget_s=resharding.budget_seconds,
        seed=seed,
        receiver_devices_per_host=_receivers_per_host(tasks, host_of),
    )
    senders, steps = lower_in_start_order(tasks, schedule, host_of, resharding.strategy, chunks)
    return Boundary(
        key=key, shape=shape, send=send, recv=recv, strategy=resharding.strategy, balancer=resharding.balancer,
        chunks=chunks, tasks=tasks, schedule=schedule, senders=senders, steps=steps,
    )


def build_boundary(job: TrainingJob, placement: Placement, key: BoundaryKey, send: str, recv: str,
                   nic_bytes_per_s: float) -> Boundary:
    shape = tuple(job.activation_shape())
    return plan_boundary(key, shape, (placement.mesh(key.src), ShardingSpec.parse(send, len(shape))),
                         (placement.mesh(key.dst), ShardingSpec.parse(recv, len(shape))), job.resharding,
                         placement.host_of, nic_bytes_per_s, job.training.seed)


def _boundaries(job: TrainingJob, placement: Placement, nic_bytes_per_s: float) -> list[Boundary]:
    out: list[Boundary] = []
    for edge in job.edges:
        forward = BoundaryKey(edge.src, edge.dst, edge.tensor)
        out.append(build_boundary(job, placement, forward, edge.send, edge.recv, nic_bytes_per_s))
        out.append(build_boundary(job, placement, forward.backward(), edge.recv, edge.send, nic_bytes_per_s))
    return out


def weight_grad_seconds(job: TrainingJob, stage: int, cost: CostModel) -> float:
    """One microbatch's W on one stage: half of the backward, which is backward_factor forwards."""
    st = job.stages[stage]
    forward = cost.forward_s(st.layers[1] - st.layers[0], job.training.microbatch_size, st.tensor_parallel,
                           st.data_parallel)
    return forward * cost.backward_factor / 2


def weight_delays(job: TrainingJob, boundaries: Sequence[Boundary], cost: CostModel) -> tuple[bool, dict[int, int]]:
    """(split_backward, W's each stage delays) for job.schedule.weightGradDelay."""
    mode = job.schedule.weight_grad_delay
    if mode == "off":
        return False, {}
    cap = max(0, job.training.microbatches - 1)
    delays: dict[int, int] = {}
    for stage in range(len(job.stages)):
        comm_s = sum(b.makespan_s for b in boundaries if b.is_backward and b.src == stage)
        if mode == "on":
            delays[stage] = min(1, cap) if any(b.is_backward and b.src == stage for b in boundaries) else 0
        else:
            delays[stage] = weight_delay_for(comm_s, weight_grad_seconds(job, stage, cost), cap)
    return True, delays


def _edges(job: TrainingJob) -> list[tuple[int, int, str]]:
    return [(e.src, e.dst, e.tensor) for e in job.edges]


def build_plan(
    job: TrainingJob,
    hosts: Sequence[Host] | None = None,
    nic_bytes_per_s: float = 1e9 / 8,
    cost: CostModel | None = None,
) -> Plan:
    """Place, decompose, balance, lower and schedule. Raises PlacementError when the hosts
    cannot hold the job; the same inputs always give the same plan."""
    if not nic_bytes_per_s > 0:
        raise ValueError(f"nic_bytes_per_s must be > 0, got {nic_bytes_per_s}")
    cost = cost or CostModel(nic_bytes_per_s=nic_bytes_per_s)
    placement = place(job, default_hosts(job) if hosts is None else hosts)
    boundaries = _boundaries(job, placement, nic_bytes_per_s)
    split, delays = weight_delays(job, boundaries, cost)
    edges = _edges(job)
    microbatches = job.training.microbatches
    lists = generate(job.schedule.kind, len(job.stages), microbatches, edges, split, delays)
    validate(lists, edges, microbatches, split)
    return Plan(
        job=job,
        placement=placement,
        boundaries=tuple(boundaries),
        schedules={s: tuple(actions) for s, actions in lists.items()},
        nic_bytes_per_s=nic_bytes_per_s,
        split_backward=split,
        weight_delay=delays,
    )

