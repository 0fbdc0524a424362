"""A mixture of experts (``picc.ir.ops.MoE``): the router, its top-k, the experts, for a token
(:func:`moe`) and for a prompt's chunk of tokens (:func:`moe_chunk`, the same bits a token).

One call of :func:`moe` computes ``y = sum_j w_j down_e_j(h_e_j(x))`` over the ``top_k`` experts the router
ranks first, in four steps and two barriers:

1. Threads split the router's ``n_experts`` rows: its logits go to the scratch.
2. Every thread takes the softmax's maximum and sum and picks the top k by logit (the lower
   index first among equals, as the interpreter's stable sort), into its own stack arrays: the
   same values in every thread, so no barrier and no thread writes what another reads. The
   weights are ``exp(l_e - max) / sum``, divided by their own sum where ``norm`` is set.
3. Threads split each chosen expert's ``n`` rows of up (and gate): ``h`` of the form, expert
   after expert, into the scratch (k rows of n floats). Barrier.
4. Threads split the ``hidden`` output rows: ``y[r] = sum_j w_j (down_e_j[r] . h_j)``, expert
   after expert in the order chosen.

The experts' matrices are stacked (expert e's rows of up and gate at ``e n``, of down at
``e hidden``); a chosen expert's rows are found by offsets computed at run time, so the kernel
reads the rows of its ``top_k`` experts and the router, nothing else. Rows are dotted with float
x (:func:`~picc.codegen_cpu.rowops.emit_tiled_rows`), in the source layout, or, with ``x_format``
``"i16"``, 4-bit rows with x (and each expert's h) rounded to int16 per block, in integers (as
the ``_xi16`` GEMVs); with ``rows8`` too, the experts' 4-bit matrices in the rows8 layout, eight
rows at a time (:func:`~picc.codegen_cpu.rows8.emit_rows8`, as the ``_r8_xi16`` GEMVs; an
expert's rows are a whole number of groups), the others (a Q4_K_M file's q8_0 down rows) one at
a time. The sums' order is the interpreter's up to float rounding (it adds the experts' outputs,
then the residual).

The variants (``picc.kernel_names.MoeVariant``) take more arguments after the common ones:
gpt-oss's biases (a pointer each, in the order router, up, gate, down; each expert's slice found
as its rows are) and its clamped SwiGLU's ``alpha`` and ``limit``
(``picc.interpreter.clamped_swiglu``); Qwen2-MoE's ``n_shared`` shared experts, stacked after the
routed ones, which every token takes after its top k (step 2), weighted by 1 or, ``gated``, by the
sigmoid of the router's extra last row's logit (computed with the others in step 1); ERNIE 4.5's
``choice_bias``, added to each expert's probability to rank them in step 2 (their weights stay
the probabilities); DeepSeek's and GLM-4.5's routing in step 2: ``sigmoid`` probabilities in
place of the softmax, the experts ranked by their probabilities (plus the choice bias) once
into the thread's stack, ``n_group`` groups scored by their largest or two largest ranks of
which the ``topk_group`` best hold the eligible experts (the others marked taken before the top
k), and the routed weights times ``routed_scale`` after the renormalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.ffn_emitter import emit_h, gated_form
from picc.codegen_cpu.int16x import alloc_int_x, fill_int_x
from picc.codegen_cpu.irtext import F32, I32, Fn, chunk_bounds, fconst
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowformats import check_dtype, emit_row_bytes
from picc.codegen_cpu.rowops import alloc_x_sums, emit_tiled_rows, fill_x_sums
from picc.codegen_cpu.rows8 import emit_group_bytes, emit_rows8
from picc.errors import PiccError
from picc.ir.ops import FfnForm
from picc.kernel_names import PLAIN_MOE, MoeVariant
from runtime.cpu import vector_isa

MOE_PARAMS = (("x", "ptr"), ("router", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("y", "ptr"),
              ("scratch", "ptr"), ("n_experts", "i32"), ("top_k", "i32"), ("n", "i32"), ("hidden", "i32"),
              ("norm", "i32"))
# moe_chunk: the same for ``seq`` tokens, x and y rows ``x_stride`` and ``y_stride`` bytes apart
CHUNK_PARAMS = (("seq", "i32"), ("x_stride", "i32"), ("y_stride", "i32"))
BIAS_PARAMS = {"r": "router_bias", "u": "up_bias", "g": "gate_bias", "d": "down_bias"}
CLAMP_PARAMS = (("alpha", "f32"), ("limit", "f32"))
SHARED_PARAMS = (("n_shared", "i32"),)
CHOICE_BIAS_PARAMS = (("choice_bias", "ptr"),)
GROUP_PARAMS = (("n_group", "i32"), ("topk_group", "i32"))
SCALE_PARAMS = (("routed_scale", "f32"),)


def moe_params(variant: MoeVariant = PLAIN_MOE) -> tuple[tuple[str, str], ...]:
    """The one-token kernel's parameters: :data:`MOE_PARAMS`, then a pointer per bias of the
    variant's, the clamped SwiGLU's constants, the shared experts' count, the choice bias, the
    groups' counts, the routed weights' scale."""
    return (MOE_PARAMS + tuple((BIAS_PARAMS[c], "ptr") for c in variant.biases)
            + (CLAMP_PARAMS if variant.clamped else ()) + (SHARED_PARAMS if variant.shared else ())
            + (CHOICE_BIAS_PARAMS if variant.choice_bias else ()) + (GROUP_PARAMS if variant.groups else ())
            + (SCALE_PARAMS if variant.scaled else ()))


def moe_scratch_bytes(router_rows: int, chosen: int, n: int) -> int:
    """The router's logits (padded to a 64-byte line), then ``h`` of each chosen expert (the top k
    and the shared ones)."""
    return 4 * (_padded(router_rows) + chosen * n)


def moe_chunk_scratch_bytes(router_rows: int, chosen: int, n: int, hidden: int, seq: int) -> int:
    """Each token's logits (padded), its chosen experts' h, and their down rows' dot products."""
    return 4 * seq * (_padded(router_rows) + chosen * n + chosen * hidden)


