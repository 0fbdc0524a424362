"""Exact numpy (de)quantization of the GGUF weight formats picc accepts.

Block formats (each block covers 32 consecutive elements of a row; a row is a
whole number of blocks, blocks are stored back to back):

    q4_0  2 + 16 bytes  f16 scale d; 32 nibbles q.         x = d * (q - 8)
    q4_1  2 + 2 + 16    f16 scale d, f16 minimum m; nibbles. x = d * q + m
    q8_0  2 + 32 bytes  f16 scale d; 32 int8 q.            x = d * q
    mxfp4 1 + 16 bytes  E8M0 exponent e; 32 nibbles q.      x = kvalues[q] * 2^(e - 128)

Nibble order follows ggml: byte j of a block holds element j in its low nibble
and element j + 16 in its high nibble.

mxfp4 is gpt-oss's expert format (GGML type MXFP4, OCP microscaling FP4):
``kvalues = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)`` (E2M1
values doubled, as int8) and the scale ``2^(e - 128)`` (half of E8M0's
``2^(e - 127)``), made bit-exactly as ggml's GGML_E8M0_TO_FP32_HALF: the f32 bits
``0x00200000 << e`` (a denormal) for e < 2, else ``(e - 1) << 23``. Hugging Face
checkpoints store the same values as ``*_blocks`` / ``*_scales`` with another
nibble order (byte j: elements 2j and 2j + 1); :func:`mxfp4_from_hf` repacks
them into these blocks, exactly.

Plain formats: "f32", "f16" (IEEE half) and "bf16" (top 16 bits of an f32).

Every function here is bit-exact with ggml's reference C code (quantize_row_*_ref
and dequantize_row_*) and with `gguf.quants`, which ports that code to numpy;
tests/test_quant.py checks this. Dequantization multiplies in float32 without
fused multiply-add, as the reference does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BLOCK_SIZE: dict[str, int] = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "mxfp4": 32}
"""Elements per block, by block-format name."""

BLOCK_BYTES: dict[str, int] = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "mxfp4": 17}
"""Bytes per block, by block-format name."""

ELEMENT_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2}
"""Bytes per element of the plain (unblocked) formats."""

DTYPES: tuple[str, ...] = (*ELEMENT_BYTES, *BLOCK_SIZE)
"""Every dtype name this module understands."""

_SCALE_BYTES = 2  # every block but mxfp4's starts with an f16 scale

MXFP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""The int8 value of each mxfp4 nibble (ggml's ``kvalues_mxfp4``: E2M1 values doubled)."""

# Blocks are processed this many at a time so the float32 temporaries stay in
# cache; one pass over a whole 28M-element matrix is several times slower.
_CHUNK_BLOCKS = 16384


