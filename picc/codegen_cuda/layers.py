"""Per-token layer kernels: RMSNorm, LayerNorm, rotary embedding, joined heads, KV-cache append, attention.

All take a sequence dimension ``seq`` (1 for decode, the prompt length for prefill) and follow
``picc.interpreter`` exactly: norms over the last axis; rotary angles ``pos * inv_freq`` in
float32 with ``inv_freq`` passed in (:func:`rope_table`: ``Rope.inv_freq()``, so every scaling
variant is covered, and the factor the cosines and sines are multiplied by);
attention with grouped K/V heads over float32 caches ``[max_ctx, n_kv_heads * head_dim]`` (the
values' ``[max_ctx, n_kv_heads * v_head_dim]``, where they are narrower than the keys: DeepSeek's
MLA decompressed), the query at position ``p`` seeing cached positions ``j <= p`` (and
``p - j < window``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.script import tirx as T

from picc.codegen_cuda.kernel import Kernel, check_positive, f32, kernel_from_func, make_kernel
from picc.errors import PiccError
from picc.ir import ops as O
from runtime import gpu_layout

ROPE_STYLES = ("llama", "gptj")


def rms_norm(name: str, seq: int, hidden: int, eps: float) -> Kernel:
    """``y = x / sqrt(mean(x^2) + eps) * w``; x, y [seq, hidden], w [hidden]."""
    check_positive(seq=seq, hidden=hidden)
    x = te.placeholder((seq, hidden), "float32", name="x")
    w = te.placeholder((hidden,), "float32", name="w")
    k = te.reduce_axis((0, hidden), name="k")
    ss = te.compute((seq,), lambda s: te.sum(x[s, k] * x[s, k], axis=k), name="ss")
    y = te.compute((seq, hidden), lambda s, c: x[s, c] / tirx.sqrt(ss[s] / f32(hidden) + f32(eps)) * w[c],
                   name="y")
    return make_kernel(name, "norm", [(x, "in"), (w, "in"), (y, "out")])


def layer_norm(name: str, seq: int, hidden: int, eps: float, bias: bool = True) -> Kernel:
    """``y = (x - mean) / sqrt(var + eps) * w (+ b)``; the variance is two-pass, as numpy's."""
    check_positive(seq=seq, hidden=hidden)
    x = te.placeholder((seq, hidden), "float32", name="x")
    w = te.placeholder((hidden,), "float32", name="w")
    k = te.reduce_axis((0, hidden), name="k")
    total = te.compute((seq,), lambda s: te.sum(x[s, k], axis=k), name="total")
    k2 = te.reduce_axis((0, hidden), name="k2")

    def centred(s: PrimExpr, c: PrimExpr) -> PrimExpr:
        return x[s, c] - total[s] / f32(hidden)

    sq = te.compute((seq,), lambda s: te.sum(centred(s, k2) * centred(s, k2), axis=k2), name="sq")
    args = [(x, "in"), (w, "in")]
    if bias:
        b = te.placeholder((hidden,), "float32", name="b")
        args.append((b, "in"))
    y = te.compute((seq, hidden), lambda s, c: centred(s, c) / tirx.sqrt(sq[s] / f32(hidden) + f32(eps)) * w[c]
                   + (b[c] if bias else f32(0)), name="y")
    return make_kernel(name, "norm", [*args, (y, "out")])


def rope_table(op: O.Rope) -> np.ndarray:
    """What a rope kernel reads as ``inv_freq``: the op's rot/2 frequencies, then its
    ``attention_factor`` (the cosines and sines are multiplied by it; 1 but for longrope and yarn)."""
    return np.append(op.inv_freq(), np.float32(op.attention_factor)).astype(np.float32)


