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
    from meshjob_operator.handlers import STATE

    await h.scenario_gang_restart_then_failed(cluster, "restart", metrics=STATE.metrics)


async def test_suspend_deletes_pods_and_resume_recreates_them(cluster, operator):
    await h.scenario_suspend_and_resume(cluster, "suspend")


async def test_invalid_spec_sets_invalid_spec_condition_and_warning_event(cluster, operator):
    await h.scenario_invalid_spec(cluster, "invalid")


async def test_unschedulable_until_a_node_appears(cluster, operator):
    await h.scenario_unschedulable_until_a_node_appears(cluster, "unsched")


async def test_deletion_garbage_collects_children(cluster, operator):
    await h.scenario_deletion_removes_children(cluster, "delete")


async def test_a_deleted_pod_restarts_the_gang(cluster, operator):
    await h.scenario_deleted_pod_restarts_the_gang(cluster, "evicted")


async def test_active_deadline_fails_the_job(cluster, operator):
    await h.scenario_activeDeadline_fails_the_job(cluster, "deadline")


async def test_operator_killed_mid_creation_converges_without_duplicates(cluster):
    await h.scenario_operator_killed_mid_creation(cluster, "killed")


async def test_restart_is_counted_once_across_operator_restart(cluster):
    await h.scenario_restart_counted_once_across_operator_restart(cluster, "once")


async def test_gang_scheduling_creates_a_podgroup_and_sets_the_scheduler(cluster):
    async with h.running_operator(cluster, config={"trainer_service_account": h.TRAINER_SERVICE_ACCOUNT}):
        await h.scenario_gang_scheduling(cluster, "gang")


async def test_spec_service_account_name_wins_over_the_trainer_account(cluster):
    async with h.running_operator(cluster, config={"trainer_service_account": h.TRAINER_SERVICE_ACCOUNT}):
        await h.scenario_spec_service_account(cluster, "ownsa")


