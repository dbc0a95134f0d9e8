"""One pipeline stage as `meshjob tune` sees it: a submesh, its data/tensor-parallel split, and what a
range of layers costs on it (seconds per microbatch, gradient all-reduce, bytes per device).

Submeshes follow Alpa's stage construction: (1, d) for d a power of two below the devices per host, or
(n, D) whole hosts, so that every set of them with at most the cluster's devices packs onto its hosts. For a
model with skip edges the space adds (n, d), d devices on each of n hosts, which a folded stage order pairs
with the mirror stage on the same hosts (a set that does not pack is dropped when placement fails).
Within a submesh the stage shards the batch over one mesh dim and the layers' weights over the other
(Megatron tensor parallelism), or, on several whole hosts, the batch over both dims (all data parallel:
across the hosts, then over each host's devices); a dim of size 1 carries neither.

Compute: meshjob.costs.device_costs' roofline of the stage's shapes on the cluster's device (the one emulated compute
waits: F, I, W of a microbatch, and the optimizer step); full recompute adds a forward to I. Tensor parallel
adds Megatron's two all-reduces of the activation per block in F and two in I; data parallel adds a ring
all-reduce of the stage's gradients after the step (meshjob.search.gradient_sync, which also shares a host's NIC
between stages whose rings cross it), then the optimizer step. A tensor-parallel ring inside a host runs at the
device link's rate, a gradient ring inside a host at the network model's intra-host rate (on a real cluster
both are the device link); a ring across hosts (tensor or data parallel over mesh dim 0) shares each host's NIC
with the host's other rings; an all-data-parallel stage's one ring over all its devices crosses each NIC once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshjob.costs.compute import StageCost
from meshjob.costs.device_costs import range_work, work_cost
from meshjob.search.cluster import Cluster
from meshjob.search.gradient_sync import GradientSync
from meshjob.search.memory_model import stage_memory
from meshjob.spec.manifest import (
    BUILTIN_MODEL_KINDS,
    ModelSpec,
    TrainingJob,
    TrainingSpec,
    kv_heads_split,
    skip_pairs,
    tensor_parallel_sizes,
)


@dataclass(frozen=True)
class StageChoice:
    """A submesh [hosts, devices per host], the mesh dims data parallelism runs over (major first; () for
    none, (0, 1) for all data parallel) and the one tensor parallelism runs over."""

    mesh: tuple[int, int]
    dp_dims: tuple[int, ...]
    tp_dim: int | None

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """Sort key (None sorts first): one data-parallel dim sorts as it did before all-data-parallel choices."""
        dp = (*self.dp_dims, -1, -1)
        return (*self.mesh, dp[0], -1 if self.tp_dim is None else self.tp_dim, dp[1])

    def __lt__(self, other: StageChoice) -> bool:
        return self.key < other.key

    @property
    def devices(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def dp(self) -> int:
        return math.prod(self.mesh[d] for d in self.dp_dims)

    @property
    def tp(self) -> int:
        return 1 if self.tp_dim is None else self.mesh[self.tp_dim]

    @property
    def dp_dim(self) -> int | None:
        """The major data-parallel mesh dim (None without data parallelism): 0 when the batch splits across hosts."""
        return self.dp_dims[0] if self.dp_dims else None

    @property
    def dp_hosts(self) -> int:
        """The parts the batch splits into across hosts: mesh[0] when data parallelism runs over mesh dim 0."""
        return self.mesh[0] if 0 in self.dp_dims else 1

    def to_stage(self, first: int, last: int) -> dict[str, object]:
        """The manifest's spec.stages[] entry: dataParallelDim for one data-parallel dim (as written before
        dataParallelDims existed), dataParallelDims for several."""
        out: dict[str, object] = {"layers": [first, last], "mesh": list(self.mesh)}
        if len(self.dp_dims) == 1:
            out["dataParallelDim"] = self.dp_dims[0]
        elif self.dp_dims:
            out["dataParallelDims"] = list(self.dp_dims)
        if self.tp_dim is not None:
            out["tensorParallelDim"] = self.tp_dim
        return out

    def label(self) -> str:
        return f"{self.mesh[0]}x{self.mesh[1]} dp{self.dp} tp{self.tp}"


def submeshes(cluster: Cluster, strided: bool = False) -> list[tuple[int, int]]:
    """Alpa's (1, w) for w below the devices per host, and (n, D) whole hosts; `strided` adds (n, w), w devices
    on each of n hosts (n a power of two), so that a folded stage takes the hosts' other devices and the
    skip edges between them stay on each host."""
    d = cluster.devices_per_host
    widths = [1 << k for k in range(d.bit_length()) if (1 << k) < d and d % (1 << k) == 0]
    rows = [1 << k for k in range(1, cluster.hosts.bit_length())] if strided else []
    return sorted(
        [(1, w) for w in widths]
        + [(n, w) for n in rows for w in widths]
        + [(n, d) for n in range(1, cluster.hosts + 1)]
    )


def _splits(mesh: tuple[int, int]) -> list[tuple[tuple[int, ...], int | None]]:
    """(data-parallel dims, tensor-parallel dim) of a submesh: each dim of size > 1 carries one of them, or,
    on several whole hosts, both dims carry the batch (Alpa's all-data-parallel stage)."""
    n, d = mesh
    if n > 1 and d > 1:
        return [((0,), 1), ((1,), 0), ((0, 1), None)]
    if n > 1:
        return [((0,), None), ((), 0)]
    if d > 1:
        return [((1,), None), ((), 1)]
    return [((), None)]


def stage_choices(model: ModelSpec, training: TrainingSpec, cluster: Cluster) -> list[StageChoice]:
    """Every (submesh, split) the spec would accept: dp divides the microbatch, tp the model's dims."""
    sizes = tensor_parallel_sizes(model) if model.kind in BUILTIN_MODEL_KINDS else {}
    out: list[StageChoice] = []
    for mesh in submeshes(cluster, strided=bool(skip_pairs(model))):
        for dp_dims, tp_dim in _splits(mesh):
            c = StageChoice(mesh, dp_dims, tp_dim)
            if training.microbatch_size % c.dp:
                continue
            if c.tp > 1 and (not sizes or any(size % c.tp for size in sizes.values())):
                continue
            if c.tp > 1 and model.kind == "llama" and not kv_heads_split(model, c.tp):
                continue
            out.append(c)
    return sorted(out)


def _ring_s(nbytes: float, ranks: int, dim: int | None, choice: StageChoice, cluster: Cluster) -> float:
    """A tensor-parallel ring all-reduce of nbytes among `ranks` devices along mesh dim `dim`."""
    if ranks <= 1:
        return 0.0
    net = cluster.network
    if dim == 0:  # across hosts: the host's other devices run their own rings through the same NIC
        rate = net.nic_bytes_per_s / choice.mesh[1]
        message = net.message_s
    else:  # the devices' own link (NVLink)
        rate, message = cluster.device.link_bytes_per_s, net.intra_message_s
    return 2 * (ranks - 1) / ranks * nbytes / rate + 2 * (ranks - 1) * message


def gradient_sync(nbytes: float, choice: StageChoice, cluster: Cluster, optimizer_s: float) -> GradientSync:
    """The stage's tail: a ring all-reduce of its nbytes of local gradients among its data-parallel devices,
    then its optimizer step. Across hosts (dp over mesh dim 0 alone) each of its devices on a host runs its own
    ring through that host's NIC; all data parallel (dims 0 and 1), one ring runs over every device, host by
    host: it crosses each host's NIC once each way, and its hops inside a host run at the intra-host rate
    alongside (the slower of the two paces it). Inside a host the ring runs at the network model's intra-host
    rate (the device link on a real cluster, where the two are the same; loopback between an emulated host's
    ranks)."""
    ranks, net = choice.dp, cluster.network
    if ranks <= 1:
        return GradientSync(0.0, 0, optimizer_s)
    share = 2 * (ranks - 1) / ranks * nbytes  # what each device sends and receives
    if choice.dp_hosts > 1 and ranks > choice.dp_hosts:
        nic_s = share / net.nic_bytes_per_s
        inside = max(0.0, share / net.intra_host_bytes_per_s - nic_s)  # the intra-host hops, where they are slower
        return GradientSync(nic_s, 1, inside + 2 * (ranks - 1) * net.message_s + optimizer_s)
    if choice.dp_hosts > 1:
        flows = choice.mesh[1]
        return GradientSync(share * flows / net.nic_bytes_per_s, flows, 2 * (ranks - 1) * net.message_s + optimizer_s)
    return GradientSync(
        0.0, 0, share / net.intra_host_bytes_per_s + 2 * (ranks - 1) * net.intra_message_s + optimizer_s
    )


@dataclass(frozen=True)
class StageFigures:
    """What layers [first, last) cost on one StageChoice, for one microbatch size."""

    cost: StageCost  # per microbatch, one device
    sync: GradientSync  # after its last action: the gradient all-reduce (with its hosts to itself), the optimizer
    optimizer_s: float

    @property
    def per_microbatch_s(self) -> float:
        return self.cost.forward_s + self.cost.backward_s

    @property
    def tail_s(self) -> float:
        """The gradient all-reduce and the optimizer step, no other stage sharing the NICs."""
        return self.sync.alone_s

    @property
    def allreduce_s(self) -> float:
        return self.sync.alone_s - self.optimizer_s


def stage_figures(
    model: ModelSpec, training: TrainingSpec, cluster: Cluster, first: int, last: int, choice: StageChoice
) -> StageFigures:
    """F, I, W from meshjob.costs.device_costs (what emulated compute waits) on the cluster's device, plus the
    tensor-parallel all-reduces and full recompute's forward;
    the tail: the device's gradients all-reduced, then its optimizer step (device_costs' again)."""
    own = work_cost(range_work(model, training, first, last, choice.dp, choice.tp), cluster.device.profile)
    act = training.activation_itemsize * training.microbatch_size / choice.dp * model.seq_len * model.hidden
    tp_s = 2 * (last - first) * _ring_s(act, choice.tp, choice.tp_dim, choice, cluster)
    forward = own.stage.forward_s + tp_s
    recompute = forward if training.recompute == "full" else 0.0
    cost = StageCost(forward, own.stage.input_grad_s + tp_s + recompute, own.stage.weight_grad_s)
    sync = gradient_sync(training.grad_reduce_itemsize * own.params, choice, cluster, own.optimizer_s)
    return StageFigures(cost, sync, own.optimizer_s)


def job_figures(job: TrainingJob, cluster: Cluster) -> list[StageFigures]:
    """stage_figures of every stage of a written job (two-dim meshes)."""
    out: list[StageFigures] = []
    for i, st in enumerate(job.stages):
        if len(st.mesh) != 2:
            raise ValueError(
                f"spec.stages[{i}].mesh {list(st.mesh)} is invalid here: two dims [hosts, devices per host]"
            )
        choice = StageChoice((st.mesh[0], st.mesh[1]), st.dp_dims, st.tensor_parallel_dim)
        out.append(stage_figures(job.model, job.training, cluster, *st.layers, choice))
    return out


def stage_bytes(
    model: ModelSpec,
    training: TrainingSpec,
    first: int,
    last: int,
    choice: StageChoice,
    stashed: int,
    boundary_directions: int,
) -> int:
    return stage_memory(
        model, training, first, last, choice.dp, choice.tp, stashed, training.recompute, boundary_directions
    ).total
