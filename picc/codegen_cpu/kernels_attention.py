"""Causal grouped-query attention over an f32 or f16 KV cache (decode, and prefill chunks).

``q`` is [seq, n_heads * head_dim], ``k`` [seq, n_kv_heads * head_dim], ``v`` [seq, n_kv_heads *
v_head_dim] and ``out`` [seq, n_heads * v_head_dim] (``v_head_dim``: the op's, values narrower than
keys as DeepSeek's MLA has them, or head_dim); the caches are [n_kv_heads, ctx, head_dim] and
[n_kv_heads, ctx, v_head_dim] of f32 or f16 (the op's ``kv_format``): each KV head's rows follow
each other, so that a head's pass over the positions reads one stream. Row s is the token at
position ``pos + s``. The kernel first stores k and v into cache rows ``pos .. pos + seq - 1``
(threads split the copy), waits at the barrier, then computes, for each (row s, query head h)
of the thread's share, with ``g = h // (n_heads / n_kv_heads)`` and p = pos + s::

    score_j = (q[s, h] . kcache[j, g]) * scale      for lo <= j <= p  (lo = p - window + 1 if window)
    prob_j  = exp(score_j - max score) / sum exp(...)
    out[s, h] = sum_j prob_j * vcache[j, g]

as ``picc.interpreter.attention`` does (ALiBi is not supported here). The caller guarantees
``pos + seq <= ctx``. The ``_softcap`` variants take an argument ``softcap`` (f32) and score
``softcap * tanh(score_j / softcap)`` (Gemma 2). The ``_sinks`` variants take a last argument
``sinks``, a pointer to a logit per query head (f32 [n_heads], gpt-oss's attention sinks) that
joins the softmax without a value: the maximum starts at ``sinks[h]`` and the sum gains
``exp(sinks[h] - max)``.

:func:`attention_rows` is the decode step of a server's batch of sequences: row b is the token at
position ``positions[b]`` of its own sequence, whose caches the runtime's table of pointers gives.
Each (row, head) goes through the very emitter the one-row kernel's items go through
(:func:`_emit_head`), so a row's output is the one-sequence step's bit for bit; one call for the
batch keeps every thread busy on the batch's rows x heads items between one barrier, where a call
per row split each row's few heads between the threads (9 of them on two) and waited at a
barrier for each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_misc import vector_sum
from picc.codegen_cpu.rowformats import load_element, load_floats16
from picc.placement.memory_plan import KV_BYTES

V16 = vec(16)
ATTENTION_PARAMS = (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("kcache", "ptr"), ("vcache", "ptr"), ("out", "ptr"),
                    ("seq", "i32"), ("pos", "i32"), ("n_heads", "i32"), ("n_kv_heads", "i32"), ("head_dim", "i32"),
                    ("v_head_dim", "i32"), ("scale", "f32"), ("window", "i32"), ("ctx", "i32"))
# attention_rows: q, k, v and out rows ``row_stride`` bytes apart; row b's caches at the pointer
# ``kv + b * kv_stride`` (its k planes; its v planes ``ctx`` k cache rows of every KV head after
# them, ``v_head_dim`` elements a row), its position ``positions[b]`` (i32).
ATTENTION_ROWS_PARAMS = (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("kv", "ptr"), ("out", "ptr"),
                         ("batch", "i32"), ("positions", "ptr"), ("n_heads", "i32"), ("n_kv_heads", "i32"),
                         ("head_dim", "i32"), ("v_head_dim", "i32"), ("scale", "f32"), ("window", "i32"),
                         ("ctx", "i32"), ("row_stride", "i32"), ("kv_stride", "i32"))
SOFTCAP_PARAM = (("softcap", "f32"),)
SINKS_PARAM = (("sinks", "ptr"),)


@dataclass(frozen=True, slots=True)
class Shape:
    """The heads of a call (i64 values): query heads, KV heads, features a query or key head, a
    value or output head's, floats a k cache row, query heads a KV head serves."""

    heads: str
    kv: str
    hd: str
    vd: str
    width: str
    group: str


