"""picc.codegen_cuda: host builds against numpy / the interpreter, CUDA sources against nvcc.

Tolerances. Every kernel accumulates in float32 and decodes f16 / q4_0 weights exactly (the
reference uses the same dequantised float32 weights), so host results differ from numpy only in
summation order: for a dot product of K terms that is ~sqrt(K) * 2^-24 relative to the terms'
magnitude, below 1e-6 for K <= 1536. We allow 1e-5 relative (to the largest reference value) for
f32 and 1e-4 for f16 / q4_0 weights (their larger, exactly representable terms change nothing,
but the budget leaves room for cancellation in sums of quantised values). Transcendentals (exp,
erf, tanh, cos, sin) come from LLVM's libm on the host and numpy's on the reference: a few ulp.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cuda_models import RELU_DEMO, SMOLLM2, model_kernels

from picc import quant
from picc.codegen_cuda import (
    ARCHS,
    FORMS,
    attention,
    attention_decode,
    attention_decode_fits,
    bias_add,
    build_cuda,
    build_host,
    compact,
    cuda_source,
    dense_ffn,
    export_host_library,
    gate_first_ffn,
    gemm,
    gemv,
    kv_append,
    layer_norm,
    merge,
    nvcc_compile,
    nvcc_path,
    pack,
    padded,
    predictor,
    rms_norm,
    rope,
    sparse_ffn,
    split_blocks,
    split_q4_0,
    unpack,
    write_cuda_sources,
)
from picc.codegen_cuda.greedy import greedy_next
from picc.codegen_cuda.layers import concat_heads, rope_table
from picc.codegen_cuda.schedules import arch_params, cpu_schedule, schedule
from picc.errors import PiccError
from picc.interpreter import KVCache, activation
from picc.interpreter import attention as ref_attention
from picc.interpreter import concat_heads as ref_concat_heads
from picc.interpreter import rope as ref_rope
from picc.ir import ops as O
from picc.ir import positional
from picc.ir.types import f32

F32_TOL = 1e-5
QUANT_TOL = 1e-4
TOL = {"f32": F32_TOL, "f16": QUANT_TOL, "q4_0": QUANT_TOL, "q4_1": QUANT_TOL, "q8_0": QUANT_TOL}
PLANES = {"q4_0": ("qs", "d"), "q4_1": ("qs", "d", "m"), "q8_0": ("qs", "d")}

needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: CUDA sources cannot be compiled")


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.normal(size=shape) * scale).astype(np.float32)


def weight_args(prefix: str, w: np.ndarray, fmt: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Kernel arguments of matrix ``w`` stored as ``fmt``, and the float32 values they hold."""
    bufs = pack(w, fmt)
    names = [f"{prefix}_{p}" for p in PLANES[fmt]] if fmt in PLANES else [prefix]
    return dict(zip(names, bufs, strict=True)), unpack(bufs, fmt)


# ---------------------------------------------------------------- weight formats


def test_q4_0_planes_hold_exactly_the_gguf_values() -> None:
    rng = np.random.default_rng(0)
    w = randn(rng, 6, 96)
    raw = quant.quantize(w, "q4_0")
    planes = split_q4_0(raw, w.shape)
    # the 16 nibble bytes of a block as four little-endian uint32 words (one register each on a GPU)
    assert planes[0].shape == (6, 12) and planes[0].dtype == np.uint32 and planes[1].shape == (6, 3)
    np.testing.assert_array_equal(planes[0].view(np.uint8).reshape(6, 3, 16),
                                  raw.view(np.uint8).reshape(6, 3, 18)[..., 2:])
    np.testing.assert_array_equal(unpack(planes, "q4_0"), quant.dequantize(raw, "q4_0", w.shape))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_q4_1_and_q8_0_planes_hold_exactly_the_gguf_values(fmt: str) -> None:
    rng = np.random.default_rng(0)
    w = randn(rng, 6, 96)
    raw = quant.quantize(w, fmt)
    np.testing.assert_array_equal(unpack(split_blocks(raw, fmt, w.shape), fmt), quant.dequantize(raw, fmt, w.shape))


def test_unsupported_format_is_one_clear_error() -> None:
    with pytest.raises(PiccError, match="weight format 'bf16' is not supported"):
        gemv("g", 8, 64, "bf16")
    with pytest.raises(PiccError, match="not a multiple of 32"):
        gemv("g", 8, 48, "q4_0")


# ---------------------------------------------------------------- dense kernels on the host


