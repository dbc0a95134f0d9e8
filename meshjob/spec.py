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
from typing import Any, Mapping

from meshjob.api import API_VERSION, KIND, TRAINER_METRICS_PORT
from meshjob.balance import BALANCERS
from meshjob.errors import FieldError, SpecError
from meshjob.fields import FieldReader, FieldSchema, build_table, unknown_field
from meshjob.resharding import STRATEGIES
from meshjob.schedule import SCHEDULE_KINDS

MODEL_KINDS = ("gpt", "utransformer")
WEIGHT_GRAD_DELAY = ("off", "on", "auto")
CHUNKS_AUTO = ("auto",)
CLEAN_POD_POLICIES = ("All", "Running", "None")
MAX_MESH_DIMS = 3
MAX_STAGE_DEVICES = 4096  # keeps per-device planning (tiles, placement) bounded
ACTIVATION = "activation"


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
    port: int = TRAINER_METRICS_PORT


@dataclass(frozen=True)
class SchedulingSpec:
    """Read by the operator only (meshjob_operator/render.py): gang scheduling, Kueue queue, topology."""
    gang: bool = False  # one PodGroup for all host pods (scheduler-plugins coscheduling)
    scheduler_name: str = ""  # YAML: schedulerName; "" = the operator's default gang scheduler
    queue: str = ""  # Kueue LocalQueue
    topology_level: str = ""  # YAML: topologyLevel; a node label (Kueue required topology)


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
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)  # operator only
    service_account_name: str | None = None  # YAML: serviceAccountName; operator only

    def activation_shape(self) -> tuple[int, int, int]:
        """(microbatch size, seq, hidden): the tensor every edge carries."""
        return (self.training.microbatch_size, self.model.seq_len, self.model.hidden)

    @property
    def world_size(self) -> int:
        """Total ranks: one per device of every stage's mesh."""
        return sum(s.size for s in self.stages)

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
NAT_INT = {"minimum": 0}
POS_INT = {"minimum": 1}
TENSOR_NAME = r"^(activation|skip[0-9]+)$"

