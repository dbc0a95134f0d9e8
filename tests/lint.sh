#!/usr/bin/env bash
# The static gate, run before the tests: ruff (lint and format), the import contracts, mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
lint-imports --no-cache
mypy
