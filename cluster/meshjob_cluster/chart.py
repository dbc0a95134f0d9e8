"""meshjob's Helm chart installed as `helm install` does it (its namespace, its CRDs, then its templates),
rendered by helm-python-sdk: for the local cluster's tests and benchmarks on machines without helm."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from helm_python import Chart


def kubectl(kubeconfig: Path | str, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True, input=input)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done


def install(
    kubeconfig: Path | str, chart: Path, release: str, namespace: str, values: Mapping[str, Any] | None = None
) -> None:
    """`helm install RELEASE CHART -n NAMESPACE --create-namespace` with `values` (what --set gives)."""
    with Chart.load(chart) as loaded:
        rendered = loaded.render(dict(values or {}), name=release, namespace=namespace)
    docs = [
        d for path, text in sorted(rendered.items()) if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d
    ]
    namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    kubectl(kubeconfig, "apply", "-f", "-", input=json.dumps(namespace_object))  # --create-namespace: kept if there
    kubectl(kubeconfig, "apply", "-f", str(chart / "crds"))
    deadline = time.monotonic() + 60
    while True:  # `kubectl wait` fails outright while the CRD has no conditions yet
        try:
            kubectl(kubeconfig, "wait", "--for=condition=Established", "crd/trainingjobs.meshjob.io", "--timeout=60s")
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    listed = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", input=listed)


def wait_ready(kubeconfig: Path | str, namespace: str, timeout_s: float = 180) -> None:
    """Until a pod of `namespace` (the operator's) has every container ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pods = json.loads(kubectl(kubeconfig, "get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        if any(all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}]) for p in pods):
            return
        time.sleep(2)
    raise TimeoutError(f"no ready pod in namespace {namespace} within {timeout_s:g} s")
