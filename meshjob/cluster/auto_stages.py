"""`spec.stages: auto` on a cluster: meshjob tune's search, run on the hosts a placement would use.

A manifest that says `stages: auto`, or `auto` for `training.microbatches`, `schedule.kind` or
`resharding.strategy`/`balancer`, leaves to the search what `meshjob tune` leaves to it (meshjob.search.inputs):
the stages when `auto` (a list is kept as written, each mesh two dims), and those fields and
`schedule.weightGradDelay` where the manifest says `auto` or leaves them out. The cluster is the hosts the job may
use (for the operator: its
usable Nodes, sorted by name), each offering the devices of the smallest of them (at most
`topology.devicesPerHost`), so every plan of the search fits on every host; the device profile is
SEARCH_DEVICE at its memory, the NIC the rate placement assumes. The search is deterministic and bounded
by a number of simulations, never by time: the same job on the same hosts gives the same choice in every
process, operator replica and run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshjob.cluster.nodes import Quantity, describe_cluster, hosts_of, node_infos
from meshjob.errors import FieldError, PlacementError, SpecError
from meshjob.network.model import NetworkModel
from meshjob.plan.placement import Host
from meshjob.search.algorithm import DEFAULT_MAX_EVALUATIONS, Prediction, Problem, default_space, search
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.search.inputs import base_job, read_fixed
from meshjob.spec.manifest import AUTO, BUILTIN_MODEL_KINDS, MAX_LAYERS, TrainingJob, parse_job, searched_fields

SEARCH_DEVICE = "h100"  # the profile the cluster's devices are searched as (compute rate, memory, NVLink)
MAX_EVALUATIONS = DEFAULT_MAX_EVALUATIONS  # simulations per search: a count, so every process stops alike


def wants_search(doc: Any) -> bool:
    """Whether the manifest asks for the search: `spec.stages: auto`, or `auto` in a searched field
    (spec.training.microbatches, spec.schedule.kind, spec.resharding.strategy/balancer; then with the
    stages as written)."""
    spec = doc.get("spec") if isinstance(doc, Mapping) else None
    if not isinstance(spec, Mapping):
        return False
    return spec.get("stages") == AUTO or any(value == AUTO for _, _, value in _searched_values(spec))


def _searched_values(spec: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """(section, key, value) of each searched field the spec sets (meshjob.spec.manifest.searched_fields)."""
    out = []
    for _, path, f in searched_fields():
        section = spec.get(path.split(".")[1])
        if isinstance(section, Mapping) and f.yaml in section:
            out.append((path.split(".")[1], f.yaml, section[f.yaml]))
    return out


def parse_searchable(doc: Mapping[str, Any]) -> TrainingJob:
    """Validate a manifest the search reads as parse_job does every other field (SpecError naming each
    bad one), `auto` read as left out (meshjob.search.inputs); with `stages: auto` the job returned holds
    one placeholder stage until the search writes the real ones."""
    spec = dict(doc["spec"])
    if "edges" in spec:
        raise SpecError(
            [
                FieldError(
                    "spec.edges",
                    spec["edges"],
                    "left out when a search chooses (spec.stages: "
                    "auto or a field's auto: the edges follow the chosen stages' natural layouts)",
                )
            ]
        )
    if spec.get("stages") == AUTO:
        model = spec.get("model")
        layers = model.get("layers") if isinstance(model, Mapping) else None
        last = layers if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= MAX_LAYERS else 1
        spec["stages"] = [{"layers": [0, last], "mesh": [1, 1]}]
    elif isinstance(spec.get("stages"), list):  # kept as written: the search places two-dim meshes
        bad = [
            FieldError(
                f"spec.stages[{i}].mesh",
                s["mesh"],
                "two dims [hosts, devices per host] when a field says auto (the search keeps the stages as written)",
            )
            for i, s in enumerate(spec["stages"])
            if isinstance(s, Mapping) and isinstance(s.get("mesh"), list) and len(s["mesh"]) != 2
        ]
        if bad:
            raise SpecError(bad)
    for section, key, value in _searched_values(spec):
        if value == AUTO:
            spec[section] = {k: v for k, v in spec[section].items() if k != key}  # searched: as if left out
    training = spec.get("training", {})
    if isinstance(training, Mapping) and training.get("microbatches") is None:
        spec["training"] = {**training, "microbatches": 1}  # searched: any count that divides the batch
    job = parse_job({**doc, "spec": spec})
    if job.model.kind not in BUILTIN_MODEL_KINDS:
        raise SpecError(
            [
                FieldError(
                    "spec.model.kind",
                    job.model.kind,
                    f"one of {', '.join(BUILTIN_MODEL_KINDS)} "
                    "with a search (spec.stages: auto or a field's auto: its cost and memory "
                    "model needs the block's shapes)",
                )
            ]
        )
    return job


@dataclass(frozen=True)
class ClusterJob:
    """A manifest as the operator reads it: the job (for `stages: auto`, its placeholder) and, when its
    stages are auto, the manifest the search reads."""

    job: TrainingJob
    search: Mapping[str, Any] | None = None


def read_for_cluster(doc: Any) -> ClusterJob:
    """parse_job, or parse_searchable for a manifest that asks for the search; SpecError names every bad field."""
    return ClusterJob(parse_searchable(doc), doc) if wants_search(doc) else ClusterJob(parse_job(doc))


def search_cluster(hosts: Sequence[Host], nic_bytes_per_s: float) -> Cluster:
    """The search's cluster on these hosts: as many hosts, each with the devices of the smallest."""
    usable = [h for h in hosts if h.devices > 0]
    if not usable:
        raise PlacementError("no usable host to search stages on (spec.stages: auto)")
    device = DEVICES[SEARCH_DEVICE]
    network = NetworkModel(nic_bytes_per_s=nic_bytes_per_s, intra_host_bytes_per_s=device.link_bytes_per_s)
    return Cluster(len(usable), min(h.devices for h in usable), device, network)


