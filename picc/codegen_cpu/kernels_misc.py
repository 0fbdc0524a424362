"""Small kernels of a decoder step: norms, rotary embedding, heads joined, residual add, activations, argmax.

Semantics follow ``picc.interpreter`` (the numpy oracle) operation for operation: RMSNorm is
``x / sqrt(mean(x^2) + eps) * w``; LayerNorm ``(x - mean) / sqrt(var + eps) * w + b``; rotary
embedding rotates ``(a, b) -> (a cos - b sin, b cos + a sin)`` at angle ``pos * inv_freq[i]``
computed in float32, pairing feature i with i + rotary_dim/2 (``llama``) or 2i with 2i + 1
(``gptj``); joined heads are ``[a_h | b_h]`` (copies). Row-wise kernels split rows (``seq``) over
threads; elementwise ones split elements.
"""

from __future__ import annotations

from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.ffn_emitter import emit_h, ffn_form
from picc.codegen_cpu.int16x import emit_round_x
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.errors import PiccError
from picc.quant import INT_X_MAX

V16 = vec(16)

NORM_PARAMS = (("x", "ptr"), ("weight", "ptr"), ("bias", "ptr"), ("out", "ptr"), ("seq", "i32"), ("n", "i32"),
               ("eps", "f32"))
ROPE_PARAMS = (("x", "ptr"), ("cos", "ptr"), ("sin", "ptr"), ("seq", "i32"), ("pos", "i32"), ("n_heads", "i32"),
               ("head_dim", "i32"), ("rotary_dim", "i32"))
CONCAT_HEADS_PARAMS = (("a", "ptr"), ("b", "ptr"), ("out", "ptr"), ("seq", "i32"), ("n_heads", "i32"),
                       ("a_dim", "i32"), ("b_dim", "i32"), ("a_heads", "i32"), ("b_heads", "i32"))
BINARY_PARAMS = (("a", "ptr"), ("b", "ptr"), ("out", "ptr"), ("n", "i32"))
ARGMAX_PARAMS = (("x", "ptr"), ("out", "ptr"), ("n", "i32"))
ROUND_PARAMS = (("x", "ptr"), ("out", "ptr"), ("seq", "i32"), ("n", "i32"))


def vector_sum(fn: Fn, base: str, n: str, term: str | None = None) -> str:
    """``sum_j f(base[j])`` for j < n (i64) with f the identity, or ``(x - c)^2`` / ``x^2``.

    ``term``: None sums x, ``"sq"`` sums x*x, any other value c sums (x - c)^2. Sixteen lanes in
    a fixed order, then the tail: the same on every SIMD level.
    """
    def f(ty: str, x: str, c: str | None) -> str:
        if term is None:
            return x
        if term != "sq":
            x = fn.v(f"fsub {ty} {x}, {c}", "dx")
        return fn.v(f"fmul {ty} {x}, {x}", "sq")

    n16 = fn.v(f"and i64 {n}, -16", "n16")
    cv = fn.splat(16, term) if term not in (None, "sq") else None
    acc = fn.var(V16, "zeroinitializer", "acc")
    with fn.loop("0", n16, "16", "j") as j:
        acc.set(fn.v(f"fadd {V16} {acc.get()}, {f(V16, fn.load(V16, fn.at(base, 4, j), 4, 'x'), cv)}", "acc"))
    total = fn.var(F32, fn.hsum(16, acc.get()), "sum")
    with fn.loop(n16, n, "1", "j") as j:
        total.set(fn.v(f"fadd float {total.get()}, {f(F32, fn.load(F32, fn.at(base, 4, j), 4, 'x'), term)}", "sum"))
    return total.get()


