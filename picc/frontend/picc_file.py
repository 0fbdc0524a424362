"""``.picc`` files: the IR text, with its weight store beside it in ``NAME.picc.weights``.

The weight file is safetensors; it also carries the tokenizer (JSON) when the model has one.
"""

from __future__ import annotations

from pathlib import Path

from picc.errors import PiccError
from picc.frontend.model import LoadedModel
from picc.fsutil import writable, write_text_atomic
from picc.ir.parser import ParseError, parse
from picc.ir.printer import print_module
from picc.ir.verifier import VerifyError, verify
from picc.ir.weights import WeightStore

_TOKENIZER_KEY = "picc.tokenizer"


def weights_path(path: Path) -> Path:
    return path.with_name(path.name + ".weights")


def save_picc(model: LoadedModel, path: Path) -> None:
    """Write ``path`` (IR text) and ``path.weights`` (only the weights the module declares): both,
    or neither."""
    path, weights = writable(path), writable(weights_path(Path(path)))
    store = model.weights.subset([w.name for w in model.module.weights])
    meta = {_TOKENIZER_KEY: model.tokenizer.to_json()} if model.tokenizer else {}
    store.save(weights, meta)
    try:
        write_text_atomic(path, print_module(model.module))
    except BaseException:
        weights.unlink(missing_ok=True)
        raise


def load_picc(path: Path) -> LoadedModel:
    from picc.frontend.tokenizer import Tokenizer

    path = Path(path)
    try:
        module = parse(path.read_text())
    except OSError as e:
        raise PiccError(f"{path}: cannot read ({e.strerror})") from None
    except ParseError as e:
        raise PiccError(f"{path}: {e}") from None
    try:
        verify(module)
    except VerifyError as e:
        raise PiccError(f"{path}: {e}") from None
    store, meta = WeightStore.load(weights_path(path))
    store.check_against(module)
    tok = meta.get(_TOKENIZER_KEY)
    return LoadedModel(module, store, Tokenizer.from_json(tok) if tok else None, source=str(path))
