"""Writes meshjob.json, the Grafana dashboard, from the panel list below.

Run `python charts/meshjob/dashboards/generate.py` after editing; a test fails when the committed
JSON differs from what this prints. Queries use Grafana variables $namespace and $trainingjob (the labels
every trainer metric and the operator's per-job metrics carry) and $__rate_interval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

JOB = 'namespace=~"$namespace", trainingjob=~"$trainingjob"'
BY_JOB = "namespace, trainingjob"
LEGEND = "{{namespace}}/{{trainingjob}}"
RATE = "$__rate_interval"


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    extra: dict = field(default_factory=dict)


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Cross-mesh resharding",
        [
            Panel(
                "Resharding bandwidth per link and strategy",
                "Bytes per second received by cross-mesh resharding, per stage boundary (link), strategy and "
                "scope (intra_host: same host; cross_host: through the NICs).",
                [
                    (
                        f"sum by (boundary, strategy, scope) (rate(meshjob_resharding_bytes_total{{{JOB}}}[{RATE}]))",
                        "{{boundary}} {{strategy}} {{scope}}",
                    )
                ],
                unit="Bps",
            ),
            Panel(
                "Achieved NIC bandwidth per host",
                "Bytes per second through each host's NIC while it reshards.",
                [(f"max by (host) (meshjob_nic_bandwidth_bytes_per_second{{{JOB}}})", "{{host}}")],
                unit="Bps",
            ),
            Panel(
                "Resharding time / lower bound",
                "Last resharding time of each boundary over its lower bound (bytes through the busiest NIC / "
                "NIC rate). 1 is optimal; the alert fires above 4.",
                [(f"max by (boundary) (meshjob_resharding_lower_bound_ratio{{{JOB}}})", "{{boundary}}")],
                extra={
                    "fieldConfig": {
                        "defaults": {
                            "unit": "short",
                            "min": 0,
                            "thresholds": {
                                "mode": "absolute",
                                "steps": [
                                    {"color": "green", "value": None},
                                    {"color": "orange", "value": 2},
                                    {"color": "red", "value": 4},
                                ],
                            },
                        }
                    }
                },
            ),
            Panel(
                "Resharding time per boundary",
                "Mean and 95th percentile wall time of one resharding of a boundary.",
                [
                    (
                        f"sum by (boundary, strategy) (rate(meshjob_resharding_seconds_sum{{{JOB}}}[{RATE}])) / "
                        f"sum by (boundary, strategy) (rate(meshjob_resharding_seconds_count{{{JOB}}}[{RATE}]))",
                        "mean {{boundary}} {{strategy}}",
                    ),
                    (
                        f"histogram_quantile(0.95, sum by (le, boundary) "
                        f"(rate(meshjob_resharding_seconds_bucket{{{JOB}}}[{RATE}])))",
                        "p95 {{boundary}}",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Unit tasks per balancer",
                "Resharding unit tasks executed per second, by the balancer that chose their senders.",
                [(f"sum by (balancer) (rate(meshjob_unit_tasks_total{{{JOB}}}[{RATE}]))", "{{balancer}}")],
                unit="ops",
            ),
        ],
    ),
    (
        "Training",
        [
            Panel(
                "Step time",
                "Median and 95th percentile wall time of a training step.",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate(meshjob_step_seconds_bucket{{{JOB}}}[{RATE}])))",
                        "p50",
                    ),
                    (
                        f"histogram_quantile(0.95, sum by (le) (rate(meshjob_step_seconds_bucket{{{JOB}}}[{RATE}])))",
                        "p95",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Throughput",
                "Tokens trained per second (every rank counts the global batch: max over ranks).",
                [(f"max by ({BY_JOB}) (rate(meshjob_tokens_total{{{JOB}}}[{RATE}]))", LEGEND)],
                unit="short",
            ),
            Panel(
                "Loss",
                "Training loss of the last step (from the stage that computes it).",
                [(f"min by ({BY_JOB}) (meshjob_loss{{{JOB}}})", LEGEND)],
            ),
            Panel(
                "Step and last checkpoint",
                "Last completed step and the step of the last checkpoint written.",
                [
                    (f"max by ({BY_JOB}) (meshjob_step{{{JOB}}})", f"step {LEGEND}"),
                    (f"max by ({BY_JOB}) (meshjob_last_checkpoint_step{{{JOB}}})", f"checkpoint {LEGEND}"),
                ],
            ),
            Panel(
                "Checkpoint time",
                "Mean wall time of writing a checkpoint.",
                [
                    (
                        f"sum by ({BY_JOB}) (rate(meshjob_checkpoint_seconds_sum{{{JOB}}}[{RATE}])) / "
                        f"sum by ({BY_JOB}) (rate(meshjob_checkpoint_seconds_count{{{JOB}}}[{RATE}]))",
                        LEGEND,
                    )
                ],
                unit="s",
            ),
            Panel(
                "Job configuration",
                "Strategy, schedule, balancer and mesh shapes of each job.",
                [(f"max by ({BY_JOB}, strategy, schedule, balancer, meshes) (meshjob_info{{{JOB}}})", "")],
                kind="table",
            ),
        ],
    ),
    (
        "Pipeline",
        [
            Panel(
                "Bubble fraction per stage",
                "Idle fraction of each stage's step time.",
                [(f"max by (stage) (meshjob_pipeline_bubble_fraction{{{JOB}}})", "stage {{stage}}")],
                unit="percentunit",
            ),
            Panel(
                "Communication/compute overlap per stage",
                "Fraction of each stage's communication time hidden behind compute.",
                [(f"max by (stage) (meshjob_pipeline_overlap_fraction{{{JOB}}})", "stage {{stage}}")],
                unit="percentunit",
            ),
        ],
    ),
    (
        "Operator",
        [
            Panel(
                "Jobs by phase",
                "TrainingJobs per phase, as the operator sees them.",
                [("sum by (phase) (meshjob_operator_jobs)", "{{phase}}")],
            ),
            Panel(
                "Gang restarts",
                "Gang restarts of each TrainingJob in the last hour, by reason: failure (counts "
                "toward runPolicy.backoffLimit) or disruption (an eviction or preemption).",
                [
                    (
                        f"sum by ({BY_JOB}, reason) (increase(meshjob_operator_restarts_total{{{JOB}}}[1h]))",
                        f"{LEGEND} {{{{reason}}}}",
                    )
                ],
            ),
            Panel(
                "Refused API calls",
                "API calls for each TrainingJob that the API server refused in the last hour, "
                "by HTTP code, for a reason that does not pass by itself (quota, admission policy, RBAC, an invalid "
                "child): the job is Blocked, its condition quoting the API server, until a retry goes through.",
                [
                    (
                        f"sum by ({BY_JOB}, code) (increase(meshjob_operator_api_errors_total{{{JOB}}}[1h]))",
                        f"{LEGEND} HTTP {{{{code}}}}",
                    )
                ],
            ),
            Panel(
                "Reconcile duration",
                "95th percentile duration of the operator's handlers.",
                [
                    (
                        f"histogram_quantile(0.95, sum by (le) "
                        f"(rate(meshjob_operator_reconcile_duration_seconds_bucket[{RATE}])))",
                        "p95",
                    )
                ],
                unit="s",
            ),
            Panel(
                "Pod creation latency",
                "95th percentile time from a job's creation to its pods.",
                [
                    (
                        f"histogram_quantile(0.95, sum by (le) "
                        f"(rate(meshjob_operator_pod_creation_latency_seconds_bucket[{RATE}])))",
                        "p95",
                    )
                ],
                unit="s",
            ),
        ],
    ),
]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    body = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                **({"format": "table", "instant": True} if panel.kind == "table" else {}),
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }
    body.update(panel.extra)
    return body


def variable(name: str, label: str, query: str) -> dict:
    """A query variable over label values (All: any value)."""
    return {
        "name": name,
        "type": "query",
        "label": label,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "refresh": 2,
        "current": {},
        "hide": 0,
    }


def dashboard() -> dict:
    panels: list[dict] = []
    panel_id, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return {
        "uid": "meshjob",
        "title": "meshjob",
        "description": "Cross-mesh resharding, pipeline schedule and training of meshjob TrainingJobs; the operator.",
        "tags": ["meshjob", "training"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                    "current": {},
                    "hide": 0,
                },
                variable("namespace", "Namespace", "label_values(meshjob_info, namespace)"),
                variable(
                    "trainingjob", "TrainingJob", 'label_values(meshjob_info{namespace=~"$namespace"}, trainingjob)'
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    Path(__file__).with_name("meshjob.json").write_text(render())
