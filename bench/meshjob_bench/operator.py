"""Operator benchmark: time from TrainingJob creation to all host pods, and many-job throughput.

  - latency: one job of H hosts (H = 1..64; one device per host, one data-parallel stage), from the
    create request until H pods exist; reported per size and as a ratio to the 1-host job;
  - throughput: N concurrent 2-host jobs created at once, until every one has its pods: jobs/s,
    and the ratio of the batch time to N x the single 2-host job latency (below 1 = concurrency pays);
  - planning: a huge but valid job (seconds of CPU to plan) and a small one created just after it: the
    small job's pods and the liveness probe's answers as fractions of the time until the huge job's pods
    (planning runs in a child process, not on kopf's event loop: targets below 1/2 and 1/5);
  - crowd: 50 small jobs (2 hosts of 2 devices) created at once on 128 free nodes, where all fit: each job's
    create-to-pods time (p50, max) and how many went Unschedulable on the way (targets: all placed, none
    Unschedulable, p50 under 5 s);
  - large: 16 large jobs (the planning section's huge job, each on nodes of its own) created at once, then a
    small job: the small job's time to pods, and the p99 of the admission handler (`admit`, run on the
    operator's event loop as the webhook runs it, without TLS) and of /healthz while they plan (target < 1 s).
Against the real kube-apiserver of KUBEBUILDER_ASSETS (or ../shared/envtest) when present, else
kmock. The operator runs in this process (its own thread and event loop) with its real handlers.
Absolute times on a shared 2-core machine are noise: compare the ratios.

Run: `python -m meshjob_bench.operator` or `meshjob bench operator`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from meshjob_operator import testing as h  # the kmock/envtest clusters and the in-process operator

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "operator.json"
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="host counts of the latency jobs (comma-separated)"
    )
    parser.add_argument("--jobs", type=int, default=100, help="concurrent jobs of the throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="latency runs per size (the median is kept)")
    parser.add_argument(
        "--server",
        choices=("auto", "envtest", "kmock"),
        default="auto",
        help="API server: the real one when available (auto), or force one",
    )
    parser.add_argument(
        "--huge-stages",
        type=int,
        default=128,
        help="stages of the planning section's huge job (128: the spec's bounds; 0: no planning section)",
    )
    parser.add_argument("--crowd-jobs", type=int, default=50, help="small jobs of the crowd section (0: none)")
    parser.add_argument("--crowd-nodes", type=int, default=128, help="free nodes of the crowd section")
    parser.add_argument("--large-jobs", type=int, default=16, help="large jobs of the large section (0: none)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--sizes: {text!r} is invalid: comma-separated host counts such as 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--sizes: {text!r} is invalid: host counts >= 1")
    return sizes


def bench_job(name: str, namespace: str, hosts: int, resource: str) -> dict[str, Any]:
    body = h.job_body(name, namespace, hosts=1, devices_per_host=1)
    body["spec"]["stages"] = [{"layers": [0, 2], "mesh": [hosts, 1], "dataParallelDim": 0}]
    body["spec"]["training"]["globalBatch"] = 2 * hosts
    body["spec"]["topology"]["deviceResource"] = resource
    return body


@contextlib.asynccontextmanager
async def _cluster(server: str) -> AsyncIterator[h.Cluster]:
    assets = h.envtest_assets()
    shared = ROOT.parent / "shared" / "envtest"  # where tests/run.sh finds it too
    if assets is None and server != "kmock" and (shared / "kube-apiserver").exists():
        os.environ.setdefault("KUBEBUILDER_ASSETS", str(shared))
        assets = h.envtest_assets()
    if server == "envtest" and assets is None:
        raise SystemExit("--server envtest: KUBEBUILDER_ASSETS names no kube-apiserver (or etcd is not on PATH)")
    if server != "kmock" and assets is not None:
        async with h.envtest_cluster(assets) as c:
            yield c
    else:
        async with h.kmock_cluster() as c:
            yield c


async def _until_pods(c: h.Cluster, namespace: str, jobs: dict[str, int], timeout: float = 300) -> None:
    """Until every job has its pods; one namespace-wide list per poll (cheap for the server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = await _pods_by_job(c, namespace)
        if all(counts.get(job, 0) >= n for job, n in jobs.items()):
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"pods of {len(jobs)} job(s) not created within {timeout} s")


