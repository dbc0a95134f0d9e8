"""The operator against a real kube-apiserver only: peered replicas, and the admission webhook called by
the API server when `kubectl apply` runs. The scenarios every server runs are in test_operator_scenarios.py.

Runs when KUBEBUILDER_ASSETS names a folder with kube-apiserver and etcd is on PATH (tests/run.sh
sets it to ../shared/envtest); ServiceAccount admission is on, as on every real cluster.
"""

from __future__ import annotations

import asyncio

import operator_harness as h
import pytest
import pytest_asyncio

from meshjob_operator import testing
from meshjob_operator.kube import MERGE_PATCH

ASSETS = testing.envtest_assets()
WEBHOOK_CONFIG = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        ASSETS is None, reason="KUBEBUILDER_ASSETS does not name a folder with kube-apiserver (and etcd on PATH)"
    ),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    async with testing.envtest_cluster(ASSETS) as c:
        yield c


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

    await asyncio.to_thread(cluster.kubectl, "apply", "-f", str(h.PEERING_CRDS))
    await asyncio.to_thread(cluster.envtest.wait_established, "clusterkopfpeerings.kopf.dev")
    await cluster.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "meshjob-test"}},
    )
    replicas = {}
    probes: dict[str, int] = {}  # replica -> liveness port
    try:
        for name, priority in (("active", 10), ("standby", 5)):
            port, live = testing.free_port(), testing.free_port()
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshjob.cli",
                    "operator",
                    "--peering",
                    "meshjob-test",
                    "--priority",
                    str(priority),
                    "--no-webhook",
                    "--metrics-port",
                    str(port),
                    "--liveness",
                    f"http://127.0.0.1:{live}/healthz",
                    "--kubeconfig",
                    str(cluster.kubeconfig),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            replicas[name] = (proc, port, tmp_path / f"{name}.log")
            probes[name] = live

            async def metrics_up(port=port) -> bool:
                return (
                    await asyncio.to_thread(_metric, port, "meshjob_operator_reconcile_duration_seconds_count")
                    is not None
                )

            await testing.eventually(metrics_up, timeout=40, what=f"the {name} replica's metrics endpoint")

        async def both_peered() -> bool:
            peering = await cluster.kube.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/meshjob-test")
            return sorted(p["priority"] for p in (peering.get("status") or {}).values()) == [5, 10]

        await testing.eventually(both_peered, timeout=30, what="both replicas in the peering object")
        for live in probes.values():  # --liveness serves kopf's health probe

            async def healthy(live=live) -> bool:
                return await asyncio.to_thread(_status_code, f"http://127.0.0.1:{live}/healthz") == 200

            await testing.eventually(healthy, timeout=20, what="the liveness probe answering 200")

        tag = "peering"
        await h.prepare_namespace(cluster, tag)
        await h.add_nodes(cluster, tag, 2)
        await cluster.create_job(h.scenario_job(tag))
        await h.wait_pods(cluster, tag, 2, timeout=30)

        def reconciles(name: str) -> float:
            return _metric(replicas[name][1], "meshjob_operator_reconcile_duration_seconds_count")

        async def active_reconciled() -> bool:  # observed when its reconcile returns, after the pods exist
            return (await asyncio.to_thread(reconciles, "active")) > 0

        await testing.eventually(active_reconciled, timeout=10, what="a reconcile by the active replica")
        assert (await asyncio.to_thread(reconciles, "standby")) == 0

        async def active_counts_the_job() -> bool:  # its first reconcile may end while the plan is still being made
            return (
                await asyncio.to_thread(_metric, replicas["active"][1], 'meshjob_operator_jobs{phase="Created"}') == 1
            )

        await testing.eventually(active_counts_the_job, timeout=10, what="the active replica counting the job Created")

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


