"""The local cluster's storage provisioner: a PersistentVolume for every PersistentVolumeClaim that has none, a
hostPath to the claim's folder (the same folder on every Node, as a shared storage class gives), with the
claim's access modes and size. The controller manager's volume binder then binds them, as on a cluster with
a dynamic provisioner; the scheduler refuses pods whose claims are unbound until then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes

CLASS = "meshjob-local"


def volume_for(claim: dict[str, Any], claims: Path) -> dict[str, Any]:
    """The PersistentVolume that satisfies `claim`, pre-bound to it (claimRef)."""
    meta = claim["metadata"]
    namespace, name = meta.get("namespace", "default"), meta["name"]
    spec = claim.get("spec", {})
    size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "labels": {"meshjob.io/provisioned": "true"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": spec.get("storageClassName") or "",
            "hostPath": {"path": str(claims / namespace / name), "type": "DirectoryOrCreate"},
            "claimRef": {"namespace": namespace, "name": name, "uid": meta["uid"]},
        },
    }


def _list(listing: Any) -> list[dict[str, Any]]:
    response: Any = listing(_preload_content=False)  # the raw JSON, not the client's models
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def provision(api: kubernetes.client.ApiClient, claims: Path) -> list[str]:
    """Create the volumes pending claims need, remove released ones; returns the claims it provisioned."""
    core = kubernetes.client.CoreV1Api(api)
    existing = {v["metadata"]["name"]: v for v in _list(core.list_persistent_volume)}
    made = []
    for claim in _list(core.list_persistent_volume_claim_for_all_namespaces):
        if claim.get("status", {}).get("phase") != "Pending" or claim.get("spec", {}).get("volumeName"):
            continue
        volume = volume_for(claim, claims)
        if volume["metadata"]["name"] in existing:
            continue
        namespace, name = claim["metadata"].get("namespace", "default"), claim["metadata"]["name"]
        (claims / namespace / name).mkdir(parents=True, exist_ok=True)
        core.create_persistent_volume(volume)  # type: ignore[arg-type]  # the client sends a dict as JSON
        made.append(f"{namespace}/{name}")
    for name, volume in existing.items():
        provisioned = (volume["metadata"].get("labels") or {}).get("meshjob.io/provisioned") == "true"
        if provisioned and volume.get("status", {}).get("phase") == "Released":
            core.delete_persistent_volume(name)
    return made
