"""End to end on a local cluster where pods run (`meshjob cluster up`): the real API server, controller manager
and scheduler, ServiceAccount admission on, a node agent per Node running the pods in network namespaces
behind shaped NICs, the chart as `helm install` renders it with the operator running in the cluster as the
chart's ServiceAccount. The README's On Kubernetes commands, as written, train the main job to Succeeded;
deleting a job leaves no trainer process; `down` leaves no process, namespace or mount."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import Chart
from test_readme_quickstart import helm_values, readme_commands

ROOT = Path(__file__).resolve().parents[1]
ASSETS = os.environ.get("KUBEBUILDER_ASSETS") or str(ROOT.parent / "shared" / "envtest")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster needs root (namespaces, mounts)"),
    pytest.mark.skipif(
        not (Path(ASSETS) / "kube-apiserver").is_file(), reason="no kube-apiserver in KUBEBUILDER_ASSETS"
    ),
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="the cluster's Prometheus: apt-get install prometheus"
    ),
]


class LocalCluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.kubeconfig = folder / "control" / "run" / "kubeconfig"

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args], capture_output=True, text=True, cwd=ROOT, input=input
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def wait(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(2)
        raise AssertionError(f"{what}: not within {timeout:g} s; agents' logs:\n{self.logs_tail()}")

    def logs_tail(self) -> str:
        return "\n".join(
            f"== {p}\n{p.read_text(errors='replace')[-1500:]}" for p in self.folder.glob("nodes/*/agent.log")
        )

    def pod_log(self, namespace: str, pod: str) -> str:
        return "".join(p.read_text(errors="replace") for p in self.folder.glob(f"nodes/*/logs/{namespace}_{pod}_*.log"))


def _meshjob(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBEBUILDER_ASSETS": ASSETS}
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )


def _install_chart(cluster: LocalCluster, helm: list[str]) -> None:
    """`helm install NAME CHART -n NS --create-namespace --set ...` as helm does it: the namespace, the chart's
    CRDs, then its templates."""
    name, chart, namespace = helm[2], helm[3], helm[helm.index("-n") + 1]
    with Chart.load(ROOT / chart) as loaded:
        rendered = loaded.render(helm_values(helm), name=name, namespace=namespace)
    docs = [
        d for path, text in sorted(rendered.items()) if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d
    ]
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-f", str(ROOT / chart / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.meshjob.io", "--timeout=60s")
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """The README's local cluster and chart: 4 Nodes of 2 devices (the main job's 4 hosts)."""
    folder = tmp_path_factory.mktemp("local-cluster")
    up = _meshjob("cluster", "up", "--nodes", "4", "--devices-per-node", "2", "--dir", str(folder))
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"export KUBECONFIG={folder}/control/run/kubeconfig" in up.stdout
    state = json.loads((folder / "state.json").read_text())
    local = LocalCluster(folder)
    try:
        (helm,) = [c for c in readme_commands() if c[0] == "helm"]
        _install_chart(local, helm)
        local.wait(
            "the operator ready",
            lambda: any(
                all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])
                for p in local.json("get", "pods", "-n", "meshjob-system")["items"]
            ),
            180,
        )
        yield local
    finally:
        down = _meshjob("cluster", "down", "--dir", str(folder))
    assert down.returncode == 0, down.stdout + down.stderr
    for pid in [*state["agent_pids"], state["daemon_pid"]]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith("mjc_")
    ]
    assert str(folder) not in Path("/proc/mounts").read_text()
    assert not folder.exists()


def _trainer_processes(job: str) -> list[str]:
    """Command lines of trainer processes of `job` still running on this machine."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if "worker" in cmd and f"MESHJOB_POD_NAME={job}-".encode() in env:
            found.append(cmd)
    return found


def test_the_readmes_commands_train_the_main_job_to_succeeded(cluster: LocalCluster):
    namespace = ""
    for command in [c for c in readme_commands() if c[0] == "kubectl"]:
        args = [a for a in command[1:] if a != "-w"]
        if args[:2] == ["create", "namespace"]:
            namespace = args[2]
        if args[0] == "get":
            continue  # the watch: checked below through the same resource
        cluster.kubectl(*args)
    job = cluster.wait(
        "gpt-demo Succeeded or Failed",
        lambda: (lambda tj: tj if tj.get("status", {}).get("phase") in ("Succeeded", "Failed") else None)(
            cluster.json("get", "tj", "-n", namespace, "gpt-demo")
        ),
        1200,
    )
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    steps = yaml.safe_load((ROOT / "examples" / "gpt-demo.yaml").read_text())["spec"]["training"]["steps"]
    assert job["status"]["step"] == steps
    pods = cluster.json("get", "pods", "-n", namespace, "-l", "meshjob.io/job-name=gpt-demo")["items"]
    assert len(pods) == 4 and {p["status"]["phase"] for p in pods} == {"Succeeded"}
    assert len({p["spec"]["nodeName"] for p in pods}) == 4
    logs = {p["metadata"]["name"]: cluster.pod_log(namespace, p["metadata"]["name"]) for p in pods}
    stages = yaml.safe_load((ROOT / "examples" / "gpt-demo.yaml").read_text())["spec"]["stages"]
    for stage in range(len(stages)):  # each stage's first rank logs one progress line per step
        logged = {
            int(m) for log in logs.values() for m in re.findall(rf"^step (\d+)/{steps} stage {stage}:", log, re.M)
        }
        assert logged == set(range(1, steps + 1)), f"stage {stage}: {sorted(logged)[:5]}..."
    losses = [
        float(m)
        for log in logs.values()
        for m in re.findall(rf"^step \d+/{steps} stage \d+: loss ([0-9.]+)", log, re.M)
    ]
    assert len(losses) >= steps  # the last stage's host logs the loss of every step
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, losses  # it falls, as under `meshjob run`
    cluster.kubectl("delete", "tj", "-n", namespace, "gpt-demo", "--wait=true", "--timeout=120s")
    cluster.wait("gpt-demo's pods gone", lambda: not cluster.json("get", "pods", "-n", namespace)["items"], 120)
    assert _trainer_processes("gpt-demo") == []


