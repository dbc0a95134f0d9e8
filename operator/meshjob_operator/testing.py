"""Clusters to test the operator against, and the operator run in-process (as `kopf.testing` is for kopf).

Used by the tests and by the operator benchmark (`meshjob bench operator`), so it ships with the package;
nothing in the operator itself imports it. Both clusters offer the same small API (`Cluster`), so a
scenario is written once and runs against both:
  * kmock's in-memory API server over HTTP (`kmock_cluster`; the `kmock` package, a test dependency);
    its quirks are handled here: cluster-wide operator, declared resources, uid/resourceVersion put
    into the bodies we create, PATCH only, label selectors ignored;
  * a real kube-apiserver v1.20 with etcd and kube-controller-manager (`envtest_cluster`): the folder
    named by KUBEBUILDER_ASSETS (controller-runtime's convention) with its start.sh/stop.sh, distinct
    ports and state per run, ServiceAccount admission on as on every real cluster.
No kubelet runs in either: a test plays the kubelet by patching pod status (`Cluster.set_pod_phase`).
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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kopf
import yaml

from meshjob.spec.crd import crd_yaml
from meshjob_operator import names
from meshjob_operator.kube import MERGE_PATCH, ApiError, Connection, Kube

if TYPE_CHECKING:  # kmock is optional (meshjob-operator[testing]): imported where a kmock cluster starts
    import kmock

JOBS = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{{ns}}/{names.PLURAL}"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def envtest_assets() -> Path | None:
    """controller-runtime's convention: KUBEBUILDER_ASSETS names a folder with kube-apiserver (and here
    its start.sh); etcd comes from PATH."""
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if (
        folder
        and (Path(folder) / "kube-apiserver").exists()
        and (Path(folder) / "start.sh").exists()
        and shutil.which("etcd")
    ):
        return Path(folder)
    return None


def node_body(
    name: str,
    devices: int,
    *,
    resource: str = "cpu",
    rack: str = "",
    ready: bool = True,
    unschedulable: bool = False,
    host_label: str = "kubernetes.io/hostname",
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    all_labels = {host_label: name, **(labels or {})}
    if rack:
        all_labels["topology.kubernetes.io/zone"] = rack
    spec: dict[str, Any] = {"unschedulable": unschedulable}
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": spec,
        "status": {
            "allocatable": {resource: str(devices), "pods": "110"},
            "capacity": {resource: str(devices), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def job_body(
    name: str,
    namespace: str = "default",
    *,
    hosts: int = 2,
    devices_per_host: int = 2,
    run_policy: dict[str, Any] | None = None,
    **spec_overrides: Any,
) -> dict[str, Any]:
    """A small valid TrainingJob: stage 0 on one host's devices, stage 1 over `hosts - 1` hosts."""
    stages = [{"layers": [0, 1], "mesh": [1, devices_per_host], "tensorParallelDim": 1}]
    if hosts > 1:
        stages.append(
            {"layers": [1, 2], "mesh": [hosts - 1, devices_per_host], "dataParallelDim": 0, "tensorParallelDim": 1}
        )
    spec: dict[str, Any] = {
        "image": "meshjob/trainer:test",
        "model": {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16},
        "training": {
            "steps": 3,
            "globalBatch": 8 * max(1, hosts - 1),
            "microbatches": 2,
            "checkpoint": {"every": 1, "path": "/ckpt", "volume": {"emptyDir": {}}},
        },
        "topology": {"devicesPerHost": devices_per_host},
        "stages": stages,
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "naive"},
        "schedule": {"kind": "1f1b", "weightGradDelay": 0},
        "runPolicy": {"backoffLimit": 2, "cleanPodPolicy": "All", **(run_policy or {})},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout: float = 15.0, interval: float = 0.1, what: str = "condition"
) -> Any:
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


# --- the clusters ------------------------------------------------------------------------------


