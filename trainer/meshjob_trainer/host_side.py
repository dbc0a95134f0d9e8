"""What every CPU wire shares: host-side ordering (nothing to wait for) and the order check's error."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class OrderError(RuntimeError):
    """Two ranks issued the messages between them in different orders."""


class HostSide:
    """CPU tensors: program order on one thread is all the ordering there is."""

    def engine_stream(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def mark(self) -> Any:
        return None

    def after(self, mark: Any) -> None:
        pass

    def hand_over(self) -> Any:
        return None

    def accept(self, tensor: torch.Tensor, mark: Any) -> None:
        pass
