"""Cluster benchmark: a TrainingJob on the local cluster where pods run (`meshjob cluster up`), from
`kubectl apply` to all its pods Running and to its first training step, for 1, 4 and 16 Nodes.

Each size gets a fresh cluster (N Nodes of one device, the chart installed, the operator running in the
cluster) and one job of N hosts x 1 device (one data-parallel stage) applied to it. Measured:
  - apply -> all pods Running (a watch on the job's pods: the scheduler, the agents, the pods' processes);
  - apply -> first step (rank 0's log line `step 1/...`: rendezvous, plan check, the first forward and backward);
  - apply -> Succeeded (the job's status, written by the operator);
  - the API server's requests while the job ran (`apiserver_request_total`), less what the cluster sends with
    no job (measured just before, per second) and less this benchmark's own (the create and two watches).
Each as a ratio to the 1-Node job. Absolute times on a shared 2-core machine are noise: compare the ratios.

Run: `meshjob bench cluster` (root: network namespaces and mounts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from meshjob_cluster import chart

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "cluster.json"
DEFAULT_NODES = (1, 4, 16)
OPERATOR_NAMESPACE = "meshjob-system"
NAMESPACE = "bench"
JOB_NAME = "bench"
OWN_REQUESTS = 3  # the job's create and the two watches (pods, job)
IDLE_S = 20.0  # the window the cluster's requests without a job are counted over


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes",
        default=",".join(map(str, DEFAULT_NODES)),
        help="Node counts, one cluster and one job of that many hosts each (comma-separated; 1 to 16)",
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps of each job")
    parser.add_argument("--images", action="store_true", help="pods in the built images (tests/images.sh)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")


def _nodes(text: str) -> list[int]:
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        nodes = []
    if not nodes or any(not 1 <= n <= 16 for n in nodes):
        raise SystemExit(f"--nodes {text!r} is invalid: comma-separated Node counts from 1 to 16")
    return nodes


def bench_job(hosts: int, steps: int) -> dict[str, Any]:
    """`hosts` hosts x 1 device, one data-parallel stage of a small GPT."""
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB_NAME, "namespace": NAMESPACE},
        "spec": {
            "image": "meshjob/trainer:0.1.0",
            "model": {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256, "seqLen": 16},
            "data": {"kind": "tokens", "path": "examples/data/shakespeare-train.bin"},
            "training": {"steps": steps, "globalBatch": 16, "microbatches": 1, "learningRate": 1.0e-3, "seed": 0},
            "topology": {"devicesPerHost": 1},
            "stages": [{"layers": [0, 2], "mesh": [hosts, 1], "dataParallelDim": 0}],
            "resharding": {"strategy": "broadcast", "chunks": 1, "balancer": "greedy", "budgetSeconds": 0.5},
            "schedule": {"kind": "1f1b", "weightGradDelay": 0},
            "runPolicy": {"backoffLimit": 0},
        },
    }


def _meshjob(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"meshjob {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def request_counts(kubeconfig: Path) -> Counter[str]:
    """The API server's requests so far by resource (apiserver_request_total, from its /metrics)."""
    text = chart.kubectl(kubeconfig, "get", "--raw", "/metrics").stdout
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                counts[sample.labels.get("resource") or "(none)"] += int(sample.value)
    return counts


def _first_step_at(folder: Path, deadline: float) -> float:
    """When rank 0's pod logs its first step (the agents keep each container's output under the folder)."""
    pattern = re.compile(r"^step 1/\d+ ", re.M)
    log = None
    while time.monotonic() < deadline:
        log = log or next(iter(folder.glob(f"nodes/*/logs/{NAMESPACE}_{JOB_NAME}-host-0_*.log")), None)
        if log is not None and pattern.search(log.read_text(errors="replace")):
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError("no first step logged")


class _Watch(threading.Thread):
    """One watch request, recording when `done(object list)` first holds."""

    def __init__(self, list_call: Any, done: Any, timeout_s: int, **kwargs: Any):
        super().__init__(daemon=True)
        self.list_call, self.done, self.timeout_s, self.kwargs = list_call, done, timeout_s, kwargs
        self.at: float | None = None
        self.last: dict[str, Any] = {}

    def run(self) -> None:
        seen: dict[str, Any] = {}
        for event in kubernetes.watch.Watch().stream(self.list_call, timeout_seconds=self.timeout_s, **self.kwargs):
            obj = event["object"]
            obj = obj if isinstance(obj, dict) else kubernetes.client.ApiClient().sanitize_for_serialization(obj)
            seen[obj["metadata"]["name"]] = obj
            self.last = obj
            if self.done(list(seen.values())):
                self.at = time.monotonic()
                return


