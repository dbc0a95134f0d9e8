"""A rank's share of one transfer, as the communication engine (meshjob_trainer.engine) runs it.

A Job is one (boundary, microbatch) on one rank: the messages it takes part in (MessageSpec: one
point-to-point step of the plan, or of the all-gather inside the destination mesh; Message: one such
message's state on the engine's thread) and the data behind them, which subclasses provide
(meshjob_trainer.reshard's executor: what a send carries, where a receive lands, the assembled result).
A Handle is the started job as the compute thread sees it: its result once delivered. Memory tallies the
payload buffers jobs hold, for the peak in flight each step reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshjob.network.host_task import Link
from meshjob.schedule.boundary import BoundaryKey
from meshjob_trainer.landing import LandingProbe
from meshjob_trainer.wire import Wire


@dataclass(frozen=True)
class MessageSpec:
    """One message a rank takes part in for every microbatch of a boundary."""

    index: int  # within the boundary: its tag offset
    step: int  # the id of its step (plan's, or the executor's gather step): its name in logs and checks
    peer: int
    send: bool
    link: Link | None = None  # the link it leaves on (sends) or arrives on (receives)
    deps: tuple[int, ...] = ()  # sends: indices of this rank's receives that must land first


@dataclass
class Message:
    spec: MessageSpec
    tensor: torch.Tensor | None = None
    work: Any = None  # what the wire's isend/irecv returned: the wire's own kind of work
    issued: bool = False
    done: bool = False
    nbytes: int = 0  # what it counts in flight on its link
    ready_s: float = 0.0  # when only its link's window or the board held it back (time.monotonic)
    issued_s: float = 0.0
    done_s: float = 0.0
    wire_s: float = 0.0  # when the wire reported it done (a send: its bytes are in the kernel's socket buffer)
    floor_s: float = 0.0  # a large send on a NIC out-link: the earliest its bytes can have left the host
    landing: LandingProbe | None = None  # a large receive on a NIC in-link: its markers (meshjob_trainer.landing)


class Job:
    """One (boundary, microbatch) on one rank. Subclasses provide the data: what a send carries, where a
    receive lands, and the assembled result; the engine only moves messages and calls these on its thread."""

    def __init__(self, key: BoundaryKey, mb: int, specs: Sequence[MessageSpec], tag_base: int) -> None:
        self.key, self.mb, self.tag_base = key, mb, tag_base
        self.messages = {s.index: Message(s) for s in specs}
        self.recvs_left = sum(not s.send for s in specs)
        self.sends_left = len(specs) - self.recvs_left
        self.receives = self.recvs_left > 0  # its result is ready when they land (else: when its sends are done)
        self._handle: Handle | None = Handle(self)
        self.held = 0  # bytes of buffers this job allocated and still counts
        self.result_bytes = 0  # of them, those the result lives in: the compute owns them once it takes it
        self.memory: Memory | None = None  # the engine's tally, set when submitted
        self._lock = threading.Lock()
        self.started_s = time.perf_counter()
        self.source_mark: Any = None  # what the engine must wait for before reading the source tile

    @property
    def handle(self) -> Handle:
        """The job's handle, until the job is retired."""
        if self._handle is None:
            raise RuntimeError(f"{self.key}#{self.mb}: the job is done and has let go of its handle")
        return self._handle

    def name(self, spec: MessageSpec) -> str:
        return f"{self.key}#{self.mb}/{spec.step}"

    def hold(self, tensor: torch.Tensor, result: bool = False) -> torch.Tensor:
        """Count a buffer this job allocated, until release(), or until the compute takes the result
        (`result`: the buffer the result lives in), or until the job is done."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count(nbytes)
        if result:
            self.result_bytes += nbytes
        return tensor

    def taken(self) -> None:
        """The compute took the result: its buffers are activations now, not payload in flight."""
        with self._lock:
            nbytes, self.result_bytes = self.result_bytes, 0
        self._count(-nbytes)

    def release(self, tensor: torch.Tensor) -> None:
        """A buffer hold() counted is no longer needed (a staging copy sent or landed)."""
        self._count(-tensor.numel() * tensor.element_size())

    def release_all(self) -> None:
        """The job is done: nothing it allocated is in flight any more."""
        with self._lock:
            held, self.result_bytes = self.held, 0
        self._count(-held)

    def retire(self) -> None:
        """The job is done: let go of its buffers and of its handle. The handle keeps the result for the
        compute; without this the job and its handle, which refer to each other, would keep every
        buffer of the transfer until Python's cyclic collector next ran (the payloads of hundreds of
        transfers, on a rank that allocates few Python objects)."""
        self._handle = None
        for message in self.messages.values():
            message.work = message.tensor = None

    def _count(self, nbytes: int) -> None:
        with self._lock:  # the engine's thread allocates, the compute's takes the result
            self.held += nbytes
        if self.memory is not None:
            self.memory.add(nbytes)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started_s

    def nbytes(self, spec: MessageSpec) -> int:
        """The bytes message `spec` moves (0: unknown; the link's window alone bounds it)."""
        return 0

    def payload(self, spec: MessageSpec) -> torch.Tensor:
        raise NotImplementedError

    def target(self, spec: MessageSpec) -> torch.Tensor:
        raise NotImplementedError

    def landed(self, spec: MessageSpec, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def sent(self, spec: MessageSpec, tensor: torch.Tensor) -> None:
        """A send is done (the engine no longer needs its payload)."""

    def assemble(self) -> torch.Tensor | None:
        raise NotImplementedError

    def finished(self, seconds: float) -> None:
        """All its messages are done (record what it moved)."""


class Handle:
    """A started job, for the compute thread. result() -> the result (None on a rank that only sends) once
    every receive has landed, or for a sender once its sends are done; wait() -> the same once every
    message (a chain's forwards too) is done."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._result: torch.Tensor | None = None
        self._mark: Any = None
        self._wire: Wire | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._done = threading.Event()

    def _set_result(self, result: torch.Tensor | None, wire: Wire, mark: Any) -> None:
        self._result, self._wire, self._mark = result, wire, mark
        self._ready.set()

    def _set_done(self) -> None:
        self._ready.set()
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()
        self._done.set()

    def _wait(self, event: threading.Event, timeout_s: float | None, what: str) -> None:
        if not event.wait(timeout_s):
            raise TimeoutError(
                f"resharding {self._job.key} of microbatch {self._job.mb} not {what} after {timeout_s:g} s"
            )
        if self._error is not None:
            raise self._error

    def result(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """The result as soon as it is there (a chain's forwards may still be under way)."""
        self._wait(self._ready, timeout_s, "delivered")
        if self._wire is not None:  # once: the compute stream waits for the engine's copy, then owns it
            if self._result is not None:
                self._wire.accept(self._result, self._mark)
            self._job.taken()
            self._wire = None
        return self._result

    def wait(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """The result, once every message of the job (its forwards too) is done."""
        self._wait(self._done, timeout_s, "done")
        return self.result()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def job(self) -> Job:
        return self._job

    @property
    def stats(self) -> Any:
        """What the job recorded (meshjob_trainer.reshard.ReshardStats), if anything."""
        return getattr(self._job, "stats", None)

    @property
    def delivered(self) -> bool:
        """False for `signal` transfers: their result is a placeholder, no data moved."""
        return not getattr(self._job, "signal", False)


@dataclass
class Memory:
    """Bytes of payload buffers held (the engine's thread allocates, the compute's takes results)."""

    held_bytes: int = 0
    peak_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def reset_peak(self) -> int:
        """The peak since the last reset (the caller's step), and start a new one from what is held now."""
        with self.lock:
            peak, self.peak_bytes = self.peak_bytes, self.held_bytes
        return peak
