"""BoundaryKey: the name of one transfer between two pipeline stages (which stages, tensor, direction).

Every edge of a job (a tensor flowing from stage `src` to stage `dst` in the forward pass) gives two
boundaries: the forward one, and the backward one in which the gradient of that tensor flows back
from dst to src. A BoundaryKey names either, always in the direction the bytes travel. Its text
form, "0->1:activation" and "1->0:grad:activation", is the one spelling of a boundary in plan JSON,
simulator results, progress events and metric labels; `parse` is its only reader.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schedule's actions name the boundary they move; no import cycle at run time
    from meshjob.schedule.actions import Action

GRAD = "grad"
_TEXT = re.compile(r"^(?P<src>\d+)->(?P<dst>\d+):(?:(?P<grad>grad):)?(?P<tensor>[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True, order=True)
class BoundaryKey:
    src: int  # the stage that sends (for a gradient: the forward edge's destination)
    dst: int  # the stage that receives
    tensor: str  # the forward tensor's name: "activation", "skip<i>"
    grad: bool = False  # the backward direction: the gradient of `tensor`

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}:{GRAD + ':' if self.grad else ''}{self.tensor}"

    @classmethod
    def parse(cls, text: str) -> BoundaryKey:
        match = _TEXT.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"boundary {text!r} is invalid: must be '<from>-><to>:<tensor>' or "
                f"'<from>-><to>:grad:<tensor>', e.g. '0->1:activation' or '1->0:grad:activation'"
            )
        return cls(int(match["src"]), int(match["dst"]), match["tensor"], match["grad"] is not None)

    @classmethod
    def of_action(cls, stage: int, action: Action) -> BoundaryKey:
        """The boundary a SEND_F/RECV_F/SEND_B/RECV_B action of `stage` moves (a SEND sends from `stage`)."""
        if action.peer is None:
            raise ValueError(f"action {action} of stage {stage} moves no tensor: only SEND/RECV actions do")
        return _of_action(stage, action.kind, action.peer, action.tensor)

    @property
    def edge(self) -> tuple[int, int]:
        """(from, to) of the forward edge this boundary belongs to."""
        return (self.dst, self.src) if self.grad else (self.src, self.dst)

    def backward(self) -> BoundaryKey:
        """The gradient's boundary of this forward one."""
        return BoundaryKey(self.dst, self.src, self.tensor, grad=True)


@functools.cache
def _of_action(stage: int, kind: str, peer: int, tensor: str) -> BoundaryKey:
    # the simulator and the transfer order ask for every action's boundary many times per run: one object each
    src, dst = (stage, peer) if kind.startswith("SEND") else (peer, stage)
    return BoundaryKey(src, dst, tensor, grad=kind.endswith("_B"))
