"""torch.distributed.pipelining as a peer: its schedules run on meshjob's models, data and emulated device.

Two kinds of stage module for torch's PipelineStage:
- RealPeerStage: layers [first, last) of meshjob's model (meshjob_trainer.model.StageModule), positional in and
  out as torch's stages pass tensors; the last stage returns logits and `peer_loss` is meshjob's loss. With an
  exported plan (meshjob.schedule.torch_csv) torch's runtime trains to meshjob's losses.
- EmulatedPeerStage: no math worth the name (one elementwise product with one weight), outputs of the real
  activation shape, and ModelledWaits' hooks wait the device's modelled times (meshjob.costs.device_costs), as
  meshjob's EmulatedCompute does: a forward hook waits F, a hook on the input's gradient waits I, a hook on the
  weight's gradient waits W. Torch's split backward runs the input gradient in I and the weight gradient in W,
  so a zero-bubble schedule's W costs what meshjob's does. A first stage has no input gradient: torch runs its
  whole backward in W (PipelineStage.backward_one_chunk), so there the weight's hook waits I + W.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule, _PipelineScheduleRuntime

from meshjob.costs.compute import StageCost
from meshjob.schedule.torch_schedules import TorchSchedule
from meshjob.spec.manifest import TrainingJob
from meshjob_trainer.compute import DeadlineClock
from meshjob_trainer.data import TRAIN, make_data
from meshjob_trainer.model import StageModule
from meshjob_trainer.optim import lr_at, make_optimizer, weight_decay_groups

KINDS = ("F", "I", "W", "optimizer")


@dataclass
class ModelledWaits:
    """One rank's modelled compute: the clock its hooks wait on, the seconds waited per kind (what a test adds
    up), and the activations stashed (forwarded, weight gradient not yet done), in one rank-full of layers."""

    clock: DeadlineClock = field(default_factory=DeadlineClock)
    modelled: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    live: float = 0.0
    peak_stash: float = 0.0

    def wait(self, kind: str, seconds: float) -> None:
        self.modelled[kind] += seconds
        self.clock.wait(seconds)

    def stash(self, share: float) -> None:
        self.live += share
        self.peak_stash = max(self.peak_stash, self.live)

    def attach(self, module: EmulatedPeerStage, cost: StageCost, share: float) -> None:
        """The hooks on one stage module; `share`: its part of the rank's layers (1 / stages per rank)."""

        def forward_hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            self.wait("F", cost.forward_s)
            self.stash(share)

        def weight_hook(grad: torch.Tensor) -> None:
            # a first stage has no input gradient: torch computes its whole backward here
            if module.first:
                self.wait("I", cost.input_grad_s)
            self.wait("W", cost.weight_grad_s)
            self.live -= share

        module.register_forward_hook(forward_hook)
        module.weight.register_hook(weight_hook)
        module.input_grad_hook = lambda grad: self.wait("I", cost.input_grad_s)


class EmulatedPeerStage(nn.Module):
    """An activation of `shape` in and out (tokens in on the first stage), at the cost of one product."""

    def __init__(self, shape: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.shape, self.first, self.last = tuple(shape), first, last
        self.weight = nn.Parameter(torch.ones(self.shape[-1]))
        self.input_grad_hook: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = torch.zeros(self.shape, dtype=self.weight.dtype, device=x.device)
        else:
            x = x.view_as(x)  # a fresh tensor each microbatch: the hook below is this microbatch's only
            if x.requires_grad and self.input_grad_hook is not None:
                x.register_hook(self.input_grad_hook)
        return x * self.weight


def emulated_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A scalar with a gradient for every element: the last stage's modelled forward already counts the loss."""
    return output.float().mean()


class RealPeerStage(nn.Module):
    """meshjob's stage module, its tensors positional: tokens or the activation in, the activation or logits out."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        if stage.skip_inputs or stage.skip_outputs:
            raise ValueError(f"layers [{stage.first}, {stage.last}): torch's stages carry no skip tensors")
        if stage.is_last and stage.tied and not stage.is_first:
            raise ValueError("a tied head on the last stage needs its gradient summed with stage 0's: untie it")
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        with s.numerics.autocast(x.device.type):  # the numerics meshjob's forward runs under (fp32 or bf16)
            h = s.embed(x) if s.is_first else x
            for i in range(s.first, s.last):
                h = s.numerics.run_block(s.blocks[str(i)], h)
            if not s.is_last:
                return h
            return F.linear(s.ln_f(h), s.wte.weight if s.tied else s.lm_head.weight)


def peer_loss(tokens_per_batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """meshjob's loss: the token cross-entropy summed, over the global batch's tokens (microbatches add up)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets.reshape(-1), reduction="sum") / tokens_per_batch

    return loss


