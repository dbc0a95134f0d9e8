"""Compute modes of a run: real (the trainer does the math) or emulated on a named device profile.

`--compute emulated --device a100|h100|<TFLOPs>`: every forward, input gradient, weight gradient and
optimizer step of a rank waits the time the device would need for its stage's real shapes
(meshjob.costs.device_costs), using no CPU, while tensors of the real sizes still cross the emulated NICs.
It measures schedules and communication, not numerics: losses are not meaningful in this mode.

A profile's rate is its dense half-precision tensor-core peak and its memory bandwidth (vendor data
sheets, SXM parts); `efficiency` is the stated fraction of both that kernels reach (model FLOPs
utilisation of large transformer training is typically 0.4-0.6). A profile given as a number of
TFLOP/s keeps the A100's bytes per FLOP for its memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshjob.errors import FieldError, SpecError

COMPUTE_MODES = ("real", "emulated")
DEFAULT_EFFICIENCY = 0.5


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    tflops: float  # dense fp16/bf16 peak, 1e12 FLOP/s
    memory_gbytes_per_s: float  # HBM bandwidth, 1e9 B/s
    efficiency: float = DEFAULT_EFFICIENCY  # fraction of both peaks that kernels reach

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * self.efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.memory_gbytes_per_s * 1e9 * self.efficiency

    def to_json(self) -> dict[str, float | str]:
        return {
            "name": self.name,
            "tflops": self.tflops,
            "memory_gbytes_per_s": self.memory_gbytes_per_s,
            "efficiency": self.efficiency,
        }


DEVICES: dict[str, DeviceProfile] = {
    "a100": DeviceProfile("a100", 312.0, 2039.0),  # A100 SXM 80 GB
    "h100": DeviceProfile("h100", 989.0, 3350.0),  # H100 SXM
}
_A100_BYTES_PER_FLOP = DEVICES["a100"].memory_gbytes_per_s / DEVICES["a100"].tflops / 1e3


def parse_device(text: str, path: str = "--device") -> DeviceProfile:
    """A named profile, or a positive number of TFLOP/s; SpecError naming `path`, the value and what is allowed."""
    name = str(text).strip().lower()
    if name in DEVICES:
        return DEVICES[name]
    try:
        tflops = float(name)
    except ValueError:
        tflops = math.nan
    if not (math.isfinite(tflops) and tflops > 0):
        raise SpecError(
            [FieldError(path, text, f"one of {', '.join(DEVICES)}, or a positive number of TFLOP/s such as 50")]
        )
    return DeviceProfile(f"{tflops:g}tflops", tflops, tflops * _A100_BYTES_PER_FLOP * 1e3)


@dataclass(frozen=True)
class ComputeMode:
    """How a run's ranks compute: kind "real", or "emulated" on `device`."""

    kind: str = "real"
    device: DeviceProfile | None = None

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"

    def describe(self) -> str:
        return f"emulated on {self.device.name}" if self.device else "real"

    def to_json(self) -> dict[str, Any]:
        return {"compute": self.kind, "device": self.device.to_json() if self.device else None}


REAL = ComputeMode()


def parse_compute(kind: str, device: str | None, path: str = "--compute") -> ComputeMode:
    """--compute and --device together: a device only with emulated compute, which needs one
    (SpecError naming the flag, the value and what is allowed)."""
    if kind not in COMPUTE_MODES:
        raise SpecError([FieldError(path, kind, f"one of {', '.join(COMPUTE_MODES)}")])
    if kind == "real":
        if device is not None:
            raise SpecError(
                [
                    FieldError(
                        "--device", device, "only with --compute emulated (real compute runs on this machine's CPU)"
                    )
                ]
            )
        return REAL
    return ComputeMode("emulated", parse_device(device if device is not None else "a100"))
