"""relu-demo, picc's own ReLU LLaMA: imports like any HF checkpoint, is sparse, and predictors
make it sparser at no measurable cost."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from picc.cli import main
from picc.frontend import load_model
from picc.frontend.aliases import resolve_alias
from picc.interpreter import Interpreter
from picc.ir.types import DType
from picc.sparsity.calib import token_windows
from picc.sparsity.evaluation import eval_windows, evaluate
from picc.sparsity.profiling import profile_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def picc_model():
    return load_model("relu-demo")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_alias("relu-demo")), dtype=torch.float32).eval()


def test_imports_through_the_hf_frontend_and_matches_transformers(picc_model, hf_model):
    assert picc_model.module.attr("arch") == "llama"
    assert {op.form for op in picc_model.module.ops() if op.NAME == "ffn"} == {"reglu"}
    assert picc_model.module.weight_types()["l0.ffn.up"].dtype == DType.F16  # shipped fp16
    ids = picc_model.tokenizer.encode("the company said its shares rose N cents in new york trading")
    ours = Interpreter(picc_model.module, picc_model.weights).run(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    # both float32 on the same (fp16-exact) weights: only summation order differs
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-4


def test_profile_matches_an_independent_torch_count(picc_model, hf_model):
    windows = token_windows(picc_model.tokenizer, "ptb", 1024, window=256, seed=2)
    profile = profile_model(picc_model.module, picc_model.weights, windows)
    active = {i: [] for i in range(len(hf_model.model.layers))}

    def hook(i):
        def grab(module, inputs, output):
            active[i].append(module.gate_proj(inputs[0][0]) > 0)  # ReGLU: relu(gate) > 0
        return grab

    handles = [layer.mlp.register_forward_hook(hook(i)) for i, layer in enumerate(hf_model.model.layers)]
    try:
        with torch.no_grad():
            for w in windows.windows:
                hf_model(torch.tensor([list(w)]))
    finally:
        for h in handles:
            h.remove()
    n = windows.n_tokens
    for i, layer in enumerate(profile.layers):
        freq = torch.cat(active[i]).float().mean(0).numpy()
        # a gate value within float rounding of 0 may flip: allow 2 tokens per neuron
        assert np.abs(freq - layer.freq).max() <= 2 / n
    assert profile.mean_sparsity > 0.6  # what makes it a stand-in for PowerInfer's models


def test_cli_profile_json(capsys):
    assert main(["profile", "relu-demo", "--json", "--tokens", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target_sparsity"] is None  # ReLU: no threshold to calibrate
    assert len(out["layers"]) == 6 and all(layer["threshold"] == 0.0 for layer in out["layers"])
    assert 0.6 < out["mean_sparsity"] < 1.0


def test_predictors_cost_under_one_percent_perplexity(relu_demo_predicted):
    sparse = load_model(relu_demo_predicted)  # picc sparsify --sparsity-mode predictor --tokens 4096
    windows = eval_windows(sparse.tokenizer, "ptb-valid", 4096, 256)
    result = evaluate(sparse.module, sparse.weights, windows, compare_dense=True)
    assert result.recall is not None and result.recall >= 0.98
    assert result.ffn_sparsity is not None and result.ffn_sparsity > 0.5
    assert result.ppl_increase is not None and result.ppl_increase <= 0.01
