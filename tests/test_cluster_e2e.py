"""End to end on a local cluster where pods run (`meshjob cluster up`): the real API server, controller manager
and scheduler, ServiceAccount admission on, a node agent per Node running the pods in network namespaces
behind shaped NICs, the chart as `helm install` renders it with the operator running in the cluster as the
chart's ServiceAccount. The README's On Kubernetes commands, as written, train the main job to Succeeded;
deleting a job leaves no trainer process; `down` leaves no process, namespace or mount."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_harness import PanelQuery, dashboard_queries, instantiate
from test_readme_quickstart import helm_values, readme_commands

from meshjob_cluster import chart

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


# Grafana's variables: every namespace and job unless a test names them; a rate window of several scrapes (15 s)
DASHBOARD_VARIABLES = {"namespace": ".*", "trainingjob": ".*", "__rate_interval": "3m", "datasource": "prometheus"}


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

    def prometheus(self, path: str, **params: Any) -> Any:
        """The cluster's Prometheus HTTP API (`meshjob cluster up` runs it, fed by the chart's monitors)."""
        port = json.loads((self.folder / "state.json").read_text())["prometheus_port"]
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body.get("status") == "success", body
        return body["data"]

    def last_sample(self, selector: str) -> float:
        """When the newest sample of `selector` was scraped (its target is gone once its pod ended)."""
        series = self.prometheus("query", query=f"{selector}[30m]")["result"]
        stamps = [float(t) for s in series for t, _ in s["values"]]
        assert stamps, f"Prometheus has no sample of {selector}; targets: {self.prometheus('targets')}"
        return max(stamps)

    def returns_series(
        self, query: PanelQuery, variables: dict[str, str], at: float | None = None, since: float | None = None
    ) -> None:
        """A dashboard query, its variables filled in as Grafana would, has a finite value at `at`; or, given
        `since`, somewhere from then to now (the panel drawn over that range, a point per scrape)."""
        expr = instantiate(query.expr, {**DASHBOARD_VARIABLES, **variables})
        if since is None:
            data = self.prometheus("query", query=expr, time=at)
            values = [float(r["value"][1]) for r in data["result"]]
        else:
            data = self.prometheus("query_range", query=expr, start=since, end=time.time(), step=15)
            values = [float(v) for r in data["result"] for _, v in r["values"]]
        assert any(math.isfinite(v) for v in values), f"panel {query.panel!r} ({query.ref}): {expr} -> {data}"

    def pod_log(self, namespace: str, pod: str) -> str:
        return "".join(p.read_text(errors="replace") for p in self.folder.glob(f"nodes/*/logs/{namespace}_{pod}_*.log"))


def _meshjob(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBEBUILDER_ASSETS": ASSETS}
    return subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )


@contextlib.contextmanager
def local_cluster(folder: Path, images: bool = False) -> Iterator[LocalCluster]:
    """The README's local cluster and chart: 4 Nodes of 2 devices (the main job's 4 hosts), pods on this
    machine's files or, with `images`, in the built images. `down` must leave nothing behind."""
    up = _meshjob(
        "cluster", "up", "--nodes", "4", "--devices-per-node", "2", "--dir", str(folder), *(["--images"] * images)
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"export KUBECONFIG={folder}/control/run/kubeconfig" in up.stdout
    state = json.loads((folder / "state.json").read_text())
    local = LocalCluster(folder)
    try:
        (helm,) = [c for c in readme_commands() if c[0] == "helm"]  # helm install NAME CHART -n NS ...
        namespace = helm[helm.index("-n") + 1]
        chart.install(local.kubeconfig, ROOT / helm[3], helm[2], namespace, helm_values(helm))
        chart.wait_ready(local.kubeconfig, namespace)
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("local-cluster")) as local:
        yield local


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
    readme_scenario(cluster)


def readme_scenario(cluster: LocalCluster) -> None:
    """The README's kubectl commands as written: gpt-demo reaches Succeeded with its final step and loss in its
    status; each stage logs a line per step and the loss falls; every trainer panel of the dashboard has series
    for it in the cluster's Prometheus; deleting it leaves no trainer process."""
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
    (final,) = {
        m for log in logs.values() for m in re.findall(rf"^step {steps}/{steps} stage \d+: loss ([0-9.]+)", log, re.M)
    }
    assert job["status"]["loss"] == pytest.approx(float(final), abs=1e-4)  # from the pods' summaries
    at = cluster.last_sample('meshjob_step{trainingjob="gpt-demo"}')
    for query in [q for q in dashboard_queries() if "meshjob_operator_" not in q.expr]:  # the trainers' panels
        cluster.returns_series(query, {"namespace": namespace, "trainingjob": "gpt-demo"}, at)
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
    steps: 200
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


