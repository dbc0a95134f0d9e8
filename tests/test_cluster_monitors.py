"""The chart's PodMonitor and ServiceMonitor become the scrape configs the Prometheus Operator would write:
Kubernetes discovery against the API server, the monitors' selectors, ports, paths and relabelings; promtool
accepts the result."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import Chart
from prometheus_harness import Prometheus

from meshjob_cluster.discovery import endpoints_groups, pod_groups
from meshjob_cluster.monitors import prometheus_config, selector_rules

CHART = Path(__file__).resolve().parents[1] / "charts" / "meshjob"
MONITORING = {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}


def chart_monitors() -> list[dict[str, Any]]:
    with Chart.load(CHART) as chart:
        rendered = chart.render(MONITORING, name="meshjob", namespace="meshjob-system")
    docs = [d for path, text in rendered.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    return [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")]


def test_the_trainer_pod_monitor_selects_job_pods_in_every_namespace_by_their_metrics_ports():
    config = prometheus_config(chart_monitors(), "/t")
    (pods,) = [c for c in config["scrape_configs"] if c["job_name"].startswith("podMonitor/")]
    assert pods["file_sd_configs"] == [{"files": ["/t/pod.json"], "refresh_interval": "5s"}]
    rules = pods["relabel_configs"]  # any namespace: no namespace rule comes first
    assert rules[0] == {
        "source_labels": ["__meta_kubernetes_pod_labelpresent_meshjob_io_job_name"],
        "regex": "true",
        "action": "keep",
    }
    port_rule = next(r for r in rules if r.get("regex") == "metrics(-[0-9]+)?")
    assert port_rule["action"] == "keep" and port_rule["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
    assert pods["honor_labels"] is True and pods["metrics_path"] == "/metrics"


def test_the_operator_service_monitor_selects_its_service_in_its_namespace_by_port_name():
    config = prometheus_config(chart_monitors(), "/t")
    (service,) = [c for c in config["scrape_configs"] if c["job_name"].startswith("serviceMonitor/")]
    assert service["file_sd_configs"] == [{"files": ["/t/endpoints.json"], "refresh_interval": "5s"}]
    assert service["relabel_configs"][0] == {
        "source_labels": ["__meta_kubernetes_namespace"],
        "regex": "(meshjob\\-system)",
        "action": "keep",
    }
    assert {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": "metrics", "action": "keep"} in service[
        "relabel_configs"
    ]
    assert any(
        r["source_labels"][0].startswith("__meta_kubernetes_service_label_app_kubernetes_io")
        for r in service["relabel_configs"]
        if r.get("action") == "keep" and "source_labels" in r
    )


def test_every_selector_operator_becomes_a_rule_and_an_unknown_one_is_refused():
    rules = selector_rules(
        "pod",
        {
            "matchLabels": {"a.b/c": "x.y"},
            "matchExpressions": [
                {"key": "k", "operator": "In", "values": ["1", "2"]},
                {"key": "k", "operator": "NotIn", "values": ["3"]},
                {"key": "e", "operator": "DoesNotExist"},
            ],
        },
    )
    assert rules == [
        {"source_labels": ["__meta_kubernetes_pod_label_a_b_c"], "regex": r"x\.y", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_label_k"], "regex": "(1|2)", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_label_k"], "regex": "(3)", "action": "drop"},
        {"source_labels": ["__meta_kubernetes_pod_labelpresent_e"], "regex": "true", "action": "drop"},
    ]
    with pytest.raises(ValueError, match="'Near' is invalid"):
        selector_rules("pod", {"matchExpressions": [{"key": "k", "operator": "Near"}]})


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) is missing")
def test_promtool_accepts_the_config(tmp_path):
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(prometheus_config(chart_monitors(), str(tmp_path))))
    done = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _pod(name: str, namespace: str, labels: dict[str, str], ports: dict[str, int]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "uid": f"uid-{name}"},
        "spec": {
            "nodeName": "node-0",
            "containers": [{"name": "main", "ports": [{"name": n, "containerPort": p} for n, p in ports.items()]}],
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "198.51.100.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian package) is missing")
def test_a_real_prometheus_keeps_exactly_the_targets_the_charts_monitors_select(tmp_path):
    """The relabeling is Prometheus' own: a trainer's rank ports are kept, its rendezvous port and a pod of no
    job are not; the operator's Service endpoint is kept by the ServiceMonitor, in its namespace only."""
    with Chart.load(CHART) as chart:
        rendered = chart.render(MONITORING, name="meshjob", namespace="meshjob-system")
    docs = [d for path, text in rendered.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    (service,) = [d for d in docs if d["kind"] == "Service" and "metrics" in str(d["spec"]["ports"])]
    trainer = _pod(
        "demo-0", "ml", {"meshjob.io/job-name": "demo"}, {"metrics": 9400, "metrics-1": 9401, "rendezvous": 29500}
    )
    stray = _pod("web", "ml", {"app": "web"}, {"metrics": 9500})
    operator_pod = _pod("meshjob-op", "meshjob-system", service["spec"]["selector"], {"metrics": 9401})
    other = _pod("op-elsewhere", "team-b", service["spec"]["selector"], {"metrics": 9401})
    endpoints = [
        {
            "metadata": {"name": service["metadata"]["name"], "namespace": ns},
            "subsets": [
                {
                    "addresses": [{"ip": "127.0.0.1", "targetRef": {"kind": "Pod", "name": pod}}],
                    "ports": [{"name": "metrics", "port": 9401}],
                }
            ],
        }
        for ns, pod in (("meshjob-system", "meshjob-op"), ("team-b", "op-elsewhere"))
    ]
    services = [service, {**service, "metadata": {**service["metadata"], "namespace": "team-b"}}]
    pods = [trainer, stray, operator_pod, other]
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "pod.json").write_text(json.dumps(pod_groups(pods)))
    (targets / "endpoints.json").write_text(json.dumps(endpoints_groups(endpoints, services, pods)))
    config = prometheus_config(chart_monitors(), str(targets))

    class Monitored(Prometheus):
        def config(self) -> dict[str, Any]:
            return config

    with Monitored(tmp_path / "prometheus", {}) as prometheus:
        active: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(active) < 3:
            active = prometheus.api("targets")["activeTargets"]
            time.sleep(1)
    kept = sorted((t["labels"]["job"], t["labels"].get("pod", ""), t["labels"]["instance"]) for t in active)
    assert kept == sorted(
        [
            ("meshjob-system/meshjob-trainers", "demo-0", "127.0.0.1:9400"),
            ("meshjob-system/meshjob-trainers", "demo-0", "127.0.0.1:9401"),
            (service["metadata"]["name"], "meshjob-op", "127.0.0.1:9401"),
        ]
    )
    ranks = {t["labels"]["instance"]: t["labels"] for t in active if t["labels"].get("pod") == "demo-0"}
    assert ranks["127.0.0.1:9401"]["metrics_port"] == "metrics-1" and ranks["127.0.0.1:9400"]["namespace"] == "ml"
