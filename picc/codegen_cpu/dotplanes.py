"""The *dotplanes* layout of a sparse FFN's gathered 4-bit up and gate rows, and the code that dots them.

A fused sparse FFN that rounds x to integers (``x_format`` ``i16`` / ``i8``) dots each active
neuron's up row (and, in predictor and dense modes, its gate row) with x. Those rows are
gathered from anywhere in the matrix, one neuron at a time. In the dotplanes layout a q4_0 /
q4_1 row holds the same bytes as its GGUF blocks, regrouped::

    16 B of nibbles[nb], f16 d[nb] (, f16 m[nb] for q4_1)

(``nb`` = k / 32 blocks; each block's 16 nibble bytes in GGUF's order: byte t holds element t in
its low nibble and element 16 + t in its high one). So the nibbles of four blocks are one 64-byte
load, and a 32-bit lane of it holds eight elements of one block: ``vpdpbusd`` (or ``vpmaddubsw``
then ``vpmaddwd``) against x's high and low bytes in the same order gives each lane an exact
integer sum, lanes ``4b .. 4b + 3`` block b's, with no transpose. Each block's ``d`` times x's
scale is broadcast to its four lanes; the per-lane products go into a float accumulator, and
q4_1's ``m sum(x)`` into a second one, four blocks wide. A row is one loop of such *pieces* (four
blocks: one 512-bit vector, or two 256-bit ones on AVX2, which computes the same bits; then
pieces of two and one block for the row's last ``nb % 4``), and the rows of a call (a neuron's
up and gate) share each piece's loads of x: each row is an independent dependency chain, where
the eight-row form of GGUF rows (:func:`picc.codegen_cpu.rows8.emit_gathered8_dots`) keeps eight
rows in one register and transposes every block into it. ``select-kernels`` stores rows so where
they are at least ``picc.kernel_names.DOTPLANES_MIN_HIDDEN`` long (on shorter rows a row's fixed
costs outweigh the transposes). Measured: docs/codegen_cpu.md.

x comes in the form :func:`emit_x_planes` makes once per call from the rows8 form of
:func:`picc.codegen_cpu.int16x.emit_int_x` (the same rounded integers): its high and low bytes in
four planes of 16 bytes a block (high bytes of elements 0-15, of 16-31, then the low bytes'), the
scale of each block, q4_1's ``scale * sum q`` and q4_0's ``-8 sum q`` (in the first of the block's
four lanes). The integer sums are the rows8 kernels' integers; the float part adds the same
products in another order (per lane, then across lanes), so a dot differs from the eight-row
form's by float rounding (~1e-7 relative), as the interpreter's reference allows.

:func:`to_dotplanes` / :func:`from_dotplanes` convert a matrix (or an interleaved up/gate tensor,
rows one after another) between GGUF's rows and this layout, bit for bit; the prefill reads a row
back as floats with :func:`emit_row_to_f32`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from picc.codegen_cpu.int16x import IntX
from picc.codegen_cpu.irtext import Fn, Var, vconst, vec
from picc.codegen_cpu.rowformats import BLOCK, BLOCK_BYTES, NIBBLE_DTYPES, V16, Block, dequantized, nibble_value_floats
from picc.codegen_cpu.rowplanes import block_parts, blocks_of, head_bytes
from picc.errors import PiccError

LAYOUT = "dotplanes"
_NIBBLES = 16  # bytes of one block's nibbles
_LINE = 64


def _check(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
    k = int(shape[-1]) if shape else 0
    if dtype not in NIBBLE_DTYPES or not shape or k % BLOCK:
        raise PiccError(f"dotplanes layout: holds q4_0 / q4_1 rows of whole blocks, not a {dtype} tensor of "
                        f"shape {tuple(shape)}")
    rows, nb = int(np.prod(shape[:-1], dtype=np.int64)), k // BLOCK
    if nbytes != rows * nb * BLOCK_BYTES[dtype]:
        raise PiccError(f"dotplanes layout: {nbytes} bytes are not a {dtype} tensor of shape {tuple(shape)}")
    return rows, nb


def to_dotplanes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's GGUF blocks (rows of ``shape[-1]`` elements, one after another) in the
    dotplanes layout, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, raw.nbytes)
    scales, quants = block_parts(raw, dtype, rows, nb)
    return np.concatenate([p.reshape(rows, -1) for p in (quants, *scales)], axis=1)


def from_dotplanes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`to_dotplanes`: the blocks in GGUF's rows, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, data.nbytes)
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    start = _NIBBLES * nb
    scales = [flat[:, start + at * nb : start + (at + 2) * nb] for at in range(0, head_bytes(dtype), 2)]
    return blocks_of(scales, flat[:, :start].reshape(rows, nb, _NIBBLES), dtype)


@dataclass(frozen=True)
class XPlanes:
    """x rounded to integers, as :func:`emit_dots` reads it (:func:`emit_x_planes`): ``bytes``,
    four planes of ``16 nblocks`` bytes (the high bytes of each block's elements 0-15, of 16-31,
    then the low bytes of the same); ``scale`` one float a block; ``sums`` (q4_1) ``scale * sum
    q`` a block; ``offsets`` (q4_0) four int32 a block, ``-8 sum q`` then three zeros."""

    bytes: str
    plane: str  # bytes of one plane (i64)
    scale: str
    sums: str | None
    offsets: str | None
    int8: bool


def emit_x_planes(fn: Fn, intx: IntX, nblocks: str) -> XPlanes:
    """The :class:`XPlanes` of an :class:`IntX` made with ``rows8=True`` (its ``split`` form),
    in stack arrays. Call it outside loops."""
    if intx.split is None:
        raise PiccError("codegen_cpu: dotplanes dot products need x's int16 form split into bytes (emit_int_x rows8)")
    planes = fn.alloca_array(vec(64, "i8"), nblocks, "xpl")
    plane = fn.v(f"shl i64 {nblocks}, 4", "xplb")
    offsets = fn.alloca_array(vec(4, "i32"), nblocks, "xoff4") if intx.isums is not None else None
    b16 = vec(16, "i8")
    with fn.loop("0", nblocks, "1", "b") as b:
        sp = fn.at(intx.split, 64, b, "sp")
        for seg in range(4):  # split: 32 high bytes then 32 low bytes, elements in order
            dst = _in_plane(fn, planes, plane, seg, fn.v(f"shl i64 {b}, 4", "bo"))
            fn.store(b16, fn.load(b16, fn.gep(sp, str(16 * seg)), 16, "xseg"), dst, 16)
        if offsets is not None and intx.isums is not None:
            first = fn.load("i32", fn.at(intx.isums, 4, b), 4, "xo")
            fn.store(vec(4, "i32"), fn.v(f"insertelement {vec(4, 'i32')} zeroinitializer, i32 {first}, i64 0", "xo4"),
                     fn.at(offsets, 16, b), 16)
    return XPlanes(planes, plane, intx.scale, intx.sums, offsets, intx.int8)


def _in_plane(fn: Fn, planes: str, plane: str, seg: int, offset: str) -> str:
    """Byte ``offset`` (i64) of plane ``seg`` of x's byte planes (``plane`` bytes each)."""
    return fn.gep(planes, fn.v(f"add i64 {fn.v(f'mul i64 {plane}, {seg}', 'po')}, {offset}", "po"), "xpp")


