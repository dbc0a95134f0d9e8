"""Pipeline schedules as data: an action IR per stage, generators and a validator.

A schedule maps each stage to the ordered list of actions it executes:
  F<mb> / B<mb>        forward / full backward of microbatch mb
  I<mb> / W<mb>        split backward: input gradient (triggers SEND_B), then weight gradient
  SEND_F / RECV_F      an activation (or skip tensor) crossing an edge, forward direction
  SEND_B / RECV_B      its gradient, backward direction
Communication actions carry the peer stage and the edge's tensor: "SEND_F3@2", "RECV_B3@1:skip0".

Edges form a DAG over stages (src < dst): the chain plus skip connections that cross several
stages. Sends are buffered (an executor posts them as isend), so only a RECV can block; the
validator's global simulation uses exactly that rule.

Generators: `gpipe` (all forwards, then all backwards), `1f1b` (stage i warms up with
min(M, S-i) forwards, then alternates B, F) and `eager-1f1b` (min(M, 2(S-i)-1) warm-up forwards,
§4 of "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022):
more microbatches in flight so that communication of one overlaps computation of the next).
With split_backward, B becomes I then W, and weight_delay[stage] W's may wait behind later I's ("backward weight
delaying"), the rest drain at the end.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
DEFAULT_TENSOR = "activation"

Edge = tuple[int, int, str]  # (src stage, dst stage, tensor name)

_ACTION_RE = re.compile(
    r"^(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(?P<mb>\d+)"
    r"(?:@(?P<peer>\d+)(?::(?P<tensor>[A-Za-z0-9_.\-]+))?)?$"
)


class ScheduleError(ValueError):
    """A schedule breaks a dependency; the message names the stage and the action."""


@dataclass(frozen=True)
class Action:
    kind: str
    mb: int
    peer: int | None = None
    tensor: str = DEFAULT_TENSOR

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.mb < 0:
            raise ValueError(f"action microbatch {self.mb} must be >= 0")
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ValueError(f"action {self.kind}: a peer stage is required exactly for SEND/RECV")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        return self.text

    @functools.cached_property
    def text(self) -> str:
        """str(action), kept: the simulator writes it for every compute action of every run."""
        text = f"{self.kind}{self.mb}"
        if self.peer is not None:
            text += f"@{self.peer}"
            if self.tensor != DEFAULT_TENSOR:
                text += f":{self.tensor}"
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"action {text!r} is invalid: expected F3, B3, I3, W3 or "
                "SEND_F3@2 / RECV_B3@1:skip0 (kind, microbatch, @peer stage, :tensor)"
            )
        peer = match["peer"]
        return cls(
            kind=match["kind"],
            mb=int(match["mb"]),
            peer=None if peer is None else int(peer),
            tensor=match["tensor"] or DEFAULT_TENSOR,
        )


@functools.lru_cache(maxsize=1 << 16)
def shared_action(kind: str, mb: int, peer: int | None = None, tensor: str = DEFAULT_TENSOR) -> Action:
    """Action(kind, mb, peer, tensor), one object per value: schedules are generated and repeated for every
    simulated candidate, and a kept action is cheaper than a checked new one (and keeps its text)."""
    return Action(kind, mb, peer, tensor)


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule generator: how many forwards each stage runs before its first backward."""

    name: str
    warmup: Callable[[int, int, int], int]  # (stage, num_stages, microbatches) -> forwards first
    forwards_first: bool = False  # every forward before any backward: forward and backward transfers never meet


# The registry: GPipe, 1F1B, and the paper's eager-1F1B (stage i warms up with 2(S-i)-1 forwards).
SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind("gpipe", lambda stage, stages, m: m, forwards_first=True),
        ScheduleKind("1f1b", lambda stage, stages, m: min(m, stages - stage)),
        ScheduleKind("eager-1f1b", lambda stage, stages, m: min(m, 2 * (stages - stage) - 1)),
    )
}


def schedule_kind(name: str) -> ScheduleKind:
    """The schedule kind called `name`; any other name is a ScheduleError that lists the registry."""
    found = SCHEDULE_KINDS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ScheduleError(f"schedule kind {name!r} is not one of {', '.join(SCHEDULE_KINDS)}")
    return found


