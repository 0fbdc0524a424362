"""GGUF files of llama.cpp's ``deepseek2`` (DeepSeek V2, V3, GLM-4.7-Flash) and ``glm4moe``
(GLM-4.5) architectures, written here from tiny HF models as convert_hf_to_gguf.py writes them
(``write_gguf``), against transformers on the same model, or where llama.cpp computes otherwise,
against picc's HF import changed in that one respect. Tolerance: relative L2 <= 1e-4, as
tests/test_gguf_frontend.py (float32 on both sides, quantized files against the model of their
dequantized weights: only the order of sums differs; measured ~1e-6).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from hf_models import make_model, reference_logits
from runtime_cases import check_rounds_alike, compiled
from test_gguf_frontend import TOKENS, rel_l2, round_trip_hf_weights, write_gguf

from picc.errors import PiccError
from picc.frontend import load_model
from picc.frontend.gguf import _Meta
from picc.frontend.gguf_deepseek import _heads_transposed, deepseek_moe
from picc.frontend.gguf_file import GgufFile
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir import verify
from picc.ir.positional import yarn_mscale
from picc.ir.types import DType
from picc.ir.weights import Tensor
from runtime.pib import PibFile

Q = gguf.GGMLQuantizationType
ARCH = {"deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "glm4_moe_lite": "deepseek2", "glm4_moe": "glm4moe"}


def gguf_of(family, variant, tmp_path, qt=Q.F32, **kwargs):
    """The tiny (family, variant) HF model, its GGUF as the converter writes it (``write_gguf``'s
    ``kwargs``), and the HF model whose weights are the file's values (the reference's)."""
    hf_dir = tmp_path / "hf"
    make_model(family, variant, hf_dir)
    arch = ARCH[family]
    path = write_gguf(hf_dir, tmp_path / "m.gguf", arch=arch, quant_type=qt, **kwargs)
    if qt == Q.F32:
        return hf_dir, path, hf_dir
    cfg = json.loads((hf_dir / "config.json").read_text())
    split = arch == "deepseek2" and kwargs.get("latent", "split") == "split"
    latent_split = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"]) if split else None
    return hf_dir, path, round_trip_hf_weights(hf_dir, tmp_path / "hf_q", qt, latent_split)


def run(model) -> np.ndarray:
    return Interpreter(model.module, model.weights).run(TOKENS)


@pytest.mark.parametrize("family, variant, latent, qt, mtp", [
    # DeepSeek V2-Lite's layout (q straight from x, softmax greedy), V2's (q through a latent), V2's yarn
    ("deepseek_v2", "base", "split", Q.F32, 0), ("deepseek_v2", "q-latent", "kv_b", Q.Q8_0, 0),
    ("deepseek_v2", "yarn", "split", Q.F32, 0),
    # V3's: sigmoids plus the correction bias, the best two of four groups, renormalised, times 2.5;
    # both latent layouts; yarn with mscale_all_dim; q without a latent; ungrouped; unnormalised
    ("deepseek_v3", "base", "split", Q.F32, 0), ("deepseek_v3", "base", "kv_b", Q.F32, 0),
    ("deepseek_v3", "base", "split", Q.Q4_0, 0), ("deepseek_v3", "yarn", "kv_b", Q.Q4_1, 0),
    ("deepseek_v3", "q-direct", "split", Q.F32, 0), ("deepseek_v3", "ungrouped", "split", Q.Q8_0, 0),
    ("deepseek_v3", "unnormalised", "split", Q.F32, 0),
    # GLM-4.7-Flash's (values wider than keys), with an MTP block as its converter appends it
    ("glm4_moe_lite", "base", "split", Q.F32, 1), ("glm4_moe_lite", "base", "split", Q.Q4_1, 0),
    ("glm4_moe_lite", "all-sparse", "split", Q.F32, 0),
    # GLM-4.5's: biases on q, k, v, half of each head rotated, its MTP block (the config's one);
    # q and k normalised; groups; no biases, not renormalised
    ("glm4_moe", "base", "split", Q.F32, None), ("glm4_moe", "qk-norm", "split", Q.Q4_1, None),
    ("glm4_moe", "groups", "split", Q.F32, None), ("glm4_moe", "unbiased", "split", Q.Q8_0, None),
])
def test_deepseek2_and_glm4moe_ggufs_match_transformers(family, variant, latent, qt, mtp, tmp_path):
    hf_dir, path, reference = gguf_of(family, variant, tmp_path, qt, latent=latent, mtp=mtp)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model = load_model(path)
    verify(model.module)
    ops = list(model.module.ops())
    n_layers = cfg["num_hidden_layers"]
    assert model.module.attr("n_layers") == n_layers
    assert not any(name.startswith(f"l{n_layers}.") for name in model.weights)  # the MTP block is left out
    ropes = [op for op in ops if op.NAME == "rope"]
    if ARCH[family] == "deepseek2":  # llama.cpp's normal rope on the rotated features (q's, and the shared key's)
        assert {(op.style, op.rotary_dim) for op in ropes} == {("gptj", cfg["qk_rope_head_dim"])}
        assert {op.v_head_dim for op in ops if op.NAME == "attention"} == {cfg["v_head_dim"]}
        assert sum(op.NAME == "concat_heads" for op in ops) == n_layers
    else:  # neox halves over rope.dimension_count of the head's features
        assert {(op.style, op.rotary_dim) for op in ropes} == {("llama", cfg["head_dim"] // 2)}
        assert sum(op.NAME == "rms_norm" and op.group == cfg["head_dim"] for op in ops) == 2 * n_layers * (
            variant == "qk-norm")
    assert sum(op.NAME == "moe" for op in ops) == (2 if variant == "all-sparse" else 1)
    assert rel_l2(run(model), reference_logits(reference, TOKENS)) <= 1e-4


def with_ops(hf_dir, change) -> np.ndarray:
    """The logits of picc's import of the HF model ``hf_dir`` with each op passed through ``change``."""
    model = load_model(hf_dir)
    func = model.module.function()
    module = model.module.with_function(replace(func, ops=tuple(change(op) for op in func.ops)))
    return Interpreter(module, model.weights).run(TOKENS)


