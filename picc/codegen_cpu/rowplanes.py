"""The *rowplanes* layout of a sparse FFN's neuron-major down projection, and the code that reads it.

A fused sparse FFN adds ``h_i down_t[i]`` to y for each active neuron i: an AXPY per row of the
neuron-major down projection. In GGUF's rows every block of 32 elements starts with its f16 scale
(and q4_1's minimum), so an AXPY spends, for every row and block, vector-pipe work on the scalars
alone: load and convert ``d`` (and ``m``), multiply by ``h``, broadcast, and add ``h m`` to the
block's constant term -- six of the twenty operations of a q4_1 row block. In the rowplanes layout
a row holds the same bytes regrouped into planes::

    q4_1  f16 d[nb], f16 m[nb], 16 B of nibbles[nb]
    q4_0  f16 d[nb],            16 B of nibbles[nb]
    q8_0  f16 d[nb],            32 B of int8[nb]

(``nb`` = k / 32 blocks, each block's quants in GGUF's order), so a row's coefficients ``h d_b``
and constant terms (``h m_b``, q4_0's ``-8 h d_b``) are computed eight blocks at a time into a
stack array, and the block loop reads one coefficient per row and block with a broadcast load,
which needs no vector pipe. The arithmetic and its order are those of the AXPYs of GGUF rows
this replaced (``(h d) q`` in f32, the constant terms summed per block in row order): the same
bits.

Measured on Zen 3 (AVX2), one thread, q4_1 rows in random order with the next rows prefetched:
1.8 against 2.2 ns a row and block at k = 4096 from memory, 1.6 against 1.95 at k = 576. The fused
kernel (``bench/kernels.py``, 4096 x 11008, two threads, 10-50% active) takes 6-11% less time a
layer with q4_1 and int16 x, 1-6% with float x, 23-26% with q4_0 (docs/codegen_cpu.md).

The block loop is :func:`emit_axpys`; prefill reads a slice of a row back as floats
(:func:`emit_row_to_f32`). :func:`to_rowplanes` and :func:`from_rowplanes` convert a matrix
between GGUF's rows and this layout, bit for bit.
"""

from __future__ import annotations

import numpy as np

from picc.codegen_cpu.irtext import F32, Fn, fconst, vec
from picc.codegen_cpu.rowformats import (
    BLOCK,
    BLOCK_BYTES,
    V16,
    Block,
    Prefetch,
    dequantized,
    nibble_value_floats,
    prefetch_block,
)
from picc.errors import PiccError

LAYOUT = "rowplanes"
DTYPES = frozenset(BLOCK_BYTES)  # the formats with per-block scales
_GROUP = 8  # blocks whose coefficients one vector operation makes
V8 = vec(8)


def _has_m(dtype: str) -> bool:
    return dtype == "q4_1"


def _head_bytes(dtype: str) -> int:
    """Bytes of one block's f16 scale (and q4_1's minimum): the planes before the quants, per block."""
    return 4 if _has_m(dtype) else 2


def _quant_bytes(dtype: str) -> int:
    """Bytes of one block's quants."""
    return BLOCK_BYTES[dtype] - _head_bytes(dtype)


def _check(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
    if dtype not in DTYPES or len(shape) != 2 or int(shape[1]) % BLOCK:
        raise PiccError(f"rowplanes layout: holds q8_0 / q4_0 / q4_1 matrices with rows of whole blocks, "
                        f"not a {dtype} matrix of shape {tuple(shape)}")
    rows, nb = int(shape[0]), int(shape[1]) // BLOCK
    if nbytes != rows * nb * BLOCK_BYTES[dtype]:
        raise PiccError(f"rowplanes layout: {nbytes} bytes are not a {dtype} matrix of shape {tuple(shape)}")
    return rows, nb


def to_rowplanes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A matrix's GGUF blocks (any array of its bytes, rows one after another) in the rowplanes
    layout, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, raw.nbytes)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, BLOCK_BYTES[dtype])
    head = _head_bytes(dtype)
    planes = [blocks[..., at : at + 2] for at in range(0, head, 2)] + [blocks[..., head:]]
    return np.concatenate([p.reshape(rows, -1) for p in planes], axis=1)


def from_rowplanes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`to_rowplanes`: the matrix's blocks in GGUF's rows, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, data.nbytes)
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    head = _head_bytes(dtype)
    out = np.empty((rows, nb, BLOCK_BYTES[dtype]), np.uint8)
    for at in range(0, head, 2):
        out[..., at : at + 2] = flat[:, at * nb : (at + 2) * nb].reshape(rows, nb, 2)
    out[..., head:] = flat[:, head * nb :].reshape(rows, nb, -1)
    return out.reshape(rows, -1)


def _plane(fn: Fn, dtype: str, row: str, nblocks: str, which: str) -> str:
    """The start of plane ``which`` ("m" or "q") of ``row`` (``nblocks`` i64 blocks in the row)."""
    before = 2 if which == "m" else _head_bytes(dtype)  # bytes per block of the planes before it
    return fn.gep(row, fn.v(f"mul i64 {nblocks}, {before}", "plo"), which + "p")


def _half(fn: Fn, plane: str, b: str, n: int) -> str:
    """Elements ``b .. b + n`` of an f16 plane as floats (one float when ``n`` is 1)."""
    ty = "half" if n == 1 else vec(n, "half")
    out = F32 if n == 1 else vec(n)
    return fn.v(f"fpext {ty} {fn.load(ty, fn.at(plane, 2, b), 2, 'h16')} to {out}", "hf")


