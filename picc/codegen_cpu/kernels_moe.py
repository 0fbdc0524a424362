"""A mixture of experts for one token (``picc.ir.ops.MoE``): the router, its top-k, the experts.

One call computes ``y = sum_j w_j down_e_j(h_e_j(x))`` over the ``top_k`` experts the router
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
the ``_xi16`` GEMVs). The sums' order is the interpreter's up to float rounding (it adds the
experts' outputs, then the residual).
"""

from __future__ import annotations

from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.ffn_emitter import emit_h, gated_form
from picc.codegen_cpu.int16x import alloc_int_x, emit_int_x, fill_int_x
from picc.codegen_cpu.irtext import F32, I32, Fn, chunk_bounds, fconst
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowformats import check_dtype, emit_row_bytes
from picc.codegen_cpu.rowops import alloc_x_sums, emit_tiled_rows, emit_x_sums, fill_x_sums
from picc.errors import PiccError

MOE_PARAMS = (("x", "ptr"), ("router", "ptr"), ("up", "ptr"), ("gate", "ptr"), ("down", "ptr"), ("y", "ptr"),
              ("scratch", "ptr"), ("n_experts", "i32"), ("top_k", "i32"), ("n", "i32"), ("hidden", "i32"),
              ("norm", "i32"))


def moe_scratch_bytes(n_experts: int, top_k: int, n: int) -> int:
    """The router's logits (padded to a 64-byte line), then ``h`` of each chosen expert."""
    return 4 * (-(-n_experts // 16) * 16 + top_k * n)


@cache
def moe(form: str, router_dtype: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
        x_format: str = "f32") -> Kernel:
    """``y = sum_j w_j down_e_j(h_e_j(x))`` over the router's top ``top_k`` of ``n_experts``
    experts of ``n`` neurons (see module doc); ``norm``: the weights divided by their sum."""
    spec = gated_form(form, gate_dtype)
    for d in (router_dtype, up_dtype, gate_dtype or up_dtype, down_dtype):
        check_dtype(d)
    if x_format not in ("f32", "i16"):
        raise PiccError(f"codegen_cpu: a mixture's rows are dotted with f32 or i16 x, not {x_format!r}")
    symbol = names.cpu_moe(form, router_dtype, up_dtype, gate_dtype, down_dtype, x_format)
    rounds = x_format != "f32"

    def emit(simd: str) -> str:
        fn = kernel_fn(symbol, MOE_PARAMS)
        n_exp, k, n, hidden = (fn.sext(f"%{p}") for p in ("n_experts", "top_k", "n", "hidden"))
        tid, nthreads = fn.sext("%tid"), fn.sext("%nthreads")
        logits = "%scratch"
        h_all = fn.at("%scratch", 4, fn.v(f"and i64 {fn.v(f'add i64 {n_exp}, 15', 'e16')}, -16", "epad"), "h")
        # 1. the router's logits
        lo, hi = chunk_bounds(fn, n_exp, tid, nthreads)
        emit_tiled_rows(fn, [(router_dtype, "%router", emit_row_bytes(fn, router_dtype, hidden))], "%x", hidden,
                        lo, hi, simd, lambda r, dots: fn.store(F32, dots[0], fn.at(logits, 4, r), 4))
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 2. the top k and their weights, in every thread
        chosen, weights = _top_k(fn, logits, n_exp, k)
        # 3. each chosen expert's h
        experts_x = {up_dtype, gate_dtype or up_dtype}
        x_int = emit_int_x(fn, "%x", hidden, experts_x) if rounds else None
        x_sums = None if x_int is not None else emit_x_sums(fn, "%x", hidden, experts_x)
        lo, hi = chunk_bounds(fn, n, tid, nthreads)
        mats = [(up_dtype, "%up"), *([(gate_dtype, "%gate")] if gate_dtype else [])]
        row_bytes = [emit_row_bytes(fn, d, hidden) for d, _ in mats]
        with fn.loop("0", k, hint="j") as j:
            e = fn.sext(fn.load(I32, fn.at(chosen, 4, j), 4, "e"), "e")
            first = fn.v(f"mul i64 {e}, {n}", "row0")  # the expert's first row of up and gate
            experts = [(d, fn.gep(base, fn.v(f"mul i64 {first}, {rb}", "off"), "mat"), rb)
                       for (d, base), rb in zip(mats, row_bytes, strict=True)]
            h = fn.at(h_all, 4, fn.v(f"mul i64 {j}, {n}", "hj"), "hrow")

            def store_h(r: str, dots: list[str], h: str = h) -> None:
                a = fn.v(f"call float @picc_act_{spec.act}(float {dots[1]})", "a") if spec.gated else None
                fn.store(F32, emit_h(fn, spec, a, dots[0]), fn.at(h, 4, r), 4)

            emit_tiled_rows(fn, experts, "%x", hidden, lo, hi, simd, store_h, xsums=x_sums, intx=x_int)
        fn.emit("call void @picc_barrier(ptr %sync, i32 %nthreads)")
        # 4. y, expert after expert
        lo, hi = chunk_bounds(fn, hidden, tid, nthreads)
        with fn.loop(lo, hi, hint="r") as r:
            fn.store(F32, fconst(0.0), fn.at("%y", 4, r), 4)
        nblocks = fn.v(f"lshr i64 {n}, 5", "nblk")
        h_int = alloc_int_x(fn, nblocks, {down_dtype}) if rounds else None
        h_sums = None if h_int is not None else alloc_x_sums(fn, nblocks, {down_dtype})
        down_bytes = emit_row_bytes(fn, down_dtype, n)
        with fn.loop("0", k, hint="j") as j:
            e = fn.sext(fn.load(I32, fn.at(chosen, 4, j), 4, "e"), "e")
            w = fn.load(F32, fn.at(weights, 4, j), 4, "w")
            down = fn.gep("%down", fn.v(f"mul i64 {fn.v(f'mul i64 {e}, {hidden}', 'drow0')}, {down_bytes}", "doff"),
                          "down")
            h = fn.at(h_all, 4, fn.v(f"mul i64 {j}, {n}", "hj"), "hrow")
            if h_int is not None:
                fill_int_x(fn, h, nblocks, h_int)
            elif h_sums is not None:
                fill_x_sums(fn, h, nblocks, h_sums)

            def add_row(r: str, dots: list[str], w: str = w) -> None:
                yp = fn.at("%y", 4, r, "yp")
                fn.store(F32, fn.fma(F32, w, dots[0], fn.load(F32, yp, 4, "y")), yp, 4)

            emit_tiled_rows(fn, [(down_dtype, down, down_bytes)], h, n, lo, hi, simd, add_row, xsums=h_sums,
                            intx=h_int)
        fn.ret_void()
        return fn.text()

    return Kernel(symbol, MOE_PARAMS, emit, moe.__doc__ or "")


def _top_k(fn: Fn, logits: str, n_exp: str, k: str) -> tuple[str, str]:
    """The ``k`` largest of ``n_exp`` logits (the lower index first among equals) and their
    softmax weights, normalised over the k where ``%norm``: two stack arrays (i32, f32)."""
    top = fn.var(F32, fconst(float("-inf")), "top")
    with fn.loop("0", n_exp, hint="e") as e:
        logit = fn.load(F32, fn.at(logits, 4, e), 4, "l")
        top.set(fn.v(f"call float @llvm.maxnum.f32(float {top.get()}, float {logit})", "top"))
    m = top.get("max")
    total = fn.var(F32, fconst(0.0), "total")
    with fn.loop("0", n_exp, hint="e") as e:
        shifted = fn.v(f"fsub float {fn.load(F32, fn.at(logits, 4, e), 4, 'l')}, {m}", "ls")
        total.set(fn.v(f"fadd float {total.get()}, {fn.v(f'call float @picc_exp(float {shifted})', 'p')}", "total"))
    chosen, weights = fn.alloca_array(I32, k, "chosen"), fn.alloca_array(F32, k, "weights")
    taken = fn.alloca_array("i8", n_exp, "taken")
    with fn.loop("0", n_exp, hint="e") as e:
        fn.store("i8", "0", fn.at(taken, 1, e), 1)
    chosen_sum = fn.var(F32, fconst(0.0), "wsum")
    with fn.loop("0", k, hint="j") as j:
        best, best_logit = fn.var("i64", "-1", "best"), fn.var(F32, fconst(0.0), "bestl")
        with fn.loop("0", n_exp, hint="e") as e:
            logit = fn.load(F32, fn.at(logits, 4, e), 4, "l")
            free = fn.v(f"icmp eq i8 {fn.load('i8', fn.at(taken, 1, e), 1, 't')}, 0", "free")
            # the first free one, then any larger (strictly: equals keep the lower index)
            larger = fn.v(f"fcmp ogt float {logit}, {best_logit.get()}", "gt")
            unset = fn.v(f"icmp eq i64 {best.get()}, -1", "unset")
            with fn.if_(fn.v(f"and i1 {free}, {fn.v(f'or i1 {larger}, {unset}', 'better')}", "take"), "pick"):
                best.set(e)
                best_logit.set(logit)
        b = best.get("b")
        fn.store("i8", "1", fn.at(taken, 1, b), 1)
        fn.store(I32, fn.v(f"trunc i64 {b} to i32", "b32"), fn.at(chosen, 4, j), 4)
        shifted = fn.v(f"fsub float {best_logit.get()}, {m}", "ls")
        p = fn.v(f"fdiv float {fn.v(f'call float @picc_exp(float {shifted})', 'e')}, {total.get()}", "p")
        fn.store(F32, p, fn.at(weights, 4, j), 4)
        chosen_sum.set(fn.v(f"fadd float {chosen_sum.get()}, {p}", "wsum"))
    with fn.if_(fn.v("icmp ne i32 %norm, 0", "norm"), "norm"):
        s = chosen_sum.get("s")
        with fn.loop("0", k, hint="j") as j:
            wp = fn.at(weights, 4, j)
            fn.store(F32, fn.v(f"fdiv float {fn.load(F32, wp, 4, 'w')}, {s}", "wn"), wp, 4)
    return chosen, weights
