"""The names cluster DNS would give, as a hosts file: no DNS server runs in the local cluster, so every pod sees
a hosts file (bind-mounted over /etc/hosts) that its Node's agent keeps current, as CoreDNS keeps its records.

A pod with `hostname` H and `subdomain` S in namespace N is `H.S.N.svc.cluster.local` (and the shorter
`H.S.N.svc`, `H.S.N`, `H.S` a resolver's search list would also find), once it has an address; every pod is
also known by its own hostname to itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CLUSTER_DOMAIN = "cluster.local"


def names_of(pod: Mapping[str, Any]) -> list[str]:
    """The DNS names a pod has (none without hostname and subdomain, as for a pod no headless Service names)."""
    spec, meta = pod.get("spec", {}), pod.get("metadata", {})
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    namespace = meta.get("namespace", "default")
    base = f"{hostname}.{subdomain}"
    return [f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{base}.{namespace}.svc", f"{base}.{namespace}", base]


def hosts_text(own: Mapping[str, Any], own_ip: str, pods: Iterable[Mapping[str, Any]]) -> str:
    """The hosts file of pod `own` (at `own_ip`), given the cluster's pods with their status."""
    own_name = own.get("spec", {}).get("hostname") or own.get("metadata", {}).get("name", "")
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"{own_ip} {own_name}"]
    for pod in sorted(pods, key=lambda p: (p.get("metadata", {}).get("namespace", ""), p["metadata"]["name"])):
        ip = pod.get("status", {}).get("podIP")
        names = names_of(pod)
        if ip and names and not pod.get("metadata", {}).get("deletionTimestamp"):
            lines.append(f"{ip} {' '.join(names)}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> bool:
    """Rewrite `path` keeping its inode (a bind mount of it keeps showing the file); whether it changed."""
    if path.exists() and path.read_text() == text:
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return True
