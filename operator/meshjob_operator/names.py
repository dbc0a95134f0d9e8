"""Deterministic names and labels of a TrainingJob's children (the basis of create-if-absent)."""

from __future__ import annotations

from meshjob.spec.api import (  # noqa: F401
    API_VERSION,
    GROUP,
    HOST_INDEX_LABEL,
    HOST_POD_INFIX,
    JOB_LABEL,
    KIND,
    MASTER_PORT,
    PLURAL,
    VERSION,
    pod_name,
)

CONFIG_DIR = "/etc/meshjob"


def service_name(job: str) -> str:
    return job


def configmap_name(job: str) -> str:
    return f"{job}-plan"


def podgroup_name(job: str) -> str:
    return job


def host_index(pod_name_: str, job: str) -> int | None:
    """The index encoded in a child pod's name, or None when the pod is not one of ours."""
    prefix = f"{job}{HOST_POD_INFIX}"
    tail = pod_name_[len(prefix) :]
    if not pod_name_.startswith(prefix) or not tail.isdigit():
        return None
    return int(tail)
