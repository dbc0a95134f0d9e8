"""The Grafana dashboard and the alerting rules against real Prometheus tooling.

* promtool checks and unit-tests the alerting rules (rules/meshjob-alerts.test.yaml).
* A real Prometheus scrapes a real `meshjob run --metrics-port` and a real `meshjob operator`
  (started with the chart's own command line, against a real kube-apiserver with a TrainingJob
  whose pod fails once), and every dashboard query, evaluated through Prometheus' HTTP API,
  returns data.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_harness import (
    BLOCKED_NAMESPACE,
    DASHBOARD,
    JOB_NAME,
    ROOT,
    PanelQuery,
    Prometheus,
    dashboard_queries,
    envtest_dir,
    free_port,
    instantiate,
    operator_scenario,
)

RULES = ROOT / "charts" / "meshjob" / "rules"
# Grafana's $__rate_interval; here a window that covers a whole short run.
VARIABLES = {"namespace": ".*", "trainingjob": ".*", "__rate_interval": "2m", "datasource": "prometheus"}
REQUIRED_PANELS = {
    "Resharding bandwidth per link and strategy",
    "Resharding time / lower bound",
    "Step time",
    "Throughput",
    "Bubble fraction per stage",
    "Communication/compute overlap per stage",
    "Loss",
    "Gang restarts",
    "Jobs by phase",
}


# --- alerting rules -------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check():
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES / "meshjob-alerts.yaml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_alert_rules_pass_promtool_unit_tests():
    result = subprocess.run(
        ["promtool", "test", "rules", str(RULES / "meshjob-alerts.test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_stuck_blocked_and_restarting_jobs_and_slow_resharding():
    groups = yaml.safe_load((RULES / "meshjob-alerts.yaml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    assert {"MeshjobJobStuck", "MeshjobJobBlocked", "MeshjobRestartStorm", "MeshjobReshardingBelowNicRate"} <= alerts
    tested = yaml.safe_load((RULES / "meshjob-alerts.test.yaml").read_text())["tests"]
    assert alerts == {t["alertname"] for test in tested for t in test["alert_rule_test"]}


# --- dashboard structure --------------------------------------------------------------------


def test_dashboard_has_the_required_panels_each_with_a_query():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert REQUIRED_PANELS <= titles
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_queries_use_only_metrics_that_exist():
    """Every meshjob_* name in a query is exported by TrainerMetrics or OperatorMetrics."""
    import re

    from meshjob_operator.metrics import OperatorMetrics
    from meshjob_trainer.metrics import TrainerMetrics

    exported = set()
    for registry in (TrainerMetrics("j", 0, "h", 0).registry, OperatorMetrics().registry):
        for family in registry.collect():
            exported |= {
                family.name,
                family.name + "_total",
                family.name + "_bucket",
                family.name + "_sum",
                family.name + "_count",
                family.name + "_info",
            }
    for q in dashboard_queries():
        for name in re.findall(r"\bmeshjob_\w+", q.expr):
            assert name in exported, f"{q.panel}: {name} is exported by nobody"


# --- every query against a real Prometheus ------------------------------------------------

JOB_YAML = """\
apiVersion: meshjob.io/v1alpha1
kind: TrainingJob
metadata: {name: dashboard-demo}
spec:
  model: {kind: gpt, layers: 2, hidden: 32, heads: 2, vocab: 64, seqLen: 16}
  training: {steps: 120, globalBatch: 8, microbatches: 2, learningRate: 1.0e-3, seed: 0,
             checkpoint: {every: 30, path: CKPT}}
  topology: {devicesPerHost: 2}
  stages:
    - {layers: [0, 1], mesh: [1, 2], tensorParallelDim: 1}
    - {layers: [1, 2], mesh: [2, 1], dataParallelDim: 0}
  resharding: {strategy: broadcast, chunks: 2, balancer: greedy, budgetSeconds: 0.5}
  schedule: {kind: eager-1f1b, weightGradDelay: 0}
  metrics: {port: 9400}
