#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine (as root): Python packages (torch pinned to the
# CPU wheel on disk), Debian's prometheus, etcd-server, iproute2, buildah and debootstrap. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v buildah >/dev/null || need_apt+=(buildah)          # tests/images.sh: the Dockerfile's images
command -v debootstrap >/dev/null || need_apt+=(debootstrap)  # ... from a Debian base made here
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # the Debian prometheus package starts a system service; the tests start their own
  (systemctl stop prometheus || service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
fi
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]' -e ./operator -e ./trainer -e ./bench -e ./cluster
# commit messages: a subject of at most 72 characters, a blank line, a body (CONTRIBUTING.md)
if git rev-parse --git-dir >/dev/null 2>&1; then git config core.hooksPath .githooks; fi
