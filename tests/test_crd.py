"""The TrainingJob CRD: generated from the spec model, committed identically twice, structural,
free of CEL rules, and accepted by a real kube-apiserver v1.20 (envtest) when one is available."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from meshjob import cli
from meshjob.spec import crd_core_types as core
from meshjob.spec import manifest as spec
from meshjob.spec.crd import build_crd, crd_yaml, open_api_schema

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = [ROOT / "crds" / "trainingjob.yaml", ROOT / "charts" / "meshjob" / "crds" / "trainingjob.yaml"]


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def version() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]


@pytest.mark.parametrize("path", COMMITTED, ids=["crds", "chart"])
def test_committed_crd_equals_the_generated_one(path):
    assert path.read_text(encoding="utf-8") == crd_yaml(), f"regenerate: meshjob crd > {path}"


def test_the_crd_fits_the_annotation_kubectl_apply_writes():
    """Client-side `kubectl apply` stores the whole object in an annotation, and annotations hold 256 KiB."""
    assert len(json.dumps(build_crd(), separators=(",", ":"))) < 256 * 1024 // 2


def test_crd_command_prints_the_generated_yaml(capsys):
    assert cli.main(["crd"]) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crd_check_passes_on_the_committed_files(capsys):
    assert cli.main(["crd", "--check", *map(str, COMMITTED)]) == 0


def test_crd_check_exits_1_with_a_diff_when_a_file_differs(tmp_path, capsys):
    stale = tmp_path / "trainingjob.yaml"
    stale.write_text(crd_yaml().replace("minimum: 1", "minimum: 2", 1))
    assert cli.main(["crd", "--check", str(stale)]) == 1
    out = capsys.readouterr()
    assert "-                    minimum: 2" in out.out and str(stale) in out.err


def test_crd_check_exits_1_when_the_file_is_missing(tmp_path, capsys):
    assert cli.main(["crd", "--check", str(tmp_path / "none.yaml")]) == 1


def test_names_group_version_and_scope():
    crd = build_crd()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == "trainingjobs.meshjob.io"
    assert crd["spec"]["group"] == "meshjob.io" and crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"] == {
        "kind": "TrainingJob",
        "listKind": "TrainingJobList",
        "plural": "trainingjobs",
        "singular": "trainingjob",
        "shortNames": ["tj"],
    }
    assert version()["name"] == "v1alpha1" and version()["served"] and version()["storage"]


def test_status_subresource_and_printer_columns():
    assert version()["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version()["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Step": ".status.step",
        "Progress": ".status.progress.percent",
        "Loss": ".status.loss",
        "Hosts": ".status.hosts",
        "Restarts": ".status.restarts",
        "Age": ".metadata.creationTimestamp",
    }


def test_schema_is_structural_every_node_has_a_type():
    untyped = [
        p
        for p, s in walk(open_api_schema())
        if "type" not in s
        and not s.get("x-kubernetes-int-or-string")
        and not s.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


def test_schema_sets_no_type_inside_any_of_but_int_or_strings():
    """Structural rule: anyOf/allOf/oneOf/not name no type, except IntOrString's two."""

    def types_inside(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            for key, sub in node.items():
                if key in ("anyOf", "allOf", "oneOf", "not"):
                    for branch in sub if isinstance(sub, list) else [sub]:
                        if "type" in branch:
                            yield node
                yield from types_inside(sub)
        elif isinstance(node, list):
            for sub in node:
                yield from types_inside(sub)

    assert [n for n in types_inside(open_api_schema()) if not n.get("x-kubernetes-int-or-string")] == []


def test_stages_is_auto_or_a_non_empty_list_of_stages():
    stages = open_api_schema()["properties"]["spec"]["properties"]["stages"]
    assert "type" not in stages and stages["x-kubernetes-preserve-unknown-fields"] is True
    schema = {"type": "object", "properties": {"stages": stages}}
    good = [{"layers": [0, 2], "mesh": [1, 1]}]
    for value in ("auto", good):
        jsonschema.Draft4Validator(schema).validate({"stages": value})
    for bad in ("Auto", "", 5, True, None, [], {}, {"layers": [0, 2]}, [{"layers": "x", "mesh": [1]}], [1]):
        assert not jsonschema.Draft4Validator(schema).is_valid({"stages": bad}), bad


def test_schema_has_no_cel_rules_so_it_loads_on_kubernetes_1_20():
    assert "x-kubernetes-validations" not in crd_yaml()


def test_every_spec_field_of_the_model_appears_with_its_manifest_name():
    props = open_api_schema()["properties"]["spec"]["properties"]
    assert set(props) == {
        "image",
        "model",
        "data",
        "training",
        "topology",
        "stages",
        "edges",
        "resharding",
        "schedule",
        "runPolicy",
        "metrics",
        "resources",
        "scheduling",
        "serviceAccountName",
        "podTemplate",
        "tunedFor",
    }
    assert set(props["model"]["properties"]) == {
        "kind",
        "layers",
        "hidden",
        "heads",
        "vocab",
        "seqLen",
        "kvHeads",
        "ffnHidden",
        "tieEmbeddings",
        "ropeTheta",
        "entrypoint",
        "config",
        "init",
    }
    assert set(props["data"]["properties"]) == {"kind", "path", "valPath", "dtype"}
    assert {"precision", "recompute", "gradClip", "lrSchedule", "evalEvery", "evalBatches", "optimizer"} <= set(
        props["training"]["properties"]
    )
    assert set(props["edges"]["items"]["properties"]) == {"from", "to", "send", "recv", "tensor"}


def test_operator_only_fields_are_in_the_schema_so_the_apiserver_keeps_them():
    # a structural schema prunes unknown fields: what meshjob_operator/render.py reads must be declared
    props = open_api_schema()["properties"]["spec"]["properties"]
    assert props["scheduling"]["properties"] == {
        "gang": {"type": "boolean"},
        "schedulerName": {"type": "string", "maxLength": 253},
        "queue": {"type": "string", "maxLength": 253},
        "topologyLevel": {
            "type": "string",
            "description": "node label for Kueue's required topology",
            "maxLength": 317,
        },
    }
    assert props["serviceAccountName"]["type"] == "string"
    template = props["podTemplate"]["properties"]
    assert set(template["metadata"]["properties"]) == {"labels", "annotations"}
    assert set(template["spec"]["properties"]) == {
        "tolerations",
        "nodeSelector",
        "affinity",
        "priorityClassName",
        "imagePullSecrets",
        "volumes",
        "containers",
    }
    assert template["spec"]["properties"]["containers"]["items"]["properties"]["name"]["enum"] == ["trainer"]
    volume = props["training"]["properties"]["checkpoint"]["properties"]["volume"]
    assert volume["type"] == "object" and volume["nullable"] is True
    assert set(volume["properties"]) == set(core.VOLUME_SOURCES)  # a volume source, of any kind core/v1 has


def test_the_schema_refuses_names_no_child_could_carry():
    """The API server checks metadata.name before any webhook: <name>-host-<index> must stay a DNS label."""
    name = open_api_schema()["properties"]["metadata"]["properties"]["name"]
    assert name["maxLength"] == 53 and name["pattern"].startswith("^[a-z]")


def test_enums_come_from_the_plan_layers_single_definitions():
    from meshjob.resharding.balance import BALANCERS
    from meshjob.resharding.strategies import STRATEGIES
    from meshjob.schedule.actions import SCHEDULE_KINDS

    props = open_api_schema()["properties"]["spec"]["properties"]
    assert props["model"]["properties"]["kind"]["enum"] == list(spec.MODEL_KINDS)
    assert props["resharding"]["properties"]["strategy"]["enum"] == [*STRATEGIES, "auto"]  # auto: searched
    assert props["resharding"]["properties"]["balancer"]["enum"] == [*BALANCERS, "auto"]
    assert props["schedule"]["properties"]["kind"]["enum"] == [*SCHEDULE_KINDS, "auto"]
    assert props["runPolicy"]["properties"]["cleanPodPolicy"]["enum"] == list(spec.CLEAN_POD_POLICIES)


def test_minimums_maximums_and_required_fields():
    props = open_api_schema()["properties"]["spec"]["properties"]
    stage = props["stages"]["items"]
    assert props["stages"]["anyOf"][1] == {"not": {"maxItems": 0}}  # a list: at least one stage
    assert "stages" in open_api_schema()["properties"]["spec"]["required"]
    assert stage["required"] == ["layers", "mesh"]
    assert stage["properties"]["mesh"]["items"]["minimum"] == 1
    assert (stage["properties"]["mesh"]["minItems"], stage["properties"]["mesh"]["maxItems"]) == (1, 3)
    assert props["edges"]["items"]["required"] == ["from", "to"]
    assert (props["metrics"]["properties"]["port"]["minimum"], props["metrics"]["properties"]["port"]["maximum"]) == (
        1,
        65535,
    )
    assert props["resharding"]["properties"]["budgetSeconds"]["exclusiveMinimum"] is True
    assert props["runPolicy"]["properties"]["backoffLimit"]["minimum"] == 0


def test_chunks_is_an_int_or_string_of_auto_or_a_positive_integer():
    chunks = open_api_schema()["properties"]["spec"]["properties"]["resharding"]["properties"]["chunks"]
    assert chunks["x-kubernetes-int-or-string"] is True and "type" not in chunks
    schema = {"type": "object", "properties": {"chunks": chunks}}
    for good in ("auto", 1, 64):
        jsonschema.Draft4Validator(schema).validate({"chunks": good})
    for bad in ("many", "", 0, -3):
        assert not jsonschema.Draft4Validator(schema).is_valid({"chunks": bad}), bad


def test_microbatches_is_an_int_or_string_of_auto_or_a_count_in_range():
    field = open_api_schema()["properties"]["spec"]["properties"]["training"]["properties"]["microbatches"]
    assert field["x-kubernetes-int-or-string"] is True and "type" not in field
    schema = {"type": "object", "properties": {"microbatches": field}}
    for good in ("auto", 1, spec.MAX_MICROBATCHES):
        jsonschema.Draft4Validator(schema).validate({"microbatches": good})
    for bad in ("AUTO", "many", "", "4", 0, spec.MAX_MICROBATCHES + 1):
        assert not jsonschema.Draft4Validator(schema).is_valid({"microbatches": bad}), bad


def test_status_schema_fields_and_preserved_unknown_fields():
    status = open_api_schema()["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert set(status["properties"]) == {
        "phase",
        "conditions",
        "hosts",
        "restarts",
        "disruptions",
        "step",
        "loss",
        "checkpointStep",
        "progress",
        "startTime",
        "completionTime",
        "placement",
        "pods",
        "observedGeneration",
        "tuned",
        "configMapDigests",
    }
    assert set(status["properties"]["conditions"]["items"]["properties"]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
    }
    assert set(status["properties"]["placement"]["items"]["properties"]) == {"stage", "host", "node", "devices"}
    assert status["properties"]["pods"]["additionalProperties"] == {"type": "string"}
    resources = open_api_schema()["properties"]["spec"]["properties"]["resources"]
    assert set(resources["properties"]) == {"limits", "requests", "claims"}  # a ResourceRequirements


# --- what a user may nest: bounded, and described as Kubernetes describes it ----------------------------------


def deep(depth: int) -> dict[str, Any]:
    """{"a": {"a": ... {}}}: `depth` mappings; at 20 kube-apiserver spent 34 s of CPU on one where it kept it."""
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def open_depth(node: dict[str, Any]) -> int:
    """How deep an x-kubernetes-preserve-unknown-fields node lets mappings and lists nest (0: scalars only)."""
    below = [s for s in (node.get("additionalProperties"), node.get("items")) if isinstance(s, dict)]
    if node.get("maxItems") == 0 and node.get("additionalProperties") is False:
        return 0
    assert below, "an open node whose values the API server would keep whole"
    return 1 + max(open_depth(s) if s.get("x-kubernetes-preserve-unknown-fields") else 0 for s in below)


def test_every_string_list_and_mapping_under_spec_has_a_maximum_and_nothing_nests_unbounded():
    """What kube-apiserver keeps unknown costs it CPU exponential in its depth: no node under spec keeps more than
    its schema says (typed objects keep only their properties), and every value has a size."""
    unbounded = []
    for path, node in walk(open_api_schema()["properties"]["spec"], "spec"):
        kind = node.get("type")
        if node.get("x-kubernetes-preserve-unknown-fields"):
            depth = open_depth(node)
            if path.startswith("spec.podTemplate") or path.startswith("spec.training.checkpoint"):
                assert depth == 0, f"{path}: open under the pod template (quantities only, scalars)"
            assert depth <= core.CONFIG_DEPTH, path
            words = node.get("anyOf", [{}])[0].get("enum")  # spec.stages: auto or a list
            if not ("maxLength" in node or words) or "maxItems" not in node:
                unbounded.append(path)
            if not ("maxProperties" in node or node.get("additionalProperties") is False):
                unbounded.append(path)
        elif node.get("x-kubernetes-int-or-string"):
            if not node.get("pattern", "").endswith(")$"):  # the words it takes beside integers
                unbounded.append(path)
        elif kind == "string" and "maxLength" not in node and "enum" not in node:
            unbounded.append(path)
        elif kind == "array" and "maxItems" not in node:
            unbounded.append(path)
        elif kind == "object" and "properties" not in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def test_the_pod_template_keeps_no_unknown_fields():
    template = open_api_schema()["properties"]["spec"]["properties"]["podTemplate"]
    opened = [p for p, n in walk(template, "spec.podTemplate") if n.get("x-kubernetes-preserve-unknown-fields")]
    quantities = ("limits{}", "requests{}", "divisor", "sizeLimit")
    assert opened and all(p.removesuffix("[]").endswith(quantities) for p in opened), opened
    quantities = [n for p, n in walk(template) if n.get("x-kubernetes-preserve-unknown-fields") and "items" in n]
    assert all(n["pattern"] == core.QUANTITY_PATTERN and open_depth(n) == 0 for n in quantities)


def upstream_definitions() -> tuple[str, dict[str, Any]]:
    """The newest Kubernetes OpenAPI definitions kubernetes-validate ships: (version, name -> schema)."""
    import kubernetes_validate

    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    newest = max(
        (p for p in folder.glob("v*-local-strict")),
        key=lambda p: tuple(int(x) for x in p.name[1:].split("-")[0].split(".")),
    )
    return newest.name, json.loads((newest / "_definitions.json").read_text())["$defs"]


def compare_with_upstream(ours: dict[str, Any], theirs: dict[str, Any], defs: dict[str, Any], path: str) -> list[str]:
    """Where our schema of a core type says what upstream's does not: a field it lacks, another type, other required
    fields. (Upstream may have fields we leave out: the API server prunes them.)"""
    ref = theirs.get("$ref") or (theirs.get("allOf") or [{}])[0].get("$ref")
    if ref:
        if ours.get("pattern") == core.QUANTITY_PATTERN:
            return [] if ref.endswith(".resource.Quantity") else [f"{path}: a quantity, upstream {ref}"]
        theirs = defs[ref.rsplit("/", 1)[-1]]
    kinds = theirs.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if ours.get("type") not in kinds:
        return [f"{path}: {ours.get('type')}, upstream {kinds}"]
    problems = []
    if ours["type"] == "array":
        problems += compare_with_upstream(ours["items"], theirs["items"], defs, f"{path}[]")
    elif ours["type"] == "object" and "properties" in ours:
        if set(ours.get("required", ())) != set(theirs.get("required", ())):
            problems.append(f"{path}: required {ours.get('required')}, upstream {theirs.get('required')}")
        for name, sub in ours["properties"].items():
            if name not in theirs.get("properties", {}):
                problems.append(f"{path}.{name}: no such field upstream")
            else:
                problems += compare_with_upstream(sub, theirs["properties"][name], defs, f"{path}.{name}")
    elif ours["type"] == "object":
        problems += compare_with_upstream(
            ours["additionalProperties"], theirs["additionalProperties"], defs, path + "{}"
        )
    return problems


def test_the_pod_template_describes_its_fields_as_kubernetes_does():
    """Every field, type and required list of the core types we describe is upstream's (kubernetes-validate's
    copy of the Kubernetes OpenAPI), and a volume takes every source upstream has."""
    version, defs = upstream_definitions()
    pod_spec, container = defs["io.k8s.api.core.v1.PodSpec"], defs["io.k8s.api.core.v1.Container"]
    props = open_api_schema()["properties"]["spec"]["properties"]
    template = props["podTemplate"]["properties"]["spec"]["properties"]
    problems = []
    for name, ours in template.items():
        if name != "containers":
            problems += compare_with_upstream(ours, pod_spec["properties"][name], defs, f"podTemplate.spec.{name}")
    for name, ours in template["containers"]["items"]["properties"].items():
        if name != "name":
            problems += compare_with_upstream(ours, container["properties"][name], defs, f"containers[].{name}")
    problems += compare_with_upstream(props["resources"], container["properties"]["resources"], defs, "resources")
    checkpoint = props["training"]["properties"]["checkpoint"]["properties"]["volume"]["properties"]
    for name, ours in checkpoint.items():  # a volume source: a Volume without its name
        volume = defs["io.k8s.api.core.v1.Volume"]["properties"][name]
        problems += compare_with_upstream(ours, volume, defs, f"checkpoint.volume.{name}")
    assert problems == [], version
    volume = defs["io.k8s.api.core.v1.Volume"]["properties"]
    assert set(core.VOLUME_SOURCES) == set(volume) - {"name"}, version


# a pod template as a user writes one: every kind of field the operator merges
REALISTIC_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "vision"}, "annotations": {"owner": "ana", "note": "x" * 2000}},
    "spec": {
        "nodeSelector": {"pool": "gpu", "topology.kubernetes.io/zone": "eu-1a"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "pool", "operator": "Equal", "value": "gpu", "effect": "NoExecute", "tolerationSeconds": 300},
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gen", "operator": "In", "values": ["h100", "a100"]}]},
                        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}]},
                    ]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 50, "preference": {"matchExpressions": [{"key": "ssd", "operator": "Exists"}]}}
                ],
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {"app": "inference"}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            },
        },
        "priorityClassName": "training-high",
        "imagePullSecrets": [{"name": "regcred"}],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
            {"name": "settings", "configMap": {"name": "train-settings", "items": [{"key": "a", "path": "a.yaml"}]}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "t", "audience": "s3"}}]}},
        ],
        "containers": [
            {
                "name": "trainer",
                "env": [
                    {"name": "HF_HOME", "value": "/data/hf"},
                    {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "token"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                ],
                "envFrom": [{"configMapRef": {"name": "train-env"}, "prefix": "TRAIN_"}],
                "volumeMounts": [
                    {"name": "data", "mountPath": "/data", "readOnly": True},
                    {"name": "shm", "mountPath": "/dev/shm"},
                ],
                "resources": {"limits": {"memory": "8Gi", "ephemeral-storage": 20e9}, "requests": {"memory": 0.5e9}},
            }
        ],
    },
}


