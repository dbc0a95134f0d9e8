"""What one point of `meshjob bench pipeline`'s sweep is (Config) and what it measured (Measured)."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass
class Measured:
    config: Config
    variant: str
    step_s: float  # the steady-state period: over ranks, the median of each one's mean timed step
    tokens_per_s: float
    stages: dict[int, dict[str, float]]
    timelines: dict[int, tuple[float, list]]  # stage -> (origin, last step's timeline)
    final_loss: float
