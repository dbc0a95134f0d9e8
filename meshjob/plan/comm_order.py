"""The order of a step's transfers, which every rank derives from the plan alone.

Two things the executor needs (meshjob_trainer.engine):
- NCCL matches the point-to-point messages between two ranks of a communicator by the order they
  are issued in, not by tags. The trainer gives each directed pair of ranks its own communicator
  (meshjob_trainer.wire), so a sender must issue its messages to a receiver in the order that
  receiver posts them. Both follow `transfers`, and inside one transfer the sender's program
  order (meshjob.plan.program). gloo matches by tag and would not need it; the trainer keeps the same
  discipline on both, so CPU runs check what GPU runs rely on.
- Receives posted early let senders run ahead (gloo sends only once the receiver has posted), but
  each posted receive holds a buffer: a stage keeps `depth[b]` receives of boundary b posted ahead
  of the one it consumes next, which bounds the memory of in-flight payloads.

`transfers` is the order in which the links of a list-scheduled run of the step (meshjob.simulate.simulator:
the plan's action lists, its compute costs and transfer makespans) take its transfers: about the
order in which they happen. Two candidates, and the simulator picks:
- the send order: each link takes transfers as their SENDs are issued. A stage that runs ahead (eager
  warm-up forwards) queues every microbatch's transfers on its out-link at once, and a receiving
  in-link then carries microbatches it needs late before one it needs now: the U-Transformer's skip
  tensors from stage 0 to the last stage queued every warm-up microbatch's skips ahead of the first
  microbatch's activation from the stage before it, and the last stage started its first forward late;
- the need order: by the later of when the transfer was sent and when its receiver reached the RECV
  that waits for it, in a run of the previous order (a few rounds, each run in the order before it).
  Ties (transfers a stage sends at one instant to receivers that both wait already) go either in the
  send order or to the one whose receiver uses it first (TIES: each a chain of rounds of its own). The
  U-Transformer's last stage sends, after its first I, the activation gradient to the stage before it
  and the skip gradients to stage 0: both receivers wait, but stage 0 uses its gradients only once the
  activation gradient has come back down the chain. In the send order the skips went first on the
  out-link, and every one of the four decoder hops of the first gradient waited behind four skips.
  Neither rule is faster on every case (`meshjob bench pipeline` compares them, bench/results/pipeline.json),
  so both are run.
The order of the fastest run is kept (the send order unless another is faster by more than TOLERANCE);
where the runs would cost more than WORK_BUDGET (actions x stages per run), the send order stands.
It is causal either way: every transfer comes after the transfers its data depends on (its data
arrived, so was sent and needed, before it was sent).
`depth[b]` is one more than the most transfers of b that this run has in flight at once (sent, not
yet received), so in this run the receive of microbatch m is posted (when m - depth[b] has been
received) before m is sent. Hence issuing in this order cannot deadlock: by induction over the
run, the earliest transfer not yet done has its data, its receiver's buffer, and every message
before it on each pair of ranks it uses. Real timing may differ from the run's; that costs waiting,
never a hang.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshjob.costs.compute import CostModel
from meshjob.plan.recent import Recent  # imports nothing of the plan: no cycle
from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import (
    PipelineResult,
    PipelineRun,
    PlanView,
    TransferCost,
    TransferInput,
    compute_costs,
    plan_cost,
    transfer_costs,
)

Transfer = tuple[BoundaryKey, int]  # (boundary, microbatch)
TIES = ("sent", "used")  # a need order's ties: in the send order, or the transfer used first first
NEED_ORDER_ROUNDS = 3  # need orders tried, each from the run of the one before
TOLERANCE = 0.01  # another order replaces the send order only when its run is this much faster
WORK_BUDGET = 2_000_000  # actions x stages of one run: above it, the send order stands unsimulated
SENDS, RECVS = ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")


@dataclass(frozen=True)
class TransferOrder:
    transfers: tuple[Transfer, ...]  # every transfer of one step, in issue order
    depth: Mapping[BoundaryKey, int] = field(default_factory=dict)  # receives posted ahead, per boundary

    @functools.cached_property
    def _positions(self) -> dict[Transfer, int]:
        return {t: i for i, t in enumerate(self.transfers)}

    def position(self, key: BoundaryKey, mb: int) -> int:
        """Where (key, mb) stands in the step's order; KeyError names a transfer the step lacks."""
        try:
            return self._positions[(key, mb)]
        except KeyError:
            raise KeyError(
                f"transfer {key} of microbatch {mb} is not in the step's order ({len(self.transfers)} transfers)"
            ) from None

    @classmethod
    def of_run(cls, run: Sequence[tuple[int, Action]], links_order: Sequence[Transfer] | None = None) -> TransferOrder:
        """From the (stage, action) sequence of a causal run of the step's action lists; its links took
        the transfers in `links_order` (None: as they were sent)."""
        # boundaries by number while counting (one key per (stage, kind, peer, tensor))
        numbers: dict[tuple[int, str, int | None, str], int] = {}
        index: dict[BoundaryKey, int] = {}
        keys: list[BoundaryKey] = []
        in_flight: list[int] = []
        most: list[int] = []
        sent: dict[int, None] = {}  # numbers by their first SEND: the depths' order
        transfers: list[Transfer] = []
        for stage, action in run:
            kind = action.kind
            if kind not in SENDS and kind not in RECVS:
                continue
            name = (stage, kind, action.peer, action.tensor)
            b = numbers.get(name)
            if b is None:
                key = BoundaryKey.of_action(stage, action)
                b = numbers[name] = index.setdefault(key, len(keys))
                if b == len(keys):
                    keys.append(key)
                    in_flight.append(0)
                    most.append(0)
            if kind in SENDS:
                transfers.append((keys[b], action.mb))
                in_flight[b] += 1
                most[b] = max(most[b], in_flight[b])
                sent[b] = None
            else:
                in_flight[b] -= 1
        return cls(tuple(links_order if links_order is not None else transfers), {keys[b]: most[b] + 1 for b in sent})

    def forward_only(self) -> TransferOrder:
        """The order of a pass of forwards only (evaluation): the step's, less its gradients. Still
        causal: a forward transfer depends only on forward transfers."""
        return TransferOrder(
            tuple(t for t in self.transfers if not t[0].grad), {k: d for k, d in self.depth.items() if not k.grad}
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "transfers": [[str(k), mb] for k, mb in self.transfers],
            "depth": {str(k): d for k, d in sorted(self.depth.items())},
        }


