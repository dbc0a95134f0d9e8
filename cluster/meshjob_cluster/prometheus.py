"""The local cluster's Prometheus, run the way the Prometheus Operator runs one: its scrape configs are the
cluster's PodMonitor and ServiceMonitor objects (meshjob_cluster.monitors), its rules the PrometheusRule
objects, its targets what Kubernetes discovery would find (meshjob_cluster.discovery), all kept current.

meshjob_cluster.daemon starts Debian's `prometheus` with these files and refreshes them every couple of
seconds, reloading it when monitors or rules change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from meshjob_cluster.discovery import endpoints_groups, pod_groups
from meshjob_cluster.dns import write_in_place
from meshjob_cluster.monitors import prometheus_config

GROUP, VERSION = "monitoring.coreos.com", "v1"
MONITOR_CRDS = (
    ("PodMonitor", "podmonitors"),
    ("ServiceMonitor", "servicemonitors"),
    ("PrometheusRule", "prometheusrules"),
)


def monitor_crds() -> list[dict[str, Any]]:
    """The Prometheus Operator's monitoring CRDs, schemaless (the chart's monitors need them to apply)."""
    return [
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{GROUP}"},
            "spec": {
                "group": GROUP,
                "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                "versions": [
                    {
                        "name": VERSION,
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        }
        for kind, plural in MONITOR_CRDS
    ]


def _items(api: kubernetes.client.ApiClient, kind: str) -> list[dict[str, Any]]:
    """Every object of `kind` in the cluster, as the API's JSON."""
    core = kubernetes.client.CoreV1Api(api)
    listing = {
        "pods": core.list_pod_for_all_namespaces,
        "endpoints": core.list_endpoints_for_all_namespaces,
        "services": core.list_service_for_all_namespaces,
    }.get(kind)
    if listing is not None:
        response: Any = listing(_preload_content=False)  # the raw response: its JSON, not the models
        items: list[dict[str, Any]] = json.loads(response.data)["items"]
        return items
    custom: Any = kubernetes.client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, kind)
    found: list[dict[str, Any]] = custom["items"]
    return found


def refresh(api: kubernetes.client.ApiClient, folder: Path) -> bool:
    """Write the targets, the config and the rules; whether the config or the rules changed (reload)."""
    pods, endpoints, services = _items(api, "pods"), _items(api, "endpoints"), _items(api, "services")
    monitors: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = []
    for kind, plural in MONITOR_CRDS:
        for item in _items(api, plural):
            item["kind"] = kind
            (rules if kind == "PrometheusRule" else monitors).append(item)
    targets = folder / "targets"
    targets.mkdir(exist_ok=True)
    write_in_place(targets / "pod.json", json.dumps(pod_groups(pods), sort_keys=True))
    write_in_place(targets / "endpoints.json", json.dumps(endpoints_groups(endpoints, services, pods), sort_keys=True))
    groups = [g for rule in sorted(rules, key=lambda r: r["metadata"]["name"]) for g in rule["spec"].get("groups", [])]
    changed = write_in_place(folder / "rules.yml", yaml.safe_dump({"groups": groups}))
    config = prometheus_config(monitors, str(targets))
    config["rule_files"] = [str(folder / "rules.yml")]
    return write_in_place(folder / "prometheus.yml", yaml.safe_dump(config, sort_keys=True)) or changed