async def test_admission_webhook_rejects_an_invalid_spec_and_an_edit_of_a_started_job_at_kubectl_apply(
    cluster, tmp_path
):
    """kubectl apply itself shows the plan layer's message, and refuses changing a started job's stages."""
    import asyncio
    import subprocess

    import yaml

    pki = cluster.kubeconfig.parent / "pki"  # start.sh's serving cert has 127.0.0.1 as a SAN
    webhook = {
        "webhook_addr": "127.0.0.1",
        "webhook_port": testing.free_port(),
        "webhook_host": "127.0.0.1",
        "webhook_cert": str(pki / "apiserver.crt"),
        "webhook_key": str(pki / "apiserver.key"),
        "webhook_ca": str(pki / "ca.crt"),
    }
    tag = "webhook"
    await h.prepare_namespace(cluster, tag)
    await h.add_nodes(cluster, tag, 3)
    bad, good, edited = h.scenario_job(tag), h.scenario_job(tag), h.scenario_job(tag, hosts=3)
    bad["spec"]["stages"][1]["layers"] = [1, 3]
    edited["spec"]["training"] = good["spec"]["training"]
    for name, body in (("bad", bad), ("good", good), ("edited", edited)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    config_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
    try:
        async with testing.running_operator(cluster, webhook=webhook):
            await testing.eventually(
                lambda: _registered(cluster, webhook["webhook_port"]),
                timeout=30,
                what="kopf's ValidatingWebhookConfiguration for this server",
            )

            def apply(name: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply", "-f", str(tmp_path / name)],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )

            rejected = await asyncio.to_thread(apply, "bad.yaml")
            assert rejected.returncode != 0
            assert "denied the request" in rejected.stderr
            assert "spec.stages[1].layers: [1, 3] is invalid" in rejected.stderr
            assert await cluster.job(tag, tag) is None
            accepted = await asyncio.to_thread(apply, "good.yaml")
            assert accepted.returncode == 0, accepted.stderr
            await h.wait_status(cluster, tag, lambda s: h.condition(s, "Created").get("status") == "True", "Created")
            refused = await asyncio.to_thread(apply, "edited.yaml")
            assert refused.returncode != 0 and "denied the request" in refused.stderr
            assert "spec.stages cannot change once the job has started" in refused.stderr
            assert len((await cluster.job(tag, tag))["spec"]["stages"][1]["mesh"]) == 2
            assert (await cluster.job(tag, tag))["spec"]["stages"][1]["mesh"][0] == 1
            await h.delete_and_wait(cluster, tag)
    finally:
        await cluster.kube.delete(config_path)


async def test_self_signed_webhook_rejects_an_invalid_spec_at_kubectl_apply(cluster, tmp_path):
    """No certificate given (the default): the operator makes its own and the real API server, trusting
    it through the caBundle kopf registers, calls the webhook over TLS: kubectl apply shows the error."""
    import asyncio
    import subprocess

    import yaml

    webhook = {"webhook_addr": "127.0.0.1", "webhook_port": testing.free_port(), "webhook_host": "127.0.0.1"}
    tag = "selfsigned"
    await h.prepare_namespace(cluster, tag)
    bad = h.scenario_job(tag)
    bad["spec"]["stages"][1]["layers"] = [1, 3]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    config_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
    try:
        async with testing.running_operator(cluster, webhook=webhook):
            await testing.eventually(
                lambda: _registered(cluster, webhook["webhook_port"]),
                timeout=30,
                what="kopf's ValidatingWebhookConfiguration for this server",
            )
            rejected = await asyncio.to_thread(
                subprocess.run,
                ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply", "-f", str(tmp_path / "bad.yaml")],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert rejected.returncode != 0
            assert "denied the request" in rejected.stderr
            assert "spec.stages[1].layers: [1, 3] is invalid" in rejected.stderr
            assert await cluster.job(tag, tag) is None
    finally:
        await cluster.kube.delete(config_path)


async def test_creating_a_job_needs_the_right_to_create_pods_and_an_allowed_image(cluster, tmp_path, monkeypatch):
    """Creating a TrainingJob is creating pods (its image, service account, podTemplate): a user who may create
    TrainingJobs but not pods is refused at kubectl apply (the webhook's SubjectAccessReview, as that user),
    and passes once she may create pods; an image off the operator's allow-list is refused too."""
    import yaml

    from meshjob_operator.reconcile import ALLOWED_IMAGES_ENV

    tag, user = "rbacgate", "alice"
    await h.prepare_namespace(cluster, tag)
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{tag}"
    for role, rules in (
        (
            "jobs",
            [{"apiGroups": ["meshjob.io"], "resources": ["trainingjobs"], "verbs": ["get", "list", "create", "patch"]}],
        ),
        ("pods", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]),
    ):
        await cluster.create(
            f"{rbac}/roles",
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": role}, "rules": rules},
        )
    bind = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "jobs"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "jobs"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    await cluster.create(f"{rbac}/rolebindings", bind)
    job, foreign = h.scenario_job(tag), h.scenario_job(tag)
    foreign["spec"]["image"] = "docker.io/someone/miner:1"
    for name, body in (("job", job), ("foreign", foreign)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    monkeypatch.setenv(ALLOWED_IMAGES_ENV, "meshjob/trainer:*")
    webhook = {"webhook_addr": "127.0.0.1", "webhook_port": testing.free_port(), "webhook_host": "127.0.0.1"}
    try:
        async with testing.running_operator(cluster, webhook=webhook):
            await testing.eventually(
                lambda: _registered(cluster, webhook["webhook_port"]),
                timeout=30,
                what="kopf's ValidatingWebhookConfiguration for this server",
            )
            apply = ("apply", "-n", tag, "-f", str(tmp_path / "job.yaml"))
            refused = await asyncio.to_thread(cluster.kubectl, f"--as={user}", *apply, check=False)
            assert refused.returncode != 0 and f"{user} may not create pods in namespace {tag}" in refused.stderr, (
                refused.stderr
            )
            assert await cluster.job(tag, tag) is None
            await cluster.create(
                f"{rbac}/rolebindings",
                {**bind, "metadata": {"name": "pods"}, "roleRef": {**bind["roleRef"], "name": "pods"}},
            )

            async def accepted() -> bool:
                result = await asyncio.to_thread(cluster.kubectl, f"--as={user}", *apply, check=False)
                return result.returncode == 0

            await testing.eventually(accepted, timeout=30, what=f"{user}'s apply accepted once she may create pods")
            foreign_apply = await asyncio.to_thread(
                cluster.kubectl, "apply", "-f", str(tmp_path / "foreign.yaml"), check=False
            )
            assert foreign_apply.returncode != 0 and "docker.io/someone/miner:1" in foreign_apply.stderr
            assert "one matching meshjob/trainer:*" in foreign_apply.stderr
            await h.delete_and_wait(cluster, tag)
    finally:
        await cluster.kube.delete(WEBHOOK_CONFIG)


async def test_pod_security_is_enforced_at_kubectl_apply_as_the_namespace_labels_say(cluster, tmp_path):
    """The webhook applies the namespace's Pod Security level as it is at the request: restricted (no label)
    refuses an nfs volume and an unconfined AppArmor profile, naming both fields; Kubernetes' own label
    `pod-security.kubernetes.io/enforce: baseline` lets the volume through but not the profile; meshjob's
    `meshjob.io/pod-security: privileged` takes precedence and lets both through."""
    import yaml

    tag = "podsecurity"
    await h.prepare_namespace(cluster, tag)
    body = h.scenario_job(
        tag,
        podTemplate={
            "metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}},
            "spec": {"volumes": [{"name": "share", "nfs": {"server": "nas", "path": "/data"}}]},
        },
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(body))
    apply = ("apply", "-f", str(tmp_path / "job.yaml"))
    annotation = "spec.podTemplate.metadata.annotations[container.apparmor.security.beta.kubernetes.io/trainer]"
    webhook = {"webhook_addr": "127.0.0.1", "webhook_port": testing.free_port(), "webhook_host": "127.0.0.1"}

    async def label(labels: dict[str, str]) -> None:
        patch = {"metadata": {"labels": labels}}
        await cluster.kube.request("PATCH", f"/api/v1/namespaces/{tag}", patch, content_type=MERGE_PATCH)

    try:
        async with testing.running_operator(cluster, webhook=webhook):
            await testing.eventually(
                lambda: _registered(cluster, webhook["webhook_port"]),
                timeout=30,
                what="kopf's ValidatingWebhookConfiguration for this server",
            )
            refused = await asyncio.to_thread(cluster.kubectl, *apply, check=False)
            assert refused.returncode != 0 and "denied the request" in refused.stderr, refused.stderr
            assert "spec.podTemplate.spec.volumes[0].nfs" in refused.stderr and annotation in refused.stderr
            assert f"namespace {tag} enforces Pod Security 'restricted'" in refused.stderr
            await label({"pod-security.kubernetes.io/enforce": "baseline"})
            refused = await asyncio.to_thread(cluster.kubectl, *apply, check=False)
            assert refused.returncode != 0 and annotation in refused.stderr, refused.stderr
            assert "volumes[0].nfs" not in refused.stderr and "Pod Security 'baseline'" in refused.stderr
            await label({"meshjob.io/pod-security": "privileged"})
            accepted = await asyncio.to_thread(cluster.kubectl, *apply, check=False)
            assert accepted.returncode == 0, accepted.stderr
            await h.delete_and_wait(cluster, tag)
    finally:
        await cluster.kube.delete(WEBHOOK_CONFIG)


async def _registered(cluster, port: int) -> bool:
    config = await cluster.kube.request("GET", WEBHOOK_CONFIG)
    hooks = config.get("webhooks") or []  # both checks (kopf creates the configuration empty, then fills it)
    return len(hooks) == 2 and all(f":{port}/" in hook["clientConfig"]["url"] for hook in hooks)


async def test_a_trainer_pods_identity_can_modify_no_other_object(cluster):
    """Trainer pods run as their namespace's default ServiceAccount, with no token mounted
    (automountServiceAccountToken: false); even that identity, impersonated, is refused every change:
    patching another pod (its image), creating a pod, deleting the job."""
    import json

    tag = "identity"
    await h.prepare_namespace(cluster, tag)
    await h.add_nodes(cluster, tag, 2)
    async with testing.running_operator(cluster):
        await cluster.create_job(h.scenario_job(tag))
        pods = await h.wait_pods(cluster, tag, 2)
        assert all(p["spec"]["automountServiceAccountToken"] is False for p in pods)
        assert {p["spec"].get("serviceAccountName", "default") for p in pods} == {"default"}
        trainer = f"--as=system:serviceaccount:{tag}:default"
        other = pods[1]["metadata"]["name"]
        image = json.dumps({"spec": {"containers": [{"name": "trainer", "image": "evil"}]}})
        attempts = [
            ("patch", "pod", other, "-p", image),
            ("label", "pod", other, "meshjob.io/job-name-"),
            ("delete", "trainingjob", tag, "--wait=false"),
            ("run", "intruder", "--image=evil"),
        ]
        for attempt in attempts:
            result = await asyncio.to_thread(cluster.kubectl, trainer, "-n", tag, *attempt, check=False)
            assert result.returncode != 0 and "forbidden" in result.stderr.lower(), (attempt, result.stderr)
        await h.delete_and_wait(cluster, tag)


@pytest.mark.parametrize("name", ["g" * 60, "1gpt"], ids=["60-characters", "starts-with-a-digit"])
async def test_a_name_no_child_could_carry_is_refused_at_kubectl_apply(cluster, tmp_path, name):
    """No operator, no webhook: the CRD's schema itself refuses it (its Service is <name>, a DNS-1035 label;
    its pods <name>-host-<index>, whose hostname is a DNS label of at most 63 characters)."""
    import yaml

    body = h.scenario_job("default")
    body["metadata"]["name"] = name
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(body))
    result = await asyncio.to_thread(cluster.kubectl, "apply", "-f", str(tmp_path / "job.yaml"), check=False)
    assert result.returncode != 0 and "metadata.name" in result.stderr, result.stderr
    assert await cluster.job(name, "default") is None
