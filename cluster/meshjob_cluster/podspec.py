"""A pod's container as a kubelet reads it: the command, the environment (downward API included), the user,
the root filesystem's mode and the mounts, turned into a ContainerRun.

What meshjob's pods use is supported; anything else a pod asks for (an env source, a volume kind) is a
PodSpecError naming the field, which the node agent reports as the container's failure instead of running
something other than what was asked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshjob_cluster.container import ContainerRun, Mount, image_env

# (kind: "configMap" | "secret", namespace, name, key) -> the value, or None where it does not exist
KeyReader = Callable[[str, str, str, str], "str | None"]


class PodSpecError(ValueError):
    """The pod asks for something this node agent does not do; the message names the field."""


@dataclass(frozen=True)
class ImageConfig:
    """What an image's config contributes to a container (OCI image config)."""

    env: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    digest: str = ""  # the image's, as a container status' imageID names it (empty: this machine's files)


@dataclass(frozen=True)
class PodPlace:
    """Where the pod runs: what the downward API and the kubelet know of it."""

    pod_ip: str
    node_name: str
    host_ip: str
    netns: str | None = None
    hosts_file: Path | None = None
    scratch: Path = field(default_factory=lambda: Path("/tmp"))


def field_ref(pod: Mapping[str, Any], place: PodPlace, path: str) -> str:
    """The value of a downward-API fieldRef (the fields a kubelet supports)."""
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": place.node_name,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": place.pod_ip,
        "status.podIPs": place.pod_ip,
        "status.hostIP": place.host_ip,
    }
    if path in simple:
        return str(simple[path])
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return str(meta.get(source, {}).get(path[len(prefix) + 2 : -2], ""))
    raise PodSpecError(f"env valueFrom.fieldRef.fieldPath {path!r} is not supported by this node agent")


def environment(
    pod: Mapping[str, Any], container: Mapping[str, Any], place: PodPlace, read_key: KeyReader
) -> dict[str, str]:
    """The container's env list resolved: values, downward-API fields, ConfigMap and Secret keys."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        source = item.get("valueFrom")
        if source is None:
            env[name] = str(item.get("value", ""))
        elif "fieldRef" in source:
            env[name] = field_ref(pod, place, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMap" if "configMapKeyRef" in source else "secret"
            ref = source[f"{kind}KeyRef"]
            value = read_key(kind, namespace, ref["name"], ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"env {name}: {kind} {namespace}/{ref['name']} has no key {ref['key']!r}")
            env[name] = value
        else:
            raise PodSpecError(f"env {name}: valueFrom {sorted(source)} is not supported by this node agent")
    return env


def _user(pod: Mapping[str, Any], container: Mapping[str, Any], image: ImageConfig) -> tuple[int, int]:
    pod_sc = pod.get("spec", {}).get("securityContext") or {}
    sc = container.get("securityContext") or {}
    image_user, _, image_group = image.user.partition(":")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", int(image_user) if image_user.isdigit() else 0))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", int(image_group) if image_group.isdigit() else 0))
    if (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")) and uid == 0:
        raise PodSpecError("securityContext.runAsNonRoot: the container would run as root (uid 0)")
    return int(uid), int(gid)


def container_run(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    volumes: Mapping[str, Path],
    place: PodPlace,
    read_key: KeyReader,
    lower: Path = Path("/"),
    image: ImageConfig = ImageConfig(),
) -> ContainerRun:
    """How to start `container` of `pod`, its volumes prepared at `volumes` (name -> folder on this machine)."""
    # A kubelet's rule: command replaces the image's entrypoint (and drops its cmd); args replace its cmd.
    command: list[str] = list(container.get("command") or image.entrypoint)
    default_args: tuple[str, ...] = () if container.get("command") else image.cmd
    argv = command + list(container.get("args") or default_args)
    if not argv:
        raise PodSpecError(f"container {container.get('name')}: no command and the image has no entrypoint")
    mounts = []
    for m in container.get("volumeMounts", []):
        if m["name"] not in volumes:
            raise PodSpecError(f"volumeMounts {m['mountPath']}: no volume named {m['name']!r} in the pod")
        source = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
        mounts.append(Mount(source, m["mountPath"], bool(m.get("readOnly"))))
    uid, gid = _user(pod, container, image)
    fs_group = (pod.get("spec", {}).get("securityContext") or {}).get("fsGroup")
    env = image_env(image.env, environment(pod, container, place, read_key))
    hostname = pod.get("spec", {}).get("hostname") or pod.get("metadata", {}).get("name", "")
    env.setdefault("HOSTNAME", hostname)
    return ContainerRun(
        argv=tuple(argv),
        env=env,
        lower=lower,
        mounts=tuple(mounts),
        uid=uid,
        gid=gid,
        groups=(gid, int(fs_group)) if fs_group is not None else (gid,),
        read_only_root=bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem")),
        workdir=container.get("workingDir") or image.workdir or ("/" if str(lower) != "/" else os.getcwd()),
        hosts_file=place.hosts_file,
        hostname=hostname,
        netns=place.netns,
        scratch=place.scratch,
    )