@pytest.mark.parametrize("fmt", ["f32", "f16", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_host_matches_numpy(fmt: str, bias: bool) -> None:
    rng = np.random.default_rng(1)
    w, x, b = randn(rng, 192, 576), randn(rng, 576), randn(rng, 192)
    args, wd = weight_args("W", w, fmt)
    if bias:
        args["b"] = b
    y = build_host(gemv(f"gemv_{fmt}_{bias}", 192, 576, fmt, bias))(x=x, **args)["y"]
    assert rel_err(y, wd @ x + (b if bias else 0)) <= TOL[fmt]


@pytest.mark.parametrize("fmt", ["f32", "q4_0"])
def test_prefill_gemm_host_matches_numpy(fmt: str) -> None:
    rng = np.random.default_rng(2)
    w, xs, b = randn(rng, 64, 320), randn(rng, 5, 320), randn(rng, 64)
    args, wd = weight_args("W", w, fmt)
    y = build_host(gemm(f"gemm_{fmt}", 5, 64, 320, fmt, bias=True))(X=xs, b=b, **args)["Y"]
    assert rel_err(y, xs @ wd.T + b) <= TOL[fmt]


@pytest.mark.parametrize(("vocab", "start"), [(8192, 7), (1000, 63), (1000, 90)])
def test_greedy_next_picks_numpys_argmax_and_advances_the_loop(vocab: int, start: int) -> None:
    """The greedy loop's kernel (its definition, which the host build runs) picks the first index
    of the largest logit, as ``numpy.argmax`` does, among many ties; records it at the loop's
    position, which it advances, and writes the next step's token and position. A position past
    the record is clamped into it (the runtime never passes one)."""
    ctx = 64
    rng = np.random.default_rng(vocab + start)
    for trial in range(4):
        logits = rng.integers(-3, 4, vocab).astype(np.float32)  # a handful of values: ties everywhere
        if trial == 1:
            logits[-1] = 10.0  # the winner in the last, partial, sweep of 256
        state = np.full(ctx + 1, -1, np.int32)
        state[ctx] = start
        out = build_host(greedy_next("greedy", vocab, ctx))(logits=logits, state=state)
        at = min(start, ctx - 1)
        best = int(np.argmax(logits))
        assert out["tokens"][0] == best and out["pos"][0] == at + 1
        assert out["state"][at] == best and out["state"][ctx] == at + 1
        assert (np.delete(out["state"][:ctx], at) == -1).all()


def test_predictor_mask_and_compaction_match_numpy() -> None:
    rng = np.random.default_rng(3)
    hidden, rank, n = 320, 32, 1280
    fc1, fc2 = randn(rng, rank, hidden, scale=hidden**-0.5), randn(rng, n, rank, scale=rank**-0.5)
    b1, b2, x = randn(rng, rank), randn(rng, n), randn(rng, hidden)
    a1, fc1d = weight_args("fc1", fc1, "f16")
    a2, fc2d = weight_args("fc2", fc2, "f16")
    threshold = 0.25
    out = build_host(predictor("pred", hidden, rank, n, "f16", True, True))(
        x=x, b1=b1, b2=b2, threshold=np.array([threshold], np.float32), **a1, **a2)
    logits = np.maximum(fc1d @ x + b1, 0) @ fc2d.T + b2
    np.testing.assert_allclose(out["hid"], np.maximum(fc1d @ x + b1, 0), rtol=0, atol=F32_TOL * np.abs(logits).max())
    # A logit within float32 rounding of the threshold may fall either way; none is that close here.
    assert np.abs(logits - threshold).min() > 1e-4
    np.testing.assert_array_equal(out["mask"], (logits > threshold).astype(np.int8))

    n_pad = padded(n)
    got = build_host(compact("compact", n, n_pad))(mask=out["mask"])
    active = np.flatnonzero(out["mask"])
    assert got["count"][0] == len(active) and 0 < len(active) < n
    np.testing.assert_array_equal(got["idx"][: len(active)], active)
    assert not got["idx"][len(active):].any()  # padding holds row 0: a valid row, never read
    # The cold part of a split layer lists its own columns of the layer's mask, numbered from 0.
    hot = 500
    part = build_host(compact("compact_cold", n - hot, padded(n - hot), hot))(mask=out["mask"])
    cold_active = np.flatnonzero(out["mask"][hot:])
    assert part["count"][0] == len(cold_active)
    np.testing.assert_array_equal(part["idx"][: len(cold_active)], cold_active)


# ---------------------------------------------------------------- sparse FFN on the host


def ffn_reference(form: str, x: np.ndarray, up: np.ndarray, gate: np.ndarray, down_t: np.ndarray,
                  rows: np.ndarray, b_ug: np.ndarray | None = None) -> np.ndarray:
    """``picc.interpreter``'s FFN restricted to ``rows`` (``sparse_ffn`` in predictor mode)."""
    spec = FORMS[form]
    act, gated, act_on_up = spec.act, spec.gated, spec.act_on_up
    u = up @ x + (b_ug[:, 0] if b_ug is not None else 0)
    if gated:
        g = gate @ x + (b_ug[:, 1] if b_ug is not None else 0)
        h = activation(act, g) * (activation(act, u) if act_on_up else u)
    else:
        h = activation(act, u)
    return h[rows] @ down_t[rows]


@pytest.mark.parametrize(("form", "fmt"), [(form, fmt) for fmt in ("f32", "f16", "q4_0") for form in FORMS]
                         + [("swiglu", "q4_1"), ("reglu", "q8_0")])
def test_sparse_ffn_host_matches_interpreter_for_any_index_list(form: str, fmt: str) -> None:
    rng = np.random.default_rng(4)
    hidden, n_ff = 128, 200  # n_ff not a multiple of the row tile: the list is padded
    gated = FORMS[form].gated
    up, gate = randn(rng, n_ff, hidden, scale=0.2), randn(rng, n_ff, hidden, scale=0.2)
    down_t, x = randn(rng, n_ff, hidden, scale=0.1), randn(rng, hidden)
    ug = np.stack([up, gate], axis=1) if gated else up[:, None, :]
    a_ug, ugd = weight_args("W_ug", ug, fmt)
    a_down, downd = weight_args("down", down_t, fmt)
    n_pad = padded(n_ff)
    kernel = build_host(sparse_ffn(f"ffn_{form}_{fmt}", hidden, n_ff, form, fmt))
    for rows in (np.array([], np.int64), np.sort(rng.choice(n_ff, 37, replace=False)), np.arange(n_ff)):
        idx = np.full(n_pad, -1, np.int32)  # entries past count are junk: never dereferenced
        idx[: len(rows)] = rows
        y = kernel(x=x, idx=idx, count=np.array([len(rows)], np.int32), **a_ug, **a_down)["y"]
        ref = ffn_reference(form, x, ugd[:, 0], ugd[:, 1] if gated else ugd[:, 0], downd, rows)
        if len(rows) == 0:
            assert not y.any()
        else:
            assert rel_err(y, ref) <= TOL[fmt], (form, fmt, len(rows))


def test_sparse_ffn_with_biases_and_unsorted_list() -> None:
    rng = np.random.default_rng(5)
    hidden, n_ff = 64, 96
    up, gate, down_t = randn(rng, n_ff, hidden), randn(rng, n_ff, hidden), randn(rng, n_ff, hidden)
    b_ug, x = randn(rng, n_ff, 2), randn(rng, hidden)
    rows = rng.permutation(n_ff)[:50]  # any order: the sum does not depend on it
    idx = np.zeros(padded(n_ff), np.int32)
    idx[:50] = rows
    y = build_host(sparse_ffn("ffn_bias", hidden, n_ff, "geglu_tanh", "f32", bias=True))(
        x=x, idx=idx, count=np.array([50], np.int32), W_ug=np.stack([up, gate], axis=1), down=down_t, b_ug=b_ug)["y"]
    assert rel_err(y, ffn_reference("geglu_tanh", x, up, gate, down_t, rows, b_ug)) <= F32_TOL


@pytest.mark.parametrize("form,fmt", [("swiglu", "q4_0"), ("reglu", "f16"), ("geglu", "f32"), ("swiglu", "q4_1"),
                                      ("swiglu", "q8_0")])
def test_gate_first_ffn_host_matches_interpreter(form: str, fmt: str) -> None:
    rng = np.random.default_rng(6)
    hidden, n_ff = 128, 160
    act = FORMS[form].act
    gate, up, down_t = randn(rng, n_ff, hidden, scale=0.2), randn(rng, n_ff, hidden, scale=0.2), randn(rng, n_ff, hidden)
    x = randn(rng, hidden)
    ag, gd = weight_args("gate", gate, fmt)
    au, ud = weight_args("up", up, fmt)
    ad, dd = weight_args("down", down_t, fmt)
    # Per-neuron score scales (Fisher scales; an unscaled layer passes ones) spanning 16x, so
    # ignoring them would change which neurons pass.
    scale = np.exp(rng.uniform(np.log(0.25), np.log(4.0), n_ff)).astype(np.float32)
    score = np.abs(activation(act, gd @ x)) * scale
    ranked = np.sort(score)
    cut = 80 + int(np.argmax(np.diff(ranked[80:120])))  # the widest gap near the middle
    threshold = np.float32((ranked[cut] + ranked[cut + 1]) / 2)
    # The kernel's gate sums differ from numpy's in the last bits; no score may sit that close.
    assert ranked[cut + 1] - ranked[cut] > 1e-4 * ranked[-1]
    out = build_host(gate_first_ffn(f"gf_{form}_{fmt}", hidden, n_ff, form, fmt))(
        x=x, threshold=np.array([threshold], np.float32), score_scale=scale, **ag, **au, **ad)
    rows = np.flatnonzero(score > threshold)
    assert 0 < len(rows) < n_ff
    assert not np.array_equal(rows, np.flatnonzero(score / scale > threshold))  # the scale matters here
    assert rel_err(out["y"], ffn_reference(form, x, ud, gd, dd, rows)) <= TOL[fmt]
    assert not out["u"][score <= threshold].any()  # skipped neurons never computed up


def test_unscheduled_definition_and_exported_library_agree_with_numpy(tmp_path: Path) -> None:
    # The CPU schedule only reorders sums; the definition itself (what the GPU schedules start
    # from) must compute the same, and so must the shared library a runtime would load.
    import tvm

    rng = np.random.default_rng(11)
    hidden, n_ff = 96, 64
    kernel = sparse_ffn("ffn_def", hidden, n_ff, "swiglu", "q4_0")
    a_ug, ugd = weight_args("W_ug", randn(rng, n_ff, 2, hidden, scale=0.2), "q4_0")
    a_down, downd = weight_args("down", randn(rng, n_ff, hidden), "q4_0")
    rows = np.sort(rng.choice(n_ff, 20, replace=False))
    idx = np.zeros(padded(n_ff), np.int32)
    idx[:20] = rows
    inputs = {"x": randn(rng, hidden), "idx": idx, "count": np.array([20], np.int32), **a_ug, **a_down}
    ref = ffn_reference("swiglu", inputs["x"], ugd[:, 0], ugd[:, 1], downd, rows)
    assert rel_err(build_host(kernel, scheduled=False)(**inputs)["y"], ref) <= QUANT_TOL

    lib = tvm.runtime.load_module(str(export_host_library([kernel], tmp_path / "kernels.so")))
    tensors = [tvm.runtime.tensor(inputs.get(p.name, np.zeros(p.shape, p.dtype))) for p in kernel.params]
    lib.get_function("ffn_def")(*tensors)
    assert rel_err(tensors[-1].numpy(), ref) <= QUANT_TOL


def test_the_host_build_computes_h_once_a_neuron_and_the_gpu_schedules_inline_it() -> None:
    # h (SiLU's exp) is a stage of its own in the fused FFNs' definition: the host build computes
    # it once per neuron, before the AXPY (inlined into it, the emulated GPU took an exp per
    # weight); the GPU schedules inline it back, so their CUDA is what it was.
    for kernel in (sparse_ffn("s", 64, 96, "swiglu", "q4_1"), dense_ffn("d", 64, 96, "swiglu", "q4_1"),
                   gate_first_ffn("g", 64, 96, "swiglu", "q4_1")):
        host = cpu_schedule(kernel).script()
        h, axpy, total = (host.index(f'T.sblock("{name}")') for name in ("h", "y_part", "y"))
        assert "T.exp(" in host[h:axpy] and "T.exp(" not in host[axpy:total], kernel.name
        for arch in ("sm_75", "sm_90"):
            assert 'T.sblock("h")' not in schedule(kernel, arch).script(), (kernel.name, arch)


@pytest.mark.parametrize(("form", "fmt"), [("reglu", "f16"), ("relu", "q4_1"), ("swiglu", "q8_0")])
def test_dense_ffn_and_its_bias_match_the_interpreter(form: str, fmt: str) -> None:
    # A dense layer on the GPU: every neuron, no index list; a whole layer's down bias follows.
    rng = np.random.default_rng(12)
    hidden, n_ff = 96, 130
    gated = FORMS[form].gated
    up, gate = randn(rng, n_ff, hidden, scale=0.2), randn(rng, n_ff, hidden, scale=0.2)
    ug = np.stack([up, gate], axis=1) if gated else up[:, None, :]
    a_ug, ugd = weight_args("W_ug", ug, fmt)
    a_down, downd = weight_args("down", randn(rng, n_ff, hidden, scale=0.1), fmt)
    x, b_ug, b_down = randn(rng, hidden), randn(rng, n_ff, 2 if gated else 1), randn(rng, hidden)
    y = build_host(dense_ffn(f"dense_{form}_{fmt}", hidden, n_ff, form, fmt, bias=True))(
        x=x, b_ug=b_ug, **a_ug, **a_down)["y"]
    ref = ffn_reference(form, x, ugd[:, 0], ugd[:, 1] if gated else ugd[:, 0], downd, np.arange(n_ff),
                        np.concatenate([b_ug, b_ug], axis=1)[:, :2])
    assert rel_err(y, ref) <= TOL[fmt]
    out = build_host(bias_add("bias_96", hidden))(x=y, b=b_down)["y"]
    np.testing.assert_array_equal(out, y + b_down)


def test_merge_adds_the_partial_sums_and_the_bias() -> None:
    rng = np.random.default_rng(13)
    a, b, c = randn(rng, 1, 64), randn(rng, 1, 64), randn(rng, 64)
    np.testing.assert_array_equal(build_host(merge("merge_b", 64, True))(a=a, b=b, bias=c)["y"], (a + b) + c)
    np.testing.assert_array_equal(build_host(merge("merge", 64, False))(a=a, b=b)["y"], a + b)


def test_launch_configs_match_the_cuda_source() -> None:
    # What the CUDA executor launches without TVM's runtime: one configuration per __global__
    # function, in order, its block the size the source bounds it to, its pointers by buffer name.
    for kernel in (sparse_ffn("lc_ffn", 576, 700, "swiglu", "q4_1"), attention("lc_att", 1, 9, 3, 64, 256, 0.125),
                   compact("lc_compact", 100, 104, 28), gemv("lc_gemv", 4096, 576, "f16")):
        art = build_cuda([kernel], "sm_80", nvcc=False)[kernel.name]
        assert [launch.entry for launch in art.launches] == list(art.entry_points)
        for launch in art.launches:
            assert set(launch.params) <= {p.name for p in kernel.params}
            threads = launch.block[0] * launch.block[1] * launch.block[2]
            head = next(ln for ln in art.source.splitlines() if f" {launch.entry}(" in ln)
            assert f"__launch_bounds__({threads})" in head or "__launch_bounds__" not in head
    rows = build_cuda([gemv("lc_rows", 4096, 576, "f16")], "sm_75", nvcc=False)["lc_rows"].launches[0]
    # A warp per `rows_per_warp` rows, four warps per block on sm_75: 4096 rows take 4096 / (4 x 2)
    # blocks of 4 x 32 threads.
    per_warp = arch_params("sm_75").rows_per_warp
    assert rows.grid == (4096 // (4 * per_warp), 1, 1) and rows.block == (32, 4, 1)


def test_gate_first_needs_a_glu_form() -> None:
    with pytest.raises(PiccError, match="gate-first needs a GLU form"):
        gate_first_ffn("gf", 64, 96, "drelu", "f16")


# ---------------------------------------------------------------- norms, rope, attention on the host


def test_rms_and_layer_norm_host_match_interpreter() -> None:
    rng = np.random.default_rng(7)
    x, w, b = randn(rng, 3, 576, scale=3.0), randn(rng, 576), randn(rng, 576)
    y = build_host(rms_norm("rms", 3, 576, 1e-5))(x=x, w=w)["y"]
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5)) * w  # as picc/interpreter.py
    assert rel_err(y, ref) <= F32_TOL
    x = x + 5.0  # an offset mean: the two-pass variance must not cancel
    y = build_host(layer_norm("ln", 3, 576, 1e-5))(x=x, w=w, b=b)["y"]
    mean = x.mean(axis=-1, keepdims=True)
    ref = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + np.float32(1e-5)) * w + b
    assert rel_err(y, ref) <= F32_TOL


