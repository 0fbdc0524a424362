"""Every CUDA kernel the compiler emits stays inside its buffers (``picc.codegen_cuda.bounds``).

The checker proves it from the lowered device code, without a GPU, for every thread of every
launch. Data-dependent indices need what the runtime promises about its integer inputs
(``_promises``); everything else is proved from the code. The tests at the bottom show the
checker failing where it must: a hand-written store past its buffer, an unguarded index list,
and the FFN AXPY schedule whose bounds predicate TVM's lowering dropped (compute-sanitizer's
finding on an H100).
"""

from __future__ import annotations

from functools import cache

import pytest
from cuda_models import RELU_DEMO, SMOLLM2, ModelShapes, model_kernels
from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from picc.codegen_cuda import ARCHS, Kernel, dense, ffn, greedy, layers, padded
from picc.codegen_cuda.bounds import ValueRanges, out_of_bounds
from picc.codegen_cuda.kernel import kernel_from_func, make_kernel

TINY = ModelShapes("tiny", hidden=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16, vocab=256, max_ctx=64,
                   predictor_rank=32, prefill=8, qk_norm=True)
LLAMA_7B = ModelShapes("llama7b", hidden=4096, n_ff=11008, n_heads=32, n_kv_heads=32, head_dim=128, vocab=32000)

Case = tuple[Kernel, ValueRanges]


def _promises(kernel: Kernel, m: ModelShapes, n_ff: int | None = None) -> ValueRanges:
    """What the runtime guarantees about the integer inputs of ``kernel`` (of model ``m``).

    ``pos``: a position in the KV cache; ``tokens``: a token id. A sparse FFN over ``n_ff``
    neurons: every entry of ``idx`` is a neuron (``compact`` writes 0 past ``count``), ``count``
    at most the list's length. ``compact``'s next slot ``mine`` (``warp_compact``) is below its ``n`` neurons
    wherever it indexes ``idx`` (at most as many entries as active neurons: a loop
    invariant, which the checker does not derive, so it is stated here).
    """
    n = m.n_ff if n_ff is None else n_ff
    promises = {"pos": (0, m.max_ctx - 1), "tokens": (0, m.vocab - 1)}
    if kernel.kind == "sparse_ffn":
        promises |= {"idx": (0, n - 1), "count": (0, kernel.param("idx").shape[0])}
    if kernel.kind == "compact":
        promises["mine"] = (0, n - 1)
    return promises


def _model(m: ModelShapes, formats: tuple[str, ...], predictor_fmt: dict[str, str]) -> list[Case]:
    """The kernels ``model_kernels`` gives ``m`` in each format (the shared layer kernels once)."""
    cases: dict[str, Case] = {}
    for fmt in formats:
        for k in model_kernels(m, fmt, predictor_fmt.get(fmt, "f16")):
            n = m.n_ff // 2 if k.name == f"{m.name}_compact_cold" else m.n_ff
            cases.setdefault(k.name, (k, _promises(k, m, n)))
    return list(cases.values())


