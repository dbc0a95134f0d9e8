"""The TrainingJob model: the dataclasses a manifest parses into, the bounds of every count, and
the facts about a job that planner, trainer and operator share (natural layouts, the model's edges).

meshjob.spec.manifest parses and validates manifests into these types (its field table: meshjob.spec.table;
its semantic rules: meshjob.spec.checks). Nothing here reads YAML or checks input.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshjob.layout.stage_order import DEFAULT_STAGE_ORDER
from meshjob.spec.api import TRAINER_METRICS_PORT

MODEL_KINDS = ("gpt", "utransformer", "llama", "custom")
INIT_KINDS = ("huggingface",)  # spec.model.init: where a job's starting weights come from
INIT_MODEL_KINDS = ("llama",)  # the families whose weights spec.model.init loads
RMS_NORM_EPS = 1e-5  # llama's RMSNorm epsilon (Llama 2 and 3's); a Hugging Face config must agree
BUILTIN_MODEL_KINDS = ("gpt", "utransformer", "llama")  # the families with tensor parallelism
DATA_KINDS = ("synthetic", "tokens")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
TOKEN_DTYPES = ("uint16", "uint32")
PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "full")
OPTIMIZER_KINDS = ("adamw",)
MAX_ZERO_STAGE = 1
AUTO = "auto"
CHUNKS_AUTO = (AUTO,)
CLEAN_POD_POLICIES = ("All", "Running", "None")
ACTIVATION = "activation"

# Upper bounds of every count. Real deployments stay far inside them (the largest published runs:
# Llama 3 405B on 16,384 GPUs in 2,048 hosts, pipeline depth 16; Megatron's 1T model with 128
# layers, hidden 25,600, pipeline depth 64; vocabularies up to 256k; contexts up to 1M tokens).
# They exist so that every input costs bounded time and memory: the parser checks them before any
# work that grows with them, and the CRD carries them as maximum/maxItems/maxLength so the API
# server refuses the same values.
MAX_LAYERS = 1024
MAX_HIDDEN = 65536
MAX_HEADS = 1024
MAX_VOCAB = 2**20
MAX_SEQ_LEN = 2**20
MAX_STEPS = 10**8
MAX_GLOBAL_BATCH = 2**20
MAX_MICROBATCHES = 4096
MAX_SEED = 2**32 - 1  # the trainer derives per-tensor seeds from it; numpy's range
MAX_DEVICES_PER_HOST = 1024  # devices may be CPU cores: hosts with a few hundred exist
MAX_STAGES = 128
MAX_MESH_DIMS = 3
MAX_MESH_DIM = 4096
MAX_STAGE_DEVICES = 4096  # devices in one stage's mesh: per-device planning (tiles) stays bounded
MAX_JOB_HOSTS = 1024  # mesh rows (hosts) of all stages together: placement grows with their square
MAX_WORLD_SIZE = 16384  # devices of all stages together
MAX_SCHEDULE_CELLS = 16384  # stages x microbatches: the size of the per-stage action lists
MAX_EDGES = MAX_STAGES - 1 + MAX_LAYERS // 2  # the chain plus every utransformer skip edge
MAX_CHUNKS = 4096
MAX_BUDGET_SECONDS = 60.0
INT32_MAX = 2**31 - 1  # Kubernetes stores these fields as int32 (Job backoffLimit, ttl...)
# ... and these as int64 (activeDeadlineSeconds). The API server reads a CRD's maximum as a float64
# and compares integers with it converted back to int64: 2^63 - 1 rounds up to 2^63, which wraps to
# -2^63 and refuses everything. 2^63 - 1024 is the largest float64 below 2^63.
INT64_MAX = 2**63 - 1024
MAX_NAME = 253  # a DNS-1123 subdomain (service account, scheduler, queue names)
MAX_LABEL_KEY = 317  # prefix (253) + "/" + name (63)
MAX_PATH = 4096  # PATH_MAX
MAX_IMAGE = 1024
MAX_LAYOUT = 32  # a sharding spec such as "S01,R,S2"
MAX_FFN_HIDDEN = 4 * MAX_HIDDEN  # the MLP's inner width: 4 x hidden by default
MAX_ROPE_THETA = 1e9  # Llama 3 uses 500,000; long-context variants a few million
MAX_ENTRYPOINT = 512  # "package.module:function"


@dataclass(frozen=True)
class InitSpec:
    """Where a job's starting weights come from instead of the seed: a Hugging Face save_pretrained
    directory (config.json and model.safetensors) whose config matches spec.model."""

    kind: str = "huggingface"
    path: str = ""  # the directory (relative paths: to the working directory)


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "gpt"
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    vocab: int = 1024
    seq_len: int = 128  # YAML: seqLen
    kv_heads: int | None = None  # YAML: kvHeads; llama: key/value heads (grouped-query attention); None: heads
    ffn_hidden: int | None = None  # YAML: ffnHidden; MLP inner width; None: the family's default (ffn_width)
    tie_embeddings: bool = True  # YAML: tieEmbeddings; the output head reuses the token embedding
    rope_theta: float = 10000.0  # YAML: ropeTheta; llama: base of the rotary position embedding
    entrypoint: str = ""  # custom: "package.module:function" returning the model's parts
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)  # custom: handed to the entry point
    init: InitSpec | None = None  # llama: start from these weights; None: random from spec.training.seed

    @property
    def key_value_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_width(self) -> int:
        """The MLP's inner width: ffnHidden, else 4 x hidden (GELU MLP) or, for llama's SwiGLU,
        8/3 x hidden (the same parameter count as 4 x hidden with two input matrices) rounded up to
        a multiple of 64 so that tensor-parallel degrees up to 64 divide it."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.kind == "llama":
            return 64 * math.ceil(8 * self.hidden / 3 / 64)
        return 4 * self.hidden


