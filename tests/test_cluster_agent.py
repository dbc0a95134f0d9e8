"""The node agent plays the kubelet against the real control plane (API server, scheduler, controller manager
with the node lifecycle controller): its Node registers and becomes Ready (the not-ready taint lifted), the
scheduler binds pods to it, their containers run on this machine's files (no image) and end as the pods
say; a deleted pod gets SIGTERM, its grace period, then SIGKILL; a missing ConfigMap is a config error until
it exists; the agent leaves no process behind when it stops, and marks the pods it lost Failed on restart."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshjob_cluster import agent as node_agent
from meshjob_cluster.podspec import PodPlace

ROOT = Path(__file__).resolve().parents[1]
NODE = "node-1"
GPU = "example.com/gpu"


def _assets() -> Path | None:
    folder = Path(os.environ.get("KUBEBUILDER_ASSETS") or ROOT.parent / "shared" / "envtest")
    needed = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "start.sh", "stop.sh")
    if all((folder / name).exists() for name in needed) and shutil.which("etcd") and shutil.which("kubectl"):
        return folder
    return None


ASSETS = _assets()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent's containers need root (mount namespaces, chroot)"),
    pytest.mark.skipif(ASSETS is None, reason="no envtest binaries (KUBEBUILDER_ASSETS or ../shared/envtest)"),
]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def eventually(check: Callable[[], Any], what: str, timeout_s: float = 180) -> Any:
    """The first truthy value of `check`, polled; generous: the machine is small and shared."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(1)


