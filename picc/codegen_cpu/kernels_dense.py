"""Dense matrix kernels: GEMV (decode), GEMM (prefill) and embedding lookup, in every weight format.

Weights are ``W[rows, k]`` row-major in a format of :mod:`picc.codegen_cpu.rowformats`; activations
are f32. Threads split the output rows: thread t computes rows ``[rows*t/n, rows*(t+1)/n)``.
"""

from __future__ import annotations

from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.ffn_emitter import emit_h, gated_form, plus_bias
from picc.codegen_cpu.int16x import IntX, emit_int_x
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowformats import check_dtype, emit_row_bytes, emit_row_to_f32
from picc.codegen_cpu.rowops import emit_tiled_rows
from picc.codegen_cpu.rows8 import ScaledX, emit_group_bytes, emit_rows8, emit_rows8_row_to_f32, emit_scaled_x
from picc.errors import PiccError
from picc.ir.ops import FfnForm
from runtime.cpu import vector_isa

GEMV_PARAMS = (("w", "ptr"), ("x", "ptr"), ("bias", "ptr"), ("y", "ptr"), ("rows", "i32"), ("k", "i32"),
               ("accumulate", "i32"))
GEMM_PARAMS = (("w", "ptr"), ("x", "ptr"), ("bias", "ptr"), ("y", "ptr"), ("seq", "i32"), ("rows", "i32"),
               ("k", "i32"), ("accumulate", "i32"))
EMBED_PARAMS = (("table", "ptr"), ("tokens", "ptr"), ("out", "ptr"), ("seq", "i32"), ("dim", "i32"))
EMBED_SCALED_PARAMS = (*EMBED_PARAMS, ("scale", "f32"))

_TILE = 4  # prefill rows that share each loaded weight vector
_ROW_PAIR = 2  # weight rows that share each loaded prefill row (see dot_grid)


def finish_row(fn: Fn, value: str, bias: str, r: str, out: str) -> None:
    """``out = (accumulate ? out : 0) + (value + bias[r])`` with a null ``bias`` meaning none
    (shared with the batched twins, :mod:`picc.codegen_cpu.kernels_batch`: the same bits)."""
    total = fn.var(F32, value, "y")
    with fn.if_(fn.v(f"icmp ne ptr {bias}, null", "hasb")):
        total.set(fn.v(f"fadd float {total.get()}, {fn.load(F32, fn.at(bias, 4, r), 4, 'b')}", "yb"))
    with fn.if_(fn.v("icmp ne i32 %accumulate, 0", "acc")):
        total.set(fn.v(f"fadd float {fn.load(F32, out, 4, 'old')}, {total.get()}", "ya"))
    fn.store(F32, total.get(), out, 4)


def check_rows8(rows8: bool, *dtypes: str, x_format: str = "f32") -> None:
    """That the rows8 layout holds ``dtypes`` for a kernel dotting ``x_format``: 4-bit (mxfp4 with
    rounded x), or q8_0 with int8 x."""
    held = (names.ROWS8_DTYPES if x_format == "i8" else names.I16_ROWS8_DTYPES if x_format == "i16"
            else names.NIBBLE_DTYPES)
    if rows8 and not set(dtypes) <= held:
        raise PiccError(f"codegen_cpu: the rows8 layout holds q4_0 / q4_1 matrices (mxfp4 ones for rounded x, "
                        f"q8_0 ones for int8 x), "
                        f"not {', '.join(dtypes)} for {x_format} x")
    if x_format != "f32" and set(dtypes) & names.BYTE_ROWS8_DTYPES and not (rows8 and x_format == "i8"):
        raise PiccError(f"codegen_cpu: q8_0 rows dot rounded x from the rows8 layout and int8 x alone, not "
                        f"{x_format} x{'' if rows8 else ' in rows'}")