@dataclass(frozen=True)
class DataSpec:
    """Where the token sequences come from: a seeded synthetic bigram chain, or token files in the
    flat binary format of nanoGPT (a headerless little-endian array of uint16 or uint32 token ids)."""

    kind: str = "synthetic"
    path: str = ""  # tokens: the training token file (relative paths: to the working directory)
    val_path: str = ""  # YAML: valPath; tokens: the validation token file (needed by evalEvery)
    dtype: str = "uint16"


@dataclass(frozen=True)
class CheckpointSpec:
    every: int = 0  # 0 = never
    path: str = ""
    volume: Mapping[str, Any] | None = None  # operator only: a Kubernetes volume source mounted at `path`


@dataclass(frozen=True)
class LrScheduleSpec:
    """Linear warm-up from 0 to learningRate over warmupSteps, then cosine decay to minLr at the last step."""

    warmup_steps: int = 0  # YAML: warmupSteps
    min_lr: float = 0.0  # YAML: minLr


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str = "adamw"
    zero_stage: int = 0  # YAML: zeroStage; 1: optimizer state sharded over a stage's data-parallel ranks
    weight_decay: float = 0.01  # YAML: weightDecay


@dataclass(frozen=True)
class TrainingSpec:
    steps: int = 20
    global_batch: int = 32  # YAML: globalBatch
    microbatches: int = 8
    learning_rate: float = 3.0e-4  # YAML: learningRate
    seed: int = 0
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    precision: str = "fp32"  # bf16: autocast compute, fp32 master weights, bf16 boundary tensors and TP reductions
    recompute: str = "none"  # full: recompute each block's activations in the backward (per stage: stages[].recompute)
    grad_clip: float | None = None  # YAML: gradClip; max global gradient norm; None: no clipping
    lr_schedule: LrScheduleSpec | None = None  # YAML: lrSchedule; None: a constant learningRate
    eval_every: int = 0  # YAML: evalEvery; steps between validation losses; 0 = never
    eval_batches: int = 2  # YAML: evalBatches; global batches of validation data per evaluation
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    overlap_grad_reduce: bool = True  # YAML: overlapGradReduce; start each bucket's reduction during the backward
    grad_bucket_mib: float = 25.0  # YAML: gradBucketMiB; gradients per data-parallel reduction (torch DDP's 25)
    # YAML: gradReduceDtype; the data-parallel gradient reductions' dtype. fp32 by default: Megatron forces its
    # accumulate_allreduce_grads_in_fp32 under bf16, as bf16's 8-bit sums lose small gradients; bf16 halves the bytes
    grad_reduce_dtype: str = "fp32"
    weight_decay_embeddings: bool = True  # YAML: weightDecayEmbeddings (Megatron decays them); norms, biases never

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // self.microbatches

    @property
    def activation_itemsize(self) -> int:
        """Bytes of one element of what crosses a stage boundary: activations and their gradients travel in
        the training dtype (bf16 under precision bf16, Megatron's pipeline_dtype)."""
        return 2 if self.precision == "bf16" else 4

    @property
    def grad_reduce_itemsize(self) -> int:
        """Bytes of one gradient element in the data-parallel reductions (gradReduceDtype)."""
        return 2 if self.grad_reduce_dtype == "bf16" else 4


