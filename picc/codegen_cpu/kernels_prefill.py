"""The fused FFN of the prefill program: a chunk of tokens through one layer, weights read once.

``chunk_ffn`` computes, for each token s < seq, exactly what :func:`~picc.codegen_cpu.kernels_ffn.
sparse_ffn` computes for it alone: ``Y[s] = sum_i h[s, i] down_t[i, :] (+ down_bias)`` over the
neurons active *for that token* (its own mask byte, gate or ``|h|`` against the threshold, as in
the decode kernel's ``mode``); the others contribute exactly zero. What changes is the order of
work, so that each weight row is read from memory once per chunk instead of once per token:

1. Threads split the neurons. A neuron's gate row (and up row) is dequantised once into a stack
   buffer, then dotted with every token's x: two neurons by four tokens per register tile (the
   neurons needing the matrix listed first, then taken in pairs); ``h[s, i]`` goes
   to ``H`` (scratch, neuron-major [n, seq] f32, so that the tokens of a neuron share cache
   lines in both phases), 0 where the neuron is inactive for token s. Rows nobody in
   the chunk needs are skipped: a predicted neuron no token selected reads nothing; a gate-first
   neuron whose gate passed for no token skips its up row.
2. Barrier. Threads split the hidden columns (32 at a time, so a block format's blocks are not
   shared). The neurons live for some token go eight at a time: their slices of ``down_t`` are
   dequantised once, and each token's row of Y gets ``sum h[s, i] down_t[i]`` over the eight in
   one pass (skipped when all eight h are 0; a zero h adds exactly nothing).

``mask`` (predictor mode) is [seq, mask_stride] bytes, this partition's first neuron at column 0.
Sums run in a different order than the decode kernel's (f32 rounding differs at the 1e-7 level).
"""

from __future__ import annotations

import contextlib
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu import rowplanes
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_dense import dot_grid
from picc.codegen_cpu.kernels_ffn import check_ffn_kernel, plus_bias, times_scale
from picc.codegen_cpu.rowformats import ELEMENT_BYTES, emit_row_bytes, emit_row_to_f32
from picc.codegen_cpu.rows8 import emit_rows8_row_to_f32

