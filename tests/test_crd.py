"""The TrainingJob CRD: generated from the spec model, committed identically twice, structural,
free of CEL rules, and accepted by a real kube-apiserver v1.20 (envtest) when one is available."""

from __future__ import annotations

import hashlib
import json
import os
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
    assert volume["x-kubernetes-preserve-unknown-fields"] is True


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
        "checkpointStep",
        "progress",
        "startTime",
        "completionTime",
        "placement",
        "pods",
        "observedGeneration",
        "tuned",
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
    assert table.stdout.split("\n")[0].split() == ["NAME", "PHASE", "STEP", "PROGRESS", "HOSTS", "RESTARTS", "AGE"]


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
    """spec.resources keeps unknown fields, so the server returns exactly what kubectl sent."""
    from meshjob.spec.safeyaml import load_documents

    install_crd(apiserver)
    text = (ROOT / "examples" / "tiny.yaml").read_text() + f"  resources: {TRICKY_SCALARS}\n"
    sent = kubectl(apiserver, "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=text)
    assert sent.returncode == 0, sent.stderr
    ours = load_documents(text)[0]
    assert json.loads(sent.stdout)["spec"]["resources"] == ours["spec"]["resources"]
    assert json.loads(sent.stdout)["spec"]["training"]["learningRate"] == ours["spec"]["training"]["learningRate"]
