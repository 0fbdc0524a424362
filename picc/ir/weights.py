"""The weight store: the data behind a module's ``weight @name : type`` declarations.

Tensors keep their storage format (quantized blocks stay quantized); ``f32(name)`` gives the exact
float32 value, kept for the next call while the float32 values kept stay under a budget
(``F32_CACHE_BYTES``: a 7B model's would be 27 GB; the least recently used go first). The store
only grows: a pass that changes a weight adds it under a new name, so every module that was ever
valid against the store stays valid.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from picc import quant
from picc.errors import PiccError
from picc.fsutil import atomic_path
from picc.ir.module import Module
from picc.ir.types import DType, TensorType

_METADATA_KEY = "picc.tensors"
# The float32 values a store keeps (WeightStore.f32): SmolLM2's all fit (~0.6 GB), a 7B model's
# layer at a time does (a layer is 0.8 GB in f32), and the interpreter and profiling run op by op.
F32_CACHE_BYTES = 2 << 30


@dataclass(frozen=True, slots=True, eq=False)
class Tensor:
    """One weight in its storage format.

    ``data`` is float32/float16 for those dtypes, uint16 bit patterns for bf16, and the raw GGUF
    block bytes (uint8, one row of blocks per row of the matrix) for quantized dtypes.
    """

    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def type(self) -> TensorType:
        return TensorType(self.dtype, self.shape)

    def to_f32(self) -> np.ndarray:
        if self.dtype == DType.F32:
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        return quant.dequantize(np.asarray(self.data), self.dtype.value, self.shape)

    def take_rows(self, rows: np.ndarray) -> Tensor:
        """The given rows of a matrix (or elements of a vector), in its dtype: a fused matrix's parts."""
        data = np.ascontiguousarray(np.asarray(self.data)[rows])
        return Tensor(self.dtype, (len(rows), *self.shape[1:]), data)

    def column_pieces(self, pieces: int) -> Tensor:
        """A matrix's columns cut into ``pieces`` equal runs, each run's rows after the previous
        run's: [rows, pieces * w] becomes [pieces * rows, w] (a shared expert's down matrix as
        expert-wide down matrices). In its dtype, bytes as they are: a run must be whole blocks."""
        rows = self.shape[0]
        data = np.asarray(self.data).reshape(rows, pieces, -1).transpose(1, 0, 2)
        return Tensor(self.dtype, (pieces * rows, self.shape[1] // pieces),
                      np.ascontiguousarray(data).reshape(pieces * rows, -1))

    @staticmethod
    def stacked(parts: list[Tensor]) -> Tensor:
        """Matrices of one dtype and row length, their rows one after another, in that dtype
        (a mixture's experts as one matrix)."""
        if len({(t.dtype, t.shape[1:]) for t in parts}) != 1:
            raise PiccError(f"cannot stack {', '.join(str(t.type) for t in parts)}: dtypes or row lengths differ")
        data = np.concatenate([np.asarray(t.data).reshape(t.shape[0], -1) for t in parts])
        return Tensor(parts[0].dtype, (sum(t.shape[0] for t in parts), *parts[0].shape[1:]),
                      data.reshape(-1, *np.asarray(parts[0].data).shape[1:]))

    @staticmethod
    def from_f32(x: np.ndarray, dtype: DType = DType.F32) -> Tensor:
        """Store float data ``x`` as ``dtype`` (quantizing it when ``dtype`` is quantized)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if dtype == DType.F32:
            return Tensor(dtype, x.shape, x)
        if dtype == DType.F16:
            return Tensor(dtype, x.shape, x.astype(np.float16))
        return Tensor(dtype, x.shape, quant.quantize(x, dtype.value))


class WeightStore:
    """Named tensors, append-only, with cached float32 views."""

    def __init__(self, tensors: dict[str, Tensor] | None = None) -> None:
        self._tensors: dict[str, Tensor] = dict(tensors or {})
        self._f32: OrderedDict[str, np.ndarray] = OrderedDict()  # least recently used first
        # f32 is called from the interpreter's window threads (Interpreter.run_many): one
        # dequantizes a weight while the others that want it wait, rather than do it again.
        self._f32_lock = threading.Lock()
        self._f32_budget: int | None = None  # None: F32_CACHE_BYTES (read when used)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"weight @{name} is not in the weight store") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self._tensors:
            raise KeyError(f"weight @{name} is already in the store (the store is append-only)")
        self._tensors[name] = tensor

    def fresh_name(self, name: str) -> str:
        """``name``, or ``name2``, ``name3``, ... : the first not yet in the (append-only) store."""
        candidate, n = name, 1
        while candidate in self._tensors:
            n += 1
            candidate = f"{name}{n}"
        return candidate

    def f32(self, name: str) -> np.ndarray:
        """The exact float32 value of weight ``name`` (thread-safe)."""
        with self._f32_lock:
            if name in self._f32:
                self._f32.move_to_end(name)
                return self._f32[name]
            value = self[name].to_f32()
            self._f32[name] = value
            self._evict()
            return value

    @contextlib.contextmanager
    def f32_budget(self, nbytes: int) -> Iterator[None]:
        """Keep at most ``nbytes`` of float32 values inside the block (at least the last one):
        for a pass that reads each weight once, in order, where the cache's budget would only
        hold weights it is done with (the Fisher pass: one decoder block's, not 2 GB)."""
        with self._f32_lock:
            before, self._f32_budget = self._f32_budget, nbytes
            self._evict()
        try:
            yield
        finally:
            with self._f32_lock:
                self._f32_budget = before

    def _evict(self) -> None:
        """Drop the least recently used float32 values past the budget (the lock held)."""
        budget = F32_CACHE_BYTES if self._f32_budget is None else self._f32_budget
        kept = sum(v.nbytes for v in self._f32.values())
        while kept > budget and len(self._f32) > 1:
            kept -= self._f32.popitem(last=False)[1].nbytes

    def check_against(self, module: Module) -> None:
        """Raise ``PiccError`` unless every weight the module declares is here with its type."""
        for decl in module.weights:
            if decl.name not in self._tensors:
                raise PiccError(f"weight @{decl.name} is declared by the module but missing from "
                                "its weight store")
            t = self._tensors[decl.name]
            if (t.dtype, t.shape) != (decl.type.dtype, decl.type.shape):
                raise PiccError(f"weight @{decl.name} is declared {decl.type} but stored as {t.type}")

    def copy(self) -> WeightStore:
        """A store with the same tensors (shared, not copied) that grows on its own: what a
        pipeline adds to it does not appear here."""
        store = WeightStore(self._tensors)
        store._f32 = OrderedDict(self._f32)
        return store

    def subset(self, names: list[str]) -> WeightStore:
        return WeightStore({n: self._tensors[n] for n in names})

    # ---------------------------------------------------------------- files

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        """Write a safetensors file atomically (a temp file renamed into place)."""
        from safetensors import SafetensorError
        from safetensors.numpy import save_file

        arrays = {name: np.ascontiguousarray(t.data) for name, t in self._tensors.items()}
        index = {name: [t.dtype.value, list(t.shape)] for name, t in self._tensors.items()}
        meta = dict(metadata or {})
        meta[_METADATA_KEY] = json.dumps(index)
        with atomic_path(Path(path)) as tmp:
            try:
                save_file(arrays, str(tmp), metadata=meta)
            except SafetensorError as e:  # its OSErrors (a full disk) come as this
                raise PiccError(f"cannot write {path}: {e}") from None

    @staticmethod
    def load(path: Path) -> tuple[WeightStore, dict[str, str]]:
        """Read a file written by ``save``: the store and the extra metadata."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise PiccError(f"{path}: weight file not found")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = dict(f.metadata() or {})
                index = json.loads(meta.pop(_METADATA_KEY))
                tensors = {}
                for name, (dtype, shape) in index.items():
                    tensors[name] = Tensor(DType(dtype), tuple(shape), f.get_tensor(name))
        except PiccError:
            raise
        except Exception as e:  # safetensors raises several types for a damaged file
            raise PiccError(f"{path}: not a picc weight file ({type(e).__name__}: {e})") from None
        return WeightStore(tensors), meta
