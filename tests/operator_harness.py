"""Shared fixtures for the operator's integration tests: kmock and a real kube-apiserver (envtest).

Both clusters offer the same small API (`Cluster`), so each scenario runs against both:
  * KmockCluster: kmock's in-memory API server over HTTP (quirks handled here: cluster-wide
    operator, declared resources, uid/resourceVersion put into the bodies we create, PATCH only);
  * EnvtestCluster: etcd + kube-apiserver + kube-controller-manager from /work/shared/envtest
    (KUBEBUILDER_ASSETS), distinct KAS_DIR and ports per run, stopped afterwards.
No kubelet runs in either: the test plays the kubelet by patching pod status (`set_pod_phase`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import yaml

from meshjob_operator import names
from meshjob_operator.kube import MERGE_PATCH, ApiError, Connection, Kube

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "trainingjob.yaml"
PEERING_CRDS = REPO / "operator" / "peering.yaml"
JOBS = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{{ns}}/{names.PLURAL}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envtest_assets() -> Path | None:
    """controller-runtime's convention: KUBEBUILDER_ASSETS names a folder with kube-apiserver."""
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if folder and (Path(folder) / "kube-apiserver").exists() and shutil.which("etcd"):
        return Path(folder)
    return None


def node_body(name: str, devices: int, *, resource: str = "cpu", rack: str = "", ready: bool = True,
              unschedulable: bool = False, host_label: str = "kubernetes.io/hostname") -> dict[str, Any]:
    labels = {host_label: name}
    if rack:
        labels["topology.kubernetes.io/zone"] = rack
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": unschedulable},
        "status": {"allocatable": {resource: str(devices), "pods": "110"},
                   "capacity": {resource: str(devices), "pods": "110"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def job_body(name: str, namespace: str = "default", *, hosts: int = 2, devices_per_host: int = 2,
             run_policy: dict[str, Any] | None = None, **spec_overrides: Any) -> dict[str, Any]:
    """A small valid TrainingJob: stage 0 on one host's devices, stage 1 over `hosts - 1` hosts."""
    stages = [{"layers": [0, 1], "mesh": [1, devices_per_host], "tensorParallelDim": 1}]
    if hosts > 1:
        stages.append({"layers": [1, 2], "mesh": [hosts - 1, devices_per_host], "dataParallelDim": 0,
                       "tensorParallelDim": 1})
    spec: dict[str, Any] = {
        "image": "meshjob/trainer:test",
        "model": {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16},
        "training": {"steps": 3, "globalBatch": 8 * max(1, hosts - 1), "microbatches": 2,
                     "checkpoint": {"every": 1, "path": "/ckpt"}},
        "topology": {"devicesPerHost": devices_per_host},
        "stages": stages,
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "naive"},
        "schedule": {"kind": "1f1b", "weightGradDelay": "off"},
        "runPolicy": {"backoffLimit": 2, "cleanPodPolicy": "All", **(run_policy or {})},
    }
    spec.update(spec_overrides)
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


class Cluster:
    """What a scenario needs from a cluster; subclasses differ only in setup and quirks."""
    kubeconfig: Path
    kube: Kube
    real: bool = False  # a real API server (GC by kube-controller-manager, status subresource, ...)

    def _stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.kube.request("POST", path, self._stamp(body))

    async def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.create(JOBS.format(ns=body["metadata"].get("namespace", "default")), body)

    async def patch_job(self, name: str, patch: dict[str, Any], namespace: str = "default") -> None:
        await self.kube.request("PATCH", JOBS.format(ns=namespace) + f"/{name}", patch, content_type=MERGE_PATCH)

    async def delete_job(self, name: str, namespace: str = "default") -> None:
        await self.kube.delete(JOBS.format(ns=namespace) + f"/{name}", propagation="Background")

    async def job(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return await self.kube.get_job(namespace, name)

    async def add_node(self, name: str, devices: int, **kwargs: Any) -> None:
        await self.create("/api/v1/nodes", node_body(name, devices, **kwargs))

    async def pods(self, job: str, namespace: str = "default") -> list[dict[str, Any]]:
        return sorted(await self.kube.list_pods(namespace, job), key=lambda p: p["metadata"]["name"])

    async def set_pod_phase(self, pod: str, phase: str, namespace: str = "default", *,
                            annotations: dict[str, str] | None = None, exit_code: int = 1) -> None:
        """Play the kubelet: report a pod's phase (and the trainer's progress annotations)."""
        status: dict[str, Any] = {"phase": phase}
        if phase == "Failed":
            status["containerStatuses"] = [{"name": "trainer", "ready": False, "restartCount": 0, "image": "x",
                                            "imageID": "", "state": {"terminated": {"exitCode": exit_code,
                                                                                   "reason": "Error"}}}]
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        await self.kube.request("PATCH", path + "/status", {"status": status}, content_type=MERGE_PATCH)
        if annotations:
            await self.kube.request("PATCH", path, {"metadata": {"annotations": annotations}},
                                    content_type=MERGE_PATCH)

    async def finish_deletions(self, namespace: str = "default") -> None:
        """Play the kubelet for terminating pods (none on kmock: deletion is immediate there)."""

    async def events(self, namespace: str = "default") -> list[dict[str, Any]]:
        found = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")
        return (found or {}).get("items") or []

    async def get(self, plural: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return await self.kube.get(namespace, plural, name)


class KmockCluster(Cluster):
    def _stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", "1")
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return body

    async def patch_job(self, name: str, patch: dict[str, Any], namespace: str = "default") -> None:
        # kmock keeps no generation: bump it as the API server does on spec changes
        if "spec" in patch:
            body = await self.job(name, namespace) or {}
            generation = int(body.get("metadata", {}).get("generation") or 1) + 1
            patch = {**patch, "metadata": {**patch.get("metadata", {}), "generation": generation}}
        await super().patch_job(name, patch, namespace)


@contextlib.asynccontextmanager
async def kmock_cluster() -> AsyncIterator[KmockCluster]:
    import kmock

    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        for res, kind, namespaced, subresources in [
            ("v1/namespaces", "Namespace", False, ()), ("v1/nodes", "Node", False, ("status",)),
            ("v1/pods", "Pod", True, ("status",)), ("v1/services", "Service", True, ()),
            ("v1/configmaps", "ConfigMap", True, ()), ("v1/events", "Event", True, ()),
            ("events.k8s.io/v1/events", "Event", True, ()),
            (f"{names.GROUP}/{names.VERSION}/{names.PLURAL}", names.KIND, True, ("status",)),
            ("scheduling.x-k8s.io/v1alpha1/podgroups", "PodGroup", True, ()),
            ("admissionregistration.k8s.io/v1/validatingwebhookconfigurations", "ValidatingWebhookConfiguration",
             False, ()),
        ]:
            emulator.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=namespaced,
                                                         subresources=set(subresources),
                                                         verbs={"list", "watch", "get", "create", "patch", "delete"})
        emulator.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default", "uid": "ns-default"}}
        tmp = Path(tempfile.mkdtemp(prefix="meshjob-kmock-"))
        cluster = KmockCluster()
        cluster.kubeconfig = tmp / "kubeconfig"
        cluster.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(server.url).rstrip("/")}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
        }))
        cluster.kube = Kube(Connection.load(str(cluster.kubeconfig)))
        cluster.emulator = emulator  # type: ignore[attr-defined]
        try:
            yield cluster
        finally:
            await cluster.kube.close()
            shutil.rmtree(tmp, ignore_errors=True)