def _rows8_x(fn: Fn, x: str, k: str, dtypes: set[str], x_format: str) -> IntX | ScaledX:
    """``x`` as rows8 dot products read it: rounded to ``x_format`` and split into bytes, or scaled."""
    if x_format != "f32":
        intx = emit_int_x(fn, x, k, dtypes, rows8=True, x_format=x_format)
        assert intx is not None
        return intx
    return emit_scaled_x(fn, x, k)


@cache
def gemv(dtype: str, x_format: str = "f32", rows8: bool = False) -> Kernel:
    """``y[r] = (accumulate ? y[r] : 0) + W[r, :] . x + bias[r]`` (bias may be null); with
    ``x_format`` ``"i16"`` / ``"i8"``, 4-bit rows dot x rounded to int16 / int8 per block
    (``rowops.emit_tiled_rows``; int8 pays in the rows8 layout, whose dot products skip the low
    bytes);
    with ``rows8``, a 4-bit W is in the rows8 layout (rows a multiple of 8), read eight rows at a
    time (``rows8.emit_rows8``) and threads split its groups of rows; q8_0 rows there dot int8 x,
    with ``vpdpbusd`` on ``avx512-vnni`` (:mod:`.rows8_q8`: the same integers, the same bits)."""
    check_dtype(dtype)
    check_rows8(rows8, dtype, x_format=x_format)
    symbol = names.cpu_gemv(dtype, x_format, rows8)
    by_level = rows8 and dtype in names.BYTE_ROWS8_DTYPES

    def emit(level: str) -> str:
        simd = vector_isa(level)
        fn = kernel_fn(symbol, GEMV_PARAMS, level if by_level else None)
        rows, k = fn.sext("%rows"), fn.sext("%k")

        def finish(r: str, dots: list[str]) -> None:
            finish_row(fn, dots[0], "%bias", r, fn.at("%y", 4, r, "yp"))

        if rows8:
            xr = _rows8_x(fn, "%x", k, {dtype}, x_format)
            glo, ghi = chunk_bounds(fn, fn.v(f"lshr i64 {rows}, 3", "groups"), fn.sext("%tid"), fn.sext("%nthreads"))
            emit_rows8(fn, [(dtype, "%w", emit_group_bytes(fn, dtype, k))], xr, k, glo, ghi, finish,
                       vnni=level == "avx512-vnni")
        else:
            lo, hi = chunk_bounds(fn, rows, fn.sext("%tid"), fn.sext("%nthreads"))
            emit_tiled_rows(fn, [(dtype, "%w", emit_row_bytes(fn, dtype, k))], "%x", k, lo, hi, simd, finish,
                            x_format=x_format)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, GEMV_PARAMS, emit, gemv.__doc__ or "", by_level=by_level)


