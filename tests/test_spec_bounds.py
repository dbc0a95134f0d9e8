"""Every count of a TrainingJob has an upper bound: in the CRD (maximum, maxItems, maxLength) and in
parse_job, so that no input, however large its numbers, costs more than bounded time and memory."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from meshjob.errors import SpecError
from meshjob.spec import manifest as spec
from meshjob.spec.crd import open_api_schema
from meshjob.spec.manifest import bounded_fields, parse_job
from meshjob.spec.safeyaml import load_documents

ROOT = Path(__file__).resolve().parent.parent
GPT_DEMO = load_documents((ROOT / "examples" / "gpt-demo.yaml").read_text())[0]
CPU_SECONDS = 2.0  # a refusal by a bound takes milliseconds; the unbounded work took minutes


BOUNDED = dict(bounded_fields())


def keys_of(path: str) -> list[Any]:
    keys: list[Any] = []
    for part in path.split("."):
        name, _, rest = part.partition("[")
        keys.append(name)
        if rest:
            keys.append(int(rest.rstrip("]")))
    return keys


def with_value(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of doc with `value` at `path`; missing mappings on the way are created."""
    doc = copy.deepcopy(doc)
    keys = keys_of(path)
    node: Any = doc
    for key, after in zip(keys, keys[1:]):
        if isinstance(node, dict) and key not in node:
            node[key] = [] if isinstance(after, int) else {}
        node = node[key]
        if isinstance(node, list) and isinstance(after, int) and len(node) <= after:
            node.extend([None] * (after + 1 - len(node)))  # a list the document leaves out (dataParallelDims)
    node[keys[-1]] = value
    return doc


def crd_property(path: str) -> dict[str, Any]:
    node = open_api_schema()
    for key in keys_of(path):
        node = node["items"] if isinstance(key, int) else node["properties"][key]
    return node