def rows_or_parts(fn: Fn, seq: str, parts: str, align: int = 1,
                  may: str = "true") -> tuple[tuple[str, str], tuple[str, str]]:
    """A thread's rows ``[lo, hi)`` of ``seq`` and parts ``[p0, p1)`` of each row's ``parts``
    (i64): the rows split between the threads where there are as many as threads, else (and
    ``may``, an i1) every thread takes every row and a share of its parts (``align``-aligned).
    A decode step's one row had one thread normalise (or rotate) it while the others waited at
    the barrier after it (SmolLM2: 55 us a token of waiting after its 61 norms)."""
    tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
    by_rows = fn.v(f"or i1 {fn.v(f'icmp sge i64 {seq}, {nthreads}', 'many')}, {fn.v(f'xor i1 {may}, true', 'not')}",
                   "byrows")
    rows, split = chunk_bounds(fn, seq, tid, nthreads), chunk_bounds(fn, parts, tid, nthreads, align=align)
    lo, hi = (fn.v(f"select i1 {by_rows}, i64 {r}, i64 {w}", "rb") for r, w in zip(rows, ("0", seq), strict=True))
    p0, p1 = (fn.v(f"select i1 {by_rows}, i64 {w}, i64 {p}", "pb") for w, p in zip(("0", parts), split, strict=True))
    return (lo, hi), (p0, p1)


def _norm(kind: str, grouped: bool = False) -> Kernel:
    symbol = names.cpu_norm(kind, grouped)
    params = (*NORM_PARAMS, ("group", "i32")) if grouped else NORM_PARAMS

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, params)
        seq, n = fn.sext("%seq"), fn.sext("%n")
        if grouped:  # each row's runs of group elements are rows of their own, back to back
            group = fn.sext("%group")
            seq = fn.v(f"mul i64 {seq}, {fn.v(f'sdiv i64 {n}, {group}', 'runs')}", "gseq")
            n = group
        nf = fn.v(f"sitofp i64 {n} to float", "nf")
        apart = fn.v("icmp ne ptr %x, %out", "apart")  # in place, a thread's writes would meet another's reads
        (lo, hi), (e0, e1) = rows_or_parts(fn, seq, n, 16, apart)
        with fn.loop(lo, hi, hint="s") as s:
            off = fn.v(f"mul i64 {s}, {fn.v(f'shl i64 {n}, 2', 'rb')}", "off")
            x, out = fn.gep("%x", off, "xr"), fn.gep("%out", off, "or")
            if kind == "rms_norm":
                center = None
                ms = fn.v(f"fdiv float {vector_sum(fn, x, n, 'sq')}, {nf}", "ms")
            else:
                center = fn.v(f"fdiv float {vector_sum(fn, x, n)}, {nf}", "mean")
                ms = fn.v(f"fdiv float {vector_sum(fn, x, n, center)}, {nf}", "var")
            denom = fn.v(f"call float @llvm.sqrt.f32(float {fn.v(f'fadd float {ms}, %eps', 'mse')})", "den")
            has_bias = fn.v("icmp ne ptr %bias, null", "hasb")
            with fn.loop(e0, e1, hint="j") as j:
                v = fn.load(F32, fn.at(x, 4, j), 4, "x")
                if center is not None:
                    v = fn.v(f"fsub float {v}, {center}", "xc")
                v = fn.v(f"fmul float {fn.v(f'fdiv float {v}, {denom}', 'xn')}, "
                         f"{fn.load(F32, fn.at('%weight', 4, j), 4, 'w')}", "y")
                y = fn.var(F32, v, "y")
                with fn.if_(has_bias):
                    y.set(fn.v(f"fadd float {y.get()}, {fn.load(F32, fn.at('%bias', 4, j), 4, 'b')}", "yb"))
                fn.store(F32, y.get(), fn.at(out, 4, j), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, token_split=True)


@cache
def rms_norm(grouped: bool = False) -> Kernel:
    """``out[s] = x[s] / sqrt(mean(x[s]^2) + eps) * weight (+ bias)`` per row (f32; bias may be null);
    ``grouped``: a last argument ``group``, and each run of ``group`` elements of a row normalised
    on its own with ``weight`` [group] (Qwen3's q and k norms, a head at a time)."""
    return _norm("rms_norm", grouped)


@cache
def layer_norm() -> Kernel:
    """``out[s] = (x[s] - mean) / sqrt(var + eps) * weight + bias`` per row (bias may be null)."""
    return _norm("layer_norm")


