"""Dense matrix kernels: GEMV (decode), GEMM (prefill) and embedding lookup, in every weight format.

Weights are ``W[rows, k]`` row-major in a format of :mod:`picc.codegen_cpu.rowops`; activations
are f32. Threads split the output rows: thread t computes rows ``[rows*t/n, rows*(t+1)/n)``.
"""

from __future__ import annotations

from functools import cache

from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowops import check_dtype, emit_dots, emit_row_bytes, emit_row_to_f32

GEMV_PARAMS = (("w", "ptr"), ("x", "ptr"), ("bias", "ptr"), ("y", "ptr"), ("rows", "i32"), ("k", "i32"),
               ("accumulate", "i32"))
GEMM_PARAMS = (("w", "ptr"), ("x", "ptr"), ("bias", "ptr"), ("y", "ptr"), ("seq", "i32"), ("rows", "i32"),
               ("k", "i32"), ("accumulate", "i32"))
EMBED_PARAMS = (("table", "ptr"), ("tokens", "ptr"), ("out", "ptr"), ("seq", "i32"), ("dim", "i32"))

_TILE = 4  # prefill rows that share each loaded weight vector
_ROWS = 4  # decode rows computed together
_AHEAD = 4  # GEMV prefetch distance, in tiles
_V16 = vec(16)


def _finish(fn: Fn, value: str, bias: str, r: str, out: str) -> None:
    """``out = (accumulate ? out : 0) + (value + bias[r])`` with a null ``bias`` meaning none."""
    total = fn.var(F32, value, "y")
    with fn.if_(fn.v(f"icmp ne ptr {bias}, null", "hasb")):
        total.set(fn.v(f"fadd float {total.get()}, {fn.load(F32, fn.at(bias, 4, r), 4, 'b')}", "yb"))
    with fn.if_(fn.v("icmp ne i32 %accumulate, 0", "acc")):
        total.set(fn.v(f"fadd float {fn.load(F32, out, 4, 'old')}, {total.get()}", "ya"))
    fn.store(F32, total.get(), out, 4)


@cache
def gemv(dtype: str) -> Kernel:
    """``y[r] = (accumulate ? y[r] : 0) + W[r, :] . x + bias[r]`` (bias may be null)."""
    check_dtype(dtype)
    symbol = f"picc_gemv_{dtype}"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, GEMV_PARAMS)
        rows, k = fn.sext("%rows"), fn.sext("%k")
        lo, hi = chunk_bounds(fn, rows, fn.sext("%tid"), fn.sext("%nthreads"))
        rowb = emit_row_bytes(fn, dtype, k)

        def row(r: str) -> str:
            return fn.gep("%w", fn.v(f"mul i64 {r}, {rowb}", "roff"), "row")

        # Rows go _ROWS at a time: their FMA chains overlap and x is loaded once for all of them.
        # Each row's own sum is the same whatever the tile, so results do not depend on it.
        nrows = fn.v(f"sub i64 {hi}, {lo}", "nr")
        tiles = fn.v(f"sub i64 {hi}, {fn.v(f'srem i64 {nrows}, {_ROWS}', 'rem')}", "tiles")
        last = fn.v(f"sub i64 {hi}, 1", "last")
        with fn.loop(lo, tiles, str(_ROWS), "r") as r:
            idx = [r] + [fn.v(f"add i64 {r}, {t}", "rt") for t in range(1, _ROWS)]
            # The rows of the tile _AHEAD tiles on, asked for block by block: the hardware
            # prefetcher alone falls behind on four interleaved row streams (1 thread, from memory:
            # q8_0 7.6 GB/s without, 12 one tile ahead, 24 two, 34 four).
            ahead = [(dtype, row(fn.min64(fn.v(f"add i64 {r}, {t + _AHEAD * _ROWS}", "ra"), last)))
                     for t in range(_ROWS)]
            for i, d in zip(idx, emit_dots(fn, [(dtype, row(i)) for i in idx], "%x", k, simd, ahead), strict=True):
                _finish(fn, d, "%bias", i, fn.at("%y", 4, i, "yp"))
        with fn.loop(tiles, hi, hint="r") as r:
            (d,) = emit_dots(fn, [(dtype, row(r))], "%x", k, simd)
            _finish(fn, d, "%bias", r, fn.at("%y", 4, r, "yp"))
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, GEMV_PARAMS, emit, gemv.__doc__ or "")