@cache
def attention(kv: str = "f32", softcap: bool = False, sinks: bool = False) -> Kernel:
    """Store k / v in the cache at ``pos``, then causal softmax attention (see module doc);
    ``window`` = 0 means no sliding window; ``kv``: what the caches hold (f32, or f16);
    ``softcap``: the scores soft-capped by an argument; ``sinks``: a sink logit per head."""
    symbol = names.cpu_attention(kv, softcap, sinks)
    params = ATTENTION_PARAMS + (SOFTCAP_PARAM if softcap else ()) + (SINKS_PARAM if sinks else ())

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, params)
        seq, pos = fn.sext("%seq"), fn.sext("%pos")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        shape, ctx = _shape(fn), fn.sext("%ctx")
        # -- phase 1: k, v -> row pos.. of each KV head's plane, threads splitting (token, KV head) items
        c0, c1 = chunk_bounds(fn, fn.v(f"mul i64 {seq}, {shape.kv}", "tot"), tid, nthreads)
        with fn.loop(c0, c1, hint="it") as it:
            s, g = fn.v(f"sdiv i64 {it}, {shape.kv}", "s"), fn.v(f"srem i64 {it}, {shape.kv}", "g")
            for k_or_v, cache_, dim in (("%k", "%kcache", shape.hd), ("%v", "%vcache", shape.vd)):
                src = fn.v(f"mul i64 {it}, {dim}", "so")  # token s's head g: [seq, n_kv, dim]
                _store(fn, kv, _plane_row(fn, kv, cache_, ctx, g, fn.v(f"add i64 {pos}, {s}", "ps"), dim),
                       fn.at(k_or_v, 4, src), dim)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # -- phase 2: (row, head) items
        scores = fn.alloca_array(F32, fn.v(f"add i64 {pos}, {seq}", "ctx"), "scores")
        lo, hi = chunk_bounds(fn, fn.v(f"mul i64 {seq}, {shape.heads}", "items"), tid, nthreads)
        one = fn.v(f"icmp eq i64 {seq}, 1", "one")  # a chunk's tokens read the rows one after another
        with fn.loop(lo, hi, hint="it") as it:
            p = fn.v(f"add i64 {pos}, {fn.v(f'sdiv i64 {it}, {shape.heads}', 's')}", "p")
            h = fn.v(f"srem i64 {it}, {shape.heads}", "h")
            qrow = fn.at("%q", 4, fn.v(f"mul i64 {it}, {shape.hd}", "qo"), "qrow")
            orow = fn.at("%out", 4, fn.v(f"mul i64 {it}, {shape.vd}", "oo"), "orow")
            _prefetch_next_group(fn, shape, it, h, hi, ctx, kv, lambda i: (pos, ("%kcache", "%vcache")), one)
            _emit_head(fn, shape, qrow, orow, h, p, ("%kcache", "%vcache"), ctx, scores, kv, softcap, sinks)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, attention.__doc__ or "")


