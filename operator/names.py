"""Deterministic names and labels of a TrainingJob's children (the basis of create-if-absent)."""
from __future__ import annotations

GROUP = "meshjob.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

JOB_LABEL = "meshjob.io/job-name"
HOST_INDEX_LABEL = "meshjob.io/host-index"
STEP_ANNOTATION = "meshjob.io/step"
CHECKPOINT_ANNOTATION = "meshjob.io/checkpoint-step"

CONFIG_DIR = "/etc/meshjob"
MASTER_PORT = 29500


def pod_name(job: str, index: int) -> str:
    return f"{job}-host-{index}"


def service_name(job: str) -> str:
    return job


def configmap_name(job: str) -> str:
    return f"{job}-plan"


def podgroup_name(job: str) -> str:
    return job


def host_index(pod_name_: str, job: str) -> int | None:
    """The index encoded in a child pod's name, or None when the pod is not one of ours."""
    prefix = f"{job}-host-"
    tail = pod_name_[len(prefix):]
    if not pod_name_.startswith(prefix) or not tail.isdigit():
        return None
    return int(tail)