def realistic_job() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["podTemplate"] = json.loads(json.dumps(REALISTIC_TEMPLATE))
    doc["spec"]["resources"] = {"requests": {"cpu": 0.5, "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    doc["spec"]["training"]["checkpoint"] = {
        "every": 1,
        "path": "/ckpt",
        "volume": {"nfs": {"server": "nas", "path": "/c"}},
    }
    return doc


def test_a_realistic_pod_template_passes_the_schema_and_parse_job():
    doc = realistic_job()
    assert list(jsonschema.Draft4Validator(open_api_schema()).iter_errors(doc)) == []
    job = spec.parse_job(doc)
    assert job.pod_template.spec.affinity == REALISTIC_TEMPLATE["spec"]["affinity"]


@pytest.mark.parametrize(
    "section, value, refused",
    [
        ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}, "nodeSelectorTerms"),
        ("tolerations", [{"key": "k", "effect": "Never"}], "effect"),
        ("tolerations", [{"key": "k"}] * (core.MAX_ITEMS + 1), "tolerations"),
        ("nodeSelector", {"pool": "x" * 64}, "pool"),
        ("nodeSelector", {"pool": deep(3)}, "pool"),
        ("volumes", [{"name": "v", "nfs": {"server": "s"}}], "nfs"),
        ("volumes", [{"name": "v", "emptyDir": {"sizeLimit": "8 gigs"}}], "sizeLimit"),
        ("volumes", [{"name": "v", "configMap": {"defaultMode": 0o1000}}], "defaultMode"),
    ],
)
def test_the_schema_and_its_check_refuse_what_kubernetes_would(section, value, refused):
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["podTemplate"] = {"spec": {section: value}}
    errors = list(jsonschema.Draft4Validator(open_api_schema()).iter_errors(doc))
    assert errors and any(refused in ".".join(map(str, e.absolute_path)) + e.message for e in errors)
    schema = open_api_schema()["properties"]["spec"]["properties"]["podTemplate"]
    problems = core.check(schema, doc["spec"]["podTemplate"], "spec.podTemplate")
    assert problems and all(p.path.startswith(f"spec.podTemplate.spec.{section}") for p in problems)
    assert any(refused in p.path or refused in p.allowed for p in problems), problems