DENSE_FFN_PARAMS = (("x", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("up_bias", "ptr"),
                    ("gate_bias", "ptr"), ("down_bias", "ptr"), ("y", "ptr"), ("scratch", "ptr"), ("n", "i32"),
                    ("hidden", "i32"), ("accumulate", "i32"))


def dense_ffn_scratch_bytes(n: int) -> int:
    return 4 * n


def store_h(fn: Fn, spec: FfnForm, r: str, dots: list[str], h: str) -> None:
    """``h[r]`` of the form from neuron ``r``'s up (and gate) dot products ``dots`` and the
    ``%up_bias`` (``%gate_bias``): phase 1 of :func:`dense_ffn`, shared with its batched twin
    (:mod:`picc.codegen_cpu.kernels_batch`) so that the two compute the same bits."""
    u = plus_bias(fn, dots[0], "%up_bias", r)
    a = (fn.v(f"call float @picc_act_{spec.act}(float {plus_bias(fn, dots[1], '%gate_bias', r)})", "a")
         if spec.gated else None)
    fn.store(F32, emit_h(fn, spec, a, u), fn.at(h, 4, r), 4)


def dense_ffn_form(form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str, rows8: bool,
                   x_format: str = "f32") -> FfnForm:
    """The gated form of a dense FFN kernel, its matrices' formats, layout and x format checked
    (one check for the one-row kernel and its batched twin)."""
    spec = gated_form(form, gate_dtype)
    for d in (up_dtype, gate_dtype or "f32", down_dtype):
        check_dtype(d)
    check_rows8(rows8, up_dtype, gate_dtype or up_dtype, down_dtype, x_format=x_format)
    return spec


@cache
def dense_ffn(form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str, x_format: str = "f32",
              rows8: bool = False) -> Kernel:
    """A dense FFN in the source layout (down [hidden, n]): ``y = (accumulate ? y : 0) + (down (h) + down_bias)``.

    Threads split the n rows of up (and gate), computing ``h`` of the form into ``scratch`` (4 n
    bytes), meet at the barrier, then split the rows of down: two GEMV phases in one call.
    ``x_format``: 4-bit rows dot x (and h) rounded to it per block, as :func:`gemv`; ``rows8``:
    every matrix in the rows8 layout (n and hidden multiples of 8), as :func:`gemv` (q8_0 ones
    with int8 x).
    """
    spec = dense_ffn_form(form, up_dtype, gate_dtype, down_dtype, rows8, x_format)
    symbol = names.cpu_dense_ffn(form, up_dtype, gate_dtype, down_dtype, x_format, rows8)
    by_level = rows8 and bool({up_dtype, gate_dtype, down_dtype} & names.BYTE_ROWS8_DTYPES)  # as gemv's

    def emit(level: str) -> str:
        simd, vnni = vector_isa(level), level == "avx512-vnni"
        fn = kernel_fn(symbol, DENSE_FFN_PARAMS, level if by_level else None)
        n, hidden = fn.sext("%n"), fn.sext("%hidden")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        mats = [(up_dtype, "%up", emit_row_bytes(fn, up_dtype, hidden))]
        if gate_dtype is not None:
            mats.append((gate_dtype, "%gate", emit_row_bytes(fn, gate_dtype, hidden)))

        def h(r: str, dots: list[str]) -> None:
            store_h(fn, spec, r, dots, "%scratch")

        def out(r: str, dots: list[str]) -> None:
            finish_row(fn, dots[0], "%down_bias", r, fn.at("%y", 4, r, "yp"))

        if rows8:
            intx = _rows8_x(fn, "%x", hidden, {up_dtype, gate_dtype or up_dtype}, x_format)
            glo, ghi = chunk_bounds(fn, fn.v(f"lshr i64 {n}, 3", "groups"), tid, nthreads)
            emit_rows8(fn, [(d, base, emit_group_bytes(fn, d, hidden)) for d, base, _ in mats], intx, hidden,
                       glo, ghi, h, vnni)
        else:
            lo, hi = chunk_bounds(fn, n, tid, nthreads)
            emit_tiled_rows(fn, mats, "%x", hidden, lo, hi, simd, h, x_format=x_format)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        if rows8:
            hx = _rows8_x(fn, "%scratch", n, {down_dtype}, x_format)
            glo2, ghi2 = chunk_bounds(fn, fn.v(f"lshr i64 {hidden}, 3", "groups"), tid, nthreads)
            emit_rows8(fn, [(down_dtype, "%down", emit_group_bytes(fn, down_dtype, n))], hx, n, glo2, ghi2, out,
                       vnni)
        else:
            lo2, hi2 = chunk_bounds(fn, hidden, tid, nthreads)
            down = [(down_dtype, "%down", emit_row_bytes(fn, down_dtype, n))]
            emit_tiled_rows(fn, down, "%scratch", n, lo2, hi2, simd, out, x_format=x_format)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, DENSE_FFN_PARAMS, emit, dense_ffn.__doc__ or "", by_level=by_level)