def _padded(n_experts: int) -> int:
    return -(-n_experts // 16) * 16


@dataclass(frozen=True)
class _Experts:
    """What the phases of both kernels share: the form, the formats, the rows' layout in bytes."""

    spec: FfnForm
    router: str
    up: str
    gate: str | None
    down: str
    rounds: bool
    rows8: bool
    variant: MoeVariant = PLAIN_MOE

    @property
    def rows8_in(self) -> bool:
        """Up (and gate) in the rows8 layout: ``rows8`` and 4-bit (mxfp4 too: the rows8 experts dot int16 x)."""
        return self.rows8 and {self.up, self.gate or self.up} <= names.I16_ROWS8_DTYPES

    @property
    def rows8_down(self) -> bool:
        return self.rows8 and self.down in names.I16_ROWS8_DTYPES

    def check(self) -> None:
        for d in (self.router, self.up, self.gate or self.up, self.down):
            check_dtype(d)
        if self.rows8 and not (self.rounds and (self.rows8_in or self.rows8_down)):
            raise PiccError("codegen_cpu: a mixture's experts are read in the rows8 layout where they are 4-bit, "
                            "with int16 x")
        biases = self.variant.biases
        if not set(biases) <= set(BIAS_PARAMS) or list(biases) != sorted(biases, key="rugd".index) \
                or ("g" in biases and self.gate is None):
            raise PiccError(f"codegen_cpu: a mixture's biases are letters of 'rugd' in that order (g with a gate), "
                            f"not {biases!r}")
        if self.variant.clamped and not (self.spec.gated and self.spec.act == "silu" and not self.spec.act_on_up):
            raise PiccError("codegen_cpu: the clamped SwiGLU is form swiglu's")
        if self.variant.shared not in ("", "plain", "gated") or (self.variant.shared == "gated" and "r" in biases):
            raise PiccError(f"codegen_cpu: shared experts are plain or gated (a gated one without a router bias), "
                            f"not {self.variant.shared!r} with biases {biases!r}")
        if self.variant.scoring not in ("softmax", "sigmoid") or self.variant.groups not in ("", "max", "top2"):
            raise PiccError(f"codegen_cpu: a router scores by softmax or sigmoid and its groups by max or top2, "
                            f"not {self.variant.scoring!r} and {self.variant.groups!r}")


def _kernel(form: str, router: str, up: str, gate: str | None, down: str, x_format: str, rows8: bool,
            variant: MoeVariant) -> _Experts:
    spec = gated_form(form, gate)
    if x_format not in ("f32", "i16"):
        raise PiccError(f"codegen_cpu: a mixture's rows are dotted with f32 or i16 x, not {x_format!r}")
    experts = _Experts(spec, router, up, gate, down, x_format != "f32", rows8, variant)
    experts.check()
    return experts


@cache
def moe(form: str, router_dtype: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
        x_format: str = "f32", rows8: bool = False, variant: MoeVariant = PLAIN_MOE) -> Kernel:
    """``y = sum_j w_j down_e_j(h_e_j(x))`` over the router's top ``top_k`` of ``n_experts``
    experts of ``n`` neurons (see module doc); ``norm``: the weights divided by their sum."""
    ex = _kernel(form, router_dtype, up_dtype, gate_dtype, down_dtype, x_format, rows8, variant)
    symbol = names.cpu_moe(form, router_dtype, up_dtype, gate_dtype, down_dtype, x_format, rows8, variant)
    params = moe_params(variant)

    def emit(level: str) -> str:
        fn = kernel_fn(symbol, params, level if rows8 else None)
        p = _Phases(fn, ex, level)
        # 1. the router's logits
        p.router_logits("%x", p.logits)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 2. the top k and their weights, in every thread
        chosen, weights, taken = p.choice_arrays(1)
        p.choose(p.logits, chosen, weights, taken)
        # 3. each chosen expert's h (x in the experts' form once for all of them)
        p.prepare_x("%x")
        with fn.loop("0", p.k, hint="j") as j:
            p.expert_h(fn.load(I32, fn.at(chosen, 4, j), 4, "e"), "%x", p.h_row(j))
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 4. y, expert after expert
        with fn.loop(p.lo_y, p.hi_y, hint="r") as r:
            fn.store(F32, fconst(0.0), fn.at("%y", 4, r), 4)
        with fn.loop("0", p.k, hint="j") as j:
            w = fn.load(F32, fn.at(weights, 4, j), 4, "w")

            def add_row(r: str, dots: list[str], w: str = w) -> None:
                yp = fn.at("%y", 4, r, "yp")
                fn.store(F32, fn.fma(F32, w, dots[0], fn.load(F32, yp, 4, "y")), yp, 4)

            p.expert_down(fn.load(I32, fn.at(chosen, 4, j), 4, "e"), p.h_row(j), add_row)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, moe.__doc__ or "", by_level=rows8)


