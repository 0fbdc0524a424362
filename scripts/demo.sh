#!/usr/bin/env bash
# The main job on the default model: set up .venv, compile SmolLM2-135M for this machine into
# build/smollm2.pib (profiling, sparsity, placement, generated CPU code), then run a prompt with it.
# The compiled file is reused while it is newer than picc's sources.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
cd "$root"
mkdir -p build
pib=build/smollm2.pib
if [[ ! -f $pib ]] || [[ -n $(find picc runtime pyproject.toml -newer "$pib" -name '*.py' -o -newer "$pib" -name '*.yaml' -o -newer "$pib" -name pyproject.toml | head -1) ]]; then
  .venv/bin/picc compile smollm2 --target cpu -o "$pib"
fi
exec .venv/bin/picc run "$pib" -p "${1:-Once upon a time}" -n "${2:-64}"
