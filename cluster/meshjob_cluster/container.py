"""One container of a pod, run the way a kubelet runs it: its command in a root filesystem of its own.

The root is an overlay over a lower directory (a built image's root filesystem, or this machine's `/` when
no image is given) with a private upper layer, read-only where the container's securityContext says
`readOnlyRootFilesystem`; the pod's volumes are bind-mounted at their mount paths, `/etc/hosts` is the
pod's hosts file, and the command runs as the pod's user and group (supplementary group fsGroup) with
exactly the environment it is given. All of it happens in a mount namespace of its own (`unshare -m`), so
nothing is left mounted when the process ends; the caller removes the upper layer.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A container runtime's /dev (runc's defaults): a private tmpfs holding this machine's basic devices, so a
# mount under /dev (a termination message file) never creates anything in this machine's /dev.
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_TREES = ("pts", "shm", "mqueue")
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
}


@dataclass(frozen=True)
class Mount:
    """A directory or file of this machine seen at `target` inside the container."""

    source: Path
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerRun:
    """Everything needed to start one container's process."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    lower: Path = Path("/")  # the image's root filesystem; "/" runs on this machine's own files
    mounts: tuple[Mount, ...] = ()
    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()
    read_only_root: bool = False
    workdir: str = "/"
    hosts_file: Path | None = None  # bind-mounted over /etc/hosts
    hostname: str = ""  # the pod's, in a UTS namespace of its own (empty: this machine's)
    # folders made traversable and readable in the container's root (its overlay; this machine's stay as they
    # are): where this machine's interpreter lives, when pods run on its files as another user
    opened: tuple[str, ...] = ()
    netns: str | None = None  # a network namespace under /var/run/netns to run in
    scratch: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))


def resolve_in(lower: Path, target: str) -> str:
    """`target` as the container sees it, with every symlink on its way resolved inside the container's root
    (`/var/run` -> `/run` in Debian): a mount must land where the container will look, not on this machine."""
    parts = [p for p in target.split("/") if p]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved[:-1]
            continue
        if part == ".":
            continue
        here = lower.joinpath(*resolved, part)
        if here.is_symlink() and hops < 40:
            hops += 1
            link = os.readlink(here)
            if link.startswith("/"):
                resolved = []
            parts = [p for p in link.split("/") if p] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


def setup_script(run: ContainerRun, root: Path, upper: Path, work: Path) -> str:
    """The shell lines, run as root in a fresh mount namespace, that build the container's root at `root`
    and exec the command in it."""
    q = shlex.quote
    lines = [
        "set -e",
        f"mount -t overlay overlay -o lowerdir={q(str(run.lower))},upperdir={q(str(upper))},"
        f"workdir={q(str(work))} {q(str(root))}",
    ]
    mounts = [replace(m, target=resolve_in(run.lower, m.target)) for m in run.mounts]
    targets = ["/proc", "/dev", "/tmp", run.workdir] + [m.target for m in mounts]
    if run.hosts_file is not None:
        targets.append("/etc/hosts")
    for target in targets:
        path = f"{root}{target}"
        if target == "/etc/hosts" or any(m.target == target and m.source.is_file() for m in mounts):
            lines.append(f"mkdir -p {q(os.path.dirname(path))} && touch {q(path)}")
        else:
            lines.append(f"mkdir -p {q(path)}")
    for folder in run.opened:
        parts = Path(folder).parts
        for i in range(2, len(parts) + 1):
            lines.append(f"chmod o+rx {q(str(root) + '/' + '/'.join(parts[1:i]))}")
    if run.read_only_root:
        lines.append(f"mount -o remount,ro {q(str(root))}")
    lines.append(f"mount -t proc proc {q(str(root))}/proc")
    lines += _dev_lines(f"{root}/dev")
    # Outer mounts first: a mount inside another volume gets its mount point in that volume, as a kubelet's.
    for m in sorted(mounts, key=lambda m: m.target.rstrip("/").count("/")):
        target = q(f"{root}{m.target}")
        make = "touch" if m.source.is_file() else "mkdir -p"
        lines.append(f"[ -e {target} ] || {make} {target}")
        lines.append(f"mount --bind {q(str(m.source))} {target}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    if run.hosts_file is not None:
        lines.append(f"mount --bind {q(str(run.hosts_file))} {q(str(root))}/etc/hosts")
    if run.hostname:
        lines.append(f"hostname {q(run.hostname)}")
    env = [f"{k}={v}" for k, v in run.env.items()]
    groups = ",".join(str(g) for g in run.groups) or str(run.gid)
    user = f"--userspec={run.uid}:{run.gid} --groups={groups}"
    inner = " ".join(q(a) for a in ("/usr/bin/env", "-i", *env, *run.argv))
    lines.append(f"exec chroot {user} {q(str(root))} /bin/sh -c {q(f'cd {q(run.workdir)} && exec {inner}')}")
    return "\n".join(lines)


def _dev_lines(dev: str) -> list[str]:
    """The container's /dev at `dev`: a tmpfs, this machine's basic devices (and GPUs) bound into it."""
    q = shlex.quote
    lines = [f"mount -t tmpfs -o nosuid,mode=755,size=65536k tmpfs {q(dev)}"]
    gpus = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")) if os.path.isdir("/dev") else []
    for name in (*DEV_NODES, *gpus):
        if os.path.exists(f"/dev/{name}") and not os.path.isdir(f"/dev/{name}"):
            lines.append(f"touch {q(f'{dev}/{name}')} && mount --bind {q(f'/dev/{name}')} {q(f'{dev}/{name}')}")
    for name in DEV_TREES:
        if os.path.isdir(f"/dev/{name}"):
            lines.append(f"mkdir {q(f'{dev}/{name}')} && mount --rbind {q(f'/dev/{name}')} {q(f'{dev}/{name}')}")
    lines += [f"ln -s {q(target)} {q(f'{dev}/{name}')}" for name, target in DEV_LINKS.items()]
    return lines


def start(run: ContainerRun, log: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the container's process (its own session: a signal to its group reaches all it started),
    output and errors appended to `log`. Returns the process and the scratch folder to remove after it."""
    scratch = Path(tempfile.mkdtemp(prefix="meshjob-ctr-", dir=run.scratch))
    root, upper, work = scratch / "root", scratch / "upper", scratch / "work"
    for d in (root, upper, work):
        d.mkdir()
    prefix: list[str] = ["ip", "netns", "exec", run.netns] if run.netns else []
    argv = [
        *prefix,
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        setup_script(run, root, upper, work),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, scratch


def remove_scratch(scratch: Path) -> None:
    """The upper layer and the mount point of a container that has ended."""
    shutil.rmtree(scratch, ignore_errors=True)


def image_env(config_env: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The image's environment (`KEY=VALUE` strings, as its config lists them) under the container's own."""
    merged = dict(item.split("=", 1) for item in config_env if "=" in item)
    merged.setdefault("PATH", DEFAULT_PATH)
    merged.update(env)
    return merged
