"""Dense matrix-vector kernels: GEMV (attention projections, LM head), prefill GEMM, predictor.

All share one reduction shape, the *row dot*: ``acc[row] = sum_k W[row, k] * x[k]`` with ``k`` split
as ``kv * vector + kl`` (``vector`` = elements per 16-byte load of the weight format), so the GPU
schedule can give each lane of a warp whole 16-byte chunks of a row (``schedules.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.script import tirx as T

from picc.codegen_cuda.formats import WeightFormat
from picc.codegen_cuda.kernel import Kernel, check_positive, f32, kernel_from_func, make_kernel

RowIndex = Callable[..., tuple[PrimExpr, ...]]


def row_dot(name: str, fmt: WeightFormat, w: list[te.Tensor], x_at: Callable[..., PrimExpr],
            shape: tuple[int, ...], cols: int, row_of: RowIndex | None = None,
            when: Callable[..., PrimExpr] | None = None) -> te.Tensor:
    """``acc[i...] = sum_k W[row_of(i...), k] * x_at(i..., k)``, zero where ``when(i...)`` is false.

    ``shape`` is the output's shape; ``row_of`` maps an output index to the weight row (default:
    the index itself). The reduction axes are named ``kv`` / ``kl`` (see the module docstring).
    """
    v = fmt.vector
    kv = te.reduce_axis((0, cols // v), name="kv")
    kl = te.reduce_axis((0, v), name="kl")

    def body(*i: PrimExpr) -> PrimExpr:
        row = row_of(*i) if row_of else i
        term = fmt.load(w, row, kv, kl) * x_at(*i, kv * v + kl)
        if when is not None:
            term = tirx.if_then_else(when(*i), term, f32(0))
        return te.sum(term, axis=[kv, kl])

    return te.compute(shape, body, name=name)


def gemv(name: str, rows: int, cols: int, fmt: str, bias: bool = False, residual: bool = False) -> Kernel:
    """``y = W x (+ b) (+ r)``: W [rows, cols] in ``fmt``, x [cols], b, r and y [rows], all f32 but
    W. ``residual``: the residual add of the decode step (``r + (W x + b)``, the add's bits)."""
    check_positive(rows=rows, cols=cols)
    wf = WeightFormat(fmt)
    w = wf.placeholders("W", (rows,), cols)
    x = te.placeholder((cols,), "float32", name="x")
    acc = row_dot("acc", wf, w, lambda r, k: x[k], (rows,), cols)
    args = [*[(t, "in") for t in w], (x, "in")]
    b = te.placeholder((rows,), "float32", name="b")
    res = te.placeholder((rows,), "float32", name="r")
    args += [(b, "in")] if bias else []
    args += [(res, "in")] if residual else []

    def value(i: PrimExpr) -> PrimExpr:
        v = acc[i] + b[i] if bias else acc[i]
        return v + res[i] if residual else v

    y = te.compute((rows,), value, name="y")
    return make_kernel(name, "gemv", [*args, (y, "out")])


def embed(name: str, seq: int, vocab: int, dim: int, fmt: str, scale: float = 1.0) -> Kernel:
    """``y[s] = table[tokens[s]]`` decoded to f32 (times ``scale``, Gemma's, where it is not 1):
    the embedding when it shares the LM head's table."""
    check_positive(seq=seq, vocab=vocab, dim=dim)
    wf = WeightFormat(fmt)
    table = wf.placeholders("W", (vocab,), dim)
    tokens = te.placeholder((seq,), "int32", name="tokens")

    def row(s: PrimExpr, c: PrimExpr) -> PrimExpr:
        value = wf.load(table, (tokens[s],), c // wf.vector, c % wf.vector)
        return value * f32(scale) if scale != 1.0 else value

    y = te.compute((seq, dim), row, name="y")
    return make_kernel(name, "elementwise", [*[(t, "in") for t in table], (tokens, "in"), (y, "out")])


def gemm(name: str, seq: int, rows: int, cols: int, fmt: str, bias: bool = False) -> Kernel:
    """Prefill ``Y = X W^T (+ b)``: X [seq, cols], W [rows, cols] in ``fmt``, Y [seq, rows]."""
    check_positive(seq=seq, rows=rows, cols=cols)
    wf = WeightFormat(fmt)
    w = wf.placeholders("W", (rows,), cols)
    x = te.placeholder((seq, cols), "float32", name="X")
    acc = row_dot("acc", wf, w, lambda s, r, k: x[s, k], (seq, rows), cols, row_of=lambda s, r: (r,))
    args = [*[(t, "in") for t in w], (x, "in")]
    if bias:
        b = te.placeholder((rows,), "float32", name="b")
        y = te.compute((seq, rows), lambda s, r: acc[s, r] + b[r], name="Y")
        args.append((b, "in"))
    else:
        y = te.compute((seq, rows), lambda s, r: acc[s, r], name="Y")
    return make_kernel(name, "gemm", [*args, (y, "out")])


def predictor(name: str, hidden: int, rank: int, n_ff: int, fmt: str, fc1_bias: bool = False,
              fc2_bias: bool = False) -> Kernel:
    """``mask = fc2(relu(fc1 x + b1)) + b2 > threshold`` as one byte (int8 0/1) per neuron.

    fc1 [rank, hidden] and fc2 [n_ff, rank] are in ``fmt`` (q4_0 needs rank % 32 == 0);
    ``threshold`` [1] is an input, so layers of the same rank share the kernel; ``hid`` [rank] is
    scratch between the two launches.
    """
    check_positive(hidden=hidden, rank=rank, n_ff=n_ff)
    wf = WeightFormat(fmt)
    w1 = wf.placeholders("fc1", (rank,), hidden)
    w2 = wf.placeholders("fc2", (n_ff,), rank)
    x = te.placeholder((hidden,), "float32", name="x")
    thr = te.placeholder((1,), "float32", name="threshold")
    args = [*[(t, "in") for t in w1], *[(t, "in") for t in w2], (x, "in"), (thr, "in")]
    acc1 = row_dot("acc1", wf, w1, lambda r, k: x[k], (rank,), hidden)
    if fc1_bias:
        b1 = te.placeholder((rank,), "float32", name="b1")
        args.append((b1, "in"))
        hid = te.compute((rank,), lambda r: tirx.max(acc1[r] + b1[r], f32(0)), name="hid")
    else:
        hid = te.compute((rank,), lambda r: tirx.max(acc1[r], f32(0)), name="hid")
    acc2 = row_dot("acc2", wf, w2, lambda r, k: hid[k], (n_ff,), rank)
    if fc2_bias:
        b2 = te.placeholder((n_ff,), "float32", name="b2")
        args.append((b2, "in"))
        logit = lambda r: acc2[r] + b2[r]  # noqa: E731
    else:
        logit = lambda r: acc2[r]  # noqa: E731
    mask = te.compute((n_ff,), lambda r: (logit(r) > thr[0]).astype("int8"), name="mask")
    return make_kernel(name, "predictor", [*args, (hid, "scratch"), (mask, "out")])


def compact(name: str, n: int, n_pad: int, offset: int = 0) -> Kernel:
    """Index list of mask columns ``offset .. offset + n``: ``idx[:count]`` = the active ones among
    them, numbered from 0 (the neurons of an FFN part), in order; the rest of ``idx`` is 0.

    ``mask`` is the layer's one byte per neuron ([offset + n] int8). ``n_pad`` >= n is the list's
    static length (a multiple of the FFN kernel's row tile). The definition (the host build's) is
    the plain serial loop; on the GPU one warp does it (``warp_compact``), so the active set stays
    on the device without a host round trip.
    """
    check_positive(n=n, n_pad=n_pad)
    total = offset + n

    @T.prim_func(s_tir=True)
    def func(mask: T.Buffer((total,), "int8"), idx: T.Buffer((n_pad,), "int32"),
             count: T.Buffer((1,), "int32")):
        for t in range(1):
            with T.sblock("compact"):
                vt = T.axis.spatial(1, t)
                T.reads(mask[0:total])
                T.writes(idx[0:n_pad], count[vt])
                found = T.sblock_alloc_buffer((1,), "int32", scope="local")
                found[0] = 0
                for i in range(n):
                    if mask[offset + i] != T.int8(0):
                        idx[found[0]] = i
                        found[0] = found[0] + 1
                for i in range(n_pad):
                    if i >= found[0]:
                        idx[i] = 0
                count[vt] = found[0]

    return kernel_from_func(name, "compact", func, {"mask": "in", "idx": "scratch", "count": "scratch"},
                            options={"n": n, "n_pad": n_pad, "offset": offset})


WARP = 32
COMPACT_GROUP = 8
"""Mask bytes each lane of ``warp_compact`` reads per step (a warp takes 256 neurons a step)."""


def warp_compact(kernel: Kernel) -> tirx.PrimFunc:
    """``compact`` for the GPU, in one warp: each step, lane ``l`` counts the active neurons of its
    ``COMPACT_GROUP`` consecutive mask bytes, a shuffle scan over the lanes gives each lane where
    its entries go, and the lanes write them -- the same list, in the same order, as the serial
    definition, in ``n / 256`` steps instead of ``n`` dependent iterations of one thread.

    The running counts live in registers: ``found`` (entries written before this step, the same in
    every lane) and ``mine`` (this lane's count, then its next slot in ``idx``).
    """
    n, n_pad, offset = kernel.options["n"], kernel.options["n_pad"], kernel.options["offset"]
    total, group = offset + n, COMPACT_GROUP
    steps, fill_steps = -(-n // (WARP * group)), -(-n_pad // WARP)
    lanes_mask = T.uint32(0xFFFFFFFF)

    @T.prim_func(s_tir=True)
    def func(mask: T.Buffer((total,), "int8"), idx: T.Buffer((n_pad,), "int32"),
             count: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        for lane in T.thread_binding(WARP, thread="threadIdx.x"):
            with T.sblock("compact"):
                T.reads(mask[0:total])
                T.writes(idx[0:n_pad], count[0])
                found = T.sblock_alloc_buffer((1,), "int32", scope="local")
                mine = T.sblock_alloc_buffer((1,), "int32", scope="local")
                scan = T.sblock_alloc_buffer((1,), "int32", scope="local")
                found[0] = 0
                for step in range(steps):
                    mine[0] = 0
                    for g in range(group):
                        # Nested: TIR may evaluate both sides of an ``and``, and the load must not run.
                        if (step * WARP + lane) * group + g < n:  # noqa: SIM102
                            if mask[offset + (step * WARP + lane) * group + g] != T.int8(0):
                                mine[0] = mine[0] + 1
                    scan[0] = mine[0]  # inclusive scan of the lanes' counts (Hillis-Steele)
                    for d in range(5):
                        up = T.call_extern("int32", "__shfl_up_sync", lanes_mask, scan[0], 1 << d, WARP)
                        if lane >= (1 << d):
                            scan[0] = scan[0] + up
                    mine[0] = found[0] + scan[0] - mine[0]
                    for g in range(group):
                        if (step * WARP + lane) * group + g < n:  # noqa: SIM102
                            if mask[offset + (step * WARP + lane) * group + g] != T.int8(0):
                                idx[mine[0]] = (step * WARP + lane) * group + g
                                mine[0] = mine[0] + 1
                    found[0] = found[0] + T.call_extern("int32", "__shfl_sync", lanes_mask, scan[0], WARP - 1, WARP)
                for i in range(fill_steps):
                    if i * WARP + lane < n_pad and i * WARP + lane >= found[0]:
                            idx[i * WARP + lane] = 0
                if lane == 0:
                    count[0] = found[0]

    return func.with_attr("global_symbol", kernel.name)
