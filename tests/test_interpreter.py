"""The reference interpreter's op semantics, checked against torch and against itself."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import MLA_YARN, tiny_llama

from picc.frontend.llama import RopeSpec
from picc.interpreter import Interpreter, activation, concat_heads, rope
from picc.ir import ops as O
from picc.ir.types import DType, f32

RNG = np.random.default_rng(0)


def _rope_op(**kw) -> O.Rope:
    return O.Rope(result="r", type=f32("seq", 32), x="x", pos="p", n_heads=4, head_dim=8, **kw)


@pytest.mark.parametrize("name, ref", [
    ("relu", torch.relu), ("silu", torch.nn.functional.silu),
    ("gelu", torch.nn.functional.gelu),
    ("gelu_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
])
def test_activations_match_torch(name, ref):
    x = RNG.normal(0, 3, size=(5, 40)).astype(np.float32)
    np.testing.assert_allclose(activation(name, x), ref(torch.from_numpy(x)).numpy(),
                               rtol=1e-6, atol=1e-6)


def test_llama_rope_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = RNG.normal(size=(6, 32)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 100, 4000], np.int32)
    op = _rope_op(theta=500000.0)
    got = rope(op, x, pos)
    inv = torch.from_numpy(op.inv_freq())
    freqs = torch.from_numpy(pos).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    q = torch.from_numpy(x).view(1, 6, 4, 8).transpose(1, 2)
    want, _ = apply_rotary_pos_emb(q, q, emb.cos()[None], emb.sin()[None])
    np.testing.assert_allclose(got, want.transpose(1, 2).reshape(6, 32).numpy(), atol=1e-5)


def test_gptj_rope_on_llama_cpp_permuted_rows_equals_llama_rope():
    """llama.cpp permutes Q/K rows so that interleaved rope computes rotate_half rope."""
    x = RNG.normal(size=(5, 32)).astype(np.float32)
    pos = np.arange(5, dtype=np.int32) * 3
    perm = np.arange(32).reshape(4, 2, 4).swapaxes(1, 2).reshape(32)  # llama.cpp's permute()
    llama = rope(_rope_op(), x, pos)
    gptj = rope(_rope_op(style="gptj"), x[:, perm], pos)
    np.testing.assert_allclose(gptj, llama[:, perm], atol=1e-6)


def test_partial_rotary_leaves_the_tail_alone():
    x = RNG.normal(size=(3, 32)).astype(np.float32)
    out = rope(_rope_op(rotary_dim=4), x, np.array([5, 6, 7], np.int32))
    heads_in, heads_out = x.reshape(3, 4, 8), out.reshape(3, 4, 8)
    np.testing.assert_array_equal(heads_out[..., 4:], heads_in[..., 4:])
    assert not np.allclose(heads_out[..., :4], heads_in[..., :4])


def test_rope_scaling_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    op = O.Rope(result="r", type=f32("seq", 64), x="x", pos="p", n_heads=2, head_dim=32,
                theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position=8192)
    np.testing.assert_allclose(op.inv_freq(), want.numpy(), rtol=1e-6)
    params = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    op = O.Rope(result="r", type=f32("seq", 64), x="x", pos="p", n_heads=2, head_dim=32,
                scaling="linear", factor=4.0)
    np.testing.assert_allclose(op.inv_freq(), want.numpy(), rtol=1e-6)


YARN_CASES = {
    "gpt-oss": (64, {"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096}),
    "qwen3": (128, {"rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}),
    "deepseek": (64, {"rope_theta": 1e4, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16,
                      "beta_slow": 2, "original_max_position_embeddings": 4096}),
    "attention-factor": (32, {"rope_theta": 1e4, "factor": None, "attention_factor": 1.3,
                              "original_max_position_embeddings": 4096}),
    # the ramp's upper end past the last pair index (clamped to rotated - 1)
    "clamped": (16, {"rope_theta": 100.0, "factor": 4.0, "beta_slow": 0.01, "original_max_position_embeddings": 4096}),
    # both ends at 2.3 (a ramp 0.001 wide), and ends that cross (transformers ramps backwards)
    "one-end": (16, {"rope_theta": 1e4, "factor": 4.0, "beta_fast": 3.0, "beta_slow": 3.0, "truncate": False,
                     "original_max_position_embeddings": 4096}),
    "crossed": (16, {"rope_theta": 1e4, "factor": 4.0, "beta_slow": 2.0, "original_max_position_embeddings": 1}),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_inv_freq_and_attention_factor_match_transformers(case):
    """The rope op rope_from_config makes of a yarn config rotates by transformers' frequencies
    (to a float32 rounding or two: picc divides by a factor per pair where transformers blends two
    frequencies) and scales by its attention factor."""
    from pathlib import Path

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from picc.frontend.hf_config import HFConfig, rope_from_config

    head_dim, params = YARN_CASES[case]
    params = {"rope_type": "yarn", **params}
    cfg = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters=dict(params))
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    spec = rope_from_config(HFConfig(Path("config.json"), {"rope_parameters": params}), head_dim, 131072)
    op = O.Rope(result="r", type=f32("seq", 2 * head_dim), x="x", pos="p", n_heads=2, head_dim=head_dim,
                **spec.op_attrs())
    np.testing.assert_allclose(op.inv_freq(), want.numpy(), rtol=3e-7, atol=0)
    assert op.attention_factor == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("kwargs", [dict(), dict(window=3), dict(n_kv_heads=1),
                                    dict(form="relu", matrix_dtype=DType.Q4_0)])
def test_decode_with_kv_cache_equals_full_prefill(kwargs):
    model = tiny_llama(**kwargs)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    full = Interpreter(model.module, model.weights).run(tokens)
    step = Interpreter(model.module, model.weights)
    chunks = [step.run(tokens[:3])] + [step.run([t]) for t in tokens[3:6]] + [step.run(tokens[6:])]
    np.testing.assert_allclose(np.concatenate(chunks), full, rtol=1e-5, atol=1e-5)
    assert step.length == len(tokens)


def test_sliding_window_changes_only_late_positions():
    tokens = list(range(10, 20))
    plain = Interpreter(*_mw(tiny_llama())).run(tokens)
    windowed = Interpreter(*_mw(tiny_llama(window=4))).run(tokens)
    np.testing.assert_allclose(windowed[:4], plain[:4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(windowed[4:], plain[4:], atol=1e-3)


def _mw(model):
    return model.module, model.weights


def test_attention_matches_torch_sdpa_with_gqa():
    seq, h, kv, d = 7, 6, 2, 8
    q = RNG.normal(size=(seq, h * d)).astype(np.float32)
    k = RNG.normal(size=(seq, kv * d)).astype(np.float32)
    v = RNG.normal(size=(seq, kv * d)).astype(np.float32)
    op = O.Attention(result="o", type=f32(seq, h * d), q="q", k="k", v="v", pos="p", n_heads=h,
                     n_kv_heads=kv, head_dim=d, scale=0.3, cache="c")
    from picc.interpreter import KVCache, attention

    got = attention(op, q, k, v, np.arange(seq, dtype=np.int32), KVCache(kv * d))
    tq = torch.from_numpy(q).view(seq, h, d).transpose(0, 1)
    tk = torch.from_numpy(k).view(seq, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    tv = torch.from_numpy(v).view(seq, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.3)
    np.testing.assert_allclose(got, want.transpose(0, 1).reshape(seq, h * d).numpy(), atol=1e-5)


def test_soft_capped_attention_is_transformers_eager_attention():
    # Gemma 2's attn_logit_softcapping as transformers' eager_attention_forward computes it: the
    # scaled scores divided by the cap, tanh, times the cap, then the causal mask and the softmax.
    seq, h, kv, d, cap = 7, 6, 2, 8, 0.9
    q, k, v = (RNG.normal(size=(seq, n * d)).astype(np.float32) for n in (h, kv, kv))
    op = O.Attention(result="o", type=f32(seq, h * d), q="q", k="k", v="v", pos="p", n_heads=h,
                     n_kv_heads=kv, head_dim=d, scale=0.3, cache="c", softcap=cap)
    from picc.interpreter import KVCache, attention

    got = attention(op, q, k, v, np.arange(seq, dtype=np.int32), KVCache(kv * d))
    tq = torch.from_numpy(q).view(seq, h, d).transpose(0, 1)
    tk = torch.from_numpy(k).view(seq, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    tv = torch.from_numpy(v).view(seq, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    scores = torch.tanh(tq @ tk.transpose(1, 2) * 0.3 / cap) * cap
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ tv
    np.testing.assert_allclose(got, want.transpose(0, 1).reshape(seq, h * d).numpy(), atol=1e-6)
    uncapped = attention(replace(op, softcap=None), q, k, v, np.arange(seq, dtype=np.int32), KVCache(kv * d))
    assert np.abs(uncapped - got).max() > 1e-2


@pytest.mark.parametrize(("window", "cap"), [(None, None), (3, 0.9)])
def test_attention_sinks_are_transformers_gpt_oss_eager_attention(window, cap):
    # gpt-oss's sinks as transformers' eager_attention_forward takes them: each head's learned
    # logit a last column of the scores (after the scale, the cap, the causal and window masks),
    # the softmax over all, the column dropped. GQA (6 heads on 2); a prompt of 7 tokens, then
    # one more at position 7 over the cache.
    seq, h, kv, d = 7, 6, 2, 8
    q, k, v = (RNG.normal(size=(seq + 1, n * d)).astype(np.float32) for n in (h, kv, kv))
    sinks = RNG.normal(0, 1.5, size=h).astype(np.float32)
    op = O.Attention(result="o", type=f32(seq, h * d), q="q", k="k", v="v", pos="p", sinks="s", n_heads=h,
                     n_kv_heads=kv, head_dim=d, scale=0.3, cache="c", window=window, softcap=cap)
    from picc.interpreter import KVCache, attention

    cache = KVCache(kv * d)
    got = np.concatenate([attention(op, q[:seq], k[:seq], v[:seq], np.arange(seq, dtype=np.int32), cache, sinks),
                          attention(op, q[seq:], k[seq:], v[seq:], np.array([seq], np.int32), cache, sinks)])
    n = seq + 1
    tq = torch.from_numpy(q).view(n, h, d).transpose(0, 1)
    tk = torch.from_numpy(k).view(n, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    tv = torch.from_numpy(v).view(n, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    scores = tq @ tk.transpose(1, 2) * 0.3
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    i = torch.arange(n)
    hidden = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :] >= window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    combined = torch.cat([scores, torch.from_numpy(sinks).reshape(h, 1, 1).expand(h, n, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    want = torch.softmax(combined, dim=-1)[..., :-1] @ tv
    np.testing.assert_allclose(got, want.transpose(0, 1).reshape(n, h * d).numpy(), atol=1e-6)
    plain = attention(replace(op, sinks=None), q[:seq], k[:seq], v[:seq], np.arange(seq, dtype=np.int32),
                      KVCache(kv * d))
    assert np.abs(plain - got[:seq]).max() > 1e-1  # the sinks weigh


@pytest.mark.parametrize("window", [None, 3])
def test_values_narrower_than_keys_are_attended_as_torch_attends_them(window):
    # DeepSeek's MLA decompressed (v_head_dim): scores over key heads of 12 features, a weighted
    # sum of value heads of 8, the output 8 a query head. GQA (6 heads on 2); a prompt of 7
    # tokens, then one more at position 7 over the cache; with and without a sliding window.
    seq, h, kv, d, dv = 7, 6, 2, 12, 8
    q, k = (RNG.normal(size=(seq + 1, n * d)).astype(np.float32) for n in (h, kv))
    v = RNG.normal(size=(seq + 1, kv * dv)).astype(np.float32)
    op = O.Attention(result="o", type=f32(seq, h * dv), q="q", k="k", v="v", pos="p", n_heads=h, n_kv_heads=kv,
                     head_dim=d, v_head_dim=dv, scale=d**-0.5, cache="c", window=window)
    from picc.interpreter import KVCache, attention

    cache = KVCache(kv * d, kv * dv)
    got = np.concatenate([attention(op, q[:seq], k[:seq], v[:seq], np.arange(seq, dtype=np.int32), cache),
                          attention(op, q[seq:], k[seq:], v[seq:], np.array([seq], np.int32), cache)])
    n = seq + 1
    tq = torch.from_numpy(q).view(n, h, d).transpose(0, 1)
    tk = torch.from_numpy(k).view(n, kv, d).transpose(0, 1).repeat_interleave(h // kv, 0)
    tv = torch.from_numpy(v).view(n, kv, dv).transpose(0, 1).repeat_interleave(h // kv, 0)
    i = torch.arange(n)
    visible = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=visible, scale=d**-0.5)
    assert got.shape == (n, h * dv)
    np.testing.assert_allclose(got, want.transpose(0, 1).reshape(n, h * dv).numpy(), atol=1e-6)


def test_quantized_weights_run_through_exact_dequantization():
    f = tiny_llama(matrix_dtype=DType.F32, seed=3)
    q = tiny_llama(matrix_dtype=DType.Q8_0, seed=3)
    tokens = [1, 2, 3, 4]
    lf = Interpreter(f.module, f.weights).run(tokens)
    lq = Interpreter(q.module, q.weights).run(tokens)
    # Q8_0 keeps ~2-3 significant digits per weight: close, but not equal.
    assert 0 < np.linalg.norm(lq - lf) / np.linalg.norm(lf) < 0.05


def test_rope_spec_defaults_are_the_op_defaults():
    spec, op = RopeSpec(), _rope_op()
    assert (spec.theta, spec.style, spec.scaling) == (op.theta, op.style, op.scaling)


def _numpy_gptj_rope(x: np.ndarray, pos: np.ndarray, n_heads: int, head_dim: int, rotary_dim: int,
                     freq_factors: tuple[float, ...] = (), attention_factor: float = 1.0) -> np.ndarray:
    """Pairs (2i, 2i + 1) of each head's first ``rotary_dim`` features rotated by ``pos / (factor_i *
    10000 ** (2i / rotary_dim))``, the cosines and sines times ``attention_factor``: in float64, loop by loop."""
    out = x.astype(np.float64).copy()
    for s, p in enumerate(pos):
        for h in range(n_heads):
            for i in range(rotary_dim // 2):
                angle = p / ((freq_factors[i] if freq_factors else 1.0) * 10000.0 ** (2 * i / rotary_dim))
                c, sn = np.cos(angle) * attention_factor, np.sin(angle) * attention_factor
                a, b = x[s, h * head_dim + 2 * i], x[s, h * head_dim + 2 * i + 1]
                out[s, h * head_dim + 2 * i], out[s, h * head_dim + 2 * i + 1] = a * c - b * sn, b * c + a * sn
    return out


@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize(("n_heads", "head_dim"), [(4, 24), (1, 8)])  # MLA's q (and k_nope's heads), and k_pe
def test_gptj_rope_of_mla_shapes_is_a_direct_rotation(n_heads, head_dim, yarn):
    # GPT-J pairs in each head's first 8 features (the rest passed through), or all of a one-head
    # k_pe; with YaRN's per-pair factors (1, 4/3, 2, 4) and attention factor. The interpreter rotates
    # by float32 angles pos * inv_freq (at pos <= 40 a few 40 * 2^-24 rad off the float64 ones) and
    # rounds its products to float32: ~1e-6 at |x| <= 4 (4e-7 measured), within 1e-5; a wrong
    # pairing, frequency or factor is O(0.1).
    x = RNG.normal(size=(5, n_heads * head_dim)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 40], np.int32)
    scaling = MLA_YARN if yarn else {}
    op = O.Rope(result="r", type=f32("seq", n_heads * head_dim), x="x", pos="p", n_heads=n_heads, head_dim=head_dim,
                rotary_dim=8, style="gptj", **scaling)
    got = rope(op, x, pos)
    want = _numpy_gptj_rope(x, pos, n_heads, head_dim, 8, scaling.get("freq_factors", ()),
                            scaling.get("attention_factor", 1.0))
    assert np.abs(got - want).max() <= 1e-5
    tail = np.arange(n_heads * head_dim) % head_dim >= 8
    np.testing.assert_array_equal(got[:, tail], x[:, tail])
    assert np.abs(got[1:, ~tail] - x[1:, ~tail]).max() > 0.1  # it rotates (position 0 is the identity)


@pytest.mark.parametrize(("a_heads", "b_heads"), [(1, 4), (4, 1), (4, 4), (1, 1)])
def test_concat_heads_joins_each_heads_parts(a_heads, b_heads):
    # Head h of the result: a's head h (its only head, where it has one) then b's, copied exactly.
    seq, n, a_dim, b_dim = 3, 4, 5, 7
    a = RNG.normal(size=(seq, a_heads * a_dim)).astype(np.float32)
    b = RNG.normal(size=(seq, b_heads * b_dim)).astype(np.float32)
    op = O.ConcatHeads(result="k", type=f32("seq", n * (a_dim + b_dim)), a="a", b="b", n_heads=n, a_dim=a_dim,
                       b_dim=b_dim)
    want = np.zeros((seq, n * (a_dim + b_dim)), np.float32)
    for s in range(seq):
        for h in range(n):
            ha, hb, start = h if a_heads > 1 else 0, h if b_heads > 1 else 0, h * (a_dim + b_dim)
            want[s, start : start + a_dim] = a[s, ha * a_dim : (ha + 1) * a_dim]
            want[s, start + a_dim : start + a_dim + b_dim] = b[s, hb * b_dim : (hb + 1) * b_dim]
    got = concat_heads(op, a, b)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
