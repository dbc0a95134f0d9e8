"""The TrainingJob manifest (the README's), parsed and validated from YAML, and written back.

The manifest's parts, one module each, all reachable from here (meshjob.spec.manifest is what callers import):
- meshjob.spec.model: the dataclasses a manifest parses into, the bounds of every count, and the facts about
  a job that planner, trainer and operator share (natural layouts, the model's edges);
- meshjob.spec.table: one table of field schemas, derived from those dataclasses plus the RULES table
  of constraints; the structural pass of `parse_job`, `job_to_dict` and the CRD generator
  (meshjob.spec.crd) all read that one table, so the YAML names, types, enums and bounds cannot drift apart;
- meshjob.spec.checks: the semantic rules that tie fields together (layer ranges, mesh vs topology,
  divisibility, edge layouts); they run after the structural pass and skip any field that already
  failed it.

Edges: the model fixes which tensors flow between stages (the chain of activations, plus the
utransformer skip connections), so `spec.edges` may only choose the send/recv layouts of those
edges; an entry naming an edge the model lacks is an error that lists the model's edges.
TrainingJob.edges always holds every edge of the model, in default_edges() order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, overload

from meshjob.errors import FieldError, SpecError
from meshjob.spec.api import API_VERSION, JOB_NAME_MAX_LENGTH, JOB_NAME_PATTERN, KIND
from meshjob.spec.checks import check_job, resolve_edges
from meshjob.spec.fields import FieldReader, FieldSchema, describe, unknown_field
from meshjob.spec.model import (
    AUTO,
    BUILTIN_MODEL_KINDS,
    CLEAN_POD_POLICIES,
    INT64_MAX,
    MAX_DEVICES_PER_HOST,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_NAME,
    MAX_SCHEDULE_CELLS,
    MODEL_KINDS,
    EdgeSpec,
    InitSpec,
    LrScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    PodTemplateSpec,
    ReshardingSpec,
    StageSpec,
    TopologySpec,
    TrainingJob,
    TrainingSpec,
    default_edges,
    kv_heads_split,
    natural_layout,
    skip_pairs,
    skip_tensor,
    tensor_parallel_sizes,
)
from meshjob.spec.safeyaml import check_tree, load_documents, read_text, source_name
from meshjob.spec.table import DNS1123_LABEL, NAME_RULE, bounded_fields, field_reader, schema_of

# what callers import from here: the entry points below, and the model's parts they need beside them
__all__ = [
    "AUTO",
    "BUILTIN_MODEL_KINDS",
    "CLEAN_POD_POLICIES",
    "INT64_MAX",
    "MAX_DEVICES_PER_HOST",
    "MAX_LAYERS",
    "MAX_MICROBATCHES",
    "MAX_NAME",
    "MAX_SCHEDULE_CELLS",
    "MODEL_KINDS",
    "EdgeSpec",
    "FieldSchema",
    "InitSpec",
    "LrScheduleSpec",
    "ModelSpec",
    "OptimizerSpec",
    "PodTemplateSpec",
    "ReshardingSpec",
    "SpecError",
    "StageSpec",
    "TopologySpec",
    "TrainingJob",
    "TrainingSpec",
    "bounded_fields",
    "default_edges",
    "job_to_dict",
    "kv_heads_split",
    "load_job",
    "load_jobs",
    "natural_layout",
    "parse_job",
    "parse_yaml",
    "parse_yaml_all",
    "schema_of",
    "searched_fields",
    "skip_pairs",
    "skip_tensor",
    "tensor_parallel_sizes",
]

# what parse_job says to `stages: auto`: only a search (the operator, meshjob tune, meshjob plan --cluster) takes it
STAGES_AUTO_HERE = (
    "a list of stages here: `auto` is chosen by a search, which the operator runs on the cluster's "
    "Nodes and `meshjob plan --cluster` runs as the operator would; for a local run write the "
    "stages, e.g. with `meshjob tune job.yaml --hosts N --out tuned.yaml`"
)
# ... and to `auto` in a field a search chooses (training.microbatches, schedule.kind, resharding.strategy/balancer)
FIELD_AUTO_HERE = (
    "here: `auto` is chosen by a search, which the operator runs on the cluster's Nodes "
    "(with spec.stages: auto or a list) and `meshjob plan --cluster` runs as the operator would; "
    "for a local run write the value, e.g. with `meshjob tune job.yaml --hosts N --out tuned.yaml`"
)


# ---------------------------------------------------------------------------------------------
# Entry points


TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec", "status")


def parse_job(doc: Mapping[str, Any]) -> TrainingJob:
    """Validate a whole TrainingJob document; raise SpecError with every problem at once. Any
    document is safe to pass: one nested too deep or too large (meshjob.spec.safeyaml.LIMITS) is refused
    before it is read."""
    check_tree(doc)
    r = field_reader()
    if not isinstance(doc, Mapping):
        raise SpecError([FieldError("document", doc, "a TrainingJob mapping with apiVersion, kind, metadata and spec")])
    for key in doc:
        if key not in TOP_LEVEL:
            r.fail(
                str(key) if isinstance(key, str) else f"[{key!r}]", doc[key], unknown_field(str(key), list(TOP_LEVEL))
            )
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
    check_job(r, job)
    if r.clean("spec.stages", "spec.model", "spec.training"):
        job = dataclasses.replace(job, edges=resolve_edges(r, job, raw_edges))
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
    allowed = (
        "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    )
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


Parsed = TypeVar("Parsed")  # what a document parser (load_jobs' `parse`) makes of one document


@overload
def load_jobs(path: str) -> list[TrainingJob]: ...
@overload
def load_jobs(path: str, parse: Callable[[Any], Parsed]) -> list[Parsed]: ...
def load_jobs(path: str, parse: Callable[[Any], Any] | None = None) -> list[Any]:
    """Every TrainingJob of a YAML file ("-": standard input), one per document, read by `parse` (default
    parse_job); SpecError names the document of each problem."""
    return parse_yaml_all(read_text(path, "TrainingJob manifest"), source_name(path), parse or parse_job)


def load_job(path: str) -> TrainingJob:
    """The one TrainingJob of a YAML file ("-": standard input), for commands that run one job."""
    return parse_yaml(read_text(path, "TrainingJob manifest"), source_name(path))


@overload
def parse_yaml_all(text: str, source: str = ...) -> list[TrainingJob]: ...
@overload
def parse_yaml_all(text: str, source: str, parse: Callable[[Any], Parsed]) -> list[Parsed]: ...
def parse_yaml_all(text: str, source: str = "<string>", parse: Callable[[Any], Any] | None = None) -> list[Any]:
    """parse_job() (or `parse`) of every document (meshjob.spec.safeyaml: bounded, kubectl's scalars, no
    duplicate keys); empty documents are skipped as kubectl skips them."""
    parse = parse or parse_job
    docs = load_documents(text, source)
    if not docs:
        raise SpecError([FieldError(source, "no document", "at least one TrainingJob document")])
    jobs: list[Any] = []
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
        raise SpecError(
            [
                FieldError(
                    source,
                    f"{len(docs)} documents",
                    "exactly one TrainingJob document (this command runs one job; meshjob plan takes several)",
                )
            ]
        )
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
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": _to_plain(TrainingJob, job),
    }