"""


@dataclass
class Scraped:
    prometheus: Prometheus
    trainer_at: float  # a time at which the trainer exporter was up (its last sample)
    operator_at: float | None  # same for the operator; None without a kube-apiserver


def last_sample_time(prom: Prometheus, selector: str) -> float:
    """Timestamp of the newest sample of `selector` (a raw range selector: no step alignment)."""
    data = prom.api("query", query=f"{selector}[10m]")
    stamps = [float(t) for series in data["result"] for t, _ in series["values"]]
    assert stamps, f"no samples of {selector}"
    return max(stamps)


def run_trainer(tmp_path: Path, port: int) -> subprocess.CompletedProcess:
    ckpt = tmp_path / "ckpt"
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.replace("CKPT", str(ckpt)))
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "run", str(job), "--metrics-port", str(port), "--quiet"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Iterator[Scraped]:
    tmp = tmp_path_factory.mktemp("dashboard")
    trainer_port, operator_port = free_port(), free_port()
    prom = Prometheus(
        tmp / "prometheus", {"trainer": [f"127.0.0.1:{trainer_port}"], "operator": [f"127.0.0.1:{operator_port}"]}
    )
    assets = envtest_dir()
    with prom:
        operator_at = None
        if assets is not None:
            with operator_scenario(assets, tmp / "envtest", operator_port, blocked=True) as scenario:
                prom.wait_for("meshjob_operator_restarts_total > 0", timeout_s=30)
                # a counter's first sample is no increase: wait for the job's next refused retry to be scraped
                prom.wait_for("increase(meshjob_operator_api_errors_total[10m]) > 0", timeout_s=90)
                operator_at = last_sample_time(prom, "meshjob_operator_api_errors_total")
                scenario.check()
        result = run_trainer(tmp, trainer_port)
        assert result.returncode == 0, f"meshjob run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        trainer_at = last_sample_time(prom, 'meshjob_step{trainingjob="dashboard-demo"}')
        yield Scraped(prom, trainer_at, operator_at)


def _evaluate(scraped: Scraped, query: PanelQuery) -> list[dict[str, Any]]:
    expr = instantiate(query.expr, VARIABLES)
    if "meshjob_operator_" in expr:
        if scraped.operator_at is None:
            pytest.skip("no real kube-apiserver (KUBEBUILDER_ASSETS): the operator was not run")
        return scraped.prometheus.query(expr, at=scraped.operator_at)
    return scraped.prometheus.query(expr, at=scraped.trainer_at)


@pytest.mark.slow
@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: f"{q.panel}-{q.ref}")
def test_dashboard_query_returns_data(scraped, query):
    result = _evaluate(scraped, query)
    assert result, f"panel {query.panel!r} query {query.ref}: no data for {instantiate(query.expr, VARIABLES)}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"panel {query.panel!r}: only NaN/Inf: {result}"


@pytest.mark.slow
def test_nic_bandwidth_is_labelled_with_the_plans_host_names(scraped, tmp_path):
    """Every host with a rank that receives across hosts shows up under its own name."""
    from meshjob.plan.build import build_plan
    from meshjob.spec.manifest import load_job

    job_path = tmp_path / "job.yaml"
    job_path.write_text(JOB_YAML.replace("CKPT", str(tmp_path / "ckpt")))
    plan = build_plan(load_job(str(job_path)))
    placement = plan.placement
    receivers = {s.dst for b in plan.boundaries for s in b.steps if s.scope == "cross_host"}
    expected = {placement.hosts[placement.host_of(r)].name for r in receivers}
    result = scraped.prometheus.query(
        'meshjob_nic_bandwidth_bytes_per_second{trainingjob="dashboard-demo"}', at=scraped.trainer_at
    )
    assert {r["metric"]["host"] for r in result} == expected
    assert all(float(r["value"][1]) > 0 for r in result)


@pytest.mark.slow
def test_namespace_and_trainingjob_variables_list_the_running_job(scraped):
    """The dashboard's variables (label_values of meshjob_info) offer the job and its namespace, so two
    same-named jobs of two namespaces stay apart."""
    window = {"start": scraped.trainer_at - 600, "end": scraped.trainer_at}
    assert "default" in scraped.prometheus.api("label/namespace/values", **{"match[]": "meshjob_info"}, **window)
    jobs = scraped.prometheus.api(
        "label/trainingjob/values", **{"match[]": 'meshjob_info{namespace=~"default"}'}, **window
    )
    assert "dashboard-demo" in jobs


def _per_job(scraped: Scraped, panel: str, label: str) -> dict[tuple[str, str, str], float]:
    """An operator panel's one query at the scenario's time: (namespace, trainingjob, `label`) -> value."""
    if scraped.operator_at is None:
        pytest.skip("no real kube-apiserver (KUBEBUILDER_ASSETS): the operator was not run")
    (query,) = [q for q in dashboard_queries() if q.panel == panel]
    return {
        (r["metric"]["namespace"], r["metric"]["trainingjob"], r["metric"][label]): float(r["value"][1])
        for r in _evaluate(scraped, query)
    }


@pytest.mark.slow
def test_a_blocked_job_shows_on_the_refused_calls_panel(scraped):
    """The scenario's job in a namespace that allows no pods: its refusals, named by namespace, job and code."""
    per_job = _per_job(scraped, "Refused API calls", "code")
    assert per_job.get((BLOCKED_NAMESPACE, JOB_NAME, "403"), 0) > 0, per_job
    assert ("default", JOB_NAME, "403") not in per_job  # the job that got its pods was refused nothing


@pytest.mark.slow
def test_operator_restart_shows_on_the_restarts_panel(scraped):
    per_job = _per_job(scraped, "Gang restarts", "reason")
    assert per_job[("default", JOB_NAME, "failure")] >= 1, per_job  # the scenario's pod failure, named by its job
