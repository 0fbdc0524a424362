"""Causal grouped-query attention over an f32 KV cache (decode, and prefill chunks).

``q`` is [seq, n_heads * head_dim], ``k`` and ``v`` [seq, n_kv_heads * head_dim]; the caches are
[ctx, n_kv_heads * head_dim] f32. Row s is the token at position ``pos + s``. The kernel first
stores k and v into cache rows ``pos .. pos + seq - 1`` (threads split the copy), waits at the
barrier, then computes, for each (row s, query head h) of the thread's share, with
``g = h // (n_heads / n_kv_heads)`` and p = pos + s::

    score_j = (q[s, h] . kcache[j, g]) * scale      for lo <= j <= p  (lo = p - window + 1 if window)
    prob_j  = exp(score_j - max score) / sum exp(...)
    out[s, h] = sum_j prob_j * vcache[j, g]

as ``picc.interpreter.attention`` does (ALiBi is not supported here). The caller guarantees
``pos + seq <= ctx``.
"""

from __future__ import annotations

from functools import cache

from picc.codegen_cpu.irtext import F32, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_misc import vector_sum
from picc.codegen_cpu.rowops import emit_dots

V16 = vec(16)
ATTENTION_PARAMS = (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("kcache", "ptr"), ("vcache", "ptr"), ("out", "ptr"),
                    ("seq", "i32"), ("pos", "i32"), ("n_heads", "i32"), ("n_kv_heads", "i32"), ("head_dim", "i32"),
                    ("scale", "f32"), ("window", "i32"))


