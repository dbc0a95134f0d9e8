"""Items run in the order they become ready: the list scheduling of one transfer's messages that the
simulator (meshjob.simulate.simulator.simulate_transfer) and the network model's all-gather costs
(meshjob.network.model) both do, so the two time a task alike."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


def in_ready_order(after: Sequence[Sequence[int]], book: Callable[[int, float], float]) -> dict[int, float]:
    """Item i (0 .. len(after) - 1) becomes ready when every item in after[i] has finished (an index
    outside the items never does); items are booked in the order they become ready, ties in index
    order: book(i, ready_s) returns when item i finishes. Returns each booked item's finish time, in
    booking order; an item missing from it waited on one that never ran (a cycle or a missing item)."""
    waiting = [len(a) for a in after]
    dependents: dict[int, list[int]] = {}
    for i, a in enumerate(after):
        for d in a:
            dependents.setdefault(d, []).append(i)
    ready = [(0.0, i) for i, a in enumerate(after) if not a]
    heapq.heapify(ready)
    finish: dict[int, float] = {}
    while ready:
        at, i = heapq.heappop(ready)
        finish[i] = book(i, at)
        for j in dependents.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (max(finish[d] for d in after[j]), j))
    return finish
