"""Real servers for monitoring and chart tests: Prometheus (Debian's `prometheus` binary) and a real
kube-apiserver (../shared/envtest, with an audit log), both on 127.0.0.1, both stopped on exit.

Also: the Grafana dashboard's queries with its template variables filled in, as Prometheus needs them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshjob_operator import names, testing

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "meshjob" / "dashboards" / "meshjob.json"


free_port = testing.free_port


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    """Poll `check` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL: only the process (group) this harness started."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)
    except ProcessLookupError:
        pass


# --- Prometheus -----------------------------------------------------------------------------


@dataclass
class Prometheus:
    """A real Prometheus scraping `targets` (scrape job -> ["127.0.0.1:port"]) every second.

    honor_labels is on, as in the chart's PodMonitor: trainer metrics carry their own `namespace` label
    (the TrainingJob's), which must not be renamed to exported_namespace."""

    workdir: Path
    targets: dict[str, list[str]]
    rule_files: list[Path] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": name, "honor_labels": True, "static_configs": [{"targets": hosts}]}
                for name, hosts in self.targets.items()
            ],
        }

    def start(self, timeout_s: float = 30) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("the `prometheus` binary is missing: apt-get install prometheus")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config()))
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=open(self.workdir / "prometheus.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(self._ready, timeout_s, f"Prometheus on {self.url} (log: {self.workdir / 'prometheus.log'})")
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise ValueError(f"Prometheus rejected {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant vector (or scalar, as a one-element list) of `expr` at time `at` (default: now)."""
        data = self.api("query", query=expr, time=at)
        if data["resultType"] == "vector":
            return data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise ValueError(f"{expr}: unexpected result type {data['resultType']}")

    def wait_for(self, expr: str, timeout_s: float = 30) -> list[dict[str, Any]]:
        return wait_until(lambda: self.query(expr), timeout_s, f"data for {expr!r}", interval_s=0.5)

    def targets_health(self) -> dict[str, str]:
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}


# --- the dashboard's queries ---------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str


def dashboard_queries(path: Path = DASHBOARD) -> list[PanelQuery]:
    dashboard = json.loads(path.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append(PanelQuery(panel["title"], target["refId"], target["expr"]))
    return found


def instantiate(expr: str, variables: dict[str, str]) -> str:
    """Fill in Grafana template variables ($trainingjob, $__rate_interval, ...) as Grafana would."""
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $__rate
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    if "$" in expr:
        raise ValueError(f"unfilled template variable in {expr!r}")
    return expr


# --- a real kube-apiserver with an audit log -------------------------------------------------

# meshjob_operator.testing's envtest, every request audited (the chart's RBAC is checked against the log)
Envtest = functools.partial(testing.Envtest, audit=True)
envtest_dir = testing.envtest_assets


# --- a real operator on the real API server, run with the chart's command line and RBAC -------

CHART = ROOT / "charts" / "meshjob"
OPERATOR_NAMESPACE = "meshjob-system"
JOB_NAME = "scenario"
SCENARIO_JOB = {
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": JOB_NAME, "namespace": "default"},
    "spec": {
        "image": "meshjob/trainer:test",
        "model": {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16},
        "training": {"steps": 3, "globalBatch": 8, "microbatches": 2, "checkpoint": {"every": 1, "path": "/ckpt"}},
        "topology": {"devicesPerHost": 2},
        "stages": [
            {"layers": [0, 1], "mesh": [1, 2], "tensorParallelDim": 1},
            {"layers": [1, 2], "mesh": [1, 2], "dataParallelDim": 0, "tensorParallelDim": 1},
        ],
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "naive"},
        "schedule": {"kind": "1f1b", "weightGradDelay": 0},
        "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "All"},
    },
}


BLOCKED_NAMESPACE = "zero-pods"  # a ResourceQuota of zero pods: the API server refuses the job's pods (403)


def ready_nodes(envtest: Envtest, names: tuple[str, ...], devices: int = 2) -> None:
    """Nodes as a kubelet registers them, Ready and schedulable."""
    envtest.apply([node(n, devices) for n in names])
    for n in names:  # the status of a node is its own subresource
        envtest.kubectl(
            "patch",
            "node",
            n,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": node(n, devices)["status"]}),
        )
        # the node lifecycle controller (not run here) lifts the not-ready taint of a Ready node
        envtest.kubectl("patch", "node", n, "--type=merge", "-p", json.dumps({"spec": {"taints": None}}))


def blocked_job(envtest: Envtest, scenario: OperatorScenario) -> None:
    """The scenario's job again in a namespace whose ResourceQuota allows no pods, on nodes of its own:
    placed, then refused its pods, so it is Blocked (and the operator counts the refusals)."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "spec": {"hard": {"pods": "0"}},
        "metadata": {"name": "zero-pods", "namespace": BLOCKED_NAMESPACE},
    }
    envtest.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": BLOCKED_NAMESPACE}}, quota])

    def counted() -> bool:  # the API server refuses pods only once the controller manager has counted the quota
        out = envtest.kubectl("get", "resourcequota", "-n", BLOCKED_NAMESPACE, "zero-pods", "-o", "json").stdout
        return bool(json.loads(out).get("status", {}).get("hard"))

    wait_until(counted, 30, f"the ResourceQuota of namespace {BLOCKED_NAMESPACE} counted")
    ready_nodes(envtest, ("host-2", "host-3"))
    envtest.apply([{**SCENARIO_JOB, "metadata": {"name": JOB_NAME, "namespace": BLOCKED_NAMESPACE}}])

    def blocked() -> bool:
        scenario.check()
        conditions = scenario.job_status(BLOCKED_NAMESPACE).get("conditions") or []
        return any(c["type"] == "Blocked" and c["status"] == "True" for c in conditions)

    wait_until(blocked, 60, f"the job of namespace {BLOCKED_NAMESPACE} Blocked")


def node(name: str, devices: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "allocatable": {"cpu": str(devices), "pods": "110"},
            "capacity": {"cpu": str(devices), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def chart_docs(values: dict[str, Any]) -> list[dict[str, Any]]:
    from helm_python import Chart

    with Chart.load(CHART) as chart:
        rendered = chart.render(values, name="meshjob", namespace=OPERATOR_NAMESPACE)
    return [d for path, text in rendered.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]


@dataclass
class OperatorScenario:
    """Holds what a test inspects after the run: the API server's audit log and the operator's log."""

    envtest: Envtest
    service_account: str
    log: Path
    process: subprocess.Popen | None = None

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{OPERATOR_NAMESPACE}:{self.service_account}"

    def operator_log(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"the operator exited ({self.process.returncode}):\n{self.operator_log()[-3000:]}")

    def pods(self) -> list[dict[str, Any]]:
        out = self.envtest.kubectl(
            "get", "pods", "-n", "default", "-l", f"meshjob.io/job-name={JOB_NAME}", "-o", "json"
        ).stdout
        return json.loads(out)["items"]

    def play_kubelet(self, phase: str | None = None, fail_one: bool = False) -> None:
        """Finish deletions (no kubelet does) and report pod phases."""
        for pod in self.pods():
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp"):
                self.envtest.kubectl(
                    "delete", "pod", "-n", "default", name, "--grace-period=0", "--force", "--wait=false", check=False
                )
                continue
            if phase is None and not fail_one:
                continue
            status: dict[str, Any] = {"phase": phase}
            if fail_one:
                status = {
                    "phase": "Failed",
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "ready": False,
                            "restartCount": 0,
                            "image": "x",
                            "imageID": "",
                            "state": {"terminated": {"exitCode": 1, "reason": "Error"}},
                        }
                    ],
                }
            self.envtest.kubectl(
                "patch",
                "pod",
                "-n",
                "default",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": status}),
            )
            if fail_one:
                return

    def job_status(self, namespace: str = "default", name: str = JOB_NAME) -> dict[str, Any]:
        out = self.envtest.kubectl("get", "trainingjob", "-n", namespace, name, "-o", "json", check=False)
        return json.loads(out.stdout).get("status", {}) if out.returncode == 0 else {}


@contextlib.contextmanager
def chart_operator(envtest: Envtest, workdir: Path, values: dict[str, Any]) -> Iterator[OperatorScenario]:
    """On a running envtest: the chart's CRDs, operator ServiceAccount and RBAC applied as `helm install`
    would (release meshjob in meshjob-system), and `meshjob operator` run here with the chart's command line
    and environment, authenticated as that ServiceAccount; entered once its liveness probe answers."""
    health_port = free_port()
    docs = chart_docs(
        {
            **values,
            "operator": {**values.get("operator", {}), "healthPort": health_port, "webhook": {"port": free_port()}},
        }
    )  # free ports: runs may overlap
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    operator = OperatorScenario(envtest, service_account, workdir / "operator.log")
    for crd in sorted((CHART / "crds").glob("*.yaml")):
        envtest.kubectl("apply", "-f", str(crd))
    envtest.wait_established("--all")
    served = (values.get("operator") or {}).get("namespaces") or []  # the chart's Roles are there
    envtest.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in [OPERATOR_NAMESPACE, *served]]
    )
    roles = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    envtest.apply([d for d in docs if d["kind"] in roles])
    peering = [d for d in docs if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "kopf.dev"]
    if peering:  # its CRD, then (a Helm hook) the peering objects
        envtest.apply(peering)
        envtest.wait_established("--all")
        envtest.apply([d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")])
    kubeconfig = envtest.token_kubeconfig(OPERATOR_NAMESPACE, service_account, workdir / "operator.kubeconfig")
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "POD_NAMESPACE": OPERATOR_NAMESPACE,
        "POD_NAME": "meshjob-operator-0",
    }
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    # envtest has no cluster DNS: the API server reaches the webhook here rather than through its Service
    # (the later flags win), with the operator's self-signed certificate for that name
    reachable = (
        ["--webhook-addr=127.0.0.1", "--webhook-host=127.0.0.1"] if "--no-webhook" not in container["args"] else []
    )
    command = [sys.executable, "-m", "meshjob.cli", *container["command"][1:], *container["args"], *reachable]
    operator.process = subprocess.Popen(
        command, env=env, stdout=open(operator.log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
    )
    try:
        probe = container["livenessProbe"]["httpGet"]["path"]

        def alive() -> bool:
            operator.check()
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{health_port}{probe}", timeout=2).status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(alive, 60, "the operator's liveness endpoint")
        yield operator
    finally:
        stop_process(operator.process)
        # its persistent (fail-closed) check outlives it, as on a cluster: gone with this operator here
        envtest.kubectl(
            "delete",
            "validatingwebhookconfiguration",
            f"{names.PLURAL}.{names.GROUP}",
            "--ignore-not-found",
            check=False,
        )


@contextlib.contextmanager
def operator_scenario(
    assets: Path, workdir: Path, metrics_port: int, blocked: bool = False
) -> Iterator[OperatorScenario]:
    """envtest (audited) + the chart's operator (chart_operator). Then a job's life: created before any node
    fits (unschedulable), nodes appear, pods are created and run, one fails (gang restart), the job is
    deleted. The context is entered once the restart happened; on exit the job is deleted and all is stopped.
    `blocked`: also the same job in a namespace that allows no pods (blocked_job), once the restart happened."""
    with (
        Envtest(assets, workdir) as envtest,
        chart_operator(envtest, workdir, {"operator": {"metricsPort": metrics_port}}) as scenario,
    ):
        envtest.apply([SCENARIO_JOB])
        time.sleep(2)  # reconciled while no node fits: Unschedulable
        ready_nodes(envtest, ("host-0", "host-1"))
        wait_until(lambda: (scenario.check(), len(scenario.pods()) == 2)[1], 60, "the job's two host pods")
        scenario.play_kubelet("Running")
        wait_until(lambda: (scenario.check(), scenario.job_status().get("phase") == "Running")[1], 60, "phase Running")
        scenario.play_kubelet(fail_one=True)

        def restarted() -> bool:
            scenario.check()
            scenario.play_kubelet()
            return int(scenario.job_status().get("restartCount") or scenario.job_status().get("restarts") or 0) >= 1

        wait_until(restarted, 60, "a gang restart", interval_s=0.5)
        if blocked:
            blocked_job(envtest, scenario)
        yield scenario
        envtest.kubectl("delete", "trainingjob", "-n", "default", JOB_NAME, "--wait=false")

        def deleted() -> bool:
            scenario.check()
            scenario.play_kubelet()
            return envtest.kubectl("get", "trainingjob", "-n", "default", JOB_NAME, check=False).returncode != 0

        wait_until(deleted, 60, "the job's deletion", interval_s=0.5)
