"""The operator end to end against kmock's in-memory API server over HTTP (kopf in this event loop)."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

import operator_harness as h

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
async def cluster():
    async with h.kmock_cluster() as c:
        yield c


@pytest.fixture
async def operator(cluster):
    async with h.running_operator(cluster) as op:
        yield op


async def test_create_makes_pinned_pods_with_env_service_configmap_and_owner(cluster, operator):
    await h.scenario_create_children(cluster, "create")


async def test_running_pods_report_progress_then_success_cleans_up_and_ttl_deletes(cluster, operator):
    await h.scenario_runs_reports_progress_and_succeeds(cluster, "success")


async def test_pod_failure_restarts_the_gang_then_fails_after_backoff_limit(cluster, operator):
    from meshjob.operator.handlers import STATE

    await h.scenario_gang_restart_then_failed(cluster, "restart", metrics=STATE.metrics)


async def test_suspend_deletes_pods_and_resume_recreates_them(cluster, operator):
    await h.scenario_suspend_and_resume(cluster, "suspend")


async def test_invalid_spec_sets_invalid_spec_condition_and_warning_event(cluster, operator):
    await h.scenario_invalid_spec(cluster, "invalid")


async def test_unschedulable_until_a_node_appears(cluster, operator):
    await h.scenario_unschedulable_until_a_node_appears(cluster, "unsched")


async def test_deletion_leaves_only_owned_children(cluster, operator):
    await h.scenario_deletion_removes_children(cluster, "delete")


async def test_active_deadline_fails_the_job(cluster, operator):
    await h.scenario_activeDeadline_fails_the_job(cluster, "deadline")


async def test_operator_killed_mid_creation_converges_without_duplicates(cluster):
    await h.scenario_operator_killed_mid_creation(cluster, "killed")


async def test_restart_is_counted_once_across_operator_restart(cluster):
    await h.scenario_restart_counted_once_across_operator_restart(cluster, "once")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_kubectl_apply_examples_against_kmock(cluster):
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/ holds the spec helper's manifests"
    out = await asyncio.to_thread(subprocess.run, ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply",
                                                   "--validate=false", "-f", str(EXAMPLES)],
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for f in files:
        import yaml
        name = yaml.safe_load(f.read_text())["metadata"]["name"]
        assert f"trainingjob.meshjob.io/{name} created" in out.stdout
        assert await cluster.job(name) is not None