async def _latency(c: h.Cluster, hosts: int, run: int) -> float:
    ns = f"lat-{hosts}-{run}"
    await c.create_namespace(ns)
    resource = f"example.com/{ns}"
    for i in range(hosts):
        await c.add_node(f"{ns}-n{i}", 1, resource=resource)
    started = time.perf_counter()
    await c.create_job(bench_job("job", ns, hosts, resource))
    await _until_pods(c, ns, {"job": hosts})
    elapsed = time.perf_counter() - started
    await _delete_all(c, ns, ["job"])
    await _delete_nodes(c, [f"{ns}-n{i}" for i in range(hosts)])
    return elapsed


async def _throughput(c: h.Cluster, count: int) -> float:
    ns = "throughput"
    await c.create_namespace(ns)
    resource = "example.com/throughput"
    for i in range(2):
        await c.add_node(f"{ns}-n{i}", 1000, resource=resource)  # room for every job
    bodies = [bench_job(f"job-{i}", ns, 2, resource) for i in range(count)]
    for body in bodies:
        body["spec"]["stages"] = [{"layers": [0, 2], "mesh": [2, 1], "dataParallelDim": 0}]
    started = time.perf_counter()
    await asyncio.gather(*(c.create_job(b) for b in bodies))
    await _until_pods(c, ns, {b["metadata"]["name"]: 2 for b in bodies}, timeout=600)
    elapsed = time.perf_counter() - started
    await _delete_all(c, ns, [b["metadata"]["name"] for b in bodies])
    await _delete_nodes(c, [f"{ns}-n{i}" for i in range(2)])
    return elapsed


async def _delete_nodes(c: h.Cluster, nodes: list[str]) -> None:
    """A section's Nodes go with it: every plan reads every Node, so the next section's would grow with them."""
    for name in nodes:
        await c.kube.delete(f"/api/v1/nodes/{name}")


async def _delete_all(c: h.Cluster, namespace: str, jobs: list[str], timeout: float = 300) -> None:
    """Delete the jobs and wait until they are gone: the next section starts on an idle operator."""
    for name in jobs:
        await c.delete_job(name, namespace)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await c.kube.request("GET", h.JOBS.format(ns=namespace))
        if not (found or {}).get("items"):
            break
        await asyncio.sleep(0.2)
    # and their pods, as the garbage collector would (the bench's API server runs none): a plan reads every pod
    pods = await c.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")
    for pod in (pods or {}).get("items") or []:
        options = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        await c.kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}", options)


def huge_job(name: str, namespace: str, stages: int, resource: str) -> dict[str, Any]:
    """Every count within the spec's bounds, and seconds of CPU to plan: `stages` stages of 2x8 devices on 2 hosts
    of 1024 devices, 128 microbatches (at 128 stages the schedule's 16384 cells are its bound)."""
    body = h.job_body(
        name,
        namespace,
        hosts=2,
        devices_per_host=1024,
        model={"kind": "gpt", "layers": stages, "hidden": 64, "heads": 8, "vocab": 64, "seqLen": 16},
        training={"steps": 3, "globalBatch": 256, "microbatches": 128},
        stages=[{"layers": [i, i + 1], "mesh": [2, 8], "tensorParallelDim": 1} for i in range(stages)],
        resharding={"strategy": "broadcast", "balancer": "greedy", "budgetSeconds": 1},
        schedule={"kind": "1f1b", "weightGradDelay": "auto"},
    )
    body["spec"]["topology"]["deviceResource"] = resource
    return body