@cache
def moe_chunk(form: str, router_dtype: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
              x_format: str = "f32", rows8: bool = False, variant: MoeVariant = PLAIN_MOE) -> Kernel:
    """:func:`moe` for each of ``seq`` tokens (a prompt's chunk), its bits for each token, the
    experts taken in turn: the rows of an expert that some tokens chose are dotted with those
    tokens' x one after another (from the cache, after the first), where token after token
    read their experts from memory each time. Each token's down dot products are kept and
    added in its own order of experts at the end, so that its output is the one-token kernel's."""
    ex = _kernel(form, router_dtype, up_dtype, gate_dtype, down_dtype, x_format, rows8, variant)
    symbol = names.cpu_moe(form, router_dtype, up_dtype, gate_dtype, down_dtype, x_format, rows8, variant) + "_chunk"
    params = moe_params(variant) + CHUNK_PARAMS

    def emit(level: str) -> str:
        fn = kernel_fn(symbol, params, level if rows8 else None)
        p = _Phases(fn, ex, level)
        seq = fn.sext("%seq")
        x_stride, y_stride = fn.sext("%x_stride"), fn.sext("%y_stride")
        e_pad = p.e_pad
        h_all = fn.at("%scratch", 4, fn.v(f"mul i64 {seq}, {e_pad}", "lall"), "hall")
        d_all = fn.at(h_all, 4, fn.v(f"mul i64 {seq}, {fn.v(f'mul i64 {p.k}, {p.n}', 'kn')}", "hsz"), "dall")

        def x_of(t: str) -> str:
            return fn.gep("%x", fn.v(f"mul i64 {t}, {x_stride}", "xo"), "xt")

        def slot(t: str, j: str) -> str:  # token t's j-th choice
            return fn.v(f"add i64 {fn.v(f'mul i64 {t}, {p.k}', 'tk')}, {j}", "slot")

        # 1. every token's logits
        with fn.loop("0", seq, hint="t") as t:
            p.router_logits(x_of(t), fn.at("%scratch", 4, fn.v(f"mul i64 {t}, {e_pad}", "lo"), "lrow"))
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 2. every token's choice, in every thread
        chosen, weights, taken = p.choice_arrays(seq)
        with fn.loop("0", seq, hint="t") as t:
            at = fn.v(f"mul i64 {t}, {p.k}", "tk")
            p.choose(fn.at("%scratch", 4, fn.v(f"mul i64 {t}, {e_pad}", "lo"), "lrow"), fn.at(chosen, 4, at, "ch"),
                     fn.at(weights, 4, at, "wt"), taken)
        # 3. h of each (token, choice), expert after expert
        with fn.loop("0", p.n_all, hint="e") as e, fn.loop("0", seq, hint="t") as t, \
                fn.loop("0", p.k, hint="j") as j:
            s = slot(t, j)
            e32 = fn.v(f"trunc i64 {e} to i32", "e32")
            with fn.if_(fn.v(f"icmp eq i32 {fn.load(I32, fn.at(chosen, 4, s), 4, 'c')}, {e32}", "mine"), "use"):
                p.prepare_x(x_of(t))
                p.expert_h(e32, x_of(t), fn.at(h_all, 4, fn.v(f"mul i64 {s}, {p.n}", "ho"), "hrow"))
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 4. the down rows' dot products of each (token, choice), expert after expert
        with fn.loop("0", p.n_all, hint="e") as e, fn.loop("0", seq, hint="t") as t, \
                fn.loop("0", p.k, hint="j") as j:
            s = slot(t, j)
            e32 = fn.v(f"trunc i64 {e} to i32", "e32")
            with fn.if_(fn.v(f"icmp eq i32 {fn.load(I32, fn.at(chosen, 4, s), 4, 'c')}, {e32}", "mine"), "use"):
                d = fn.at(d_all, 4, fn.v(f"mul i64 {s}, {p.hidden}", "do"), "drow")
                p.expert_down(e32, fn.at(h_all, 4, fn.v(f"mul i64 {s}, {p.n}", "ho"), "hrow"),
                              lambda r, dots, d=d: fn.store(F32, dots[0], fn.at(d, 4, r), 4))
        # 5. each token's y from its own rows of the dot products (no barrier: the thread's rows)
        with fn.loop("0", seq, hint="t") as t, fn.loop(p.lo_y, p.hi_y, hint="r") as r:
            acc = fn.var(F32, fconst(0.0), "y")
            with fn.loop("0", p.k, hint="j") as j:
                s = slot(t, j)
                at = fn.v(f"add i64 {fn.v(f'mul i64 {s}, {p.hidden}', 'do')}, {r}", "dr")
                dot = fn.load(F32, fn.at(d_all, 4, at), 4, "d")
                acc.set(fn.fma(F32, fn.load(F32, fn.at(weights, 4, s), 4, "w"), dot, acc.get()))
            yrow = fn.gep("%y", fn.v(f"mul i64 {t}, {y_stride}", "yo"), "yt")
            fn.store(F32, acc.get(), fn.at(yrow, 4, r), 4)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, params, emit, moe_chunk.__doc__ or "", by_level=rows8)