def _dot_tile(fn: Fn, wrow: str, xs: list[str], k: str) -> list[str]:
    """Dot products of one f32 row with each f32 vector in ``xs`` (each weight load is shared)."""
    accs = [fn.var(_V16, "zeroinitializer", "acc") for _ in xs]
    n16 = fn.v(f"and i64 {k}, -16", "n16")
    with fn.loop("0", n16, "16", "j") as j:
        w = fn.load(_V16, fn.at(wrow, 4, j), 4, "w")
        for acc, x in zip(accs, xs, strict=True):
            xv = fn.load(_V16, fn.at(x, 4, j), 4, "x")
            acc.set(fn.fma(_V16, w, xv, acc.get("acc")))
    sums = [fn.var(F32, fn.hsum(16, acc.get("acc")), "dot") for acc in accs]
    with fn.loop(n16, k, "1", "j") as j:
        w = fn.load(F32, fn.at(wrow, 4, j), 4, "w")
        for s, x in zip(sums, xs, strict=True):
            s.set(fn.fma(F32, w, fn.load(F32, fn.at(x, 4, j), 4, "x"), s.get()))
    return [s.get() for s in sums]


@cache
def gemm(dtype: str) -> Kernel:
    """``Y[s, r] = (accumulate ? Y[s, r] : 0) + W[r, :] . X[s, :] + bias[r]`` for s < seq.

    Each weight row is dequantised once into a stack buffer and multiplied with the prompt's
    rows four at a time, so the weights are read from memory once per call.
    """
    check_dtype(dtype)
    symbol = f"picc_gemm_{dtype}"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, GEMM_PARAMS)
        seq, rows, k = fn.sext("%seq"), fn.sext("%rows"), fn.sext("%k")
        lo, hi = chunk_bounds(fn, rows, fn.sext("%tid"), fn.sext("%nthreads"))
        rowb = emit_row_bytes(fn, dtype, k)
        xrow = fn.v(f"mul i64 {k}, 4", "xrowb")
        yrow = fn.v(f"mul i64 {rows}, 4", "yrowb")
        buf = fn.alloca_array(F32, k, "wrow")
        tiles = fn.v(f"sub i64 {seq}, {fn.v(f'srem i64 {seq}, {_TILE}', 'rem')}", "tiles")
        with fn.loop(lo, hi, hint="r") as r:
            row = fn.gep("%w", fn.v(f"mul i64 {r}, {rowb}", "roff"), "row")
            if dtype == "f32":
                wrow = row
            else:
                emit_row_to_f32(fn, dtype, row, buf, k, simd)
                wrow = buf
            with fn.loop("0", tiles, str(_TILE), "s") as s:
                idx = [s] + [fn.v(f"add i64 {s}, {t}", "st") for t in range(1, _TILE)]
                xs = [fn.gep("%x", fn.v(f"mul i64 {i}, {xrow}", "xo"), "xr") for i in idx]
                for i, d in zip(idx, _dot_tile(fn, wrow, xs, k), strict=True):
                    out = fn.gep(fn.gep("%y", fn.v(f"mul i64 {i}, {yrow}", "yo")), fn.v(f"shl i64 {r}, 2", "rc"))
                    _finish(fn, d, "%bias", r, out)
            with fn.loop(tiles, seq, "1", "s") as s:
                x = fn.gep("%x", fn.v(f"mul i64 {s}, {xrow}", "xo"), "xr")
                (d,) = _dot_tile(fn, wrow, [x], k)
                out = fn.gep(fn.gep("%y", fn.v(f"mul i64 {s}, {yrow}", "yo")), fn.v(f"shl i64 {r}, 2", "rc"))
                _finish(fn, d, "%bias", r, out)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, GEMM_PARAMS, emit, gemm.__doc__ or "")


@cache
def embed(dtype: str) -> Kernel:
    """``out[s, :] = table[tokens[s], :]`` dequantised to f32 (tokens i32, threads split s)."""
    check_dtype(dtype)
    symbol = f"picc_embed_{dtype}"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, EMBED_PARAMS)
        seq, dim = fn.sext("%seq"), fn.sext("%dim")
        lo, hi = chunk_bounds(fn, seq, fn.sext("%tid"), fn.sext("%nthreads"))
        rowb = emit_row_bytes(fn, dtype, dim)
        with fn.loop(lo, hi, hint="s") as s:
            tok = fn.sext(fn.load("i32", fn.at("%tokens", 4, s), 4, "tok"), "tok")
            row = fn.gep("%table", fn.v(f"mul i64 {tok}, {rowb}", "roff"), "row")
            out = fn.gep("%out", fn.v(f"mul i64 {s}, {fn.v(f'shl i64 {dim}, 2', 'ob')}", "oo"), "orow")
            emit_row_to_f32(fn, dtype, row, out, dim, simd)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, EMBED_PARAMS, emit, embed.__doc__ or "")