def raw_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes needed to store a tensor of logical `shape` in `dtype`.

    For block formats the last dimension must be a multiple of the block size.
    """
    count = math.prod(shape)
    if dtype in ELEMENT_BYTES:
        return count * ELEMENT_BYTES[dtype]
    _check_block_shape(dtype, shape)
    return count // BLOCK_SIZE[dtype] * BLOCK_BYTES[dtype]


def raw_shape(dtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the raw array `quantize` returns for a tensor of logical `shape`.

    Plain formats keep the logical shape; block formats turn the last dimension
    into its byte count, as GGUF files and `gguf.quants` do.
    """
    if dtype in ELEMENT_BYTES:
        return tuple(shape)
    _check_block_shape(dtype, shape)
    *leading, cols = shape
    return (*leading, cols // BLOCK_SIZE[dtype] * BLOCK_BYTES[dtype])


def dequantize(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode `raw` (stored as `dtype`) into a float32 array of logical `shape`.

    `raw` may be any contiguous array holding exactly `raw_nbytes(dtype, shape)`
    bytes: uint8 bytes as read from a GGUF file, or, for the plain formats,
    float32 / float16 / uint16 elements.
    """
    expected = raw_nbytes(dtype, shape)
    if raw.nbytes != expected:
        raise ValueError(f"{dtype} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.nbytes}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if dtype == "f32":
        return data.view(np.float32).reshape(shape)
    if dtype == "f16":
        return data.view(np.float16).astype(np.float32).reshape(shape)
    if dtype == "bf16":
        # bf16 is the high half of an f32, so widening is a shift.
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = data.reshape(-1, BLOCK_BYTES[dtype])
    out = np.empty((blocks.shape[0], BLOCK_SIZE[dtype]), dtype=np.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = slice(start, start + _CHUNK_BLOCKS)
        out[chunk] = _DEQUANTIZE_BLOCKS[dtype](blocks[chunk])
    return out.reshape(shape)


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """Encode `x` (rounded to float32 first) as `dtype`, exactly as ggml does.

    Block formats return uint8 of shape `raw_shape(dtype, x.shape)`, the GGUF
    layout. Plain formats return elements of `x.shape`: float32 for "f32",
    float16 for "f16" and uint16 bit patterns for "bf16".
    """
    values = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "f32":
        return values
    if dtype == "f16":
        return values.astype(np.float16)
    if dtype == "bf16":
        return _float32_to_bf16_bits(values)
    if dtype not in BLOCK_SIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    out_shape = raw_shape(dtype, values.shape)
    blocks = values.reshape(-1, BLOCK_SIZE[dtype])
    out = np.empty((blocks.shape[0], BLOCK_BYTES[dtype]), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = slice(start, start + _CHUNK_BLOCKS)
        out[chunk] = _QUANTIZE_BLOCKS[dtype](blocks[chunk])
    return out.reshape(out_shape)


INT_X_MAX = {"i16": 32767, "i8": 127}
"""The integer that a block's largest |x| becomes in :func:`round_x_blocks`, per x format."""


def round_x_blocks(x: np.ndarray, x_format: str) -> np.ndarray:
    """``x`` (float32, last axis a multiple of 32) as the integer dot products of an op with
    ``x_format`` (``"i16"`` or ``"i8"``) read it: per block of 32, ``q = roundeven(x * (top /
    amax))`` (``top`` = 32767 or 127), then ``q * (amax / top)``, every step one float32 rounding,
    as the CPU kernels compute it (``picc.codegen_cpu.int16x.emit_int_x``). An all-zero block
    stays zero. Each element moves by at most half a step: 2^-16 (int16) or 1/254 (int8) of its
    block's largest |x|."""
    if x_format not in INT_X_MAX:
        raise ValueError(f"x is rounded to one of {sorted(INT_X_MAX)}, not {x_format!r}")
    values = np.asarray(x, dtype=np.float32)
    if values.shape[-1] % 32:
        raise ValueError(f"rounding to {x_format} blocks needs a multiple of 32 values per row, got {values.shape[-1]}")
    blocks = values.reshape(*values.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    top = np.float32(INT_X_MAX[x_format])
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, top / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q * (amax / top)).reshape(values.shape).astype(np.float32)


def round_to_int16_blocks(x: np.ndarray) -> np.ndarray:
    """:func:`round_x_blocks` to int16."""
    return round_x_blocks(x, "i16")


def _check_block_shape(dtype: str, shape: Sequence[int]) -> None:
    if dtype not in BLOCK_SIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if len(shape) == 0 or shape[-1] % BLOCK_SIZE[dtype] != 0:
        raise ValueError(f"{dtype} needs a last dimension divisible by {BLOCK_SIZE[dtype]}, got shape {tuple(shape)}")


# --- plain formats -----------------------------------------------------------


def _float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns like ggml_compute_fp32_to_bf16."""
    bits = values.view(np.uint32)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    # Truncating a NaN could clear every mantissa bit and yield infinity, so
    # ggml forces the quiet bit instead of rounding.
    quiet_nan = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
    # Round half to even; uint64 because the carry can overflow 32 bits.
    wide = bits.astype(np.uint64)
    rounded = (wide + np.uint64(0x7FFF) + ((wide >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.where(is_nan, quiet_nan >> np.uint32(16), rounded).astype(np.uint16)


# --- block formats: decoding -------------------------------------------------


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 stored at byte `offset` of each block, as a float32 column."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) uint8 values: low nibbles first, then high."""
    values = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.uint8)
    half = packed.shape[1]
    np.bitwise_and(packed, np.uint8(0x0F), out=values[:, :half])
    np.right_shift(packed, np.uint8(4), out=values[:, half:])
    return values


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_at(blocks, 0)
    quants = _unpack_nibbles(blocks[:, _SCALE_BYTES:]).astype(np.int8) - np.int8(8)
    return scale * quants.astype(np.float32)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_at(blocks, 0)
    minimum = _f16_at(blocks, 2)
    quants = _unpack_nibbles(blocks[:, 2 * _SCALE_BYTES :]).astype(np.float32)
    return scale * quants + minimum


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_at(blocks, 0)
    return blocks[:, _SCALE_BYTES:].view(np.int8).astype(np.float32) * scale


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """``2^(e - 128)`` as float32 for uint8 exponents ``e``, bit for bit as ggml's
    GGML_E8M0_TO_FP32_HALF (a denormal for e < 2)."""
    wide = np.asarray(e, dtype=np.uint32)
    bits = np.where(wide < 2, np.uint32(0x00200000) << wide, (wide - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


_MXFP4_LUT = np.array(MXFP4_VALUES, dtype=np.int8)


def _dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    scale = e8m0_to_f32_half(blocks[:, :1])
    with np.errstate(over="ignore"):  # e > 252 can overflow to inf, as in ggml
        return _MXFP4_LUT[_unpack_nibbles(blocks[:, 1:])].astype(np.float32) * scale


# --- block formats: encoding -------------------------------------------------


def _reciprocal_or_zero(scale: np.ndarray) -> np.ndarray:
    """1 / scale in float32, with 0 where scale is 0 (an all-zero block)."""
    return np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)


def _round_half_away_from_zero(values: np.ndarray) -> np.ndarray:
    """C's roundf; np.round rounds halves to even, and floor(|v| + 0.5) is
    wrong just below 0.5, where the addition itself rounds up."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.sign(values) * (whole + np.floor(2 * (magnitude - whole)))


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """(n, 32) values in 0..15 -> (n, 16) bytes, the inverse of _unpack_nibbles."""
    half = values.shape[1] // 2
    return values[:, :half] | (values[:, half:] << np.uint8(4))


def _f16_bytes(column: np.ndarray) -> np.ndarray:
    return column.astype(np.float16).view(np.uint8)


def _quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # The scale takes the sign of the largest-magnitude element (the first one
    # on ties), so that element maps exactly to quant 0 (value -8 * d).
    largest = np.abs(blocks).argmax(axis=1, keepdims=True)
    scale = np.take_along_axis(blocks, largest, axis=1) / np.float32(-8)
    shifted = blocks * _reciprocal_or_zero(scale) + np.float32(8.5)
    quants = np.clip(np.trunc(shifted), 0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(scale), _pack_nibbles(quants)], axis=1)


def _quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    minimum = blocks.min(axis=1, keepdims=True)
    scale = (blocks.max(axis=1, keepdims=True) - minimum) / np.float32(15)
    shifted = (blocks - minimum) * _reciprocal_or_zero(scale) + np.float32(0.5)
    quants = np.clip(np.trunc(shifted), 0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(scale), _f16_bytes(minimum), _pack_nibbles(quants)], axis=1)


def _quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    quants = _round_half_away_from_zero(blocks * _reciprocal_or_zero(scale)).astype(np.int8)
    return np.concatenate([_f16_bytes(scale), quants.view(np.uint8)], axis=1)


def _quantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    # ggml's quantize_row_mxfp4_ref: the exponent puts the largest |x| in [4, 8) steps of the
    # scale (up to the top value 12 = 6 * 2), then each element takes the nearest of the 16
    # values (the first on ties).
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    values = e8m0_to_f32_half(e)[:, :, None] * _MXFP4_LUT.astype(np.float32)
    quants = np.abs(values - blocks[:, :, None]).argmin(axis=2).astype(np.uint8)
    return np.concatenate([e, _pack_nibbles(quants)], axis=1)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face's MXFP4 tensors (gpt-oss's ``*_blocks``, uint8 ``[..., rows, n_blocks, 16]``,
    byte j holding element 2j (low nibble) and 2j + 1 (high); ``*_scales``, uint8 ``[..., rows,
    n_blocks]``, E8M0 with bias 127 over FP4 values ``lut[q] = MXFP4_VALUES[q] / 2``) as mxfp4
    blocks, uint8 ``[..., rows, n_blocks * 17]``: the same values exactly (a scale byte is
    ggml's ``e``; only the nibbles move), the row of ``cols = 32 n_blocks`` elements that
    ``transformers``' ``convert_moe_packed_tensors`` makes (before its transpose)."""
    packed = np.ascontiguousarray(blocks, dtype=np.uint8)
    exps = np.ascontiguousarray(scales, dtype=np.uint8)
    if packed.ndim < 2 or packed.shape[-1] != 16 or packed.shape[:-1] != exps.shape:
        raise ValueError(f"MXFP4 blocks [..., n_blocks, 16] and scales [..., n_blocks] expected, got "
                         f"{packed.shape} and {exps.shape}")
    flat = packed.reshape(-1, 16)
    elements = np.empty((flat.shape[0], 32), dtype=np.uint8)  # element order
    elements[:, 0::2] = flat & np.uint8(0x0F)
    elements[:, 1::2] = flat >> np.uint8(4)
    out = np.concatenate([exps.reshape(-1, 1), _pack_nibbles(elements)], axis=1)
    return out.reshape(*exps.shape[:-1], exps.shape[-1] * BLOCK_BYTES["mxfp4"])


_DEQUANTIZE_BLOCKS = {
    "q4_0": _dequantize_q4_0,
    "q4_1": _dequantize_q4_1,
    "q8_0": _dequantize_q8_0,
    "mxfp4": _dequantize_mxfp4,
}
_QUANTIZE_BLOCKS = {
    "q4_0": _quantize_q4_0,
    "q4_1": _quantize_q4_1,
    "q8_0": _quantize_q8_0,
    "mxfp4": _quantize_mxfp4,
}
