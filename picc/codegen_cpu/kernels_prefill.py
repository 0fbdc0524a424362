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
   neuron whose gate passed for no token skips its up row. The matrices a gate-first or
   down-only kernel reads whole, stored in the rows8 layout and dotted with rounded x, instead
   go eight rows at a time through the decode kernel's integer products, the chunk's tokens
   together (SmolLM2's FFN, 32 tokens, int16 x, Zen 5: down-only 1.4x, gate-first 1.3x).
2. Barrier. Threads split the hidden columns (32 at a time, so a block format's blocks are not
   shared). The neurons live for some token go eight at a time: their slices of ``down_t`` are
   dequantised once, and each token's row of Y gets ``sum h[s, i] down_t[i]`` over the eight in
   one pass (skipped when all eight h are 0; a zero h adds exactly nothing).

``mask`` (predictor mode) is [seq, mask_stride] bytes, this partition's first neuron at column 0.
Sums run in a different order than the decode kernel's (f32 rounding differs at the 1e-7 level).

The emitter is :class:`_ChunkFfn`, one method per phase; what a neuron computes (``h``, the
activity scores) it shares with the decode kernel (:mod:`picc.codegen_cpu.ffn_emitter`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu import dotplanes, rowplanes
from picc.codegen_cpu.dotplanes import LAYOUT as DOTPLANES
from picc.codegen_cpu.ffn_emitter import FfnEmitter, any_nonzero, check_ffn_kernel, fabs, load_index, round_line
from picc.codegen_cpu.irtext import F32, Fn, chunk_bounds, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.kernels_batch import emit_rows8_batch, emit_x_rows, paired_x, uses_vnni
from picc.codegen_cpu.kernels_dense import dot_grid, gemm_tile
from picc.codegen_cpu.rowformats import ELEMENT_BYTES, emit_row_to_f32
from picc.codegen_cpu.rows8 import GROUP, emit_group_bytes, emit_rows8_row_to_f32
from picc.codegen_cpu.rows8 import LAYOUT as ROWS8
from picc.ir.ops import FfnForm
from runtime.cpu import vector_isa

CHUNK_FFN_PARAMS = (("x", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("up_bias", "ptr"),
                    ("gate_bias", "ptr"), ("down_bias", "ptr"), ("y", "ptr"), ("mask", "ptr"), ("scratch", "ptr"),
                    ("seq", "i32"), ("mask_stride", "i32"), ("n", "i32"), ("hidden", "i32"), ("threshold", "f32"),
                    ("score_scale", "ptr"))
_TILE = 4  # tokens dotted per pass over a dequantised row
_GROUP = 8  # live neurons added to a token's row of Y per pass (8 dequantised rows, 8 h in registers)
_V16 = vec(16)


def chunk_ffn_scratch_bytes(seq: int, n: int) -> int:
    """Bytes of the ``scratch`` :func:`chunk_ffn` needs for ``seq`` tokens and ``n`` neurons: H,
    the up products of a down-only kernel's rows8 phase beside it, the live marks."""
    return 2 * round_line(4 * seq * n) + round_line(n)


def _dots_all_tokens(fn: Fn, wrows: list[str], k: str, seq: str, consume: Callable[[int, str, str], None],
                     lanes: int) -> None:
    """``consume(r, s, wrows[r] . x[s])`` for every row r and token s < seq (f32 rows of k floats,
    x rows k apart), four tokens at a time (:func:`~picc.codegen_cpu.kernels_dense.dot_grid`)."""
    xrow = fn.v(f"shl i64 {k}, 2", "xrowb")
    tiles = fn.v(f"sub i64 {seq}, {fn.v(f'srem i64 {seq}, {_TILE}', 'rem')}", "tiles")
    with fn.loop("0", tiles, str(_TILE), "s") as s:
        idx = [s] + [fn.v(f"add i64 {s}, {t}", "st") for t in range(1, _TILE)]
        xs = [fn.gep("%x", fn.v(f"mul i64 {i}, {xrow}", "xo"), "xr") for i in idx]
        for r, dots in enumerate(dot_grid(fn, wrows, xs, k, lanes)):
            for i, d in zip(idx, dots, strict=True):
                consume(r, i, d)
    with fn.loop(tiles, seq, "1", "s") as s:
        xs = [fn.gep("%x", fn.v(f"mul i64 {s}, {xrow}", "xo"), "xr")]
        for r, (d,) in enumerate(dot_grid(fn, wrows, xs, k, lanes)):
            consume(r, s, d)


def _any_token(fn: Fn, seq: str, test: Callable[[str], str]) -> str:
    """An i1: whether ``test(s)`` holds for some token s < seq."""
    hit = fn.var("i1", "false", "any")
    with fn.loop("0", seq, hint="s") as s:
        hit.set(fn.v(f"or i1 {hit.get()}, {test(s)}", "any"))
    return hit.get("any")


def _list_where(fn: Fn, ids: str, lo: str, hi: str, keep: Callable[[str], str], hint: str) -> str:
    """Write the i in [lo, hi) where ``keep(i)`` (an i1, or ``"true"``) holds to ``ids``, in order;
    their count (``hint`` names it)."""
    count = fn.var("i64", "0", hint)
    with fn.loop(lo, hi, hint="i") as i:
        kept = keep(i)
        with fn.if_(kept) if kept != "true" else contextlib.nullcontext():
            c = count.get("c")
            fn.store("i32", fn.v(f"trunc i64 {i} to i32", "i32"), fn.at(ids, 4, c), 4)
            count.set(fn.v(f"add i64 {c}, 1", "c1"))
    return count.get(hint)


def _in_groups(fn: Fn, total: str, size: int, group: Callable[[str, int], None], hint: str) -> None:
    """``group(k, size)`` for k = 0, size, .. while a whole group fits in ``total``, then
    ``group(k, 1)`` for the rest (``hint`` names where the whole groups end)."""
    end = fn.v(f"and i64 {total}, {-size}", hint)
    with fn.loop("0", end, str(size), "k") as k:
        group(k, size)
    with fn.loop(end, total, hint="k") as k:
        group(k, 1)


@cache
def chunk_ffn(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
              interleaved: bool = False, dense_rows8: bool = False, gathered: str = "rows",
              x_format: str = "f32") -> Kernel:
    """The prefill FFN kernel of ``mode`` and ``form`` (see module doc); ``scratch`` holds
    :func:`chunk_ffn_scratch_bytes` bytes. ``dense_rows8``: the matrices the mode reads whole
    (gate-first: the gate; down-only: the gate and up) are in the rows8 layout (that of
    ``sparse_ffn``'s ``dense_rows8``). With ``x_format`` ``"i16"`` / ``"i8"`` (x rounded per
    block, the decode kernel's integer products) they are dotted as the decode kernel dots
    them, eight rows by several tokens at a time (``kernels_batch.emit_rows8_batch``: each
    token's products the decode kernel's bits for the same x); with float x their rows are
    dequantised to the floats of the row layout. ``gathered`` ``"dotplanes"``: the matrices it
    gathers (``names.gathered_dotted``) are in the dotplanes layout (that of ``sparse_ffn``'s
    ``gathered``), their rows dequantised likewise. Without ``dense_rows8`` every dot product is
    float and ``x_format`` changes nothing."""
    spec = check_ffn_kernel(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
    x_format = names.ffn_x_format(x_format, up_dtype, gate_dtype) if dense_rows8 else "f32"
    symbol = names.cpu_chunk_ffn(mode, form, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8, gathered,
                                 x_format)
    by_level = dense_rows8 and x_format != "f32"  # AVX-512 takes x rows in pairs, VNNI sums them

    def emit(level: str) -> str:
        fn = kernel_fn(symbol, CHUNK_FFN_PARAMS, level if by_level else None)
        ffn = _ChunkFfn(fn, level, mode, spec, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8, gathered,
                        x_format)
        ffn.neuron_phase()
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        ffn.column_phase()
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, CHUNK_FFN_PARAMS, emit, chunk_ffn.__doc__ or "", by_level=by_level)


class _ChunkFfn(FfnEmitter):
    """:func:`chunk_ffn`'s emitter: the IR values its phases share and one method per phase (the
    values a phase makes for its helpers, this thread's neurons ``lo``, ``hi`` and its columns
    ``c0``, ``width``, ..., are set when it emits them)."""

    def __init__(self, fn: Fn, level: str, mode: str, spec: FfnForm, up_dtype: str, gate_dtype: str | None,
                 down_dtype: str, interleaved: bool, dense_rows8: bool, gathered: str = "rows",
                 x_format: str = "f32") -> None:
        super().__init__(fn, mode, spec, up_dtype, gate_dtype, down_dtype, interleaved, dense_rows8)
        self.level, self.simd, self.x_format = level, vector_isa(level), x_format
        self.seq, self.n, self.hidden = fn.sext("%seq"), fn.sext("%n"), fn.sext("%hidden")
        self.tid, self.nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        self.stride = fn.sext("%mask_stride")
        self.emit_row_bytes(self.hidden)
        floats = fn.v(f"mul i64 {self.seq}, {self.n}", "sn")
        floats = fn.v(f"and i64 {fn.v(f'add i64 {floats}, 15', 'r')}, -16", "hn")
        self.ups = fn.gep("%scratch", fn.v(f"shl i64 {floats}, 2", "hb"), "ups")  # U: [n, seq] f32, as H
        self.live = fn.gep("%scratch", fn.v(f"shl i64 {floats}, 3", "lb"), "live")  # one byte per neuron
        self.row_tile, self.lanes = gemm_tile(self.simd)  # dequantised rows dotted together, lanes a vector
        self.wbufs = [fn.alloca_array(F32, self.hidden, "wrow") for _ in range(self.row_tile)]
        self.in_rows8 = names.read_whole(mode, "up", "gate") if dense_rows8 else ()
        # With rounded x those go through the decode kernel's integer products (the chunk's x rows
        # together); with float x, dequantised rows against dot_grid's tile were faster
        # (SmolLM2's FFN, 32 tokens: 1.2x) than the rows8 float products.
        self.int_rows8 = self.in_rows8 if x_format != "f32" else ()
        self.in_planes = names.gathered_dotted(mode, "up", "gate") if gathered == "dotplanes" else ()

    def h_at(self, s: str, i: str, base: str = "%scratch") -> str:
        """Where h[s, i] is (``base`` :attr:`ups`: where up's product is). H is neuron-major: a
        neuron's tokens share cache lines."""
        fn = self.fn
        return fn.at(base, 4, fn.v(f"add i64 {fn.v(f'mul i64 {i}, {self.seq}', 'is')}, {s}", "is"), "hp")

    def selected(self, s: str, i: str) -> str:
        """An i1: whether token s's mask byte selects neuron i (predictor mode)."""
        fn = self.fn
        m = fn.load("i8", fn.gep("%mask", fn.v(f"add i64 {fn.v(f'mul i64 {s}, {self.stride}', 'ms')}, {i}", "mi")), 1)
        return fn.v(f"icmp ne i8 {m}, 0", "sel")

    # -- phase 1: h[s, i] for this thread's neurons

    def neuron_phase(self) -> None:
        """H for this thread's neurons: act(gate) of the neurons some token needs, then up and h
        of those some token keeps. The matrices the mode reads whole, in the rows8 layout, go a
        group of eight rows at a time through every token (:meth:`_rows8_whole`); the others'
        rows through a list of the neurons that need them, ``gemm_tile``'s rows at a time
        (dot_grid's register tile)."""
        fn, seq = self.fn, self.seq
        self.lo, self.hi = chunk_bounds(fn, self.n, self.tid, self.nthreads, align=GROUP if self.int_rows8 else 1)
        live = fn.gep(self.live, self.lo)
        fn.emit(f"call void @llvm.memset.p0.i64(ptr {live}, i8 0, i64 {fn.v(f'sub i64 {self.hi}, {self.lo}', 'nl')}, "
                "i1 false)")
        if self.int_rows8:
            self._rows8_whole()
            if self.mode == "down-only":
                return
        self.ids = fn.alloca_array("i32", fn.v(f"sub i64 {self.hi}, {self.lo}", "nl"), "ids")  # _rows_of's lists

        def needed(i: str) -> str:
            return _any_token(fn, seq, lambda s: self.selected(s, i)) if self.mode == "predictor" else "true"

        def up_needed(i: str) -> str:
            if self.mode == "gate-first":
                return _any_token(fn, seq, lambda s: fn.v(f"fcmp ogt float {self._gate_score(s, i)}, "
                                                          f"{self.gate_cut}", "pass"))
            return needed(i)

        if self.spec.gated and "gate" not in self.int_rows8:
            def store_act(i: str, s: str, g: str) -> None:
                fn.store(F32, self.gate_act(i, g), self.h_at(s, i), 4)

            self._rows_of("%gate", self.gate_dtype, self.rb_gate, self._layout("gate"),  # type: ignore[arg-type]
                          needed, store_act)
        self._rows_of("%up", self.up_dtype, self.rb_up, self._layout("up"), up_needed, self._store_h)

    def _rows8_whole(self) -> None:
        """H from the matrices read whole (gate-first: act(gate); down-only: h, and the live
        marks), as the decode kernel's dense projections compute them for each token
        (``kernels_ffn._SparseFfn._dense_projections``): eight rows of the gate and up at a time,
        the chunk's x rows a few at a time through each group's blocks, each product stored as
        it comes (the gate's, or an ungated up's, in H; a gated up's in U); then each neuron's
        tokens in one loop that LLVM vectorises (the same operations on each element: the
        decode kernel's bits)."""
        fn = self.fn
        mats = [(dtype, f"%{m}", emit_group_bytes(fn, dtype, self.hidden))
                for m, dtype in (("gate", self.gate_dtype), ("up", self.up_dtype)) if m in self.int_rows8]
        xs = emit_x_rows(fn, "%x", fn.v(f"shl i64 {self.hidden}, 2", "xrowb"), self.hidden, self.seq,
                         {dtype for dtype, _, _ in mats}, self.x_format, rows8=True,
                         pairs=paired_x(self.level, self.x_format, rows8=True))
        bases = ["%scratch", self.ups][: len(mats)]

        def consume(s: str, i: str, dots: list[str]) -> None:
            for base, dot in zip(bases, dots, strict=True):
                fn.store(F32, dot, self.h_at(s, i, base), 4)

        glo, ghi = fn.v(f"lshr i64 {self.lo}, 3", "glo"), fn.v(f"lshr i64 {self.hi}, 3", "ghi")
        emit_rows8_batch(fn, mats, xs, self.hidden, self.seq, glo, ghi, consume, uses_vnni(self.level))
        with fn.loop(self.lo, self.hi, hint="i") as i:
            if self.mode == "gate-first":
                with fn.loop("0", self.seq, hint="s") as s:
                    hp = self.h_at(s, i)
                    fn.store(F32, self.gate_act(i, fn.load(F32, hp, 4, "g")), hp, 4)
            else:
                self._down_only_h(i)

    def _down_only_h(self, i: str) -> None:
        """Neuron i's h for each token from the products :meth:`_rows8_whole` stored (0 where
        ``|h|`` is not above the threshold), and its live mark."""
        fn = self.fn
        nonzero = fn.var("i8", "0", "nz")
        with fn.loop("0", self.seq, hint="s") as s:
            hp = self.h_at(s, i)
            first = fn.load(F32, hp, 4, "d")
            a = self.gate_act(i, first) if self.spec.gated else None
            u = self.up(i, fn.load(F32, self.h_at(s, i, self.ups), 4, "u") if self.spec.gated else first)
            h = self.h(a, u)
            h = fn.v(f"select i1 {fn.v(f'fcmp ogt float {fabs(fn, h)}, %threshold', 'keep')}, float {h}, "
                     "float 0.0", "h")
            fn.store(F32, h, hp, 4)
            nz = fn.v(f"zext i1 {fn.v(f'fcmp one float {h}, 0.0', 'nz')} to i8", "nz8")
            nonzero.set(fn.v(f"or i8 {nonzero.get()}, {nz}", "nz"))
        fn.store("i8", nonzero.get("nz"), fn.gep(self.live, i), 1)

    def _layout(self, matrix: str) -> str | None:
        """The layout ``matrix`` ("up", "gate") is stored in: rows8, dotplanes, or GGUF's rows (None)."""
        return ROWS8 if matrix in self.in_rows8 else DOTPLANES if matrix in self.in_planes else None

    def _rows_of(self, matrix: str, dtype: str, rowb: str, layout: str | None, wanted: Callable[[str], str],
                 consume: Callable[[str, str, str], None]) -> None:
        """``consume(i, s, row_i . x[s])`` for each neuron i of this thread where ``wanted(i)``
        (``layout``: :meth:`_layout`)."""
        fn = self.fn
        total = _list_where(fn, self.ids, self.lo, self.hi, wanted, "cnt")

        def group(k: str, size: int) -> None:
            neurons = [load_index(fn, self.ids, fn.v(f"add i64 {k}, {g}", "kg")) for g in range(size)]
            for i, buf in zip(neurons, self.wbufs, strict=False):
                if layout == ROWS8:
                    emit_rows8_row_to_f32(fn, dtype, matrix, i, buf, self.hidden, self.simd)
                elif layout == DOTPLANES:
                    dotplanes.emit_row_to_f32(fn, dtype, self.row(matrix, rowb, i, "p"), buf, self.hidden, self.simd)
                else:
                    emit_row_to_f32(fn, dtype, self.row(matrix, rowb, i, "p"), buf, self.hidden, self.simd)
            _dots_all_tokens(fn, self.wbufs[:size], self.hidden, self.seq, lambda r, t, d: consume(neurons[r], t, d),
                             self.lanes)

        _in_groups(fn, total, self.row_tile, group, "pend")

    def _gate_score(self, s: str, i: str) -> str:
        """:meth:`gate_score` of token s, neuron i (act(g) stored in H)."""
        return self.gate_score(self.fn.load(F32, self.h_at(s, i), 4, "a"), i)

    def _store_h(self, i: str, s: str, u: str) -> None:
        """h[s, i] from up's dot product ``u`` and act(g) in H, 0 where the neuron is inactive for
        token s; neuron i marked live when it is not 0."""
        fn, mode = self.fn, self.mode
        hp = self.h_at(s, i)
        u = self.up(i, u)
        h = self.h(fn.load(F32, hp, 4, "a") if self.spec.gated else None, u)
        if mode == "predictor":
            keep = self.selected(s, i)
        elif mode == "gate-first":
            keep = fn.v(f"fcmp ogt float {self._gate_score(s, i)}, {self.gate_cut}", "keep")
            if self.spec.act_on_up:
                keep = fn.v(f"and i1 {keep}, {self.h_passes(h, i, 'big')}", "keep")
        elif mode == "down-only":
            keep = fn.v(f"fcmp ogt float {fabs(fn, h)}, %threshold", "keep")
        else:
            keep = "true"
        h = fn.v(f"select i1 {keep}, float {h}, float 0.0", "h")
        fn.store(F32, h, hp, 4)
        nz = fn.v(f"zext i1 {fn.v(f'fcmp one float {h}, 0.0', 'nz')} to i8", "nz8")
        lp = fn.gep(self.live, i)
        fn.store("i8", fn.v(f"or i8 {fn.load('i8', lp, 1, 'lv')}, {nz}", "lv"), lp, 1)

    # -- phase 2: Y[s, c0:c1] = sum_i h[s, i] down_t[i, c0:c1] (+ bias) for this thread's columns

    def column_phase(self) -> None:
        """This thread's columns of every token's row of Y, the live neurons ``_GROUP`` at a time:
        their slices of down_t dequantised side by side, and each token's row of Y loaded and
        stored once per group (not once per neuron: with Y rows of 32 tokens out of L1, that
        traffic was most of the kernel)."""
        fn, seq, hidden = self.fn, self.seq, self.hidden
        self.c0, c1 = chunk_bounds(fn, hidden, self.tid, self.nthreads, align=32)
        self.width = fn.v(f"sub i64 {c1}, {self.c0}", "width")
        self.w16 = fn.v(f"and i64 {self.width}, -16", "w16")
        self.ybytes = fn.v(f"shl i64 {hidden}, 2", "yrowb")
        with fn.loop("0", seq, hint="s") as s:
            fn.emit(f"call void @llvm.memset.p0.i64(ptr align 4 {self._yrow(s)}, i8 0, i64 "
                    f"{fn.v(f'shl i64 {self.width}, 2', 'wb')}, i1 false)")
        # A block-format down_t is in the rowplanes layout, as the decode kernel reads it: the
        # slice starts at block b0 of each plane; f32 / f16 rows at byte ``first``.
        self.planes = self.down_dtype in rowplanes.DTYPES
        self.b0, self.nblocks = fn.v(f"lshr i64 {self.c0}, 5", "b0"), fn.v(f"lshr i64 {hidden}, 5", "nblk")
        self.first = (fn.v(f"mul i64 {self.c0}, {ELEMENT_BYTES[self.down_dtype]}", "co") if not self.planes
                      else None)
        ids = fn.alloca_array("i32", self.n, "ids")
        total = _list_where(fn, ids, "0", self.n, lambda i: fn.v(
            f"icmp ne i8 {fn.load('i8', fn.gep(self.live, i), 1, 'lv')}, 0", "islive"), "nlive")
        self.dbufs = fn.alloca_array(F32, fn.v(f"mul i64 {self.width}, {_GROUP}", "gw"), "dbufs")

        def group(k: str, size: int) -> None:
            """Neurons ids[k : k + size] into every token's row of Y."""
            neurons = [load_index(fn, ids, fn.v(f"add i64 {k}, {g}", "kg")) for g in range(size)]
            self._add_down_slices(neurons, self._down_slices(neurons))

        _in_groups(fn, total, _GROUP, group, "gend")
        with fn.if_(fn.v("icmp ne ptr %down_bias, null", "hasb")), fn.loop("0", seq, hint="s") as s:
            y = self._yrow(s)
            with fn.loop("0", self.width, hint="j") as j:
                yp = fn.at(y, 4, j)
                b = fn.load(F32, fn.at("%down_bias", 4, fn.v(f"add i64 {self.c0}, {j}", "cj")), 4, "b")
                fn.store(F32, fn.v(f"fadd float {fn.load(F32, yp, 4, 'y')}, {b}", "yb"), yp, 4)

    def _yrow(self, s: str) -> str:
        """This thread's columns of token s's row of Y."""
        fn = self.fn
        return fn.at(fn.gep("%y", fn.v(f"mul i64 {s}, {self.ybytes}", "yo")), 4, self.c0, "yr")

    def _down_slices(self, neurons: list[str]) -> list[str]:
        """The neurons' slices of down_t, dequantised to f32 buffers of the columns' width."""
        fn = self.fn
        rows = [fn.at(self.dbufs, 4, fn.v(f"mul i64 {self.width}, {g}", "go"), "db") for g in range(len(neurons))]
        for i, buf in zip(neurons, rows, strict=True):
            drow = self.row("%down", self.rb_down, i, "dr", "do")
            if self.planes:
                rowplanes.emit_row_to_f32(fn, self.down_dtype, drow, self.nblocks, self.b0, buf, self.width)
            else:
                assert self.first is not None
                emit_row_to_f32(fn, self.down_dtype, fn.gep(drow, self.first, "dr"), buf, self.width, self.simd)
        return rows

    def _add_down_slices(self, neurons: list[str], rows: list[str]) -> None:
        """Y[s] += sum h[s, i] row_i over the neurons, for each token s where one of the h is not 0."""
        fn = self.fn
        with fn.loop("0", self.seq, hint="s") as s:
            hs = [fn.load(F32, self.h_at(s, i), 4, "h") for i in neurons]
            with fn.if_(any_nonzero(fn, hs, "nz")):
                y = self._yrow(s)
                hvs = [fn.splat(16, h) for h in hs]
                with fn.loop("0", self.w16, "16", "j") as j:
                    yp = fn.at(y, 4, j)
                    acc = fn.load(_V16, yp, 4, "y")
                    for hv, buf in zip(hvs, rows, strict=True):
                        acc = fn.fma(_V16, hv, fn.load(_V16, fn.at(buf, 4, j), 4, "d"), acc)
                    fn.store(_V16, acc, yp, 4)
                with fn.loop(self.w16, self.width, hint="j") as j:
                    yp = fn.at(y, 4, j)
                    acc = fn.load(F32, yp, 4, "y")
                    for h, buf in zip(hs, rows, strict=True):
                        acc = fn.fma(F32, h, fn.load(F32, fn.at(buf, 4, j), 4, "d"), acc)
                    fn.store(F32, acc, yp, 4)