def test_config_is_open_to_any_scalar_nested_at_most_config_depth():
    config = open_api_schema()["properties"]["spec"]["properties"]["model"]["properties"]["config"]
    validator = jsonschema.Draft4Validator(config)
    nested: Any = {"a": {"b": [{"c": 1.5, "d": "x", "e": True, "f": None}]}}  # 4 deep: config, a, b, b[0]
    for good in ({}, {"kernel": 4, "tie": True, "act": "gelu", "eps": 1e-5}, nested, {"n": None}):
        assert list(validator.iter_errors(good)) == [] and core.check(config, good, "config") == []
    for bad in (deep(core.CONFIG_DEPTH + 1), {"a": [[[[[]]]]]}, {"s": "x" * (core.MAX_TEXT + 1)}):
        assert list(validator.iter_errors(bad)) and core.check(config, bad, "config")
    (problem,) = core.check(config, deep(25), "spec.model.config")
    assert problem.path == "spec.model.config.a.a.a.a.a" and "nothing nests deeper" in problem.allowed


def test_the_check_refuses_unknown_fields_the_api_server_would_drop():
    schema = open_api_schema()["properties"]["spec"]["properties"]["podTemplate"]
    (problem,) = core.check(schema, {"spec": {"affinity": deep(25)}}, "spec.podTemplate")
    assert problem.path == "spec.podTemplate.spec.affinity.a"
    assert problem.allowed == "unknown field; known fields: nodeAffinity, podAffinity, podAntiAffinity"
    assert core.check(schema, REALISTIC_TEMPLATE, "spec.podTemplate") == []