class Cluster:
    """What a scenario needs from a cluster; subclasses differ only in setup and quirks."""

    kubeconfig: Path
    kube: Kube
    real: bool = False  # a real API server (GC by kube-controller-manager, admission, status subresource, ...)

    def _stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.kube.request("POST", path, self._stamp(body))

    async def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A namespace as a user finds it (with `labels`): on a real cluster with its `default` ServiceAccount."""

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

    async def set_pod_phase(
        self,
        pod: str,
        phase: str,
        namespace: str = "default",
        *,
        ip: str | None = None,
        exit_code: int = 1,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """Play the kubelet: report a pod's phase (and its IP, where its metrics endpoint is); a Succeeded pod
        given a `message` reports it as its trainer's termination message."""
        status: dict[str, Any] = {"phase": phase}
        if ip:
            status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
        if reason:
            status["reason"] = reason
        if phase == "Failed":
            status["containerStatuses"] = [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}},
                }
            ]
        if phase == "Succeeded" and message is not None:
            ended = {"exitCode": 0, "reason": "Completed", "message": message}
            status["containerStatuses"] = [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {"terminated": ended},
                }
            ]
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
        await self.kube.request("PATCH", path, {"status": status}, content_type=MERGE_PATCH)

    async def set_pod_scheduled(self, pod: str, namespace: str = "default", *, unschedulable: str = "") -> None:
        """Play the scheduler: condition PodScheduled, False with reason Unschedulable and its message
        when `unschedulable` says why the pod fits no node."""
        cond = (
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
            if unschedulable
            else {"type": "PodScheduled", "status": "True"}
        )
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
        await self.kube.request("PATCH", path, {"status": {"conditions": [cond]}}, content_type=MERGE_PATCH)

    async def finish_deletions(self, namespace: str = "default") -> None:
        """Play the kubelet for terminating pods (none on kmock: deletion is immediate there)."""

    async def forbid_pods(self, namespace: str) -> str:
        """From now on the operator's requests for pods in `namespace` are refused with 403 Forbidden;
        returns the API's message (or a part of it)."""
        raise NotImplementedError

    async def allow_pods(self, namespace: str) -> None:
        """Undo forbid_pods."""
        raise NotImplementedError

    async def events(self, namespace: str = "default") -> list[dict[str, Any]]:
        found = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")
        return (found or {}).get("items") or []

    async def get(self, plural: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return await self.kube.get(namespace, plural, name)


class KmockCluster(Cluster):
    forbidden: set[str]  # namespaces where pod creation is refused (forbid_pods)
    emulator: kmock.KubernetesEmulator  # fault injection in tests

    async def forbid_pods(self, namespace: str) -> str:
        """kmock stores even a create it answers with an error, so the listing is what is refused here."""
        self.forbidden.add(namespace)
        return KMOCK_REFUSAL

    async def allow_pods(self, namespace: str) -> None:
        self.forbidden.discard(namespace)

    async def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """kmock keeps no Namespace (its core cluster-scoped paths do not parse): one with labels is served as is,
        one without is none (the operator reads no labels then, as of an unlabelled one)."""
        if labels:
            body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
            path = f"/api/v1/namespaces/{name}"
            self.emulator[lambda r: r.method.upper() == "GET" and str(r.url).split("?")[0].endswith(path)] << body

    def _refused(self, request: Any) -> bool:
        path = str(request.url).split("?")[0]
        return request.method.upper() == "GET" and any(path.endswith(f"/namespaces/{ns}/pods") for ns in self.forbidden)

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


KMOCK_RESOURCES = [  # (resource, kind, namespaced, subresources)
    ("v1/namespaces", "Namespace", False, ()),
    ("v1/nodes", "Node", False, ("status",)),
    ("v1/pods", "Pod", True, ("status",)),
    ("v1/services", "Service", True, ()),
    ("v1/configmaps", "ConfigMap", True, ()),
    ("v1/events", "Event", True, ()),
    ("events.k8s.io/v1/events", "Event", True, ()),
    (f"{names.GROUP}/{names.VERSION}/{names.PLURAL}", names.KIND, True, ("status",)),
    ("scheduling.x-k8s.io/v1alpha1/podgroups", "PodGroup", True, ()),
    ("admissionregistration.k8s.io/v1/validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False, ()),
]


KMOCK_REFUSAL = 'pods is forbidden: User "kmock" cannot list resource "pods" in the namespace'


def _kubeconfig(server: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    }


@contextlib.asynccontextmanager
async def kmock_cluster() -> AsyncIterator[KmockCluster]:
    """kmock's in-memory API server, served over HTTP in this event loop."""
    import kmock  # here, not at the top: an optional dependency (meshjob-operator[testing]); envtest needs none

    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        for res, kind, namespaced, subresources in KMOCK_RESOURCES:
            emulator.resources[res] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources=set(subresources),
                verbs={"list", "watch", "get", "create", "patch", "delete"},
            )
        emulator.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "default", "uid": "ns-default"},
        }
        tmp = Path(tempfile.mkdtemp(prefix="meshjob-kmock-"))
        cluster = KmockCluster()
        cluster.kubeconfig = tmp / "kubeconfig"
        cluster.kubeconfig.write_text(yaml.safe_dump(_kubeconfig(str(server.url).rstrip("/"))))
        cluster.kube = Kube(Connection.load(str(cluster.kubeconfig)))
        cluster.emulator = emulator
        cluster.forbidden = set()
        emulator[cluster._refused] << kmock.KubernetesError(status=403, reason="Forbidden", message=KMOCK_REFUSAL)
        try:
            yield cluster
        finally:
            await cluster.kube.close()
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Envtest:
    """etcd + kube-apiserver v1.20 (RBAC on) + kube-controller-manager from the assets' start.sh, on 127.0.0.1.

    `service_account_admission` as on every real cluster (a pod naming a missing ServiceAccount is
    refused; the controller manager creates each namespace's `default` account); `audit` logs every
    request (Metadata level) to `audit_log`."""

    assets: Path
    workdir: Path
    controller_manager: bool = True
    service_account_admission: bool = True
    audit: bool = False

    @property
    def kubeconfig(self) -> Path:
        """Written by start.sh when the API server is up."""
        return self.workdir / "run" / "kubeconfig"

    def _env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "KAS_DIR": str(self.workdir),
            "KAS_KCM": "1" if self.controller_manager else "0",
            "KAS_SA_ADMISSION": "1" if self.service_account_admission else "0",
            "ETCD_PORT": str(self.ports[0]),
            "ETCD_PEER_PORT": str(self.ports[1]),
            "APISERVER_PORT": str(self.ports[2]),
            "KCM_PORT": str(self.ports[3]),
            "APISERVER_BIN": str(self.assets / "kube-apiserver"),
        }
        if (self.assets / "kube-controller-manager").exists():
            env["KCM_BIN"] = str(self.assets / "kube-controller-manager")
        if self.audit:
            env["APISERVER_BIN"] = str(self.workdir / "kube-apiserver-audited")
        return env

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def _audit_wrapper(self) -> None:
        """start.sh runs APISERVER_BIN with its own flags; this wrapper adds the audit log to them."""
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        wrapper = self.workdir / "kube-apiserver-audited"
        wrapper.write_text(
            f'#!/bin/sh\nexec "{self.assets / "kube-apiserver"}" "$@" '
            f'--audit-policy-file="{policy}" --audit-log-path="{self.audit_log}" '
            f"--audit-log-mode=blocking\n"
        )
        wrapper.chmod(0o755)

    def start(self) -> Envtest:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = (free_port(), free_port(), free_port(), free_port())
        if self.audit:
            self._audit_wrapper()
        result = subprocess.run(
            ["bash", str(self.assets / "start.sh")], env=self._env(), capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"envtest did not start:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        if self.service_account_admission:
            self.wait_for_default_service_account("default")
        return self

    def stop(self) -> None:
        subprocess.run(["bash", str(self.assets / "stop.sh")], env=self._env(), capture_output=True, timeout=60)

    def __enter__(self) -> Envtest:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        kubeconfig: Path | None = None,
        check: bool = True,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["kubectl", f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def apply(self, docs: list[dict[str, Any]]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def wait_established(self, *crds: str, timeout_s: float = 60) -> None:
        """Until the CRDs (names, or "--all") are Established; `kubectl wait` fails outright, not waits, while a
        CRD just applied has no conditions yet."""
        deadline = time.monotonic() + timeout_s
        targets = ["crd", "--all"] if crds == ("--all",) else [f"crd/{c}" for c in crds]
        while True:
            done = self.kubectl(
                "wait", "--for=condition=Established", *targets, f"--timeout={timeout_s:g}s", check=False
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRDs {list(crds)} not Established: {done.stderr.strip()}")
            time.sleep(0.5)

    def wait_for_default_service_account(self, namespace: str, timeout_s: float = 30) -> None:
        """The controller manager creates it (and its token) shortly after the namespace: wait, as a user
        never meets a namespace without it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.kubectl("-n", namespace, "get", "serviceaccount", "default", "-o", "json", check=False)
            if found.returncode == 0 and json.loads(found.stdout).get("secrets"):
                return
            time.sleep(0.2)
        raise TimeoutError(f"no default ServiceAccount (with its token) in namespace {namespace} after {timeout_s} s")

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount (TokenRequest API)."""
        token = self.kubectl("-n", namespace, "create", "token", service_account, "--duration=1h").stdout.strip()
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["users"] = [{"name": "sa", "user": {"token": token}}]
        config["contexts"] = [
            {"name": "sa", "context": {"cluster": config["clusters"][0]["name"], "user": "sa", "namespace": namespace}}
        ]
        config["current-context"] = "sa"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def audited_requests(self, username: str) -> list[dict[str, Any]]:
        """Completed resource requests of one user, from the audit log."""
        events = []
        if self.audit_log.exists():
            for line in self.audit_log.read_text().splitlines():
                event = json.loads(line)
                if (
                    event.get("user", {}).get("username") == username
                    and event.get("stage") == "ResponseComplete"
                    and "objectRef" in event
                ):  # not discovery (/api, /apis: open to everyone)
                    events.append(event)
        return events


class EnvtestCluster(Cluster):
    real = True
    envtest: Envtest

    async def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        metadata: dict[str, Any] = {"name": name, **({"labels": labels} if labels else {})}
        await self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
        if self.envtest.service_account_admission:
            await asyncio.to_thread(self.envtest.wait_for_default_service_account, name)

    async def add_node(self, name: str, devices: int, **kwargs: Any) -> None:
        """Also plays the node lifecycle controller (not run here): the API server taints a new Node
        not-ready, and a Ready node loses that taint."""
        await super().add_node(name, devices, **kwargs)
        if kwargs.get("ready", True):
            node = await self.kube.request("GET", f"/api/v1/nodes/{name}")
            taints = [t for t in node["spec"].get("taints") or [] if t.get("key") != "node.kubernetes.io/not-ready"]
            await self.kube.request(
                "PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": taints or None}}, content_type=MERGE_PATCH
            )

    async def finish_deletions(self, namespace: str = "default") -> None:
        found = await self.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        for pod in (found or {}).get("items") or []:
            if pod["metadata"].get("deletionTimestamp"):
                await self.kube.request(
                    "DELETE",
                    f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
                    {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
                )

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self.envtest.kubectl(*args, input=input, check=check)

    async def forbid_pods(self, namespace: str) -> str:
        """A ResourceQuota of zero pods, once the controller manager has counted its usage."""
        await self.create(
            f"/api/v1/namespaces/{namespace}/resourcequotas",
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": "zero-pods"},
                "spec": {"hard": {"pods": "0"}},
            },
        )

        async def counted() -> bool:
            quota = await self.kube.get(namespace, "resourcequotas", "zero-pods")
            return bool(((quota or {}).get("status") or {}).get("hard"))

        await eventually(counted, timeout=30, what=f"the ResourceQuota of namespace {namespace} counted")
        return "exceeded quota: zero-pods"

    async def allow_pods(self, namespace: str) -> None:
        await self.kube.delete(f"/api/v1/namespaces/{namespace}/resourcequotas/zero-pods")


@contextlib.asynccontextmanager
async def envtest_cluster(assets: Path, **options: Any) -> AsyncIterator[EnvtestCluster]:
    """A real API server (Envtest options) with the TrainingJob CRD installed and established."""
    workdir = Path(tempfile.mkdtemp(prefix="meshjob-envtest-"))
    envtest = Envtest(assets, workdir, **options)
    try:
        await asyncio.to_thread(envtest.start)
        await asyncio.to_thread(envtest.kubectl, "apply", "-f", "-", input=crd_yaml())
        await asyncio.to_thread(envtest.wait_established, f"{names.PLURAL}.{names.GROUP}")
        cluster = EnvtestCluster()
        cluster.envtest, cluster.kubeconfig = envtest, envtest.kubeconfig
        cluster.kube = Kube(Connection.load(str(cluster.kubeconfig)))
        try:
            yield cluster
        finally:
            await cluster.kube.close()
    finally:
        await asyncio.to_thread(envtest.stop)
        shutil.rmtree(workdir, ignore_errors=True)


# --- the operator, in this process ---------------------------------------------------------------


class OperatorThread:
    """kopf in its own thread and event loop, as in a real process: the test's loop stays its own."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        webhook: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        liveness: str | None = None,
    ):
        self.cluster, self.webhook = cluster, webhook  # webhook: OperatorConfig fields, None = off
        self.liveness = liveness  # kopf's liveness endpoint, e.g. http://127.0.0.1:PORT/healthz
        self.config = config or {}  # other OperatorConfig fields
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="kopf-operator", daemon=True)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(
            kopf.operator(
                clusterwide=True,
                standalone=True,
                stop_flag=self.stop_flag,
                ready_flag=self.ready_flag,
                liveness_endpoint=self.liveness,
            )
        )
        try:
            self.loop.run_until_complete(self.task)
        except BaseException as err:  # noqa: BLE001 (kept for the test to see)
            self.error = err
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def start(self) -> None:
        # here, not at the top: importing the handlers registers them with kopf, which only a started operator wants
        from meshjob_operator.handlers import STATE, OperatorConfig

        os.environ["KUBECONFIG"] = str(self.cluster.kubeconfig)
        STATE.config = OperatorConfig(
            metrics_port=None,
            webhook=self.webhook is not None,
            kubeconfig=str(self.cluster.kubeconfig),
            **(self.webhook or {}),
            **self.config,
        )
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
async def running_operator(
    cluster: Cluster,
    *,
    webhook: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    liveness: str | None = None,
) -> AsyncIterator[OperatorThread]:
    """The operator (cluster-wide, standalone, this package's handlers) for the duration of the block."""
    op = OperatorThread(cluster, webhook=webhook, config=config, liveness=liveness)
    await op.start()
    try:
        yield op
    finally:
        await op.stop()
