"""The Pod Security Standards' "restricted" profile as published (kubernetes.io/docs/concepts/security/
pod-security-standards, policy version "latest": every baseline control plus the restricted ones), as
checks on a Pod body. Pod Security admission arrived in Kubernetes 1.22, after the v1.20 API server the
tests run, so the rules are applied here, one function per control, each returning its violations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("containers", "initContainers", "ephemeralContainers"):
        yield from spec.get(key) or []


def contexts(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "pod", spec.get("securityContext") or {}
    for c in containers(spec):
        yield f"container {c['name']}", c.get("securityContext") or {}


def host_process(spec):
    return [
        f"{who}: windowsOptions.hostProcess"
        for who, sc in contexts(spec)
        if (sc.get("windowsOptions") or {}).get("hostProcess")
    ]


def host_namespaces(spec):
    return [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]


def privileged(spec):
    return [f"{who}: privileged" for who, sc in contexts(spec) if who != "pod" and sc.get("privileged")]


def baseline_capabilities(spec):
    return [
        f"container {c['name']}: capability {cap}"
        for c in containers(spec)
        for cap in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        if cap not in BASELINE_CAPABILITIES
    ]


def host_path_volumes(spec):
    return [f"volume {v['name']}: hostPath" for v in spec.get("volumes") or [] if "hostPath" in v]


def host_ports(spec):
    return [
        f"container {c['name']}: hostPort {p['hostPort']}"
        for c in containers(spec)
        for p in c.get("ports") or []
        if p.get("hostPort")
    ]


def app_armor(spec, annotations):
    bad = [
        f"annotation {k}={v}"
        for k, v in annotations.items()
        if k.startswith("container.apparmor.security.beta.kubernetes.io/")
        and not (v == "runtime/default" or v.startswith("localhost/"))
    ]
    return bad + [
        f"{who}: appArmorProfile Unconfined"
        for who, sc in contexts(spec)
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined"
    ]


def se_linux(spec):
    out = []
    for who, sc in contexts(spec):
        options = sc.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role"):
            out.append(f"{who}: seLinuxOptions {options}")
    return out


def proc_mount(spec):
    return [
        f"{who}: procMount {sc['procMount']}"
        for who, sc in contexts(spec)
        if sc.get("procMount") not in (None, "Default")
    ]


def sysctls(spec):
    return [
        f"sysctl {s['name']}"
        for s in (spec.get("securityContext") or {}).get("sysctls") or []
        if s["name"] not in SAFE_SYSCTLS
    ]


def volume_types(spec):
    return [
        f"volume {v['name']}: {sorted(set(v) - {'name'})}"
        for v in spec.get("volumes") or []
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES
    ]


def privilege_escalation(spec):
    return [
        f"container {c['name']}: allowPrivilegeEscalation is not false"
        for c in containers(spec)
        if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False
    ]


def non_root(spec):
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    out = [f"{who}: runAsNonRoot false" for who, sc in contexts(spec) if sc.get("runAsNonRoot") is False]
    return out + [
        f"container {c['name']}: runAsNonRoot not set (nor on the pod)"
        for c in containers(spec)
        if pod is not True and (c.get("securityContext") or {}).get("runAsNonRoot") is not True
    ]


def non_root_user(spec):
    return [f"{who}: runAsUser 0" for who, sc in contexts(spec) if sc.get("runAsUser") == 0]


def seccomp(spec):
    allowed = ("RuntimeDefault", "Localhost")
    pod = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    out = [
        f"{who}: seccompProfile Unconfined"
        for who, sc in contexts(spec)
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined"
    ]
    return out + [
        f"container {c['name']}: no RuntimeDefault/Localhost seccompProfile"
        for c in containers(spec)
        if pod not in allowed
        and ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type") not in allowed
    ]


def restricted_capabilities(spec):
    out = []
    for c in containers(spec):
        caps = (c.get("securityContext") or {}).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {c['name']}: capabilities.drop lacks ALL")
        out += [f"container {c['name']}: adds {cap}" for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"]
    return out


CONTROLS: list[Callable[[dict[str, Any]], list[str]]] = [
    host_process,
    host_namespaces,
    privileged,
    baseline_capabilities,
    host_path_volumes,
    host_ports,
    se_linux,
    proc_mount,
    sysctls,
    volume_types,
    privilege_escalation,
    non_root,
    non_root_user,
    seccomp,
    restricted_capabilities,
]


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every way the pod breaks the restricted profile; [] when it passes."""
    spec = pod["spec"]
    out = app_armor(spec, pod.get("metadata", {}).get("annotations") or {})
    for control in CONTROLS:
        out += control(spec)
    return out
