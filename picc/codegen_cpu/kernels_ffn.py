"""The fused sparse FFN of one device partition, and the activity predictor.

``sparse_ffn`` computes ``y = sum_i h_i down_t[i, :] (+ down_bias)`` over the active neurons i
of ``n`` (with ``accumulate``, adds it to y: a residual add in the same call), where ``h_i`` is
the form's activation of ``up[i] . x`` (and ``gate[i] . x``); the down projection is stored
neuron-major (``down_t[n, hidden]``, row i = neuron i's column of down), so each active neuron
is one AXPY; a down projection in a block format (q8_0, q4_0, q4_1) is in the rowplanes layout
(:mod:`picc.codegen_cpu.rowplanes`: each row's scales, then its quants). With ``interleaved``
weights, up and gate rows alternate (one ``up_gate`` matrix [n, 2, hidden]: the caller passes it
as ``up`` and, one row later, as ``gate``; its biases likewise), so an active neuron's two rows
are one contiguous stream. How the active set is known (``mode``):

* ``predictor``: the neurons whose byte in ``mask[0:n]`` is nonzero (from :func:`predictor`; a
  part of a split layer gets the mask from its first neuron on).
* ``dense``: every neuron.
* ``gate-first``: ``act(gate[i] . x + gate_bias[i])`` for all rows; active where its magnitude
  exceeds ``threshold`` (dReLU: where ``|h_i|`` does); up and down rows of the others are skipped.
* ``down-only``: gate and up for all rows; down rows skipped where ``|h_i| <= threshold``.

Phases (each thread, barriers between): [sparse modes: rows ``n*t/T..`` of the mask (of the
dense projections first, in gate-first / down-only mode), compacting the active rows of each
chunk; then every thread takes its share of the concatenated list] -> for its share of active
neurons, two at a time: the gathered dot products, ``h``, and the AXPY into the thread's own f32
buffer (prefetching the rows of a later pair; 4-bit rows go eight neurons at a time first, their
blocks transposed in registers to the rows8 form) -> barrier -> each thread sums the T buffers over its
share of the columns into ``y`` (fixed order: deterministic).
Neurons whose ``h`` is exactly 0 are not added (an exact skip that over-predicted ReLU rows earn).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu import rowplanes
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowops import (
    NIBBLE_DTYPES,
    IntX,
    check_dtype,
    emit_add_block_consts,
    emit_axpys,
    emit_dots,
    emit_int_x,
    emit_row_bytes,
    emit_tiled_rows,
    emit_x_sums,
    prefetch_block,
    zero_floats,
)
from picc.codegen_cpu.rows8 import (
    GROUP,
    ScaledX,
    emit_gathered8_dots,
    emit_group_bytes,
    emit_rows8,
    emit_scaled_x,
)
from picc.errors import PiccError
from picc.ir.ops import FFN_FORMS, FfnForm

FORMS = FFN_FORMS  # how each FFN form combines its projections: the IR's own table
MODES = ("predictor", "dense", "gate-first", "down-only")

FFN_PARAMS = (("x", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("up_bias", "ptr"),
              ("gate_bias", "ptr"), ("down_bias", "ptr"), ("y", "ptr"), ("mask", "ptr"), ("count", "ptr"),
              ("scratch", "ptr"), ("n", "i32"), ("hidden", "i32"), ("threshold", "f32"), ("score_scale", "ptr"),
              ("accumulate", "i32"))
PREDICT_PARAMS = (("x", "ptr"), ("fc1", "ptr"), ("b1", "ptr"), ("fc2t", "ptr"), ("b2", "ptr"), ("mask", "ptr"),
                  ("scratch", "ptr"), ("hidden", "i32"), ("rank", "i32"), ("n", "i32"), ("threshold", "f32"))
_LINE = 64
# Rows are prefetched this many pairs of neurons ahead: a pair of gathered rows is computed in less
# than a memory round trip. Measured with bench/kernels.py (1 thread, SmolLM2 shape): 1 pair is
# worse; 2, 4 and 8 are within noise of each other (4 slightly ahead for q4_0).
_AHEAD = 4
_V16 = vec(16)


def _round(nbytes: int) -> int:
    return -(-nbytes // _LINE) * _LINE


def ffn_scratch_bytes(n: int, hidden: int, nthreads: int) -> int:
    """Bytes of the ``scratch`` buffer :func:`sparse_ffn` needs (any mode) for ``nthreads`` threads."""
    return nthreads * _round(4 * hidden) + 3 * _round(4 * n) + nthreads * _LINE


def predictor_scratch_bytes(rank: int) -> int:
    """Bytes of the ``scratch`` buffer :func:`predictor` needs."""
    return _round(4 * rank)


def _round_ir(fn: Fn, nbytes: str) -> str:
    return fn.v(f"and i64 {fn.v(f'add i64 {nbytes}, {_LINE - 1}', 'rb')}, {-_LINE}", "r64")


def _if_given(fn: Fn, op: str, value: str, vector: str, i: str, stride: int = 1, ty: str = F32) -> str:
    """``value <op> vector[stride * i]`` (``ty`` elements: a float, or a span of floats from there),
    or ``value`` when the optional ``vector`` is null."""
    out = fn.var(ty, value, "vg")
    with fn.if_(fn.v(f"icmp ne ptr {vector}, null", "given")):
        out.set(fn.v(f"{op} {ty} {out.get()}, {fn.load(ty, fn.at(vector, 4 * stride, i), 4, 'e')}", "ve"))
    return out.get()


def plus_bias(fn: Fn, value: str, bias: str, i: str, stride: int = 1) -> str:
    """``value + bias[stride * i]``, or ``value`` when ``bias`` is null."""
    return _if_given(fn, "fadd", value, bias, i, stride)


def times_scale(fn: Fn, value: str, i: str, ty: str = F32) -> str:
    """``value * score_scale[i]`` (a gate-first layer's per-neuron score scale; ``ty`` a vector type:
    the span from i), or ``value`` when the layer has none (a null ``%score_scale``)."""
    return _if_given(fn, "fmul", value, "%score_scale", i, ty=ty)


def _abs(fn: Fn, v: str) -> str:
    return fn.v(f"call float @llvm.fabs.f32(float {v})", "abs")


def _counts_total(fn: Fn, cnt: str, upto: str) -> str:
    """``sum(cnt[s] for s < upto)`` (each count on its own cache line)."""
    total = fn.var("i64", "0", "tot")
    with fn.loop("0", upto, hint="s") as s:
        c = fn.sext(fn.load("i32", fn.at(cnt, _LINE, s), 4, "c"))
        total.set(fn.v(f"add i64 {total.get()}, {c}", "tot"))
    return total.get()


_SPAN = 32  # rows whose keep bits _compact takes at once (one i32)


def _compact(fn: Fn, lo: str, seg: str, cnt: str, tid: str, rows: tuple[str, str], keep: Callable[[str], str],
             keep_span: Callable[[str], str]) -> None:
    """For r in rows: when ``keep(r)`` (an i1) holds, append r to ``seg[lo:]``; then cnt[tid].

    ``keep_span(r)`` is the i32 whose bit j is ``keep(r + j)``, from vector compares: the rows go
    ``_SPAN`` at a time, visiting only the set bits (count trailing zeros, clear the lowest), so
    the cost follows the kept rows and no branch depends on a single row (a row-by-row loop
    mispredicted its branch on every few rows of a 10-70% active mask)."""
    start, stop = rows
    c = fn.var("i64", "0", "c")

    def append(r: str) -> None:
        cur = c.get()
        fn.store("i32", fn.v(f"trunc i64 {r} to i32", "r32"), fn.at(seg, 4, fn.v(f"add i64 {lo}, {cur}", "sp")), 4)
        c.set(fn.v(f"add i64 {cur}, 1", "c1"))

    span = fn.v(f"sub i64 {stop}, {start}", "span")
    whole = fn.v(f"add i64 {start}, {fn.v(f'and i64 {span}, {-_SPAN}', 'spans')}", "whole")
    with fn.loop(start, whole, str(_SPAN), "r") as r:
        bits = fn.var("i32", keep_span(r), "bits")
        head, body, done = fn.label("bit.head"), fn.label("bit.body"), fn.label("bit.done")
        fn.br(head)
        fn.start(head)
        w = bits.get("w")
        fn.cbr(fn.v(f"icmp ne i32 {w}, 0", "any"), body, done)
        fn.start(body)
        b = fn.v(f"zext i32 {fn.v(f'call i32 @llvm.cttz.i32(i32 {w}, i1 true)', 'tz')} to i64", "b")
        append(fn.v(f"add i64 {r}, {b}", "rb"))
        bits.set(fn.v(f"and i32 {w}, {fn.v(f'sub i32 {w}, 1', 'wm1')}", "rest"))
        fn.br(head)
        fn.start(done)
    with fn.loop(whole, stop, hint="r") as r, fn.if_(keep(r)):
        append(r)
    fn.store("i32", fn.v(f"trunc i64 {c.get()} to i32", "c32"), fn.at(cnt, _LINE, tid), 4)


def _gather_share(fn: Fn, seg: str, cnt: str, lst: str, n: str, nthreads: str, k0: str, k1: str,
                  align: int = 1) -> None:
    """Write ``lst[k0:k1]`` of the concatenation of each chunk's compacted rows (chunk s:
    ``seg[lo_s:]``, ``lo_s`` its ``chunk_bounds(n, s, T, align)``)."""
    base = fn.var("i64", "0", "base")
    with fn.loop("0", nthreads, hint="s") as s:
        start = fn.v(f"sdiv i64 {fn.v(f'mul i64 {n}, {s}', 'ns')}, {nthreads}", "segs")
        if align > 1:
            start = fn.v(f"and i64 {start}, {-align}", "segs")
        b = base.get()
        c = fn.sext(fn.load("i32", fn.at(cnt, _LINE, s), 4, "c"))
        end = fn.v(f"add i64 {b}, {c}", "end")
        with fn.loop(fn.max64(k0, b), fn.min64(k1, end), hint="j") as j:
            src = fn.v(f"add i64 {start}, {fn.v(f'sub i64 {j}, {b}', 'jo')}", "src")
            fn.store("i32", fn.load("i32", fn.at(seg, 4, src), 4, "nid"), fn.at(lst, 4, j), 4)
        base.set(end)


def _reduce(fn: Fn, ybufs: str, ystride: str, y: str, bias: str, hidden: str, tid: str, nthreads: str) -> None:
    """``y[j] = (accumulate ? y[j] : 0) + ((ybuf_0[j] + ... + ybuf_{T-1}[j]) (+ bias[j]))`` for this
    thread's columns (``%accumulate``: the residual add done here, the same bits as a separate add)."""
    c0, c1 = chunk_bounds(fn, hidden, tid, nthreads, align=16)
    width = fn.v(f"sub i64 {c1}, {c0}", "w")
    c16 = fn.v(f"add i64 {c0}, {fn.v(f'and i64 {width}, -16', 'w16')}", "c16")
    has_bias = fn.v(f"icmp ne ptr {bias}, null", "hasb")
    for ty, lo, hi, step in ((_V16, c0, c16, "16"), (F32, c16, c1, "1")):
        with fn.loop(lo, hi, step, "j") as j:
            off = fn.v(f"shl i64 {j}, 2", "jo")
            s = fn.var(ty, "zeroinitializer" if ty == _V16 else fconst(0.0), "s")
            with fn.loop("0", nthreads, hint="t") as t:
                p = fn.gep(fn.gep(ybufs, fn.v(f"mul i64 {t}, {ystride}", "to")), off)
                s.set(fn.v(f"fadd {ty} {s.get()}, {fn.load(ty, p, 4, 'yt')}", "s"))
            with fn.if_(has_bias):
                s.set(fn.v(f"fadd {ty} {s.get()}, {fn.load(ty, fn.gep(bias, off), 4, 'b')}", "sb"))
            yp = fn.gep(y, off, "yp")
            with fn.if_(fn.v("icmp ne i32 %accumulate, 0", "acc")):
                s.set(fn.v(f"fadd {ty} {fn.load(ty, yp, 4, 'old')}, {s.get()}", "sa"))
            fn.store(ty, s.get(), yp, 4)


