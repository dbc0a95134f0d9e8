"""How each strategy's unit task becomes point-to-point steps: the lowering rules the registry
(meshjob.resharding.strategies) names, one function each, over a StepBuilder that numbers the steps."""

from __future__ import annotations

from collections.abc import Callable

from meshjob.layout.sharding import Slice
from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST, Step, UnitTask, split


class StepBuilder:
    """Appends steps with consecutive ids, each scoped by the hosts of its two ends."""

    def __init__(self, task: int, host_of: Callable[[int], int], first_id: int, signal: bool = False):
        self.task, self.host_of, self.next_id, self.signal = task, host_of, first_id, signal
        self.steps: list[Step] = []

    def copy(self, src: int, dst: int, region: Slice, after: tuple[int, ...]) -> int:
        scope = INTRA_HOST if self.host_of(src) == self.host_of(dst) else CROSS_HOST
        step = Step(self.next_id, self.task, src, dst, region, after, scope, self.signal)
        self.steps.append(step)
        self.next_id += 1
        return step.id


def scatter_then_ring(b: StepBuilder, sender: int, region: Slice, ring: list[int]) -> None:
    """Scatter: part p of `region` goes to ring[p]. Then the ring all-gather as point-to-point
    steps: each part travels once around the ring, one hop per round, and every hop waits for the
    step that brought that part to the forwarding device."""
    parts = split(region, len(ring))
    last = [b.copy(sender, ring[p], part, ()) for p, part in enumerate(parts)]
    n = len(ring)
    for k in range(1, n):
        for p, part in enumerate(parts):
            last[p] = b.copy(ring[(p + k - 1) % n], ring[(p + k) % n], part, (last[p],))


def chain(b: StepBuilder, sender: int, region: Slice, hosts: list[list[int]], chunks: int) -> None:
    """Pipelined broadcast: sender -> head of host 1 -> head of host 2 ...; each head forwards
    chunk k onward and to its host's other devices as soon as it holds chunk k."""
    for chunk in split(region, chunks):
        src = sender
        got: tuple[int, ...] = ()
        for devices in hosts:
            head = devices[0]
            received = b.copy(src, head, chunk, got)
            for other in devices[1:]:
                b.copy(head, other, chunk, (received,))
            src, got = head, (received,)


# The rules, one per strategy: (builder, sender rank, the task, receiving hosts' devices in chain order, K).
def send_each(b: StepBuilder, sender: int, task: UnitTask, hosts: list[list[int]], chunks: int) -> None:
    """The sender sends the whole slice to every receiving device."""
    for r in task.receivers:
        b.copy(sender, r, task.slice, ())


def ring_per_host(b: StepBuilder, sender: int, task: UnitTask, hosts: list[list[int]], chunks: int) -> None:
    """A part per device of each receiving host, then a ring all-gather inside each host."""
    for devices in hosts:
        scatter_then_ring(b, sender, task.slice, devices)


def one_ring(b: StepBuilder, sender: int, task: UnitTask, hosts: list[list[int]], chunks: int) -> None:
    """A part per receiving device, then one ring all-gather over all of them."""
    scatter_then_ring(b, sender, task.slice, [r for devices in hosts for r in devices])


def chunked_chain(b: StepBuilder, sender: int, task: UnitTask, hosts: list[list[int]], chunks: int) -> None:
    """The pipelined broadcast chain in `chunks` chunks."""
    chain(b, sender, task.slice, hosts, chunks)


def one_chunk_chain(b: StepBuilder, sender: int, task: UnitTask, hosts: list[list[int]], chunks: int) -> None:
    """The broadcast's dependency shape with one chunk (signal: 1 byte per message)."""
    chain(b, sender, task.slice, hosts, 1)