CHUNK_FFN_PARAMS = (("x", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("up_bias", "ptr"),
                    ("gate_bias", "ptr"), ("down_bias", "ptr"), ("y", "ptr"), ("mask", "ptr"), ("scratch", "ptr"),
                    ("seq", "i32"), ("mask_stride", "i32"), ("n", "i32"), ("hidden", "i32"), ("threshold", "f32"),
                    ("score_scale", "ptr"))
_TILE = 4  # tokens dotted per pass over a dequantised row
_GROUP = 8  # live neurons added to a token's row of Y per pass (8 dequantised rows, 8 h in registers)
_V16 = vec(16)
_LINE = 64


def chunk_ffn_scratch_bytes(seq: int, n: int) -> int:
    """Bytes of the ``scratch`` :func:`chunk_ffn` needs for ``seq`` tokens and ``n`` neurons."""
    return -(-4 * seq * n // _LINE) * _LINE + -(-n // _LINE) * _LINE


def _dots_all_tokens(fn: Fn, wrows: list[str], k: str, seq: str, consume) -> None:  # noqa: ANN001
    """``consume(r, s, wrows[r] . x[s])`` for every row r and token s < seq (f32 rows of k floats,
    x rows k apart), four tokens at a time (:func:`~picc.codegen_cpu.kernels_dense.dot_grid`)."""
    xrow = fn.v(f"shl i64 {k}, 2", "xrowb")
    tiles = fn.v(f"sub i64 {seq}, {fn.v(f'srem i64 {seq}, {_TILE}', 'rem')}", "tiles")
    with fn.loop("0", tiles, str(_TILE), "s") as s:
        idx = [s] + [fn.v(f"add i64 {s}, {t}", "st") for t in range(1, _TILE)]
        xs = [fn.gep("%x", fn.v(f"mul i64 {i}, {xrow}", "xo"), "xr") for i in idx]
        for r, dots in enumerate(dot_grid(fn, wrows, xs, k)):
            for i, d in zip(idx, dots, strict=True):
                consume(r, i, d)
    with fn.loop(tiles, seq, "1", "s") as s:
        for r, (d,) in enumerate(dot_grid(fn, wrows, [fn.gep("%x", fn.v(f"mul i64 {s}, {xrow}", "xo"), "xr")], k)):
            consume(r, s, d)


def _any_token(fn: Fn, seq: str, test) -> str:  # noqa: ANN001 - s -> i1
    """An i1: whether ``test(s)`` holds for some token s < seq."""
    hit = fn.var("i1", "false", "any")
    with fn.loop("0", seq, hint="s") as s:
        hit.set(fn.v(f"or i1 {hit.get()}, {test(s)}", "any"))
    return hit.get("any")


@cache
def chunk_ffn(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
              interleaved: bool = False, dense_rows8: bool = False) -> Kernel:
    """The prefill FFN kernel of ``mode`` and ``form`` (see module doc); ``scratch`` holds
    :func:`chunk_ffn_scratch_bytes` bytes. ``dense_rows8``: the matrices the mode reads whole
    (gate-first: the gate; down-only: the gate and up) are in the rows8 layout (that of
    ``sparse_ffn``'s ``dense_rows8``), their rows dequantised to the same floats."""
    spec = check_ffn_kernel(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
    symbol = names.cpu_chunk_ffn(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
    act = f"@picc_act_{spec.act}"
    bias_stride = 2 if interleaved else 1

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, CHUNK_FFN_PARAMS)
        seq, n, hidden = fn.sext("%seq"), fn.sext("%n"), fn.sext("%hidden")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        stride = fn.sext("%mask_stride")
        rb_up, rb_down = emit_row_bytes(fn, up_dtype, hidden), emit_row_bytes(fn, down_dtype, hidden)
        rb_gate = emit_row_bytes(fn, gate_dtype, hidden) if gate_dtype else None
        if interleaved:
            rb_up = rb_gate = fn.v(f"shl i64 {rb_up}, 1", "rb2")
        floats = fn.v(f"mul i64 {seq}, {n}", "sn")
        floats = fn.v(f"and i64 {fn.v(f'add i64 {floats}, 15', 'r')}, -16", "hn")
        live = fn.gep("%scratch", fn.v(f"shl i64 {floats}, 2", "hb"), "live")  # one byte per neuron
        wbufs = [fn.alloca_array(F32, hidden, "wrow") for _ in range(2)]  # a pair of dequantised rows
        in_rows8 = names.read_whole(mode, "up", "gate") if dense_rows8 else ()
        thr = "%threshold"

        def h_at(s: str, i: str) -> str:  # H is neuron-major: a neuron's tokens share cache lines
            return fn.at("%scratch", 4, fn.v(f"add i64 {fn.v(f'mul i64 {i}, {seq}', 'is')}, {s}", "is"), "hp")

        def selected(s: str, i: str) -> str:
            m = fn.load("i8", fn.gep("%mask", fn.v(f"add i64 {fn.v(f'mul i64 {s}, {stride}', 'ms')}, {i}", "mi")), 1)
            return fn.v(f"icmp ne i8 {m}, 0", "sel")

        def absf(v: str) -> str:
            return fn.v(f"call float @llvm.fabs.f32(float {v})", "abs")

        # -- phase 1: h[s, i] for this thread's neurons. Each matrix's rows go through a list of
        # the neurons that need them, two at a time (dot_grid's register tile).
        lo, hi = chunk_bounds(fn, n, tid, nthreads)
        fn.emit(f"call void @llvm.memset.p0.i64(ptr {fn.gep(live, lo)}, i8 0, i64 {fn.v(f'sub i64 {hi}, {lo}', 'nl')}, "
                "i1 false)")
        ids = fn.alloca_array("i32", fn.v(f"sub i64 {hi}, {lo}", "nl"), "ids")

        def rows_of(matrix: str, dtype: str, rowb: str, wanted, consume, in_rows8: bool = False) -> None:  # noqa: ANN001
            """``consume(i, s, row_i . x[s])`` for each neuron i in [lo, hi) where ``wanted(i)``."""
            count = fn.var("i64", "0", "cnt")
            with fn.loop(lo, hi, hint="i") as i:
                keep = wanted(i)
                with fn.if_(keep) if keep != "true" else contextlib.nullcontext():
                    c = count.get("c")
                    fn.store("i32", fn.v(f"trunc i64 {i} to i32", "i32"), fn.at(ids, 4, c), 4)
                    count.set(fn.v(f"add i64 {c}, 1", "c1"))
            total = count.get("cnt")

            def group(k: str, size: int) -> None:
                neurons = [fn.sext(fn.load("i32", fn.at(ids, 4, fn.v(f"add i64 {k}, {g}", "kg")), 4, "nid"), "nid")
                           for g in range(size)]
                for i, buf in zip(neurons, wbufs, strict=False):
                    if in_rows8:
                        emit_rows8_row_to_f32(fn, dtype, matrix, i, buf, hidden, simd)
                    else:
                        emit_row_to_f32(fn, dtype, fn.gep(matrix, fn.v(f"mul i64 {i}, {rowb}", "ro")), buf, hidden,
                                        simd)
                _dots_all_tokens(fn, wbufs[:size], hidden, seq, lambda r, t, d: consume(neurons[r], t, d))

            pairs_end = fn.v(f"and i64 {total}, -2", "pend")
            with fn.loop("0", pairs_end, "2", "k") as k:
                group(k, 2)
            with fn.loop(pairs_end, total, hint="k") as k:
                group(k, 1)

        def needed(i: str) -> str:
            return _any_token(fn, seq, lambda s: selected(s, i)) if mode == "predictor" else "true"

        if spec.gated:
            def store_act(i: str, s: str, g: str) -> None:
                a = fn.v(f"call float {act}(float {plus_bias(fn, g, '%gate_bias', i, bias_stride)})", "a")
                fn.store(F32, a, h_at(s, i), 4)

            rows_of("%gate", gate_dtype, rb_gate, needed, store_act, "gate" in in_rows8)
        # dReLU's gate-first test is |h| > threshold, decided after up; relu(g) = 0 means h = 0.
        cut = fconst(0.0) if spec.act_on_up else thr

        def up_needed(i: str) -> str:
            if mode == "gate-first":
                return _any_token(fn, seq, lambda s: fn.v(f"fcmp ogt float {gate_score(s, i)}, {cut}", "pass"))
            return needed(i)

        def gate_score(s: str, i: str) -> str:
            """|act(g)| of token s, neuron i, times its score scale (dReLU decides on |h| later)."""
            a = absf(fn.load(F32, h_at(s, i), 4, "a"))
            return a if spec.act_on_up else times_scale(fn, a, i)

        def store_h(i: str, s: str, u: str) -> None:
            hp = h_at(s, i)
            u = plus_bias(fn, u, "%up_bias", i, bias_stride)
            if spec.gated:
                a = fn.load(F32, hp, 4, "a")
                if spec.act_on_up:
                    u = fn.v(f"call float {act}(float {u})", "au")
                h = fn.v(f"fmul float {a}, {u}", "h")
            else:
                h = fn.v(f"call float {act}(float {u})", "h")
            if mode == "predictor":
                keep = selected(s, i)
            elif mode == "gate-first":
                keep = fn.v(f"fcmp ogt float {gate_score(s, i)}, {cut}", "keep")
                if spec.act_on_up:
                    big = fn.v(f"fcmp ogt float {times_scale(fn, absf(h), i)}, {thr}", "big")
                    keep = fn.v(f"and i1 {keep}, {big}", "keep")
            elif mode == "down-only":
                keep = fn.v(f"fcmp ogt float {absf(h)}, {thr}", "keep")
            else:
                keep = "true"
            h = fn.v(f"select i1 {keep}, float {h}, float 0.0", "h")
            fn.store(F32, h, hp, 4)
            nz = fn.v(f"zext i1 {fn.v(f'fcmp one float {h}, 0.0', 'nz')} to i8", "nz8")
            lp = fn.gep(live, i)
            fn.store("i8", fn.v(f"or i8 {fn.load('i8', lp, 1, 'lv')}, {nz}", "lv"), lp, 1)

        rows_of("%up", up_dtype, rb_up, up_needed, store_h, "up" in in_rows8)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")

        # -- phase 2: Y[s, c0:c1] = sum_i h[s, i] down_t[i, c0:c1] (+ bias) for this thread's columns
        c0, c1 = chunk_bounds(fn, hidden, tid, nthreads, align=32)
        width = fn.v(f"sub i64 {c1}, {c0}", "width")
        w16 = fn.v(f"and i64 {width}, -16", "w16")
        ybytes = fn.v(f"shl i64 {hidden}, 2", "yrowb")

        def yrow(s: str) -> str:
            return fn.at(fn.gep("%y", fn.v(f"mul i64 {s}, {ybytes}", "yo")), 4, c0, "yr")

        with fn.loop("0", seq, hint="s") as s:
            fn.emit(f"call void @llvm.memset.p0.i64(ptr align 4 {yrow(s)}, i8 0, i64 "
                    f"{fn.v(f'shl i64 {width}, 2', 'wb')}, i1 false)")
        # A block-format down_t is in the rowplanes layout, as the decode kernel reads it: the
        # slice starts at block b0 of each plane; f32 / f16 rows at byte ``first``.
        planes = down_dtype in rowplanes.DTYPES
        b0, nblocks = fn.v(f"lshr i64 {c0}, 5", "b0"), fn.v(f"lshr i64 {hidden}, 5", "nblk")
        first = fn.v(f"mul i64 {c0}, {ELEMENT_BYTES[down_dtype]}", "co") if not planes else None
        # The live neurons, in order, then _GROUP at a time: their slices of down_t dequantised
        # side by side, and each token's row of Y loaded and stored once per group (not once per
        # neuron: with Y rows of 32 tokens out of L1, that traffic was most of the kernel).
        ids = fn.alloca_array("i32", n, "ids")
        count = fn.var("i64", "0", "nlive")
        with fn.loop("0", n, hint="i") as i, fn.if_(
                fn.v(f"icmp ne i8 {fn.load('i8', fn.gep(live, i), 1, 'lv')}, 0", "islive")):
            c = count.get("c")
            fn.store("i32", fn.v(f"trunc i64 {i} to i32", "i32"), fn.at(ids, 4, c), 4)
            count.set(fn.v(f"add i64 {c}, 1", "c1"))
        total = count.get("nlive")
        dbufs = fn.alloca_array(F32, fn.v(f"mul i64 {width}, {_GROUP}", "gw"), "dbufs")

        def group(k: str, size: int) -> None:
            """Neurons ids[k : k + size] into every token's row of Y."""
            neurons = [fn.sext(fn.load("i32", fn.at(ids, 4, fn.v(f"add i64 {k}, {g}", "kg")), 4, "nid"), "nid")
                       for g in range(size)]
            rows = [fn.at(dbufs, 4, fn.v(f"mul i64 {width}, {g}", "go"), "db") for g in range(size)]
            for i, buf in zip(neurons, rows, strict=True):
                drow = fn.gep("%down", fn.v(f"mul i64 {i}, {rb_down}", "do"), "dr")
                if planes:
                    rowplanes.emit_row_to_f32(fn, down_dtype, drow, nblocks, b0, buf, width, simd)
                else:
                    assert first is not None
                    emit_row_to_f32(fn, down_dtype, fn.gep(drow, first, "dr"), buf, width, simd)
            with fn.loop("0", seq, hint="s") as s:
                hs = [fn.load(F32, h_at(s, i), 4, "h") for i in neurons]
                nonzero = fn.v(f"fcmp one float {hs[0]}, 0.0", "nz")
                for h in hs[1:]:
                    nonzero = fn.v(f"or i1 {nonzero}, {fn.v(f'fcmp one float {h}, 0.0', 'nz')}", "nz")
                with fn.if_(nonzero):
                    y = yrow(s)
                    hvs = [fn.splat(16, h) for h in hs]
                    with fn.loop("0", w16, "16", "j") as j:
                        yp = fn.at(y, 4, j)
                        acc = fn.load(_V16, yp, 4, "y")
                        for hv, buf in zip(hvs, rows, strict=True):
                            acc = fn.fma(_V16, hv, fn.load(_V16, fn.at(buf, 4, j), 4, "d"), acc)
                        fn.store(_V16, acc, yp, 4)
                    with fn.loop(w16, width, hint="j") as j:
                        yp = fn.at(y, 4, j)
                        acc = fn.load(F32, yp, 4, "y")
                        for h, buf in zip(hs, rows, strict=True):
                            acc = fn.fma(F32, h, fn.load(F32, fn.at(buf, 4, j), 4, "d"), acc)
                        fn.store(F32, acc, yp, 4)

        groups_end = fn.v(f"and i64 {total}, {-_GROUP}", "gend")
        with fn.loop("0", groups_end, str(_GROUP), "k") as k:
            group(k, _GROUP)
        with fn.loop(groups_end, total, hint="k") as k:
            group(k, 1)
        with fn.if_(fn.v("icmp ne ptr %down_bias, null", "hasb")), fn.loop("0", seq, hint="s") as s:
            y = yrow(s)
            with fn.loop("0", width, hint="j") as j:
                yp = fn.at(y, 4, j)
                b = fn.load(F32, fn.at("%down_bias", 4, fn.v(f"add i64 {c0}, {j}", "cj")), 4, "b")
                fn.store(F32, fn.v(f"fadd float {fn.load(F32, yp, 4, 'y')}, {b}", "yb"), yp, 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, CHUNK_FFN_PARAMS, emit, chunk_ffn.__doc__ or "")
