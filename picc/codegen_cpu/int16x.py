"""x rounded to int16 or int8 per block of 32, and the integer dot products of 4-bit blocks with it.

Models that decide no sparsity may dot 4-bit rows (q4_0, q4_1) with x rounded to integers instead
of f32 (the ``_xi16`` and ``_xi8`` kernels, an op's ``x_format``): :func:`emit_int_x` rounds x
once per x, block by block, into the forms the dot products read (rows one at a time,
:func:`int_dot_block`, two ``vpmaddwd`` a block; rows eight at a time in the rows8 layout,
:mod:`picc.codegen_cpu.rows8`); :func:`emit_round_x` writes the same rounded floats for the
prefill's GEMMs. The rounding is ``picc.quant.round_x_blocks``'s, step for step, so the
interpreter rounds as the kernels do.

int8 x is held as int16 whose low bytes are zero: ``q8 * 256`` with the scale ``(amax / 127) *
2^-8`` (exact, a power of two), so every reader of the int16 form computes the same numbers from
it, and the rows8 dot products (:attr:`IntX.int8`) skip the low bytes' products, half their
integer work. The float results are those of a kernel that kept ``q8`` and ``amax / 127``: a
power of two moves no float rounding (no value here is near the denormals).
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cpu.irtext import F32, Fn, fconst, vconst, vec
from picc.codegen_cpu.rowformats import BLOCK, V8, V16, block_bytes, fold8, mxfp4_scale, mxfp4_values
from picc.kernel_names import INT_DOT_DTYPES as INT_ROW_DTYPES  # rows one at a time dot int16 x in integers
from picc.quant import INT_X_MAX


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
    a block; ``sums`` (q4_1), ``scale * sum q``, one float a block; ``qsums`` (q8_0 rows in the
    rows8 layout, int8 x), ``-128 sum q8`` as one int32 a block (what ``vpdpbusd`` adds when it
    reads the rows' signed bytes as unsigned ones, 128 more each: :mod:`.rows8_q8`). ``int8``: x
    was rounded to int8 (``q = 256 q8``): the low bytes are zero.
    """

    scale: str
    q: str | None = None
    offsets: str | None = None
    folded: str | None = None
    split: str | None = None
    isums: str | None = None
    sums: str | None = None
    int8: bool = False
    qsums: str | None = None


def x_format_of(intx: IntX | None) -> str:
    """The x format an :class:`IntX` holds (``"f32"`` for none)."""
    return "f32" if intx is None else "i8" if intx.int8 else "i16"


def _int16_block(fn: Fn, xp: str, x_format: str = "i16") -> tuple[str, list[str]]:
    """Block ``xp`` (32 floats) rounded to int16: its scale (largest |x| / top, 0 for an
    all-zero block) and its two halves of 16 int16, ``roundeven(x * (top / largest |x|))``, top
    32767; for ``x_format`` ``"i8"`` top 127, then the integers times 256 and the scale times
    2^-8 (the int8 as the int16 form holds it). The arithmetic of ``picc.quant.round_x_blocks``,
    which the interpreter runs."""
    top, int8 = INT_X_MAX[x_format], x_format == "i8"
    halves = [fn.load(V16, xp, 4, "xlo"), fn.load(V16, fn.gep(xp, "64"), 4, "xhi")]
    mags = [fn.v(f"call {V16} @llvm.fabs.v16f32({V16} {h})", "ax") for h in halves]
    # nnan: without it the reduction is fifteen serial scalar maxima, each with a NaN test (the
    # block's one long dependency chain; 8 x rows of 576 took 4.7 us against 3.1 to round). The
    # largest of values that are not NaN does not depend on the order it is taken in.
    amax = fn.v(f"call nnan float @llvm.vector.reduce.fmax.v16f32({V16} "
                f"{fn.v(f'call nnan {V16} @llvm.maxnum.v16f32({V16} {mags[0]}, {V16} {mags[1]})', 'am')})", "amax")
    some = fn.v(f"fcmp ogt float {amax}, 0.0", "some")
    inv = fn.v(f"select i1 {some}, float {fn.v(f'fdiv float {fconst(top)}, {amax}', 'inv')}, float 0.0", "inv")
    scale = fn.v(f"fdiv float {amax}, {fconst(top)}", "s")
    if int8:
        scale = fn.v(f"fmul float {scale}, {fconst(2.0 ** -8)}", "s")
    invs, qs = fn.splat(16, inv), []
    for h in halves:
        r = fn.v(f"call {V16} @llvm.roundeven.v16f32({V16} {fn.v(f'fmul {V16} {h}, {invs}', 'xq')})", "xr")
        if int8:
            r = fn.v(f"fmul {V16} {r}, {vconst(16, fconst(256.0))}", "xr")
        qs.append(fn.v(f"fptosi {V16} {r} to {vec(16, 'i16')}", "xi"))
    return scale, qs


