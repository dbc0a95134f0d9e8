"""The images, built from the Dockerfile as it stands (tests/images.sh, buildah), run as a pod runs them:
as uid 10001, a read-only root filesystem and only the volumes the operator mounts (meshjob_cluster runs
the containers, as its node agent does).

The trainer image trains a job the operator rendered (its pod, its ConfigMap, a checkpoint claim) to the
end and writes a checkpoint; the operator image has no torch, starts against a real API server and
serves /healthz."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity

from meshjob.cluster.nodes import host_pods, plan_on_nodes
from meshjob.plan.rendered import render as render_files
from meshjob.spec.manifest import job_to_dict, parse_job
from meshjob_cluster import volumes
from meshjob_cluster.container import ContainerRun, Mount, image_env, remove_scratch, start
from meshjob_cluster.images import image_root
from meshjob_cluster.podspec import PodPlace, container_run
from meshjob_operator import render
from meshjob_operator.testing import envtest_assets, envtest_cluster

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"
CAN_BUILD = os.geteuid() == 0 and shutil.which("apt-get") is not None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # the first build on a fresh machine: the base, then torch's layer
    pytest.mark.skipif(not CAN_BUILD, reason="building images needs root (buildah's vfs storage, chroot)"),
]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """The three targets, built once (cached by tests/images.sh: a rebuild of unchanged files takes seconds)."""
    done = subprocess.run(["bash", "tests/images.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    built = done.stdout.split()
    assert built == [f"localhost/meshjob/operator:{VERSION}", f"localhost/meshjob/trainer:{VERSION}"], done.stdout
    assert "trainer-cuda built up to its torch layer only" in done.stderr
    return {"operator": built[0], "trainer": built[1]}


def test_the_images_hold_this_trees_code(images):
    """A rebuild after a code change installs the changed code (the wheels' layer is not cached by its text)."""
    sources = {"meshjob": ROOT / "meshjob", "meshjob_operator": ROOT / "operator" / "meshjob_operator"}
    sources["meshjob_trainer"] = ROOT / "trainer" / "meshjob_trainer"
    for target, packages in (
        ("operator", ("meshjob", "meshjob_operator")),
        ("trainer", ("meshjob", "meshjob_trainer")),
    ):
        root, _ = image_root(images[target])
        (site,) = root.glob("usr/local/lib/python3*/dist-packages")
        for package in packages:
            stale = [
                str(path.relative_to(sources[package]))
                for path in sources[package].rglob("*.py")
                if (site / package / path.relative_to(sources[package])).read_bytes() != path.read_bytes()
            ]
            assert not stale, f"{target} image: {package} differs from this tree in {stale[:5]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(run: ContainerRun, log: Path, timeout: float) -> tuple[int, str]:
    proc, scratch = start(run, log)
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        remove_scratch(scratch)
    return code, log.read_text()


def test_the_operator_image_has_no_torch_and_runs_as_10001_on_a_read_only_root(images, tmp_path):
    root, config = image_root(images["operator"])
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    probe = (
        "import importlib.util, os\n"
        "assert importlib.util.find_spec('torch') is None, 'torch in the operator image'\n"
        "import meshjob_operator.handlers\n"
        "print('uid', os.getuid(), 'cwd', os.getcwd())\n"
        "try:\n    open('/app/x', 'w')\nexcept OSError as err:\n    print('root:', err.strerror)\n"
    )
    run = ContainerRun(
        argv=("python", "-c", probe),
        env=image_env(config.env, {}),
        lower=root,
        mounts=(Mount(tmp, "/tmp"),),
        uid=10001,
        gid=10001,
        read_only_root=True,
        workdir=config.workdir,
    )
    code, log = _run(run, tmp_path / "log", 120)
    assert code == 0, log
    assert "uid 10001 cwd /app" in log and "root: Read-only file system" in log
    assert config.entrypoint == ("meshjob",) and config.cmd == ("operator",) and config.user == "10001:10001"


@pytest.mark.skipif(envtest_assets() is None, reason="KUBEBUILDER_ASSETS names no kube-apiserver")
async def test_the_operator_image_starts_against_a_real_api_server_and_serves_healthz(images, tmp_path):
    root, config = image_root(images["operator"])
    health, metrics = _free_port(), _free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    async with envtest_cluster(envtest_assets()) as cluster:
        kube = tmp_path / "kube"  # as a Secret volume gives it: readable by the pod's user
        kube.mkdir()
        (kube / "kubeconfig").write_text(cluster.kubeconfig.read_text())
        (kube / "kubeconfig").chmod(0o644)
        run = ContainerRun(
            argv=(
                *config.entrypoint,
                "operator",
                f"--metrics-port={metrics}",
                f"--liveness=http://127.0.0.1:{health}/healthz",
                "--all-namespaces",
                "--standalone",
            ),
            env=image_env(config.env, {"KUBECONFIG": "/var/run/meshjob/kube/kubeconfig"}),
            lower=root,
            mounts=(Mount(tmp, "/tmp"), Mount(kube, "/var/run/meshjob/kube", read_only=True)),
            uid=10001,
            gid=10001,
            read_only_root=True,
            workdir=config.workdir,
        )
        proc, scratch = start(run, tmp_path / "log")
        try:
            body = ""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None and not body:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r:
                        body = r.read().decode()
                except OSError:
                    time.sleep(1)
            exported = ""
            if body:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                    exported = r.read().decode()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                proc.wait(30)
            remove_scratch(scratch)
    log = (tmp_path / "log").read_text()
    assert body, f"/healthz never answered; the operator's log:\n{log[-3000:]}"
    assert "meshjob_operator_jobs" in exported


JOB = """
apiVersion: meshjob.io/v1alpha1
kind: TrainingJob
metadata: {name: image-check, namespace: team-a, uid: 0b5e-image-check}
spec:
  image: meshjob/trainer:0.1.0
  model: {kind: gpt, layers: 2, hidden: 32, heads: 2, vocab: 256, seqLen: 16}
  data: {kind: tokens, path: examples/data/shakespeare-train.bin, valPath: examples/data/shakespeare-val.bin}
  training:
    steps: 4
    globalBatch: 8
    microbatches: 2
    learningRate: 1.0e-3
    evalEvery: 4
    checkpoint: {every: 2, path: /ckpt, volume: {persistentVolumeClaim: {claimName: ckpt}}}
  topology: {devicesPerHost: 2}
  stages:
    - {layers: [0, 1], mesh: [1, 1]}
    - {layers: [1, 2], mesh: [1, 1]}
  resharding: {strategy: broadcast, chunks: 2, balancer: greedy, budgetSeconds: 0.5}
  schedule: {kind: 1f1b, weightGradDelay: 0}
  metrics: {port: PORT}
"""


def _node(name: str, devices: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "allocatable": {"cpu": str(devices)},
            "capacity": {"cpu": str(devices)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_the_trainer_image_trains_the_operators_pod_to_the_end_and_writes_a_checkpoint(images, tmp_path):
    """The pod and ConfigMap are what the operator's reconcile creates for this job on one 2-device Node."""
    body = yaml.safe_load(JOB.replace("PORT", str(_free_port())))
    job = parse_job(body)
    inputs, plan, _ = plan_on_nodes(job, [_node("node-0", 2)], parse_quantity)
    meta = render.JobMeta.of(body)
    wanted = host_pods(plan.placement)
    assert len(wanted) == 1
    pod = render.pod(meta, job, wanted[0], wanted)
    configmap = render.configmap(meta, job_to_dict(job)["spec"], render_files(inputs, plan))
    (container,) = pod["spec"]["containers"]

    def read_object(kind: str, namespace: str, name: str) -> dict[str, str] | None:
        return configmap["data"] if (kind, name) == ("configMap", configmap["metadata"]["name"]) else None

    claims = tmp_path / "claims"
    prepared = volumes.prepare(pod, tmp_path / "volumes", read_object, claims)
    assert set(prepared) == {v["name"] for v in pod["spec"]["volumes"]}
    root, config = image_root(images["trainer"])
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {render.master_addr(meta)} {pod['spec']['hostname']}\n")
    place = PodPlace(pod_ip="127.0.0.1", node_name="node-0", host_ip="127.0.0.1", hosts_file=hosts)
    run = container_run(pod, container, prepared, place, lambda *_: None, lower=root, image=config)
    assert (run.uid, run.read_only_root, run.workdir) == (10001, True, "/app")
    assert {m.target for m in run.mounts} == {m["mountPath"] for m in container["volumeMounts"]}
    message = tmp_path / "termination-log"  # what a kubelet mounts at the container's terminationMessagePath
    message.write_bytes(b"")
    os.chown(message, 10001, 10001)
    run = replace(run, mounts=(*run.mounts, Mount(message, container["terminationMessagePath"])))
    code, log = _run(run, tmp_path / "log", 600)
    assert code == 0, log[-4000:]
    assert "step 4/4" in log, log[-4000:]
    summary = json.loads(message.read_text())  # the operator's status.step and status.loss come from it
    assert summary["step"] == 4 and summary["loss"] > 0, summary
    written = sorted(p.relative_to(claims) for p in claims.rglob("*") if p.is_file())
    assert written, f"no checkpoint on the claim; log:\n{log[-3000:]}"
    assert all((claims / p).stat().st_uid == 10001 for p in written)


@pytest.mark.skipif(envtest_assets() is None, reason="KUBEBUILDER_ASSETS names no kube-apiserver")
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the cluster's Prometheus: apt-get install prometheus")
def test_the_readmes_commands_train_the_main_job_on_a_cluster_whose_pods_run_in_the_images(images, tmp_path):
    """`meshjob cluster up --images`: the operator's pod runs in the operator image, the trainers' in the trainer
    image (as uid 10001 on read-only roots), and the README's first scenario passes as it does on this machine's
    files (tests/test_cluster_e2e.py)."""
    from test_cluster_e2e import local_cluster, readme_scenario

    with local_cluster(tmp_path / "cluster", images=True) as cluster:
        readme_scenario(cluster)
        (operator,) = cluster.json("get", "pods", "-n", "meshjob-system")["items"]
        image_id = operator["status"]["containerStatuses"][0]["imageID"]
        assert image_id.startswith(f"{images['operator']}@sha256:"), image_id  # it ran from the built image
