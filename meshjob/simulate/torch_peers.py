"""torch.distributed.pipelining's schedules on the simulator: their action lists, as data, run on a plan's costs.

Torch's compute orders (per rank, (stage, kind, microbatch): meshjob.schedule.torch_orders, as torch's classes
generate them) become one action list per rank, which simulate_pipeline runs with a rank as its
executor: a rank's stages share its device. A stage's microbatch m is action microbatch k * M + m (k: the stage's
place on its rank), and the transfer between stages s and s + 1 is the tensor "s<s>" between their ranks (none
when both are on one rank: torch hands it over locally). Receives stand right before the compute that needs
them, sends right after the one that produces them: torch's runtime waits for a posted receive there.
A rank's F, I, W cost the mean of its stages' (the simulator prices compute per executor and kind).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshjob.costs.compute import CostModel, StageCost
from meshjob.schedule.actions import DEFAULT_TENSOR, Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.schedule.torch_schedules import TORCH_SCHEDULES, TorchSchedule
from meshjob.simulate.simulator import (
    PipelineResult,
    PlanView,
    TransferCost,
    TransferInput,
    simulate_pipeline,
    transfer_costs,
)


def _tensor(stage: int) -> str:
    return f"s{stage}"  # the transfer from stage `stage` to stage + 1


def rank_schedules(spec: TorchSchedule, ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """Each rank's actions with their transfers, in torch's compute order."""
    stages = ranks * spec.stages_per_rank
    out: dict[int, list[Action]] = {}
    for rank, cells in spec.orders(ranks, microbatches).items():
        local = spec.stages_of(rank, ranks)
        acts: list[Action] = []
        for stage, kind, mb in cells:
            compute = Action(kind, local.index(stage) * microbatches + mb)
            if kind == "F":
                prev = spec.rank_of(stage - 1, ranks) if stage > 0 else rank
                if prev != rank:
                    acts.append(Action("RECV_F", mb, prev, _tensor(stage - 1)))
                acts.append(compute)
                after = spec.rank_of(stage + 1, ranks) if stage < stages - 1 else rank
                if after != rank:
                    acts.append(Action("SEND_F", mb, after, _tensor(stage)))
            elif kind in ("B", "I"):
                after = spec.rank_of(stage + 1, ranks) if stage < stages - 1 else rank
                if after != rank:
                    acts.append(Action("RECV_B", mb, after, _tensor(stage)))
                acts.append(compute)
                prev = spec.rank_of(stage - 1, ranks) if stage > 0 else rank
                if prev != rank:
                    acts.append(Action("SEND_B", mb, prev, _tensor(stage - 1)))
            else:
                acts.append(compute)
        out[rank] = acts
    return out


def _hop(hop: TransferCost, src: int, dst: int) -> TransferInput:
    """The plan's one-hop transfer (host 0 to host 1) moved onto ranks src -> dst (one host each)."""
    hosts = sorted({host for host, _ in hop.per_link})
    sender = min(hosts)
    moved = {((src if host == sender else dst), kind): n for (host, kind), n in hop.per_link.items()}
    return TransferCost(hop.seconds, moved, hop.early_s)


def simulate_torch(
    spec: TorchSchedule,
    ranks: int,
    microbatches: int,
    stage_costs: Sequence[StageCost],
    hop: TransferCost,
    cost: CostModel | None = None,
) -> PipelineResult:
    """One step of torch's schedule: `stage_costs` per stage (ranks x stages per rank), every transfer costs
    `hop` (one activation between two hosts on the plan's network) on its ranks' NIC links."""
    schedules = rank_schedules(spec, ranks, microbatches)
    compute: dict[tuple[int, str], float] = {}
    for rank in schedules:
        mine = [stage_costs[s] for s in spec.stages_of(rank, ranks)]
        for kind, seconds in (
            ("F", [c.forward_s for c in mine]),
            ("B", [c.backward_s for c in mine]),
            ("I", [c.input_grad_s for c in mine]),
            ("W", [c.weight_grad_s for c in mine]),
        ):
            compute[(rank, kind)] = sum(seconds) / len(seconds)
    transfers: dict[BoundaryKey, TransferInput] = {}
    for rank, acts in schedules.items():
        for a in acts:
            if a.kind.startswith("SEND"):
                key = BoundaryKey.of_action(rank, a)
                transfers[key] = _hop(hop, key.src, key.dst)
    return simulate_pipeline(schedules, compute, transfers, cost)


def torch_families(plan: PlanView, cost: CostModel) -> dict[str, float]:
    """One step of each torch schedule on a plan's pipeline (a rank per stage, its compute; a stage of a
    two-stage schedule half of one), every transfer the plan's first activation boundary: which family wins
    on the user's job before anything runs. Schedules torch refuses for these counts are left out."""
    ranks, microbatches = len(plan.job.stages), plan.job.training.microbatches
    per_stage = cost.stage_costs(plan.job)
    hop = transfer_costs(plan, cost)[BoundaryKey(0, 1, DEFAULT_TENSOR)]
    out: dict[str, float] = {}
    for name, spec in TORCH_SCHEDULES.items():
        k = spec.stages_per_rank
        costs = [
            StageCost(c.forward_s / k, c.input_grad_s / k, c.weight_grad_s / k)
            for c in (per_stage[spec.rank_of(s, ranks)] for s in range(ranks * k))
        ]
        try:
            out[name] = simulate_torch(spec, ranks, microbatches, costs, hop, cost).step_s
        except ValueError:  # torch's own rules (microbatches per round, at least as many as stages)
            continue
    return out
