"""The Helm chart: it lints and renders (helm-python-sdk, Helm's own Go code) with default and
non-default values, every rendered manifest validates, values.schema.json rejects bad values, and the
operator Deployment is locked down."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmError, lint

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "meshjob"
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
EVERYTHING_ON = {
    "monitoring": {
        "release": "kube-prom",
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "grafana": {"dashboard": {"enabled": True}},
}
NON_DEFAULT = {
    **EVERYTHING_ON,
    "fullnameOverride": "mj",
    "operator": {
        "replicas": 2,
        "namespaces": ["team-a", "team-b"],
        "peering": {"enabled": True, "name": "mj"},
        "image": {"repository": "registry.example/meshjob/operator", "tag": "0.1.0-rc1"},
        "imagePullSecrets": [{"name": "regcred"}],
        "extraArgs": ["--verbose"],
        "allowedImages": ["registry.example/ml/*", "meshjob/trainer:*"],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "webhook": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}},
        },
    },
    "serviceAccount": {"name": "meshjob-op", "annotations": {"example.com/role": "x"}},
}


def render(values: dict[str, Any] | None = None, namespace: str = "meshjob-system") -> dict[str, str]:
    with Chart.load(CHART) as chart:
        return chart.render(values or {}, name="meshjob", namespace=namespace)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for path, text in rendered.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in crd["spec"]["versions"] if v.get("storage"))["schema"]["openAPIV3Schema"]


def validate_custom(doc: dict[str, Any], crd: dict[str, Any]) -> None:
    """openAPIV3Schema is OpenAPI 3.0: JSON Schema draft 4 semantics (boolean exclusiveMinimum)."""
    jsonschema.Draft4Validator(crd_schema(crd)).validate(doc)


# Prometheus Operator kinds: no schema ships offline, so check the fields this chart relies on.
MONITORING_SHAPES = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port", "interval"],
                            "properties": {"honorLabels": {"type": "boolean"}},
                        },
                    },
                },
            }
        },
    },
    "PodMonitor": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints", "namespaceSelector"],
                "properties": {
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["interval", "honorLabels"],
                            "properties": {
                                "relabelings": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["sourceLabels"],
                                        "properties": {
                                            "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                            "action": {
                                                "enum": [
                                                    "replace",
                                                    "keep",
                                                    "drop",
                                                    "labelmap",
                                                    "labeldrop",
                                                    "labelkeep",
                                                ]
                                            },
                                        },
                                    },
                                }
                            },
                        },
                    }
                },
            }
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "object", "required": ["name", "rules"]},
                    }
                },
            }
        },
    },
}
# cert-manager kinds: no schema ships offline either
CERT_MANAGER_SHAPES = {
    "Certificate": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["secretName", "dnsNames", "issuerRef"],
                "properties": {
                    "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    "issuerRef": {
                        "type": "object",
                        "required": ["name", "kind"],
                        "properties": {"kind": {"enum": ["Issuer", "ClusterIssuer"]}},
                    },
                },
            }
        },
    },
    "Issuer": {"type": "object", "required": ["spec"], "properties": {"spec": {"type": "object", "minProperties": 1}}},
}


def validate_manifest(doc: dict[str, Any], crds: dict[str, dict[str, Any]]) -> None:
    kind = doc["kind"]
    if kind in MONITORING_SHAPES:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.validate(doc, MONITORING_SHAPES[kind])
    elif kind in CERT_MANAGER_SHAPES:
        assert doc["apiVersion"] == "cert-manager.io/v1"
        jsonschema.validate(doc, CERT_MANAGER_SHAPES[kind])
    elif kind in crds:
        validate_custom(doc, crds[kind])
    else:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def rendered_crds(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    crds = {d["spec"]["names"]["kind"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    for path in (CHART / "crds").glob("*.yaml"):
        for d in yaml.safe_load_all(path.read_text()):
            crds[d["spec"]["names"]["kind"]] = d
    return crds


# --- lint and render ------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NON_DEFAULT], ids=["default", "non-default"])
def test_chart_lints_without_errors_or_warnings(values):
    report = lint(CHART, values, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON, NON_DEFAULT], ids=["default", "everything-on", "non-default"])
def test_every_rendered_manifest_validates(values):
    docs = manifests(render(values))
    crds = rendered_crds(docs)
    assert docs
    for doc in docs:
        validate_manifest(doc, crds)


def test_default_render_has_exactly_the_core_objects():
    kinds = sorted(d["kind"] for d in manifests(render()))
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "Service",
        "ServiceAccount",
    ]


def test_optional_objects_appear_only_behind_their_flags():
    kinds = {d["kind"] for d in manifests(render(EVERYTHING_ON))}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} <= kinds
    for flag, kind in [
        (("monitoring", "serviceMonitor"), "ServiceMonitor"),
        (("monitoring", "podMonitor"), "PodMonitor"),
        (("monitoring", "prometheusRule"), "PrometheusRule"),
        (("grafana", "dashboard"), "ConfigMap"),
    ]:
        values = json.loads(json.dumps(EVERYTHING_ON))
        values[flag[0]][flag[1]]["enabled"] = False
        assert kind not in {d["kind"] for d in manifests(render(values))}, flag


def test_example_trainingjobs_validate_against_the_charts_crd():
    crd = rendered_crds([])["TrainingJob"]
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "TrainingJob":
                validate_custom(doc, crd)


def test_chart_crds_are_identical_to_the_generated_crds():
    chart_crds = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    repo_crds = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    assert chart_crds and chart_crds == repo_crds


# --- values.schema.json -------------------------------------------------------------------


def test_default_values_satisfy_the_schema():
    jsonschema.Draft7Validator.check_schema(json.loads((CHART / "values.schema.json").read_text()))
    with Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)


@pytest.mark.parametrize(
    "values,path",
    [
        ({"operator": {"replicas": -1}}, "replicas"),
        ({"operator": {"metricsPort": 70000}}, "metricsPort"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
        ({"operator": {"namespaces": ["Not_A_Namespace"]}}, "namespaces"),
        ({"operator": {"replica": 2}}, "replica"),
        ({"monitoring": {"serviceMonitor": {"enabled": "yes"}}}, "enabled"),
        ({"monitoring": {"podMonitor": {"enabled": True, "interval": "fast"}}}, "interval"),
        ({"service": {"type": "Ingress"}}, "type"),
        ({"grafana": {"dashboard": {"enabled": True, "labelValue": 1}}}, "labelValue"),
        ({"trainer": {"serviceAccount": {"create": True}}}, "trainer"),
        ({"operator": {"webhook": {"enabled": True, "certSecret": 7}}}, "certSecret"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(values, path):
    with pytest.raises(HelmError) as err:
        render(values)
    assert path in str(err.value)


# --- the operator Deployment ----------------------------------------------------------------


def deployment(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (dep,) = by_kind(manifests(render(values)), "Deployment")
    return dep


def test_operator_runs_non_root_with_read_only_root_fs_no_capabilities_and_runtime_default_seccomp():
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}


def test_operator_probes_hit_the_liveness_endpoint_it_is_told_to_serve():
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    liveness = next(a for a in container["args"] if a.startswith("--liveness="))
    match = re.fullmatch(r"--liveness=http://0\.0\.0\.0:(\d+)(/\S+)", liveness)
    assert match, liveness
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == match[2] and ports[get["port"]] == int(match[1])


def test_operator_has_resource_requests_and_limits():
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])


def test_default_images_are_the_dockerfile_targets_at_app_version():
    with Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"meshjob/operator:{app_version}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MESHJOB_TRAINER_IMAGE"] == f"meshjob/trainer:{app_version}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+ AS operator$", dockerfile, re.M) and re.search(
        r"^FROM \S+ AS trainer$", dockerfile, re.M
    )


def test_namespaces_and_peering_values_become_operator_arguments():
    (container,) = deployment(NON_DEFAULT)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert "--peering=mj" in args and "--standalone" not in args
    assert "--allowed-image=registry.example/ml/*" in args and "--allowed-image=meshjob/trainer:*" in args
    default_args = deployment()["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in default_args and "--standalone" in default_args
    assert deployment()["spec"]["strategy"] == {"type": "Recreate"}


def test_every_operator_argument_is_accepted_by_meshjob_operator():
    """The chart's command line must parse: a typo or a renamed flag would crash-loop the pod."""
    (container,) = deployment(NON_DEFAULT)["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if a != "--verbose"]
    (default,) = deployment()["spec"]["template"]["spec"]["containers"]
    code = "import sys; from meshjob.cli import build_parser; argv = sys.argv[1:]; build_parser(argv).parse_args(argv)"
    for argv in (container["command"][1:] + args, default["command"][1:] + default["args"]):
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"meshjob {' '.join(argv)}:\n{result.stderr[-1500:]}"


# --- monitoring objects, dashboard, notes -------------------------------------------------


def test_monitors_and_rule_carry_the_configured_release_label():
    docs = manifests(render(EVERYTHING_ON))
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (doc,) = by_kind(docs, kind)
        assert doc["metadata"]["labels"]["release"] == "kube-prom", kind


def test_pod_monitor_selects_trainer_pods_by_the_operators_job_label():
    from meshjob_operator import names

    (pm,) = by_kind(manifests(render(EVERYTHING_ON)), "PodMonitor")
    assert pm["spec"]["selector"]["matchExpressions"] == [{"key": names.JOB_LABEL, "operator": "Exists"}]
    assert pm["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True


def _kept_port_names(pod_monitor: dict[str, Any], port_names: list[str]) -> list[str]:
    """Prometheus' `keep` relabeling (the regex is anchored) applied to container port names."""
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint  # no port: every declared container port is a candidate target
    (keep,) = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    return [n for n in port_names if re.fullmatch(keep["regex"], n)]


def test_pod_monitor_scrapes_the_metrics_port_of_every_local_rank_and_no_other_port():
    """The port names the operator declares for a 16-device host: all 16 metrics ports are kept,
    the rendezvous port is not."""
    from meshjob.spec.manifest import parse_job
    from meshjob_operator import render as operator_render
    from meshjob_operator.testing import job_body

    job = parse_job(job_body("demo"))
    ports = [{"name": "rendezvous"}, *operator_render.metrics_ports(job, 16)]
    (pm,) = by_kind(manifests(render(EVERYTHING_ON)), "PodMonitor")
    kept = _kept_port_names(pm, [p["name"] for p in ports])
    assert kept == ["metrics"] + [f"metrics-{r}" for r in range(1, 16)]


def test_pod_monitor_port_name_value_moves_the_pattern():
    values = json.loads(json.dumps(EVERYTHING_ON))
    values["monitoring"]["podMonitor"]["portName"] = "prom"
    (pm,) = by_kind(manifests(render(values)), "PodMonitor")
    assert _kept_port_names(pm, ["metrics", "prom", "prom-3", "prom-x", "rendezvous"]) == ["prom", "prom-3"]


def test_service_monitor_selects_the_operator_service_port():
    docs = manifests(render(EVERYTHING_ON))
    (sm,) = by_kind(docs, "ServiceMonitor")
    (svc,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    pod_labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_prometheus_rule_holds_the_rules_file_verbatim():
    (rule,) = by_kind(manifests(render(EVERYTHING_ON)), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "meshjob-alerts.yaml").read_text())


def test_dashboard_configmap_is_labelled_for_grafana_and_holds_the_dashboard():
    (cm,) = by_kind(manifests(render(EVERYTHING_ON)), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["meshjob.json"]) == json.loads((CHART / "dashboards" / "meshjob.json").read_text())


def test_committed_dashboard_is_what_the_generator_writes():
    sys.path.insert(0, str(CHART / "dashboards"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    assert (CHART / "dashboards" / "meshjob.json").read_text() == generate.render()


def test_notes_say_how_to_apply_an_example_job_that_exists():
    notes = render()["meshjob/templates/NOTES.txt"]
    assert "kubectl apply -f examples/" in notes
    named = re.findall(r"examples/([\w./-]+\.yaml)", notes)
    assert "gpt-demo.yaml" in named and "kubernetes/gpt-demo-checkpoints.yaml" in named
    for name in named:
        assert (ROOT / "examples" / name).is_file(), name


# --- least-privilege RBAC: rules == what the operator's source calls, confirmed by a real run ------

# The operator's Kube client (meshjob_operator/kube.py): method -> the (group, resource, verb) it sends.
# A new method fails the test until it is added here, so every new API call gets an RBAC review.
KUBE_METHODS: dict[str, list[tuple[str, str, str]]] = {
    "get_job": [("meshjob.io", "trainingjobs", "get")],
    # the status subresource, or the main resource where a CRD has none
    "patch_job_status": [("meshjob.io", "trainingjobs/status", "patch"), ("meshjob.io", "trainingjobs", "patch")],
    "delete_job": [("meshjob.io", "trainingjobs", "delete")],
    "list_pods": [("", "pods", "list")],
    "list_running_pods": [("", "pods", "list")],  # every namespace: the devices other pods hold
    "delete_pod": [("", "pods", "delete")],
    "list_nodes": [("", "nodes", "list")],
    "namespace_labels": [("", "namespaces", "get")],  # a job's namespace's Pod Security level
    "may_create_pods": [],  # the admission webhook's SubjectAccessReview: see needed_by_kopf (webhook on)
    "close": [],
}
KUBE_PLURAL_METHODS = {"get": "get", "patch": "patch", "create_if_absent": "create"}  # plural is an argument
KOPF_EVENT_CALLS = {"event", "info", "warn", "exception"}
KOPF_STATEFUL = {"create", "update", "resume", "delete", "field"}  # handlers that persist progress: patch


def _literal_strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _constant(module_names: dict[str, str], node: ast.AST) -> str | None:
    """A string literal, or names.X of meshjob_operator/names.py."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "names":
        return module_names.get(node.attr)
    return None


def needed_by_operator_source() -> set[tuple[str, str, str]]:
    """(group, resource, verb) the operator calls: its Kube client calls and its kopf handlers."""
    from meshjob_operator import names as names_module

    consts = {k: v for k, v in vars(names_module).items() if isinstance(v, str)}
    needed: set[tuple[str, str, str]] = set()
    for path in sorted((ROOT / "operator" / "meshjob_operator").glob("*.py")):
        if path.name in ("kube.py", "testing.py"):  # the client itself; test clusters (never run by the operator)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            func, owner = node.func, node.func.value
            # self.kube.<method>(...) / <x>.kube.<method>(...)
            if isinstance(owner, ast.Attribute) and owner.attr == "kube":
                if func.attr in KUBE_METHODS:
                    needed |= set(KUBE_METHODS[func.attr])
                elif func.attr in KUBE_PLURAL_METHODS:
                    plural = _constant(consts, node.args[1])
                    assert plural, f"{path.name}:{node.lineno}: kube.{func.attr} with a computed plural"
                    group = ""
                    for text in _literal_strings(node):
                        if text.startswith("/apis/"):
                            group = text.split("/")[2]
                    needed.add((group, plural, KUBE_PLURAL_METHODS[func.attr]))
                else:
                    raise AssertionError(
                        f"{path.name}:{node.lineno}: kube.{func.attr} is not in KUBE_METHODS: "
                        "add its (group, resource, verb) and review templates/rbac.yaml"
                    )
            # kopf.event / kopf.warn ...: Events
            elif isinstance(owner, ast.Name) and owner.id == "kopf" and func.attr in KOPF_EVENT_CALLS:
                needed.add(("", "events", "create"))
        for node in ast.walk(ast.parse(path.read_text())):
            # @kopf.on.<cause>(group, version, plural, ...) and @kopf.daemon/timer/index(...)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            dotted = ast.unparse(node.func)
            if not (dotted.startswith("kopf.on.") or dotted in ("kopf.daemon", "kopf.timer", "kopf.index")):
                continue
            cause = dotted.rsplit(".", 1)[-1]
            args = [_constant(consts, a) for a in node.args[:3]]
            if len(args) < 3 or cause in ("startup", "cleanup", "login", "probe", "validate", "mutate"):
                continue
            group, _, plural = args
            assert plural, f"{path.name}:{node.lineno}: {dotted} with a computed resource"
            group = "" if group in ("", "v1") else group
            needed |= {(group, plural, "list"), (group, plural, "watch")}
            if cause in KOPF_STATEFUL or dotted in ("kopf.daemon", "kopf.timer"):
                # finalizers and progress annotations on the object, handler status patches
                needed |= {(group, plural, "patch"), (group, f"{plural}/status", "patch")}
    return needed


def needed_by_kopf(values: dict[str, Any]) -> set[tuple[str, str, str]]:
    """What kopf itself calls for the chart's operator flags (kopf 1.45: scanning, peering, admission)."""
    operator = {
        **{"namespaces": [], "peering": {"enabled": False}, "webhook": {"enabled": True}},
        **values.get("operator", {}),
    }
    needed = {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    if operator["namespaces"]:
        needed |= {("", "namespaces", "list"), ("", "namespaces", "watch")}
    if operator["peering"]["enabled"]:
        plural = "kopfpeerings" if operator["namespaces"] else "clusterkopfpeerings"
        needed |= {("kopf.dev", plural, verb) for verb in ("list", "watch", "patch")}
    if operator["webhook"]["enabled"]:  # kopf manages both kinds of configuration, whatever handlers exist
        needed |= {
            ("admissionregistration.k8s.io", kind, verb)
            for verb in ("create", "patch")
            for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations")
        }
        needed.add(("authorization.k8s.io", "subjectaccessreviews", "create"))  # our webhook: may_create_pods
    return needed


def operator_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-operator")]
    return role


def rules_of(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def namespace_roles(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The operator's Roles (operator.namespaces set), by namespace."""
    return {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-operator")}


def granted(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """What the operator may do somewhere: its ClusterRole and its Roles in the namespaces it serves."""
    return rules_of(operator_role(docs)).union(*(rules_of(r) for r in namespace_roles(docs).values()))


WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def used(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    found = set()
    for event in events:
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        found.add((ref.get("apiGroup", ""), resource, event["verb"]))
    return found


WEBHOOK_ON = {
    **NON_DEFAULT,
    "operator": {**NON_DEFAULT["operator"], "webhook": {"enabled": True, "certSecret": "mj-webhook-tls"}},
}
WEBHOOK_ONE_REPLICA = {"operator": {"webhook": {"enabled": True}}}


@pytest.mark.parametrize(
    "values",
    [{}, NON_DEFAULT, WEBHOOK_ON, WEBHOOK_ONE_REPLICA],
    ids=["default", "non-default", "webhook", "webhook-self-signed"],
)
def test_rbac_grants_exactly_what_the_operator_source_calls(values):
    needed = needed_by_operator_source() | needed_by_kopf(values)
    rules = granted(manifests(render(values)))
    assert not needed - rules, f"the operator calls these, the chart forbids them: {sorted(needed - rules)}"
    assert not rules - needed, f"granted but never called (least privilege): {sorted(rules - needed)}"


def test_with_namespaces_set_every_write_is_a_role_in_those_namespaces_only():
    """operator.namespaces: pods, ConfigMaps, Services, PodGroups, Events and the jobs themselves are written
    through a Role (bound to the operator's account) in each of those namespaces; the ClusterRole keeps what the
    operator reads across the cluster (nodes, other pods' devices, CRDs, namespaces) and cluster-scoped objects
    (its webhook configuration, SubjectAccessReviews), no namespaced write at all."""
    docs = manifests(render(NON_DEFAULT))
    cluster_wide = rules_of(operator_role(docs))
    cluster_scoped = {"validatingwebhookconfigurations", "mutatingwebhookconfigurations", "subjectaccessreviews"}
    assert {(g, r, v) for g, r, v in cluster_wide if v in WRITES and r not in cluster_scoped} == set()
    assert ("", "pods", "list") in cluster_wide and ("", "nodes", "watch") in cluster_wide
    roles = namespace_roles(docs)
    assert set(roles) == {"team-a", "team-b"}
    writes = {("", "pods", "create"), ("", "configmaps", "patch"), ("meshjob.io", "trainingjobs/status", "patch")}
    writes |= {("", "events", "create"), ("kopf.dev", "kopfpeerings", "patch")}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding")}
    for namespace, role in roles.items():
        assert writes <= rules_of(role)
        binding = bindings[namespace]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mj-operator"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "meshjob-op", "namespace": "meshjob-system"}]
    everywhere = manifests(render({}))  # every namespace: the same rules in the ClusterRole, no Role
    assert not by_kind(everywhere, "Role") and not by_kind(everywhere, "RoleBinding")
    assert writes - {("kopf.dev", "kopfpeerings", "patch")} <= rules_of(operator_role(everywhere))


def test_rbac_rules_name_no_wildcards_and_no_secrets():
    for group, resource, verb in granted(manifests(render(WEBHOOK_ON))):
        assert "*" not in (group, resource, verb)
        assert resource != "secrets"


def test_webhook_values_add_its_service_port_arguments_and_rules():
    docs = manifests(render(WEBHOOK_ON))
    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    assert "mj-webhook" in services
    (container,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert "--webhook-host=mj-webhook.meshjob-system.svc" in container["args"]
    assert "--no-webhook" not in container["args"]
    assert "--no-webhook" not in deployment()["spec"]["template"]["spec"]["containers"][0]["args"]  # on by default
    off = deployment({"operator": {"webhook": {"enabled": False}}})
    assert "--no-webhook" in off["spec"]["template"]["spec"]["containers"][0]["args"]


def test_webhook_patch_permission_names_only_its_own_configuration():
    role = operator_role(manifests(render(WEBHOOK_ON)))
    rules = [r for r in role["rules"] if r["apiGroups"] == ["admissionregistration.k8s.io"]]
    assert {tuple(r["verbs"]): r.get("resourceNames") for r in rules} == {
        ("create",): None,
        ("patch",): ["trainingjobs.meshjob.io"],
    }
    assert all(r["resources"] == ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"] for r in rules)


def test_webhook_with_one_replica_serves_a_self_signed_certificate():
    (container,) = deployment(WEBHOOK_ONE_REPLICA)["spec"]["template"]["spec"]["containers"]
    assert not any(a.startswith(("--webhook-cert", "--webhook-key", "--webhook-ca")) for a in container["args"])
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}  # where the certificate is written


def test_webhook_cert_secret_is_mounted_and_passed_as_cert_key_and_ca():
    spec = deployment(WEBHOOK_ON)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    tls = "/etc/meshjob/webhook-tls"
    assert {f"--webhook-cert={tls}/tls.crt", f"--webhook-key={tls}/tls.key", f"--webhook-ca={tls}/ca.crt"} <= set(
        container["args"]
    )
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == tls]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "mj-webhook-tls" and mount["readOnly"] is True


def test_webhook_with_several_replicas_needs_a_cert_secret():
    values = {"operator": {"replicas": 2, "peering": {"enabled": True}, "webhook": {"enabled": True}}}
    with pytest.raises(HelmError) as err:
        render(values)
    assert "operator.webhook.certSecret is required" in str(err.value)


def test_cert_manager_signs_the_webhook_certificate_for_the_name_the_operator_registers():
    docs = manifests(render({"operator": {"webhook": {"certManager": {"enabled": True}}}}))
    (certificate,) = by_kind(docs, "Certificate")
    (issuer,) = by_kind(docs, "Issuer")  # none named: a self-signed one
    assert certificate["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"] and issuer["spec"] == {
        "selfSigned": {}
    }
    spec = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    (host,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--webhook-host=")]
    assert host in certificate["spec"]["dnsNames"]
    assert "--webhook-ca=/etc/meshjob/webhook-tls/ca.crt" in container["args"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]


def test_a_named_cert_manager_issuer_is_used_and_none_is_created():
    docs = manifests(render(NON_DEFAULT))
    (certificate,) = by_kind(docs, "Certificate")
    assert certificate["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "corp-ca"}
    assert not by_kind(docs, "Issuer")


def test_trainingjobs_join_the_standard_edit_and_view_roles_and_grant_nothing_else():
    """Creating a TrainingJob is creating pods: the verbs go to the aggregated edit role (whose holders may
    create pods) and reading them to view; these roles grant nothing beyond TrainingJobs."""
    roles = {r["metadata"]["name"]: r for r in by_kind(manifests(render(NON_DEFAULT)), "ClusterRole")}
    edit, view = roles["mj-edit"], roles["mj-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "create" in edit["rules"][0]["verbs"] and not {"create", "update", "patch", "delete"} & {
        verb for rule in view["rules"] for verb in rule["verbs"]
    }
    assert {g for r in (edit, view) for rule in r["rules"] for g in rule["apiGroups"]} == {"meshjob.io"}
    off = {
        r["metadata"]["name"]
        for r in by_kind(manifests(render({"rbac": {"aggregateToStandardRoles": False}})), "ClusterRole")
    }
    assert off == {"meshjob-operator"}


# --- trainer pods: no API access, so nothing for them in the chart -----------------------


def test_the_chart_gives_trainer_pods_no_account_role_or_binding():
    """Trainers report nothing through the API (the operator reads their metrics), and their pods carry no
    token: the chart's only Roles and RoleBindings are the operator's (operator.namespaces), one ServiceAccount
    (the operator's)."""
    docs = manifests(render(NON_DEFAULT))
    assert {r["metadata"]["name"] for r in by_kind(docs, "Role") + by_kind(docs, "RoleBinding")} == {"mj-operator"}
    assert {s["name"] for b in by_kind(docs, "RoleBinding") for s in b["subjects"]} == {"meshjob-op"}
    (account,) = by_kind(docs, "ServiceAccount")
    (operator,) = by_kind(docs, "Deployment")
    assert account["metadata"]["name"] == operator["spec"]["template"]["spec"]["serviceAccountName"]


@pytest.mark.slow
def test_a_real_operator_run_as_the_charts_service_account_is_never_forbidden(tmp_path):
    """The operator runs with the chart's command line as the chart's ServiceAccount, bound by the chart's
    ClusterRole, against a real kube-apiserver (RBAC on) through a job's life (unschedulable, scheduled,
    running, a pod fails: gang restart, deleted). The server's audit log lists every call it made: none
    was forbidden, and each is in the set derived from the source (so the derivation misses nothing)."""
    from prometheus_harness import envtest_dir, free_port, operator_scenario

    assets = envtest_dir()
    if assets is None:
        pytest.skip("needs a real kube-apiserver: set KUBEBUILDER_ASSETS (tests/run.sh does)")
    with operator_scenario(assets, tmp_path, free_port()) as scenario:
        pass
    events = scenario.envtest.audited_requests(scenario.username)  # the log outlives the server
    assert events, "the audit log holds no request of the operator"
    forbidden = sorted({(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403})
    assert not forbidden, f"the chart's RBAC forbids calls the operator makes: {forbidden}"
    derived = needed_by_operator_source() | needed_by_kopf({})
    assert used(events) <= derived, f"calls the source derivation missed: {sorted(used(events) - derived)}"
    # the run exercised the core of the rules, not a trivial subset
    assert {
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("meshjob.io", "trainingjobs/status", "patch"),
        ("", "events", "create"),
        ("", "configmaps", "create"),
    } <= used(events)


@pytest.mark.slow
def test_an_operator_serving_some_namespaces_writes_only_there_with_the_charts_roles(tmp_path):
    """operator.namespaces [team-a] (and peering): the chart's ClusterRole (cluster-wide reads) and its Role in
    team-a are all the operator's account holds, and they are enough for a job's life there (placed, pods
    created, deleted) on a real kube-apiserver: the audit log holds no refused call and no write outside
    team-a but the cluster-scoped webhook configuration and access reviews."""
    from prometheus_harness import (
        SCENARIO_JOB,
        Envtest,
        chart_operator,
        envtest_dir,
        free_port,
        ready_nodes,
        wait_until,
    )

    assets = envtest_dir()
    if assets is None:
        pytest.skip("needs a real kube-apiserver: set KUBEBUILDER_ASSETS (tests/run.sh does)")
    values = {"operator": {"namespaces": ["team-a"], "peering": {"enabled": True}, "metricsPort": free_port()}}
    job = {**SCENARIO_JOB, "metadata": {"name": "scenario", "namespace": "team-a"}}

    def pods() -> list[dict[str, Any]]:
        out = envtest.kubectl("get", "pods", "-n", "team-a", "-o", "json").stdout
        return json.loads(out)["items"]

    with Envtest(assets, tmp_path) as envtest, chart_operator(envtest, tmp_path, values) as scenario:
        ready_nodes(envtest, ("host-0", "host-1"))
        envtest.apply([job])
        wait_until(lambda: (scenario.check(), len(pods()) == 2)[1], 60, "the job's two host pods in team-a")
        envtest.kubectl("delete", "trainingjob", "-n", "team-a", "scenario", "--wait=false")

        def deleted() -> bool:
            scenario.check()
            return envtest.kubectl("get", "trainingjob", "-n", "team-a", "scenario", check=False).returncode != 0

        wait_until(deleted, 60, "the job's deletion (its finalizer released)", interval_s=0.5)
    events = scenario.envtest.audited_requests(scenario.username)
    forbidden = sorted({(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403})
    assert not forbidden, f"the chart's RBAC forbids calls the operator makes: {forbidden}"
    writes = {
        (e["verb"], e["objectRef"]["resource"], e["objectRef"].get("namespace", ""))
        for e in events
        if e["verb"] in WRITES
    }
    assert {("create", "pods", "team-a"), ("create", "configmaps", "team-a")} <= writes
    cluster_scoped = {"validatingwebhookconfigurations", "mutatingwebhookconfigurations", "subjectaccessreviews"}
    assert {w for w in writes if w[2] != "team-a" and w[1] not in cluster_scoped} == set()


@pytest.mark.slow
def test_rendered_chart_is_accepted_by_a_real_kube_apiserver(tmp_path):
    """Server-side dry run on kube-apiserver v1.20, the chart's oldest supported version (kubeVersion).
    Prometheus Operator kinds are left out: their CRDs are not installed there."""
    from prometheus_harness import Envtest, envtest_dir

    assets = envtest_dir()
    if assets is None:
        pytest.skip("needs a real kube-apiserver: set KUBEBUILDER_ASSETS (tests/run.sh does)")
    docs = [d for d in manifests(render(WEBHOOK_ON)) if d["kind"] not in MONITORING_SHAPES]
    with Envtest(assets, tmp_path) as envtest:
        for path in sorted((CHART / "crds").glob("*.yaml")):
            envtest.kubectl("apply", "-f", str(path))
        crds = by_kind(docs, "CustomResourceDefinition")
        envtest.apply(
            crds
            + [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                for ns in ("meshjob-system", "team-a", "team-b", "team-c")
            ]
        )
        envtest.wait_established("--all")
        rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
        result = envtest.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(rest), check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("(server dry run)") == len(rest), result.stdout