@cache
def rope(style: str) -> Kernel:
    """Rotary embedding of ``x[seq, n_heads * head_dim]`` in place, row s at position ``pos + s``.

    ``cos`` and ``sin`` are f32 tables [positions, rotary_dim / 2] (``picc.interpreter.rope_cos_sin``), row
    ``pos + s`` is used: the angles' cosines and sines are computed once, at compile time, as the
    interpreter computes them, instead of 2 x rotary_dim / 2 C-library calls per rope and token
    (the q rope and the k rope of each layer, on one thread). q and k of the same token can be
    rotated in one call when they are adjacent in memory (n_heads = q heads + k heads).
    """
    if style not in ("llama", "gptj"):
        raise PiccError(f"codegen_cpu: rope style {style!r} is not one of llama, gptj")
    symbol = names.cpu_rope(style)

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, ROPE_PARAMS)
        seq, heads, hd, rot = (fn.sext(f"%{n}") for n in ("seq", "n_heads", "head_dim", "rotary_dim"))
        half = fn.v(f"lshr i64 {rot}, 1", "half")
        width = fn.v(f"mul i64 {heads}, {hd}", "width")
        (lo, hi), (h0, h1) = rows_or_parts(fn, seq, heads)
        with fn.loop(lo, hi, hint="s") as s:
            p = fn.v(f"add i64 {fn.sext('%pos')}, {s}", "p")
            row = fn.gep("%x", fn.v(f"mul i64 {s}, {fn.v(f'shl i64 {width}, 2', 'rb')}", "ro"), "xr")
            with fn.loop("0", half, hint="i") as i:
                t = fn.v(f"add i64 {fn.v(f'mul i64 {p}, {half}', 'tp')}, {i}", "ti")
                c, sn = fn.load(F32, fn.at("%cos", 4, t), 4, "cos"), fn.load(F32, fn.at("%sin", 4, t), 4, "sin")
                if style == "llama":
                    ia, ib = i, fn.v(f"add i64 {i}, {half}", "ib")
                else:
                    ia = fn.v(f"shl i64 {i}, 1", "ia")
                    ib = fn.v(f"add i64 {ia}, 1", "ib")
                with fn.loop(h0, h1, hint="h") as h:
                    base = fn.v(f"mul i64 {h}, {hd}", "hb")
                    pa = fn.at(row, 4, fn.v(f"add i64 {base}, {ia}", "ja"))
                    pb = fn.at(row, 4, fn.v(f"add i64 {base}, {ib}", "jb"))
                    a, b = fn.load(F32, pa, 4, "a"), fn.load(F32, pb, 4, "b")
                    ac, bs = fn.v(f"fmul float {a}, {c}", "ac"), fn.v(f"fmul float {b}, {sn}", "bs")
                    bc, as_ = fn.v(f"fmul float {b}, {c}", "bc"), fn.v(f"fmul float {a}, {sn}", "as")
                    ra = fn.v(f"fsub float {ac}, {bs}", "ra")
                    rb = fn.v(f"fadd float {bc}, {as_}", "rb")
                    fn.store(F32, ra, pa, 4)
                    fn.store(F32, rb, pb, 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, ROPE_PARAMS, emit, rope.__doc__ or "", token_split=True)


