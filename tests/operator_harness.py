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
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import yaml

from meshjob.operator import names
from meshjob.operator.kube import MERGE_PATCH, ApiError, Connection, Kube

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


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, *, webhook: bool = False) -> AsyncIterator[asyncio.Task]:
    """kopf in this event loop (cluster-wide, standalone), with this package's handlers."""
    import kopf

    from meshjob.operator.handlers import STATE, OperatorConfig

    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)  # kopf's login reads it
    STATE.config = OperatorConfig(metrics_port=None, webhook=webhook, kubeconfig=str(cluster.kubeconfig))
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), timeout=20)
        yield task
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout=15)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()


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