@pytest.mark.parametrize("style,rotary,scaling", [("llama", None, "none"), ("gptj", None, "none"),
                                                  ("llama", 32, "llama3"), ("gptj", 16, "linear"),
                                                  ("llama", 48, "longrope"), ("gptj", None, "yarn")])
def test_rope_host_matches_interpreter(style: str, rotary: int | None, scaling: str) -> None:
    # longrope: a factor per pair and the cosines and sines scaled (Phi-4-mini rotates 3/4 of a head);
    # yarn likewise, its factors 1, blended and 8
    rng = np.random.default_rng(8)
    seq, heads, d = 4, 3, 64
    per_pair = {"longrope": dict(freq_factors=tuple(1 + rng.random(24)), attention_factor=1.19),
                "yarn": dict(freq_factors=positional.yarn_freq_factors(64, 1e4, 8.0, 256, 32.0, 1.0, True),
                             attention_factor=positional.yarn_mscale(8.0))}.get(scaling, {})
    op = O.Rope(result="y", type=f32(seq, heads * d), x="x", pos="pos", n_heads=heads, head_dim=d,
                rotary_dim=rotary, style=style, scaling=scaling, factor=8.0, original_max_position=256, **per_pair)
    x, pos = randn(rng, seq, heads * d), np.array([0, 1, 17, 1000], np.int32)
    y = build_host(rope(f"rope_{style}_{rotary}", seq, heads, d, rotary, style))(x=x, pos=pos,
                                                                                inv_freq=rope_table(op))["y"]
    # Angles up to 1000 rad: cos/sin of the same float32 angle agree to a few ulp between libms.
    assert rel_err(y, ref_rope(op, x, pos)) <= F32_TOL


