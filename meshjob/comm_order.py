"""The order of a step's transfers, which every rank derives from the plan alone.

Two things the executor needs (meshjob_trainer.engine):
- NCCL matches the point-to-point messages between two ranks of a communicator by the order they
  are issued in, not by tags. The trainer gives each directed pair of ranks its own communicator
  (meshjob_trainer.wire), so a sender must issue its messages to a receiver in the order that
  receiver posts them. Both follow `transfers`, and inside one transfer the sender's program
  order (meshjob.program). gloo matches by tag and would not need it; the trainer keeps the same
  discipline on both, so CPU runs check what GPU runs rely on.
- Receives posted early let senders run ahead (gloo sends only once the receiver has posted), but
  each posted receive holds a buffer: a stage keeps `depth[b]` receives of boundary b posted ahead
  of the one it consumes next, which bounds the memory of in-flight payloads.

`transfers` is the order in which a list-scheduled run of the step (meshjob.simulate.simulate_plan:
the plan's action lists, its compute costs and transfer makespans) issues its SENDs: about the order
in which they happen. It is causal: every transfer comes after the transfers its data depends on.
`depth[b]` is one more than the most transfers of b that this run has in flight at once (sent, not
yet received), so in this run the receive of microbatch m is posted (when m - depth[b] has been
received) before m is sent. Hence issuing in this order cannot deadlock: by induction over the
run, the earliest transfer not yet done has its data, its receiver's buffer, and every message
before it on each pair of ranks it uses. Real timing may differ from the run's; that costs waiting,
never a hang.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from meshjob.boundary import BoundaryKey
from meshjob.schedule import Action

Transfer = tuple[BoundaryKey, int]  # (boundary, microbatch)


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
            raise KeyError(f"transfer {key} of microbatch {mb} is not in the step's order "
                           f"({len(self.transfers)} transfers)") from None

    @classmethod
    def of_run(cls, run: Sequence[tuple[int, Action]]) -> TransferOrder:
        """From the (stage, action) sequence of a causal run of the step's action lists."""
        transfers: list[Transfer] = []
        in_flight: dict[BoundaryKey, int] = {}
        depth: dict[BoundaryKey, int] = {}
        for stage, action in run:
            if not action.is_comm:
                continue
            key = BoundaryKey.of_action(stage, action)
            if action.kind.startswith("SEND"):
                transfers.append((key, action.mb))
                in_flight[key] = in_flight.get(key, 0) + 1
                depth[key] = max(depth.get(key, 0), in_flight[key])
            else:
                in_flight[key] = in_flight.get(key, 0) - 1
        return cls(tuple(transfers), {key: most + 1 for key, most in depth.items()})

    def forward_only(self) -> TransferOrder:
        """The order of a pass of forwards only (evaluation): the step's, less its gradients. Still
        causal: a forward transfer depends only on forward transfers."""
        return TransferOrder(tuple(t for t in self.transfers if not t[0].grad),
                             {k: d for k, d in self.depth.items() if not k.grad})

    def to_json(self) -> dict[str, Any]:
        return {"transfers": [[str(k), mb] for k, mb in self.transfers],
                "depth": {str(k): d for k, d in sorted(self.depth.items())}}


def transfer_order(plan: Any) -> TransferOrder:
    """The order of `plan` (a meshjob.plan.Plan): its list-scheduled step on its own cost model."""
    from meshjob.simulate import plan_cost, simulate_plan

    return TransferOrder.of_run(simulate_plan(plan, plan_cost(plan), follow_plan_order=False).order)


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