@cache
def concat_heads() -> Kernel:
    """``out[s]``'s head h (of ``n_heads``) = ``[a[s]'s head h | b[s]'s head h]``, ``a_dim +
    b_dim`` floats: ``a`` has ``a_heads`` heads of ``a_dim`` a row, 1 (the head every head takes)
    or ``n_heads``, likewise ``b``; rows back to back, out apart from both. The threads split the
    rows, or a row's heads where there are fewer rows than threads (a decode step's one row)."""
    symbol = names.cpu_concat_heads()

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, CONCAT_HEADS_PARAMS)
        seq, heads, a_dim, b_dim = (fn.sext(f"%{n}") for n in ("seq", "n_heads", "a_dim", "b_dim"))
        a_bytes, b_bytes = fn.v(f"shl i64 {a_dim}, 2", "abytes"), fn.v(f"shl i64 {b_dim}, 2", "bbytes")
        head_bytes = fn.v(f"add i64 {a_bytes}, {b_bytes}", "hbytes")
        # Bytes from one of an operand's heads to the next: none where its one head serves every head.
        steps = [fn.v(f"select i1 {fn.v(f'icmp eq i32 %{n}, 1', 'one')}, i64 0, i64 {nbytes}", "step")
                 for n, nbytes in (("a_heads", a_bytes), ("b_heads", b_bytes))]
        rows = [fn.v(f"mul i64 {fn.sext(f'%{n}')}, {nbytes}", "row")
                for n, nbytes in (("a_heads", a_bytes), ("b_heads", b_bytes))]
        out_row = fn.v(f"mul i64 {heads}, {head_bytes}", "orow")
        (lo, hi), (h0, h1) = rows_or_parts(fn, seq, heads)
        with fn.loop(lo, hi, hint="s") as s:
            a_row, b_row, o_row = (fn.gep(base, fn.v(f"mul i64 {s}, {size}", "ro"), "r")
                                   for base, size in (("%a", rows[0]), ("%b", rows[1]), ("%out", out_row)))
            with fn.loop(h0, h1, hint="h") as h:
                dst = fn.gep(o_row, fn.v(f"mul i64 {h}, {head_bytes}", "ho"), "dst")
                for src_row, step, nbytes, at in ((a_row, steps[0], a_bytes, dst),
                                                  (b_row, steps[1], b_bytes, fn.gep(dst, a_bytes, "dstb"))):
                    src = fn.gep(src_row, fn.v(f"mul i64 {h}, {step}", "so"), "src")
                    fn.emit(f"call void @llvm.memcpy.p0.p0.i64(ptr align 4 {at}, ptr align 4 {src}, "
                            f"i64 {nbytes}, i1 false)")
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, CONCAT_HEADS_PARAMS, emit, concat_heads.__doc__ or "", token_split=True)


def _elementwise(symbol: str, combine: str) -> Kernel:
    """``out[j] = combine(a[j], b[j])`` split over threads in 16-float chunks; ``combine`` is a
    format string over ``{ty} {a} {b}`` producing one instruction (or a call for scalars)."""

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, BINARY_PARAMS)
        lo, hi = chunk_bounds(fn, fn.sext("%n"), fn.sext("%tid"), fn.sext("%nthreads"), align=16)
        width = fn.v(f"sub i64 {hi}, {lo}", "w")
        n16 = fn.v(f"add i64 {lo}, {fn.v(f'and i64 {width}, -16', 'w16')}", "n16")
        for ty, start, stop, step in ((V16, lo, n16, "16"), (F32, n16, hi, "1")):
            with fn.loop(start, stop, step, "j") as j:
                a, b = fn.load(ty, fn.at("%a", 4, j), 4, "a"), fn.load(ty, fn.at("%b", 4, j), 4, "b")
                fn.store(ty, fn.v(combine.format(ty=ty, a=a, b=b), "r"), fn.at("%out", 4, j), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, BINARY_PARAMS, emit)


@cache
def round_x(x_format: str = "i16") -> Kernel:
    """``out = x`` rounded as the ``_xi16`` / ``_xi8`` kernels read it (``picc.quant.round_x_blocks``):
    ``seq`` rows of ``n`` floats (n a multiple of 32), back to back; threads split the blocks.
    The prefill program's GEMMs read it where the step's kernels dot rounded x."""
    if x_format not in INT_X_MAX:
        raise PiccError(f"codegen_cpu: x is rounded to one of {', '.join(INT_X_MAX)}, not {x_format!r}")
    symbol = names.cpu_elementwise(f"round_x{x_format}")

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, ROUND_PARAMS)
        seq, n = fn.sext("%seq"), fn.sext("%n")
        blocks = fn.v(f"lshr i64 {fn.v(f'mul i64 {seq}, {n}', 'all')}, 5", "nblk")
        lo, hi = chunk_bounds(fn, blocks, fn.sext("%tid"), fn.sext("%nthreads"))
        emit_round_x(fn, "%x", "%out", lo, hi, x_format)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, ROUND_PARAMS, emit, round_x.__doc__ or "")


@cache
def add() -> Kernel:
    """``out[j] = a[j] + b[j]`` for j < n (f32; out may be a or b): the residual add."""
    return _elementwise(names.cpu_elementwise("add"), "fadd {ty} {a}, {b}")