def check_ffn_kernel(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
                     interleaved: bool, dense_rows8: bool = False) -> FfnForm:
    """The form's spec, after checking that a fused FFN kernel of these parameters makes sense."""
    if mode not in MODES:
        raise PiccError(f"codegen_cpu: FFN mode {mode!r} is not one of {', '.join(MODES)}")
    if form not in FORMS:
        raise PiccError(f"codegen_cpu: FFN form {form!r} is not one of {', '.join(FORMS)}")
    spec = FORMS[form]
    if spec.gated != (gate_dtype is not None):
        raise PiccError(f"codegen_cpu: FFN form {form!r} {'needs' if spec.gated else 'takes no'} gate weights")
    if mode == "gate-first" and not spec.gated:
        raise PiccError(f"codegen_cpu: FFN mode 'gate-first' needs a gated form, got {form!r}")
    for d in (up_dtype, gate_dtype or "f32", down_dtype):
        check_dtype(d)
    if interleaved and (not spec.gated or gate_dtype != up_dtype or mode == "gate-first"):
        raise PiccError(f"codegen_cpu: interleaved up/gate rows need a gated form, one format and a mode that "
                        f"gathers both rows, got {form!r} {mode!r}")
    whole = names.read_whole(mode, up_dtype, gate_dtype)
    if dense_rows8 and not (whole and set(whole) <= NIBBLE_DTYPES):
        raise PiccError(f"codegen_cpu: matrices in the rows8 layout need gate-first or down-only mode, whose whole "
                        f"matrices are q4_0 / q4_1, got {mode!r} with {up_dtype} up and {gate_dtype} gate")
    return spec


