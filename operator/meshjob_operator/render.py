"""Pure rendering of a TrainingJob's children: ConfigMap, headless Service, host pods, PodGroup.

Every function maps (spec, plan, job metadata) to a dict ready for the API server; nothing here
talks to a cluster, so the bodies are unit-tested as data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import format_quantity, parse_quantity

from meshjob.cluster.nodes import HostPod, world_size
from meshjob.errors import FieldError, SpecError
from meshjob.plan import rendered
from meshjob.spec.manifest import TrainingJob
from meshjob.spec.safeyaml import dump_yaml
from meshjob_operator import names, podsecurity, podtemplate

RUN_AS_USER = 10001  # the trainer image's user (the Dockerfile's USER): its files, its volumes' group
TERMINATION_LOG = "/dev/termination-log"  # the Kubernetes default terminationMessagePath, named for the worker
DEFAULT_GANG_SCHEDULER = "scheduler-plugins-scheduler"


@dataclass(frozen=True)
class JobMeta:
    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> JobMeta:
        meta = body.get("metadata", {})
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""))


def labels(meta: JobMeta, index: int | None = None) -> dict[str, str]:
    out = {
        names.JOB_LABEL: meta.name,
        "app.kubernetes.io/name": "meshjob",
        "app.kubernetes.io/managed-by": "meshjob-operator",
    }
    if index is not None:
        out[names.HOST_INDEX_LABEL] = str(index)
        out["app.kubernetes.io/component"] = "trainer"
    return out


def owner_reference(meta: JobMeta) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": meta.name,
        "uid": meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(meta: JobMeta, name: str, index: int | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": meta.namespace,
        "labels": labels(meta, index),
        "ownerReferences": [owner_reference(meta)],
    }


def configmap(meta: JobMeta, spec: Mapping[str, Any], files: Mapping[str, str]) -> dict[str, Any]:
    """What the pods' workers rebuild the plan from, mounted at /etc/meshjob: the job manifest, the
    hosts the plan was placed on, the NIC rate and cost model, and the plan's digest to verify it by
    (meshjob.plan.rendered says why the plan itself does not travel)."""
    manifest = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": meta.name, "namespace": meta.namespace},
        "spec": dict(spec),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(meta, names.configmap_name(meta.name)),
        "data": {rendered.JOB_FILE: dump_yaml(manifest, sort_keys=True), **files},
    }


def configmap_digest(cm: Mapping[str, Any]) -> str:
    """sha256 of what a ConfigMap gives the pods that mount it (data and binaryData; empty = absent)."""
    content = {"data": dict(cm.get("data") or {}), "binaryData": dict(cm.get("binaryData") or {})}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def service(meta: JobMeta, job: TrainingJob) -> dict[str, Any]:
    """Headless Service: gives each host pod a DNS name for the rendezvous, ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names.service_name(meta.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.JOB_LABEL: meta.name},
            "ports": [
                {"name": "rendezvous", "port": names.MASTER_PORT, "targetPort": names.MASTER_PORT},
                {"name": "metrics", "port": job.metrics.port, "targetPort": job.metrics.port},
            ],
        },
    }


def podgroup(meta: JobMeta, pods: tuple[HostPod, ...]) -> dict[str, Any]:
    """scheduler-plugins coscheduling PodGroup: all host pods or none."""
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": _metadata(meta, names.podgroup_name(meta.name)),
        "spec": {"minMember": len(pods)},
    }


def master_addr(meta: JobMeta) -> str:
    return f"{names.pod_name(meta.name, 0)}.{names.service_name(meta.name)}.{meta.namespace}.svc"