@dataclass(frozen=True)
class TopologySpec:
    devices_per_host: int = 1  # YAML: devicesPerHost
    host_label: str = "kubernetes.io/hostname"
    rack_label: str = "topology.kubernetes.io/zone"
    device_resource: str = "cpu"  # or nvidia.com/gpu
    stage_order: str = DEFAULT_STAGE_ORDER  # YAML: stageOrder; meshjob.layout.stage_order


@dataclass(frozen=True)
class StageSpec:
    layers: tuple[int, int]  # half-open [first, last) layer range
    mesh: tuple[int, ...]  # dim 0 across hosts, the rest within a host; 1-3 dims
    # As the manifest writes them: one dim (dataParallelDim) or several (dataParallelDims, major first).
    # Read dp_dims, which is both in one form.
    data_parallel_dim: int | None = None  # YAML: dataParallelDim; the same as dataParallelDims [d]
    data_parallel_dims: tuple[int, ...] | None = None  # YAML: dataParallelDims; mesh dims, major first
    tensor_parallel_dim: int | None = None  # YAML: tensorParallelDim
    recompute: str | None = None  # overrides spec.training.recompute for this stage

    @property
    def size(self) -> int:
        """Devices in this stage's mesh."""
        return math.prod(self.mesh)

    @property
    def dp_dims(self) -> tuple[int, ...]:
        """The mesh dims the batch is sharded over, major first: dataParallelDims, else (dataParallelDim,),
        else () (no data parallelism)."""
        if self.data_parallel_dims is not None:
            return self.data_parallel_dims
        return () if self.data_parallel_dim is None else (self.data_parallel_dim,)

    @property
    def data_parallel(self) -> int:
        """The data-parallel degree: the product of the data-parallel mesh dims' sizes."""
        return math.prod(self.mesh[d] for d in self.dp_dims if d < len(self.mesh))

    @property
    def tensor_parallel(self) -> int:
        return self.mesh[self.tensor_parallel_dim] if self.tensor_parallel_dim is not None else 1


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
    chunks: int | str = "auto"  # K, or "auto": from bytes, receiving hosts and the per-message cost
    balancer: str = "greedy"
    budget_seconds: float = 1.0  # YAML: budgetSeconds


@dataclass(frozen=True)
class ScheduleSpec:
    kind: str = "eager-1f1b"
    weight_grad_delay: int | str = AUTO  # YAML: weightGradDelay; "auto" or W's to delay (0: no split)


@dataclass(frozen=True)
class TunedForSpec:
    """The cluster `meshjob tune` chose the plan for (written by it): `meshjob plan` and `meshjob simulate`
    predict the plan on it unless their flags say otherwise (meshjob.search.settings reads it)."""

    hosts: int
    nic_rate: str  # YAML: nicRate; per host and direction, tc style (100gbit)
    device: str  # a device profile of meshjob.costs.devices (h100, a100)
    memory: str = ""  # per device, e.g. 80Gi; "": the device profile's


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int = 3
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    clean_pod_policy: str = "Running"
    suspend: bool = False


@dataclass(frozen=True)
class MetricsSpec:
    port: int = TRAINER_METRICS_PORT


@dataclass(frozen=True)
class SchedulingSpec:
    """Read by the operator only (meshjob_operator/render.py): gang scheduling, Kueue queue, topology."""

    gang: bool = False  # one PodGroup for all host pods (scheduler-plugins coscheduling)
    scheduler_name: str = ""  # YAML: schedulerName; "" = the operator's default gang scheduler
    queue: str = ""  # Kueue LocalQueue
    topology_level: str = ""  # YAML: topologyLevel; a node label (Kueue required topology)


@dataclass(frozen=True)
class ContainerTemplate:
    """podTemplate.spec.containers[]: merged into the trainer container (operator only)."""

    name: str
    env: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()  # YAML: envFrom
    volume_mounts: tuple[Mapping[str, Any], ...] = ()  # YAML: volumeMounts
    resources: Mapping[str, Any] = field(default_factory=dict)  # per pod, beside spec.resources (per device)


@dataclass(frozen=True)
class PodTemplateMetadata:
    labels: Mapping[str, Any] = field(default_factory=dict)
    annotations: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PodTemplateSpec:
    """The PodSpec fields a job may add to its trainer pods (operator only; merged by meshjob_operator)."""

    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, Any] = field(default_factory=dict)  # YAML: nodeSelector
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None  # YAML: priorityClassName
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()  # YAML: imagePullSecrets
    volumes: tuple[Mapping[str, Any], ...] = ()
    containers: tuple[ContainerTemplate, ...] = ()


@dataclass(frozen=True)
class PodTemplate:
    """spec.podTemplate: a PodTemplateSpec fragment, as Kubeflow and JobSet users write one."""

    metadata: PodTemplateMetadata = field(default_factory=PodTemplateMetadata)
    spec: PodTemplateSpec = field(default_factory=PodTemplateSpec)