@pytest.mark.parametrize(("a_heads", "b_heads"), [(1, 4), (4, 1), (4, 4), (1, 1)])
def test_concat_heads_host_matches_interpreter(a_heads: int, b_heads: int) -> None:
    # Head h: a's head h (or its one head) then b's; copies, so the interpreter's bits.
    rng = np.random.default_rng(9)
    seq, n, a_dim, b_dim = 2, 4, 8, 12
    a, b = randn(rng, seq, a_heads * a_dim), randn(rng, seq, b_heads * b_dim)
    op = O.ConcatHeads(result="k", type=f32(seq, n * (a_dim + b_dim)), a="a", b="b", n_heads=n, a_dim=a_dim,
                       b_dim=b_dim)
    y = build_host(concat_heads(f"concat_{a_heads}_{b_heads}", seq, n, a_heads, a_dim, b_heads, b_dim))(a=a, b=b)["y"]
    np.testing.assert_array_equal(y, ref_concat_heads(op, a, b))


def test_concat_heads_takes_one_head_or_a_head_each() -> None:
    with pytest.raises(PiccError, match="each operand has 1 or n_heads=4 heads, got 2 and 4"):
        concat_heads("bad", 1, 4, 2, 8, 4, 8)


# gpt-oss's sinks (a logit per query head, from below the scores to above them), with a window;
# DeepSeek's values narrower than the keys (v_dim features a value head, of 64 a key head; one case
# wider), with a window, sinks and Gemma 2's soft cap (0.7: where these scores, ~N(0, 1), bend)
@pytest.mark.parametrize("heads,kv_heads,window,sinks,v_dim,cap", [
    (9, 3, None, False, None, None), (5, 1, None, False, None, None), (4, 2, 3, False, None, None),
    (6, 2, 3, True, None, None), (4, 2, 3, False, 48, None), (6, 2, None, True, 40, 0.7), (4, 4, None, False, 96, None)])
