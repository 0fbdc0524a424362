"""The fused sparse FFN of one device partition (decode: one token).

``sparse_ffn`` computes ``y = sum_i h_i down_t[i, :] (+ down_bias)`` over the active neurons i
of ``n`` (with ``accumulate``, adds it to y: a residual add in the same call), where ``h_i`` is
the form's activation of ``up[i] . x`` (and ``gate[i] . x``); the down projection is stored
neuron-major (``down_t[n, hidden]``, row i = neuron i's column of down), so each active neuron
is one AXPY; a down projection in a block format (q8_0, q4_0, q4_1) is in the rowplanes layout
(:mod:`picc.codegen_cpu.rowplanes`: each row's scales, then its quants). With ``interleaved``
weights, up and gate rows alternate (one ``up_gate`` matrix [n, 2, hidden]: the caller passes it
as ``up`` and, one row later, as ``gate``; its biases likewise), so an active neuron's two rows
are one contiguous stream. How the active set is known (``mode``):

* ``predictor``: the neurons whose byte in ``mask[0:n]`` is nonzero (from
  :func:`~picc.codegen_cpu.kernels_predictor.predictor`; a part of a split layer gets the mask
  from its first neuron on).
* ``dense``: every neuron.
* ``gate-first``: ``act(gate[i] . x + gate_bias[i])`` for all rows; active where its magnitude
  exceeds ``threshold`` (dReLU: where ``|h_i|`` does); up and down rows of the others are skipped.
* ``down-only``: gate and up for all rows; down rows skipped where ``|h_i| <= threshold``.

Phases (each thread, barriers between): [sparse modes: rows ``n*t/T..`` of the mask (of the
dense projections first, in gate-first / down-only mode), compacting the active rows of each
chunk; then every thread takes its share of the concatenated list] -> for its share of active
neurons, two at a time (four in down-only mode, which dots no rows): the gathered dot products,
``h``, and the AXPY into the thread's own f32 buffer (prefetching the rows of a later group; 4-bit
dotted rows go eight neurons at a time first, their blocks transposed in registers to the rows8
form; or, stored in the dotplanes layout, one neuron at a time, their AXPYs four at a time) ->
barrier -> each thread sums the T buffers over its share of the columns into ``y`` (fixed order:
deterministic).
Neurons whose ``h`` is exactly 0 are not added (an exact skip that over-predicted ReLU rows earn).

The emitter is :class:`_SparseFfn`, one method per phase; what a neuron computes (``h``, the
activity scores) it shares with the prefill's ``chunk_ffn`` (:mod:`picc.codegen_cpu.ffn_emitter`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu import dotplanes, rowplanes
from picc.codegen_cpu.ffn_emitter import (
    FORMS,
    LINE,
    MODES,
    FfnEmitter,
    any_nonzero,
    check_ffn_kernel,
    fabs,
    load_index,
    plus_bias,
    round_line,
    times_scale,
)
from picc.codegen_cpu.int16x import IntX, emit_int_x
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_predictor import PREDICT_PARAMS, predictor, predictor_scratch_bytes
from picc.codegen_cpu.rowformats import NIBBLE_DTYPES, prefetch_block
from picc.codegen_cpu.rowops import (
    emit_add_block_consts,
    emit_axpys,
    emit_dots,
    emit_tiled_rows,
    emit_x_sums,
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
from picc.ir.ops import FfnForm
from runtime.cpu import vector_isa

# Defined here, or (re-exported from ffn_emitter and kernels_predictor, split from this module) the
# names other modules import from here.
__all__ = [
    "FFN_PARAMS", "FORMS", "MODES", "PREDICT_PARAMS", "check_ffn_kernel", "ffn_scratch_bytes", "plus_bias",
    "predictor", "predictor_scratch_bytes", "sparse_ffn", "times_scale",
]

FFN_PARAMS = (("x", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("up_bias", "ptr"),
              ("gate_bias", "ptr"), ("down_bias", "ptr"), ("y", "ptr"), ("mask", "ptr"), ("count", "ptr"),
              ("scratch", "ptr"), ("n", "i32"), ("hidden", "i32"), ("threshold", "f32"), ("score_scale", "ptr"),
              ("accumulate", "i32"))
# Rows are prefetched this many groups of neurons ahead (pairs, or fours: see accumulate_active): a
# group of gathered rows is computed in less than a memory round trip. Measured with
# bench/kernels.py (1 thread, SmolLM2 shape): 1 pair is worse; 2, 4 and 8 pairs are within noise
# of each other (4 slightly ahead for q4_0). Down-only's fours (SmolLM2's FFN, 70% active, 40
# layers from memory, 1 thread, two runs each): 2 fours ahead 10.6-10.7 GB/s of down rows, 4
# fours 10.2-13.3, 6 fours 12.8-12.9; without prefetches 4.8.
_AHEAD = 4
_OCTET_AXPYS = 4  # down rows added in one pass over ybuf: an octet's, four at a time, and down-only's groups
_PLANES_AHEAD = 6  # neurons ahead whose dotplanes rows a neuron's dot products prefetch
_V16 = vec(16)


def ffn_scratch_bytes(n: int, hidden: int, nthreads: int) -> int:
    """Bytes of the ``scratch`` buffer :func:`sparse_ffn` needs (any mode) for ``nthreads`` threads."""
    return nthreads * round_line(4 * hidden) + 3 * round_line(4 * n) + nthreads * LINE


def _round_ir(fn: Fn, nbytes: str) -> str:
    """IR: the i64 ``nbytes`` rounded up to whole cache lines."""
    return fn.v(f"and i64 {fn.v(f'add i64 {nbytes}, {LINE - 1}', 'rb')}, {-LINE}", "r64")


def _counts_total(fn: Fn, cnt: str, upto: str) -> str:
    """``sum(cnt[s] for s < upto)`` (each count on its own cache line)."""
    total = fn.var("i64", "0", "tot")
    with fn.loop("0", upto, hint="s") as s:
        c = fn.sext(fn.load("i32", fn.at(cnt, LINE, s), 4, "c"))
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
    fn.store("i32", fn.v(f"trunc i64 {c.get()} to i32", "c32"), fn.at(cnt, LINE, tid), 4)


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
        c = fn.sext(fn.load("i32", fn.at(cnt, LINE, s), 4, "c"))
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


@cache
def sparse_ffn(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
               interleaved: bool = False, x_format: str = "f32", dense_rows8: bool = False,
               gathered: str = "rows") -> Kernel:
    """The fused FFN kernel of ``mode`` and ``form`` for the given weight formats (see module doc).

    ``x_format`` ``"i16"`` / ``"i8"``: 4-bit up and gate rows (the dense GEMV part of gate-first
    and down-only, and the gathered rows) dot x rounded to int16 / int8 per block
    (``int16x.emit_int_x``), as the ``_xi16`` / ``_xi8`` GEMVs do; the down AXPY reads ``h`` as
    is. ``dense_rows8`` (gate-first or down-only, n a multiple of 8): the matrices the mode reads
    whole (the gate; the gate and up), 4-bit, are in the rows8 layout and their dense projections
    go eight rows at a time (``rows8.emit_rows8``; threads split n at multiples of 8).
    ``gathered`` ``"dotplanes"`` (rounded x, 4-bit dotted rows of one format): the rows it gathers
    and dots are in the dotplanes layout and go one neuron at a time (:mod:`.dotplanes`); else
    GGUF's rows, eight neurons at a time where they are 4-bit.

    ``scratch`` holds :func:`ffn_scratch_bytes` bytes. In the sparse modes ``count`` (when not
    null) receives the number of active neurons (for dReLU in gate-first mode, of those whose gate
    passed, before ``|h| > threshold`` is checked). ``mask`` is read in predictor mode only.
    """
    spec = check_ffn_kernel(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
    symbol = names.cpu_fused_ffn(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, x_format, dense_rows8,
                                 gathered)
    x_format = names.ffn_x_format(x_format, up_dtype, gate_dtype)  # rounded only where 4-bit rows are dotted
    planes = gathered == "dotplanes"
    if planes and not names.dotplanes_fit(mode, x_format, up_dtype, gate_dtype):
        raise PiccError(f"codegen_cpu: the dotplanes layout holds 4-bit rows of one format dotted with rounded x; a "
                        f"{mode} kernel with x {x_format} dots {up_dtype} / {gate_dtype} rows")

    def emit(level: str) -> str:
        fn = kernel_fn(symbol, FFN_PARAMS, level if x_format != "f32" else None)
        ffn = _SparseFfn(fn, vector_isa(level), mode, spec, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8,
                         x_format, vnni=level == "avx512-vnni", planes=planes)
        ffn.accumulate_active(ffn.active_list())
        ffn.reduce()
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, FFN_PARAMS, emit, sparse_ffn.__doc__ or "", by_level=x_format != "f32")


class _SparseFfn(FfnEmitter):
    """:func:`sparse_ffn`'s emitter: the IR values its phases share, made in the kernel's entry
    (sizes, the scratch regions, x in the forms the dot products read), and one method per phase."""

    def __init__(self, fn: Fn, simd: str, mode: str, spec: FfnForm, up_dtype: str, gate_dtype: str | None,
                 down_dtype: str, interleaved: bool, dense_rows8: bool, x_format: str, vnni: bool = False,
                 planes: bool = False) -> None:
        super().__init__(fn, mode, spec, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
        self.simd, self.vnni = simd, vnni  # vnni: rounded x's eight-row sums with vpdpbusd
        self.n, self.hidden = fn.sext("%n"), fn.sext("%hidden")
        self.tid, self.nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        self.emit_row_bytes(self.hidden)
        # scratch: each thread's f32 buffer of y, then [n] of vals (the dense projections), seg (each
        # chunk's compacted rows), lst (the active list) and the chunks' counts, a line apart.
        self.ystride = _round_ir(fn, fn.v(f"shl i64 {self.hidden}, 2", "yb"))
        nbytes = _round_ir(fn, fn.v(f"shl i64 {self.n}, 2", "nb"))
        self.ybuf = fn.gep("%scratch", fn.v(f"mul i64 {self.tid}, {self.ystride}", "yo"), "ybuf")
        self.vals = fn.gep("%scratch", fn.v(f"mul i64 {self.nthreads}, {self.ystride}", "vo"), "vals")
        self.seg = fn.gep(self.vals, nbytes, "seg")
        self.lst = fn.gep(self.seg, nbytes, "lst")
        self.cnt = fn.gep(self.lst, nbytes, "cnt")
        zero_floats(fn, self.ybuf, self.hidden)
        # Matrices whose rows each active neuron reads in the gather phase (dot products).
        self.dotted = list(names.gathered_dotted(mode, ("%up", up_dtype, self.rb_up),
                                                 ("%gate", gate_dtype, self.rb_gate) if gate_dtype else None))
        self.planes = planes  # the dotted rows in the dotplanes layout, a neuron at a time
        self._x_forms(x_format)
        self._down_coefficients()
        self.listp: str | None = None

    def _x_forms(self, x_format: str) -> None:
        """x as the dot products read it: rounded or its sums (rows one at a time), rows8's forms."""
        fn, hidden = self.fn, self.hidden
        dotted_dtypes = {self.up_dtype, self.gate_dtype or self.up_dtype}
        rounded = x_format != "f32"
        # x's form for rows one at a time: the gathered rows not in the dotplanes layout, and a
        # gate-first gate read whole not in the rows8 layout (rounded once a call: not where unread).
        rows_form = not self.planes or (self.mode not in ("predictor", "dense") and not self.dense_rows8)
        self.intx = emit_int_x(fn, "%x", hidden, dotted_dtypes, x_format=x_format) if rounded and rows_form else None
        self.xsums = None if rounded else emit_x_sums(fn, "%x", hidden, dotted_dtypes)
        # 4-bit rows gathered and dotted go eight neurons at a time (see accumulate_active). They and
        # the matrices read whole from the rows8 layout take x in the form the rows8 dot products
        # read (scaled floats, or int16 split into bytes), made once for both.
        gathered = {dtype for _, dtype, _ in self.dotted}
        self.octets = bool(gathered) and gathered <= NIBBLE_DTYPES and not self.planes
        whole = names.read_whole(self.mode, self.up_dtype, self.gate_dtype) if self.dense_rows8 else ()
        rows8_dtypes = (gathered if self.octets or self.planes else set()) | set(whole)
        self.x8: IntX | ScaledX | None = None
        if rows8_dtypes:
            self.x8 = (emit_int_x(fn, "%x", hidden, rows8_dtypes, rows8=True, x_format=x_format) if rounded
                       else emit_scaled_x(fn, "%x", hidden))
        self.xplanes = None  # x as the dotplanes rows' dot products read it
        if self.planes:
            assert isinstance(self.x8, IntX)
            self.xplanes = dotplanes.emit_x_planes(fn, self.x8, fn.v(f"lshr i64 {hidden}, 5", "nblk"))

    def _down_coefficients(self) -> None:
        """Stack arrays for a rowplanes down row's coefficients and the 4-bit rows' constant terms."""
        self.consts = None  # the 4-bit down rows' per-block constant terms (see emit_axpys)
        self.coefs: list[str] = []  # the scaled block scales of the rowplanes down rows of one AXPY call
        if self.down_dtype in rowplanes.DTYPES:
            self.coefs, self.consts = rowplanes.emit_scratch(self.fn, self.down_dtype, self.hidden, _OCTET_AXPYS)

    # -- phase 1 (sparse modes): the active list

    def active_list(self) -> str:
        """The number of active neurons, listed at :attr:`listp` (left None in dense mode: all of them)."""
        fn, mode = self.fn, self.mode
        if mode == "dense":
            return self.n
        lo, hi = chunk_bounds(fn, self.n, self.tid, self.nthreads, align=GROUP if self.dense_rows8 else 1)
        if mode != "predictor":
            self._dense_projections(lo, hi)
        _compact(fn, lo, self.seg, self.cnt, self.tid, (lo, hi), self._keep, self._keep_span)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        total = _counts_total(fn, self.cnt, self.nthreads)
        with fn.if_(fn.v(f"icmp eq i64 {self.tid}, 0", "t0")), fn.if_(fn.v("icmp ne ptr %count, null", "hc")):
            fn.store("i32", fn.v(f"trunc i64 {total} to i32", "tot32"), "%count", 4)
        self.listp = self.lst
        return total

    def _dense_projections(self, lo: str, hi: str) -> None:
        """vals[r] = act(g) (gate-first) or h (down-only) of this thread's rows: a GEMV (rows in
        tiles that share x, the next tiles prefetched), or eight rows at a time from rows8."""
        fn, mode = self.fn, self.mode
        dense = [(self.gate_dtype, "%gate", self.rb_gate)] if self.spec.gated else []
        if mode == "down-only":
            dense.append((self.up_dtype, "%up", self.rb_up))

        def score(r: str, dots: list[str]) -> None:
            a = self.gate_act(r, dots[0]) if self.spec.gated else None
            value = a if mode == "gate-first" else self.h(a, self.up(r, dots[-1]))
            fn.store(F32, value, fn.at(self.vals, 4, r), 4)

        if self.dense_rows8:
            whole = [(dt, base, emit_group_bytes(fn, dt, self.hidden)) for dt, base, _ in dense]
            assert self.x8 is not None
            glo, ghi = fn.v(f"lshr i64 {lo}, 3", "glo"), fn.v(f"lshr i64 {hi}, 3", "ghi")
            emit_rows8(fn, whole, self.x8, self.hidden, glo, ghi, score, self.vnni)
        else:
            emit_tiled_rows(fn, dense, "%x", self.hidden, lo, hi, self.simd, score, self.xsums,  # type: ignore[arg-type]
                            intx=self.intx)

    @property
    def _cut(self) -> str:
        """What a row's score must exceed: gate-first's :attr:`gate_cut`, down-only's threshold."""
        return self.gate_cut if self.mode == "gate-first" else "%threshold"

    def _keep(self, r: str) -> str:
        """An i1: whether row r is active."""
        fn = self.fn
        if self.mode == "predictor":
            return fn.v(f"icmp ne i8 {fn.load('i8', fn.gep('%mask', r), 1, 'm')}, 0", "keep")
        v = fn.load(F32, fn.at(self.vals, 4, r), 4, "v")
        v = self.gate_score(v, r) if self.mode == "gate-first" else fabs(fn, v)
        return fn.v(f"fcmp ogt float {v}, {self._cut}", "keep")

    def _keep_span(self, r: str) -> str:
        """An i32 whose bit j is :meth:`_keep` of row r + j, for j < ``_SPAN``."""
        fn, span = self.fn, vec(_SPAN)
        if self.mode == "predictor":
            m = fn.load(vec(_SPAN, "i8"), fn.gep("%mask", r), 1, "ms")
            hit = fn.v(f"icmp ne {vec(_SPAN, 'i8')} {m}, zeroinitializer", "keeps")
        else:
            v = fn.load(span, fn.at(self.vals, 4, r), 4, "vs")
            a = fn.v(f"call {span} @llvm.fabs.v32f32({span} {v})", "abss")
            if self.mode == "gate-first" and not self.spec.act_on_up:
                a = times_scale(fn, a, r, span)
            hit = fn.v(f"fcmp ogt {span} {a}, {fn.splat(_SPAN, self._cut)}", "keeps")
        return fn.v(f"bitcast {vec(_SPAN, 'i1')} {hit} to i32", "bits")

    # -- phase 2: h of this thread's share of the active neurons, and their AXPYs into ybuf

    def _neuron(self, k: str) -> str:
        """The k-th active neuron."""
        return k if self.listp is None else load_index(self.fn, self.listp, k)

    def _h_values(self, ids: list[str], ahead: list[str] | None) -> list[str]:
        """h of each neuron in ``ids``, prefetching the dotted rows of ``ahead``."""
        fn = self.fn
        if self.mode == "down-only":
            return [fn.load(F32, fn.at(self.vals, 4, i), 4, "h") for i in ids]
        rows = [(dt, self.row(mat, rb, i)) for i in ids for mat, dt, rb in self.dotted]
        pf = [(dt, self.row(mat, rb, i)) for i in ahead or [] for mat, dt, rb in self.dotted]
        dots = emit_dots(fn, rows, "%x", self.hidden, self.simd, pf, self.xsums, self.intx, prefetch_into="l2")
        return self._h_from(ids, dots)

    def _h_from(self, ids: list[str], dots: list[str]) -> list[str]:
        """h of each neuron in ``ids`` from its dot products (up, then gate when dotted)."""
        fn, sums, hs = self.fn, iter(dots), []
        for i in ids:
            u = self.up(i, next(sums))
            if self.mode == "gate-first":
                a: str | None = fn.load(F32, fn.at(self.vals, 4, i), 4, "a")
            else:
                a = self.gate_act(i, next(sums)) if self.spec.gated else None
            h = self.h(a, u)
            if self.mode == "gate-first" and self.spec.act_on_up:  # dReLU: active when |h| (scaled) > threshold
                h = fn.v(f"select i1 {self.h_passes(h, i, 'live')}, float {h}, float 0.0", "h")
            hs.append(h)
        return hs

    def _axpys(self, ids: list[str], hs: list[str], ahead: list[str] | None) -> None:
        """ybuf += sum h_i down_t[i] (skipped when every h is 0), prefetching ``ahead``'s rows."""
        fn, down = self.fn, self.down_dtype
        with fn.if_(any_nonzero(fn, hs, "live")):
            rows = [(down, self.row("%down", self.rb_down, i), h) for i, h in zip(ids, hs, strict=True)]
            pf = [(down, self.row("%down", self.rb_down, i)) for i in ahead or []]
            if self.coefs:
                rowplanes.emit_axpys(fn, rows, self.ybuf, self.hidden, self.coefs, self.consts, pf)
            else:
                emit_axpys(fn, rows, self.ybuf, self.hidden, self.simd, pf)

    def accumulate_active(self, total: str) -> None:
        """This thread's share of the ``total`` active neurons into its ybuf: eight at a time
        first (4-bit dotted rows), then in pairs, then the last one."""
        fn = self.fn
        k0, k1 = chunk_bounds(fn, total, self.tid, self.nthreads)
        if self.listp is not None:
            _gather_share(fn, self.seg, self.cnt, self.listp, self.n, self.nthreads, k0, k1,
                          GROUP if self.dense_rows8 else 1)
        # Neurons go in pairs (four at a time where none of their rows is dotted: down-only's
        # AXPYs alone): the rows of each matrix in flight together, one pass over ybuf per group,
        # and the rows of a later group prefetched along the way (gathered rows defeat the hardware
        # prefetcher; contiguous ones, in dense mode, do not need it).
        group = 2 if self.dotted else _OCTET_AXPYS
        span = fn.v(f"sub i64 {k1}, {k0}", "span")
        last = fn.v(f"sub i64 {k1}, 1", "last")
        if self.planes:
            self._in_fours(k0, k1, last)
            return
        groups_start = self._octets(k0, span, last) if self.octets else k0
        span = fn.v(f"sub i64 {k1}, {groups_start}", "span")
        groups_end = fn.v(f"add i64 {groups_start}, {fn.v(f'and i64 {span}, -{group}', 'whole')}", "gend")
        with fn.loop(groups_start, groups_end, str(group), "k") as k:
            ids = [self._neuron(fn.v(f"add i64 {k}, {u}", "ku") if u else k) for u in range(group)]
            ahead = None
            if self.listp is not None:
                ahead = [self._neuron(fn.min64(fn.v(f"add i64 {k}, {_AHEAD * group + u}", "kd"), last))
                         for u in range(group)]
            self._axpys(ids, self._h_values(ids, ahead), ahead)
        with fn.loop(groups_end, k1, hint="k") as k:
            ids = [self._neuron(k)]
            self._axpys(ids, self._h_values(ids, None), None)

    def _in_fours(self, k0: str, k1: str, last: str) -> None:
        """Active neurons k0..k1 from dotplanes rows: each neuron's rows dotted on their own (its
        up and gate in one pass, prefetching the rows of the neuron ``_PLANES_AHEAD`` later), the
        AXPYs four at a time (one pass over ybuf), then the last ones alone. Measured
        (bench/kernels.py, 4096 x 11008 q4_1, one thread, the dots alone): two neurons' rows in one
        pass read 1.4x slower from memory than one neuron's; with the AXPYs, two threads read best
        prefetching six neurons ahead (two or four: ~0.75x the rate; eight or twelve: about the same)."""
        fn, four = self.fn, _OCTET_AXPYS
        assert self.xplanes is not None
        span = fn.v(f"sub i64 {k1}, {k0}", "span")
        fours_end = fn.v(f"add i64 {k0}, {fn.v(f'and i64 {span}, -{four}', 'whole')}", "fend")

        def later(k: str, by: int) -> list[str]:
            return [] if self.listp is None else [self._neuron(fn.min64(fn.v(f"add i64 {k}, {by}", "kd"), last))]

        def h_of(k: str, i: str) -> str:
            rows = [(dt, self.row(mat, rb, i)) for mat, dt, rb in self.dotted]
            ahead = [self.row(mat, rb, j) for j in later(k, _PLANES_AHEAD) for mat, _, rb in self.dotted]
            dots = dotplanes.emit_dots(fn, rows, self.xplanes, self.hidden, self.simd, self.vnni, ahead)
            return self._h_from([i], dots)[0]

        with fn.loop(k0, fours_end, str(four), "k") as k:
            ks = [fn.v(f"add i64 {k}, {u}", "ku") if u else k for u in range(four)]
            ids = [self._neuron(ku) for ku in ks]
            hs = [h_of(ku, i) for ku, i in zip(ks, ids, strict=True)]
            self._axpys(ids, hs, [j for u in range(four) for j in later(k, four + u)] or None)
        with fn.loop(fours_end, k1, hint="k") as k:
            i = self._neuron(k)
            self._axpys([i], [h_of(k, i)], None)

    def _octets(self, k0: str, span: str, last: str) -> str:
        """Active neurons k0.. eight at a time: each dotted matrix's eight rows transposed block by
        block and dotted as a rows8 group (rows8.emit_gathered8_dots), the next eight's rows
        prefetched along; then the AXPYs in pairs. Returns where the pairs start."""
        fn = self.fn
        assert self.x8 is not None
        oct_end = fn.v(f"add i64 {k0}, {fn.v(f'and i64 {span}, -{GROUP}', 'oct')}", "oend")
        with fn.loop(k0, oct_end, str(GROUP), "k") as k:
            ids = [self._neuron(fn.v(f"add i64 {k}, {u}", "ku") if u else k) for u in range(GROUP)]
            nxt = None
            if self.listp is not None:
                nxt = [self._neuron(fn.min64(fn.v(f"add i64 {k}, {GROUP + u}", "kn"), last)) for u in range(GROUP)]

            def prefetch(b: str, nxt: list[str] | None = nxt) -> None:
                for i in nxt or []:
                    for mat, dt, rb in self.dotted:
                        prefetch_block(fn, dt, self.row(mat, rb, i), b, "l2")

            mats = [(dt, [self.row(mat, rb, i) for i in ids]) for mat, dt, rb in self.dotted]
            vectors = emit_gathered8_dots(fn, mats, self.x8, self.hidden, prefetch, self.vnni)
            dots = [fn.v(f"extractelement {vec(GROUP)} {v}, i64 {u}", "dot") for u in range(GROUP) for v in vectors]
            hs = self._h_from(ids, dots)
            for u in range(0, GROUP, _OCTET_AXPYS):  # one pass over ybuf per four rows
                span = slice(u, u + _OCTET_AXPYS)
                self._axpys(ids[span], hs[span], nxt[span] if nxt else None)
        return oct_end

    # -- phase 3: the threads' buffers summed into y

    def reduce(self) -> None:
        """4-bit down rows' constant terms into ybuf, the barrier, then this thread's columns of y."""
        fn = self.fn
        if self.consts is not None:
            emit_add_block_consts(fn, self.ybuf, self.consts, self.hidden)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        _reduce(fn, fn.gep("%scratch", "0"), self.ystride, "%y", "%down_bias", self.hidden, self.tid, self.nthreads)