def run_size(nodes: int, steps: int, images: bool, workdir: Path) -> dict[str, Any]:
    folder = workdir / f"cluster-{nodes}"
    up = ["cluster", "up", "--nodes", str(nodes), "--devices-per-node", "1", "--dir", str(folder)]
    _meshjob(*up, *(["--images"] if images else []))
    kubeconfig = folder / "control" / "run" / "kubeconfig"
    try:
        chart.install(kubeconfig, ROOT / "charts" / "meshjob", "meshjob", OPERATOR_NAMESPACE)
        chart.wait_ready(kubeconfig, OPERATOR_NAMESPACE)
        chart.kubectl(kubeconfig, "create", "namespace", NAMESPACE)
        api = kubernetes.config.new_client_from_config(str(kubeconfig))
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        idle_from, idle_start = request_counts(kubeconfig), time.monotonic()
        time.sleep(IDLE_S)
        idle_to, idle_s = request_counts(kubeconfig), time.monotonic() - idle_start
        idle = {k: (idle_to[k] - idle_from[k]) / idle_s for k in idle_to}

        def running(pods: list[dict[str, Any]]) -> bool:
            return len(pods) == nodes and all((p.get("status") or {}).get("phase") == "Running" for p in pods)

        def ended(jobs: list[dict[str, Any]]) -> bool:
            return any((j.get("status") or {}).get("phase") in ("Succeeded", "Failed") for j in jobs)

        pods = _Watch(
            core.list_namespaced_pod,
            running,
            600,
            namespace=NAMESPACE,
            label_selector=f"meshjob.io/job-name={JOB_NAME}",
        )
        job = _Watch(
            custom.list_namespaced_custom_object,
            ended,
            900,
            group="meshjob.io",
            version="v1alpha1",
            namespace=NAMESPACE,
            plural="trainingjobs",
        )
        before = request_counts(kubeconfig)
        pods.start()
        job.start()
        time.sleep(1)  # both watches open before the job exists
        start = time.monotonic()
        custom.create_namespaced_custom_object(
            "meshjob.io", "v1alpha1", NAMESPACE, "trainingjobs", bench_job(nodes, steps)
        )
        first_step = _first_step_at(folder, start + 600)
        pods.join(600)
        job.join(900)
        done_at = time.monotonic()
        after = request_counts(kubeconfig)
        phase = (job.last.get("status") or {}).get("phase")
        if pods.at is None or job.at is None or phase != "Succeeded":
            raise RuntimeError(f"{nodes} Nodes: the job ended {phase!r}; status {job.last.get('status')}")
        window = done_at - start + 1
        by_resource = {k: after[k] - before[k] - idle.get(k, 0.0) * window for k in after}
        job_requests = sum(after.values()) - sum(before.values()) - sum(idle.values()) * window - OWN_REQUESTS
        return {
            "nodes": nodes,
            "apply_to_running_s": round(pods.at - start, 3),
            "apply_to_first_step_s": round(first_step - start, 3),
            "apply_to_succeeded_s": round(job.at - start, 3),
            "api_requests_per_job": round(job_requests),
            "api_requests_by_resource": {k: round(v) for k, v in sorted(by_resource.items()) if round(v) > 0},
            "idle_api_requests_per_s": round(sum(idle.values()), 2),
        }
    finally:
        _meshjob("cluster", "down", "--dir", str(folder))


def run_bench(nodes: list[int], steps: int, images: bool) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshjob-bench-cluster-") as tmp:
        for n in nodes:
            rows.append(run_size(n, steps, images, Path(tmp)))
            print(f"{n} Nodes: {rows[-1]}", file=sys.stderr)
    first = rows[0]
    for row in rows:
        for key in ("apply_to_running_s", "apply_to_first_step_s", "api_requests_per_job"):
            row[f"{key.removesuffix('_s')}_over_smallest"] = round(row[key] / first[key], 2) if first[key] else None
    return {
        "benchmark": "cluster",
        "pods": "in their images" if images else "on this machine's files",
        "steps": steps,
        "machine": {"cpus": os.cpu_count()},
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"cluster benchmark: one job of N hosts x 1 device on N Nodes, pods {result['pods']}")
    print(
        f"{'nodes':>6} {'->Running s':>12} {'x':>6} {'->step 1 s':>11} {'x':>6} {'->done s':>9} {'API req':>8} {'x':>6}"
    )
    for r in result["rows"]:
        print(
            f"{r['nodes']:>6} {r['apply_to_running_s']:>12.2f} {r['apply_to_running_over_smallest']:>6.2f} "
            f"{r['apply_to_first_step_s']:>11.2f} {r['apply_to_first_step_over_smallest']:>6.2f} "
            f"{r['apply_to_succeeded_s']:>9.2f} {r['api_requests_per_job']:>8} "
            f"{r['api_requests_per_job_over_smallest']:>6.2f}"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    """Apply -> Running and apply -> first step against the Node count; API requests per job on the right."""
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    nodes = [r["nodes"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    ax.plot(nodes, [r["apply_to_running_s"] for r in rows], marker="o", label="apply -> all pods Running")
    ax.plot(nodes, [r["apply_to_first_step_s"] for r in rows], marker="s", label="apply -> first step")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("Nodes (= hosts of the job)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax2.bar([str(n) for n in nodes], [r["api_requests_per_job"] for r in rows])
    ax2.set_xlabel("Nodes")
    ax2.set_ylabel("API requests per job")
    fig.suptitle(f"local cluster, pods {result['pods']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise SystemExit("meshjob bench cluster: needs root (the local cluster's network namespaces and mounts)")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps!r} is invalid: an integer >= 1")
    result = run_bench(_nodes(args.nodes), args.steps, args.images)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"written: {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
