"""Placement: hosts -> stage meshes (each mesh row on one host; racks and adjacency respected).

A stage's mesh has shape [rows, d1, ...]: row r needs prod(mesh[1:]) devices on one host, and
the rows of one stage sit on distinct hosts (mesh dim 0 runs across hosts). Several stages may
share a host when it has the devices.

Preferences, in order, for each row (a deterministic depth-first search that backtracks only
when the preferred choice leaves a later row without a host):
  1. the stage's home rack: the rack nearest to the previous stage's rack that can hold the whole
     stage (racks are ordered by first appearance in the host list; "near" = close in that order),
     then racks by distance from it;
  2. hosts that already hold the previous stage (adjacent stages on one host talk over loopback);
     "previous" in spec.topology.stageOrder (meshjob.layout.stage_order: chain, or fold for skip edges);
  3. best fit (fewest devices left over, which keeps big hosts for big rows), then host order.
Global ranks run stage by stage, row-major over each mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshjob.errors import FieldError, PlacementError, SpecError
from meshjob.layout.mesh import Mesh
from meshjob.layout.stage_order import stage_order
from meshjob.spec.manifest import MAX_DEVICES_PER_HOST, MAX_NAME, TrainingJob
from meshjob.spec.safeyaml import dump_yaml, load_one, read_text, source_name

MAX_SEARCH_NODES = 200_000  # backtracking budget; beyond it the cluster is reported as too small
MAX_CLUSTER_HOSTS = 5000  # hosts in a hosts file: Kubernetes' largest supported cluster (5000 nodes)


@dataclass(frozen=True)
class Host:
    name: str
    devices: int
    rack: str = ""


@dataclass(frozen=True)
class RankSlot:
    rank: int
    stage: int
    host: int  # index into Placement.hosts
    local_device: int  # device index on that host


@dataclass(frozen=True)
class Placement:
    hosts: tuple[Host, ...]
    slots: tuple[RankSlot, ...]  # ordered by global rank
    mesh_shapes: tuple[tuple[int, ...], ...]  # per stage

    @property
    def world_size(self) -> int:
        return len(self.slots)

    @property
    def num_stages(self) -> int:
        return len(self.mesh_shapes)

    def ranks_on(self, host: int) -> tuple[int, ...]:
        return tuple(s.rank for s in self.slots if s.host == host)

    def host_of(self, rank: int) -> int:
        return self.slots[rank].host

    def stage_of(self, rank: int) -> int:
        return self.slots[rank].stage

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(s.rank for s in self.slots if s.stage == stage)

    def mesh(self, stage: int) -> Mesh:
        ranks = self.stage_ranks(stage)
        return Mesh(shape=self.mesh_shapes[stage], ranks=ranks, hosts=tuple(self.host_of(r) for r in ranks))

    def hosts_used(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s.host for s in self.slots))

    def to_json(self) -> list[dict[str, Any]]:
        """One entry per mesh row: {stage, row, host, rack, devices (global ranks), local_devices}."""
        rows: list[dict[str, Any]] = []
        for stage, shape in enumerate(self.mesh_shapes):
            ranks = self.stage_ranks(stage)
            per_row = math.prod(shape[1:])
            for row in range(shape[0]):
                row_slots = [self.slots[r] for r in ranks[row * per_row : (row + 1) * per_row]]
                host = self.hosts[row_slots[0].host]
                rows.append(
                    {
                        "stage": stage,
                        "row": row,
                        "host": host.name,
                        "rack": host.rack,
                        "devices": [s.rank for s in row_slots],
                        "local_devices": [s.local_device for s in row_slots],
                    }
                )
        return rows


@dataclass(frozen=True)
class _Row:
    stage: int
    row: int
    devices: int


def _rows(job: TrainingJob) -> list[_Row]:
    return [
        _Row(stage, row, math.prod(st.mesh[1:])) for stage, st in enumerate(job.stages) for row in range(st.mesh[0])
    ]


def _check_hosts(hosts: Sequence[Host]) -> None:
    errors: list[FieldError] = []
    seen: set[str] = set()
    for i, host in enumerate(hosts):
        if not isinstance(host.name, str) or not host.name:
            errors.append(FieldError(f"hosts[{i}].name", host.name, "a non-empty string"))
        elif host.name in seen:
            errors.append(FieldError(f"hosts[{i}].name", host.name, "a name not used by another host"))
        seen.add(host.name)
        if not isinstance(host.devices, int) or isinstance(host.devices, bool) or host.devices < 0:
            errors.append(FieldError(f"hosts[{i}].devices", host.devices, "an integer >= 0"))
        if not isinstance(host.rack, str):
            errors.append(FieldError(f"hosts[{i}].rack", host.rack, "a string (empty: no rack)"))
    if errors:
        raise SpecError(errors)


# A search state: rows placed, and how many hosts have each (free devices, used by the current stage).
_State = tuple[int, tuple[tuple[tuple[int, bool], int], ...]]


class _Search:
    """Depth-first assignment of rows to hosts in preference order (an explicit stack: a job may
    have thousands of rows)."""

    def __init__(self, rows: list[_Row], hosts: Sequence[Host], previous: dict[int, int]):
        self.rows = rows
        self.previous = previous  # stage -> the stage placed before it (-1: none)
        self.racks = list(dict.fromkeys(h.rack for h in hosts))
        self.rack_index = [self.racks.index(h.rack) for h in hosts]
        self.free = [h.devices for h in hosts]
        self.stage_rows = Counter(r.stage for r in rows)
        self.assignment: list[int] = []
        self.stage_hosts: dict[int, set[int]] = {}  # stage -> hosts holding its placed rows
        self.home: dict[int, int] = {}  # stage -> home rack index
        self.failed: set[_State] = set()  # canonical states known to have no completion

    def run(self) -> list[int] | None:
        frames: list[tuple[list[int], _State]] = []  # per placed-or-trying row: candidates, state
        tried: list[int] = []  # per frame: how many candidates were tried
        nodes = 0
        while len(self.assignment) < len(self.rows):
            index = len(self.assignment)
            if len(frames) == index:  # first visit of this row
                nodes += 1
                row = self.rows[index]
                if row.row == 0:
                    self.home[row.stage] = self._home_rack(row)
                state = self._state(row)
                blocked = state in self.failed or nodes > MAX_SEARCH_NODES
                frames.append(([] if blocked else self._candidates(row), state))
                tried.append(0)
            candidates, state = frames[-1]
            if tried[-1] < len(candidates):
                self._assign(candidates[tried[-1]])
                tried[-1] += 1
                continue
            # every candidate of this row failed: remember the state, backtrack one row
            self.failed.add(state)
            frames.pop()
            tried.pop()
            if self.rows[index].row == 0:
                del self.home[self.rows[index].stage]
            if not self.assignment:
                return None
            self._unassign()
        return list(self.assignment)

    def _assign(self, host: int) -> None:
        row = self.rows[len(self.assignment)]
        self.free[host] -= row.devices
        self.stage_hosts.setdefault(row.stage, set()).add(host)
        self.assignment.append(host)

    def _unassign(self) -> None:
        host = self.assignment.pop()
        row = self.rows[len(self.assignment)]
        self.free[host] += row.devices
        self.stage_hosts[row.stage].discard(host)

    def _home_rack(self, row: _Row) -> int:
        previous = self.home.get(self.previous[row.stage], 0)
        fitting = Counter(self.rack_index[i] for i, f in enumerate(self.free) if f >= row.devices)
        fits = [r for r in range(len(self.racks)) if fitting[r] >= self.stage_rows[row.stage]]
        return min(fits, key=lambda r: (abs(r - previous), r)) if fits else previous

    def _candidates(self, row: _Row) -> list[int]:
        used_by_stage = self.stage_hosts.get(row.stage, set())
        previous_stage_hosts = self.stage_hosts.get(self.previous[row.stage], set())
        home = self.home[row.stage]
        # hosts alike in free devices, rack and previous-stage membership are interchangeable for
        # every later row: trying one of each kind keeps the search small when it must backtrack
        first_of_kind: dict[tuple[int, int, bool], int] = {}
        for i, free in enumerate(self.free):
            if free >= row.devices and i not in used_by_stage:
                first_of_kind.setdefault((free, self.rack_index[i], i in previous_stage_hosts), i)
        return sorted(
            first_of_kind.values(),
            key=lambda i: (
                abs(self.rack_index[i] - home),
                i not in previous_stage_hosts,
                self.free[i] - row.devices,
                i,
            ),
        )

    def _state(self, row: _Row) -> _State:
        """Feasibility of the rest depends only on how many hosts have each number of free
        devices (and whether the current stage uses them), not on names: a failed state never
        needs a retry."""
        used = self.stage_hosts.get(row.stage, set())
        kinds = Counter((f, i in used) for i, f in enumerate(self.free))
        return (len(self.assignment), tuple(sorted(kinds.items())))


def _assign(rows: list[_Row], hosts: Sequence[Host], order: Sequence[int] | None = None) -> list[int] | None:
    """Each row's host (rows in stage order), the stages placed in `order` (default: stage by stage)."""
    if sum(r.devices for r in rows) > sum(h.devices for h in hosts):
        return None  # quick necessary check before searching
    if order is None:
        order = sorted({r.stage for r in rows})
    position = {stage: i for i, stage in enumerate(order)}
    placed = sorted(range(len(rows)), key=lambda i: (position[rows[i].stage], rows[i].row))
    previous = {stage: order[i - 1] if i else -1 for i, stage in enumerate(order)}
    found = _Search([rows[i] for i in placed], hosts, previous).run()
    if found is None:
        return None
    out = [0] * len(rows)
    for i, host in zip(placed, found):
        out[i] = host
    return out