def _tiny(
    cluster: LocalCluster, name: str, data: str = "examples/data/shakespeare-train.bin", namespace: str = "team-t"
) -> None:
    """A small job of 2 hosts (namespace team-t unless named), its checkpoints on a claim of its own."""
    if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(CLAIM).replace("NAME", name))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=TINY.replace("NAME", name).replace("DATA", data))


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
    losses = re.findall(r"^step 200/200 stage 1: loss ([0-9.]+)", logs, re.M)
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


def _pods(cluster: LocalCluster, job: str, namespace: str = "team-t") -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.json("get", "pods", "-n", namespace, "-l", f"meshjob.io/job-name={job}")[
        "items"
    ]
    return found


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions") or [] if c["type"] == kind), {})


def test_a_node_tainted_or_filled_after_the_plan_puts_the_schedulers_own_message_in_the_condition(
    cluster: LocalCluster,
):
    """The scheduler is paused while the operator plans and creates the pods; then one planned Node is tainted
    and the other filled by a pod bound to it directly. Started again, the scheduler places them nowhere, and
    its own words reach the job's Unschedulable condition."""
    scheduler = int((cluster.folder / "control" / "run" / "kube-scheduler.pid").read_text())
    nodes = {
        n["metadata"]["labels"]["kubernetes.io/hostname"]: n["metadata"]["name"]
        for n in cluster.json("get", "nodes")["items"]
    }
    tainted = filled = ""
    os.killpg(scheduler, signal.SIGSTOP)
    try:
        _tiny(cluster, "late")
        pods = cluster.wait(
            "late's 2 pods created", lambda: (lambda p: p if len(p) == 2 else None)(_pods(cluster, "late")), 120
        )
        assert not any(p["spec"].get("nodeName") for p in pods)  # planned, not yet bound
        pinned = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            (host,) = [v for e in terms["nodeSelectorTerms"][0]["matchExpressions"] for v in e["values"]]
            pinned.append(nodes[host])
        tainted, filled = pinned
        cluster.kubectl("taint", "nodes", tainted, "meshjob.io/maintenance=now:NoSchedule")
        devices = pods[0]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
        filler = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "filler", "namespace": "team-t"},
            "spec": {
                "nodeName": filled,  # bound by hand: the scheduler is paused
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "meshjob/trainer:0.1.0",
                        "command": ["sleep", "600"],
                        "resources": {"requests": {"cpu": devices}, "limits": {"cpu": devices}},
                    }
                ],
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(filler))
    finally:
        _start_again(cluster.folder / "control" / "run" / "kube-scheduler.pid")
    try:
        seen: list[str] = []

        def both_reported() -> bool:  # the scheduler tries the pods one by one: wait for both reasons
            condition = _condition(cluster.json("get", "tj", "-n", "team-t", "late"), "Unschedulable")
            seen.append(condition.get("message", "") if condition.get("status") == "True" else "")
            return "maintenance" in seen[-1] and "Insufficient" in seen[-1]

        deadline = time.monotonic() + 120
        while not both_reported() and time.monotonic() < deadline:
            time.sleep(2)
        message = seen[-1]
        # kube-scheduler's words: "0/4 nodes are available: 1 node(s) had taint {meshjob.io/maintenance: now}, that
        # the pod didn't tolerate, ..." and "1 Insufficient cpu"
        assert re.search(r"0/4 nodes are available: .*taint \{meshjob.io/maintenance: now\}", message), message
        assert "Insufficient cpu" in message, message

        def events() -> str:  # kopf posts Events from a queue: a moment after the status
            about_late = ("--field-selector", "involvedObject.name=late")
            return cluster.kubectl("get", "events", "-n", "team-t", *about_late).stdout

        deadline = time.monotonic() + 30
        while "meshjob.io/maintenance" not in events() and time.monotonic() < deadline:
            time.sleep(1)
        assert "meshjob.io/maintenance" in events(), events()
    finally:
        cluster.kubectl("delete", "tj", "-n", "team-t", "late", "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "pod", "-n", "team-t", "filler", "--grace-period=0", "--force", check=False)
        if tainted:
            cluster.kubectl("taint", "nodes", tainted, "meshjob.io/maintenance-", check=False)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:  # gone
        return False


def _start_again(pid_file: Path) -> None:
    """A stopped control-plane process killed and started anew with its command line: its caches are filled
    afresh before it acts (resumed, it could act on events still queued from before the changes it missed)."""
    pid = int(pid_file.read_text())
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _running(pid):
        assert time.monotonic() < deadline, f"{argv[0]} ({pid}) does not end"
        time.sleep(0.1)
    with open(pid_file.with_suffix(".log"), "ab") as log:
        started = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    pid_file.write_text(str(started.pid))  # `down` stops it by this file


def test_deleting_the_jobs_namespace_ends_every_trainer_process_within_the_grace_period(cluster: LocalCluster):
    _tiny(cluster, "doomed", namespace="team-gone")
    cluster.wait(
        "doomed's trainers running", lambda: _trainer_pids("doomed-host-0") and _trainer_pids("doomed-host-1"), 300
    )
    grace = _pods(cluster, "doomed", "team-gone")[0]["spec"].get("terminationGracePeriodSeconds", 30)
    cluster.kubectl("delete", "namespace", "team-gone", "--wait=false")
    # the agents send SIGTERM, then SIGKILL once the grace period is over: nothing outlives it for long
    cluster.wait("doomed's trainer processes gone", lambda: not _trainer_processes("doomed"), grace + 60)
    cluster.wait(
        "namespace team-gone gone",
        lambda: cluster.kubectl("get", "namespace", "team-gone", check=False).returncode,
        180,
    )


def test_every_operator_panel_of_the_dashboard_returns_series_from_the_clusters_prometheus(cluster: LocalCluster):
    """The operator's panels, drawn from when a job's pods are created and another job's are refused by a
    ResourceQuota (an API error the operator counts)."""
    cluster.kubectl("create", "namespace", "team-q")
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods"},
        "spec": {"hard": {"pods": "0"}},
    }
    cluster.kubectl("apply", "-n", "team-q", "-f", "-", input=json.dumps(quota))
    for monitor in cluster.json("get", "servicemonitors", "-A")["items"]:  # the chart's 30 s: a rate waits minutes
        every_5s = [
            {"op": "replace", "path": f"/spec/endpoints/0/{key}", "value": "5s"}
            for key in ("interval", "scrapeTimeout")  # Prometheus refuses a timeout above the interval
        ]
        meta = monitor["metadata"]
        cluster.kubectl(
            "patch", "servicemonitor", "-n", meta["namespace"], meta["name"], "--type=json", "-p", json.dumps(every_5s)
        )
    cluster.wait(
        "the quota counted",
        lambda: cluster.json("get", "resourcequota", "-n", "team-q", "no-pods").get("status", {}).get("used"),
        60,
    )
    cluster.wait(  # the operator scraped before the pods are created: a rate needs a sample before and after
        "the operator's metrics in Prometheus",
        lambda: cluster.prometheus("query", query="meshjob_operator_pod_creation_latency_seconds_count")["result"],
        180,
    )
    since = time.time()
    _tiny(cluster, "refused", namespace="team-q")
    _tiny(cluster, "panels")
    try:
        cluster.wait("panels' pods created", lambda: len(_pods(cluster, "panels")) == 2, 120)
        queries = [q for q in dashboard_queries() if "meshjob_operator_" in q.expr]
        assert queries

        def all_return_series() -> bool:
            try:
                for query in queries:
                    cluster.returns_series(query, {}, since=since)
            except AssertionError:
                return False
            return True

        deadline = time.monotonic() + 240  # a refused job is retried with backoff
        while not all_return_series() and time.monotonic() < deadline:
            time.sleep(5)
        for query in queries:  # said panel by panel where one has none
            cluster.returns_series(query, {}, since=since)
    finally:
        cluster.kubectl("delete", "namespace", "team-q", "--wait=false", check=False)
        cluster.kubectl("delete", "tj", "-n", "team-t", "panels", "--wait=true", "--timeout=120s", check=False)