def rope(name: str, seq: int, n_heads: int, head_dim: int, rotary_dim: int | None = None,
         style: str = "llama") -> Kernel:
    """Rotary embedding of x [seq, n_heads * head_dim] at ``pos`` [seq] with ``inv_freq`` [rot/2 + 1]
    (:func:`rope_table`).

    ``llama`` pairs feature i with i + rot/2 of each head, ``gptj`` pairs 2i with 2i + 1;
    features past ``rotary_dim`` pass through.
    """
    check_positive(seq=seq, n_heads=n_heads, head_dim=head_dim)
    rot = head_dim if rotary_dim is None else rotary_dim
    if style not in ROPE_STYLES or rot % 2 or not 0 < rot <= head_dim:
        raise PiccError(f"{name}: rope needs style in {ROPE_STYLES} and an even rotary_dim in "
                        f"(0, {head_dim}], got style={style!r}, rotary_dim={rot}")
    half = rot // 2
    x = te.placeholder((seq, n_heads * head_dim), "float32", name="x")
    pos = te.placeholder((seq,), "int32", name="pos")
    inv = te.placeholder((half + 1,), "float32", name="inv_freq")

    def out(s: PrimExpr, c: PrimExpr) -> PrimExpr:
        return _rotated(lambda f: x[s, f], c, pos[s], lambda i: inv[i], head_dim, rot, style)

    y = te.compute((seq, n_heads * head_dim), out, name="y")
    return make_kernel(name, "elementwise", [(x, "in"), (pos, "in"), (inv, "in"), (y, "out")])


def rope_pair(name: str, n_first: int, n_second: int, head_dim: int, rotary_dim: int | None = None,
              style: str = "llama", append_ctx: int | None = None, v_width: int | None = None) -> Kernel:
    """:func:`rope` of two vectors at one position in one launch (a layer's q and k): ``x1``
    [1, n_first * head_dim] and ``x2`` [1, n_second * head_dim] -> ``y1``, ``y2``, the same values
    as two ``rope`` calls. With ``append_ctx``, the launch is also :func:`kv_append`'s: ``y2`` and
    ``v`` [1, v_width] (``v_width``: values narrower than keys, DeepSeek's; else n_second *
    head_dim) go to row ``pos`` of ``k_cache`` [append_ctx, n_second * head_dim] and ``v_cache``
    [append_ctx, v_width] (inout). One block of threads over both vectors' features (and the
    values' past ``y2``'s, where they are wider); a thread writes one feature of one of them, a
    thread of ``y2``'s also that feature of the cache rows that have it."""
    check_positive(n_first=n_first, n_second=n_second, head_dim=head_dim)
    rot = head_dim if rotary_dim is None else rotary_dim
    if style not in ROPE_STYLES or rot % 2 or not 0 < rot <= head_dim:
        raise PiccError(f"{name}: rope needs style in {ROPE_STYLES} and an even rotary_dim in "
                        f"(0, {head_dim}], got style={style!r}, rotary_dim={rot}")
    w1, w2, half = n_first * head_dim, n_second * head_dim, rot // 2

    def rotate(x: tirx.Buffer, c: PrimExpr, p: PrimExpr, inv: tirx.Buffer) -> PrimExpr:
        return _rotated(lambda f: x[0, f], c, p, lambda i: inv[i], head_dim, rot, style)

    roles = {"x1": "in", "x2": "in", "pos": "in", "inv_freq": "in", "y1": "out", "y2": "out"}
    if append_ctx is None:
        @T.prim_func(s_tir=True)
        def func(x1: T.Buffer((1, w1), "float32"), x2: T.Buffer((1, w2), "float32"),
                 pos: T.Buffer((1,), "int32"), inv_freq: T.Buffer((half + 1,), "float32"),
                 y1: T.Buffer((1, w1), "float32"), y2: T.Buffer((1, w2), "float32")):
            for c in range(w1 + w2):
                with T.sblock("y"):
                    vc = T.axis.spatial(w1 + w2, c)
                    T.reads(x1[0, 0:w1], x2[0, 0:w2], pos[0], inv_freq[0 : half + 1])
                    T.writes(y1[0, 0:w1], y2[0, 0:w2])
                    if vc < w1:
                        y1[0, vc] = rotate(x1, vc, pos[0], inv_freq)
                    else:
                        y2[0, vc - w1] = rotate(x2, vc - w1, pos[0], inv_freq)

        return kernel_from_func(name, "elementwise", func, roles)
    vw = w2 if v_width is None else v_width
    check_positive(append_ctx=append_ctx, v_width=vw)
    wide = w1 + max(w2, vw)

    @T.prim_func(s_tir=True)
    def appending(x1: T.Buffer((1, w1), "float32"), x2: T.Buffer((1, w2), "float32"),
                  v: T.Buffer((1, vw), "float32"), pos: T.Buffer((1,), "int32"),
                  inv_freq: T.Buffer((half + 1,), "float32"), y1: T.Buffer((1, w1), "float32"),
                  y2: T.Buffer((1, w2), "float32"), k_cache: T.Buffer((append_ctx, w2), "float32"),
                  v_cache: T.Buffer((append_ctx, vw), "float32")):
        for c in range(wide):
            with T.sblock("y"):
                vc = T.axis.spatial(wide, c)
                T.reads(x1[0, 0:w1], x2[0, 0:w2], v[0, 0:vw], pos[0], inv_freq[0 : half + 1])
                T.writes(y1[0, 0:w1], y2[0, 0:w2], k_cache[pos[0], 0:w2], v_cache[pos[0], 0:vw])
                if vc < w1:
                    y1[0, vc] = rotate(x1, vc, pos[0], inv_freq)
                else:
                    if vc - w1 < w2:
                        y2[0, vc - w1] = rotate(x2, vc - w1, pos[0], inv_freq)
                        k_cache[pos[0], vc - w1] = rotate(x2, vc - w1, pos[0], inv_freq)
                    if vc - w1 < vw:
                        v_cache[pos[0], vc - w1] = v[0, vc - w1]

    return kernel_from_func(name, "elementwise", appending,
                            {**roles, "v": "in", "k_cache": "inout", "v_cache": "inout"})