class _Phases:
    """The phases of a mixture's kernels in ``fn`` (see module doc), for any x and its rows;
    ``level``: the SIMD level of the code (VNNI's integer products for rows8 experts at
    ``avx512-vnni``)."""

    def __init__(self, fn: Fn, ex: _Experts, level: str) -> None:
        self.fn, self.ex, self.simd, self.vnni = fn, ex, vector_isa(level), level == "avx512-vnni"
        self.n_exp, self.k_routed, self.n, self.hidden = (fn.sext(f"%{p}") for p in ("n_experts", "top_k", "n",
                                                                                      "hidden"))
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        # the experts a token takes: its top k, then the shared ones (stacked after the routed); the
        # router's rows: the routed experts', then a gated shared expert's gate
        shared = ex.variant.shared
        self.n_shared = fn.sext("%n_shared") if shared else "0"
        self.k = fn.v(f"add i64 {self.k_routed}, {self.n_shared}", "kall") if shared else self.k_routed
        self.n_all = fn.v(f"add i64 {self.n_exp}, {self.n_shared}", "nall") if shared else self.n_exp
        router_rows = fn.v(f"add i64 {self.n_exp}, 1", "nrouter") if shared == "gated" else self.n_exp
        self.logits = "%scratch"
        self.e_pad = fn.v(f"and i64 {fn.v(f'add i64 {router_rows}, 15', 'e16')}, -16", "epad")  # a token's logits
        self.h_all = fn.at("%scratch", 4, self.e_pad, "h")
        self.lo_r, self.hi_r = chunk_bounds(fn, router_rows, tid, nthreads)
        self.lo_n, self.hi_n = chunk_bounds(fn, self.n, tid, nthreads)
        self.lo_y, self.hi_y = chunk_bounds(fn, self.hidden, tid, nthreads)
        # rows8: the threads' shares of an expert's groups of eight rows (up and gate; down); the
        # output rows a thread writes are then its groups' (lo_y, hi_y: whatever the layout)
        self.lo_gn, self.hi_gn = chunk_bounds(fn, fn.v(f"lshr i64 {self.n}, 3", "groups"), tid, nthreads)
        self.lo_gy, self.hi_gy = chunk_bounds(fn, fn.v(f"lshr i64 {self.hidden}, 3", "groups"), tid, nthreads)
        if ex.rows8_down:
            self.lo_y, self.hi_y = fn.v(f"shl i64 {self.lo_gy}, 3", "ylo"), fn.v(f"shl i64 {self.hi_gy}, 3", "yhi")
        self.router_bytes = emit_row_bytes(fn, ex.router, self.hidden)
        self.mats = [(ex.up, "%up"), *([(ex.gate, "%gate")] if ex.gate else [])]
        # bytes of one row (rows) or one group of eight (rows8)
        in_bytes = emit_group_bytes if ex.rows8_in else emit_row_bytes
        self.row_bytes = [in_bytes(fn, d, self.hidden) for d, _ in self.mats]
        self.down_bytes = (emit_group_bytes if ex.rows8_down else emit_row_bytes)(fn, ex.down, self.n)
        # x's and h's forms for the dot products, in the thread's stack, filled where each is dotted
        hblocks, xblocks = fn.v(f"lshr i64 {self.n}, 5", "nblk"), fn.v(f"lshr i64 {self.hidden}, 5", "xblk")
        experts_x = {ex.up, ex.gate or ex.up}
        self.router_sums = alloc_x_sums(fn, xblocks, {ex.router})
        self.x_int = alloc_int_x(fn, xblocks, experts_x, rows8=ex.rows8_in) if ex.rounds else None
        self.x_sums = None if self.x_int is not None else alloc_x_sums(fn, xblocks, experts_x)
        self.h_int = alloc_int_x(fn, hblocks, {ex.down}, rows8=ex.rows8_down) if ex.rounds else None
        self.h_sums = None if self.h_int is not None else alloc_x_sums(fn, hblocks, {ex.down})
        self.xblocks, self.hblocks = xblocks, hblocks

    def h_row(self, j: str) -> str:
        return self.fn.at(self.h_all, 4, self.fn.v(f"mul i64 {j}, {self.n}", "hj"), "hrow")

    def choice_arrays(self, tokens: int | str) -> tuple[str, str, _Scratch]:
        """Stack arrays for ``tokens`` tokens' choices and weights (k each) and a token's scratch
        of choosing."""
        fn, variant = self.fn, self.ex.variant
        count = fn.v(f"mul i64 {tokens}, {self.k}", "nk")
        chosen, weights = fn.alloca_array(I32, count, "chosen"), fn.alloca_array(F32, count, "weights")
        taken = fn.alloca_array("i8", self.n_exp, "taken")
        keys = fn.alloca_array(F32, self.n_exp, "keys") if variant.ranks_by_probability else None
        groups = None
        if variant.groups:
            n_group = fn.sext("%n_group", "ngroup")
            groups = (n_group, fn.alloca_array(F32, n_group, "gscore"), fn.alloca_array("i8", n_group, "gtaken"))
        return chosen, weights, _Scratch(taken, keys, groups)

    def choose(self, logits: str, chosen: str, weights: str, scratch: _Scratch) -> None:
        """A token's experts and weights from its ``logits``: the top k (:func:`_top_k`), then the
        shared experts with weight 1, or the sigmoid of the logit after the routed experts'."""
        fn, shared = self.fn, self.ex.variant.shared
        _top_k(fn, logits, self.n_exp, self.k_routed, chosen, weights, scratch, self.ex.variant)
        if not shared:
            return
        weight = fconst(1.0)
        if shared == "gated":
            gate = fn.load(F32, fn.at(logits, 4, self.n_exp), 4, "sgl")
            e = fn.v(f"call float @picc_exp(float {fn.v(f'fneg float {gate}', 'nsg')})", "sge")
            weight = fn.v(f"fdiv float 1.0, {fn.v(f'fadd float 1.0, {e}', 'sgd')}", "sgw")
        with fn.loop("0", self.n_shared, hint="s") as s:
            at = fn.v(f"add i64 {self.k_routed}, {s}", "sat")
            fn.store(I32, fn.v(f"trunc i64 {fn.v(f'add i64 {self.n_exp}, {s}', 'se')} to i32", "se32"),
                     fn.at(chosen, 4, at), 4)
            fn.store(F32, weight, fn.at(weights, 4, at), 4)

    def router_logits(self, x: str, out: str) -> None:
        """The thread's share of x's router logits into ``out``."""
        fn = self.fn
        if self.router_sums is not None:
            fill_x_sums(fn, x, self.xblocks, self.router_sums)
        emit_tiled_rows(fn, [(self.ex.router, "%router", self.router_bytes)], x, self.hidden, self.lo_r, self.hi_r,
                        self.simd, lambda r, dots: fn.store(F32, self.biased("r", dots[0], r), fn.at(out, 4, r), 4),
                        xsums=self.router_sums)

    def biased(self, which: str, value: str, index: str) -> str:
        """``value`` plus element ``index`` (i64) of bias ``which`` (a letter of ``BIAS_PARAMS``),
        where the kernel has it."""
        if which not in self.ex.variant.biases:
            return value
        fn = self.fn
        b = fn.load(F32, fn.at(f"%{BIAS_PARAMS[which]}", 4, index), 4, "bias")
        return fn.v(f"fadd float {value}, {b}", "biased")

    def prepare_x(self, x: str) -> None:
        """``x`` in the form the experts' rows dot (rounded, or its block sums), for :meth:`expert_h`."""
        if self.x_int is not None:
            fill_int_x(self.fn, x, self.xblocks, self.x_int)
        elif self.x_sums is not None:
            fill_x_sums(self.fn, x, self.xblocks, self.x_sums)

    def expert_h(self, e: str, x: str, h: str) -> None:
        """The thread's share of expert ``e``'s (i32) ``h`` of ``x`` (prepared: :meth:`prepare_x`)
        into ``h``."""
        fn, spec = self.fn, self.ex.spec
        rows = fn.v(f"mul i64 {fn.sext(e, 'e')}, {self.n}", "row0")  # the expert's first row of up and gate
        first = fn.v(f"lshr i64 {rows}, 3", "grp0") if self.ex.rows8_in else rows
        experts = [(d, fn.gep(base, fn.v(f"mul i64 {first}, {rb}", "off"), "mat"), rb)
                   for (d, base), rb in zip(self.mats, self.row_bytes, strict=True)]

        def store_h(r: str, dots: list[str]) -> None:
            at = fn.v(f"add i64 {rows}, {r}", "nrow")
            u = self.biased("u", dots[0], at)
            g = self.biased("g", dots[1], at) if spec.gated else None
            if self.ex.variant.clamped:
                assert g is not None
                value = _clamped_swiglu(fn, g, u)
            else:
                a = fn.v(f"call float @picc_act_{spec.act}(float {g})", "a") if g is not None else None
                value = emit_h(fn, spec, a, u)
            fn.store(F32, value, fn.at(h, 4, r), 4)

        if self.ex.rows8_in:
            assert self.x_int is not None
            emit_rows8(fn, experts, self.x_int, self.hidden, self.lo_gn, self.hi_gn, store_h, self.vnni)
        else:
            emit_tiled_rows(fn, experts, x, self.hidden, self.lo_n, self.hi_n, self.simd, store_h,
                            xsums=self.x_sums, intx=self.x_int)

    def expert_down(self, e: str, h: str, consume: Callable[[str, list[str]], None]) -> None:
        """The thread's share of the output rows of expert ``e``'s (i32) down rows dotted with ``h``."""
        fn = self.fn
        if self.h_int is not None:
            fill_int_x(fn, h, self.hblocks, self.h_int)
        elif self.h_sums is not None:
            fill_x_sums(fn, h, self.hblocks, self.h_sums)
        rows = fn.v(f"mul i64 {fn.sext(e, 'e')}, {self.hidden}", "drow0")
        first = fn.v(f"lshr i64 {rows}, 3", "dgrp0") if self.ex.rows8_down else rows
        if "d" in self.ex.variant.biases:
            outer = consume

            def consume(r: str, dots: list[str]) -> None:
                outer(r, [self.biased("d", dots[0], fn.v(f"add i64 {rows}, {r}", "orow"))])

        down = [(self.ex.down, fn.gep("%down", fn.v(f"mul i64 {first}, {self.down_bytes}", "doff"), "down"),
                 self.down_bytes)]
        if self.ex.rows8_down:
            assert self.h_int is not None
            emit_rows8(fn, down, self.h_int, self.n, self.lo_gy, self.hi_gy, consume, self.vnni)
        else:
            emit_tiled_rows(fn, down, h, self.n, self.lo_y, self.hi_y, self.simd, consume, xsums=self.h_sums,
                            intx=self.h_int)


