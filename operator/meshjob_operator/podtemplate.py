"""spec.podTemplate and spec.training.checkpoint.volume: merged onto every trainer pod, and the checks that
keep the merge safe.

Merge, the way Kubeflow and JobSet users expect a pod template to apply:
  * labels and annotations are added; the operator's own keys win (they identify the job's pods);
  * tolerations, imagePullSecrets and volumes are appended; nodeSelector and priorityClassName are set;
  * affinity is kept whole, except that the operator's pin to the pod's host is added to every
    required node-selector term (terms are ORed, so the pin must be in each);
  * the container named `trainer`: env, envFrom and volumeMounts appended after the operator's,
    resources added for what spec.resources (per device) and the device resource do not set.
Refused (at admission and by the operator, naming the field): what would silently lose or override
the operator's own parts (a volume, mount path, env variable or resource it sets) and hostPath
volumes (a user-chosen host path is a way out of the pod; a checkpoint belongs on a PVC).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from meshjob.errors import FieldError, SpecError
from meshjob.spec.manifest import TrainingJob

TEMPLATE = "spec.podTemplate.spec"
TRAINER = f"{TEMPLATE}.containers[trainer]"


def checkpoint_volume(job: TrainingJob) -> dict[str, Any]:
    """The volume at spec.training.checkpoint.path: the spec's volume source, else an emptyDir (which does
    not survive a gang restart: the operator says so in an Event)."""
    source = job.training.checkpoint.volume or {"emptyDir": {}}
    return {"name": "checkpoint", **copy.deepcopy(dict(source))}


def check(
    job: TrainingJob, owned_volumes: set[str], owned_mounts: set[str], owned_env: set[str], owned_resources: set[str]
) -> None:
    """SpecError naming each field of the template (or checkpoint volume) the merge cannot take."""
    errors: list[FieldError] = []
    volume = job.training.checkpoint.volume
    if volume is not None:
        errors += _volume_source_errors("spec.training.checkpoint.volume", volume)
        if not job.training.checkpoint.path:
            errors.append(FieldError("spec.training.checkpoint.path", "", "a mount path for checkpoint.volume"))
    template = job.pod_template.spec
    for i, item in enumerate(template.volumes):
        path = f"{TEMPLATE}.volumes[{i}]"
        if item.get("name") in owned_volumes:
            errors.append(
                FieldError(
                    f"{path}.name",
                    item.get("name"),
                    f"a name the operator does not use ({', '.join(sorted(owned_volumes))})",
                )
            )
        errors += _volume_source_errors(path, {k: v for k, v in item.items() if k != "name"})
    for container in template.containers:
        errors += _owned(
            f"{TRAINER}.volumeMounts",
            [m.get("mountPath") for m in container.volume_mounts],
            owned_mounts,
            "a mount path the operator does not use",
        )
        errors += _owned(
            f"{TRAINER}.env", [e.get("name") for e in container.env], owned_env, "a variable the operator does not set"
        )
        for kind in ("requests", "limits"):
            errors += _owned(
                f"{TRAINER}.resources.{kind}",
                list(container.resources.get(kind) or {}),
                owned_resources,
                "a resource neither spec.resources (per device) nor spec.topology.deviceResource sets",
            )
    for key, value in [*job.pod_template.metadata.labels.items(), *job.pod_template.metadata.annotations.items()]:
        if not isinstance(value, str):
            errors.append(
                FieldError(
                    f"spec.podTemplate.metadata[{key!r}]",
                    value,
                    "a string (label and annotation values are strings: quote numbers and booleans)",
                )
            )
    if errors:
        raise SpecError(errors)


def _volume_source_errors(path: str, source: Mapping[str, Any]) -> list[FieldError]:
    if len(source) != 1:
        return [
            FieldError(path, dict(source), "exactly one volume source, e.g. {persistentVolumeClaim: {claimName: ckpt}}")
        ]
    if "hostPath" in source:
        return [
            FieldError(
                f"{path}.hostPath", source["hostPath"], "no hostPath: a PersistentVolumeClaim or another volume source"
            )
        ]
    return []


def _owned(path: str, values: list[Any], owned: set[str], allowed: str) -> list[FieldError]:
    return [FieldError(path, value, f"{allowed} ({', '.join(sorted(owned))})") for value in values if value in owned]


def merge(pod: dict[str, Any], job: TrainingJob, pin: Mapping[str, Any]) -> dict[str, Any]:
    """The pod with the job's template merged in (see the module docstring); `pin` is the operator's
    node-selector requirement that puts the pod on its host."""
    template = job.pod_template
    meta, spec = pod["metadata"], pod["spec"]
    meta["labels"] = {**template.metadata.labels, **meta["labels"]}
    meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
    t = template.spec
    if t.tolerations:
        spec["tolerations"] = [dict(x) for x in t.tolerations]
    if t.node_selector:
        spec["nodeSelector"] = dict(t.node_selector)
    if t.priority_class_name:
        spec["priorityClassName"] = t.priority_class_name
    if t.image_pull_secrets:
        spec["imagePullSecrets"] = [dict(x) for x in t.image_pull_secrets]
    spec["volumes"] = spec["volumes"] + [copy.deepcopy(dict(v)) for v in t.volumes]
    spec["affinity"] = _affinity(t.affinity, pin)
    (trainer,) = [c for c in spec["containers"] if c["name"] == "trainer"]
    for extra in t.containers:
        trainer["env"] = trainer["env"] + [copy.deepcopy(dict(e)) for e in extra.env]
        if extra.env_from:
            trainer["envFrom"] = [copy.deepcopy(dict(e)) for e in extra.env_from]
        trainer["volumeMounts"] = trainer["volumeMounts"] + [copy.deepcopy(dict(m)) for m in extra.volume_mounts]
        for kind, values in extra.resources.items():
            trainer["resources"].setdefault(kind, {}).update(copy.deepcopy(dict(values)))
    return pod


def _affinity(user: Mapping[str, Any], pin: Mapping[str, Any]) -> dict[str, Any]:
    affinity = copy.deepcopy(dict(user))
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*(term.get("matchExpressions") or []), dict(pin)]} for term in terms
    ]
    return affinity
