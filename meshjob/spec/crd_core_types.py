"""The Kubernetes core types spec.podTemplate merges (Affinity, Toleration, Volume, EnvVar, ...) as bounded CRD
schemas, field by field as upstream's, and the check of a value against one of them."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from meshjob.errors import FieldError
from meshjob.spec.model import INT32_MAX, INT64_MAX, MAX_JOB_HOSTS, MAX_LABEL_KEY, MAX_NAME, MAX_PATH

Schema = dict[str, Any]

LABEL_VALUE = 63  # a label value, a DNS label (a volume's name)
MAX_TEXT = 32768  # free text: an env variable's value, an annotation
MAX_ITEMS = 64  # short lists: tolerations, selector terms and expressions, key-to-path items, ...
MAX_VALUES = MAX_JOB_HOSTS  # values of one match expression: node names, as many as a job's hosts
MAX_ENV = 512  # env variables of the trainer container
MAX_VOLUMES = 128  # volumes, volume mounts
MAX_KEYS = 128  # maps: labels, annotations, nodeSelector, matchLabels, volumeAttributes, options
MAX_RESOURCES = 32  # resource names in requests or limits
MAX_QUANTITY = 64
# resource.Quantity's syntax (k8s.io/apimachinery), as upstream's generated CRDs write it
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
FILE_MODE = 0o777  # defaultMode, mode: permission bits


def string(max_length: int = MAX_NAME, *enum: str, description: str = "") -> Schema:
    out: Schema = {"type": "string", "maxLength": max_length}
    if enum:
        out["enum"] = list(enum)
    if description:
        out["description"] = description
    return out


def integer(minimum: int = -INT32_MAX - 1, maximum: int = INT32_MAX) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def boolean() -> Schema:
    return {"type": "boolean"}


def array(items: Schema, max_items: int = MAX_ITEMS) -> Schema:
    return {"type": "array", "maxItems": max_items, "items": items}


def obj(properties: dict[str, Schema], *required: str, description: str = "") -> Schema:
    """An object of these properties only: the API server prunes any other key before it stores or even
    validates the object, so nothing nests under an object deeper than its schema."""
    out: Schema = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    return out


def string_map(max_value: int, max_keys: int = MAX_KEYS, description: str = "") -> Schema:
    out: Schema = {"type": "object", "maxProperties": max_keys, "additionalProperties": string(max_value)}
    if description:
        out["description"] = description
    return out


def free_form(depth: int, max_keys: int, max_items: int, max_length: int, description: str = "") -> Schema:
    """Any JSON value whose mappings and lists nest at most `depth` deep, with at most max_keys keys, max_items
    items and max_length characters in each. Kept open (x-kubernetes-preserve-unknown-fields) one level at a time:
    each level's additionalProperties and items are the next level, and the last takes scalars only (its keys are
    forbidden properties, and the API server empties their values as it prunes), so the server never holds a
    value nested deeper than the schema (a deep one costs it exponential CPU before any validation runs).
    Not nullable: the API server drops a null here, as it does in any field that is not nullable."""
    out: Schema = {"x-kubernetes-preserve-unknown-fields": True, "maxLength": max_length}
    if depth == 0:  # a list is refused, but its items still pruned
        scalar = out | {"maxItems": 0, "additionalProperties": False}
        return ({"description": description} if description else {}) | scalar | {"items": tree(scalar)}
    if description:
        out["description"] = description
    inner = free_form(depth - 1, max_keys, max_items, max_length)
    out.update(maxProperties=max_keys, maxItems=max_items, additionalProperties=inner, items=tree(inner))
    return out


def quantity(description: str = "") -> Schema:
    """A resource.Quantity: a number or a string such as 500m, 4Gi (a scalar: JSON numbers like 0.5 are quantities
    in a Pod, so no int-or-string, which refuses them)."""
    out = free_form(0, 0, 0, MAX_QUANTITY, description or "a quantity: a number or a string such as 500m, 4Gi")
    out["pattern"] = QUANTITY_PATTERN
    return out


def tree(schema: Schema) -> Schema:
    """A fresh tree (shared sub-dicts would be written as YAML anchors)."""
    out: Schema = json.loads(json.dumps(schema))
    return out


def quantities() -> Schema:
    return {"type": "object", "maxProperties": MAX_RESOURCES, "additionalProperties": quantity()}


# --- selectors and affinity --------------------------------------------------------------------------------------

LOCAL_OBJECT_REFERENCE = obj({"name": string()})
LABEL_SELECTOR = obj(
    {
        "matchLabels": string_map(LABEL_VALUE),
        "matchExpressions": array(
            obj(
                {
                    "key": string(MAX_LABEL_KEY),
                    "operator": string(16, "In", "NotIn", "Exists", "DoesNotExist"),
                    "values": array(string(LABEL_VALUE), MAX_VALUES),
                },
                "key",
                "operator",
            )
        ),
    }
)
NODE_SELECTOR_REQUIREMENT = obj(
    {
        "key": string(MAX_LABEL_KEY),
        "operator": string(16, "In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"),
        "values": array(string(MAX_NAME), MAX_VALUES),  # matchFields: node names (DNS subdomains)
    },
    "key",
    "operator",
)
NODE_SELECTOR_TERM = obj(
    {"matchExpressions": array(NODE_SELECTOR_REQUIREMENT), "matchFields": array(NODE_SELECTOR_REQUIREMENT)}
)
NODE_AFFINITY = obj(
    {
        "requiredDuringSchedulingIgnoredDuringExecution": obj(
            {"nodeSelectorTerms": array(NODE_SELECTOR_TERM)}, "nodeSelectorTerms"
        ),
        "preferredDuringSchedulingIgnoredDuringExecution": array(
            obj({"weight": integer(1, 100), "preference": NODE_SELECTOR_TERM}, "weight", "preference")
        ),
    }
)
POD_AFFINITY_TERM = obj(
    {
        "labelSelector": LABEL_SELECTOR,
        "namespaceSelector": LABEL_SELECTOR,
        "namespaces": array(string(LABEL_VALUE)),
        "topologyKey": string(MAX_LABEL_KEY),
        "matchLabelKeys": array(string(MAX_LABEL_KEY)),
        "mismatchLabelKeys": array(string(MAX_LABEL_KEY)),
    },
    "topologyKey",
)
POD_AFFINITY = obj(
    {
        "requiredDuringSchedulingIgnoredDuringExecution": array(POD_AFFINITY_TERM),
        "preferredDuringSchedulingIgnoredDuringExecution": array(
            obj({"weight": integer(1, 100), "podAffinityTerm": POD_AFFINITY_TERM}, "weight", "podAffinityTerm")
        ),
    }
)
AFFINITY = obj({"nodeAffinity": NODE_AFFINITY, "podAffinity": POD_AFFINITY, "podAntiAffinity": POD_AFFINITY})
TOLERATION = obj(
    {
        "key": string(MAX_LABEL_KEY),
        "operator": string(16, "", "Exists", "Equal"),
        "value": string(LABEL_VALUE),
        "effect": string(32, "", "NoSchedule", "PreferNoSchedule", "NoExecute"),
        "tolerationSeconds": integer(-INT64_MAX, INT64_MAX),
    }
)

# --- the trainer container's env, mounts and resources -----------------------------------------------------------

OBJECT_FIELD_SELECTOR = obj({"apiVersion": string(), "fieldPath": string(MAX_PATH)}, "fieldPath")
RESOURCE_FIELD_SELECTOR = obj(
    {"containerName": string(LABEL_VALUE), "resource": string(), "divisor": quantity()}, "resource"
)
KEY_SELECTOR = obj({"name": string(), "key": string(), "optional": boolean()}, "key")
ENV_VAR = obj(
    {
        "name": string(),
        "value": string(MAX_TEXT),
        "valueFrom": obj(
            {
                "configMapKeyRef": KEY_SELECTOR,
                "secretKeyRef": KEY_SELECTOR,
                "fieldRef": OBJECT_FIELD_SELECTOR,
                "resourceFieldRef": RESOURCE_FIELD_SELECTOR,
            }
        ),
    },
    "name",
)
ENV_FROM_REF = obj({"name": string(), "optional": boolean()})
ENV_FROM = obj({"prefix": string(), "configMapRef": ENV_FROM_REF, "secretRef": ENV_FROM_REF})
VOLUME_MOUNT = obj(
    {
        "name": string(LABEL_VALUE),
        "mountPath": string(MAX_PATH),
        "subPath": string(MAX_PATH),
        "subPathExpr": string(MAX_PATH),
        "readOnly": boolean(),
        "mountPropagation": string(32, "None", "HostToContainer", "Bidirectional"),
        "recursiveReadOnly": string(16, "Disabled", "IfPossible", "Enabled"),
    },
    "name",
    "mountPath",
)
RESOURCE_REQUIREMENTS = obj(
    {
        "limits": quantities(),
        "requests": quantities(),
        "claims": array(obj({"name": string(LABEL_VALUE), "request": string(LABEL_VALUE)}, "name")),
    }
)

# --- volumes -------------------------------------------------------------------------------------------------------

FS_TYPE = string(LABEL_VALUE)
KEY_TO_PATH = obj({"key": string(), "path": string(MAX_PATH), "mode": integer(0, FILE_MODE)}, "key", "path")
DOWNWARD_API_FILE = obj(
    {
        "path": string(MAX_PATH),
        "fieldRef": OBJECT_FIELD_SELECTOR,
        "resourceFieldRef": RESOURCE_FIELD_SELECTOR,
        "mode": integer(0, FILE_MODE),
    },
    "path",
)
OBJECT_PROJECTION = obj({"name": string(), "items": array(KEY_TO_PATH), "optional": boolean()})
PVC_SPEC = obj(
    {
        "accessModes": array(string(32, "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"), 4),
        "resources": obj({"limits": quantities(), "requests": quantities()}),
        "storageClassName": string(),
        "volumeAttributesClassName": string(),
        "volumeMode": string(16, "Filesystem", "Block"),
        "volumeName": string(),
        "selector": LABEL_SELECTOR,
        "dataSource": obj({"apiGroup": string(), "kind": string(), "name": string()}, "kind", "name"),
        "dataSourceRef": obj(
            {"apiGroup": string(), "kind": string(), "name": string(), "namespace": string(LABEL_VALUE)},
            "kind",
            "name",
        ),
    }
)
# every source of core/v1 Volume: a source left out would be pruned, and the volume left without one
VOLUME_SOURCES: dict[str, Schema] = {
    "persistentVolumeClaim": obj({"claimName": string(), "readOnly": boolean()}, "claimName"),
    "configMap": obj(
        {"name": string(), "items": array(KEY_TO_PATH), "defaultMode": integer(0, FILE_MODE), "optional": boolean()}
    ),
    "secret": obj(
        {
            "secretName": string(),
            "items": array(KEY_TO_PATH),
            "defaultMode": integer(0, FILE_MODE),
            "optional": boolean(),
        }
    ),
    "emptyDir": obj({"medium": string(LABEL_VALUE), "sizeLimit": quantity()}),
    # refused by the operator (a way out of the pod), described so that it says so instead of finding no source
    "hostPath": obj({"path": string(MAX_PATH), "type": string(32)}, "path"),
    "nfs": obj({"server": string(), "path": string(MAX_PATH), "readOnly": boolean()}, "server", "path"),
    "csi": obj(
        {
            "driver": string(),
            "fsType": FS_TYPE,
            "readOnly": boolean(),
            "volumeAttributes": string_map(MAX_TEXT),
            "nodePublishSecretRef": LOCAL_OBJECT_REFERENCE,
        },
        "driver",
    ),
    "downwardAPI": obj({"items": array(DOWNWARD_API_FILE), "defaultMode": integer(0, FILE_MODE)}),
    "projected": obj(
        {
            "defaultMode": integer(0, FILE_MODE),
            "sources": array(
                obj(
                    {
                        "configMap": OBJECT_PROJECTION,
                        "secret": OBJECT_PROJECTION,
                        "downwardAPI": obj({"items": array(DOWNWARD_API_FILE)}),
                        "serviceAccountToken": obj(
                            {
                                "audience": string(),
                                "expirationSeconds": integer(600, INT64_MAX),
                                "path": string(MAX_PATH),
                            },
                            "path",
                        ),
                        "clusterTrustBundle": obj(
                            {
                                "name": string(),
                                "signerName": string(),
                                "labelSelector": LABEL_SELECTOR,
                                "optional": boolean(),
                                "path": string(MAX_PATH),
                            },
                            "path",
                        ),
                    }
                )
            ),
        }
    ),
    "ephemeral": obj(
        {
            "volumeClaimTemplate": obj(
                {
                    "metadata": obj({"labels": string_map(LABEL_VALUE), "annotations": string_map(MAX_TEXT)}),
                    "spec": PVC_SPEC,
                },
                "spec",
            )
        }
    ),
    "image": obj({"reference": string(1024), "pullPolicy": string(16, "Always", "Never", "IfNotPresent")}),
    # the in-tree drivers (most now served by CSI drivers under the same API)
    "awsElasticBlockStore": obj(
        {"volumeID": string(), "fsType": FS_TYPE, "partition": integer(), "readOnly": boolean()}, "volumeID"
    ),
    "azureDisk": obj(
        {
            "diskName": string(),
            "diskURI": string(1024),
            "cachingMode": string(16),
            "fsType": FS_TYPE,
            "kind": string(16),
            "readOnly": boolean(),
        },
        "diskName",
        "diskURI",
    ),
    "azureFile": obj({"secretName": string(), "shareName": string(), "readOnly": boolean()}, "secretName", "shareName"),
    "cephfs": obj(
        {
            "monitors": array(string()),
            "path": string(MAX_PATH),
            "user": string(),
            "secretFile": string(MAX_PATH),
            "secretRef": LOCAL_OBJECT_REFERENCE,
            "readOnly": boolean(),
        },
        "monitors",
    ),
    "cinder": obj(
        {"volumeID": string(), "fsType": FS_TYPE, "readOnly": boolean(), "secretRef": LOCAL_OBJECT_REFERENCE},
        "volumeID",
    ),
    "fc": obj(
        {
            "targetWWNs": array(string()),
            "lun": integer(0, 255),
            "wwids": array(string()),
            "fsType": FS_TYPE,
            "readOnly": boolean(),
        }
    ),
    "flexVolume": obj(
        {
            "driver": string(),
            "fsType": FS_TYPE,
            "secretRef": LOCAL_OBJECT_REFERENCE,
            "readOnly": boolean(),
            "options": string_map(MAX_TEXT),
        },
        "driver",
    ),
    "flocker": obj({"datasetName": string(), "datasetUUID": string()}),
    "gcePersistentDisk": obj(
        {"pdName": string(), "fsType": FS_TYPE, "partition": integer(), "readOnly": boolean()}, "pdName"
    ),
    "gitRepo": obj({"repository": string(MAX_PATH), "revision": string(), "directory": string(MAX_PATH)}, "repository"),
    "glusterfs": obj({"endpoints": string(), "path": string(MAX_PATH), "readOnly": boolean()}, "endpoints", "path"),
    "iscsi": obj(
        {
            "targetPortal": string(),
            "iqn": string(),
            "lun": integer(0, 255),
            "iscsiInterface": string(),
            "fsType": FS_TYPE,
            "readOnly": boolean(),
            "portals": array(string()),
            "chapAuthDiscovery": boolean(),
            "chapAuthSession": boolean(),
            "secretRef": LOCAL_OBJECT_REFERENCE,
            "initiatorName": string(),
        },
        "targetPortal",
        "iqn",
        "lun",
    ),
    "photonPersistentDisk": obj({"pdID": string(), "fsType": FS_TYPE}, "pdID"),
    "portworxVolume": obj({"volumeID": string(), "fsType": FS_TYPE, "readOnly": boolean()}, "volumeID"),
    "quobyte": obj(
        {
            "registry": string(),
            "volume": string(),
            "readOnly": boolean(),
            "user": string(),
            "group": string(),
            "tenant": string(),
        },
        "registry",
        "volume",
    ),
    "rbd": obj(
        {
            "monitors": array(string()),
            "image": string(),
            "fsType": FS_TYPE,
            "pool": string(),
            "user": string(),
            "keyring": string(MAX_PATH),
            "secretRef": LOCAL_OBJECT_REFERENCE,
            "readOnly": boolean(),
        },
        "monitors",
        "image",
    ),
    "scaleIO": obj(
        {
            "gateway": string(MAX_PATH),
            "system": string(),
            "secretRef": LOCAL_OBJECT_REFERENCE,
            "sslEnabled": boolean(),
            "protectionDomain": string(),
            "storagePool": string(),
            "storageMode": string(16),
            "volumeName": string(),
            "fsType": FS_TYPE,
            "readOnly": boolean(),
        },
        "gateway",
        "system",
        "secretRef",
    ),
    "storageos": obj(
        {
            "volumeName": string(),
            "volumeNamespace": string(LABEL_VALUE),
            "fsType": FS_TYPE,
            "readOnly": boolean(),
            "secretRef": LOCAL_OBJECT_REFERENCE,
        }
    ),
    "vsphereVolume": obj(
        {"volumePath": string(MAX_PATH), "fsType": FS_TYPE, "storagePolicyName": string(), "storagePolicyID": string()},
        "volumePath",
    ),
}
VOLUME_SOURCE = obj(VOLUME_SOURCES)
VOLUME = obj({"name": string(LABEL_VALUE), **VOLUME_SOURCES}, "name")

CONFIG_DEPTH = 4  # spec.model.config: mappings and lists nested at most this deep (config.a.b.c.d is a scalar)

# (dataclass, attribute) -> the schema of each field the spec's table types as a free mapping (Mapping[str, Any]) or
# a list of them: the Kubernetes types the operator merges into the trainer pods (meshjob_operator/podtemplate.py),
# and the custom model's settings, open at a bounded depth.
FIELDS: dict[tuple[str, str], Callable[[], Schema]] = {
    ("ModelSpec", "config"): lambda: free_form(
        CONFIG_DEPTH,
        MAX_KEYS,
        MAX_VALUES,
        MAX_TEXT,
        f"any values, in mappings and lists nested at most {CONFIG_DEPTH} deep",
    ),
    ("CheckpointSpec", "volume"): lambda: VOLUME_SOURCE,
    ("TrainingJob", "resources"): lambda: RESOURCE_REQUIREMENTS,
    ("PodTemplateMetadata", "labels"): lambda: string_map(LABEL_VALUE),
    ("PodTemplateMetadata", "annotations"): lambda: string_map(MAX_TEXT),
    ("PodTemplateSpec", "tolerations"): lambda: array(TOLERATION),
    ("PodTemplateSpec", "node_selector"): lambda: string_map(LABEL_VALUE),
    ("PodTemplateSpec", "affinity"): lambda: AFFINITY,
    ("PodTemplateSpec", "image_pull_secrets"): lambda: array(LOCAL_OBJECT_REFERENCE),
    ("PodTemplateSpec", "volumes"): lambda: array(VOLUME, MAX_VOLUMES),
    ("ContainerTemplate", "env"): lambda: array(ENV_VAR, MAX_ENV),
    ("ContainerTemplate", "env_from"): lambda: array(ENV_FROM),
    ("ContainerTemplate", "volume_mounts"): lambda: array(VOLUME_MOUNT, MAX_VOLUMES),
    ("ContainerTemplate", "resources"): lambda: RESOURCE_REQUIREMENTS,
}


def schema_of_field(owner: str, attr: str) -> Schema | None:
    """A fresh copy of FIELDS' schema of dataclass `owner`'s attribute, or None when it has none."""
    make = FIELDS.get((owner, attr))
    return None if make is None else tree(make())


# --- the check --------------------------------------------------------------------------------------------------


def check(schema: Schema, value: Any, path: str) -> list[FieldError]:
    """Where `value` breaks `schema` (as kube-apiserver checks a custom resource, and as JSON Schema reads it), each
    error naming the field; stricter in two ways, so that what passes here passes there: a key the schema does not
    describe is an unknown field (the API server would drop it), and null is refused where it is not nullable (the
    API server drops it). `schema` uses only what this module writes."""
    errors: list[FieldError] = []
    _check(schema, value, path, errors)
    return errors


def _check(s: Schema, value: Any, path: str, errors: list[FieldError]) -> None:
    if value is None:
        if "type" in s and not s.get("nullable"):
            errors.append(FieldError(path, value, _words(s)))
        return
    kind = s.get("type")
    if kind is not None and not _is(kind, value) or "enum" in s and value not in s["enum"]:
        errors.append(FieldError(path, value, _words(s)))
        return
    problem = _bounds(s, value)
    if problem:
        errors.append(FieldError(path, value, problem))
        return
    if isinstance(value, Mapping):
        known = s.get("properties", {})
        extra = s.get("additionalProperties", False)
        missing = [k for k in s.get("required", ()) if k not in value]
        if missing:
            errors.append(FieldError(path, value, f"required: {', '.join(missing)}"))
        for key, sub in value.items():
            where = f"{path}.{key}"
            if key in known:
                _check(known[key], sub, where, errors)
            elif isinstance(extra, dict):
                _check(extra, sub, where, errors)
            elif known:
                errors.append(FieldError(where, sub, f"unknown field; known fields: {', '.join(known)}"))
            else:
                errors.append(FieldError(where, sub, f"a scalar at {path}: nothing nests deeper"))
    elif isinstance(value, list) and "items" in s:
        for i, item in enumerate(value):
            _check(s["items"], item, f"{path}[{i}]", errors)


def _is(kind: str, value: Any) -> bool:
    if kind == "integer":  # Kubernetes reads a JSON number with an integral value (2.0, 1e3) as an integer
        return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    types: dict[str, type | tuple[type, ...]] = {"string": str, "boolean": bool, "object": Mapping, "array": list}
    return isinstance(value, types[kind])


def _bounds(s: Schema, value: Any) -> str | None:
    if isinstance(value, str):
        if "maxLength" in s and len(value) > s["maxLength"]:
            return f"a string of at most {s['maxLength']} characters"
        if "pattern" in s and not re.search(s["pattern"], value):
            return _words(s)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in s and value < s["minimum"] or "maximum" in s and value > s["maximum"]:
            return _words(s)
    elif isinstance(value, list) and "maxItems" in s and len(value) > s["maxItems"]:
        return f"a list of at most {s['maxItems']} items" if s["maxItems"] else "a scalar: no list here"
    elif isinstance(value, Mapping) and "maxProperties" in s and len(value) > s["maxProperties"]:
        return f"a mapping of at most {s['maxProperties']} keys"
    return None


def _words(s: Schema) -> str:
    if "enum" in s:
        return "one of " + ", ".join(repr(v) if v == "" else str(v) for v in s["enum"])
    if "pattern" in s:
        return s.get("description") or f"a string matching {s['pattern']}"
    kind = s.get("type")
    if kind in ("integer", "number") and "minimum" in s:
        return f"{'an integer' if kind == 'integer' else 'a number'} in {s['minimum']}..{s['maximum']}"
    words = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false"}
    if kind in words:
        return words[kind]
    if kind == "array":
        return "a list"
    if kind == "object" and "properties" in s:
        return f"a mapping with fields {', '.join(s['properties'])}"
    return "a mapping"