def test_v2s_groups_are_scored_by_their_two_best_experts_as_llama_cpp_scores_them(tmp_path):
    # DeepSeek V2's group_limited_greedy scores a group by its best expert in transformers;
    # llama.cpp's build_moe_ffn scores every grouped router by its two best (V3's rule), so the
    # file computes what picc's HF import computes with group_score top2 (the best 3 of the best
    # 2 of 4 groups, times 16), and not transformers' logits: the groups chosen differ.
    hf_dir, path, _ = gguf_of("deepseek_v2", "group-limited", tmp_path)
    model = load_model(path)
    moe = next(op for op in model.module.ops() if op.NAME == "moe")
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.group_score, moe.routed_scale, moe.norm_topk) == (
        "softmax", 4, 2, "top2", 16.0, False)
    got = run(model)
    assert rel_l2(got, with_ops(hf_dir, lambda op: replace(op, group_score="top2") if op.NAME == "moe" else op)) <= 1e-4
    assert rel_l2(got, reference_logits(hf_dir, TOKENS)) > 1e-2


def test_v3_without_rope_interleave_still_rotates_adjacent_pairs(tmp_path):
    # llama.cpp rotates every deepseek2 file's pairs (2i, 2i + 1) and the converter keeps the
    # checkpoint's rows: a V3 config with rope_interleave false (transformers: halves) runs as
    # picc's HF import with the gptj style.
    hf_dir, path, _ = gguf_of("deepseek_v3", "rotate-half", tmp_path)
    got = run(load_model(path))
    assert rel_l2(got, with_ops(hf_dir, lambda op: replace(op, style="gptj") if op.NAME == "rope" else op)) <= 1e-4
    assert rel_l2(got, reference_logits(hf_dir, TOKENS)) > 1e-2


