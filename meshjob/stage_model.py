"""One pipeline stage as `meshjob tune` sees it: a submesh, its data/tensor-parallel split, and what a
range of layers costs on it (seconds per microbatch, gradient all-reduce, bytes per device).

Submeshes follow Alpa's stage construction: (1, d) for d a power of two below the devices per host, or
(n, D) whole hosts, so that every set of them with at most the cluster's devices packs onto its hosts.
Within a submesh the stage shards the batch over one mesh dim and the layers' weights over the other
(Megatron tensor parallelism); a dim of size 1 carries neither.

Compute: FLOPs of the blocks (2 x parameters x tokens plus attention's 4 s^2 h per sample) and of the
head on the last stage, on dp x tp devices at the device's rate. Backward = input gradient (I) + weight
gradient (W), one forward each (meshjob.costs' factor 2); full recompute adds a forward to I. Tensor
parallel adds Megatron's two all-reduces of the activation per block in F and two in I; data parallel
adds a ring all-reduce of the stage's gradients after the step. A ring over devices of one host runs at
the device link's rate; one across hosts shares each host's NIC with the host's other rings.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshjob.costs import StageCost
from meshjob.tune_cluster import Cluster
from meshjob.memory_model import FLOAT32, block_parameters, stage_memory, stage_parameters
from meshjob.spec import BUILTIN_MODEL_KINDS, tensor_parallel_sizes


@dataclass(frozen=True)
class StageChoice:
    """A submesh [hosts, devices per host] and the mesh dims data and tensor parallelism run over."""

    mesh: tuple[int, int]
    dp_dim: int | None
    tp_dim: int | None

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Sort key (None sorts first)."""
        return (*self.mesh, -1 if self.dp_dim is None else self.dp_dim, -1 if self.tp_dim is None else self.tp_dim)

    def __lt__(self, other: "StageChoice") -> bool:
        return self.key < other.key

    @property
    def devices(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def dp(self) -> int:
        return 1 if self.dp_dim is None else self.mesh[self.dp_dim]

    @property
    def tp(self) -> int:
        return 1 if self.tp_dim is None else self.mesh[self.tp_dim]

    def to_stage(self, first: int, last: int) -> dict[str, object]:
        """The manifest's spec.stages[] entry."""
        out: dict[str, object] = {"layers": [first, last], "mesh": list(self.mesh)}
        if self.dp_dim is not None:
            out["dataParallelDim"] = self.dp_dim
        if self.tp_dim is not None:
            out["tensorParallelDim"] = self.tp_dim
        return out

    def label(self) -> str:
        return f"{self.mesh[0]}x{self.mesh[1]} dp{self.dp} tp{self.tp}"


def submeshes(cluster: Cluster) -> list[tuple[int, int]]:
    d = cluster.devices_per_host
    partial = [(1, 1 << k) for k in range(d.bit_length()) if (1 << k) < d and d % (1 << k) == 0]
    return partial + [(n, d) for n in range(1, cluster.hosts + 1)]


def _splits(mesh: tuple[int, int]) -> list[tuple[int | None, int | None]]:
    n, d = mesh
    if n > 1 and d > 1:
        return [(0, 1), (1, 0)]
    if n > 1:
        return [(0, None), (None, 0)]
    if d > 1:
        return [(1, None), (None, 1)]
    return [(None, None)]


def stage_choices(model, training, cluster: Cluster) -> list[StageChoice]:
    """Every (submesh, split) the spec would accept: dp divides the microbatch, tp the model's dims."""
    sizes = tensor_parallel_sizes(model) if model.kind in BUILTIN_MODEL_KINDS else {}
    out = []
    for mesh in submeshes(cluster):
        for dp_dim, tp_dim in _splits(mesh):
            c = StageChoice(mesh, dp_dim, tp_dim)
            if training.microbatch_size % c.dp:
                continue
            if c.tp > 1 and (not sizes or any(size % c.tp for size in sizes.values())):
                continue
            out.append(c)
    return sorted(out)


def _ring_s(nbytes: float, ranks: int, dim: int | None, choice: StageChoice, cluster: Cluster) -> float:
    """A ring all-reduce of nbytes among `ranks` devices along mesh dim `dim`."""
    if ranks <= 1:
        return 0.0
    net = cluster.network
    if dim == 0:  # across hosts: the host's other devices run their own rings through the same NIC
        rate = net.nic_bytes_per_s / choice.mesh[1]
        message = net.message_s
    else:
        rate, message = net.intra_host_bytes_per_s, net.intra_message_s
    return 2 * (ranks - 1) / ranks * nbytes / rate + 2 * (ranks - 1) * message


@dataclass(frozen=True)
class StageFigures:
    """What layers [first, last) cost on one StageChoice, for one microbatch size."""

    cost: StageCost  # per microbatch, one device
    allreduce_s: float  # gradient all-reduce after the step

    @property
    def per_microbatch_s(self) -> float:
        return self.cost.forward_s + self.cost.backward_s


def layer_flops(model) -> float:
    """Forward FLOPs of one block for one sample."""
    s, h = model.seq_len, model.hidden
    return 2 * block_parameters(model) * s + 4 * s * s * h


def stage_figures(model, training, cluster: Cluster, first: int, last: int, choice: StageChoice
                  ) -> StageFigures:
    samples = training.microbatch_size / choice.dp
    flops = (last - first) * layer_flops(model)
    if last == model.layers:
        flops += 2 * model.seq_len * model.hidden * model.vocab
    compute = flops * samples / choice.tp / cluster.device.flops_per_s(training.precision)
    act = FLOAT32 * samples * model.seq_len * model.hidden
    tp_s = 2 * (last - first) * _ring_s(act, choice.tp, choice.tp_dim, choice, cluster)
    recompute = compute if training.recompute == "full" else 0.0
    grads = FLOAT32 * -(-stage_parameters(model, first, last) // choice.tp)
    ar = _ring_s(grads, choice.dp, choice.dp_dim, choice, cluster)
    return StageFigures(StageCost(compute + tp_s, compute + tp_s + recompute, compute), ar)


def stage_bytes(model, training, first: int, last: int, choice: StageChoice, stashed: int,
                boundary_directions: int) -> int:
    return stage_memory(model, training, first, last, choice.dp, choice.tp, stashed, training.recompute,
                        boundary_directions).total
