"""The local cluster's control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler from
KUBEBUILDER_ASSETS (controller-runtime's envtest convention), with what a real cluster turns on:
ServiceAccount admission, the scheduler, and the node lifecycle controller (Nodes need heartbeats).

The API server serves on every address of the root namespace, so pods reach it at the cluster network's root
address, which its serving certificate names; kubectl and Prometheus use the kubeconfig written here.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SERVICE_RANGE = "10.0.0.0/24"


class ControlPlaneError(RuntimeError):
    """A component did not start; the message has the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)}: {done.stderr.strip()[-400:]}")


def make_pki(pki: Path, addresses: tuple[str, ...]) -> None:
    """A CA, the API server's serving certificate (for 127.0.0.1, `addresses` and kubernetes.default), an
    admin client certificate (system:masters) and the service account signing keys; made once."""
    if (pki / "admin.crt").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=meshjob-local-ca",
        cwd=pki,
    )
    sans = [
        "IP:127.0.0.1",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
        "IP:10.0.0.1",
        *(f"IP:{a}" for a in addresses),
    ]
    (pki / "apiserver.ext").write_text(f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        "-subj",
        "/CN=kube-apiserver",
        cwd=pki,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "apiserver.crt",
        "-days",
        "3650",
        "-extfile",
        "apiserver.ext",
        cwd=pki,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "admin.key",
        "-out",
        "admin.csr",
        "-subj",
        "/O=system:masters/CN=meshjob-admin",
        cwd=pki,
    )
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "admin.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "admin.crt",
        "-days",
        "3650",
        "-extfile",
        "client.ext",
        cwd=pki,
    )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig_text(pki: Path, server: str) -> str:
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: meshjob\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {b64('ca.crt')}\n"
        f"users:\n- name: admin\n  user:\n    client-certificate-data: {b64('admin.crt')}\n"
        f"    client-key-data: {b64('admin.key')}\n"
        "contexts:\n- name: meshjob\n  context: {cluster: meshjob, user: admin, namespace: default}\n"
        "current-context: meshjob\n"
    )


@dataclass(frozen=True)
class ControlPlane:
    """Where the components run and what they write: `run/` holds logs, pid files, the PKI and the kubeconfig."""

    assets: Path
    workdir: Path
    api_port: int
    etcd_port: int
    addresses: tuple[str, ...] = ()

    @property
    def run(self) -> Path:
        return self.workdir / "run"

    @property
    def kubeconfig(self) -> Path:
        return self.run / "kubeconfig"

    @property
    def ca(self) -> Path:
        return self.run / "pki" / "ca.crt"

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.run / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        (self.run / f"{name}.pid").write_text(str(proc.pid))

    def _wait(self, name: str, url: str, timeout: float = 90) -> None:
        pki = self.run / "pki"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cmd = (
                [
                    "curl",
                    "-fsS",
                    "--cacert",
                    str(pki / "ca.crt"),
                    "--cert",
                    str(pki / "admin.crt"),
                    "--key",
                    str(pki / "admin.key"),
                    url,
                ]
                if url.startswith("https://127.0.0.1:" + str(self.api_port))
                else ["curl", "-ksfS", url]
            )
            if subprocess.run(cmd, capture_output=True).returncode == 0:
                return
            pid = int((self.run / f"{name}.pid").read_text())
            if not _alive(pid):
                break
            time.sleep(0.5)
        tail = (self.run / f"{name}.log").read_text(errors="replace")[-2000:]
        raise ControlPlaneError(f"{name} did not become ready; its log ends:\n{tail}")

    def _client_flags(self, binary: str, port: int, certs: str) -> list[str]:
        """The command line a component that talks to the API server as admin starts with (serving on `port`)."""
        kcfg = str(self.kubeconfig)
        return [
            str(self.assets / binary),
            f"--kubeconfig={kcfg}",
            f"--authentication-kubeconfig={kcfg}",
            f"--authorization-kubeconfig={kcfg}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--port=0",
            f"--cert-dir={self.run / certs}",
            "--leader-elect=false",
        ]

    def start(self) -> None:
        """etcd, the API server, the controller manager and the scheduler, each waited for."""
        self.run.mkdir(parents=True, exist_ok=True)
        pki = self.run / "pki"
        make_pki(pki, self.addresses)
        etcd = shutil.which("etcd") or str(self.assets / "etcd")
        peer = free_port()
        shutil.rmtree(self.run / "etcd-data", ignore_errors=True)
        self._start(
            "etcd",
            [
                etcd,
                "--name",
                "meshjob",
                "--data-dir",
                str(self.run / "etcd-data"),
                "--listen-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"meshjob=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
            ],
        )
        self._wait("etcd", f"http://127.0.0.1:{self.etcd_port}/health")
        self._start(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=0.0.0.0",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                "--insecure-port=0",
                f"--cert-dir={self.run / 'certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=RBAC",
                "--enable-aggregator-routing=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        self.kubeconfig.write_text(kubeconfig_text(pki, f"https://127.0.0.1:{self.api_port}"))
        self.kubeconfig.chmod(0o600)
        self._wait("kube-apiserver", f"https://127.0.0.1:{self.api_port}/readyz")
        kcm_port, ks_port = free_port(), free_port()
        self._start(
            "kube-controller-manager",
            [
                *self._client_flags("kube-controller-manager", kcm_port, "kcm-certs"),
                "--use-service-account-credentials=false",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--controllers=*,-nodeipam,-service,-route,-cloud-node-lifecycle,-bootstrapsigner,-tokencleaner",
                "--v=1",
            ],
        )
        self._wait("kube-controller-manager", f"https://127.0.0.1:{kcm_port}/healthz")
        self._start(
            "kube-scheduler",
            [
                *self._client_flags("kube-scheduler", ks_port, "ks-certs"),
                "--v=1",
            ],
        )
        self._wait("kube-scheduler", f"https://127.0.0.1:{ks_port}/healthz")

    def stop(self) -> list[str]:
        """Stop every component by its pid file (SIGTERM, then SIGKILL); returns the ones it stopped."""
        stopped = []
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            pid_file = self.run / f"{name}.pid"
            if not pid_file.exists():
                continue
            pid = int(pid_file.read_text())
            if stop_process(pid):
                stopped.append(name)
            pid_file.unlink()
        return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is gone for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def stop_process(pid: int, grace: float = 10) -> bool:
    """SIGTERM `pid`'s process group, wait `grace` seconds, then SIGKILL; whether it was running."""
    if not _alive(pid):
        return False
    try:
        os.killpg(pid, 15)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
    return True
