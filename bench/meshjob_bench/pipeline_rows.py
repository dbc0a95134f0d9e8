"""What one point of `meshjob bench pipeline`'s sweep is (Config) and what it measured (Measured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


@dataclass(frozen=True)
class Config:
    """One point of the sweep."""

    model: str
    stages: int
    comm_fraction: float  # asked for: sets the NIC rate
    nic_bytes_per_s: float

    @property
    def nic_rate(self) -> str:
        """A tc rate string (kbit resolution)."""
        return f"{max(1, round(self.nic_bytes_per_s * 8 / 1e3))}kbit"


class StageMeasured(TypedDict):
    """One stage of a measured run."""

    bubble: float  # the share of its steps' time it did not compute
    overlap: float  # the share of its communication hidden behind compute
    peak_stashed: int  # microbatches forwarded and not yet backwarded at once, at most
    compute_s_per_step: float
    timeline: list[tuple[str, float, float]]  # its last step's compute actions, from the earliest rank's step start


@dataclass
class Measured:
    config: Config
    variant: str
    step_s: float  # the steady-state period: over ranks, the median of each one's mean timed step
    tokens_per_s: float
    stages: dict[int, StageMeasured]
    timelines: dict[int, tuple[float, list]]  # stage -> (origin, last step's timeline)
    final_loss: float
    # scope -> boundary-tensor bytes the ranks counted landing over the whole run (run_variant's count_bytes only)
    bytes_received: dict[str, int] = field(default_factory=dict)
