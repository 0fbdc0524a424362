"""The data-path handlers of the ONNX matcher, one per ONNX op type (see ``onnx_match``).

Each handler gets the abstract values of its node's inputs and returns those of its outputs, or
raises ``NoMatch`` saying what it expected. Commutative ops try both operand orders.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import onnx

from picc.frontend.onnx_attention import attention_context, masked_scores, rope_done, rotary_table, table_tol
from picc.frontend.onnx_match import (
    Act,
    Heads,
    Known,
    Matcher,
    NoMatch,
    Partial,
    axes_of,
    axis_is_last,
    both,
    close,
    const_vector,
    handles,
    mismatch,
    renames_partial,
    scalar,
)

_FLOAT_CASTS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE}
_SQRT1_2 = 1 / math.sqrt(2)


@handles("Cast", "Identity")
def _cast(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    # picc computes in float32 throughout; casts between float types are where exporters of
    # fp16/bf16 models round, and picc does not.
    if node.op_type == "Cast" and a.get("to") not in _FLOAT_CASTS:
        raise NoMatch(f"cast of hidden states to non-float type {a.get('to')}")
    return [ins[0]]


@handles("Shape")
def _shape(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    shape = np.asarray(getattr(ins[0], "shape", ()), dtype=np.int64)
    start, end = int(a.get("start", 0)), a.get("end")
    return [Known(shape[start:None if end is None else int(end)], const=False)]


@handles("Gather")
def _gather(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    table, idx = ins
    if (isinstance(table, Known) and table.const and table.value.ndim == 2 and isinstance(idx, Known)
            and idx.tokens and int(a.get("axis", 0)) == 0):
        r = m.rec("embed", (), node, table=table.value)
        return [Act(r, (*idx.value.shape, table.value.shape[1]))]
    raise mismatch(node, ins)


# ---------------------------------------------------------------- linear layers


def _linear(m: Matcher, node: onnx.NodeProto, x: Act, w: np.ndarray, bias: np.ndarray | None) -> Act:
    """``x @ w`` with ``w`` [in, out] (picc stores its transpose)."""
    if x.scale != 1.0:
        raise NoMatch(f"input scaled by {x.scale} before a projection")
    r = m.rec("linear", (x.rec,), node, weight=np.ascontiguousarray(w.T),
              **({"bias": bias} if bias is not None else {}))
    return Act(r, (*x.shape[:-1], w.shape[1]))


@handles("MatMul")
def _matmul(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, w = ins
    if isinstance(x, Act) and isinstance(w, Known) and w.const and w.value.ndim == 2:
        if w.value.shape[0] != x.shape[-1]:
            raise NoMatch(f"weight {list(w.value.shape)} does not take {x.shape[-1]} inputs")
        return [_linear(m, node, x, w.value, None)]
    if isinstance(x, Heads) and isinstance(w, Heads) and x.layout == "bnsd" and w.layout == "bndt":
        return [Partial("scores", x, (1, x.n, x.shape[2], w.shape[3]), (w, x.scale * w.scale, None))]
    if isinstance(x, Partial) and x.kind == "probs" and isinstance(w, Heads) and w.layout == "bnsd":
        return [attention_context(m, node, x, w)]
    raise mismatch(node, ins)


@handles("Gemm")
def _gemm(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, w = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if (not isinstance(x, Act) or not isinstance(w, Known) or not w.const or a.get("transA", 0)
            or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0):
        raise mismatch(node, ins)
    weight = w.value.T if a.get("transB", 0) else w.value
    bias = const_vector(c, weight.shape[1]) if c is not None else None
    if c is not None and bias is None:
        raise NoMatch("Gemm bias is not a constant vector")
    return [_linear(m, node, x, weight, bias)]


def _with_bias(m: Matcher, node: onnx.NodeProto, x: Act, bias: np.ndarray) -> Act:
    lin = m.recs[x.rec]
    if lin.op != "linear" or "bias" in lin.weights or x.scale != 1.0:
        raise NoMatch("a constant vector added to something other than a projection")
    r = m.rec("linear", lin.inputs, node, weight=lin.weights["weight"], bias=bias)
    lin.attrs["superseded"] = r
    return replace(x, rec=r)


# ---------------------------------------------------------------- elementwise


@handles("Add")
def _add(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    for x, y in both(ins):
        if isinstance(x, Act) and isinstance(y, Act) and x.scale == y.scale == 1.0:
            return [Act(m.rec("add", (x.rec, y.rec), node), _broadcast(x.shape, y.shape))]
        if isinstance(x, Act) and (b := const_vector(y, x.shape[-1])) is not None:
            return [_with_bias(m, node, x, b)]
        if isinstance(x, Act) and isinstance(y, Known) and not y.const:
            return [_position_embedding(m, node, x, y)]
        if isinstance(x, Partial) and x.kind == "meansq" and (eps := scalar(y)) is not None:
            return [replace(x, kind="meansq_eps", info=(eps,))]
        if isinstance(x, Partial) and x.kind == "scores" and isinstance(y, Known):
            return [masked_scores(x, y, m)]
        if (isinstance(x, Partial) and isinstance(y, Partial) and x.kind == "cos_term"
                and y.kind == "sin_term" and x.base == y.base):
            return [rope_done(m, node, x, y)]
        if isinstance(x, Partial) and x.kind in ("erf", "tanh") and scalar(y) == 1.0:
            return [replace(x, kind=x.kind + "1")]
        if isinstance(x, Act) and isinstance(y, Partial) and y.kind == "cube_c" and y.base == x:
            return [replace(y, kind="tanh_inner0")]
    raise mismatch(node, ins)


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(a, b))


@handles("Mul")
def _mul(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    if isinstance(ins[0], Act) and ins[0] == ins[1]:
        return [Partial("sq", ins[0], ins[0].shape)]
    for x, y in both(ins):
        s = scalar(y)
        if isinstance(x, Act):
            if isinstance(y, Partial) and y.kind == "inv_rms" and y.base == x:
                return [replace(y, kind="normed")]
            if isinstance(y, Partial) and y.kind == "sigmoid" and y.base == x:
                return [Act(m.rec("act", (x.rec,), node, kind="silu"), x.shape)]
            if isinstance(y, Partial) and y.kind in ("erf1", "tanh1") and y.base == replace(x, scale=1.0):
                # x * (1 + erf(...)): the 0.5 is already on x, or comes next
                return [_gelu_product(m, node, y, x.scale) if x.scale != 1.0 else replace(y, kind="x_" + y.kind)]
            if isinstance(y, Partial) and y.kind in ("half_erf1", "half_tanh1") and y.base == x:
                return [_gelu_product(m, node, y, 0.5)]
            if isinstance(y, Act) and x.scale == y.scale == 1.0:
                return [Act(m.rec("mul", (x.rec, y.rec), node), _broadcast(x.shape, y.shape))]
            if s is not None:
                return [replace(x, scale=x.scale * s)]
        if isinstance(x, Partial):
            if x.kind == "normed" and (w := const_vector(y, x.base.shape[-1])) is not None:
                return [_rms_norm(m, node, x, w)]
            if x.kind == "scores" and s is not None:
                return [replace(x, info=(x.info[0], x.info[1] * s, x.info[2]))]
            if x.kind in ("erf1", "tanh1") and s == 0.5:
                return [replace(x, kind="half_" + x.kind)]
            if x.kind in ("x_erf1", "x_tanh1") and s == 0.5:
                return [_gelu_product(m, node, x, 0.5)]
            if x.kind == "cube" and s is not None and close(s, 0.044715, 1e-4):
                return [replace(x, kind="cube_c")]
            if x.kind == "tanh_inner0" and s is not None and close(s, math.sqrt(2 / math.pi), 1e-4):
                return [replace(x, kind="tanh_inner")]
            if x.kind == "rot" and isinstance(y, Known):
                return [Partial("sin_term", x.base, x.shape, (rotary_table(y, x.base), table_tol(y)))]
        if isinstance(x, Heads):
            if s is not None:
                return [replace(x, scale=x.scale * s)]
            if isinstance(y, Known) and x.layout in ("bnsd", "bsnd"):
                return [Partial("cos_term", x, x.shape, (rotary_table(y, x), table_tol(y)))]
    raise mismatch(node, ins)


@handles("Div")
def _div(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, y = ins
    s = scalar(y)
    if scalar(x) == 1.0 and isinstance(y, Partial) and y.kind == "rms":
        return [replace(y, kind="inv_rms")]
    if isinstance(x, Act) and isinstance(y, Partial) and y.kind == "rms" and y.base == x:
        return [replace(y, kind="normed")]
    if s is not None and s != 0:
        if isinstance(x, Act | Heads):
            return [replace(x, scale=x.scale / s)]
        if isinstance(x, Partial) and x.kind == "scores":
            return [replace(x, info=(x.info[0], x.info[1] / s, x.info[2]))]
    raise mismatch(node, ins)


@handles("Pow")
def _pow(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, e = ins
    if isinstance(x, Act) and x.scale == 1.0 and scalar(e) in (2.0, 3.0):
        return [Partial("sq" if scalar(e) == 2.0 else "cube", x, x.shape)]
    raise mismatch(node, ins)


@handles("ReduceMean")
def _reduce_mean(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    axes = axes_of(ins, a)
    if (isinstance(x, Partial) and x.kind == "sq" and axes is not None and len(axes) == 1
            and axis_is_last(int(axes[0]), len(x.shape)) and a.get("keepdims", 1) == 1):
        return [replace(x, kind="meansq")]
    raise mismatch(node, ins)


renames_partial("Sqrt", "meansq_eps", "rms")  # RMSNorm: sqrt(mean(x^2) + eps) ...
renames_partial("Reciprocal", "rms", "inv_rms")  # ... then 1 / that


def _rms_norm(m: Matcher, node: onnx.NodeProto, p: Partial, w: np.ndarray) -> Act:
    x = p.base
    assert isinstance(x, Act)
    return Act(m.rec("rms_norm", (x.rec,), node, weight=w, eps=float(p.info[0])), x.shape)


# ---------------------------------------------------------------- activations


@handles("Sigmoid")
def _sigmoid(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    if isinstance(ins[0], Act) and ins[0].scale == 1.0:
        return [Partial("sigmoid", ins[0], ins[0].shape)]
    raise mismatch(node, ins)


@handles("Relu", "Gelu")
def _act(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if not isinstance(x, Act) or x.scale != 1.0:
        raise mismatch(node, ins)
    kind = "relu" if node.op_type == "Relu" else "gelu" if a.get("approximate", "none") == "none" else "gelu_tanh"
    return [Act(m.rec("act", (x.rec,), node, kind=kind), x.shape)]


@handles("Erf")
def _erf(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if isinstance(x, Act) and close(x.scale, _SQRT1_2, 1e-4):
        return [Partial("erf", replace(x, scale=1.0), x.shape)]
    raise mismatch(node, ins)


@handles("Tanh")
def _tanh(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if isinstance(x, Partial) and x.kind == "tanh_inner":
        return [Partial("tanh", x.base, x.shape)]
    raise mismatch(node, ins)


def _gelu_product(m: Matcher, node: onnx.NodeProto, p: Partial, factor: float) -> Act:
    if factor != 0.5:
        raise NoMatch(f"GELU-like product scaled by {factor}, expected 0.5")
    x = p.base
    assert isinstance(x, Act)
    kind = "gelu" if "erf" in p.kind else "gelu_tanh"
    return Act(m.rec("act", (x.rec,), node, kind=kind), x.shape)


# ---------------------------------------------------------------- norms (fused forms)


def _norm_weight(v: object, width: int, what: str) -> np.ndarray:
    w = const_vector(v, width)
    if w is None:
        raise NoMatch(f"{what} is not a constant vector of {width}")
    return w


@handles("SimplifiedLayerNormalization", "RMSNormalization")
def _simplified_ln(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if not isinstance(x, Act) or x.scale != 1.0 or not axis_is_last(int(a.get("axis", -1)), len(x.shape)):
        raise mismatch(node, ins)
    w = _norm_weight(ins[1], x.shape[-1], "scale")
    r = m.rec("rms_norm", (x.rec,), node, weight=w, eps=float(a.get("epsilon", 1e-5)))
    return [Act(r, x.shape)]


@handles("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
def _skip_ln(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, skip = ins[0], ins[1]
    simplified = node.op_type.startswith("SkipSimplified")
    bias_at = 3 if simplified else 4
    if not (isinstance(x, Act) and isinstance(skip, Act) and x.scale == skip.scale == 1.0):
        raise mismatch(node, ins)
    if len(ins) > bias_at and ins[bias_at] is not None:
        raise NoMatch("the bias input of a skip layer norm is not supported")
    s = m.rec("add", (x.rec, skip.rec), node)
    w = _norm_weight(ins[2], x.shape[-1], "gamma")
    eps = float(a.get("epsilon", 1e-5))
    if simplified:
        r = m.rec("rms_norm", (s,), node, weight=w, eps=eps)
    else:
        beta = ins[3] if len(ins) > 3 else None
        extra = {"bias": _norm_weight(beta, x.shape[-1], "beta")} if beta is not None else {}
        r = m.rec("layer_norm", (s,), node, weight=w, eps=eps, **extra)
    # outputs: normalised, mean, inv_std_var, input + skip
    return [Act(r, x.shape), None, None, Act(s, x.shape)]


@handles("LayerNormalization")
def _layer_norm(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if not isinstance(x, Act) or x.scale != 1.0 or not axis_is_last(int(a.get("axis", -1)), len(x.shape)):
        raise mismatch(node, ins)
    w = _norm_weight(ins[1], x.shape[-1], "scale")
    extra = {}
    if len(ins) > 2 and ins[2] is not None:
        extra["bias"] = _norm_weight(ins[2], x.shape[-1], "bias")
    r = m.rec("layer_norm", (x.rec,), node, weight=w, eps=float(a.get("epsilon", 1e-5)), **extra)
    return [Act(r, x.shape)]


def _position_embedding(m: Matcher, node: onnx.NodeProto, x: Act, y: Known) -> Act:
    """``x + table[pos + offset]``: an input-derived addend equal to rows of a constant table."""
    rows = np.broadcast_to(y.value, x.shape).reshape(-1, x.shape[-1])
    pos = m.probe.positions
    for init in m.graph.initializer:
        if len(init.dims) != 2 or init.dims[1] != x.shape[-1] or init.dims[0] < len(pos):
            continue
        known = m.env[init.name]
        assert isinstance(known, Known)
        table = known.value
        for offset in range(0, 4):
            if pos[-1] + offset < table.shape[0] and np.array_equal(table[pos + offset], rows):
                r = m.rec("pos_embed", (), node, table=table, offset=offset)
                return Act(m.rec("add", (x.rec, r), node), x.shape)
    raise NoMatch("an input-derived tensor is added to the hidden states, but it is not rows of a "
                  "position table")
