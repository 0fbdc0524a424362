"""Two x rows to a 512-bit vector: the rows8 int16-x dot products of the batched kernels on AVX-512.

The batched kernels (:mod:`picc.codegen_cpu.kernels_batch`) dot a group of eight rows in the
rows8 layout with several x rows, and on two cores they are bound by that arithmetic. Here two
x rows go through one vector: lane ``2r + i`` (r < 8, i < 2) holds weight row r against x row i
of the pair. Each chunk of nibbles is loaded once and its int32 lane r copied to lanes 2r and
2r + 1; x's four-byte groups are stored pair by pair (:class:`PairX`: row 0's four bytes, then
row 1's), so one 8-byte broadcast puts row 0's in the even lanes and row 1's in the odd ones;
the scales and minimums are copied the same way and x's scale and sums come in pairs.

Every row keeps its bits. A block's ``q . x`` is an exact integer (:func:`rows8.int_sums`: int16
partial sums that cannot overflow, then int32), and a lane's integer is the same whichever
instructions sum it: ``vpmaddubsw`` / ``vpmaddwd`` on 512 bits (``avx512``), each lane's words
what a 256-bit lane's words are, or ``vpdpbusd`` (``avx512-vnni``), four products summed into an
int32 lane without saturation (high bytes: at most 32 x 15 x 128, low: 32 x 15 x 255). The float
part is :func:`rows8.scaled_sum` lane by lane (``sitofp``, ``d * scale``, the FMA into the
accumulator, then q4_1's ``m * sum`` FMA), the one-row kernel's operations in its order; LLVM may
not reorder them (no fast-math flags). A pair's accumulators are split into its rows' eight lanes
at the end (a shuffle moves bits, it computes nothing).

Measured on a 2-core Zen 4 (AVX-512 executed 256 bits at a time), one thread, SmolLM2's 1536 x
576 q4_1 GEMV in L2, batch 8, cycles per x row and group block: 19.5 with x rows one to a
256-bit vector (``rows8.emit_rows8_dots_xs``), 16.4 in pairs, 12.5 in pairs with ``vpdpbusd``.
Two rows' 512-bit ``vpmaddubsw`` cost what two 256-bit ones cost on Zen 4; the pairs halve the
broadcasts of x's groups (one 8-byte broadcast feeds two rows) and the instructions around the
products (the 256-bit code with 14 of its 16 broadcasts a block taken out took 16 cycles; the
pairs without their float part 14.7). Each pair's x block is made just before the products that
use it: made for all pairs first (64 broadcast vectors live at once with 8 x rows), LLVM spilled
~50 vectors a block to the stack, and SmolLM2's batched FFN (batch 8, two threads, VNNI, in one
process) took 165 us a layer against 146 now, the same bits. Tried and not kept: ``vpdpbusd`` on
256 bits with x's groups as embedded broadcasts and its low bytes made signed (a bias of 128,
corrected by 128 times the nibbles' sum): 12.5-13 cycles, no better than the pairs, whose
``vpdpbusd`` count per row is the same; folding the ``<< 8`` into ``vpmaddwd`` (by 256): no
change; one ``vpdpbusd`` chain per sum instead of two (145 against 147 us: within the noise), or
the low bytes' chain started from the high bytes' sum shifted (165 us: one chain twice as long).
What bounds it (loops of generated code on the same Zen 4): 512-bit ``vpdpbusd`` retires one a
cycle on FP pipes 0-1, which the FMAs and multiplies share; broadcasts from memory are free, and
masks, shifts and conversions fit beside them. A pair and group block is 16 ``vpdpbusd`` and
three float operations there (the scale product and two FMAs, in the one-row kernel's order): a
floor of 9.5 cycles an x row and block, against 11.5-11.8 measured (docs/serving.md); tuning for
Zen 4 (``tune-cpu``) or four chains a sum gained nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cpu.int16x import IntX
from picc.codegen_cpu.irtext import F32, Fn, vconst, vec
from picc.codegen_cpu.rowformats import NIBBLE_DTYPES
from picc.codegen_cpu.rows8 import (
    GROUP,
    MXFP4_UNSIGNED,
    _prefetch,
    group_block_bytes,
    header_bytes,
    int_sums,
    mxfp4_scales,
    scaled_sum,
)
from picc.codegen_cpu.vnni import vnni_sums
from picc.errors import PiccError
from picc.kernel_names import INT_ROWS8_DTYPES

LANES = 2 * GROUP  # int32 lanes of a 512-bit vector: eight weight rows x two x rows
_V16, _I16, _B64 = vec(LANES), vec(LANES, "i32"), vec(4 * LANES, "i8")
_DOUBLE = "<" + ", ".join(f"i32 {i // 2}" for i in range(LANES)) + ">"  # lane r to lanes 2r, 2r + 1


@dataclass(frozen=True, slots=True)
class PairX:
    """Two x rows' int16 forms (:class:`~picc.codegen_cpu.int16x.IntX` made with ``rows8``)
    interleaved, one block after another: ``split``, 128 bytes a block, the high bytes' eight
    four-byte groups (row 0's group j at ``8 j``, row 1's at ``8 j + 4``), then the low bytes'
    the same way; ``scale``, ``isums`` (q4_0, mxfp4) and ``sums`` (q4_1), row 0's then row 1's
    (8 bytes a block)."""

    split: str
    scale: str
    isums: str | None = None
    sums: str | None = None
    int8: bool = False


PAIR_X_BLOCK_BYTES = {"split": 128, "scale": 8, "isums": 8, "sums": 8}
"""Bytes per block of each array of a :class:`PairX`."""


def alloc_pair_x(fn: Fn, nblocks: str, dtypes: set[str], int8: bool = False) -> PairX:
    """Stack arrays of a :class:`PairX` of ``nblocks`` (i64) blocks for rows of ``dtypes``
    (``int8``: of x rounded to int8, whose low bytes are zero)."""
    return PairX(fn.alloca_array(vec(128, "i8"), nblocks, "pxsplit"), fn.alloca_array("<2 x float>", nblocks, "pxs"),
                 isums=fn.alloca_array("<2 x i32>", nblocks, "pxis") if dtypes & {"q4_0", "mxfp4"} else None,
                 sums=fn.alloca_array("<2 x float>", nblocks, "pxsum") if "q4_1" in dtypes else None, int8=int8)


def fill_pair_x(fn: Fn, rows: tuple[IntX, IntX], nblocks: str, out: PairX) -> None:
    """Interleave two rows' filled int16 forms (``nblocks`` (i64) blocks) into ``out``."""
    a, b = rows
    if a.split is None or b.split is None:
        raise PiccError("codegen_cpu: x pairs are made from x's int16 form split into bytes (rows8)")
    if a.int8 != out.int8 or b.int8 != out.int8:
        raise PiccError("codegen_cpu: a pair of x rows holds one x format")
    weave = "<" + ", ".join(f"i32 {j // 2 + (LANES if j % 2 else 0)}" for j in range(2 * LANES)) + ">"
    with fn.loop("0", nblocks, "1", "pb") as blk:
        halves = [fn.load(_I16, fn.at(r.split, 64, blk, "sp"), 64, "xsp") for r in (a, b)]
        woven = fn.v(f"shufflevector {_I16} {halves[0]}, {_I16} {halves[1]}, <32 x i32> {weave}", "xw")
        fn.store("<32 x i32>", woven, fn.at(out.split, 128, blk, "pp"), 64)
        for name, ty in (("scale", F32), ("isums", "i32"), ("sums", F32)):
            dst = getattr(out, name)
            if dst is None:
                continue
            pair = "poison"
            for i, r in enumerate((a, b)):
                value = fn.load(ty, fn.at(getattr(r, name), 4, blk), 4, "xv")
                pair = fn.v(f"insertelement <2 x {ty}> {pair}, {ty} {value}, i64 {i}", "xpv")
            fn.store(f"<2 x {ty}>", pair, fn.at(dst, 8, blk), 8)