def test_attention_prefill_then_decode_host_matches_interpreter(heads: int, kv_heads: int, window: int | None,
                                                               sinks: bool, v_dim: int | None,
                                                               cap: float | None) -> None:
    rng = np.random.default_rng(9)
    d, max_ctx, prompt = 64, 16, 6
    dv = v_dim or d
    width, v_width = kv_heads * d, kv_heads * dv
    op = O.Attention(result="o", type=f32(1, heads * dv), q="q", k="k", v="v", pos="pos", n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=d, v_head_dim=v_dim, scale=d**-0.5, cache="c", window=window,
                     softcap=cap, sinks="s" if sinks else None)
    sink = np.linspace(-2.0, 3.0, heads, dtype=np.float32) if sinks else None
    given = {"sinks": sink} if sinks else {}
    cache = KVCache(width, v_width)
    k_cache, v_cache = np.zeros((max_ctx, width), np.float32), np.zeros((max_ctx, v_width), np.float32)
    for seq, start in ((prompt, 0), (1, prompt), (1, prompt + 1)):
        q, k, v = randn(rng, seq, heads * d), randn(rng, seq, width), randn(rng, seq, v_width)
        pos = np.arange(start, start + seq, dtype=np.int32)
        ref = ref_attention(op, q, k, v, pos, cache, sink)
        written = build_host(kv_append(f"kva_{seq}_{width}_{v_width}", seq, width, max_ctx, v_width))(
            k=k, v=v, pos=pos, k_cache=k_cache, v_cache=v_cache)
        k_cache, v_cache = written["k_cache"], written["v_cache"]
        name = f"attn_{seq}_{heads}_{kv_heads}_{window}_{v_dim}_{cap}" + ("_sinks" if sinks else "")
        out = build_host(attention(name.replace(".", "p"), seq, heads, kv_heads, d, max_ctx, d**-0.5, window, cap,
                                   sinks, v_dim))(q=q, pos=pos, k_cache=k_cache, v_cache=v_cache, **given)["out"]
        assert out.shape == (seq, heads * dv) and rel_err(out, ref) <= F32_TOL, (seq, start)


