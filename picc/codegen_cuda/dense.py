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


def gemv(name: str, rows: int, cols: int, fmt: str, bias: bool = False) -> Kernel:
    """``y = W x (+ b)``: W [rows, cols] in ``fmt``, x [cols], b and y [rows], all f32 but W."""
    check_positive(rows=rows, cols=cols)
    wf = WeightFormat(fmt)
    w = wf.placeholders("W", (rows,), cols)
    x = te.placeholder((cols,), "float32", name="x")
    acc = row_dot("acc", wf, w, lambda r, k: x[k], (rows,), cols)
    args = [*[(t, "in") for t in w], (x, "in")]
    if bias:
        b = te.placeholder((rows,), "float32", name="b")
        y = te.compute((rows,), lambda r: acc[r] + b[r], name="y")
        args.append((b, "in"))
    else:
        y = te.compute((rows,), lambda r: acc[r], name="y")
    return make_kernel(name, "gemv", [*args, (y, "out")])


def embed(name: str, seq: int, vocab: int, dim: int, fmt: str) -> Kernel:
    """``y[s] = table[tokens[s]]`` decoded to f32: the embedding when it shares the LM head's table."""
    check_positive(seq=seq, vocab=vocab, dim=dim)
    wf = WeightFormat(fmt)
    table = wf.placeholders("W", (vocab,), dim)
    tokens = te.placeholder((seq,), "int32", name="tokens")
    y = te.compute((seq, dim), lambda s, c: wf.load(table, (tokens[s],), c // wf.vector, c % wf.vector), name="y")
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
    static length (a multiple of the FFN kernel's row tile). On the GPU this runs in one thread: a
    prefix scan would be faster, but the list is short (n_ff) and the kernel keeps the active set
    on the device, so no host round trip is needed.
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
                # The running count lives in a register: a global read-modify-write per active
                # neuron would cost an L2 round trip each on the GPU.
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

    return kernel_from_func(name, "single_thread", func, {"mask": "in", "idx": "scratch", "count": "scratch"})
