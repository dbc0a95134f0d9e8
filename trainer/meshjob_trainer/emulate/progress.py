"""Progress of a running gang: the ranks' events aggregated, a rich progress bar and summary.

Ranks emit the trainer's typed events (meshjob_trainer.events) into the launcher's event pipe;
RunStats aggregates the kinds its summary shows (each kind has its handler below) and ignores the
others, which still reach the run's metrics endpoint (commands.run.MetricsFeed).
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshjob_trainer.events import (
    CheckpointRestored,
    CheckpointWritten,
    Evaluated,
    Event,
    LowerBoundRatio,
    NicBandwidth,
    PayloadMemory,
    PipelineFractions,
    Resharded,
    StepFinished,
    UnitTasks,
    WeightDelay,
)


@dataclass
class RunStats:
    """Aggregates rank events; a step counts as done when every rank has reported it."""

    world_size: int
    total_steps: int
    resume_step: int = 0  # steps a checkpoint already holds when the run starts
    last_step: dict[int, int] = field(default_factory=dict)  # rank -> last step reported
    step_seconds: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # max over ranks
    step_tokens: dict[int, int] = field(default_factory=dict)
    loss: float = math.nan
    # step -> global-batch loss: every last-stage rank reports the same one; a restart's rerun replaces it
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    reshard_bytes: int = 0
    reshard_seconds: float = 0.0  # summed over receivers: includes waiting for the peer stage
    first_event_s: float | None = None  # monotonic time of the first and latest rank event
    last_event_s: float | None = None
    reshard_by_boundary: dict[str, list[float]] = field(default_factory=dict)  # [bytes, seconds, n]
    checkpoint_step: int | None = None
    pipeline: dict[int, tuple[float, float]] = field(default_factory=dict)
    nic_bytes_per_s: dict[str, float] = field(default_factory=dict)  # host -> highest achieved rate
    lower_bound_ratio: dict[str, float] = field(default_factory=dict)  # boundary -> latest ratio
    unit_tasks: dict[str, int] = field(default_factory=dict)  # balancer -> tasks sent
    payload: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> (peak, bound) bytes, most of any rank
    weight_delay: dict[int, WeightDelay] = field(default_factory=dict)  # stage -> the delay it runs with
    restarts: int = 0
    resumed_from: list[int] = field(default_factory=list)  # per restart: steps already done
    _awaiting_resume: bool = False

    def add(self, rank: int, event: Event) -> None:
        """One event from rank `rank`."""
        now = time.monotonic()
        self.first_event_s = now if self.first_event_s is None else self.first_event_s
        self.last_event_s = now
        self._add(event, rank)

    @functools.singledispatchmethod
    def _add(self, event: Event, rank: int) -> None:
        """Kinds the summary does not show."""

    @_add.register
    def _step(self, event: StepFinished, rank: int) -> None:
        if self._awaiting_resume:  # the first step a restarted gang finishes
            self.resumed_from.append(event.step - 1)
            self._awaiting_resume = False
        self.last_step[rank] = event.step
        self.step_seconds[event.step] = max(self.step_seconds[event.step], event.seconds)
        self.step_tokens[event.step] = event.tokens
        if not math.isnan(event.loss):
            self.loss = event.loss
            self.losses[event.step] = event.loss

    @_add.register
    def _evaluated(self, event: Evaluated, rank: int) -> None:
        if not math.isnan(event.loss):
            self.val_losses[event.step] = event.loss

    @_add.register
    def _resharded(self, event: Resharded, rank: int) -> None:
        self.reshard_bytes += event.nbytes
        self.reshard_seconds += event.seconds
        acc = self.reshard_by_boundary.setdefault(str(event.boundary), [0.0, 0.0, 0.0])
        acc[0] += event.nbytes
        acc[1] += event.seconds
        acc[2] += 1

    @_add.register
    def _checkpoint(self, event: CheckpointWritten, rank: int) -> None:
        self.checkpoint_step = event.step

    @_add.register
    def _restored(self, event: CheckpointRestored, rank: int) -> None:
        if not self.restarts:  # what the first gang's ranks restored, not what was guessed before they ran
            self.resume_step = event.step

    @_add.register
    def _pipeline(self, event: PipelineFractions, rank: int) -> None:
        self.pipeline[event.stage] = (event.bubble, event.overlap)

    @_add.register
    def _nic(self, event: NicBandwidth, rank: int) -> None:
        self.nic_bytes_per_s[event.host] = max(self.nic_bytes_per_s.get(event.host, 0.0), event.bytes_per_second)

    @_add.register
    def _ratio(self, event: LowerBoundRatio, rank: int) -> None:
        self.lower_bound_ratio[str(event.boundary)] = event.ratio

    @_add.register
    def _unit_tasks(self, event: UnitTasks, rank: int) -> None:
        self.unit_tasks[event.balancer] = self.unit_tasks.get(event.balancer, 0) + event.count

    @_add.register
    def _payload(self, event: PayloadMemory, rank: int) -> None:
        peak, bound = self.payload.get(event.stage, (0, 0))
        self.payload[event.stage] = (max(peak, event.peak_bytes), max(bound, event.bound_bytes))

    @_add.register
    def _weight_delay(self, event: WeightDelay, rank: int) -> None:
        self.weight_delay[event.stage] = event

    def restart(self) -> None:
        """A new gang resumes from the checkpoint: steps after it will be reported again."""
        self.restarts += 1
        self.last_step.clear()
        self._awaiting_resume = True

    @property
    def step(self) -> int:
        """Steps completed by every rank (counting those a resumed checkpoint holds)."""
        if len(self.last_step) < self.world_size:
            return self.resume_step
        return max(self.resume_step, min(self.last_step.values()))

    @property
    def tokens_per_s(self) -> float:
        """Of the last completed step (the slowest rank's time)."""
        s = self.step
        if s == 0 or self.step_seconds.get(s, 0) <= 0:
            return 0.0
        return self.step_tokens[s] / self.step_seconds[s]

    @property
    def mean_tokens_per_s(self) -> float:
        done = [s for s in range(self.resume_step + 1, self.step + 1) if self.step_seconds.get(s, 0) > 0]
        secs = sum(self.step_seconds[s] for s in done)
        return sum(self.step_tokens[s] for s in done) / secs if secs > 0 else 0.0

    @property
    def reshard_gbytes_per_s(self) -> float:
        """Bytes received by resharding, all ranks together, over the time ranks have been
        reporting. (A receiver's own resharding time includes waiting for the sending stage to
        compute, so bytes over that time would not be a transfer rate.)"""
        if self.first_event_s is None or self.last_event_s is None or self.last_event_s <= self.first_event_s:
            return 0.0
        return self.reshard_bytes / (self.last_event_s - self.first_event_s) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "steps_completed": self.step,
            "total_steps": self.total_steps,
            "final_loss": None if math.isnan(self.loss) else self.loss,
            "losses": sorted(self.losses.items()),  # [step, loss], each step once
            "final_val_loss": self.val_losses[max(self.val_losses)] if self.val_losses else None,
            "val_losses": sorted(self.val_losses.items()),
            "tokens_per_s_mean": self.mean_tokens_per_s,
            "resharding_bytes": self.reshard_bytes,
            "resharding_gbytes_per_s": self.reshard_gbytes_per_s,
            "resharding": {
                b: {"bytes": v[0], "seconds": v[1], "count": int(v[2])}
                for b, v in sorted(self.reshard_by_boundary.items())
            },
            "pipeline": {str(s): {"bubble": b, "overlap": o} for s, (b, o) in sorted(self.pipeline.items())},
            "nic_bytes_per_s_max": dict(sorted(self.nic_bytes_per_s.items())),
            "resharding_lower_bound_ratio": dict(sorted(self.lower_bound_ratio.items())),
            "unit_tasks": dict(sorted(self.unit_tasks.items())),
            "weight_delay": {
                str(s): {
                    "delay": d.delay,
                    "forward_s": d.forward_s,
                    "input_grad_s": d.input_grad_s,
                    "weight_grad_s": d.weight_grad_s,
                    "peak_stash": d.peak_stash,
                    "stash_bound": d.stash_bound,
                    "measured": d.measured,
                }
                for s, d in sorted(self.weight_delay.items())
            },
            "payload_memory": {
                str(s): {"peak_bytes": p, "bound_bytes": b} for s, (p, b) in sorted(self.payload.items())
            },
            "resume_step": self.resume_step,
            "last_checkpoint_step": self.checkpoint_step,
            "restarts": self.restarts,
            "resumed_from_steps": self.resumed_from,
        }


class ProgressView:
    """A rich progress bar refreshed by the caller (no refresh thread: ranks are forked from the
    main thread, and a fork while another thread holds a stdio lock could deadlock the child)."""

    def __init__(self, stats: RunStats, console: Console | None = None, enabled: bool = True):
        self.stats = stats
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("reshard {task.fields[gbps]} GB/s"),
            TimeElapsedColumn(),
            console=self.console,
            auto_refresh=False,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=stats.total_steps, loss="-", tps="-", gbps="-")

    def __enter__(self) -> ProgressView:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.update()
        self.progress.stop()

    def update(self) -> None:
        s = self.stats
        self.progress.update(
            self.task,
            completed=s.step,
            loss="-" if math.isnan(s.loss) else f"{s.loss:.4f}",
            tps=f"{s.tokens_per_s:,.0f}",
            gbps=f"{s.reshard_gbytes_per_s:.3g}",
        )
        self.progress.refresh()


def summary_table(rows: list[tuple[str, str]], title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    for key, value in rows:
        table.add_row(key, value)
    return table
