"""torch 2.13's pipeline schedules' compute orders, generated as its classes generate them (ported, no torch).

One function per schedule class of torch.distributed.pipelining: (ranks, microbatches) -> each rank's compute
actions as (stage, kind, microbatch) in the order torch's runtime runs them ("F", "B", "I", "W"; an overlapped
F and B as its two parts; torch's idle slots left out: they order nothing). tests/test_peers.py checks every one
against torch's own class. GPipe and 1F1B are meshjob's generators' orders, which is what torch's runtime runs
(torch 2.13's Schedule1F1B._get_pipeline_order, only used for display, is off by one on the last rank).
"""

from __future__ import annotations

from collections.abc import Callable

from meshjob.schedule.actions import compute_order

Cell = tuple[int, str, int]
Rows = dict[int, list[Cell]]


def _of_kind(kind: str) -> Callable[[int, int], Rows]:
    def rows(ranks: int, microbatches: int) -> Rows:
        return {r: [(r, k, mb) for k, mb in compute_order(kind, r, ranks, microbatches)] for r in range(ranks)}

    return rows


gpipe = _of_kind("gpipe")
one_f_one_b = _of_kind("1f1b")


def looped_bfs(ranks: int, microbatches: int) -> Rows:
    """ScheduleLoopedBFS: every microbatch's forward through a rank's stages in turn, then backwards in reverse."""
    out: Rows = {}
    for rank in range(ranks):
        stages = list(range(rank, 2 * ranks, ranks))
        cells = [(s, "F", mb) for s in stages for mb in range(microbatches)]
        cells += [(s, "B", mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        out[rank] = cells
    return out


def _warmup_ops(rank: int, local: int, per_round: int, ranks: int, microbatches: int, factor: int) -> int:
    return min((local - 1) * per_round + factor * (ranks - 1 - rank), microbatches * local)


def _interleaved(ranks: int, microbatches: int, zero_bubble: bool) -> Rows:
    """torch's _get_1f1b_rank_ops over two looped stages per rank: Interleaved1F1B, or InterleavedZeroBubble."""
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ValueError(f"{microbatches} microbatches are not a multiple of the {rounds} rounds torch needs")
    return {
        rank: _interleaved_rank(rank, ranks, microbatches, microbatches // rounds, zero_bubble) for rank in range(ranks)
    }


def _interleaved_rank(rank: int, ranks: int, microbatches: int, per_round: int, zero_bubble: bool) -> list[Cell]:
    local = 2
    warmup = _warmup_ops(rank, local, per_round, ranks, microbatches, 1 if zero_bubble else 2)
    total = local * microbatches

    def fwd_stage(op: int) -> int:
        return ((op // per_round) % local) * ranks + rank

    def bwd_stage(op: int) -> int:
        return (local - 1 - ((op - warmup) // per_round) % local) * ranks + rank

    counts: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Cell:
        mb = counts.get((kind, stage), 0)
        counts[(kind, stage)] = mb + 1
        return (stage, kind, mb)

    cells: list[Cell] = []
    backward_ops: list[int] = []
    weights = 0
    backward = "I" if zero_bubble else "B"
    for op in range(total + warmup):  # warm-up (F), steady (F then B), cool-down (B): warm-up long
        if op < total:
            cells.append(take("F", fwd_stage(op)))
        if op < warmup:
            continue
        cells.append(take(backward, bwd_stage(op)))
        backward_ops.append(op)
        if zero_bubble and op - warmup >= rank:  # torch: num_1f1b_microbatches = rank
            cells.append(take("W", bwd_stage(backward_ops[weights])))
            weights += 1
    while zero_bubble and weights < len(backward_ops):
        cells.append(take("W", bwd_stage(backward_ops[weights])))
        weights += 1
    return cells


def interleaved_1f1b(ranks: int, microbatches: int) -> Rows:
    return _interleaved(ranks, microbatches, zero_bubble=False)


def interleaved_zero_bubble(ranks: int, microbatches: int) -> Rows:
    return _interleaved(ranks, microbatches, zero_bubble=True)


def zbv_zero_bubble(ranks: int, microbatches: int) -> Rows:
    """ScheduleZBVZeroBubble: rank r holds stages r and 2R - 1 - r; microbatches past M are torch's padding."""
    out: Rows = {}
    n_micro = max(2 * ranks - 1, microbatches)
    for rank in range(ranks):
        chunk0, chunk1 = rank, 2 * ranks - 1 - rank
        cells: list[Cell] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (ranks - rank) - 1):
            cells.append((chunk0, "F", f0))
            f0 += 1
        for _ in range(rank):
            cells += [(chunk1, "F", f1), (chunk0, "F", f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(ranks - rank):
            cells += [(chunk1, "F", f1), (chunk1, "I", b1), (chunk1, "W", b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                cells.append((chunk0, "F", f0))
                f0 += 1
            cells += [(chunk0, "I", b0), (chunk0, "W", b0), (chunk1, "F", f1), (chunk1, "I", b1), (chunk1, "W", b1)]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(rank):
            cells += [(chunk0, "I", b0), (chunk1, "I", b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(ranks - rank):
            cells += [(chunk0, "I", b0), (chunk0, "W", w0)]
            b0, w0 = b0 + 1, w0 + 1
        cells += [(chunk1, "W", w) for w in range(w1, b1)]
        cells += [(chunk0, "W", w) for w in range(w0, b0)]
        out[rank] = [c for c in cells if c[2] < microbatches]
    return out


def dual_pipe_v(ranks: int, microbatches: int) -> Rows:
    """ScheduleDualPipeV: V placement, overlapped F and full B in the middle, I/W split at the ends."""
    if microbatches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages: {microbatches} < {2 * ranks}")
    return {rank: _dual_pipe_v_rank(rank, ranks, microbatches) for rank in range(ranks)}


def _dual_pipe_v_rank(rank: int, ranks: int, microbatches: int) -> list[Cell]:
    s0, s1 = rank, 2 * ranks - 1 - rank
    counts: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []
    cells: list[Cell] = []

    def act(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = counts.get(key, 0)
        cells.append((stage, kind, mb))
        if kind == "B":  # a full backward counts as its I and its W
            counts[(stage, "I")] = mb + 1
            counts[(stage, "W")] = counts.get((stage, "W"), 0) + 1
            return
        if kind == "I":
            weights.append((stage, mb))
        counts[key] = mb + 1

    def overlap(forward: int, backward: int) -> None:
        act(forward, "F")
        act(backward, "B")

    def pending_weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            cells.append((stage, "W", mb))
            counts[(stage, "W")] = counts.get((stage, "W"), 0) + 1

    for _ in range((ranks - rank - 1) * 2):
        act(s0, "F")
    for _ in range(rank + 1):
        act(s0, "F")
        act(s1, "F")
    for _ in range(ranks - rank - 1):
        act(s1, "I")
        pending_weight()
        act(s1, "F")
    for _ in range(microbatches - ranks * 2 + rank + 1):
        overlap(s0, s1)  # torch's first step of the last rank runs the same two actions, not overlapped
        overlap(s1, s0)
    for _ in range(ranks - rank - 1):
        act(s1, "B")
        overlap(s1, s0)
    steps, split = rank + 1, False
    for i in range(steps):
        split = split or (i == steps // 2 and rank % 2 == 1)
        act(s1, "I" if split else "B")
        split = split or (i == steps // 2 and rank % 2 == 0)
        act(s0, "I" if split else "B")
    for _ in range(ranks - rank - 1):
        pending_weight()
        act(s0, "I" if split else "B")
    for _ in range(rank + 1):
        pending_weight()
    return cells
