"""Pod Security on the trainer pods: the Pod Security Standards' "baseline" and "restricted" profiles as
checks on a rendered Pod body, meshjob's two refusals beside them, and the level a namespace asks for.

The profiles as published (kubernetes.io/docs/concepts/security/pod-security-standards, policy version
"latest"), one function per control, each returning its violations with the pod's field, its value and
what the profile allows; "restricted" is every baseline control plus its own. Pod Security admission
arrived in Kubernetes 1.22 and is off in many clusters (and absent on the v1.20 API server the tests
run), so the webhook and the operator apply the rules themselves, to the very pods the operator renders.

meshjob refuses two things beside the profiles, at "baseline" and "restricted" alike: the priority
classes of the cluster's own components (system-node-critical, system-cluster-critical: they preempt
anything) and a toleration with operator Exists and no key (it tolerates every taint, the control plane's
included).

The level of a namespace (`namespace_level`): its label `meshjob.io/pod-security`, else Kubernetes' own
`pod-security.kubernetes.io/enforce`, else "restricted". A cluster that wants less for a namespace labels
it `baseline` or `privileged` (changing a Namespace's labels is a cluster administrator's right: the
standard admin and edit roles cannot).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from meshjob.errors import FieldError, SpecError
from meshjob.spec.manifest import TrainingJob
from meshjob_operator.podtemplate import TEMPLATE

PRIVILEGED, BASELINE, RESTRICTED = "privileged", "baseline", "restricted"
LEVELS = (PRIVILEGED, BASELINE, RESTRICTED)  # from the least strict
LABEL = "meshjob.io/pod-security"
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

BASELINE_CAPABILITIES = frozenset(
    {
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
)
SAFE_SYSCTLS = frozenset(
    {
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
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
CRITICAL_PRIORITY_CLASSES = frozenset({"system-node-critical", "system-cluster-critical"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


@dataclass(frozen=True)
class Violation:
    path: str  # the pod's field, list items by name: spec.volumes[data].nfs, spec.containers[trainer].ports[0]
    value: Any
    allowed: str  # what the profile allows there, in words
    level: str  # the least strict level that refuses it: baseline (refused by restricted too) or restricted

    def __str__(self) -> str:
        return f"{self.path}: {self.value!r} ({self.allowed})"


Pod = Mapping[str, Any]
Control = Callable[[Pod], list[Violation]]


def namespace_level(labels: Mapping[str, str]) -> str:
    """The level a namespace's labels ask for: meshjob.io/pod-security, else pod-security.kubernetes.io/enforce,
    else restricted (a value that is no level is skipped)."""
    for key in (LABEL, ENFORCE_LABEL):
        if labels.get(key) in LEVELS:
            return labels[key]
    return RESTRICTED


def violations(pod: Pod, level: str = RESTRICTED) -> list[Violation]:
    """Every way the pod breaks the level (meshjob's refusals included); [] when it passes."""
    controls = {PRIVILEGED: [], BASELINE: BASELINE_CONTROLS, RESTRICTED: BASELINE_CONTROLS + RESTRICTED_CONTROLS}
    return [v for control in controls[level] for v in control(pod)]


# --- the pod's parts ------------------------------------------------------------------------------------------


def _spec(pod: Pod) -> Mapping[str, Any]:
    return pod.get("spec") or {}


def _containers(pod: Pod) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("containers", "initContainers", "ephemeralContainers"):
        for c in _spec(pod).get(key) or []:
            yield f"spec.{key}[{c.get('name')}]", c


def _contexts(pod: Pod) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, securityContext) of the pod and of every container."""
    yield "spec.securityContext", _spec(pod).get("securityContext") or {}
    for path, c in _containers(pod):
        yield f"{path}.securityContext", c.get("securityContext") or {}


def _container_contexts(pod: Pod) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for path, c in _containers(pod):
        yield f"{path}.securityContext", c.get("securityContext") or {}


def _volumes(pod: Pod) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for v in _spec(pod).get("volumes") or []:
        yield f"spec.volumes[{v.get('name')}]", v


# --- baseline -------------------------------------------------------------------------------------------------


def host_process(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.windowsOptions.hostProcess", True, "false or unset", BASELINE)
        for path, sc in _contexts(pod)
        if (sc.get("windowsOptions") or {}).get("hostProcess")
    ]


def host_namespaces(pod: Pod) -> list[Violation]:
    return [
        Violation(f"spec.{key}", True, "false or unset: the node's namespaces are not the pod's", BASELINE)
        for key in ("hostNetwork", "hostPID", "hostIPC")
        if _spec(pod).get(key)
    ]


def privileged(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.privileged", True, "false or unset", BASELINE)
        for path, sc in _container_contexts(pod)
        if sc.get("privileged")
    ]


def baseline_capabilities(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.capabilities.add", cap, f"one of {', '.join(sorted(BASELINE_CAPABILITIES))}", BASELINE)
        for path, sc in _container_contexts(pod)
        for cap in (sc.get("capabilities") or {}).get("add") or []
        if cap not in BASELINE_CAPABILITIES
    ]


def host_path_volumes(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.hostPath", v["hostPath"], "no hostPath volume", BASELINE)
        for path, v in _volumes(pod)
        if "hostPath" in v
    ]


def host_ports(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.ports[{i}].hostPort", p["hostPort"], "0 or unset", BASELINE)
        for path, c in _containers(pod)
        for i, p in enumerate(c.get("ports") or [])
        if p.get("hostPort")
    ]


def app_armor(pod: Pod) -> list[Violation]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    bad = [
        Violation(f"metadata.annotations[{k}]", v, "runtime/default or localhost/<profile>", BASELINE)
        for k, v in annotations.items()
        if k.startswith(APPARMOR_ANNOTATION) and not (v == "runtime/default" or str(v).startswith("localhost/"))
    ]
    return bad + [
        Violation(f"{path}.appArmorProfile.type", "Unconfined", "RuntimeDefault or Localhost", BASELINE)
        for path, sc in _contexts(pod)
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined"
    ]


def se_linux(pod: Pod) -> list[Violation]:
    out = []
    for path, sc in _contexts(pod):
        options = sc.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role"):
            allowed = f"no user or role, type one of {', '.join(sorted(SELINUX_TYPES - {''}))} or unset"
            out.append(Violation(f"{path}.seLinuxOptions", dict(options), allowed, BASELINE))
    return out


def proc_mount(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.procMount", sc["procMount"], "Default or unset", BASELINE)
        for path, sc in _container_contexts(pod)
        if sc.get("procMount") not in (None, "Default")
    ]


def seccomp_baseline(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.seccompProfile.type", "Unconfined", "RuntimeDefault or Localhost", BASELINE)
        for path, sc in _contexts(pod)
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined"
    ]


def sysctls(pod: Pod) -> list[Violation]:
    return [
        Violation(f"spec.securityContext.sysctls[{s.get('name')}]", s.get("name"), "a safe sysctl", BASELINE)
        for s in (_spec(pod).get("securityContext") or {}).get("sysctls") or []
        if s.get("name") not in SAFE_SYSCTLS
    ]


# --- meshjob's own (baseline and restricted) -------------------------------------------------------------------


def critical_priority(pod: Pod) -> list[Violation]:
    name = _spec(pod).get("priorityClassName")
    if name not in CRITICAL_PRIORITY_CLASSES:
        return []
    allowed = (
        "a PriorityClass of the cluster's workloads (system-node-critical and system-cluster-critical are for its "
        "own components: they preempt anything)"
    )
    return [Violation("spec.priorityClassName", name, allowed, BASELINE)]


def tolerates_every_taint(pod: Pod) -> list[Violation]:
    allowed = (
        "a toleration naming the taint's key (operator Exists without a key tolerates every taint, the control "
        "plane's included)"
    )
    return [
        Violation(f"spec.tolerations[{i}]", dict(t), allowed, BASELINE)
        for i, t in enumerate(_spec(pod).get("tolerations") or [])
        if t.get("operator") == "Exists" and not t.get("key")
    ]


# --- restricted -----------------------------------------------------------------------------------------------


def volume_types(pod: Pod) -> list[Violation]:
    allowed = (
        f"a volume of type {', '.join(sorted(RESTRICTED_VOLUMES))} (a PersistentVolumeClaim can hold nfs and "
        "the others)"
    )
    return [
        Violation(f"{path}.{source}", v[source], allowed, RESTRICTED)
        for path, v in _volumes(pod)
        for source in sorted(set(v) - {"name"} - RESTRICTED_VOLUMES)
    ]


def privilege_escalation(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.allowPrivilegeEscalation", sc.get("allowPrivilegeEscalation"), "false", RESTRICTED)
        for path, sc in _container_contexts(pod)
        if sc.get("allowPrivilegeEscalation") is not False
    ]


def non_root(pod: Pod) -> list[Violation]:
    on_pod = (_spec(pod).get("securityContext") or {}).get("runAsNonRoot")
    out = [
        Violation(f"{path}.runAsNonRoot", False, "true or unset", RESTRICTED)
        for path, sc in _contexts(pod)
        if sc.get("runAsNonRoot") is False
    ]
    return out + [
        Violation(f"{path}.runAsNonRoot", None, "true, here or on the pod", RESTRICTED)
        for path, sc in _container_contexts(pod)
        if on_pod is not True and sc.get("runAsNonRoot") is not True
    ]


def non_root_user(pod: Pod) -> list[Violation]:
    return [
        Violation(f"{path}.runAsUser", 0, "a user other than root (0)", RESTRICTED)
        for path, sc in _contexts(pod)
        if sc.get("runAsUser") == 0
    ]


def seccomp_restricted(pod: Pod) -> list[Violation]:
    allowed = ("RuntimeDefault", "Localhost")
    on_pod = ((_spec(pod).get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    return [
        Violation(f"{path}.seccompProfile.type", None, "RuntimeDefault or Localhost, here or on the pod", RESTRICTED)
        for path, sc in _container_contexts(pod)
        if on_pod not in allowed and (sc.get("seccompProfile") or {}).get("type") not in allowed
    ]


def restricted_capabilities(pod: Pod) -> list[Violation]:
    out = []
    for path, sc in _container_contexts(pod):
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(Violation(f"{path}.capabilities.drop", caps.get("drop"), "a list holding ALL", RESTRICTED))
        out += [  # (those beyond the baseline's are its violations already)
            Violation(f"{path}.capabilities.add", cap, "only NET_BIND_SERVICE", RESTRICTED)
            for cap in caps.get("add") or []
            if cap in BASELINE_CAPABILITIES - {"NET_BIND_SERVICE"}
        ]
    return out


BASELINE_CONTROLS: list[Control] = [
    host_process,
    host_namespaces,
    privileged,
    baseline_capabilities,
    host_path_volumes,
    host_ports,
    app_armor,
    se_linux,
    proc_mount,
    seccomp_baseline,
    sysctls,
    critical_priority,
    tolerates_every_taint,
]
RESTRICTED_CONTROLS: list[Control] = [
    volume_types,
    privilege_escalation,
    non_root,
    non_root_user,
    seccomp_restricted,
    restricted_capabilities,
]


# --- as errors of the spec ------------------------------------------------------------------------------------


def check(job: TrainingJob, pods: Iterable[Pod], level: str, namespace: str) -> None:
    """SpecError naming, for every violation of the level by the job's pods, the spec field it comes from (the
    podTemplate's annotation, volume, priorityClassName or toleration, or the checkpoint volume), what the level
    allows, and the namespace label that would allow it."""
    errors: dict[tuple[str, str], FieldError] = {}
    for pod in pods:
        for v in violations(pod, level):
            looser = BASELINE if v.level == RESTRICTED else PRIVILEGED
            allowed = (
                f"{v.allowed}; namespace {namespace} enforces Pod Security {level!r} (a cluster administrator "
                f"may label it {LABEL}={looser} to allow this)"
            )
            error = FieldError(_spec_path(job, v.path), v.value, allowed)
            errors.setdefault((error.path, repr(v.value)), error)  # every host pod breaks it alike
    if errors:
        raise SpecError(list(errors.values()))


def _spec_path(job: TrainingJob, path: str) -> str:
    """The spec field a rendered pod's field comes from."""
    if path.startswith(("metadata.annotations[", "spec.priorityClassName", "spec.tolerations[")):
        return f"spec.podTemplate.{path}"
    if job.training.checkpoint.volume is not None and path.startswith("spec.volumes[checkpoint]."):
        return "spec.training.checkpoint.volume." + path.split(".", 2)[2]
    for i, volume in enumerate(job.pod_template.spec.volumes):
        if path.startswith(f"spec.volumes[{volume.get('name')}]."):
            return f"{TEMPLATE}.volumes[{i}]." + path.split(".", 2)[2]
    return f"the trainer pod's {path}"  # the operator's own part of the pod
