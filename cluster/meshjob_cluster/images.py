"""Built images as root filesystems: one read-only working container per image (buildah, vfs storage), whose
mounted root is the lower layer of every container run from that image, and the image's config.

The images come from tests/images.sh (the Dockerfile, built with buildah); a pod names one by its tag.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from meshjob_cluster.podspec import ImageConfig, PodSpecError

BUILDAH = ("buildah", "--storage-driver", "vfs")


def _buildah(*args: str) -> str:
    done = subprocess.run([*BUILDAH, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise PodSpecError(f"buildah {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


def local_name(image: str) -> str:
    """The tag buildah knows a pod's image by: `meshjob/trainer:0.1.0` is `localhost/meshjob/trainer:0.1.0`."""
    first = image.split("/", 1)[0]
    return image if "." in first or ":" in first or first == "localhost" else f"localhost/{image}"


def container_name(image: str) -> str:
    return "meshjob-root-" + re.sub(r"[^a-zA-Z0-9_.-]+", "-", local_name(image))


def image_root(image: str) -> tuple[Path, ImageConfig]:
    """The mounted root filesystem of `image` and its config; made once, reused after."""
    name = container_name(image)
    inspected = json.loads(_buildah("inspect", "--type", "image", local_name(image)))
    listed = _buildah("containers", "--format", "{{.ContainerName}} {{.ImageID}}")
    existing = dict(line.split()[:2] for line in listed.splitlines() if len(line.split()) >= 2)
    if name in existing and existing[name] != inspected["FromImageID"]:
        _buildah("rm", name)  # made from an older build of the tag: its root is stale
        del existing[name]
    if name not in existing:
        _buildah("from", "--name", name, "--pull-never", local_name(image))
    root = Path(_buildah("mount", name))
    config = inspected["OCIv1"].get("config", {})
    return root, ImageConfig(
        env=tuple(config.get("Env") or ()),
        entrypoint=tuple(config.get("Entrypoint") or ()),
        cmd=tuple(config.get("Cmd") or ()),
        workdir=config.get("WorkingDir") or "",
        user=config.get("User") or "",
        digest=inspected.get("FromImageDigest") or "",
    )


def release(image: str) -> None:
    """Unmount and remove the working container of `image` (the image stays)."""
    name = container_name(image)
    subprocess.run([*BUILDAH, "rm", name], capture_output=True)