# --- a real kube-apiserver (v1.20.2 from ../shared/envtest) ----------------------------------


def envtest_dir() -> Path | None:
    for candidate in (os.environ.get("KUBEBUILDER_ASSETS"), str(ROOT.parent / "shared" / "envtest")):
        if candidate and (Path(candidate) / "kube-apiserver").is_file() and (Path(candidate) / "start.sh").is_file():
            return Path(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def module_apiserver(tmp_path_factory) -> Iterator[dict[str, str]]:
    """etcd + kube-apiserver on free ports, one for the module (each takes ~5 s to start and ~5 s to
    stop); yields the env with KUBECONFIG."""
    assets = envtest_dir()
    if assets is None or shutil.which("etcd") is None or shutil.which("kubectl") is None:
        pytest.skip("needs ../shared/envtest (or KUBEBUILDER_ASSETS), etcd and kubectl")
    folder = tmp_path_factory.mktemp("kas")
    env = dict(
        os.environ,
        KAS_DIR=str(folder),
        KAS_KCM="0",
        ETCD_PORT=str(free_port()),
        ETCD_PEER_PORT=str(free_port()),
        APISERVER_PORT=str(free_port()),
    )
    try:
        subprocess.run(
            ["bash", str(assets / "start.sh")], env=env, check=True, timeout=60, capture_output=True, text=True
        )
        yield dict(env, KUBECONFIG=str(folder / "run" / "kubeconfig"))
    finally:
        subprocess.run(["bash", str(assets / "stop.sh")], env=env, timeout=30, capture_output=True)


@pytest.fixture
def apiserver(module_apiserver, tmp_path, request) -> dict[str, str]:
    """The module's API server, its kubeconfig's context in a namespace of this test's own, so that what
    one test creates and lists is its own."""
    namespace = "t" + hashlib.sha1(request.node.name.encode()).hexdigest()[:12]
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copy(module_apiserver["KUBECONFIG"], kubeconfig)
    env = dict(module_apiserver, KUBECONFIG=str(kubeconfig))
    for args in (
        ("create", "namespace", namespace),
        ("config", "set-context", "--current", f"--namespace={namespace}"),
    ):
        done = kubectl(env, *args)
        assert done.returncode == 0, done.stderr
    return env


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], env=env, input=stdin, capture_output=True, text=True, timeout=30)


