"""The reference interpreter: numpy semantics of every op, the oracle for passes and backends.

It favours clarity over speed, but works on whole sequences at once so that a 64-token prefill of
a 135M model takes seconds. ``Interpreter.run`` executes one call of ``forward`` and keeps each
attention op's KV cache between calls, so prefill followed by decode steps works as in a runtime.

An op with ``x_format = "i16"`` or ``"i8"`` (chosen by ``select-kernels``) dots its 4-bit weight
rows (and a q8_0 LM head in the rows8 layout its q8_0 rows) with its input rounded to int16 or
int8 per block of 32: the interpreter rounds that input as the kernel does
(``picc.quant.round_x_blocks``), so it stays the oracle of those kernels.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
from scipy.special import erf

from picc import kernel_names, quant
from picc.blas import blas_threads
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.weights import WeightStore
from picc.targets.host import host_cores

_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The activation functions of ``picc.ir.ops.ACTIVATIONS``, in float32."""
    if name == "relu":
        return np.maximum(x, np.float32(0))
    if name == "silu":
        return x / (np.float32(1) + np.exp(-x))
    if name == "gelu":
        return (np.float32(0.5) * x * (np.float32(1) + erf(x / np.float32(np.sqrt(2))))).astype(
            np.float32
        )
    if name == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)
        return np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))
    raise NotImplementedError(name)