def schedule_class(spec: TorchSchedule) -> type[_PipelineSchedule]:
    """torch's class of the registered schedule (the registry holds its name: the plan layer imports no torch)."""
    cls = getattr(torch_schedules, spec.name)
    assert isinstance(cls, type) and issubclass(cls, _PipelineSchedule)
    return cls


def torch_rows(spec: TorchSchedule, ranks: int, microbatches: int) -> dict[int, list[tuple[int, str, int | None]]]:
    """Every rank's compute-only actions as torch's class generates them, (stage, kind, microbatch) each (an
    overlapped F and B as its two parts): what meshjob.schedule.torch_orders' port must give. No process group:
    the classes compute every rank's order in their constructor, here from stand-ins for their stages."""
    if issubclass(schedule_class(spec), PipelineScheduleSingle):  # its display order is not what its step runs
        return {r: [(s, k, m) for s, k, m in cells] for r, cells in spec.orders(ranks, microbatches).items()}
    stages = ranks * spec.stages_per_rank

    def stand_in(index: int) -> SimpleNamespace:
        last = index == stages - 1
        return SimpleNamespace(
            num_stages=stages,
            group_size=ranks,
            group_rank=0,
            stage_index=index,
            submod=nn.Identity(),
            is_first=index == 0,
            is_last=last,
        )

    mine = [stand_in(i) for i in spec.stages_of(0, ranks)]
    order = _new_schedule(spec, mine, microbatches).pipeline_order or {}
    rows: dict[int, list[tuple[int, str, int | None]]] = {}
    for rank in range(ranks):
        cells: list[tuple[int, str, int | None]] = []
        for action in order[rank]:
            for part in action.sub_actions or (action,) if action is not None else ():
                cells.append((part.stage_index, part.computation_type.value, part.microbatch_index))
        rows[rank] = cells
    return rows