class EnvtestCluster(Cluster):
    real = True

    async def finish_deletions(self, namespace: str = "default") -> None:
        found = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        for pod in (found or {}).get("items") or []:
            if pod["metadata"].get("deletionTimestamp"):
                await self.kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
                                        {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})


def kubectl(kubeconfig: Path, *args: str, timeout: float = 60) -> str:
    out = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


@contextlib.asynccontextmanager
async def envtest_cluster(assets: Path) -> AsyncIterator[EnvtestCluster]:
    kas_dir = Path(tempfile.mkdtemp(prefix="meshjob-envtest-"))
    env = {**os.environ, "KAS_DIR": str(kas_dir), "ETCD_PORT": str(free_port()),
           "ETCD_PEER_PORT": str(free_port()), "APISERVER_PORT": str(free_port()), "KCM_PORT": str(free_port())}
    if (assets / "kube-apiserver").exists():
        env["APISERVER_BIN"] = str(assets / "kube-apiserver")
    if (assets / "kube-controller-manager").exists():
        env["KCM_BIN"] = str(assets / "kube-controller-manager")
    start = Path("/work/shared/envtest/start.sh")
    start = assets / "start.sh" if (assets / "start.sh").exists() else start
    try:
        proc = await asyncio.create_subprocess_exec("bash", str(start), env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=90)
        if proc.returncode != 0:
            raise RuntimeError(f"envtest start.sh failed:\n{out.decode()[-2000:]}")
        cluster = EnvtestCluster()
        cluster.kubeconfig = kas_dir / "run" / "kubeconfig"
        await asyncio.to_thread(kubectl, cluster.kubeconfig, "apply", "-f", str(CRD_PATH))
        await asyncio.to_thread(kubectl, cluster.kubeconfig, "wait", "--for=condition=Established",
                                "crd/trainingjobs.meshjob.io", "--timeout=60s")
        cluster.kube = Kube(Connection.load(str(cluster.kubeconfig)))
        try:
            yield cluster
        finally:
            await cluster.kube.close()
    finally:
        stop = start.parent / "stop.sh"
        subprocess.run(["bash", str(stop)], env=env, capture_output=True, timeout=60)
        shutil.rmtree(kas_dir, ignore_errors=True)


