"""The TrainingJob CRD: generated from the spec model, committed identically twice, structural,
free of CEL rules, and accepted by a real kube-apiserver v1.20 (envtest) when one is available."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

from meshjob import cli, spec
from meshjob.crd import build_crd, crd_yaml, open_api_schema

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
    assert crd["spec"]["names"] == {"kind": "TrainingJob", "listKind": "TrainingJobList",
                                    "plural": "trainingjobs", "singular": "trainingjob", "shortNames": ["tj"]}
    assert version()["name"] == "v1alpha1" and version()["served"] and version()["storage"]


def test_status_subresource_and_printer_columns():
    assert version()["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version()["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Step": ".status.step", "Hosts": ".status.hosts",
                       "Restarts": ".status.restarts", "Age": ".metadata.creationTimestamp"}


def test_schema_is_structural_every_node_has_a_type():
    untyped = [p for p, s in walk(open_api_schema())
               if "type" not in s and not s.get("x-kubernetes-int-or-string")]
    assert untyped == []


def test_schema_has_no_cel_rules_so_it_loads_on_kubernetes_1_20():
    assert "x-kubernetes-validations" not in crd_yaml()


def test_every_spec_field_of_the_model_appears_with_its_manifest_name():
    props = open_api_schema()["properties"]["spec"]["properties"]
    assert set(props) == {"image", "model", "training", "topology", "stages", "edges", "resharding",
                          "schedule", "runPolicy", "metrics", "resources", "scheduling", "serviceAccountName"}
    assert set(props["model"]["properties"]) == {"kind", "layers", "hidden", "heads", "vocab", "seqLen"}
    assert set(props["edges"]["items"]["properties"]) == {"from", "to", "send", "recv", "tensor"}


def test_operator_only_fields_are_in_the_schema_so_the_apiserver_keeps_them():
    # a structural schema prunes unknown fields: what meshjob_operator/render.py reads must be declared
    props = open_api_schema()["properties"]["spec"]["properties"]
    assert props["scheduling"]["properties"] == {
        "gang": {"type": "boolean"}, "schedulerName": {"type": "string"}, "queue": {"type": "string"},
        "topologyLevel": {"type": "string", "description": "node label for Kueue's required topology"}}
    assert props["serviceAccountName"]["type"] == "string"


def test_enums_come_from_the_plan_layers_single_definitions():
    from meshjob.balance import BALANCERS
    from meshjob.resharding import STRATEGIES
    from meshjob.schedule import SCHEDULE_KINDS

    props = open_api_schema()["properties"]["spec"]["properties"]
    assert props["model"]["properties"]["kind"]["enum"] == list(spec.MODEL_KINDS)
    assert props["resharding"]["properties"]["strategy"]["enum"] == list(STRATEGIES)
    assert props["resharding"]["properties"]["balancer"]["enum"] == list(BALANCERS)
    assert props["schedule"]["properties"]["kind"]["enum"] == list(SCHEDULE_KINDS)
    assert props["schedule"]["properties"]["weightGradDelay"]["enum"] == list(spec.WEIGHT_GRAD_DELAY)
    assert props["runPolicy"]["properties"]["cleanPodPolicy"]["enum"] == list(spec.CLEAN_POD_POLICIES)


def test_minimums_maximums_and_required_fields():
    props = open_api_schema()["properties"]["spec"]["properties"]
    stage = props["stages"]["items"]
    assert props["stages"]["minItems"] == 1 and "stages" in open_api_schema()["properties"]["spec"]["required"]
    assert stage["required"] == ["layers", "mesh"]
    assert stage["properties"]["mesh"]["items"]["minimum"] == 1
    assert (stage["properties"]["mesh"]["minItems"], stage["properties"]["mesh"]["maxItems"]) == (1, 3)
    assert props["edges"]["items"]["required"] == ["from", "to"]
    assert props["metrics"]["properties"]["port"] == {"type": "integer", "minimum": 1, "maximum": 65535}
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


def test_status_schema_fields_and_preserved_unknown_fields():
    status = open_api_schema()["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert set(status["properties"]) == {"phase", "conditions", "hosts", "restarts", "step", "checkpointStep",
                                         "startTime", "completionTime", "placement", "pods",
                                         "observedGeneration"}
    assert set(status["properties"]["conditions"]["items"]["properties"]) == {
        "type", "status", "reason", "message", "lastTransitionTime"}
    assert set(status["properties"]["placement"]["items"]["properties"]) == {"stage", "host", "node", "devices"}
    assert status["properties"]["pods"]["additionalProperties"] == {"type": "string"}
    resources = open_api_schema()["properties"]["spec"]["properties"]["resources"]
    assert resources["x-kubernetes-preserve-unknown-fields"] is True


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


@pytest.fixture
def apiserver(tmp_path) -> Iterator[dict[str, str]]:
    """Start etcd + kube-apiserver on free ports in tmp_path; yield the env with KUBECONFIG."""
    assets = envtest_dir()
    if assets is None or shutil.which("etcd") is None or shutil.which("kubectl") is None:
        pytest.skip("needs ../shared/envtest (or KUBEBUILDER_ASSETS), etcd and kubectl")
    env = dict(os.environ, KAS_DIR=str(tmp_path / "kas"), KAS_KCM="0", ETCD_PORT=str(free_port()),
               ETCD_PEER_PORT=str(free_port()), APISERVER_PORT=str(free_port()))
    try:
        subprocess.run(["bash", str(assets / "start.sh")], env=env, check=True, timeout=60,
                       capture_output=True, text=True)
        yield dict(env, KUBECONFIG=str(tmp_path / "kas" / "run" / "kubeconfig"))
    finally:
        subprocess.run(["bash", str(assets / "stop.sh")], env=env, timeout=30, capture_output=True)


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], env=env, input=stdin, capture_output=True, text=True, timeout=30)


@pytest.mark.slow
def test_real_apiserver_establishes_the_crd_and_serves_the_examples(apiserver):
    created = kubectl(apiserver, "apply", "-f", str(COMMITTED[0]))
    assert created.returncode == 0, created.stderr
    ready = kubectl(apiserver, "wait", "--for=condition=Established", "--timeout=20s",
                    "crd/trainingjobs.meshjob.io")
    assert ready.returncode == 0, ready.stderr
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    for example in examples:
        made = kubectl(apiserver, "create", "-f", str(example))
        assert made.returncode == 0, f"{example.name}: {made.stderr}"
    listed = kubectl(apiserver, "get", "tj", "-o", "json")
    items = json.loads(listed.stdout)["items"]
    assert sorted(i["metadata"]["name"] for i in items) == sorted(
        yaml.safe_load(e.read_text())["metadata"]["name"] for e in examples)
    # what the server stored parses back into the same job
    for item in items:
        stored = spec.parse_job(item)
        assert stored == spec.parse_job(spec.job_to_dict(stored))
    table = kubectl(apiserver, "get", "tj")
    assert table.stdout.split("\n")[0].split() == ["NAME", "PHASE", "STEP", "HOSTS", "RESTARTS", "AGE"]


@pytest.mark.slow
def test_real_apiserver_rejects_bad_specs_and_keeps_operator_fields_and_status(apiserver):
    assert kubectl(apiserver, "apply", "-f", str(COMMITTED[0])).returncode == 0
    assert kubectl(apiserver, "wait", "--for=condition=Established", "--timeout=20s",
                   "crd/trainingjobs.meshjob.io").returncode == 0
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["resharding"]["strategy"] = "bcast"
    doc["spec"]["metrics"]["port"] = 0
    rejected = kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc))
    assert rejected.returncode != 0
    assert "spec.resharding.strategy" in rejected.stderr and "spec.metrics.port" in rejected.stderr
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["scheduling"] = {"gang": True, "queue": "team-q"}
    assert kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc)).returncode == 0
    status = {"status": {"phase": "Running", "step": 2, "hosts": 2, "restarts": 0,
                         "placement": [{"stage": 0, "host": "h0", "node": "n0", "devices": [0, 1]}],
                         "pods": {"tiny-h0": "Running"}, "kopf": {"progress": {}}}}
    patched = kubectl(apiserver, "patch", "tj", "tiny", "--subresource=status", "--type=merge",
                      "-p", json.dumps(status))
    assert patched.returncode == 0, patched.stderr
    row = kubectl(apiserver, "get", "tj", "tiny", "--no-headers").stdout.split()
    assert row[:5] == ["tiny", "Running", "2", "2", "0"]
    stored = json.loads(kubectl(apiserver, "get", "tj", "tiny", "-o", "json").stdout)
    assert stored["status"]["kopf"] == {"progress": {}}  # preserved, not pruned
    assert stored["spec"]["scheduling"] == {"gang": True, "queue": "team-q"}  # operator fields kept


@pytest.mark.slow
def test_real_apiserver_takes_chunks_as_auto_or_a_positive_integer(apiserver):
    assert kubectl(apiserver, "apply", "-f", str(COMMITTED[0])).returncode == 0
    assert kubectl(apiserver, "wait", "--for=condition=Established", "--timeout=20s",
                   "crd/trainingjobs.meshjob.io").returncode == 0
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    for i, chunks in enumerate(("auto", 8, "many", 0)):
        doc["metadata"]["name"] = f"tiny-{i}"
        doc["spec"]["resharding"]["chunks"] = chunks
        made = kubectl(apiserver, "create", "-f", "-", stdin=json.dumps(doc))
        assert (made.returncode == 0) == (chunks in ("auto", 8)), (chunks, made.stderr)
        if made.returncode:
            assert "spec.resharding.chunks" in made.stderr
