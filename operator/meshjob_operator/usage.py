"""Devices other jobs hold: one cluster pod list shared by the plans that start together, plus reservations.

Many jobs created at once used to list every pod of the cluster twice per placement attempt and plan on the
same free nodes, so all but one found their devices taken. Here a list younger than `max_age_s` is shared
(one request in flight at a time), and the devices a plan takes are reserved from the moment it is accepted
(inside the reconciler's placement lock) until a pod list read after its pods were created shows them: the
next plan, even from a stale list, sees them as taken. A reservation is written as the pods it stands for
(same namespace, name, job label and node), so a listed pod replaces its reservation instead of counting twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshjob.cluster.nodes import HostPod
from meshjob.spec.api import JOB_LABEL, pod_name

Key = tuple[str, str]  # (namespace, job name)
MAX_AGE_S = 1.0  # a pod list this young serves another plan: reservations cover what this operator created since


@dataclass
class Reservation:
    pods: list[dict[str, Any]]  # pod-shaped: what placement counts (devices_in_use)
    created_at: float | None = None  # monotonic time its pods were created; None while they are being created


@dataclass
class DeviceUsage:
    list_pods: Callable[[], Awaitable[list[dict[str, Any]]]]  # every running pod of the cluster (Kube)
    max_age_s: float = MAX_AGE_S
    clock: Callable[[], float] = time.monotonic
    lists: int = 0  # pod lists requested so far (tests, the benchmark)
    _listed: tuple[float, list[dict[str, Any]]] | None = None  # (monotonic time the list was asked for, pods)
    _listing: asyncio.Future[tuple[float, list[dict[str, Any]]]] | None = None
    _reserved: dict[Key, Reservation] = field(default_factory=dict)

    async def pods(self) -> list[dict[str, Any]]:
        """The cluster's running pods, with reservations for plans whose pods the list may not show yet."""
        asked, listed = await self._list()
        for key, held in list(self._reserved.items()):  # a list asked for after the pods existed shows them
            if held.created_at is not None and asked > held.created_at:
                del self._reserved[key]
        names = {_key_of(p) for p in listed}
        extra = [p for held in self._reserved.values() for p in held.pods if _key_of(p) not in names]
        return [*listed, *extra]

    async def _list(self) -> tuple[float, list[dict[str, Any]]]:
        if self._listed is not None and self.clock() - self._listed[0] < self.max_age_s:
            return self._listed
        if self._listing is not None:  # one request at a time: the plans that wait for it share it
            return await asyncio.shield(self._listing)
        self._listing = asyncio.get_running_loop().create_future()
        asked = self.clock()
        try:
            self.lists += 1
            listed = (asked, await self.list_pods())
        except BaseException as err:
            self._listing.set_exception(err)
            self._listing.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        else:
            self._listing.set_result(listed)
            self._listed = listed
            return listed
        finally:
            self._listing = None

    def reserve(self, key: Key, pods: Sequence[HostPod], node_of_host: Mapping[str, str], resource: str) -> None:
        """The plan of job `key` was accepted: its pods' devices are taken from now on."""
        namespace, job = key
        self._reserved[key] = Reservation(
            [
                {
                    "metadata": {"namespace": namespace, "name": pod_name(job, p.index), "labels": {JOB_LABEL: job}},
                    "spec": {
                        "nodeName": node_of_host.get(p.host, ""),
                        "containers": [{"resources": {"requests": {resource: str(p.devices)}}}],
                    },
                    "status": {"phase": "Pending"},
                }
                for p in pods
            ]
        )

    def created(self, key: Key) -> None:
        """Its pods exist now: the reservation lasts until a pod list asked for from now on shows them."""
        held = self._reserved.get(key)
        if held is not None:
            held.created_at = self.clock()

    def release(self, key: Key) -> None:
        """The plan was not carried out (its pods were not created): its devices are free again."""
        self._reserved.pop(key, None)

    def reserved(self) -> dict[Key, int]:
        """Pods reserved per job (tests)."""
        return {key: len(held.pods) for key, held in self._reserved.items()}


def _key_of(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