def _rotated(x: Callable[[PrimExpr], PrimExpr], c: PrimExpr, p: PrimExpr, inv: Callable[[PrimExpr], PrimExpr],
             head_dim: int, rot: int, style: str) -> PrimExpr:
    """Feature ``c`` of a rotary embedding at position ``p``: ``x(f)`` reads feature ``f`` of the
    input, ``inv(i)`` frequency ``i`` and ``inv(rot / 2)`` the cosines' and sines' factor (see
    :func:`rope`)."""
    half = rot // 2
    base, i = c - c % head_dim, c % head_dim
    if style == "llama":
        pair, first = i % half, i < half
        partner = tirx.if_then_else(first, i + half, i - half)
    else:
        pair, first = i // 2, i % 2 == 0
        partner = tirx.if_then_else(first, i + 1, i - 1)
    angle = p.astype("float32") * inv(tirx.min(pair, half - 1))
    cos, sin = tirx.cos(angle) * inv(half), tirx.sin(angle) * inv(half)
    a = x(c)
    b = x(base + tirx.min(partner, head_dim - 1))
    rotated = tirx.if_then_else(first, a * cos - b * sin, a * cos + b * sin)
    return tirx.if_then_else(i < rot, rotated, a)


def add(name: str, seq: int, n: int) -> Kernel:
    """``y = a + b`` over [seq, n] (residual connections, the merge of a split FFN's parts)."""
    check_positive(seq=seq, n=n)
    a = te.placeholder((seq, n), "float32", name="a")
    b = te.placeholder((seq, n), "float32", name="b")
    y = te.compute((seq, n), lambda s, c: a[s, c] + b[s, c], name="y")
    return make_kernel(name, "elementwise", [(a, "in"), (b, "in"), (y, "out")])


def concat_heads(name: str, seq: int, n_heads: int, a_heads: int, a_dim: int, b_heads: int, b_dim: int) -> Kernel:
    """``y`` [seq, n_heads * (a_dim + b_dim)], head h = ``[a's head h | b's head h]``: ``a`` [seq,
    a_heads * a_dim] and ``b`` [seq, b_heads * b_dim], each of one head (which every head takes)
    or of ``n_heads``. A thread copies one feature."""
    check_positive(seq=seq, n_heads=n_heads, a_dim=a_dim, b_dim=b_dim)
    if a_heads not in (1, n_heads) or b_heads not in (1, n_heads):
        raise PiccError(f"{name}: each operand has 1 or n_heads={n_heads} heads, got {a_heads} and {b_heads}")
    a = te.placeholder((seq, a_heads * a_dim), "float32", name="a")
    b = te.placeholder((seq, b_heads * b_dim), "float32", name="b")
    width = a_dim + b_dim

    def joined(s: PrimExpr, c: PrimExpr) -> PrimExpr:
        h, f = c // width, c % width
        # Each read's index is clamped into its operand, as the rope's are: in bounds even where the
        # feature takes the other operand's value.
        from_a = a[s, (h if a_heads > 1 else 0) * a_dim + tirx.min(f, a_dim - 1)]
        from_b = b[s, (h if b_heads > 1 else 0) * b_dim + tirx.max(f - a_dim, 0)]
        return tirx.if_then_else(f < a_dim, from_a, from_b)

    y = te.compute((seq, n_heads * width), joined, name="y")
    return make_kernel(name, "elementwise", [(a, "in"), (b, "in"), (y, "out")])


