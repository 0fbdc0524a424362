"""IR emitters for the row operations every matrix kernel is built from, in every weight format.

A *row* of a weight matrix is ``k`` logical elements stored in one of the formats below; rows are
stored back to back (``row_bytes(dtype, k)`` apart). The block formats are GGUF's: 32 elements per
block, an f16 scale first::

    q8_0  34 B: f16 d, 32 x int8 q                      w = d * q
    q4_0  18 B: f16 d, 16 B nibbles                     w = d * (q - 8)
    q4_1  20 B: f16 d, f16 m, 16 B nibbles              w = d * q + m

Byte j of a nibble block holds element j (low nibble) and element j + 16 (high nibble).

Rows are processed a block of 32 elements at a time, as two ``<16 x float>`` halves (one AVX-512
register, two AVX2 ones). Dot products keep one accumulator per row (see :func:`emit_dots`), the
block formats' ``sum_b d_b (q_b . x_b)`` with the scale applied once per block and the 4-bit
formats' constant parts (q4_0's ``- 8``, q4_1's ``m``) moved to sums of x made once per x
(:func:`emit_x_sums`); AXPYs of block-format rows, which read them in the rowplanes layout
(:mod:`picc.codegen_cpu.rowplanes`), likewise collect those constant parts per block. Several
rows share each load of ``x``, so the FMA chains of different rows overlap. Models that decide
no sparsity may dot 4-bit rows with x rounded to int16 instead (:func:`emit_int_x`, ``int_dots``
of :func:`emit_tiled_rows`), and read 4-bit matrices whose rows come in multiples of eight in the
*rows8* layout, eight rows at a time (:mod:`picc.codegen_cpu.rows8`). The order of every sum is
fixed in the IR (no fast-math flags), so AVX2 and AVX-512 builds compute the same bits.

q4_0 / q4_1 nibbles become floats through a 16-entry table (``vpermps``) on AVX-512, through
integer arithmetic and a conversion elsewhere; both give exactly ``q`` (or ``q - 8``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from picc.codegen_cpu.irtext import F32, Fn, fconst, vconst, vec
from picc.errors import PiccError
from picc.kernel_names import CPU_WEIGHT_FORMATS
from picc.quant import INT16_X_MAX

BLOCK = 32
V16 = vec(16)
V8 = vec(8)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
ELEMENT_BYTES = {"f32": 4, "f16": 2}
WEIGHT_DTYPES = CPU_WEIGHT_FORMATS
NIBBLE_DTYPES = frozenset({"q4_0", "q4_1"})  # 4-bit formats: x sums needed in dot products


def check_dtype(dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise PiccError(f"codegen_cpu: weight dtype {dtype!r} is not supported; expected one of "
                        f"{', '.join(WEIGHT_DTYPES)}")


def is_blocked(dtype: str) -> bool:
    return dtype in BLOCK_BYTES


def block_bytes(dtype: str) -> int:
    """Bytes of 32 consecutive elements of a row."""
    return BLOCK_BYTES[dtype] if is_blocked(dtype) else BLOCK * ELEMENT_BYTES[dtype]


def row_bytes(dtype: str, k: int) -> int:
    """Bytes of one row of ``k`` elements (``k`` a multiple of 32 for block formats)."""
    check_dtype(dtype)
    if is_blocked(dtype):
        if k % BLOCK:
            raise PiccError(f"codegen_cpu: a {dtype} row needs a multiple of 32 elements, got {k}")
        return k // BLOCK * BLOCK_BYTES[dtype]
    return k * ELEMENT_BYTES[dtype]


def emit_row_bytes(fn: Fn, dtype: str, k: str) -> str:
    """IR for :func:`row_bytes` of an i64 ``k``."""
    if is_blocked(dtype):
        return fn.v(f"mul i64 {fn.v(f'lshr i64 {k}, 5', 'nb')}, {BLOCK_BYTES[dtype]}", "rowb")
    return fn.v(f"mul i64 {k}, {ELEMENT_BYTES[dtype]}", "rowb")


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a row: the two halves (unscaled quants for block formats), scale and minimum."""

    lo: str
    hi: str
    d: str | None = None
    m: str | None = None


def _nibble_floats(fn: Fn, qptr: str, signed: bool, simd: str) -> tuple[str, str]:
    """The low and high nibbles of 16 bytes as floats (``q - 8`` when ``signed``)."""
    return nibble_value_floats(fn, fn.load(vec(16, "i8"), qptr, 1, "nib"), signed, simd)