# (dataclass name, attribute) -> FieldSchema keywords (item_minimum: bound of array elements)
RULES: dict[tuple[str, str], dict[str, Any]] = {
    ("ModelSpec", "kind"): {"enum": MODEL_KINDS, "description": "gpt: a decoder stack; utransformer: "
                            "layer i also feeds layer L-1-i (skip connections)"},
    ("ModelSpec", "layers"): POS_INT | {"description": "transformer blocks (L)"},
    ("ModelSpec", "hidden"): POS_INT,
    ("ModelSpec", "heads"): POS_INT | {"description": "attention heads; divides hidden"},
    ("ModelSpec", "vocab"): POS_INT,
    ("ModelSpec", "seq_len"): POS_INT,
    ("CheckpointSpec", "every"): NAT_INT | {"description": "steps between checkpoints; 0 = never"},
    ("TrainingSpec", "steps"): POS_INT,
    ("TrainingSpec", "global_batch"): POS_INT | {"description": "sequences per step"},
    ("TrainingSpec", "microbatches"): POS_INT | {"description": "pipeline microbatches per step; "
                                                 "divides globalBatch"},
    ("TrainingSpec", "learning_rate"): {"minimum": 0, "exclusive_minimum": True},
    ("TrainingSpec", "seed"): NAT_INT,
    ("TopologySpec", "devices_per_host"): POS_INT,
    ("TopologySpec", "host_label"): {"min_length": 1},
    ("TopologySpec", "device_resource"): {"description": "resource requested per device: cpu or "
                                          "nvidia.com/gpu"},
    ("StageSpec", "layers"): {"item_minimum": 0, "description": "half-open [first, last) layer range"},
    ("StageSpec", "mesh"): {"item_minimum": 1, "min_items": 1, "max_items": MAX_MESH_DIMS,
                            "description": "device mesh shape; dim 0 runs across hosts, the "
                            "rest within a host"},
    ("StageSpec", "data_parallel_dim"): NAT_INT | {"description": "mesh dim the batch is sharded over"},
    ("StageSpec", "tensor_parallel_dim"): NAT_INT | {"description": "mesh dim of tensor parallelism"},
    ("EdgeSpec", "src"): NAT_INT | {"description": "source stage"},
    ("EdgeSpec", "dst"): NAT_INT | {"description": "destination stage"},
    ("EdgeSpec", "send"): {"required": False, "description": "sharding spec of the activation as sent (default: the "
                           "source stage's natural layout)"},
    ("EdgeSpec", "recv"): {"required": False, "description": "sharding spec as received (default: the destination "
                           "stage's natural layout)"},
    ("EdgeSpec", "tensor"): {"pattern": TENSOR_NAME},
    ("ReshardingSpec", "strategy"): {"enum": STRATEGIES},
    ("ReshardingSpec", "chunks"): POS_INT | {"enum": CHUNKS_AUTO, "description": "K: chunks of the broadcast "
                                             "chain; auto: from the bytes, receiving hosts and "
                                             "the network's per-message cost"},
    ("ReshardingSpec", "balancer"): {"enum": BALANCERS},
    ("ReshardingSpec", "budget_seconds"): {"minimum": 0, "exclusive_minimum": True,
                                           "description": "planning time budget of dfs"},
    ("ScheduleSpec", "kind"): {"enum": SCHEDULE_KINDS},
    ("ScheduleSpec", "weight_grad_delay"): {"enum": WEIGHT_GRAD_DELAY},
    ("RunPolicy", "backoff_limit"): NAT_INT,
    ("RunPolicy", "active_deadline_seconds"): NAT_INT,
    ("RunPolicy", "ttl_seconds_after_finished"): NAT_INT,
    ("RunPolicy", "clean_pod_policy"): {"enum": CLEAN_POD_POLICIES},
    ("MetricsSpec", "port"): {"minimum": 1, "maximum": 65535},
    ("TrainingJob", "image"): {"min_length": 1},
    ("TrainingJob", "stages"): {"min_items": 1, "required": True, "description": "one disjoint device mesh per "
                                "pipeline stage, in layer order"},
    ("TrainingJob", "edges"): {"description": "optional layout overrides of the model's edges (the "
                               "stage chain plus utransformer skip edges)"},
    ("TrainingJob", "resources"): {"description": "k8s ResourceRequirements per device"},
    ("TrainingJob", "scheduling"): {"description": "operator: gang scheduling (PodGroup), Kueue "
                                    "queue and topology level"},
    ("TrainingJob", "service_account_name"): {"min_length": 1,
                                              "description": "operator: service account of the pods"},
    ("SchedulingSpec", "topology_level"): {"description": "node label for Kueue's required topology"},
}
# TrainingJob fields that live in metadata, not in spec
METADATA_ATTRS = ("name", "namespace")


@functools.cache
def schema_of(cls: type) -> tuple[FieldSchema, ...]:
    """The field table of one dataclass of the model (metadata fields of TrainingJob excluded)."""
    return build_table(cls, RULES, RENAMES, METADATA_ATTRS if cls is TrainingJob else ())


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
    if r.clean("spec.model.heads", "spec.model.hidden") and m.hidden % m.heads:
        r.fail("spec.model.heads", m.heads, f"a divisor of spec.model.hidden ({m.hidden})")