def install_crd(env: dict[str, str]) -> None:
    created = kubectl(env, "apply", "-f", str(COMMITTED[0]))
    assert created.returncode == 0, created.stderr
    deadline = time.monotonic() + 30
    while True:
        ready = kubectl(env, "wait", "--for=condition=Established", "--timeout=20s", "crd/trainingjobs.meshjob.io")
        # kubectl 1.32 gives up at once ("accessor error") while the new CRD has no conditions yet
        if ready.returncode == 0 or "accessor error" not in ready.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ready.returncode == 0, ready.stderr


@pytest.mark.slow
def test_real_apiserver_establishes_the_crd_and_serves_the_examples(apiserver):
    install_crd(apiserver)
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    for example in examples:
        made = kubectl(apiserver, "create", "-f", str(example))
        assert made.returncode == 0, f"{example.name}: {made.stderr}"
    listed = kubectl(apiserver, "get", "tj", "-o", "json")
    items = json.loads(listed.stdout)["items"]
    assert sorted(i["metadata"]["name"] for i in items) == sorted(
        yaml.safe_load(e.read_text())["metadata"]["name"] for e in examples
    )
    # what the server stored parses back into the same job
    for item in items:
        stored = spec.parse_job(item)
        assert stored == spec.parse_job(spec.job_to_dict(stored))
    table = kubectl(apiserver, "get", "tj")
    assert table.stdout.split("\n")[0].split() == [
        "NAME",
        "PHASE",
        "STEP",
        "PROGRESS",
        "LOSS",
        "HOSTS",
        "RESTARTS",
        "AGE",
    ]


