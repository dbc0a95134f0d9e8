"""Messages between ranks of one host as a single memory copy (Linux cross-memory attach).

Inside a host, gloo sends over loopback TCP: the sender copies the payload into the kernel, the
receiver copies it out, and both run the TCP stack, so every byte costs two copies and two cores.
NCCL and MPI move intra-node messages through shared memory instead. `LocalCopyWire` does the same
on CPU with process_vm_readv(2): the receiver copies the payload straight out of the sender's memory
into its own buffer, one copy in the kernel. Messages to other hosts go over the inner wire
unchanged, and so does everything when this process may not make the call at all (a seccomp profile
without it, or not x86-64: see the mailbox below).

The mailbox: each direction between two ranks of a host has a ring of message headers in shared
memory (the sender's pid, the payload's address and size, its tag, its state), and two futex words:
the sender's count of posted headers, the receiver's count of answered ones. The sender writes a
header when the engine issues the send; the receiver, in issue order, waits for the header of its
next receive, checks its tag (a different one: the two ranks issue their messages in different
orders, an error), copies, and answers in the header (copied, or refused); the sender's send is done
when the answer is there and it may release the payload. No socket is touched per message: a
message costs two futex wake-ups instead of three gloo messages (a header, an ack, and gloo's own
receive-ready notice for each, over loopback TCP), which measured 2-3x the CPU per message through
the engine. Each side waits a tick at a time and fails with a clear error when its peer's process is
gone. The mailbox is named once per direction and wire: the first message carries, over the inner
wire and matched by its tag, the sender's pid and the mailbox's random name in /dev/shm, which the
receiver opens and unlinks (nothing is left behind). Headers are plain stores, read in the order they
were written: x86-64's memory order; elsewhere the wire is not used (local_copy_available).

Reading a sibling process also needs ptrace access: each rank allows it for every process of its user
(Yama's PR_SET_PTRACER); where that is not enough (Yama scope 2 or 3), the receiver answers with a
refusal and the sender sends the payload over the inner wire instead (matched by tag), message by
message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshjob_trainer.board import shm_dir
from meshjob_trainer.host_side import HostSide, OrderError
from meshjob_trainer.procs import pid_alive

FALLBACK_TAG = 2 << 29  # added to a message's tag for the payload itself, when the receiver could not copy it
PREFIX = "meshjob-lcw-"
SLOTS = 64  # headers in a mailbox's ring (the engine keeps far fewer messages in flight to one peer)
TICK_S = 1.0  # how often a waiting side checks that its peer's process is still there
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
_FUTEX = {"x86_64": 202}.get(platform.machine())  # SYS_futex; the mailbox relies on x86-64's store order
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the two processes map one file
FREE, POSTED, COPIED, REFUSED = 0, 1, 2, 3  # a header's state
_FIELDS = 6  # per header: seq, tag, pid, address, nbytes, state
_HEAD = 64  # bytes before the ring: the two futex words (posted, answered) and the receiver's pid


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _readv() -> Any:
    fn = _LIBC.process_vm_readv
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _readv()


def copy_from(pid: int, address: int, into: torch.Tensor) -> None:
    """Copy into.nbytes bytes at `address` in process `pid` into `into` (contiguous, CPU)."""
    nbytes = into.numel() * into.element_size()
    local, remote = _IoVec(into.data_ptr(), nbytes), _IoVec(address, nbytes)
    done = 0
    while done < nbytes:  # the kernel may copy less than asked (it stops at page-table boundaries)
        local.iov_base, local.iov_len = into.data_ptr() + done, nbytes - done
        remote.iov_base, remote.iov_len = address + done, nbytes - done
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got


def allow_readers() -> None:
    """Let processes of this user read this one (Yama ptrace_scope 1 allows only descendants)."""
    _LIBC.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)  # no Yama: EINVAL, nothing to allow


def local_copy_available() -> bool:
    """Whether this process may use process_vm_readv (read a byte of itself) and the mailbox (x86-64)."""
    if _FUTEX is None:
        return False
    try:
        probe, into = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        copy_from(os.getpid(), probe.data_ptr(), into)
        return bool(into.item() == 1)
    except (OSError, AttributeError):
        return False


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SYSCALL = _LIBC.syscall
_SYSCALL.restype = ctypes.c_long
_TICK = _Timespec(int(TICK_S), int(TICK_S % 1 * 1e9))


class _Mailbox:
    """One direction between two ranks of a host: a ring of SLOTS message headers and two futex words
    (headers posted, headers answered) in a shared file. The sender writes headers and frees answered
    ones, the receiver answers: each word of a header has one writer at a time."""

    SIZE = _HEAD + SLOTS * _FIELDS * 8

    def __init__(self, path: str, create: bool) -> None:
        if _FUTEX is None:
            raise OSError(f"local copy: no futex system call known on {platform.machine()}")
        self._futex = ctypes.c_long(_FUTEX)
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)  # zero-filled: every header FREE
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self.words = (ctypes.c_uint32 * 2).from_buffer(self._map)
        self.peer = ctypes.c_int64.from_buffer(self._map, 8)  # the receiver's pid, once it opened the mailbox
        self.cells = (ctypes.c_int64 * (SLOTS * _FIELDS)).from_buffer(self._map, _HEAD)
        self._lock = threading.Lock()

    def _cell(self, seq: int, field: int) -> int:
        return seq % SLOTS * _FIELDS + field

    def state(self, seq: int) -> int:
        return self.cells[self._cell(seq, 5)] if self.cells[self._cell(seq, 0)] == seq else FREE

    def free(self, seq: int) -> bool:
        return self.cells[self._cell(seq, 5)] == FREE

    def post(self, seq: int, tag: int, address: int, nbytes: int) -> None:
        base = self._cell(seq, 0)
        self.cells[base : base + 5] = [seq, tag, os.getpid(), address, nbytes]
        self.cells[base + 5] = POSTED  # last: the receiver reads the header once it sees this
        self._bump(0)

    def header(self, seq: int) -> tuple[int, int, int, int]:
        """(tag, pid, address, nbytes) of posted header `seq`."""
        base = self._cell(seq, 0)
        tag, pid, address, nbytes = self.cells[base + 1 : base + 5]
        return tag, pid, address, nbytes

    def answer(self, seq: int, state: int) -> None:
        self.cells[self._cell(seq, 5)] = state
        self._bump(1)

    def release(self, seq: int) -> None:
        """The sender read the answer: the header's place in the ring may take another."""
        self.cells[self._cell(seq, 5)] = FREE

    def _bump(self, word: int) -> None:
        with self._lock:  # the engine thread and a waiter may both post
            self.words[word] = (self.words[word] + 1) & 0xFFFFFFFF
        _SYSCALL(
            self._futex,
            ctypes.c_void_p(ctypes.addressof(self.words) + 4 * word),
            ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(1 << 30),
            None,
            None,
            ctypes.c_int(0),
        )

    def wait(self, word: int, ready: Callable[[], bool], peer_pid: Callable[[], int], what: str) -> None:
        """Until ready(): sleeps on futex word `word` (bumped by every post, or every answer), a tick at
        a time; fails once the peer's process is gone."""
        address = ctypes.c_void_p(ctypes.addressof(self.words) + 4 * word)
        checked = time.monotonic()
        while True:
            seen = self.words[word]
            if ready():
                return
            _SYSCALL(
                self._futex,
                address,
                ctypes.c_int(_FUTEX_WAIT),
                ctypes.c_uint32(seen),
                ctypes.byref(_TICK),
                None,
                ctypes.c_int(0),
            )
            if time.monotonic() - checked >= TICK_S:
                pid = peer_pid()
                if pid and not pid_alive(pid) and not ready():
                    raise RuntimeError(f"local copy: {what}, but process {pid} is gone")
                checked = time.monotonic()


