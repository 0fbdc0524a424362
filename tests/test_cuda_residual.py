"""The GPU kernels that also do another op's work: the decode step's residual add
(``accumulated_by`` on an ``add``), a layer's k rope (``launched_with`` on a ``rope``) and its
attention's KV cache append (``appended_by_rope`` on the ``attention``).

On a GPU a decode step is bound by its launches, so ``select-kernels`` gives each residual add to
the kernel of its operand's producer (a GEMV, a fused FFN, a split layer's merge, a down bias's
add) and the add launches nothing. The variant must compute exactly the add's bits: ``r + t``
with ``t`` what the plain kernel writes (f32 addition commutes, so ``t + r`` is the same number).
Checked on the host build of the same TensorIR, bit for bit; the CUDA code of the variants is
checked to stay inside its buffers in tests/test_cuda_bounds.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import half_the_ffn, tiny_llama, with_tokenizer

from picc.codegen_cuda import build_host, dense, ffn, layers
from picc.codegen_cuda.kernel import Kernel
from picc.compile import CompileOptions, compile_model
from picc.ir import ops as O
from picc.ir.types import Placement
from picc.placement import memory_plan as mp
from picc.sparsity.sparsify import SparsifyOptions


def _inputs(kernel: Kernel, rng: np.random.Generator, n_ff: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every ``in`` parameter of ``kernel``: activations and float weights
    around 1, 4-bit nibbles anywhere, small block scales, an index list of distinct neurons."""
    out: dict[str, np.ndarray] = {}
    for p in kernel.params:
        if p.role != "in":
            continue
        if p.name == "idx":
            out[p.name] = np.zeros(p.shape, np.int32)
            out[p.name][: n_ff // 2] = rng.permutation(n_ff)[: n_ff // 2]
        elif p.name == "count":
            out[p.name] = np.array([n_ff // 2], np.int32)
        elif p.dtype == "uint8":
            out[p.name] = rng.integers(0, 256, p.shape, dtype=np.uint8)
        elif p.name.endswith("_d"):
            out[p.name] = (rng.random(p.shape) * 0.02).astype(p.dtype)
        else:
            out[p.name] = rng.standard_normal(p.shape).astype(p.dtype)
    return out


PAIRS = [
    pytest.param(lambda res: dense.gemv(f"g_res{res}", 96, 64, "q4_0", bias=True, residual=res), 0, id="gemv"),
    pytest.param(lambda res: ffn.sparse_ffn(f"s_res{res}", 320, 1280, "reglu", "f16", residual=res), 1280,
                 id="sparse_ffn"),
    pytest.param(lambda res: ffn.dense_ffn(f"d_res{res}", 64, 128, "swiglu", "q4_0", residual=res), 0, id="dense_ffn"),
    pytest.param(lambda res: ffn.gate_first_ffn(f"gf_res{res}", 64, 128, "swiglu", "f32", residual=res), 0,
                 id="gate_first_ffn"),
    pytest.param(lambda res: layers.merge(f"m_res{res}", 64, bias=True, residual=res), 0, id="merge"),
    pytest.param(lambda res: ffn.bias_add(f"b_res{res}", 64, residual=res), 0, id="bias_add"),
]


@pytest.mark.parametrize(("make", "n_ff"), PAIRS)
def test_the_residual_variant_writes_the_adds_bits(make, n_ff: int) -> None:
    plain, added = make(False), make(True)
    names = [p.name for p in plain.params]
    first_written = next(i for i, p in enumerate(plain.params) if p.role in ("scratch", "out"))
    assert [p.name for p in added.params] == [*names[:first_written], "r", *names[first_written:]]
    inputs = _inputs(plain, np.random.default_rng(3), n_ff)
    out_name = next(p.name for p in plain.params if p.role == "out")
    t = build_host(plain)(**inputs)[out_name]
    r = np.random.default_rng(4).standard_normal(t.shape).astype(np.float32)
    y = build_host(added)(**inputs, r=r)[out_name]
    assert np.abs(t).max() > 0
    np.testing.assert_array_equal(y, r + t)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, seed=5))
    sparsity = SparsifyOptions(mode="predictor", tokens=512, window=64, budget=0.5)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PICC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        out = compile_model(model, CompileOptions(target="pc-low", vram="4MiB", sparsity=sparsity), say=lambda _: None)
        split = compile_model(model, CompileOptions(target="pc-low", vram=str(half_the_ffn(out)), sparsity=sparsity),
                              say=lambda _: None)
    return out, split


def test_every_residual_add_on_the_gpu_launches_nothing(whole):
    """In a model whole on the GPU each layer's two residual adds are done by the attention's
    output GEMV and the FFN's kernel, whose kernels are the ``_res`` variants; in a split model,
    by the merge of the layer's two FFN parts."""
    for compiled, producers in zip(whole, ({O.Linear, "FusedFFN"}, {O.Linear, "Merge"}), strict=True):
        ops = compiled.model.module.function().ops
        by_result = {op.result: op for op in ops}
        adds = [op for op in ops if isinstance(op, O.Add) and op.type.placement == Placement.GPU]
        assert adds and all(op.accumulated is not None for op in adds)
        assert all(mp.gpu_launch_count(op, 512) == 0 for op in adds)
        made_by = {by_result[op.accumulated[0]] for op in adds}
        assert {O.Linear if isinstance(p, O.Linear) else type(p).__name__ for p in made_by} == producers
        assert all(p.kernel.endswith("_res") for p in made_by)


@pytest.mark.parametrize(("style", "rotary"), [("llama", None), ("gptj", 8)])
def test_a_rope_pair_writes_what_two_ropes_write(style: str, rotary: int | None) -> None:
    rng = np.random.default_rng(5)
    x1 = rng.standard_normal((1, 4 * 16)).astype(np.float32)
    x2 = rng.standard_normal((1, 2 * 16)).astype(np.float32)
    pos = np.array([23], np.int32)
    inv = rng.random(((rotary or 16) // 2 + 1,)).astype(np.float32)  # the frequencies, then a factor
    pair = build_host(layers.rope_pair(f"pair_{style}", 4, 2, 16, rotary, style))(x1=x1, x2=x2, pos=pos, inv_freq=inv)
    one = build_host(layers.rope(f"one_{style}", 1, 4, 16, rotary, style))(x=x1, pos=pos, inv_freq=inv)["y"]
    two = build_host(layers.rope(f"two_{style}", 1, 2, 16, rotary, style))(x=x2, pos=pos, inv_freq=inv)["y"]
    assert not np.array_equal(one, x1)
    np.testing.assert_array_equal(pair["y1"], one)
    np.testing.assert_array_equal(pair["y2"], two)


def test_each_layers_k_rope_is_launched_with_its_q_rope(whole):
    for compiled in whole:
        ops = compiled.model.module.function().ops
        by_result = {op.result: op for op in ops}
        ropes = [op for op in ops if isinstance(op, O.Rope) and op.type.placement == Placement.GPU]
        seconds = [op for op in ropes if op.launched_with is not None]
        assert ropes and len(seconds) == len(ropes) // 2
        for second in seconds:
            first = by_result[second.launched_with]
            assert first.result.endswith("q_rope") and second.result.endswith("k_rope")
            assert first.block == second.block and first.kernel == second.kernel
            assert mp.gpu_launch_count(second, 512) == 0 and mp.gpu_launch_count(first, 512) == 1
            (att,) = [op for op in ops if isinstance(op, O.Attention) and op.k == second.result]
            assert att.appended_by_rope and first.kernel.endswith("_append_ctx512")
            assert mp.gpu_launch_count(att, 512) == 1  # the one-launch attention, no append of its own


@pytest.mark.parametrize("v_width", [32, 24, 40])  # values as wide as the keys, narrower (DeepSeek's), wider
def test_a_rope_pair_that_appends_writes_the_cache_rows_kv_append_writes(v_width: int) -> None:
    # Row pos of each cache is the rotated k's, the v's (v_width features); every other row is
    # left as it was.
    rng = np.random.default_rng(6)
    x1, x2 = (rng.standard_normal((1, n * 16)).astype(np.float32) for n in (4, 2))
    v = rng.standard_normal((1, v_width)).astype(np.float32)
    pos, inv = np.array([5], np.int32), rng.random((9,)).astype(np.float32)
    caches = {name: rng.standard_normal((16, n)).astype(np.float32) for name, n in (("k_cache", 32),
                                                                                  ("v_cache", v_width))}
    out = build_host(layers.rope_pair(f"pair_append_{v_width}", 4, 2, 16, None, "llama", append_ctx=16,
                                      v_width=v_width))(x1=x1, x2=x2, v=v, pos=pos, inv_freq=inv, **caches)
    rows = build_host(layers.kv_append(f"append_{v_width}", 1, 32, 16, v_width))(k=out["y2"], v=v, pos=pos, **caches)
    plain = build_host(layers.rope_pair("pair_plain", 4, 2, 16, None, "llama"))(x1=x1, x2=x2, pos=pos, inv_freq=inv)
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(out[name], plain[name])
    for name, row in (("k_cache", plain["y2"][0]), ("v_cache", v[0])):
        np.testing.assert_array_equal(out[name], rows[name])
        np.testing.assert_array_equal(out[name][5], row)
        others = np.arange(16) != 5
        np.testing.assert_array_equal(out[name][others], caches[name][others])
