"""Frontends: turn a model source (alias, HF directory, GGUF file, picc IR file) into IR."""

from __future__ import annotations

from pathlib import Path

from picc.errors import PiccError
from picc.frontend.aliases import ALIASES, resolve_alias
from picc.frontend.model import LoadedModel

SOURCE_FORMS = (
    "an alias (" + ", ".join(ALIASES) + ")",
    "a Hugging Face directory with config.json",
    "a .gguf file",
    "an .onnx file",
    "a .picc file written by 'picc import'",
    "a .pib file written by 'picc compile'",
)


def load_model(source: str | Path) -> LoadedModel:
    """Load ``source`` into IR; a one-line ``PiccError`` says what was wrong with it."""
    text = str(source)
    if text in ALIASES:
        return load_model(resolve_alias(text))
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PiccError(f"{path}: directory has no config.json (expected a Hugging Face "
                            "model directory)")
        from picc.frontend.hf import load_hf

        return load_hf(path)
    if path.suffix == ".gguf":
        from picc.frontend.gguf import load_gguf

        return load_gguf(path)
    if path.suffix == ".onnx":
        from picc.frontend.onnx import load_onnx

        return load_onnx(path)
    if path.suffix == ".picc":
        from picc.frontend.picc_file import load_picc

        return load_picc(path)
    if path.suffix == ".pib":
        from picc.pib import load_pib

        return load_pib(path)
    if not path.exists():
        raise PiccError(f"{text}: no such file, directory or alias; expected "
                        + "; ".join(SOURCE_FORMS))
    raise PiccError(f"{text}: unrecognised model source; expected " + "; ".join(SOURCE_FORMS))
