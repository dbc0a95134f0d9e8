"""The TrainingJob model (the README's manifest), parsed and validated from YAML.

One table of field schemas (`schema_of`) is derived from the dataclasses below plus the RULES
table of constraints; the structural pass of `parse_job`, `job_to_dict` and the CRD generator
(meshjob.crd) all read that one table, so the YAML names, types, enums and minimums cannot drift
apart. Semantic rules that tie fields together (layer ranges, mesh vs topology, divisibility,
edge layouts) run after the structural pass and skip any field that already failed it.

Edges: the model fixes which tensors flow between stages (the chain of activations, plus the
utransformer skip connections), so `spec.edges` may only choose the send/recv layouts of those
edges; an entry naming an edge the model lacks is an error that lists the model's edges.
TrainingJob.edges always holds every edge of the model, in default_edges() order.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from meshjob.api import API_VERSION, JOB_NAME_MAX_LENGTH, JOB_NAME_PATTERN, KIND, TRAINER_METRICS_PORT
from meshjob.balance import BALANCERS
from meshjob.errors import FieldError, SpecError
from meshjob.fields import FieldReader, FieldSchema, build_table, describe, unknown_field
from meshjob.resharding import STRATEGIES
from meshjob.safeyaml import check_tree, load_documents, read_text, source_name
from meshjob.schedule import SCHEDULE_KINDS

MODEL_KINDS = ("gpt", "utransformer", "llama", "custom")
BUILTIN_MODEL_KINDS = ("gpt", "utransformer", "llama")  # the families with tensor parallelism
DATA_KINDS = ("synthetic", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "full")
OPTIMIZER_KINDS = ("adamw",)
MAX_ZERO_STAGE = 1
AUTO = "auto"
CHUNKS_AUTO = (AUTO,)
CLEAN_POD_POLICIES = ("All", "Running", "None")
# what parse_job says to `stages: auto`: only a search (the operator, meshjob tune, meshjob plan --cluster) takes it
STAGES_AUTO_HERE = ("a list of stages here: `auto` is chosen by a search, which the operator runs on the cluster's "
                    "Nodes and `meshjob plan --cluster` runs as the operator would; for a local run write the "
                    "stages, e.g. with `meshjob tune job.yaml --hosts N --out tuned.yaml`")
# ... and to `auto` in a field a search chooses (training.microbatches, schedule.kind, resharding.strategy/balancer)
FIELD_AUTO_HERE = ("here: `auto` is chosen by a search, which the operator runs on the cluster's Nodes "
                   "(with spec.stages: auto or a list) and `meshjob plan --cluster` runs as the operator would; "
                   "for a local run write the value, e.g. with `meshjob tune job.yaml --hosts N --out tuned.yaml`")
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
    precision: str = "fp32"  # bf16: autocast compute, fp32 master weights, fp32 gradient reductions
    recompute: str = "none"  # full: recompute each block's activations in the backward (per stage: stages[].recompute)
    grad_clip: float | None = None  # YAML: gradClip; max global gradient norm; None: no clipping
    lr_schedule: LrScheduleSpec | None = None  # YAML: lrSchedule; None: a constant learningRate
    eval_every: int = 0  # YAML: evalEvery; steps between validation losses; 0 = never
    eval_batches: int = 2  # YAML: evalBatches; global batches of validation data per evaluation
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)

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
    recompute: str | None = None  # overrides spec.training.recompute for this stage

    @property
    def size(self) -> int:
        """Devices in this stage's mesh."""
        return math.prod(self.mesh)

    @property
    def data_parallel(self) -> int:
        return self.mesh[self.data_parallel_dim] if self.data_parallel_dim is not None else 1

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
# The field table: YAML name, JSON type and constraints of every field, derived from the
# dataclasses; RULES adds what the Python types cannot say.


RENAMES = {"src": "from", "dst": "to"}
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
TENSOR_NAME = r"^(activation|skip[0-9]+)$"
# a Python import path and the function in it, as setuptools writes entry points
ENTRYPOINT = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
MAX_EVAL_BATCHES = 1024  # an evaluation costs evalBatches forward passes of a global batch


def count(maximum: int, minimum: int = 1, why: str = "") -> dict[str, Any]:
    """An integer field in minimum..maximum; `why` says where the bound comes from."""
    return {"minimum": minimum, "maximum": maximum, "description": why}


def chars(max_length: int, min_length: int | None = None, why: str = "") -> dict[str, Any]:
    return {"min_length": min_length, "max_length": max_length, "description": why}


# The old on/off spellings of weightGradDelay, and the booleans YAML makes of them unquoted
OLD_WEIGHT_GRAD_DELAY = (
    ("off", "write 0 (no delay: the backward is not split)"),
    ("on", "write 1 (one delayed W per stage) or auto"),
    (False, "false is what YAML makes of unquoted off/no: write 0 (no delay)"),
    (True, "true is what YAML makes of unquoted on/yes: write 1 (one delayed W per stage) or auto"),
)

