"""An emulated cluster on one machine: one network namespace per host, joined by a bridge.

Layout:
    mj<pid>_sw   holds bridge br0 and the switch end h<i> of every host's veth
    mj<pid>_h<i> holds eth0 (10.77.0.<i+1>/16) and lo
tbf on eth0 throttles what host i sends, tbf on h<i> what it receives: together they are its NIC.
Each host's address has a name, meshjob-host<i>, in a hosts file a rank sees in place of /etc/hosts
(EmulatedHost.enter), as `ip netns exec` would show it /etc/netns/<name>/hosts.
Interfaces are created directly inside the namespaces, so the root namespace is never touched.

Without root or without `ip`, the cluster falls back to loopback (every host is 127.0.0.1,
no throttling) with a warning; `emulated` is then False and results must say so.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any

from meshjob.spec.api import MASTER_PORT
from meshjob.units import parse_rate
from meshjob_trainer.procs import pid_alive

NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
HOSTS_FILE = "/etc/hosts"
SUBNET = "10.77"
IFNAME = "eth0"
_NAME_RE = re.compile(r"^mj(\d+)_(h\d+|sw)$")
_HOSTS_FILE_RE = re.compile(r"^mj(\d+)_.*\.hosts$")  # write_hosts_file's, in the temporary folder


class EmulationError(RuntimeError):
    """A namespace, link or qdisc could not be set up; the message has the failing command."""


def netns_available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why (for the warning)."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "`ip`/`tc` (iproute2) not found"
    return True, ""


def _ip(*args: str) -> None:
    cmd = ["ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _tc(ns: str, dev: str, rate: str, burst: str, latency: str) -> None:
    _ip(
        "netns",
        "exec",
        ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        burst,
        "latency",
        latency,
    )


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def cleanup_stale() -> list[str]:
    """Delete namespaces (and hosts files) left by meshjob runs whose process is gone; returns the
    namespaces' names."""
    removed = []
    for name in list_netns():
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    for name in os.listdir(tempfile.gettempdir()):
        m = _HOSTS_FILE_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tempfile.gettempdir(), name))
    return removed


def setns(name: str) -> None:
    """Move the calling process into network namespace `name` (call before making sockets).

    Python 3.11's os has no setns, so libc's is called through ctypes; a forked child uses this
    instead of `ip netns exec`, which would re-import torch in every rank.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def host_name(index: int) -> str:
    """The name of emulated host `index` in the cluster's hosts file."""
    return f"meshjob-host{index}"


def see_hosts_file(path: str) -> bool:
    """Give the calling process (a forked rank) its own /etc/hosts: `path` bind-mounted over it in a mount
    namespace of its own, which the rest of the machine never sees. Why: inside a host's namespace the
    machine's DNS server cannot be reached, so a reverse lookup of another host's address failed and c10d's
    store warned "The hostname of the client socket cannot be retrieved" once for every rank of every run;
    from the file the address has its name. False where the kernel refuses (no CAP_SYS_ADMIN): the names
    are then missing, nothing else."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    # private first: the bind below must not propagate to the machine's mount namespace
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    return libc.mount(path.encode(), HOSTS_FILE.encode(), None, MS_BIND, None) == 0


def write_hosts_file(prefix: str, addresses: Sequence[str]) -> str:
    """A hosts file: the machine's own entries, then every emulated host's address and name; its path."""
    try:
        with open(HOSTS_FILE) as machine:
            lines = machine.read().rstrip("\n").splitlines()
    except OSError:
        lines = ["127.0.0.1 localhost"]
    lines += [f"{address} {host_name(i)}" for i, address in enumerate(addresses)]
    # and each as an IPv4-mapped IPv6 address: how a dual-stack listener (c10d's store) sees its peers
    lines += [f"::ffff:{address} {host_name(i)}" for i, address in enumerate(addresses)]
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".hosts")
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.chmod(path, 0o644)
    return path


@dataclass(frozen=True)
class GangPlace:
    """The launcher's arguments for a gang on this cluster (meshjob_trainer.launch.launch)."""

    master_addr: str
    master_port: int | None  # None: the launcher picks a free one
    pre_exec: Callable[[int], None]  # in each forked rank: enter its host

    def launch_args(self) -> dict[str, Any]:
        return {"master_addr": self.master_addr, "master_port": self.master_port, "pre_exec": self.pre_exec}


@dataclass(frozen=True)
class EmulatedHost:
    index: int
    netns: str | None  # None in the loopback fallback
    address: str  # where ranks on this host listen
    ifname: str  # GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for ranks on this host
    hosts_file: str | None = None  # the cluster's names of its hosts (see_hosts_file); None: none

    def enter(self) -> None:
        """Join this host's namespace (in a forked child, before any socket), see the cluster's hosts file
        as /etc/hosts, and bind gloo and NCCL to the host's NIC. Both read their settings from the
        environment only, so these are the variables a rank sets: for them, never for meshjob. NCCL also
        learns which ranks share a host from NCCL_HOSTID (else from the machine's name): ranks of different
        emulated hosts then talk through their NICs, not through NVLink or shared memory
        (meshjob_trainer.dist.nccl_host_id adds a rank's own suffix where ranks share a GPU)."""
        if self.netns is not None:
            setns(self.netns)
        if self.hosts_file is not None:
            see_hosts_file(self.hosts_file)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = self.ifname
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-emulated-host{self.index}"