def softcap(name: str, seq: int, n: int, cap: float) -> Kernel:
    """``y = cap * tanh(x / cap)`` over [seq, n] (Gemma 2's capped logits)."""
    check_positive(seq=seq, n=n)
    x = te.placeholder((seq, n), "float32", name="x")
    y = te.compute((seq, n), lambda s, c: tirx.tanh(x[s, c] / f32(cap)) * f32(cap), name="y")
    return make_kernel(name, "elementwise", [(x, "in"), (y, "out")])


def merge(name: str, n: int, bias: bool, residual: bool = False) -> Kernel:
    """``y = a + b (+ bias) (+ r)``: the partial sums of a split FFN layer, its down bias and, with
    ``residual``, the decode step's residual add (``r + merged``, the add's bits)."""
    check_positive(n=n)
    a = te.placeholder((1, n), "float32", name="a")
    b = te.placeholder((1, n), "float32", name="b")
    c = te.placeholder((n,), "float32", name="bias")
    r = te.placeholder((1, n), "float32", name="r")
    args = [(a, "in"), (b, "in"), *([(c, "in")] if bias else []), *([(r, "in")] if residual else [])]

    def value(s: PrimExpr, i: PrimExpr) -> PrimExpr:
        v = a[s, i] + b[s, i] + c[i] if bias else a[s, i] + b[s, i]
        return v + r[s, i] if residual else v

    y = te.compute((1, n), value, name="y")
    return make_kernel(name, "elementwise", [*args, (y, "out")])


def kv_append(name: str, seq: int, width: int, max_ctx: int, v_width: int | None = None) -> Kernel:
    """Write ``k`` [seq, width] and ``v`` [seq, v_width] (``v_width``: values narrower than keys,
    DeepSeek's; else ``width``) into rows ``pos`` of ``k_cache`` [max_ctx, width] and ``v_cache``
    [max_ctx, v_width], in place. A thread takes feature ``c`` of both rows, where each has it."""
    vw = width if v_width is None else v_width
    check_positive(seq=seq, width=width, v_width=vw, max_ctx=max_ctx)
    wide = max(width, vw)

    @T.prim_func(s_tir=True)
    def func(k: T.Buffer((seq, width), "float32"), v: T.Buffer((seq, vw), "float32"),
             pos: T.Buffer((seq,), "int32"), k_cache: T.Buffer((max_ctx, width), "float32"),
             v_cache: T.Buffer((max_ctx, vw), "float32")):
        for s, c in T.grid(seq, wide):
            with T.sblock("append"):
                vs, vc = T.axis.remap("SS", [s, c])
                T.reads(k[vs, 0:width], v[vs, 0:vw], pos[vs])
                T.writes(k_cache[pos[vs], 0:width], v_cache[pos[vs], 0:vw])
                if vc < width:
                    k_cache[pos[vs], vc] = k[vs, vc]
                if vc < vw:
                    v_cache[pos[vs], vc] = v[vs, vc]

    roles = {"k": "in", "v": "in", "pos": "in", "k_cache": "inout", "v_cache": "inout"}
    return kernel_from_func(name, "elementwise", func, roles)