def _broadcast_pair(fn: Fn, ptr: str, elem: str) -> str:
    """The two ``elem`` (i32 or float) at ``ptr`` repeated over the 16 lanes (even, odd)."""
    two = fn.load(f"<2 x {elem}>", ptr, 4, "pr")
    mask = "<" + ", ".join(f"i32 {i % 2}" for i in range(LANES)) + ">"
    return fn.v(f"shufflevector <2 x {elem}> {two}, <2 x {elem}> poison, <{LANES} x i32> {mask}", "pr")


def _x_block(fn: Fn, pair: PairX, b: str) -> tuple[list[list[str]], str]:
    """Block ``b`` of a pair: its four-byte groups as <64 x i8> (row 0's in the even lanes, row
    1's in the odd), high bytes then low bytes, and its two scales."""
    sp = fn.at(pair.split, 128, b, "psp")
    xs = [[fn.v(f"bitcast {_I16} {_broadcast_pair(fn, fn.gep(sp, str(half + 8 * j)), 'i32')} to {_B64}", "px")
           for j in range(8)] for half in ((0,) if pair.int8 else (0, 64))]
    return xs, _broadcast_pair(fn, fn.at(pair.scale, 8, b), F32)


def _doubled(fn: Fn, v: str, ty: str) -> str:
    """<8 x ty> ``v`` with lane r in lanes 2r and 2r + 1."""
    return fn.v(f"shufflevector <8 x {ty}> {v}, <8 x {ty}> poison, <{LANES} x i32> {_DOUBLE}", "dbl")