@cache
def sparse_ffn(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
               interleaved: bool = False, int_dots: bool = False, dense_rows8: bool = False) -> Kernel:
    """The fused FFN kernel of ``mode`` and ``form`` for the given weight formats (see module doc).

    ``int_dots``: 4-bit up and gate rows (the dense GEMV part of gate-first and down-only, and
    the gathered rows) dot x rounded to int16 per block (``rowops.emit_int_x``), as the ``_xi16``
    GEMVs do; the down AXPY reads ``h`` as is. ``dense_rows8`` (gate-first or down-only, n a
    multiple of 8): the matrices the mode reads whole (the gate; the gate and up), 4-bit, are in
    the rows8 layout and their dense projections go eight rows at a time (``rows8.emit_rows8``;
    threads split n at multiples of 8).

    ``scratch`` holds :func:`ffn_scratch_bytes` bytes. In the sparse modes ``count`` (when not
    null) receives the number of active neurons (for dReLU in gate-first mode, of those whose gate
    passed, before ``|h| > threshold`` is checked). ``mask`` is read in predictor mode only.
    """
    spec = check_ffn_kernel(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
    symbol = names.cpu_fused_ffn(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, int_dots, dense_rows8)
    int_dots = names.ffn_rounds_x(int_dots, up_dtype, gate_dtype)  # only where 4-bit rows are dotted
    act = f"@picc_act_{spec.act}"
    bias_stride = 2 if interleaved else 1

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, FFN_PARAMS)
        n, hidden = fn.sext("%n"), fn.sext("%hidden")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        rb_up, rb_down = emit_row_bytes(fn, up_dtype, hidden), emit_row_bytes(fn, down_dtype, hidden)
        rb_gate = emit_row_bytes(fn, gate_dtype, hidden) if gate_dtype else None
        if interleaved:  # neuron i's up row, then its gate row: each matrix steps two rows at a time
            rb_up = rb_gate = fn.v(f"shl i64 {rb_up}, 1", "rb2")
        ystride = _round_ir(fn, fn.v(f"shl i64 {hidden}, 2", "yb"))
        nbytes = _round_ir(fn, fn.v(f"shl i64 {n}, 2", "nb"))
        ybuf = fn.gep("%scratch", fn.v(f"mul i64 {tid}, {ystride}", "yo"), "ybuf")
        vals = fn.gep("%scratch", fn.v(f"mul i64 {nthreads}, {ystride}", "vo"), "vals")
        seg = fn.gep(vals, nbytes, "seg")
        lst = fn.gep(seg, nbytes, "lst")
        cnt = fn.gep(lst, nbytes, "cnt")
        zero_floats(fn, ybuf, hidden)
        dotted_dtypes = {up_dtype, gate_dtype or up_dtype}
        intx = emit_int_x(fn, "%x", hidden, dotted_dtypes) if int_dots else None
        xsums = None if intx is not None else emit_x_sums(fn, "%x", hidden, dotted_dtypes)
        # 4-bit rows gathered and dotted go eight neurons at a time (see below). They and the
        # matrices read whole from the rows8 layout take x in the form the rows8 dot products
        # read (scaled floats, or int16 split into bytes), made once for both.
        gathered = {up_dtype} | ({gate_dtype} if mode in ("predictor", "dense") and gate_dtype else set())
        octets = mode != "down-only" and gathered <= NIBBLE_DTYPES
        rows8_dtypes = (gathered if octets else set()) | set(names.read_whole(mode, up_dtype, gate_dtype)
                                                             if dense_rows8 else ())
        x8: IntX | ScaledX | None = None
        if rows8_dtypes:
            x8 = emit_scaled_x(fn, "%x", hidden) if intx is None else emit_int_x(fn, "%x", hidden, rows8_dtypes,
                                                                                  rows8=True)
        consts = None  # the 4-bit down rows' per-block constant terms (see emit_axpys)
        coefs: list[str] = []  # the scaled block scales of the rowplanes down rows of one AXPY call
        if down_dtype in rowplanes.DTYPES:
            nblk = fn.v(f"lshr i64 {hidden}, 5", "nblk")
            coefs = [fn.alloca_array(F32, nblk, "coef") for _ in range(2)]
            if down_dtype in NIBBLE_DTYPES:
                consts = fn.alloca_array(F32, nblk, "consts")
                zero_floats(fn, consts, nblk)

        def row(mat: str, rb: str, i: str) -> str:
            return fn.gep(mat, fn.v(f"mul i64 {i}, {rb}", "ro"), "row")

        def gate_act(i: str, g: str) -> str:
            """act(gate[i] . x + gate_bias[i]) from the dot product ``g``."""
            return fn.v(f"call float {act}(float {plus_bias(fn, g, '%gate_bias', i, bias_stride)})", "a")

        def combine(a: str | None, u: str) -> str:
            """h from act(gate) (None when not gated) and the up projection."""
            if a is None:
                return fn.v(f"call float {act}(float {u})", "h")
            if spec.act_on_up:
                u = fn.v(f"call float {act}(float {u})", "au")
            return fn.v(f"fmul float {a}, {u}", "h")

        # -- the active list: (list pointer or None for identity, total count)
        thr = "%threshold"
        if mode == "dense":
            listp, total = None, n
        else:
            lo, hi = chunk_bounds(fn, n, tid, nthreads, align=GROUP if dense_rows8 else 1)
            if mode != "predictor":
                # The dense projections of this thread's rows first, as a GEMV (rows in tiles that
                # share x, the next tiles prefetched): vals[r] = act(g) (gate-first) or h.
                dense = [(gate_dtype, "%gate", rb_gate)] if spec.gated else []
                if mode == "down-only":
                    dense.append((up_dtype, "%up", rb_up))

                def score(r: str, dots: list[str]) -> None:
                    a = gate_act(r, dots[0]) if spec.gated else None
                    value = a if mode == "gate-first" else combine(a, plus_bias(fn, dots[-1], "%up_bias", r,
                                                                                  bias_stride))
                    fn.store(F32, value, fn.at(vals, 4, r), 4)

                if dense_rows8:
                    whole = [(dt, base, emit_group_bytes(fn, dt, hidden)) for dt, base, _ in dense]
                    assert x8 is not None
                    glo, ghi = fn.v(f"lshr i64 {lo}, 3", "glo"), fn.v(f"lshr i64 {hi}, 3", "ghi")
                    emit_rows8(fn, whole, x8, hidden, glo, ghi, score)
                else:
                    emit_tiled_rows(fn, dense, "%x", hidden, lo, hi, simd, score, xsums,  # type: ignore[arg-type]
                                    intx=intx)

            # dReLU's gate-first score is |h|, decided after up; relu(g) = 0 already means h = 0.
            cut = fconst(0.0) if mode == "gate-first" and spec.act_on_up else thr

            def keep(r: str) -> str:
                if mode == "predictor":
                    return fn.v(f"icmp ne i8 {fn.load('i8', fn.gep('%mask', r), 1, 'm')}, 0", "keep")
                v = _abs(fn, fn.load(F32, fn.at(vals, 4, r), 4, "v"))
                if mode == "gate-first" and not spec.act_on_up:
                    v = times_scale(fn, v, r)
                return fn.v(f"fcmp ogt float {v}, {cut}", "keep")

            def keep_span(r: str) -> str:
                if mode == "predictor":
                    m = fn.load(vec(_SPAN, "i8"), fn.gep("%mask", r), 1, "ms")
                    hit = fn.v(f"icmp ne {vec(_SPAN, 'i8')} {m}, zeroinitializer", "keeps")
                else:
                    v = fn.load(vec(_SPAN), fn.at(vals, 4, r), 4, "vs")
                    a = fn.v(f"call {vec(_SPAN)} @llvm.fabs.v32f32({vec(_SPAN)} {v})", "abss")
                    if mode == "gate-first" and not spec.act_on_up:
                        a = times_scale(fn, a, r, vec(_SPAN))
                    hit = fn.v(f"fcmp ogt {vec(_SPAN)} {a}, {fn.splat(_SPAN, cut)}", "keeps")
                return fn.v(f"bitcast {vec(_SPAN, 'i1')} {hit} to i32", "bits")

            _compact(fn, lo, seg, cnt, tid, (lo, hi), keep, keep_span)
            fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
            total = _counts_total(fn, cnt, nthreads)
            with fn.if_(fn.v(f"icmp eq i64 {tid}, 0", "t0")), fn.if_(fn.v("icmp ne ptr %count, null", "hc")):
                fn.store("i32", fn.v(f"trunc i64 {total} to i32", "tot32"), "%count", 4)
            listp = lst

        k0, k1 = chunk_bounds(fn, total, tid, nthreads)
        if listp == lst:
            _gather_share(fn, seg, cnt, lst, n, nthreads, k0, k1, GROUP if dense_rows8 else 1)

        def neuron(k: str) -> str:
            if listp is None:
                return k
            return fn.sext(fn.load("i32", fn.at(listp, 4, k), 4, "nid"), "nid")

        # Matrices whose rows each active neuron reads in the gather phase (dot products).
        dotted = [] if mode == "down-only" else [("%up", up_dtype, rb_up)]
        if mode in ("predictor", "dense") and gate_dtype is not None and rb_gate is not None:
            dotted.append(("%gate", gate_dtype, rb_gate))

        def h_values(ids: list[str], ahead: list[str] | None) -> list[str]:
            """h of each neuron in ``ids``, prefetching the dotted rows of ``ahead``."""
            if mode == "down-only":
                return [fn.load(F32, fn.at(vals, 4, i), 4, "h") for i in ids]
            rows = [(dt, row(mat, rb, i)) for i in ids for mat, dt, rb in dotted]
            pf = [(dt, row(mat, rb, i)) for i in ahead or [] for mat, dt, rb in dotted]
            return h_from(ids, emit_dots(fn, rows, "%x", hidden, simd, pf, xsums, intx))

        def h_from(ids: list[str], dots: list[str]) -> list[str]:
            """h of each neuron in ``ids`` from its dot products (up, then gate when dotted)."""
            sums = iter(dots)
            hs = []
            for i in ids:
                u = plus_bias(fn, next(sums), "%up_bias", i, bias_stride)
                if mode == "gate-first":
                    a: str | None = fn.load(F32, fn.at(vals, 4, i), 4, "a")
                else:
                    a = gate_act(i, next(sums)) if spec.gated else None
                h = combine(a, u)
                if mode == "gate-first" and spec.act_on_up:  # dReLU: active when |h| (scaled) > threshold
                    score = times_scale(fn, _abs(fn, h), i)
                    h = fn.v(f"select i1 {fn.v(f'fcmp ogt float {score}, {thr}', 'live')}, "
                             f"float {h}, float 0.0", "h")
                hs.append(h)
            return hs

        def accumulate(ids: list[str], hs: list[str], ahead: list[str] | None) -> None:
            """ybuf += sum h_i down_t[i] (skipped when every h is 0), prefetching ``ahead``'s rows."""
            live = fn.v(f"fcmp one float {hs[0]}, 0.0", "live")
            for h in hs[1:]:
                live = fn.v(f"or i1 {live}, {fn.v(f'fcmp one float {h}, 0.0', 'nz')}", "live")
            with fn.if_(live):
                rows = [(down_dtype, row("%down", rb_down, i), h) for i, h in zip(ids, hs, strict=True)]
                pf = [(down_dtype, row("%down", rb_down, i)) for i in ahead or []]
                if coefs:
                    rowplanes.emit_axpys(fn, rows, ybuf, hidden, simd, coefs, consts, pf)
                else:
                    emit_axpys(fn, rows, ybuf, hidden, simd, pf)

        # Neurons go in pairs: two rows of each matrix in flight, one pass over ybuf per pair,
        # and the rows of the next pair prefetched along the way (gathered rows defeat the
        # hardware prefetcher; contiguous ones, in dense mode, do not need it).
        span = fn.v(f"sub i64 {k1}, {k0}", "span")
        last = fn.v(f"sub i64 {k1}, 1", "last")
        if octets:
            # Eight neurons at a time first: each dotted matrix's eight rows transposed block by
            # block and dotted as a rows8 group (rows8.emit_gathered8_dots), the next eight's rows
            # prefetched along; then the AXPYs in pairs. The rest go in pairs below.
            assert x8 is not None
            oct_end = fn.v(f"add i64 {k0}, {fn.v(f'and i64 {span}, -{GROUP}', 'oct')}", "oend")
            with fn.loop(k0, oct_end, str(GROUP), "k") as k:
                ids = [neuron(fn.v(f"add i64 {k}, {u}", "ku") if u else k) for u in range(GROUP)]
                nxt = None
                if listp is not None:
                    nxt = [neuron(fn.min64(fn.v(f"add i64 {k}, {GROUP + u}", "kn"), last)) for u in range(GROUP)]

                def prefetch(b: str, nxt: list[str] | None = nxt) -> None:
                    for i in nxt or []:
                        for mat, dt, rb in dotted:
                            prefetch_block(fn, dt, row(mat, rb, i), b)

                vectors = emit_gathered8_dots(fn, [(dt, [row(mat, rb, i) for i in ids]) for mat, dt, rb in dotted],
                                              x8, hidden, prefetch)
                dots = [fn.v(f"extractelement {vec(GROUP)} {v}, i64 {u}", "dot") for u in range(GROUP) for v in vectors]
                hs = h_from(ids, dots)
                for u in range(0, GROUP, 2):
                    accumulate(ids[u:u + 2], hs[u:u + 2], nxt[u:u + 2] if nxt else None)
            pairs_start = oct_end
        else:
            pairs_start = k0
        span = fn.v(f"sub i64 {k1}, {pairs_start}", "span")
        pairs_end = fn.v(f"add i64 {pairs_start}, {fn.v(f'and i64 {span}, -2', 'even')}", "pend")
        with fn.loop(pairs_start, pairs_end, "2", "k") as k:
            ids = [neuron(k), neuron(fn.v(f"add i64 {k}, 1", "k1"))]
            ahead = None
            if listp is not None:
                ahead = [neuron(fn.min64(fn.v(f"add i64 {k}, {d}", "kd"), last)) for d in (2 * _AHEAD, 2 * _AHEAD + 1)]
            accumulate(ids, h_values(ids, ahead), ahead)
        with fn.loop(pairs_end, k1, hint="k") as k:
            ids = [neuron(k)]
            accumulate(ids, h_values(ids, None), None)
        if consts is not None:
            emit_add_block_consts(fn, ybuf, consts, hidden)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        _reduce(fn, fn.gep("%scratch", "0"), ystride, "%y", "%down_bias", hidden, tid, nthreads)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, FFN_PARAMS, emit, sparse_ffn.__doc__ or "")


