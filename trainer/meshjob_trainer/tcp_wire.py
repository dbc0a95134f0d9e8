"""CPU messages between hosts over TCP: one connection per directed pair of ranks, matched by order.

Why not gloo's point-to-point: between two emulated hosts of this machine a 16 KiB message through
gloo costs about 200 µs of CPU on each side (a receive-ready notice back to the sender, then the
payload, each handed between gloo's device thread and the caller); over a plain TCP socket it costs
6-7 µs. Through the communication engine this wire costs 1.7x less CPU per message than gloo, yet on
two shared cores the resharding bench measures alike over both (`meshjob bench resharding --transport tcp`
against gloo: the engine's own threads are then the rest of a message's cost), so it is opt-in: `cpu_wire="tcp"`.

No tags are needed: the communication engine (meshjob_trainer.engine) issues every message in an
order both ranks derive from the plan (the discipline NCCL needs, meshjob.plan.comm_order), so the k-th
message a sender writes on its connection to a receiver is the k-th receive that receiver posts from
it. Each message still carries a 16-byte header (its tag and size) which the receiver checks: two
ranks that disagree get an OrderError naming the message, never bytes in the wrong buffer.

A receive, when issued, sends the sender a grant (8 bytes, its tag) back on the same connection; the
sender writes a payload only once its grant is there, as gloo and NCCL send only to a posted receive:
a host's in-link then takes its messages in the order its receives are posted, the plan's, instead of
sharing itself between every sender at once (without grants, many-to-many cases whose in-links several
hosts feed measured up to 1.5 L against 1.1 L planned, and paper-scale ones up to 2.5 L). `wait` does
a message's work on the engine's waiter thread for that peer and direction, which waits on that peer's
messages in issue order: the connection's order. A send (its grant read, then header and payload
written) is done once its bytes sit in the kernel's socket buffer (as gloo reports a send); a receive
once its payload is in its buffer. A receiving host whose NIC messages all come from one other host
(a one-to-many chain's next hop) needs no grants: that host's out-link, and its board, already put
them in the plan's order (route.one_feeder_pairs), so those pairs send at once.

Connections: every rank of the job builds its wires with the same pairs, in the same sequence (the
wire's keys in the job's store name its pair set and how many wires of that set came before). A rank
that receives listens on its host's address (GLOO_SOCKET_IFNAME's, the variable gloo and an emulated
host set, else the address it reaches the store from), publishes it and accepts its senders in the
background; a sender connects on its first message to a peer, on that peer's waiter thread, and names
itself. Nothing waits on the engine's thread, and a wire that carries no message costs no connection.
A rank whose peer is gone gets an error naming the peer (a broken or closed connection).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import os
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshjob_trainer.host_side import HostSide, OrderError

HEADER = struct.Struct("<qq")  # a message's tag and payload bytes
HELLO = struct.Struct("<q")  # a connection's first bytes: the sender's rank
GRANT = struct.Struct("<q")  # back on the connection, from the receiver: the tag of the receive it posted
CONNECT_TIMEOUT_S = 300.0
_SIOCGIFADDR = 0x8915
_WIRES: collections.Counter[str] = collections.Counter()  # wires built per pair set (names each in the store)
_WIRES_LOCK = threading.Lock()


@dataclass
class _Message:
    tensor: torch.Tensor
    peer: int
    tag: int
    name: str
    send: bool


class TcpWire(HostSide):
    """CPU point-to-point over TCP between `rank` and its peers in `pairs` ((sender, receiver) ranks of
    the whole job; every rank passes the same). Pairs with a rank in `skip` get no connection (the
    ranks of this host that an outer wire reaches by a memory copy). Pairs in `ungranted` send without
    waiting for a grant (their receiving host is fed by the sender's host alone: route.one_feeder_pairs;
    every rank passes the same). `store`: the job's key-value store (default: torch.distributed's, once
    it is up)."""

    def __init__(
        self,
        rank: int,
        pairs: Iterable[tuple[int, int]],
        store: dist.Store | None = None,
        skip: Iterable[int] = (),
        timeout_s: float = CONNECT_TIMEOUT_S,
        ungranted: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.rank, self.device, self.timeout_s = rank, torch.device("cpu"), timeout_s
        pairs = sorted(set(pairs))
        skipped = set(skip) | {rank}
        self.sends_to = frozenset(b for a, b in pairs if a == rank and b not in skipped)
        self.recvs_from = frozenset(a for a, b in pairs if b == rank and a not in skipped)
        ungranted = set(ungranted)
        self._granted_to = frozenset(b for b in self.sends_to if (rank, b) not in ungranted)  # sends wait for grants
        self._granting = frozenset(a for a in self.recvs_from if (a, rank) not in ungranted)  # receives grant
        self.namespace = _namespace(pairs)  # now: every rank builds its wires in the same sequence
        self._store = store
        self._out: dict[int, socket.socket] = {}
        self._in: dict[int, socket.socket] = {}
        self._lock = threading.Condition()
        self._grants_due: dict[int, list[int]] = collections.defaultdict(list)  # posted before the sender connected
        self._listener: socket.socket | None = None
        self.connections = 0  # made or accepted so far (close() keeps the count)
        self._accept_error: BaseException | None = None
        self._closed = False
        if self.recvs_from and (store is not None or (dist.is_available() and dist.is_initialized())):
            self._listen()  # senders may connect as soon as they have a message

    def _store_now(self) -> dist.Store:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _listen(self) -> None:
        """Listen on this host's address, publish it, and accept the senders in the background."""
        with self._lock:
            if self._listener is not None or self._closed:
                return
            store = self._store_now()
            host = local_address(store)
            listener = self._listener = socket.create_server((host, 0), backlog=len(self.recvs_from) + 8)
            store.set(f"{self.namespace}/{self.rank}", f"{host}:{listener.getsockname()[1]}")
        threading.Thread(
            target=self._accept_all, args=(listener,), daemon=True, name=f"rank {self.rank} TCP wire accepts"
        ).start()

    def _accept_all(self, listener: socket.socket) -> None:
        try:
            while self.recvs_from - self._in.keys():
                sock, _ = listener.accept()
                _tune(sock)
                hello = bytearray(HELLO.size)
                _recv_exact(sock, memoryview(hello), "its first message", self.rank, "a connecting rank")
                (peer,) = HELLO.unpack(hello)
                with self._lock:
                    if peer not in self.recvs_from or peer in self._in:
                        sock.close()
                        raise ConnectionError(
                            f"rank {self.rank}: a connection named rank {peer}, which this wire does not expect"
                        )
                    self._in[peer] = sock
                    self.connections += 1
                    for tag in self._grants_due.pop(peer, ()):
                        sock.sendall(GRANT.pack(tag))
                    self._lock.notify_all()
        except BaseException as err:  # noqa: BLE001 - reported to every receive that waits for a connection
            with self._lock:
                self._accept_error = None if self._closed else err
                self._lock.notify_all()
        finally:
            listener.close()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.sends_to:
            raise RuntimeError(
                f"rank {self.rank}: no TCP connection for messages to rank {peer}; the plan has no step between them"
            )
        return _Message(_checked(tensor, message), peer, tag, message, True)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, message: str) -> Any:
        if peer not in self.recvs_from:
            raise RuntimeError(
                f"rank {self.rank}: no TCP connection for messages from rank {peer}; the plan has no step between them"
            )
        self._listen()
        work = _Message(_checked(tensor, message), peer, tag, message, False)
        if peer in self._granting:
            self._grant(peer, tag, message)
        return work

    def _grant(self, peer: int, tag: int, message: str) -> None:
        """Tell the sender that this receive is posted: it sends the payload only then, as gloo and NCCL do,
        so an in-link takes its messages in the order the receives are posted (the plan's) rather than
        sharing itself between every sender at once. On the engine's thread: 8 bytes on a connection that
        carries nothing else this way, never a wait."""
        with self._lock:
            sock = self._in.get(peer)
            if sock is None:
                self._grants_due[peer].append(tag)  # sent once the sender connects (_accept_all)
                return
            try:
                sock.sendall(GRANT.pack(tag))
            except OSError as err:
                raise ConnectionError(
                    f"rank {self.rank}: posting the receive of {message} from rank {peer}: the "
                    f"connection broke ({err}); is rank {peer} gone?"
                ) from err

    def _sending_to(self, peer: int) -> socket.socket:
        """The connection to `peer`, made on its first message (on the waiter thread of that peer's sends)."""
        with self._lock:
            sock = self._out.get(peer)
        if sock is not None:
            return sock
        where = self._store_now().get(f"{self.namespace}/{peer}").decode()
        host, port = where.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        except OSError as err:
            raise ConnectionError(f"rank {self.rank}: cannot connect to rank {peer} at {where}: {err}") from err
        _tune(sock)
        sock.sendall(HELLO.pack(self.rank))
        with self._lock:
            self._out[peer] = sock
            self.connections += 1
        return sock

    def _receiving_from(self, peer: int) -> socket.socket:
        with self._lock:
            if not self._lock.wait_for(
                lambda: peer in self._in or self._accept_error is not None or self._closed, self.timeout_s
            ):
                raise ConnectionError(f"rank {self.rank}: rank {peer} did not connect within {self.timeout_s:g} s")
            if peer in self._in:
                return self._in[peer]
            raise ConnectionError(
                f"rank {self.rank}: no connection from rank {peer}: {self._accept_error or 'the wire is closed'}"
            )

    def wait(self, work: _Message) -> None:
        payload = _bytes_of(work.tensor)
        if work.send:
            sock = self._sending_to(work.peer)
            if work.peer in self._granted_to:
                self._await_grant(sock, work)
            try:
                _send_all(sock, HEADER.pack(work.tag, len(payload)), payload)
            except OSError as err:
                raise ConnectionError(
                    f"rank {self.rank}: sending {work.name} to rank {work.peer}: the connection "
                    f"broke ({err}); is rank {work.peer} gone?"
                ) from err
            return
        sock = self._receiving_from(work.peer)
        header = bytearray(HEADER.size)
        _recv_exact(sock, memoryview(header), work.name, self.rank, f"rank {work.peer}")
        tag, nbytes = HEADER.unpack(header)
        if tag != work.tag or nbytes != len(payload):
            raise OrderError(
                f"rank {self.rank}: the next message from rank {work.peer} has tag {tag} and {nbytes} "
                f"bytes; the receive posted for {work.name} has tag {work.tag} and {len(payload)} bytes: "
                f"the two ranks issue their messages in different orders"
            )
        _recv_exact(sock, payload, work.name, self.rank, f"rank {work.peer}")

    def _await_grant(self, sock: socket.socket, work: _Message) -> None:
        grant = bytearray(GRANT.size)
        _recv_exact(sock, memoryview(grant), f"the receive posted for {work.name}", self.rank, f"rank {work.peer}")
        (posted,) = GRANT.unpack(grant)
        if posted != work.tag:
            raise OrderError(
                f"rank {self.rank}: rank {work.peer} posted its next receive from this rank for tag "
                f"{posted}; this rank's next send to it, {work.name}, has tag {work.tag}: the two ranks "
                f"issue their messages in different orders"
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._out, self._in = [*self._out.values(), *self._in.values()], {}, {}
            listener, self._listener = self._listener, None
            self._lock.notify_all()
        for sock in ([listener] if listener is not None else []) + socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Close `sock` and wake a thread blocked on it (accept or recv): close() alone does not, on Linux. A
    send's bytes still in the kernel's buffer leave before the end of the stream."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # never connected, or the peer is gone already
    sock.close()


def _namespace(pairs: list[tuple[int, int]]) -> str:
    """The store's keys for this wire: its pair set and how many wires of that set this process built."""
    digest = hashlib.sha1(repr(pairs).encode()).hexdigest()[:16]
    with _WIRES_LOCK:
        _WIRES[digest] += 1
        return f"meshjob/tcpwire/{digest}/{_WIRES[digest]}"


def local_address(store: Any) -> str:
    """This host's address for peers: GLOO_SOCKET_IFNAME's (its first interface), else the source
    address of a route to the store's host."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(store.host), 9))  # no packet leaves: it only picks a route
        return probe.getsockname()[0]


def _tune(sock: socket.socket) -> None:
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a chunk leaves now, not with the next
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _checked(tensor: torch.Tensor, message: str) -> torch.Tensor:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{message}: the TCP wire carries contiguous CPU tensors, got a "
            f"{'non-contiguous ' if not tensor.is_contiguous() else ''}{tensor.device} tensor"
        )
    return tensor


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def _send_all(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    views = [v for v in (memoryview(header), payload) if len(v)]
    while views:
        sent = sock.sendmsg(views)  # one system call for header and payload, mostly
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _recv_exact(sock: socket.socket, view: memoryview, name: str, rank: int, peer: str) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        except OSError as err:
            raise ConnectionError(f"rank {rank}: receiving {name} from {peer}: the connection broke ({err})") from err
        if n == 0:
            raise ConnectionError(
                f"rank {rank}: {peer} closed its connection before {name} arrived ({got} of {len(view)} bytes)"
            )
        got += n