def clamped_swiglu(gate: np.ndarray | None, up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's SwiGLU (``picc.ir.ops.MoE.swiglu_limit``): ``g sigmoid(alpha g) (u + 1)`` of the
    gate clamped above at ``limit`` and the up projection to ``[-limit, limit]``, in float32."""
    assert gate is not None
    lim = np.float32(limit)
    g, u = np.minimum(gate, lim), np.clip(up, -lim, lim)
    return g / (np.float32(1) + np.exp(-(np.float32(alpha) * g))) * (u + np.float32(1))


def moe_route(op: O.MoE, logits: np.ndarray, choice_bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``op``'s routed experts of each token from its router's ``logits`` [seq, n_experts]
    (float32; ``choice_bias`` the op's, as floats): their indices [seq, top_k] in the order
    chosen and their weights, in float32 as ``picc.ir.ops.MoE`` says (probabilities, divided by
    their plain sum where ``norm_topk``, then times ``routed_scale``)."""
    if op.scoring == "sigmoid":
        probs = np.float32(1) / (np.float32(1) + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    scores = probs + (np.float32(0) if choice_bias is None else choice_bias)
    chosen, by_probability = np.empty((logits.shape[0], op.top_k), np.int64), op.ranks_by_probability
    for s in range(logits.shape[0]):
        rank = scores[s] if by_probability else logits[s]
        if op.n_group > 1:  # the experts of the topk_group best groups, the lower group first among equals
            members = np.sort(scores[s].reshape(op.n_group, -1), axis=1)
            score = members[:, -1] if op.group_score == "max" else members[:, -1] + members[:, -2]
            best = np.zeros(op.n_group, bool)
            best[np.argsort(-score, kind="stable")[: op.topk_group]] = True
            rank = np.where(np.repeat(best, op.n_experts // op.n_group), rank, np.float32(-np.inf))
        chosen[s] = np.argsort(-rank, kind="stable")[: op.top_k]
    weights = np.take_along_axis(probs, chosen, axis=1)
    if op.norm_topk:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return chosen, weights * np.float32(op.routed_scale)


def rope_cos_sin(op: O.Rope, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cosines and sines of ``op``'s angles at positions ``pos`` (times its
    ``attention_factor``): float32 [len(pos), r/2] each. The CPU kernels read them from tables
    made by this function, so they rotate with the interpreter's very values."""
    angles = pos.astype(np.float32)[:, None] * op.inv_freq()[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if op.attention_factor != 1.0:
        cos, sin = cos * np.float32(op.attention_factor), sin * np.float32(op.attention_factor)
    return cos, sin


def rope(op: O.Rope, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    seq = x.shape[0]
    heads = x.reshape(seq, op.n_heads, op.head_dim)
    r = op.rotated
    cos, sin = (t[:, None, :] for t in rope_cos_sin(op, pos))  # [seq, 1, r/2]
    part = heads[..., :r]
    if op.style == "llama":
        a, b = part[..., : r // 2], part[..., r // 2 :]
        rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(part.shape)
    out = np.concatenate([rotated, heads[..., r:]], axis=-1)
    return out.reshape(seq, -1).astype(np.float32)


def concat_heads(op: O.ConcatHeads, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Head h of the result: ``a``'s head h then ``b``'s (an operand of one head gives it to every head)."""
    seq = a.shape[0]
    parts = [np.broadcast_to(x.reshape(seq, -1, dim), (seq, op.n_heads, dim))
             for x, dim in ((a, op.a_dim), (b, op.b_dim))]
    return np.concatenate(parts, axis=-1).reshape(seq, -1)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    return quant.dequantize(quant.quantize(x, "bf16"), "bf16", x.shape)


class KVCache:
    """Keys and values of one attention op at absolute positions 0..length-1: rows of ``width``
    features, the values' ``v_width`` (default ``width``) where values are narrower than keys."""

    def __init__(self, width: int, v_width: int | None = None) -> None:
        self.k = np.zeros((0, width), np.float32)
        self.v = np.zeros((0, width if v_width is None else v_width), np.float32)
        self.length = 0

    def write(self, pos: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        end = int(pos.max()) + 1
        if end > self.k.shape[0]:
            grow = max(end, 2 * self.k.shape[0], 16)
            self.k = np.concatenate([self.k, np.zeros((grow - self.k.shape[0], k.shape[1]),
                                                      np.float32)])
            self.v = np.concatenate([self.v, np.zeros((grow - self.v.shape[0], v.shape[1]),
                                                      np.float32)])
        if int(pos.min()) > self.length:
            raise PiccError(f"positions must continue the cache: it holds {self.length} tokens, "
                            f"got position {int(pos.min())}")
        self.k[pos] = k
        self.v[pos] = v
        self.length = max(self.length, end)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)`` in f32, in transformers' order (divide, tanh, multiply)."""
    c = np.float32(cap)
    return np.tanh(x / c) * c


def attention(op: O.Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
              cache: KVCache, sinks: np.ndarray | None = None) -> np.ndarray:
    """``op`` over ``cache`` after writing k and v at ``pos``; ``sinks``: the values of
    ``op.sinks`` (f32 [n_heads]), each head's extra logit in the softmax's maximum and sum."""
    if (sinks is None) != (op.sinks is None):
        raise PiccError(f"%{op.result}: the sinks' values go with a sinks weight, and only with one "
                        f"(sinks = {op.sinks and '@' + op.sinks})")
    if op.kv_format == "f16":  # the cache holds half precision: the keys and values it gives back
        k, v = (t.astype(np.float16).astype(np.float32) for t in (k, v))
    cache.write(pos, k, v)
    seq, length, d, dv = q.shape[0], cache.length, op.head_dim, op.v_dim
    kv, group = op.n_kv_heads, op.n_heads // op.n_kv_heads
    # Query heads grouped under their K/V head, so each K/V head is one contiguous matmul
    # (numpy's batched matmul is only fast on contiguous operands).
    qg = np.ascontiguousarray(q.reshape(seq, kv, group, d).transpose(1, 2, 0, 3)).reshape(kv, group * seq, d)
    kt = np.ascontiguousarray(cache.k[:length].reshape(length, kv, d).transpose(1, 2, 0))  # [KV, D, L]
    vh = np.ascontiguousarray(cache.v[:length].reshape(length, kv, dv).transpose(1, 0, 2))  # [KV, L, DV]
    scores = (qg @ kt).reshape(kv * group, seq, length)  # head h = kv_head * group + g
    if op.alibi == "falcon":
        slopes = round_to_bf16(op.alibi_slopes())
        bias = round_to_bf16(slopes[:, None] * np.arange(length, dtype=np.float32)[None, :])
        scores += bias[:, None, :]
    scores *= np.float32(op.scale)
    if op.softcap is not None:
        scores = softcap(scores, op.softcap)
    j = np.arange(length)[None, :]
    p = pos[:, None].astype(np.int64)
    visible = j <= p
    if op.window is not None:
        visible &= p - j < op.window
    scores += np.where(visible, np.float32(0), np.float32(-np.inf))[None]
    # A sink is a logit per head with no value: in the maximum and the sum only.
    sink = None if sinks is None else sinks.astype(np.float32)[:, None, None]
    top = scores.max(axis=-1, keepdims=True)
    top = top if sink is None else np.maximum(top, sink)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    scores /= total if sink is None else total + np.exp(sink - top)
    out = scores.reshape(kv, group * seq, length) @ vh  # [KV, G*S, DV]
    return out.reshape(kv, group, seq, dv).transpose(2, 0, 1, 3).reshape(seq, op.n_heads * dv)


class Interpreter:
    """Runs ``module``'s ``forward`` on numpy arrays, keeping KV caches between calls."""

    def __init__(self, module: Module, weights: WeightStore, function: str = "forward") -> None:
        self.module = module
        self.weights = weights
        self.func = module.function(function)
        self.caches: dict[str, KVCache] = {}
        # Called after every ffn / sparse_ffn op computes its activations (profiling, eval).
        self.on_ffn: Callable[[FfnTrace], None] | None = None

    @property
    def length(self) -> int:
        """How many positions the KV caches hold."""
        return max((c.length for c in self.caches.values()), default=0)

    def reset(self) -> None:
        self.caches.clear()

    def run(self, tokens: np.ndarray | list[int], pos: np.ndarray | None = None) -> np.ndarray:
        """Execute ``forward`` on ``tokens`` at positions ``pos`` (default: continue the cache)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if pos is None:
            pos = np.arange(self.length, self.length + len(tokens), dtype=np.int32)
        env: dict[str, np.ndarray] = {}
        arg_values = {"tokens": tokens, "pos": np.asarray(pos, dtype=np.int32)}
        for a in self.func.args:
            if a.name not in arg_values:
                raise PiccError(f"the interpreter cannot bind argument %{a.name} of @{self.func.name}")
            env[a.name] = arg_values[a.name]
        with blas_threads(1):  # many small matmuls: BLAS threads would spin more than they help
            for op in self.func.ops:
                env[op.result] = self.eval(op, env)
        return env[self.func.ret]

    def run_many(self, windows: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None,
                 workers: int | None = None) -> list[np.ndarray]:
        """``forward`` on each of ``windows`` as a fresh sequence (positions from 0), op by op:
        every window through an op before the next op, so each weight is read (and dequantized,
        within ``WeightStore.f32``'s budget) once however many windows there are, and a value or
        KV cache is dropped after its last use. The results, and ``on_ffn``'s calls with each
        layer's windows in order, are ``reset(); run(window)``'s for each window. ``progress``
        gets each op's share of the windows' tokens (the ops' count, in all, per token).

        ``workers`` windows go through an op at once, on threads (numpy releases the GIL in its
        products), each with one BLAS thread, so each window's arithmetic is ``run``'s, bit for
        bit, whatever ``workers`` is; ``on_ffn`` is still called on this thread, in window order.
        By default as many as this process has cores: a 1B model profiled 1.8x faster on two."""
        ops = self.func.ops
        last_use = {a.name: -1 for a in self.func.args}
        for i, op in enumerate(ops):
            last_use.update(dict.fromkeys(op.values(), i))
        last_use[self.func.ret] = len(ops)
        cache_done = {op.cache: i for i, op in enumerate(ops) if isinstance(op, O.Attention)}
        envs = [{"tokens": np.asarray(w, dtype=np.int32), "pos": np.arange(len(w), dtype=np.int32)}
                for w in windows]
        traces: list[list[FfnTrace]] = [[] for _ in windows]
        lanes = [self._lane(trace_list.append if self.on_ffn else None) for trace_list in traces]
        if workers is None:
            workers = host_cores()
        workers = max(1, min(workers, len(windows)))
        tokens = sum(len(w) for w in windows)

        def through(op: Op, i: int, k: int) -> int:
            env, lane = envs[k], lanes[k]
            env[op.result] = lane.eval(op, env)
            for name in [n for n in env if last_use.get(n, i) <= i]:
                del env[name]
            if isinstance(op, O.Attention) and cache_done[op.cache] == i:
                del lane.caches[op.cache]  # a fresh window's cache: no later op reads it
            return k

        with blas_threads(1), ThreadPoolExecutor(workers) as pool:
            for i, op in enumerate(ops):
                # In window order, each as soon as it is through (the others go on meanwhile).
                for k in pool.map(partial(through, op, i), range(len(windows))):
                    if self.on_ffn is not None:
                        for trace in traces[k]:
                            self.on_ffn(trace)
                    traces[k].clear()
                if progress is not None:
                    progress(tokens / len(ops))
        return [env[self.func.ret] for env in envs]

    def _lane(self, on_ffn: Callable[[FfnTrace], None] | None) -> Interpreter:
        """An interpreter of the same function and weights with caches of its own (one window of
        ``run_many``) that hands its FFN traces to ``on_ffn``."""
        lane = copy.copy(self)
        lane.caches = {}
        lane.on_ffn = on_ffn
        return lane

    def eval(self, op: Op, env: dict[str, np.ndarray]) -> np.ndarray:  # noqa: C901 - one case per op
        w = self.weights.f32
        match op:
            case O.Embed():
                rows = w(op.table)[env[op.tokens]]
                return rows * np.float32(op.scale) if op.scale != 1.0 else rows
            case O.PosEmbed():
                table, rows = w(op.table), env[op.pos] + op.offset
                if rows.size and int(rows.max()) >= table.shape[0]:
                    # Learned positions end (OPT: max_position_embeddings); say so, not IndexError.
                    raise PiccError(f"position {int(rows.max()) - op.offset} is beyond the "
                                    f"{table.shape[0] - op.offset} positions of @{op.table}")
                return table[rows]
            case O.RMSNorm():
                x = env[op.x]
                x = x.reshape(*x.shape[:-1], -1, op.group) if op.group else x
                ms = np.mean(x * x, axis=-1, keepdims=True)
                return ((x / np.sqrt(ms + np.float32(op.eps))) * w(op.weight)).reshape(env[op.x].shape)
            case O.LayerNorm():
                x = env[op.x]
                mean = x.mean(axis=-1, keepdims=True)
                var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
                y = (x - mean) / np.sqrt(var + np.float32(op.eps)) * w(op.weight)
                return y + w(op.bias) if op.bias else y
            case O.Linear():
                y = self.dot_input(op, op.weight, env[op.x]) @ w(op.weight).T
                return y + w(op.bias) if op.bias else y
            case O.Rope():
                return rope(op, env[op.x], env[op.pos])
            case O.ConcatHeads():
                return concat_heads(op, env[op.a], env[op.b])
            case O.Attention():
                widths = (op.n_kv_heads * op.head_dim, op.n_kv_heads * op.v_dim)  # a key's, a value's
                cache = self.caches.setdefault(op.cache, KVCache(*widths))
                return attention(op, env[op.q], env[op.k], env[op.v], env[op.pos], cache,
                                 w(op.sinks) if op.sinks else None)
            case O.Relu() | O.Silu() | O.Gelu() | O.GeluTanh():
                return activation(op.NAME, env[op.x])
            case O.Softcap():
                return softcap(env[op.x], op.cap)
            case O.MoE():
                return self.moe(op, env[op.x])
            case O.Add():
                return env[op.a] + env[op.b]
            case O.Mul():
                return env[op.a] * env[op.b]
            case SparseFFN():
                return self.ffn(op, env[op.x], env[op.mask] if op.mask else None)
            case O.FFN():
                return self.ffn(op, env[op.x])
            case FusedFFN():
                return self.fused_ffn(op, env[op.x], env[op.mask] if op.mask else None)
            case Merge():
                y = env[op.a] + env[op.b]
                return y + w(op.bias) if op.bias else y
            case Predict():
                return self.predict(op, env[op.x])
        raise NotImplementedError(op.NAME)

    def ffn(self, op: O.FFN, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Dense ``ffn``, or ``sparse_ffn``: the same with inactive neurons' ``h`` set to 0."""
        w = self.weights.f32
        up = self.dot_input(op, op.up, x) @ w(op.up).T
        if op.up_bias:
            up = up + w(op.up_bias)
        gate = None
        if op.spec.gated:
            assert op.gate is not None
            gate = self.dot_input(op, op.gate, x) @ w(op.gate).T
            if op.gate_bias:
                gate = gate + w(op.gate_bias)
        h, score = _activations(op.spec, up, gate)
        if op.score_scale:
            score = score * w(op.score_scale)
        active = None
        if isinstance(op, SparseFFN):
            if mask is not None:  # a part of a layer reads its own neurons' columns
                mask = mask[:, op.neuron_offset : op.neuron_offset + h.shape[1]]
            active = sparse_active_set(op, mask, score, h)
        if self.on_ffn is not None:
            self.on_ffn(FfnTrace(op, x, score, h, active))
        if active is not None:
            h = np.where(active, h, np.float32(0))
        # A neuron-major down is an AXPY over the active rows (no dot product, h as is).
        y = h @ w(op.down) if op.neuron_major else self.dot_input(op, op.down, h) @ w(op.down).T
        return y + w(op.down_bias) if op.down_bias else y

    def moe(self, op: O.MoE, x: np.ndarray) -> np.ndarray:
        """Each token through its router's ``top_k`` experts (:func:`moe_route`), their outputs
        weighted and summed in that order, then through the shared experts (weighted by 1, or the
        sigmoid of the router's last logit)."""
        w = self.weights.f32

        def bias(name: str | None, part: slice | None = None) -> np.ndarray | np.float32:
            return np.float32(0) if name is None else w(name) if part is None else w(name)[part]

        all_logits = x @ w(op.router).T + bias(op.router_bias)
        routed, routed_weights = moe_route(op, all_logits[:, : op.n_experts],
                                           w(op.choice_bias) if op.choice_bias else None)
        shared = np.arange(op.n_experts, op.n_experts + op.n_shared)
        shared_weight = (np.float32(1) / (np.float32(1) + np.exp(-all_logits[:, op.n_experts])) if op.shared_gated
                         else np.ones(x.shape[0], np.float32))
        up, down = w(op.up), w(op.down)
        gate = w(op.gate) if op.gate else None
        n_ff, hidden = up.shape[0] // (op.n_experts + op.n_shared), x.shape[1]

        def rounded(values: np.ndarray, weight: str) -> np.ndarray:  # as the kernel dots weight's rows
            four_bit = op.x_format != "f32" and self.weights[weight].dtype.value in kernel_names.INT_DOT_DTYPES
            return quant.round_x_blocks(values, op.x_format) if four_bit else values

        out = np.zeros_like(x)
        for s in range(x.shape[0]):
            chosen = np.concatenate([routed[s], shared])
            weights = np.concatenate([routed_weights[s], np.full(op.n_shared, shared_weight[s], np.float32)])
            for e, weight in zip(chosen, weights, strict=True):
                rows, out_rows = slice(e * n_ff, (e + 1) * n_ff), slice(e * hidden, (e + 1) * hidden)
                u = rounded(x[s], op.up) @ up[rows].T + bias(op.up_bias, rows)
                g = (rounded(x[s], op.gate) @ gate[rows].T + bias(op.gate_bias, rows)
                     if op.gate and gate is not None else None)
                h = clamped_swiglu(g, u, op.swiglu_limit, op.swiglu_alpha) if op.swiglu_limit is not None \
                    else _activations(op.spec, u, g)[0]
                out[s] += weight * (rounded(h, op.down) @ down[out_rows].T + bias(op.down_bias, out_rows))
        return out

    def dot_input(self, op: Op, weight: str, x: np.ndarray) -> np.ndarray:
        """``x`` as ``op``'s kernel reads it when it dots it with rows of ``weight``: rounded to
        int16 or int8 per block for the 4-bit rows of an op whose ``x_format`` says so (and int8
        for q8_0 rows read from the rows8 layout), else as is."""
        if not (isinstance(op, O.MatrixOp) and op.rounds_x):
            return x
        fmt = self.weights[weight].dtype.value
        if fmt in kernel_names.INT_DOT_DTYPES or (fmt in kernel_names.BYTE_ROWS8_DTYPES and op.layout == "rows8"):
            return quant.round_x_blocks(x, op.x_format)
        return x

    def fused_ffn(self, op: FusedFFN, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The partial sum of ``op``'s active neurons (plus ``down_bias`` for a whole layer)."""
        w = self.weights.f32
        spec = O.FFN_FORMS[op.form]
        if op.up_gate is not None:
            both = self.dot_input(op, op.up_gate, x) @ w(op.up_gate).reshape(-1, x.shape[1]).T  # up_0, gate_0, ...
            bias = w(op.up_gate_bias).reshape(-1) if op.up_gate_bias else np.float32(0)
            both = both + bias
            up, gate = both[:, 0::2], both[:, 1::2]
        else:
            assert op.up is not None
            up = self.dot_input(op, op.up, x) @ w(op.up).T + (w(op.up_bias) if op.up_bias else np.float32(0))
            gate = (self.dot_input(op, op.gate, x) @ w(op.gate).T + (w(op.gate_bias) if op.gate_bias else np.float32(0))
                    if op.gate else None)
        h, score = _activations(spec, up, gate)
        if op.score_scale:
            score = score * w(op.score_scale)
        n = h.shape[1]
        if op.mode == "predictor":
            assert mask is not None
            active = mask[:, op.neuron_offset : op.neuron_offset + n]
        elif op.mode == "gate-first":
            active = score > np.float32(op.threshold)
        elif op.mode == "down-only":
            active = np.abs(h) > np.float32(op.threshold)
        else:
            active = None
        if self.on_ffn is not None:
            self.on_ffn(FfnTrace(op, x, score, h, active))
        if active is not None:
            h = np.where(active, h, np.float32(0))
        y = h @ w(op.down)
        return y + w(op.down_bias) if op.down_bias else y

    def predict(self, op: Predict, x: np.ndarray) -> np.ndarray:
        return predictor_logits(op, x, self.weights) > np.float32(op.threshold)


def _activations(spec: O.FfnForm, up: np.ndarray, gate: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``h`` of an FFN form from its projections, and each neuron's activity score."""
    if not spec.gated:
        h = activation(spec.act, up)
        return h, np.abs(h)
    assert gate is not None
    act = activation(spec.act, gate)
    if spec.act_on_up:
        up = activation(spec.act, up)
    h = act * up
    return h, np.abs(h) if spec.act_on_up else np.abs(act)


def predictor_logits(op: Predict, x: np.ndarray, weights: WeightStore) -> np.ndarray:
    """``fc2(relu(fc1(x)))``: the predictor's logit for each neuron."""
    hidden = x @ weights.f32(op.fc1).T
    if op.fc1_bias:
        hidden = hidden + weights.f32(op.fc1_bias)
    logits = np.maximum(hidden, np.float32(0)) @ weights.f32(op.fc2).T
    return logits + weights.f32(op.fc2_bias) if op.fc2_bias else logits


def sparse_active_set(op: SparseFFN, mask: np.ndarray | None, score: np.ndarray,
                      h: np.ndarray) -> np.ndarray:
    """Which neurons a ``sparse_ffn`` computes, by its mode."""
    if op.mode == "predictor":
        assert mask is not None
        return mask
    if op.mode == "gate-first":
        assert op.threshold is not None
        return score > np.float32(op.threshold)
    assert op.down_threshold is not None
    return np.abs(h) > np.float32(op.down_threshold)


@dataclass(frozen=True)
class FfnTrace:
    """What ``Interpreter.on_ffn`` sees of one ffn / sparse_ffn execution.

    ``score`` is each neuron's activity score (see ``picc.ir.ops.FFN``), ``h`` the dense
    activation that multiplies ``down``, ``active`` the set a ``sparse_ffn`` computes (None for a
    dense ``ffn``).
    """

    op: O.FFN | FusedFFN
    x: np.ndarray
    score: np.ndarray
    h: np.ndarray
    active: np.ndarray | None