@pytest.mark.slow
def test_real_apiserver_rejects_bad_specs_and_keeps_operator_fields_and_status(apiserver):
    install_crd(apiserver)
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["resharding"]["strategy"] = "bcast"
    doc["spec"]["metrics"]["port"] = 0
    rejected = kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc))
    assert rejected.returncode != 0
    assert "spec.resharding.strategy" in rejected.stderr and "spec.metrics.port" in rejected.stderr
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["scheduling"] = {"gang": True, "queue": "team-q"}
    assert kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc)).returncode == 0
    status = {
        "status": {
            "phase": "Running",
            "step": 2,
            "hosts": 2,
            "restarts": 0,
            "progress": {"step": 2, "total": 4, "percent": 50, "eta": "2026-01-01T00:00:00Z"},
            "placement": [{"stage": 0, "host": "h0", "node": "n0", "devices": [0, 1]}],
            "pods": {"tiny-h0": "Running"},
            "kopf": {"progress": {}},
        }
    }
    patched = kubectl(
        apiserver, "patch", "tj", "tiny", "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    assert patched.returncode == 0, patched.stderr
    row = kubectl(apiserver, "get", "tj", "tiny", "--no-headers").stdout.split()
    assert row[:6] == ["tiny", "Running", "2", "50", "2", "0"]
    stored = json.loads(kubectl(apiserver, "get", "tj", "tiny", "-o", "json").stdout)
    assert stored["status"]["kopf"] == {"progress": {}}  # preserved, not pruned
    assert stored["spec"]["scheduling"] == {"gang": True, "queue": "team-q"}  # operator fields kept


@pytest.mark.slow
def test_real_apiserver_takes_chunks_as_auto_or_a_positive_integer(apiserver):
    install_crd(apiserver)
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    for i, chunks in enumerate(("auto", 8, "many", 0)):
        doc["metadata"]["name"] = f"tiny-{i}"
        doc["spec"]["resharding"]["chunks"] = chunks
        made = kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc))
        assert (made.returncode == 0) == (chunks in ("auto", 8)), (chunks, made.stderr)
        if made.returncode:
            assert "spec.resharding.chunks" in made.stderr