@cache
def mul() -> Kernel:
    """``out[j] = a[j] * b[j]`` for j < n (f32)."""
    return _elementwise(names.cpu_elementwise("mul"), "fmul {ty} {a}, {b}")


MERGE_PARAMS = (("a", "ptr"), ("b", "ptr"), ("bias", "ptr"), ("out", "ptr"), ("n", "i32"))


@cache
def merge() -> Kernel:
    """``out[j] = a[j] + b[j] (+ bias[j])`` (bias may be null): a split FFN layer's partial sums."""
    symbol = names.cpu_elementwise("merge")

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, MERGE_PARAMS)
        lo, hi = chunk_bounds(fn, fn.sext("%n"), fn.sext("%tid"), fn.sext("%nthreads"), align=16)
        has_bias = fn.v("icmp ne ptr %bias, null", "hasb")
        with fn.loop(lo, hi, hint="j") as j:
            a, b = fn.load(F32, fn.at("%a", 4, j), 4, "a"), fn.load(F32, fn.at("%b", 4, j), 4, "b")
            total = fn.var(F32, fn.v(f"fadd float {a}, {b}", "ab"), "sum")
            with fn.if_(has_bias):
                total.set(fn.v(f"fadd float {total.get()}, {fn.load(F32, fn.at('%bias', 4, j), 4, 'c')}", "abc"))
            fn.store(F32, total.get(), fn.at("%out", 4, j), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, MERGE_PARAMS, emit, merge.__doc__ or "")


SOFTCAP_PARAMS = (("x", "ptr"), ("out", "ptr"), ("n", "i32"), ("cap", "f32"))


@cache
def softcap() -> Kernel:
    """``out[j] = cap * tanh(x[j] / cap)`` for j < n (out may be x): Gemma 2's capped logits;
    threads split the elements."""
    symbol = names.cpu_elementwise("softcap")

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, SOFTCAP_PARAMS)
        lo, hi = chunk_bounds(fn, fn.sext("%n"), fn.sext("%tid"), fn.sext("%nthreads"), align=16)
        with fn.loop(lo, hi, hint="j") as j:
            scaled = fn.v(f"fdiv float {fn.load(F32, fn.at('%x', 4, j), 4, 'x')}, %cap", "xs")
            t = fn.v(f"call float @picc_tanh(float {scaled})", "t")
            fn.store(F32, fn.v(f"fmul float {t}, %cap", "y"), fn.at("%out", 4, j), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, SOFTCAP_PARAMS, emit, softcap.__doc__ or "")


@cache
def ffn_activation(form: str) -> Kernel:
    """``out[j] = h`` of FFN ``form`` from ``a = gate[j]`` and ``b = up[j]`` (``act(b)`` for the
    ungated forms, where ``a`` is ignored): the dense FFN's middle in prefill."""
    spec = ffn_form(form)
    symbol = f"picc_ffn_act_{form}"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, BINARY_PARAMS)
        lo, hi = chunk_bounds(fn, fn.sext("%n"), fn.sext("%tid"), fn.sext("%nthreads"), align=16)
        act = f"@picc_act_{spec.act}"
        with fn.loop(lo, hi, hint="j") as j:
            u = fn.load(F32, fn.at("%b", 4, j), 4, "u")
            a = fn.v(f"call float {act}(float {fn.load(F32, fn.at('%a', 4, j), 4, 'g')})", "ag") if spec.gated else None
            fn.store(F32, emit_h(fn, spec, a, u), fn.at("%out", 4, j), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, BINARY_PARAMS, emit, ffn_activation.__doc__ or "")