# (dataclass name, attribute) -> FieldSchema keywords (item_minimum/item_maximum: bounds of array
# elements; legacy: refused values with what to write instead)
RULES: dict[tuple[str, str], dict[str, Any]] = {
    ("ModelSpec", "kind"): {"enum": MODEL_KINDS, "description": "gpt: a decoder stack; utransformer: "
                            "layer i also feeds layer L-1-i (skip connections); llama: RMSNorm, rotary "
                            "embeddings, SwiGLU, grouped-query attention; custom: the user's model "
                            "(entrypoint)"},
    ("ModelSpec", "layers"): count(MAX_LAYERS, why="transformer blocks (L); at most 1024, 8x the deepest "
                                   "published model (128)"),
    ("ModelSpec", "hidden"): count(MAX_HIDDEN, why="model width; at most 65536 (the widest published: 25600)"),
    ("ModelSpec", "heads"): count(MAX_HEADS, why="attention heads; divides hidden; at most 1024"),
    ("ModelSpec", "vocab"): count(MAX_VOCAB, why="vocabulary size; at most 2^20 (the largest published: 256k)"),
    ("ModelSpec", "seq_len"): count(MAX_SEQ_LEN, why="tokens per sequence; at most 2^20 (1M-token contexts)"),
    ("ModelSpec", "kv_heads"): count(MAX_HEADS, why="llama: key/value heads of grouped-query attention; "
                                     "divides heads (default: heads)"),
    ("ModelSpec", "ffn_hidden"): count(MAX_FFN_HIDDEN, why="MLP inner width (default: 4 x hidden; llama: 8/3 x "
                                       "hidden rounded up to a multiple of 64); at most 4 x 65536"),
    ("ModelSpec", "tie_embeddings"): {"description": "the output head reuses the token embedding "
                                      "(gpt, utransformer, llama)"},
    ("ModelSpec", "rope_theta"): {"minimum": 0, "exclusive_minimum": True, "maximum": MAX_ROPE_THETA,
                                  "description": "llama: base of the rotary position embedding; at most 1e9"},
    ("ModelSpec", "entrypoint"): chars(MAX_ENTRYPOINT, why="custom: package.module:function returning the "
                                       "embedding, blocks, head and boundary shape (meshjob_trainer.custom)"),
    ("ModelSpec", "config"): {"description": "custom: free-form settings handed to the entry point"},
    ("DataSpec", "kind"): {"enum": DATA_KINDS, "description": "synthetic: a seeded bigram chain; tokens: "
                           "token files (nanoGPT's flat binary format)"},
    ("DataSpec", "path"): chars(MAX_PATH, why="tokens: the training token file (relative: to the working "
                                "directory)"),
    ("DataSpec", "val_path"): chars(MAX_PATH, why="tokens: the validation token file (needed by evalEvery)"),
    ("DataSpec", "dtype"): {"enum": TOKEN_DTYPES, "description": "token file element type, little-endian"},
    ("LrScheduleSpec", "warmup_steps"): count(MAX_STEPS, 0, "steps of linear warm-up; at most steps"),
    ("LrScheduleSpec", "min_lr"): {"minimum": 0, "description": "floor of the cosine decay; at most learningRate"},
    ("OptimizerSpec", "kind"): {"enum": OPTIMIZER_KINDS},
    ("OptimizerSpec", "zero_stage"): count(MAX_ZERO_STAGE, 0, "0: every data-parallel rank holds the whole "
                                           "optimizer state; 1: each holds 1/DP of it (ZeRO-1)"),
    ("OptimizerSpec", "weight_decay"): {"minimum": 0, "description": "AdamW's decoupled weight decay"},
    ("CheckpointSpec", "every"): count(MAX_STEPS, 0, "steps between checkpoints; 0 = never"),
    ("CheckpointSpec", "path"): chars(MAX_PATH, why="directory of the checkpoints"),
    ("TrainingSpec", "steps"): count(MAX_STEPS, why="optimizer steps; at most 10^8"),
    ("TrainingSpec", "global_batch"): count(MAX_GLOBAL_BATCH, why="sequences per step; at most 2^20"),
    ("TrainingSpec", "microbatches"): count(MAX_MICROBATCHES, why=(
        f"pipeline microbatches per step; divides globalBatch; at most {MAX_MICROBATCHES}, and stages x "
        f"microbatches at most {MAX_SCHEDULE_CELLS} (the size of the schedules); or auto: a search chooses "
        f"it (the operator, meshjob tune)")) | {"auto": AUTO},
    ("TrainingSpec", "learning_rate"): {"minimum": 0, "exclusive_minimum": True},
    ("TrainingSpec", "seed"): count(MAX_SEED, 0, "random seed; 0..2^32-1"),
    ("TrainingSpec", "precision"): {"enum": PRECISIONS, "description": "bf16: autocast compute with fp32 "
                                    "master weights and fp32 gradient reductions"},
    ("TrainingSpec", "recompute"): {"enum": RECOMPUTE, "description": "full: keep only each block's input "
                                    "and recompute its activations in the backward"},
    ("TrainingSpec", "grad_clip"): {"minimum": 0, "exclusive_minimum": True, "description": "clip the global "
                                    "gradient norm (every stage and rank) to this value"},
    ("TrainingSpec", "lr_schedule"): {"description": "linear warm-up, then cosine decay to minLr"},
    ("TrainingSpec", "eval_every"): count(MAX_STEPS, 0, "steps between validation losses; 0 = never"),
    ("TrainingSpec", "eval_batches"): count(MAX_EVAL_BATCHES, why="global batches of validation data per "
                                            "evaluation; at most 1024"),
    ("TopologySpec", "devices_per_host"): count(MAX_DEVICES_PER_HOST, why="devices of one host; at most 1024"),
    ("TopologySpec", "host_label"): chars(MAX_LABEL_KEY, 1, "node label naming the host"),
    ("TopologySpec", "rack_label"): chars(MAX_LABEL_KEY, why="node label naming the rack or zone"),
    ("TopologySpec", "device_resource"): chars(MAX_LABEL_KEY, why="resource requested per device: cpu or "
                                              "nvidia.com/gpu"),
    ("StageSpec", "layers"): {"item_minimum": 0, "item_maximum": MAX_LAYERS,
                              "description": "half-open [first, last) layer range"},
    ("StageSpec", "mesh"): {"item_minimum": 1, "item_maximum": MAX_MESH_DIM, "min_items": 1,
                            "max_items": MAX_MESH_DIMS, "description": (
                                f"device mesh shape; dim 0 runs across hosts, the rest within a host; at "
                                f"most {MAX_STAGE_DEVICES} devices per stage, {MAX_WORLD_SIZE} devices and "
                                f"{MAX_JOB_HOSTS} hosts (dim 0 summed over the stages) per job")},
    ("StageSpec", "data_parallel_dim"): count(MAX_MESH_DIMS - 1, 0, "mesh dim the batch is sharded over"),
    ("StageSpec", "tensor_parallel_dim"): count(MAX_MESH_DIMS - 1, 0, "mesh dim of tensor parallelism"),
    ("StageSpec", "recompute"): {"enum": RECOMPUTE, "description": "this stage's recompute (default: "
                                 "spec.training.recompute)"},
    ("EdgeSpec", "src"): count(MAX_STAGES - 1, 0, "source stage"),
    ("EdgeSpec", "dst"): count(MAX_STAGES - 1, 0, "destination stage"),
    ("EdgeSpec", "send"): {"required": False, "max_length": MAX_LAYOUT, "description": "sharding spec of the "
                           "activation as sent (default: the source stage's natural layout)"},
    ("EdgeSpec", "recv"): {"required": False, "max_length": MAX_LAYOUT, "description": "sharding spec as "
                           "received (default: the destination stage's natural layout)"},
    ("EdgeSpec", "tensor"): {"pattern": TENSOR_NAME, "max_length": MAX_LAYOUT},
    ("ReshardingSpec", "strategy"): {"enum": STRATEGIES, "auto": AUTO},
    ("ReshardingSpec", "chunks"): count(MAX_CHUNKS, why="K: chunks of the broadcast chain, at most 4096; auto: "
                                        "from the bytes, receiving hosts and the network's per-message cost")
                                  | {"enum": CHUNKS_AUTO},
    ("ReshardingSpec", "balancer"): {"enum": BALANCERS, "auto": AUTO},
    ("ReshardingSpec", "budget_seconds"): {"minimum": 0, "exclusive_minimum": True,
                                           "maximum": MAX_BUDGET_SECONDS,
                                           "description": "planning time budget of dfs; at most 60"},
    ("ScheduleSpec", "kind"): {"enum": SCHEDULE_KINDS, "auto": AUTO},
    ("ScheduleSpec", "weight_grad_delay"): {
        "enum": (AUTO,), "minimum": 0, "maximum": MAX_MICROBATCHES - 1, "legacy": OLD_WEIGHT_GRAD_DELAY,
        "description": "auto (each stage delays as many weight-gradient computations as cover its "
                       "gradient communication) or a number N of microbatches (each stage that sends "
                       "gradients delays N, at most microbatches - 1); 0 = no delay (the backward is "
                       "not split)"},
    ("RunPolicy", "backoff_limit"): count(INT32_MAX, 0, "gang restarts before the job fails (int32)"),
    ("RunPolicy", "active_deadline_seconds"): count(INT64_MAX, 0, "seconds the job may run (int64)"),
    ("RunPolicy", "ttl_seconds_after_finished"): count(INT32_MAX, 0, "seconds a finished job is kept (int32)"),
    ("RunPolicy", "clean_pod_policy"): {"enum": CLEAN_POD_POLICIES},
    ("MetricsSpec", "port"): count(65535, why="metrics port of local rank 0 (local rank r: port + r)"),
    ("TrainingJob", "image"): chars(MAX_IMAGE, 1, "trainer image"),
    ("TrainingJob", "stages"): {"min_items": 1, "max_items": MAX_STAGES, "required": True, "auto": AUTO,
                                "description": f"one disjoint device mesh per pipeline stage, in layer order; "
                                f"at most {MAX_STAGES} (the deepest published pipeline: 64); or auto: the "
                                f"operator chooses them with meshjob tune's search on the cluster's Nodes"},
    ("TrainingJob", "edges"): {"max_items": MAX_EDGES, "description": "optional layout overrides of the "
                               "model's edges (the stage chain plus utransformer skip edges)"},
    ("TrainingJob", "resources"): {"description": "k8s ResourceRequirements per device"},
    ("TrainingJob", "scheduling"): {"description": "operator: gang scheduling (PodGroup), Kueue "
                                    "queue and topology level"},
    ("TrainingJob", "service_account_name"): chars(MAX_NAME, 1, "operator: service account of the pods"),
    ("SchedulingSpec", "scheduler_name"): chars(MAX_NAME),
    ("SchedulingSpec", "queue"): chars(MAX_NAME),
    ("SchedulingSpec", "topology_level"): chars(MAX_LABEL_KEY, why="node label for Kueue's required topology"),
    ("CheckpointSpec", "volume"): {"description": "operator: the volume mounted at path, a Kubernetes volume "
                                   "source such as {persistentVolumeClaim: {claimName: ckpt}} (no hostPath)"},
    ("TrainingJob", "pod_template"): {"description": "operator: labels, annotations and PodSpec fields merged "
                                      "onto every trainer pod"},
    ("PodTemplateSpec", "containers"): {"description": "the trainer container's extra env, envFrom, "
                                        "volumeMounts and resources (per pod)"},
    ("ContainerTemplate", "name"): {"enum": ("trainer",), "description": "the container the fields go to"},
    ("PodTemplateSpec", "priority_class_name"): chars(MAX_NAME, 1),
}
NAME_RULE = (f"a DNS-1035 label of at most {JOB_NAME_MAX_LENGTH} characters: lowercase letters, digits and "
             "'-', starting with a letter and ending with a letter or digit (the job's Service is named "
             "<name> and its pods <name>-host-<index>)")