def _scale_planes(fn: Fn, dtype: str, nblocks: str) -> tuple[str, str | None]:
    """The byte offsets in a row of ``nblocks`` (i64) blocks of its ``d`` plane and (q4_1) its
    ``m`` plane, after the nibbles."""
    d_at = fn.v(f"shl i64 {nblocks}, 4", "dpl")  # _NIBBLES (16) bytes a block
    return d_at, fn.v(f"mul i64 {nblocks}, {_NIBBLES + 2}", "mpl") if dtype == "q4_1" else None


def _spread(fn: Fn, value: str, blocks: int) -> str:
    """A ``<blocks x float>`` with each element repeated over its block's four lanes."""
    pick = ", ".join(f"i32 {lane // 4}" for lane in range(4 * blocks))
    return fn.v(f"shufflevector {vec(blocks)} {value}, {vec(blocks)} poison, <{4 * blocks} x i32> <{pick}>", "spread")


def _widen(fn: Fn, value: str, n: int, width: int) -> str:
    """A ``<n x float>`` as the first lanes of a ``<width x float>`` (the rest zero)."""
    if n == width:
        return value
    pick = ", ".join(f"i32 {i if i < n else n}" for i in range(width))
    return fn.v(f"shufflevector {vec(n)} {value}, {vec(n)} zeroinitializer, <{width} x i32> <{pick}>", "wide")


