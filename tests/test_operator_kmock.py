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


async def test_a_deleted_pod_restarts_the_gang(cluster, operator):
    await h.scenario_deleted_pod_restarts_the_gang(cluster, "evicted")


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


def _failing(cluster, method: str, plural: str, status: int, times: int | None) -> list[str]:
    """Make the first `times` (None: every) `method` requests on `plural` fail with `status`; returns a log."""
    import kmock

    seen: list[str] = []

    def matches(req) -> bool:
        if req.method.upper() != method or f"/{plural}" not in str(req.url):
            return False
        key = f"{id(req)}"
        if key not in seen:
            seen.append(key)
        return times is None or seen.index(key) < times

    cluster.emulator[matches] << kmock.KubernetesError(status=status, reason="Injected", message=f"injected {status}")
    return seen


async def test_transient_api_errors_are_retried_until_the_job_converges(cluster, operator):
    attempts = _failing(cluster, "POST", "pods", 503, times=3)
    await h.add_nodes(cluster, "flaky", 2)
    await cluster.create_job(h.scenario_job("flaky"))
    pods = await h.wait_pods(cluster, "flaky", 2)
    status = await h.wait_status(cluster, "flaky", lambda s: s.get("phase") == "Created", "Created after retries")
    # both creations answered 503 (kmock keeps the object, as a server that timed out may): only a
    # retried reconcile gets past them to write the status
    assert len(attempts) == 2 and status["hosts"] == 2 and len(pods) == 2


async def test_a_permanent_api_error_is_not_retried(cluster, operator):
    attempts = _failing(cluster, "POST", "configmaps", 403, times=None)
    await h.add_nodes(cluster, "denied", 2)
    await cluster.create_job(h.scenario_job("denied"))

    async def warned():
        return [e for e in await cluster.events("denied") if e.get("reason") == "ApiError"] or None
    events = await h.eventually(warned, what="a Warning Event ApiError")
    assert "HTTP 403" in events[0]["message"]
    tried = len(attempts)
    await asyncio.sleep(2.0)  # a retry storm would show here
    assert len(attempts) == tried == 1
    assert await cluster.pods("denied", "denied") == []


async def test_gang_scheduling_creates_a_podgroup_and_sets_the_scheduler(cluster, operator):
    await h.add_nodes(cluster, "gang", 2)
    await cluster.create_job(h.scenario_job("gang", scheduling={"gang": True, "queue": "team"}))
    pods = await h.wait_pods(cluster, "gang", 2)
    group = await cluster.kube.request("GET", "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/gang/podgroups/gang")
    assert group["spec"]["minMember"] == 2
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gang"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"


async def test_kopf_run_module_runs_the_same_operator(cluster, tmp_path):
    import os
    import sys

    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "MESHJOB_OPERATOR_METRICS_PORT": "0",
           "MESHJOB_OPERATOR_WEBHOOK": "0"}
    log = open(tmp_path / "kopf.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kopf", "run", "-m", "meshjob.operator", "--standalone", "-A"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        await h.add_nodes(cluster, "kopfrun", 2)
        await cluster.create_job(h.scenario_job("kopfrun"))
        await h.wait_pods(cluster, "kopfrun", 2, timeout=40)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        print((tmp_path / "kopf.log").read_text()[-3000:])