def nibble_value_floats(fn: Fn, raw: str, signed: bool, simd: str) -> tuple[str, str]:
    """:func:`_nibble_floats` of a ``<16 x i8>`` value."""
    wide = fn.v(f"zext {vec(16, 'i8')} {raw} to {vec(16, 'i32')}", "nibw")
    hi_i = fn.v(f"lshr {vec(16, 'i32')} {wide}, {vconst(16, '4', 'i32')}", "hi4")
    if simd == "avx512":
        # vpermps reads only the low 4 bits of each index: the table lookup is the conversion.
        table = "<" + ", ".join(f"float {fconst(q - 8 if signed else q)}" for q in range(16)) + ">"
        return tuple(fn.v(f"call {V16} @llvm.x86.avx512.permvar.sf.512({V16} {table}, {vec(16, 'i32')} {i})", "qf")
                     for i in (wide, hi_i))  # type: ignore[return-value]
    lo_i = fn.v(f"and {vec(16, 'i32')} {wide}, {vconst(16, '15', 'i32')}", "lo4")
    out = []
    for i in (lo_i, hi_i):
        if signed:
            i = fn.v(f"sub {vec(16, 'i32')} {i}, {vconst(16, '8', 'i32')}", "qs")
        out.append(fn.v(f"sitofp {vec(16, 'i32')} {i} to {V16}", "qf"))
    return out[0], out[1]


def load_block(fn: Fn, dtype: str, row: str, b: str, simd: str, q4_0_raw: bool = False) -> Block:
    """Block ``b`` (i64) of ``row``; with ``q4_0_raw``, q4_0's quants as stored (``q``, not ``q - 8``)."""
    bptr = fn.at(row, block_bytes(dtype), b, "blk")
    if dtype in ("f32", "f16"):
        ty = F32 if dtype == "f32" else "half"
        size = 4 if dtype == "f32" else 2
        halves = [fn.load(vec(16, ty), fn.gep(bptr, str(16 * size * h)), size, "w") for h in (0, 1)]
        if dtype == "f16":
            halves = [fn.v(f"fpext {vec(16, 'half')} {w} to {V16}", "w") for w in halves]
        return Block(halves[0], halves[1])
    # The scale (and q4_1's minimum) as one 4-byte load and one conversion: two scalar f16 loads
    # cost Zen 3 more FP-pipe work (an insert and a convert each) than it is worth.
    dm = fn.v(f"fpext <2 x half> {fn.load('<2 x half>', bptr, 2, 'dmh')} to <2 x float>", "dm")
    d = fn.v(f"extractelement <2 x float> {dm}, i64 0", "d")
    if dtype == "q8_0":
        lo, hi = (fn.v(f"sitofp {vec(16, 'i8')} {fn.load(vec(16, 'i8'), fn.gep(bptr, str(2 + 16 * h)), 1, 'q8')} "
                       f"to {V16}", "qf") for h in (0, 1))
        return Block(lo, hi, d)
    if dtype == "q4_0":
        lo, hi = _nibble_floats(fn, fn.gep(bptr, "2"), not q4_0_raw, simd)
        return Block(lo, hi, d)
    lo, hi = _nibble_floats(fn, fn.gep(bptr, "4"), False, simd)
    return Block(lo, hi, d, fn.v(f"extractelement <2 x float> {dm}, i64 1", "m"))


def dequantized(fn: Fn, blk: Block) -> tuple[str, str]:
    """The block's f32 values, computed exactly as ``picc.quant.dequantize`` (``d * q (+ m)``)."""
    if blk.d is None:
        return blk.lo, blk.hi
    ds = fn.splat(16, blk.d)
    out = [fn.v(f"fmul {V16} {q}, {ds}", "w") for q in (blk.lo, blk.hi)]
    if blk.m is not None:
        ms = fn.splat(16, blk.m)
        out = [fn.v(f"fadd {V16} {w}, {ms}", "w") for w in out]
    return out[0], out[1]


def _load_element(fn: Fn, dtype: str, row: str, j: str) -> str:
    """Element ``j`` of a plain (f32 / f16) row as a float."""
    if dtype == "f32":
        return fn.load(F32, fn.at(row, 4, j), 4, "e")
    return fn.v(f"fpext half {fn.load('half', fn.at(row, 2, j), 2, 'e16')} to float", "e")


def prefetch_block(fn: Fn, dtype: str, row: str, b: str) -> None:
    """Prefetch the cache lines of block ``b`` of ``row`` (one per 64 bytes; blocks under 64
    bytes get one each, which covers every line since consecutive blocks are < 64 bytes apart)."""
    bb = block_bytes(dtype)
    start = fn.v(f"mul i64 {b}, {bb}", "pfo")
    for off in range(0, bb, 64):
        p = fn.gep(row, fn.v(f"add i64 {start}, {off}", "pfo") if off else start, "pfp")
        fn.emit(f"call void @llvm.prefetch.p0(ptr {p}, i32 0, i32 3, i32 1)")


