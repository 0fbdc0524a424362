"""How a weight is laid out in GPU memory: the buffers ("planes") the GPU kernels read.

The compiler's memory plan counts exactly these bytes, the GPU kernels (``picc.codegen_cuda``)
take exactly these buffers, and the runtime's GPU executors upload weights into them; this module
is the one statement of the layout that all three read (the runtime never imports the compiler,
the compiler may import the runtime).

* A matrix (rank >= 2) ``[rows..., cols]`` keeps its storage format. f32 and f16 are one plane.
  GGUF block formats are split into planes so that every block's bytes start 16-byte aligned (an
  18- or 20-byte block cannot be): ``_qs`` (q4_0 / q4_1: the 16 nibble bytes of each block, as
  little-endian uint32 words ``[rows..., cols / 8]``; q8_0: int8 ``[rows..., cols]``), ``_d``
  (f16 scales ``[rows..., cols / 32]``) and, for q4_1, ``_m`` (f16 minimums). Element j of a q4
  block is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 otherwise
  (ggml's order). The nibbles are words, not bytes, for the kernels: a GPU thread holds a loaded
  block in four registers and shifts its nibbles out, where a byte array would live in local
  memory (measured on an H100: the q4_0 gather-GEMV read 0.55 TB/s, f16 2.9).
* A vector (rank 1: norm weights, biases, frequencies) is float32 whatever its storage format:
  the kernels read vectors as f32 and they are small.

Planes follow each other in the weight's buffer, each at a multiple of ``PLANE_ALIGN`` bytes
(what zero-copy tensor views need), so a weight's GPU size can exceed its size in the file by a
little padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PLANE_ALIGN = 64
QBLOCK = 32
_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
_ELEMENT = {"float32": 4, "float16": 2, "uint8": 1, "int8": 1, "int32": 4, "uint32": 4}


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a kernel buffer's dtype (``float32``, ``float16``, ``int32``, ``uint32``,
    ``uint8``, ``int8``)."""
    return _ELEMENT[dtype]


class LayoutError(Exception):
    """A weight that has no GPU layout (an unsupported format or shape)."""


@dataclass(frozen=True, slots=True)
class Plane:
    """One buffer of a weight on the GPU: ``suffix`` names it (``""``, ``"_qs"``, ``"_d"``, ``"_m"``)."""

    suffix: str
    shape: tuple[int, ...]
    dtype: str  # numpy / TVM dtype name
    offset: int  # bytes from the start of the weight's buffer

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ELEMENT[self.dtype]


ROW_TILE = 8
"""Rows per thread block of the GPU's gather-GEMV: index lists (and their dot products) are padded
to a multiple of it, so no thread reads past them."""


AXPY_BLOCKS = 256
"""Thread blocks the GPU's down-projection AXPY aims for (column tiles x row slices): enough to
keep every SM of a large GPU (132 on an H100) busy with a few blocks each."""