def _probe_seconds(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as answer:
        if answer.status != 200:
            raise RuntimeError(f"liveness probe {url}: HTTP {answer.status}")
    return time.perf_counter() - started


async def _planning(c: h.Cluster, stages: int, liveness: str) -> dict[str, Any]:
    """A huge job, then a small one at once: until each one's pods, and the liveness probe meanwhile."""
    huge, small = "plan-huge", "plan-small"
    for ns, devices in ((huge, 1024), (small, 2)):
        await c.create_namespace(ns)
        for i in range(2):
            await c.add_node(f"{ns}-n{i}", devices, resource=f"example.com/{ns}")
    small_body = h.job_body("job", small, hosts=2, devices_per_host=2)
    small_body["spec"]["topology"]["deviceResource"] = f"example.com/{small}"
    started = time.perf_counter()
    await c.create_job(huge_job("job", huge, stages, f"example.com/{huge}"))
    await c.create_job(small_body)
    await _until_pods(c, small, {"job": 2})
    small_s = time.perf_counter() - started
    probes: list[float] = []
    deadline = time.monotonic() + 600
    while not await c.pods("job", huge):
        if time.monotonic() > deadline:
            raise TimeoutError("the huge job's pods not created within 600 s")
        probes.append(await asyncio.to_thread(_probe_seconds, liveness))
        await asyncio.sleep(0.5)
    huge_s = time.perf_counter() - started
    for ns in (huge, small):
        await _delete_all(c, ns, ["job"])
        await _delete_nodes(c, [f"{ns}-n{i}" for i in range(2)])
    return {
        "huge_job": {"stages": stages, "microbatches": 128, "devices": 2 * 1024},
        "small_job_seconds": round(small_s, 3),
        "huge_job_seconds": round(huge_s, 3),
        "small_over_huge": round(small_s / huge_s, 4),
        "probes_before_huge_placed": len(probes),
        "max_probe_seconds": round(max(probes), 4) if probes else None,
        "max_probe_over_huge": round(max(probes) / huge_s, 4) if probes else None,
        "targets": {"small_over_huge": "< 0.5", "max_probe_over_huge": "< 0.2"},
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _pods_by_job(c: h.Cluster, namespace: str) -> dict[str, int]:
    """Pods per job in `namespace`: one namespace-wide list (cheap for the server)."""
    found = await c.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")
    counts: dict[str, int] = {}
    for pod in (found or {}).get("items") or []:
        job = (pod["metadata"].get("labels") or {}).get("meshjob.io/job-name")
        if job is not None:
            counts[job] = counts.get(job, 0) + 1
    return counts


async def _went_unschedulable(c: h.Cluster, namespace: str, jobs: list[str]) -> int:
    """Jobs whose status holds condition Unschedulable (True now, or False after having been True)."""
    count = 0
    for name in jobs:
        status = ((await c.job(name, namespace)) or {}).get("status") or {}
        count += any(cond.get("type") == "Unschedulable" for cond in status.get("conditions") or [])
    return count


async def _crowd(c: h.Cluster, count: int, nodes: int, timeout: float = 600) -> dict[str, Any]:
    """`count` 2-host jobs created at once on `nodes` free nodes of 2 devices: each one's create-to-pods time."""
    ns, resource = "crowd", "example.com/crowd"
    await c.create_namespace(ns)
    for i in range(nodes):
        await c.add_node(f"{ns}-n{i:03d}", 2, resource=resource)
    await asyncio.sleep(2.0)  # the operator's node cache catches up (a job placed before that waits Unschedulable)
    bodies = [h.job_body(f"job-{i:02d}", ns, hosts=2, devices_per_host=2) for i in range(count)]
    for body in bodies:
        body["spec"]["topology"]["deviceResource"] = resource
    started = time.perf_counter()
    await asyncio.gather(*(c.create_job(b) for b in bodies))
    placed: dict[str, float] = {}
    names_ = [b["metadata"]["name"] for b in bodies]
    deadline = time.monotonic() + timeout
    while len(placed) < count and time.monotonic() < deadline:
        counts = await _pods_by_job(c, ns)
        now = time.perf_counter() - started
        for name in names_:
            if name not in placed and counts.get(name, 0) >= 2:
                placed[name] = now
        await asyncio.sleep(0.05)
    unschedulable = await _went_unschedulable(c, ns, names_)
    await _delete_all(c, ns, names_)
    times = list(placed.values())
    return {
        "jobs": count,
        "nodes": nodes,
        "hosts_per_job": 2,
        "placed": len(placed),
        "went_unschedulable": unschedulable,
        "create_to_pods_p50_seconds": round(_percentile(times, 0.5), 3) if times else None,
        "create_to_pods_max_seconds": round(max(times), 3) if times else None,
        "targets": {"placed": f"= {count}", "went_unschedulable": "= 0", "create_to_pods_p50_seconds": "< 5"},
    }


async def _admit_seconds(op: h.OperatorThread, body: dict[str, Any]) -> float:
    """The admission handler, as the webhook server runs it: on the operator's event loop."""
    # imported here, as the operator thread does: importing the handlers registers them with kopf
    handlers = importlib.import_module("meshjob_operator.handlers")

    assert op.loop is not None
    started = time.perf_counter()
    call = handlers.admit(body=body, userinfo={"username": "bench"}, operation="CREATE")
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, op.loop))
    return time.perf_counter() - started