Fastest = tuple[TransferOrder, float, PipelineRun]  # an order, its simulated step, the run of that step


def transfer_order(plan: PlanView) -> TransferOrder:
    """The order of `plan` (a meshjob.plan.build.Plan): its links' order in the fastest of the send order's and
    the need orders' list-scheduled runs, on its own cost model."""
    cost = plan_cost(plan)
    return fastest_order(plan.schedules, compute_costs(plan, cost), transfer_costs(plan, cost), cost)[0]


def fastest_order(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel,
    rounds: int = NEED_ORDER_ROUNDS,
    ties: Sequence[str] = TIES,
) -> tuple[TransferOrder, float]:
    """(the order, its simulated step) of the fastest run of `schedules`: the send order's, or one of
    `rounds` need orders' per tie rule of `ties` (arguments as meshjob.simulate.simulator.simulate_pipeline takes
    them)."""
    key = (
        tuple((stage, tuple(actions)) for stage, actions in schedules.items()),
        tuple(compute_s.items()),
        tuple((k, t.seconds, tuple(t.per_link.items()), t.early_s) for k, t in _costs(transfers).items()),
        cost,
        rounds,
        tuple(ties),
    )
    return _FASTEST.get(key, lambda: fastest_run(schedules, compute_s, transfers, cost, rounds, ties)[:2])


# Plans of a search that differ only in strategy or balancer often move the same bytes in the same times: the
# same lists and costs, the same runs.
_FASTEST: Recent[tuple[TransferOrder, float]] = Recent(32)


def _costs(transfers: Mapping[BoundaryKey, TransferInput]) -> dict[BoundaryKey, TransferCost]:
    return {k: TransferCost(*t) for k, t in transfers.items()}  # a plain pair: not paced, as PipelineRun reads it


def fastest_run(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel,
    rounds: int = NEED_ORDER_ROUNDS,
    ties: Sequence[str] = TIES,
) -> Fastest:
    """fastest_order's (order, step), and the PipelineRun of that step, its links planned in that order from
    there on, which a caller may run more steps on (meshjob.simulate.steady.period_on)."""
    sent = _simulate(schedules, compute_s, transfers, cost)
    sent_run = sent.result()
    best: Fastest = (TransferOrder.of_run(sent_run.order), sent_run.step_s, sent)
    if run_work(schedules) <= WORK_BUDGET:
        best = _need_orders(schedules, compute_s, transfers, cost, rounds, ties, best, sent_run)
    if best[2] is sent:  # the run the send order planned gives: each transfer went as it was sent
        sent.plan_links()
    return best