@cache
def attention_rows(kv: str = "f32", softcap: bool = False, sinks: bool = False) -> Kernel:
    """:func:`attention` of ``batch`` rows, each a token of its own sequence (see module doc)."""
    symbol = names.cpu_attention(kv, softcap, sinks) + "_rows"
    params = ATTENTION_ROWS_PARAMS + (SOFTCAP_PARAM if softcap else ()) + (SINKS_PARAM if sinks else ())

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, params)
        batch, ctx, row_stride, kv_stride = (fn.sext(f"%{n}") for n in ("batch", "ctx", "row_stride", "kv_stride"))
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        shape = _shape(fn)
        row_bytes = fn.v(f"mul i64 {shape.width}, {KV_BYTES[kv]}", "rowb")  # a cache row's
        v_offset = fn.v(f"mul i64 {ctx}, {row_bytes}", "voff")  # bytes from a layer's k rows to its v rows

        def row_of(b: str) -> tuple[str, str, str]:
            """Row b's position (i64) and its sequence's caches of the layer (k rows, v rows)."""
            pos = fn.sext(fn.load("i32", fn.at("%positions", 4, b), 4, "pos"), "pos")
            kc = fn.load("ptr", fn.gep("%kv", fn.v(f"mul i64 {b}, {kv_stride}", "kvo")), 8, "kc")
            return pos, kc, fn.gep(kc, v_offset, "vc")

        # -- phase 1: each row's k, v -> its caches at its position, threads splitting the rows
        r0, r1 = chunk_bounds(fn, batch, tid, nthreads)
        with fn.loop(r0, r1, hint="b") as b:
            pos, kc, vc = row_of(b)
            at = fn.v(f"mul i64 {b}, {row_stride}", "ro")
            with fn.loop("0", shape.kv, hint="g") as g:
                for k_or_v, cache_, dim in (("%k", kc, shape.hd), ("%v", vc, shape.vd)):
                    _store(fn, kv, _plane_row(fn, kv, cache_, ctx, g, pos, dim), _head(fn, k_or_v, at, g, dim), dim)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # -- phase 2: (row, head) items, as the one-row kernel's
        scores = fn.alloca_array(F32, ctx, "scores")
        lo, hi = chunk_bounds(fn, fn.v(f"mul i64 {batch}, {shape.heads}", "items"), tid, nthreads)
        with fn.loop(lo, hi, hint="it") as it:
            b = fn.v(f"sdiv i64 {it}, {shape.heads}", "b")
            h = fn.v(f"srem i64 {it}, {shape.heads}", "h")
            pos, kc, vc = row_of(b)

            def next_item(i: str) -> tuple[str, tuple[str, str]]:  # item i's position and caches
                p2, kc2, vc2 = row_of(fn.v(f"sdiv i64 {i}, {shape.heads}", "b"))
                return p2, (kc2, vc2)

            _prefetch_next_group(fn, shape, it, h, hi, ctx, kv, next_item)
            at = fn.v(f"mul i64 {b}, {row_stride}", "ro")
            _emit_head(fn, shape, _head(fn, "%q", at, h, shape.hd), _head(fn, "%out", at, h, shape.vd), h, pos,
                       (kc, vc), ctx, scores, kv, softcap, sinks)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, attention_rows.__doc__ or "")


def _head(fn: Fn, base: str, at: str, h: str, dim: str) -> str:
    """Head ``h`` of ``dim`` floats (i64) of the row at byte ``at`` of ``base``."""
    head_bytes = fn.v(f"shl i64 {fn.v(f'mul i64 {h}, {dim}', 'ho')}, 2", "hb")
    return fn.gep(base, fn.v(f"add i64 {at}, {head_bytes}", "qo"))


def _prefetch_next_group(fn: Fn, shape: Shape, it: str, h: str, hi: str, ctx: str, kv: str,
                         item: Callable[[str], tuple[str, tuple[str, str]]], when: str = "true") -> None:
    """At the first query head of each KV head's group (items ``it`` with ``h`` a multiple of the
    group), ask for the cache rows of the thread's next group, item ``it + group``, if it is below
    ``hi`` and ``when`` (i1) holds (``item(i)``: item i's position and its layer's caches): k's
    and v's, into L2, while this group computes. A decode step reads each group's rows from
    memory once (the weights streamed since have evicted them), in short streams the hardware's
    prefetchers do not ramp up on: SmolLM2's batch step (8 rows near position 40, a profile of
    its calls, three alternating pairs) spent 763-811 us a step in attention against 909-919;
    prefetched into L1, or two groups ahead, no change."""
    within = fn.v(f"srem i64 {h}, {shape.group}", "hg")
    nxt = fn.v(f"add i64 {it}, {shape.group}", "nxt")
    first = fn.v(f"icmp eq i64 {within}, 0", "first")
    more = fn.v(f"and i1 {when}, {fn.v(f'icmp slt i64 {nxt}, {hi}', 'more')}", "more")
    with fn.if_(fn.v(f"and i1 {first}, {more}", "pf"), "pf"):
        p, caches = item(nxt)
        g = fn.v(f"sdiv i64 {fn.v(f'srem i64 {nxt}, {shape.heads}', 'h')}, {shape.group}", "g")
        j0, count = _window(fn, p)
        for cache_, dim in zip(caches, (shape.hd, shape.vd), strict=True):
            nbytes = fn.v(f"mul i64 {count}, {fn.v(f'mul i64 {dim}, {KV_BYTES[kv]}', 'rb')}", "pfb")
            start = _plane_row(fn, kv, cache_, ctx, g, j0, dim)
            with fn.loop("0", nbytes, "64", "pf") as off:
                line = fn.v(f"getelementptr i8, ptr {start}, i64 {off}", "pfp")
                fn.prefetch(line, "l2")