def _int_sums(fn: Fn, nib: tuple[str, str], xb: list[str], lanes: int, isa: str, vnni: bool, int8: bool) -> str:
    """Each 32-bit lane's exact ``q . x``: ``nib`` the low and high nibbles (``<4 lanes x i8>``),
    ``xb`` x's high bytes of elements 0-15 and 16-31 of the blocks, then their low bytes. On AVX2
    sixteen lanes are two halves of eight (the same integers)."""
    if lanes == 16 and isa != "avx512":
        b64, ints8 = vec(64, "i8"), vec(8, "i32")

        def half(v: str, h: int) -> str:
            pick = ", ".join(f"i32 {32 * h + i}" for i in range(32))
            return fn.v(f"shufflevector {b64} {v}, {b64} poison, <32 x i32> <{pick}>", "half")

        parts = [_int_sums(fn, (half(nib[0], h), half(nib[1], h)), [half(x, h) for x in xb], 8, isa, vnni, int8)
                 for h in (0, 1)]
        pick = ", ".join(f"i32 {i}" for i in range(16))
        return fn.v(f"shufflevector {ints8} {parts[0]}, {ints8} {parts[1]}, <16 x i32> <{pick}>", "dots")
    nbytes = 4 * lanes
    bytes_t, ints, words = vec(nbytes, "i8"), vec(lanes, "i32"), vec(2 * lanes, "i16")
    if vnni:
        def dot(acc: str, unsigned: str, signed: str) -> str:
            return fn.v(f"call {ints} @llvm.x86.avx512.vpdpbusd.{32 * lanes}({ints} {acc}, {bytes_t} {unsigned}, "
                        f"{bytes_t} {signed})", "dp")

        high = dot(dot("zeroinitializer", nib[0], xb[0]), nib[1], xb[1])
        low = None if int8 else dot(dot("zeroinitializer", xb[2], nib[0]), xb[3], nib[1])
    else:
        ub_sw, wd = {4: ("ssse3.pmadd.ub.sw.128", "sse2.pmadd.wd"), 8: ("avx2.pmadd.ub.sw", "avx2.pmadd.wd"),
                     16: ("avx512.pmaddubs.w.512", "avx512.pmaddw.d.512")}[lanes]

        def pairs(a: str, b: str) -> str:
            return fn.v(f"call {words} @llvm.x86.{ub_sw}({bytes_t} {a}, {bytes_t} {b})", "pmb")

        def to_ints(w: str) -> str:
            return fn.v(f"call {ints} @llvm.x86.{wd}({words} {w}, {words} {vconst(2 * lanes, '1', 'i16')})", "pm")

        # int16 sums that cannot saturate: 2 x 2 x 15 x 128 (high bytes), 2 x 2 x 15 x 255 (low).
        high = to_ints(fn.v(f"add {words} {pairs(nib[0], xb[0])}, {pairs(nib[1], xb[1])}", "hs"))
        low = None if int8 else to_ints(fn.v(f"add {words} {pairs(xb[2], nib[0])}, {pairs(xb[3], nib[1])}", "ls"))
    dots = fn.v(f"shl {ints} {high}, {vconst(lanes, '8', 'i32')}", "hi8")
    return dots if low is None else fn.v(f"add {ints} {dots}, {low}", "dots")