async def _large(c: h.Cluster, op: h.OperatorThread, count: int, stages: int, liveness: str) -> dict[str, Any]:
    """`count` large jobs at once, then a small one: its time to pods, and admission and /healthz meanwhile."""
    ns = "large"
    await c.create_namespace(ns)
    for j in range(count):
        for i in range(2):
            await c.add_node(f"{ns}-{j:02d}-n{i}", 1024, resource=f"example.com/{ns}-{j:02d}")
    for i in range(2):
        await c.add_node(f"{ns}-small-n{i}", 2, resource=f"example.com/{ns}-small")
    await asyncio.sleep(2.0)
    small = h.job_body("small", ns, hosts=2, devices_per_host=2)
    small["spec"]["topology"]["deviceResource"] = f"example.com/{ns}-small"
    larges = [huge_job(f"big-{j:02d}", ns, stages, f"example.com/{ns}-{j:02d}") for j in range(count)]
    await asyncio.gather(*(c.create_job(b) for b in larges))
    started = time.perf_counter()
    await c.create_job(small)
    admissions: list[float] = []
    probes: list[float] = []
    small_s: float | None = None
    candidate = h.job_body("candidate", ns)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        counts = await _pods_by_job(c, ns)
        if small_s is None and counts.get("small", 0) >= 2:
            small_s = time.perf_counter() - started
        if small_s is not None and all(counts.get(b["metadata"]["name"], 0) >= 2 for b in larges):
            break
        admissions.append(await _admit_seconds(op, candidate))
        probes.append(await asyncio.to_thread(_probe_seconds, liveness))
        await asyncio.sleep(0.2)
    await _delete_all(c, ns, ["small", *(b["metadata"]["name"] for b in larges)])
    return {
        "large_jobs": count,
        "stages": stages,
        "other_job_to_pods_seconds": round(small_s, 3) if small_s is not None else None,
        "admission_p99_seconds": round(_percentile(admissions, 0.99), 4) if admissions else None,
        "admission_max_seconds": round(max(admissions), 4) if admissions else None,
        "healthz_p99_seconds": round(_percentile(probes, 0.99), 4) if probes else None,
        "healthz_max_seconds": round(max(probes), 4) if probes else None,
        "samples": len(probes),
        "targets": {"other_job_to_pods_seconds": "< 1", "admission_p99_seconds": "< 1", "healthz_p99_seconds": "< 1"},
    }