@pytest.mark.slow
def test_real_apiserver_enforces_the_bounds_parse_job_enforces(apiserver):
    install_crd(apiserver)
    tiny = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    bad = [
        ("model", "layers", spec.MAX_LAYERS + 1),
        ("model", "seqLen", 2**63),
        ("runPolicy", "activeDeadlineSeconds", 10**39),
        ("runPolicy", "backoffLimit", 2**31),
        ("schedule", "weightGradDelay", True),
        ("schedule", "weightGradDelay", 5000),
        ("schedule", "weightGradDelay", "on"),
        ("training", "microbatches", spec.MAX_MICROBATCHES + 1),
    ]
    for section, key, value in bad:
        doc = json.loads(json.dumps(tiny))
        doc["spec"].setdefault(section, {})[key] = value
        refused = kubectl(apiserver, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(doc))
        assert refused.returncode != 0 and f"spec.{section}.{key}" in refused.stderr, (key, value)
        with pytest.raises(spec.SpecError, match=f"spec.{section}.{key}"):
            spec.parse_job(doc)
    good = json.loads(json.dumps(tiny))
    good["spec"]["schedule"]["weightGradDelay"] = 3
    good["spec"]["runPolicy"] = {"activeDeadlineSeconds": spec.INT64_MAX}
    made = kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(good))
    assert made.returncode == 0, made.stderr
    stored = json.loads(kubectl(apiserver, "get", "tj", "tiny", "-o", "json").stdout)
    assert spec.parse_job(stored).schedule.weight_grad_delay == 3
    assert stored["spec"]["runPolicy"]["activeDeadlineSeconds"] == spec.INT64_MAX


@pytest.mark.slow
def test_real_apiserver_takes_stages_as_auto_or_a_list_and_refuses_the_rest(apiserver):
    install_crd(apiserver)
    tiny = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    cases = [
        ("auto", True),
        (tiny["spec"]["stages"], True),
        (5, False),
        ("many", False),
        ([], False),
        ({"layers": [0, 2]}, False),
        ([{"layers": "x", "mesh": [1, 1]}], False),
    ]
    for i, (stages, ok) in enumerate(cases):
        doc = json.loads(json.dumps(tiny))
        doc["metadata"]["name"] = f"tiny-{i}"
        doc["spec"]["stages"] = stages
        made = kubectl(apiserver, "create", "-o", "json", "-f", "-", stdin=json.dumps(doc))
        assert (made.returncode == 0) == ok, (stages, made.stderr)
        if ok:
            assert json.loads(made.stdout)["spec"]["stages"] == stages  # stored as sent
        else:
            assert "spec.stages" in made.stderr, (stages, made.stderr)


@pytest.mark.slow
def test_real_apiserver_takes_auto_in_the_searched_fields_and_refuses_other_words(apiserver):
    install_crd(apiserver)
    tiny = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    cases = [
        ("training", "microbatches", "auto", True),
        ("schedule", "kind", "auto", True),
        ("resharding", "strategy", "auto", True),
        ("resharding", "balancer", "auto", True),
        ("training", "microbatches", "AUTO", False),
        ("training", "microbatches", "4", False),
        ("training", "microbatches", 0, False),
        ("training", "microbatches", True, False),
        ("schedule", "kind", "automatic", False),
        ("resharding", "balancer", "Auto", False),
    ]
    for i, (section, key, value, ok) in enumerate(cases):
        doc = json.loads(json.dumps(tiny))
        doc["metadata"]["name"] = f"tiny-{i}"
        doc["spec"][section][key] = value
        made = kubectl(apiserver, "create", "-o", "json", "-f", "-", stdin=json.dumps(doc))
        assert (made.returncode == 0) == ok, (key, value, made.stderr)
        if ok:
            assert json.loads(made.stdout)["spec"][section][key] == value  # stored as sent, for the search
        else:
            assert f"spec.{section}.{key}" in made.stderr, (key, value, made.stderr)


# scalars whose reading differs between YAML 1.1 (PyYAML), YAML 1.2 and kubectl (go-yaml v2)
TRICKY_SCALARS = (
    "{a: 1e400, b: 100000000000000000000000000000000000000000, e: 0b101, f: +12, g: -0x10, "
    "h: 1.0e+3, i: 2001-12-14T21:59:43.10-05:00, j: Yes, k: ON, l: NO, m: ~, n: Null, p: 1:30, "
    "q: 0., r: -.5e1, s: 1_000.5, t: 0o, u: 0x, v: 00, w: -0b11, x: '12', z: !!str 12, "
    "aa: !!int '13', ab: 12e, ac: 1e+3, ad: 0777, ae: 08, af: .5, ag: 1E3, ah: y, 3: three}"
)


