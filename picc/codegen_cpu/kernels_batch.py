"""Batched twins of the dense decode kernels: ``batch`` sequences' x rows against one read of the weights.

A server that decodes B sequences in one step calls these instead of B calls of
:func:`~picc.codegen_cpu.kernels_dense.gemv` and :func:`~picc.codegen_cpu.kernels_dense.dense_ffn`.
Each sequence must get the bits of the one-sequence step (greedy output token for token; a sparse
gate flips on 1e-7), so nothing here computes a row differently:

* each x row is made into the form the dot products read (int16 per block, scaled, or its block
  sums) by the same emitters, row by row, into stack arrays that hold the batch's forms one after
  another (``alloc_*`` / ``fill_*`` of :mod:`.int16x`, :mod:`.rows8`, :mod:`.rowops`);
* threads split the rows exactly as the one-row kernel does (groups of eight, or rows), and each
  thread walks its groups or tiles of rows (:func:`~picc.codegen_cpu.rowops.walk_row_tiles`) as
  it does; the batch loop is *inside*: each group or tile is dotted with the x rows a few at a
  time by the very emitters the one-row kernels go through
  (:func:`~picc.codegen_cpu.rows8.emit_rows8_dots_xs`, :func:`~picc.codegen_cpu.rowops.emit_dots_xs`;
  ``emit_rows8_dots`` and ``emit_dots`` are their one-x case, and the one-row kernels' IR is what
  it was before them, byte for byte). On AVX-512 the rows8 int16-x dot products take x rows
  two to a 512-bit vector instead (:mod:`.rows8_pairs`, with ``vpdpbusd`` on ``avx512-vnni``):
  a block's ``q . x`` is an exact integer, which other instructions sum to the same integer,
  and the float operations after it are the one-row kernel's, lane by lane (these kernels see
  the SIMD level itself, ``Kernel.by_level``). Each x row keeps its own accumulators, fed block
  by block by the same operations in the same order, and a row's sum is that chain of float
  operations in the IR's order (no fast-math flags): it cannot depend on the batch, the thread, the x rows
  beside it or the weight rows beside it;
* the group's or tile's weights come from memory for the first x rows and from L1 / L2 for the
  others: the step reads its weights once, not B times. The x rows that go through a group's
  blocks together share each block's loads, and LLVM merges their identical nibble unpacking
  and scale conversions: these kernels are bound by their arithmetic on two cores, not by memory
  (SmolLM2's q4_1 rows8 GEMVs read ~30 GB/s of a 55 GB/s machine), so that is most of the gain.

Parameters: the one-row kernel's, then ``batch`` (>= 1), ``x_stride`` and ``y_stride`` (bytes,
multiples of 4): row b reads ``x + b x_stride`` and writes ``y + b y_stride``; ``accumulate``
applies to every row, the bias is shared. The x forms live on each thread's stack, 2 to 4 bytes
per element of every x row (both phases' for the FFN; int16 x in pairs another 2): keep ``batch
* k`` under a million or so on the 8 MiB stacks of the runtime's threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.int16x import INT_X_BLOCK_BYTES, IntX, alloc_int_x, fill_int_x
from picc.codegen_cpu.irtext import Fn, chunk_bounds, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_dense import (
    DENSE_FFN_PARAMS,
    GEMV_PARAMS,
    check_rows8,
    dense_ffn_form,
    dense_ffn_scratch_bytes,
    finish_row,
    store_h,
)
from picc.codegen_cpu.rowformats import Prefetch, check_dtype, emit_row_bytes
from picc.codegen_cpu.rowops import (
    X_SUMS_BLOCK_BYTES,
    XSums,
    alloc_x_sums,
    emit_dots_xs,
    fill_x_sums,
    walk_row_tiles,
)
from picc.codegen_cpu.rows8 import (
    GROUP,
    SCALED_X_BLOCK_BYTES,
    ScaledX,
    alloc_scaled_x,
    emit_group_bytes,
    emit_rows8_dots_xs,
    fill_scaled_x,
)
from picc.codegen_cpu.rows8_pairs import PAIR_X_BLOCK_BYTES, PairX, alloc_pair_x, emit_rows8_pair_dots, fill_pair_x
from runtime.cpu import vector_isa

BATCH_PARAMS = (("batch", "i32"), ("x_stride", "i32"), ("y_stride", "i32"))
GEMV_ROWS_PARAMS = GEMV_PARAMS + BATCH_PARAMS
DENSE_FFN_ROWS_PARAMS = DENSE_FFN_PARAMS + BATCH_PARAMS
Form = IntX | ScaledX | XSums
_BLOCK_BYTES: dict[type, dict[str, int]] = {IntX: INT_X_BLOCK_BYTES, ScaledX: SCALED_X_BLOCK_BYTES,
                                            XSums: X_SUMS_BLOCK_BYTES, PairX: PAIR_X_BLOCK_BYTES}
# x rows that go through a rows8 group's blocks together (divided among its matrices: 2 each for
# up and gate). Rows per second at batch 8 over the one-row kernel, SmolLM2 1536 x 576 up / 576 x
# 1536 down, 2 threads, Zen 4: 1 at a time 1.47x / 1.28x, 2 1.64 / 1.50, 4 1.48 / 1.54, 8 1.61 / 1.69
# (noisy to ~0.1: 4 keeps the accumulators and unpacked nibbles within AVX2's 16 registers).
_X_TILE = 4
# q8_0 rows (an LM head) with vpdpbusd: one accumulator and one int sum per x row, eight chunks
# shared; SmolLM2's head at batch 8, two threads, Zen 4, three alternating runs: 8 rows a tile
# 1058 / 1104 / 1181 us, 4 rows 1251 / 1328 / 1458.
_BYTE_X_TILE = 8
# The same with x rows two to a vector (rows8_pairs: int16 x on AVX-512), by the number of matrices:
# SmolLM2 q4_1 in L2, one thread, Zen 4, batch 8, cycles per x row and group block (avx512 / VNNI):
# the 1536 x 576 GEMV 17.4 / 13.3 with 4 rows a tile, 16.4 / 12.5 with 8 (16 the same); its FFN's
# up and gate with 2 rows a tile 20.5, 4 18.5, 8 19.3 (avx512). From memory, two threads, batch
# 8, the FFN (up and gate, then down) with 8 rather than 4, alternating, three pairs: 209 / 253,
# 229 / 246, 260 / 275 us (batch 4: 139 / 146).
_PAIR_TILE = {1: 8, 2: 8}
# x rows that go through a tile of rows one at a time together, by SIMD level: SmolLM2's q8_0
# head at batch 8, Zen 4, 2 threads: AVX-512 1 at a time 1.33x, 2 1.96x, 4 1.81x; the AVX2 build
# 1.40x with 1 and 1.39x with 2 (its 16 registers already hold four rows' converted blocks). Since
# q8_0 rows stopped folding each block (rowops.emit_dots), one thread, batch 8: AVX-512 2 at a
# time 1.47x, 4 1.67-2.11x, 8 1.01x (spilled); two threads, 4 at a time: 1.83x and 2.41x where
# the code before reached 1.42x and 0.99x in the same runs.
_ROW_X_TILE = {"avx512": 4}
# What a batch consumer gets: (x row b, weight row r, the row's dot products, one per matrix).
Consume = Callable[[str, str, list[str]], None]


def dense_ffn_rows_scratch_bytes(n: int, batch: int) -> int:
    """``batch`` rows of :func:`dense_ffn`'s scratch (row b's h at ``b * dense_ffn_scratch_bytes(n)``)."""
    return batch * dense_ffn_scratch_bytes(n)


def _view(fn: Fn, form: Form | PairX, first: str) -> Form | PairX:
    """``form`` from block ``first`` (i64) on: each of its arrays moved as far."""
    per_block = _BLOCK_BYTES[type(form)]
    moved = {f.name: fn.at(getattr(form, f.name), per_block[f.name], first, "xform")
             for f in fields(form) if f.name in per_block and getattr(form, f.name) is not None}
    return replace(form, **moved)


@dataclass(frozen=True, slots=True)
class XRows:
    """The x rows of a batch (``batch`` rows ``stride`` bytes apart from ``x``, ``nblocks`` blocks
    of 32 floats each) and their forms for the dot products, all rows' in each array of ``form``
    (row b's at block ``b * nblocks``), or None for formats that read x as it is; ``pairs``, rows
    2p and 2p + 1 interleaved (:class:`~picc.codegen_cpu.rows8_pairs.PairX`, pair p's at block
    ``p * nblocks``) where the dot products take x rows two at a time."""

    x: str
    stride: str
    nblocks: str
    form: Form | None
    pairs: PairX | None = None

    def row(self, fn: Fn, b: str) -> tuple[str, Form | None]:
        """Row ``b``'s x pointer and its form (a view into the batch's arrays)."""
        x = fn.gep(self.x, fn.v(f"mul i64 {b}, {self.stride}", "xoff"), "xrow")
        if self.form is None:
            return x, None
        return x, _view(fn, self.form, fn.v(f"mul i64 {b}, {self.nblocks}", "xblk"))  # type: ignore[return-value]

    def pair(self, fn: Fn, b: str) -> PairX:
        """Rows ``b`` (even) and ``b + 1`` interleaved (a view into the batch's pair arrays)."""
        assert self.pairs is not None
        first = fn.v(f"mul i64 {fn.v(f'lshr i64 {b}, 1', 'xpair')}, {self.nblocks}", "xblk")
        return _view(fn, self.pairs, first)  # type: ignore[return-value]


def emit_x_rows(fn: Fn, x: str, stride: str, k: str, batch: str, dtypes: set[str], x_format: str,
                rows8: bool, pairs: bool = False) -> XRows:
    """Each x row's form as the one-row kernel makes it for rows of ``dtypes``: rounded per block
    (``x_format`` ``"i16"`` / ``"i8"``), scaled (``rows8`` with float x), block sums (4-bit rows
    with float x) or none; with ``pairs`` (rounded x, rows8), rows 2p and 2p + 1's forms
    interleaved too.
    Call it outside loops: the arrays are allocated where it is called."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    total = fn.v(f"mul i64 {nblocks}, {batch}", "nblkall")
    form: Form | None
    if x_format != "f32" or rows8:
        form = alloc_int_x(fn, total, dtypes, rows8, x_format) if x_format != "f32" else None
        if form is None and rows8:
            form = alloc_scaled_x(fn, total, fn.v(f"shl i64 {total}, 5", "nx"))
    else:
        form = alloc_x_sums(fn, total, dtypes)
    paired = None
    if pairs and isinstance(form, IntX) and rows8:
        paired = alloc_pair_x(fn, fn.v(f"mul i64 {nblocks}, {fn.v(f'lshr i64 {batch}, 1', 'npair')}", "npblk"), dtypes,
                              form.int8)
    rows = XRows(x, stride, nblocks, form, paired)
    if form is not None:
        with fn.loop("0", batch, "1", "xb") as b:
            xb, fb = rows.row(fn, b)
            if isinstance(fb, IntX):
                fill_int_x(fn, xb, nblocks, fb)
            elif isinstance(fb, ScaledX):
                fill_scaled_x(fn, xb, nblocks, fb)
            else:
                assert fb is not None
                fill_x_sums(fn, xb, nblocks, fb)
    if paired is not None:
        with fn.loop("0", fn.v(f"and i64 {batch}, -2", "bpairs"), "2", "xp") as b:
            a, c = rows.row(fn, b)[1], rows.row(fn, fn.v(f"add i64 {b}, 1", "xb1"))[1]
            assert isinstance(a, IntX) and isinstance(c, IntX)
            fill_pair_x(fn, (a, c), nblocks, rows.pair(fn, b))
    return rows


def _in_x_tiles(fn: Fn, batch: str, most: int, body: Callable[[list[str]], None]) -> None:
    """``body(bs)`` for tiles ``bs`` of x rows covering [0, batch) (i64) once each, in order:
    ``most`` (a power of two) rows at a time, then at most one tile of each smaller power of two."""
    start, size = "0", most
    while size >= 1:
        end = batch if size == 1 else fn.v(f"sub i64 {batch}, {fn.v(f'srem i64 {batch}, {size}', 'brem')}", "bend")
        with fn.loop(start, end, str(size), "b") as b:
            body([b] + [fn.v(f"add i64 {b}, {t}", "bt") for t in range(1, size)])
        start, size = end, size // 2


def emit_rows8_batch(fn: Fn, mats: list[tuple[str, str, str]], rows: XRows, k: str, batch: str, glo: str,
                     ghi: str, consume: Consume, vnni: bool = False) -> None:
    """:func:`~picc.codegen_cpu.rows8.emit_rows8` over a batch: for each group g in [glo, ghi)
    of the rows8 matrices ``(dtype, base, group_bytes)``, then each x row b, the one-row kernel's
    dot products of the group's eight rows with row b, handed to ``consume(b, row, dots)``.
    x rows go ``_X_TILE // len(mats)`` at a time (q8_0 rows with ``vnni``: ``_BYTE_X_TILE``) through the group's blocks
    (:func:`~picc.codegen_cpu.rows8.emit_rows8_dots_xs`), sharing each block's loads and nibbles;
    with ``rows.pairs``, ``_PAIR_TILE // len(mats)`` at a time, two to a vector
    (:func:`~picc.codegen_cpu.rows8_pairs.emit_rows8_pair_dots`, ``vnni``: with ``vpdpbusd``),
    and an odd batch's last row alone."""
    bytes_vnni = vnni and {d for d, _, _ in mats} <= names.BYTE_ROWS8_DTYPES
    most = (_PAIR_TILE[len(mats)] if rows.pairs is not None else _BYTE_X_TILE // len(mats) if bytes_vnni
            else _X_TILE // len(mats))
    with fn.loop(glo, ghi, "1", "g") as g:
        groups = [(dtype, fn.gep(base, fn.v(f"mul i64 {g}, {gbytes}", "goff"), "grp")) for dtype, base, gbytes in mats]
        first = fn.v(f"shl i64 {g}, 3", "r0")

        def tile(bs: list[str]) -> None:
            if rows.pairs is not None and len(bs) > 1:
                got = emit_rows8_pair_dots(fn, groups, [rows.pair(fn, b) for b in bs[::2]], k, vnni)
            else:
                forms = [rows.row(fn, b)[1] for b in bs]
                assert all(isinstance(f, IntX | ScaledX) for f in forms)
                got = emit_rows8_dots_xs(fn, groups, forms, k, vnni)  # type: ignore[arg-type]
            for b, dots in zip(bs, got, strict=True):
                for lane in range(GROUP):
                    r = fn.v(f"add i64 {first}, {lane}", "r") if lane else first
                    consume(b, r, [fn.v(f"extractelement {vec(8)} {d}, i64 {lane}", "dot") for d in dots])

        _in_x_tiles(fn, batch, max(1, most), tile)


def emit_tiled_batch(fn: Fn, mats: list[tuple[str, str, str]], rows: XRows, k: str, batch: str, lo: str, hi: str,
                     simd: str, consume: Consume) -> None:
    """:func:`~picc.codegen_cpu.rowops.emit_tiled_rows` over a batch: the same tiles of rows
    [lo, hi), each dotted with every x row by the one-row kernel's dot code, x rows
    ``_ROW_X_TILE[simd]`` at a time (:func:`~picc.codegen_cpu.rowops.emit_dots_xs`: they share
    each block's loads and conversion; the tiles ahead are prefetched alongside)."""

    def tile_dots(trows: list[tuple[str, str]], idx: list[str], ahead: Prefetch | None) -> None:
        def x_tile(bs: list[str]) -> None:
            xs = []
            for b in bs:
                xb, form = rows.row(fn, b)
                assert not isinstance(form, ScaledX)
                xs.append((xb, form, None) if isinstance(form, XSums) or form is None else (xb, None, form))
            for b, dots in zip(bs, emit_dots_xs(fn, trows, xs, k, simd, ahead), strict=True):
                for t, i in enumerate(idx):
                    consume(b, i, [dots[m * len(idx) + t] for m in range(len(mats))])

        _in_x_tiles(fn, batch, _ROW_X_TILE.get(simd, 1), x_tile)

    walk_row_tiles(fn, mats, lo, hi, tile_dots)


def paired_x(level: str, x_format: str, rows8: bool) -> bool:
    """Whether the rows8 rounded-x dot products take x rows two to a vector: on both AVX-512 levels."""
    return x_format != "f32" and rows8 and vector_isa(level) == "avx512"


def uses_vnni(level: str) -> bool:
    """Whether the pairs' integer sums use ``vpdpbusd`` (AVX-512 VNNI)."""
    return level == "avx512-vnni"


def _strides(fn: Fn) -> tuple[str, str, str]:
    return fn.sext("%batch", "batch"), fn.sext("%x_stride", "xstride"), fn.sext("%y_stride", "ystride")


def _out(fn: Fn, y: str, y_stride: str, b: str, r: str) -> str:
    """``&y[b][r]``: float ``r`` of output row ``b``."""
    return fn.at(fn.gep(y, fn.v(f"mul i64 {b}, {y_stride}", "yoff"), "yrow"), 4, r, "yp")


@cache
def gemv_rows(dtype: str, x_format: str = "f32", rows8: bool = False) -> Kernel:
    """:func:`~picc.codegen_cpu.kernels_dense.gemv` for ``batch`` x rows: ``y_b[r] = (accumulate ?
    y_b[r] : 0) + W[r, :] . x_b + bias[r]``, every row the bits of the one-row kernel, the
    weights read once (see the module docstring)."""
    check_dtype(dtype)
    check_rows8(rows8, dtype, x_format=x_format)
    symbol = names.cpu_gemv_rows(dtype, x_format, rows8)

    def emit(level: str) -> str:
        simd, pairs = vector_isa(level), paired_x(level, x_format, rows8) and dtype in names.INT_DOT_DTYPES
        fn = kernel_fn(symbol, GEMV_ROWS_PARAMS, level)
        rows, k = fn.sext("%rows"), fn.sext("%k")
        batch, x_stride, y_stride = _strides(fn)
        xs = emit_x_rows(fn, "%x", x_stride, k, batch, {dtype}, x_format, rows8, pairs)

        def finish(b: str, r: str, dots: list[str]) -> None:
            finish_row(fn, dots[0], "%bias", r, _out(fn, "%y", y_stride, b, r))

        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        if rows8:
            glo, ghi = chunk_bounds(fn, fn.v(f"lshr i64 {rows}, 3", "groups"), tid, nthreads)
            emit_rows8_batch(fn, [(dtype, "%w", emit_group_bytes(fn, dtype, k))], xs, k, batch, glo, ghi, finish,
                             uses_vnni(level))
        else:
            lo, hi = chunk_bounds(fn, rows, tid, nthreads)
            emit_tiled_batch(fn, [(dtype, "%w", emit_row_bytes(fn, dtype, k))], xs, k, batch, lo, hi, simd, finish)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, GEMV_ROWS_PARAMS, emit, gemv_rows.__doc__ or "", by_level=x_format != "f32" and rows8)


@cache
def dense_ffn_rows(form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str, x_format: str = "f32",
                   rows8: bool = False) -> Kernel:
    """:func:`~picc.codegen_cpu.kernels_dense.dense_ffn` for ``batch`` x rows, every row the bits
    of the one-row kernel, each matrix read once. ``scratch`` holds ``batch`` rows of the one-row
    kernel's (:func:`dense_ffn_rows_scratch_bytes`): phase 1 writes row b's h there, the barrier,
    then phase 2 dots down with each row's h (rounded per row as the one-row kernel rounds its h)."""
    spec = dense_ffn_form(form, up_dtype, gate_dtype, down_dtype, rows8, x_format)
    symbol = names.cpu_dense_ffn_rows(form, up_dtype, gate_dtype, down_dtype, x_format, rows8)

    def emit(level: str) -> str:
        four_bit = {up_dtype, gate_dtype or up_dtype, down_dtype} <= names.INT_DOT_DTYPES
        simd, pairs = vector_isa(level), paired_x(level, x_format, rows8) and four_bit
        fn = kernel_fn(symbol, DENSE_FFN_ROWS_PARAMS, level)
        n, hidden = fn.sext("%n"), fn.sext("%hidden")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        batch, x_stride, y_stride = _strides(fn)
        h_stride = fn.v(f"shl i64 {n}, 2", "hstride")
        mats = [(up_dtype, "%up", emit_row_bytes(fn, up_dtype, hidden))]
        if gate_dtype is not None:
            mats.append((gate_dtype, "%gate", emit_row_bytes(fn, gate_dtype, hidden)))

        def h(b: str, r: str, dots: list[str]) -> None:
            store_h(fn, spec, r, dots, fn.gep("%scratch", fn.v(f"mul i64 {b}, {h_stride}", "hoff"), "hrow"))

        def out(b: str, r: str, dots: list[str]) -> None:
            finish_row(fn, dots[0], "%down_bias", r, _out(fn, "%y", y_stride, b, r))

        xs = emit_x_rows(fn, "%x", x_stride, hidden, batch, {d for d, _, _ in mats}, x_format, rows8, pairs)
        if rows8:
            glo, ghi = chunk_bounds(fn, fn.v(f"lshr i64 {n}, 3", "groups"), tid, nthreads)
            emit_rows8_batch(fn, [(d, base, emit_group_bytes(fn, d, hidden)) for d, base, _ in mats], xs, hidden,
                             batch, glo, ghi, h, uses_vnni(level))
        else:
            lo, hi = chunk_bounds(fn, n, tid, nthreads)
            emit_tiled_batch(fn, mats, xs, hidden, batch, lo, hi, simd, h)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        hs = emit_x_rows(fn, "%scratch", h_stride, n, batch, {down_dtype}, x_format, rows8, pairs)
        if rows8:
            glo2, ghi2 = chunk_bounds(fn, fn.v(f"lshr i64 {hidden}, 3", "groups"), tid, nthreads)
            emit_rows8_batch(fn, [(down_dtype, "%down", emit_group_bytes(fn, down_dtype, n))], hs, n, batch,
                             glo2, ghi2, out, uses_vnni(level))
        else:
            lo2, hi2 = chunk_bounds(fn, hidden, tid, nthreads)
            emit_tiled_batch(fn, [(down_dtype, "%down", emit_row_bytes(fn, down_dtype, n))], hs, n, batch, lo2, hi2,
                             simd, out)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, DENSE_FFN_ROWS_PARAMS, emit, dense_ffn_rows.__doc__ or "",
                  by_level=x_format != "f32" and rows8)