def _quants(fn: Fn, dtype: str, qplane: str, b: str, simd: str) -> tuple[str, str]:
    """Block ``b``'s quants as two ``<16 x float>`` halves: ``q`` (q4_0 unsigned, as stored)."""
    at = fn.at(qplane, _quant_bytes(dtype), b, "qb")
    if dtype == "q8_0":
        return tuple(fn.v(f"sitofp {vec(16, 'i8')} {fn.load(vec(16, 'i8'), fn.gep(at, str(16 * h)), 1, 'q8')} "
                          f"to {V16}", "qf") for h in (0, 1))  # type: ignore[return-value]
    return nibble_value_floats(fn, fn.load(vec(16, "i8"), at, 1, "nib"), False, simd)


def emit_coefficients(fn: Fn, dtype: str, row: str, nblocks: str, a: str, coef: str, consts: str | None) -> None:
    """``coef[b] = a d_b`` for the row's blocks, and (4-bit) its constant terms added to
    ``consts[b]``: ``a m_b`` (q4_1), ``-8 a d_b`` (q4_0). Eight blocks at a time, then one by one."""
    if (dtype != "q8_0") != (consts is not None):
        raise PiccError(f"codegen_cpu: {dtype} rows {'need' if consts is None else 'have no'} per-block constants")
    mplane = _plane(fn, dtype, row, nblocks, "m") if _has_m(dtype) else None
    full = fn.v(f"and i64 {nblocks}, {-_GROUP}", "nfull")
    for start, stop, step in (("0", full, _GROUP), (full, nblocks, 1)):
        ty = F32 if step == 1 else V8
        av = a if step == 1 else fn.splat(_GROUP, a, hint="a8")
        with fn.loop(start, stop, str(step), "g") as g:
            c = fn.v(f"fmul {ty} {av}, {_half(fn, row, g, step)}", "c")
            fn.store(ty, c, fn.at(coef, 4, g, "cp"), 4)
            if consts is None:
                continue
            if mplane is not None:
                term = fn.v(f"fmul {ty} {av}, {_half(fn, mplane, g, step)}", "am")
            else:
                eight = fconst(-8.0) if step == 1 else fn.splat(_GROUP, fconst(-8.0))
                term = fn.v(f"fmul {ty} {c}, {eight}", "c8")
            cp = fn.at(consts, 4, g, "kp")
            fn.store(ty, fn.v(f"fadd {ty} {fn.load(ty, cp, 4, 'k')}, {term}", "k"), cp, 4)


def emit_axpys(fn: Fn, rows: list[tuple[str, str, str]], y: str, k: str, simd: str, coefs: list[str],
               consts: str | None, prefetch: Prefetch | None = None) -> None:
    """``y[j] += sum(a * row[j] for (dtype, row, a) in rows)`` for j < k (i64, a multiple of 32),
    y f32, rows in the rowplanes layout (``(a d) q`` per block, rows in order): the 4-bit
    constant terms go to ``consts[b]`` (``k / 32`` floats) for the caller to add
    (:func:`rowops.emit_add_block_consts`). ``coefs``: a stack array of ``k / 32`` floats per row
    (at least as many as ``rows``). ``prefetch``: rows read after these, prefetched along."""
    if len(coefs) < len(rows):
        raise PiccError(f"codegen_cpu: {len(rows)} rowplanes AXPYs need as many coefficient arrays, got {len(coefs)}")
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    planes = []
    for (dtype, row, a), coef in zip(rows, coefs, strict=False):
        emit_coefficients(fn, dtype, row, nblocks, a, coef, consts)
        planes.append((dtype, _plane(fn, dtype, row, nblocks, "q"), coef))
    with fn.loop("0", nblocks, "1", "b") as b:
        for dtype, row in prefetch or []:
            prefetch_block(fn, dtype, row, b)  # a row's bytes, spread over its blocks
        yp = fn.at(y, 4 * BLOCK, b, "yp")
        yhp = fn.gep(yp, "64", "yhp")
        ylo, yhi = fn.load(V16, yp, 4, "ylo"), fn.load(V16, yhp, 4, "yhi")
        for dtype, qplane, coef in planes:
            lo, hi = _quants(fn, dtype, qplane, b, simd)
            scale = fn.splat(16, fn.load(F32, fn.at(coef, 4, b), 4, "c"))
            ylo = fn.fma(V16, lo, scale, ylo, "ylo")
            yhi = fn.fma(V16, hi, scale, yhi, "yhi")
        fn.store(V16, ylo, yp, 4)
        fn.store(V16, yhi, yhp, 4)


def emit_row_to_f32(fn: Fn, dtype: str, row: str, nblocks: str, b0: str, out: str, k: str, simd: str) -> None:
    """``out[j]`` = element ``32 b0 + j`` of ``row`` (rowplanes, ``nblocks`` i64 blocks), j < k (i64,
    a multiple of 32), dequantised exactly as ``picc.quant`` (:func:`rowformats.dequantized`)."""
    mplane = _plane(fn, dtype, row, nblocks, "m") if _has_m(dtype) else None
    qplane = _plane(fn, dtype, row, nblocks, "q")
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "j") as j:
        b = fn.v(f"add i64 {b0}, {j}", "b")
        lo, hi = _quants(fn, dtype, qplane, b, simd)
        if dtype == "q4_0":
            eight = fn.splat(16, fconst(8.0))
            lo, hi = (fn.v(f"fsub {V16} {q}, {eight}", "qs") for q in (lo, hi))
        m = _half(fn, mplane, b, 1) if mplane is not None else None
        lo, hi = dequantized(fn, Block(lo, hi, _half(fn, row, b, 1), m))
        op = fn.at(out, 4 * BLOCK, j, "op")
        fn.store(V16, lo, op, 4)
        fn.store(V16, hi, fn.gep(op, "64"), 4)
