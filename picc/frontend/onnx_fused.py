"""Matcher handlers for fused attention and rotary ops: onnxruntime's contrib ops
(``com.microsoft`` GroupQueryAttention, Attention, RotaryEmbedding) and their standard opset-23
counterparts (``Attention``, ``RotaryEmbedding``, which torch.onnx's optimizer fuses SDPA and
rotate_half into when exporting with ``opset_version=23``).

The two domains share op names but not signatures, so ``Attention`` and ``RotaryEmbedding``
dispatch on the node's domain. Every fused attention becomes one ``attention`` recognised op; a
fused QKV projection (contrib ``Attention``, packed GQA) becomes one ``linear`` whose rows
``onnx_decoder`` splits into q, k and v.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import onnx

from picc.frontend.onnx_attention import attention_context, masked_scores, table_tol
from picc.frontend.onnx_match import Act, Heads, Known, Matcher, NoMatch, Partial, handles, mismatch


def _contrib(node: onnx.NodeProto) -> bool:
    return node.domain == "com.microsoft"


def _padded(ins: list, n: int) -> list:
    return ins + [None] * (n - len(ins))


def _extra_inputs(node: onnx.NodeProto, first: int, names: str) -> None:
    if any(node.input[first:]):
        raise NoMatch(f"{node.op_type} with {names} inputs is not supported")


# ---------------------------------------------------------------- rotary embedding


@handles("RotaryEmbedding")
def _rotary_embedding(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    # com.microsoft: (input, position_ids, cos_cache, sin_cache); ai.onnx (opset 23):
    # (X, cos_cache, sin_cache, position_ids?), where without position_ids the caches hold one
    # row per token ([batch, seq, d/2]) instead of one per position.
    if _contrib(node):
        x, pos, cos, sin = _padded(ins, 4)[:4]
    else:
        x, cos, sin, pos = _padded(ins, 4)[:4]
    if a.get("rotary_embedding_dim", 0):
        raise NoMatch("rotary_embedding_dim: partial rotary embeddings are not supported")
    if not (isinstance(cos, Known) and isinstance(sin, Known) and cos.value.shape == sin.value.shape):
        raise mismatch(node, ins)
    if isinstance(x, Heads) and x.layout == "bnsd":
        n, d = x.n, x.d
    elif isinstance(x, Act) and len(x.shape) == 3:
        n = int(a.get("num_heads", 0))
        d = 2 * cos.value.shape[-1]
        n = n or (x.shape[-1] // d if x.shape[-1] % d == 0 else 0)
        if n * d != x.shape[-1]:
            raise NoMatch(f"cannot split {x.shape[-1]} features into heads of {d}")
    else:
        raise mismatch(node, ins)
    if pos is not None:  # tables indexed by position
        if not isinstance(pos, Known) or cos.value.ndim != 2:
            raise mismatch(node, ins)
        tables, positions = (cos.value, sin.value), np.arange(cos.value.shape[0])
    else:  # one row per token of the probe
        rows = cos.value.reshape(-1, cos.value.shape[-1])
        if rows.shape[0] != m.probe.seq:
            raise NoMatch(f"cos_cache {list(cos.value.shape)} has no row per token")
        tables, positions = (rows, sin.value.reshape(rows.shape)), m.probe.positions
    if 2 * tables[0].shape[-1] != d:
        raise NoMatch(f"rotary tables cover {2 * tables[0].shape[-1]} of {d} head features; partial "
                      "rotary embeddings are not supported")
    r = m.rec("rope", (x.rec,), node, cos=np.asarray(tables[0], np.float32), sin=np.asarray(tables[1], np.float32),
              positions=positions, n_heads=n, head_dim=d, style="gptj" if a.get("interleaved", 0) else "llama",
              table_tol=table_tol(cos))
    return [replace(x, rec=r)]


# ---------------------------------------------------------------- attention


@handles("Attention")
def _attention(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    return _contrib_attention(m, node, ins, a) if _contrib(node) else _onnx_attention(m, node, ins, a)


def _onnx_attention(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    """Opset 23's ``Attention(Q, K, V, attn_mask?, past_key?, past_value?)``: 4-D heads
    [batch, heads, seq, d], or 3-D [batch, seq, heads * d] with ``q_num_heads`` / ``kv_num_heads``;
    grouped when K and V have fewer heads than Q."""
    q, k, v, mask, past_k, past_v = _padded(ins, 6)[:6]
    _extra_inputs(node, 6, "nonpad_kv_seqlen")
    if float(a.get("softcap", 0.0)) != 0.0:
        raise NoMatch("Attention with softcap is not supported")
    if len(node.output) > 3 and node.output[3]:
        raise NoMatch("Attention's qk_matmul_output output is not supported")
    flat = isinstance(q, Act)
    if flat:
        q, k, v = _split_heads(q, k, v, int(a.get("q_num_heads", 0)), int(a.get("kv_num_heads", 0)))
    if not all(isinstance(t, Heads) and t.layout == "bnsd" for t in (q, k, v)):
        raise mismatch(node, ins)
    past = 0
    if past_k is not None or past_v is not None:
        if not all(isinstance(t, Heads) and t.past and t.layout == "bnsd" for t in (past_k, past_v)):
            raise mismatch(node, ins)
        past = past_k.shape[2]
        k, v = (replace(t, past=True, shape=(1, t.n, p.shape[2] + t.shape[2], t.d), offset=p.offset)
                for t, p in ((k, past_k), (v, past_v)))
    if k.groups == 1 and q.n != k.n:
        if q.n % k.n or v.n != k.n or v.groups != 1:
            raise NoMatch(f"{q.n} query heads do not share {k.n} key/value heads evenly")
        k, v = replace(k, groups=q.n // k.n), replace(v, groups=q.n // k.n)
    seq, keys = q.shape[2], k.shape[2]
    bias = np.zeros((1, 1, seq, keys), np.float32)
    if mask is not None:
        if not isinstance(mask, Known):
            raise mismatch(node, ins)
        mv = mask.value
        bias = bias + (np.where(mv, np.float32(0), np.float32(-np.inf)) if mv.dtype == np.bool_ else mv)
    # Causal and window masks are aligned bottom-right by the cache given to the op itself
    # (past_key), not by keys concatenated before it (see the ONNX reference implementation).
    i, j = np.arange(seq)[:, None] + past, np.arange(keys)[None, :]
    allowed = np.ones((seq, keys), np.bool_)
    if a.get("is_causal", 0):
        allowed &= j <= i
    left, right = int(a.get("left_window_size", -1)), int(a.get("right_window_size", -1))
    if left >= 0:
        allowed &= i - j <= left
    if right >= 0:
        allowed &= j - i <= right
    bias = np.where(allowed, bias, np.float32(-np.inf)).astype(np.float32)
    scale = float(a.get("scale", 0.0)) or 1 / math.sqrt(q.d)
    keys_t = replace(k, layout="bndt", shape=(1, k.n, k.d, keys))
    scores = Partial("scores", replace(q, scale=1.0), (1, q.n, seq, keys), (keys_t, scale * q.scale * k.scale, None))
    probs = replace(masked_scores(scores, Known(bias, const=False), m), kind="probs")
    out = attention_context(m, node, probs, v)
    y: Act | Heads = Act(out.rec, (1, seq, q.n * q.d)) if flat else out
    return [y, k, v]


def _split_heads(q: Act, k: object, v: object, n: int, n_kv: int) -> tuple[Heads, Heads, Heads]:
    if not (n and n_kv and isinstance(k, Act) and isinstance(v, Act) and q.shape[-1] % n == 0):
        raise NoMatch("3-D Attention inputs need q_num_heads and kv_num_heads")
    d = q.shape[-1] // n
    if k.shape[-1] != n_kv * d or v.shape[-1] != n_kv * d:
        raise NoMatch(f"keys {k.shape[-1]} / values {v.shape[-1]} are not {n_kv} heads of {d}")
    return tuple(Heads(t.rec, (1, h, t.shape[-2], d), "bnsd", h, d, scale=t.scale)  # type: ignore[return-value]
                 for t, h in ((q, n), (k, n_kv), (v, n_kv)))


def _contrib_attention(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    """com.microsoft ``Attention(input, weights, bias?, mask_index?, past?)``: the QKV projection
    (weights [hidden, 3 * hidden]) and multi-head attention in one op, causal when
    ``unidirectional``; ``past`` / ``present`` stack keys and values: [2, batch, heads, seq, d]."""
    x, w, bias, mask, past = _padded(ins, 5)[:5]
    _extra_inputs(node, 5, "attention_bias or past_sequence_length")
    n = int(a["num_heads"])
    if not a.get("unidirectional", 0):
        raise NoMatch("Attention without unidirectional=1 is not causal")
    if a.get("do_rotary", 0):
        raise NoMatch("Attention with do_rotary is not supported")
    if a.get("past_present_share_buffer", 0):
        raise NoMatch("Attention with past_present_share_buffer is not supported")
    if not (isinstance(x, Act) and x.scale == 1.0 and isinstance(w, Known) and w.const and w.value.ndim == 2
            and w.value.shape[0] == x.shape[-1] and w.value.shape[1] % (3 * n) == 0):
        raise mismatch(node, ins)
    width = w.value.shape[1] // 3
    sizes = list(a.get("qkv_hidden_sizes", [width] * 3))
    if sizes != [width] * 3:
        raise NoMatch(f"qkv_hidden_sizes {sizes}: q, k and v of different widths are not supported")
    if bias is not None and not (isinstance(bias, Known) and bias.const and bias.value.shape == (3 * width,)):
        raise NoMatch("the bias is not a constant vector of the QKV width")
    if mask is not None and not (isinstance(mask, Known) and mask.value.ndim == 2
                                 and mask.value.shape[-1] == m.probe.total and np.all(mask.value != 0)):
        # for the probe, an attention_mask input is all ones: only padding could be masked
        raise NoMatch("mask_index other than a [batch, total] attention mask is not supported")
    if past is not None and not (isinstance(past, Heads) and past.layout == "kvbnsd"):
        raise mismatch(node, ins)
    d = width // n
    lin = m.rec("linear", (x.rec,), node, weight=np.ascontiguousarray(w.value.T),
                **({"bias": bias.value} if bias is not None else {}))
    scale = float(a.get("scale", 0.0)) or 1 / math.sqrt(d)
    r = m.rec("attention", (lin,), node, n_heads=n, n_kv_heads=n, head_dim=d, scale=scale, window=None,
              cached=past is not None, packed=True)
    present = Heads(r, (2, 1, n, m.probe.total, d), "kvbnsd", n, d, past=True)
    return [Act(r, (*x.shape[:-1], width)), present]


@handles("GroupQueryAttention")
def _gqa(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
    q, k, v, past_k, past_v, _, _, cos, sin = _padded(ins, 9)[:9]
    n, n_kv = int(a["num_heads"]), int(a["kv_num_heads"])
    if int(a.get("local_window_size", -1)) != -1 or float(a.get("softcap", 0.0)) != 0.0:
        raise NoMatch("GroupQueryAttention with local_window_size or softcap is not supported")
    _extra_inputs(node, 9, "position_ids, attention_bias or head_sink")
    if not isinstance(q, Act) or q.scale != 1.0:
        raise mismatch(node, ins)
    packed = k is None and v is None
    if packed:
        d = q.shape[-1] // (n + 2 * n_kv)
        sources: tuple[int, ...] = (q.rec,)
    elif isinstance(k, Act) and isinstance(v, Act):
        d = q.shape[-1] // n
        sources = (q.rec, k.rec, v.rec)
    else:
        raise mismatch(node, ins)
    rope: dict[str, object] = {}
    if a.get("do_rotary", 0):
        if not (isinstance(cos, Known) and cos.const and isinstance(sin, Known) and sin.const):
            raise NoMatch("do_rotary without constant cos_cache / sin_cache")
        rope = dict(cos=cos.value, sin=sin.value, positions=np.arange(cos.value.shape[0]),
                    style="gptj" if a.get("rotary_interleaved", 0) else "llama", table_tol=table_tol(cos))
    scale = float(a.get("scale", 0.0)) or 1 / math.sqrt(d)
    r = m.rec("attention", sources, node, n_heads=n, n_kv_heads=n_kv, head_dim=d, scale=scale,
              window=None, cached=isinstance(past_k, Heads), packed=packed, **rope)
    present = [Heads(r, (1, n_kv, m.probe.total, d), "bnsd", n_kv, d, past=True)] * 2
    return [Act(r, (*q.shape[:-1], n * d)), *present]
