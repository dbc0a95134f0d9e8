"""Progress of a running gang: events from the ranks, aggregated figures, rich bar and summary.

Ranks send JSON events through the launcher's pipe (RankContext.report). Schema (`kind` first):
  step:       stage, step (None: count), seconds, tokens (of the global batch), loss (NaN: no loss here)
  reshard:    boundary "a->b", strategy, scope, bytes (received by this rank), seconds
  checkpoint: step, seconds
  pipeline:   stage, bubble, overlap (fractions)
  nic:        host (the rank's host name in the plan), bytes_per_second (achieved while resharding)
  ratio:      boundary "a->b", value (resharding time over its lower bound)
  unit_tasks: balancer, count
`hook_trainer_metrics` produces them from the trainer's own TrainerMetrics calls, so the trainer
needs no second reporting path.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def hook_trainer_metrics(report: Callable[..., None]) -> None:
    """In a forked rank: make every TrainerMetrics.record_* call also report a progress event."""
    from meshjob_trainer.metrics import TrainerMetrics

    orig_step = TrainerMetrics.record_step
    orig_reshard = TrainerMetrics.record_resharding
    orig_ckpt = TrainerMetrics.record_checkpoint
    orig_pipe = TrainerMetrics.record_pipeline
    orig_nic = TrainerMetrics.record_nic
    orig_ratio = TrainerMetrics.record_resharding_ratio
    orig_tasks = TrainerMetrics.record_unit_tasks

    def record_step(self: Any, seconds: float, tokens: int, loss: float, step: int | None = None) -> None:
        orig_step(self, seconds, tokens, loss, step)
        report(kind="step", stage=self.stage, step=step, seconds=seconds, tokens=tokens, loss=loss)

    def record_resharding(self: Any, strategy: str, scope: str, boundary: str, nbytes: int,
                          seconds: float) -> None:
        orig_reshard(self, strategy, scope, boundary, nbytes, seconds)
        report(kind="reshard", boundary=str(boundary), strategy=strategy, scope=scope, bytes=nbytes,
               seconds=seconds)

    def record_checkpoint(self: Any, seconds: float, step: int) -> None:
        orig_ckpt(self, seconds, step)
        report(kind="checkpoint", step=step, seconds=seconds)

    def record_pipeline(self: Any, stage: int, bubble_fraction: float, overlap_fraction: float) -> None:
        orig_pipe(self, stage, bubble_fraction, overlap_fraction)
        report(kind="pipeline", stage=stage, bubble=bubble_fraction, overlap=overlap_fraction)

    def record_nic(self: Any, host: str, bytes_per_second: float) -> None:
        orig_nic(self, host, bytes_per_second)
        report(kind="nic", host=host, bytes_per_second=bytes_per_second)

    def record_resharding_ratio(self: Any, boundary: str, seconds_over_lower_bound: float) -> None:
        orig_ratio(self, boundary, seconds_over_lower_bound)
        report(kind="ratio", boundary=str(boundary), value=seconds_over_lower_bound)

    def record_unit_tasks(self: Any, balancer: str, count: int) -> None:
        orig_tasks(self, balancer, count)
        report(kind="unit_tasks", balancer=balancer, count=count)

    TrainerMetrics.record_step = record_step  # type: ignore[method-assign]
    TrainerMetrics.record_resharding = record_resharding  # type: ignore[method-assign]
    TrainerMetrics.record_checkpoint = record_checkpoint  # type: ignore[method-assign]
    TrainerMetrics.record_pipeline = record_pipeline  # type: ignore[method-assign]
    TrainerMetrics.record_nic = record_nic  # type: ignore[method-assign]
    TrainerMetrics.record_resharding_ratio = record_resharding_ratio  # type: ignore[method-assign]
    TrainerMetrics.record_unit_tasks = record_unit_tasks  # type: ignore[method-assign]


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
    losses: list[tuple[int, float]] = field(default_factory=list)
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
    restarts: int = 0
    resumed_from: list[int] = field(default_factory=list)  # per restart: steps already done
    _awaiting_resume: bool = False

    def add(self, event: dict) -> None:
        kind, rank = event.get("kind"), int(event.get("rank", -1))
        now = time.monotonic()
        self.first_event_s = now if self.first_event_s is None else self.first_event_s
        self.last_event_s = now
        if kind == "step":
            step = event.get("step")
            step = self.last_step.get(rank, 0) + 1 if step is None else int(step)
            if self._awaiting_resume:  # the first step a restarted gang finishes
                self.resumed_from.append(step - 1)
                self._awaiting_resume = False
            self.last_step[rank] = step
            self.step_seconds[step] = max(self.step_seconds[step], float(event["seconds"]))
            self.step_tokens[step] = int(event["tokens"])
            loss = float(event["loss"])
            if not math.isnan(loss):
                self.loss = loss
                self.losses.append((step, loss))
        elif kind == "reshard":
            self.reshard_bytes += int(event["bytes"])
            self.reshard_seconds += float(event["seconds"])
            acc = self.reshard_by_boundary.setdefault(event["boundary"], [0.0, 0.0, 0.0])
            acc[0] += float(event["bytes"])
            acc[1] += float(event["seconds"])
            acc[2] += 1
        elif kind == "checkpoint":
            self.checkpoint_step = int(event["step"])
        elif kind == "pipeline":
            self.pipeline[int(event["stage"])] = (float(event["bubble"]), float(event["overlap"]))
        elif kind == "nic":
            host = str(event["host"])
            self.nic_bytes_per_s[host] = max(self.nic_bytes_per_s.get(host, 0.0), float(event["bytes_per_second"]))
        elif kind == "ratio":
            self.lower_bound_ratio[str(event["boundary"])] = float(event["value"])
        elif kind == "unit_tasks":
            balancer = str(event["balancer"])
            self.unit_tasks[balancer] = self.unit_tasks.get(balancer, 0) + int(event["count"])

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
            "steps_completed": self.step, "total_steps": self.total_steps,
            "final_loss": None if math.isnan(self.loss) else self.loss,
            "losses": self.losses,
            "tokens_per_s_mean": self.mean_tokens_per_s,
            "resharding_bytes": self.reshard_bytes,
            "resharding_gbytes_per_s": self.reshard_gbytes_per_s,
            "resharding": {b: {"bytes": v[0], "seconds": v[1], "count": int(v[2])}
                           for b, v in sorted(self.reshard_by_boundary.items())},
            "pipeline": {str(s): {"bubble": b, "overlap": o} for s, (b, o) in sorted(self.pipeline.items())},
            "nic_bytes_per_s_max": dict(sorted(self.nic_bytes_per_s.items())),
            "resharding_lower_bound_ratio": dict(sorted(self.lower_bound_ratio.items())),
            "unit_tasks": dict(sorted(self.unit_tasks.items())),
            "resume_step": self.resume_step, "last_checkpoint_step": self.checkpoint_step, "restarts": self.restarts,
            "resumed_from_steps": self.resumed_from,
        }


class ProgressView:
    """A rich progress bar refreshed by the caller (no refresh thread: ranks are forked from the
    main thread, and a fork while another thread holds a stdio lock could deadlock the child)."""

    def __init__(self, stats: RunStats, console: Console | None = None, enabled: bool = True):
        self.stats = stats
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("reshard {task.fields[gbps]} GB/s"), TimeElapsedColumn(),
            console=self.console, auto_refresh=False, disable=not enabled, transient=False)
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
            self.task, completed=s.step, loss="-" if math.isnan(s.loss) else f"{s.loss:.4f}",
            tps=f"{s.tokens_per_s:,.0f}", gbps=f"{s.reshard_gbytes_per_s:.3g}")
        self.progress.refresh()


def summary_table(rows: list[tuple[str, str]], title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    for key, value in rows:
        table.add_row(key, value)
    return table