class ControlPlane:
    """etcd, the API server, the controller manager (node lifecycle on) and the scheduler, by start.sh."""

    def __init__(self, workdir: Path):
        assert ASSETS is not None
        etcd, peer, api, kcm, ks = _free_ports(5)
        self.api_port = api
        self.env = {
            **os.environ,
            "KAS_DIR": str(workdir),
            "ETCD_PORT": str(etcd),
            "ETCD_PEER_PORT": str(peer),
            "APISERVER_PORT": str(api),
            "KCM_PORT": str(kcm),
            "KS_PORT": str(ks),
            "KAS_SCHEDULER": "1",
            "KAS_SA_ADMISSION": "1",
            "KAS_NODE_LIFECYCLE": "1",
        }
        self.kubeconfig = workdir / "run" / "kubeconfig"

    def start(self) -> None:
        assert ASSETS is not None
        done = subprocess.run(
            ["bash", str(ASSETS / "start.sh")], env=self.env, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"the control plane did not start:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def stop(self) -> None:
        assert ASSETS is not None
        subprocess.run(["bash", str(ASSETS / "stop.sh")], env=self.env, capture_output=True, timeout=120)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def get(self, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        done = self.kubectl("-n", namespace, "get", kind, name, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr or "not found" in done.stderr:
                return None
            raise RuntimeError(done.stderr)
        return json.loads(done.stdout)

    def apply(self, *docs: Mapping[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("envtest"))
    plane.start()
    try:

        def default_account() -> bool:
            account = plane.get("serviceaccount", "default")
            return bool(account and account.get("secrets"))

        eventually(default_account, "the default ServiceAccount and its token")
        yield plane
    finally:
        plane.stop()


def loopback_network(folder: Path, node: str) -> node_agent.PodNetwork:
    """Every pod on 127.0.0.1; its hosts file maps its hostname and the headless Service's names to it."""

    def place(pod: Mapping[str, Any]) -> PodPlace:
        meta, spec = pod["metadata"], pod["spec"]
        hostname = spec.get("hostname") or meta["name"]
        names = [hostname]
        if spec.get("subdomain"):
            names += [f"{hostname}.{spec['subdomain']}", f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc"]
        hosts = folder / f"{meta['namespace']}_{meta['name']}.hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {' '.join(names)}\n")
        return PodPlace(pod_ip="127.0.0.1", node_name=node, host_ip="127.0.0.1", netns=None, hosts_file=hosts)

    return place


class AgentThread:
    """An Agent on its own event loop in a thread of the test process."""

    def __init__(self, agent: node_agent.Agent):
        self.agent = agent
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="node-agent", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.agent.run())
        except BaseException as err:  # re-raised in the test's thread by stop()
            self.error = err

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.agent.stop_threadsafe()
        self.thread.join(180)
        assert not self.thread.is_alive(), "the agent did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def agent(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[node_agent.Agent]:
    folder = tmp_path_factory.mktemp("agent")
    (folder / "hosts").mkdir()
    running = AgentThread(
        node_agent.Agent(
            str(cluster.kubeconfig),
            node_agent.NodeConfig(name=NODE, devices=2, device_resource=GPU, labels={"pool": "test"}),
            pod_network=loopback_network(folder / "hosts", NODE),
            claims=folder / "claims",
            state_dir=folder / "state",
            api_host="127.0.0.1",
            api_port=cluster.api_port,
            retry_s=2,
        )
    )
    running.start()
    try:
        yield running.agent
    finally:
        running.stop()
    assert not running.agent.workers


def pod(name: str, command: list[str], node: str = NODE, **spec: Any) -> dict[str, Any]:
    """A pod for the scheduler to bind (no nodeName), pinned to `node` by its hostname label."""
    container = {"name": "main", "image": "none", "command": command, **spec.pop("container", {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", **spec.pop("metadata", {})},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [container],
            **spec,
        },
    }


def phase_is(cluster: ControlPlane, name: str, *phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        found = cluster.get("pod", name)
        return found if found and found.get("status", {}).get("phase") in phases else None

    return check


def node_ready(cluster: ControlPlane, name: str) -> Callable[[], dict[str, Any] | None]:
    """The Node, once Ready and without the not-ready taint (lifted by the node lifecycle controller)."""

    def check() -> dict[str, Any] | None:
        node = cluster.get("node", name, namespace="default")
        if not node:
            return None
        ready = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}.get("Ready")
        tainted = any(t["key"] == node_agent.NOT_READY_TAINT for t in node["spec"].get("taints") or [])
        return node if ready == "True" and not tainted else None

    return check


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run (not a zombie waiting for its parent)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def container_pid(found: Mapping[str, Any]) -> int:
    container_id = found["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("meshjob://")
    return int(container_id.removeprefix("meshjob://"))


def test_the_node_registers_becomes_ready_and_loses_its_not_ready_taint(cluster, agent):
    node = eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == NODE
    assert node["metadata"]["labels"]["pool"] == "test"
    assert node["status"]["capacity"][GPU] == "2" and node["status"]["allocatable"][GPU] == "2"
    assert {"type": "InternalIP", "address": "127.0.0.1"} in node["status"]["addresses"]
    lease = cluster.get("lease", NODE, namespace="kube-node-lease")
    assert lease is not None and lease["spec"]["holderIdentity"] == NODE


PROBE = """
import os, socket
for key in ('POD_NAME', 'POD_IP', 'NODE_NAME', 'APP', 'KUBERNETES_SERVICE_HOST', 'KUBERNETES_SERVICE_PORT', 'HOSTNAME'):
    print(f'{key}={os.environ.get(key)}')
open('/scratch/note', 'w').write('written')
print('scratch:', open('/scratch/note').read())
print('resolves:', socket.gethostbyname('worker-0.workers'))
print('account namespace:', open('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read())
"""


def test_a_pod_is_bound_by_the_scheduler_runs_and_succeeds(cluster, agent, capsys):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
    ]
    cluster.apply(
        pod(
            "probe",
            ["python3", "-c", PROBE],
            metadata={"labels": {"app": "probe-app"}},
            hostname="worker-0",
            subdomain="workers",
            container={
                "env": env,
                "resources": {"limits": {GPU: "1"}},
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            },
            volumes=[{"name": "scratch", "emptyDir": {}}],
        )
    )
    done = eventually(phase_is(cluster, "probe", "Succeeded", "Failed"), "pod probe ended")
    log = (agent.state_dir / "logs" / "default_probe_main.log").read_text()
    assert done["status"]["phase"] == "Succeeded", log
    assert done["spec"]["nodeName"] == NODE  # bound by the scheduler: the pod named no node
    conditions = {c["type"]: c["status"] for c in done["status"]["conditions"]}
    assert conditions["PodScheduled"] == "True" and conditions["Initialized"] == "True"
    assert done["status"]["podIP"] == "127.0.0.1" and done["status"]["hostIP"] == "127.0.0.1"
    (status,) = done["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 0 and status["state"]["terminated"]["reason"] == "Completed"
    assert status["restartCount"] == 0 and status["containerID"].startswith("meshjob://")
    for line in (
        "POD_NAME=probe",
        "POD_IP=127.0.0.1",
        f"NODE_NAME={NODE}",
        "APP=probe-app",
        "KUBERNETES_SERVICE_HOST=127.0.0.1",
        f"KUBERNETES_SERVICE_PORT={cluster.api_port}",
        "HOSTNAME=worker-0",
        "scratch: written",
        "resolves: 127.0.0.1",
        "account namespace: default",  # the ServiceAccount admission's token volume (a Secret, decoded)
    ):
        assert line in log, log
    assert node_agent.pod_logs(agent.state_dir, "default", "probe") == {"main": log}
    assert node_agent.main(["logs", "probe", "-n", "default", "--state-dir", str(agent.state_dir)]) == 0
    assert "scratch: written" in capsys.readouterr().out
    # the pod's own folders (its emptyDir) go once it has ended
    eventually(lambda: not (agent.state_dir / "pods" / done["metadata"]["uid"]).exists(), "probe's folders removed")


def test_a_container_exiting_non_zero_fails_the_pod(cluster, agent):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    cluster.apply(pod("exits-3", ["sh", "-c", "echo failing; exit 3"]))
    done = eventually(phase_is(cluster, "exits-3", "Succeeded", "Failed"), "pod exits-3 ended")
    assert done["status"]["phase"] == "Failed"
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert "failing" in (agent.state_dir / "logs" / "default_exits-3_main.log").read_text()
    assert "message" not in terminated  # policy File, nothing written: no message


def test_the_termination_message_is_the_file_written_else_the_log_tail_on_failure(cluster, agent):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    cluster.apply(pod("summary", ["sh", "-c", "echo noise; printf '{\"loss\": 1.5}' > /dev/termination-log"]))
    cluster.apply(
        pod(
            "custom-path", ["sh", "-c", "echo why > /tmp/why; exit 4"], container={"terminationMessagePath": "/tmp/why"}
        )
    )
    cluster.apply(pod("fallback", ["sh", "-c", "echo first; echo last words; exit 5"], container=fallback))
    cluster.apply(pod("fine", ["sh", "-c", "echo all good"], container=fallback))
    messages = {}
    for name in ("summary", "custom-path", "fallback", "fine"):
        done = eventually(phase_is(cluster, name, "Succeeded", "Failed"), f"pod {name} ended")
        messages[name] = done["status"]["containerStatuses"][0]["state"]["terminated"].get("message")
    assert messages == {
        "summary": '{"loss": 1.5}',
        "custom-path": "why\n",
        "fallback": "first\nlast words",
        "fine": None,  # succeeded: its log is no message
    }


def test_a_deleted_pod_gets_sigterm_then_sigkill_and_its_object_goes(cluster, agent, tmp_path):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    out = tmp_path / "out"
    # traps SIGTERM (writes a file) and goes on: only the SIGKILL after the grace period ends it
    script = "trap 'echo term > /out/term' TERM; echo started > /out/started; while true; do sleep 1; done"
    cluster.apply(
        pod(
            "long",
            ["sh", "-c", script],
            container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
            volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}],
        )
    )
    running = eventually(phase_is(cluster, "long", "Running", "Succeeded", "Failed"), "pod long running")
    assert running["status"]["phase"] == "Running"
    assert running["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    pid = container_pid(running)
    eventually(lambda: (out / "started").exists(), "the container's command started")
    cluster.kubectl("delete", "pod", "long", "--grace-period=5", "--wait=false")
    eventually(lambda: cluster.get("pod", "long") is None, "pod long deleted")
    assert (out / "term").read_text() == "term\n"  # it got SIGTERM first
    assert group_members(pid) == []  # and nothing of it is left
    assert not any(p.name == running["metadata"]["uid"] for p in (agent.state_dir / "pods").glob("*"))


def test_a_missing_configmap_is_a_config_error_until_it_exists(cluster, agent):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    cluster.apply(
        pod(
            "needs-config",
            ["cat", "/config/greeting"],
            container={"volumeMounts": [{"name": "config", "mountPath": "/config"}]},
            volumes=[{"name": "config", "configMap": {"name": "late-config"}}],
        )
    )

    def config_error() -> dict[str, Any] | None:
        found = cluster.get("pod", "needs-config")
        statuses = (found or {}).get("status", {}).get("containerStatuses") or []
        waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return waiting if waiting.get("reason") == node_agent.CONFIG_ERROR else None

    waiting = eventually(config_error, "needs-config reported CreateContainerConfigError")
    assert "late-config" in waiting["message"]
    assert cluster.get("pod", "needs-config")["status"]["phase"] == "Pending"
    cluster.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late-config"}, "data": {"greeting": "hello"}}
    )
    done = eventually(phase_is(cluster, "needs-config", "Succeeded", "Failed"), "needs-config ended")
    assert done["status"]["phase"] == "Succeeded"
    assert (agent.state_dir / "logs" / "default_needs-config_main.log").read_text() == "hello"


def test_on_failure_restarts_the_container_with_its_restart_count(cluster, agent, tmp_path):
    eventually(node_ready(cluster, NODE), "node-1 Ready and untainted")
    marker = tmp_path / "marks"
    script = "if [ -e /marks/once ]; then echo second; exit 0; fi; touch /marks/once; echo first; exit 2"
    cluster.apply(
        pod(
            "flaky",
            ["sh", "-c", script],
            restartPolicy="OnFailure",
            container={"volumeMounts": [{"name": "marks", "mountPath": "/marks"}]},
            volumes=[{"name": "marks", "hostPath": {"path": str(marker), "type": "DirectoryOrCreate"}}],
        )
    )
    done = eventually(phase_is(cluster, "flaky", "Succeeded", "Failed"), "flaky ended")
    assert done["status"]["phase"] == "Succeeded"
    (status,) = done["status"]["containerStatuses"]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 2
    assert status["state"]["terminated"]["exitCode"] == 0
    assert (agent.state_dir / "logs" / "default_flaky_main.log").read_text() == "first\nsecond\n"


def test_the_agent_process_stops_its_containers_on_sigterm_and_marks_lost_pods_on_restart(cluster, tmp_path):
    node = "node-2"
    state = tmp_path / "state"
    argv = [
        sys.executable,
        "-m",
        "meshjob_cluster.agent",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--node={node}",
        "--devices=1",
        f"--device-resource={GPU}",
        f"--claims={tmp_path / 'claims'}",
        f"--state-dir={state}",
        "--label=pool=other",
    ]

    def start_agent(log_name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / log_name, "wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def stop_agent(proc: subprocess.Popen[bytes]) -> int:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    first = start_agent("agent-1.log")
    try:
        eventually(node_ready(cluster, node), "node-2 Ready and untainted")
        # two processes in the container's group: the agent must stop both
        cluster.apply(pod("sleeper", ["sh", "-c", "sleep 1000 & sleep 1000"], node=node))
        running = eventually(phase_is(cluster, "sleeper", "Running", "Succeeded", "Failed"), "sleeper running")
        assert running["status"]["phase"] == "Running"
        pid = container_pid(running)
        eventually(lambda: len(group_members(pid)) >= 2, "both of sleeper's processes")
    finally:
        code = stop_agent(first)
    assert code == 0, (tmp_path / "agent-1.log").read_text()
    assert group_members(pid) == []  # the agent left no process behind
    # a new run of the agent adopts nothing: the pod it ran is Failed, not silently Running
    second = start_agent("agent-2.log")
    try:
        failed = eventually(phase_is(cluster, "sleeper", "Failed"), "sleeper marked Failed")
        assert failed["status"]["reason"] == node_agent.AGENT_RESTARTED
        terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["reason"] == node_agent.AGENT_RESTARTED
    finally:
        assert stop_agent(second) == 0, (tmp_path / "agent-2.log").read_text()
