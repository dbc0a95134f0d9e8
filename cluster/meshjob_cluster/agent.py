"""The node agent: a kubelet's part for meshjob's pods, one asyncio process per Node of the local cluster.

It registers its Node and keeps it Ready (its Lease in kube-node-lease and the Ready condition's heartbeat,
every 10 s), watches the pods bound to it, runs each container (meshjob_cluster.container) with its volumes
and its network, reports phase and container states through the pods' status subresource, and on deletion
stops the containers (SIGTERM, the grace period, SIGKILL), removes the pod's folders and deletes the pod
object. Each container's output is kept as a log file under the state folder (`python -m
meshjob_cluster.agent logs ...` prints it: there is no kubelet API, so no `kubectl logs`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import inspect
import json
import logging
import os
import platform
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes  # only for reading the credentials (kubeconfig or in-cluster)

from meshjob_cluster import container as ctr
from meshjob_cluster import images as image_store
from meshjob_cluster import volumes as pod_volumes
from meshjob_cluster.network import MAX_NODES, ClusterNetwork
from meshjob_cluster.podnet import NodePods
from meshjob_cluster.podspec import ImageConfig, PodPlace, PodSpecError, container_run

log = logging.getLogger("meshjob_cluster.agent")

MERGE_PATCH = "application/merge-patch+json"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
CONFIG_ERROR = "CreateContainerConfigError"
AGENT_RESTARTED = "NodeAgentRestarted"
MIN_GRACE_S = 2  # a kubelet's minimum grace period (a forced deletion still gets it)
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"  # a kubelet's default terminationMessagePath
TERMINATION_MESSAGE_MAX = 4096  # bytes of it a kubelet reports

# pod -> where it runs (its address, network namespace, hosts file); sync or async
PodNetwork = Callable[[Mapping[str, Any]], "PodPlace | Awaitable[PodPlace]"]
# pod -> None: the pod has ended, its address may go back
PodNetworkRelease = Callable[[Mapping[str, Any]], "None | Awaitable[None]"]


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """A Lease's MicroTime."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