def _window(fn: Fn, p: str) -> tuple[str, str]:
    """The first cached position the item at position ``p`` attends to, and how many it attends
    to, through ``p`` (i64)."""
    win = fn.sext("%window")
    start = fn.var("i64", "0", "start")
    with fn.if_(fn.v(f"icmp sgt i64 {win}, 0", "haswin")):
        start.set(fn.max64("0", fn.v(f"add i64 {fn.v(f'sub i64 {p}, {win}', 'pw')}, 1", "ws")))
    j0 = start.get("j0")
    return j0, fn.v(f"sub i64 {fn.v(f'add i64 {p}, 1', 'p1')}, {j0}", "count")


def _shape(fn: Fn) -> Shape:
    heads, kv, hd, vd = (fn.sext(f"%{n}") for n in ("n_heads", "n_kv_heads", "head_dim", "v_head_dim"))
    return Shape(heads, kv, hd, vd, fn.v(f"mul i64 {kv}, {hd}", "width"), fn.v(f"sdiv i64 {heads}, {kv}", "group"))


def _plane_row(fn: Fn, kv: str, cache: str, ctx: str, g: str, j: str, dim: str) -> str:
    """Where row ``j`` of KV head ``g`` is in a layer's k (or v) cache: head g's plane of ``ctx``
    rows of ``dim`` elements (head_dim for k, v_head_dim for v), so that a head's rows follow each
    other in memory."""
    row = fn.v(f"add i64 {fn.v(f'mul i64 {g}, {ctx}', 'gc')}, {j}", "gj")
    return fn.at(cache, KV_BYTES[kv], fn.v(f"mul i64 {row}, {dim}", "crow"), "crow")


def _store(fn: Fn, kv: str, dst: str, src: str, count: str) -> None:
    """``count`` (i64) floats at ``src`` into the cache at ``dst``: copied (f32), or rounded to
    half precision, to nearest even as numpy rounds (f16)."""
    if kv == "f32":
        fn.emit(f"call void @llvm.memcpy.p0.p0.i64(ptr align 4 {dst}, ptr align 4 {src}, "
                f"i64 {fn.v(f'shl i64 {count}, 2', 'nb')}, i1 false)")
        return
    c16 = fn.v(f"and i64 {count}, -16", "c16")
    for ty, half, start, stop, step in ((V16, vec(16, "half"), "0", c16, "16"), (F32, "half", c16, count, "1")):
        with fn.loop(start, stop, step, "e") as e:
            value = fn.v(f"fptrunc {ty} {fn.load(ty, fn.at(src, 4, e), 4, 'x')} to {half}", "h")
            fn.store(half, value, fn.at(dst, 2, e), 2)


SCORE_BLOCK = 4
"""Cached positions scored together (then one at a time). SmolLM2's shape (9 heads of 64, 3 KV
heads, f16) at 450 positions, one thread, caches in L3, us a layer: 29 with 4, 31-33 with 2, 47
with 8 (on AVX-512, whose registers hold eight accumulators), 31 for the kernel before, which
summed each position's lanes on their own; in a decode step (caches from memory, `picc bench
--profile`, three alternating pairs) the step 3.82-3.86 against 3.94-4.11 ms."""