class _Rows:
    """The accumulators of one call of :func:`emit_dots`: per row, the per-lane products and
    (q4_1) the ``m sum(x)`` terms, ``width`` lanes and ``width / 4`` blocks wide (on every
    level: AVX2 holds sixteen lanes in two registers, and so computes AVX-512's bits)."""

    def __init__(self, fn: Fn, dtype: str, rows: list[str], width: int, isa: str, nblocks: str) -> None:
        self.fn, self.dtype, self.rows, self.width, self.isa = fn, dtype, rows, width, isa
        self.dplane, self.mplane = _scale_planes(fn, dtype, nblocks)
        self.acc = [fn.var(vec(width), "zeroinitializer", "dacc") for _ in rows]
        self.accm = [fn.var(vec(width // 4), "zeroinitializer", "macc") for _ in rows] if dtype == "q4_1" else None

    def piece(self, xp: XPlanes, b: str, blocks: int, vnni: bool) -> None:
        """Blocks ``b .. b + blocks`` of every row into the accumulators."""
        fn, lanes = self.fn, 4 * blocks
        bytes_t = vec(4 * lanes, "i8")
        at = fn.v(f"shl i64 {b}, 4", "xo")
        segments = 2 if xp.int8 else 4  # int8 x: the low bytes are zero
        xb = [fn.load(bytes_t, _in_plane(fn, xp.bytes, xp.plane, seg, at), 16, "xb") for seg in range(segments)]
        scale = fn.load(vec(blocks), fn.at(xp.scale, 4, b), 4, "xsc")
        sums = fn.load(vec(blocks), fn.at(xp.sums, 4, b), 4, "xsum") if self.accm is not None and xp.sums else None
        offsets = fn.load(vec(lanes, "i32"), fn.at(xp.offsets, 16, b), 16, "xoff") if xp.offsets else None
        for r, row in enumerate(self.rows):
            raw = fn.load(bytes_t, fn.gep(row, at), 1, "nib")
            shifted = fn.v(f"lshr {bytes_t} {raw}, {vconst(4 * lanes, '4', 'i8')}", "sh")
            mask = vconst(4 * lanes, "15", "i8")
            nib = (fn.v(f"and {bytes_t} {raw}, {mask}", "lo4"), fn.v(f"and {bytes_t} {shifted}, {mask}", "hi4"))
            dots = _int_sums(fn, nib, xb, lanes, self.isa, vnni, xp.int8)
            if self.dtype == "q4_0":
                assert offsets is not None
                dots = fn.v(f"add {vec(lanes, 'i32')} {dots}, {offsets}", "dots")
            d = self._halves(fn.gep(row, self.dplane), b, blocks)
            ds = _spread(fn, fn.v(f"fmul {vec(blocks)} {d}, {scale}", "ds"), blocks)
            t = fn.v(f"sitofp {vec(lanes, 'i32')} {dots} to {vec(lanes)}", "t")
            self._add(self.acc[r], t, ds, lanes, self.width)
            if self.accm is not None:
                assert sums is not None and self.mplane is not None
                m = self._halves(fn.gep(row, self.mplane), b, blocks)
                self._add(self.accm[r], m, sums, blocks, self.width // 4)

    def _add(self, acc: Var, a: str, b: str, n: int, width: int) -> None:
        """``acc += a * b`` (``<n x float>``; a narrower piece's products in acc's first lanes)."""
        fn = self.fn
        if n == width:
            acc.set(fn.fma(vec(n), a, b, acc.get("a")))
        else:
            t = _widen(fn, fn.v(f"fmul {vec(n)} {a}, {b}", "t"), n, width)
            acc.set(fn.v(f"fadd {vec(width)} {acc.get('a')}, {t}", "a"))

    def _halves(self, plane: str, b: str, n: int) -> str:
        """Elements ``b .. b + n`` of an f16 plane as a ``<n x float>``."""
        fn = self.fn
        return fn.v(f"fpext {vec(n, 'half')} {fn.load(vec(n, 'half'), fn.at(plane, 2, b), 2, 'h16')} to {vec(n)}", "hf")

    def totals(self) -> list[str]:
        fn, out = self.fn, []
        for r in range(len(self.rows)):
            total = fn.hsum(self.width, self.acc[r].get("a"))
            if self.accm is not None:
                total = fn.v(f"fadd float {total}, {fn.hsum(self.width // 4, self.accm[r].get('m'))}", "dot")
            out.append(total)
        return out


def emit_dots(fn: Fn, mats: list[tuple[str, str]], xp: XPlanes, k: str, isa: str, vnni: bool,
              prefetch: list[str] | None = None) -> list[str]:
    """The float dot product with x of each ``(dtype, row)`` (rows of ``k`` (i64) elements in the
    dotplanes layout; every row of one call in one format), in one pass over the blocks: four
    at a time (one vector on AVX-512, ``isa``; two on AVX2, the same bits), then the row's last
    ones. ``vnni``: the integer sums with ``vpdpbusd``. ``prefetch``: rows (same format) read
    next, brought into L2 a line per line of these rows read, their scales at the start."""
    dtypes = {dtype for dtype, _ in mats}
    if len(dtypes) != 1 or not dtypes <= NIBBLE_DTYPES:
        raise PiccError(f"codegen_cpu: dotplanes dot products of one call read q4_0 or q4_1 rows of one format, "
                        f"got {sorted(dtypes)}")
    dtype = dtypes.pop()
    if dtype == "q4_1" and xp.sums is None or dtype == "q4_0" and xp.offsets is None:
        raise PiccError(f"codegen_cpu: x's planes were made without the sums {dtype} rows need")
    per = 4  # blocks a piece
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    rows = _Rows(fn, dtype, [row for _, row in mats], 4 * per, isa, nblocks)
    ahead = prefetch or []
    scale_bytes = fn.v(f"mul i64 {nblocks}, {head_bytes(dtype)}", "scb")
    for row in ahead:  # the scale planes, a line at a time
        with fn.loop("0", scale_bytes, str(_LINE), "o") as o:
            fn.prefetch(fn.gep(row, fn.v(f"add i64 {rows.dplane}, {o}", "pfo")), "l2")
    whole = fn.v(f"and i64 {nblocks}, {-per}", "whole")

    def piece(b: str, blocks: int) -> None:
        at = fn.v(f"shl i64 {b}, 4", "pfo")
        for row in ahead:  # the line of nibbles this piece reads (the last pieces too: short rows)
            fn.prefetch(fn.gep(row, at), "l2")
        rows.piece(xp, b, blocks, vnni)

    with fn.loop("0", whole, str(per), "b") as b:
        piece(b, per)
    with fn.if_(fn.v(f"icmp ne i64 {fn.v(f'and i64 {nblocks}, 2', 'two')}, 0", "has2")):
        piece(whole, 2)
    with fn.if_(fn.v(f"icmp ne i64 {fn.v(f'and i64 {nblocks}, 1', 'one')}, 0", "has1")):
        piece(fn.v(f"sub i64 {nblocks}, 1", "lastb"), 1)
    return rows.totals()


def emit_row_to_f32(fn: Fn, dtype: str, row: str, out: str, k: str, simd: str) -> None:
    """``out[j] = row[j]`` for j < k (i64), a dotplanes row dequantised exactly as ``picc.quant``
    (``d * q (+ m)``, q4_0's ``q - 8``)."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    d_at, m_at = _scale_planes(fn, dtype, nblocks)
    dplane = fn.gep(row, d_at, "dp")
    mplane = fn.gep(row, m_at, "mp") if m_at is not None else None
    with fn.loop("0", nblocks, "1", "b") as b:
        raw = fn.load(vec(16, "i8"), fn.at(row, _NIBBLES, b), 1, "nib")
        lo, hi = nibble_value_floats(fn, raw, dtype == "q4_0", simd)
        d = fn.v(f"fpext half {fn.load('half', fn.at(dplane, 2, b), 2, 'd16')} to float", "d")
        m = (fn.v(f"fpext half {fn.load('half', fn.at(mplane, 2, b), 2, 'm16')} to float", "m")
             if mplane is not None else None)
        vals = dequantized(fn, Block(lo, hi, d, m))
        op = fn.at(out, 4 * BLOCK, b, "op")
        fn.store(V16, vals[0], op, 4)
        fn.store(V16, vals[1], fn.gep(op, "64"), 4)