@pytest.mark.slow
def test_meshjob_reads_yaml_scalars_as_kubectl_sends_them(apiserver):
    """spec.model.config keeps any scalar, so the server returns what kubectl sent (but nulls: the API server
    drops a null where the schema says no `nullable`, as in a field left out)."""
    from meshjob.spec.safeyaml import load_documents

    install_crd(apiserver)
    text = (
        (ROOT / "examples" / "tiny.yaml").read_text().replace("seqLen: 16}", f"seqLen: 16, config: {TRICKY_SCALARS}}}")
    )
    sent = kubectl(apiserver, "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=text)
    assert sent.returncode == 0, sent.stderr
    ours = load_documents(text)[0]
    config = {k: v for k, v in ours["spec"]["model"]["config"].items() if v is not None}
    assert len(config) == len(ours["spec"]["model"]["config"]) - 2
    assert json.loads(sent.stdout)["spec"]["model"]["config"] == config
    assert json.loads(sent.stdout)["spec"]["training"]["learningRate"] == ours["spec"]["training"]["learningRate"]


def create(env: dict[str, str], doc: dict[str, Any], *flags: str) -> tuple[int | None, subprocess.CompletedProcess]:
    """kubectl create of `doc`, with the HTTP status of the API server's answer to the POST (None: no POST: kubectl
    refused it itself); 30 s for the server to answer, the time a deep mapping once took it to time out."""
    done = kubectl(
        env, "create", "-v=6", "--request-timeout=30s", "-o", "json", *flags, "-f", "-", stdin=json.dumps(doc)
    )
    posts = re.findall(r"POST \S+/trainingjobs\S* (\d{3}) ", done.stderr)
    return (int(posts[-1]) if posts else None), done


@pytest.mark.slow
def test_real_apiserver_answers_a_25_deep_nest_in_the_pod_template_at_once_and_keeps_none_of_it(apiserver):
    """Issue 53: a 20-deep mapping under podTemplate.spec.affinity (kept whole, x-kubernetes-preserve-unknown-fields)
    took the API server 34 s at 100% CPU. Now kubectl refuses it by the schema, naming the field; a client that
    skips that check gets an answer at once, without the nest (pruned: affinity keeps only its own fields); and
    where the schema keeps what a user writes (maps of strings, scalars, the custom model's config, stages), the
    API server itself refuses the nest, naming the field."""
    install_crd(apiserver)
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["podTemplate"] = {"spec": {"affinity": deep(25)}}
    status, refused = create(apiserver, doc)
    assert status is None and refused.returncode != 0
    assert 'unknown field "a"' in refused.stderr and "spec.podTemplate.spec.affinity" in refused.stderr
    status, made = create(apiserver, doc, "--validate=false")
    assert (status, made.returncode) == (201, 0), made.stderr
    assert json.loads(made.stdout)["spec"]["podTemplate"] == {"spec": {"affinity": {}}}
    # what the schema keeps, it bounds: the API server refuses the nest itself (HTTP 422, Invalid), naming the field
    kept = [
        ("spec.podTemplate.spec.nodeSelector.a", ("podTemplate",), {"spec": {"nodeSelector": deep(25)}}),
        ("spec.podTemplate.metadata.labels.a", ("podTemplate",), {"metadata": {"labels": deep(25)}}),
        (
            "spec.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            ".nodeSelectorTerms.matchExpressions.key",
            ("podTemplate",),
            {
                "spec": {
                    "affinity": REALISTIC_TEMPLATE["spec"]["affinity"]
                    | {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": [{"key": deep(25), "operator": "Exists"}]}]
                            }
                        }
                    }
                }
            },
        ),
        (
            "spec.podTemplate.spec.volumes.csi.volumeAttributes.a",
            ("podTemplate",),
            {"spec": {"volumes": [{"name": "v", "csi": {"driver": "d", "volumeAttributes": deep(25)}}]}},
        ),
        (
            "spec.podTemplate.spec.containers.resources.limits.cpu",
            ("podTemplate",),
            {"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"cpu": deep(25)}}}]}},
        ),
        ("spec.resources.requests.cpu", ("resources",), {"requests": {"cpu": deep(25)}}),
        ("spec.model.config.a.a.a.a", ("model", "config"), deep(25)),
        ("spec.stages", ("stages",), deep(25)),
    ]
    for field, keys, value in kept:
        doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        node = doc["spec"]
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        status, refused = create(apiserver, doc, "--validate=false", "--dry-run=server")
        assert status == 422 and "is invalid" in refused.stderr, (field, status, refused.stderr)
        assert field in refused.stderr, (field, refused.stderr)


@pytest.mark.slow
def test_real_apiserver_accepts_a_realistic_pod_template_whole(apiserver):
    """Affinity, tolerations, volumes (a PVC, a configMap, ...), env from a secret, nodeSelector, resources: created
    with kubectl's own check of the schema, stored as sent (nothing pruned), and read back into the same job."""
    install_crd(apiserver)
    doc = realistic_job()
    status, made = create(apiserver, doc)
    assert (status, made.returncode) == (201, 0), made.stderr
    stored = json.loads(made.stdout)
    assert stored["spec"] == doc["spec"]
    assert spec.parse_job(stored) == dataclasses.replace(spec.parse_job(doc), namespace=stored["metadata"]["namespace"])
