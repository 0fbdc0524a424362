"""Weight formats as the GPU kernels read them: TE placeholders, a decode expression, numpy packing.

A weight matrix ``W[rows..., cols]`` is passed to a kernel as one or more buffers, per format (the
planes of ``runtime.gpu_layout``, the layout the memory plan counts and the runtime uploads):

    f32   W      float32 [rows..., cols]
    f16   W      float16 [rows..., cols]
    q4_0  W_qs   uint32  [rows..., cols / 8]    the 16 nibble bytes of every GGUF block, in order
          W_d    float16 [rows..., cols / 32]   the block scales
    q4_1  W_qs   uint32  [rows..., cols / 8]    as q4_0
          W_d    float16 [rows..., cols / 32]   the block scales
          W_m    float16 [rows..., cols / 32]   the block minimums
    q8_0  W_qs   int8    [rows..., cols]        the 32 values of every block, in order
          W_d    float16 [rows..., cols / 32]   the block scales

q4_0 is GGUF's block format split into two planes: an 18-byte GGUF block (f16 scale + 16 bytes)
starts at odd 2-byte offsets, so a 16-byte vector load of its nibbles would be misaligned; the
split planes keep every block's nibbles at a 16-byte boundary. Element ``j`` of block ``b`` is
``(q - 8) * d`` with ``q`` the low nibble of byte ``b*16 + j`` for ``j < 16`` and the high nibble
of byte ``b*16 + j - 16`` otherwise (ggml's order); the bytes are read as little-endian words,
four to a block, so a nibble is one shift and mask of a register. q4_1 decodes ``q * d + m`` from the same
nibbles, q8_0 ``q * d`` from signed bytes; the GGUF blocks of both (20 and 34 bytes) are misaligned
the same way, so they are split into planes too. ``split_blocks`` turns GGUF bytes into the planes,
exactly (no requantization).

Every kernel accumulates in float32; a decoded weight is ``float32(d) * float32(q - 8)``, the
same product ``picc.quant.dequantize`` computes, so host results differ from numpy only by
summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr

from picc import quant
from picc.errors import PiccError
from runtime import gpu_layout

FORMATS = ("f32", "f16", "q4_0", "q4_1", "q8_0")
Q4_BLOCK = 32
_Q4_NIBBLE_BYTES = 16
_Q4_WORDS = 4  # uint32 words of a block's nibbles


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How one weight format is laid out in kernel buffers and decoded to float32."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise PiccError(f"weight format {self.name!r} is not supported by the GPU kernels; "
                            f"expected one of {', '.join(FORMATS)}")

    @property
    def vector(self) -> int:
        """Elements of a row one thread decodes per step: one 16-byte load (a q4_0 block)."""
        return {"f32": 4, "f16": 8, "q4_0": Q4_BLOCK, "q4_1": Q4_BLOCK, "q8_0": Q4_BLOCK}[self.name]

    def buffer_specs(self, prefix: str, rows: tuple[int, ...], cols: int) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, dtype)`` of the buffers holding a ``[rows..., cols]`` matrix."""
        if cols % self.vector:
            raise PiccError(f"{prefix}: {cols} columns are not a multiple of {self.vector} "
                            f"(the {self.name} kernels read {self.vector} elements per step)")
        try:
            specs = gpu_layout.plane_specs(self.name, (*rows, cols))
        except gpu_layout.LayoutError as e:
            raise PiccError(f"{prefix}: {e}") from None
        return [(prefix + suffix, shape, dtype) for suffix, shape, dtype in specs]

    def placeholders(self, prefix: str, rows: tuple[int, ...], cols: int) -> list[te.Tensor]:
        return [te.placeholder(shape, dtype, name=name)
                for name, shape, dtype in self.buffer_specs(prefix, rows, cols)]

    def load(self, bufs: list[te.Tensor], row: tuple[PrimExpr, ...], kv: PrimExpr,
             kl: PrimExpr, scale: PrimExpr | None = None) -> PrimExpr:
        """Element ``kv * vector + kl`` of row ``row``, as float32, times ``scale`` if given.

        A block format folds ``scale`` into its block scale (``(scale * d) * q``): one product a
        block rather than one an element, which is what the down AXPY's ``h * w`` needs (h is
        the row's; on a GPU the 4-bit decode is arithmetic-bound)."""
        if self.name in ("f32", "f16"):
            w = bufs[0][(*row, kv * self.vector + kl)]
            w = w if self.name == "f32" else w.astype("float32")
            return w if scale is None else scale * w
        d = bufs[1][(*row, kv)].astype("float32")
        ds = d if scale is None else scale * d
        if self.name == "q8_0":
            return ds * bufs[0][(*row, kv * Q4_BLOCK + kl)].astype("float32")
        byte = kl % _Q4_NIBBLE_BYTES  # byte of the block, then which nibble of it
        word = bufs[0][(*row, kv * _Q4_WORDS + byte // 4)]
        nibble = (word >> ((byte % 4) * 8 + (kl // _Q4_NIBBLE_BYTES) * 4).astype("uint32")) & _u32(15)
        if self.name == "q4_1":
            m = bufs[2][(*row, kv)].astype("float32")
            return ds * nibble_float(nibble, 0) + (m if scale is None else scale * m)
        return ds * nibble_float(nibble, 8)


_TWO_23 = 0x4B000000
"""The bits of float32 2**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + q."""


def nibble_float(nibble: PrimExpr, offset: int) -> PrimExpr:
    """``float32(nibble - offset)``, exactly, without an integer-to-float conversion: the nibble
    goes into the mantissa of 2**23 and one subtraction removes 2**23 + offset. A GPU converts
    integers at a quarter of its float rate (16 a clock per SM on sm_80 and sm_90 against 64-128
    adds), which bounded the 4-bit kernels' decode; the OR and the subtraction run at full rate."""
    biased = tirx.reinterpret("float32", nibble | _u32(_TWO_23))
    return biased - tirx.const(float(2**23 + offset), "float32")


def _u32(value: int) -> PrimExpr:
    return tirx.const(value, "uint32")


def pack(w: np.ndarray, fmt: str) -> list[np.ndarray]:
    """The kernel buffers of float32 matrix ``w`` stored as ``fmt`` (quantizing as ggml does)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if fmt == "f32":
        return [w]
    if fmt == "f16":
        return [w.astype(np.float16)]
    if fmt in ("q4_0", "q4_1", "q8_0"):
        return split_blocks(quant.quantize(w, fmt), fmt, w.shape)
    raise PiccError(f"weight format {fmt!r} is not supported; expected one of {', '.join(FORMATS)}")


def split_q4_0(raw: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """GGUF q4_0 bytes of a ``shape`` matrix -> ``[qs uint32 [..., cols/8], d float16 [..., cols/32]]``."""
    return split_blocks(raw, "q4_0", shape)


def split_blocks(raw: np.ndarray, fmt: str, shape: tuple[int, ...]) -> list[np.ndarray]:
    """GGUF block bytes (q4_0, q4_1, q8_0) of a ``shape`` matrix -> the format's planes, exactly
    (``runtime.gpu_layout``, which the runtime uses to upload weights)."""
    return gpu_layout.split_blocks(raw, fmt, shape)


def unpack(bufs: list[np.ndarray], fmt: str) -> np.ndarray:
    """The float32 matrix kernel buffers ``bufs`` (of ``fmt``) hold: the tests' reference."""
    if fmt in ("f32", "f16"):
        return bufs[0].astype(np.float32)
    qs, d = bufs[:2]
    shape = qs.shape[:-1]
    if fmt == "q8_0":
        q = qs.astype(np.float32).reshape(*shape, -1, Q4_BLOCK)
        return (d.astype(np.float32)[..., None] * q).reshape(*shape, -1)
    offset = 8 if fmt == "q4_0" else 0
    qs = np.ascontiguousarray(qs).view(np.uint8).reshape(*shape, -1)
    lo = (qs & 0x0F).astype(np.int8) - offset
    hi = (qs >> 4).astype(np.int8) - offset
    lo = lo.reshape(*shape, -1, _Q4_NIBBLE_BYTES)
    hi = hi.reshape(*shape, -1, _Q4_NIBBLE_BYTES)
    q = np.concatenate([lo, hi], axis=-1).astype(np.float32)
    values = d.astype(np.float32)[..., None] * q
    if fmt == "q4_1":
        values = values + bufs[2].astype(np.float32)[..., None]
    return values.reshape(*shape, -1)