@dataclass(frozen=True)
class TrainingJob:
    name: str
    namespace: str = "default"
    image: str = "meshjob/trainer:0.1.0"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    topology: TopologySpec = field(default_factory=TopologySpec)
    stages: tuple[StageSpec, ...] = ()
    edges: tuple[EdgeSpec, ...] = ()  # always filled after parsing (defaults resolved)
    resharding: ReshardingSpec = field(default_factory=ReshardingSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    tuned_for: TunedForSpec | None = None  # YAML: tunedFor; the cluster meshjob tune chose the plan for
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    resources: Mapping[str, Any] = field(default_factory=dict)  # k8s ResourceRequirements per device
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)  # operator only
    service_account_name: str | None = None  # YAML: serviceAccountName; operator only
    pod_template: PodTemplate = field(default_factory=PodTemplate)  # YAML: podTemplate; operator only

    def activation_shape(self) -> tuple[int, int, int]:
        """(microbatch size, seq, hidden): the tensor every edge carries."""
        return (self.training.microbatch_size, self.model.seq_len, self.model.hidden)

    @property
    def world_size(self) -> int:
        """Total ranks: one per device of every stage's mesh."""
        return sum(s.size for s in self.stages)

    def recompute(self, stage: int) -> str:
        """none or full: the stage's own setting, else spec.training.recompute."""
        own = self.stages[stage].recompute
        return self.training.recompute if own is None else own

    def stage_of_layer(self, layer: int) -> int:
        """Index of the stage whose [first, last) range holds `layer`."""
        for i, stage in enumerate(self.stages):
            if stage.layers[0] <= layer < stage.layers[1]:
                return i
        raise ValueError(f"layer {layer} is in no stage of {self.name}")


# ---------------------------------------------------------------------------------------------
# Facts about a job


def natural_layout(stage: StageSpec) -> str:
    """Batch sharded over the data-parallel mesh dims (major first), replicated otherwise (canonical spec):
    S0RR, S01RR for a batch split over hosts and then over each host's devices. Dims of size 1 split
    nothing and are left out."""
    dims = [d for d in stage.dp_dims if d < len(stage.mesh) and stage.mesh[d] > 1]
    return f"S{''.join(map(str, dims))}RR" if dims else "RRR"


def skip_pairs(model: ModelSpec) -> list[tuple[int, int]]:
    """(source layer i, destination layer L-1-i) of every long skip connection of a U-Transformer;
    the trainer's model and the edges below both read them from here."""
    if model.kind != "utransformer":
        return []
    last = model.layers - 1
    return [(i, last - i) for i in range(model.layers // 2) if i < last - i]


def skip_tensor(source_layer: int) -> str:
    """The name of the skip tensor that leaves layer `source_layer` (an edge's and a stage output's)."""
    return f"skip{source_layer}"


def default_edges(model: ModelSpec, stages: tuple[StageSpec, ...]) -> tuple[EdgeSpec, ...]:
    """The chain i -> i+1, then (utransformer) skip edges layer i -> layer L-1-i across stages."""
    edges = [
        EdgeSpec(i, i + 1, natural_layout(stages[i]), natural_layout(stages[i + 1])) for i in range(len(stages) - 1)
    ]
    starts = [st.layers[0] for st in stages]
    for src_layer, dst_layer in skip_pairs(model):
        a = bisect.bisect_right(starts, src_layer) - 1  # stage holding the source layer
        b = bisect.bisect_right(starts, dst_layer) - 1
        if a != b:
            edges.append(
                EdgeSpec(a, b, natural_layout(stages[a]), natural_layout(stages[b]), tensor=skip_tensor(src_layer))
            )
    return tuple(edges)


def tensor_parallel_sizes(m: ModelSpec) -> dict[str, int]:
    """The model dims a tensor-parallel degree must divide (Megatron: attention heads, the MLP's
    inner width; llama also the vocabulary of its vocab-parallel embedding). Llama's key/value heads
    need only kv_heads_split (below)."""
    sizes = {"heads": m.heads, "hidden": m.hidden, "ffnHidden": m.ffn_width}
    if m.kind == "llama":
        sizes |= {"vocab": m.vocab}
    return sizes


def kv_heads_split(m: ModelSpec, degree: int) -> bool:
    """Whether llama's key/value heads go to `degree` tensor-parallel ranks: kvHeads / degree each, or,
    with fewer heads than ranks, each head replicated on degree / kvHeads ranks (as Megatron does)."""
    kv = m.key_value_heads
    return kv % degree == 0 or degree % kv == 0
