"""The small CPU kernels (norms, rope, attention, element-wise ops, argmax) against the interpreter
and numpy (tolerances: ``tests/cpu_kernels.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MLA_YARN
from cpu_kernels import F32_TOL, THREADS, act64, rel_err, run

from picc.codegen_cpu import CpuModule, build_ir, compile_kernels, effective_simd
from picc.codegen_cpu.kernels_attention import attention
from picc.codegen_cpu.kernels_ffn import FORMS
from picc.codegen_cpu.kernels_misc import (
    add,
    argmax,
    concat_heads,
    ffn_activation,
    layer_norm,
    mul,
    rms_norm,
    rope,
    softcap,
)
from picc.interpreter import KVCache, rope_cos_sin
from picc.interpreter import attention as attention_ref
from picc.interpreter import concat_heads as concat_heads_ref
from picc.interpreter import rope as rope_ref
from picc.ir import ops as O
from picc.ir.types import f32
from runtime.cpu import host_has

KERNELS = ([rms_norm(), layer_norm(), add(), mul(), argmax(), softcap(), concat_heads()]
           + [attention(kv, cap, sinks) for kv in ("f32", "f16") for cap in (False, True) for sinks in (False, True)]
           + [rope(s) for s in ("llama", "gptj")] + [ffn_activation(f) for f in FORMS])


@pytest.fixture(scope="module")
def host() -> CpuModule:
    return compile_kernels(KERNELS, simd="host")


@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
@pytest.mark.parametrize(("seq", "threads"), [(3, 2), (1, 3), (2, 3)])
def test_norms(host, teams, kind, seq, threads):
    # Fewer rows than threads (a decode step's one row): every thread takes each row's statistics
    # and a share of its elements; the same bits as one thread, and in place as out of place.
    rng = np.random.default_rng(15)
    n, eps = 100, 1e-5
    x = rng.normal(size=(seq, n)).astype(np.float32)
    w, b = (1 + 0.1 * rng.normal(size=n)).astype(np.float32), rng.normal(size=n).astype(np.float32)
    kernel, bias = (rms_norm(), None) if kind == "rms_norm" else (layer_norm(), b)
    out, alone, in_place = np.zeros_like(x), np.zeros_like(x), x.copy()
    run(host, teams[threads], kernel, x, w, bias, out, seq, n, eps)
    run(host, teams[1], kernel, x, w, bias, alone, seq, n, eps)
    run(host, teams[threads], kernel, in_place, w, bias, in_place, seq, n, eps)
    np.testing.assert_array_equal(out, alone)
    np.testing.assert_array_equal(in_place, alone)
    xd = x.astype(np.float64)
    if kind == "rms_norm":
        ref = xd / np.sqrt((xd**2).mean(-1, keepdims=True) + eps) * w
    else:
        c = xd - xd.mean(-1, keepdims=True)
        ref = c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * w + b
    assert rel_err(out, ref) <= F32_TOL


@pytest.mark.parametrize("style", ("llama", "gptj"))
@pytest.mark.parametrize("rotary_dim", (16, 8))
@pytest.mark.parametrize("seq", (3, 1))  # one row on two threads: they split its heads
def test_rope_matches_interpreter(host, teams, style, rotary_dim, seq):
    rng = np.random.default_rng(16)
    pos, heads, hd = 1000, 3, 16  # a large position: the angle's float32 rounding matters
    op = O.Rope(result="r", type=f32(seq, heads * hd), x="x", pos="p", n_heads=heads, head_dim=hd,
                rotary_dim=rotary_dim, style=style, theta=500000.0)
    x = rng.normal(size=(seq, heads * hd)).astype(np.float32)
    ref = rope_ref(op, x, np.arange(pos, pos + seq, dtype=np.int32))
    out = x.copy()
    cos, sin = rope_cos_sin(op, np.arange(pos + seq))  # the tables the lowering stores, rows 0 .. pos + seq
    run(host, teams[2], rope(style), out, cos, sin, seq, pos, heads, hd, rotary_dim)
    # The interpreter's cosines and sines, the same products and sums: the same bits.
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("yarn", (False, True))
@pytest.mark.parametrize(("heads", "hd"), ((4, 24), (1, 8)))  # DeepSeek's q (8 of 24 rotated), and its one-head k_pe
@pytest.mark.parametrize("seq", (3, 1))
def test_rope_of_mla_shapes_matches_interpreter(host, teams, heads, hd, seq, yarn):
    rng = np.random.default_rng(24)
    pos = 700
    op = O.Rope(result="r", type=f32(seq, heads * hd), x="x", pos="p", n_heads=heads, head_dim=hd, rotary_dim=8,
                style="gptj", **(MLA_YARN if yarn else {}))
    x = rng.normal(size=(seq, heads * hd)).astype(np.float32)
    out = x.copy()
    cos, sin = rope_cos_sin(op, np.arange(pos + seq))
    run(host, teams[2], rope("gptj"), out, cos, sin, seq, pos, heads, hd, 8)
    np.testing.assert_array_equal(out, rope_ref(op, x, np.arange(pos, pos + seq, dtype=np.int32)))


def _concat_operands(rng: np.random.Generator, seq: int, heads: tuple[int, int], dims: tuple[int, int]):
    return tuple(rng.normal(size=(seq, h * d)).astype(np.float32) for h, d in zip(heads, dims, strict=True))


@pytest.mark.parametrize(("a_heads", "b_heads"), ((1, 5), (5, 1), (5, 5), (1, 1)))
@pytest.mark.parametrize(("seq", "threads"), ((3, 2), (1, 3), (2, 3), (4, 1)))  # fewer rows than threads: heads split
def test_concat_heads_matches_interpreter(host, teams, a_heads, b_heads, seq, threads):
    # Head h of each row: a's head h (or its one head), then b's; copies, so the interpreter's bits.
    # The output starts as NaNs: a float the kernel leaves unwritten shows.
    rng = np.random.default_rng(25)
    n, dims = 5, (8, 13)  # 13: a head that ends off a 16-byte boundary
    a, b = _concat_operands(rng, seq, (a_heads, b_heads), dims)
    op = O.ConcatHeads(result="k", type=f32(seq, n * sum(dims)), a="a", b="b", n_heads=n, a_dim=dims[0], b_dim=dims[1])
    out = np.full((seq, n * sum(dims)), np.nan, np.float32)
    run(host, teams[threads], concat_heads(), a, b, out, seq, n, *dims, a_heads, b_heads)
    np.testing.assert_array_equal(out, concat_heads_ref(op, a, b))


@pytest.mark.parametrize("simd", ("avx2", "avx512", "avx512-vnni"))
def test_concat_heads_and_rope_compile_at_every_level(host, teams, simd):
    # Each SIMD level's build is compiled to machine code; a level the host runs gives the host build's bits.
    kernels = [concat_heads(), rope("gptj")]
    module = host if simd == effective_simd("host") else CpuModule(build_ir(kernels, (), simd), simd)
    asm = module.emit_assembly()
    assert all(f"{k.symbol}:" in asm for k in kernels)
    if not host_has(simd):
        pytest.skip(f"this host cannot run {simd} code (compiled only)")
    rng = np.random.default_rng(26)
    a, b = _concat_operands(rng, 3, (1, 4), (8, 16))
    outs = [np.zeros((3, 96), np.float32) for _ in range(2)]
    for mod, out in zip((host, module), outs, strict=True):
        run(mod, teams[2], concat_heads(), a, b, out, 3, 4, 8, 16, 1, 4)
        cos, sin = rope_cos_sin(O.Rope(result="r", type=f32(3, 96), x="x", pos="p", n_heads=4, head_dim=24,
                                       rotary_dim=8, style="gptj"), np.arange(8))
        run(mod, teams[2], rope("gptj"), out, cos, sin, 3, 5, 4, 24, 8)
    np.testing.assert_array_equal(outs[0], outs[1])


# Key and value heads: 16 + a tail; 64 (the wide V pass) + 16 + a tail; then values narrower than
# keys (DeepSeek's MLA: v_head_dim): the wide V pass + a tail, and 16 + a tail under keys of 32 + 8.
@pytest.mark.parametrize(("hd", "vd"), ((20, 20), (84, 84), (84, 68), (40, 20)))
@pytest.mark.parametrize("window", (None, 3))
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_format", ("f32", "f16"))
@pytest.mark.parametrize("cap", (None, 0.7))  # Gemma 2's soft cap, here where scores (~N(0, 1)) bend
@pytest.mark.parametrize("sinks", (False, True))  # gpt-oss's sink logit per head
def test_attention_matches_interpreter(host, teams, threads, window, hd, vd, kv_format, cap, sinks):
    rng = np.random.default_rng(17)
    heads, kv, ctx = 6, 2, 16  # up to 10 positions: scored four at a time, then one
    op = O.Attention(result="a", type=f32(1, heads * vd), q="q", k="k", v="v", pos="p", n_heads=heads,
                     n_kv_heads=kv, head_dim=hd, v_head_dim=vd if vd != hd else None, scale=hd**-0.5, cache="c",
                     window=window, kv_format=kv_format, softcap=cap, sinks="s" if sinks else None)
    # Sinks from below the scores to above them all (then the maximum is the sink's).
    sink = np.linspace(-2.0, 3.0, heads, dtype=np.float32) if sinks else None
    dtype = np.float16 if kv_format == "f16" else np.float32
    cache, kcache, vcache = KVCache(kv * hd, kv * vd), np.zeros((ctx, kv * hd), dtype), np.zeros((ctx, kv * vd), dtype)
    pos = 0
    for seq in (5, 1, 1, 3):  # a prefill chunk, then decode steps, then another chunk
        q = rng.normal(size=(seq, heads * hd)).astype(np.float32)
        k, v = (rng.normal(size=(seq, kv * d)).astype(np.float32) for d in (hd, vd))
        ref = attention_ref(op, q, k, v, np.arange(pos, pos + seq, dtype=np.int32), cache, sink)
        out = np.zeros((seq, heads * vd), np.float32)
        run(host, teams[threads], attention(kv_format, cap is not None, sinks), q, k, v, kcache, vcache, out, seq,
            pos, heads, kv, hd, vd, hd**-0.5, window or 0, ctx, *([cap] if cap else []), *([sink] if sinks else []))
        # The cache holds k and v as numpy rounds them (to nearest even), each KV head's rows in
        # its own plane [ctx, hd] (v's [ctx, vd]), and the interpreter, which rounds alike, attends
        # over the same values.
        for cached, new, d in ((kcache, k, hd), (vcache, v, vd)):
            planes = cached.reshape(kv, ctx, d)[:, pos : pos + seq]
            np.testing.assert_array_equal(planes, new.reshape(seq, kv, d).transpose(1, 0, 2).astype(dtype))
        assert rel_err(out, ref) <= F32_TOL, seq
        pos += seq


def test_add_mul_and_ffn_activations(host, teams):
    rng = np.random.default_rng(18)
    n = 1000 + 7
    a, b = (rng.normal(size=n).astype(np.float32) * 3 for _ in range(2))
    out = np.zeros(n, np.float32)
    run(host, teams[3], add(), a, b, out, n)
    np.testing.assert_array_equal(out, a + b)  # one float32 addition per element, as numpy
    run(host, teams[3], mul(), a, b, out, n)
    np.testing.assert_array_equal(out, a * b)
    for form, spec in FORMS.items():
        run(host, teams[2], ffn_activation(form), a, b, out, n)
        up = act64(spec.act, b) if spec.act_on_up or not spec.gated else b
        ref = act64(spec.act, a) * up if spec.gated else up
        # exp / erf / tanh are polynomial approximations good to a few float32 ulp.
        assert rel_err(out, ref) <= 1e-6, form


def test_softcap(host, teams):
    # Gemma 2's capped logits: cap * tanh(x / cap), from the linear middle to the saturated ends;
    # picc_tanh is good to ~1e-7 absolute (relative to the cap here), as GELU's.
    x = np.linspace(-40, 40, 1000 + 7, dtype=np.float32)
    out = np.zeros_like(x)
    run(host, teams[3], softcap(), x, out, x.size, 3.0)
    want = 3.0 * np.tanh(x.astype(np.float64) / 3.0)
    assert np.abs(out - want).max() <= 3.0 * 2e-7
    run(host, teams[2], softcap(), x, x, x.size, 3.0)  # in place
    np.testing.assert_array_equal(x, out)


def test_argmax_first_of_ties(host, teams):
    x = np.random.default_rng(19).normal(size=49157).astype(np.float32)
    out = np.zeros(1, np.int32)
    for where in (0, 17, 49156, 30000):
        y = x.copy()
        y[where] = y[30001] = 10.0  # a tie: the first index wins, as np.argmax
        run(host, teams[2], argmax(), y, out, len(y))
        assert out[0] == np.argmax(y)


def test_argmax_at_every_length_and_place_ignoring_nans(host, teams):
    # Four 16-lane chains then 16-wide tails, and the scan 16 at a time then one by one: lengths
    # on and off those steps, the largest (and a tie after it) in the chains, the 16-wide part
    # and the last elements, and NaNs anywhere (ignored, as np.nanargmax does).
    rng = np.random.default_rng(23)
    out = np.zeros(1, np.int32)
    for n in (1, 5, 16, 20, 64, 70, 100, 1000, 1037):
        x = rng.normal(size=n).astype(np.float32)
        for where in sorted({0, n // 2, max(0, n - 17), n - 1}):
            y = x.copy()
            y[where] = 10.0
            y[n - 1 if where < n - 1 else 0] = 10.0 if where < n - 1 else y[0]  # a later tie
            if n > 2:
                y[(where + 1) % n] = np.nan if y[(where + 1) % n] != 10.0 else y[(where + 1) % n]
            run(host, teams[2], argmax(), y, out, n)
            assert out[0] == np.nanargmax(y), (n, where)
    y = np.full(40, -np.inf, np.float32)
    run(host, teams[2], argmax(), y, out, 40)
    assert out[0] == 0