def _missing(job: TrainingJob, rows: list[_Row], hosts: Sequence[Host]) -> tuple[int, int]:
    """Fewest extra hosts (and the fewest devices each) that would make the job fit."""
    size = max([job.topology.devices_per_host] + [r.devices for r in rows])
    extra_hosts = 1
    while _assign(rows, list(hosts) + _spares(extra_hosts, size)) is None:
        extra_hosts += 1
    devices = size
    while devices > 1 and _assign(rows, list(hosts) + _spares(extra_hosts, devices - 1)) is not None:
        devices -= 1
    return extra_hosts, devices


def _spares(count: int, devices: int) -> list[Host]:
    return [Host(f"missing-{i}", devices, "\0missing") for i in range(count)]


def place(job: TrainingJob, hosts: Sequence[Host]) -> Placement:
    """Put every stage's mesh on the hosts, or raise PlacementError saying what is missing."""
    _check_hosts(hosts)
    rows = _rows(job)
    order = stage_order(job.topology.stage_order).order(len(job.stages))
    assignment = _assign(rows, hosts, order)
    if assignment is None:
        resource = job.topology.device_resource
        extra_hosts, devices = _missing(job, rows, hosts)
        total = sum(r.devices for r in rows)
        free = sum(h.devices for h in hosts)
        biggest = max((r.devices for r in rows), default=0)
        largest_host = max((h.devices for h in hosts), default=0)
        detail = (
            f" (a mesh row needs {biggest} {resource} devices on one host; the largest host has {largest_host})"
            if biggest > largest_host
            else ""
        )
        raise PlacementError(
            f"the cluster cannot hold TrainingJob {job.name!r}: missing {extra_hosts} "
            f"host{'s' if extra_hosts != 1 else ''} with {devices} free {resource} device"
            f"{'s' if devices != 1 else ''} each{detail}; the job needs {total} {resource} devices in "
            f"{len(rows)} mesh rows (rows of one stage on distinct hosts), the cluster has "
            f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} with {free} devices"
        )
    used = [0] * len(hosts)
    slots: list[RankSlot] = []
    for row, host in zip(rows, assignment):
        for _ in range(row.devices):
            slots.append(RankSlot(rank=len(slots), stage=row.stage, host=host, local_device=used[host]))
            used[host] += 1
    return Placement(
        hosts=tuple(hosts),
        slots=tuple(slots),
        mesh_shapes=tuple(tuple(st.mesh) for st in job.stages),
    )


