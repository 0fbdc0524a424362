"""The torch forward behind the Fisher scales follows the interpreter; the scales measure what they say.

Tolerance for the logits: 1e-5 relative to the largest logit. Both sides compute in float32 from
the same weights and differ only in summation order (observed ~2e-6 on SmolLM2's 30 layers).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import narrow_values, tiny_llama, tiny_mla, with_tokenizer
from hf_models import make_model

from picc.errors import PiccError
from picc.frontend import load_model
from picc.frontend.llama import RopeSpec
from picc.interpreter import Interpreter
from picc.ir.module import WeightDecl
from picc.ir.weights import Tensor
from picc.sparsity.calib import token_windows
from picc.sparsity.fisher import TorchForward, fisher_scales


def _logits_match(model, tokens: list[int]) -> None:
    ref = Interpreter(model.module, model.weights).run(tokens)
    with torch.no_grad():
        got = TorchForward(model.module, model.weights).run(tokens).numpy()
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.mark.parametrize("make", [
    lambda: tiny_llama("swiglu", n_layers=3, biases=True),
    lambda: tiny_llama("geglu_tanh", rope=RopeSpec(style="gptj", rotary_dim=8), window=5, tied=True),
    lambda: tiny_llama("drelu", n_kv_heads=1),
    lambda: tiny_llama("swiglu", window=5, sinks=True),
    lambda: tiny_mla(yarn=True),
    lambda: tiny_mla(a_heads=4, b_heads=1),
    lambda: narrow_values(tiny_llama("swiglu", window=5, biases=True), 12),  # DeepSeek's MLA: v_head_dim 12 of 16
], ids=["swiglu-biases", "geglu-gptj-window-tied", "drelu-mqa", "swiglu-window-sinks", "mla-keys-yarn", "b-shared",
        "swiglu-window-narrow-values"])
def test_torch_forward_matches_the_interpreter(make):
    _logits_match(make(), list(np.random.default_rng(0).integers(0, 128, 23)))


@pytest.mark.parametrize("family, variant", [("opt", "pre-ln"), ("falcon", "alibi"), ("qwen3", "head-dim"),
                                             ("phi3", "longrope-partial"), ("gemma3_text", "base"),
                                             ("llama", "rope-yarn-mscale"), ("gpt_oss", "yarn"),
                                             ("qwen2_moe", "base"), ("ernie4_5_moe", "base"), ("deepseek_v3", "yarn"),
                                             ("deepseek_v2", "group-limited"), ("glm4_moe", "qk-norm")])
def test_torch_forward_matches_on_hf_families(tmp_path: Path, family: str, variant: str):
    # OPT: LayerNorm with biases, learned positions with an offset, a non-gated ReLU FFN.
    # Falcon with ALiBi: the bf16-rounded biases. Qwen3: the norms of each head's q and k.
    # Phi-4-mini's longrope: a factor per frequency, the cosines and sines scaled (YaRN's too). Gemma 3:
    # the embedding scaled, the sandwich norms, a rope per layer. gpt-oss: sinks, the experts' biases
    # and clamped SwiGLU. Qwen2-MoE: the gated shared experts. ERNIE 4.5: the choice bias. DeepSeek:
    # the latent attention (keys joined head by head, narrower values, yarn's mscale) and the grouped
    # routings; GLM-4.5: half of each head rotated after q and k norms, sigmoid routing.
    make_model(family, variant, tmp_path / family)
    _logits_match(load_model(tmp_path / family), list(np.random.default_rng(1).integers(3, 90, 19)))


@pytest.mark.parametrize("routing", ["deepseek-v2", "deepseek-v3", "glm-4.5"])
def test_torch_forward_routes_as_the_interpreter(tmp_path: Path, routing: str):
    # DeepSeek's and GLM-4.5's routers (tests/moe_routers.py) on a tiny ERNIE 4.5 MoE: sigmoids or
    # the softmax, the groups, the routed weights' scale.
    from moe_routers import with_routing

    make_model("ernie4_5_moe", "base", tmp_path / "hf")
    _logits_match(with_routing(load_model(tmp_path / "hf"), routing), list(np.random.default_rng(1).integers(3, 90, 19)))


def test_fisher_scales_are_deterministic_and_follow_the_down_columns():
    # dL/da_i = u_i * (down_i . dL/dy): a neuron whose down column is zero cannot move the loss,
    # so its scale is exactly 0; the other neurons' scales are positive. A scale taken from the
    # wrong tensor (gate, or h) would not vanish with the column.
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2))
    windows = token_windows(model.tokenizer, "ptb", 256, window=64, seed=1)
    scales = fisher_scales(model.module, model.weights, windows, seed=0)
    assert set(scales) == {"l0.ffn.out", "l1.ffn.out"}
    assert all(s.shape == (96,) and (s > 0).all() for s in scales.values())
    again = fisher_scales(model.module, model.weights, windows, seed=0)
    for name in scales:
        np.testing.assert_array_equal(scales[name], again[name])
    down = model.weights.f32("l1.ffn.down").copy()  # [hidden, n_ff]: column i is neuron i's
    down[:, [3, 40]] = 0
    model.weights.add("l1.ffn.down.cut", Tensor.from_f32(down))
    func = model.module.function()
    ops = tuple(replace(op, down="l1.ffn.down.cut") if op.result == "l1.ffn.out" else op for op in func.ops)
    module = replace(model.module, weights=(*model.module.weights,
                                            WeightDecl("l1.ffn.down.cut", model.weights["l1.ffn.down.cut"].type)))
    cut = fisher_scales(module.with_function(replace(func, ops=ops)), model.weights, windows, seed=0)
    assert cut["l1.ffn.out"][3] == 0 and cut["l1.ffn.out"][40] == 0
    assert (np.delete(cut["l1.ffn.out"], [3, 40]) > 0).all()


def test_fisher_scales_need_gated_ffns():
    model = with_tokenizer(tiny_llama("relu"))
    windows = token_windows(model.tokenizer, "ptb", 64, window=64)
    with pytest.raises(PiccError, match="Fisher scales need gated FFNs"):
        fisher_scales(model.module, model.weights, windows, seed=0)


def _whole_graph_scales(model, windows, seed: int) -> dict[str, np.ndarray]:
    """The Fisher scales as one autograd graph per window through the whole model (what the
    block-by-block pass must reproduce)."""
    forward = TorchForward(model.module, model.weights)
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, torch.Tensor] = {}
    for window in windows.windows:
        logits = forward.run(list(window))
        with torch.no_grad():
            labels = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
        torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
        for name, act in forward.gate_acts.items():
            sums[name] = sums.get(name, 0) + (act.grad.double() ** 2).sum(0)
    return {name: np.sqrt(s.numpy() / windows.n_tokens).astype(np.float32) for name, s in sums.items()}


def test_fisher_scales_block_by_block_hold_no_more_than_a_block_of_float32_weights(monkeypatch):
    # A 7B model's weights in float32 are 27 GB: the pass must not keep them all (it once did, in
    # torch copies, until the machine killed the compile). Between blocks, no float32 weight may
    # be alive in torch; the scales equal those of one graph through the whole model.
    import gc

    from picc.ir.types import DType

    model = with_tokenizer(tiny_llama("swiglu", n_layers=4, n_ff=512, matrix_dtype=DType.Q4_0, biases=True))
    windows = token_windows(model.tokenizer, "ptb", 144, window=48, seed=1)
    shapes = {tuple(model.weights[name].shape) for name in model.weights if len(model.weights[name].shape) == 2}
    assert not any(s[0] == 48 for s in shapes)  # an activation [48, n] is never mistaken for a weight
    alive: list[int] = []
    advanced: list[float] = []

    def weight_shaped() -> list:
        return [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and tuple(t.shape) in shapes]

    # Tensors other tests left alive (transformers models they keep) are not the pass's: held here,
    # so that no tensor the pass makes can take one's id.
    before = weight_shaped()
    theirs = {id(t) for t in before}

    def weight_bytes_in_torch(n: float) -> None:
        advanced.append(n)
        tensors = [t for t in weight_shaped() if id(t) not in theirs]
        alive.append(sum({t.data_ptr(): t.nbytes for t in tensors}.values()))

    scales = fisher_scales(model.module, model.weights, windows, seed=0, progress=weight_bytes_in_torch)
    # parts: the embedding, 4 blocks, the head; the forward pass stops before the head
    assert len(alive) == 5 + 6 and max(alive) == 0
    assert sum(advanced) == pytest.approx(windows.n_tokens)  # the bar ends at its total
    expected = _whole_graph_scales(model, windows, seed=0)
    assert set(scales) == set(expected) == {f"l{i}.ffn.out" for i in range(4)}
    for name in scales:
        np.testing.assert_allclose(scales[name], expected[name], rtol=1e-5, atol=1e-7 * expected[name].max())


def test_fisher_tokens_take_the_gradients_of_the_first_windows_and_observe_them_all():
    # The scales from the first windows holding `tokens` are those of those windows alone (the
    # same labels, drawn window by window in order), bit for bit; the forward still shows every
    # window's FFNs to the observer, each layer's in window order.
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2))
    windows = token_windows(model.tokenizer, "ptb", 256, window=64, seed=1)
    seen = []
    part = fisher_scales(model.module, model.weights, windows, seed=0, tokens=100,
                         on_ffn=lambda t: seen.append((t.op.result, t.score.copy())))
    first = replace(windows, windows=windows.windows[:2])  # 128 tokens: the first two windows hold 100
    alone = fisher_scales(model.module, model.weights, first, seed=0)
    every = fisher_scales(model.module, model.weights, windows, seed=0)
    for name in alone:
        np.testing.assert_array_equal(part[name], alone[name])
        assert not np.array_equal(part[name], every[name])
    assert [name for name, _ in seen] == ["l0.ffn.out"] * 4 + ["l1.ffn.out"] * 4
    traces = []
    interp = Interpreter(model.module, model.weights)
    interp.on_ffn = lambda t: traces.append((t.op.result, t.score))
    for w in windows.windows:
        interp.reset()
        interp.run(list(w))
    by_layer = sorted(traces, key=lambda t: t[0])  # stable: windows in order within a layer
    for (_, got), (_, want) in zip(seen, by_layer, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32, another summation order


def test_the_fisher_pass_keeps_one_blocks_float32_weights(monkeypatch):
    # The store's cache holds 2 GB of float32 weights for the interpreter; the Fisher pass reads
    # each block's for every window and then moves on, so it bounds the cache to the largest
    # block's (a 7B's 0.8 GB; keeping 2 GB made the sparse 7B compile peak 1.2 GB higher), and
    # puts the budget back after.
    from picc.ir import weights as W

    model = with_tokenizer(tiny_llama("swiglu", n_layers=3, hidden=64, n_ff=128))
    windows = token_windows(model.tokenizer, "ptb", 128, window=64, seed=1)
    block = sum(4 * int(np.prod(model.weights[name].shape)) for op in model.module.ops() if op.block == 1
                for name in op.weights())
    kept = []
    f32 = W.WeightStore.f32

    def watched(store, name):  # noqa: ANN001, ANN202
        value = f32(store, name)
        kept.append(sum(v.nbytes for v in store._f32.values()))
        return value

    monkeypatch.setattr(W.WeightStore, "f32", watched)
    scales = fisher_scales(model.module, model.weights, windows, seed=0)
    assert max(kept) <= block < W.F32_CACHE_BYTES
    np.testing.assert_array_equal(scales["l0.ffn.out"],
                                  fisher_scales(model.module, model.weights.copy(), windows, seed=0)["l0.ffn.out"])
    model.weights.f32("l0.ffn.up")
    model.weights.f32("l1.ffn.up")
    assert len(model.weights._f32) >= 2  # the 2 GB budget again
