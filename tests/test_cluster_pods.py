"""meshjob_cluster reads a pod as a kubelet does: its command, environment (downward API), user, mounts and
volumes; and the container it starts sees its volumes where the pod says, as its user, on a read-only root."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from meshjob_cluster import volumes
from meshjob_cluster.container import ContainerRun, Mount, remove_scratch, resolve_in, setup_script, start
from meshjob_cluster.podspec import ImageConfig, PodPlace, PodSpecError, container_run, environment

PLACE = PodPlace(pod_ip="203.0.113.5", node_name="node-1", host_ip="198.51.100.2")


def _pod(**container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "job-1", "namespace": "team-a", "uid": "u-1", "labels": {"app": "x"}},
        "spec": {
            "hostname": "job-1",
            "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001, "runAsNonRoot": True},
            "containers": [{"name": "trainer", **container}],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "config", "configMap": {"name": "job-config"}}],
        },
    }


def no_keys(kind: str, namespace: str, name: str, key: str) -> str | None:
    return None


def test_env_resolves_values_and_the_downward_api_and_refuses_what_it_cannot():
    pod = _pod()
    container = {
        "env": [
            {"name": "PLAIN", "value": "1"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ]
    }

    def keys(kind: str, namespace: str, name: str, key: str) -> str | None:
        return f"{kind}:{namespace}/{name}/{key}"

    assert environment(pod, container, PLACE, keys) == {
        "PLAIN": "1",
        "POD": "job-1",
        "NS": "team-a",
        "IP": "203.0.113.5",
        "NODE": "node-1",
        "APP": "x",
        "SECRET": "secret:team-a/s/k",
    }
    with pytest.raises(PodSpecError, match="has no key 'k'"):
        environment(pod, container, PLACE, no_keys)
    bad = {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.phase"}}}]}
    with pytest.raises(PodSpecError, match="status.phase"):
        environment(pod, bad, PLACE, no_keys)


def test_the_run_takes_the_pods_user_command_mounts_and_read_only_root(tmp_path):
    pod = _pod(
        command=["meshjob", "worker"],
        args=["--nproc", "2"],
        securityContext={"readOnlyRootFilesystem": True},
        volumeMounts=[
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "config", "mountPath": "/etc/x", "readOnly": True},
        ],
    )
    folders = {"tmp": tmp_path / "tmp", "config": tmp_path / "config"}
    image = ImageConfig(env=("PATH=/usr/bin", "A=image"), entrypoint=("python",), cmd=("-V",), workdir="/app")
    run = container_run(pod, pod["spec"]["containers"][0], folders, PLACE, no_keys, Path("/img"), image)
    assert run.argv == ("meshjob", "worker", "--nproc", "2")
    assert (run.uid, run.gid, run.groups, run.read_only_root, run.workdir) == (
        10001,
        10001,
        (10001, 10001),
        True,
        "/app",
    )
    assert run.mounts == (Mount(folders["tmp"], "/tmp"), Mount(folders["config"], "/etc/x", read_only=True))
    assert run.env["PATH"] == "/usr/bin" and run.env["A"] == "image" and run.env["HOSTNAME"] == "job-1"
    no_command = container_run(_pod(), {"name": "c"}, {}, PLACE, no_keys, Path("/img"), image)
    assert no_command.argv == ("python", "-V")  # the image's entrypoint and cmd


def test_a_non_root_pod_never_runs_as_root():
    pod = _pod()
    pod["spec"]["securityContext"] = {"runAsNonRoot": True}
    with pytest.raises(PodSpecError, match="runAsNonRoot"):
        container_run(pod, {"name": "c", "command": ["true"]}, {}, PLACE, no_keys)


def test_volumes_are_folders_with_the_configmaps_files_and_the_claim_shared(tmp_path):
    pod = _pod()
    pod["spec"]["volumes"].append({"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}})

    def objects(kind: str, namespace: str, name: str) -> dict[str, str] | None:
        return {"job.yaml": "spec: {}\n"} if (kind, namespace, name) == ("configMap", "team-a", "job-config") else None

    made = volumes.prepare(pod, tmp_path / "pod", objects, tmp_path / "claims")
    assert (made["config"] / "job.yaml").read_text() == "spec: {}\n"
    assert made["ckpt"] == tmp_path / "claims" / "team-a" / "ckpt"
    assert made["tmp"].stat().st_gid == 10001 and made["ckpt"].stat().st_gid == 10001
    missing = _pod()
    missing["spec"]["volumes"] = [{"name": "c", "configMap": {"name": "absent"}}]
    with pytest.raises(PodSpecError, match="configMap team-a/absent does not exist"):
        volumes.prepare(missing, tmp_path / "p2", objects, tmp_path / "claims")


def test_a_mount_target_behind_an_absolute_symlink_lands_inside_the_root(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    os.symlink("/run", tmp_path / "var" / "run")
    assert resolve_in(tmp_path, "/var/run/secrets/token") == "/run/secrets/token"
    assert resolve_in(tmp_path, "/etc/meshjob") == "/etc/meshjob"


def test_outer_mounts_are_made_before_the_mounts_inside_them():
    run = ContainerRun(
        argv=("true",), env={}, mounts=(Mount(Path("/k"), "/tmp/kube"), Mount(Path("/t"), "/tmp")), read_only_root=True
    )
    script = setup_script(run, Path("/r"), Path("/u"), Path("/w"))
    assert script.index("mount --bind /t /r/tmp") < script.index("mount --bind /k /r/tmp/kube")
    assert script.index("remount,ro /r") < script.index("mount --bind /t /r/tmp")


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces and chroot need root")
def test_the_container_sees_its_volumes_as_its_user_on_a_read_only_root(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("hello")
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 10001, 10001)
    probe = (
        "import os; print(os.getuid(), os.getgid(), open('/data/in.txt').read());"
        "open('/out/written', 'w').write('ok');"
        "\ntry:\n    open('/data/x', 'w')\nexcept OSError as e:\n    print('data:', e.strerror)"
        "\ntry:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    print('root:', e.strerror)"
    )
    run = ContainerRun(
        argv=("python3", "-c", probe),
        env={"PATH": os.environ["PATH"]},
        mounts=(Mount(data, "/data", read_only=True), Mount(out, "/out")),
        uid=10001,
        gid=10001,
        read_only_root=True,
        workdir="/",
        scratch=tmp_path,
    )
    proc, scratch = start(run, tmp_path / "log")
    assert proc.wait(60) == 0, (tmp_path / "log").read_text()
    remove_scratch(scratch)
    log = (tmp_path / "log").read_text()
    assert "10001 10001 hello" in log
    assert "data: Read-only file system" in log and "root: Read-only file system" in log
    assert (out / "written").read_text() == "ok" and (out / "written").stat().st_uid == 10001


def test_the_container_has_a_dev_of_its_own_and_a_file_mounted_there_stays_inside(tmp_path):
    message = tmp_path / "message"
    message.write_bytes(b"")
    os.chown(message, 10001, 10001)
    probe = (
        "import os; open('/dev/termination-log', 'w').write('done');"
        "print(sorted(n for n in ('null', 'zero', 'urandom', 'shm', 'fd') if os.path.exists('/dev/' + n)));"
        "print(len(os.urandom(4)), open('/dev/null').read() == '')"
    )
    run = ContainerRun(
        argv=("python3", "-c", probe),
        env={"PATH": os.environ["PATH"]},
        mounts=(Mount(message, "/dev/termination-log"),),
        uid=10001,
        gid=10001,
        read_only_root=True,
        scratch=tmp_path,
    )
    proc, scratch = start(run, tmp_path / "log")
    assert proc.wait(60) == 0, (tmp_path / "log").read_text()
    remove_scratch(scratch)
    log = (tmp_path / "log").read_text()
    assert "['fd', 'null', 'shm', 'urandom', 'zero']" in log and "4 True" in log, log
    assert message.read_text() == "done"
    assert not Path("/dev/termination-log").exists()  # the mount point was made in the container's own /dev
