"""A pod's volumes as folders on this machine, made the way a kubelet makes them before the containers start.

emptyDir: a fresh folder (memory-backed or not, both are folders here); configMap and secret: a folder of
one file per key (or per listed item); persistentVolumeClaim: the claim's folder, the same on every Node
(what a shared storage class gives); hostPath: the path itself; projected: the service account token, the
API server's CA and the namespace, as a kubelet projects them. A pod with fsGroup gets its writable folders
owned by that group, so its non-root user can write them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshjob_cluster.podspec import PodSpecError

# (kind: "configMap" | "secret", namespace, name) -> its data (values decoded), or None where it is absent
ObjectReader = Callable[[str, str, str], "Mapping[str, str] | None"]


@dataclass(frozen=True)
class ServiceAccountFiles:
    """What a projected service account volume holds: a token for the pod's account, the CA, the namespace."""

    token: str
    ca_crt: str


def _write_files(folder: Path, data: Mapping[str, str], items: list[dict[str, Any]] | None, mode: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
    for key, rel in chosen.items():
        if key not in data:
            raise PodSpecError(f"volume item {key!r}: not in the object")
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[key])
        path.chmod(mode)


def prepare(
    pod: Mapping[str, Any],
    under: Path,
    read_object: ObjectReader,
    claims: Path,
    service_account: Callable[[], ServiceAccountFiles] | None = None,
) -> dict[str, Path]:
    """Every volume of `pod` as a folder under `under` (claims under `claims/<namespace>/<claim>`)."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    fs_group = (pod.get("spec", {}).get("securityContext") or {}).get("fsGroup")
    out: dict[str, Path] = {}
    for volume in pod.get("spec", {}).get("volumes", []):
        name = volume["name"]
        folder = under / name
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            _own(folder, fs_group, 0o2777 if fs_group is None else 0o2775)
        elif "configMap" in volume or "secret" in volume:
            kind = "configMap" if "configMap" in volume else "secret"
            ref = volume[kind]
            object_name = ref["name"] if kind == "configMap" else ref["secretName"]
            data = read_object(kind, namespace, object_name)
            if data is None:
                if ref.get("optional"):
                    data = {}
                else:
                    raise PodSpecError(f"volume {name}: {kind} {namespace}/{object_name} does not exist")
            _write_files(folder, data, ref.get("items"), int(ref.get("defaultMode", 0o644)))
            _own(folder, fs_group, 0o755)
        elif "persistentVolumeClaim" in volume:
            folder = claims / namespace / volume["persistentVolumeClaim"]["claimName"]
            folder.mkdir(parents=True, exist_ok=True)
            _own(folder, fs_group, 0o2775 if fs_group is not None else 0o777)
        elif "hostPath" in volume:
            folder = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                folder.mkdir(parents=True, exist_ok=True)
        elif "projected" in volume:
            _project(folder, volume["projected"], namespace, read_object, service_account)
        else:
            raise PodSpecError(f"volume {name}: kind {sorted(set(volume) - {'name'})} is not supported here")
        out[name] = folder
    return out


def _project(
    folder: Path,
    projected: Mapping[str, Any],
    namespace: str,
    read_object: ObjectReader,
    service_account: Callable[[], ServiceAccountFiles] | None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for source in projected.get("sources", []):
        if "serviceAccountToken" in source:
            if service_account is None:
                raise PodSpecError("projected serviceAccountToken: this node agent has no token source")
            files = service_account()
            (folder / source["serviceAccountToken"].get("path", "token")).write_text(files.token)
        elif "configMap" in source:
            data = read_object("configMap", namespace, source["configMap"]["name"]) or {}
            _write_files(folder, data, source["configMap"].get("items"), 0o644)
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items", []):
                if item.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                    (folder / item["path"]).write_text(namespace)
        else:
            raise PodSpecError(f"projected source {sorted(source)} is not supported here")
    for path in folder.rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)


def _own(folder: Path, group: int | None, mode: int) -> None:
    if group is not None:
        os.chown(folder, -1, int(group))
    folder.chmod(mode)


def remove(volumes: Mapping[str, Path], under: Path) -> None:
    """The pod's own folders (not its claims, not host paths)."""
    shutil.rmtree(under, ignore_errors=True)