@cache
def argmax() -> Kernel:
    """``out[0] = `` the first index of the largest of ``x[0:n]`` (thread 0 only; NaNs ignored).

    The maximum in four independent 16-lane chains (one chain waited on its own latency), the
    first index holding it 16 elements to a compare (it was one scalar compare and branch an
    element): SmolLM2's 49152 logits 17.9 -> 5.3 us on this Zen 4. A maximum is the same whatever
    order it is taken in, and so is the first index holding it. In a batch step the rows go to
    the threads whole (``token_split``): thread 0 alone took all eight rows' argmax while the
    other waited."""
    symbol = "picc_argmax"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, ARGMAX_PARAMS)
        n = fn.sext("%n")
        with fn.if_(fn.v("icmp eq i32 %tid, 0", "t0")):
            m = _maximum(fn, n)
            n16 = fn.v(f"and i64 {n}, -16", "n16")
            found = fn.var("i64", n, "found")
            j = fn.var("i64", "0", "j")
            scan, body, hit, tail, done = (fn.label(h) for h in ("scan", "scan16", "hit", "tail", "found"))
            fn.br(scan)
            fn.start(scan)
            at = j.get("j")
            fn.cbr(fn.v(f"icmp sge i64 {at}, {n16}", "end16"), tail, body)
            fn.start(body)
            eq = fn.v(f"fcmp oeq {V16} {fn.load(V16, fn.at('%x', 4, at), 4, 'x')}, {fn.splat(16, m)}", "eq")
            bits = fn.v(f"zext i16 {fn.v(f'bitcast <16 x i1> {eq} to i16', 'eqb')} to i32", "eqw")
            j.set(fn.v(f"add i64 {at}, 16", "j16"))
            fn.cbr(fn.v(f"icmp ne i32 {bits}, 0", "any"), hit, scan)
            fn.start(hit)
            first = fn.v(f"zext i32 {fn.v(f'call i32 @llvm.cttz.i32(i32 {bits}, i1 true)', 'tz')} to i64", "tz")
            found.set(fn.v(f"add i64 {at}, {first}", "at"))
            fn.br(done)
            fn.start(tail)
            with fn.loop(n16, n, hint="k") as k:  # the first k with x[k] == m, if found is still n
                eq = fn.v(f"fcmp oeq float {fn.load(F32, fn.at('%x', 4, k), 4, 'x')}, {m}", "eq")
                now = found.get("f")
                first = fn.v(f"and i1 {eq}, {fn.v(f'icmp eq i64 {now}, {n}', 'unset')}", "first")
                found.set(fn.v(f"select i1 {first}, i64 {k}, i64 {now}", "f"))
            fn.br(done)
            fn.start(done)
            idx = fn.var("i64", found.get(), "idx")
            with fn.if_(fn.v(f"icmp sge i64 {idx.get()}, {n}", "none")):
                idx.set("0")
            fn.store("i32", fn.v(f"trunc i64 {idx.get()} to i32", "i32"), "%out", 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, ARGMAX_PARAMS, emit, argmax.__doc__ or "", token_split=True)


def _maximum(fn: Fn, n: str) -> str:
    """The largest of ``x[0:n]`` (maxnum: NaNs ignored; -inf for none), four 16-lane chains at a time."""
    n64, n16 = fn.v(f"and i64 {n}, -64", "n64"), fn.v(f"and i64 {n}, -16", "n16")
    ninf = fn.splat(16, fconst(float("-inf")))
    chains = [fn.var(V16, ninf, "best") for _ in range(4)]

    def most(a: str, b: str) -> str:
        return fn.v(f"call {V16} @llvm.maxnum.v16f32({V16} {a}, {V16} {b})", "best")

    with fn.loop("0", n64, "64", "j") as j:
        for c, chain in enumerate(chains):
            chain.set(most(chain.get(), fn.load(V16, fn.at("%x", 4, fn.v(f"add i64 {j}, {16 * c}", "jc")), 4, "x")))
    best = fn.var(V16, most(most(chains[0].get(), chains[1].get()), most(chains[2].get(), chains[3].get())), "best")
    with fn.loop(n64, n16, "16", "j") as j:
        best.set(most(best.get(), fn.load(V16, fn.at("%x", 4, j), 4, "x")))
    top = fn.var(F32, fn.v(f"call float @llvm.vector.reduce.fmax.v16f32({V16} {best.get()})", "top"), "top")
    with fn.loop(n16, n, hint="j") as j:
        top.set(fn.v(f"call float @llvm.maxnum.f32(float {top.get()}, float {fn.load(F32, fn.at('%x', 4, j), 4, 'x')})",
                     "top"))
    return top.get("m")
