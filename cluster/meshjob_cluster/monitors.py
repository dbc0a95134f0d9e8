"""PodMonitor and ServiceMonitor objects as Prometheus scrape configs, the way the Prometheus Operator writes them:
the targets of Kubernetes service discovery (role pod or endpoints), the monitor's label selector and
namespaces as `keep` rules, its port, path, interval and relabelings, and the target labels the operator adds
(namespace, pod, container, service, endpoint).

The discovered targets come from files (meshjob_cluster.discovery writes them, with the labels Prometheus'
`kubernetes_sd_configs` gives: Debian's Prometheus is built without it). The local cluster's Prometheus
scrapes with these configs, so the chart's monitors select the trainers and the operator there, as on a
cluster with kube-prometheus-stack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

Config = dict[str, Any]


def _label_key(kind: str, key: str) -> str:
    """The discovery meta label of a Kubernetes label `key` (Prometheus: any other character becomes `_`)."""
    return f"__meta_kubernetes_{kind}_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _present_key(kind: str, key: str) -> str:
    return f"__meta_kubernetes_{kind}_labelpresent_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def selector_rules(kind: str, selector: Mapping[str, Any]) -> list[Config]:
    """keep/drop rules equivalent to a label selector over pods' or services' labels."""
    rules: list[Config] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        rules.append({"source_labels": [_label_key(kind, key)], "regex": re.escape(str(value)), "action": "keep"})
    for expression in selector.get("matchExpressions") or []:
        key, op = expression["key"], expression["operator"]
        values = "|".join(re.escape(str(v)) for v in expression.get("values") or [])
        if op == "Exists":
            rules.append({"source_labels": [_present_key(kind, key)], "regex": "true", "action": "keep"})
        elif op == "DoesNotExist":
            rules.append({"source_labels": [_present_key(kind, key)], "regex": "true", "action": "drop"})
        elif op == "In":
            rules.append({"source_labels": [_label_key(kind, key)], "regex": f"({values})", "action": "keep"})
        elif op == "NotIn":
            rules.append({"source_labels": [_label_key(kind, key)], "regex": f"({values})", "action": "drop"})
        else:
            raise ValueError(f"selector operator {op!r} is invalid: In, NotIn, Exists or DoesNotExist")
    return rules


_RELABEL_FIELDS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}


def relabelings(items: Iterable[Mapping[str, Any]]) -> list[Config]:
    """A monitor's relabelings (camelCase, as the CRD spells them) in Prometheus' spelling."""
    return [{_RELABEL_FIELDS[k]: v for k, v in item.items() if k in _RELABEL_FIELDS} for item in items]


def _discovery(role: str, targets: str) -> list[Config]:
    """The role's discovered targets (meshjob_cluster.discovery's file for it)."""
    return [{"files": [f"{targets}/{role}.json"], "refresh_interval": "5s"}]


def namespace_rules(monitor: Mapping[str, Any]) -> list[Config]:
    """The monitor's namespaceSelector (discovery's `namespaces` under kubernetes_sd_configs) as a keep rule."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return []
    names = selector.get("matchNames") or [monitor["metadata"].get("namespace", "default")]
    regex = "|".join(re.escape(n) for n in names)
    return [{"source_labels": ["__meta_kubernetes_namespace"], "regex": f"({regex})", "action": "keep"}]


def _endpoint_settings(endpoint: Mapping[str, Any]) -> Config:
    out: Config = {"metrics_path": endpoint.get("path", "/metrics"), "scheme": endpoint.get("scheme", "http")}
    for key, name in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
        if key in endpoint:
            out[name] = endpoint[key]
    if endpoint.get("honorLabels"):
        out["honor_labels"] = True
    return out


def pod_monitor(monitor: Mapping[str, Any], targets: str) -> list[Config]:
    """One scrape config per podMetricsEndpoint of a PodMonitor."""
    meta = monitor["metadata"]
    out = []
    for i, endpoint in enumerate(monitor["spec"].get("podMetricsEndpoints") or []):
        rules = namespace_rules(monitor) + selector_rules("pod", monitor["spec"].get("selector") or {})
        rules.append(
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"}
        )
        if "port" in endpoint:
            rules.append(
                {
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": re.escape(endpoint["port"]),
                    "action": "keep",
                }
            )
        rules += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"target_label": "job", "replacement": f"{meta.get('namespace', 'default')}/{meta['name']}"},
        ]
        rules += relabelings(endpoint.get("relabelings") or [])
        job = f"podMonitor/{meta.get('namespace', 'default')}/{meta['name']}/{i}"
        out.append(
            {
                "job_name": job,
                "file_sd_configs": _discovery("pod", targets),
                **_endpoint_settings(endpoint),
                "relabel_configs": rules,
            }
        )
    return out


def service_monitor(monitor: Mapping[str, Any], targets: str) -> list[Config]:
    """One scrape config per endpoint of a ServiceMonitor (role endpoints: the Service's ready pods)."""
    meta = monitor["metadata"]
    out = []
    for i, endpoint in enumerate(monitor["spec"].get("endpoints") or []):
        rules = namespace_rules(monitor) + selector_rules("service", monitor["spec"].get("selector") or {})
        if "port" in endpoint:
            rules.append(
                {
                    "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                    "regex": re.escape(endpoint["port"]),
                    "action": "keep",
                }
            )
        rules += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
            {"target_label": "endpoint", "replacement": str(endpoint.get("port", ""))},
        ]
        rules += relabelings(endpoint.get("relabelings") or [])
        job = f"serviceMonitor/{meta.get('namespace', 'default')}/{meta['name']}/{i}"
        out.append(
            {
                "job_name": job,
                "file_sd_configs": _discovery("endpoints", targets),
                **_endpoint_settings(endpoint),
                "relabel_configs": rules,
            }
        )
    return out


def prometheus_config(monitors: Iterable[Mapping[str, Any]], targets: str, interval: str = "5s") -> Config:
    """The whole config: every PodMonitor and ServiceMonitor given, in name order; discovered targets in the
    folder `targets` (pod.json, endpoints.json)."""
    scrape: list[Config] = []
    for monitor in sorted(
        monitors, key=lambda m: (m["kind"], m["metadata"].get("namespace", ""), m["metadata"]["name"])
    ):
        if monitor["kind"] == "PodMonitor":
            scrape += pod_monitor(monitor, targets)
        elif monitor["kind"] == "ServiceMonitor":
            scrape += service_monitor(monitor, targets)
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": scrape}
