#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine (as root): Python packages (torch pinned to the
# CPU wheel on disk), Debian's prometheus and etcd-server. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v ip >/dev/null || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # the Debian prometheus package starts a system service; the tests start their own
  (systemctl stop prometheus || service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
fi
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]' -e ./operator -e ./trainer -e ./bench