TINY = """
apiVersion: meshjob.io/v1alpha1
kind: TrainingJob
metadata: {name: NAME}
spec:
  image: meshjob/trainer:0.1.0
  model: {kind: gpt, layers: 2, hidden: 32, heads: 2, vocab: 256, seqLen: 16}
  data: {kind: tokens, path: DATA, valPath: examples/data/shakespeare-val.bin}
  training:
    steps: 400
    globalBatch: 8
    microbatches: 2
    learningRate: 1.0e-3
    seed: 0
    checkpoint: {every: 50, path: /ckpt, volume: {persistentVolumeClaim: {claimName: NAME-ckpt}}}
  topology: {devicesPerHost: 2}
  stages:
    - {layers: [0, 1], mesh: [1, 2], tensorParallelDim: 1}
    - {layers: [1, 2], mesh: [1, 2], dataParallelDim: 1}
  resharding: {strategy: broadcast, chunks: 2, balancer: greedy, budgetSeconds: 0.5}
  schedule: {kind: 1f1b, weightGradDelay: 0}
  runPolicy: {backoffLimit: 2}
"""
CLAIM = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "NAME-ckpt"},
    "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
}


def _tiny(cluster: LocalCluster, name: str, data: str = "examples/data/shakespeare-train.bin") -> None:
    """A small job of 2 hosts in namespace team-t, its checkpoints on a claim of its own."""
    if cluster.kubectl("get", "namespace", "team-t", check=False).returncode != 0:
        cluster.kubectl("create", "namespace", "team-t")
    cluster.kubectl("apply", "-n", "team-t", "-f", "-", input=json.dumps(CLAIM).replace("NAME", name))
    cluster.kubectl("apply", "-n", "team-t", "-f", "-", input=TINY.replace("NAME", name).replace("DATA", data))


def _finished(cluster: LocalCluster, name: str, timeout: float = 600) -> dict[str, Any]:
    found: dict[str, Any] = cluster.wait(
        f"{name} Succeeded or Failed",
        lambda: (lambda tj: tj if tj.get("status", {}).get("phase") in ("Succeeded", "Failed") else None)(
            cluster.json("get", "tj", "-n", "team-t", name)
        ),
        timeout,
    )
    return found


def _final_loss(cluster: LocalCluster, name: str) -> str:
    logs = "".join(cluster.pod_log("team-t", f"{name}-host-{i}") for i in range(2))
    losses = re.findall(r"^step 400/400 stage 1: loss ([0-9.]+)", logs, re.M)
    assert losses, logs[-2000:]
    return losses[-1]


def test_a_killed_trainer_fails_its_pod_restarts_the_gang_and_resumes_to_the_same_loss(cluster: LocalCluster):
    _tiny(cluster, "steady")
    assert _finished(cluster, "steady")["status"]["phase"] == "Succeeded"
    _tiny(cluster, "killed")
    saved = cluster.folder / "claims" / "team-t" / "killed-ckpt"
    cluster.wait("killed's first checkpoint on the claim", lambda: saved.is_dir() and any(saved.iterdir()), 300)
    victims = _trainer_pids("killed-host-1")
    assert victims, "no trainer process of killed-host-1"
    os.kill(victims[-1], 9)
    job = _finished(cluster, "killed")
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    assert job["status"].get("restarts", 0) >= 1, json.dumps(job["status"], indent=1)
    events = cluster.kubectl("get", "events", "-n", "team-t", "--field-selector", "involvedObject.name=killed").stdout
    assert re.search(r"pod killed-host-1 failed: container trainer exited [1-9]", events), events  # its exit code
    assert _final_loss(cluster, "killed") == _final_loss(cluster, "steady")


def test_a_data_path_missing_in_the_pod_fails_the_job_with_the_reason_and_no_restart_loop(cluster: LocalCluster):
    _tiny(cluster, "nodata", data="/data/not-here.bin")
    job = _finished(cluster, "nodata")
    assert job["status"]["phase"] == "Failed"
    reasons = json.dumps(job["status"].get("conditions", []))
    assert "not-here.bin" in reasons, reasons
    time.sleep(10)  # a restart loop would show as new pods
    pods = cluster.json("get", "pods", "-n", "team-t", "-l", "meshjob.io/job-name=nodata")["items"]
    assert all(p["metadata"].get("labels", {}).get("meshjob.io/restart", "0") in ("0", None) for p in pods)
    assert job["status"].get("restarts", 0) == 0


def _trainer_pids(pod: str) -> list[int]:
    """Processes of `pod`'s trainer (its `meshjob worker` and the ranks it started), oldest first."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"MESHJOB_POD_NAME={pod}\0".encode() in env:
            found.append(int(proc.name))
    return sorted(found)
