"""The weights of a Hugging Face checkpoint directory: ``model.safetensors`` or an indexed set of shards.

picc reads the safetensors format itself (an 8-byte header length, a JSON header, raw little-endian
data) rather than through ``safetensors.numpy``, because numpy has no bfloat16 and picc keeps bf16
weights as their 16-bit patterns. Files are memory-mapped, so importing a 14 GB checkpoint does not
copy it; tensors keep the dtype they are stored in (f32, f16 or bf16). Bytes (``U8``: gpt-oss's
MXFP4 blocks and scales) are read as such by :meth:`Checkpoint.packed`.

Like transformers, picc looks for ``model.safetensors`` first and then for
``model.safetensors.index.json``; other ``*.safetensors`` files in the directory are not part of
the checkpoint.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from picc.errors import PiccError
from picc.ir.types import DType
from picc.ir.weights import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> (picc dtype, numpy dtype of the stored elements)
_DTYPES: dict[str, tuple[DType, str]] = {
    "F32": (DType.F32, "<f4"),
    "F16": (DType.F16, "<f2"),
    "BF16": (DType.BF16, "<u2"),  # bfloat16 kept as its bit pattern, as picc.quant expects
    "F64": (DType.F32, "<f8"),  # narrowed to f32: transformers loads float32 from it the same way
}
_PACKED = "U8"  # bytes of a quantized format (gpt-oss's MXFP4 blocks and scales), read by Checkpoint.packed
_OTHER_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
                       "flax_model.msgpack", "model.ckpt.index", "consolidated.00.pth")


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one tensor's bytes are: file, dtype, shape and byte range inside the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class Checkpoint:
    """The tensors of one checkpoint directory, by their Hugging Face names, read on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        files, self.index = _checkpoint_files(self.directory)
        self._entries: dict[str, _Entry] = {}
        self._maps: dict[Path, np.ndarray] = {}
        for f in files:
            for name, entry in _read_header(f).items():
                self._entries.setdefault(name, entry)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def where(self, name: str) -> str:
        """The file a missing tensor should be in, as a phrase for error messages."""
        if self.index is None:
            return f"missing from {self.directory / SINGLE_FILE}"
        shard = self.index.get(name)
        if shard is None:
            return f"missing from the checkpoint ({self.directory / INDEX_FILE} maps no shard to it)"
        return f"missing from {self.directory / shard} (the shard {INDEX_FILE} puts it in)"

    def tensor(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """Tensor ``name`` in its stored dtype; it must exist and have exactly ``shape``."""
        entry = self._entries.get(name)
        if entry is None:
            raise PiccError(f"{self.directory}: tensor {name!r} is {self.where(name)}")
        if entry.shape != tuple(shape):
            raise PiccError(f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, but "
                            f"config.json implies {list(shape)}")
        if entry.dtype == _PACKED:
            raise PiccError(f"{entry.file}: tensor {name!r} is bytes (U8), not the float weights picc expects there")
        dtype, stored = _DTYPES[entry.dtype]
        raw = self._map(entry.file)[entry.start:entry.end]
        data = raw.view(np.dtype(stored)).reshape(entry.shape)
        if entry.dtype == "F64":
            data = data.astype(np.float32)
        return Tensor(dtype, entry.shape, data)

    def packed(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name``'s bytes (a ``U8`` tensor of exactly ``shape``): a quantized format's."""
        entry = self._entries.get(name)
        if entry is None:
            raise PiccError(f"{self.directory}: tensor {name!r} is {self.where(name)}")
        if entry.dtype != _PACKED or entry.shape != tuple(shape):
            raise PiccError(f"{entry.file}: tensor {name!r} is {entry.dtype} {list(entry.shape)}, but "
                            f"config.json implies U8 {list(shape)}")
        return self._map(entry.file)[entry.start:entry.end].reshape(entry.shape)

    def _map(self, file: Path) -> np.ndarray:
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        return self._maps[file]


def _checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of the checkpoint and, when sharded, the index's weight map."""
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single], None
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        others = sorted(p.name for p in directory.iterdir() if p.name in _OTHER_WEIGHT_FILES
                        or p.suffix == ".safetensors")
        found = f" (found {', '.join(others)})" if others else ""
        raise PiccError(f"{directory}: no safetensors weights: expected {SINGLE_FILE} or "
                        f"{INDEX_FILE}{found}; picc reads only safetensors checkpoints")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PiccError(f"{index_path}: not a readable JSON index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PiccError(f"{index_path}: expected an object with a 'weight_map' of tensor name -> "
                        "shard file name")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (directory / shard).is_file():
            raise PiccError(f"{directory}: shard {shard!r} listed in {INDEX_FILE} is missing")
    return [directory / s for s in shards], weight_map


def _read_header(file: Path) -> dict[str, _Entry]:
    """Parse a safetensors header; every entry is checked against the file's size."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PiccError(f"{file}: not a safetensors file ({e})") from None
    base = 8 + n
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PiccError(f"{file}: malformed header entry for tensor {name!r}") from None
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(
                isinstance(o, int) for o in (begin, end)):
            raise PiccError(f"{file}: malformed header entry for tensor {name!r}")
        if dtype not in _DTYPES and dtype != _PACKED:
            raise PiccError(f"{file}: tensor {name!r} has dtype {dtype}; picc reads float "
                            f"checkpoints ({', '.join(_DTYPES)}), not quantized ones")
        itemsize = 1 if dtype == _PACKED else np.dtype(_DTYPES[dtype][1]).itemsize
        if end - begin != itemsize * int(np.prod(shape)) or not 0 <= begin <= end <= size - base:
            raise PiccError(f"{file}: tensor {name!r} has byte range [{begin}, {end}) that does not "
                            f"fit its shape {list(shape)} or the file (truncated?)")
        entries[name] = _Entry(file, dtype, shape, base + begin, base + end)
    return entries