def _prefetch_group(prefetch: list[tuple[str, str]] | None) -> int:
    """Blocks per prefetch for ``prefetch``'s rows: as many as fit in a cache line (1 for blocks
    of a line or more, which :func:`prefetch_block` covers block by block)."""
    if not prefetch:
        return 1
    return max(1, 64 // max(block_bytes(dtype) for dtype, _ in prefetch))


def _prefetch_group_lines(fn: Fn, dtype: str, row: str, g: str, group: int) -> None:
    """Prefetch the line holding the last byte of blocks [g, g + group) of ``row``. Groups span
    at most 64 bytes, so every line a group touches holds its last byte or the previous group's:
    one prefetch per group covers the row."""
    last = fn.v(f"add i64 {fn.v(f'mul i64 {g}, {block_bytes(dtype)}', 'pfo')}, {group * block_bytes(dtype) - 1}",
                "pfo")
    fn.emit(f"call void @llvm.prefetch.p0(ptr {fn.gep(row, last, 'pfp')}, i32 0, i32 3, i32 1)")


Prefetch = list[tuple[str, str]]
"""Rows to prefetch alongside a loop over blocks: ``(dtype, row pointer)``."""


@dataclass(frozen=True, slots=True)
class XSums:
    """Per-block sums of an ``x`` that the 4-bit formats' dot products read (:func:`emit_x_sums`).

    ``offsets`` (q4_0): ``-8 (x_lo + x_hi)``, 16 floats a block, so that ``(q - 8) . x`` is
    ``q . x`` plus them; ``folded`` (q4_1): ``x_lo + x_hi`` folded to 8 lanes, for ``m sum(x)``.
    """

    offsets: str | None
    folded: str | None


def emit_x_sums(fn: Fn, x: str, k: str, dtypes: set[str]) -> XSums | None:
    """The :class:`XSums` of ``x`` (k elements, i64) that rows of ``dtypes`` need, in stack arrays,
    or None when none do. Call it outside loops: the arrays are allocated where it is called."""
    need_off, need_fold = "q4_0" in dtypes, "q4_1" in dtypes
    if not (need_off or need_fold):
        return None
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    off = fn.alloca_array(V16, nblocks, "xoff") if need_off else None
    fold = fn.alloca_array(V8, nblocks, "xfold") if need_fold else None
    with fn.loop("0", nblocks, "1", "b") as b:
        xp = fn.at(x, 4 * BLOCK, b, "xp")
        xsum = fn.v(f"fadd {V16} {fn.load(V16, xp, 4, 'xlo')}, {fn.load(V16, fn.gep(xp, '64'), 4, 'xhi')}", "xs")
        if off:
            fn.store(V16, fn.v(f"fmul {V16} {xsum}, {vconst(16, fconst(-8.0))}", "xo"), fn.at(off, 64, b), 64)
        if fold:
            fn.store(V8, _fold(fn, xsum), fn.at(fold, 32, b), 32)
    return XSums(off, fold)


@dataclass(frozen=True, slots=True)
class IntX:
    """``x`` rounded to int16 per block of 32 for 4-bit dot products in integers (:func:`emit_int_x`).

    ``scale``: one float a block (the block's largest |x| / 32767), ``x ~ scale_b * q``. For rows
    one at a time: ``q``, 32 int16 a block in element order; ``offsets`` (q4_0), ``-8 * q`` summed
    in ``vpmaddwd``'s pairs, 8 int32 a block; ``folded`` (q4_1), the rounded x's ``lo + hi``
    halves (``q * scale`` in floats) folded to 8 lanes, so that q4_1's ``m sum(x)`` reads the same
    x as its ``q . x``. For rows eight at a time from the rows8 layout (``picc.codegen_cpu.rows8``):
    ``split``, 64 bytes a block, the 32 high bytes of q (``q >> 8``, signed) then its 32 low
    bytes (``q & 255``, unsigned), in element order; ``isums`` (q4_0), ``-8 sum q`` as one int32
    a block; ``sums`` (q4_1), ``scale * sum q``, one float a block.
    """

    scale: str
    q: str | None = None
    offsets: str | None = None
    folded: str | None = None
    split: str | None = None
    isums: str | None = None
    sums: str | None = None


def _int16_block(fn: Fn, xp: str) -> tuple[str, list[str]]:
    """Block ``xp`` (32 floats) rounded to int16: its scale (largest |x| / 32767, 0 for an
    all-zero block) and its two halves of 16 int16, ``roundeven(x * (32767 / largest |x|))``.
    The arithmetic of ``picc.quant.round_to_int16_blocks``, which the interpreter runs."""
    halves = [fn.load(V16, xp, 4, "xlo"), fn.load(V16, fn.gep(xp, "64"), 4, "xhi")]
    mags = [fn.v(f"call {V16} @llvm.fabs.v16f32({V16} {h})", "ax") for h in halves]
    amax = fn.v(f"call float @llvm.vector.reduce.fmax.v16f32({V16} "
                f"{fn.v(f'call {V16} @llvm.maxnum.v16f32({V16} {mags[0]}, {V16} {mags[1]})', 'am')})", "amax")
    some = fn.v(f"fcmp ogt float {amax}, 0.0", "some")
    inv = fn.v(f"select i1 {some}, float {fn.v(f'fdiv float {fconst(INT16_X_MAX)}, {amax}', 'inv')}, float 0.0",
               "inv")
    scale = fn.v(f"fdiv float {amax}, {fconst(INT16_X_MAX)}", "s")
    invs, qs = fn.splat(16, inv), []
    for h in halves:
        r = fn.v(f"call {V16} @llvm.roundeven.v16f32({V16} {fn.v(f'fmul {V16} {h}, {invs}', 'xq')})", "xr")
        qs.append(fn.v(f"fptosi {V16} {r} to {vec(16, 'i16')}", "xi"))
    return scale, qs


def _int16_values(fn: Fn, qs: list[str], scale: str) -> list[str]:
    """The floats an int16 block stands for, ``q * scale``, per half."""
    s, i16 = fn.splat(16, scale), vec(16, "i16")
    return [fn.v(f"fmul {V16} {fn.v(f'sitofp {i16} {q} to {V16}', 'qf')}, {s}", "xv") for q in qs]


def emit_int_x(fn: Fn, x: str, k: str, dtypes: set[str], rows8: bool = False) -> IntX | None:
    """The :class:`IntX` of ``x`` (k elements, i64) for rows of ``dtypes`` (``rows8``: in the rows8
    layout), in stack arrays, or None when no row is 4-bit. Rounding moves each element by at most
    half a step, 2^-16 of its block's largest |x|. Call it outside loops (the arrays are allocated
    where it is called)."""
    need_q4_0, need_q4_1 = "q4_0" in dtypes, "q4_1" in dtypes
    if not (need_q4_0 or need_q4_1):
        return None
    i16, i32 = vec(16, "i16"), vec(16, "i32")
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    scale = fn.alloca_array(F32, nblocks, "xs")
    if rows8:
        out = IntX(scale, split=fn.alloca_array(vec(64, "i8"), nblocks, "xsplit"),
                   isums=fn.alloca_array("i32", nblocks, "xis") if need_q4_0 else None,
                   sums=fn.alloca_array(F32, nblocks, "xsum") if need_q4_1 else None)
    else:
        out = IntX(scale, fn.alloca_array(vec(32, "i16"), nblocks, "xi"),
                   offsets=fn.alloca_array(vec(8, "i32"), nblocks, "xoff") if need_q4_0 else None,
                   folded=fn.alloca_array(V8, nblocks, "xfold") if need_q4_1 else None)
    with fn.loop("0", nblocks, "1", "b") as b:
        s, qs = _int16_block(fn, fn.at(x, 4 * BLOCK, b, "xp"))
        fn.store(F32, s, fn.at(scale, 4, b), 4)
        if out.q:
            qp = fn.at(out.q, 64, b, "qp")
            for h, qh in enumerate(qs):
                fn.store(i16, qh, fn.gep(qp, str(32 * h)), 32)
        if out.offsets:
            eight = vconst(16, "-8", "i16")
            pairs = [fn.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd({i16} {qh}, {i16} {eight})", "xo") for qh in qs]
            fn.store("<8 x i32>", fn.v(f"add <8 x i32> {pairs[0]}, {pairs[1]}", "xo"), fn.at(out.offsets, 32, b), 32)
        if out.folded:
            lo, hi = _int16_values(fn, qs, s)
            fn.store(V8, _fold(fn, fn.v(f"fadd {V16} {lo}, {hi}", "xs")), fn.at(out.folded, 32, b), 32)
        if out.split:
            sp = fn.at(out.split, 64, b, "sp")
            for h, qh in enumerate(qs):
                high = fn.v(f"ashr {i16} {qh}, {vconst(16, '8', 'i16')}", "xh")
                for half, part in ((0, high), (32, qh)):  # trunc keeps the low byte
                    fn.store(vec(16, "i8"), fn.v(f"trunc {i16} {part} to {vec(16, 'i8')}", "xb"),
                             fn.gep(sp, str(half + 16 * h)), 16)
        if out.isums or out.sums:
            wide = [fn.v(f"sext {i16} {qh} to {i32}", "xw") for qh in qs]
            both = fn.v(f"add {i32} {wide[0]}, {wide[1]}", "xt")
            total = fn.v(f"call i32 @llvm.vector.reduce.add.v16i32({i32} {both})", "xtot")
            if out.isums:
                fn.store("i32", fn.v(f"mul i32 {total}, -8", "xo"), fn.at(out.isums, 4, b), 4)
            if out.sums:
                fn.store(F32, fn.v(f"fmul float {fn.v(f'sitofp i32 {total} to float', 'xtf')}, {s}", "xsum"),
                         fn.at(out.sums, 4, b), 4)
    return out


def emit_round_int16(fn: Fn, x: str, out: str, lo: str, hi: str) -> None:
    """Blocks [lo, hi) (i64) of the floats at ``x`` as the integer dot products read them
    (:func:`_int16_block`'s ``q * scale``), written to ``out`` (which may be ``x``): what the
    prefill program's GEMMs read where the step's kernels dot int16 x."""
    with fn.loop(lo, hi, "1", "b") as b:
        s, qs = _int16_block(fn, fn.at(x, 4 * BLOCK, b, "xp"))
        op = fn.at(out, 4 * BLOCK, b, "op")
        for h, v in enumerate(_int16_values(fn, qs, s)):
            fn.store(V16, v, fn.gep(op, str(64 * h)), 4)


_ZEXT_BROADCAST = f"{vec(32, 'i32')} <" + ", ".join(f"i32 {i % 16}" for i in range(32)) + ">"
# Word j (bytes 2j, 2j+1) of the result: byte j of the 16 (in the lane that holds word j), then a
# zero (index -128). Lane 1 holds words 8-15, so it reads bytes 8-15 of its copy.
_ZEXT_SHUFFLE = "<" + ", ".join(f"i8 {j // 2 if j % 2 == 0 else -128}" for j in range(32)) + ">"


def _int_dot_block(fn: Fn, dtype: str, row: str, b: str, intx: IntX, scale: str, acc: str) -> str:
    """``acc`` plus block ``b`` of a 4-bit ``row`` dotted with the int16 x, in 8 lanes:
    ``d s (q . x_q (- 8 sum x_q))`` (+ ``m`` times q4_1's folded float x sums)."""
    i16 = vec(16, "i16")
    bptr = fn.at(row, block_bytes(dtype), b, "blk")
    dm = fn.v(f"fpext <2 x half> {fn.load('<2 x half>', bptr, 2, 'dmh')} to <2 x float>", "dm")
    d = fn.v(f"extractelement <2 x float> {dm}, i64 0", "d")
    # Bytes to words without crossing lanes: the 16 bytes broadcast to both 128-bit lanes (a
    # load), then an in-lane byte shuffle puts byte j in word j with a zero high byte.
    raw = fn.load(vec(16, "i8"), fn.gep(bptr, "2" if dtype == "q4_0" else "4"), 1, "nib")
    b16, b32 = vec(16, "i8"), vec(32, "i8")
    both = fn.v(f"shufflevector {b16} {raw}, {b16} poison, {_ZEXT_BROADCAST}", "nibb")
    spread = fn.v(f"call {b32} @llvm.x86.avx2.pshuf.b({b32} {both}, {b32} {_ZEXT_SHUFFLE})", "nibs")
    wide = fn.v(f"bitcast {b32} {spread} to {i16}", "nibw")
    nibbles = [fn.v(f"and {i16} {wide}, {vconst(16, '15', 'i16')}", "lo4"),
               fn.v(f"lshr {i16} {wide}, {vconst(16, '4', 'i16')}", "hi4")]
    assert intx.q is not None, "x's int16 form for rows one at a time"
    qp = fn.at(intx.q, 64, b, "qp")
    xs = [fn.load(i16, fn.gep(qp, str(32 * h)), 32, "xi") for h in (0, 1)]
    parts = [fn.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd({i16} {w}, {i16} {xq})", "pm")
             for w, xq in zip(nibbles, xs, strict=True)]
    total = fn.v(f"add <8 x i32> {parts[0]}, {parts[1]}", "pm")
    if dtype == "q4_0" and intx.offsets is not None:
        total = fn.v(f"add <8 x i32> {total}, {fn.load('<8 x i32>', fn.at(intx.offsets, 32, b), 32, 'xo')}", "pm")
    t = fn.v(f"sitofp <8 x i32> {total} to {V8}", "t")
    value = fn.fma(V8, t, fn.splat(8, fn.v(f"fmul float {d}, {scale}", "ds")), acc)
    if dtype == "q4_1" and intx.folded is not None:
        m = fn.v(f"extractelement <2 x float> {dm}, i64 1", "m")
        value = fn.fma(V8, fn.load(V8, fn.at(intx.folded, 32, b), 32, "xf"), fn.splat(8, m), value)
    return value


def _fold(fn: Fn, v16: str) -> str:
    """Lanes 0-7 plus lanes 8-15 of a ``<16 x float>`` (free on AVX2: two registers)."""
    halves = [fn.v(f"shufflevector {V16} {v16}, {V16} poison, <8 x i32> "
                   f"<{', '.join(f'i32 {i}' for i in range(h, h + 8))}>", "half") for h in (0, 8)]
    return fn.v(f"fadd {V8} {halves[0]}, {halves[1]}", "fold")


def emit_dots(fn: Fn, rows: list[tuple[str, str]], x: str, k: str, simd: str,
              prefetch: Prefetch | None = None, xsums: XSums | None = None, intx: IntX | None = None) -> list[str]:
    """``[sum_j row[j] * x[j] for (dtype, row) in rows]`` for an f32 ``x`` of ``k`` (i64) elements.

    Block formats need ``k % 32 == 0``; plain formats sum the ``k % 32`` tail in order after the
    blocks. ``prefetch`` rows are prefetched block by block alongside (the next rows to come).
    ``xsums``: :func:`emit_x_sums` of ``x`` for the rows' formats (needed by q4_0 and q4_1 rows),
    made once per ``x`` by the caller, outside its loops.

    Register pressure decides the speed here (measured on Zen 3: an accumulator spilled in the
    block loop cost more than a tenth of a q4_0 GEMV). Block formats compute the block's
    ``t = q_lo x_lo + q_hi x_hi`` in 16 lanes, fold it to 8 and add ``d t`` to an 8-lane
    accumulator (one AVX2 register), so that four rows in flight, x and the temporaries fit
    AVX2's sixteen registers. f16 rows do the same without the scale: ``w_lo x_lo + w_hi x_hi``
    folded to 8 lanes and added to an 8-lane accumulator (with a 16-lane accumulator per row, the
    converted halves and four rows spilled two accumulators a block: the f16 GEMV ran at ~9 bytes
    a cycle, in L2 as from L3). f32 rows keep a 16-lane accumulator and add ``w_lo x_lo`` then
    ``w_hi x_hi`` to it: their FMAs read w straight from memory, so nothing spills, and the
    folded form measured 4-7% slower on SmolLM2 F32. The 4-bit formats take ``q`` as stored and
    move the rest to x's side: q4_0 starts t from ``-8 (x_lo + x_hi)`` (``(q - 8) . x = q . x - 8 sum(x)``), q4_1
    adds ``m`` times the folded ``x_lo + x_hi`` (``(d q + m) . x = d (q . x) + m sum(x)``). The
    dot product is the sum of the lanes, halving in a fixed order. With ``intx`` (x rounded to
    int16, :func:`emit_int_x`) the 4-bit rows take the integer path instead (``_int_dot_block``);
    their x sums then come from ``intx``.
    """
    need = {dtype for dtype, _ in rows} & NIBBLE_DTYPES
    if intx is not None:
        if ("q4_0" in need and not intx.offsets) or ("q4_1" in need and not intx.folded):
            raise PiccError(f"codegen_cpu: integer dot products of {sorted(need)} rows need x's int16 form for them")
    elif need and (xsums is None or ("q4_0" in need and not xsums.offsets) or ("q4_1" in need and not xsums.folded)):
        raise PiccError(f"codegen_cpu: dot products of {sorted(need)} rows need x's sums (emit_x_sums)")
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    lanes = [16 if dtype == "f32" else 8 for dtype, _ in rows]  # each row's accumulator (see above)
    accs = [fn.var(vec(n), "zeroinitializer", "acc") for n in lanes]

    def block(b: str) -> None:
        xp = fn.at(x, 4 * BLOCK, b, "xp")
        xlo, xhi = fn.load(V16, xp, 4, "xlo"), fn.load(V16, fn.gep(xp, "64"), 4, "xhi")
        xscale = fn.load(F32, fn.at(intx.scale, 4, b), 4, "xsc") if intx is not None and need else None
        for (dtype, row), acc in zip(rows, accs, strict=True):
            if intx is not None and xscale is not None and dtype in NIBBLE_DTYPES:
                acc.set(_int_dot_block(fn, dtype, row, b, intx, xscale, acc.get("acc")))
                continue
            blk = load_block(fn, dtype, row, b, simd, q4_0_raw=True)
            if dtype == "f32":
                acc.set(fn.fma(V16, blk.hi, xhi, fn.fma(V16, blk.lo, xlo, acc.get("acc"))))
                continue
            if blk.d is None:  # f16
                t = fn.fma(V16, blk.hi, xhi, fn.v(f"fmul {V16} {blk.lo}, {xlo}", "t"), "t")
                acc.set(fn.v(f"fadd {V8} {acc.get('acc')}, {_fold(fn, t)}", "acc"))
                continue
            if dtype == "q4_0":
                start = fn.fma(V16, blk.lo, xlo, fn.load(V16, fn.at(xsums.offsets, 64, b), 64, "xo"), "t")
            else:
                start = fn.v(f"fmul {V16} {blk.lo}, {xlo}", "t")
            t8 = _fold(fn, fn.fma(V16, blk.hi, xhi, start, "t"))
            value = fn.fma(V8, t8, fn.splat(8, blk.d), acc.get("acc"))
            if blk.m is not None:
                value = fn.fma(V8, fn.load(V8, fn.at(xsums.folded, 32, b), 32, "xf"), fn.splat(8, blk.m), value)
            acc.set(value)

    group = _prefetch_group(prefetch)
    grouped = "0"
    if group > 1:
        # Blocks shorter than a cache line go ``group`` at a time with one prefetch per row: a
        # prefetch per block asked for each line two or three times, and the prefetches and
        # their addresses took issue slots from the arithmetic (q4_1 rows, int16 x, two threads,
        # from memory: 21.1 -> 21.7 GB/s).
        grouped = fn.v(f"sub i64 {nblocks}, {fn.v(f'urem i64 {nblocks}, {group}', 'rem')}", "grouped")
        with fn.loop("0", grouped, str(group), "g") as g:
            for dtype, row in prefetch or []:
                _prefetch_group_lines(fn, dtype, row, g, group)
            for u in range(group):
                block(fn.v(f"add i64 {g}, {u}", "b") if u else g)
    with fn.loop(grouped, nblocks, "1", "b") as b:
        for dtype, row in prefetch or []:
            prefetch_block(fn, dtype, row, b)
        block(b)
    sums = []
    for (dtype, row), acc, n in zip(rows, accs, lanes, strict=True):
        total = fn.var(F32, fn.hsum(n, acc.get("acc")), "dot")
        if not is_blocked(dtype):
            with fn.loop(fn.v(f"shl i64 {nblocks}, 5", "tail"), k, "1", "j") as j:
                xj = fn.load(F32, fn.at(x, 4, j), 4, "xj")
                total.set(fn.fma(F32, _load_element(fn, dtype, row, j), xj, total.get("dot")))
        sums.append(total)
    return [s.get("dot") for s in sums]


def emit_axpys(fn: Fn, rows: list[tuple[str, str, str]], y: str, k: str, simd: str,
               prefetch: Prefetch | None = None) -> None:
    """``y[j] += sum(a * row[j] for (dtype, row, a) in rows)`` for j < k (i64), y f32, f32 / f16
    rows in order. Rows in a block format are AXPY'd from the rowplanes layout
    (:func:`picc.codegen_cpu.rowplanes.emit_axpys`), where their scales come eight at a time."""
    if any(is_blocked(dtype) for dtype, _, _ in rows):
        raise PiccError("codegen_cpu: AXPYs of block-format rows read the rowplanes layout (rowplanes.emit_axpys)")
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    coef = [fn.splat(16, a, hint="a") for _, _, a in rows]
    with fn.loop("0", nblocks, "1", "b") as b:
        for dtype, row in prefetch or []:
            prefetch_block(fn, dtype, row, b)
        yp = fn.at(y, 4 * BLOCK, b, "yp")
        yhp = fn.gep(yp, "64", "yhp")
        ylo, yhi = fn.load(V16, yp, 4, "ylo"), fn.load(V16, yhp, 4, "yhi")
        for (dtype, row, _), av in zip(rows, coef, strict=True):
            blk = load_block(fn, dtype, row, b, simd)
            ylo = fn.fma(V16, blk.lo, av, ylo, "ylo")
            yhi = fn.fma(V16, blk.hi, av, yhi, "yhi")
        fn.store(V16, ylo, yp, 4)
        fn.store(V16, yhi, yhp, 4)
    with fn.loop(fn.v(f"shl i64 {nblocks}, 5", "tail"), k, "1", "j") as j:
        yj = fn.at(y, 4, j, "yp")
        value = fn.load(F32, yj, 4, "y")
        for dtype, row, a in rows:
            value = fn.fma(F32, _load_element(fn, dtype, row, j), a, value)
        fn.store(F32, value, yj, 4)


def emit_add_block_consts(fn: Fn, y: str, consts: str, k: str) -> None:
    """``y[j] += consts[j / 32]`` for j < k (i64, a multiple of 32): the constant terms of 4-bit
    rows' AXPYs (``picc.codegen_cpu.rowplanes.emit_axpys``)."""
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "b") as b:
        c = fn.splat(16, fn.load(F32, fn.at(consts, 4, b), 4, "cb"))
        yp = fn.at(y, 4 * BLOCK, b, "yp")
        for half in (yp, fn.gep(yp, "64", "yhp")):
            fn.store(V16, fn.v(f"fadd {V16} {fn.load(V16, half, 4, 'y')}, {c}", "yc"), half, 4)


def emit_row_to_f32(fn: Fn, dtype: str, row: str, out: str, k: str, simd: str) -> None:
    """``out[j] = row[j]`` dequantised exactly as ``picc.quant``, for j < k (i64)."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    with fn.loop("0", nblocks, "1", "b") as b:
        lo, hi = dequantized(fn, load_block(fn, dtype, row, b, simd))
        op = fn.at(out, 4 * BLOCK, b, "op")
        fn.store(V16, lo, op, 4)
        fn.store(V16, hi, fn.gep(op, "64"), 4)
    if not is_blocked(dtype):
        with fn.loop(fn.v(f"shl i64 {nblocks}, 5", "tail"), k, "1", "j") as j:
            fn.store(F32, _load_element(fn, dtype, row, j), fn.at(out, 4, j, "op"), 4)


def zero_floats(fn: Fn, ptr: str, n: str) -> None:
    """``ptr[0:n] = 0`` (f32)."""
    fn.emit(f"call void @llvm.memset.p0.i64(ptr align 4 {ptr}, i8 0, i64 {fn.v(f'shl i64 {n}, 2', 'nb')}, i1 false)")


_ROWS = 4  # GEMV rows computed together (over all the matrices of a tile: 2 rows each of up and gate)
_AHEAD = 4  # GEMV prefetch distance, in tiles
# Rows of these formats shorter than this go four at a time from four ranges of rows (see emit_tiled_rows).
_LIGHT_DTYPES = frozenset({"f16", "q8_0"})
_SHORT_ROW_BYTES = 4096


def emit_tiled_rows(fn: Fn, mats: list[tuple[str, str, str]], x: str, k: str, lo: str, hi: str, simd: str,
                    consume: Callable[[str, list[str]], None], xsums: XSums | None = None,
                    int_dots: bool = False, intx: IntX | None = None) -> None:
    """GEMV rows: for rows r in [lo, hi) (i64), the dot products of row r of each matrix
    ``(dtype, base, row_bytes)`` with ``x`` (k elements), handed to ``consume(r, dots)``.

    Rows go ``_ROWS / len(mats)`` at a time: their FMA chains overlap and x is loaded once for
    all of them; more would not fit AVX2's registers. Each row's own sum is the same whatever
    the tile, so results do not depend on it. A tile is consecutive rows, the tiles further on
    prefetched; except for short rows (under ``_SHORT_ROW_BYTES``) of formats whose arithmetic is
    light (f16, q8_0), decided at run time from the row length: there a tile takes one row from
    each of ``tile`` equal ranges of [lo, hi), so that each range is read as one long sequential
    stream, which the hardware prefetcher follows (a tile of consecutive short rows is as many
    short streams, which it follows badly, prefetched or not). Measured on Zen 3, two threads,
    against rows one at a time (what short rows did before): f16 8192 x 320 (relu-demo's LM head)
    from memory 35.5 vs 31.9 GB/s, from L3 96 vs 74; f16 8192 x 576 35.5 vs 29.9 and 104 vs 74;
    q8_0 49152 x 576 (SmolLM2's LM head) from L3 35 vs 29, q8_0 8192 x 576 from memory 34.5 vs
    30.7. Consecutive tiles with their prefetches did worse from memory (f16 8192 x 320: 23 GB/s)
    and, at 4096-byte rows and over, better than ranges (f16 4096 x 4096: 33.1 vs 31.7). Formats
    bound by their arithmetic (q4_0, q4_1) need the shared x loads and nothing else.

    ``xsums``: x's :func:`emit_x_sums`, made here when not given. ``int_dots``: 4-bit rows dot x
    rounded to int16 (:func:`emit_int_x`, made here) in integers, two ``vpmaddwd`` a block:
    1.2-1.4x faster, and within 2^-16 of each block's largest |x| of the float result
    (``select-kernels`` chooses; the interpreter rounds x as they do). ``intx``: that int16 x,
    when the caller has made it already (``int_dots`` is then implied).
    """
    dtypes = {dtype for dtype, _, _ in mats}
    if intx is None and int_dots:
        intx = emit_int_x(fn, x, k, dtypes)
    if xsums is None and intx is None:
        xsums = emit_x_sums(fn, x, k, dtypes)
    tile = max(1, _ROWS // len(mats))

    def row(base: str, rowb: str, r: str) -> str:
        return fn.gep(base, fn.v(f"mul i64 {r}, {rowb}", "roff"), "row")

    def rows_of_tile(idx: list[str], ahead: Prefetch | None) -> None:
        rows = [(dtype, row(base, rowb, i)) for dtype, base, rowb in mats for i in idx]
        dots = emit_dots(fn, rows, x, k, simd, ahead, xsums, intx)
        for t, i in enumerate(idx):
            consume(i, [dots[m * len(idx) + t] for m in range(len(mats))])

    def rows_in_tiles(tile: int) -> None:
        nrows = fn.v(f"sub i64 {hi}, {lo}", "nr")
        tiles = fn.v(f"sub i64 {hi}, {fn.v(f'srem i64 {nrows}, {tile}', 'rem')}", "tiles")
        last = fn.v(f"sub i64 {hi}, 1", "last")
        with fn.loop(lo, tiles, str(tile), "r") as r:
            # The rows of the tile _AHEAD tiles on, asked for block by block: the hardware
            # prefetcher alone falls behind on four interleaved row streams (1 thread, from memory:
            # q8_0 7.6 GB/s without, 12 one tile ahead, 24 two, 34 four).
            ahead = [(dtype, row(base, rowb, fn.min64(fn.v(f"add i64 {r}, {t + _AHEAD * tile}", "ra"), last)))
                     for dtype, base, rowb in mats for t in range(tile)]
            rows_of_tile([r] + [fn.v(f"add i64 {r}, {t}", "rt") for t in range(1, tile)], ahead)
        with fn.loop(tiles, hi, hint="r") as r:
            rows_of_tile([r], None)

    def rows_in_ranges(tile: int) -> None:
        span = fn.v(f"sdiv i64 {fn.v(f'sub i64 {hi}, {lo}', 'nr')}, {tile}", "span")  # rows of each range
        with fn.loop(lo, fn.v(f"add i64 {lo}, {span}", "end"), hint="r") as r:
            rows_of_tile([r] + [fn.v(f"add i64 {r}, {fn.v(f'mul i64 {span}, {t}', 'ro')}", "rt")
                                for t in range(1, tile)], None)
        with fn.loop(fn.v(f"add i64 {lo}, {fn.v(f'mul i64 {span}, {tile}', 'all')}", "rest"), hi, hint="r") as r:
            rows_of_tile([r], None)

    if tile == 1 or not dtypes <= _LIGHT_DTYPES:
        rows_in_tiles(tile)
        return
    longest = mats[0][2]
    for _, _, rowb in mats[1:]:
        longest = fn.max64(longest, rowb)
    short = fn.v(f"icmp ult i64 {longest}, {_SHORT_ROW_BYTES}", "short")
    with fn.if_(short):
        rows_in_ranges(tile)
    with fn.if_(fn.v(f"xor i1 {short}, true", "long")):
        rows_in_tiles(tile)