# --- the API ---------------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str):
        self.status, self.message = status, message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Api:
    """Raw JSON over aiohttp; the credentials are the kubernetes package's (kubeconfig, or in-cluster)."""

    def __init__(self, kubeconfig: str | None = None):
        config = kubernetes.client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG")
        if path:
            kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
        else:
            kubernetes.config.load_incluster_config(client_configuration=config)
        self._config = config
        self.server = config.host.rstrip("/")
        self.ca_file: str | None = config.ssl_ca_cert
        context: ssl.SSLContext | bool = True
        if self.server.startswith("https"):
            context = ssl.create_default_context(cafile=config.ssl_ca_cert if config.verify_ssl else None)
            if not config.verify_ssl:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if config.cert_file:
                context.load_cert_chain(config.cert_file, config.key_file)
        self._ssl = context
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        token = self._config.get_api_key_with_prefix("authorization", alias="BearerToken")
        if not token:
            return {}
        return {"Authorization": token if " " in token else f"Bearer {token}"}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32),
                timeout=aiohttp.ClientTimeout(total=30),
                read_bufsize=2**20,  # a watch event is one line, a pod can be large
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = content_type
        data = None if body is None else json.dumps(body)
        try:
            async with self._http().request(
                method, self.server + path, data=data, headers=headers, params=params
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise ApiError(503, method, path, f"connection error: {err!r}") from err
        if resp.status >= 400:
            try:
                message = str(json.loads(text).get("message", text))
            except (ValueError, AttributeError):
                message = text
            raise ApiError(resp.status, method, path, message[:500])
        return json.loads(text) if text else None

    async def get(self, path: str) -> Any:
        """The object, or None where it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def watch(self, path: str, params: Mapping[str, str], timeout_s: int) -> AsyncIterator[dict[str, Any]]:
        """The watch events of one request (it ends when the server closes it after `timeout_s`)."""
        query = {**params, "watch": "1", "timeoutSeconds": str(timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s + 30)
        try:
            async with self._http().get(
                self.server + path, params=query, headers=self._headers(), timeout=timeout
            ) as resp:
                if resp.status >= 400:
                    raise ApiError(resp.status, "WATCH", path, (await resp.text())[:500])
                async for line in resp.content:
                    if line.strip():
                        yield json.loads(line)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise ApiError(503, "WATCH", path, f"connection error: {err!r}") from err


# --- the Node ------------------------------------------------------------------------------------------------


def _memory_total() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1])}Ki"
    return "8Gi"


@dataclass(frozen=True)
class NodeConfig:
    """What the Node says of itself: its name, address, labels and what pods may ask of it."""

    name: str
    address: str = "127.0.0.1"
    devices: int = 0
    device_resource: str = ""  # e.g. example.com/gpu (a count of `devices`); none where empty
    cpu: str = field(default_factory=lambda: str(os.cpu_count() or 1))
    memory: str = field(default_factory=_memory_total)
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)

    def resources(self) -> dict[str, str]:
        out = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.max_pods)}
        if self.device_resource:
            out[self.device_resource] = str(self.devices)
        return out

    def all_labels(self) -> dict[str, str]:
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        return {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": arch,
            **self.labels,
        }


# --- one pod ---------------------------------------------------------------------------------------------------


class _Missing(Exception):
    """An object a reader was asked for that was not fetched before: fetch it, then try again."""

    def __init__(self, kind: str, namespace: str, name: str):
        self.ref = (kind, namespace, name)


def _decode(data: Mapping[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in (data or {}).items()}


def referenced_objects(pod: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every ConfigMap and Secret the pod's volumes and env read."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    spec = pod.get("spec", {})
    refs: set[tuple[str, str, str]] = set()
    for volume in spec.get("volumes") or []:
        if "configMap" in volume:
            refs.add(("configMap", namespace, volume["configMap"]["name"]))
        if "secret" in volume:
            refs.add(("secret", namespace, volume["secret"]["secretName"]))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                refs.add(("configMap", namespace, source["configMap"]["name"]))
            if "secret" in source:
                refs.add(("secret", namespace, source["secret"]["name"]))
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for item in c.get("env") or []:
            source = item.get("valueFrom") or {}
            for kind in ("configMap", "secret"):
                if f"{kind}KeyRef" in source:
                    refs.add((kind, namespace, source[f"{kind}KeyRef"]["name"]))
    return refs


def _proc_start_time(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat): a pid with another start time is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie has ended: it only waits to be reaped)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    """The process's exit status, awaited without a thread (a pidfd; polling where there is none)."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        fd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):
        while proc.poll() is None:
            await asyncio.sleep(0.2)
        return proc.returncode
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


def exit_code(returncode: int) -> int:
    """As a container runtime reports it: killed by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class _Container:
    spec: Mapping[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    exit_task: asyncio.Task[int] | None = None
    scratch: Path | None = None
    container_id: str = ""
    started_at: str = ""
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    last_exit: int | None = None  # the exit code of its last run
    finished: bool = False  # exited, and is not restarted
    next_try: float = 0.0  # monotonic time of its next (re)start
    log_offset: int = 0  # where its current run's output starts in its log
    image_id: str = ""  # the built image its current run started from (empty: this machine's files)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.proc is not None,
            "started": self.proc is not None,
            "restartCount": self.restarts,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


class PodWorker:
    """Everything about one pod bound to this Node, from its start to its end."""

    def __init__(self, agent: Agent, pod: Mapping[str, Any]):
        self.agent = agent
        self.pod: Mapping[str, Any] = pod
        meta = pod["metadata"]
        self.uid, self.name, self.namespace = meta["uid"], meta["name"], meta.get("namespace", "default")
        self.changed = asyncio.Event()
        self.gone = False  # the object no longer exists
        self.dir = agent.state_dir / "pods" / self.uid
        self.place: PodPlace | None = None
        self.volumes: dict[str, Path] | None = None
        self.containers = [_Container(c) for c in pod["spec"]["containers"]]
        self.start_time = ""
        self.conditions: dict[str, tuple[str, str]] = {}  # type -> (status, lastTransitionTime)
        self.reported: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    @property
    def deleting(self) -> bool:
        return self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy") or "Always")

    def update(self, pod: Mapping[str, Any] | None) -> None:
        if pod is None:
            self.gone = True
        else:
            self.pod = pod
        self.changed.set()

    # --- the lifecycle ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._live()
            if self.agent.stopping:
                await self._terminate(min(self._grace(), self.agent.shutdown_grace_s))
            elif self.deleting:
                await self._terminate(self._grace())
                if not self.gone:
                    await self._report()
            else:
                await self._kill_leftovers()
        finally:
            self.kill_now()
            await self._clean_up()
        if self.deleting and not self.gone and not self.agent.stopping:
            await self.agent.final_delete(self.namespace, self.name, self.uid)

    async def _live(self) -> None:
        """Start, report and restart the containers until the pod ends, is deleted or the agent stops."""
        if not self.start_time:
            self.start_time = now()
        if self.pod["spec"].get("initContainers"):
            message = "spec.initContainers: not supported by this node agent"
            for c in self.containers:
                c.state = {"waiting": {"reason": CONFIG_ERROR, "message": message}}
                c.next_try = float("inf")
        while not (self.deleting or self.agent.stopping):
            await self._start_due()
            await self._report()
            if self.phase() in ("Succeeded", "Failed") or self.gone:
                return
            await self._wait()
            self._collect_exits()

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(max(int(grace), MIN_GRACE_S))

    async def _wait(self) -> None:
        """Until a container exits, the pod changes or a container is due to (re)start."""
        waits: set[asyncio.Future[Any]] = {c.exit_task for c in self.containers if c.exit_task is not None}
        changed = asyncio.ensure_future(self.changed.wait())
        waits.add(changed)
        due = [c.next_try for c in self.containers if c.proc is None and not c.finished and c.next_try < float("inf")]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not changed.done():
            changed.cancel()
        self.changed.clear()

    def _log_tail(self, c: _Container) -> str:
        """A kubelet's fallback termination message: the last 80 lines (2 KiB at most) of this run's output."""
        try:
            with open(self.agent.log_path(self.namespace, self.name, c.name), "rb") as log:
                log.seek(c.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-80:])[-2048:]

    def _termination_file(self, c: _Container, run: ctr.ContainerRun) -> ctr.Mount:
        """A kubelet's termination message file: empty at each start, writable by the container's user,
        seen at its terminationMessagePath."""
        path = self.dir / "termination" / c.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        os.chown(path, run.uid, run.gid)
        return ctr.Mount(path, str(c.spec.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH))

    def _termination_message(self, c: _Container, code: int) -> str:
        """What the container wrote to its termination message file (4 KiB at most, as a kubelet reads it);
        with FallbackToLogsOnError and nothing written, the tail of its log when it failed."""
        try:
            with open(self.dir / "termination" / c.name, "rb") as f:
                written = f.read(TERMINATION_MESSAGE_MAX).decode(errors="replace")
        except OSError:
            written = ""
        if not written and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            return self._log_tail(c)
        return written

    def _collect_exits(self) -> None:
        for c in self.containers:
            if c.exit_task is None or not c.exit_task.done() or c.proc is None:
                continue
            code = exit_code(c.exit_task.result())
            _killpg(c.proc.pid, signal.SIGKILL)  # what it left behind in its group dies with it
            self._ended(c, code)
            restart = self.policy == "Always" or (self.policy == "OnFailure" and code != 0)
            if restart:
                delay = min(self.agent.backoff_s * 2**c.restarts, self.agent.backoff_max_s)
                c.next_try = time.monotonic() + delay
                c.last_state, c.state = (
                    c.state,
                    {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:g}s restarting"}},
                )
            else:
                c.finished = True

    def _ended(self, c: _Container, code: int) -> None:
        c.state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_at,
                "finishedAt": now(),
                "containerID": c.container_id,
            }
        }
        message = self._termination_message(c, code)
        if message:
            c.state["terminated"]["message"] = message
        c.last_exit = code
        if c.scratch is not None:
            ctr.remove_scratch(c.scratch)
        c.proc, c.exit_task, c.scratch = None, None, None
        (self.dir / "pids" / c.name).unlink(missing_ok=True)

    async def _start_due(self) -> None:
        for c in self.containers:
            if c.proc is not None or c.finished or c.next_try > time.monotonic():
                continue
            try:
                await self._start(c)
            except Exception as err:  # the container cannot start now: say why, try again later
                message = str(err.message if isinstance(err, ApiError) else err)
                expected = isinstance(err, (PodSpecError, ApiError, OSError))
                log.info(
                    "pod %s/%s container %s: %s", self.namespace, self.name, c.name, message, exc_info=not expected
                )
                waiting = {"waiting": {"reason": CONFIG_ERROR, "message": message}}
                if c.last_exit is None:
                    c.state = waiting
                else:
                    c.state, c.last_state = waiting, c.last_state or c.state
                c.next_try = time.monotonic() + self.agent.retry_s

    async def _start(self, c: _Container) -> None:
        objects = await self.agent.fetch_objects(referenced_objects(self.pod))
        for _ in range(3):  # an object not fetched above: fetch it too, then once more
            try:
                await self._prepare(objects)
                run = await self._container_run(c.spec, objects)
                break
            except _Missing as missing:
                objects.update(await self.agent.fetch_objects({missing.ref}))
        else:
            raise PodSpecError(f"container {c.name}: the objects it reads keep changing")
        run = replace(run, mounts=(*run.mounts, self._termination_file(c, run)))
        self.agent.logs.mkdir(parents=True, exist_ok=True)
        log_file = self.agent.log_path(self.namespace, self.name, c.name)
        c.log_offset = log_file.stat().st_size if log_file.exists() else 0
        proc, scratch = ctr.start(run, log_file)
        pids = self.dir / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / c.name).write_text(f"{proc.pid} {_proc_start_time(proc.pid)}\n")
        if c.last_exit is not None:  # a restart: its last run stays as lastState
            c.restarts += 1
        c.proc, c.scratch, c.started_at = proc, scratch, now()
        if self.agent.images:  # the image it runs from, by digest (as a kubelet reports it)
            name = str(c.spec["image"])
            c.image_id = f"{image_store.local_name(name)}@{(await self.agent.image(name))[1].digest}"
        c.container_id = f"meshjob://{proc.pid}"
        c.exit_task = asyncio.ensure_future(wait_exit(proc))
        c.state = {"running": {"startedAt": c.started_at}}
        log.info("pod %s/%s container %s started (pid %d)", self.namespace, self.name, c.name, proc.pid)

    async def _prepare(self, objects: Mapping[tuple[str, str, str], Mapping[str, str] | None]) -> None:
        """The pod's network and volumes, once (the first time they can be made)."""
        if self.place is None:
            place = await _maybe_await(self.agent.pod_network(self.pod))
            self.place = replace(place, scratch=self.dir / "scratch")
            self.place.scratch.mkdir(parents=True, exist_ok=True)
        if self.volumes is None:
            token = await self._service_account_token()

            def read_object(kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
                if (kind, namespace, name) not in objects:
                    raise _Missing(kind, namespace, name)
                return objects[(kind, namespace, name)]

            self.volumes = pod_volumes.prepare(
                self.pod, self.dir / "volumes", read_object, self.agent.claims, service_account=token
            )

    async def _service_account_token(self) -> Callable[[], pod_volumes.ServiceAccountFiles] | None:
        """A token for the pod's ServiceAccount (TokenRequest), where a projected volume asks for one."""
        sources = [
            s["serviceAccountToken"]
            for v in self.pod["spec"].get("volumes") or []
            for s in (v.get("projected") or {}).get("sources") or []
            if "serviceAccountToken" in s
        ]
        if not sources:
            return None
        account = self.pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": int(sources[0].get("expirationSeconds", 3600)),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
        }
        if sources[0].get("audience"):
            spec["audiences"] = [sources[0]["audience"]]
        answer = await self.agent.api.request(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        files = pod_volumes.ServiceAccountFiles(token=answer["status"]["token"], ca_crt=self.agent.ca_crt())
        return lambda: files

    async def _container_run(
        self, spec: Mapping[str, Any], objects: Mapping[tuple[str, str, str], Mapping[str, str] | None]
    ) -> ctr.ContainerRun:
        assert self.place is not None and self.volumes is not None

        def read_key(kind: str, namespace: str, name: str, key: str) -> str | None:
            if (kind, namespace, name) not in objects:
                raise _Missing(kind, namespace, name)
            return (objects[(kind, namespace, name)] or {}).get(key)

        # this machine as the image: its files, and the PATH its installed commands (meshjob) are found on
        lower, image = Path("/"), ImageConfig(env=(f"PATH={os.environ.get('PATH', ctr.DEFAULT_PATH)}",))
        if self.agent.images:
            if not spec.get("image"):
                raise PodSpecError(f"container {spec['name']}: image: none given")
            lower, image = await self.agent.image(str(spec["image"]))
        run = container_run(self.pod, spec, self.volumes, self.place, read_key, lower, image)
        declared = {item["name"] for item in spec.get("env") or []}
        env = dict(run.env)
        for key, value in self.agent.service_env().items():
            if key not in declared:
                env[key] = value
        if self.agent.images:
            return replace(run, env=env)
        # On this machine's files as another user: its interpreter and the folder pods start in must be readable,
        # and stay visible under the pod's volumes (an emptyDir at /tmp would hide a checkout or venv there).
        opened = tuple(dict.fromkeys(p for p in (sys.prefix, sys.base_prefix, run.workdir) if p != "/"))
        through = tuple(
            ctr.Mount(Path(p), p, read_only=True) for p in opened if p not in {m.target for m in run.mounts}
        )
        return replace(run, env=env, opened=opened, mounts=run.mounts + through)

    async def _terminate(self, grace: float) -> None:
        """SIGTERM to each container's process group, `grace` seconds, then SIGKILL."""
        running = [c for c in self.containers if c.proc is not None]
        for c in running:
            assert c.proc is not None
            log.info("pod %s/%s container %s: SIGTERM (grace %gs)", self.namespace, self.name, c.name, grace)
            _killpg(c.proc.pid, signal.SIGTERM)
        tasks = [c.exit_task for c in running if c.exit_task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for c in running:
            assert c.proc is not None
            _killpg(c.proc.pid, signal.SIGKILL)
        if tasks:
            await asyncio.wait(tasks)
        for c in running:  # what the command started in its group goes too, before the container is ended
            assert c.proc is not None
            deadline = time.monotonic() + 10
            while group_alive(c.proc.pid) and time.monotonic() < deadline:
                _killpg(c.proc.pid, signal.SIGKILL)
                await asyncio.sleep(0.1)
        for c in running:
            if c.exit_task is not None and c.proc is not None:
                self._ended(c, exit_code(c.exit_task.result()))
                c.finished = True

    async def _kill_leftovers(self) -> None:
        """After the pod ended: anything still running in a finished container's group (none, normally)."""
        await self._terminate(0)

    def kill_now(self) -> None:
        """SIGKILL whatever still runs, and reap it (the last resort: the agent is going away)."""
        for c in self.containers:
            if c.proc is not None:
                _killpg(c.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(10)
                deadline = time.monotonic() + 10
                while group_alive(c.proc.pid) and time.monotonic() < deadline:
                    _killpg(c.proc.pid, signal.SIGKILL)
                    time.sleep(0.1)
                if c.exit_task is not None and not c.exit_task.done():
                    c.exit_task.cancel()
                self._ended(c, exit_code(c.proc.returncode if c.proc.returncode is not None else -9))

    async def _clean_up(self) -> None:
        """The pod's own folders (scratch, volumes; not its claims), and its network."""
        for c in self.containers:
            if c.scratch is not None:
                ctr.remove_scratch(c.scratch)
        pod_volumes.remove(self.volumes or {}, self.dir / "volumes")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.place is not None and self.agent.release_network is not None:
            try:
                await _maybe_await(self.agent.release_network(self.pod))
            except Exception:  # a failed release must not keep the pod from ending
                log.exception("pod %s/%s: releasing its network", self.namespace, self.name)
            self.place = None

    # --- the status ------------------------------------------------------------------------------------------

    def phase(self) -> str:
        """A kubelet's rule (getPhase) over the containers' states."""
        waiting = running = stopped = succeeded = 0
        for c in self.containers:
            if c.proc is not None:
                running += 1
            elif c.last_exit is not None:
                stopped += 1
                succeeded += c.last_exit == 0
            else:
                waiting += 1
        if waiting:
            return "Pending"
        if running:
            return "Running"
        if self.policy == "Always":
            return "Running"
        if self.policy == "OnFailure":
            return "Succeeded" if succeeded == stopped else "Running"
        return "Succeeded" if succeeded == stopped else "Failed"

    def _condition(self, kind: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
        previous = self.conditions.get(kind)
        if previous is None or previous[0] != status:
            self.conditions[kind] = (status, now())
        out = {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": self.conditions[kind][1]}
        if reason:
            out["reason"] = reason
        if message:
            out["message"] = message
        return out

    def status(self) -> dict[str, Any]:
        phase = self.phase()
        unready = [c.name for c in self.containers if c.proc is None]
        ready = "False" if unready else "True"
        ended = phase in ("Succeeded", "Failed")
        reason = "PodCompleted" if ended else ("ContainersNotReady" if unready else "")
        message = f"containers with unready status: [{' '.join(unready)}]" if unready and not ended else ""
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": self.place.host_ip if self.place else self.agent.node.address,
            "startTime": self.start_time,
            "conditions": [
                self._condition("Initialized", "True"),
                self._condition("Ready", ready, reason, message),
                self._condition("ContainersReady", ready, reason, message),
                self._condition("PodScheduled", "True"),
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.place is not None:
            status["podIP"] = self.place.pod_ip
            status["podIPs"] = [{"ip": self.place.pod_ip}]
        return status

    async def _report(self) -> None:
        """Merge-patch the status subresource where it changed; a pod that no longer exists is gone."""
        status = self.status()
        if status == self.reported or self.gone:
            return
        for attempt in range(5):
            try:
                await self.agent.api.request(
                    "PATCH",
                    self.path + "/status",
                    {"metadata": {"uid": self.uid}, "status": status},
                    content_type=MERGE_PATCH,
                )
                self.reported = status
                return
            except ApiError as err:
                if err.status in (404, 409, 422) and await self._replaced():
                    self.gone = True
                    return
                log.warning("pod %s/%s: status not reported (%s)", self.namespace, self.name, err)
                if self.agent.stopping:
                    return
                await asyncio.sleep(min(2**attempt, 10))

    async def _replaced(self) -> bool:
        try:
            found = await self.agent.api.get(self.path)
        except ApiError:
            return False
        return found is None or found["metadata"]["uid"] != self.uid


# --- the agent -------------------------------------------------------------------------------------------------


def host_network(state_dir: Path, address: str) -> PodNetwork:
    """Pods on the host's network (no namespace): their address is the Node's, and a hosts file maps the pod's
    hostname (and hostname.subdomain, the headless Service's names) to it. What runs without network.py."""

    def place(pod: Mapping[str, Any]) -> PodPlace:
        meta, spec = pod["metadata"], pod["spec"]
        namespace = meta.get("namespace", "default")
        hostname = spec.get("hostname") or meta["name"]
        names = [hostname]
        if spec.get("subdomain"):
            sub = f"{hostname}.{spec['subdomain']}"
            names += [sub, f"{sub}.{namespace}.svc", f"{sub}.{namespace}.svc.cluster.local"]
        hosts = state_dir / "hosts" / f"{namespace}_{meta['name']}"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{address}\t{' '.join(names)}\n")
        hosts.chmod(0o644)
        return PodPlace(pod_ip=address, node_name=spec.get("nodeName", ""), host_ip=address, hosts_file=hosts)

    return place


class Agent:
    """One Node's agent. `await agent.run()` until `agent.stop()`; every container is stopped on the way out."""

    def __init__(
        self,
        kubeconfig: str | None,
        node: NodeConfig,
        *,
        pod_network: PodNetwork,
        claims: Path,
        state_dir: Path,
        release_network: PodNetworkRelease | None = None,
        images: bool = False,
        api_host: str = "",
        api_port: int | str = "",
        heartbeat_s: float = 10.0,
        retry_s: float = 3.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        shutdown_grace_s: float = 10.0,
    ):
        self.kubeconfig = kubeconfig
        self.node = node
        self.pod_network = pod_network
        self.release_network = release_network
        self.claims = claims
        self.state_dir = state_dir
        self.logs = state_dir / "logs"
        self.images = images
        self.api_host, self.api_port = api_host, str(api_port)
        self.heartbeat_s, self.retry_s = heartbeat_s, retry_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.shutdown_grace_s = shutdown_grace_s
        self.stopping = False
        self.workers: dict[str, PodWorker] = {}
        self._done: set[str] = set()  # uids of pods this agent has ended (or will not run)
        self._deleting: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._images: dict[str, tuple[Path, ImageConfig]] = {}
        self._ready_since = now()
        self.api: Api

    # --- running -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.stopping:
            return
        self.api = Api(self.kubeconfig)
        try:
            self._kill_previous()
            await self._register()
            if self.stopping:
                return
            beat = asyncio.ensure_future(self._heartbeat())
            watch = asyncio.ensure_future(self._watch_pods())
            await self._stop.wait()
            for task in (beat, watch):
                task.cancel()
            await asyncio.gather(beat, watch, return_exceptions=True)
        finally:
            self.stopping = True
            await self._shutdown()
            await self.api.close()

    def stop(self) -> None:
        """Stop the agent (from its loop: a signal handler; other threads: `stop_threadsafe`)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()
        for worker in self.workers.values():
            worker.changed.set()

    def stop_threadsafe(self) -> None:
        if self._loop is None:
            self.stopping = True
        else:
            self._loop.call_soon_threadsafe(self.stop)

    async def _shutdown(self) -> None:
        for worker in self.workers.values():
            worker.changed.set()
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.shutdown_grace_s + 30)
        for task in tasks:
            task.cancel()
        for worker in list(self.workers.values()):
            worker.kill_now()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", what, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def _kill_previous(self) -> None:
        """Containers an earlier run of this agent left (it was killed): killed, their folders removed."""
        pods = self.state_dir / "pods"
        for pidfile in pods.glob("*/pids/*"):
            with contextlib.suppress(ValueError, OSError):
                pid_text, started = pidfile.read_text().split()
                pid = int(pid_text)
                if _proc_start_time(pid) == started:
                    log.info("killing pid %d, left by an earlier run of this agent", pid)
                    _killpg(pid, signal.SIGKILL)
        shutil.rmtree(pods, ignore_errors=True)

    # --- the Node ------------------------------------------------------------------------------------------

    def _conditions(self) -> list[dict[str, Any]]:
        beat = now()
        pressure = [
            ("MemoryPressure", "KubeletHasSufficientMemory"),
            ("DiskPressure", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "KubeletHasSufficientPID"),
        ]
        out = [
            {
                "type": kind,
                "status": "False",
                "reason": reason,
                "message": "",
                "lastHeartbeatTime": beat,
                "lastTransitionTime": self._ready_since,
            }
            for kind, reason in pressure
        ]
        out.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "meshjob node agent is posting ready status",
                "lastHeartbeatTime": beat,
                "lastTransitionTime": self._ready_since,
            }
        )
        return out

    def _node_status(self) -> dict[str, Any]:
        return {
            "capacity": self.node.resources(),
            "allocatable": self.node.resources(),
            "addresses": [
                {"type": "InternalIP", "address": self.node.address},
                {"type": "Hostname", "address": self.node.name},
            ],
            "conditions": self._conditions(),
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "meshjob local cluster",
                "containerRuntimeVersion": "meshjob://0.1.0",
                "kubeletVersion": "v1.20.2",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": self.node.all_labels()["kubernetes.io/arch"],
            },
        }

    async def _register(self) -> None:
        """Create the Node (status included, as a kubelet does), or bring an existing one up to date."""
        path = f"/api/v1/nodes/{self.node.name}"
        while not self.stopping:
            try:
                if await self.api.get(path) is None:
                    body = {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {"name": self.node.name, "labels": self.node.all_labels()},
                        "spec": {},
                        "status": self._node_status(),
                    }
                    await self.api.request("POST", "/api/v1/nodes", body)
                else:
                    labels = {"metadata": {"labels": self.node.all_labels()}}
                    await self.api.request("PATCH", path, labels, content_type=MERGE_PATCH)
                    await self.api.request(
                        "PATCH", path + "/status", {"status": self._node_status()}, content_type=MERGE_PATCH
                    )
                log.info("node %s registered", self.node.name)
                return
            except ApiError as err:
                if err.status not in (409, 429, 500, 502, 503, 504):
                    raise
                log.warning("node %s: not registered yet (%s)", self.node.name, err)
                await asyncio.sleep(1)

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._renew_lease()
                await self.api.request(
                    "PATCH",
                    f"/api/v1/nodes/{self.node.name}/status",
                    {"status": {"conditions": self._conditions()}},
                    content_type=MERGE_PATCH,
                )
            except ApiError as err:
                log.warning("node %s: heartbeat failed (%s)", self.node.name, err)
                if err.status == 404:  # the Node was deleted: register it again
                    with contextlib.suppress(ApiError):
                        await self._register()
            await asyncio.sleep(self.heartbeat_s)

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node.name}"
        try:
            await self.api.request("PATCH", path, {"spec": {"renewTime": micro_now()}}, content_type=MERGE_PATCH)
            return
        except ApiError as err:
            if err.status != 404:
                raise
        node = await self.api.request("GET", f"/api/v1/nodes/{self.node.name}")
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node.name, "uid": node["metadata"]["uid"]}
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
            "spec": {"holderIdentity": self.node.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_now()},
        }
        await self.api.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", body)

    # --- the pods ------------------------------------------------------------------------------------------

    async def _watch_pods(self) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.node.name}"}
        version: str | None = None
        while True:
            try:
                if version is None:
                    listed = await self.api.request("GET", "/api/v1/pods", params=params)
                    version = str(listed["metadata"]["resourceVersion"])
                    self._reconcile(listed.get("items") or [])
                watch_params = {**params, "resourceVersion": version, "allowWatchBookmarks": "true"}
                async for event in self.api.watch("/api/v1/pods", watch_params, timeout_s=300):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # 410 Gone: the version is too old; anything else: start over too
                        log.info("pod watch: %s", obj.get("message"))
                        version = None
                        break
                    version = str(obj["metadata"]["resourceVersion"])
                    if kind != "BOOKMARK":
                        self.on_pod(obj, gone=kind == "DELETED")
            except ApiError as err:
                log.warning("pod watch: %s", err)
                version = None
                await asyncio.sleep(1)

    def _reconcile(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """A full list: every pod as an event; a known pod missing from it is gone."""
        present = {p["metadata"]["uid"] for p in pods}
        for pod in pods:
            self.on_pod(pod)
        for uid, worker in list(self.workers.items()):
            if uid not in present:
                worker.update(None)
        self._done &= present

    def on_pod(self, pod: Mapping[str, Any], gone: bool = False) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(None if gone else pod)
            return
        if gone:
            self._done.discard(uid)
            self._deleting.discard(uid)
            return
        if meta.get("deletionTimestamp"):  # not running here: nothing to stop
            if uid not in self._deleting:
                self._deleting.add(uid)
                self._spawn(self.final_delete(meta.get("namespace", "default"), meta["name"], uid), "final delete")
            return
        if uid in self._done or self.stopping:
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self._done.add(uid)
        elif phase == "Running":  # started by an earlier run of this agent: its processes are gone
            self._done.add(uid)
            self._spawn(self._mark_restarted(pod), "marking a pod failed")
        else:
            self._start_worker(pod)

    def _start_worker(self, pod: Mapping[str, Any]) -> None:
        worker = PodWorker(self, pod)
        self.workers[worker.uid] = worker
        meta = pod["metadata"]
        log.info("pod %s/%s: starting", meta.get("namespace"), meta["name"])

        def ended(_: asyncio.Task[Any]) -> None:
            self.workers.pop(worker.uid, None)
            if not worker.gone:
                self._done.add(worker.uid)

        self._spawn(worker.run(), f"pod {meta.get('namespace')}/{meta['name']}").add_done_callback(ended)

    async def _mark_restarted(self, pod: Mapping[str, Any]) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        finished = now()
        containers = []
        for c in status.get("containerStatuses") or []:
            state = c.get("state") or {}
            if "terminated" not in state:
                started = (state.get("running") or {}).get("startedAt")
                state = {
                    "terminated": {
                        "exitCode": 137,
                        "reason": AGENT_RESTARTED,
                        "message": "the node agent restarted: the container's process is gone",
                        "startedAt": started,
                        "finishedAt": finished,
                    }
                }
            containers.append({**c, "state": state, "ready": False, "started": False})
        conditions = [
            {**c, "status": "False", "reason": AGENT_RESTARTED, "lastTransitionTime": finished}
            if c.get("type") in ("Ready", "ContainersReady") and c.get("status") != "False"
            else c
            for c in status.get("conditions") or []
        ]
        patch = {
            "metadata": {"uid": meta["uid"]},
            "status": {
                "phase": "Failed",
                "reason": AGENT_RESTARTED,
                "message": f"the node agent of {self.node.name} restarted while the pod ran",
                "conditions": conditions,
                "containerStatuses": containers,
            },
        }
        path = f"/api/v1/namespaces/{meta.get('namespace', 'default')}/pods/{meta['name']}/status"
        with contextlib.suppress(ApiError):
            await self.api.request("PATCH", path, patch, content_type=MERGE_PATCH)
            log.info("pod %s/%s: Failed (%s)", meta.get("namespace"), meta["name"], AGENT_RESTARTED)

    async def final_delete(self, namespace: str, name: str, uid: str) -> None:
        """A kubelet's last word on a pod it has stopped: delete the object now (grace period 0)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        for attempt in range(5):
            try:
                await self.api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)
                log.info("pod %s/%s: deleted", namespace, name)
                return
            except ApiError as err:
                if err.status in (404, 409):  # gone, or another pod of that name now
                    return
                log.warning("pod %s/%s: not deleted (%s)", namespace, name, err)
                await asyncio.sleep(min(2**attempt, 10))

    # --- what the pods read --------------------------------------------------------------------------------

    async def fetch_objects(
        self, refs: set[tuple[str, str, str]]
    ) -> dict[tuple[str, str, str], Mapping[str, str] | None]:
        """ConfigMaps' and Secrets' data (decoded), None where one does not exist."""
        out: dict[tuple[str, str, str], Mapping[str, str] | None] = {}
        for kind, namespace, name in sorted(refs):
            plural = "configmaps" if kind == "configMap" else "secrets"
            found = await self.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
            if found is None:
                out[(kind, namespace, name)] = None
            elif kind == "secret":
                out[(kind, namespace, name)] = _decode(found.get("data"))
            else:
                out[(kind, namespace, name)] = {**_decode(found.get("binaryData")), **(found.get("data") or {})}
        return out

    def ca_crt(self) -> str:
        return Path(self.api.ca_file).read_text() if self.api.ca_file else ""

    def service_env(self) -> dict[str, str]:
        """What a kubelet puts in every container: where the API server is."""
        if not self.api_host:
            return {}
        return {
            "KUBERNETES_SERVICE_HOST": self.api_host,
            "KUBERNETES_SERVICE_PORT": self.api_port,
            "KUBERNETES_SERVICE_PORT_HTTPS": self.api_port,
        }

    async def image(self, name: str) -> tuple[Path, ImageConfig]:
        if name not in self._images:
            self._images[name] = await asyncio.to_thread(image_store.image_root, name)
        return self._images[name]

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.logs / f"{namespace}_{pod}_{container}.log"


# --- the command line ------------------------------------------------------------------------------------------


def pod_logs(state_dir: Path, namespace: str, pod: str, container: str | None = None) -> dict[str, str]:
    """Container name -> its log (every run of it), as the agent of `state_dir` kept it."""
    logs = state_dir / "logs"
    pattern = f"{namespace}_{pod}_{container or '*'}.log"
    return {
        p.name[len(f"{namespace}_{pod}_") : -len(".log")]: p.read_text(errors="replace") for p in logs.glob(pattern)
    }


def _logs_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshjob_cluster.agent logs", description="a pod's container logs")
    parser.add_argument("pod")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("-c", "--container")
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    found = pod_logs(args.state_dir, args.namespace, args.pod, args.container)
    if not found:
        print(f"no log of pod {args.namespace}/{args.pod} under {args.state_dir}", file=sys.stderr)
        return 1
    for name, text in sorted(found.items()):
        if len(found) > 1:
            sys.stdout.write(f"==> {name} <==\n")
        sys.stdout.write(text)
    return 0


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label {text!r}: expected KEY=VALUE")
    return key, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m meshjob_cluster.agent",
        description="Run one Node's agent (or `logs POD -n NS --state-dir DIR` to print a pod's log).",
    )
    p.add_argument("--kubeconfig", help="default: $KUBECONFIG, else the in-cluster account")
    p.add_argument("--node", required=True, help="the Node's name")
    p.add_argument("--devices", type=int, default=0, help="how many devices the Node has")
    p.add_argument("--device-resource", default="", help="the devices' resource name, e.g. example.com/gpu")
    p.add_argument("--cpu", default=str(os.cpu_count() or 1))
    p.add_argument("--memory", default=_memory_total())
    p.add_argument("--max-pods", type=int, default=110)
    p.add_argument("--address", default="127.0.0.1", help="the Node's InternalIP")
    p.add_argument("--claims", type=Path, required=True, help="the claims' folder, shared by all Nodes")
    p.add_argument("--state-dir", type=Path, help="default: /tmp/meshjob-agent-NODE")
    p.add_argument("--images", action="store_true", help="run containers in their built images (buildah)")
    p.add_argument("--api-host", default="", help="KUBERNETES_SERVICE_HOST in every container")
    p.add_argument("--api-port", default="", help="KUBERNETES_SERVICE_PORT in every container")
    p.add_argument("--label", type=_label, action="append", default=[], help="KEY=VALUE, a Node label")
    p.add_argument(
        "--node-index",
        type=int,
        help="this Node's index on the cluster network (meshjob cluster up); without it, pods use the host's network",
    )
    p.add_argument("--network-prefix", default="mjc", help="the cluster network's namespace prefix")
    return p


def main(
    argv: Sequence[str] | None = None,
    pod_network: PodNetwork | None = None,
    release_network: PodNetworkRelease | None = None,
) -> int:
    """Run one agent until SIGTERM/SIGINT. Without `pod_network`, pods use the host's network
    (`host_network`): the caller that owns the Nodes' network passes its own."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["logs"]:
        return _logs_main(args_list[1:])
    args = parser().parse_args(args_list)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state_dir = args.state_dir or Path(f"/tmp/meshjob-agent-{args.node}")
    node = NodeConfig(
        name=args.node,
        address=args.address,
        devices=args.devices,
        device_resource=args.device_resource,
        cpu=args.cpu,
        memory=args.memory,
        max_pods=args.max_pods,
        labels=dict(args.label),
    )
    pods: NodePods | None = None
    if pod_network is None and args.node_index is not None:
        # the cluster network `meshjob cluster up` laid: a namespace and address per pod, names kept current
        network = ClusterNetwork(nodes=MAX_NODES, prefix=args.network_prefix)
        pods = NodePods(network, args.node_index, state_dir, args.node)
        pod_network, release_network = pods.place, pods.release
    agent = Agent(
        args.kubeconfig,
        node,
        pod_network=pod_network or host_network(state_dir, args.address),
        release_network=release_network,
        claims=args.claims,
        state_dir=state_dir,
        images=args.images,
        api_host=args.api_host,
        api_port=args.api_port,
    )

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        names = None
        if pods is not None:
            lister = Api(args.kubeconfig)

            async def list_pods() -> list[dict[str, Any]]:
                try:
                    listed = await lister.get("/api/v1/pods")
                except ApiError as err:
                    raise OSError(str(err)) from err
                items: list[dict[str, Any]] = listed["items"] if listed else []
                return items

            names = asyncio.create_task(pods.keep_names(list_pods))
        try:
            await agent.run()
        finally:
            if names is not None:
                names.cancel()
                await lister.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
