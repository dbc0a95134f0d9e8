"""The plan as the operator renders it for its pods: the plan's inputs and its digest.

The ranks of a pod must run the plan the operator placed the pods by. Shipping that plan is not
possible at scale: its lowered steps grow with devices x unit tasks x chunks, and a ConfigMap holds
at most 1 MiB. So the ConfigMap carries what the plan is a deterministic function of, all of it
small: the job (job.yaml), the hosts it was placed on (hosts.yaml), the NIC rate and the cost model
(plan.json), plus the plan's digest (Plan.digest) and the digest of each of its top-level parts.
A worker rebuilds the plan from exactly those inputs and refuses to run when its digest differs
(another meshjob version, an edited file), naming both digests and the parts that differ.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshjob.costs.compute import CostModel
from meshjob.network.model import NetworkModel, emulated_network
from meshjob.plan.build import Plan, build_plan
from meshjob.plan.placement import Host, dump_hosts, load_hosts
from meshjob.spec.manifest import TrainingJob, load_job

JOB_FILE = "job.yaml"
HOSTS_FILE = "hosts.yaml"
PLAN_FILE = "plan.json"
DEFAULT_NIC_BYTES_PER_S = 1e9 / 8


class PlanMismatch(ValueError):
    """The plan built here is not the one the operator rendered; the message says where they differ."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything build_plan reads: the same inputs always give the same plan."""

    job: TrainingJob
    hosts: tuple[Host, ...] | None = None  # None: the smallest cluster of identical hosts that fits
    nic_bytes_per_s: float = DEFAULT_NIC_BYTES_PER_S  # wins over the cost model's network rate
    cost: CostModel = field(default_factory=CostModel)  # compute costs and the network model

    @classmethod
    def of(
        cls, job: TrainingJob, hosts: Sequence[Host] | None = None, nic_bytes_per_s: float = DEFAULT_NIC_BYTES_PER_S
    ) -> PlanInputs:
        """With the cost model build_plan assumes for this NIC rate."""
        return cls(
            job,
            None if hosts is None else tuple(hosts),
            nic_bytes_per_s,
            CostModel(network=NetworkModel(nic_bytes_per_s=nic_bytes_per_s)),
        )

    @classmethod
    def emulated(cls, job: TrainingJob, hosts: Sequence[Host] | None, nic_bytes_per_s: float, cores: int) -> PlanInputs:
        """What `meshjob run` plans its emulated cluster with (and `meshjob plan --emulated` shows): every host
        on `cores` cores of one machine, the engine's costs there (meshjob.network.model.emulated_network)."""
        return cls(
            job,
            None if hosts is None else tuple(hosts),
            nic_bytes_per_s,
            CostModel(network=emulated_network(nic_bytes_per_s, cores)),
        )

    def build(self) -> Plan:
        network = dataclasses.replace(self.cost.network, nic_bytes_per_s=self.nic_bytes_per_s)
        return build_plan(self.job, self.hosts, network=network, cost=self.cost)


@dataclass(frozen=True)
class RenderedDigest:
    """What a worker checks its plan against (plan.json, beside the inputs it also holds)."""

    digest: str
    sections: Mapping[str, str]  # top-level key of Plan.to_json() -> its digest
    source: str = PLAN_FILE  # where it was read, for error messages

    def check(self, plan: Plan) -> None:
        ours = plan.digest()
        if ours == self.digest:
            return
        mine = plan.section_digests()
        differing = sorted(k for k in set(mine) | set(self.sections) if mine.get(k) != self.sections.get(k))
        raise PlanMismatch(
            f"the plan built here (digest {ours}) differs from the one the operator rendered in {self.source} "
            f"(digest {self.digest}) in {', '.join(differing) or 'its canonical form'}: the ranks would not run "
            f"what the pods were placed for; were the job or hosts files edited, or do the operator and the "
            f"trainer image run different meshjob versions?"
        )


def render(inputs: PlanInputs, plan: Plan) -> dict[str, str]:
    """The files of the ConfigMap beside the job manifest: hosts.yaml and plan.json."""
    if inputs.hosts is None:
        raise ValueError("render: the inputs must name the hosts the plan was placed on")
    doc = {
        "nic_bytes_per_s": inputs.nic_bytes_per_s,
        "cost_model": inputs.cost.to_json(),
        "digest": plan.digest(),
        "sections": plan.section_digests(),
    }
    return {HOSTS_FILE: dump_hosts(inputs.hosts), PLAN_FILE: json.dumps(doc, sort_keys=True)}


def _plan_doc(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise PlanMismatch(
            f"the rendered plan {path} cannot be read ({err.strerror}): it was named "
            f"(MESHJOB_PLAN) so it must exist; the plan cannot be verified without it"
        ) from err
    except ValueError as err:
        raise PlanMismatch(f"the rendered plan {path} is not valid JSON ({err})") from err
    missing = [k for k in ("nic_bytes_per_s", "cost_model", "digest", "sections") if k not in doc]
    if not isinstance(doc, dict) or missing:
        raise PlanMismatch(
            f"the rendered plan {path} lacks {', '.join(missing) or 'a JSON object'}: "
            f"it must hold nic_bytes_per_s, cost_model, digest and sections"
        )
    return doc


def load(job_path: str, hosts_path: str, plan_path: str) -> tuple[PlanInputs, RenderedDigest]:
    """The inputs and the digest the operator rendered (SpecError names a bad job or hosts file)."""
    doc = _plan_doc(plan_path)
    inputs = PlanInputs(
        load_job(job_path),
        load_hosts(hosts_path) if hosts_path else None,
        float(doc["nic_bytes_per_s"]),
        CostModel.from_json(doc["cost_model"]),
    )
    return inputs, RenderedDigest(str(doc["digest"]), dict(doc["sections"]), plan_path)