def default_hosts(job: TrainingJob) -> tuple[Host, ...]:
    """The smallest cluster of identical hosts (topology.devicesPerHost devices each) that fits."""
    per_host = job.topology.devices_per_host
    rows = _rows(job)
    too_big = [r for r in rows if r.devices > per_host]
    if too_big:
        row = too_big[0]
        raise PlacementError(
            f"stage {row.stage} mesh rows need {row.devices} {job.topology.device_resource} devices on "
            f"one host, but topology.devicesPerHost is {per_host}"
        )
    total = sum(r.devices for r in rows)
    count = max([math.ceil(total / per_host)] + [st.mesh[0] for st in job.stages] + [1])
    while True:
        hosts = tuple(Host(f"host-{i}", per_host) for i in range(count))
        if _assign(rows, hosts) is not None:
            return hosts
        count += 1


def dump_hosts(hosts: Sequence[Host]) -> str:
    """hosts.yaml as load_hosts reads it back (the operator's ConfigMap carries the hosts it placed on)."""
    return dump_yaml([{"name": h.name, "devices": h.devices, "rack": h.rack} for h in hosts])


def load_hosts(path: str | Path) -> tuple[Host, ...]:
    """hosts.yaml: a list of {name, devices, rack} or {hosts: [...]}; SpecError names the field."""
    source = str(path)
    try:
        doc = load_one(read_text(source, "hosts file"), source_name(source), "hosts")
    except SpecError as err:  # say which option the file came from
        raise SpecError([dataclasses.replace(e, path=f"--hosts {e.path}") for e in err.errors]) from None
    return parse_hosts(doc)