def error_paths(doc: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return {e.path: e.allowed for e in info.value.errors}


def test_every_count_of_the_model_has_a_maximum():
    integers = [p for p, f in BOUNDED.items() if f.type in ("integer", "int-or-string")]
    assert len(integers) >= 20
    assert {
        "spec.model.layers",
        "spec.model.seqLen",
        "spec.training.microbatches",
        "spec.stages[0].mesh[0]",
        "spec.resharding.chunks",
        "spec.runPolicy.activeDeadlineSeconds",
    } <= set(integers)


@pytest.mark.parametrize("path", sorted(BOUNDED))
def test_bound_appears_in_the_crd(path):
    field, prop = BOUNDED[path], crd_property(path)
    assert prop.get("maximum") == field.maximum and prop.get("maxLength") == field.max_length


@pytest.mark.parametrize("path", sorted(p for p, f in BOUNDED.items() if f.maximum is not None))
def test_one_past_the_maximum_is_refused_naming_the_field(path):
    field = BOUNDED[path]
    allowed = error_paths(with_value(GPT_DEMO, path, int(field.maximum) + 1))[path]
    assert str(int(field.maximum)) in allowed


@pytest.mark.parametrize("path", sorted(p for p, f in BOUNDED.items() if f.max_length is not None))
def test_one_character_past_the_maximum_length_is_refused_naming_the_field(path):
    allowed = error_paths(with_value(GPT_DEMO, path, "x" * (BOUNDED[path].max_length + 1)))[path]
    assert (
        f"at most {BOUNDED[path].max_length} characters" in allowed
        or f"to {BOUNDED[path].max_length} characters" in allowed
    )


@pytest.mark.parametrize(
    "path, value",
    [
        ("spec.model.seqLen", 2**63),
        ("spec.runPolicy.activeDeadlineSeconds", 10**39),
        ("spec.runPolicy.activeDeadlineSeconds", 1e39),
        ("spec.runPolicy.backoffLimit", 2**31),
        ("spec.training.seed", 2**64),
    ],
)
def test_values_kubernetes_cannot_store_are_refused(path, value):
    assert path in error_paths(with_value(GPT_DEMO, path, value))


def test_int64_field_takes_the_largest_value_the_api_server_can_compare():
    job = parse_job(with_value(GPT_DEMO, "spec.runPolicy.activeDeadlineSeconds", spec.INT64_MAX))
    assert job.run_policy.active_deadline_seconds == 2**63 - 1024


def test_integral_floats_are_integers_as_the_api_server_reads_them():
    job = parse_job(with_value(GPT_DEMO, "spec.training.steps", 1e3))
    assert job.training.steps == 1000 and type(job.training.steps) is int
    assert "spec.training.steps" in error_paths(with_value(GPT_DEMO, "spec.training.steps", 10.5))


def utransformer(layers: int) -> dict[str, Any]:
    doc = with_value(GPT_DEMO, "spec.model.kind", "utransformer")
    doc = with_value(doc, "spec.model.layers", layers)
    doc["spec"].pop("edges")
    return with_value(doc, "spec.stages[3].layers", [6, layers])


@pytest.mark.parametrize(
    "doc, path",
    [
        (utransformer(10**9), "spec.model.layers"),  # took 75 s when only skip edges bounded it
        (
            with_value(with_value(GPT_DEMO, "spec.training.microbatches", 10**6), "spec.training.globalBatch", 10**6),
            "spec.training.microbatches",
        ),  # 150 s and 2.2 GB of schedules
        (
            with_value(with_value(GPT_DEMO, "spec.training.microbatches", 10**7), "spec.training.globalBatch", 10**7),
            "spec.training.microbatches",
        ),  # a MemoryError
    ],
)
def test_huge_but_well_formed_jobs_are_refused_fast_by_a_bound(doc, path):
    started = time.process_time()
    assert path in error_paths(doc)
    assert time.process_time() - started < CPU_SECONDS


def stages(count: int, mesh: list[int], layers_each: int = 1) -> list[dict[str, Any]]:
    return [
        {"layers": [i * layers_each, (i + 1) * layers_each], "mesh": mesh, "dataParallelDim": 0} for i in range(count)
    ]


def job_with(stage_list: list[dict[str, Any]], microbatches: int = 4, per_host: int = 2) -> dict[str, Any]:
    doc = copy.deepcopy(GPT_DEMO)
    doc["spec"].pop("edges")
    doc["spec"]["stages"] = stage_list
    doc["spec"]["model"]["layers"] = stage_list[-1]["layers"][1]
    doc["spec"]["topology"]["devicesPerHost"] = per_host
    doc["spec"]["training"].update(microbatches=microbatches, globalBatch=microbatches * 4096)
    return doc


def test_schedules_are_bounded_by_stages_times_microbatches():
    assert parse_job(job_with(stages(128, [1, 1]), microbatches=128)).training.microbatches == 128
    allowed = error_paths(job_with(stages(128, [1, 1]), microbatches=129))["spec.training.microbatches"]
    assert "at most 128 with 128 stages" in allowed and "16384" in allowed


def test_devices_of_all_stages_are_bounded():
    assert parse_job(job_with(stages(4, [256, 16]), per_host=16)).world_size == 16384
    assert "at most 16384 devices" in error_paths(job_with(stages(5, [128, 32]), per_host=32))["spec.stages"]


def test_hosts_of_all_stages_are_bounded():
    assert parse_job(job_with(stages(8, [128, 1]))).world_size == 1024
    assert "at most 1024 hosts" in error_paths(job_with(stages(9, [128, 1])))["spec.stages"]


def test_a_deeply_nested_parsed_document_is_refused_without_recursion_error():
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    with pytest.raises(SpecError, match="levels of nesting"):
        parse_job(with_value(GPT_DEMO, "spec.resources", {"limits": deep}))


def test_the_largest_edge_list_validates_within_the_cpu_budget():
    """512 skip edges between two 4096-device stages, every layout spelled out: each layout check
    walks the mesh, so they are remembered per (layout, stage)."""
    doc = job_with(stages(2, [512, 8], layers_each=512), per_host=8)
    doc["spec"]["model"]["kind"] = "utransformer"
    doc["spec"]["edges"] = [
        {"from": 0, "to": 1, "tensor": f"skip{i}", "send": "S0RR", "recv": "S01RR"} for i in range(512)
    ]
    started = time.process_time()
    job = parse_job(doc)
    assert time.process_time() - started < CPU_SECONDS
    assert len(job.edges) == 513 and job.edges[1].recv == "S01RR"