@pytest.mark.parametrize("heads,kv_heads,window,sinks,v_dim,cap", [
    (9, 3, None, False, None, None), (5, 1, None, False, None, None), (4, 2, 3, False, None, None),
    (8, 2, 7, False, None, None), (8, 2, 7, True, None, None), (4, 2, 7, False, 48, None), (8, 2, None, True, 40, 0.7),
    (4, 4, None, False, 96, None)])
def test_attention_decode_host_matches_interpreter(heads: int, kv_heads: int, window: int | None,
                                                   sinks: bool, v_dim: int | None, cap: float | None) -> None:
    """The one-launch decode attention (its definition, which the host build compiles) against the
    interpreter over a cache filled token by token, at the first position, a middle one and the
    last. Rows past the query's position hold NaN: a kernel that reads them, or lets an invisible
    position contribute anything, gives NaN. Value heads of ``v_dim`` features where given, as
    in the prefill test above."""
    rng = np.random.default_rng(11)
    d, max_ctx = 64, 64
    dv = v_dim or d
    width, v_width = kv_heads * d, kv_heads * dv
    op = O.Attention(result="o", type=f32(1, heads * dv), q="q", k="k", v="v", pos="pos", n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=d, v_head_dim=v_dim, scale=d**-0.5, cache="c", window=window,
                     softcap=cap, sinks="s" if sinks else None)
    # gpt-oss's sinks, from below the scores to above them (the maximum then the sink's)
    sink = np.linspace(-2.0, 3.0, heads, dtype=np.float32) if sinks else None
    given = {"sinks": sink} if sinks else {}
    name = f"attn_decode_{heads}_{kv_heads}_{window}_{v_dim}_{cap}" + ("_sinks" if sinks else "")
    run = build_host(attention_decode(name.replace(".", "p"), heads, kv_heads, d, max_ctx, d**-0.5, window, cap,
                                      sinks, v_dim))
    assert [(p.name, p.role, p.shape) for p in run.kernel.params] == [
        ("q", "in", (1, heads * d)), ("pos", "in", (1,)), ("k_cache", "in", (max_ctx, width)),
        ("v_cache", "in", (max_ctx, v_width)), *[("sinks", "in", (heads,))] * sinks, ("out", "out", (1, heads * dv))]
    cache = KVCache(width, v_width)
    k_cache, v_cache = np.full((max_ctx, width), np.nan, np.float32), np.full((max_ctx, v_width), np.nan, np.float32)
    checked = []
    for p in range(max_ctx):
        q, k, v = randn(rng, 1, heads * d, scale=2.0), randn(rng, 1, width), randn(rng, 1, v_width)
        pos = np.array([p], np.int32)
        ref = ref_attention(op, q, k, v, pos, cache, sink)
        k_cache[p], v_cache[p] = k[0], v[0]
        if p in (0, 29, max_ctx - 1):
            out = run(q=q, pos=pos, k_cache=k_cache, v_cache=v_cache, **given)["out"]
            assert rel_err(out, ref) <= F32_TOL, p
            checked.append(p)
    assert checked == [0, 29, max_ctx - 1]


def test_attention_decode_is_offered_only_where_its_block_holds_the_cache() -> None:
    # Two arrays of max_ctx floats a block in 32 KiB, and whole warps of positions.
    assert [attention_decode_fits(n) for n in (32, 512, 4096, 4097, 8192, 100)] == [
        True, True, True, False, False, False]
    with pytest.raises(PiccError, match="max_ctx=8192 positions does not fit"):
        attention_decode("too_long", 4, 2, 64, 8192, 0.125)


# ---------------------------------------------------------------- CUDA sources and nvcc

MODEL_FORMATS = [(SMOLLM2, "f16"), (SMOLLM2, "q4_0"), (RELU_DEMO, "f16"), (RELU_DEMO, "q4_0")]


@pytest.fixture(scope="module")
def example_kernels() -> list:
    """Every kernel of the two example models, f16 and q4_0 (shared kernels once)."""
    kernels = {k.name: k for m, fmt in MODEL_FORMATS for k in model_kernels(m, fmt)}
    return list(kernels.values())


