"""Matcher handlers for attention: head split/merge, rotary embedding, repeat_kv, KV-cache concat,
scores with scale and causal mask, softmax. The fused ops (GroupQueryAttention, Attention,
RotaryEmbedding) are in ``onnx_fused``.

Rotary tables and masks are auxiliary values: they are read off for the probe's positions and
checked (``onnx_decoder`` fits a ``RopeSpec`` to the tables; the mask must be causal, possibly
with a sliding window).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import onnx

from picc.frontend.onnx_match import (
    Act,
    Heads,
    Known,
    Matcher,
    NoMatch,
    Partial,
    axes_of,
    axis_is_last,
    handles,
    mismatch,
    renames_partial,
)


def _target_shape(shape: tuple[int, ...], target: np.ndarray, allowzero: bool) -> tuple[int, ...]:
    """ONNX Reshape's output shape (0 copies a dim unless ``allowzero``; -1 is inferred)."""
    dims = [int(d) for d in target.reshape(-1)]
    out = [shape[i] if d == 0 and not allowzero else d for i, d in enumerate(dims)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = math.prod(shape) // max(known, 1)
    if math.prod(out) != math.prod(shape):
        raise NoMatch(f"cannot reshape {list(shape)} to {dims}")
    return tuple(out)


@handles("Reshape")
def _reshape(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, t = ins
    if not isinstance(t, Known):
        raise mismatch(node, ins)
    out = _target_shape(getattr(x, "shape", ()), t.value, bool(a.get("allowzero", 0)))
    squeezed = tuple(d for d in out if d != 1)
    if isinstance(x, Act):
        seq, width = x.shape[-2] if len(x.shape) > 1 else 1, x.shape[-1]
        if len(out) == 4 and out[0] == 1 and out[1] == seq and out[2] * out[3] == width:
            return [Heads(x.rec, out, "bsnd", out[2], out[3], scale=x.scale)]
        if squeezed == tuple(d for d in x.shape if d != 1) and len(out) <= 3:
            return [replace(x, shape=out)]
    if isinstance(x, Heads):
        # SDPA decompositions fold batch into heads for the k transpose, then unfold it again.
        if x.layout in ("bnsd", "bndt") and out == x.shape[1:]:
            return [replace(x, shape=out, layout=x.layout[1:])]
        if x.layout in ("nsd", "ndt") and out == (1, *x.shape):
            return [replace(x, shape=out, layout="b" + x.layout)]
        if x.layout == "bsnd" and len(out) in (2, 3) and out[-1] == x.n * x.d and out[-2] == x.shape[1]:
            if x.scale != 1.0:
                raise NoMatch("heads merged with a pending scale")
            return [Act(x.rec, out)]
        if x.layout == "bngsd" and out == (1, x.n * x.groups, x.shape[3], x.d):
            return [replace(x, shape=out, layout="bnsd")]
    raise mismatch(node, ins)


@handles("Transpose")
def _transpose(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    perm = list(a.get("perm", []))
    if isinstance(x, Heads):
        s = x.shape
        if perm == [0, 2, 1, 3] and x.layout in ("bsnd", "bnsd"):
            layout = "bnsd" if x.layout == "bsnd" else "bsnd"
            return [replace(x, layout=layout, shape=(s[0], s[2], s[1], s[3]))]
        if perm == [0, 2, 3, 1] and x.layout == "bsnd":  # keys straight to q @ k^T's layout
            return [replace(x, layout="bndt", shape=(s[0], s[2], s[3], s[1]))]
        if perm == [0, 1, 3, 2] and x.layout == "bnsd":
            return [replace(x, layout="bndt", shape=(s[0], s[1], s[3], s[2]))]
        if perm == [0, 2, 1] and x.layout == "nsd":
            return [replace(x, layout="ndt", shape=(s[0], s[2], s[1]))]
    raise mismatch(node, ins)


@handles("Unsqueeze")
def _unsqueeze(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    axes = axes_of(ins, a)
    if isinstance(x, Heads) and x.layout == "bnsd" and list(axes or []) == [2]:
        s = x.shape
        return [replace(x, layout="bn1sd", shape=(s[0], s[1], 1, s[2], s[3]))]
    raise mismatch(node, ins)


@handles("Expand")
def _expand(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x, t = ins
    if isinstance(x, Heads) and x.layout == "bn1sd" and isinstance(t, Known):
        out = tuple(np.broadcast_shapes(x.shape, tuple(int(d) for d in t.value.reshape(-1))))
        if out[:2] == x.shape[:2] and out[3:] == x.shape[3:]:
            return [replace(x, layout="bngsd", groups=out[2], shape=out)]
    raise mismatch(node, ins)


# ---------------------------------------------------------------- rotary embedding


def _slice_args(ins: list) -> tuple[int, int, int, int] | None:
    vals = []
    for k, default in ((1, None), (2, None), (3, -1), (4, 1)):
        v = ins[k] if len(ins) > k else None
        if v is None:
            vals.append(default)
        elif isinstance(v, Known) and v.value.size == 1:
            vals.append(int(v.value.reshape(())))
        else:
            return None
    return tuple(vals)  # type: ignore[return-value]


@handles("Slice")
def _slice(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    args = _slice_args(ins)
    shape = getattr(x, "shape", None)
    if args is not None and shape is not None and args[3] == 1 and -len(shape) <= args[2] < len(shape):
        start, end, axis = args[0], args[1], args[2]
        if start == 0 and end >= shape[axis]:
            return [x]  # the whole axis: exporters keep such no-op slices from x[:, :, None]
    if isinstance(x, Heads) and x.past and x.layout == "bnsd" and args is not None:
        start, end, axis, step = args
        if axis in (2, -2) and step == 1 and start < 0 and end >= x.shape[2]:
            # A sliding-window cache (transformers' DynamicSlidingWindowLayer) keeps the last
            # -start positions; the mask then covers only those (see masked_scores).
            keep = min(-start, x.shape[2])
            drop = x.shape[2] - keep
            return [replace(x, shape=(*x.shape[:2], keep, x.shape[3]), offset=x.offset + drop)]
    if isinstance(x, Heads) and x.layout in ("bnsd", "bsnd") and args is not None:
        start, end, axis, step = args
        half = x.d // 2
        if axis_is_last(axis, 4) and step == 1:
            end = min(end, x.d)
            if (start, end) == (0, half):
                return [Partial("lo", x, (*x.shape[:3], half))]
            if (start, end) == (half, x.d):
                return [Partial("hi", x, (*x.shape[:3], half))]
            raise NoMatch(f"slice [{start}:{end}] of a head of {x.d}: partial rotary embeddings are "
                          "not supported")
    raise mismatch(node, ins)


renames_partial("Neg", "hi", "neg_hi")  # rotate_half: -x[..., half:]


@handles("Concat")
def _concat(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    axis = int(a.get("axis", 0))
    if len(ins) == 2:
        x, y = ins
        if (isinstance(x, Partial) and isinstance(y, Partial) and x.kind == "neg_hi" and y.kind == "lo"
                and x.base == y.base and axis_is_last(axis, 4)):
            return [replace(x, kind="rot", shape=x.base.shape)]
        if (isinstance(x, Heads) and isinstance(y, Heads) and x.past and not y.past
                and x.layout == y.layout == "bnsd" and axis in (2, -2) and x.n in (0, y.n) and x.d in (0, y.d)):
            return [replace(y, past=True, shape=(1, y.n, x.shape[2] + y.shape[2], y.d), offset=x.offset)]
    raise mismatch(node, ins)


def rotary_table(t: Known, h: Heads) -> np.ndarray:
    """A rotary cos/sin table broadcast against heads ``h``: one row per position, [seq, d]."""
    full = np.broadcast_to(t.value, h.shape)
    per_head = full[0] if h.layout == "bnsd" else np.moveaxis(full[0], 1, 0)  # [n, seq, d]
    if not all(np.array_equal(per_head[i], per_head[0]) for i in range(per_head.shape[0])):
        raise NoMatch("rotary table differs between heads")
    return np.asarray(per_head[0], dtype=np.float32)


def table_tol(t: Known) -> float:
    """How far a rotary table of ``t``'s dtype may be from the exact float32 one (0: float32,
    where fit_rope derives the tolerance from the positions)."""
    return {np.dtype(np.float16): 2e-3, np.dtype(np.uint16): 1e-2}.get(t.value.dtype, 0.0)


def rope_done(m: Matcher, node: onnx.NodeProto, c: Partial, s: Partial) -> Heads:
    """``x * cos + rotate_half(x) * sin``: llama-style rotary embedding of heads ``c.base``."""
    h = c.base
    assert isinstance(h, Heads)
    cos, sin = c.info[0], s.info[0]
    half = h.d // 2
    if not (np.array_equal(cos[:, :half], cos[:, half:]) and np.array_equal(sin[:, :half], sin[:, half:])):
        raise NoMatch("rotary tables are not the rotate_half layout (cat(freqs, freqs))")
    r = m.rec("rope", (h.rec,), node, cos=cos[:, :half], sin=sin[:, :half], positions=m.probe.positions,
              n_heads=h.n, head_dim=h.d, style="llama", table_tol=max(c.info[1], s.info[1]))
    return replace(h, rec=r)


# ---------------------------------------------------------------- attention


def masked_scores(x: Partial, mask: Known, m: Matcher) -> Partial:
    """Scores plus a mask that must be causal (optionally with a sliding window)."""
    if x.info[2] is not None:
        raise NoMatch("a second mask added to attention scores")
    full = np.broadcast_to(mask.value, x.shape).astype(np.float32)
    rows = full[0, 0]
    if not all(np.array_equal(full[0, h], rows) for h in range(full.shape[1])):
        raise NoMatch("attention mask differs between heads (ALiBi is not supported)")
    keys = x.info[0]
    assert isinstance(keys, Heads)
    window = _window(rows, m, keys.offset)
    if keys.offset and not 0 < window <= keys.shape[-1] - m.probe.seq + 1:
        raise NoMatch(f"the KV cache keeps only {keys.shape[-1] - m.probe.seq} past positions but the "
                      f"mask allows {window or 'all'}")
    return replace(x, info=(x.info[0], x.info[1], window))


def _window(rows: np.ndarray, m: Matcher, offset: int) -> int:
    """The sliding window a [seq, keys] additive mask implements (0: plain causal); key column c
    is position ``offset + c``."""
    allowed = rows == 0
    if not np.all((rows == 0) | (rows <= -1e4)):
        raise NoMatch("attention mask has values other than 0 and a large negative number")
    q = m.probe.positions[:, None]
    j = offset + np.arange(rows.shape[1])[None, :]
    causal = j <= q
    if np.array_equal(allowed, causal):
        return 0
    for window in range(1, rows.shape[1] + 1):
        if np.array_equal(allowed, causal & (q - j < window)):
            return window
    raise NoMatch("attention mask is not causal for the probe positions")


def attention_context(m: Matcher, node: onnx.NodeProto, probs: Partial, v: Heads) -> Heads:
    q = probs.base
    k, scale, window = probs.info[0], probs.info[1], probs.info[2]
    assert isinstance(q, Heads) and isinstance(k, Heads)
    if window is None:
        raise NoMatch("attention without a causal mask")
    n_kv = k.n
    if v.n != n_kv or v.groups != k.groups or q.n != n_kv * k.groups or not (k.past == v.past):
        raise NoMatch(f"keys ({k.n} heads x {k.groups}), values ({v.n} x {v.groups}) and queries "
                      f"({q.n} heads) do not fit grouped attention")
    r = m.rec("attention", (q.rec, k.rec, v.rec), node, n_heads=q.n, n_kv_heads=n_kv, head_dim=q.d,
              scale=scale, window=window or None, cached=k.past)
    return Heads(r, (1, q.n, q.shape[2], q.d), "bnsd", q.n, q.d)


@handles("Softmax")
def _softmax(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if isinstance(x, Partial) and x.kind == "scores" and axis_is_last(int(a.get("axis", -1)), 4):
        return [replace(x, kind="probs")]
    raise mismatch(node, ins)


@handles("IsNaN")
def _isnan(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    x = ins[0]
    if isinstance(x, Partial) and x.kind == "probs":
        return [Partial("isnan", x.base, x.shape, (x,))]
    raise mismatch(node, ins)


@handles("Where")
def _where(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    cond, x, y = ins
    # where(isnan(p), 0, p): SDPA's guard for rows that are masked entirely, which causal rows
    # never are.
    if isinstance(cond, Partial) and cond.kind == "isnan" and isinstance(x, Known) and y == cond.info[0]:
        return [y]
    # where(allowed, scores, -inf): a boolean mask instead of an additive one
    fill = y.value if isinstance(y, Known) and y.value.size == 1 else None
    if (isinstance(cond, Known) and cond.value.dtype == np.bool_ and isinstance(x, Partial)
            and x.kind == "scores" and fill is not None and float(fill.reshape(())) <= -1e4):
        additive = np.where(cond.value, np.float32(0), np.float32(-np.inf))
        return [masked_scores(x, Known(additive, cond.const), m)]
    raise mismatch(node, ins)
