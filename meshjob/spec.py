"""The TrainingJob model (DESIGN.md "user-facing API"), parsed and validated from YAML.

CONTRACT STUB: the dataclasses and function signatures below are the interface other modules
code against. The owner of this module fills in parsing/validation; names stay.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from meshjob.errors import FieldError, SpecError

API_VERSION = "meshjob.io/v1alpha1"
KIND = "TrainingJob"
MODEL_KINDS = ("gpt", "utransformer")
STRATEGIES = ("send_recv", "local_allgather", "global_allgather", "broadcast", "signal")
BALANCERS = ("naive", "load_balance", "dfs", "greedy")
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")
WEIGHT_GRAD_DELAY = ("off", "on", "auto")
CLEAN_POD_POLICIES = ("All", "Running", "None")


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "gpt"
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    vocab: int = 1024
    seq_len: int = 128  # YAML: seqLen


@dataclass(frozen=True)
class CheckpointSpec:
    every: int = 0  # 0 = never
    path: str = ""


@dataclass(frozen=True)
class TrainingSpec:
    steps: int = 20
    global_batch: int = 32  # YAML: globalBatch
    microbatches: int = 8
    learning_rate: float = 3.0e-4  # YAML: learningRate
    seed: int = 0
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // self.microbatches


@dataclass(frozen=True)
class TopologySpec:
    devices_per_host: int = 1  # YAML: devicesPerHost
    host_label: str = "kubernetes.io/hostname"
    rack_label: str = "topology.kubernetes.io/zone"
    device_resource: str = "cpu"  # or nvidia.com/gpu


@dataclass(frozen=True)
class StageSpec:
    layers: tuple[int, int]  # half-open [first, last) layer range
    mesh: tuple[int, ...]  # dim 0 across hosts, the rest within a host; 1-3 dims
    data_parallel_dim: int | None = None  # YAML: dataParallelDim
    tensor_parallel_dim: int | None = None  # YAML: tensorParallelDim


@dataclass(frozen=True)
class EdgeSpec:
    src: int  # YAML: from
    dst: int  # YAML: to
    send: str  # canonical sharding spec of the activation as sent, e.g. "S0RR"
    recv: str  # canonical sharding spec as received on the destination mesh
    tensor: str = "activation"  # "activation" for the chain, "skip<i>" for skip connections


@dataclass(frozen=True)
class ReshardingSpec:
    strategy: str = "broadcast"
    chunks: int = 16
    balancer: str = "greedy"
    budget_seconds: float = 1.0  # YAML: budgetSeconds


@dataclass(frozen=True)
class ScheduleSpec:
    kind: str = "eager-1f1b"
    weight_grad_delay: str = "auto"  # YAML: weightGradDelay


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int = 3
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    clean_pod_policy: str = "Running"
    suspend: bool = False


@dataclass(frozen=True)
class MetricsSpec:
    port: int = 9400


@dataclass(frozen=True)
class TrainingJob:
    name: str
    namespace: str = "default"
    image: str = "meshjob/trainer:0.1.0"
    model: ModelSpec = field(default_factory=ModelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    topology: TopologySpec = field(default_factory=TopologySpec)
    stages: tuple[StageSpec, ...] = ()
    edges: tuple[EdgeSpec, ...] = ()  # always filled after parsing (defaults resolved)
    resharding: ReshardingSpec = field(default_factory=ReshardingSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    resources: Mapping[str, Any] = field(default_factory=dict)  # k8s ResourceRequirements per device

    def activation_shape(self) -> tuple[int, int, int]:
        """(microbatch size, seq, hidden): the tensor every edge carries."""
        return (self.training.microbatch_size, self.model.seq_len, self.model.hidden)


def natural_layout(stage: StageSpec) -> str:
    """Batch sharded over the data-parallel mesh dim, replicated otherwise (canonical spec)."""
    raise NotImplementedError


def parse_job(doc: Mapping[str, Any]) -> TrainingJob:
    """Validate a whole TrainingJob document; raise SpecError with every problem at once."""
    raise NotImplementedError


def load_job(path: str) -> TrainingJob:
    """Read YAML from a file and parse_job() it (YAML errors become SpecError too)."""
    raise NotImplementedError


def job_to_dict(job: TrainingJob) -> dict[str, Any]:
    """The camelCase manifest form of a job (parse_job(job_to_dict(j)) == j)."""
    raise NotImplementedError
