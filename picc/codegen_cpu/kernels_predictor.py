"""The activity predictor of a sparse FFN: one byte per neuron, whether it is predicted active.

``predictor`` evaluates a low-rank MLP, ``mask[i] = fc2 relu(fc1 x + b1) + b2 > threshold``, for
the ``predictor`` mode of :func:`picc.codegen_cpu.kernels_ffn.sparse_ffn` (decode) and of
:func:`picc.codegen_cpu.kernels_prefill.chunk_ffn` (prefill, one call per token of the chunk).
"""

from __future__ import annotations

from functools import cache

from picc import kernel_names as names
from picc.codegen_cpu.ffn_emitter import plus_bias, round_line
from picc.codegen_cpu.irtext import F32, chunk_bounds, fconst, vec
from picc.codegen_cpu.kernel import Kernel, kernel_fn
from picc.codegen_cpu.rowformats import emit_row_bytes
from picc.codegen_cpu.rowops import emit_dots
from picc.errors import PiccError

PREDICT_PARAMS = (("x", "ptr"), ("fc1", "ptr"), ("b1", "ptr"), ("fc2t", "ptr"), ("b2", "ptr"), ("mask", "ptr"),
                  ("scratch", "ptr"), ("hidden", "i32"), ("rank", "i32"), ("n", "i32"), ("threshold", "f32"))


def predictor_scratch_bytes(rank: int) -> int:
    """Bytes of the ``scratch`` buffer :func:`predictor` needs."""
    return round_line(4 * rank)


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
