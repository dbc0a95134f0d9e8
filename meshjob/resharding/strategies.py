"""The resharding strategies, one object each in one registry: its lowering, its cost, its rules.

For a unit task with A receiving hosts of B devices each ("On Optimizing the Communication of Model
Parallelism", Zhuang et al., 2022, §3.1): `send_recv` sends A*B copies, `local_allgather` one copy per host
then a ring inside it, `global_allgather` (Alpa's) a part per receiver then one ring over all, `broadcast`
a pipelined chain of K chunks across the hosts (t + (A-1)t/K); `signal` (1 byte per message, the
broadcast's dependencies) is the benchmarks' upper bound. Adding a strategy is adding one object here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from meshjob.network.host_task import HostTask, TaskCost
from meshjob.network.model import DEFAULT_MESSAGE_S, NetworkModel
from meshjob.resharding import lowering, task_costs
from meshjob.resharding.lowering import StepBuilder
from meshjob.resharding.task_costs import Messages, Remote
from meshjob.resharding.tasks import Step, UnitTask, group_by_host

Lowering = Callable[[StepBuilder, int, UnitTask, list[list[int]], int], None]
Cost = Callable[[NetworkModel, HostTask, int, int, Remote, "int | str"], TaskCost]
MessageCount = Callable[[float, int, Remote, int], Messages]


@dataclass(frozen=True)
class Strategy:
    """How one strategy moves a unit task: its steps (lower), their time on the network model (cost) and
    their messages (the CPU they take on shared cores)."""

    name: str
    lower: Lowering
    cost: Cost
    messages: MessageCount
    one_byte: bool = False  # every message carries 1 byte: a benchmark's bound, never a job's choice
    interleaved: bool = False  # its ring parts interleave with other tasks' (meshjob.plan.build.Boundary)
    searched: bool = True  # `meshjob tune` may choose it


SEND_RECV = Strategy("send_recv", lowering.send_each, task_costs.send_recv_cost, task_costs.send_messages)
LOCAL_ALLGATHER = Strategy(
    "local_allgather",
    lowering.ring_per_host,
    task_costs.ring_per_host_cost,
    task_costs.ring_per_host_messages,
    interleaved=True,
)
GLOBAL_ALLGATHER = Strategy(
    "global_allgather", lowering.one_ring, task_costs.one_ring_cost, task_costs.one_ring_messages, interleaved=True
)
BROADCAST = Strategy("broadcast", lowering.chunked_chain, task_costs.chain_cost, task_costs.chain_messages)
SIGNAL = Strategy(
    "signal",
    lowering.one_chunk_chain,
    task_costs.one_byte_chain_cost,
    task_costs.chain_messages,
    one_byte=True,
    searched=False,
)

# The registry, simplest first (the order error messages and the CRD's enum list them in).
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (SEND_RECV, LOCAL_ALLGATHER, GLOBAL_ALLGATHER, BROADCAST, SIGNAL)}
# What `meshjob tune` tries, best first.
SEARCHED: tuple[str, ...] = tuple(reversed([name for name, s in STRATEGIES.items() if s.searched]))


def by_name(name: str) -> Strategy:
    """The strategy called `name`; any other name is a ValueError that lists the registry."""
    found = STRATEGIES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"strategy {name!r} is invalid: one of {', '.join(STRATEGIES)}")
    return found


def lower(
    task: UnitTask,
    task_index: int,
    sender: int,
    strategy_name: str,
    chunks: int,
    host_of: Callable[[int], int],
    first_step_id: int = 0,
) -> list[Step]:
    """Explicit region copies that deliver `task.slice` from `sender` to every receiver."""
    if sender not in task.senders:
        raise ValueError(f"sender {sender} does not hold slice {task.slice} (holders: {task.senders})")
    chosen = by_name(strategy_name)
    if chunks < 1:
        raise ValueError(f"chunks {chunks!r} is invalid: a positive integer")
    hosts = group_by_host(task.receivers, host_of)
    # The sender's own host (if it receives) goes first: its hop stays intra-host and its head
    # then feeds the rest of the chain.
    hosts.sort(key=lambda devices: host_of(devices[0]) != host_of(sender))
    b = StepBuilder(task_index, host_of, first_step_id, signal=chosen.one_byte)
    chosen.lower(b, sender, task, hosts, chunks)
    return b.steps


@functools.lru_cache(maxsize=4096)
def task_cost(
    model: NetworkModel, task: HostTask, sender: int, strategy_name: str, chunks: int | str = "auto"
) -> TaskCost:
    """Duration and held links of `task` sent from host `sender` by the named strategy on `model`.
    Cached: models and tasks are frozen."""
    chosen = by_name(strategy_name)
    own = task.devices_on(sender) if sender in task.receiver_hosts else 0
    remote = tuple((h, task.devices_on(h)) for h in task.receiver_hosts if h != sender)
    cost = chosen.cost(model, task, sender, own, remote, chunks)
    if model.shared_cpu_cores:  # it cannot end before the shared cores did its messages' work
        nbytes = 1 if chosen.one_byte else task.bytes
        cpu = model.cpu_s(*chosen.messages(nbytes, own, remote, cost.chunks))
        cost = replace(cost, seconds=model.with_cpu(cost.seconds, cpu), cpu_s=cpu, link_s=cost.seconds)
    if model.duplex == "half":  # the paper's constraint 3: every host of the task, all along
        hosts = dict.fromkeys([model.link(sender, "out")] + [model.link(h, "in") for h, _ in remote])
        return TaskCost(cost.seconds, tuple(hosts) if remote else (), cost.chunks, cpu_s=cost.cpu_s, link_s=cost.link_s)
    return cost


def auto_chunks(nbytes: int, hops: int, nic_bytes_per_s: float, message_s: float = DEFAULT_MESSAGE_S) -> int:
    """K for a broadcast chain from a sender to `hops` hosts of one device each: the K that minimises
    (K + hops - 1) * (t / K + message_s), t = nbytes / rate, i.e. near sqrt((hops - 1) t / message_s).
    One hop gains nothing from chunks (K = 1); free messages would want as many as allowed."""
    model = NetworkModel(nic_bytes_per_s=nic_bytes_per_s, message_s=message_s)
    task = HostTask((0,), tuple(range(1, hops + 1)), nbytes)
    return task_cost(model, task, 0, BROADCAST.name, "auto").chunks