def parse_hosts(doc: Any) -> tuple[Host, ...]:
    prefix = "hosts"
    if isinstance(doc, dict):
        unknown = sorted(set(doc) - {"hosts"})
        if unknown:
            raise SpecError([FieldError(unknown[0], doc[unknown[0]], "only the key 'hosts' is allowed at the top")])
        doc = doc.get("hosts")
    if not isinstance(doc, list) or not doc or len(doc) > MAX_CLUSTER_HOSTS:
        raise SpecError([FieldError(prefix, doc, f"a list of 1 to {MAX_CLUSTER_HOSTS} {{name, devices, rack}}")])
    errors: list[FieldError] = []
    hosts: list[Host] = []
    for i, item in enumerate(doc):
        path = f"{prefix}[{i}]"
        if not isinstance(item, dict):
            errors.append(FieldError(path, item, "a mapping {name, devices, rack}"))
            continue
        for key in sorted(set(item) - {"name", "devices", "rack"}):
            errors.append(FieldError(f"{path}.{key}", item[key], "only name, devices and rack are allowed"))
        name, devices, rack = item.get("name"), item.get("devices"), item.get("rack", "")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            errors.append(FieldError(f"{path}.name", name, f"a string of 1 to {MAX_NAME} characters"))
        if not isinstance(devices, int) or isinstance(devices, bool) or not 0 <= devices <= MAX_DEVICES_PER_HOST:
            errors.append(FieldError(f"{path}.devices", devices, f"an integer in 0..{MAX_DEVICES_PER_HOST}"))
        if rack is None:
            rack = ""
        if not isinstance(rack, (str, int)) or isinstance(rack, bool):
            errors.append(FieldError(f"{path}.rack", rack, "a string (rack or zone label)"))
        hosts.append(Host(str(name), devices if isinstance(devices, int) else 0, str(rack)))
    if not errors:
        names = [h.name for h in hosts]
        errors += [
            FieldError(f"{prefix}[{i}].name", n, "a name not used by another host")
            for i, n in enumerate(names)
            if n in names[:i]
        ]
    if errors:
        raise SpecError(errors)
    return tuple(hosts)
