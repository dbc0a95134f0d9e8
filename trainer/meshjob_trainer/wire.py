"""The wire a rank's communication engine (meshjob_trainer.engine) issues its messages on.

A wire issues point-to-point messages (isend/irecv), blocks a thread until one is done (wait), and
keeps the engine's device work apart from the compute stream. Four of them:

- GlooWire (CPU tensors, the default): gloo's isend/irecv on the default group, matched by (peer, tag). gloo
  tells completion only through a blocking wait(): Work.is_completed() stays False until wait()
  returns, wait(timeout) closes the connection when it expires, and point-to-point work has no
  future. The engine therefore learns completions from waiter threads, one per peer and direction,
  each waiting in issue order: the order in which messages complete on one connection.
- NcclWire (CUDA tensors): device to device, no CPU staging. NCCL matches a communicator's
  point-to-point messages by the order they are issued, not by tags, and runs them in order on one
  stream; a receive posted early on a pair would hold back every later message on that pair, in
  either direction. So every directed pair of ranks that exchanges messages gets its own two-rank
  communicator, used for that direction only: it carries one sender's messages to one receiver, in
  the order both derive from the plan (meshjob.plan.comm_order), and receives posted early hold back
  nothing else. The engine issues on its own CUDA stream (`engine_stream`), so transfers overlap the
  compute stream; events order the two where a tensor crosses (`mark`, `after`, `hand_over`,
  `accept`). NCCL creates a communicator on its first message, blocking until the peer does too;
  issued from one engine thread in whatever order transfers come, two ranks could wait on each
  other's first messages, so `connect` initialises every pair at setup, in one global order.
  Run on one lent GPU by bench/gpu_check.sh (ranks sharing it, each an NCCL host of its own): it checks the
  NCCL path's correctness and order, not its speed (docs/benchmarks.md).
- TcpWire (CPU tensors between hosts, `cpu_wire="tcp"`; meshjob_trainer.tcp_wire): a TCP connection per
  directed pair, messages matched by the order both ranks issue them, as NCCL matches them, each sent
  once its receive is posted where several hosts feed the receiving host; less CPU per message than
  gloo's point-to-point, not faster on two shared cores (`meshjob bench resharding --transport tcp`;
  trainer/ENGINE.md, "The TCP wire").
  Inside a host the memory copy (meshjob_trainer.local_copy) wraps it as it wraps gloo.
- CheckedWire (tests): wraps a wire and fails on any message issued out of order, as NCCL would
  pair them wrongly: the k-th message a sender issues to a receiver must be the k-th that receiver
  posts from that sender. Both sides record what they issue in the job's key-value store; the
  second to arrive compares. It also logs every issue and completion (sends in order, in flight).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshjob_trainer.host_side import HostSide, OrderError
from meshjob_trainer.local_copy import LocalCopyWire, local_copy_available
from meshjob_trainer.tcp_wire import TcpWire


class Wire(Protocol):
    device: torch.device

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any: ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any: ...

    def wait(self, work: Any) -> None:
        """Block the calling thread until the message is done (sent, or landed in its buffer)."""

    def engine_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Entered once by the engine thread: the stream its copies and messages run on."""

    def mark(self) -> Any:
        """On the compute thread, when it hands the engine a tensor: what the engine must wait for."""

    def after(self, mark: Any) -> None:
        """On the engine thread, before it reads that tensor."""

    def hand_over(self) -> Any:
        """On the engine thread, when a result is assembled: what the compute thread must wait for."""

    def accept(self, tensor: torch.Tensor, mark: Any) -> None:
        """On the compute thread, before it uses a result the engine assembled."""


class GlooWire(HostSide):
    """gloo point-to-point on `group` (default: the default group), CPU tensors."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.device = torch.device("cpu")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        return dist.isend(tensor, peer, group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        return dist.irecv(tensor, peer, group=self.group, tag=tag)

    def wait(self, work: Any) -> None:
        work.wait()


Pair = tuple[int, int]  # (sender rank, receiver rank)


def directed_groups(pairs: Iterable[Pair], new_group: Callable[..., Any] | None = None) -> dict[Pair, Any]:
    """A two-rank group per directed pair. Collective: every rank of the job calls this with the same
    pairs (they come from the plan) and creates them in one sorted order, as new_group requires."""
    make = new_group or dist.new_group
    return {(a, b): make(ranks=sorted((a, b)), backend="nccl") for a, b in sorted(set(pairs))}


class NcclWire:
    """NCCL point-to-point, one communicator per directed pair, issued on the engine's CUDA stream."""

    POLL_S = (10e-6, 1e-3)  # first and longest sleep between completion checks (wait_polling)

    def __init__(self, rank: int, device: torch.device, groups: dict[Pair, Any]) -> None:
        self.rank, self.device, self.groups = rank, device, groups
        self.stream = torch.cuda.Stream(device=device)

    def _group(self, src: int, dst: int) -> Any:
        try:
            return self.groups[(src, dst)]
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: no communicator for messages from rank {src} to rank {dst}; "
                f"the plan has no step between them"
            ) from None

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        return dist.isend(tensor, peer, group=self._group(self.rank, peer))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        return dist.irecv(tensor, peer, group=self._group(peer, self.rank))

    def wait(self, work: Any) -> None:
        wait_polling(work, *self.POLL_S)

    def connect(self) -> None:
        """Initialise every communicator this rank belongs to, in the groups' one global order (each
        pair's first message blocks until both ranks are in it; the same order everywhere cannot
        deadlock)."""
        one = torch.zeros(1, device=self.device)
        for (src, dst), group in sorted(self.groups.items()):
            if self.rank == src:
                dist.send(one, dst, group=group)
            elif self.rank == dst:
                dist.recv(one, src, group=group)
        torch.cuda.synchronize(self.device)

    def engine_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def after(self, mark: Any) -> None:
        if mark is not None:
            self.stream.wait_event(mark)

    def hand_over(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def accept(self, tensor: torch.Tensor, mark: Any) -> None:
        current = torch.cuda.current_stream(self.device)
        if mark is not None:
            current.wait_event(mark)
        tensor.record_stream(current)  # allocated on the engine's stream, now used on this one


def wait_polling(work: Any, first_s: float, longest_s: float) -> None:
    """NCCL's wait() only orders streams; the host learns completion by polling the work's event,
    sleeping longer each time (up to longest_s) while nothing happens."""
    pause = first_s
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, longest_s)
    work.wait()  # raises a failed communicator's error


