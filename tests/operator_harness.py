"""Helpers of the operator scenarios (tests/test_operator_scenarios.py) and the kmock/envtest-only tests.

The clusters themselves (kmock, a real kube-apiserver) and the in-process operator are
meshjob_operator.testing. Every scenario uses its own namespace, node names and device resource
(example.com/<tag>), so scenarios can share one API server without interfering.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from meshjob_operator.testing import Cluster, eventually, job_body

REPO = Path(__file__).resolve().parents[1]
PEERING_CRDS = REPO / "operator" / "peering.yaml"


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
        if len(pods) == count and (phase is None or all((p.get("status") or {}).get("phase", "Pending") == phase
                                                        for p in pods)):
            return pods or [{}]
        return None
    found = await eventually(check, timeout=timeout, what=f"{count} pod(s) of job {tag}")
    return [p for p in found if p]


async def wait_status(c: Cluster, tag: str, predicate: Callable[[dict], bool], what: str,
                      timeout: float = 20) -> dict[str, Any]:
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
