"""The operator against kmock's in-memory API server only: what a real API server cannot be made to do
(injected API errors), the example manifests through kubectl, `kopf run -m`, the default command line.
The scenarios every server runs are in test_operator_scenarios.py."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import operator_harness as h
import pytest

from meshjob_operator import testing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
async def cluster():
    async with testing.kmock_cluster() as c:
        yield c


@pytest.fixture
async def operator(cluster):
    async with testing.running_operator(cluster) as op:
        yield op


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_kubectl_apply_examples_against_kmock(cluster):
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/ holds the spec helper's manifests"
    out = await asyncio.to_thread(
        subprocess.run,
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "apply", "--validate=false", "-f", str(EXAMPLES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
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


async def test_kopf_run_module_runs_the_same_operator(cluster, tmp_path):
    import os
    import sys

    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "MESHJOB_OPERATOR_METRICS_PORT": "0",
        "MESHJOB_OPERATOR_WEBHOOK": "0",
    }
    log = open(tmp_path / "kopf.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "-m", "meshjob_operator.handlers", "--standalone", "-A"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
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


def _admission_review(job: dict, operation: str = "CREATE", old: dict | None = None) -> dict:
    from meshjob_operator import names

    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "review-1",
            "operation": operation,
            "userInfo": {"username": "tester"},
            "kind": {"group": names.GROUP, "version": names.VERSION, "kind": names.KIND},
            "resource": {"group": names.GROUP, "version": names.VERSION, "resource": names.PLURAL},
            "namespace": job["metadata"]["namespace"],
            "name": job["metadata"]["name"],
            "object": job,
            "oldObject": old,
        },
    }


async def test_default_command_line_serves_liveness_and_a_self_signed_webhook(cluster, tmp_path):
    """`meshjob operator` with its webhook defaults (on, 0.0.0.0:9443, no certificate given) starts,
    answers its liveness probe, registers the webhook with its own certificate as the CA bundle, and
    that webhook, reached over TLS verified by that bundle, rejects a bad spec and admits a good one."""
    import base64
    import json
    import os
    import ssl
    import sys
    import urllib.parse
    import urllib.request

    live = testing.free_port()
    log_path = tmp_path / "operator.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshjob.cli",
            "operator",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--liveness",
            f"http://127.0.0.1:{live}/healthz",
            "--metrics-port",
            str(testing.free_port()),
        ],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
    )
    config_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/trainingjobs.meshjob.io"
    try:

        def probe() -> int:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{live}/healthz", timeout=2).status
            except OSError:
                return 0

        async def healthy() -> bool:
            assert proc.poll() is None, f"the operator exited:\n{log_path.read_text()[-3000:]}"
            return await asyncio.to_thread(probe) == 200

        await testing.eventually(healthy, timeout=40, what="the liveness probe answering 200")

        async def both_checks() -> dict | None:  # kopf creates the configuration empty, then fills it
            config = await cluster.kube.request("GET", config_path)
            return config if len(config.get("webhooks") or []) == 2 else None

        config = await testing.eventually(both_checks, timeout=20, what="kopf's ValidatingWebhookConfiguration")
        # two checks, both failing closed: the requester's right to create pods (creation) and the spec (creation
        # and edits: an edit made while the operator is down is refused, not run unchecked)
        hooks = {"+".join(hook["rules"][0]["operations"]): hook["clientConfig"] for hook in config["webhooks"]}
        assert sorted(hooks) == ["CREATE", "CREATE+UPDATE"]
        assert [hook["failurePolicy"] for hook in config["webhooks"]] == ["Fail", "Fail"]
        client_config = hooks["CREATE+UPDATE"]
        url = urllib.parse.urlsplit(client_config["url"])
        assert url.scheme == "https" and url.port == 9443 and url.hostname in ("localhost", "127.0.0.1")
        context = ssl.create_default_context(cadata=base64.b64decode(client_config["caBundle"]).decode())

        def review(job: dict, operation: str = "CREATE", old: dict | None = None, hook: str = "CREATE+UPDATE") -> dict:
            body = json.dumps(_admission_review(job, operation, old)).encode()
            request = urllib.request.Request(
                hooks[hook]["url"], data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            return json.loads(urllib.request.urlopen(request, context=context, timeout=10).read())["response"]

        bad = h.scenario_job("selfsigned")
        bad["spec"]["stages"][1]["layers"] = [1, 3]
        denied = await asyncio.to_thread(review, bad)
        assert denied["allowed"] is False
        assert "spec.stages[1].layers: [1, 3] is invalid" in denied["status"]["message"]
        assert (await asyncio.to_thread(review, h.scenario_job("selfsigned")))["allowed"] is True
        # an invalid job that exists already stays deletable: updates that keep the spec pass
        finalized = json.loads(json.dumps(bad))
        finalized["metadata"]["finalizers"] = []
        assert (await asyncio.to_thread(review, finalized, "UPDATE", bad))["allowed"] is True
        # kmock has no authorizer to say the requester may create pods: creation is refused (fail closed)
        assert (await asyncio.to_thread(review, h.scenario_job("selfsigned"), hook="CREATE"))["allowed"] is False
        assert "certbuilder" not in log_path.read_text()
        # a stopped operator leaves both checks behind, failing closed: no job is created or edited while it is
        # away (kmock runs in this loop: wait in a thread)
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 20) == 0
        left = (await cluster.kube.request("GET", config_path))["webhooks"]
        assert [hook["failurePolicy"] for hook in left] == ["Fail", "Fail"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        print(log_path.read_text()[-3000:])
