"""One log line per training step from the first rank of each pipeline stage, and one per evaluation
from the last stage's (spec.training.evalEvery): what `kubectl logs` shows.

A listener of the trainer's events (meshjob_trainer.events), on by default under `meshjob worker` (the
pods' command); `meshjob run` draws its own progress bar instead. The operator reads progress from the
metrics endpoint, not from these lines: they are for people.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from meshjob_trainer.events import Evaluated, Event, StepFinished


def print_line(line: str) -> None:
    # A pod's log is its stdout, shared by the host's ranks: one write per line (print writes the text and
    # the newline apart, and another rank's line could land between them); flush: a line per step, now.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass
class StepLog:
    total_steps: int
    write: Callable[[str], None] = field(default=print_line)

    def emit(self, event: Event) -> None:
        if isinstance(event, StepFinished):
            self.write(line(event, self.total_steps))
        elif isinstance(event, Evaluated) and not math.isnan(event.loss):  # the last stage holds the loss
            self.write(f"step {event.step}/{self.total_steps} stage {event.stage}: validation loss {event.loss:.4f}")


def line(step: StepFinished, total_steps: int) -> str:
    """e.g. `step 12/150 stage 1: loss 2.3456, 8123 tokens/s, 0.252 s/step`"""
    loss = "-" if math.isnan(step.loss) else f"{step.loss:.4f}"
    rate = step.tokens / step.seconds if step.seconds > 0 else 0.0
    return (
        f"step {step.step}/{total_steps} stage {step.stage}: loss {loss}, {rate:.0f} tokens/s, "
        f"{step.seconds:.3f} s/step"
    )