CPU_WIRES = ("gloo", "tcp")  # between CPU ranks of different hosts: gloo's isend, or meshjob_trainer.tcp_wire


def wire_for(
    device: torch.device,
    rank: int,
    pairs: Iterable[Pair],
    new_group: Callable[..., Any] | None = None,
    local_peers: Iterable[int] = (),
    cpu_wire: str = "gloo",
    ungranted: Iterable[Pair] = (),
) -> Wire:
    """NCCL between CUDA devices (a communicator per directed pair, all connected now: collective, every
    rank calls it with the same pairs); for CPU tensors `cpu_wire` between hosts (gloo: its isend/irecv;
    tcp: a connection per directed pair, meshjob_trainer.tcp_wire, every rank building its wires with the
    same pairs in the same sequence; `ungranted`: its pairs whose sends need no grant, route.one_feeder_pairs),
    and between CPU ranks of one host (`local_peers`) one memory copy (meshjob_trainer.local_copy) where the
    system allows it."""
    if device.type != "cuda":
        if cpu_wire not in CPU_WIRES:
            raise ValueError(f"cpu_wire {cpu_wire!r} is invalid: one of {', '.join(CPU_WIRES)}")
        local = set(local_peers) if local_copy_available() else set()
        inner: Wire = TcpWire(rank, pairs, skip=local, ungranted=ungranted) if cpu_wire == "tcp" else GlooWire()
        return LocalCopyWire(inner, local) if local else inner
    wire = NcclWire(rank, device, directed_groups(pairs, new_group))
    wire.connect()
    return wire


def close_wire(wire: Any) -> None:
    """Release what a wire holds (a TCP wire's connections; gloo and NCCL keep theirs in the process group)."""
    for part in (wire, getattr(wire, "inner", None)):
        close = getattr(part, "close", None)
        if close is not None:
            close()


@dataclass
class WireLog:
    """What a CheckedWire saw on one rank, in order: (op, peer, message), op "send", "recv", "send done"
    or "recv done" (when the engine learnt it)."""

    entries: list[tuple[str, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str, peer: int, message: str) -> None:
        with self.lock:
            self.entries.append((op, peer, message))


class CheckedWire:
    """Fails on the first message a rank issues out of the order its peer issues it in (see the module
    docstring); delegates to `inner` otherwise. `store`: the job's key-value store (dist's default)."""

    PREFIX = "meshjob/wire-order"

    def __init__(self, inner: Wire, rank: int, store: Any = None) -> None:
        self.inner, self.rank = inner, rank
        self.device = inner.device
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.log = WireLog()
        self._count: dict[tuple[str, int], int] = {}

    def _check(self, op: str, peer: int, message: str) -> None:
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        k = self._count.get((op, peer), 0)
        self._count[(op, peer)] = k + 1
        mine, theirs = (f"{self.PREFIX}/{src}>{dst}/{k}/{side}" for side in ((op, "recv" if op == "send" else "send")))
        self.store.set(mine, message)
        if self.store.check([theirs]):
            other = self.store.get(theirs).decode()
            if other != message:
                sent, posted = (message, other) if op == "send" else (other, message)
                raise OrderError(
                    f"rank {self.rank}: message {k} from rank {src} to rank {dst}: the sender issued "
                    f"{sent}, the receiver posted {posted}; the two ranks issue their messages in "
                    f"different orders (NCCL would pair them wrongly)"
                )

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        self.log.add("send", peer, message)  # before the store learns of it: a peer may act on that
        self._check("send", peer, message)
        return _Logged(self.inner.isend(tensor, peer, tag, message), "send", peer, message)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        self.log.add("recv", peer, message)
        self._check("recv", peer, message)
        return _Logged(self.inner.irecv(tensor, peer, tag, message), "recv", peer, message)

    def wait(self, work: Any) -> None:
        self.inner.wait(work.work)
        self.log.add(f"{work.op} done", work.peer, work.message)

    def engine_stream(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.engine_stream()

    def mark(self) -> Any:
        return self.inner.mark()

    def after(self, mark: Any) -> None:
        self.inner.after(mark)

    def hand_over(self) -> Any:
        return self.inner.hand_over()

    def accept(self, tensor: torch.Tensor, mark: Any) -> None:
        self.inner.accept(tensor, mark)


@dataclass(frozen=True)
class _Logged:
    work: Any
    op: str
    peer: int
    message: str