async def run_bench(
    sizes: list[int],
    jobs: int,
    repeats: int,
    server: str,
    huge_stages: int = 0,
    crowd_jobs: int = 0,
    crowd_nodes: int = 128,
    large_jobs: int = 0,
) -> dict[str, Any]:
    liveness = f"http://127.0.0.1:{h.free_port()}/healthz"
    async with _cluster(server) as c, h.running_operator(c, liveness=liveness) as op:
        kind = "kube-apiserver v1.20 (envtest)" if c.real else "kmock (in-memory)"
        latency: dict[int, float] = {}
        for hosts in sizes:
            times = sorted([await _latency(c, hosts, r) for r in range(repeats)])
            latency[hosts] = times[len(times) // 2]
        single_2 = latency.get(2) or sorted([await _latency(c, 2, r) for r in range(repeats)])[repeats // 2]
        batch = await _throughput(c, jobs)
        planning = await _planning(c, huge_stages, liveness) if huge_stages > 0 else None
        crowd = await _crowd(c, crowd_jobs, crowd_nodes) if crowd_jobs > 0 else None
        large = await _large(c, op, large_jobs, huge_stages or 128, liveness) if large_jobs > 0 else None
    base = latency[min(sizes)]
    return {
        "server": kind,
        "latency": [
            {
                "hosts": n,
                "seconds": round(t, 4),
                "ratio_to_smallest": round(t / base, 3),
                "ms_per_pod": round(1000 * t / n, 2),
            }
            for n, t in latency.items()
        ],
        "throughput": {
            "jobs": jobs,
            "hosts_per_job": 2,
            "seconds": round(batch, 3),
            "jobs_per_second": round(jobs / batch, 2),
            "ratio_to_sequential": round(batch / (jobs * single_2), 3),
        },
        "planning": planning,
        "crowd": crowd,
        "large": large,
        "note": "median of repeats; ratios are the result, absolute times are noise on a shared 2-core machine",
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"operator benchmark on {result['server']}")
    print(f"{'hosts':>6} {'create->all pods (s)':>21} {'x smallest':>11} {'ms/pod':>8}")
    for row in result["latency"]:
        print(f"{row['hosts']:>6} {row['seconds']:>21.3f} {row['ratio_to_smallest']:>11.2f} {row['ms_per_pod']:>8.1f}")
    t = result["throughput"]
    print(
        f"{t['jobs']} concurrent {t['hosts_per_job']}-host jobs: {t['seconds']:.2f} s, "
        f"{t['jobs_per_second']:.1f} jobs/s, "
        f"{t['ratio_to_sequential']:.2f} x the time of one job after another"
    )
    p = result.get("planning")
    if p:
        print(
            f"a {p['huge_job']['stages']}-stage job planning: a small job's pods after {p['small_over_huge']:.3f} x "
            f"its time, /healthz at most {p['max_probe_over_huge']} x it over {p['probes_before_huge_placed']} probes"
        )
    _print_crowds(result)


def _print_crowds(result: dict[str, Any]) -> None:
    crowd, large = result.get("crowd"), result.get("large")
    if crowd:
        print(
            f"{crowd['jobs']} small jobs on {crowd['nodes']} nodes: {crowd['placed']} placed, "
            f"{crowd['went_unschedulable']} went Unschedulable, create->pods p50 "
            f"{crowd['create_to_pods_p50_seconds']} s, max {crowd['create_to_pods_max_seconds']} s"
        )
    if large:
        print(
            f"{large['large_jobs']} large jobs planning: another job's pods after "
            f"{large['other_job_to_pods_seconds']} s, admission p99 {large['admission_p99_seconds']} s, "
            f"/healthz p99 {large['healthz_p99_seconds']} s over {large['samples']} samples"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    """Create->all-pods time and ms per pod against the host count (log scale)."""
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = [r["hosts"] for r in result["latency"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(hosts, [r["seconds"] for r in result["latency"]], marker="o", label="create -> all pods (s)")
    ax.plot(hosts, [r["ms_per_pod"] / 1000 for r in result["latency"]], marker="s", label="per pod (s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hosts (pods) in the job")
    ax.set_ylabel("seconds")
    t = result["throughput"]
    ax.set_title(
        f"operator on {result['server']}\n{t['jobs']} concurrent jobs: {t['jobs_per_second']} jobs/s", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if min(args.crowd_jobs, args.large_jobs) < 0 or args.crowd_nodes < 2 * args.crowd_jobs:
        raise SystemExit(
            f"--crowd-jobs={args.crowd_jobs} / --crowd-nodes={args.crowd_nodes} / --large-jobs={args.large_jobs} "
            "are invalid: jobs >= 0, and 2 nodes per crowd job at least (they must all fit)"
        )
    if args.jobs < 1 or args.repeats < 1 or args.huge_stages < 0:
        raise SystemExit(
            f"--jobs={args.jobs} / --repeats={args.repeats} / --huge-stages={args.huge_stages} are invalid: "
            "jobs and repeats >= 1, huge stages >= 0"
        )
    result = asyncio.run(
        run_bench(
            _sizes(args.sizes),
            args.jobs,
            args.repeats,
            args.server,
            args.huge_stages,
            args.crowd_jobs,
            args.crowd_nodes,
            args.large_jobs,
        )
    )
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