def emit_rows8_pair_dots(fn: Fn, mats: list[tuple[str, str]], pairs: list[PairX], k: str,
                         vnni: bool) -> list[list[str]]:
    """:func:`rows8.emit_rows8_dots_xs` of the int16 x rows of ``pairs`` (two a pair, in order):
    for each x row, the <8 x float> of each ``(dtype, group)``'s eight rows dotted with it, the
    bits of the one-row kernel. ``vnni``: the integer sums with ``vpdpbusd``."""
    for dtype, _ in mats:
        if dtype not in NIBBLE_DTYPES | INT_ROWS8_DTYPES:
            raise PiccError(f"codegen_cpu: the rows8 layout holds q4_0 / q4_1 / mxfp4 rows, not {dtype}")
    accs = [[fn.var(_V16, "zeroinitializer", "pacc") for _ in mats] for _ in pairs]
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "b") as b:
        blocks = [(dtype, _group_block(fn, dtype, fn.at(group, group_block_bytes(dtype), b, "gblk")))
                  for dtype, group in mats]
        for pair, acc in zip(pairs, accs, strict=True):  # a pair's x block made where it is used
            xs, scale = _x_block(fn, pair, b)
            for m_i, (dtype, (chunks, d, m)) in enumerate(blocks):
                acc[m_i].set(_pair_block(fn, dtype, chunks, xs, scale, pair, b, d, m, acc[m_i].get("pacc"), vnni))
    out = []
    for acc in accs:
        dots = [a.get("pdots") for a in acc]
        for i in (0, 1):
            pick = "<" + ", ".join(f"i32 {2 * r + i}" for r in range(GROUP)) + ">"
            out.append([fn.v(f"shufflevector {_V16} {v}, {_V16} poison, <8 x i32> {pick}", "dots") for v in dots])
    return out


def _group_block(fn: Fn, dtype: str, blk: str) -> tuple[list[str], str, str | None]:
    """A group block's four nibble chunks (<64 x i8>), scales and (q4_1) minimums (<16 x
    float>), each of its eight rows' lanes doubled; the lines ahead prefetched."""
    _prefetch(fn, blk, group_block_bytes(dtype))
    chunks = []
    for c in range(4):
        raw = fn.load("<8 x i32>", fn.gep(blk, str(header_bytes(dtype) + 32 * c)), 4, "nib")
        chunks.append(fn.v(f"bitcast {_I16} {_doubled(fn, raw, 'i32')} to {_B64}", "nib"))
    if dtype == "mxfp4":
        return chunks, _doubled(fn, mxfp4_scales(fn, blk), F32), None
    halves = [fn.load("<8 x half>", fn.gep(blk, str(16 * i)), 2, "dmh") for i in range(2 if dtype == "q4_1" else 1)]
    floats = [_doubled(fn, fn.v(f"fpext <8 x half> {h} to {vec(8)}", "dm"), F32) for h in halves]
    return chunks, floats[0], floats[1] if dtype == "q4_1" else None


def _pair_block(fn: Fn, dtype: str, chunks: list[str], xs: list[list[str]], scale: str, pair: PairX, b: str, d: str,
                m: str | None, acc: str, vnni: bool) -> str:
    """``acc`` plus a block of the pair's dot products, lane by lane :func:`rows8._int_block`'s."""
    table = MXFP4_UNSIGNED if dtype == "mxfp4" else None
    dots = vnni_sums(fn, chunks, xs, table=table) if vnni else int_sums(fn, chunks, xs, LANES, table=table)
    if dtype in ("q4_0", "mxfp4"):
        assert pair.isums is not None
        offset = _broadcast_pair(fn, fn.at(pair.isums, 8, b), "i32")
        if dtype == "mxfp4":  # -12 sum x_q from -8 sum x_q (rows8.mxfp4_offset)
            three = fn.v(f"mul {_I16} {offset}, {vconst(LANES, '3', 'i32')}", "xo3")
            offset = fn.v(f"ashr {_I16} {three}, {vconst(LANES, '1', 'i32')}", "xo")
        dots = fn.v(f"add {_I16} {dots}, {offset}", "pm")
    value = scaled_sum(fn, dots, d, scale, acc, LANES)
    if m is not None:
        assert pair.sums is not None
        value = fn.fma(_V16, m, _broadcast_pair(fn, fn.at(pair.sums, 8, b), F32), value)
    return value