def _need_orders(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel,
    rounds: int,
    ties: Sequence[str],
    best: Fastest,
    sent_run: PipelineResult,
) -> Fastest:
    """fastest_run's need orders, each tried against `best`, the send order's."""
    # each order run once: the two rules agree where nothing ties. A need order that is the send order runs as
    # the send order's run did: each transfer is first on its links when it is sent, and goes at once.
    runs: list[tuple[list[Transfer], PipelineResult]] = [(list(best[0].transfers), sent_run)]
    for rule in ties:
        run = sent_run
        for _ in range(rounds):
            order = need_order(run, rule)
            done = next((r for o, r in runs if o == order), None)  # (lists differ early: cheaper than hashing)
            if done is run:  # the run gives its own order: the rounds after it would repeat it
                break
            if done is not None:
                run = done
                continue
            try:
                planned = _simulate(schedules, compute_s, transfers, cost, order)
            except ValueError:  # a link would wait on a transfer never sent: not an order to run
                break
            run = planned.result()
            runs.append((order, run))
            if run.step_s < best[1] * (1 - TOLERANCE):
                best = (TransferOrder.of_run(run.order, order), run.step_s, planned)
    return best


def _simulate(
    schedules: Mapping[int, Sequence[Action]],
    compute_s: Mapping[tuple[int, str], float],
    transfers: Mapping[BoundaryKey, TransferInput],
    cost: CostModel,
    order: Sequence[Transfer] | None = None,
) -> PipelineRun:
    """simulate_pipeline's run, kept to be run on."""
    run = PipelineRun(compute_s, transfers, cost, planned=order is not None)
    run.extend(schedules, order or ())
    return run


def run_work(schedules: Mapping[int, Sequence[Action]]) -> int:
    """What one simulated run of `schedules` costs: actions x stages (the list scheduler's steps)."""
    return sum(len(a) for a in schedules.values()) * len(schedules)


def need_order(run: PipelineResult, ties: str = TIES[0]) -> list[Transfer]:
    """A run's transfers (a meshjob.simulate.simulator.PipelineResult) by the later of when each was sent and when
    its receiver needed it; ties in the run's send order. A receiver needs every transfer of a run of
    consecutive RECVs when it reaches the first of them: the compute after them takes them all (the
    executor posts receives ahead), while the list-scheduled run reaches each later RECV only once the
    one before it has arrived. Timed by its own RECV, a skip gradient that the U-Transformer's last
    stage sent early queued on stage 0's in-link behind the activation gradient sent after it, and the
    link idled meanwhile.
    `ties` (TIES): "sent", transfers needed at one instant in the run's send order; "used", first the one
    whose receiver starts the compute that takes it first (then in the send order)."""
    if ties not in TIES:
        raise ValueError(f"ties {ties!r} is invalid: one of {', '.join(TIES)}")
    # transfers as (boundary number, mb) while timing them: pairs of ints hash fast
    numbers: dict[tuple[int, str, int | None, str], int] = {}
    index: dict[BoundaryKey, int] = {}
    sent: dict[tuple[int, int], float] = {}
    needed: dict[tuple[int, int], float] = {}
    reached: dict[int, float] = {}  # stage -> when it reached the first RECV of the run it is in
    waiting: dict[int, list[tuple[int, int]]] = {}  # stage -> the transfers of the RECV run it is in
    used: dict[tuple[int, int], float] = {}  # when the compute after the RECV run started
    for (stage, action), at in zip(run.order, run.started_s):
        kind = action.kind
        if kind in RECVS or kind in SENDS:
            name = (stage, kind, action.peer, action.tensor)
            b = numbers.get(name)
            if b is None:
                b = numbers[name] = index.setdefault(BoundaryKey.of_action(stage, action), len(index))
            transfer = (b, action.mb)
            if kind in RECVS:
                waiting.setdefault(stage, []).append(transfer)
                needed[transfer] = reached.setdefault(stage, at)
                continue
        reached.pop(stage, None)
        if stage in waiting:
            for t in waiting.pop(stage):
                used[t] = at
        if kind in SENDS:
            sent[transfer] = at
    # sorted by key, then by the send order (each key ends with the transfer's place in it: no ties)
    listed = list(sent.items())
    if ties == "used":
        keys = [(max(at, needed.get(t, at)), used.get(t, math.inf), i) for i, (t, at) in enumerate(listed)]
    else:
        keys = [(max(at, needed.get(t, at)), math.inf, i) for i, (t, at) in enumerate(listed)]
    boundaries = list(index)  # by number
    return [(boundaries[listed[k[2]][0][0]], listed[k[2]][0][1]) for k in sorted(keys)]


def recv_depths(schedules: Mapping[int, Sequence[Action]], order: TransferOrder) -> dict[int, dict[BoundaryKey, int]]:
    """Per stage, per boundary it receives: how many receives it keeps posted ahead (at most the
    microbatches it receives of that boundary)."""
    out: dict[int, dict[BoundaryKey, int]] = {}
    for stage, actions in schedules.items():
        counts: dict[BoundaryKey, int] = {}
        for a in actions:
            if a.kind.startswith("RECV"):
                key = BoundaryKey.of_action(stage, a)
                counts[key] = counts.get(key, 0) + 1
        out[stage] = {key: min(n, order.depth.get(key, n)) for key, n in counts.items()}
    return out
