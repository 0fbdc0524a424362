"""A GGUF file's metadata and tensor table, read straight from its bytes.

``gguf.GGUFReader`` makes a numpy view of every element of every metadata array as it opens a
file: SmolLM2's 49k-token vocabulary and its 49k merges took 2.7-6 s per load here, paid by every
``picc compile smollm2``. picc needs the scalar metadata and the tensor table, so it reads those
itself (tens of milliseconds) and decodes an array only when one is asked for. The ``gguf``
package still names the tensor types and gives their block sizes.

Layout (GGUF v2 / v3, little-endian): ``GGUF``, version (u32), tensor count and key-value count
(u64 each); the key-value pairs (key string, value type u32, value; a string is a u64 length and
UTF-8 bytes, an array an element type u32, a u64 count and the elements); the tensor infos (name,
dimension count u32, dimensions u64 with the row length first, type u32, data offset u64); padding
to ``general.alignment`` (default 32), then the tensor data, each tensor at its offset from there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# value type -> struct format of one element (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor data as numpy reads it: floats as such, everything else (blocks, bf16) as bytes
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor: its GGML type's name (``Q4_1``...), its dimensions as stored (row length
    first), and its data (a read-only view of the file: floats for F32 / F16, bytes otherwise)."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    data: np.ndarray


class _Array:
    """An array value not decoded yet: its element type, count and where its elements start."""

    def __init__(self, buf: np.ndarray, elem_type: int, count: int, offset: int) -> None:
        self.buf, self.elem_type, self.count, self.offset = buf, elem_type, count, offset

    def values(self) -> list:
        reader = _Cursor(self.buf, self.offset)
        return [reader.value(self.elem_type) for _ in range(self.count)]


class _Cursor:
    """Reads values from ``buf`` onwards from ``offset``; running past the end is a ValueError."""

    def __init__(self, buf: np.ndarray, offset: int) -> None:
        self.buf, self.offset = buf, offset

    def _take(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)} inside its header (truncated?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += size
        return value

    def u32(self) -> int:
        return self._take("<I")  # type: ignore[return-value]

    def u64(self) -> int:
        return self._take("<Q")  # type: ignore[return-value]

    def string(self) -> str:
        n = self.u64()
        if self.offset + n > len(self.buf):
            raise ValueError(f"a {n}-byte string at byte {self.offset} runs past the end of the file (truncated?)")
        raw = bytes(self.buf[self.offset : self.offset + n])
        self.offset += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self._take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            elem, count = self.u32(), self.u64()
            start = self.offset
            self.skip(elem, count)
            return _Array(self.buf, elem, count, start)
        raise ValueError(f"unknown metadata value type {vtype} at byte {self.offset - 4}")

    def skip(self, elem: int, count: int) -> None:
        """Past ``count`` elements of type ``elem`` (strings and nested arrays one by one)."""
        if elem in _SCALARS:
            self.offset += count * struct.calcsize(_SCALARS[elem])
            if self.offset > len(self.buf):
                raise ValueError("an array runs past the end of the file (truncated?)")
            return
        for _ in range(count):
            if elem == _STRING:
                n = self.u64()
                self.offset += n
                if self.offset > len(self.buf):
                    raise ValueError("an array of strings runs past the end of the file (truncated?)")
            else:
                self.value(elem)


class GgufFile:
    """The metadata (``get``) and tensors (``tensors``) of the GGUF file at ``path``. Malformed or
    truncated files raise ValueError saying where."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self._bytes = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(self._bytes[:4]) != _MAGIC:
            raise ValueError("the file does not start with the GGUF magic")
        head = _Cursor(self._bytes, 4)
        version = head.u32()
        if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS:
            raise ValueError("a big-endian GGUF file (picc reads little-endian ones, as llama.cpp writes them)")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (picc reads versions 2 and 3, little-endian)")
        n_tensors, n_kv = head.u64(), head.u64()
        self._fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = head.string()
            self._fields[key] = head.value(head.u32())
        infos = []
        for _ in range(n_tensors):
            name = head.string()
            dims = tuple(head.u64() for _ in range(head.u32()))
            infos.append((name, dims, head.u32(), head.u64()))
        alignment = self._fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment is {alignment!r}; expected a power of two")
        data_start = -(-head.offset // alignment) * alignment
        self.tensors: list[GgufTensor] = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown GGML type {type_id}") from None
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims, dtype=np.int64))
            if count % block:
                raise ValueError(f"tensor {name!r}: {count} elements are not whole {qtype.name} blocks of {block}")
            start, nbytes = data_start + offset, count // block * block_bytes
            if start + nbytes > len(self._bytes):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            data = self._bytes[start : start + nbytes]
            if qtype.name in _FLOAT_DTYPES:
                data = data.view(_FLOAT_DTYPES[qtype.name])
            self.tensors.append(GgufTensor(name, qtype.name, dims, data))

    def get(self, key: str, default: object = None) -> object:
        """The value of metadata ``key`` (a list for an array), or ``default`` when it is absent."""
        value = self._fields.get(key, default)
        return value.values() if isinstance(value, _Array) else value
