#!/usr/bin/env bash
# The test suite: set up .venv, check lint, run pytest (extra arguments go to pytest).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
cd "$root"
.venv/bin/ruff check picc runtime tests examples
# HF_HUB_OFFLINE: nothing in picc or its tests may reach a model hub.
# PICC_CACHE_DIR: what the tests derive and can rebuild (trained predictors, converted tokenizers,
# the host's bandwidth) is cached inside the build, not in the user's cache.
export PICC_CACHE_DIR="${PICC_CACHE_DIR:-$root/build/cache}"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 exec .venv/bin/python -m pytest -q "$@"
