#!/usr/bin/env bash
# Builds meshjob's images from the Dockerfile with buildah, without docker or a registry:
#   operator       localhost/meshjob/operator:VERSION
#   trainer        localhost/meshjob/trainer:VERSION
#   trainer-cuda   with --cuda, where its CUDA wheel index is reachable; otherwise built up to its torch layer
#                  (the base and the wheels it installs) and said so.
# Registry images cannot be pulled on machines without registry access, so the Python base is made from Debian
# bookworm (debootstrap, from Debian's package registry) and passed as PYTHON_IMAGE; torch comes from a local
# index of the CPU wheel pip finds (TORCH_INDEX_URL). Both are cached: the base by the hash of its recipe and
# of the CA bundle it copies, the index by torch's version. Run as root (buildah's vfs storage, chroot).
#   usage: tests/images.sh [--cuda] [--targets "operator trainer"]
set -euo pipefail
cd "$(dirname "$0")/.."
targets="operator trainer trainer-cuda"
cuda=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --targets) targets="$2"; shift ;;
    *) echo "usage: tests/images.sh [--cuda] [--targets \"operator trainer trainer-cuda\"]" >&2; exit 2 ;;
  esac
  shift
done
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
torch_version=2.13.0
B=(buildah --storage-driver vfs)
need=()
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# ---- the base: what the official python image gives, made from Debian's packages ----
recipe="debootstrap --variant=minbase --include=python3,python3-pip,python3-venv bookworm; no EXTERNALLY-MANAGED;
python -> python3; CA bundle; PATH with sbin; PIP_CERT, SSL_CERT_FILE"
base_hash=$( (echo "$recipe"; cat /etc/ssl/certs/ca-certificates.crt) | sha256sum | cut -c1-12)
base=localhost/meshjob-base:bookworm-$base_hash
if [ -z "$("${B[@]}" images -q "$base" 2>/dev/null)" ]; then
  echo "images: making the base $base (debootstrap bookworm, about a minute)" >&2
  root=$(mktemp -d /var/tmp/meshjob-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv bookworm "$root" >/dev/null
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  ln -sf python3 "$root/usr/bin/python"
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  ctr=$("${B[@]}" from scratch)
  mnt=$("${B[@]}" mount "$ctr")
  cp -a "$root/." "$mnt/"
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$ctr"
  "${B[@]}" commit -q "$ctr" "$base" >/dev/null
  "${B[@]}" rm "$ctr" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

# ---- torch: a simple index of the CPU wheel and its dependencies, as pip on this machine finds them ----
index=/var/tmp/meshjob-torch-index-$torch_version
if [ ! -f "$index/torch/index.html" ]; then
  echo "images: making the local torch index $index" >&2
  files=$(mktemp -d /var/tmp/meshjob-torch-files.XXXXXX)
  python3 -m pip download -q "torch==$torch_version" -d "$files"
  python3 - "$files" "$index" <<'PY'
import os, re, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for f in os.listdir(src):
    project = re.sub(r"[-_.]+", "-", f.split("-")[0]).lower()
    os.makedirs(os.path.join(dst, project), exist_ok=True)
    shutil.copy(os.path.join(src, f), os.path.join(dst, project))
for project in os.listdir(dst):
    names = sorted(n for n in os.listdir(os.path.join(dst, project)) if n != "index.html")
    with open(os.path.join(dst, project, "index.html"), "w") as out:
        out.write("".join(f'<a href="{n}">{n}</a>\n' for n in names))
PY
  rm -rf "$files"
fi

build() {  # build TARGET NAME [extra bud args]
  local target=$1 name=$2
  shift 2
  echo "images: building $target as $name" >&2
  "${B[@]}" bud --isolation chroot --layers -q --build-arg "PYTHON_IMAGE=$base" --target "$target" -t "$name" "$@" . \
    >/dev/null
  echo "$name"
}
for target in $targets; do
  case "$target" in
    operator) build operator "localhost/meshjob/operator:$version" ;;
    trainer)
      build trainer "localhost/meshjob/trainer:$version" -v "$index:/torch-index:ro" \
        --build-arg TORCH_INDEX_URL=file:///torch-index ;;
    trainer-cuda)
      if [ "$cuda" = 1 ]; then
        build trainer-cuda "localhost/meshjob/trainer-cuda:$version"
      else
        # Everything before its torch layer is the base and the build stage's wheels: build those.
        build build "localhost/meshjob/build:$version" >/dev/null
        echo "images: trainer-cuda built up to its torch layer only: its CUDA wheel index is not reachable" \
          "from here (pass --cuda where it is)" >&2
      fi ;;
    *) echo "images: unknown target $target (operator, trainer, trainer-cuda)" >&2; exit 2 ;;
  esac
done