def environment(meta: JobMeta, job: TrainingJob, pod: HostPod, pods: tuple[HostPod, ...]) -> list[dict[str, Any]]:
    """torchrun's variables, Kubeflow's PET_* spellings, and meshjob's own."""
    plain = {
        "MASTER_ADDR": master_addr(meta),
        "MASTER_PORT": str(names.MASTER_PORT),
        "WORLD_SIZE": str(world_size(pods)),
        "NODE_RANK": str(pod.index),
        "PET_NNODES": str(len(pods)),
        "PET_NPROC_PER_NODE": str(pod.devices),
        "PET_NODE_RANK": str(pod.index),
        "PET_MASTER_ADDR": master_addr(meta),
        "PET_MASTER_PORT": str(names.MASTER_PORT),
        "MESHJOB_JOB": f"{names.CONFIG_DIR}/job.yaml",
        "MESHJOB_HOSTS": f"{names.CONFIG_DIR}/hosts.yaml",
        "MESHJOB_PLAN": f"{names.CONFIG_DIR}/plan.json",
        "MESHJOB_METRICS_PORT": str(job.metrics.port),
        "MESHJOB_TERMINATION_LOG": TERMINATION_LOG,  # the worker's summary: final step and loss
    }
    if job.training.checkpoint.path:
        plain["MESHJOB_CHECKPOINT_DIR"] = job.training.checkpoint.path
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in plain.items()]
    env.append({"name": "MESHJOB_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    env.append({"name": "MESHJOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    return env


def scale_quantity(value: str | int | float, factor: int, path: str = "quantity") -> str:
    """`value` times `factor`, keeping its unit suffix (2Gi x 3 = 6Gi, 500m x 2 = 1000m).

    Parsing and formatting are the kubernetes client's (kubernetes.utils.quantity); a bad value is
    reported with the field's path."""
    text = str(value).strip()
    try:
        scaled = parse_quantity(text) * factor
    except ValueError:
        raise SpecError([FieldError(path, value, "a Kubernetes quantity such as 2, 500m, 4Gi")]) from None
    suffix = text.lstrip("+-.0123456789")
    try:
        in_unit = format_quantity(scaled, suffix)[: -len(suffix)] if suffix else str(scaled)
    except ValueError:  # an exponent form such as 1e3 has no unit to keep
        in_unit, suffix = str(scaled), ""
    return format(Decimal(in_unit).normalize(), "f") + suffix  # 3.0Ki -> 3Ki


def resources(job: TrainingJob, devices: int) -> dict[str, Any]:
    """spec.resources is per device: scaled by the pod's device count, plus the device resource itself."""
    out: dict[str, dict[str, str]] = {}
    for kind in ("requests", "limits"):
        for resource, value in (job.resources.get(kind) or {}).items():
            out.setdefault(kind, {})[resource] = scale_quantity(value, devices, f"spec.resources.{kind}.{resource}")
    device = job.topology.device_resource
    out.setdefault("requests", {})[device] = str(devices)
    if device not in ("cpu", "memory"):  # extended resources need limits == requests
        out.setdefault("limits", {})[device] = str(devices)
    return out


def metrics_ports(job: TrainingJob, devices: int) -> list[dict[str, Any]]:
    """One port per local rank: rank r of the pod serves on spec.metrics.port + r (trainer/worker).

    Named metrics, metrics-1, metrics-2, ... so a PodMonitor can keep them by name pattern."""
    return [
        {
            "name": "metrics" if rank == 0 else f"metrics-{rank}",
            "containerPort": job.metrics.port + rank,
            "protocol": "TCP",
        }
        for rank in range(devices)
    ]


def pod(meta: JobMeta, job: TrainingJob, host_pod: HostPod, pods: tuple[HostPod, ...]) -> dict[str, Any]:
    """One trainer pod: `meshjob worker` for the devices the plan uses on its host, pinned to that host,
    with spec.podTemplate merged in (meshjob_operator/podtemplate.py).

    Trainers need no API access (the operator reads their progress from their metrics endpoint), so
    the pod carries no service-account token: a trainer can change nothing in the cluster. A job
    that names spec.serviceAccountName (an identity for its data, e.g. workload identity) gets it."""
    return podtemplate.merge(_own_pod(meta, job, host_pod, pods), job, _pin(job, host_pod))


def check_pod_template(job: TrainingJob) -> None:
    """SpecError naming what spec.podTemplate or the checkpoint volume would clash with (validate())."""
    host = HostPod(index=0, host="host", rack="", devices=1, stages=(0,))
    own = _own_pod(JobMeta(job.name, job.namespace, ""), job, host, (host,))
    (trainer,) = own["spec"]["containers"]
    podtemplate.check(
        job,
        owned_volumes={v["name"] for v in own["spec"]["volumes"]},
        owned_mounts={m["mountPath"] for m in trainer["volumeMounts"]},
        owned_env={e["name"] for e in trainer["env"]},
        owned_resources={k for kind in trainer["resources"].values() for k in kind},
    )


def check_pod_security(job: TrainingJob, level: str = podsecurity.RESTRICTED) -> None:
    """SpecError naming each spec field that makes the job's pods break the Pod Security level of its
    namespace (meshjob_operator/podsecurity.py), as a trainer pod would be rendered (validate())."""
    host = HostPod(index=0, host="host", rack="", devices=1, stages=(0,))
    podsecurity.check(job, [pod(JobMeta(job.name, job.namespace, ""), job, host, (host,))], level, job.namespace)


def _pin(job: TrainingJob, host_pod: HostPod) -> dict[str, Any]:
    return {"key": job.topology.host_label, "operator": "In", "values": [host_pod.host]}


def _own_pod(meta: JobMeta, job: TrainingJob, host_pod: HostPod, pods: tuple[HostPod, ...]) -> dict[str, Any]:
    """The pod without the job's template."""
    name = names.pod_name(meta.name, host_pod.index)
    metadata = _metadata(meta, name, host_pod.index)
    metadata["annotations"] = {
        "meshjob.io/devices": str(host_pod.devices),
        "meshjob.io/stages": ",".join(str(s) for s in host_pod.stages),
    }
    mounts = [
        {"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.configmap_name(meta.name)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    if job.training.checkpoint.path:
        mounts.append({"name": "checkpoint", "mountPath": job.training.checkpoint.path})
        volumes.append(podtemplate.checkpoint_volume(job))
    container = {
        "name": "trainer",
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "meshjob",
            "worker",
            "--job",
            f"{names.CONFIG_DIR}/job.yaml",
            "--nproc",
            str(host_pod.devices),
            "--node-rank",
            str(host_pod.index),
        ],
        "env": environment(meta, job, host_pod, pods),
        "ports": [
            {"name": "rendezvous", "containerPort": names.MASTER_PORT, "protocol": "TCP"},
            *metrics_ports(job, host_pod.devices),
        ],
        "resources": resources(job, host_pod.devices),
        # a failed worker's last lines (what was invalid, which rank died) become the container's termination
        # message, which the job's Failed condition quotes
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "terminationMessagePath": TERMINATION_LOG,
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # any failure is a gang restart, decided by the operator
        "hostname": name,
        "subdomain": names.service_name(meta.name),
        "enableServiceLinks": False,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [_pin(job, host_pod)]}]
                }
            }
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if job.service_account_name:
        pod_spec["serviceAccountName"] = job.service_account_name
    pod_spec["automountServiceAccountToken"] = bool(job.service_account_name)
    scheduling = job.scheduling
    if scheduling.gang:
        pod_spec["schedulerName"] = scheduling.scheduler_name or DEFAULT_GANG_SCHEDULER
        metadata["labels"]["scheduling.x-k8s.io/pod-group"] = names.podgroup_name(meta.name)
    if scheduling.queue:
        metadata["labels"]["kueue.x-k8s.io/queue-name"] = scheduling.queue
        metadata["labels"]["kueue.x-k8s.io/pod-group-name"] = meta.name
        metadata["annotations"]["kueue.x-k8s.io/pod-group-total-count"] = str(len(pods))
        if scheduling.topology_level:
            metadata["annotations"]["kueue.x-k8s.io/podset-required-topology"] = scheduling.topology_level
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
