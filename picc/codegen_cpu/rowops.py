"""IR emitters for the row operations every matrix kernel is built from, in every weight format.

The formats and the loading of their blocks are :mod:`picc.codegen_cpu.rowformats`'s. Here: dot
products of rows with an f32 ``x`` (:func:`emit_dots`), AXPYs into an f32 ``y``
(:func:`emit_axpys`) and GEMV rows in tiles (:func:`emit_tiled_rows`). Rows are processed a block
of 32 elements at a time, as two ``<16 x float>`` halves. Dot products keep one accumulator per
row (see :func:`emit_dots`), the block formats' ``sum_b d_b (q_b . x_b)`` with the scale applied
once per block and the 4-bit formats' constant parts (q4_0's ``- 8``, q4_1's ``m``) moved to sums
of x made once per x (:func:`emit_x_sums`); AXPYs of block-format rows, which read them in the
rowplanes layout (:mod:`picc.codegen_cpu.rowplanes`), likewise collect those constant parts per
block. Several rows share each load of ``x``, so the FMA chains of different rows overlap. Models
that decide no sparsity may dot 4-bit rows with x rounded to int16 instead
(:mod:`picc.codegen_cpu.int16x`, ``int_dots`` of :func:`emit_tiled_rows`), and read 4-bit
matrices whose rows come in multiples of eight in the *rows8* layout, eight rows at a time
(:mod:`picc.codegen_cpu.rows8`). The order of every sum is fixed in the IR (no fast-math flags),
so AVX2 and AVX-512 builds compute the same bits.

The names of the two modules split from this one stay importable from it (``rowops.row_bytes``,
``rowops.emit_int_x``, ...): the kernels and the lowering import them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from picc.codegen_cpu.int16x import INT_ROW_DTYPES, IntX, emit_int_x, emit_round_x, int_dot_block
from picc.codegen_cpu.irtext import F32, Fn, Var, fconst, vconst, vec
from picc.codegen_cpu.rowformats import (
    BLOCK,
    BLOCK_BYTES,
    ELEMENT_BYTES,
    NIBBLE_DTYPES,
    V8,
    V16,
    Block,
    Prefetch,
    block_bytes,
    check_dtype,
    dequantized,
    emit_row_bytes,
    emit_row_to_f32,
    fold8,
    is_blocked,
    load_block,
    load_element,
    nibble_value_floats,
    prefetch_block,
    row_bytes,
)
from picc.errors import PiccError

# Defined here, and (re-exported) the names other modules have imported from here.
__all__ = [
    "BLOCK", "BLOCK_BYTES", "ELEMENT_BYTES", "NIBBLE_DTYPES", "V16", "X_SUMS_BLOCK_BYTES", "Block", "IntX", "Prefetch",
    "TileDots", "XForms", "XSums", "alloc_x_sums", "check_dtype", "dequantized", "emit_add_block_consts", "emit_axpys",
    "emit_dots", "emit_dots_xs", "emit_int_x", "emit_round_x", "emit_row_bytes", "emit_row_to_f32",
    "emit_tiled_rows", "emit_x_sums", "fill_x_sums", "nibble_value_floats", "prefetch_block", "row_bytes",
    "walk_row_tiles", "zero_floats",
]


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
    if not dtypes & NIBBLE_DTYPES:
        return None
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    out = alloc_x_sums(fn, nblocks, dtypes)
    assert out is not None
    fill_x_sums(fn, x, nblocks, out)
    return out


X_SUMS_BLOCK_BYTES = {"offsets": 64, "folded": 32}
"""Bytes per block of each array of an :class:`XSums` (as :func:`alloc_x_sums` allocates them)."""


def alloc_x_sums(fn: Fn, nblocks: str, dtypes: set[str]) -> XSums | None:
    """Stack arrays of an :class:`XSums` of ``nblocks`` (i64) blocks for rows of ``dtypes`` (None
    when none need them): apart from :func:`fill_x_sums` so that a batched kernel can hold
    several x's sums one after another."""
    need_off, need_fold = "q4_0" in dtypes, "q4_1" in dtypes
    if not (need_off or need_fold):
        return None
    return XSums(fn.alloca_array(V16, nblocks, "xoff") if need_off else None,
                 fn.alloca_array(V8, nblocks, "xfold") if need_fold else None)