def warmup_forwards(kind: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Forwards stage `stage` (0-based) runs before its first backward."""
    return schedule_kind(kind).warmup(stage, num_stages, microbatches)


def compute_order(
    kind: str, stage: int, num_stages: int, microbatches: int, warmup: int | None = None
) -> list[tuple[str, int]]:
    """The F/B sequence of one stage: warm-up forwards (`warmup`, default the kind's), then alternate
    B, F; then the last B's."""
    if warmup is None:
        warmup = warmup_forwards(kind, stage, num_stages, microbatches)
    elif not 1 <= warmup <= microbatches:
        raise ScheduleError(f"warm-up forwards of stage {stage}: {warmup} is invalid: 1 to {microbatches}")
    order = [("F", mb) for mb in range(warmup)]
    next_f = warmup
    for mb in range(microbatches):
        order.append(("B", mb))
        if next_f < microbatches:
            order.append(("F", next_f))
            next_f += 1
    return order


def _check_edges(edges: Iterable[Edge], num_stages: int) -> list[Edge]:
    checked: list[Edge] = []
    for src, dst, tensor in edges:
        if not (0 <= src < dst < num_stages):
            raise ScheduleError(f"edge ({src}, {dst}, {tensor!r}) is invalid: need 0 <= src < dst < {num_stages}")
        if (src, dst, tensor) in checked:
            raise ScheduleError(f"edge ({src}, {dst}, {tensor!r}) is listed twice")
        checked.append((src, dst, tensor))
    return sorted(checked)


def _recvs_f(stage: int, mb: int, edges: Sequence[Edge]) -> list[Action]:
    return [shared_action("RECV_F", mb, s, t) for s, d, t in edges if d == stage]


def _sends_f(stage: int, mb: int, edges: Sequence[Edge]) -> list[Action]:
    return [shared_action("SEND_F", mb, d, t) for s, d, t in edges if s == stage]


def _recvs_b(stage: int, mb: int, edges: Sequence[Edge]) -> list[Action]:
    return [shared_action("RECV_B", mb, d, t) for s, d, t in edges if s == stage]


def _sends_b(stage: int, mb: int, edges: Sequence[Edge]) -> list[Action]:
    return [shared_action("SEND_B", mb, s, t) for s, d, t in edges if d == stage]


def generate(
    kind: str,
    num_stages: int,
    microbatches: int,
    edges: Iterable[Edge],
    split_backward: bool = False,
    weight_delay: Mapping[int, int] | None = None,
    warmups: Mapping[int, int] | None = None,
) -> dict[int, list[Action]]:
    """Every stage's action list: RECVs right before the compute that needs them, SENDs right
    after the compute that produces them. weight_delay only applies with split_backward. `warmups`:
    per stage, forwards before its first backward where not the kind's (a schedule between 1F1B's and
    GPipe's; validate checks that it cannot deadlock)."""
    if num_stages < 1 or microbatches < 1:
        raise ScheduleError(f"need at least 1 stage and 1 microbatch, got {num_stages}, {microbatches}")
    edge_list = _check_edges(edges, num_stages)
    delays = dict(weight_delay or {})
    for stage, delay in delays.items():
        if delay < 0:
            raise ScheduleError(f"weight_delay[{stage}] = {delay} must be >= 0")
    warm = dict(warmups or {})
    return {
        stage: stage_actions(
            kind, stage, num_stages, microbatches, edge_list, split_backward, delays.get(stage, 0), warm.get(stage)
        )
        for stage in range(num_stages)
    }


def stage_actions(
    kind: str,
    stage: int,
    num_stages: int,
    microbatches: int,
    edges: Sequence[Edge],
    split_backward: bool,
    delay: int,
    warmup: int | None = None,
) -> list[Action]:
    """One stage's action list (edges already checked and sorted; `warmup` as compute_order takes it)."""
    actions: list[Action] = []
    pending_w: list[int] = []  # microbatches whose W waits behind later I's
    ins = [(s, t) for s, d, t in edges if d == stage]  # as _recvs_f and _sends_b list them
    outs = [(d, t) for s, d, t in edges if s == stage]  # as _sends_f and _recvs_b list them
    backward = "I" if split_backward else "B"
    for compute, mb in compute_order(kind, stage, num_stages, microbatches, warmup):
        if compute == "F":
            actions += [shared_action("RECV_F", mb, s, t) for s, t in ins]
            actions.append(shared_action("F", mb))
            actions += [shared_action("SEND_F", mb, d, t) for d, t in outs]
            continue
        actions += [shared_action("RECV_B", mb, d, t) for d, t in outs]
        actions.append(shared_action(backward, mb))
        actions += [shared_action("SEND_B", mb, s, t) for s, t in ins]
        if split_backward:
            pending_w.append(mb)
            while len(pending_w) > delay:
                actions.append(shared_action("W", pending_w.pop(0)))
    actions += [shared_action("W", mb) for mb in pending_w]  # drain the delayed weight gradients
    return actions


def stash_bound(num_stages: int, microbatches: int) -> int:
    """Eager-1F1B's stage-0 peak, min(M, 2S - 1): the most any stage may stash when W's are delayed."""
    return min(microbatches, 2 * num_stages - 1)


def max_delay_within(
    kind: str, stage: int, num_stages: int, microbatches: int, edges: Iterable[Edge], bound: int
) -> int:
    """The largest weight delay that keeps the stage's peak stash at or below `bound` (or at its
    undelayed peak, when that is higher already). The peak grows with the delay: binary search."""
    return _max_delay_within(kind, stage, num_stages, microbatches, tuple(_check_edges(edges, num_stages)), bound)


@functools.cache
def _max_delay_within(
    kind: str, stage: int, num_stages: int, microbatches: int, edge_list: tuple[Edge, ...], bound: int
) -> int:
    # the plans of a search's candidates with one stage count, microbatch count and schedule ask the same
    def peak(delay: int) -> int:
        return peak_stashed_stage(stage_actions(kind, stage, num_stages, microbatches, edge_list, True, delay))

    limit = max(bound, peak(0))
    lo, hi = 0, max(0, microbatches - 1)  # peak(lo) <= limit always; find the last such delay
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def weight_delay_for(comm_s: float, w_compute_s: float, cap: int) -> int:
    """Backward weight delaying, minimal (Zhuang et al., 2022, §4): postpone just enough W's
    that their compute covers the backward communication, ceil(comm / w), and never more than cap."""
    if comm_s <= 0:
        return 0
    if w_compute_s <= 0:
        return max(cap, 0)
    return max(0, min(cap, math.ceil(comm_s / w_compute_s)))


def peak_stashed_stage(actions: Sequence[Action]) -> int:
    """Most microbatches forwarded but not yet fully backwarded (activations kept alive)."""
    live, peak = 0, 0
    done_kind = "W" if any(a.kind == "I" for a in actions) else "B"
    for action in actions:
        if action.kind == "F":
            live += 1
            peak = max(peak, live)
        elif action.kind == done_kind:
            live -= 1
    return peak


def peak_stashed(schedules: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    return {stage: peak_stashed_stage(actions) for stage, actions in schedules.items()}


def _expected_actions(stage: int, microbatches: int, edges: Sequence[Edge], split_backward: bool) -> set[Action]:
    expected: set[Action] = set()
    for mb in range(microbatches):
        kinds = ("F", "I", "W") if split_backward else ("F", "B")
        expected |= {shared_action(k, mb) for k in kinds}
        expected |= set(_recvs_f(stage, mb, edges) + _sends_f(stage, mb, edges))
        expected |= set(_recvs_b(stage, mb, edges) + _sends_b(stage, mb, edges))
    return expected


def _check_stage(stage: int, actions: Sequence[Action], microbatches: int, edges: Sequence[Edge], split: bool) -> None:
    """Each action exactly once, and local order: RECV < compute < SEND, F < B/I < W."""
    expected = _expected_actions(stage, microbatches, edges, split)
    position: dict[Action, int] = {}
    for index, action in enumerate(actions):
        if action in position:
            raise ScheduleError(
                f"stage {stage}: action {action} appears twice (positions {position[action]} and {index})"
            )
        if action not in expected:
            why = "the edges and microbatches do not call for it"
            if action.kind == "B" and split:
                why = "the backward is split into I and W"
            elif action.kind in ("I", "W") and not split:
                why = "the backward is not split (use B)"
            raise ScheduleError(f"stage {stage}: unexpected action {action} at position {index}: {why}")
        position[action] = index
    missing = sorted(expected - position.keys(), key=lambda a: (a.mb, KINDS.index(a.kind), str(a)))
    if missing:
        raise ScheduleError(f"stage {stage}: action {missing[0]} is missing")
    backward = "I" if split else "B"

    def require_before(first: Action, then: Action) -> None:
        if position[first] > position[then]:
            raise ScheduleError(
                f"stage {stage}: action {then} at position {position[then]} comes before "
                f"{first} (position {position[first]}), which it depends on"
            )

    for mb in range(microbatches):
        f, b = shared_action("F", mb), shared_action(backward, mb)
        require_before(f, b)
        if split:
            require_before(b, shared_action("W", mb))
        for recv in _recvs_f(stage, mb, edges):
            require_before(recv, f)
        for send in _sends_f(stage, mb, edges):
            require_before(f, send)
        for recv in _recvs_b(stage, mb, edges):
            require_before(recv, b)
        for send in _sends_b(stage, mb, edges):
            require_before(b, send)


def _matching_send(stage: int, recv: Action) -> tuple[int, Action]:
    kind = "SEND_F" if recv.kind == "RECV_F" else "SEND_B"
    assert recv.peer is not None
    return recv.peer, shared_action(kind, recv.mb, stage, recv.tensor)


def _simulate(schedules: Mapping[int, Sequence[Action]]) -> None:
    """Each stage runs its list in order; a RECV waits until the peer's SEND has run."""
    cursor = {stage: 0 for stage in schedules}
    sent: set[tuple[int, Action]] = set()
    progress = True
    while progress:
        progress = False
        for stage, actions in schedules.items():
            while cursor[stage] < len(actions):
                action = actions[cursor[stage]]
                if action.kind.startswith("RECV") and _matching_send(stage, action) not in sent:
                    break
                if action.kind.startswith("SEND"):
                    sent.add((stage, action))
                cursor[stage] += 1
                progress = True
    blocked = [(s, schedules[s][c]) for s, c in cursor.items() if c < len(schedules[s])]
    if blocked:
        waits = "; ".join(
            f"stage {s} waits at {a} (position {cursor[s]}) for stage {a.peer}'s {_matching_send(s, a)[1]}"
            for s, a in blocked
        )
        stage, action = blocked[0]
        raise ScheduleError(f"deadlock: stage {stage}: action {action} never completes: {waits}")


def validate(
    schedules: Mapping[int, Sequence[Action]],
    edges: Iterable[Edge],
    microbatches: int,
    split_backward: bool,
) -> None:
    """Raise ScheduleError (naming the stage and the action) unless every stage runs each of
    its computations and transfers exactly once, in dependency order, and all stages together
    finish without deadlock."""
    lists = tuple((stage, tuple(actions)) for stage, actions in schedules.items())
    _validate(lists, tuple(edges), microbatches, split_backward)


@functools.lru_cache(maxsize=64)
def _validate(
    lists: tuple[tuple[int, tuple[Action, ...]], ...], edges: tuple[Edge, ...], microbatches: int, split_backward: bool
) -> None:
    # a search's plans with one stage count, microbatch count and schedule have the same lists: checked once
    schedules = dict(lists)
    num_stages = len(schedules)
    if sorted(schedules) != list(range(num_stages)):
        raise ScheduleError(f"schedules must cover stages 0..{num_stages - 1}, got {sorted(schedules)}")
    edge_list = _check_edges(edges, num_stages)
    for stage in range(num_stages):
        _check_stage(stage, schedules[stage], microbatches, edge_list, split_backward)
    _simulate(schedules)