def attention(name: str, seq: int, n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int,
              scale: float, window: int | None = None, softcap: float | None = None, sinks: bool = False,
              v_head_dim: int | None = None) -> Kernel:
    """Causal GQA attention of q [seq, n_heads * head_dim] over the caches (after ``kv_append``).

    Parameters: ``q``, ``pos`` [seq] i32, ``k_cache`` [max_ctx, n_kv * head_dim], ``v_cache``
    [max_ctx, n_kv * dv], (with ``sinks``: a logit per query head, ``sinks`` [n_heads]), scratch
    ``scores`` [seq, n_heads, max_ctx], ``smax`` and ``ssum`` [seq, n_heads], ``probs`` [seq,
    n_heads, max_ctx], output ``out`` [seq, n_heads * dv]; ``dv`` is ``v_head_dim`` where the value
    heads are narrower than the key heads (DeepSeek's MLA decompressed), else head_dim. Scores of
    invisible positions are never computed (their scratch entries hold 0). Five launches on the
    GPU, one a stage; ``attention_decode`` is the one-launch kernel of a decode step.
    """
    t = _attention_stages(name, seq, n_heads, n_kv_heads, head_dim, max_ctx, scale, window, softcap, sinks,
                          v_head_dim)
    args = [*_attention_inputs(t), (t["scores"], "scratch"), (t["smax"], "scratch"), (t["ssum"], "scratch"),
            (t["probs"], "scratch"), (t["out"], "out")]
    return make_kernel(name, "attention", args, guards={"scores": _scores_guard(window)},
                       options={"v_head_dim": v_head_dim or head_dim})


def attention_decode(name: str, n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int, scale: float,
                     window: int | None = None, softcap: float | None = None, sinks: bool = False,
                     v_head_dim: int | None = None) -> Kernel:
    """``attention`` of one query (seq = 1) in one GPU launch: the same stages, but the scores,
    softmax statistics and probabilities are the kernel's own (shared memory on the GPU, a block
    per head; ``schedules_attention.schedule_attention_decode``), so it takes no scratch.

    Parameters: ``q`` [1, n_heads * head_dim], ``pos`` [1] i32, ``k_cache`` [max_ctx, n_kv *
    head_dim], ``v_cache`` [max_ctx, n_kv * dv], (with ``sinks``: ``sinks`` [n_heads]), output
    ``out`` [1, n_heads * dv] (``dv`` as in ``attention``). Use it only where
    ``attention_decode_fits(max_ctx)``.
    """
    if not attention_decode_fits(max_ctx):
        raise PiccError(f"{name}: a one-launch decode attention over max_ctx={max_ctx} positions does not fit "
                        f"in shared memory (or its tiles); use attention")
    t = _attention_stages(name, 1, n_heads, n_kv_heads, head_dim, max_ctx, scale, window, softcap, sinks, v_head_dim)
    args = [*_attention_inputs(t), (t["out"], "out")]
    return make_kernel(name, "attention_decode", args, guards={"scores": _scores_guard(window)},
                       options={"v_head_dim": v_head_dim or head_dim})


def attention_decode_fits(max_ctx: int) -> bool:
    """Whether ``attention_decode`` serves a cache of ``max_ctx`` positions (``gpu_layout``'s rule,
    which the memory plan also reads: TVM-free)."""
    return gpu_layout.fused_attention(max_ctx)


def _attention_inputs(t: dict[str, te.Tensor]) -> list[tuple[te.Tensor, str]]:
    """The inputs of an attention kernel in parameter order: q, pos, the caches, the sinks if any."""
    return [(t[n], "in") for n in ("q", "pos", "k_cache", "v_cache", "sinks") if n in t]