def fill_x_sums(fn: Fn, x: str, nblocks: str, out: XSums) -> None:
    """The sums of ``x`` (``nblocks`` (i64) blocks of 32 floats) into the arrays of ``out``."""
    with fn.loop("0", nblocks, "1", "b") as b:
        xp = fn.at(x, 4 * BLOCK, b, "xp")
        xsum = fn.v(f"fadd {V16} {fn.load(V16, xp, 4, 'xlo')}, {fn.load(V16, fn.gep(xp, '64'), 4, 'xhi')}", "xs")
        if out.offsets:
            fn.store(V16, fn.v(f"fmul {V16} {xsum}, {vconst(16, fconst(-8.0))}", "xo"), fn.at(out.offsets, 64, b), 64)
        if out.folded:
            fn.store(V8, fold8(fn, xsum), fn.at(out.folded, 32, b), 32)


def _prefetch_group(prefetch: list[tuple[str, str]] | None) -> int:
    """Blocks per prefetch for ``prefetch``'s rows: as many as fit in a cache line (1 for blocks
    of a line or more, which :func:`prefetch_block` covers block by block)."""
    if not prefetch:
        return 1
    return max(1, 64 // max(block_bytes(dtype) for dtype, _ in prefetch))


def _prefetch_group_lines(fn: Fn, dtype: str, row: str, g: str, group: int, into: str) -> None:
    """Prefetch the line holding the last byte of blocks [g, g + group) of ``row``. Groups span
    at most 64 bytes, so every line a group touches holds its last byte or the previous group's:
    one prefetch per group covers the row."""
    last = fn.v(f"add i64 {fn.v(f'mul i64 {g}, {block_bytes(dtype)}', 'pfo')}, {group * block_bytes(dtype) - 1}",
                "pfo")
    fn.prefetch(fn.gep(row, last, 'pfp'), into)


def _blocks_with_prefetch(fn: Fn, nblocks: str, prefetch: Prefetch | None, block: Callable[[str], None],
                          into: str) -> None:
    """``block(b)`` for b < nblocks (i64), the lines of block b of each ``prefetch`` row asked for
    along the way (into ``into``, see ``Fn.prefetch``): blocks shorter than a line ``group`` at a
    time, with one prefetch a group."""
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
                _prefetch_group_lines(fn, dtype, row, g, group, into)
            for u in range(group):
                block(fn.v(f"add i64 {g}, {u}", "b") if u else g)
    with fn.loop(grouped, nblocks, "1", "b") as b:
        for dtype, row in prefetch or []:
            prefetch_block(fn, dtype, row, b, into)
        block(b)


def emit_dots(fn: Fn, rows: list[tuple[str, str]], x: str, k: str, simd: str,
              prefetch: Prefetch | None = None, xsums: XSums | None = None, intx: IntX | None = None,
              prefetch_into: str = "l1") -> list[str]:
    """``[sum_j row[j] * x[j] for (dtype, row) in rows]`` for an f32 ``x`` of ``k`` (i64) elements.

    Block formats need ``k % 32 == 0``; plain formats sum the ``k % 32`` tail in order after the
    blocks. ``prefetch`` rows are prefetched block by block alongside (the next rows to come),
    into ``prefetch_into`` (``Fn.prefetch``: "l2" for rows gathered from scattered places).
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
    folded form measured 4-7% slower on SmolLM2 F32. q8_0 rows are dequantized first, ``w = d q``
    (exact in float32: an f16 scale's 11 significant bits times 8 bits of quant), and then go as
    f32 rows: two FMAs a block for each x, where ``d (q_lo x_lo + q_hi x_hi)`` took three (and
    folding five), which is what bounds a batched LM head (every x row repeats them; the
    products with d are made once for all of them). The 4-bit formats take ``q`` as
    stored and move the rest to x's side: q4_0 starts t from ``-8 (x_lo + x_hi)``
    (``(q - 8) . x = q . x - 8 sum(x)``), q4_1 adds ``m`` times the folded ``x_lo + x_hi``
    (``(d q + m) . x = d (q . x) + m sum(x)``). The dot product is the sum of the lanes, halving in
    a fixed order. With ``intx`` (x rounded to int16, :func:`emit_int_x`) the 4-bit rows take the
    integer path instead (``int_dot_block``); their x sums then come from ``intx``.
    """
    return emit_dots_xs(fn, rows, [(x, xsums, intx)], k, simd, prefetch, prefetch_into)[0]


XForms = tuple[str, XSums | None, IntX | None]
"""An x as :func:`emit_dots_xs` reads it: the floats, and their sums or int16 form (or None)."""


def emit_dots_xs(fn: Fn, rows: list[tuple[str, str]], xs: list[XForms], k: str, simd: str,
                 prefetch: Prefetch | None = None, prefetch_into: str = "l1") -> list[list[str]]:
    """:func:`emit_dots` of each x of ``xs`` (a list per x) in one pass over the rows' blocks: a
    batched kernel's x rows share each block's loads and conversion to floats (the int16 path
    emits its unpacking per x; LLVM merges the identical instructions), while each x's sum is
    the one-x function's, operation for operation."""
    need = {dtype for dtype, _ in rows} & NIBBLE_DTYPES
    for _, xsums, intx in xs:
        if intx is not None:
            if ("q4_0" in need and not intx.offsets) or ("q4_1" in need and not intx.folded):
                raise PiccError(f"codegen_cpu: integer dot products of {sorted(need)} rows need x's int16 form "
                                "for them")
        elif need and (xsums is None or ("q4_0" in need and not xsums.offsets)
                       or ("q4_1" in need and not xsums.folded)):
            raise PiccError(f"codegen_cpu: dot products of {sorted(need)} rows need x's sums (emit_x_sums)")
    int_rows = {dtype for dtype, _ in rows} & INT_ROW_DTYPES
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    lanes = [16 if dtype == "f32" or _wide_rows(dtype) else 8 for dtype, _ in rows]  # see emit_dots
    accs = [[fn.var(vec(n), "zeroinitializer", "acc") for n in lanes] for _ in xs]

    def block(b: str) -> None:
        loaded = []
        for x, _, intx in xs:
            xp = fn.at(x, 4 * BLOCK, b, "xp")
            xlo, xhi = fn.load(V16, xp, 4, "xlo"), fn.load(V16, fn.gep(xp, "64"), 4, "xhi")
            loaded.append((xlo, xhi, fn.load(F32, fn.at(intx.scale, 4, b), 4, "xsc")
                           if intx is not None and int_rows else None))
        for i, (dtype, row) in enumerate(rows):
            blk: Block | None = None
            for (_, xsums, intx), (xlo, xhi, xscale), acc_x in zip(xs, loaded, accs, strict=True):
                acc = acc_x[i]
                if intx is not None and xscale is not None and dtype in INT_ROW_DTYPES:
                    acc.set(int_dot_block(fn, dtype, row, b, intx, xscale, acc.get("acc")))
                    continue
                if blk is None:
                    blk = load_block(fn, dtype, row, b, simd, q4_0_raw=True)
                    if _wide_rows(dtype):
                        blk = Block(*dequantized(fn, blk))
                acc.set(_float_dot_block(fn, dtype, blk, xlo, xhi, xsums, b, acc))

    _blocks_with_prefetch(fn, nblocks, prefetch, block, prefetch_into)
    out = []
    for (x, _, _), acc_x in zip(xs, accs, strict=True):
        sums = []
        for (dtype, row), acc, n in zip(rows, acc_x, lanes, strict=True):
            total = fn.var(F32, fn.hsum(n, acc.get("acc")), "dot")
            if not is_blocked(dtype):
                with fn.loop(fn.v(f"shl i64 {nblocks}, 5", "tail"), k, "1", "j") as j:
                    xj = fn.load(F32, fn.at(x, 4, j), 4, "xj")
                    total.set(fn.fma(F32, load_element(fn, dtype, row, j), xj, total.get("dot")))
            sums.append(total)
        out.append([s.get("dot") for s in sums])
    return out


def _wide_rows(dtype: str) -> bool:
    """Whether a row's blocks are dequantized and go into a 16-lane accumulator as f32 rows do,
    as :func:`emit_dots` describes: q8_0 (on every level: all compute the same bits)."""
    return dtype == "q8_0"


def _float_dot_block(fn: Fn, dtype: str, blk: Block, xlo: str, xhi: str, xsums: XSums | None, b: str,
                     acc: Var) -> str:
    """``acc`` plus block ``b`` of a row (``blk``) dotted with x's block (``xlo``, ``xhi``), as
    :func:`emit_dots` describes per format."""
    if dtype == "f32" or _wide_rows(dtype):
        return fn.fma(V16, blk.hi, xhi, fn.fma(V16, blk.lo, xlo, acc.get("acc")))
    if blk.d is None:  # f16
        t = fn.fma(V16, blk.hi, xhi, fn.v(f"fmul {V16} {blk.lo}, {xlo}", "t"), "t")
        return fn.v(f"fadd {V8} {acc.get('acc')}, {fold8(fn, t)}", "acc")
    if dtype == "q4_0":
        assert xsums is not None and xsums.offsets is not None
        start = fn.fma(V16, blk.lo, xlo, fn.load(V16, fn.at(xsums.offsets, 64, b), 64, "xo"), "t")
    else:
        start = fn.v(f"fmul {V16} {blk.lo}, {xlo}", "t")
    t8 = fold8(fn, fn.fma(V16, blk.hi, xhi, start, "t"))
    value = fn.fma(V8, t8, fn.splat(8, blk.d), acc.get("acc"))
    if blk.m is not None:
        assert xsums is not None and xsums.folded is not None
        value = fn.fma(V8, fn.load(V8, fn.at(xsums.folded, 32, b), 32, "xf"), fn.splat(8, blk.m), value)
    return value


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
            prefetch_block(fn, dtype, row, b, "l2")  # the rows of a sparse FFN's down projection
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
            value = fn.fma(F32, load_element(fn, dtype, row, j), a, value)
        fn.store(F32, value, yj, 4)


def emit_add_block_consts(fn: Fn, y: str, consts: str, k: str) -> None:
    """``y[j] += consts[j / 32]`` for j < k (i64, a multiple of 32): the constant terms of 4-bit
    rows' AXPYs (``picc.codegen_cpu.rowplanes.emit_axpys``)."""
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "b") as b:
        c = fn.splat(16, fn.load(F32, fn.at(consts, 4, b), 4, "cb"))
        yp = fn.at(y, 4 * BLOCK, b, "yp")
        for half in (yp, fn.gep(yp, "64", "yhp")):
            fn.store(V16, fn.v(f"fadd {V16} {fn.load(V16, half, 4, 'y')}, {c}", "yc"), half, 4)


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
                    x_format: str = "f32", intx: IntX | None = None) -> None:
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

    ``xsums``: x's :func:`emit_x_sums`, made here when not given. ``x_format`` ``"i16"`` (or
    ``"i8"``): 4-bit rows dot x rounded to it (:func:`emit_int_x`, made here) in integers, two
    ``vpmaddwd`` a block: 1.2-1.4x faster, and within 2^-16 of each block's largest |x| of the
    float result (``select-kernels`` chooses; the interpreter rounds x as they do). ``intx``:
    that rounded x, when the caller has made it already (``x_format`` is then implied).
    """
    dtypes = {dtype for dtype, _, _ in mats}
    if intx is None and x_format != "f32":
        intx = emit_int_x(fn, x, k, dtypes, x_format=x_format)
    if xsums is None and intx is None:
        xsums = emit_x_sums(fn, x, k, dtypes)

    def tile_dots(rows: list[tuple[str, str]], idx: list[str], ahead: Prefetch | None) -> None:
        dots = emit_dots(fn, rows, x, k, simd, ahead, xsums, intx, prefetch_into="l2")
        for t, i in enumerate(idx):
            consume(i, [dots[m * len(idx) + t] for m in range(len(mats))])

    walk_row_tiles(fn, mats, lo, hi, tile_dots)


TileDots = Callable[[list[tuple[str, str]], list[str], Prefetch | None], None]
"""What :func:`walk_row_tiles` does with a tile: ``(rows, idx, ahead)``, the tile's rows
``(dtype, row pointer)`` matrix by matrix (``len(idx)`` of each), their row numbers, and the
rows to prefetch while reading them (or None)."""


def walk_row_tiles(fn: Fn, mats: list[tuple[str, str, str]], lo: str, hi: str, tile_dots: TileDots) -> None:
    """The tiles of rows [lo, hi) (i64) of the matrices ``(dtype, base, row_bytes)`` that
    :func:`emit_tiled_rows` computes together, each handed to ``tile_dots``: the walk apart from
    the dot products so that a batched GEMV can dot each tile with several x's while it is in
    cache."""
    dtypes = {dtype for dtype, _, _ in mats}
    tile = max(1, _ROWS // len(mats))

    def row(base: str, rowb: str, r: str) -> str:
        return fn.gep(base, fn.v(f"mul i64 {r}, {rowb}", "roff"), "row")

    def rows_of_tile(idx: list[str], ahead: Prefetch | None) -> None:
        tile_dots([(dtype, row(base, rowb, i)) for dtype, base, rowb in mats for i in idx], idx, ahead)

    def rows_in_tiles(tile: int) -> None:
        nrows = fn.v(f"sub i64 {hi}, {lo}", "nr")
        tiles = fn.v(f"sub i64 {hi}, {fn.v(f'srem i64 {nrows}, {tile}', 'rem')}", "tiles")
        last = fn.v(f"sub i64 {hi}, 1", "last")
        with fn.loop(lo, tiles, str(tile), "r") as r:
            # The rows of the tile _AHEAD tiles on, asked for block by block (into L2: SmolLM2 F32
            # decode 1.35x L1's): the hardware prefetcher alone falls behind on four interleaved
            # row streams (1 thread, from memory: q8_0 7.6 GB/s without, 12 one tile ahead, 24 two, 34 four).
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

