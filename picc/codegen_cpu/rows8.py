"""The *rows8* layout of 4-bit matrices, and the code that reads it eight rows at a time.

A q4_0 / q4_1 matrix whose rows come in multiples of eight may be stored for the CPU in groups of
eight rows. A group holds its eight rows' blocks of 32 columns one after another, each *group
block* as many bytes as the eight row blocks it replaces::

    q4_1  160 B: f16 d of rows 0-7, f16 m of rows 0-7, 4 chunks x 32 B of nibbles
    q4_0  144 B: f16 d of rows 0-7,                    4 chunks x 32 B of nibbles
    mxfp4 136 B: E8M0 e of rows 0-7,                   4 chunks x 32 B of nibbles
    q8_0  272 B: f16 d of rows 0-7,                    8 chunks x 32 B of bytes

Byte ``4r + e`` of chunk ``c`` (row ``r`` < 8, ``e`` < 4) holds element ``4c + e`` of row ``r``
in its low nibble and element ``16 + 4c + e`` in its high one. Masked with 0x0F, a chunk is four
consecutive elements of each row in the four bytes of that row's int32 lane, so ``vpmaddubsw``
against four bytes of x broadcast to every lane leaves row ``r``'s products in lane ``r``, and
the eight rows' scales (one load of eight ``d``, one of eight ``m``) apply in one vector
operation. x is rounded to int16 per block as for rows one at a time (:func:`int16x.emit_int_x`,
the same numbers) and split into its high bytes (signed) and low bytes (unsigned): ``q . x =
256 (q . x_high) + q . x_low``, two ``vpmaddubsw`` per chunk half (the low bytes as the unsigned
operand, the nibbles as the signed one), sums in int16 that cannot overflow, and three
``vpmaddwd`` a block. The integer sum is exact, as is its conversion to float (under 2^24).

mxfp4's nibbles index a table (``picc.quant.MXFP4_VALUES``, -12..12); a ``vpshufb`` of each
masked chunk reads :data:`MXFP4_UNSIGNED`, the values plus :data:`MXFP4_OFFSET` (0..24, bytes
both ``vpmaddubsw`` operands take), and ``-12 sum x_q`` undoes the offset, as q4_0's ``-8 sum
x_q`` does its nibbles' 8. Products up to 24 overflow int16 sooner than 15's, so the words are
summed in smaller runs before ``vpmaddwd`` widens them (:func:`int_sums`; ``vpdpbusd`` sums into
int32 and needs none). The scale ``2^(e - 128)`` is made from e's bits as the rows kernels make
it (``rowformats.mxfp4_scale``), eight at a time. mxfp4 rows8 rows are dotted with rounded x
alone (``kernel_names.INT_ROWS8_DTYPES``): the float-x trick below converts masked nibbles in
place, which a table's values are not.

Rows one at a time spend ~15 vector operations per row and block, most of them on scales,
unpacking and reductions; here it is ~7. Measured on Zen 3, two threads, from memory (1536 x 576
q4_1): 37 GB/s, against 21.6 for rows one at a time with int16 x (int8 x, llama.cpp's choice,
would reach the memory's 43 GB/s, but moves the logits of a 30-layer model 1e-2 away from the
interpreter: a float-rounding difference puts an element across a rounding boundary, a step
of 1/254 of its block, instead of 2^-16).

Float x reads it too (:func:`emit_scaled_x`): a chunk masked to one nibble, unshifted, converts
to ``q 2^s`` exactly, and x is scaled once by ``2^-s`` for each element's place, so an element of
eight rows costs a mask, a conversion and an FMA (24.2 GB/s against 15.6 for rows one at a time,
same matrix). The prefill GEMMs read a row of the layout back as floats
(:func:`emit_rows8_row_to_f32`). The numpy functions convert a matrix in GGUF's row layout to and
from it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from picc import kernel_names as names
from picc.codegen_cpu.int16x import IntX
from picc.codegen_cpu.irtext import F32, Fn, fconst, vconst, vec
from picc.codegen_cpu.rowformats import (
    BLOCK,
    BLOCK_BYTES,
    NIBBLE_DTYPES,
    V16,
    mxfp4_scale,
    mxfp4_values,
    nibble_value_floats,
    table_lookup,
)
from picc.codegen_cpu.rows8_q8 import byte_floats, byte_sums
from picc.codegen_cpu.vnni import vnni_sums
from picc.errors import PiccError
from picc.quant import MXFP4_VALUES

LAYOUT = "rows8"
GROUP = 8  # rows per group
B32, W16 = vec(32, "i8"), vec(16, "i16")
_CHUNKS = 4  # 32-byte nibble chunks per group block
BYTE_CHUNKS = 8  # 32-byte chunks of a q8_0 group block
_PREFETCH_AHEAD = 2048  # bytes; a group's rows are one stream (1536 x 576 q4_1: 27.1 GB/s without, 37.2)
MXFP4_OFFSET = 12  # added to mxfp4's values (-12..12) to make them bytes both vpmaddubsw operands take
MXFP4_UNSIGNED = tuple(v + MXFP4_OFFSET for v in MXFP4_VALUES)


def _scale_bytes(dtype: str) -> int:
    """Bytes of one row's scale: an f16 d, or mxfp4's E8M0 exponent."""
    return 1 if dtype == "mxfp4" else 2


def header_bytes(dtype: str) -> int:
    """Bytes of a group block before its nibbles: eight scales (and eight f16 minimums)."""
    return _scale_bytes(dtype) * GROUP * (2 if dtype == "q4_1" else 1)


def _chunk_count(dtype: str) -> int:
    """32-byte chunks of quants in a group block: four of nibbles (4-bit), eight of bytes (q8_0)."""
    return BYTE_CHUNKS if dtype in names.BYTE_ROWS8_DTYPES else _CHUNKS


def group_block_bytes(dtype: str) -> int:
    return GROUP * BLOCK_BYTES[dtype]


def _check(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
    if len(shape) != 2 or not names.rows8_fits(dtype, int(shape[0]), int(shape[1]), x_format="i8"):
        raise PiccError(f"rows8 layout: a {dtype} matrix of shape {tuple(shape)} does not fit it "
                        f"(q4_0 / q4_1 / mxfp4 / q8_0, rows a multiple of {GROUP}, columns of {BLOCK})")
    rows, k = int(shape[0]), int(shape[1])
    if nbytes != rows * (k // BLOCK) * BLOCK_BYTES[dtype]:
        raise PiccError(f"rows8 layout: {nbytes} bytes are not a {dtype} matrix of shape {tuple(shape)}")
    return rows, k


def to_rows8(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A matrix's GGUF blocks (any array of its bytes, rows one after another) in the rows8 layout."""
    rows, k = _check(dtype, shape, raw.nbytes)
    nb, bb, head, w = k // BLOCK, BLOCK_BYTES[dtype], header_bytes(dtype), _scale_bytes(dtype)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows // GROUP, GROUP, nb, bb)
    out = np.empty((rows // GROUP, nb, GROUP * bb), np.uint8)
    scales = blocks[..., : head // GROUP].transpose(0, 2, 1, 3)  # group, block, row, scale bytes
    for i in range(head // (w * GROUP)):  # d (e), then m
        out[..., w * GROUP * i : w * GROUP * (i + 1)] = scales[..., w * i : w * i + w].reshape(rows // GROUP, nb, -1)
    quants = blocks[..., head // GROUP :].transpose(0, 2, 1, 3)  # group, block, row, 16 (32) bytes
    if dtype in names.BYTE_ROWS8_DTYPES:  # chunk c: bytes 4c..4c+3 of each row
        out[..., head:] = quants.reshape(rows // GROUP, nb, GROUP, BYTE_CHUNKS, 4).transpose(0, 1, 3, 2, 4).reshape(
            rows // GROUP, nb, -1)
        return out.reshape(rows, nb * bb)
    q = np.concatenate([quants & 15, quants >> 4], axis=-1)  # elements 0-31 of each row
    for c in range(_CHUNKS):
        lo, hi = q[..., 4 * c : 4 * c + 4], q[..., 16 + 4 * c : 20 + 4 * c]  # group, block, row, 4
        start = head + 32 * c
        out[..., start : start + 32] = (lo | (hi << 4)).reshape(rows // GROUP, nb, 32)
    return out.reshape(rows, nb * bb)


def from_rows8(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`to_rows8`: the matrix's blocks in GGUF's row layout, ``[rows, row bytes]``."""
    rows, k = _check(dtype, shape, data.nbytes)
    nb, bb, head, w = k // BLOCK, BLOCK_BYTES[dtype], header_bytes(dtype), _scale_bytes(dtype)
    groups = np.ascontiguousarray(data).view(np.uint8).reshape(rows // GROUP, nb, GROUP * bb)
    out = np.empty((rows // GROUP, GROUP, nb, bb), np.uint8)
    for i in range(head // (w * GROUP)):
        scales = groups[..., w * GROUP * i : w * GROUP * (i + 1)].reshape(rows // GROUP, nb, GROUP, w)
        out[..., w * i : w * i + w] = scales.transpose(0, 2, 1, 3)
    if dtype in names.BYTE_ROWS8_DTYPES:
        chunks = groups[..., head:].reshape(rows // GROUP, nb, BYTE_CHUNKS, GROUP, 4)
        out[..., head // GROUP :] = chunks.transpose(0, 3, 1, 2, 4).reshape(rows // GROUP, GROUP, nb, -1)
        return out.reshape(rows, nb * bb)
    q = np.empty((rows // GROUP, nb, GROUP, 2 * 16), np.uint8)
    for c in range(_CHUNKS):
        chunk = groups[..., head + 32 * c : head + 32 * c + 32].reshape(rows // GROUP, nb, GROUP, 4)
        q[..., 4 * c : 4 * c + 4] = chunk & 15
        q[..., 16 + 4 * c : 20 + 4 * c] = chunk >> 4
    out[..., head // GROUP :] = (q[..., :16] | (q[..., 16:] << 4)).transpose(0, 2, 1, 3)
    return out.reshape(rows, nb * bb)


def emit_group_bytes(fn: Fn, dtype: str, k: str) -> str:
    """IR: the bytes of one group of eight rows of ``k`` (i64) elements."""
    return fn.v(f"mul i64 {fn.v(f'lshr i64 {k}, 5', 'nb')}, {group_block_bytes(dtype)}", "grpb")


def _splat_i32(fn: Fn, value: str, as_bytes: bool) -> str:
    s = fn.splat(8, value, "i32", "xb")
    return fn.v(f"bitcast <8 x i32> {s} to {B32}", "xb") if as_bytes else s


def _prefetch(fn: Fn, blk: str, nbytes: int) -> None:
    for off in range(0, nbytes, 64):
        p = fn.v(f"getelementptr i8, ptr {blk}, i64 {_PREFETCH_AHEAD + off}", "pfp")  # may pass the end: no inbounds
        fn.prefetch(p, "l1")


@dataclass(frozen=True, slots=True)
class ScaledX:
    """A float ``x`` as the float dot products of rows8 rows read it (:func:`emit_scaled_x`):
    ``values``, each element times the power of two that undoes its nibble's place in its int32
    lane (so a masked, unshifted lane converts to ``q 2^s`` and meets ``x 2^-s``; the top nibble's
    lane is shifted down instead, its x left as is); ``sums``, each block's sum of x, one float a
    block (q4_0's ``-8 sum x``, q4_1's ``m sum x``)."""

    values: str
    sums: str


def _place(j: int) -> int:
    """The bit position of element ``j`` (< 32) of a block in its row's int32 lane of a chunk."""
    return 8 * (j % 4) + (4 if j >= 16 else 0)


_TOP = 28  # the top nibble's place: its lane is shifted down (masked, its int32 would be negative)


def _factor(j: int) -> float:
    """What :class:`ScaledX` multiplies element ``j`` of a block by."""
    return 1.0 if _place(j) == _TOP else 2.0 ** -_place(j)


def emit_scaled_x(fn: Fn, x: str, k: str) -> ScaledX:
    """:class:`ScaledX` of the float ``x`` (k elements, i64), in stack arrays. The scalings are
    powers of two: exact (for |x| above 2^-98, where x 2^-28 would be denormal)."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    out = alloc_scaled_x(fn, nblocks, k)
    fill_scaled_x(fn, x, nblocks, out)
    return out


SCALED_X_BLOCK_BYTES = {"values": 4 * BLOCK, "sums": 4}
"""Bytes per block of each array of a :class:`ScaledX` (as :func:`alloc_scaled_x` allocates them)."""


def alloc_scaled_x(fn: Fn, nblocks: str, nvalues: str) -> ScaledX:
    """Stack arrays of a :class:`ScaledX` of ``nblocks`` (i64) blocks, ``nvalues`` = 32 ``nblocks``
    floats: apart from :func:`fill_scaled_x` so that a batched kernel can hold several x's one
    after another."""
    return ScaledX(fn.alloca_array(F32, nvalues, "xsc"), fn.alloca_array(F32, nblocks, "xsum"))


def fill_scaled_x(fn: Fn, x: str, nblocks: str, out: ScaledX) -> None:
    """Scale ``x`` (``nblocks`` (i64) blocks of 32 floats) into the arrays of ``out``."""
    factors = [f"<{', '.join(f'float {fconst(_factor(16 * h + i))}' for i in range(16))}>" for h in (0, 1)]
    with fn.loop("0", nblocks, "1", "b") as b:
        xp, op = fn.at(x, 4 * BLOCK, b, "xp"), fn.at(out.values, 4 * BLOCK, b, "op")
        halves = [fn.load(V16, fn.gep(xp, str(64 * h)), 4, "x") for h in (0, 1)]
        for h, half in enumerate(halves):
            fn.store(V16, fn.v(f"fmul {V16} {half}, {factors[h]}", "xs"), fn.gep(op, str(64 * h)), 4)
        fn.store(F32, fn.hsum(16, fn.v(f"fadd {V16} {halves[0]}, {halves[1]}", "xt")), fn.at(out.sums, 4, b), 4)


_FLOAT_CHAINS = 4  # independent FMA chains per block and matrix (2: 18.9 GB/s, 4: 24.2, 8: 21.4)


def _float_block(fn: Fn, dtype: str, chunks: list[str], xs: list[str], xsum: str, d: str, m: str | None,
                 acc: str) -> str:
    """``acc`` plus eight rows' dot products with one block of a float x: ``chunks`` are the
    block's four nibble chunks (<8 x i32>, row r's four bytes in lane r), ``xs`` the block's 32
    scaled x elements, each in every lane, ``xsum`` its sum of x (every lane), ``d`` / ``m`` the
    rows' scales and (q4_1) minimums (<8 x float>).

    Element ``4c + e`` (and ``16 + 4c + e``) of the eight rows is chunk ``c`` masked to its
    nibble, unshifted, converted to float (``q 2^s``, exact) and multiplied by ``x 2^-s`` (the top
    nibble, whose int32 would be negative, is shifted down instead, and its x is not scaled): one
    integer operation, a conversion and an FMA per element of eight rows, against ~5 per element
    of each row one row at a time."""
    v8, i32 = vec(8), "<8 x i32>"
    chains: list[str | None] = [None] * _FLOAT_CHAINS
    n = 0
    for c, raw in enumerate(chunks):
        for j in (4 * c + e + 16 * h for h in (0, 1) for e in range(4)):
            if _place(j) == _TOP:
                q = fn.v(f"lshr {i32} {raw}, {vconst(8, str(_TOP), 'i32')}", "q")
            else:
                q = fn.v(f"and {i32} {raw}, {vconst(8, str(0xF << _place(j)), 'i32')}", "q")
            qf = fn.v(f"sitofp {i32} {q} to {v8}", "qf")
            i, n = n % _FLOAT_CHAINS, n + 1
            chains[i] = (fn.v(f"fmul {v8} {qf}, {xs[j]}", "t") if chains[i] is None
                         else fn.fma(v8, qf, xs[j], chains[i]))
    parts = [c for c in chains if c is not None]
    while len(parts) > 1:
        parts = [fn.v(f"fadd {v8} {parts[i]}, {parts[i + 1]}", "t") for i in range(0, len(parts), 2)]
    t = parts[0]
    if dtype == "q4_0":
        t = fn.fma(v8, vconst(8, fconst(-8.0)), xsum, t)
    value = fn.fma(v8, t, d, acc)
    if m is not None:
        value = fn.fma(v8, m, xsum, value)
    return value


def _scaled_x_block(fn: Fn, sx: ScaledX, b: str) -> tuple[list[str], str]:
    """Block ``b`` of a :class:`ScaledX`: its 32 elements and its sum, each in every lane."""
    xb = fn.at(sx.values, 4 * BLOCK, b, "xb")
    xs = [fn.splat(8, fn.load(F32, fn.gep(xb, str(4 * j)), 4, "xj")) for j in range(BLOCK)]
    return xs, fn.splat(8, fn.load(F32, fn.at(sx.sums, 4, b), 4, "xsum"))


def _gathered_halves(fn: Fn, blocks: list[str], offset: int) -> str:
    """<8 x float> of the f16 at ``offset`` in each of eight blocks."""
    v = "<8 x half> poison"
    for r, blk in enumerate(blocks):
        h = fn.load("half", fn.gep(blk, str(offset)), 2, "h")
        v = "<8 x half> " + fn.v(f"insertelement {v}, half {h}, i64 {r}", "hv")
    return fn.v(f"fpext {v} to {vec(8)}", "hf")


def _gathered_scale_pairs(fn: Fn, blocks: list[str]) -> tuple[str, str]:
    """<8 x float> d and m of eight q4_1 blocks: each block's (d, m) f16 pair loaded as one i32
    (half the element inserts of two :func:`_gathered_halves`), then split."""
    v = "<8 x i32> poison"
    for r, blk in enumerate(blocks):
        pair = fn.load("i32", blk, 2, "dm")
        v = "<8 x i32> " + fn.v(f"insertelement {v}, i32 {pair}, i64 {r}", "dmv")
    halves = fn.v(f"bitcast {v} to <16 x half>", "dmh")
    out = []
    for first in (0, 1):
        pick = ", ".join(f"i32 {2 * r + first}" for r in range(8))
        h = fn.v(f"shufflevector <16 x half> {halves}, <16 x half> poison, <8 x i32> <{pick}>", "hs")
        out.append(fn.v(f"fpext <8 x half> {h} to {vec(8)}", "hf"))
    return out[0], out[1]


def _transpose_chunks(fn: Fn, lanes: list[str]) -> list[str]:
    """Eight rows' 16 nibble bytes (<4 x i32> each) as the four rows8 chunks (<8 x i32>: lane r
    holds int32 ``c`` of row r): two rows to a register, then a 4 x 4 transpose in each half."""
    def shuffle(a: str, b: str, mask: tuple[int, ...], ty: str = "<8 x i32>") -> str:
        return fn.v(f"shufflevector {ty} {a}, {ty} {b}, <8 x i32> <{', '.join(f'i32 {i}' for i in mask)}>", "tr")

    pairs = [shuffle(lanes[r], lanes[r + 4], tuple(range(8)), "<4 x i32>") for r in range(4)]  # rows r, r + 4
    lo32, hi32 = (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)
    t = [shuffle(pairs[0], pairs[1], lo32), shuffle(pairs[0], pairs[1], hi32),
         shuffle(pairs[2], pairs[3], lo32), shuffle(pairs[2], pairs[3], hi32)]
    lo64, hi64 = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)
    return [shuffle(t[0], t[2], lo64), shuffle(t[0], t[2], hi64), shuffle(t[1], t[3], lo64), shuffle(t[1], t[3], hi64)]


def emit_gathered8_dots(fn: Fn, mats: list[tuple[str, list[str]]], x: IntX | ScaledX, k: str,
                        block_hook: Callable[[str], None] | None = None, vnni: bool = False) -> list[str]:
    """For each ``(dtype, rows)`` (eight 4-bit rows in GGUF's own layout, anywhere in memory: a
    sparse FFN's gathered active rows of one matrix), the <8 x float> of their dot products with
    ``x`` as :func:`emit_rows8_dots` takes it (float, or int16 split into bytes). Each block of
    the eight is transposed in registers to the rows8 chunks and computed as a group block: float
    x ~16 operations a row and block, int16 x ~7, plus ~3 for the transpose and the gathered
    scales, against ~30 for a row at a time. The matrices share one block loop, so x's block is
    made once for all of them. ``block_hook(b)`` runs in the block loop (prefetches)."""
    for dtype, _ in mats:
        if dtype not in NIBBLE_DTYPES:
            raise PiccError(f"codegen_cpu: gathered eight-row dot products read q4_0 / q4_1 rows, not {dtype}")
    accs = [fn.var(vec(8), "zeroinitializer", "acc") for _ in mats]
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "b") as b:
        if block_hook is not None:
            block_hook(b)
        xb = _x_block(fn, x, b)
        for (dtype, rows), acc in zip(mats, accs, strict=True):
            bb = BLOCK_BYTES[dtype]
            blocks = [fn.at(row, bb, b, "blk") for row in rows]
            lanes = [fn.load("<4 x i32>", fn.gep(blk, str(bb - 16)), 1, "q") for blk in blocks]  # after d (and m)
            chunks = _transpose_chunks(fn, lanes)
            if dtype == "q4_1":
                d, m = _gathered_scale_pairs(fn, blocks)
            else:
                d, m = _gathered_halves(fn, blocks, 0), None
            acc.set(_dot_block(fn, dtype, chunks, x, xb, b, d, m, acc.get("acc"), vnni))
    return [acc.get("dots") for acc in accs]


def _x_block(fn: Fn, x: IntX | ScaledX, b: str) -> tuple[list, str]:
    """Block ``b`` of x as :func:`_dot_block` reads it (made once per block, for every matrix)."""
    return _scaled_x_block(fn, x, b) if isinstance(x, ScaledX) else _int_x_block(fn, x, b)


def _dot_block(fn: Fn, dtype: str, chunks: list[str], x: IntX | ScaledX, xb: tuple[list, str], b: str,
               d: str, m: str | None, acc: str, vnni: bool = False) -> str:
    """``acc`` plus eight rows' dot products with block ``b`` of ``x`` (``xb``: :func:`_x_block`),
    ``chunks`` the block's four nibble chunks (q8_0: eight byte chunks) as <8 x i32>:
    :func:`_float_block` or :func:`_int_block`."""
    if isinstance(x, ScaledX):
        return _float_block(fn, dtype, chunks, xb[0], xb[1], d, m, acc)
    as_bytes = [fn.v(f"bitcast <8 x i32> {c} to {B32}", "nib") for c in chunks]
    return _int_block(fn, dtype, as_bytes, xb[0], xb[1], x, b, d, m, acc, vnni)


def emit_rows8_dots(fn: Fn, mats: list[tuple[str, str]], x: IntX | ScaledX, k: str, vnni: bool = False) -> list[str]:
    """For each ``(dtype, group)`` (a pointer to one group of eight rows of ``k`` (i64)
    elements in the rows8 layout), the ``<8 x float>`` of its eight rows dotted with ``x``:
    the int16 x of :func:`int16x.emit_int_x` (made with ``rows8=True``), ``sum_b d s (q . x_q
    (- 8 sum x_q)) (+ m s sum x_q)`` per row; or the float x of :func:`emit_scaled_x`,
    ``sum_b d (q . x (- 8 sum x)) (+ m sum x)``; q8_0 rows, int8 x alone (``vnni``: its sums
    with ``vpdpbusd``, :mod:`.rows8_q8`). Blocks in order."""
    return emit_rows8_dots_xs(fn, mats, [x], k, vnni)[0]


def emit_rows8_dots_xs(fn: Fn, mats: list[tuple[str, str]], xs: list[IntX | ScaledX], k: str,
                       vnni: bool = False) -> list[list[str]]:
    """:func:`emit_rows8_dots` of each x of ``xs`` (a list per x), in one pass over the groups'
    blocks: a batched kernel's x rows share each block's loads (and, LLVM merging the identical
    instructions, its nibble masks and scales), while each x's sum is the one-x function's,
    operation for operation."""
    for dtype, _ in mats:
        if not (dtype in NIBBLE_DTYPES or (dtype == "q8_0" and all(_int8(x) for x in xs))
                or (dtype in names.INT_ROWS8_DTYPES and all(isinstance(x, IntX) for x in xs))):
            raise PiccError(f"codegen_cpu: the rows8 layout holds q4_0 / q4_1 rows (mxfp4 rows dot rounded x, "
                            f"q8_0 rows int8 x), not {dtype}")
    v8, nblocks = vec(8), fn.v(f"lshr i64 {k}, 5", "nblk")
    accs = [[fn.var(v8, "zeroinitializer", "acc") for _ in mats] for _ in xs]
    with fn.loop("0", nblocks, "1", "b") as b:
        blocks = []
        for dtype, group in mats:
            blk = fn.at(group, group_block_bytes(dtype), b, "gblk")
            _prefetch(fn, blk, group_block_bytes(dtype))
            chunks = [fn.load("<8 x i32>", fn.gep(blk, str(header_bytes(dtype) + 32 * c)), 4, "nib")
                      for c in range(_chunk_count(dtype))]
            d = (mxfp4_scales(fn, blk) if dtype == "mxfp4"
                 else fn.v(f"fpext <8 x half> {fn.load('<8 x half>', blk, 2, 'dh')} to {v8}", "d"))
            m = (fn.v(f"fpext <8 x half> {fn.load('<8 x half>', fn.gep(blk, '16'), 2, 'mh')} to {v8}", "m")
                 if dtype == "q4_1" else None)
            blocks.append((dtype, chunks, d, m))
        for x, acc in zip(xs, accs, strict=True):  # x's block made where it is used: see rows8_pairs
            xb = _x_block(fn, x, b)
            for m_i, (dtype, chunks, d, m) in enumerate(blocks):
                acc[m_i].set(_dot_block(fn, dtype, chunks, x, xb, b, d, m, acc[m_i].get("acc"), vnni))
    return [[acc.get("dots") for acc in row] for row in accs]


def _int8(x: IntX | ScaledX) -> bool:
    return isinstance(x, IntX) and x.int8


def _int_x_block(fn: Fn, intx: IntX, b: str) -> tuple[list[list[str]], str]:
    """Block ``b`` of the split int16 x: its four-byte groups (elements 4j..4j+3, j < 8) in every
    lane, high bytes then low bytes, and its scale in every lane."""
    if intx.split is None:
        raise PiccError("codegen_cpu: rows8 dot products need x's int16 form split into bytes (emit_int_x rows8)")
    sp = fn.at(intx.split, 64, b, "sp")
    xs = [[_splat_i32(fn, fn.load("i32", fn.gep(sp, str(half + 4 * j)), 4, "x4"), as_bytes=True)
           for j in range(8)] for half in ((0,) if intx.int8 else (0, 32))]
    return xs, fn.splat(8, fn.load(F32, fn.at(intx.scale, 4, b), 4, "xsc"))


def mxfp4_scales(fn: Fn, blk: str, lanes: int = GROUP) -> str:
    """``<lanes x float>`` of the ``lanes`` E8M0 exponents at ``blk``, ``2^(e - 128)``, bit for
    bit ``rowformats.mxfp4_scale``'s: ``(e - 1) << 23``, the denormal ``0x00200000 << e`` for e < 2."""
    i32 = vec(lanes, "i32")
    e = fn.v(f"zext {vec(lanes, 'i8')} {fn.load(vec(lanes, 'i8'), blk, 1, 'e8')} to {i32}", "e")
    em1 = fn.v(f"sub {i32} {e}, {vconst(lanes, '1', 'i32')}", "em1")
    normal = fn.v(f"shl {i32} {em1}, {vconst(lanes, '23', 'i32')}", "dn")
    denormal = fn.v(f"shl {i32} {vconst(lanes, '2097152', 'i32')}, {e}", "dd")
    small = fn.v(f"icmp ult {i32} {e}, {vconst(lanes, '2', 'i32')}", "small")
    bits = fn.v(f"select {vec(lanes, 'i1')} {small}, {i32} {denormal}, {i32} {normal}", "db")
    return fn.v(f"bitcast {i32} {bits} to {vec(lanes)}", "d")


def _run(top: int, x_max: int) -> int:
    """How many ``vpmaddubsw`` words (each two products of values up to ``top`` and x bytes up to
    ``x_max`` in size) an int16 sum holds without overflow."""
    return 32767 // (2 * top * x_max)


def int_sums(fn: Fn, chunks: list[str], xs: list[list[str]], lanes: int = GROUP, vnni: bool = False,
             table: tuple[int, ...] | None = None) -> str:
    """The exact integer ``q . x`` of each int32 lane of a block (``<lanes x i32>``): ``chunks``
    the block's four nibble chunks (``<4 lanes x i8>``, four bytes a lane), ``xs`` x's four-byte
    groups, high bytes then low bytes (:func:`_int_x_block`; int8 x: high bytes only, its low
    bytes are zero). ``lanes`` 8: AVX2's ``vpmaddubsw`` / ``vpmaddwd``; 16: their 512-bit forms,
    each lane computing what an 8-lane lane computes (two x rows a vector,
    :mod:`picc.codegen_cpu.rows8_pairs`). ``vnni`` (8 lanes): ``vpdpbusd`` on 256 bits, the same
    integers (:func:`.vnni.vnni_sums`). ``table``: each nibble stands for ``table[q]`` (unsigned
    bytes, mxfp4's :data:`MXFP4_UNSIGNED`), looked up after the mask; the int16 runs shorten to
    fit its largest entry."""
    if vnni:
        return vnni_sums(fn, chunks, xs, lanes, table)
    nbytes, nwords = 4 * lanes, 2 * lanes
    bytes_t, words, i32 = vec(nbytes, "i8"), vec(nwords, "i16"), vec(lanes, "i32")
    mask, ones = vconst(nbytes, "15", "i8"), vconst(nwords, "1", "i16")
    ub_sw, wd = (("avx2.pmadd.ub.sw", "avx2.pmadd.wd") if lanes == GROUP
                 else ("avx512.pmaddubs.w.512", "avx512.pmaddw.d.512"))

    def pairs(a: str, b: str) -> str:
        return fn.v(f"call {words} @llvm.x86.{ub_sw}({bytes_t} {a}, {bytes_t} {b})", "pmb")

    def words_to_ints(w: str) -> str:
        return fn.v(f"call {i32} @llvm.x86.{wd}({words} {w}, {words} {ones})", "pm")

    def add(total: str | None, value: str, ty: str = words) -> str:
        return value if total is None else fn.v(f"add {ty} {total}, {value}", "tot")

    # int16 runs of words: q4's 8 x 2 x 15 x 128 fit one for x's high bytes, 4 x 2 x 15 x 255 two
    # halves for its low bytes; mxfp4's values up to 24 runs of 5 and 2
    top = 15 if table is None else max(table)
    high_run, low_run = _run(top, 128), _run(top, 255)
    high: list[str | None] = [None] * -(-2 * len(chunks) // high_run)
    low: list[str | None] = [None] * -(-2 * len(chunks) // low_run)
    for c, raw in enumerate(chunks):
        shifted = fn.v(f"lshr {bytes_t} {raw}, {vconst(nbytes, '4', 'i8')}", "sh")
        for w, nib, j in ((2 * c, fn.v(f"and {bytes_t} {raw}, {mask}", "lo4"), c),
                          (2 * c + 1, fn.v(f"and {bytes_t} {shifted}, {mask}", "hi4"), 4 + c)):
            if table is not None:
                nib = table_lookup(fn, nib, nbytes, table)
            high[w // high_run] = add(high[w // high_run], pairs(nib, xs[0][j]))
            if len(xs) > 1:
                low[w // low_run] = add(low[w // low_run], pairs(xs[1][j], nib))

    def ints(runs: list[str | None]) -> str:
        total: str | None = None
        for run in runs:
            assert run is not None
            total = add(total, words_to_ints(run), i32)
        assert total is not None
        return total

    dots = fn.v(f"shl {i32} {ints(high)}, {vconst(lanes, '8', 'i32')}", "hi8")
    if len(xs) == 1:  # int8 x: the low bytes are zero
        return dots
    return add(dots, ints(low), i32)


def scaled_sum(fn: Fn, dots: str, d: str, scale: str, acc: str, lanes: int = GROUP) -> str:
    """``acc + float(dots) (d scale)``: the float part of a block of int16 x, the one sequence
    of float operations every rows8 int16-x dot product goes through (a lane's bits follow)."""
    v = vec(lanes)
    t = fn.v(f"sitofp {vec(lanes, 'i32')} {dots} to {v}", "t")
    return fn.fma(v, t, fn.v(f"fmul {v} {d}, {scale}", "ds"), acc)


def mxfp4_offset(fn: Fn, isum: str) -> str:
    """``-12 sum x_q`` (what undoes :data:`MXFP4_OFFSET`) from x's ``isums``, ``-8 sum x_q``
    (an i32): times 3, halved (exact: it is even)."""
    return fn.v(f"ashr i32 {fn.v(f'mul i32 {isum}, 3', 'xo3')}, 1", "xo")


def _int_block(fn: Fn, dtype: str, chunks: list[str], xs: list[list[str]], scale: str, intx: IntX, b: str,
               d: str, m: str | None, acc: str, vnni: bool = False) -> str:
    """``acc`` plus eight rows' dot products with block ``b`` of the int16 x: ``chunks`` the
    block's four nibble chunks (q8_0: eight byte chunks; <32 x i8>), ``xs`` / ``scale`` from
    :func:`_int_x_block`, ``d`` / ``m`` the rows' scales and (q4_1) minimums (<8 x float>)."""
    v8, i32 = vec(8), "<8 x i32>"
    if dtype == "q8_0":
        qsum = (_splat_i32(fn, fn.load("i32", fn.at(intx.qsums, 4, b), 4, "xq"), as_bytes=False)
                if vnni and intx.qsums is not None else None)
        return scaled_sum(fn, byte_sums(fn, chunks, xs[0], qsum, vnni), d, scale, acc)
    dots = int_sums(fn, chunks, xs, vnni=vnni, table=MXFP4_UNSIGNED if dtype == "mxfp4" else None)
    if dtype in ("q4_0", "mxfp4"):
        assert intx.isums is not None
        offset = _splat_i32(fn, mxfp4_offset(fn, fn.load("i32", fn.at(intx.isums, 4, b), 4, "xo"))
                            if dtype == "mxfp4" else fn.load("i32", fn.at(intx.isums, 4, b), 4, "xo"), as_bytes=False)
        dots = fn.v(f"add {i32} {dots}, {offset}", "pm")
    value = scaled_sum(fn, dots, d, scale, acc)
    if m is not None:
        assert intx.sums is not None
        value = fn.fma(v8, m, fn.splat(8, fn.load(F32, fn.at(intx.sums, 4, b), 4, "xs")), value)
    return value


def emit_rows8(fn: Fn, mats: list[tuple[str, str, str]], x: IntX | ScaledX, k: str, glo: str, ghi: str,
               consume: Callable[[str, list[str]], None], vnni: bool = False) -> None:
    """GEMV rows eight at a time: for groups g in [glo, ghi) (i64) of the rows8 matrices
    ``(dtype, base, group_bytes)``, the dot products of rows ``8g .. 8g + 7`` of each with
    ``x`` (k elements; see :func:`emit_rows8_dots`), handed to ``consume(row, dots)`` row by row."""
    with fn.loop(glo, ghi, "1", "g") as g:
        groups = [(dtype, fn.gep(base, fn.v(f"mul i64 {g}, {gbytes}", "goff"), "grp")) for dtype, base, gbytes in mats]
        dots = emit_rows8_dots(fn, groups, x, k, vnni)
        first = fn.v(f"shl i64 {g}, 3", "r0")
        for lane in range(GROUP):
            r = fn.v(f"add i64 {first}, {lane}", "r") if lane else first
            consume(r, [fn.v(f"extractelement {vec(8)} {d}, i64 {lane}", "dot") for d in dots])


def emit_rows8_row_to_f32(fn: Fn, dtype: str, base: str, r: str, out: str, k: str, simd: str) -> None:
    """``out[j] = W[r, j]`` (j < k, i64) of a rows8 matrix at ``base``, dequantised exactly as
    ``picc.quant`` (the bytes of row ``r`` are its GGUF blocks, spread over the group's)."""
    gbytes = emit_group_bytes(fn, dtype, k)
    lane = fn.v(f"and i64 {r}, 7", "lane")
    group = fn.gep(base, fn.v(f"mul i64 {fn.v(f'lshr i64 {r}, 3', 'g')}, {gbytes}", "goff"), "grp")
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "b") as b:
        blk = fn.at(group, group_block_bytes(dtype), b, "gblk")
        d = (mxfp4_scale(fn, fn.at(blk, 1, lane)) if dtype == "mxfp4"
             else fn.v(f"fpext half {fn.load('half', fn.at(blk, 2, lane), 2, 'dh')} to float", "d"))
        nchunks = _chunk_count(dtype)
        words = f"<{nchunks} x i32> poison"
        for c in range(nchunks):
            piece = fn.load("i32", fn.at(fn.gep(blk, str(header_bytes(dtype) + 32 * c)), 4, lane), 4, "nib4")
            words = f"<{nchunks} x i32> " + fn.v(f"insertelement {words}, i32 {piece}, i64 {c}", "nibw")
        raw = fn.v(f"bitcast {words} to {vec(4 * nchunks, 'i8')}", "nib")  # the row's GGUF quant bytes
        if dtype == "q8_0":
            q = byte_floats(fn, raw)
        elif dtype == "mxfp4":
            q = [fn.v(f"sitofp {vec(16, 'i8')} {v} to {V16}", "qf") for v in mxfp4_values(fn, raw)]
        else:
            q = nibble_value_floats(fn, raw, dtype == "q4_0", simd)
        ds = fn.splat(16, d)
        values = [fn.v(f"fmul {V16} {half}, {ds}", "w") for half in q]
        if dtype == "q4_1":
            m = fn.v(f"fpext half {fn.load('half', fn.at(fn.gep(blk, '16'), 2, lane), 2, 'mh')} to float", "m")
            ms = fn.splat(16, m)
            values = [fn.v(f"fadd {V16} {w}, {ms}", "w") for w in values]
        op = fn.at(out, 4 * BLOCK, b, "op")
        for h, w in enumerate(values):
            fn.store(V16, w, fn.gep(op, str(64 * h)), 4)