DEFAULT_BURST = "128kb"  # tc tbf's bucket per NIC


class EmulatedCluster:
    """Context manager: `with EmulatedCluster(4, "1gbit") as c: c.hosts[i].enter() ...`.

    Always removes what it made: on normal exit, on exceptions, on SIGTERM (turned into
    SystemExit while the cluster is up) and, as a last resort, at interpreter exit.
    """

    def __init__(
        self,
        num_hosts: int,
        nic_rate: str = "1gbit",
        burst: str = DEFAULT_BURST,
        latency: str = "10ms",
        use_netns: bool = True,
        prefix: str | None = None,
    ):
        if num_hosts < 1 or num_hosts > 250:
            raise ValueError(f"num_hosts: {num_hosts!r} is invalid: between 1 and 250")
        self.rate_bytes_per_s = parse_rate(nic_rate, "nic_rate")
        self.num_hosts = num_hosts
        self.nic_rate = nic_rate
        self.burst = burst
        self.latency = latency
        self.prefix = prefix or f"mj{os.getpid()}_"
        self.use_netns = use_netns
        self.fallback_reason = "" if use_netns else "--no-netns"
        self.hosts: list[EmulatedHost] = []
        self._made: list[str] = []
        self._hosts_file: str | None = None
        self._old_sigterm: Callable | int | None = None
        self._owner_pid = os.getpid()

    @property
    def emulated(self) -> bool:
        return bool(self.hosts) and self.hosts[0].netns is not None

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    @property
    def nic_bytes_per_s(self) -> float:
        return self.rate_bytes_per_s

    def __enter__(self) -> EmulatedCluster:
        self._install_sigterm()
        atexit.register(self.close)
        if self.use_netns:
            ok, why = netns_available()
            if not ok:
                self.fallback_reason = why
                self.use_netns = False
        if self.use_netns:
            try:
                self._create()
            except EmulationError as err:  # e.g. root without CAP_SYS_ADMIN in a container
                self.close()
                self._install_sigterm()
                self.hosts = []
                self.use_netns = False
                self.fallback_reason = f"namespaces could not be made: {err}"
            except BaseException:
                self.close()
                raise
        if not self.use_netns:
            warnings.warn(
                f"emulated cluster: no network namespaces ({self.fallback_reason}); "
                f"all {self.num_hosts} hosts share loopback, NIC rate "
                f"{self.nic_rate} is NOT applied",
                RuntimeWarning,
                stacklevel=2,
            )
            self.hosts = [EmulatedHost(i, None, "127.0.0.1", "lo") for i in range(self.num_hosts)]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _create(self) -> None:
        sw = self.switch_ns
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.num_hosts):
            ns = self.host_ns(i)
            _ip("netns", "add", ns)
            self._made.append(ns)
            peer = f"h{i}"
            _ip("-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", peer, "netns", sw)
            addr = f"{SUBNET}.{i // 250}.{i % 250 + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/16", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "set", peer, "master", "br0")
            _ip("-n", sw, "link", "set", peer, "up")
            # both directions: what the host sends (eth0) and what it receives (switch port)
            _tc(ns, IFNAME, self.nic_rate, self.burst, self.latency)
            _tc(sw, peer, self.nic_rate, self.burst, self.latency)
            self.hosts.append(EmulatedHost(i, ns, addr, IFNAME))
        try:
            self._hosts_file = write_hosts_file(self.prefix, [host.address for host in self.hosts])
        except OSError:  # no writable temporary folder: the hosts go without names, nothing else
            return
        self.hosts = [replace(host, hosts_file=self._hosts_file) for host in self.hosts]

    def close(self) -> None:
        """Delete every namespace this cluster made (idempotent; only in the creating process)."""
        if os.getpid() != self._owner_pid:
            return  # a forked rank must not tear down the cluster
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        if self._hosts_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._hosts_file)
            self._hosts_file = None
        self._restore_sigterm()
        atexit.unregister(self.close)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def gang(self, rank_hosts: Sequence[int]) -> GangPlace:
        """Where the ranks of a gang live: rank r on host rank_hosts[r], rendezvous on rank 0's host."""
        hosts = [self.hosts[h] for h in rank_hosts]
        # inside fresh namespaces torchrun's port is free; on loopback another run may hold it
        return GangPlace(hosts[0].address, MASTER_PORT if self.emulated else None, lambda rank: hosts[rank].enter())

    def describe(self) -> str:
        if self.emulated:
            return (
                f"{self.num_hosts} emulated hosts (network namespaces {self.prefix}h*), "
                f"NIC {self.nic_rate} each (tbf, burst {self.burst})"
            )
        return f"{self.num_hosts} hosts on loopback ({self.fallback_reason}): NIC rate {self.nic_rate} NOT applied"


def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds the with-blocks, so the namespaces are deleted on `kill <pid>`
    raise SystemExit(128 + signum)