class OperatorThread:
    """kopf in its own thread and event loop, as in a real process: the test's loop stays its own."""

    def __init__(self, cluster: Cluster, *, webhook: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None):
        self.cluster, self.webhook = cluster, webhook  # webhook: OperatorConfig fields, None = off
        self.config = config or {}  # other OperatorConfig fields
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="kopf-operator", daemon=True)

    def _main(self) -> None:
        import kopf

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(kopf.operator(clusterwide=True, standalone=True,
                                                        stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        try:
            self.loop.run_until_complete(self.task)
        except BaseException as err:  # noqa: BLE001 (kept for the test to see)
            self.error = err
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def start(self) -> None:
        from meshjob_operator.handlers import STATE, OperatorConfig

        os.environ["KUBECONFIG"] = str(self.cluster.kubeconfig)
        STATE.config = OperatorConfig(metrics_port=None, webhook=self.webhook is not None,
                                      kubeconfig=str(self.cluster.kubeconfig), **(self.webhook or {}),
                                      **self.config)
        self.thread.start()
        if not await asyncio.to_thread(self.ready_flag.wait, 20):
            raise AssertionError(f"operator not ready in 20 s: {self.error!r}")

    def kill(self) -> None:
        """Abrupt death mid-whatever: cancel the operator's task, no graceful stop (callable from any thread)."""
        assert self.loop is not None and self.task is not None
        self.loop.call_soon_threadsafe(self.task.cancel)

    async def stop(self) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self.thread.join, 20)
        if self.thread.is_alive():
            self.kill()
            await asyncio.to_thread(self.thread.join, 10)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, *, webhook: dict[str, Any] | None = None,
                           config: dict[str, Any] | None = None) -> AsyncIterator[OperatorThread]:
    """The operator (cluster-wide, standalone, this package's handlers) for the duration of the block."""
    op = OperatorThread(cluster, webhook=webhook, config=config)
    await op.start()
    try:
        yield op
    finally:
        await op.stop()


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout: float = 15.0, interval: float = 0.1,
                     what: str = "condition") -> Any:
    """Poll until `check()` returns something truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await check()
        except ApiError as err:
            last = err
        if last and not isinstance(last, ApiError):
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


# ---------------------------------------------------------------------------------------------
# Scenarios: each runs on any Cluster. Every scenario uses its own namespace, node names and
# device resource (example.com/<tag>), so scenarios can share one API server without interfering.

def scenario_job(tag: str, *, hosts: int = 2, devices: int = 2, **kwargs: Any) -> dict[str, Any]:
    body = job_body(tag, tag, hosts=hosts, devices_per_host=devices, **kwargs)
    body["spec"]["topology"]["deviceResource"] = f"example.com/{tag}"
    return body


async def add_nodes(c: Cluster, tag: str, count: int, devices: int = 2, start: int = 0) -> list[str]:
    names_ = [f"{tag}-n{i}" for i in range(start, start + count)]
    for name in names_:
        await c.add_node(name, devices, resource=f"example.com/{tag}")
    return names_


async def prepare_namespace(c: Cluster, tag: str) -> None:
    if c.real:
        await c.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": tag}})


async def wait_pods(c: Cluster, tag: str, count: int, *, phase: str | None = None, timeout: float = 20) -> list[dict]:
    async def check() -> list[dict] | None:
        await c.finish_deletions(tag)
        pods = [p for p in await c.pods(tag, tag) if not p["metadata"].get("deletionTimestamp")]
        if len(pods) == count and (phase is None or all((p.get("status") or {}).get("phase", "Pending") == phase
                                                        for p in pods)):
            return pods or [{}]
        return None
    found = await eventually(check, timeout=timeout, what=f"{count} pod(s) of job {tag}")
    return [p for p in found if p]


async def wait_status(c: Cluster, tag: str, predicate: Callable[[dict], bool], what: str,
                      timeout: float = 20) -> dict[str, Any]:
    async def check() -> dict | None:
        await c.finish_deletions(tag)
        job = await c.job(tag, tag)
        status = (job or {}).get("status") or {}
        return status if predicate(status) else None
    return await eventually(check, timeout=timeout, what=f"job {tag}: {what}")


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


async def delete_and_wait(c: Cluster, tag: str) -> None:
    await c.delete_job(tag, tag)
    await eventually(lambda: _gone(c, tag), what=f"job {tag} deleted (finalizer released)")


async def _gone(c: Cluster, tag: str) -> bool:
    return await c.job(tag, tag) is None


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


async def scenario_create_children(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    nodes = await add_nodes(c, tag, 2)
    job = await c.create_job(scenario_job(tag))
    pods = await wait_pods(c, tag, 2)
    uid = (await c.job(tag, tag))["metadata"]["uid"]
    pinned = set()
    for index, pod in enumerate(pods):
        env = env_of(pod)
        assert pod["metadata"]["name"] == f"{tag}-host-{index}"
        assert env["NODE_RANK"] == str(index) and env["WORLD_SIZE"] == "4" and env["PET_NNODES"] == "2"
        assert env["MASTER_ADDR"] == f"{tag}-host-0.{tag}.{tag}.svc"
        assert pod["metadata"]["labels"][names.HOST_INDEX_LABEL] == str(index)
        assert [o["uid"] for o in pod["metadata"]["ownerReferences"]] == [uid]
        term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        pinned.update(term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])
    assert pinned == set(nodes)  # one pod per node
    svc = await c.get("services", tag, tag)
    cm = await c.get("configmaps", f"{tag}-plan", tag)
    assert svc["spec"]["clusterIP"] == "None" and "plan.json" in cm["data"]
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Created", "phase Created")
    assert status["hosts"] == 2 and {p["node"] for p in status["placement"]} == set(nodes)
    assert condition(status, "Created")["status"] == "True"
    assert job["metadata"]["name"] == tag
    await delete_and_wait(c, tag)


async def scenario_runs_reports_progress_and_succeeds(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, run_policy={"ttlSecondsAfterFinished": 2, "cleanPodPolicy": "All"}))
    pods = await wait_pods(c, tag, 2)
    for step, pod in zip((7, 5), pods):
        await c.set_pod_phase(pod["metadata"]["name"], "Running", tag,
                              annotations={names.STEP_ANNOTATION: str(step), names.CHECKPOINT_ANNOTATION: "4"})
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Running" and s.get("step") == 5, "Running at step 5")
    assert status["checkpointStep"] == 4 and condition(status, "Running")["status"] == "True"
    assert set(status["pods"].values()) == {"Running"}
    for pod in pods:
        await c.set_pod_phase(pod["metadata"]["name"], "Succeeded", tag)
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Succeeded", "Succeeded")
    assert status["completionTime"] and condition(status, "Succeeded")["reason"] == "AllPodsSucceeded"
    assert condition(status, "Running")["status"] == "False"
    await wait_pods(c, tag, 0)  # cleanPodPolicy All
    await eventually(lambda: _gone(c, tag), timeout=20, what="job deleted by ttlSecondsAfterFinished")


async def scenario_gang_restart_then_failed(c: Cluster, tag: str, metrics: Any = None) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, run_policy={"backoffLimit": 1, "cleanPodPolicy": "All"}))
    first = await wait_pods(c, tag, 2)
    before = metrics.restarts._value.get() if metrics is not None else 0.0
    await c.set_pod_phase(first[1]["metadata"]["name"], "Failed", tag)
    status = await wait_status(c, tag, lambda s: s.get("restarts") == 1 and not s.get("restartPending"), "restart 1")
    assert condition(status, "Restarting")["status"] == "True"
    assert f"pod {tag}-host-1 failed" in condition(status, "Restarting")["message"]
    second = await wait_pods(c, tag, 2, phase="Pending")
    if c.real:  # recreated, not kept: new uids
        assert {p["metadata"]["uid"] for p in second}.isdisjoint({p["metadata"]["uid"] for p in first})
    if metrics is not None:
        assert metrics.restarts._value.get() == before + 1
    await c.set_pod_phase(second[0]["metadata"]["name"], "Failed", tag)
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Failed", "Failed after backoffLimit")
    failed = condition(status, "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit=1" in failed["message"]
    assert status["restarts"] == 1
    await wait_pods(c, tag, 0)
    await delete_and_wait(c, tag)


async def scenario_suspend_and_resume(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag))
    await wait_pods(c, tag, 2)
    await c.patch_job(tag, {"spec": {"runPolicy": {"suspend": True}}}, tag)
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Suspended", "Suspended")
    assert condition(status, "Suspended")["status"] == "True"
    await wait_pods(c, tag, 0)
    await c.patch_job(tag, {"spec": {"runPolicy": {"suspend": False}}}, tag)
    await wait_pods(c, tag, 2)
    status = await wait_status(c, tag, lambda s: condition(s, "Suspended").get("status") == "False", "resumed")
    assert condition(status, "Suspended")["reason"] == "Resumed" and status["phase"] != "Suspended"
    await delete_and_wait(c, tag)


async def scenario_invalid_spec(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    body = scenario_job(tag)
    body["spec"]["stages"][1]["layers"] = [1, 3]  # past the model's 2 layers: the schema cannot tell
    await c.create_job(body)
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Failed", "Failed")
    failed = condition(status, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.stages[1].layers: [1, 3] is invalid" in failed["message"]

    async def warning() -> list[dict] | None:
        found = [e for e in await c.events(tag) if e.get("reason") == "InvalidSpec" and e.get("type") == "Warning"
                 and e.get("involvedObject", {}).get("name") == tag]
        return found or None
    events = await eventually(warning, what="a Warning Event InvalidSpec")
    assert "spec.stages[1].layers" in events[0]["message"]
    assert await c.pods(tag, tag) == []
    await delete_and_wait(c, tag)


async def scenario_unschedulable_until_a_node_appears(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 1)
    await c.create_job(scenario_job(tag))
    status = await wait_status(c, tag, lambda s: condition(s, "Unschedulable").get("status") == "True", "Unschedulable")
    message = condition(status, "Unschedulable")["message"]
    assert "missing 1 host" in message and f"example.com/{tag}" in message
    assert await c.pods(tag, tag) == []
    await add_nodes(c, tag, 1, start=1)
    await wait_pods(c, tag, 2)
    status = await wait_status(c, tag, lambda s: condition(s, "Unschedulable").get("status") == "False", "scheduled")
    assert condition(status, "Unschedulable")["reason"] == "Scheduled"
    await delete_and_wait(c, tag)


async def scenario_deletion_removes_children(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag))
    pods = await wait_pods(c, tag, 2)
    uid = (await c.job(tag, tag))["metadata"]["uid"]
    await delete_and_wait(c, tag)
    if c.real:  # kube-controller-manager's garbage collector follows the owner references
        await wait_pods(c, tag, 0, timeout=30)
        await eventually(lambda: _absent(c, "configmaps", f"{tag}-plan", tag), timeout=30, what="configmap gone")
        await eventually(lambda: _absent(c, "services", tag, tag), timeout=30, what="service gone")
    else:  # kmock has no garbage collector: the children are owned, so a real cluster removes them
        for pod in pods:
            owner = pod["metadata"]["ownerReferences"][0]
            assert owner["uid"] == uid and owner["controller"] and owner["blockOwnerDeletion"]


async def _absent(c: Cluster, plural: str, name: str, ns: str) -> bool:
    return await c.get(plural, name, ns) is None


async def scenario_activeDeadline_fails_the_job(c: Cluster, tag: str) -> None:
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, run_policy={"activeDeadlineSeconds": 2, "cleanPodPolicy": "Running"}))
    await wait_pods(c, tag, 2)
    status = await wait_status(c, tag, lambda s: s.get("phase") == "Failed", "Failed by deadline", timeout=30)
    assert condition(status, "Failed")["reason"] == "DeadlineExceeded"
    await wait_pods(c, tag, 0)
    await delete_and_wait(c, tag)


async def scenario_operator_killed_mid_creation(c: Cluster, tag: str) -> None:
    """The operator dies after creating 2 of 4 pods; a new one creates the rest, once each."""
    from meshjob_operator.handlers import STATE

    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 4)
    async with running_operator(c) as op:
        kube = STATE.reconciler.kube
        original = kube.create_if_absent
        created: list[str] = []

        async def dying(body: dict[str, Any], plural: str, path: str | None = None) -> bool:
            result = await original(body, plural, path)
            if plural == "pods":
                created.append(body["metadata"]["name"])
                if len(created) == 2:
                    op.kill()  # killed: no graceful stop, no status written after this point
                    await asyncio.sleep(3600)
            return result

        kube.create_if_absent = dying  # type: ignore[method-assign]
        await c.create_job(scenario_job(tag, hosts=4))
        await eventually(lambda: _dead(op), what="the first operator killed")
    survivors = await c.pods(tag, tag)
    assert 1 <= len(survivors) <= 4
    async with running_operator(c):
        pods = await wait_pods(c, tag, 4)
        assert [p["metadata"]["name"] for p in pods] == [f"{tag}-host-{i}" for i in range(4)]
        if c.real:  # the survivors were kept, not recreated
            kept = {p["metadata"]["name"]: p["metadata"]["uid"] for p in survivors}
            assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods if p["metadata"]["name"] in kept} == kept
        status = await wait_status(c, tag, lambda s: s.get("hosts") == 4 and len(s.get("pods") or {}) == 4, "4 pods")
        assert not status.get("restarts")
        await asyncio.sleep(0.5)  # a later reconcile must not add anything
        assert len(await c.pods(tag, tag)) == 4
        await delete_and_wait(c, tag)


async def _dead(op: OperatorThread) -> bool:
    return not op.alive


async def scenario_restart_counted_once_across_operator_restart(c: Cluster, tag: str) -> None:
    """The operator died after recording a gang restart but before deleting pods: no second count."""
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    async with running_operator(c):
        await c.create_job(scenario_job(tag, run_policy={"backoffLimit": 3}))
        pods = await wait_pods(c, tag, 2)
        await wait_status(c, tag, lambda s: s.get("hosts") == 2, "hosts recorded")
    await c.set_pod_phase(pods[0]["metadata"]["name"], "Failed", tag)
    await c.kube.patch_job_status(tag, tag, {"restarts": 1, "restartPending": True, "phase": "Restarting"})
    async with running_operator(c):
        status = await wait_status(c, tag, lambda s: not s.get("restartPending") and len(s.get("pods") or {}) == 2,
                                   "restart finished")
        new = await wait_pods(c, tag, 2, phase="Pending")
        assert status["restarts"] == 1
        if c.real:
            assert {p["metadata"]["uid"] for p in new}.isdisjoint({p["metadata"]["uid"] for p in pods})
        await delete_and_wait(c, tag)


async def scenario_deleted_pod_restarts_the_gang(c: Cluster, tag: str) -> None:
    """A host pod deleted by someone else (eviction, drain) breaks the gang: restart all of it."""
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, run_policy={"backoffLimit": 3}))
    pods = await wait_pods(c, tag, 2)
    await wait_status(c, tag, lambda s: len(s.get("pods") or {}) == 2, "pods recorded")
    await c.kube.delete_pod(tag, pods[1]["metadata"]["name"])
    status = await wait_status(c, tag, lambda s: s.get("restarts") == 1 and not s.get("restartPending"), "restart 1")
    assert f"pod {tag}-host-1 disappeared" in condition(status, "Restarting")["message"]
    await wait_pods(c, tag, 2)
    await asyncio.sleep(0.5)
    assert (await c.job(tag, tag))["status"]["restarts"] == 1  # the planned deletions are not counted again
    await delete_and_wait(c, tag)


# scheduler-plugins' PodGroup, reduced to what the operator writes (a real API server needs the CRD)
PODGROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.x-k8s.io"},
    "spec": {"group": "scheduling.x-k8s.io", "scope": "Namespaced",
             "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup", "shortNames": ["pg"]},
             "versions": [{"name": "v1alpha1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "properties": {"spec": {"type": "object", "properties": {
                     "minMember": {"type": "integer", "format": "int32"}}}}}}}]},
}


async def install_podgroup_crd(c: Cluster) -> None:
    if c.real:
        await c.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json.loads(json.dumps(PODGROUP_CRD)))
        await asyncio.to_thread(kubectl, c.kubeconfig, "wait", "--for=condition=Established",
                                "crd/podgroups.scheduling.x-k8s.io", "--timeout=60s")


async def scenario_gang_scheduling(c: Cluster, tag: str) -> None:
    """spec.scheduling (part of the CRD: a real API server keeps it) gives a PodGroup, the gang scheduler,
    Kueue labels; the operator's trainer ServiceAccount goes on pods whose spec names none."""
    await prepare_namespace(c, tag)
    await install_podgroup_crd(c)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, scheduling={"gang": True, "queue": "team"}))
    stored = await c.job(tag, tag)
    assert stored["spec"]["scheduling"] == {"gang": True, "queue": "team"}  # not pruned
    pods = await wait_pods(c, tag, 2)
    group = await c.kube.request("GET", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{tag}/podgroups/{tag}")
    assert group["spec"]["minMember"] == 2
    assert [o["uid"] for o in group["metadata"]["ownerReferences"]] == [stored["metadata"]["uid"]]
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == tag
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"
        assert pod["spec"]["serviceAccountName"] == TRAINER_SERVICE_ACCOUNT
    await delete_and_wait(c, tag)


async def scenario_spec_service_account(c: Cluster, tag: str) -> None:
    """spec.serviceAccountName (kept by a real API server) wins over the operator's trainer account."""
    await prepare_namespace(c, tag)
    await add_nodes(c, tag, 2)
    await c.create_job(scenario_job(tag, serviceAccountName="team-trainer"))
    assert (await c.job(tag, tag))["spec"]["serviceAccountName"] == "team-trainer"
    pods = await wait_pods(c, tag, 2)
    assert {p["spec"]["serviceAccountName"] for p in pods} == {"team-trainer"}
    await delete_and_wait(c, tag)


TRAINER_SERVICE_ACCOUNT = "meshjob-trainer"