def test_deepseek2_yarn_scales_as_llama_cpp(tmp_path):
    # V3's yarn (factor 4, mscale_all_dim 1, written as yarn_log_multiplier 0.1): the rope's factor
    # 1, the scores' get_mscale(4)^2 / sqrt(24), as transformers. Without the multiplier llama.cpp
    # multiplies the cosines and sines by get_mscale(4) too (transformers: only them), so the file
    # computes picc's HF import with that factor on every rope.
    hf_dir, path, _ = gguf_of("deepseek_v3", "yarn", tmp_path)
    model = load_model(path)
    mscale = yarn_mscale(4.0)
    assert {op.attention_factor for op in model.module.ops() if op.NAME == "rope"} == {1.0}
    assert [op.scale for op in model.module.ops() if op.NAME == "attention"] == [
        pytest.approx(mscale * mscale / math.sqrt(24), rel=1e-6)] * 2
    bare = load_model(write_gguf(hf_dir, tmp_path / "bare.gguf", arch="deepseek2", drop_keys=("log_mul",)))
    assert [op.scale for op in bare.module.ops() if op.NAME == "attention"] == [
        pytest.approx(mscale * mscale / math.sqrt(24), rel=1e-6)] * 2
    assert [op.attention_factor for op in bare.module.ops() if op.NAME == "rope"] == [pytest.approx(mscale)] * 4
    with_rope_factor = with_ops(hf_dir, lambda op: replace(op, attention_factor=mscale) if op.NAME == "rope" else op)
    assert rel_l2(run(bare), with_rope_factor) <= 1e-4
    assert rel_l2(run(bare), reference_logits(hf_dir, TOKENS)) > 1e-3


def test_quantized_attn_k_b_is_transposed_back_exactly(tmp_path):
    # attn_k_b holds each head's k_nope matrix transposed, its rows (nope = 32 wide) Q8_0 blocks:
    # picc decodes them to F32 to transpose them back (said in a note) and computes the model of
    # the file's values. An F16 one is transposed as it is, element for element.
    hf_dir, path, reference = gguf_of("deepseek_v3", "wide-nope", tmp_path, Q.Q8_0)
    model = load_model(path)
    assert model.notes == ("2 attn_k_b tensors decoded to F32 (each head's matrix transposed back: quantized "
                           "blocks cannot be)",)
    assert model.weights["l0.attn.k"].dtype == DType.F32 and model.weights["l0.attn.v"].dtype == DType.Q8_0
    assert rel_l2(run(model), reference_logits(reference, TOKENS)) <= 1e-4
    values = np.random.default_rng(0).normal(size=(2 * 32, 16)).astype(np.float16)  # 2 heads, latent 32, nope 16
    k = _heads_transposed(Tensor(DType.F16, values.shape, values), 2)
    assert k.dtype == DType.F16 and k.shape == (2 * 16, 32)
    np.testing.assert_array_equal(k.data, values.reshape(2, 32, 16).transpose(0, 2, 1).reshape(32, 32))


def metadata_only(tmp_path, arch, **keys):
    """A GGUF of metadata ``keys`` (``arch.`` prefixed) alone, as ``_Meta`` reads it."""
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for name, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{name}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{name}", value)
        else:
            w.add_uint32(f"{arch}.{name}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return _Meta(GgufFile(path), path)


MOE_KEYS = dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=32, expert_shared_count=1,
                leading_dense_block_count=1)


@pytest.mark.parametrize("arch, n_layers, vocab, keys, expect", [
    # no gating key: V2's softmax for deepseek2 files, sigmoids for glm4moe and for deepseek2 files
    # of 47 or 48 layers and 154880 tokens (GLM-4.7-Flash's); no scale (or 0): 1; not renormalised
    ("deepseek2", 2, 256, {}, ("softmax", 1, 1, 1.0, False)),
    ("deepseek2", 47, 154880, {}, ("sigmoid", 1, 1, 1.0, False)),
    ("deepseek2", 48, 154880, dict(expert_weights_scale=0.0), ("sigmoid", 1, 1, 1.0, False)),
    ("deepseek2", 47, 256, {}, ("softmax", 1, 1, 1.0, False)),
    ("glm4moe", 2, 256, {}, ("sigmoid", 1, 1, 1.0, False)),
    # the file's gating, groups (whatever the gating: top2), scale and norm
    ("deepseek2", 2, 256, dict(expert_gating_func=2, expert_group_count=4, expert_group_used_count=2,
                               expert_weights_scale=2.5, expert_weights_norm=True), ("sigmoid", 4, 2, 2.5, True)),
    ("deepseek2", 2, 256, dict(expert_gating_func=1, expert_group_count=1, expert_group_used_count=1),
     ("softmax", 1, 1, 1.0, False)),
])
def test_routing_keys_are_read_as_llama_cpp_reads_them(tmp_path, arch, n_layers, vocab, keys, expect):
    meta = metadata_only(tmp_path, arch, **MOE_KEYS, **keys)
    moe = deepseek_moe(meta, lambda k: f"{arch}.{k}", arch, n_layers, 160, vocab, meta.path)
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.routed_scale, moe.norm_topk) == expect
    assert moe.group_score == ("top2" if moe.n_group > 1 else "max")
    assert moe.layers == tuple(i >= 1 for i in range(n_layers)) and (moe.n_ff, moe.n_shared) == (32, 1)


