"""Step-level balancing: transfers that can be in flight together are balanced as one problem.

A window is a set of boundaries (tensor x direction between two stages) whose transfers can share
the network at the same time. Their unit tasks are balanced jointly, so the per-link loads of one
boundary are seen by the others (Alpa keeps per-device send loads across all transfers). Without it,
an activation and a skip tensor between the same stage pair each pick the same "best" sender host
and then collide on its out-link.

Windows follow the schedule kind:
- `1f1b`, `eager-1f1b`: one window, the whole step. In the steady phase every stage sends the
  activations of microbatch m + k while the gradients of microbatch m cross the same stage pair,
  and all stage pairs do so at once; eager-1F1B widens exactly this overlap.
- `gpipe`: two windows, every forward boundary, then every backward one: no backward starts before
  the last forward, so forward and backward transfers never share a link.

The joint schedule fixes every task's sender host and the order on each link. Transfers of different
boundaries start when their SEND actions run, so the joint start times are not enforceable; each
boundary therefore keeps its share (senders, order), timed alone by list scheduling: the makespan
of one microbatch's transfer, what the weight-gradient delay and the simulator use. (The all-gather
strategies' boundaries are timed by their lowered steps instead, message by message: the rings of their
tasks interleave where list scheduling holds each task's links from its first message to its last,
meshjob.plan.build's Boundary.timed_s; a window's joint makespan then times all its members' steps together.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshjob.network.host_task import HostTask
from meshjob.network.model import NetworkModel
from meshjob.resharding import balance as bal

STEP, FORWARD, BACKWARD = "step", "forward", "backward"


@dataclass(frozen=True)
class Window:
    name: str  # STEP, or FORWARD / BACKWARD (gpipe)
    boundaries: tuple[int, ...]  # indices into the plan's boundaries
    schedule: bal.Schedule  # over the boundaries' tasks, concatenated in `boundaries` order
    offsets: tuple[int, ...]  # index of each boundary's first task in the joint task list
    # The all-gather strategies: every member's lowered steps timed together, message by message
    # (meshjob.plan.build.timed_together); None: the joint schedule's makespan.
    timed_s: float | None = None

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan_s if self.timed_s is None else self.timed_s

    @property
    def lower_bound_s(self) -> float:
        return self.schedule.lower_bound_s

    def to_json(self) -> dict[str, object]:
        s = self.schedule
        return {
            "name": self.name,
            "boundaries": list(self.boundaries),
            "tasks": len(s.sender_host),
            "makespan_s": self.makespan_s,
            "lower_bound_s": s.lower_bound_s,
            "ratio": self.makespan_s / s.lower_bound_s if s.lower_bound_s > 0 else None,
            "balancer": s.balancer,
            "finished": s.finished,
        }


def window_groups(forwards_first: bool, backward: Sequence[bool]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, boundary indices) of each window, given which boundaries carry gradients. A schedule that
    runs every forward first (GPipe) never has forward and backward transfers in flight together."""
    if forwards_first:
        groups = [
            (FORWARD, tuple(i for i, b in enumerate(backward) if not b)),
            (BACKWARD, tuple(i for i, b in enumerate(backward) if b)),
        ]
        return [(name, members) for name, members in groups if members]
    return [(STEP, tuple(range(len(backward))))] if backward else []


def with_shares(tasks: Sequence[HostTask]) -> list[HostTask]:
    """Each task with `share`: how many of `tasks` its busiest receiving host's in-link must take,
    and `cpu_share`: all of them, for the cores every host shares on an emulated cluster."""
    incoming: dict[int, int] = {}
    for t in tasks:
        for h in set(t.receiver_hosts) - set(t.sender_hosts):
            incoming[h] = incoming.get(h, 0) + 1
    return [
        replace(t, share=max([1] + [incoming.get(h, 0) for h in t.receiver_hosts]), cpu_share=len(tasks)) for t in tasks
    ]


def balance_window(
    name: str,
    members: Sequence[int],
    tasks: Sequence[Sequence[HostTask]],
    balancer: str,
    strategy: str,
    network: NetworkModel,
    chunks: int | str,
    budget_s: float,
    seed: int,
) -> tuple[Window, dict[int, bal.Schedule]]:
    """The joint schedule of the member boundaries' tasks, and each member's share timed alone.
    Each task's chunks (auto) count the window's tasks queued on its busiest receiving link."""
    joint_tasks: list[HostTask] = []
    offsets: list[int] = []
    for b in members:
        offsets.append(len(joint_tasks))
        joint_tasks += tasks[b]
    joint_tasks = with_shares(joint_tasks)
    joint = bal.balance(joint_tasks, balancer, strategy, network, chunks, budget_s=budget_s, seed=seed)
    order = joint.order
    shares: dict[int, bal.Schedule] = {}
    for b, first in zip(members, offsets):
        n = len(tasks[b])
        local_order = [i - first for i in order if first <= i < first + n]
        senders = joint.sender_host[first : first + n]
        shares[b] = bal.list_schedule(
            joint_tasks[first : first + n], senders, local_order, strategy, network, chunks, balancer
        )
    return Window(name, tuple(members), joint, tuple(offsets)), shares


def separately_balanced(
    window: Window,
    tasks: Sequence[Sequence[HostTask]],
    balancer: str,
    strategy: str,
    network: NetworkModel,
    chunks: int | str,
    budget_s: float,
    seed: int,
) -> bal.Schedule:
    """The ablation: each boundary of the window balanced alone (the old per-boundary planning),
    then all of them run together (list scheduling in each one's own order, interleaved by start)."""
    joint_tasks: list[HostTask] = []
    senders: list[int] = []
    keys: list[tuple[float, int, int, int]] = []
    for b in window.boundaries:
        mine = with_shares(tasks[b])  # all that planning one boundary at a time knows
        alone = bal.balance(mine, balancer, strategy, network, chunks, budget_s=budget_s, seed=seed)
        first = len(joint_tasks)
        joint_tasks += mine
        senders += alone.sender_host
        latest = 0.0  # merge by start time, keeping each boundary's own order
        for j, i in enumerate(alone.order):
            latest = max(latest, alone.start_s[i])
            keys.append((latest, b, j, first + i))
    order = [k[-1] for k in sorted(keys)]
    return bal.list_schedule(joint_tasks, senders, order, strategy, network, chunks, f"{balancer} per boundary")