def dot_grid(fn: Fn, wrows: list[str], xs: list[str], k: str, lanes: int = 8) -> list[list[str]]:
    """``[[w . x for x in xs] for w in wrows]`` for f32 rows of ``k`` floats: the GEMM's register
    tile, ``lanes`` per accumulator. Eight, so that two rows by four vectors (eight accumulators,
    the two rows' loads, one x) fit AVX2's sixteen registers: each loaded x feeds two FMAs and each
    loaded w four, where one row by four vectors spent more on loads than on FMAs. Sixteen where
    AVX-512's 32 registers hold four rows by four (:func:`gemm_tile`)."""
    vl = vec(lanes)
    accs = [[fn.var(vl, "zeroinitializer", "acc") for _ in xs] for _ in wrows]
    nl = fn.v(f"and i64 {k}, -{lanes}", "nl")
    with fn.loop("0", nl, str(lanes), "j") as j:
        ws = [fn.load(vl, fn.at(w, 4, j), 4, "w") for w in wrows]
        for t, x in enumerate(xs):
            xv = fn.load(vl, fn.at(x, 4, j), 4, "x")
            for r, w in enumerate(ws):
                accs[r][t].set(fn.fma(vl, w, xv, accs[r][t].get("acc")))
    sums = [[fn.var(F32, fn.hsum(lanes, acc.get("acc")), "dot") for acc in row] for row in accs]
    with fn.loop(nl, k, "1", "j") as j:
        ws = [fn.load(F32, fn.at(w, 4, j), 4, "w") for w in wrows]
        for t, x in enumerate(xs):
            xj = fn.load(F32, fn.at(x, 4, j), 4, "x")
            for r, w in enumerate(ws):
                sums[r][t].set(fn.fma(F32, w, xj, sums[r][t].get()))
    return [[d.get() for d in row] for row in sums]


def gemm_tile(simd: str) -> tuple[int, int]:
    """(weight rows, lanes) of :func:`dot_grid`'s tile at ``simd``: two rows of 8 lanes for AVX2's
    16 registers, four of 16 for AVX-512's 32 (sixteen accumulators, four rows' loads, one x: each
    512-bit x load feeds four FMAs). SmolLM2's prefill GEMMs (32 tokens, one thread, this Zen 5):
    f32 ~90 -> ~170 GFLOP/s."""
    return (4, 16) if simd.startswith("avx512") else (_ROW_PAIR, 8)


