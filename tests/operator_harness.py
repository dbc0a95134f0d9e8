"""Helpers of the operator scenarios (tests/test_operator_scenarios.py) and the kmock/envtest-only tests.

The clusters themselves (kmock, a real kube-apiserver) and the in-process operator are
meshjob_operator.testing. Every scenario uses its own namespace, node names and device resource
(example.com/<tag>), so scenarios can share one API server without interfering.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from meshjob_operator.testing import (
    Cluster,
    envtest_assets,
    envtest_cluster,
    eventually,
    job_body,
    kmock_cluster,
    running_operator,
)

REPO = Path(__file__).resolve().parents[1]
PEERING_CRDS = REPO / "operator" / "peering.yaml"

# The modules that run their scenarios on both servers import these fixtures (apiserver, cluster, operator).
ASSETS = envtest_assets()
CLUSTERS = [
    "kmock",
    pytest.param(
        "envtest",
        marks=pytest.mark.skipif(
            ASSETS is None, reason="KUBEBUILDER_ASSETS does not name a folder with kube-apiserver (and etcd on PATH)"
        ),
    ),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=CLUSTERS)
async def apiserver(request):
    """A real API server starts in seconds: one serves the module. kmock: none here (see cluster)."""
    if request.param == "envtest":
        async with envtest_cluster(ASSETS) as c:
            yield c
    else:
        yield None


@pytest_asyncio.fixture(loop_scope="module")
async def cluster(apiserver):
    """The module's real API server, or a fresh kmock per scenario (in-memory and cheap; one shared by
    every scenario slows down as objects and kopf's same-named events pile up)."""
    if apiserver is not None:
        yield apiserver
    else:
        async with kmock_cluster() as c:
            yield c


@pytest_asyncio.fixture(loop_scope="module")
async def operator(cluster):
    async with running_operator(cluster) as op:
        yield op


async def plan_on_cluster(c: Cluster, body: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`meshjob plan --json --cluster` on `body`, reading the cluster's Nodes through its kubeconfig (a child
    process, as a user runs it): its JSON."""
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "meshjob.cli",
            "plan",
            str(path),
            "--json",
            "--cluster",
            "--kubeconfig",
            str(c.kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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
    await c.create_namespace(tag)


async def wait_pods(c: Cluster, tag: str, count: int, *, phase: str | None = None, timeout: float = 20) -> list[dict]:
    async def check() -> list[dict] | None:
        await c.finish_deletions(tag)
        pods = [p for p in await c.pods(tag, tag) if not p["metadata"].get("deletionTimestamp")]
        if len(pods) == count and (
            phase is None or all((p.get("status") or {}).get("phase", "Pending") == phase for p in pods)
        ):
            return pods or [{}]
        return None

    found = await eventually(check, timeout=timeout, what=f"{count} pod(s) of job {tag}")
    return [p for p in found if p]


async def wait_status(
    c: Cluster, tag: str, predicate: Callable[[dict], bool], what: str, timeout: float = 20
) -> dict[str, Any]:
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
    await eventually(lambda: job_gone(c, tag), what=f"job {tag} deleted (finalizer released)")


async def job_gone(c: Cluster, tag: str) -> bool:
    return await c.job(tag, tag) is None


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