def _clamped_swiglu(fn: Fn, g: str, u: str) -> str:
    """``min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)`` (``%alpha``,
    ``%limit``), in the interpreter's order of operations."""
    g = fn.v(f"call float @llvm.minnum.f32(float {g}, float %limit)", "gc")
    u = fn.v(f"call float @llvm.minnum.f32(float {u}, float %limit)", "uc")
    u = fn.v(f"call float @llvm.maxnum.f32(float {u}, float {fn.v('fneg float %limit', 'nlim')})", "uc")
    ag = fn.v(f"fneg float {fn.v(f'fmul float %alpha, {g}', 'ag')}", "nag")
    den = fn.v(f"fadd float 1.0, {fn.v(f'call float @picc_exp(float {ag})', 'e')}", "den")
    return fn.v(f"fmul float {fn.v(f'fdiv float {g}, {den}', 'glu')}, {fn.v(f'fadd float {u}, 1.0', 'u1')}", "h")


@dataclass(frozen=True)
class _Scratch:
    """A token's scratch of choosing, in the thread's stack: ``taken`` (a byte per expert), the
    experts' ranks ``keys`` (a float each) where they are not the logits, and the groups' count,
    scores (floats) and taken flags (bytes) where the variant has groups."""

    taken: str
    keys: str | None = None
    groups: tuple[str, str, str] | None = None