def _score_rows(fn: Fn, kv: str, rows: list[str], qrow: str, hd: str, out: str) -> None:
    """``out[t] = scale * (q . rows[t])`` for the cache rows ``rows`` (1, or a power of two up to 8).

    Each row's products go into 16 lanes over q's 16-element slices in order, fold to 8 (lane i
    plus lane i + 8), then sum by adjacent pairs (0+1, 2+3, ..), three times, and any elements
    past the last whole slice follow in order. The rows' pair sums are taken together, a shuffle
    of two vectors at a time (the lanes of rows 2i and 2i + 1 in one vector), so summing a row
    costs ~3 vector operations where a horizontal sum of its own took ~8; a row's sum is the same
    whichever rows it is scored with."""
    hd16 = fn.v(f"and i64 {hd}, -16", "hd16")
    accs = [fn.var(V16, "zeroinitializer", "sacc") for _ in rows]
    with fn.loop("0", hd16, "16", "d") as d:
        qv = fn.load(V16, fn.at(qrow, 4, d), 4, "q")
        for acc, row in zip(accs, rows, strict=True):
            acc.set(fn.fma(V16, load_floats16(fn, kv, row, d), qv, acc.get("sacc")))
    lo8, hi8 = ("<" + ", ".join(f"i32 {i + o}" for i in range(8)) + ">" for o in (0, 8))
    parts = [fn.v(f"fadd {vec(8)} {fn.v(f'shufflevector {V16} {v}, {V16} poison, <8 x i32> {lo8}', 'lo')}, "
                  f"{fn.v(f'shufflevector {V16} {v}, {V16} poison, <8 x i32> {hi8}', 'hi')}", "fold")
             for v in (acc.get("sacc") for acc in accs)]
    lanes, width = 8, 8  # lanes a vector of parts holds; lanes a row still spans
    while width > 1:
        if len(parts) > 1:  # two vectors' adjacent pairs into one
            parts = [_pair_sums(fn, parts[i], parts[i + 1], lanes) for i in range(0, len(parts), 2)]
        else:
            parts, lanes = [_pair_sums(fn, parts[0], None, lanes)], lanes // 2
        width //= 2
    sums = parts[0]
    fn.store(vec(lanes), sums, out, 4)
    with fn.loop(hd16, hd, hint="d") as d:  # the elements past the last 16-element slice, in order
        qd = fn.load(F32, fn.at(qrow, 4, d), 4, "qd")
        for t, row in enumerate(rows):
            at = fn.at(out, 4, str(t)) if t else out
            fn.store(F32, fn.fma(F32, load_element(fn, kv, row, d), qd, fn.load(F32, at, 4, "s")), at, 4)
    got = fn.load(vec(lanes), out, 4, "s")
    fn.store(vec(lanes), fn.v(f"fmul {vec(lanes)} {got}, {fn.splat(lanes, '%scale')}", "sc"), out, 4)


