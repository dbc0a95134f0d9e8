"""Prometheus' Kubernetes service discovery, done here: the local cluster's pods and endpoints as target groups
with the same `__meta_kubernetes_*` labels Prometheus' own `kubernetes_sd_configs` gives them.

Debian's Prometheus is built without Kubernetes discovery, so the local cluster writes these groups to files
(`file_sd_configs`); the scrape configs made from the chart's monitors (meshjob_cluster.monitors) then select
targets by relabeling exactly as they would under kube-prometheus-stack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

Group = dict[str, Any]  # {"targets": [...], "labels": {...}}


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _object_labels(kind: str, meta: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for source, what in (("labels", "label"), ("annotations", "annotation")):
        for key, value in (meta.get(source) or {}).items():
            out[f"__meta_kubernetes_{kind}_{what}_{_name(key)}"] = str(value)
            out[f"__meta_kubernetes_{kind}_{what}present_{_name(key)}"] = "true"
    return out


def _ready(pod: Mapping[str, Any]) -> str:
    conditions = pod.get("status", {}).get("conditions") or []
    return "true" if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions) else "false"


def pod_meta(pod: Mapping[str, Any]) -> dict[str, str]:
    """The labels every target of a pod carries (role pod; also the pod part of role endpoints)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    labels = {
        "__meta_kubernetes_namespace": meta.get("namespace", "default"),
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_ready": _ready(pod),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
        **_object_labels("pod", meta),
    }
    owners = meta.get("ownerReferences") or []
    controller = next((o for o in owners if o.get("controller")), None)
    if controller is not None:
        labels["__meta_kubernetes_pod_controller_kind"] = controller["kind"]
        labels["__meta_kubernetes_pod_controller_name"] = controller["name"]
    return labels


def pod_groups(pods: Iterable[Mapping[str, Any]]) -> list[Group]:
    """Role pod: a target per declared container port (a port-less one per container without ports)."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        base = pod_meta(pod)
        for container in pod.get("spec", {}).get("containers", []):
            ports = container.get("ports") or [None]
            for port in ports:
                labels = {**base, "__meta_kubernetes_pod_container_name": container["name"]}
                target = ip
                if port is not None:
                    target = f"{ip}:{port['containerPort']}"
                    labels["__meta_kubernetes_pod_container_port_name"] = port.get("name", "")
                    labels["__meta_kubernetes_pod_container_port_number"] = str(port["containerPort"])
                    labels["__meta_kubernetes_pod_container_port_protocol"] = port.get("protocol", "TCP")
                groups.append({"targets": [target], "labels": labels})
    return groups


def endpoints_groups(
    endpoints: Iterable[Mapping[str, Any]], services: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[Group]:
    """Role endpoints: a target per address and port of every Endpoints object, with its Service's labels and,
    where the address is a pod, the pod's."""
    by_service = {(s["metadata"].get("namespace", "default"), s["metadata"]["name"]): s for s in services}
    by_pod = {(p["metadata"].get("namespace", "default"), p["metadata"]["name"]): p for p in pods}
    groups = []
    for ep in endpoints:
        meta = ep["metadata"]
        namespace = meta.get("namespace", "default")
        service = by_service.get((namespace, meta["name"]))
        base = {
            "__meta_kubernetes_namespace": namespace,
            "__meta_kubernetes_endpoints_name": meta["name"],
            **_object_labels("endpoints", meta),
        }
        if service is not None:
            base["__meta_kubernetes_service_name"] = service["metadata"]["name"]
            base.update(_object_labels("service", service["metadata"]))
        for subset in ep.get("subsets") or []:
            addresses = [(a, "true") for a in subset.get("addresses") or []]
            addresses += [(a, "false") for a in subset.get("notReadyAddresses") or []]
            for address, ready in addresses:
                for port in subset.get("ports") or []:
                    labels = {
                        **base,
                        "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                        "__meta_kubernetes_endpoint_port_protocol": port.get("protocol", "TCP"),
                        "__meta_kubernetes_endpoint_ready": ready,
                    }
                    ref = address.get("targetRef") or {}
                    if ref.get("kind") == "Pod":
                        labels["__meta_kubernetes_endpoint_address_target_kind"] = "Pod"
                        labels["__meta_kubernetes_endpoint_address_target_name"] = ref.get("name", "")
                        pod = by_pod.get((namespace, ref.get("name", "")))
                        if pod is not None:
                            labels.update(pod_meta(pod))
                    groups.append({"targets": [f"{address['ip']}:{port['port']}"], "labels": labels})
    return groups