def _top_k(fn: Fn, logits: str, n_exp: str, k: str, chosen: str, weights: str, scratch: _Scratch,
           variant: MoeVariant) -> None:
    """The ``k`` experts of largest rank among ``n_exp`` (the lower index first among equals)
    into ``chosen`` (i32) and their probabilities into ``weights``, normalised over the k where
    ``%norm``, times ``%routed_scale`` where ``variant.scaled``. The probabilities: the softmax of
    the logits, or (``variant.scoring`` ``"sigmoid"``) each logit's sigmoid. The ranks: the logits,
    or (``variant.ranks_by_probability``) the probabilities plus ``%choice_bias`` where the variant
    has it, computed once into ``scratch.keys``; with ``variant.groups``, only the experts of the
    ``%topk_group`` best groups (:func:`_eligible_groups`) are free to take."""
    taken, softmax = scratch.taken, variant.scoring == "softmax"
    if softmax:
        top = fn.var(F32, fconst(float("-inf")), "top")
        with fn.loop("0", n_exp, hint="e") as e:
            logit = fn.load(F32, fn.at(logits, 4, e), 4, "l")
            top.set(fn.v(f"call float @llvm.maxnum.f32(float {top.get()}, float {logit})", "top"))
        m = top.get("max")
        total = fn.var(F32, fconst(0.0), "total")
        with fn.loop("0", n_exp, hint="e") as e:
            shifted = fn.v(f"fsub float {fn.load(F32, fn.at(logits, 4, e), 4, 'l')}, {m}", "ls")
            total.set(fn.v(f"fadd float {total.get()}, {fn.v(f'call float @picc_exp(float {shifted})', 'p')}",
                           "total"))

    def probability(logit: str) -> str:
        if softmax:
            shifted = fn.v(f"fsub float {logit}, {m}", "ls")
            return fn.v(f"fdiv float {fn.v(f'call float @picc_exp(float {shifted})', 'e')}, {total.get()}", "p")
        e = fn.v(f"call float @picc_exp(float {fn.v(f'fneg float {logit}', 'nl')})", "e")
        return fn.v(f"fdiv float 1.0, {fn.v(f'fadd float 1.0, {e}', 'den')}", "p")

    with fn.loop("0", n_exp, hint="e") as e:
        fn.store("i8", "0", fn.at(taken, 1, e), 1)
    keys = scratch.keys
    if keys is not None:
        with fn.loop("0", n_exp, hint="e") as e:
            key = probability(fn.load(F32, fn.at(logits, 4, e), 4, "l"))
            if variant.choice_bias:
                key = fn.v(f"fadd float {key}, {fn.load(F32, fn.at('%choice_bias', 4, e), 4, 'cb')}", "key")
            fn.store(F32, key, fn.at(keys, 4, e), 4)
    if scratch.groups is not None:
        assert keys is not None
        _eligible_groups(fn, keys, n_exp, taken, variant.groups, *scratch.groups)
    chosen_sum = fn.var(F32, fconst(0.0), "wsum")
    with fn.loop("0", k, hint="j") as j:
        best, best_logit = fn.var("i64", "-1", "best"), fn.var(F32, fconst(0.0), "bestl")
        best_key = fn.var(F32, fconst(0.0), "bestk")
        with fn.loop("0", n_exp, hint="e") as e:
            logit = fn.load(F32, fn.at(logits, 4, e), 4, "l")
            key = logit if keys is None else fn.load(F32, fn.at(keys, 4, e), 4, "key")
            free = fn.v(f"icmp eq i8 {fn.load('i8', fn.at(taken, 1, e), 1, 't')}, 0", "free")
            # the first free one, then any larger (strictly: equals keep the lower index)
            larger = fn.v(f"fcmp ogt float {key}, {best_key.get()}", "gt")
            unset = fn.v(f"icmp eq i64 {best.get()}, -1", "unset")
            with fn.if_(fn.v(f"and i1 {free}, {fn.v(f'or i1 {larger}, {unset}', 'better')}", "take"), "pick"):
                best.set(e)
                best_logit.set(logit)
                best_key.set(key)
        b = best.get("b")
        fn.store("i8", "1", fn.at(taken, 1, b), 1)
        fn.store(I32, fn.v(f"trunc i64 {b} to i32", "b32"), fn.at(chosen, 4, j), 4)
        p = probability(best_logit.get())
        fn.store(F32, p, fn.at(weights, 4, j), 4)
        chosen_sum.set(fn.v(f"fadd float {chosen_sum.get()}, {p}", "wsum"))
    with fn.if_(fn.v("icmp ne i32 %norm, 0", "norm"), "norm"):
        s = chosen_sum.get("s")
        with fn.loop("0", k, hint="j") as j:
            wp = fn.at(weights, 4, j)
            fn.store(F32, fn.v(f"fdiv float {fn.load(F32, wp, 4, 'w')}, {s}", "wn"), wp, 4)
    if variant.scaled:  # after the renormalisation
        with fn.loop("0", k, hint="j") as j:
            wp = fn.at(weights, 4, j)
            fn.store(F32, fn.v(f"fmul float {fn.load(F32, wp, 4, 'w')}, %routed_scale", "ws"), wp, 4)


