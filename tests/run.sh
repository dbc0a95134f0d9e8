#!/usr/bin/env bash
# The project's test command: set up (idempotent), the static gate (ruff, import contracts, mypy), then the
# whole suite. Runs the real-apiserver variants of the operator tests when ../shared/envtest (or
# $KUBEBUILDER_ASSETS) holds kube-apiserver.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/setup.sh
bash tests/lint.sh
if [ -z "${KUBEBUILDER_ASSETS:-}" ] && [ -x ../shared/envtest/kube-apiserver ]; then
  export KUBEBUILDER_ASSETS=$(readlink -f ../shared/envtest)
fi
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