def _int16_values(fn: Fn, qs: list[str], scale: str) -> list[str]:
    """The floats an int16 block stands for, ``q * scale``, per half."""
    s, i16 = fn.splat(16, scale), vec(16, "i16")
    return [fn.v(f"fmul {V16} {fn.v(f'sitofp {i16} {q} to {V16}', 'qf')}, {s}", "xv") for q in qs]


def emit_int_x(fn: Fn, x: str, k: str, dtypes: set[str], rows8: bool = False, x_format: str = "i16") -> IntX | None:
    """The :class:`IntX` of ``x`` (k elements, i64) rounded to ``x_format`` for rows of ``dtypes``
    (``rows8``: in the rows8 layout), in stack arrays, or None when no row is 4-bit. Rounding
    moves each element by at most half a step, 2^-16 (int16) or 1/254 (int8) of its block's
    largest |x|. Call it outside loops (the arrays are allocated where it is called)."""
    if not dtypes & INT_ROW_DTYPES and not (rows8 and "q8_0" in dtypes):
        return None
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    out = alloc_int_x(fn, nblocks, dtypes, rows8, x_format)
    assert out is not None
    fill_int_x(fn, x, nblocks, out)
    return out


def alloc_int_x(fn: Fn, nblocks: str, dtypes: set[str], rows8: bool = False, x_format: str = "i16") -> IntX | None:
    """Stack arrays of an :class:`IntX` of ``nblocks`` (i64) blocks of ``x_format``, for rows of ``dtypes``
    (None when no row is 4-bit, or q8_0 in the rows8 layout): apart from :func:`fill_int_x` so
    that a batched kernel can hold several x's forms one after another (``INT_X_BLOCK_BYTES``:
    each array's bytes per block)."""
    need_q4_0, need_q4_1, need_q8_0 = "q4_0" in dtypes, "q4_1" in dtypes, rows8 and "q8_0" in dtypes
    # rows: q alone, mxfp4 has no constant part; rows8: -8 sum q, whose 3 / 2 is the -12 sum q that
    # undoes the 12 added to its values to make them unsigned bytes (rows8.MXFP4_OFFSET)
    need_mxfp4 = "mxfp4" in dtypes
    if not (need_q4_0 or need_q4_1 or need_q8_0 or need_mxfp4):
        return None
    scale = fn.alloca_array(F32, nblocks, "xs")
    if rows8:
        return IntX(scale, split=fn.alloca_array(vec(64, "i8"), nblocks, "xsplit"),
                    isums=fn.alloca_array("i32", nblocks, "xis") if need_q4_0 or need_mxfp4 else None,
                    sums=fn.alloca_array(F32, nblocks, "xsum") if need_q4_1 else None, int8=x_format == "i8",
                    qsums=fn.alloca_array("i32", nblocks, "xqs") if need_q8_0 else None)
    return IntX(scale, fn.alloca_array(vec(32, "i16"), nblocks, "xi"),
                offsets=fn.alloca_array(vec(8, "i32"), nblocks, "xoff") if need_q4_0 else None,
                folded=fn.alloca_array(V8, nblocks, "xfold") if need_q4_1 else None, int8=x_format == "i8")


INT_X_BLOCK_BYTES = {"scale": 4, "q": 64, "offsets": 32, "folded": 32, "split": 64, "isums": 4, "sums": 4,
                     "qsums": 4}
"""Bytes per block of each array of an :class:`IntX` (as :func:`alloc_int_x` allocates them)."""