def build_schedule(
    spec: TorchSchedule,
    stages: list[PipelineStage],
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """torch's schedule over this rank's stages; the loss already averages, so gradients are not scaled again."""
    schedule: _PipelineSchedule = _new_schedule(spec, stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule


def _new_schedule(spec: TorchSchedule, stages: Sequence[Any], microbatches: int, **options: Any) -> Any:
    """An instance of the class: a single-stage class takes the rank's stage, the others the list of them."""
    cls: Any = schedule_class(spec)
    return cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else list(stages), microbatches, **options)


def csv_schedule(
    path: str,
    stage: PipelineStage,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineScheduleRuntime:
    """torch's runtime running an exported meshjob plan (meshjob.schedule.torch_csv), one stage per rank."""
    schedule = _PipelineScheduleRuntime([stage], microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule._load_csv(path, format="compute_comms")
    return schedule


def run_step(
    schedule: _PipelineSchedule,
    stage_indices: Sequence[int],
    num_stages: int,
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """One training step of this rank's stages on (input, target) microbatches; the step's loss where the
    last stage is here, else NaN. torch splits the batch evenly along dim 0, so meshjob's microbatches
    (equal slices) concatenated come back as they were."""
    losses: list[torch.Tensor] = []
    has_first, has_last = 0 in stage_indices, num_stages - 1 in stage_indices
    args = (torch.cat([x for x, _ in microbatches]),) if has_first else ()
    target = torch.cat([t for _, t in microbatches]) if has_last else None
    schedule.step(*args, target=target, losses=losses, return_outputs=False)
    return math.fsum(float(loss.detach()) for loss in losses) if has_last else math.nan


@dataclass
class PeerResult:
    rank: int
    stages: tuple[int, ...]
    step_seconds: list[float]
    modelled: list[dict[str, float]]  # per step, seconds waited per kind (F, I, W, optimizer)
    peak_stash: list[float]  # per step, most activations stashed at once, in one rank-full of layers


def run_emulated_rank(
    spec: TorchSchedule,
    rank: int,
    ranks: int,
    costs: Sequence[StageCost],
    optimizer_s: float,
    shape: Sequence[int],
    microbatches: int,
    steps: int,
) -> PeerResult:
    """This rank's part of `steps` steps of torch's schedule under emulated compute (the default process group
    is up): `costs` per stage (len: ranks x stages per rank), the optimizer step a wait as meshjob's is.
    Torch's first step also infers the stages' shapes (one extra forward): read the steps after it."""
    indices = spec.stages_of(rank, ranks)
    waits = ModelledWaits()
    stages = []
    for i in indices:
        module = EmulatedPeerStage(shape, first=i == 0, last=i == len(costs) - 1)
        waits.attach(module, costs[i], 1 / spec.stages_per_rank)
        stages.append(PipelineStage(module, i, len(costs), torch.device("cpu")))
    schedule = build_schedule(spec, stages, microbatches, emulated_loss)
    tokens = torch.zeros((shape[0], shape[1]), dtype=torch.long)
    batch = [(tokens, tokens) for _ in range(microbatches)]
    result = PeerResult(rank, indices, [], [], [])
    dist.barrier()  # every rank starts the first step together; then, as meshjob's, they run unsynchronised
    for _ in range(steps):
        before = dict(waits.modelled)
        waits.live = waits.peak_stash = 0.0  # a rank's step ends with every stash released
        start = time.perf_counter()
        run_step(schedule, indices, len(costs), batch)
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        waits.wait("optimizer", optimizer_s)
        result.step_seconds.append(time.perf_counter() - start)
        result.modelled.append({k: v - before.get(k, 0.0) for k, v in waits.modelled.items()})
        result.peak_stash.append(waits.peak_stash)
    return result


def train_peer_rank(
    job: TrainingJob,
    stage_indices: Sequence[int],
    make_schedule: Callable[[list[PipelineStage], Callable[..., torch.Tensor]], _PipelineSchedule],
) -> list[float]:
    """`job`'s training in torch's runtime on this rank's stages of `job` (the default process group is up):
    meshjob's model, data, loss and AdamW, real math. The step losses where this rank holds the last stage."""
    t, num_stages = job.training, len(job.stages)
    modules = [StageModule(job.model, *job.stages[i].layers, t.seed) for i in stage_indices]
    stages = [
        PipelineStage(RealPeerStage(m), i, num_stages, torch.device("cpu")) for m, i in zip(modules, stage_indices)
    ]
    schedule = make_schedule(stages, peer_loss(t.global_batch * job.model.seq_len))
    groups = [g for m in modules for g in weight_decay_groups(m, t.optimizer.weight_decay, t.weight_decay_embeddings)]
    optimizer = make_optimizer(groups, t.learning_rate)
    data = make_data(job, TRAIN)
    losses: list[float] = []
    for step in range(t.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        batch = [data.microbatch(step, mb, t.microbatches) for mb in range(t.microbatches)]
        loss = run_step(schedule, stage_indices, num_stages, [(b.tokens, b.targets) for b in batch])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if num_stages - 1 in stage_indices:
            losses.append(loss)
    return losses


def train_csv_rank(job: TrainingJob, stage_index: int, csv_path: str) -> list[float]:
    """train_peer_rank with the exported CSV as torch's schedule (meshjob.schedule.torch_csv: one stage per rank)."""
    m = job.training.microbatches
    return train_peer_rank(job, (stage_index,), lambda stages, loss: csv_schedule(csv_path, stages[0], m, loss))


def train_torch_rank(job: TrainingJob, spec: TorchSchedule, rank: int, ranks: int) -> list[float]:
    """train_peer_rank with torch's own schedule `spec` (`job` cut into ranks x its stages per rank)."""
    m = job.training.microbatches
    return train_peer_rank(job, spec.stages_of(rank, ranks), lambda stages, loss: build_schedule(spec, stages, m, loss))
