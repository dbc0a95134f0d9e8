"""`weightGradDelay: auto`: the smallest weight-gradient delays the simulator rates as fast as the fastest.

The ratio rule (meshjob.schedule.actions.weight_delay_for: per stage ceil(comm / W), capped by the stash
bound) sizes each stage's delay alone, as if its gradient transfers had the NICs to themselves.
On a step whose transfers queue behind each other on shared NIC links that is often too few W's
(the simulator rates larger delays faster, e.g. on `meshjob bench e2e`'s GPT). So the plan simulates a few
candidate assignments on its own network and stage costs (meshjob.simulate.simulator.simulate_pipeline, the
model `meshjob simulate` and the search trust), each rated by its steady-state period (meshjob.simulate.steady:
the step run three times over, as a job runs it, where a stage's delayed W's at the end of one step
overlap the next step's warm-up; one isolated step counts them in full), each in the transfer order its plan
would take (the send order or a need order, meshjob.plan.comm_order: it can change which delay is fastest),
and keeps the smallest whose period is within TOLERANCE of the fastest candidate's and no slower than the
rule's.

Candidates (few, so planning stays fast): the rule's delays; one global delay d, each stage taking
min(d, its room), for d = 0, 1, 2, 3, 4, 6, 8, 12, 16, ... (about two per doubling) and the largest
room; and the rule's delays raised together, each stage min(rule + k, its room), for the same k >= 1
(stages whose gradients queue longer keep their larger share); and a ramp, the rule raised toward the
last stage: stage s at min(max(rule, D - lead_s), room) for the same D, where lead_s is how many more
warm-up forwards s runs than the last stage (meshjob.schedule.actions.warmup_forwards: 2 per stage in
eager-1F1B). A stage with a shorter warm-up idles longer in the drain, and the W's it delays fill that
idle time, while its input gradients, which the stages before it wait for, go out sooner. With 4
stages the rooms already make that ramp (0, 2, 4, 6: d=6); with 8 stages of 8 microbatches every room
is 7 and none of the other candidates is a ramp. A stage's room is the most W's it may delay without its
peak stash passing eager-1F1B's stage-0 bound min(M, 2S-1) (meshjob.schedule.actions.max_delay_within), so no
candidate raises any stage's stash above the bound. "Smallest": fewest delayed W's summed over stages, then the
smallest largest delay, then the earlier candidate (the rule first).

A simulation costs about (actions of the step) x (stages) steps of the list scheduler: where all the
candidates together would cost more than WORK_BUDGET (about 10 s here; e.g. 128 stages of 128
microbatches), the rule stands unsimulated (DelayChoice.simulated False); where only the need orders'
extra runs would pass it, candidates are simulated in the send order alone. The budget counts work,
not seconds, so every rank that builds the plan picks the same delays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshjob.costs.compute import CostModel
from meshjob.plan.comm_order import (  # imports nothing of the plan: no cycle
    NEED_ORDER_ROUNDS,
    TIES,
    TransferOrder,
    fastest_run,
    run_work,
)
from meshjob.schedule.actions import Action, Edge, generate, warmup_forwards
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import TransferInput
from meshjob.simulate.steady import STEADY_STEPS, period_on

TOLERANCE = 0.01  # a candidate within 1% of the fastest simulated period counts as fast as it
WORK_BUDGET = 10_000_000  # actions x stages, summed over the candidates
RULE = "rule"


@dataclass(frozen=True)
class DelayCandidate:
    name: str  # "rule" (ceil(comm / W) per stage), "d=N" (one delay N), "rule+K" or "ramp=D" (candidate_delays)
    delays: Mapping[int, int]  # stage -> W's delayed
    step_s: float  # simulated steady-state step period (meshjob.simulate.steady) on the plan's own network and costs
    # the transfer order that step ran in, where it is the one the plan takes (meshjob.plan.comm_order.transfer_order:
    # every need order tried); None where the budget held the candidates to the send order
    order: TransferOrder | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> tuple[int, int]:
        return sum(self.delays.values()), max(self.delays.values(), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight_delay": {str(s): d for s, d in sorted(self.delays.items())},
            "step_s": self.step_s,
        }


@dataclass(frozen=True)
class DelayChoice:
    chosen: DelayCandidate
    candidates: tuple[DelayCandidate, ...]  # the rule's first
    tolerance: float = TOLERANCE
    simulated: bool = True  # False: over WORK_BUDGET, the rule alone (its step_s not simulated: nan)

    @property
    def rule(self) -> DelayCandidate:
        return self.candidates[0]

    def to_json(self) -> dict[str, Any]:
        if not self.simulated:
            return {"chosen": self.chosen.name, "simulated": False, "work_budget": WORK_BUDGET}
        return {
            "chosen": self.chosen.name,
            "simulated": True,
            "tolerance": self.tolerance,
            "rule_step_s": self.rule.step_s,
            "chosen_step_s": self.chosen.step_s,
            "candidates": [c.to_json() for c in self.candidates],
        }


def global_delays(largest: int) -> list[int]:
    """0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to `largest`, and `largest` itself."""
    out, power = [0, 1, 2], 2
    while 3 * power // 2 < largest:
        out += [3 * power // 2, 2 * power]
        power *= 2
    return sorted({d for d in out if d < largest} | {max(0, largest)})


def warmup_leads(kind: str, num_stages: int, microbatches: int) -> dict[int, int]:
    """Per stage, how many more warm-up forwards it runs than the last stage (the ramp's steps)."""
    last = warmup_forwards(kind, num_stages - 1, num_stages, microbatches)
    return {s: warmup_forwards(kind, s, num_stages, microbatches) - last for s in range(num_stages)}


def candidate_delays(
    rule: Mapping[int, int], rooms: Mapping[int, int], leads: Mapping[int, int] | None = None
) -> list[tuple[str, dict[int, int]]]:
    """(name, delays) to simulate: the rule's; each global d (global_delays of the largest room) with
    every stage at min(d, room); the rule raised by each k >= 1 of the same list, every stage at
    min(rule + k, room); with `leads` (warmup_leads), the ramp to each D >= 1 of the same list, every
    stage at min(max(rule, D - lead), room). An assignment already listed is not repeated. `rooms`:
    stage -> the most W's it may delay (0 for stages that send no gradients)."""
    steps = global_delays(max(rooms.values(), default=0))
    listed = [(RULE, dict(rule))]
    listed += [(f"d={d}", {s: min(d, room) for s, room in rooms.items()}) for d in steps]
    listed += [(f"rule+{k}", {s: min(rule.get(s, 0) + k, room) for s, room in rooms.items()}) for k in steps if k]
    if leads is not None:
        listed += [
            (f"ramp={d}", {s: min(max(rule.get(s, 0), d - leads[s]), room) for s, room in rooms.items()})
            for d in steps
            if d
        ]
    out: list[tuple[str, dict[int, int]]] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    for name, delays in listed:
        if tuple(sorted(delays.items())) not in seen:
            seen.add(tuple(sorted(delays.items())))
            out.append((name, delays))
    return out


def pick(candidates: Sequence[DelayCandidate], tolerance: float = TOLERANCE) -> DelayCandidate:
    """The smallest candidate whose step is within `tolerance` of the fastest and no slower than the
    first (the rule's)."""
    if not candidates:
        raise ValueError("no delay candidates to choose from")
    if not tolerance >= 0:
        raise ValueError(f"tolerance {tolerance!r} is invalid: a fraction >= 0")
    fastest = min(c.step_s for c in candidates)
    limit = min(fastest * (1 + tolerance), candidates[0].step_s) * (1 + 1e-12)  # float ties count as equal
    fits = [(c.size, i) for i, c in enumerate(candidates) if c.step_s <= limit]
    return candidates[min(fits)[1]]


def within_budget(
    rule: Mapping[int, int],
    rule_lists: Mapping[int, Sequence[Action]],
    rooms: Mapping[int, int],
    leads: Mapping[int, int] | None = None,
    runs: int = 1,
) -> bool:
    """Whether simulating every candidate (candidate_delays), `runs` one-step runs each and its steady
    period (STEADY_STEPS steps), stays within WORK_BUDGET: actions x stages per step."""
    per_candidate = runs + STEADY_STEPS
    return run_work(rule_lists) * per_candidate * len(candidate_delays(rule, rooms, leads)) <= WORK_BUDGET


def unsimulated(rule: Mapping[int, int]) -> DelayChoice:
    """The rule, taken without simulating (over WORK_BUDGET)."""
    candidate = DelayCandidate(RULE, dict(rule), float("nan"))
    return DelayChoice(candidate, (candidate,), simulated=False)


def choose(
    kind: str,
    microbatches: int,
    edges: Sequence[Edge],
    rule: Mapping[int, int],
    rule_lists: Mapping[int, Sequence[Action]],
    rooms: Mapping[int, int],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel,
    tolerance: float = TOLERANCE,
) -> tuple[DelayChoice, Mapping[int, Sequence[Action]]]:
    """Simulate every candidate (split backward) and pick one: (the choice, its action lists).
    `rule_lists`: the rule's action lists; compute_s and transfers as meshjob.simulate.simulator.simulate_pipeline
    takes them. The caller checks within_budget first."""
    num_stages = len(rule_lists)
    leads = warmup_leads(kind, num_stages, microbatches)
    listed = candidate_delays(rule, rooms, leads)
    # each candidate with the transfer order its plan would take (meshjob.plan.comm_order), where the need
    # orders' runs fit the budget too: the order can change which delay is fastest
    # (both tie rules where their runs fit the budget, else the send order's ties alone)
    ties: tuple[str, ...]
    if within_budget(rule, rule_lists, rooms, leads, 1 + len(TIES) * NEED_ORDER_ROUNDS):
        ties = TIES
    elif within_budget(rule, rule_lists, rooms, leads, 1 + NEED_ORDER_ROUNDS):
        ties = TIES[:1]
    else:
        ties = ()
    lists: dict[str, Mapping[int, Sequence[Action]]] = {RULE: rule_lists}
    simulated: list[DelayCandidate] = []
    for name, delays in listed:
        if name not in lists:
            lists[name] = generate(kind, num_stages, microbatches, edges, True, delays)
        order, _, run = fastest_run(lists[name], compute_s, transfers, cost, NEED_ORDER_ROUNDS, ties)  # (): send order
        period = period_on(run, lists[name], microbatches, order.transfers)  # its run is the period's first step
        simulated.append(DelayCandidate(name, delays, period, order if ties == TIES else None))
    chosen = pick(simulated, tolerance)
    return DelayChoice(chosen, tuple(simulated), tolerance), lists[chosen.name]