def fill_int_x(fn: Fn, x: str, nblocks: str, out: IntX) -> None:
    """Round ``x`` (``nblocks`` (i64) blocks of 32 floats) into the arrays of ``out``."""
    i16, i32 = vec(16, "i16"), vec(16, "i32")
    with fn.loop("0", nblocks, "1", "b") as b:
        s, qs = _int16_block(fn, fn.at(x, 4 * BLOCK, b, "xp"), x_format_of(out))
        fn.store(F32, s, fn.at(out.scale, 4, b), 4)
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
            fn.store(V8, fold8(fn, fn.v(f"fadd {V16} {lo}, {hi}", "xs")), fn.at(out.folded, 32, b), 32)
        if out.split:
            sp = fn.at(out.split, 64, b, "sp")
            for h, qh in enumerate(qs):
                high = fn.v(f"ashr {i16} {qh}, {vconst(16, '8', 'i16')}", "xh")
                for half, part in ((0, high), (32, qh)):  # trunc keeps the low byte
                    fn.store(vec(16, "i8"), fn.v(f"trunc {i16} {part} to {vec(16, 'i8')}", "xb"),
                             fn.gep(sp, str(half + 16 * h)), 16)
        if out.isums or out.sums or out.qsums:
            wide = [fn.v(f"sext {i16} {qh} to {i32}", "xw") for qh in qs]
            both = fn.v(f"add {i32} {wide[0]}, {wide[1]}", "xt")
            total = fn.v(f"call i32 @llvm.vector.reduce.add.v16i32({i32} {both})", "xtot")
            if out.isums:
                fn.store("i32", fn.v(f"mul i32 {total}, -8", "xo"), fn.at(out.isums, 4, b), 4)
            if out.qsums:  # sum q is 256 sum q8 (int8 x): -128 sum q8 is -(sum q) / 2, exactly
                fn.store("i32", fn.v(f"sub i32 0, {fn.v(f'ashr i32 {total}, 1', 'xh')}", "xq"),
                         fn.at(out.qsums, 4, b), 4)
            if out.sums:
                fn.store(F32, fn.v(f"fmul float {fn.v(f'sitofp i32 {total} to float', 'xtf')}, {s}", "xsum"),
                         fn.at(out.sums, 4, b), 4)


def emit_round_x(fn: Fn, x: str, out: str, lo: str, hi: str, x_format: str = "i16") -> None:
    """Blocks [lo, hi) (i64) of the floats at ``x`` as the integer dot products read them
    (:func:`_int16_block`'s ``q * scale``), written to ``out`` (which may be ``x``): what the
    prefill program's GEMMs read where the step's kernels dot x rounded to ``x_format``."""
    with fn.loop(lo, hi, "1", "b") as b:
        s, qs = _int16_block(fn, fn.at(x, 4 * BLOCK, b, "xp"), x_format)
        op = fn.at(out, 4 * BLOCK, b, "op")
        for h, v in enumerate(_int16_values(fn, qs, s)):
            fn.store(V16, v, fn.gep(op, str(64 * h)), 4)


_ZEXT_BROADCAST = f"{vec(32, 'i32')} <" + ", ".join(f"i32 {i % 16}" for i in range(32)) + ">"
# Word j (bytes 2j, 2j+1) of the result: byte j of the 16 (in the lane that holds word j), then a
# zero (index -128). Lane 1 holds words 8-15, so it reads bytes 8-15 of its copy.
_ZEXT_SHUFFLE = "<" + ", ".join(f"i8 {j // 2 if j % 2 == 0 else -128}" for j in range(32)) + ">"


def int_dot_block(fn: Fn, dtype: str, row: str, b: str, intx: IntX, scale: str, acc: str) -> str:
    """``acc`` plus block ``b`` of a 4-bit ``row`` dotted with the int16 x, in 8 lanes:
    ``d s (q . x_q (- 8 sum x_q))`` (+ ``m`` times q4_1's folded float x sums); mxfp4: ``d s
    (v . x_q)``, v its nibbles' int8 values (``vpshufb``), widened to words (|v| <= 12: the
    pairs' sums stay exact in int32, and so do their conversions to float, under 2^24)."""
    i16 = vec(16, "i16")
    bptr = fn.at(row, block_bytes(dtype), b, "blk")
    b16, b32 = vec(16, "i8"), vec(32, "i8")
    dm: str | None = None
    if dtype == "mxfp4":
        d = mxfp4_scale(fn, bptr)
        values = mxfp4_values(fn, fn.load(b16, fn.gep(bptr, "1"), 1, "nib"))
        nibbles = [fn.v(f"sext {b16} {v} to {i16}", "mxw") for v in values]
    else:
        dm = fn.v(f"fpext <2 x half> {fn.load('<2 x half>', bptr, 2, 'dmh')} to <2 x float>", "dm")
        d = fn.v(f"extractelement <2 x float> {dm}, i64 0", "d")
        # Bytes to words without crossing lanes: the 16 bytes broadcast to both 128-bit lanes (a
        # load), then an in-lane byte shuffle puts byte j in word j with a zero high byte.
        raw = fn.load(b16, fn.gep(bptr, "2" if dtype == "q4_0" else "4"), 1, "nib")
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
    if dtype == "q4_1" and intx.folded is not None and dm is not None:
        m = fn.v(f"extractelement <2 x float> {dm}, i64 1", "m")
        value = fn.fma(V8, fn.load(V8, fn.at(intx.folded, 32, b), 32, "xf"), fn.splat(8, m), value)
    return value
