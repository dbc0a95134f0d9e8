"""The clock a pipeline step's timeline is read on: the host's, or a CUDA device's.

On a CPU the host computes each action itself, so the host's clock around an action measures it
(HostClock). On a GPU the host only launches kernels: the clock around an action would measure the
launch, and the host then blocks wherever it needs a result (a transfer's hand-over, at the step's
end), so the dashboard's compute time would be launch time and the device's work would count as
waiting. DeviceClock marks the compute stream instead: each mark is a CUDA event recorded there, so
it reads when the device reached that point of the stream, and a step's marks are read once, at its
end (an event synchronize there, and one at the step's start to pin its origin). The executor marks
the same points on either clock: an action's start and end, and both sides of each wait for a
transfer; on the device, the time between a wait's two marks is the stream waiting for the transfer's
hand-over (meshjob_trainer.wire: `accept`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class StepClock(Protocol):
    def start(self) -> float:
        """Begin a step: its origin mark, read now; returns the host's perf_counter() at that instant."""

    def mark(self) -> Any:
        """A point of the step, in the order the executor reaches it."""

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """The marks of this step as seconds after its origin (called once, at the step's end)."""


class HostClock:
    """time.perf_counter(): what the host does is what runs."""

    def __init__(self) -> None:
        self.origin = 0.0

    def start(self) -> float:
        self.origin = time.perf_counter()
        return self.origin

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        return [m - self.origin for m in marks]


class DeviceClock:
    """CUDA events on the current stream of `device` (the compute stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.origin: Any = None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> float:
        # Wait until the device reaches the origin (the last step's optimizer may still run), so that the
        # host's instant returned here is the origin's on the device too: ranks align timelines by it.
        self.origin = self._event()
        self.origin.synchronize()
        return time.perf_counter()

    def mark(self) -> Any:
        return self._event()

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        if marks:
            marks[-1].synchronize()  # the stream runs its events in order: the last one done means all are
        return [self.origin.elapsed_time(m) / 1e3 for m in marks]


def clock_for(device: torch.device | str) -> StepClock:
    """The device's clock where kernels run after their launch returns (CUDA), else the host's."""
    device = torch.device(device)
    return DeviceClock(device) if device.type == "cuda" else HostClock()
