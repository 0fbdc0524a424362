"""Writing compiled models as ``.pib`` files, and reading them back into IR (the format is in
``runtime.pib``, which the runtime reads without the compiler).

``picc compile`` calls :func:`write_pib`; ``load_pib`` gives the compiler's view of a .pib (module,
weights, tokenizer), so ``picc logits`` / ``generate`` / ``eval`` run a compiled model on the
reference interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from picc.errors import PiccError
from picc.frontend.model import LoadedModel
from picc.fsutil import atomic_path
from picc.ir.parser import ParseError, parse
from picc.ir.printer import print_module
from picc.ir.types import DType
from picc.ir.verifier import VerifyError, verify
from picc.ir.weights import Tensor, WeightStore
from picc.progress import progress_bar
from runtime.pib import PibError, PibFile, PibWriter, StoredTensor


def write_pib(path: Path, model: LoadedModel, *, plan: dict, report: dict, meta: dict,
              extra: dict[str, bytes] | None = None, extra_tensors: dict[str, Tensor] | None = None,
              layouts: dict[str, str] | None = None) -> int:
    """Write ``model`` (its final IR and the weights it declares) with its plan, report,
    ``extra`` sections and ``extra_tensors`` (what generated code reads besides the weights) to
    ``path`` atomically; return the file's size. ``layouts``: weights to store in another layout
    than GGUF's rows, for the kernels that read them (``picc.codegen_cpu.rows8``, ``.rowplanes``,
    ``.dotplanes``)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        w = PibWriter(f)
        w.add_section("meta", json.dumps(meta, indent=1))
        w.add_section("ir", print_module(model.module))
        w.add_section("plan", json.dumps(plan))
        w.add_section("report", json.dumps(report, indent=1))
        if model.tokenizer is not None:
            w.add_section("tokenizer", model.tokenizer.to_json())
        for name, blob in (extra or {}).items():
            w.add_section(name, blob)
        tensors = [(decl.name, model.weights[decl.name], (layouts or {}).get(decl.name))
                   for decl in model.module.weights]
        tensors += [(name, t, None) for name, t in (extra_tensors or {}).items()]
        # A 7B model's tensors are 3.6 GB: written (some converted to rows8 first) over tens of seconds.
        with progress_bar(sum(t.data.nbytes for _, t, _ in tensors), f"writing {path.name}", in_bytes=True) as advance:
            for name, t, layout in tensors:
                data = t.data if layout is None else _to_layout(t, layout, name)
                w.add_tensor(name, t.dtype.value, t.shape, data, layout=layout)
                advance(t.data.nbytes)
        w.finish()
    return path.stat().st_size


def open_pib(path: Path) -> PibFile:
    """Open a .pib for reading; its problems become one-line ``PiccError``s."""
    try:
        return PibFile(path)
    except PibError as e:
        raise PiccError(str(e)) from None


def load_pib(path: Path) -> LoadedModel:
    """The IR, weights (mapped, not copied) and tokenizer of a compiled model."""
    from picc.frontend.tokenizer import Tokenizer

    pib = open_pib(path)
    try:
        module = parse(pib.text("ir"))
        verify(module)
    except (ParseError, VerifyError) as e:
        raise PiccError(f"{path}: its IR is invalid: {e}") from None
    tensors = {}
    declared = {w.name for w in module.weights}
    for name in (n for n in pib.tensor_names if n in declared):
        stored = pib.tensor(name)
        data = stored.data if stored.layout is None else _from_layout(stored, name, path)
        tensors[name] = Tensor(DType(stored.dtype), stored.shape, data)
    store = WeightStore(tensors)
    store.check_against(module)
    tokenizer = Tokenizer.from_json(pib.text("tokenizer")) if pib.has("tokenizer") else None
    return LoadedModel(module, store, tokenizer, source=str(path))


def _converters(layout: str, what: str):  # noqa: ANN202 - (to, from) functions of a layout
    from picc.codegen_cpu import dotplanes, rowplanes, rows8

    known = {rows8.LAYOUT: (rows8.to_rows8, rows8.from_rows8),
             rowplanes.LAYOUT: (rowplanes.to_rowplanes, rowplanes.from_rowplanes),
             dotplanes.LAYOUT: (dotplanes.to_dotplanes, dotplanes.from_dotplanes)}
    if layout not in known:
        raise PiccError(f"{what}: unknown storage layout {layout!r} (expected {' or '.join(known)})")
    return known[layout]


def _to_layout(t: Tensor, layout: str, name: str) -> np.ndarray:
    return _converters(layout, f"weight @{name}")[0](t.data, t.dtype.value, t.shape)


def _from_layout(stored: StoredTensor, name: str, path: Path) -> np.ndarray:
    """A weight the file stores for its kernels (rows8, rowplanes, dotplanes), back in GGUF's rows for the
    interpreter."""
    convert = _converters(stored.layout or "", f"{path}: tensor {name!r}")[1]
    return convert(stored.data, stored.dtype, stored.shape).reshape(stored.data.shape)
