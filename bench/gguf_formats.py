"""The shipped SmolLM2 GGUF (Q4_1, embeddings Q8_0) rewritten in F16 and in F32, for benchmarks.

    python bench/gguf_formats.py f16 build/bench/smollm2-f16.gguf

Every tensor is decoded with ``picc.quant.dequantize`` (exact: ``d q + m`` in f32, as ggml
computes it) and written as F32, or, for the F16 file, matrices rounded to F16 and vectors kept
in F32 (llama.cpp's own ``MOSTLY_F16`` layout). All metadata (architecture, hyper-parameters,
the tokenizer, the chat template) is copied; ``general.file_type`` says the new type. The F32
file computes the same numbers as the Q4_1 one; the F16 file rounds each weight once more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from picc import quant  # noqa: E402

# ggml's names for the formats picc decodes, and llama.cpp's file types.
_DTYPES = {"F32": "f32", "F16": "f16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_FILE_TYPES = {"f32": 0, "f16": 1}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16


def write_dequantized(src: Path, dst: Path, fmt: str) -> Path:
    """Write ``src`` with every tensor dequantized to ``fmt`` (``f16`` or ``f32``) at ``dst``
    (through a temporary file, so an interrupted run leaves nothing half-written)."""
    import gguf

    if fmt not in _FILE_TYPES:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(_FILE_TYPES)}")
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = _FILE_TYPES[fmt]
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        dtype = _DTYPES.get(t.tensor_type.name)
        if dtype is None:
            raise ValueError(f"{src}: tensor {t.name} is {t.tensor_type.name}, which picc.quant does not decode")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order: rows first
        values = quant.dequantize(np.asarray(t.data), dtype, shape)
        if fmt == "f16" and len(shape) > 1:
            values = values.astype(np.float16)
        writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("format", choices=sorted(_FILE_TYPES))
    p.add_argument("output", type=Path)
    p.add_argument("--source", type=Path, help="the GGUF to convert (default: the smollm2 alias)")
    args = p.parse_args()
    if args.source is None:
        from picc.frontend.aliases import resolve_alias

        args.source = resolve_alias("smollm2")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(write_dequantized(args.source, args.output, args.format))


if __name__ == "__main__":
    main()
