"""torch.distributed.pipelining's schedules as data: which stages each rank holds, and their action lists.

The registry names torch's schedule classes (torch 2.13) with what the plan layer needs to know of each
without importing torch: how many stages a rank holds and where they sit (looped: rank r holds r, r + R, ...;
V: r and 2R - 1 - r), whether the backward is split into I and W, and each rank's compute order as torch's class
generates it (meshjob.schedule.torch_orders, checked against torch's classes by the tests). The trainer builds
the class of the same name (meshjob_trainer.torch_peer); the simulator runs the orders (meshjob.simulate.torch_peers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshjob.schedule import torch_orders
from meshjob.schedule.actions import ScheduleError


def _looped(rank: int, ranks: int, per_rank: int) -> tuple[int, ...]:
    return tuple(rank + ranks * i for i in range(per_rank))


def _v_shape(rank: int, ranks: int, per_rank: int) -> tuple[int, ...]:
    return (rank, 2 * ranks - 1 - rank)


@dataclass(frozen=True)
class TorchSchedule:
    """One schedule class of torch.distributed.pipelining, as the benchmark and the simulator see it."""

    name: str  # torch's class name (meshjob_trainer.torch_peer builds this class)
    stages_per_rank: int
    split_backward: bool  # the schedule runs I and W (zero bubble) instead of B
    orders: Callable[[int, int], torch_orders.Rows]  # (ranks, microbatches) -> each rank's compute order
    placement: Callable[[int, int, int], tuple[int, ...]] = _looped  # (rank, ranks, per rank) -> stages

    def stages_of(self, rank: int, ranks: int) -> tuple[int, ...]:
        """The stage indices `rank` holds, in the order torch's schedule expects its stage list."""
        return self.placement(rank, ranks, self.stages_per_rank)

    def rank_of(self, stage: int, ranks: int) -> int:
        for rank in range(ranks):
            if stage in self.stages_of(rank, ranks):
                return rank
        raise ScheduleError(f"{self.name}: stage {stage} is on no rank of {ranks}")


# The seven schedules torch 2.13 ships that train (forward-only and the DualPipe variants' helpers aside).
TORCH_SCHEDULES: dict[str, TorchSchedule] = {
    s.name: s
    for s in (
        TorchSchedule("ScheduleGPipe", 1, False, torch_orders.gpipe),
        TorchSchedule("Schedule1F1B", 1, False, torch_orders.one_f_one_b),
        TorchSchedule("ScheduleInterleaved1F1B", 2, False, torch_orders.interleaved_1f1b),
        TorchSchedule("ScheduleLoopedBFS", 2, False, torch_orders.looped_bfs),
        TorchSchedule("ScheduleInterleavedZeroBubble", 2, True, torch_orders.interleaved_zero_bubble),
        TorchSchedule("ScheduleZBVZeroBubble", 2, True, torch_orders.zbv_zero_bubble, _v_shape),
        TorchSchedule("ScheduleDualPipeV", 2, True, torch_orders.dual_pipe_v, _v_shape),
    )
}


def torch_schedule(name: str) -> TorchSchedule:
    """The registered torch schedule called `name`; any other name is a ScheduleError that lists them."""
    found = TORCH_SCHEDULES.get(name)
    if found is None:
        raise ScheduleError(f"torch schedule {name!r} is not one of {', '.join(TORCH_SCHEDULES)}")
    return found