def _attention_stages(name: str, seq: int, n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int,
                      scale: float, window: int | None, softcap: float | None = None,
                      sinks: bool = False, v_head_dim: int | None = None) -> dict[str, te.Tensor]:
    """The tensors of attention by name: placeholders ``q``, ``pos``, ``k_cache``, ``v_cache``
    (and ``sinks`` [n_heads] with ``sinks``) and the stages ``scores``, ``smax``, ``ssum``,
    ``probs``, ``out`` (the arithmetic of ``picc.interpreter.attention``, the scores soft-capped
    where ``softcap`` is given). Keys are ``head_dim`` wide, values and the output's heads
    ``v_head_dim`` (when given). A sink joins where the maximum and the sum are read, not in
    their reductions (a reduction is a stage's whole body): ``probs`` divides by ``ssum`` plus
    the sink's term, both against ``max(smax, sink)``."""
    dv = head_dim if v_head_dim is None else v_head_dim
    check_positive(seq=seq, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, v_head_dim=dv,
                   max_ctx=max_ctx)
    if n_heads % n_kv_heads:
        raise PiccError(f"{name}: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    group, d = n_heads // n_kv_heads, head_dim
    q = te.placeholder((seq, n_heads * d), "float32", name="q")
    pos = te.placeholder((seq,), "int32", name="pos")
    kc = te.placeholder((max_ctx, n_kv_heads * d), "float32", name="k_cache")
    vc = te.placeholder((max_ctx, n_kv_heads * dv), "float32", name="v_cache")
    sk = te.placeholder((n_heads,), "float32", name="sinks") if sinks else None

    def visible(s: PrimExpr, j: PrimExpr) -> PrimExpr:
        seen = j <= pos[s]
        return seen if window is None else tirx.all(seen, pos[s] - j < window)

    kd = te.reduce_axis((0, d), name="kd")
    # ``scores`` holds the unscaled dot products; the scale is applied where they are read, after
    # the sum, as numpy does (the same float32 rounding).
    scores = te.compute((seq, n_heads, max_ctx), lambda s, h, j: te.sum(
        tirx.if_then_else(visible(s, j), q[s, h * d + kd] * kc[j, (h // group) * d + kd], f32(0)), axis=kd),
        name="scores")

    def scaled(s: PrimExpr, h: PrimExpr, j: PrimExpr) -> PrimExpr:
        x = scores[s, h, j] * f32(scale)
        return x if softcap is None else tirx.tanh(x / f32(softcap)) * f32(softcap)

    jm = te.reduce_axis((0, max_ctx), name="jm")
    smax = te.compute((seq, n_heads), lambda s, h: te.max(
        tirx.if_then_else(visible(s, jm), scaled(s, h, jm), f32(-3.0e38)), axis=jm), name="smax")
    js = te.reduce_axis((0, max_ctx), name="js")

    def top(s: PrimExpr, h: PrimExpr) -> PrimExpr:
        return smax[s, h] if sk is None else tirx.max(smax[s, h], sk[h])

    def weight(s: PrimExpr, h: PrimExpr, j: PrimExpr) -> PrimExpr:
        return tirx.if_then_else(visible(s, j), tirx.exp(scaled(s, h, j) - top(s, h)), f32(0))

    def total(s: PrimExpr, h: PrimExpr) -> PrimExpr:
        return ssum[s, h] if sk is None else ssum[s, h] + tirx.exp(sk[h] - top(s, h))

    ssum = te.compute((seq, n_heads), lambda s, h: te.sum(weight(s, h, js), axis=js), name="ssum")
    # Probabilities once per (query, head, position), as numpy's ``scores /= sum``; the output
    # stage then reads them instead of recomputing exp in every one of its head_dim threads.
    probs = te.compute((seq, n_heads, max_ctx), lambda s, h, j: weight(s, h, j) / total(s, h), name="probs")
    jo = te.reduce_axis((0, max_ctx), name="jo")
    out = te.compute((seq, n_heads * dv), lambda s, c: te.sum(tirx.if_then_else(
        visible(s, jo), probs[s, c // dv, jo] * vc[jo, (c // dv // group) * dv + c % dv], f32(0)),
        axis=jo), name="out")
    stages = {"q": q, "pos": pos, "k_cache": kc, "v_cache": vc, "scores": scores, "smax": smax, "ssum": ssum,
              "probs": probs, "out": out}
    return stages if sk is None else {**stages, "sinks": sk}


def _scores_guard(window: int | None) -> Callable[..., PrimExpr]:
    """The guard of ``scores`` (``Kernel.guards``): whether query ``s`` sees position ``j``."""
    return lambda b, s, h, j: visible_buf(b, s, j, window)


def visible_buf(b: dict[str, tirx.Buffer], s: PrimExpr, j: PrimExpr,
                window: int | None) -> PrimExpr:
    """``visible`` on the function's own ``pos`` buffer (for the schedule's guard)."""
    seen = j <= b["pos"][s]
    return seen if window is None else tirx.all(seen, b["pos"][s] - j < window)