def _metric(port: int, name: str) -> float | None:
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _status_code(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


async def test_peered_replicas_never_both_act_and_the_standby_takes_over(cluster, tmp_path):
    """Two `meshjob operator --peering` processes: only the higher priority reconciles; on its exit
    the other one resumes. Their metrics endpoints tell who reconciled."""
    import asyncio
    import subprocess
    import sys

    await asyncio.to_thread(h.kubectl, cluster.kubeconfig, "apply", "-f", str(h.PEERING_CRDS))
    await asyncio.to_thread(h.kubectl, cluster.kubeconfig, "wait", "--for=condition=Established",
                            "crd/clusterkopfpeerings.kopf.dev", "--timeout=60s")
    await cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings",
                         {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "meshjob-test"}})
    replicas = {}
    probes: dict[str, int] = {}  # replica -> liveness port
    try:
        for name, priority in (("active", 10), ("standby", 5)):
            port, live = h.free_port(), h.free_port()
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "meshjob.cli", "operator", "--peering", "meshjob-test",
                                     "--priority", str(priority), "--no-webhook", "--metrics-port", str(port),
                                     "--liveness", f"http://127.0.0.1:{live}/healthz",
                                     "--kubeconfig", str(cluster.kubeconfig)], stdout=log, stderr=subprocess.STDOUT)
            replicas[name] = (proc, port, tmp_path / f"{name}.log")
            probes[name] = live

            async def metrics_up(port=port) -> bool:
                return await asyncio.to_thread(_metric, port, "meshjob_operator_reconcile_duration_seconds_count") is not None
            await h.eventually(metrics_up, timeout=40, what=f"the {name} replica's metrics endpoint")

        async def both_peered() -> bool:
            peering = await cluster.kube.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/meshjob-test")
            return sorted(p["priority"] for p in (peering.get("status") or {}).values()) == [5, 10]
        await h.eventually(both_peered, timeout=30, what="both replicas in the peering object")
        for live in probes.values():  # --liveness serves kopf's health probe
            async def healthy(live=live) -> bool:
                return await asyncio.to_thread(_status_code, f"http://127.0.0.1:{live}/healthz") == 200
            await h.eventually(healthy, timeout=20, what="the liveness probe answering 200")

        tag = "peering"
        await h.prepare_namespace(cluster, tag)
        await h.add_nodes(cluster, tag, 2)
        await cluster.create_job(h.scenario_job(tag))
        await h.wait_pods(cluster, tag, 2, timeout=30)
        reconciles = lambda name: _metric(replicas[name][1], "meshjob_operator_reconcile_duration_seconds_count")
        assert (await asyncio.to_thread(reconciles, "active")) > 0
        assert (await asyncio.to_thread(reconciles, "standby")) == 0
        assert await asyncio.to_thread(_metric, replicas["active"][1], 'meshjob_operator_jobs{phase="Created"}') == 1

        replicas["active"][0].terminate()
        await asyncio.to_thread(replicas["active"][0].wait, 30)
        await cluster.patch_job(tag, {"spec": {"runPolicy": {"suspend": True}}}, tag)
        await h.wait_pods(cluster, tag, 0, timeout=40)
        assert (await asyncio.to_thread(reconciles, "standby")) > 0
        await h.delete_and_wait(cluster, tag)
    finally:
        for name, (proc, _, log_path) in replicas.items():
            print(f"--- {name} replica log (tail) ---\n" + "\n".join(log_path.read_text().splitlines()[-25:]))
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def test_admission_webhook_rejects_an_invalid_spec_at_kubectl_apply(cluster, tmp_path):
    """kubectl apply itself shows the plan layer's message (kept last: it registers a webhook)."""
    import asyncio
    import subprocess

    import yaml

    pki = cluster.kubeconfig.parent / "pki"  # start.sh's serving cert has 127.0.0.1 as a SAN
    webhook = {"webhook_addr": "127.0.0.1", "webhook_port": h.free_port(), "webhook_host": "127.0.0.1",
               "webhook_cert": str(pki / "apiserver.crt"), "webhook_key": str(pki / "apiserver.key"),
               "webhook_ca": str(pki / "ca.crt")}
    tag = "webhook"
    await h.prepare_namespace(cluster, tag)
    bad, good = h.scenario_job(tag), h.scenario_job(tag)
    bad["spec"]["stages"][1]["layers"] = [1, 3]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    config_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
    try:
        async with h.running_operator(cluster, webhook=webhook):
            await h.eventually(lambda: cluster.kube.request("GET", config_path), timeout=30,
                               what="kopf's ValidatingWebhookConfiguration")

            def apply(name: str) -> subprocess.CompletedProcess:
                return subprocess.run(["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply", "-f",
                                       str(tmp_path / name)], capture_output=True, text=True, timeout=60)
            rejected = await asyncio.to_thread(apply, "bad.yaml")
            assert rejected.returncode != 0
            assert "denied the request" in rejected.stderr
            assert "spec.stages[1].layers: [1, 3] is invalid" in rejected.stderr
            assert await cluster.job(tag, tag) is None
            accepted = await asyncio.to_thread(apply, "good.yaml")
            assert accepted.returncode == 0, accepted.stderr
            await h.delete_and_wait(cluster, tag)
    finally:
        await cluster.kube.delete(config_path)


async def test_self_signed_webhook_rejects_an_invalid_spec_at_kubectl_apply(cluster, tmp_path):
    """No certificate given (the default): the operator makes its own and the real API server, trusting
    it through the caBundle kopf registers, calls the webhook over TLS: kubectl apply shows the error."""
    import asyncio
    import subprocess

    import yaml

    webhook = {"webhook_addr": "127.0.0.1", "webhook_port": h.free_port(), "webhook_host": "127.0.0.1"}
    tag = "selfsigned"
    await h.prepare_namespace(cluster, tag)
    bad = h.scenario_job(tag)
    bad["spec"]["stages"][1]["layers"] = [1, 3]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    config_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
    try:
        async with h.running_operator(cluster, webhook=webhook):
            async def registered():
                config = await cluster.kube.request("GET", config_path)
                hooks = config.get("webhooks") or []
                return hooks and f":{webhook['webhook_port']}/" in hooks[0]["clientConfig"]["url"]
            await h.eventually(registered, timeout=30, what="kopf's ValidatingWebhookConfiguration for this server")
            rejected = await asyncio.to_thread(
                subprocess.run, ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply", "-f",
                                 str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=60)
            assert rejected.returncode != 0
            assert "denied the request" in rejected.stderr
            assert "spec.stages[1].layers: [1, 3] is invalid" in rejected.stderr
            assert await cluster.job(tag, tag) is None
    finally:
        await cluster.kube.delete(config_path)