@cache
def predictor(fc1_dtype: str, fc2_dtype: str) -> Kernel:
    """``mask[i] = sum_r relu(fc1 x + b1)[r] fc2t[r, i] + b2[i] > threshold`` as one byte per neuron.

    fc1 is [rank, hidden]; ``fc2t`` is the predictor's fc2 transposed, [rank, n] (the lowering
    stores it so: a row of fc2 is only ``rank`` long, and a dot product that short spends as much
    on its horizontal sum as on its products). Biases may be null. ``scratch`` holds
    :func:`predictor_scratch_bytes` bytes (the hidden layer). Threads split fc1's rows, meet at the
    barrier, then split the n outputs, 64 at a time in registers, adding ``h[r] fc2t[r]`` for the
    rows r where h (after the ReLU) is not zero (listed once per thread, in order).
    """
    for d in (fc1_dtype, fc2_dtype):
        if d not in ("f32", "f16"):
            raise PiccError(f"codegen_cpu: predictor weights must be f32 or f16, got {d!r}")
    symbol = names.cpu_predictor(fc1_dtype, fc2_dtype)
    size = 4 if fc2_dtype == "f32" else 2

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, PREDICT_PARAMS)
        hidden, rank, n = fn.sext("%hidden"), fn.sext("%rank"), fn.sext("%n")
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        hid = fn.gep("%scratch", "0", "hid")
        rb1 = emit_row_bytes(fn, fc1_dtype, hidden)
        lo, hi = chunk_bounds(fn, rank, tid, nthreads)
        with fn.loop(lo, hi, hint="r") as r:
            (d,) = emit_dots(fn, [(fc1_dtype, fn.gep("%fc1", fn.v(f"mul i64 {r}, {rb1}", "ro")))], "%x", hidden, simd)
            fn.store(F32, fn.v(f"call float @picc_act_relu(float {plus_bias(fn, d, '%b1', r)})", "hr"),
                     fn.at(hid, 4, r), 4)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # The hidden units after the ReLU that are not zero, listed once (branch-free appends):
        # a test of h[r] per rank and per output chunk mispredicted on about half of them.
        live = fn.alloca_array("i32", rank, "live")
        count = fn.var("i64", "0", "nlive")
        with fn.loop("0", rank, hint="r") as r:
            c = count.get()
            fn.store("i32", fn.v(f"trunc i64 {r} to i32", "r32"), fn.at(live, 4, c), 4)
            nz = fn.v(f"fcmp one float {fn.load(F32, fn.at(hid, 4, r), 4, 'h')}, 0.0", "nz")
            count.set(fn.v(f"add i64 {c}, {fn.v(f'zext i1 {nz} to i64', 'nz64')}", "c1"))
        nlive = count.get()
        c0, c1 = chunk_bounds(fn, n, tid, nthreads, align=16)
        w = fn.v(f"sub i64 {c1}, {c0}", "w")
        c64 = fn.v(f"add i64 {c0}, {fn.v(f'and i64 {w}, -64', 'w64')}", "c64")
        c16 = fn.v(f"add i64 {c0}, {fn.v(f'and i64 {w}, -16', 'w16')}", "c16")

        def outputs(first: str, lanes: int, count: int) -> None:
            """Outputs ``first ..`` : ``count`` vectors of ``lanes`` accumulated over the rank."""
            ty = vec(lanes) if lanes > 1 else F32
            wty = (vec(lanes, "half") if lanes > 1 else "half") if size == 2 else ty
            offs = [fn.v(f"add i64 {first}, {lanes * q}", "cq") for q in range(count)]
            accs = [fn.var(ty, "zeroinitializer" if lanes > 1 else fconst(0.0), "acc") for _ in offs]
            with fn.loop("0", nlive, hint="k") as k:
                r = fn.sext(fn.load("i32", fn.at(live, 4, k), 4, "r"), "r")
                h = fn.load(F32, fn.at(hid, 4, r), 4, "h")
                hv = fn.splat(lanes, h) if lanes > 1 else h
                row = fn.gep("%fc2t", fn.v(f"mul i64 {r}, {fn.v(f'mul i64 {n}, {size}', 'rb')}", "ro"))
                for acc, c in zip(accs, offs, strict=True):
                    wv = fn.load(wty, fn.at(row, size, c), size, "w")
                    if size == 2:
                        wv = fn.v(f"fpext {wty} {wv} to {ty}", "wf")
                    acc.set(fn.fma(ty, hv, wv, acc.get()))
            thr = fn.splat(lanes, "%threshold") if lanes > 1 else "%threshold"
            bytes_ty = vec(lanes, "i8") if lanes > 1 else "i8"
            for acc, c in zip(accs, offs, strict=True):
                logit = fn.var(ty, acc.get(), "logit")
                with fn.if_(fn.v("icmp ne ptr %b2, null", "hasb")):
                    logit.set(fn.v(f"fadd {ty} {logit.get()}, {fn.load(ty, fn.at('%b2', 4, c), 4, 'b')}", "lb"))
                hit = fn.v(f"fcmp ogt {ty} {logit.get()}, {thr}", "hit")
                fn.store(bytes_ty, fn.v(f"zext {vec(lanes, 'i1') if lanes > 1 else 'i1'} {hit} to {bytes_ty}", "m"),
                         fn.gep("%mask", c), 1)

        with fn.loop(c0, c64, "64", "c") as c:
            outputs(c, 16, 4)
        with fn.loop(c64, c16, "16", "c") as c:
            outputs(c, 16, 1)
        with fn.loop(c16, c1, "1", "c") as c:
            outputs(c, 1, 1)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, PREDICT_PARAMS, emit, predictor.__doc__ or "")
