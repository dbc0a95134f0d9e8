"""What a step costs: per-stage compute (forward, input gradient, weight gradient) and the network.

Compute comes from a formula (one layer's forward per sample, scaled by each stage's layers,
microbatch size and parallel degrees; backward = backward_factor forwards, split evenly into I and
W) or, when measured, from per-stage figures (`stages`): `meshjob plan|simulate --calibrate` measure
the formula's two constants with the trainer (meshjob_trainer.calibrate); ranks that profile their
own stage pass StageCosts. The plan uses the W costs to size the weight-gradient delay, the
simulator uses all of it to predict a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshjob.network.model import NetworkModel
from meshjob.spec.model import TrainingJob


@dataclass(frozen=True)
class StageCost:
    """Seconds of one microbatch on one device of a stage."""

    forward_s: float
    input_grad_s: float  # I: gradient of the stage's input (what the previous stage waits for)
    weight_grad_s: float  # W: gradient of the stage's weights (may be delayed)

    def __post_init__(self) -> None:
        for name in ("forward_s", "input_grad_s", "weight_grad_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} is invalid: a number of seconds >= 0")

    @property
    def backward_s(self) -> float:
        return self.input_grad_s + self.weight_grad_s

    def to_json(self) -> dict[str, float]:
        return {"F": self.forward_s, "I": self.input_grad_s, "W": self.weight_grad_s}

    @classmethod
    def from_json(cls, doc: dict[str, float]) -> StageCost:
        return cls(doc["F"], doc["I"], doc["W"])


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work, and the network they run on."""

    network: NetworkModel = field(default_factory=NetworkModel)
    layer_forward_s: float = 2.5e-4  # one layer, one sample, unsharded
    backward_factor: float = 2.0  # B = I + W, each about one forward
    itemsize: int = 4
    stages: tuple[StageCost, ...] = ()  # measured per stage; empty: the formula above
    measured: bool = False  # the figures come from a measurement (--calibrate, per-stage profiling)

    @property
    def nic_bytes_per_s(self) -> float:
        return self.network.nic_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "network": self.network.to_json(),
            "layer_forward_s": self.layer_forward_s,
            "backward_factor": self.backward_factor,
            "itemsize": self.itemsize,
            "stages": [c.to_json() for c in self.stages],
            "measured": self.measured,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CostModel:
        """The inverse of to_json; missing keys take their defaults."""
        fields = {k: doc[k] for k in ("layer_forward_s", "backward_factor", "itemsize", "measured") if k in doc}
        return cls(
            network=NetworkModel(**doc.get("network", {})),
            stages=tuple(StageCost.from_json(c) for c in doc.get("stages", ())),
            **fields,
        )

    def forward_s(self, layers: int, samples: int, tp_degree: int, dp_degree: int) -> float:
        """One microbatch of `samples` on one device of a stage: data parallel splits the samples,
        tensor parallel splits each layer's work."""
        return self.layer_forward_s * layers * samples / max(1, tp_degree * dp_degree)

    def stage_costs(self, job: TrainingJob) -> dict[int, StageCost]:
        """Per stage of `job` (a meshjob.spec.manifest.TrainingJob): the measured costs, or the formula's."""
        if self.stages:
            if len(self.stages) != len(job.stages):
                raise ValueError(
                    f"cost model has {len(self.stages)} measured stages, the job "
                    f"{job.name!r} has {len(job.stages)}: measure every stage"
                )
            return dict(enumerate(self.stages))
        out: dict[int, StageCost] = {}
        for i, st in enumerate(job.stages):
            f = self.forward_s(
                st.layers[1] - st.layers[0], job.training.microbatch_size, st.tensor_parallel, st.data_parallel
            )
            half = f * self.backward_factor / 2
            out[i] = StageCost(f, half, half)
        return out
