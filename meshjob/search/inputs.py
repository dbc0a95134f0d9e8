"""What `meshjob tune` reads from a manifest: the job to search for, and the fields the user fixed.

Left to the search: spec.stages (missing or `auto`), spec.training.microbatches (missing or `auto`),
spec.schedule.kind (missing or `auto`), spec.schedule.weightGradDelay (missing), spec.resharding.strategy
and .balancer (missing or `auto`), spec.topology.stageOrder (missing or `auto`; searched where the model has skip
edges). Every other field is kept as written. A stages list fixes the number
of stages; an entry's `layers` fixes its range, its `mesh` (two dims: hosts, devices per host) fixes the
mesh with the parallel dims as written (dataParallelDim d and dataParallelDims [d] alike). The rest of
the manifest is validated as `meshjob plan` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshjob.errors import FieldError, SpecError, UsageError
from meshjob.search.algorithm import Fixed, StageFix
from meshjob.search.stage_model import StageChoice
from meshjob.spec.manifest import AUTO, TrainingJob, parse_job


def _free(value: Any) -> bool:
    return value is None or value == AUTO


def read_fixed(doc: Mapping[str, Any]) -> Fixed:
    spec = doc.get("spec") if isinstance(doc, Mapping) else None
    if not isinstance(spec, Mapping):
        raise UsageError("spec: missing: a TrainingJob manifest with a spec mapping")
    training = spec.get("training") or {}
    schedule = spec.get("schedule") or {}
    resharding = spec.get("resharding") or {}
    topology = spec.get("topology") or {}
    stages = spec.get("stages")
    per_stage: tuple[StageFix, ...] = ()
    if not _free(stages):
        if not isinstance(stages, list) or not stages:
            raise UsageError(f"spec.stages: {stages!r} is invalid: auto, or a non-empty list of stages")
        per_stage = tuple(_stage_fix(i, s) for i, s in enumerate(stages))
    return Fixed(
        stages=len(per_stage) or None,
        per_stage=per_stage,
        microbatches=None if _free(training.get("microbatches")) else training["microbatches"],
        kind=None if _free(schedule.get("kind")) else schedule["kind"],
        weight_grad_delay=schedule.get("weightGradDelay"),
        strategy=None if _free(resharding.get("strategy")) else resharding["strategy"],
        balancer=None if _free(resharding.get("balancer")) else resharding["balancer"],
        chunks=resharding.get("chunks", AUTO),
        stage_order=None if _free(topology.get("stageOrder")) else topology["stageOrder"],
    )


def _stage_fix(i: int, stage: Any) -> StageFix:
    path = f"spec.stages[{i}]"
    if not isinstance(stage, Mapping):
        raise UsageError(f"{path}: {stage!r} is invalid: a mapping with layers and/or mesh")
    layers = stage.get("layers")
    mesh = stage.get("mesh")
    if mesh is not None and (not isinstance(mesh, list) or len(mesh) != 2):
        raise UsageError(f"{path}.mesh: {mesh!r} is invalid for meshjob tune: two dims [hosts, devices per host]")
    choice = None if mesh is None else StageChoice(tuple(mesh), _dp_dims(path, stage), stage.get("tensorParallelDim"))
    return StageFix(None if layers is None else tuple(layers), choice)


def _dp_dims(path: str, stage: Mapping[str, Any]) -> tuple[int, ...]:
    """The data-parallel dims a stage entry writes: dataParallelDims, or dataParallelDim d as [d] (one form, so
    that either spelling fixes the same choice)."""
    dim, dims = stage.get("dataParallelDim"), stage.get("dataParallelDims")
    if dims is None:
        return () if dim is None else (dim,)
    if dim is not None:
        raise UsageError(
            f"{path}.dataParallelDims: {dims!r} is invalid: unset when dataParallelDim is set ({dim!r}): write one "
            f"of them, dataParallelDim d (the same as dataParallelDims [d]) or dataParallelDims (e.g. [0, 1])"
        )
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise UsageError(f"{path}.dataParallelDims: {dims!r} is invalid: a list of mesh dims, e.g. [0, 1]")
    return tuple(dims)


def base_job(doc: Mapping[str, Any], devices_per_host: int) -> TrainingJob:
    """The manifest validated with one placeholder stage (the search writes the real ones) and the
    search's own fields at valid values: model, training and the rest as meshjob plan checks them."""
    spec = dict(doc["spec"])
    spec["stages"] = [{"layers": [0, (spec.get("model") or {}).get("layers", 8)], "mesh": [1, 1]}]
    spec.pop("edges", None)
    training = dict(spec.get("training") or {})
    if _free(training.get("microbatches")):
        training["microbatches"] = 1
    spec["training"] = training
    spec["topology"] = {**(spec.get("topology") or {}), "devicesPerHost": devices_per_host}
    if spec["topology"].get("stageOrder") == AUTO:
        spec["topology"].pop("stageOrder")
    for section, keys in (("schedule", ("kind",)), ("resharding", ("strategy", "balancer"))):
        values = dict(spec.get(section) or {})
        for key in keys:
            if values.get(key) == AUTO:
                values.pop(key)
        spec[section] = values
    job = parse_job({**doc, "spec": spec})
    if job.model.kind not in ("gpt", "utransformer", "llama"):
        raise SpecError(
            [
                FieldError(
                    "spec.model.kind",
                    job.model.kind,
                    "gpt, utransformer or llama for meshjob tune: its cost and memory model needs the block's shapes",
                )
            ]
        )
    return job
