"""The field table of the TrainingJob model: the YAML name, JSON type and constraints of every field,
derived from the dataclasses (meshjob.spec.model) plus RULES, what the Python types cannot say. The
structural pass of meshjob.spec.manifest.parse_job, job_to_dict and the CRD generator (meshjob.spec.crd) all read
this one table, so the YAML names, types, enums and bounds cannot drift apart."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

from meshjob.errors import FieldError
from meshjob.layout.stage_order import STAGE_ORDERS
from meshjob.resharding.balance import BALANCERS
from meshjob.resharding.strategies import STRATEGIES
from meshjob.schedule.actions import SCHEDULE_KINDS
from meshjob.spec import crd_core_types
from meshjob.spec.api import JOB_NAME_MAX_LENGTH
from meshjob.spec.fields import FieldReader, FieldSchema, build_table
from meshjob.spec.model import (
    AUTO,
    CHUNKS_AUTO,
    CLEAN_POD_POLICIES,
    DATA_KINDS,
    GRAD_REDUCE_DTYPES,
    INIT_KINDS,
    INIT_MODEL_KINDS,
    INT32_MAX,
    INT64_MAX,
    MAX_BUDGET_SECONDS,
    MAX_CHUNKS,
    MAX_DEVICES_PER_HOST,
    MAX_EDGES,
    MAX_ENTRYPOINT,
    MAX_FFN_HIDDEN,
    MAX_GLOBAL_BATCH,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_IMAGE,
    MAX_JOB_HOSTS,
    MAX_LABEL_KEY,
    MAX_LAYERS,
    MAX_LAYOUT,
    MAX_MESH_DIM,
    MAX_MESH_DIMS,
    MAX_MICROBATCHES,
    MAX_NAME,
    MAX_PATH,
    MAX_ROPE_THETA,
    MAX_SCHEDULE_CELLS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_STAGE_DEVICES,
    MAX_STAGES,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WORLD_SIZE,
    MAX_ZERO_STAGE,
    MODEL_KINDS,
    OPTIMIZER_KINDS,
    PRECISIONS,
    RECOMPUTE,
    TOKEN_DTYPES,
    TrainingJob,
)

# ---------------------------------------------------------------------------------------------
# The field table: YAML name, JSON type and constraints of every field, derived from the
# dataclasses; RULES adds what the Python types cannot say.


RENAMES = {"src": "from", "dst": "to", "grad_bucket_mib": "gradBucketMiB"}
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
    ("ModelSpec", "kind"): {
        "enum": MODEL_KINDS,
        "description": "gpt: a decoder stack; utransformer: "
        "layer i also feeds layer L-1-i (skip connections); llama: RMSNorm, rotary "
        "embeddings, SwiGLU, grouped-query attention; custom: the user's model "
        "(entrypoint)",
    },
    ("ModelSpec", "layers"): count(
        MAX_LAYERS, why="transformer blocks (L); at most 1024, 8x the deepest published model (128)"
    ),
    ("ModelSpec", "hidden"): count(MAX_HIDDEN, why="model width; at most 65536 (the widest published: 25600)"),
    ("ModelSpec", "heads"): count(MAX_HEADS, why="attention heads; divides hidden; at most 1024"),
    ("ModelSpec", "vocab"): count(MAX_VOCAB, why="vocabulary size; at most 2^20 (the largest published: 256k)"),
    ("ModelSpec", "seq_len"): count(MAX_SEQ_LEN, why="tokens per sequence; at most 2^20 (1M-token contexts)"),
    ("ModelSpec", "kv_heads"): count(
        MAX_HEADS,
        why="llama: key/value heads of grouped-query attention; divides heads (default: heads); fewer than a "
        "stage's tensor-parallel degree are replicated",
    ),
    ("ModelSpec", "ffn_hidden"): count(
        MAX_FFN_HIDDEN,
        why="MLP inner width (default: 4 x hidden; llama: 8/3 x "
        "hidden rounded up to a multiple of 64); at most 4 x 65536",
    ),
    ("ModelSpec", "tie_embeddings"): {
        "description": "the output head reuses the token embedding (gpt, utransformer, llama)"
    },
    ("ModelSpec", "rope_theta"): {
        "minimum": 0,
        "exclusive_minimum": True,
        "maximum": MAX_ROPE_THETA,
        "description": "llama: base of the rotary position embedding; at most 1e9",
    },
    ("ModelSpec", "entrypoint"): chars(
        MAX_ENTRYPOINT,
        why="custom: package.module:function returning the "
        "embedding, blocks, head and boundary shape (meshjob_trainer.custom)",
    ),
    ("ModelSpec", "config"): {"description": "custom: free-form settings handed to the entry point"},
    ("ModelSpec", "init"): {
        "description": f"{', '.join(INIT_MODEL_KINDS)}: start from these weights instead of random ones from "
        "spec.training.seed"
    },
    ("InitSpec", "kind"): {
        "enum": INIT_KINDS,
        "description": "huggingface: a save_pretrained directory (config.json, model.safetensors) whose config "
        "matches spec.model",
    },
    ("InitSpec", "path"): chars(MAX_PATH, 1, "the directory of the weights (relative: to the working directory)")
    | {"required": True},
    ("DataSpec", "kind"): {
        "enum": DATA_KINDS,
        "description": "synthetic: a seeded bigram chain; tokens: token files (nanoGPT's flat binary format)",
    },
    ("DataSpec", "path"): chars(MAX_PATH, why="tokens: the training token file (relative: to the working directory)"),
    ("DataSpec", "val_path"): chars(MAX_PATH, why="tokens: the validation token file (needed by evalEvery)"),
    ("DataSpec", "dtype"): {"enum": TOKEN_DTYPES, "description": "token file element type, little-endian"},
    ("LrScheduleSpec", "warmup_steps"): count(MAX_STEPS, 0, "steps of linear warm-up; at most steps"),
    ("LrScheduleSpec", "min_lr"): {"minimum": 0, "description": "floor of the cosine decay; at most learningRate"},
    ("OptimizerSpec", "kind"): {"enum": OPTIMIZER_KINDS},
    ("OptimizerSpec", "zero_stage"): count(
        MAX_ZERO_STAGE,
        0,
        "0: every data-parallel rank holds the whole optimizer state; 1: each holds 1/DP of it (ZeRO-1)",
    ),
    ("OptimizerSpec", "weight_decay"): {"minimum": 0, "description": "AdamW's decoupled weight decay"},
    ("CheckpointSpec", "every"): count(MAX_STEPS, 0, "steps between checkpoints; 0 = never"),
    ("CheckpointSpec", "path"): chars(MAX_PATH, why="directory of the checkpoints"),
    ("TrainingSpec", "steps"): count(MAX_STEPS, why="optimizer steps; at most 10^8"),
    ("TrainingSpec", "global_batch"): count(MAX_GLOBAL_BATCH, why="sequences per step; at most 2^20"),
    ("TrainingSpec", "microbatches"): count(
        MAX_MICROBATCHES,
        why=(
            f"pipeline microbatches per step; divides globalBatch; at most {MAX_MICROBATCHES}, and stages x "
            f"microbatches at most {MAX_SCHEDULE_CELLS} (the size of the schedules); or auto: a search chooses "
            f"it (the operator, meshjob tune)"
        ),
    )
    | {"auto": AUTO},
    ("TrainingSpec", "learning_rate"): {"minimum": 0, "exclusive_minimum": True},
    ("TrainingSpec", "seed"): count(MAX_SEED, 0, "random seed; 0..2^32-1"),
    ("TrainingSpec", "precision"): {
        "enum": PRECISIONS,
        "description": "bf16: autocast compute with fp32 master weights; boundary tensors and tensor-parallel "
        "reductions in bf16, data-parallel gradient reductions in gradReduceDtype",
    },
    ("TrainingSpec", "overlap_grad_reduce"): {
        "description": "start each bucket's data-parallel gradient reduction as its last backward pass completes "
        "it (overlapped); false: all after the step's backward"
    },
    ("TrainingSpec", "grad_bucket_mib"): {
        "minimum": 0,
        "exclusive_minimum": True,
        "maximum": 65536,
        "description": "MiB of fp32 gradients per data-parallel reduction bucket",
    },
    ("TrainingSpec", "grad_reduce_dtype"): {
        "enum": GRAD_REDUCE_DTYPES,
        "description": "dtype of the data-parallel gradient reductions (bf16 halves their bytes, sums rounded)",
    },
    ("TrainingSpec", "weight_decay_embeddings"): {
        "description": "decay the embeddings, as Megatron does (norms and biases never are)"
    },
    ("TrainingSpec", "recompute"): {
        "enum": RECOMPUTE,
        "description": "full: keep only each block's input and recompute its activations in the backward",
    },
    ("TrainingSpec", "grad_clip"): {
        "minimum": 0,
        "exclusive_minimum": True,
        "description": "clip the global gradient norm (every stage and rank) to this value",
    },
    ("TrainingSpec", "lr_schedule"): {"description": "linear warm-up, then cosine decay to minLr"},
    ("TrainingSpec", "eval_every"): count(MAX_STEPS, 0, "steps between validation losses; 0 = never"),
    ("TrainingSpec", "eval_batches"): count(
        MAX_EVAL_BATCHES, why="global batches of validation data per evaluation; at most 1024"
    ),
    ("TopologySpec", "devices_per_host"): count(MAX_DEVICES_PER_HOST, why="devices of one host; at most 1024"),
    ("TopologySpec", "host_label"): chars(MAX_LABEL_KEY, 1, "node label naming the host"),
    ("TopologySpec", "rack_label"): chars(MAX_LABEL_KEY, why="node label naming the rack or zone"),
    ("TopologySpec", "device_resource"): chars(
        MAX_LABEL_KEY, why="resource requested per device: cpu or nvidia.com/gpu"
    ),
    ("TopologySpec", "stage_order"): {
        "enum": tuple(STAGE_ORDERS),
        "description": "the order stages are placed on hosts: chain, or fold (stage k beside stage S-1-k)",
    },
    ("StageSpec", "layers"): {
        "item_minimum": 0,
        "item_maximum": MAX_LAYERS,
        "description": "half-open [first, last) layer range",
    },
    ("StageSpec", "mesh"): {
        "item_minimum": 1,
        "item_maximum": MAX_MESH_DIM,
        "min_items": 1,
        "max_items": MAX_MESH_DIMS,
        "description": (
            f"device mesh shape; dim 0 runs across hosts, the rest within a host; at "
            f"most {MAX_STAGE_DEVICES} devices per stage, {MAX_WORLD_SIZE} devices and "
            f"{MAX_JOB_HOSTS} hosts (dim 0 summed over the stages) per job"
        ),
    },
    ("StageSpec", "data_parallel_dim"): count(
        MAX_MESH_DIMS - 1, 0, "mesh dim the batch is sharded over (the same as dataParallelDims [d])"
    ),
    ("StageSpec", "data_parallel_dims"): {
        "item_minimum": 0,
        "item_maximum": MAX_MESH_DIMS - 1,
        "min_items": 1,
        "max_items": MAX_MESH_DIMS,
        "description": "mesh dims the batch is sharded over, in increasing order (major first: [0, 1] splits "
        "it across hosts, then over each host's devices); instead of dataParallelDim",
    },
    ("StageSpec", "tensor_parallel_dim"): count(MAX_MESH_DIMS - 1, 0, "mesh dim of tensor parallelism"),
    ("StageSpec", "recompute"): {
        "enum": RECOMPUTE,
        "description": "this stage's recompute (default: spec.training.recompute)",
    },
    ("EdgeSpec", "src"): count(MAX_STAGES - 1, 0, "source stage"),
    ("EdgeSpec", "dst"): count(MAX_STAGES - 1, 0, "destination stage"),
    ("EdgeSpec", "send"): {
        "required": False,
        "max_length": MAX_LAYOUT,
        "description": "sharding spec of the activation as sent (default: the source stage's natural layout)",
    },
    ("EdgeSpec", "recv"): {
        "required": False,
        "max_length": MAX_LAYOUT,
        "description": "sharding spec as received (default: the destination stage's natural layout)",
    },
    ("EdgeSpec", "tensor"): {"pattern": TENSOR_NAME, "max_length": MAX_LAYOUT},
    ("ReshardingSpec", "strategy"): {"enum": tuple(STRATEGIES), "auto": AUTO},
    ("ReshardingSpec", "chunks"): count(
        MAX_CHUNKS,
        why="K: chunks of the broadcast chain, at most 4096; auto: "
        "from the bytes, receiving hosts and the network's per-message cost",
    )
    | {"enum": CHUNKS_AUTO},
    ("ReshardingSpec", "balancer"): {"enum": tuple(BALANCERS), "auto": AUTO},
    ("ReshardingSpec", "budget_seconds"): {
        "minimum": 0,
        "exclusive_minimum": True,
        "maximum": MAX_BUDGET_SECONDS,
        "description": "planning time budget of dfs; at most 60",
    },
    ("ScheduleSpec", "kind"): {"enum": tuple(SCHEDULE_KINDS), "auto": AUTO},
    ("ScheduleSpec", "weight_grad_delay"): {
        "enum": (AUTO,),
        "minimum": 0,
        "maximum": MAX_MICROBATCHES - 1,
        "legacy": OLD_WEIGHT_GRAD_DELAY,
        "description": "auto (each stage delays as many weight-gradient computations as cover its "
        "gradient communication) or a number N of microbatches (each stage that sends "
        "gradients delays N, at most microbatches - 1); 0 = no delay (the backward is "
        "not split)",
    },
    ("TunedForSpec", "hosts"): count(MAX_JOB_HOSTS, why="hosts of the cluster meshjob tune chose the plan for"),
    ("TunedForSpec", "nic_rate"): chars(32, 1, "NIC rate per host and direction it was tuned for, tc style: 100gbit"),
    ("TunedForSpec", "device"): chars(32, 1, "device profile it was tuned for: h100, a100 or TFLOP/s"),
    ("TunedForSpec", "memory"): chars(32, why="memory per device it was tuned for, e.g. 80Gi; empty: the profile's"),
    ("RunPolicy", "backoff_limit"): count(INT32_MAX, 0, "gang restarts before the job fails (int32)"),
    ("RunPolicy", "active_deadline_seconds"): count(INT64_MAX, 0, "seconds the job may run (int64)"),
    ("RunPolicy", "ttl_seconds_after_finished"): count(INT32_MAX, 0, "seconds a finished job is kept (int32)"),
    ("RunPolicy", "clean_pod_policy"): {"enum": CLEAN_POD_POLICIES},
    ("MetricsSpec", "port"): count(65535, why="metrics port of local rank 0 (local rank r: port + r)"),
    ("TrainingJob", "image"): chars(MAX_IMAGE, 1, "trainer image"),
    ("TrainingJob", "stages"): {
        "min_items": 1,
        "max_items": MAX_STAGES,
        "required": True,
        "auto": AUTO,
        "description": f"one disjoint device mesh per pipeline stage, in layer order; "
        f"at most {MAX_STAGES} (the deepest published pipeline: 64); or auto: the "
        f"operator chooses them with meshjob tune's search on the cluster's Nodes",
    },
    ("TrainingJob", "edges"): {
        "max_items": MAX_EDGES,
        "description": "optional layout overrides of the model's edges (the stage chain plus utransformer skip edges)",
    },
    ("TrainingJob", "resources"): {"description": "k8s ResourceRequirements per device"},
    ("TrainingJob", "scheduling"): {
        "description": "operator: gang scheduling (PodGroup), Kueue queue and topology level"
    },
    ("TrainingJob", "service_account_name"): chars(MAX_NAME, 1, "operator: service account of the pods"),
    ("SchedulingSpec", "scheduler_name"): chars(MAX_NAME),
    ("SchedulingSpec", "queue"): chars(MAX_NAME),
    ("SchedulingSpec", "topology_level"): chars(MAX_LABEL_KEY, why="node label for Kueue's required topology"),
    ("CheckpointSpec", "volume"): {
        "description": "operator: the volume mounted at path, a Kubernetes volume "
        "source such as {persistentVolumeClaim: {claimName: ckpt}} (no hostPath)"
    },
    ("TrainingJob", "pod_template"): {
        "description": "operator: labels, annotations and PodSpec fields merged onto every trainer pod"
    },
    ("PodTemplateSpec", "containers"): {
        "description": "the trainer container's extra env, envFrom, volumeMounts and resources (per pod)"
    },
    ("ContainerTemplate", "name"): {"enum": ("trainer",), "description": "the container the fields go to"},
    ("PodTemplateSpec", "priority_class_name"): chars(MAX_NAME, 1),
}
NAME_RULE = (
    f"a DNS-1035 label of at most {JOB_NAME_MAX_LENGTH} characters: lowercase letters, digits and "
    "'-', starting with a letter and ending with a letter or digit (the job's Service is named "
    "<name> and its pods <name>-host-<index>)"
)
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
            assert f.items is not None, f"{sub}: an array field without an item schema"
            yield f"{sub}[0]", f.items
        elif f.maximum is not None or f.max_length is not None:
            yield sub, f


def field_reader() -> FieldReader:
    """A reader of documents by this table (meshjob.spec.fields), which checks the free mappings as the CRD does."""
    return FieldReader(schema_of, _check_free)


def _check_free(cls: type, attr: str, value: Any, path: str) -> list[FieldError]:
    schema = crd_core_types.schema_of_field(cls.__name__, attr)
    return [] if schema is None else crd_core_types.check(schema, value, path)
