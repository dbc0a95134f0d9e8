"""The emulated cluster: namespaces made and always removed, tbf really throttles, loopback fallback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from meshjob.units import parse_rate
from meshjob_trainer.emulate.netns import EmulatedCluster, cleanup_stale, list_netns, netns_available, write_hosts_file
from meshjob_trainer.launch import RankContext, launch, launch_with_restarts

HAVE_NETNS, WHY_NOT = netns_available()
netns = pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")


def ours(prefix: str) -> list[str]:
    return [n for n in list_netns() if n.startswith(prefix)]


def test_parse_rate_reads_tc_units():
    assert parse_rate("1gbit") == 1e9 / 8  # bytes per second
    assert parse_rate("500mbit") == 5e8 / 8
    assert parse_rate("125mbps") == 1.25e8  # tc's "bps" units are bytes


def test_parse_rate_error_names_field_value_and_allowed_units():
    with pytest.raises(ValueError, match=r"nic_rate: '1 gigabit' is invalid: a positive tc rate"):
        parse_rate("1 gigabit", "nic_rate")


@pytest.mark.netns
@netns
def test_cluster_makes_one_namespace_per_host_plus_switch_and_removes_them():
    with EmulatedCluster(3, "1gbit", prefix="mjt1_") as c:
        assert ours("mjt1_") == ["mjt1_h0", "mjt1_h1", "mjt1_h2", "mjt1_sw"]
        assert c.emulated and [h.address for h in c.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        qdiscs = subprocess.run(
            ["ip", "netns", "exec", "mjt1_sw", "tc", "qdisc", "show"], capture_output=True, text=True
        ).stdout
        assert qdiscs.count("tbf") == 3  # the switch end of every host's veth (receive side)
    assert ours("mjt1_") == []


@pytest.mark.netns
@netns
def test_addresses_exist_only_inside_namespaces():
    with EmulatedCluster(2, prefix="mjt2_"):
        root = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        assert "10.77." not in root


@pytest.mark.netns
@netns
def test_cleanup_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, prefix="mjt3_"):
            raise RuntimeError("boom")
    assert ours("mjt3_") == []


@pytest.mark.netns
@pytest.mark.slow
@netns
def test_cleanup_after_sigterm_of_the_process(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from meshjob_trainer.emulate.netns import EmulatedCluster
        with EmulatedCluster(2, prefix="mjt4_"):
            print("up", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(ours("mjt4_")) == 3
        proc.terminate()
        assert proc.wait(timeout=20) == 128 + 15
    finally:
        proc.kill()
    assert ours("mjt4_") == []


@pytest.mark.netns
@netns
def test_cleanup_stale_removes_namespaces_of_dead_runs_only():
    proc = subprocess.Popen(["true"])
    proc.wait()
    stale = f"mj{proc.pid}_h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    stale_hosts_file = write_hosts_file(f"mj{proc.pid}_", ["10.77.0.1"])
    try:
        with EmulatedCluster(1) as live:
            removed = cleanup_stale()
            assert stale in removed and not os.path.exists(stale_hosts_file)
            assert ours(live.prefix) == [live.host_ns(0), live.switch_ns]
            assert os.path.exists(live.hosts[0].hosts_file)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def _receiver(address: str) -> tuple[int, float]:
    """(bytes received, seconds) of one TCP transfer to `address`."""
    with socket.create_server((address, 5001)) as srv:
        conn, _ = srv.accept()
        with conn:
            got = 0
            t0 = time.monotonic()
            while chunk := conn.recv(1 << 20):
                got += len(chunk)
            return got, time.monotonic() - t0


def _sender(nbytes: int, address: str):
    def send() -> None:
        for _ in range(100):  # wait for the receiver's listen
            try:
                conn = socket.create_connection((address, 5001))
                break
            except OSError:
                time.sleep(0.05)
        with conn:
            conn.sendall(b"\0" * nbytes)

    return send


@pytest.mark.netns
@pytest.mark.slow
@netns
def test_tbf_throttles_a_tcp_transfer_between_two_hosts_to_the_nic_rate():
    nbytes, rate = 4 << 20, 100e6  # 4 MiB at 100 mbit: >= 0.34 s
    with EmulatedCluster(2, "100mbit", prefix="mjt5_") as c:
        address, send = c.hosts[1].address, _sender(nbytes, c.hosts[1].address)
        result = launch(2, lambda ctx: _receiver(address) if ctx.rank == 0 else send(), **c.gang([1, 0]).launch_args())
    assert result.ok, result
    received, seconds = result.values[0]
    assert received == nbytes
    burst = 128 * 1024  # tbf lets one burst through at line speed
    assert seconds >= (nbytes - burst) * 8 / rate


def _name_of(address: str):
    return lambda ctx: socket.getnameinfo((address, 0), 0)[0]


@pytest.mark.netns
@netns
def test_a_rank_resolves_every_emulated_host_by_name_and_the_machine_keeps_its_hosts_file():
    with open("/etc/hosts") as f:
        machine_hosts = f.read()
    with EmulatedCluster(2, prefix="mjt7_") as c:
        result = launch(1, _name_of(c.hosts[1].address), **c.gang([0]).launch_args())
        hosts_file = c.hosts[0].hosts_file
        with open("/etc/hosts") as f:
            assert f.read() == machine_hosts
    assert result.ok, result
    assert result.values == ["meshjob-host1"]
    assert hosts_file is not None and not os.path.exists(hosts_file)  # removed with the cluster


@pytest.mark.netns
@netns
def test_hosts_without_a_hosts_file_still_make_a_cluster(monkeypatch):
    import meshjob_trainer.emulate.netns as netns_module

    def unwritable(prefix: str, addresses: list[str]) -> str:
        raise PermissionError(13, "Permission denied", "/tmp")

    monkeypatch.setattr(netns_module, "write_hosts_file", unwritable)
    with EmulatedCluster(2, prefix="mjt9_") as c:
        assert c.emulated and [h.hosts_file for h in c.hosts] == [None, None]
        result = launch(1, lambda ctx: "up", **c.gang([0]).launch_args())
    assert result.values == ["up"]


def _store_gang(ctx: RankContext) -> None:
    from meshjob_trainer.dist import init_distributed

    init_distributed(ctx.env, backend="gloo")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.netns
@pytest.mark.slow
@netns
def test_a_gang_across_hosts_starts_without_hostname_warnings(capfd):
    with EmulatedCluster(3, prefix="mjt8_") as c:
        result = launch(3, _store_gang, **c.gang([0, 1, 2]).launch_args())
    assert result.ok, result
    assert "hostname of the client socket cannot be retrieved" not in capfd.readouterr().err


def test_loopback_fallback_warns_and_says_the_rate_is_not_applied():
    with pytest.warns(RuntimeWarning, match="NIC rate 1gbit is NOT applied"):
        with EmulatedCluster(2, use_netns=False) as c:
            assert not c.emulated
            assert [h.address for h in c.hosts] == ["127.0.0.1", "127.0.0.1"]
            assert "NOT applied" in c.describe()


@pytest.mark.slow
def test_gang_kills_the_other_ranks_when_one_fails():
    def target(ctx: RankContext) -> None:
        if ctx.rank == 1:
            raise SystemExit(3)
        time.sleep(60)  # would hang in a collective; the launcher must kill it

    with pytest.warns(RuntimeWarning):
        with EmulatedCluster(2, use_netns=False) as c:
            t0 = time.monotonic()
            result = launch(2, target, **c.gang([0, 1]).launch_args())
    assert not result.ok and result.first_failure.rank == 1 and result.first_failure.exit_code == 3
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_gang_restarts_after_a_killed_rank_and_reports_each_attempt():
    def target(ctx: RankContext) -> None:
        if ctx.rank == 0 and ctx.attempt == 0:
            os.kill(os.getpid(), 9)
        ctx.events.emit(("attempt", ctx.attempt))

    events: list[tuple[int, tuple[str, int]]] = []
    with pytest.warns(RuntimeWarning):
        with EmulatedCluster(1, use_netns=False) as c:
            results = launch_with_restarts(
                2,
                target,
                max_restarts=2,
                on_event=lambda rank, e: events.append((rank, e)),
                **c.gang([0, 0]).launch_args(),
            )
    assert [r.ok for r in results] == [False, True] and [r.attempt for r in results] == [0, 1]
    assert results[0].first_failure.describe() == "rank 0 killed by SIGKILL"
    assert {rank for rank, (_, attempt) in events if attempt == 1} == {0, 1}


def test_namespaces_that_cannot_be_made_fall_back_to_loopback_naming_the_reason(monkeypatch):
    import meshjob_trainer.emulate.netns as netns_module

    made: list[tuple[str, ...]] = []

    def refuse(*args: str) -> None:
        made.append(args)
        if len(made) > 1:  # the switch namespace exists, then the next command is refused
            raise netns_module.EmulationError("`ip link add` failed: Operation not permitted")

    monkeypatch.setattr(netns_module, "netns_available", lambda: (True, ""))
    monkeypatch.setattr(netns_module, "_ip", refuse)
    deleted: list[list[str]] = []
    monkeypatch.setattr(netns_module.subprocess, "run", lambda cmd, **kw: deleted.append(cmd))
    with pytest.warns(RuntimeWarning, match="Operation not permitted"):
        with EmulatedCluster(2, prefix="mjt6_") as c:
            assert not c.emulated and c.hosts[1].address == "127.0.0.1"
    assert ["ip", "netns", "del", "mjt6_sw"] in deleted  # what was made is removed
