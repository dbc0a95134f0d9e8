"""Messages between ranks of one host as a single memory copy (Linux cross-memory attach).

Inside a host, gloo sends over loopback TCP: the sender copies the payload into the kernel, the
receiver copies it out, and both run the TCP stack, so every byte costs two copies and two cores.
NCCL and MPI move intra-node messages through shared memory instead. `LocalCopyWire` does the same
on CPU with process_vm_readv(2): the sender posts a small header (its pid, the payload's address and
size) over the inner wire; the receiver copies the payload straight out of the sender's memory into
its own buffer, one copy in the kernel, then acks so the sender may release the payload. Messages to
other hosts go over the inner wire unchanged, and so does everything when this process may not make
the call at all (a seccomp profile without it). Reading a sibling process also needs ptrace access: each
rank allows it for every process of its user (Yama's PR_SET_PTRACER); where that is not enough (Yama
scope 2 or 3), the receiver answers the header with a refusal and the sender sends the payload over the
inner wire instead, message by message. The header and the ack are matched by tag like the payload would
have been, so the engine's order discipline (meshjob_trainer.engine) is the same on both paths.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from meshjob_trainer.wire import _HostSide

ACK_TAG = 1 << 29  # added to a message's tag for its ack (the engine's tags stay far below)
FALLBACK_TAG = 2 << 29  # added for the payload itself, when the receiver could not copy it
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _readv() -> Any:
    fn = _LIBC.process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
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
    """Whether this process may use process_vm_readv (read a byte of itself)."""
    try:
        probe, into = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        copy_from(os.getpid(), probe.data_ptr(), into)
        return bool(into.item() == 1)
    except (OSError, AttributeError):
        return False


@dataclass
class _Send:
    header_work: Any
    ack_work: Any
    payload: torch.Tensor  # kept alive (and unchanged) until the ack: the receiver reads it in place
    header: torch.Tensor
    ack: torch.Tensor  # 1: copied; 0: the receiver may not read us, send the payload itself
    peer: int
    tag: int


@dataclass
class _Recv:
    header_work: Any
    header: torch.Tensor
    into: torch.Tensor
    peer: int
    tag: int


class LocalCopyWire(_HostSide):
    """Wraps a CPU wire (GlooWire); messages to and from `local_peers` move by one memory copy."""

    def __init__(self, inner: Any, local_peers: Iterable[int], group: Any = None) -> None:
        self.inner, self.local_peers, self.group = inner, frozenset(local_peers), group
        self.device = inner.device
        if self.local_peers:
            allow_readers()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.local_peers:
            return self.inner.isend(tensor, peer, tag, message)
        if not tensor.is_contiguous():
            raise ValueError(f"{message}: a local copy needs a contiguous payload")
        header = torch.tensor([os.getpid(), tensor.data_ptr(), tensor.numel() * tensor.element_size()],
                              dtype=torch.int64)
        ack = torch.zeros(1, dtype=torch.uint8)
        ack_work = dist.irecv(ack, peer, group=self.group, tag=tag + ACK_TAG)  # posted first: the ack never waits
        return _Send(dist.isend(header, peer, group=self.group, tag=tag), ack_work, tensor, header, ack, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.local_peers:
            return self.inner.irecv(tensor, peer, tag, message)
        if not tensor.is_contiguous():
            raise ValueError(f"{message}: a local copy needs a contiguous buffer")
        header = torch.zeros(3, dtype=torch.int64)
        return _Recv(dist.irecv(header, peer, group=self.group, tag=tag), header, tensor, peer, tag)

    def wait(self, work: Any) -> None:
        if isinstance(work, _Send):
            work.header_work.wait()
            work.ack_work.wait()
            if not int(work.ack.item()):  # the receiver may not read us: the payload goes over the inner wire
                dist.isend(work.payload, work.peer, group=self.group, tag=work.tag + FALLBACK_TAG).wait()
        elif isinstance(work, _Recv):
            work.header_work.wait()
            pid, address, nbytes = (int(v) for v in work.header.tolist())
            want = work.into.numel() * work.into.element_size()
            if nbytes != want:
                raise RuntimeError(f"local copy from rank {work.peer}: {nbytes} bytes sent, {want} expected")
            try:
                copy_from(pid, address, work.into)
                copied = True
            except OSError:  # not allowed to read that process: have it send the payload
                copied = False
            dist.isend(torch.tensor([int(copied)], dtype=torch.uint8), work.peer, group=self.group,
                       tag=work.tag + ACK_TAG).wait()
            if not copied:
                dist.irecv(work.into, work.peer, group=self.group, tag=work.tag + FALLBACK_TAG).wait()
        else:
            self.inner.wait(work)
