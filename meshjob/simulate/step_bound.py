"""A lower bound on a pipeline step: no schedule of the plan's transfers and compute is faster.

Signal (the same schedule with 1-byte transfers) is what a step would take if communication were
free. How close to it a schedule can come depends on the NIC links: a link carries every microbatch's
transfers of the boundaries through it, none of which can leave before the compute that makes its data,
and after the last one lands, the compute that needs it still follows. This module computes that bound
per NIC link and takes the largest:

- Each (boundary, microbatch) through the link is a job: its bytes over the NIC rate (p), the earliest
  time its data can exist (head, r), and the least work that must follow its landing (tail, q).
  A forward from stage s, microbatch m: stage s has done F(0..m), in order, after the first forward
  reached it through the chain of stages (F_0 .. F_s and the chain's activation transfers). A gradient
  from stage a: the last stage's first F, then I back through the chain to a (and its transfers),
  then I_a of microbatches 1..m. After a forward lands at stage d: the rest of its microbatch's chain
  (F_d .. F_{S-1}, every I back to stage 0, W_0, stage 0's optimizer step), and stage d's own F, I, W of
  microbatches m..M-1 and its optimizer step, whichever is longer. After a gradient lands at stage b:
  I_b .. I_0, W_0 and stage 0's optimizer step along the chain, or stage b's I and W of m..M-1 and its
  optimizer step.
- A link moves at most its rate's bytes in any interval (plus one token bucket, `burst_bytes`), and may
  interleave messages freely; so the step is at least the optimum of one machine with release times and
  tails, preemption allowed (1|r_j, pmtn|max C_j + q_j). Jackson's rule (run the released job with the
  longest tail) is optimal for it, and its value equals the largest, over subsets of the jobs, of
  min head + total bytes / rate + min tail (Carlier): the bound of the NICs' bytes with their heads and
  tails, microbatch by microbatch.
A transfer along the chain takes at least its busiest NIC link's bytes over the rate, less the bucket.
Per-message costs, latency, contention between links and the schedule's order only add to every term.
Stages are assumed to run their microbatches in order (every schedule in meshjob.schedule.actions does), and
the plan's edges must include the chain s -> s+1 (pipelines built from layer ranges always do).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshjob.costs.compute import CostModel
from meshjob.network.host_task import Link
from meshjob.network.model import NetworkModel
from meshjob.simulate.simulator import BoundaryView, PlanView, simulate_transfer

Job = tuple[float, float, float]  # (head: earliest start, bytes over the rate, tail: least work after)


@dataclass(frozen=True)
class StepBound:
    step_s: float  # no step of the plan is shorter
    link: Link | None  # the NIC link that bounds it (None: no transfer crosses a NIC)
    transfers: int  # (boundary, microbatch) transfers through that link

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "link": None if self.link is None else f"host {self.link[0]} {self.link[1]}",
            "transfers": self.transfers,
        }


def single_link_bound(jobs: Sequence[Job]) -> float:
    """The least max(finish + tail) over preemptive schedules of `jobs` on one link (Jackson's rule)."""
    pending = sorted(jobs)
    released: list[list[float]] = []  # [-tail, seconds left]
    now, best, i = 0.0, 0.0, 0
    while i < len(pending) or released:
        if not released:
            now = max(now, pending[i][0])
        while i < len(pending) and pending[i][0] <= now:
            head, seconds, tail = pending[i]
            heapq.heappush(released, [-tail, seconds])
            i += 1
        job = released[0]
        next_head = pending[i][0] if i < len(pending) else float("inf")
        run = min(job[1], next_head - now)
        now += run
        job[1] -= run
        if job[1] <= 1e-12:
            heapq.heappop(released)
            best = max(best, now - job[0])
    return best


def nic_bytes(plan: PlanView, boundary: BoundaryView, network: NetworkModel, itemsize: int = 4) -> Mapping[Link, int]:
    """NIC link -> the bytes one microbatch of `boundary` moves through it (its steps on plain links)."""
    return simulate_transfer(
        boundary.steps, plan.placement.host_of, replace(network, burst_bytes=0.0), itemsize
    ).nic_bytes


def step_bound(plan: PlanView, cost: CostModel, optimizer_s: Sequence[float] | None = None) -> StepBound | None:
    """The bound on `plan` under `cost` (each stage's optimizer step `optimizer_s` after its last
    action, default none); None when the plan lacks the chain edges s -> s+1."""
    job = plan.job
    stages, microbatches = len(job.stages), job.training.microbatches
    chain = {e.src for e in job.edges if e.dst == e.src + 1 and e.tensor == "activation"}
    if any(s not in chain for s in range(stages - 1)):
        return None
    c = cost.stage_costs(job)
    f = [c[s].forward_s for s in range(stages)]
    i = [c[s].input_grad_s for s in range(stages)]
    w = [c[s].weight_grad_s for s in range(stages)]
    opt = list(optimizer_s) if optimizer_s is not None else [0.0] * stages
    net = cost.network
    bucket_s = net.burst_bytes / net.nic_bytes_per_s
    itemsize = plan.job.training.activation_itemsize
    through = {b.key: nic_bytes(plan, b, net, itemsize) for b in plan.boundaries}

    def transfer_s(src: int, dst: int, grad: bool) -> float:
        """The chain's activation (or its gradient) between neighbours: at least its busiest link's time."""
        links = next(
            (n for k, n in through.items() if (k.src, k.dst, k.grad, k.tensor) == (src, dst, grad, "activation")), {}
        )
        return max([max(0.0, n / net.nic_bytes_per_s - bucket_s) for n in links.values()] or [0.0])

    forward_done = []  # the earliest F_s(0) can end
    at = 0.0
    for s in range(stages):
        at += f[s] + (transfer_s(s - 1, s, False) if s else 0.0)
        forward_done.append(at)
    input_done = [0.0] * stages  # the earliest I_a(0) can end
    for a in range(stages - 1, -1, -1):
        at += i[a] + (transfer_s(a + 1, a, True) if a < stages - 1 else 0.0)
        input_done[a] = at
    back_to_0 = [
        sum(i[: b + 1]) + sum(transfer_s(k + 1, k, True) for k in range(b)) + w[0] + opt[0] for b in range(stages)
    ]  # after stage b's gradient input lands: I_b .. I_0, W_0
    forward_rest = [
        sum(f[d:]) + sum(transfer_s(k, k + 1, False) for k in range(d, stages - 1)) + back_to_0[-1]
        for d in range(stages)
    ]  # after a forward lands at stage d: F_d .. F_{S-1}, then back to 0

    jobs: dict[Link, list[Job]] = {}
    for key, links in through.items():
        for link, nbytes in links.items():
            seconds = nbytes / net.nic_bytes_per_s
            for m in range(microbatches):
                left = microbatches - m
                if key.grad:
                    head = input_done[key.src] + m * i[key.src]
                    tail = max(back_to_0[key.dst], left * (i[key.dst] + w[key.dst]) + opt[key.dst])
                else:
                    head = forward_done[key.src] + m * f[key.src]
                    tail = max(forward_rest[key.dst], left * (f[key.dst] + i[key.dst] + w[key.dst]) + opt[key.dst])
                jobs.setdefault(link, []).append((head, seconds, tail))
    best = StepBound(0.0, None, 0)
    for link in sorted(jobs):
        step = single_link_bound(jobs[link]) - bucket_s
        if step > best.step_s:
            best = StepBound(step, link, len(jobs[link]))
    return best