def _eligible_groups(fn: Fn, keys: str, n_exp: str, taken: str, score: str, n_group: str, scores: str,
                     group_taken: str) -> None:
    """Mark ``taken`` the experts outside the ``%topk_group`` best of the ``n_group`` groups of
    consecutive experts, each group scored by its largest ``keys`` (``score`` ``"max"``) or the
    sum of its two largest (``"top2"``: the largest plus the second), the lower group first among
    equals; ``scores`` and ``group_taken``: ``n_group`` floats and bytes of scratch."""
    size = fn.v(f"sdiv i64 {n_exp}, {n_group}", "gsize")
    with fn.loop("0", n_group, hint="g") as g:
        base = fn.v(f"mul i64 {g}, {size}", "g0")
        first, second = fn.var(F32, fconst(float("-inf")), "first"), fn.var(F32, fconst(float("-inf")), "second")
        with fn.loop("0", size, hint="i") as i:
            key = fn.load(F32, fn.at(keys, 4, fn.v(f"add i64 {base}, {i}", "ge")), 4, "key")
            top = first.get("top")
            if score == "top2":  # a new largest pushes the old one down to second
                above = fn.v(f"fcmp ogt float {key}, {top}", "above")
                rest = fn.v(f"call float @llvm.maxnum.f32(float {second.get()}, float {key})", "rest")
                second.set(fn.v(f"select i1 {above}, float {top}, float {rest}", "second"))
            first.set(fn.v(f"call float @llvm.maxnum.f32(float {top}, float {key})", "first"))
        value = first.get("gmax") if score == "max" else fn.v(f"fadd float {first.get()}, {second.get()}", "gtop2")
        fn.store(F32, value, fn.at(scores, 4, g), 4)
        fn.store("i8", "0", fn.at(group_taken, 1, g), 1)
    with fn.loop("0", fn.sext("%topk_group", "tkg"), hint="j"):
        best, best_score = fn.var("i64", "-1", "bestg"), fn.var(F32, fconst(0.0), "bests")
        with fn.loop("0", n_group, hint="g") as g:
            value = fn.load(F32, fn.at(scores, 4, g), 4, "gs")
            free = fn.v(f"icmp eq i8 {fn.load('i8', fn.at(group_taken, 1, g), 1, 't')}, 0", "free")
            larger = fn.v(f"fcmp ogt float {value}, {best_score.get()}", "gt")
            unset = fn.v(f"icmp eq i64 {best.get()}, -1", "unset")
            with fn.if_(fn.v(f"and i1 {free}, {fn.v(f'or i1 {larger}, {unset}', 'better')}", "take"), "pickg"):
                best.set(g)
                best_score.set(value)
        fn.store("i8", "1", fn.at(group_taken, 1, best.get("bg")), 1)
    with fn.loop("0", n_group, hint="g") as g:  # an expert of a group not taken is out of the choice
        flag = fn.load("i8", fn.at(group_taken, 1, g), 1, "t")
        out = fn.v(f"zext i1 {fn.v(f'icmp eq i8 {flag}, 0', 'out')} to i8", "out8")
        base = fn.v(f"mul i64 {g}, {size}", "g0")
        with fn.loop("0", size, hint="i") as i:
            fn.store("i8", out, fn.at(taken, 1, fn.v(f"add i64 {base}, {i}", "ge")), 1)