def one_of_each_kind(kernels: list) -> list:
    """The first q4_0 kernel of each kind among ``kernels`` (the first of any format if none)."""
    seen: dict[str, object] = {}
    for k in sorted(kernels, key=lambda k: not any(p.name.endswith("_qs") for p in k.params)):
        seen.setdefault(k.kind, k)
    return [*seen.values(), next(k for k in kernels if k.name == "smollm2_f16_gemv_q")]


@needs_nvcc
def test_artifacts_compile_alone_with_nvcc(example_kernels: list, tmp_path: Path) -> None:
    # Each per-kernel source, as a .pib carries it, compiles alone. TVM writes the same
    # self-contained header into every source, so one kernel of each kind and format stands for
    # the rest here (every kernel and every arch is compiled by the next test).
    sample = one_of_each_kind(example_kernels)
    arts = build_cuda(sample, "sm_89", outputs=("ptx",), jobs=2)
    for art in arts.values():
        assert art.ptx and b".entry " + art.entry_points[0].encode() in art.ptx, art.name
    paths = write_cuda_sources(arts, tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{k.name}.cu" for k in sample)
    gemv_ptx = arts["smollm2_f16_gemv_q"].ptx.decode()
    assert "ld.global.v4" in gemv_ptx or "ld.global.nc.v4" in gemv_ptx  # 16-byte weight loads
    assert "shfl.sync" in gemv_ptx  # the warp reduction is shuffles, not shared memory
    ffn_q4 = arts["smollm2_q4_0_sparse_ffn_swiglu"].ptx.decode()
    assert "ld.global.v4" in ffn_q4 or "ld.global.nc.v4" in ffn_q4  # one q4_0 block per load


@needs_nvcc
def test_cubin_for_each_arch() -> None:
    kernel = sparse_ffn("ffn_cubin", 320, 1280, "reglu", "q4_0")
    sources = {arch: cuda_source(kernel, arch) for arch in ARCHS}
    with ThreadPoolExecutor(2) as pool:
        cubins = list(pool.map(lambda a: nvcc_compile({"k": sources[a]}, a, ("cubin",), 1)["k"]["cubin"], ARCHS))
    assert all(c[:4] == b"\x7fELF" for c in cubins)  # an ELF device image per arch


@needs_nvcc
def test_a_cubin_made_with_the_ptx_is_the_one_the_source_gives() -> None:
    # Asked for both, nvcc_compile makes the cubin from the PTX (ptxas only, no second pass of
    # the front end); the device code must be the same, byte for byte.
    src = cuda_source(sparse_ffn("ffn_same", 320, 1280, "swiglu", "q4_1"), "sm_80")
    both = nvcc_compile({"k": src}, "sm_80", ("ptx", "cubin"), 1)["k"]
    alone = nvcc_compile({"k": src}, "sm_80", ("cubin",), 1)["k"]
    assert b".entry ffn_same_kernel" in both["ptx"]
    assert both["cubin"][:4] == b"\x7fELF" and both["cubin"] == alone["cubin"]


@needs_nvcc
def test_a_source_nvcc_rejects_is_named_in_one_error(monkeypatch) -> None:
    broken = 'extern "C" __global__ void k() { undeclared(); }'
    with pytest.raises(PiccError, match=r"^nvcc -ptx -arch=sm_75 failed on kernel broken: .*error.*undeclared"):
        nvcc_compile({"broken": broken}, "sm_75", ("ptx", "cubin"), 1)
    # From the thread that builds a model's bundle, the error reaches the caller as it is.
    import picc.codegen_cuda.build as build

    monkeypatch.setattr(build, "cuda_bundle", lambda *_: broken)
    with pytest.raises(PiccError, match="failed on kernel model"):
        build.build_model_cuda([rms_norm("rms_broken", 1, 64, 1e-5)], "sm_75")


def test_sparse_ffn_source_skips_rows_past_count() -> None:
    src = cuda_source(sparse_ffn("ffn_src", 576, 1536, "swiglu", "f16"), "sm_75")
    start = src.index("ffn_src_kernel(", src.index("ffn_src_kernel(") + 1)  # the definition, not the declaration
    gather = src[start:src.index("ffn_src_kernel_1(", start)]
    guard = gather.index("< count_ptr[0])")
    assert guard < gather.index("*(uint4*)(W_ug_local_ptr")  # weights are loaded only under the guard
    assert "__shfl_down_sync" in gather



def _definition(src: str, entry: str) -> str:
    """The body of kernel ``entry`` in a CUDA source (its definition, not its declaration)."""
    start = src.index(f"{entry}(", src.index(f"{entry}(") + 1)
    return src[start:src.index("\n}\n", start)]


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_gather_gemv_loads_a_row_without_a_branch_per_chunk(fmt: str) -> None:
    # A data-dependent row (idx[r]) made TVM guard every staged 16-byte load with its own
    # `if (0 <= idx[r] && idx[r] < n_ff)`: a lane's loads could not be in flight together (on an
    # H100 the 7B-shape gather-GEMV at 10% active took 35 us, 28 with the row clamped). The row is
    # clamped into range instead, so the loads follow each other in one basic block.
    gather = _definition(cuda_source(sparse_ffn("ffn_rows", 1024, 2048, "reglu", fmt), "sm_90"), "ffn_rows_kernel")
    assert "0 <= idx_ptr" not in gather
    chunks = {"f16": 4, "q4_0": 1}[fmt] * arch_params("sm_90").rows_per_warp  # a lane's, unrolled
    assert gather.count("= *(uint4*)(W_ug") == chunks


def test_axpy_trips_past_count_load_nothing() -> None:
    # The down AXPY's threads walk their rows (ascending) a trip of `axpy_unroll` rows at a time;
    # a trip whose first row is past count is skipped whole, so the AXPY's work follows the active
    # count instead of visiting every row of the index list.
    src = cuda_source(sparse_ffn("ffn_trip", 1024, 16384, "swiglu", "f16"), "sm_90")  # 32 rows a thread
    axpy = _definition(src, "ffn_trip_kernel_1")
    trips = re.search(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\) \{\n(?:\s*int \w+ = .*;\n)*\s*if \((.*)\) \{", axpy)
    assert trips is not None and "count_ptr[0]" in trips.group(3)
    assert int(trips.group(2)) == 32 // arch_params("sm_90").axpy_unroll
    assert axpy.count("half4 v_") == arch_params("sm_90").axpy_unroll  # a trip's rows, unrolled: a load each


def test_a_live_axpy_trip_loads_its_rows_unconditionally_unless_a_bias_makes_dead_rows_count() -> None:
    # Without a bias a row past count adds zero even if computed, so a live trip's rows load
    # without a condition each (in flight together); with a bias h(b) != 0, so each row keeps its own.
    unroll = arch_params("sm_90").axpy_unroll
    for bias, per_row in ((False, 0), (True, unroll)):
        src = cuda_source(sparse_ffn("ffn_eager", 1024, 16384, "swiglu", "f16", bias=bias), "sm_90")
        assert _definition(src, "ffn_eager_kernel_1").count("< count_ptr[0]") == 1 + per_row

@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_decode_attention_is_one_launch_that_nvcc_compiles(arch: str) -> None:
    """relu-demo's shape (5 heads over one K/V head of 64, 512 positions), LLaMA-7B's and DeepSeek
    V3's (keys of 192 features, values of 128) at the longest cache the kernel takes: one
    ``__global__`` function, a block per head, no scratch, its static shared memory under the 48
    KiB a block gets without opting in, K read 16 bytes a load."""
    for heads, kv_heads, d, ctx, dv in ((5, 1, 64, 512, None), (32, 32, 128, 4096, None), (128, 128, 192, 4096, 128)):
        kernel = attention_decode(f"decode_{heads}_{ctx}", heads, kv_heads, d, ctx, d**-0.5, v_head_dim=dv)
        art = build_cuda([kernel], arch, outputs=("ptx",))[kernel.name]
        assert art.entry_points == (f"{kernel.name}_kernel",)
        (launch,) = art.launches
        assert launch.grid == (heads, 1, 1) and 64 <= int(np.prod(launch.block)) <= 1024, launch
        assert sorted(launch.params) == ["k_cache", "out", "pos", "q", "v_cache"]
        assert art.ptx is not None and art.ptx.count(b".entry ") == 1
        shared = re.findall(r"__shared__ alignas\(\d+\) (\w+) \w+\[(\d+)\];", art.source)
        assert {dtype for dtype, _ in shared} == {"float"}
        assert 4 * ctx <= sum(4 * int(n) for _, n in shared) <= 48 * 1024, shared
        ptx = art.ptx.decode()
        assert "ld.global.v4.f32" in ptx or "ld.global.nc.v4.f32" in ptx


def test_bad_arch_and_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(PiccError, match="GPU architecture 'sm_61' has no schedule"):
        cuda_source(rms_norm("r", 1, 64, 1e-5), "sm_61")
    k = build_host(rms_norm("r", 1, 64, 1e-5))
    with pytest.raises(PiccError, match=r"x must be float32\[1, 64\], got float32\[64\]"):
        k(x=np.zeros(64, np.float32), w=np.ones(64, np.float32))
    with pytest.raises(PiccError, match="missing input w"):
        k(x=np.zeros((1, 64), np.float32))


@needs_nvcc
def test_every_kernel_waits_for_its_predecessors_on_sm_90_only() -> None:
    """Each ``__global__`` function starts by waiting for the kernels before it
    (``griddepcontrol.wait``, sm_90+), which is what makes launching it with
    programmatic stream serialization safe (``CudaManifest.dependent_launch``); for older
    architectures the macro is empty."""
    kernels = [sparse_ffn("pdl_ffn", 64, 128, "reglu", "f16"), rms_norm("pdl_norm", 1, 64, 1e-5)]
    for arch, per_entry in (("sm_90", 1), ("sm_75", 0)):
        for art in build_cuda(kernels, arch, outputs=("ptx",)).values():
            bodies = art.source.split("PICC_GRID_DEPENDENCY();")
            assert len(bodies) - 1 == len(art.entry_points) >= 1
            ptx = (art.ptx or b"").decode()
            assert ptx.count("griddepcontrol.wait") == per_entry * len(art.entry_points)
            assert "griddepcontrol.launch_dependents" not in ptx  # see build.GRID_DEPENDENCY