@cache
def gemm(dtype: str, rows8: bool = False) -> Kernel:
    """``Y[s, r] = (accumulate ? Y[s, r] : 0) + W[r, :] . X[s, :] + bias[r]`` for s < seq.

    Weight rows go two at a time, each dequantised once into a stack buffer, against the prompt's
    rows four at a time (:func:`dot_grid`), so the weights are read from memory once per call.
    ``rows8``: W in the rows8 layout (what the step's ``_r8_xi16`` kernels read), dequantised to
    the same floats.
    """
    check_dtype(dtype)
    if rows8 and dtype not in names.ROWS8_DTYPES:  # the layout's every format, read back as floats
        raise PiccError(f"codegen_cpu: the rows8 layout holds no {dtype} matrix")
    symbol = names.cpu_gemm(dtype, rows8)

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, GEMM_PARAMS)
        seq, rows, k = fn.sext("%seq"), fn.sext("%rows"), fn.sext("%k")
        lo, hi = chunk_bounds(fn, rows, fn.sext("%tid"), fn.sext("%nthreads"))
        rowb = emit_row_bytes(fn, dtype, k)
        xrow = fn.v(f"mul i64 {k}, 4", "xrowb")
        yrow = fn.v(f"mul i64 {rows}, 4", "yrowb")
        row_tile, lanes = gemm_tile(simd)
        bufs = [fn.alloca_array(F32, k, "wrow") for _ in range(row_tile)]
        tiles = fn.v(f"sub i64 {seq}, {fn.v(f'srem i64 {seq}, {_TILE}', 'rem')}", "tiles")

        def rows_out(rs: list[str]) -> None:
            """Rows ``rs`` of W (dequantised once each) against every row of X, a tile at a time."""
            wrows = []
            for r, buf in zip(rs, bufs, strict=False):
                row = fn.gep("%w", fn.v(f"mul i64 {r}, {rowb}", "roff"), "row")
                if rows8:
                    emit_rows8_row_to_f32(fn, dtype, "%w", r, buf, k, simd)
                    wrows.append(buf)
                elif dtype == "f32":
                    wrows.append(row)
                else:
                    emit_row_to_f32(fn, dtype, row, buf, k, simd)
                    wrows.append(buf)

            def finish(idx: list[str], dots: list[list[str]]) -> None:
                for r, row_dots in zip(rs, dots, strict=True):
                    for i, d in zip(idx, row_dots, strict=True):
                        out = fn.gep(fn.gep("%y", fn.v(f"mul i64 {i}, {yrow}", "yo")), fn.v(f"shl i64 {r}, 2", "rc"))
                        finish_row(fn, d, "%bias", r, out)

            with fn.loop("0", tiles, str(_TILE), "s") as s:
                idx = [s] + [fn.v(f"add i64 {s}, {t}", "st") for t in range(1, _TILE)]
                finish(idx, dot_grid(fn, wrows, [fn.gep("%x", fn.v(f"mul i64 {i}, {xrow}", "xo"), "xr")
                                                  for i in idx], k, lanes))
            with fn.loop(tiles, seq, "1", "s") as s:
                finish([s], dot_grid(fn, wrows, [fn.gep("%x", fn.v(f"mul i64 {s}, {xrow}", "xo"), "xr")], k, lanes))

        nrows = fn.v(f"sub i64 {hi}, {lo}", "nr")
        tiles_end = fn.v(f"sub i64 {hi}, {fn.v(f'srem i64 {nrows}, {row_tile}', 'odd')}", "tend")
        with fn.loop(lo, tiles_end, str(row_tile), "r") as r:
            rows_out([r] + [fn.v(f"add i64 {r}, {t}", "rt") for t in range(1, row_tile)])
        with fn.loop(tiles_end, hi, "1", "r") as r:
            rows_out([r])
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, GEMM_PARAMS, emit, gemm.__doc__ or "")


@cache
def embed(dtype: str, rows8: bool = False, scaled: bool = False) -> Kernel:
    """``out[s, :] = table[tokens[s], :]`` dequantised to f32 (tokens i32, threads split s);
    ``rows8``: the table in the rows8 layout (the LM head's, tied to it); ``scaled``: then times
    ``scale`` (f32, as the interpreter multiplies)."""
    check_dtype(dtype)
    if rows8 and dtype not in names.ROWS8_DTYPES:
        raise PiccError(f"codegen_cpu: the rows8 layout holds no {dtype} table")
    symbol = names.cpu_embed(dtype, rows8, scaled)
    params = EMBED_SCALED_PARAMS if scaled else EMBED_PARAMS

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, params)
        seq, dim = fn.sext("%seq"), fn.sext("%dim")
        lo, hi = chunk_bounds(fn, seq, fn.sext("%tid"), fn.sext("%nthreads"))
        rowb = emit_row_bytes(fn, dtype, dim)
        with fn.loop(lo, hi, hint="s") as s:
            tok = fn.sext(fn.load("i32", fn.at("%tokens", 4, s), 4, "tok"), "tok")
            out = fn.gep("%out", fn.v(f"mul i64 {s}, {fn.v(f'shl i64 {dim}, 2', 'ob')}", "oo"), "orow")
            if rows8:
                emit_rows8_row_to_f32(fn, dtype, "%table", tok, out, dim, simd)
            else:
                emit_row_to_f32(fn, dtype, fn.gep("%table", fn.v(f"mul i64 {tok}, {rowb}", "roff"), "row"), out,
                                dim, simd)
            if scaled:  # one pass over the row, a token's (the step's, or a prompt chunk's)
                with fn.loop("0", dim, hint="c") as c:
                    at = fn.at(out, 4, c)
                    fn.store("float", fn.v(f"fmul float {fn.load('float', at, 4)}, %scale", "sc"), at, 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, embed.__doc__ or "", token_split=True)