def _variants() -> list[Case]:
    """What ``lower_gpu`` emits beyond ``model_kernels``: biases, embedding, layer norm, partial
    and GPT-J rotary, heads joined from a shared head and a head each, a sliding window (with soft-capped scores and sinks), an FFN part at a neuron offset, q8_0, GeGLU, and the
    greedy loop's kernel over a vocabulary its threads do not divide; value heads narrower than
    key heads (DeepSeek's) in the cache appends and the attention kernels, and wider ones."""
    m, n = TINY, TINY.n_ff
    kernels = [
        dense.gemv("v_gemv_bias", 96, 64, "q4_0", bias=True),
        dense.gemm("v_gemm_bias", 8, 96, 64, "f16", bias=True),
        dense.embed("v_embed_q4_0", 1, m.vocab, 64, "q4_0"),
        dense.embed("v_embed_f16", 1, m.vocab, 64, "f16"),
        dense.predictor("v_predictor_bias", 64, 32, n, "f32", fc1_bias=True, fc2_bias=True),
        layers.layer_norm("v_layer_norm", 1, 320, 1e-5),
        layers.layer_norm("v_layer_norm_nobias", 8, 64, 1e-5, bias=False),
        layers.rope("v_rope_gptj", 1, 4, 16, None, "gptj"),
        layers.rope("v_rope_partial", 8, 4, 16, 8, "llama"),
        layers.rope_pair("v_rope_pair", 5, 1, 64, None, "llama"),
        layers.rope_pair("v_rope_pair_gptj_partial", 4, 2, 16, 8, "gptj"),
        layers.rope_pair("v_rope_pair_append", 4, 2, 16, None, "llama", append_ctx=m.max_ctx),
        layers.rope_pair("v_rope_pair_append_narrow", 4, 2, 16, None, "llama", append_ctx=m.max_ctx, v_width=24),
        layers.rope_pair("v_rope_pair_append_wide", 4, 2, 16, 8, "gptj", append_ctx=m.max_ctx, v_width=48),
        layers.kv_append("v_kv_append_narrow", 1, 32, m.max_ctx, 24),
        layers.kv_append("v_kv_append_wide", 8, 32, m.max_ctx, 48),
        layers.concat_heads("v_concat_heads_a1", 1, 4, 1, 8, 4, 16),  # DeepSeek's keys: one k_pe head for all
        layers.concat_heads("v_concat_heads_b1", 1, 4, 4, 8, 1, 16),
        layers.attention("v_attention_window", 8, 4, 2, 16, m.max_ctx, 0.25, window=5),
        layers.attention_decode("v_attention_decode_window", 4, 2, 16, m.max_ctx, 0.25, window=5),
        layers.attention("v_attention_sinks", 8, 4, 2, 16, m.max_ctx, 0.25, window=5, softcap=0.7, sinks=True),
        layers.attention_decode("v_attention_decode_sinks", 4, 2, 16, m.max_ctx, 0.25, window=5, softcap=0.7,
                                sinks=True),
        layers.attention("v_attention_narrow", 8, 4, 2, 16, m.max_ctx, 0.25, window=5, softcap=0.7, sinks=True,
                         v_head_dim=12),
        layers.attention_decode("v_attention_decode_narrow", 4, 2, 16, m.max_ctx, 0.25, window=5, v_head_dim=12),
        layers.attention("v_attention_wide", 1, 4, 4, 16, m.max_ctx, 0.25, v_head_dim=24),
        layers.attention_decode("v_attention_decode_wide", 4, 4, 16, m.max_ctx, 0.25, sinks=True, v_head_dim=24),
        layers.merge("v_merge_bias", 64, bias=True),
        ffn.sparse_ffn("v_sparse_ffn_bias", 64, n, "drelu", "q8_0", bias=True),
        ffn.sparse_ffn("v_sparse_ffn_relu", 64, n, "relu", "q4_1"),
        ffn.dense_ffn("v_dense_ffn_bias", 64, n, "gelu", "f16", bias=True),
        ffn.gate_first_ffn("v_gate_first_geglu", 64, n, "geglu_tanh", "q8_0"),
        # The variants that also do a residual add (``accumulated_by``).
        dense.gemv("v_gemv_res", 96, 64, "q4_0", bias=True, residual=True),
        layers.merge("v_merge_res", 64, bias=False, residual=True),
        ffn.bias_add("v_bias_add_res", 64, residual=True),
        ffn.dense_ffn("v_dense_ffn_res", 64, n, "swiglu", "q4_0", residual=True),
        ffn.gate_first_ffn("v_gate_first_res", 64, n, "swiglu", "f16", residual=True),
        greedy.greedy_next("v_greedy_next_odd_vocab", 1000, m.max_ctx),  # the last 256 logits a partial sweep
    ]
    cases = [(k, _promises(k, m)) for k in kernels]
    relu = ffn.sparse_ffn("v_sparse_ffn_res_relu_demo", RELU_DEMO.hidden, RELU_DEMO.n_ff, "reglu", "f16", residual=True)
    cases.append((relu, _promises(relu, RELU_DEMO)))
    half = dense.compact("v_compact_offset", n // 2, padded(n // 2), n // 2)
    return [*cases, (half, _promises(half, m, n // 2))]


def _decode_attention() -> list[Case]:
    """The one-launch decode attention at the shapes of the models (their caches: SmolLM2 and
    LLaMA-7B at 2048, the latter also at 4096, the longest the kernel takes; relu-demo at its
    512), a sliding window, and the odd tiles: the shortest cache, a head_dim of 80; DeepSeek V3's
    heads (keys of 192 features, values of 128) at the longest cache."""
    shapes = [(SMOLLM2, SMOLLM2.max_ctx), (RELU_DEMO, 512), (LLAMA_7B, 2048), (LLAMA_7B, 4096)]
    kernels = [layers.attention_decode(f"{m.name}_attention_decode_{ctx}", m.n_heads, m.n_kv_heads, m.head_dim, ctx,
                                       m.head_dim**-0.5) for m, ctx in shapes]
    kernels.append(layers.attention_decode("relu_demo_attention_decode_window", 5, 1, 64, 512, 0.125, window=100))
    # The shortest cache it takes (two rows of positions) and a head_dim of no power of two.
    kernels.append(layers.attention_decode("short_attention_decode", 4, 2, 64, 32, 0.125))
    kernels.append(layers.attention_decode("d80_attention_decode", 4, 2, 80, 256, 80**-0.5))
    kernels.append(layers.attention_decode("deepseek_attention_decode", 128, 128, 192, 4096, 192**-0.5, v_head_dim=128))
    return [(k, {"pos": (0, k.param("k_cache").shape[0] - 1)}) for k in kernels]


@cache
def _cases(model: str) -> list[Case]:
    match model:
        case "tiny":
            return _model(TINY, ("f32", "q4_0", "q8_0"), {})
        case "smollm2":
            return _model(SMOLLM2, ("q4_0", "q4_1", "f16", "f32"), {"q4_0": "q4_0"})
        case "relu_demo":
            return _model(RELU_DEMO, ("f16", "q4_0"), {})
        case "llama7b_ffn":
            return [(k, _promises(k, LLAMA_7B)) for k in (
                ffn.sparse_ffn(f"llama7b_{fmt}_sparse_ffn_swiglu", 4096, 11008, "swiglu", fmt) for fmt in ("f16", "q4_0"))]
        case "attention_decode":
            return _decode_attention()
        case _:
            return _variants()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", ["tiny", "smollm2", "relu_demo", "llama7b_ffn", "attention_decode", "variants"])
def test_every_kernel_stays_inside_its_buffers(model: str, arch: str) -> None:
    kinds = {k.kind for k, _ in _cases(model)}
    violations = [m for kernel, promises in _cases(model) for m in out_of_bounds(kernel, arch, promises)]
    assert not violations, "\n".join(violations)
    if model not in ("llama7b_ffn", "attention_decode"):  # the sets cover every kind the compiler emits
        assert {"gemv", "gemm", "predictor", "compact", "sparse_ffn", "dense_ffn", "gate_first_ffn",
                "norm", "elementwise", "attention", "attention_decode", "greedy_next"} <= kinds


# -- the checker fails where it must ---------------------------------------------------------------


@T.prim_func(s_tir=True)
def _store_past_the_end(y: T.Buffer((32,), "float32")):
    for t in T.thread_binding(64, thread="threadIdx.x"):
        with T.sblock("y"):
            vt = T.axis.spatial(64, t)
            T.reads()
            T.writes(y[vt])
            y[vt] = T.float32(1)


@T.prim_func(s_tir=True)
def _guarded_store(y: T.Buffer((32,), "float32"), x: T.Buffer((32,), "float32")):
    for t in T.thread_binding(64, thread="threadIdx.x"):
        if t < 32:
            y[t] = x[t]
        y[T.min(t, 31)] = T.if_then_else(t < 32, x[t], T.float32(0))


@T.prim_func(s_tir=True)
def _scatter(y: T.Buffer((32,), "float32"), idx: T.Buffer((8,), "int32"), count: T.Buffer((1,), "int32")):
    for t in T.thread_binding(8, thread="threadIdx.x"):
        if t < count[0]:
            y[idx[t]] = T.float32(1)


@T.prim_func(s_tir=True)
def _vector_load(y: T.Buffer((36,), "float32"), x: T.Buffer((32,), "float32")):
    for t in T.thread_binding(9, thread="threadIdx.x"):
        y[T.Ramp(t * 4, 1, 4)] = x[T.Ramp(t * 4, 1, 4)]


def _kernel(func: tirx.PrimFunc, roles: dict[str, str]) -> Kernel:
    return kernel_from_func(func.attrs["global_symbol"], "hand_written", func, roles)


def test_a_store_past_the_end_is_found() -> None:
    kernel = _kernel(_store_past_the_end, {"y": "out"})
    (message,) = out_of_bounds(kernel, "sm_90", func=kernel.func)
    assert "stores to y [32 elements]" in message and "index in [0, 63]" in message


def test_if_and_if_then_else_conditions_count() -> None:
    kernel = _kernel(_guarded_store, {"y": "out", "x": "in"})
    assert out_of_bounds(kernel, "sm_75", func=kernel.func) == []


def test_a_data_dependent_index_needs_a_promise_and_is_held_to_it() -> None:
    kernel = _kernel(_scatter, {"y": "out", "idx": "in", "count": "in"})
    (unknown,) = out_of_bounds(kernel, "sm_90", func=kernel.func)
    assert "stores to y" in unknown and "depends on the values of idx" in unknown
    assert out_of_bounds(kernel, "sm_90", {"idx": (0, 31)}, func=kernel.func) == []
    (too_wide,) = out_of_bounds(kernel, "sm_90", {"idx": (0, 32)}, func=kernel.func)
    assert "index in [0, 32]" in too_wide


def test_vector_indices_are_checked_at_their_last_lane() -> None:
    kernel = _kernel(_vector_load, {"y": "out", "x": "in"})
    (message,) = out_of_bounds(kernel, "sm_90", func=kernel.func)
    assert "loads from x [32 elements]" in message and "index in [0, 35]" in message


def test_the_axpy_whose_predicate_the_lowering_drops_is_found() -> None:
    """The FFN AXPY schedule the H100 caught: columns split [None, 32, 4] over 64 columns. The
    scheduled TensorIR is right (``T.where(k_1 < 16)`` on the final block); the lowered code
    stores ``y[threadIdx.x * 4 + i]`` from all 32 threads."""
    h = te.placeholder((128,), "float32", name="h")
    d = te.placeholder((128, 64), "float32", name="d")
    r = te.reduce_axis((0, 128), name="r")
    y = te.compute((64,), lambda k: te.sum(h[r] * d[r, k], axis=r), name="y")
    kernel = make_kernel("old_axpy", "axpy", [(h, "in"), (d, "in"), (y, "out")])
    sch = s_tir.Schedule(kernel.func)
    k, r_loop = sch.get_loops(sch.get_sblock("y"))
    ro, ry = sch.split(r_loop, [None, 16])
    rf = sch.rfactor(ry, 0)
    k, ro, ry = sch.get_loops(rf)
    bx, tx, vec = sch.split(k, [None, 32, 4])
    sch.reorder(bx, tx, ry, ro, vec)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.bind(ry, "threadIdx.y")
    sch.vectorize(vec)
    sch.decompose_reduction(rf, ro)
    sch.set_scope(rf, 0, "local")
    final = sch.get_sblock("y")
    sch.reverse_compute_at(final, tx)
    red, col = sch.get_loops(final)[-2:]
    sch.reorder(col, red)
    sch.bind(red, "threadIdx.y")
    func = sch.mod["main"]
    assert "T.where" in func.script()  # the schedule still says which threads store
    (message,) = out_of_bounds(kernel, "sm_90", func=func)
    assert "stores to y [64 elements]" in message and "index in [0, 127]" in message