# TrainingJob fields that live in metadata, not in spec
METADATA_ATTRS = ("name", "namespace")


@functools.cache
def schema_of(cls: type) -> tuple[FieldSchema, ...]:
    """The field table of one dataclass of the model (metadata fields of TrainingJob excluded)."""
    return build_table(cls, RULES, RENAMES, METADATA_ATTRS if cls is TrainingJob else ())


def bounded_fields(cls: type = TrainingJob, path: str = "spec") -> Iterator[tuple[str, FieldSchema]]:
    """(path, schema) of every scalar with a maximum or a maximum length; a list's elements appear
    as its first one (spec.stages[0].mesh[0]). Tests and the fuzz benchmark walk the bounds with it."""
    for f in schema_of(cls):
        sub = f"{path}.{f.yaml}"
        if f.type == "object" and f.model is not None:
            yield from bounded_fields(f.model, sub)
        elif f.type == "array" and f.model is not None:
            yield from bounded_fields(f.model, f"{sub}[0]")
        elif f.type == "array":
            yield f"{sub}[0]", f.items
        elif f.maximum is not None or f.max_length is not None:
            yield sub, f


def _reader() -> FieldReader:
    return FieldReader(schema_of)


# ---------------------------------------------------------------------------------------------
# Semantic rules


def natural_layout(stage: StageSpec) -> str:
    """Batch sharded over the data-parallel mesh dim, replicated otherwise (canonical spec)."""
    dp = stage.data_parallel_dim
    if dp is not None and dp < len(stage.mesh) and stage.mesh[dp] > 1:
        return f"S{dp}RR"
    return "RRR"


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
    edges = [EdgeSpec(i, i + 1, natural_layout(stages[i]), natural_layout(stages[i + 1]))
             for i in range(len(stages) - 1)]
    starts = [st.layers[0] for st in stages]
    for src_layer, dst_layer in skip_pairs(model):
        a = bisect.bisect_right(starts, src_layer) - 1  # stage holding the source layer
        b = bisect.bisect_right(starts, dst_layer) - 1
        if a != b:
            edges.append(EdgeSpec(a, b, natural_layout(stages[a]), natural_layout(stages[b]),
                                  tensor=skip_tensor(src_layer)))
    return tuple(edges)