def _pair_sums(fn: Fn, a: str, b: str | None, lanes: int) -> str:
    """Lanes ``2i`` plus ``2i + 1`` of ``a`` then ``b`` (``lanes`` each): ``lanes`` lanes, or
    ``lanes / 2`` from ``a`` alone."""
    n = 2 * lanes if b is not None else lanes
    other = b if b is not None else "poison"
    even, odd = ("<" + ", ".join(f"i32 {2 * i + o}" for i in range(n // 2)) + ">" for o in (0, 1))
    pick = [fn.v(f"shufflevector {vec(lanes)} {a}, {vec(lanes)} {other}, <{n // 2} x i32> {m}", "pr")
            for m in (even, odd)]
    return fn.v(f"fadd {vec(n // 2)} {pick[0]}, {pick[1]}", "ps")


# The emitter is over 60 lines: its statements follow the loop nest of one (row, head) item (cache
# rows, softmax, the weighted sum of v) one to one, which splitting would hide.
def _emit_head(fn: Fn, shape: Shape, qrow: str, orow: str, h: str, p: str,
               caches: tuple[str, str], ctx: str, scores: str, kv: str, softcap: bool, sinks: bool) -> None:
    """``orow`` = the attention of query head ``h`` (``qrow``) at position ``p`` over the cache
    rows up to p (``caches``: the layer's k rows and v rows, ``p + 1`` at least, of ``kv``
    elements) as the module doc says, with ``scores`` (p + 1 floats) for the probabilities;
    ``softcap``: the scores capped by ``%softcap`` (divided, tanh, multiplied, as transformers
    orders it) as the maximum is taken; ``sinks``: head h's sink ``%sinks[h]`` in the maximum
    and, after the scores' sum, in the denominator (the interpreter's order)."""
    kcache, vcache = caches
    hd, vd = shape.hd, shape.vd
    g = fn.v(f"sdiv i64 {h}, {shape.group}", "g")
    j0, count = _window(fn, p)

    def cache_row(base: str, j: str, dim: str) -> str:
        return _plane_row(fn, kv, base, ctx, g, j, dim)

    # Scores SCORE_BLOCK cached positions at a time, then one at a time: the same bits either way.
    countb = fn.v(f"and i64 {count}, {-SCORE_BLOCK}", "cb")
    for lo, stop, n in (("0", countb, SCORE_BLOCK), (countb, count, 1)):
        with fn.loop(lo, stop, str(n), "j") as j:
            rows = [cache_row(kcache, fn.v(f"add i64 {j0}, {fn.v(f'add i64 {j}, {t}', 'jt')}", "jj"), hd)
                    for t in range(n)]
            _score_rows(fn, kv, rows, qrow, hd, fn.at(scores, 4, j, "sp"))
    sink = fn.load(F32, fn.at("%sinks", 4, h, "sinkp"), 4, "sink") if sinks else None
    top = fn.var(F32, sink or fconst(float("-inf")), "top")
    with fn.loop("0", count, hint="j") as j:
        score = fn.load(F32, fn.at(scores, 4, j), 4, "sc")
        if softcap:
            t = fn.v(f"call float @picc_tanh(float {fn.v(f'fdiv float {score}, %softcap', 'sd')})", "th")
            score = fn.v(f"fmul float {t}, %softcap", "capped")
            fn.store(F32, score, fn.at(scores, 4, j), 4)
        top.set(fn.v(f"call float @llvm.maxnum.f32(float {top.get()}, float {score})", "top"))
    m = top.get("m")
    with fn.loop("0", count, hint="j") as j:
        sp = fn.at(scores, 4, j)
        shifted = fn.v(f"fsub float {fn.load(F32, sp, 4, 'sc')}, {m}", "sm")
        e = fn.v(f"call float @picc_exp(float {shifted})", "e")
        fn.store(F32, e, sp, 4)
    total = vector_sum(fn, scores, count)
    if sink is not None:
        sunk = fn.v(f"call float @picc_exp(float {fn.v(f'fsub float {sink}, {m}', 'sm')})", "se")
        total = fn.v(f"fadd float {total}, {sunk}", "total")
    with fn.loop("0", count, hint="j") as j:
        sp = fn.at(scores, 4, j)
        fn.store(F32, fn.v(f"fdiv float {fn.load(F32, sp, 4, 'e')}, {total}", "prob"), sp, 4)
    # out = sum_j prob_j v_j: up to 64 features in registers per pass over the positions (one
    # broadcast of prob_j for all of them), then 16, then one at a time.
    d64 = fn.v(f"and i64 {vd}, -64", "d64")
    d16 = fn.v(f"and i64 {vd}, -16", "d16")
    for lo, stop, vectors in (("0", d64, 4), (d64, d16, 1)):
        with fn.loop(lo, stop, str(16 * vectors), "d") as d:
            accs = [fn.var(V16, "zeroinitializer", "acc") for _ in range(vectors)]
            with fn.loop("0", count, hint="j") as j:
                vrow = cache_row(vcache, fn.v(f"add i64 {j0}, {j}", "jj"), vd)
                pv = fn.splat(16, fn.load(F32, fn.at(scores, 4, j), 4, "prob"))
                for w, acc in enumerate(accs):
                    vw = load_floats16(fn, kv, vrow, fn.v(f"add i64 {d}, {16 * w}", "dw"))
                    acc.set(fn.fma(V16, pv, vw, acc.get()))
            for w, acc in enumerate(accs):
                fn.store(V16, acc.get(), fn.at(orow, 4, fn.v(f"add i64 {d}, {16 * w}", "dw")), 4)
    with fn.loop(d16, vd, hint="d") as d:
        acc1 = fn.var(F32, fconst(0.0), "acc")
        with fn.loop("0", count, hint="j") as j:
            vrow = cache_row(vcache, fn.v(f"add i64 {j0}, {j}", "jj"), vd)
            acc1.set(fn.fma(F32, fn.load(F32, fn.at(scores, 4, j), 4, "prob"),
                            load_element(fn, kv, vrow, d), acc1.get()))
        fn.store(F32, acc1.get(), fn.at(orow, 4, d), 4)
