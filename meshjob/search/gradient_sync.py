"""The end of a step after the pipeline: each stage's data-parallel gradient all-reduce, then its optimizer step.

A stage starts its tail when its last action ends. A ring all-reduce across hosts moves 2 (n - 1) / n of the
gradient bytes through each of its hosts' NICs, one ring per device of the stage on each host; alone, the
stage's rings share its hosts' NICs among themselves (GradientSync.nic_s). Stages whose rings cross the same
host share its NIC while both run (the examples' two 2x1 data-parallel stages sit on the same two hosts; giving
each stage the NICs alone under-predicts their steps measured by `meshjob bench tune`, bench/results/tune.json).
Sharing is fluid: every ring through a host gets an equal part of its NIC, and a stage's rings progress at the
part their busiest host leaves them. The rest of the tail (the rings' per-message latency, rings inside one
host, the optimizer step) is not shared and follows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from meshjob.plan.placement import Placement


@dataclass(frozen=True)
class GradientSync:
    """One stage's tail: `nic_s` seconds of its rings on its hosts' NICs when no other stage uses them
    (`flows` rings through each host), then `fixed_s` seconds of work nothing else slows."""

    nic_s: float
    flows: int
    fixed_s: float

    @property
    def alone_s(self) -> float:
        return self.nic_s + self.fixed_s


def tail_ends(starts: Sequence[float], syncs: Sequence[GradientSync], hosts: Sequence[Collection[int]]) -> list[float]:
    """When each stage's tail ends: stage i starts at starts[i] and its NIC part crosses hosts[i]."""
    n = len(syncs)
    left = [s.nic_s if s.flows > 0 and hosts[i] else 0.0 for i, s in enumerate(syncs)]
    nic_end = [starts[i] if left[i] <= 0 else None for i in range(n)]
    t = min(starts, default=0.0)
    while any(e is None for e in nic_end):
        active = [i for i in range(n) if nic_end[i] is None and starts[i] <= t]
        waiting = [starts[i] for i in range(n) if nic_end[i] is None and starts[i] > t]
        if not active:
            t = min(waiting)
            continue
        load: Counter[int] = Counter()  # rings through each host's NIC
        for i in active:
            load.update({h: syncs[i].flows for h in hosts[i]})
        speed = {i: syncs[i].flows / max(load[h] for h in hosts[i]) for i in active}
        first = min(active, key=lambda i: (left[i] / speed[i], i))
        finish = left[first] / speed[first]
        dt = min([finish] + [w - t for w in waiting])
        for i in active:
            left[i] -= speed[i] * dt
        if dt == finish:
            left[first] = 0.0
        t += dt
        for i in active:
            if left[i] <= 1e-12 * max(1.0, syncs[i].nic_s):
                nic_end[i] = t
    ends = [e for e in nic_end if e is not None]  # the loop ran until every stage's NIC part ended
    return [e + s.fixed_s for e, s in zip(ends, syncs)]


def stage_hosts(placement: Placement) -> list[frozenset[int]]:
    """The hosts each stage's devices are on (placement: meshjob.plan.placement.Placement)."""
    return [frozenset(placement.host_of(r) for r in placement.stage_ranks(k)) for k in range(placement.num_stages)]
