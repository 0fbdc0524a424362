#!/usr/bin/env bash
# The main job on the default model: set up .venv, then generate from SmolLM2-135M.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
cd "$root"
exec .venv/bin/picc generate smollm2 -p "${1:-Once upon a time}" -n "${2:-32}"