def _check_training(r: FieldReader, t: TrainingSpec) -> None:
    if r.clean("spec.training.microbatches", "spec.training.globalBatch") \
            and t.global_batch % t.microbatches:
        r.fail("spec.training.microbatches", t.microbatches,
               f"a divisor of spec.training.globalBatch ({t.global_batch})")
    if r.clean("spec.training.checkpoint") and t.checkpoint.every > 0 and not t.checkpoint.path:
        r.fail("spec.training.checkpoint.path", t.checkpoint.path,
               "a non-empty path when spec.training.checkpoint.every > 0")


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
        if r.clean(f"{p}.tensorParallelDim") and tp is not None and tp < dims:
            degree = st.mesh[tp]
            for key, size in (("heads", m.heads), ("hidden", m.hidden)):
                if r.clean(f"spec.model.{key}") and size % degree:
                    r.fail(f"{p}.mesh[{tp}]", degree, f"a tensor-parallel degree dividing "
                           f"spec.model.{key} ({size})")
        if r.clean(f"{p}.dataParallelDim", "spec.training") and dp is not None and dp < dims \
                and t.global_batch % t.microbatches == 0 and t.microbatch_size % st.mesh[dp]:
            r.fail(f"{p}.mesh[{dp}]", st.mesh[dp], f"a data-parallel degree dividing the microbatch "
                   f"size {t.microbatch_size} (spec.training.globalBatch / microbatches)")
    if ranges_ok and job.stages and expect != m.layers:
        i = len(job.stages) - 1
        r.fail(f"spec.stages[{i}].layers", list(job.stages[i].layers),
               f"a range ending at spec.model.layers ({m.layers}): stages cover every layer")


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
    coarser = sharding.ShardingSpec.parse(natural, ndim=len(shape))
    if not sharding.at_least_as_sharded(spec, coarser, stage.mesh, shape):
        r.fail(path, text, f"a layout at least as sharded as the {role} stage {index}'s natural "
               f"layout {natural} (its tiles must nest in those tiles)")
        return natural
    return str(spec)


def _reason(err: Exception) -> str:
    if isinstance(err, SpecError) and err.errors:
        return "; ".join(e.allowed for e in err.errors)
    return str(err)


# ---------------------------------------------------------------------------------------------
# Entry points


TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec", "status")


def parse_job(doc: Mapping[str, Any]) -> TrainingJob:
    """Validate a whole TrainingJob document; raise SpecError with every problem at once."""
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
    raw_edges = attrs.pop("edges") if "edges" in doc["spec"] else None
    attrs.pop("edges", None)
    job = TrainingJob(name=name, namespace=namespace, **attrs, edges=())
    _check_model(r, job.model)
    _check_training(r, job.training)
    _check_stages(r, job)
    if r.clean("spec.stages", "spec.model", "spec.training"):
        job = dataclasses.replace(job, edges=_resolve_edges(r, job, raw_edges))
    if r.errors:
        raise SpecError(r.errors)
    return job


def _read_metadata(r: FieldReader, meta: Any) -> tuple[str, str]:
    """name (required) and namespace (default "default"); other k8s metadata is ignored."""
    allowed = "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and " \
              "ending with a letter or digit"
    if not isinstance(meta, Mapping):
        r.fail("metadata", meta, "a mapping with name (and optionally namespace)")
        return "", "default"
    name = meta.get("name")
    if not isinstance(name, str) or len(name) > 63 or not DNS1123_LABEL.match(name):
        r.fail("metadata.name", name, allowed)
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or len(namespace) > 63 or not DNS1123_LABEL.match(namespace):
        r.fail("metadata.namespace", namespace, allowed)
    return (name if isinstance(name, str) else ""), (namespace if isinstance(namespace, str) else "default")


def load_job(path: str) -> TrainingJob:
    """Read YAML from a file and parse_job() it (YAML errors become SpecError too)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([FieldError(path, None, f"a readable UTF-8 YAML file ({err})")]) from None
    return parse_yaml(text, source=path)


def parse_yaml(text: str, source: str = "<string>") -> TrainingJob:
    """parse_job() of one YAML document; syntax errors name source:line:column."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or str(err)
        raise SpecError([FieldError(where, problem, "valid YAML (one TrainingJob document)")]) from None
    return parse_job(doc)


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
