"""The same scenarios against a real kube-apiserver (+ kube-controller-manager for garbage collection).

Runs when KUBEBUILDER_ASSETS names a folder with kube-apiserver and etcd is on PATH (tests/run.sh
sets it to ../shared/envtest). One API server per module; each scenario has its own namespace,
nodes and device resource. No kubelet: the scenarios play it by patching pod status.
"""
from __future__ import annotations

import pytest
import pytest_asyncio

import operator_harness as h

ASSETS = h.envtest_assets()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(ASSETS is None, reason="KUBEBUILDER_ASSETS does not name a folder with kube-apiserver "
                                              "(and etcd on PATH)"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    async with h.envtest_cluster(ASSETS) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
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


async def test_deletion_garbage_collects_children(cluster, operator):
    await h.scenario_deletion_removes_children(cluster, "delete")


async def test_active_deadline_fails_the_job(cluster, operator):
    await h.scenario_activeDeadline_fails_the_job(cluster, "deadline")


async def test_operator_killed_mid_creation_converges_without_duplicates(cluster):
    await h.scenario_operator_killed_mid_creation(cluster, "killed")


async def test_restart_is_counted_once_across_operator_restart(cluster):
    await h.scenario_restart_counted_once_across_operator_restart(cluster, "once")
