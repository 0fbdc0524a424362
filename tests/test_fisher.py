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
from conftest import tiny_llama, with_tokenizer
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
], ids=["swiglu-biases", "geglu-gptj-window-tied", "drelu-mqa"])
def test_torch_forward_matches_the_interpreter(make):
    _logits_match(make(), list(np.random.default_rng(0).integers(0, 128, 23)))


@pytest.mark.parametrize("family, variant", [("opt", "pre-ln"), ("falcon", "alibi")])
def test_torch_forward_matches_on_hf_families(tmp_path: Path, family: str, variant: str):
    # OPT: LayerNorm with biases, learned positions with an offset, a non-gated ReLU FFN.
    # Falcon with ALiBi: the bf16-rounded biases.
    make_model(family, variant, tmp_path / family)
    _logits_match(load_model(tmp_path / family), list(np.random.default_rng(1).integers(3, 90, 19)))


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