def axpy_slices(rows: int, hidden: int) -> int:
    """Row slices of an FFN's down-projection AXPY on the GPU: each slice sums its rows into its own
    partial row ``y_part[slice]``, and a second launch adds the slices up. A divisor of ``rows`` (no
    slice reads past the rows), of at least 16 rows a slice, as many as reach ``AXPY_BLOCKS`` blocks
    with the column tiles of ``hidden`` (128 columns a tile), at most 64."""
    want = max(1, AXPY_BLOCKS // max(1, hidden // 128))
    limit = max(1, min(64, want, rows // 16))
    return max(d for d in range(1, limit + 1) if rows % d == 0)


ATTENTION_SHARED = 32 * 1024
"""Shared memory (bytes) a thread block of the one-launch decode attention may hold: its head's
scores and probabilities, 4 bytes each for every cached position. A quarter of what a Turing SM
has, so blocks of several heads can share an SM; far below the 48 KiB a block gets without opt-in."""


def fused_attention(ctx: int) -> bool:
    """Whether a decode step's GPU attention over a cache of ``ctx`` positions is one kernel
    (``picc.codegen_cuda.layers.attention_decode``: no scratch in the workspace) rather than five
    with their scratch: its two per-head arrays of ``ctx`` floats fit in ``ATTENTION_SHARED``, and
    ``ctx`` is a multiple of 32, so a block's threads tile the positions without a remainder."""
    return ctx % 32 == 0 and 2 * 4 * ctx <= ATTENTION_SHARED


def aligned(n: int) -> int:
    """``n`` rounded up to ``PLANE_ALIGN``."""
    return -(-n // PLANE_ALIGN) * PLANE_ALIGN


def padded_rows(n: int) -> int:
    """``n`` rounded up to ``ROW_TILE``: the static length of an FFN's index list."""
    return -(-n // ROW_TILE) * ROW_TILE


def plane_specs(dtype: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
    """``(suffix, shape, dtype)`` of each plane of a weight of ``dtype`` and logical ``shape``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 1:
        if dtype not in ("f32", "f16", "bf16"):
            raise LayoutError(f"a {dtype} vector has no GPU layout (vectors are float)")
        return [("", shape, "float32")]
    if dtype in ("f32", "f16"):
        return [("", shape, "float32" if dtype == "f32" else "float16")]
    if dtype not in _BLOCK_BYTES:
        raise LayoutError(f"weight format {dtype!r} has no GPU layout; expected f32, f16, q4_0, q4_1 or q8_0")
    *rows, cols = shape
    if cols % QBLOCK:
        raise LayoutError(f"a {dtype} matrix needs rows of a multiple of {QBLOCK} elements, got {cols}")
    scales = (*rows, cols // QBLOCK)
    if dtype == "q8_0":
        return [("_qs", (*rows, cols), "int8"), ("_d", scales, "float16")]
    planes = [("_qs", (*rows, cols // 8), "uint32"), ("_d", scales, "float16")]
    return planes + ([("_m", scales, "float16")] if dtype == "q4_1" else [])


def planes(dtype: str, shape: tuple[int, ...]) -> list[Plane]:
    """The planes of a weight with their offsets in its buffer (see the module docstring)."""
    out, at = [], 0
    for suffix, pshape, pdtype in plane_specs(dtype, shape):
        plane = Plane(suffix, pshape, pdtype, at)
        out.append(plane)
        at = aligned(at + plane.nbytes)
    return out


def gpu_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a weight's GPU buffer: its planes, each but the last padded to ``PLANE_ALIGN``."""
    last = planes(dtype, shape)[-1]
    return last.offset + last.nbytes


def split_blocks(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> list[np.ndarray]:
    """GGUF block bytes (q4_0, q4_1, q8_0) of a ``shape`` matrix -> its planes' arrays, exactly."""
    *rows, cols = shape
    nblocks = cols // QBLOCK
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(*rows, nblocks, _BLOCK_BYTES[dtype])

    def half(at: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16).reshape(*rows, nblocks)

    if dtype == "q8_0":
        return [np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(*rows, cols), half(0)]
    start = 2 if dtype == "q4_0" else 4
    qs = np.ascontiguousarray(blocks[..., start:]).view("<u4").reshape(*rows, cols // 8)
    return [qs, half(0)] + ([half(2)] if dtype == "q4_1" else [])


def plane_arrays(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> list[np.ndarray]:
    """A stored weight (``data`` as the .pib keeps it) as the arrays of its GPU planes."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 1:
        if dtype == "bf16":
            bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
            return [bits.view(np.float32).reshape(shape)]
        return [np.asarray(data).astype(np.float32).reshape(shape)]
    if dtype in ("f32", "f16"):
        return [np.asarray(data).reshape(shape)]
    return split_blocks(data, dtype, shape)


def write_planes(dest: np.ndarray, data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    """Lay weight ``data`` out into ``dest`` (uint8, the weight's GPU buffer) plane by plane."""
    for plane, array in zip(planes(dtype, shape), plane_arrays(data, dtype, shape), strict=True):
        dest[plane.offset : plane.offset + plane.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