@cache
def attention() -> Kernel:
    """Store k / v in the cache at ``pos``, then causal softmax attention (see module doc);
    ``window`` = 0 means no sliding window."""
    symbol = "picc_attention"

    # The emitter is over 80 lines: its statements follow the kernel's loop nest (heads, cache
    # rows, softmax, the weighted sum of v) one to one, which splitting would hide.
    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, ATTENTION_PARAMS)
        seq, pos, heads, kv, hd = (fn.sext(f"%{n}") for n in ("seq", "pos", "n_heads", "n_kv_heads", "head_dim"))
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        width = fn.v(f"mul i64 {kv}, {hd}", "width")  # floats per cache row
        # -- phase 1: k, v -> cache rows pos.., threads copying 16-float aligned chunks
        c0, c1 = chunk_bounds(fn, fn.v(f"mul i64 {seq}, {width}", "tot"), tid, nthreads, align=16)
        cbytes = fn.v(f"shl i64 {fn.v(f'sub i64 {c1}, {c0}', 'cn')}, 2", "cb")
        dst0 = fn.v(f"add i64 {fn.v(f'mul i64 {pos}, {width}', 'pw')}, {c0}", "dst")
        for src, cache_ in (("%k", "%kcache"), ("%v", "%vcache")):
            fn.emit(f"call void @llvm.memcpy.p0.p0.i64(ptr align 4 {fn.at(cache_, 4, dst0)}, "
                    f"ptr align 4 {fn.at(src, 4, c0)}, i64 {cbytes}, i1 false)")
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # -- phase 2: (row, head) items
        group = fn.v(f"sdiv i64 {heads}, {kv}", "group")
        ctx = fn.v(f"add i64 {pos}, {seq}", "ctx")
        scores = fn.alloca_array(F32, ctx, "scores")
        lo, hi = chunk_bounds(fn, fn.v(f"mul i64 {seq}, {heads}", "items"), tid, nthreads)
        with fn.loop(lo, hi, hint="it") as it:
            s = fn.v(f"sdiv i64 {it}, {heads}", "s")
            h = fn.v(f"srem i64 {it}, {heads}", "h")
            p = fn.v(f"add i64 {pos}, {s}", "p")
            g = fn.v(f"sdiv i64 {h}, {group}", "g")
            win = fn.sext("%window")
            start = fn.var("i64", "0", "start")
            with fn.if_(fn.v(f"icmp sgt i64 {win}, 0", "haswin")):
                start.set(fn.max64("0", fn.v(f"add i64 {fn.v(f'sub i64 {p}, {win}', 'pw')}, 1", "ws")))
            j0 = start.get("j0")
            count = fn.v(f"sub i64 {fn.v(f'add i64 {p}, 1', 'p1')}, {j0}", "count")
            qrow = fn.at("%q", 4, fn.v(f"mul i64 {it}, {hd}", "qo"), "qrow")
            goff = fn.v(f"mul i64 {g}, {hd}", "goff")

            def cache_row(base: str, j: str) -> str:
                return fn.at(base, 4, fn.v(f"add i64 {fn.v(f'mul i64 {j}, {width}', 'jw')}, {goff}", "co"), "crow")

            # Scores four cached positions at a time: one pass over q for four K rows.
            count4 = fn.v(f"and i64 {count}, -4", "c4")
            with fn.loop("0", count4, "4", "j") as j:
                js = [j] + [fn.v(f"add i64 {j}, {t}", "jt") for t in range(1, 4)]
                krows = [("f32", cache_row("%kcache", fn.v(f"add i64 {j0}, {jt}", "jj"))) for jt in js]
                for jt, dot in zip(js, emit_dots(fn, krows, qrow, hd, simd), strict=True):
                    fn.store(F32, fn.v(f"fmul float {dot}, %scale", "sc"), fn.at(scores, 4, jt), 4)
            with fn.loop(count4, count, hint="j") as j:
                (dot,) = emit_dots(fn, [("f32", cache_row("%kcache", fn.v(f"add i64 {j0}, {j}", "jj")))],
                                   qrow, hd, simd)
                fn.store(F32, fn.v(f"fmul float {dot}, %scale", "sc"), fn.at(scores, 4, j), 4)
            top = fn.var(F32, fconst(float("-inf")), "top")
            with fn.loop("0", count, hint="j") as j:
                top.set(fn.v(f"call float @llvm.maxnum.f32(float {top.get()}, "
                             f"float {fn.load(F32, fn.at(scores, 4, j), 4, 'sc')})", "top"))
            m = top.get("m")
            with fn.loop("0", count, hint="j") as j:
                sp = fn.at(scores, 4, j)
                shifted = fn.v(f"fsub float {fn.load(F32, sp, 4, 'sc')}, {m}", "sm")
                e = fn.v(f"call float @picc_exp(float {shifted})", "e")
                fn.store(F32, e, sp, 4)
            total = vector_sum(fn, scores, count)
            with fn.loop("0", count, hint="j") as j:
                sp = fn.at(scores, 4, j)
                fn.store(F32, fn.v(f"fdiv float {fn.load(F32, sp, 4, 'e')}, {total}", "prob"), sp, 4)
            # out[s, h] = sum_j prob_j v_j: up to 64 features in registers per pass over the
            # positions (one broadcast of prob_j for all of them), then 16, then one at a time.
            orow = fn.at("%out", 4, fn.v(f"mul i64 {it}, {hd}", "oo"), "orow")
            d64 = fn.v(f"and i64 {hd}, -64", "d64")
            d16 = fn.v(f"and i64 {hd}, -16", "d16")
            for start, stop, vectors in (("0", d64, 4), (d64, d16, 1)):
                with fn.loop(start, stop, str(16 * vectors), "d") as d:
                    accs = [fn.var(V16, "zeroinitializer", "acc") for _ in range(vectors)]
                    with fn.loop("0", count, hint="j") as j:
                        vrow = cache_row("%vcache", fn.v(f"add i64 {j0}, {j}", "jj"))
                        pv = fn.splat(16, fn.load(F32, fn.at(scores, 4, j), 4, "prob"))
                        for w, acc in enumerate(accs):
                            vp = fn.at(vrow, 4, fn.v(f"add i64 {d}, {16 * w}", "dw"))
                            acc.set(fn.fma(V16, pv, fn.load(V16, vp, 4, "v"), acc.get()))
                    for w, acc in enumerate(accs):
                        fn.store(V16, acc.get(), fn.at(orow, 4, fn.v(f"add i64 {d}, {16 * w}", "dw")), 4)
            with fn.loop(d16, hd, hint="d") as d:
                acc1 = fn.var(F32, fconst(0.0), "acc")
                with fn.loop("0", count, hint="j") as j:
                    vrow = cache_row("%vcache", fn.v(f"add i64 {j0}, {j}", "jj"))
                    acc1.set(fn.fma(F32, fn.load(F32, fn.at(scores, 4, j), 4, "prob"),
                                    fn.load(F32, fn.at(vrow, 4, d), 4, "v"), acc1.get()))
                fn.store(F32, acc1.get(), fn.at(orow, 4, d), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, ATTENTION_PARAMS, emit, attention.__doc__ or "")
