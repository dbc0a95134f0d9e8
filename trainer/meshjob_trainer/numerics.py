"""How a stage computes: precision (fp32, or bf16 autocast over fp32 master weights) and activation
recomputation (keep each block's input, recompute its activations once in the backward).

bf16 here is mixed precision, not a bf16 model: parameters, gradients and optimizer state stay
fp32, autocast runs the matrix products in bf16, and every reduction (tensor-parallel, data-parallel,
the tied embedding, the loss) adds in fp32. The residual stream adds a bf16 block output to an fp32
input, which promotes to fp32, so the tensors that cross stage boundaries stay fp32 as the plan's
byte counts assume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshjob.spec.manifest import TrainingJob
from meshjob_trainer.recompute import recompute_block

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Numerics:
    precision: str = "fp32"  # meshjob.spec.manifest.PRECISIONS
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_DTYPES:
            raise ValueError(
                f"training.precision: {self.precision!r} is invalid: allowed are {', '.join(PRECISION_DTYPES)}"
            )

    @classmethod
    def of(cls, job: TrainingJob, stage: int) -> Numerics:
        """The numerics of one stage of a meshjob.spec.manifest.TrainingJob."""
        return cls(job.training.precision, job.recompute(stage) == "full")

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward's autocast region (none for fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=PRECISION_DTYPES[self.precision])

    def run_block(self, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """block(x), keeping only x for the backward when recomputing: the backward recomputes the
        block once, under the same autocast state, also when split into I and W (meshjob_trainer.recompute)."""
        if not self.recompute or not torch.is_grad_enabled():
            return block(x)
        return recompute_block(block, x)