@pytest.mark.parametrize("family, kwargs, message", [
    ("deepseek_v3", dict(keys=dict(expert_gating_func=SimpleNamespace(value=3))),  # (add_expert_gating_func's enum)
     "deepseek2.expert_gating_func 3 is not supported (1: softmax, 2: sigmoid)"),
    ("deepseek_v3", dict(keys=dict(expert_group_used_count=4)),
     "deepseek2.expert_group_count 4 and deepseek2.expert_group_used_count 4 do not fit 8 experts, 2 a token"),
    ("deepseek_v3", dict(keys=dict(expert_shared_count=2)),
     "tensor 'blk.1.ffn_gate_shexp.weight' must hold 64 neurons (expert_shared_count 2 x expert_feed_forward_length "
     "32), got 32"),
    ("deepseek_v3", dict(drop_keys=("key_length_mla", "value_length_mla")),
     "deepseek2 tensor 'blk.0.attn_q_b.weight' must be [160, 48] (numpy order), got [96, 48]"),
    ("deepseek_v3", dict(keys=dict(rope_scaling_yarn_log_mul=-1.0)),
     "deepseek2.rope.scaling.yarn_log_multiplier must be a number >= 0, got -1.0"),
    ("deepseek_v3", dict(keys=dict(nextn_predict_layers=2)), "deepseek2.nextn_predict_layers must be 0 to block_count - 1"),
    ("deepseek_v2", dict(extra={"blk.0.attn_kv_a_mqa.bias": (np.zeros(40), Q.F32)}),
     "tensor 'blk.0.attn_kv_a_mqa.bias' is not part of a llama model picc knows"),
    ("glm4_moe", dict(extra={"blk.1.attn_q_norm.weight": (np.ones(16), Q.F32)}),
     "glm4moe files must have attn_q_norm and attn_k_norm in every layer or in none"),
])
def test_files_llama_cpp_would_not_run_are_refused_in_one_line(family, kwargs, message, tmp_path):
    hf_dir = tmp_path / "hf"
    make_model(family, "base", hf_dir)
    path = write_gguf(hf_dir, tmp_path / "bad.gguf", arch=ARCH[family], **kwargs)
    with pytest.raises(PiccError) as e:
        load_model(path)
    assert message in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_glm4moe_layer_without_its_correction_bias_is_refused(tmp_path):
    hf_dir = tmp_path / "hf"
    make_model("glm4_moe", "base", hf_dir)

    def without(sd):
        return {k: v for k, v in sd.items() if not k.endswith("layers.1.mlp.gate.e_score_correction_bias")}

    from hf_edit import edited_copy

    path = write_gguf(edited_copy(hf_dir, tmp_path / "edited", tensors=without), tmp_path / "bad.gguf", arch="glm4moe")
    with pytest.raises(PiccError, match=r"glm4moe tensor 'blk\.1\.exp_probs_b\.bias' is missing \(llama\.cpp needs it "
                                        r"in every mixture layer\)$"):
        load_model(path)


def test_a_deepseek2_gguf_compiles_as_it_computes(tmp_path):
    # DeepSeek V2's group-limited routing as llama.cpp runs it (softmax, groups by their two best:
    # a kernel variant the HF import never makes) and its latent attention, from a Q8_0 file of the
    # newer layout, compiled dense (no tokenizer to profile with), float32 caches: the step and the
    # chunk programs against the interpreter. Its Q8_0 LM head dots x rounded to int8, which the
    # interpreter rounds alike but a sum's order can move across a step: check_rounds_alike's
    # bounds (tests/runtime_cases.py; one straddle measured, 1.9e-3 at position 7 of TOKENS).
    _, path, _ = gguf_of("deepseek_v2", "group-limited", tmp_path, Q.Q8_0)
    pib_path, pib = compiled(load_model(path), tmp_path, "deepseek2", kv_cache="f32", dense=True)
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    assert [op.kernel for op in moes] == ["picc_moe_swiglu_f32_q8_0_q8_0_q8_0_shared_gtop2_scaled"]
    with PibFile(pib_path) as f:
        assert "picc_gemv_q8_0_r8_xi8(" in f.text("cpu/ir")
    check_rounds_alike(pib_path, pib)
