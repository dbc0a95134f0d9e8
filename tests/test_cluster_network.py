"""The local cluster's network: pods on different Nodes reach each other through their Nodes' NICs, pods of one
Node through its bridge, and the root namespace (API server, Prometheus) reaches every pod; names are the ones
cluster DNS would give; `down` leaves no namespace or route behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshjob_cluster.dns import hosts_text, names_of, write_in_place
from meshjob_cluster.network import ROOT_ADDRESS, ClusterNetwork, node_address, pod_cidr

SERVE = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); print('listening', flush=True)\n"
    "c, peer = s.accept(); n = 0\n"
    "while (d := c.recv(1 << 16)): n += len(d)\n"
    "print(n, peer[0])\n"
)


def _netns(ns: str | None) -> list[str]:
    return ["ip", "netns", "exec", ns] if ns else []


def transfer(src: str | None, dst: str | None, ip: str, port: int, nbytes: int) -> tuple[int, str]:
    """Bytes the listener in `dst` received from a sender in `src`, and the address it saw them from."""
    server = subprocess.Popen([*_netns(dst), sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    send = f"import socket; s = socket.create_connection(('{ip}', {port}), timeout=10); s.sendall(b'x' * {nbytes})"
    subprocess.run([*_netns(src), sys.executable, "-c", send], check=True, timeout=60)
    out, _ = server.communicate(timeout=60)
    got, peer = out.split()
    return int(got), peer


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip")
def test_pods_reach_each_other_and_the_root_namespace_and_down_leaves_nothing():
    net = ClusterNetwork(nodes=2, nic_rate="500mbit", prefix="mjtst")
    net.down()
    try:
        net.up()
        a, b, c = net.add_pod(0), net.add_pod(1), net.add_pod(0)
        assert (a.ip, b.ip, c.ip) == ("203.0.113.2", "203.0.113.18", "203.0.113.3")
        assert transfer(a.netns, b.netns, b.ip, 5101, 1 << 20) == (1 << 20, a.ip)  # across two NICs, routed
        assert transfer(a.netns, c.netns, c.ip, 5102, 1 << 20) == (1 << 20, a.ip)  # one Node's bridge
        assert transfer(None, b.netns, b.ip, 5103, 1000) == (1000, ROOT_ADDRESS)  # the API server to a pod
        assert transfer(b.netns, None, ROOT_ADDRESS, 5104, 1000) == (1000, b.ip)  # a pod to the API server
        qdiscs = subprocess.run(
            ["ip", "netns", "exec", net.node_netns(0), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdiscs and "rate 500Mbit" in qdiscs
        net.remove_pod(c)
        assert net.add_pod(0).ip == c.ip  # the freed address is reused
    finally:
        removed = net.down()
    assert {"mjtst_n0", "mjtst_n1", "mjtst_sw"} <= set(removed)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mjtst_" not in left
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert pod_cidr(0).split("/")[0] not in routes and node_address(0) not in routes


def _pod(name: str, ip: str | None, hostname: str | None = None, subdomain: str | None = None) -> dict:
    pod: dict = {"metadata": {"name": name, "namespace": "ml"}, "spec": {}, "status": {}}
    if hostname:
        pod["spec"] = {"hostname": hostname, "subdomain": subdomain}
    if ip:
        pod["status"]["podIP"] = ip
    return pod


def test_a_pod_of_a_headless_service_has_the_names_cluster_dns_gives():
    assert names_of(_pod("job-0", None, "job-0", "job")) == [
        "job-0.job.ml.svc.cluster.local",
        "job-0.job.ml.svc",
        "job-0.job.ml",
        "job-0.job",
    ]
    assert names_of(_pod("web", None)) == []


def test_the_hosts_file_lists_the_pods_with_addresses_and_names(tmp_path: Path):
    me = _pod("job-1", "203.0.113.18", "job-1", "job")
    pods = [_pod("job-0", "203.0.113.2", "job-0", "job"), me, _pod("job-2", None, "job-2", "job"), _pod("x", "1.2.3.4")]
    text = hosts_text(me, "203.0.113.18", pods)
    assert "203.0.113.18 job-1\n" in text
    assert "203.0.113.2 job-0.job.ml.svc.cluster.local job-0.job.ml.svc job-0.job.ml job-0.job\n" in text
    assert "job-2" not in text and "1.2.3.4" not in text  # no address yet; no DNS name
    path = tmp_path / "hosts"
    assert write_in_place(path, text) and not write_in_place(path, text)
    inode = path.stat().st_ino
    assert write_in_place(path, text + "# more\n") and path.stat().st_ino == inode