def _check_model(r: FieldReader, m: ModelSpec) -> None:
    if not r.clean("spec.model.kind"):
        return
    if m.kind == "custom":
        _check_custom_model(r, m)
        return
    for key, value in (("entrypoint", m.entrypoint), ("config", m.config)):
        if r.clean(f"spec.model.{key}") and value:
            r.fail(f"spec.model.{key}", value, "only with spec.model.kind custom")
    if r.clean("spec.model.heads", "spec.model.hidden") and m.hidden % m.heads:
        r.fail("spec.model.heads", m.heads, f"a divisor of spec.model.hidden ({m.hidden})")
    if m.kind != "llama":
        if r.clean("spec.model.kvHeads") and m.kv_heads is not None and m.kv_heads != m.heads:
            r.fail("spec.model.kvHeads", m.kv_heads, f"unset or equal to spec.model.heads ({m.heads}): "
                   f"grouped-query attention is a spec.model.kind llama feature")
        return
    if r.clean("spec.model.kvHeads", "spec.model.heads") and m.heads % m.key_value_heads:
        r.fail("spec.model.kvHeads", m.kv_heads, f"a divisor of spec.model.heads ({m.heads})")
    if r.clean("spec.model.heads", "spec.model.hidden") and m.hidden % m.heads == 0 \
            and (m.hidden // m.heads) % 2:
        r.fail("spec.model.heads", m.heads, f"a divisor of spec.model.hidden ({m.hidden}) leaving an even "
               f"head size: rotary embeddings turn pairs of channels")


def _check_custom_model(r: FieldReader, m: ModelSpec) -> None:
    if r.clean("spec.model.entrypoint") and not re.match(ENTRYPOINT, m.entrypoint):
        r.fail("spec.model.entrypoint", m.entrypoint, "package.module:function, the function returning "
               "the model's parts (meshjob_trainer.custom.CustomModel)")
    if r.clean("spec.model.kvHeads") and m.kv_heads is not None:
        r.fail("spec.model.kvHeads", m.kv_heads, "unset: a custom model's attention is its own")


def _check_data(r: FieldReader, job: TrainingJob) -> None:
    d, t = job.data, job.training
    if not r.clean("spec.data.kind"):
        return
    if d.kind == "tokens":
        if r.clean("spec.data.path") and not d.path:
            r.fail("spec.data.path", d.path, "a token file when spec.data.kind is tokens")
        if r.clean("spec.data.valPath", "spec.training.evalEvery") and t.eval_every > 0 and not d.val_path:
            r.fail("spec.data.valPath", d.val_path, "a validation token file when spec.training.evalEvery > 0")
        return
    for key, value in (("path", d.path), ("valPath", d.val_path)):
        if r.clean(f"spec.data.{key}") and value:
            r.fail(f"spec.data.{key}", value, "only with spec.data.kind tokens (synthetic data needs no file)")


def _check_training(r: FieldReader, t: TrainingSpec) -> None:
    if r.clean("spec.training.microbatches", "spec.training.globalBatch") \
            and t.global_batch % t.microbatches:
        r.fail("spec.training.microbatches", t.microbatches,
               f"a divisor of spec.training.globalBatch ({t.global_batch})")
    if r.clean("spec.training.checkpoint") and t.checkpoint.every > 0 and not t.checkpoint.path:
        r.fail("spec.training.checkpoint.path", t.checkpoint.path,
               "a non-empty path when spec.training.checkpoint.every > 0")
    s = t.lr_schedule
    if s is None or not r.clean("spec.training.lrSchedule"):
        return
    if r.clean("spec.training.steps") and s.warmup_steps > t.steps:
        r.fail("spec.training.lrSchedule.warmupSteps", s.warmup_steps,
               f"at most spec.training.steps ({t.steps})")
    if r.clean("spec.training.learningRate") and s.min_lr > t.learning_rate:
        r.fail("spec.training.lrSchedule.minLr", s.min_lr,
               f"at most spec.training.learningRate ({t.learning_rate})")


def _check_stages(r: FieldReader, job: TrainingJob) -> None:
    """Layer ranges, meshes vs topology, parallel dims vs model and batch."""
    m, t = job.model, job.training
    expect = 0  # where the next stage's layer range must begin
    ranges_ok = r.clean("spec.model.layers")
    for i, st in enumerate(job.stages):
        p = f"spec.stages[{i}]"
        if not r.clean(f"{p}.layers"):
            ranges_ok = False
        elif ranges_ok:
            first, last = st.layers
            if first != expect or last <= first:
                r.fail(f"{p}.layers", list(st.layers),
                       f"a non-empty range [{expect}, n) with {expect} < n <= {m.layers}: "
                       f"stages cover [0, spec.model.layers) contiguously, in order")
                ranges_ok = False
            elif last > m.layers:
                r.fail(f"{p}.layers", list(st.layers),
                       f"a range ending at most at spec.model.layers ({m.layers})")
                ranges_ok = False
            else:
                expect = last
        if not r.clean(f"{p}.mesh"):
            continue
        if st.size > MAX_STAGE_DEVICES:
            r.fail(f"{p}.mesh", list(st.mesh), f"a mesh of at most {MAX_STAGE_DEVICES} devices")
            continue
        per_host = math.prod(st.mesh[1:])
        if r.clean("spec.topology.devicesPerHost") and per_host > job.topology.devices_per_host:
            r.fail(f"{p}.mesh", list(st.mesh),
                   f"mesh dims after dim 0 (dim 0 runs across hosts) multiply to at most "
                   f"spec.topology.devicesPerHost ({job.topology.devices_per_host}), got {per_host}")
        dims = len(st.mesh)
        for key, dim in (("dataParallelDim", st.data_parallel_dim),
                         ("tensorParallelDim", st.tensor_parallel_dim)):
            if r.clean(f"{p}.{key}") and dim is not None and dim >= dims:
                r.fail(f"{p}.{key}", dim, f"a mesh dim in 0..{dims - 1} (spec.stages[{i}].mesh "
                       f"has {dims} dims)")
        dp, tp = st.data_parallel_dim, st.tensor_parallel_dim
        if r.clean(f"{p}.dataParallelDim", f"{p}.tensorParallelDim") and dp is not None and dp == tp:
            r.fail(f"{p}.tensorParallelDim", tp, f"a mesh dim other than dataParallelDim ({dp})")
        if r.clean(f"{p}.tensorParallelDim", "spec.model.kind") and tp is not None and tp < dims:
            _check_tensor_parallel(r, m, f"{p}.mesh[{tp}]", st.mesh[tp])
        if r.clean(f"{p}.dataParallelDim", "spec.training") and dp is not None and dp < dims \
                and t.global_batch % t.microbatches == 0 and t.microbatch_size % st.mesh[dp]:
            r.fail(f"{p}.mesh[{dp}]", st.mesh[dp], f"a data-parallel degree dividing the microbatch "
                   f"size {t.microbatch_size} (spec.training.globalBatch / microbatches)")
    if ranges_ok and job.stages and expect != m.layers:
        i = len(job.stages) - 1
        r.fail(f"spec.stages[{i}].layers", list(job.stages[i].layers),
               f"a range ending at spec.model.layers ({m.layers}): stages cover every layer")


def _check_size(r: FieldReader, job: TrainingJob) -> None:
    """Bounds on the whole job: devices, hosts and schedule size grow with several fields at once."""
    if not r.clean("spec.stages"):
        return
    world = sum(st.size for st in job.stages)
    if world > MAX_WORLD_SIZE:
        r.fail("spec.stages", f"{world} devices", f"at most {MAX_WORLD_SIZE} devices in all stages' meshes")
    hosts = sum(st.mesh[0] for st in job.stages)
    if hosts > MAX_JOB_HOSTS:
        r.fail("spec.stages", f"{hosts} hosts", f"at most {MAX_JOB_HOSTS} hosts (mesh dim 0) in all stages")
    cells = len(job.stages) * job.training.microbatches
    if r.clean("spec.training.microbatches") and cells > MAX_SCHEDULE_CELLS:
        r.fail("spec.training.microbatches", job.training.microbatches,
               f"at most {MAX_SCHEDULE_CELLS // len(job.stages)} with {len(job.stages)} stages (stages x "
               f"microbatches at most {MAX_SCHEDULE_CELLS})")


def tensor_parallel_sizes(m: ModelSpec) -> dict[str, int]:
    """The model dims a tensor-parallel degree must divide (Megatron: attention heads, the MLP's
    inner width; llama also key/value heads and the vocabulary of its vocab-parallel embedding)."""
    sizes = {"heads": m.heads, "hidden": m.hidden, "ffnHidden": m.ffn_width}
    if m.kind == "llama":
        sizes |= {"kvHeads": m.key_value_heads, "vocab": m.vocab}
    return sizes


def _check_tensor_parallel(r: FieldReader, m: ModelSpec, path: str, degree: int) -> None:
    if m.kind not in BUILTIN_MODEL_KINDS:
        if degree > 1:
            r.fail(path, degree, f"a tensor-parallel degree of 1: tensor parallelism is for the built-in families "
                   f"({', '.join(BUILTIN_MODEL_KINDS)}); a custom model runs pipeline and data parallel")
        return
    for key, size in tensor_parallel_sizes(m).items():
        if r.clean(f"spec.model.{key}") and size % degree:
            r.fail(path, degree, f"a tensor-parallel degree dividing spec.model.{key} ({size})")


def _resolve_edges(r: FieldReader, job: TrainingJob, raw: Any) -> tuple[EdgeSpec, ...]:
    """The model's edges (defaults) with the user's layout overrides applied and checked."""
    defaults = default_edges(job.model, job.stages)
    if raw is None:
        return defaults
    index = {(e.src, e.dst, e.tensor): k for k, e in enumerate(defaults)}
    edges = list(defaults)
    seen: set[tuple[int, int, str]] = set()
    shape = job.activation_shape()
    for n, e in enumerate(raw):
        p = f"spec.edges[{n}]"
        if not r.clean(p):
            continue
        n_stages = len(job.stages)
        bad = False
        for key, stage in (("from", e.src), ("to", e.dst)):
            if stage >= n_stages:
                r.fail(f"{p}.{key}", stage, f"a stage index in 0..{n_stages - 1}")
                bad = True
        if bad:
            continue
        if e.src >= e.dst:
            r.fail(f"{p}.to", e.dst, f"a stage after from ({e.src}): edges run forward in layer order")
            continue
        key = (e.src, e.dst, e.tensor)
        if key not in index:
            known = ", ".join(f"{a}->{b} {t}" for a, b, t in index)
            r.fail(p, {"from": e.src, "to": e.dst, "tensor": e.tensor},
                   f"an edge of the model: {known}")
            continue
        if key in seen:
            r.fail(p, {"from": e.src, "to": e.dst, "tensor": e.tensor}, "each edge listed once")
            continue
        seen.add(key)
        default = defaults[index[key]]
        send = _check_layout(r, f"{p}.send", e.send, default.send, job.stages[e.src], e.src,
                             shape, "source")
        recv = _check_layout(r, f"{p}.recv", e.recv, default.recv, job.stages[e.dst], e.dst,
                             shape, "destination")
        edges[index[key]] = EdgeSpec(e.src, e.dst, send, recv, e.tensor)
    return tuple(edges)


def _check_layout(r: FieldReader, path: str, text: str | None, natural: str, stage: StageSpec,
                  index: int, shape: tuple[int, int, int], role: str) -> str:
    """Canonical form of a user layout, checked against the stage's mesh and natural layout."""
    if text is None:
        return natural
    from meshjob import sharding  # the sharding algebra is its own module (owned elsewhere)

    try:
        spec = sharding.ShardingSpec.parse(text, ndim=len(shape), path=path)
    except SpecError as err:
        for problem in err.errors:
            r.fail(problem.path, problem.value, f"{problem.allowed}; e.g. {natural} "
                   f"(the activation is (batch, seq, hidden))")
        return natural
    except ValueError as err:
        r.fail(path, text, f"a sharding spec with one token per activation dim (batch, seq, "
               f"hidden), e.g. {natural}: {_reason(err)}")
        return natural
    problems = sharding.check_spec(spec, stage.mesh, shape, path)
    if problems:
        for problem in problems:
            r.errors.append(problem)
            r.bad.add(problem.path)
        return natural
    if not _nests(str(spec), natural, stage.mesh, shape):
        r.fail(path, text, f"a layout at least as sharded as the {role} stage {index}'s natural "
               f"layout {natural} (its tiles must nest in those tiles)")
        return natural
    return str(spec)


@functools.lru_cache(maxsize=4096)
def _nests(finer: str, coarser: str, mesh: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether layout `finer`'s tiles nest in `coarser`'s. It walks every device of the mesh and
    up to 640 edges may ask it about the same few layouts: remembered."""
    from meshjob import sharding

    return sharding.at_least_as_sharded(sharding.ShardingSpec.parse(finer, len(shape)),
                                        sharding.ShardingSpec.parse(coarser, len(shape)), mesh, shape)


def _reason(err: Exception) -> str:
    if isinstance(err, SpecError) and err.errors:
        return "; ".join(e.allowed for e in err.errors)
    return str(err)


# ---------------------------------------------------------------------------------------------
# Entry points


TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec", "status")


def parse_job(doc: Mapping[str, Any]) -> TrainingJob:
    """Validate a whole TrainingJob document; raise SpecError with every problem at once. Any
    document is safe to pass: one nested too deep or too large (meshjob.safeyaml.LIMITS) is refused
    before it is read."""
    check_tree(doc)
    r = _reader()
    if not isinstance(doc, Mapping):
        raise SpecError([FieldError("document", doc, "a TrainingJob mapping with apiVersion, kind, "
                                    "metadata and spec")])
    for key in doc:
        if key not in TOP_LEVEL:
            r.fail(str(key) if isinstance(key, str) else f"[{key!r}]", doc[key],
                   unknown_field(str(key), list(TOP_LEVEL)))
    if doc.get("apiVersion") != API_VERSION:
        r.fail("apiVersion", doc.get("apiVersion"), API_VERSION)
    if doc.get("kind") != KIND:
        r.fail("kind", doc.get("kind"), KIND)
    name, namespace = _read_metadata(r, doc.get("metadata"))
    attrs = r.read_object(TrainingJob, doc.get("spec"), "spec")
    if attrs is None:
        raise SpecError(r.errors)
    if attrs["stages"] == AUTO:
        r.fail("spec.stages", AUTO, STAGES_AUTO_HERE)
        attrs["stages"] = ()
    _refuse_field_autos(r, attrs)
    raw_edges = attrs.pop("edges") if "edges" in doc["spec"] else None
    attrs.pop("edges", None)
    job = TrainingJob(name=name, namespace=namespace, **attrs, edges=())
    _check_model(r, job.model)
    _check_data(r, job)
    _check_training(r, job.training)
    _check_stages(r, job)
    _check_size(r, job)
    if r.clean("spec.stages", "spec.model", "spec.training"):
        job = dataclasses.replace(job, edges=_resolve_edges(r, job, raw_edges))
    if r.errors:
        raise SpecError(r.errors)
    return job


def searched_fields() -> Iterator[tuple[str, str, FieldSchema]]:
    """(section attribute, field path, schema) of every field of a spec section that also takes `auto`
    (a search chooses it): spec.training.microbatches, spec.schedule.kind, spec.resharding.strategy and
    .balancer. spec.stages takes it too (TrainingJob's own `auto`); weightGradDelay's and chunks' `auto`
    are values the plan resolves, not searched."""
    for f in schema_of(TrainingJob):
        if f.type == "object" and f.model is not None:
            for g in schema_of(f.model):
                if g.auto is not None:
                    yield f.attr, f"spec.{f.yaml}.{g.yaml}", g


def _refuse_field_autos(r: FieldReader, attrs: dict[str, Any]) -> None:
    """parse_job refuses `auto` in a searched field as it refuses `spec.stages: auto`; the field reads
    as its default so the other checks still run."""
    for section, path, f in searched_fields():
        obj = attrs.get(section)
        if obj is not None and getattr(obj, f.attr) == f.auto:
            r.fail(path, f.auto, f"{describe(f)} {FIELD_AUTO_HERE}")
            attrs[section] = dataclasses.replace(obj, **{f.attr: f.default})


def _read_metadata(r: FieldReader, meta: Any) -> tuple[str, str]:
    """name (required) and namespace (default "default"); other k8s metadata is ignored."""
    allowed = "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and " \
              "ending with a letter or digit"
    if not isinstance(meta, Mapping):
        r.fail("metadata", meta, "a mapping with name (and optionally namespace)")
        return "", "default"
    name = meta.get("name")
    if not isinstance(name, str) or len(name) > JOB_NAME_MAX_LENGTH or not re.match(JOB_NAME_PATTERN, name):
        r.fail("metadata.name", name, NAME_RULE)
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or len(namespace) > 63 or not DNS1123_LABEL.match(namespace):
        r.fail("metadata.namespace", namespace, allowed)
    return (name if isinstance(name, str) else ""), (namespace if isinstance(namespace, str) else "default")


def load_jobs(path: str, parse: Callable[[Any], Any] | None = None) -> list[Any]:
    """Every TrainingJob of a YAML file ("-": standard input), one per document, read by `parse` (default
    parse_job); SpecError names the document of each problem."""
    return parse_yaml_all(read_text(path, "TrainingJob manifest"), source_name(path), parse)


def load_job(path: str) -> TrainingJob:
    """The one TrainingJob of a YAML file ("-": standard input), for commands that run one job."""
    return parse_yaml(read_text(path, "TrainingJob manifest"), source_name(path))


def parse_yaml_all(text: str, source: str = "<string>", parse: Callable[[Any], Any] | None = None) -> list[Any]:
    """parse_job() (or `parse`) of every document (meshjob.safeyaml: bounded, kubectl's scalars, no
    duplicate keys); empty documents are skipped as kubectl skips them."""
    parse = parse or parse_job
    docs = load_documents(text, source)
    if not docs:
        raise SpecError([FieldError(source, "no document", "at least one TrainingJob document")])
    jobs: list[TrainingJob] = []
    errors: list[FieldError] = []
    for i, doc in enumerate(docs):
        try:
            jobs.append(parse(doc))
        except SpecError as err:
            prefix = f"{source} document {i + 1}: " if len(docs) > 1 else ""
            errors += [dataclasses.replace(e, path=prefix + e.path) for e in err.errors]
    if errors:
        raise SpecError(errors)
    return jobs


def parse_yaml(text: str, source: str = "<string>") -> TrainingJob:
    """parse_job() of a YAML stream that holds exactly one document."""
    docs = load_documents(text, source)
    if len(docs) != 1:
        raise SpecError([FieldError(source, f"{len(docs)} documents", "exactly one TrainingJob document "
                                    "(this command runs one job; meshjob plan takes several)")])
    return parse_job(docs[0])


def _to_plain(cls: type, obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in schema_of(cls):
        value = getattr(obj, f.attr)
        if value is None:
            continue
        if f.type == "object" and f.model is not None:
            value = _to_plain(f.model, value)
        elif f.type == "array" and f.model is not None:
            value = [_to_plain(f.model, v) for v in value]
        elif f.type == "array":
            value = list(value)
        elif f.preserve_unknown:
            value = dict(value)
        out[f.yaml] = value
    return out


def job_to_dict(job: TrainingJob) -> dict[str, Any]:
    """The camelCase manifest form of a job (parse_job(job_to_dict(j)) == j)."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": job.name, "namespace": job.namespace},
            "spec": _to_plain(TrainingJob, job)}