@dataclass(frozen=True)
class Tuned:
    """What the search chose: the manifest with the choices written in, and why."""

    manifest: dict[str, Any]
    best: Prediction
    evaluated: int  # plans simulated
    proven: bool  # every plan that could beat it was simulated
    cluster: Cluster

    def job(self) -> TrainingJob:
        return parse_job(self.manifest)

    def status(self) -> dict[str, Any]:
        """status.tuned: the chosen fields, the prediction and the cluster it was made for."""
        spec = self.manifest["spec"]
        return {
            "plan": self.best.candidate.label(),
            "stages": spec["stages"],
            "microbatches": spec["training"]["microbatches"],
            "schedule": {k: spec["schedule"][k] for k in ("kind", "weightGradDelay")},
            "resharding": {k: spec["resharding"][k] for k in ("strategy", "balancer")},
            "predictedStepSeconds": self.best.step_s,
            "evaluated": self.evaluated,
            "provenBest": self.proven,
            "cluster": {
                "hosts": self.cluster.hosts,
                "devicesPerHost": self.cluster.devices_per_host,
                "device": self.cluster.device.name,
                "nicBytesPerSecond": self.cluster.network.nic_bytes_per_s,
            },
        }

    def message(self) -> str:
        """One line for the StagesChosen Event."""
        c = self.cluster
        proven = "proven best" if self.proven else f"best of the {self.evaluated} simulated (the search's budget)"
        return (
            f"chose {self.best.candidate.label()} on {c.hosts} host(s) x {c.devices_per_host} device(s) "
            f"({c.device.name} profile): predicted step {self.best.step_s:.3g} s, {proven}"
        )


def tune(doc: Mapping[str, Any], cluster: Cluster, max_evaluations: int = MAX_EVALUATIONS) -> Tuned:
    """meshjob tune's search for the manifest on the cluster; raises meshjob.search.algorithm.Infeasible (with the
    smallest memory overflow) when no plan fits."""
    fixed = read_fixed(doc)
    job = base_job(doc, cluster.devices_per_host)
    problem = Problem(doc, job, cluster, fixed, default_space(job, fixed, cluster))
    result = search(problem, top=1, max_evaluations=max_evaluations)
    return Tuned(problem.manifest(result.best.candidate), result.best, result.evaluated, result.proven, cluster)


def tune_on_nodes(
    job: TrainingJob,
    doc: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    quantity: Quantity,
    nic_bytes_per_s: float,
    pods: Sequence[Mapping[str, Any]] = (),
    hosts: Sequence[Host] | None = None,
) -> Tuned:
    """The search on the hosts the job would be placed on: these Nodes less what the cluster's `pods` use
    there (meshjob.cluster.nodes, as placement reads them, with `job` the manifest's placeholder), or `hosts`
    (those its running pods hold). No usable node is a PlacementError naming the nodes left out and why."""
    if hosts is None:
        infos = node_infos(nodes, job, quantity, pods)
        try:
            cluster = search_cluster(hosts_of(infos), nic_bytes_per_s)
        except PlacementError as err:
            raise PlacementError(f"{err} (cluster: {describe_cluster(infos, job.topology)})") from None
    else:
        cluster = search_cluster(hosts, nic_bytes_per_s)
    return tune(doc, cluster)


def as_started(job: TrainingJob, doc: Mapping[str, Any], started: TrainingJob) -> TrainingJob:
    """The `stages: auto` job with what the search chose when it started (`started`, the job that runs)
    in the fields the manifest leaves to the search: equal to `started` unless the user edited the rest."""
    fixed = read_fixed(doc)
    training = (
        job.training
        if fixed.microbatches is not None
        else dataclasses.replace(job.training, microbatches=started.training.microbatches)
    )
    schedule = dataclasses.replace(
        job.schedule,
        kind=job.schedule.kind if fixed.kind else started.schedule.kind,
        weight_grad_delay=job.schedule.weight_grad_delay
        if fixed.weight_grad_delay is not None
        else started.schedule.weight_grad_delay,
    )
    resharding = dataclasses.replace(
        job.resharding,
        strategy=job.resharding.strategy if fixed.strategy else started.resharding.strategy,
        balancer=job.resharding.balancer if fixed.balancer else started.resharding.balancer,
    )
    topology = dataclasses.replace(job.topology, devices_per_host=started.topology.devices_per_host)
    return dataclasses.replace(
        job,
        stages=started.stages,
        edges=started.edges,
        training=training,
        schedule=schedule,
        resharding=resharding,
        topology=topology,
        tuned_for=started.tuned_for,  # the cluster the search chose for, as the search writes it
    )
