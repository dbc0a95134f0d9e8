"""`meshjob cluster up|down|status`: a local Kubernetes cluster where meshjob's pods run, for users without
docker and for the tests, like kind.

`up` starts the control plane (meshjob_cluster.control), lays the network (meshjob_cluster.network: every Node
a namespace with `tc tbf` as its NIC) and one node agent per Node (meshjob_cluster.agent), waits for the Nodes
to be Ready, and prints the `export KUBECONFIG=...` line. `down` stops them all and removes every namespace,
mount and folder `up` made. Needs root (namespaces, mounts) and KUBEBUILDER_ASSETS (kube-apiserver,
kube-controller-manager, kube-scheduler; etcd from there or PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshjob.errors import UsageError
from meshjob_cluster.control import ControlPlane, free_port, stop_process
from meshjob_cluster.network import MAX_NODES, ROOT_ADDRESS, ClusterNetwork, node_address
from meshjob_cluster.prometheus import monitor_crds

HELP = "a local Kubernetes cluster where meshjob's pods run: up, down, status"
DEFAULT_DIR = Path("/var/tmp/meshjob-cluster")
PREFIX = "mjc"


@dataclass(frozen=True)
class State:
    """What `up` started, for `down` and `status` (state.json in the cluster's folder)."""

    nodes: int
    devices_per_node: int
    device_resource: str
    nic_rate: str
    images: bool
    api_port: int
    etcd_port: int
    agent_pids: tuple[int, ...]
    daemon_pid: int
    prometheus_port: int
    kubeconfig: str

    @classmethod
    def read(cls, folder: Path) -> State | None:
        path = folder / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["agent_pids"] = tuple(data["agent_pids"])
        return cls(**data)

    def write(self, folder: Path) -> None:
        (folder / "state.json").write_text(json.dumps(asdict(self), indent=2) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start the cluster")
    up.add_argument("--nodes", type=int, default=2, help=f"Nodes (1 to {MAX_NODES}; default 2)")
    up.add_argument("--devices-per-node", type=int, default=2, help="devices each Node offers (default 2)")
    up.add_argument("--device-resource", default="cpu", help="the devices' resource name (default cpu)")
    up.add_argument("--nic-rate", default="1gbit", help="each Node's NIC, as tc writes rates (default 1gbit)")
    up.add_argument("--images", action="store_true", help="run pods in their built images (tests/images.sh)")
    down = sub.add_parser("down", help="stop everything up started and remove what it made")
    status = sub.add_parser("status", help="the Nodes, and the KUBECONFIG line")
    for each in (up, down, status):
        each.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's folder (default {DEFAULT_DIR})")


def _assets() -> Path:
    found = os.environ.get("KUBEBUILDER_ASSETS")
    if not found or not (Path(found) / "kube-apiserver").is_file():
        raise UsageError(
            f"KUBEBUILDER_ASSETS {found!r} is invalid: a folder holding kube-apiserver, "
            "kube-controller-manager and kube-scheduler (etcd from there or PATH)"
        )
    return Path(found)


def _kubectl(kubeconfig: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True)


def up(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise UsageError("meshjob cluster up: needs root (network namespaces, mounts)")
    if not 1 <= args.nodes <= MAX_NODES:
        raise UsageError(f"--nodes {args.nodes!r} is invalid: 1 to {MAX_NODES}")
    if args.devices_per_node < 1:
        raise UsageError(f"--devices-per-node {args.devices_per_node!r} is invalid: an integer >= 1")
    folder: Path = args.dir
    if State.read(folder) is not None:
        raise UsageError(f"a cluster already runs from {folder}: `meshjob cluster down --dir {folder}` first")
    assets = _assets()
    folder.mkdir(parents=True, exist_ok=True)
    network = ClusterNetwork(nodes=args.nodes, nic_rate=args.nic_rate, prefix=PREFIX)
    network.down()  # what a crashed run left
    control = ControlPlane(assets, folder / "control", free_port(), free_port(), (ROOT_ADDRESS,))
    pids: list[int] = []
    prometheus_port = free_port()
    try:
        network.up()
        control.start()
        _apply(str(control.kubeconfig), monitor_crds())
        pids.append(_start_daemon(folder, control, prometheus_port))
        for i in range(args.nodes):
            pids.append(_start_agent(args, folder, control, i))
        state = State(
            nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            device_resource=args.device_resource,
            nic_rate=args.nic_rate,
            images=args.images,
            api_port=control.api_port,
            etcd_port=control.etcd_port,
            agent_pids=tuple(pids[1:]),
            daemon_pid=pids[0],
            prometheus_port=prometheus_port,
            kubeconfig=str(control.kubeconfig),
        )
        state.write(folder)
        _wait_ready(str(control.kubeconfig), args.nodes)
    except BaseException:
        for pid in reversed(pids):
            stop_process(pid, grace=30)
        control.stop()
        network.down()
        (folder / "state.json").unlink(missing_ok=True)
        raise
    print(
        f"meshjob cluster: {args.nodes} Nodes x {args.devices_per_node} {args.device_resource}, NICs "
        f"{args.nic_rate}, pods {'in their images' if args.images else 'on this machine'}; logs in {folder}"
    )
    print(f"Prometheus (the chart's monitors and rules, once installed): http://127.0.0.1:{prometheus_port}")
    print(f"export KUBECONFIG={control.kubeconfig}")
    return 0


def _apply(kubeconfig: str, objects: list[dict[str, Any]]) -> None:
    done = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", "apply", "-f", "-"],
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl apply: {done.stderr.strip()}")


def _start_daemon(folder: Path, control: ControlPlane, prometheus_port: int) -> int:
    argv = [
        sys.executable,
        "-m",
        "meshjob_cluster.daemon",
        f"--kubeconfig={control.kubeconfig}",
        f"--dir={folder / 'prometheus'}",
        f"--claims={folder / 'claims'}",
        f"--prometheus-port={prometheus_port}",
    ]
    with open(folder / "daemon.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return proc.pid


def _start_agent(args: argparse.Namespace, folder: Path, control: ControlPlane, index: int) -> int:
    node = f"node-{index}"
    state_dir = folder / "nodes" / node
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "meshjob_cluster.agent",
        f"--kubeconfig={control.kubeconfig}",
        f"--node={node}",
        f"--node-index={index}",
        f"--network-prefix={PREFIX}",
        *_device_flags(args.devices_per_node, args.device_resource),
        f"--address={node_address(index)}",
        f"--claims={folder / 'claims'}",
        f"--state-dir={state_dir}",
        f"--api-host={ROOT_ADDRESS}",
        f"--api-port={control.api_port}",
    ]
    if args.images:
        argv.append("--images")
    with open(state_dir / "agent.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return proc.pid


def _device_flags(devices: int, resource: str) -> list[str]:
    """A Node's devices as the agent's flags. Devices counted in CPUs come with one CPU more, for the cluster's
    own pods (the operator asks for 100m: the scheduler and the operator's placement would count it as one)."""
    if resource == "cpu":
        return [f"--cpu={devices + 1}"]
    return [f"--devices={devices}", f"--device-resource={resource}"]


def _wait_ready(kubeconfig: str, nodes: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    ready = 0
    while time.monotonic() < deadline:
        out = _kubectl(kubeconfig, "get", "nodes", "-o", "json")
        if out.returncode == 0:
            items = json.loads(out.stdout)["items"]
            ready = sum(
                any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
                and not any(t["key"] == "node.kubernetes.io/not-ready" for t in n.get("spec", {}).get("taints", []))
                for n in items
            )
            if ready == nodes:
                return
        time.sleep(1)
    raise RuntimeError(f"only {ready} of {nodes} Nodes became Ready within {timeout:g} s")


def down(args: argparse.Namespace) -> int:
    folder: Path = args.dir
    state = State.read(folder)
    for pid in state.agent_pids if state else ():
        stop_process(pid, grace=60)  # an agent stops its pods within their grace periods first
    if state is not None:
        stop_process(state.daemon_pid, grace=30)
    control = ControlPlane(Path("/"), folder / "control", 0, 0)
    stopped = control.stop()
    removed = ClusterNetwork(nodes=state.nodes if state else 1, prefix=PREFIX).down()
    shutil.rmtree(folder, ignore_errors=True)
    print(
        f"meshjob cluster: stopped {len(state.agent_pids) if state else 0} node agents, {', '.join(stopped) or 'no'} "
        f"control plane components; removed {len(removed)} namespaces and {folder}"
    )
    return 0


def status(args: argparse.Namespace) -> int:
    state = State.read(args.dir)
    if state is None:
        print(f"meshjob cluster: none runs from {args.dir}")
        return 1
    nodes = _kubectl(state.kubeconfig, "get", "nodes", "-o", "wide")
    print(nodes.stdout or nodes.stderr)
    print(f"Prometheus: http://127.0.0.1:{state.prometheus_port}")
    print(f"export KUBECONFIG={state.kubeconfig}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"up": up, "down": down, "status": status}[args.action](args)