@dataclass
class _Out:
    """This rank's sends to one peer of its host."""

    box: _Mailbox
    sent: int = 0  # headers issued so far (the next one's seq)


@dataclass
class _In:
    """This rank's receives from one peer of its host."""

    box: _Mailbox | None = None  # opened on the first message's hello
    sender: int = 0  # the sender's pid
    posted: int = 0  # receives issued so far


@dataclass
class _Send:
    out: _Out
    seq: int
    payload: torch.Tensor  # kept alive (and unchanged) until answered: the receiver reads it in place
    peer: int
    tag: int
    written: bool  # its header is in the ring (else: the ring was full when issued, the wait writes it)
    hello: torch.Tensor | None = None
    hello_work: dist.Work | None = None


@dataclass
class _Recv:
    inbox: _In
    seq: int
    into: torch.Tensor
    peer: int
    tag: int
    hello: torch.Tensor | None = None
    hello_work: dist.Work | None = None


class LocalCopyWire(HostSide):
    """Wraps a CPU wire (GlooWire); messages to and from `local_peers` move by one memory copy."""

    def __init__(self, inner: Any, local_peers: Iterable[int], group: dist.ProcessGroup | None = None) -> None:
        self.inner, self.local_peers, self.group = inner, frozenset(local_peers), group
        self.device = inner.device
        self._out: dict[int, _Out] = {}
        self._in: dict[int, _In] = {}
        if self.local_peers:
            allow_readers()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.local_peers:
            return self.inner.isend(tensor, peer, tag, message)
        if not tensor.is_contiguous():
            raise ValueError(f"{message}: a local copy needs a contiguous payload")
        out = self._out.get(peer)
        hello = hello_work = None
        if out is None:  # the first message to this peer names the mailbox, over the inner wire
            name = secrets.randbits(62)
            out = self._out[peer] = _Out(_Mailbox(self._path(os.getpid(), name), create=True))
            hello = torch.tensor([os.getpid(), name], dtype=torch.int64)
            hello_work = dist.isend(hello, peer, group=self.group, tag=tag)
        send = _Send(out, out.sent, tensor, peer, tag, False, hello, hello_work)
        out.sent += 1
        if out.box.free(send.seq):
            self._write(send)
        return send

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.local_peers:
            return self.inner.irecv(tensor, peer, tag, message)
        if not tensor.is_contiguous():
            raise ValueError(f"{message}: a local copy needs a contiguous buffer")
        inbox = self._in.setdefault(peer, _In())
        recv = _Recv(inbox, inbox.posted, tensor, peer, tag)
        if inbox.posted == 0:
            recv.hello = torch.zeros(2, dtype=torch.int64)
            recv.hello_work = dist.irecv(recv.hello, peer, group=self.group, tag=tag)
        inbox.posted += 1
        return recv

    def wait(self, work: Any) -> None:
        if isinstance(work, _Send):
            self._wait_send(work)
        elif isinstance(work, _Recv):
            self._wait_recv(work)
        else:
            self.inner.wait(work)

    @staticmethod
    def _path(pid: int, name: int) -> str:
        return os.path.join(shm_dir(), f"{PREFIX}{pid}-{name:x}")

    @staticmethod
    def _write(send: _Send) -> None:
        payload = send.payload
        send.out.box.post(send.seq, send.tag, payload.data_ptr(), payload.numel() * payload.element_size())
        send.written = True

    def _wait_send(self, send: _Send) -> None:
        box = send.out.box
        if send.hello_work is not None:
            send.hello_work.wait()
        receiver = lambda: int(box.peer.value)  # noqa: E731
        if not send.written:  # the ring was full: the sends before it (waited first) free its place
            box.wait(1, lambda: box.free(send.seq), receiver, f"message {send.seq} to rank {send.peer} waits")
            self._write(send)
        box.wait(
            1,
            lambda: box.state(send.seq) in (COPIED, REFUSED),
            receiver,
            f"message {send.seq} to rank {send.peer} is not answered",
        )
        refused = box.state(send.seq) == REFUSED
        box.release(send.seq)
        if refused:  # the receiver may not read us: the payload goes over the inner wire
            dist.send(send.payload, send.peer, group=self.group, tag=send.tag + FALLBACK_TAG)

    def _wait_recv(self, recv: _Recv) -> None:
        inbox = recv.inbox
        if recv.hello_work is not None:
            recv.hello_work.wait()
            assert recv.hello is not None  # posted with its work
            pid, name = (int(v) for v in recv.hello.tolist())
            path = self._path(pid, name)
            inbox.box, inbox.sender = _Mailbox(path, create=False), pid
            os.unlink(path)  # both sides hold it mapped: nothing is left in /dev/shm
            inbox.box.peer.value = os.getpid()
        box = inbox.box
        if box is None:
            raise RuntimeError(f"local copy from rank {recv.peer}: receive {recv.seq} waited before receive 0")
        box.wait(
            0,
            lambda: box.state(recv.seq) == POSTED,
            lambda: inbox.sender,
            f"receive {recv.seq} from rank {recv.peer} waits for its message",
        )
        tag, pid, address, nbytes = box.header(recv.seq)
        if tag != recv.tag:
            raise OrderError(
                f"local copy from rank {recv.peer}: message {recv.seq} carries tag {tag}, the receiver "
                f"posted tag {recv.tag}; the two ranks issue their messages in different orders"
            )
        want = recv.into.numel() * recv.into.element_size()
        if nbytes != want:
            raise RuntimeError(f"local copy from rank {recv.peer}: {nbytes} bytes sent, {want} expected")
        try:
            copy_from(pid, address, recv.into)
            copied = True
        except OSError:  # not allowed to read that process: have it send the payload
            copied = False
        box.answer(recv.seq, COPIED if copied else REFUSED)
        if not copied:
            dist.recv(recv.into, recv.peer, group=self.group, tag=recv.tag + FALLBACK_TAG)
