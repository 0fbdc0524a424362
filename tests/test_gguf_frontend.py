"""The GGUF frontend on small files written here, from random HF LLaMAs, Qwen2s and Qwen3s, the way
llama.cpp does.

llama.cpp's converter permutes the rows of a LLaMA's q/k per head for its interleaved rope (not a
Qwen's, which it runs with the half-split rope) and stores tensors with reversed dims; importing
such a file must reproduce transformers' logits for the original HF model. Tolerance: relative L2 <= 1e-4 (float32 on both sides, only the summation
order differs).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
from hf_edit import edited_copy
from hf_models import make_model, reference_logits

from picc import quant
from picc.errors import PiccError
from picc.frontend import load_model
from picc.interpreter import Interpreter
from picc.ir import verify
from picc.ir.types import DType

Q = gguf.GGMLQuantizationType
TOKENS = [5, 77, 3, 200, 13, 64, 9, 151, 42, 7, 250, 1]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rope rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, out, *, quant_type=Q.F32, arch="llama", tie=False, extra=None,
               drop_keys=(), keys=None, shared_type=None, latent="split", mtp=None):
    """Write the HF model in ``hf_dir`` (a llama, or a qwen2 / qwen3 / phi3 / gemma2 / gemma3 with
    ``arch`` saying so) as a GGUF file, matrices in ``quant_type`` (those whose rows are not whole
    blocks in F16, llama-quantize's fallback); ``keys``: more metadata, by the GGUFWriter method
    that adds each (``rope_scaling_yarn_beta_fast`` for ``add_...``); ``shared_type``: Qwen2-MoE's
    shared expert's matrices' type, where not ``quant_type``. ``deepseek2``: ``latent`` "split"
    (the converter's ``attn_k_b`` and ``attn_v_b``) or "kv_b" (older files' ``attn_kv_b``).
    ``mtp``: that many multi-token-prediction blocks appended (random, as the converter appends
    GLM's), with ``nextn_predict_layers``; by default the config's ``num_nextn_predict_layers``
    for glm4moe (Glm4MoeModel writes them), none for the others."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if mtp is None:
        mtp = cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0
    w = gguf.GGUFWriter(str(out), arch)
    meta = {
        "block_count": (w.add_block_count, cfg["num_hidden_layers"] + mtp),
        "embedding_length": (w.add_embedding_length, cfg["hidden_size"]),
        "feed_forward_length": (w.add_feed_forward_length, cfg["intermediate_size"]),
        "head_count": (w.add_head_count, h),
        "head_count_kv": (w.add_head_count_kv, kv),
        "rms_eps": (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
        "rope_freq_base": (w.add_rope_freq_base, cfg["rope_parameters"].get(
            "rope_theta", cfg["rope_parameters"].get("full_attention", {}).get("rope_theta"))),
    }
    # Gemma: the window, and norms stored as 1 + w (below), as convert_hf_to_gguf.py's Gemma2Model
    # and Gemma3Model write them; Gemma2Model writes both soft caps too
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        meta["sliding_window"] = (w.add_sliding_window, cfg["sliding_window"])
    if "num_experts_per_tok" in cfg or "moe_k" in cfg:  # convert_hf_to_gguf.py's Qwen3MoeModel, LlamaModel's Mixtral
        experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("moe_num_experts", cfg.get("n_routed_experts"))))
        meta["expert_count"] = (w.add_expert_count, experts)
        meta["expert_used_count"] = (w.add_expert_used_count, cfg.get("num_experts_per_tok", cfg.get("moe_k")))
        if arch in ("qwen3moe", "qwen2moe"):
            meta["expert_feed_forward_length"] = (w.add_expert_feed_forward_length, cfg["moe_intermediate_size"])
        if arch == "qwen2moe":  # convert_hf_to_gguf.py's Qwen2MoeModel
            meta["shared_width"] = (w.add_expert_shared_feed_forward_length, cfg["shared_expert_intermediate_size"])
        if arch == "ernie4_5-moe":  # convert_hf_to_gguf.py's Ernie4_5MoeModel
            meta["expert_feed_forward_length"] = (w.add_expert_feed_forward_length, cfg["moe_intermediate_size"])
            meta["lead"] = (w.add_leading_dense_block_count, cfg["moe_layer_start_index"])
            meta["step"] = (w.add_interleave_moe_layer_step, cfg["moe_layer_interval"])
            meta["shared_count"] = (w.add_expert_shared_count, cfg["moe_num_shared_experts"])
        if arch == "gpt-oss":  # convert_hf_to_gguf.py's GptOssModel
            meta["expert_feed_forward_length"] = (w.add_expert_feed_forward_length, cfg["intermediate_size"])
            meta["sliding_window"] = (w.add_sliding_window, cfg["sliding_window"])
    if arch in ("granite", "granitemoe"):  # convert_hf_to_gguf.py's GraniteModel (and GraniteMoeModel)
        meta["embedding_scale"] = (w.add_embedding_scale, cfg["embedding_multiplier"])
        meta["residual_scale"] = (w.add_residual_scale, cfg["residual_multiplier"])
        meta["attention_scale"] = (w.add_attention_scale, cfg["attention_multiplier"])
        meta["logit_scale"] = (w.add_logit_scale, cfg["logits_scaling"])
    if arch == "gemma2":
        meta["attn_softcap"] = (w.add_attn_logit_softcapping, cfg["attn_logit_softcapping"])
        meta["final_softcap"] = (w.add_final_logit_softcapping, cfg["final_logit_softcapping"])
    if cfg.get("head_dim"):
        meta["key_length"] = (w.add_key_length, cfg["head_dim"])
    partial = cfg["rope_parameters"].get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        meta["rope_dims"] = (w.add_rope_dimension_count, int(cfg["hidden_size"] // h * partial))
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf.py's Phi3MiniModel writes it
        original = cfg.get("original_max_position_embeddings", rope["original_max_position_embeddings"])
        scale = cfg["max_position_embeddings"] / original
        meta["context_length"] = (w.add_context_length, cfg["max_position_embeddings"])
        meta["original_context"] = (w.add_rope_scaling_orig_ctx_len, original)
        meta["attn_factor"] = (w.add_rope_scaling_attn_factors, math.sqrt(1 + math.log(scale) / math.log(original)))
        extra = {"rope_factors_long.weight": (np.array(rope["long_factor"]), Q.F32),
                 "rope_factors_short.weight": (np.array(rope["short_factor"]), Q.F32), **(extra or {})}
    if rope.get("rope_type") == "yarn":  # as convert_hf_to_gguf.py's TextModel writes it
        meta["scaling_type"] = (w.add_rope_scaling_type, gguf.RopeScalingType.YARN)
        meta["factor"] = (w.add_rope_scaling_factor, rope["factor"])
        meta["original_context"] = (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"])
        for beta in ("beta_fast", "beta_slow"):
            if beta in rope:
                meta[beta] = (getattr(w, f"add_rope_scaling_yarn_{beta}"), rope[beta])
    if arch in ("deepseek2", "glm4moe"):
        meta.update(deepseek_gguf_meta(w, cfg, arch, latent))
    if mtp:
        meta["mtp"] = (w.add_nextn_predict_layers, mtp)
    for name, value in (keys or {}).items():  # in place of the entry of that name
        meta[name] = (getattr(w, f"add_{name}"), value)
    permute = llama_cpp_permute if arch in ("llama", "granite", "granitemoe") else lambda x, heads: x
    for key, (add, value) in meta.items():
        if key not in drop_keys:
            add(value)

    written = []

    def tensor(name, x, qt=Q.F32):
        x = np.ascontiguousarray(x, dtype=np.float32)
        written.append((name, x.shape))
        if gemma and name.endswith("norm.weight"):
            x = x + 1
        if qt != Q.F32 and x.shape[-1] % 32:  # rows that are not whole blocks (llama-quantize's fallback)
            qt = Q.F16
        if qt == Q.F32 or x.ndim == 1:
            w.add_tensor(name, x)
        elif qt == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:  # a matrix's rows, or each of a mixture's [experts, rows, cols]
            raw = quant.quantize(x.reshape(-1, x.shape[-1]), qt.name.lower()).reshape(*x.shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)

    tensor("token_embd.weight", sd["model.embed_tokens.weight"], quant_type)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if p + "input_layernorm.weight" in sd:  # OLMo 2 has none
            tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        if arch == "phi3":  # fused as in the checkpoint
            tensor(f"blk.{i}.attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"], quant_type)
            tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"], quant_type)
        elif arch == "deepseek2":
            latent_attention_tensors(tensor, sd, p, i, cfg, latent, quant_type)
        else:
            tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], h), quant_type)
            tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], kv), quant_type)
            tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], quant_type)
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            if p + f"self_attn.{theirs}.bias" in sd:
                tensor(f"blk.{i}.{ours}.bias", sd[p + f"self_attn.{theirs}.bias"])
        for ours in ("q_norm", "k_norm"):
            if p + f"self_attn.{ours}.weight" in sd:
                tensor(f"blk.{i}.attn_{ours}.weight", sd[p + f"self_attn.{ours}.weight"])
        tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], quant_type)
        if arch == "gpt-oss":  # the MLP's input norm under another name; sinks; the experts and their biases
            tensor(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
            tensor(f"blk.{i}.attn_sinks.weight", sd[p + "self_attn.sinks"])
            tensor(f"blk.{i}.attn_output.bias", sd[p + "self_attn.o_proj.bias"])
            tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.router.weight"])
            tensor(f"blk.{i}.ffn_gate_inp.bias", sd[p + "mlp.router.bias"])
            both, both_bias = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1), sd[p + "mlp.experts.gate_up_proj_bias"]
            tensor(f"blk.{i}.ffn_gate_exps.weight", both[:, 0::2], quant_type)
            tensor(f"blk.{i}.ffn_up_exps.weight", both[:, 1::2], quant_type)
            tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1), quant_type)
            tensor(f"blk.{i}.ffn_gate_exps.bias", both_bias[:, 0::2])
            tensor(f"blk.{i}.ffn_up_exps.bias", both_bias[:, 1::2])
            tensor(f"blk.{i}.ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"])
            continue
        if gemma or arch == "olmo2":  # the outputs' norms; Gemma's MLP's input norm too
            tensor(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
            if gemma:
                tensor(f"blk.{i}.ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"])
            tensor(f"blk.{i}.post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])
        elif arch == "glm4moe":  # the FFN's input norm under another name (Glm4MoeModel's tensor map)
            tensor(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        else:
            tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            if p + f"mlp.{theirs}.weight" in sd:
                tensor(f"blk.{i}.ffn_{ours}.weight", sd[p + f"mlp.{theirs}.weight"], quant_type)
            moe = next((m for m in ("mlp.", "block_sparse_moe.") if p + m + "gate.weight" in sd), None)
            if moe is not None:  # a mixture: each expert's matrices as one [experts, rows, cols]
                count = meta["expert_count"][1]
                hf = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[theirs] if moe == "block_sparse_moe." else theirs
                stacked = np.stack([sd[f"{p}{moe}experts.{e}.{hf}.weight"] for e in range(count)])
                tensor(f"blk.{i}.ffn_{ours}_exps.weight", stacked, quant_type)
        for moe in ("mlp.", "block_sparse_moe."):
            if p + moe + "gate.weight" in sd:
                tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + moe + "gate.weight"])
        for bias in ("mlp.moe_statics.e_score_correction_bias", "mlp.gate.e_score_correction_bias"):
            if p + bias in sd:  # ERNIE 4.5's, DeepSeek V3's, GLM's choice bias
                tensor(f"blk.{i}.exp_probs_b.bias", sd[p + bias])
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            if p + f"mlp.shared_experts.{theirs}.weight" in sd:  # ERNIE 4.5's, DeepSeek's, GLM's shared experts
                tensor(f"blk.{i}.ffn_{ours}_shexp.weight", sd[p + f"mlp.shared_experts.{theirs}.weight"], quant_type)
        if p + "mlp.shared_expert_gate.weight" in sd:  # Qwen2-MoE's shared expert and its gate ([hidden])
            tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"].reshape(-1))
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                tensor(f"blk.{i}.ffn_{ours}_shexp.weight", sd[p + f"mlp.shared_expert.{theirs}.weight"],
                       shared_type or quant_type)
        if p + "block_sparse_moe.input_linear.weight" in sd:  # GraniteMoeModel splits each expert's gate, up
            both = sd[p + "block_sparse_moe.input_linear.weight"]
            half = both.shape[1] // 2
            tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + "block_sparse_moe.router.layer.weight"])
            tensor(f"blk.{i}.ffn_gate_exps.weight", both[:, :half], quant_type)
            tensor(f"blk.{i}.ffn_up_exps.weight", both[:, half:], quant_type)
            tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "block_sparse_moe.output_linear.weight"], quant_type)
    if mtp:  # random blocks of the last layer's tensors, and the MTP head's own
        rng, n, hidden = np.random.default_rng(7), cfg["num_hidden_layers"], cfg["hidden_size"]
        last = [(name.split(".", 2)[2], shape) for name, shape in written if name.startswith(f"blk.{n - 1}.")]
        for j in range(n, n + mtp):
            for name, shape in last + [("nextn.eh_proj.weight", (hidden, 2 * hidden)), ("nextn.enorm.weight", (hidden,)),
                                       ("nextn.hnorm.weight", (hidden,)), ("nextn.shared_head_norm.weight", (hidden,))]:
                tensor(f"blk.{j}.{name}", rng.normal(0, 0.5, shape), quant_type)
    tensor("output_norm.weight", sd["model.norm.weight"])
    if not tie:
        tensor("output.weight", sd["lm_head.weight"], quant_type)
    for name, (x, qt) in (extra or {}).items():
        tensor(name, x, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def deepseek_gguf_meta(w, cfg, arch, latent):
    """The keys convert_hf_to_gguf.py's DeepseekV2Model (and Glm4MoeLiteModel, a DeepseekV2Model),
    or Glm4MoeModel, writes beside the generic ones, by the names write_gguf's ``meta`` keeps.
    The expert gating function as the released configs' ``scoring_func`` has it (transformers'
    configs do not keep that field): V2's softmax, V3's and GLM's sigmoids."""
    heads, rope = cfg["num_attention_heads"], cfg["rope_parameters"]
    meta = {"expert_ff": (w.add_expert_feed_forward_length, cfg["moe_intermediate_size"]),
            "shared_count": (w.add_expert_shared_count, cfg.get("n_shared_experts", 0)),
            "scale": (w.add_expert_weights_scale, cfg["routed_scaling_factor"]),
            "gating": (w.add_expert_gating_func, gguf.ExpertGatingFuncType.SOFTMAX if cfg["model_type"] == "deepseek_v2"
                       else gguf.ExpertGatingFuncType.SIGMOID),
            "context_length": (w.add_context_length, cfg["max_position_embeddings"])}
    if cfg.get("norm_topk_prob") or arch == "glm4moe":  # Glm4MoeModel writes it either way, DeepseekV2Model if true
        meta["norm"] = (w.add_expert_weights_norm, cfg["norm_topk_prob"])
    if cfg.get("n_group") is not None:  # TextModel's, from the config whatever its topk_method
        meta["groups"] = (w.add_expert_group_count, cfg["n_group"])
        meta["groups_used"] = (w.add_expert_group_used_count, cfg["topk_group"])
    if "mlp_layer_types" in cfg:  # GLM-4.7-Flash: its leading dense layers (first_k_dense_replace as released)
        lead = next((i for i, t in enumerate(cfg["mlp_layer_types"]) if t != "dense"), len(cfg["mlp_layer_types"]))
    else:
        lead = cfg.get("first_k_dense_replace", 0)
    meta["lead"] = (w.add_leading_dense_block_count, lead)
    if arch == "glm4moe":
        meta["key_length"] = (w.add_key_length, cfg["head_dim"])
        meta["rope_dims"] = (w.add_rope_dimension_count, int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
        return meta
    qk, v, rank = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    meta["head_count_kv"] = (w.add_head_count_kv, 1 if latent == "split" else heads)
    meta["kv_rank"] = (w.add_kv_lora_rank, rank)
    if cfg.get("q_lora_rank") is not None:
        meta["q_rank"] = (w.add_q_lora_rank, cfg["q_lora_rank"])
    if latent == "split":  # the cache's widths, then each head's
        meta["key_length"] = (w.add_key_length, rank + cfg["qk_rope_head_dim"])
        meta["value_length"] = (w.add_value_length, rank)
        meta["key_length_mla"] = (w.add_key_length_mla, qk)
        meta["value_length_mla"] = (w.add_value_length_mla, v)
    else:  # before the split: each head's widths under the plain keys
        meta["key_length"] = (w.add_key_length, qk)
        meta["value_length"] = (w.add_value_length, v)
    meta["rope_dims"] = (w.add_rope_dimension_count, cfg["qk_rope_head_dim"])
    if rope.get("mscale_all_dim") is not None:  # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: 0.1 mscale_all_dim
        meta["log_mul"] = (w.add_rope_scaling_yarn_log_mul, 0.1 * rope["mscale_all_dim"])
    return meta


def latent_attention_tensors(tensor, sd, p, i, cfg, latent, qt):
    """A DeepSeek layer's attention as DeepseekV2Model writes it: q (or q_a, its norm, q_b), the
    latent with the shared rotated key (``attn_kv_a_mqa``), its norm, and kv_b_proj whole
    (``latent`` "kv_b") or split per head into k_b, each head's k_nope rows transposed
    ([heads, latent, nope]), and v_b ([heads, v, latent])."""
    a = p + "self_attn."
    if a + "q_proj.weight" in sd:
        tensor(f"blk.{i}.attn_q.weight", sd[a + "q_proj.weight"], qt)
    else:
        tensor(f"blk.{i}.attn_q_a.weight", sd[a + "q_a_proj.weight"], qt)
        tensor(f"blk.{i}.attn_q_a_norm.weight", sd[a + "q_a_layernorm.weight"])
        tensor(f"blk.{i}.attn_q_b.weight", sd[a + "q_b_proj.weight"], qt)
    tensor(f"blk.{i}.attn_kv_a_mqa.weight", sd[a + "kv_a_proj_with_mqa.weight"], qt)
    tensor(f"blk.{i}.attn_kv_a_norm.weight", sd[a + "kv_a_layernorm.weight"])
    kv_b = sd[a + "kv_b_proj.weight"]
    if latent == "kv_b":
        tensor(f"blk.{i}.attn_kv_b.weight", kv_b, qt)
        return
    nope = cfg["qk_nope_head_dim"]
    per_head = kv_b.reshape(cfg["num_attention_heads"], nope + cfg["v_head_dim"], -1)
    tensor(f"blk.{i}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1), qt)
    tensor(f"blk.{i}.attn_v_b.weight", per_head[:, nope:], qt)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gqa"
    make_model("llama", "gqa", path)
    return path, reference_logits(path, TOKENS)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_f32_gguf_matches_transformers_on_the_original_model(hf_llama, tmp_path):
    hf_dir, want = hf_llama
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf"))
    verify(model.module)
    assert model.tokenizer is None  # no tokenizer metadata was written
    rope = next(op for op in model.module.ops() if op.NAME == "rope")
    assert rope.style == "gptj"
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, want) <= 1e-4


def round_trip_hf_weights(hf_dir, out_dir, qt, latent_split=None):
    """A copy of the HF model whose matrices are what ``qt`` stores: dequantize(quantize(w)), in
    F16 where a row is not whole blocks (write_gguf's fallback).

    Quantizing rows in blocks commutes with llama.cpp's row permutation, so this is exactly the
    model the GGUF file holds, and transformers' logits for it are the reference. ``latent_split``
    (heads, nope): a DeepSeek's kv_b_proj stored as write_gguf's ``attn_k_b`` and ``attn_v_b``, its
    k rows transposed head by head (quantized along nope), its v rows as they are.
    """
    import shutil

    from safetensors.numpy import load_file, save_file

    def stored(w):
        kind = "f16" if w.shape[-1] % 32 else qt.name.lower()
        return quant.dequantize(quant.quantize(w.reshape(-1, w.shape[-1]), kind), kind, w.shape)

    shutil.copytree(hf_dir, out_dir)
    sd = load_file(str(hf_dir / "model.safetensors"))
    for key, w in sd.items():
        transposed = key.endswith(("experts.gate_up_proj", "experts.down_proj"))  # gpt-oss's experts: x @ W
        w = w.transpose(0, 2, 1) if transposed else w
        if w.ndim == 3:  # Granite-MoE's and gpt-oss's experts, each matrix's rows
            rows = stored(w)
            sd[key] = np.ascontiguousarray(rows.transpose(0, 2, 1)) if transposed else rows
        routers = ("mlp.gate.weight", "moe.gate.weight", "router.layer.weight", "mlp.router.weight",
                   "shared_expert_gate.weight", "e_score_correction_bias")  # f32
        if latent_split is not None and key.endswith("kv_b_proj.weight"):
            heads, nope = latent_split
            per_head = w.reshape(heads, -1, w.shape[1]).copy()
            per_head[:, :nope] = stored(per_head[:, :nope].transpose(0, 2, 1)).transpose(0, 2, 1)
            per_head[:, nope:] = stored(per_head[:, nope:])
            sd[key] = per_head.reshape(w.shape)
        elif w.ndim == 2 and not key.endswith(routers + ("_bias",)):  # (gpt-oss's experts' biases: f32)
            sd[key] = stored(w)
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("qt, dtype", [(Q.F16, DType.F16), (Q.Q8_0, DType.Q8_0), (Q.Q4_0, DType.Q4_0),
                                       (Q.Q4_1, DType.Q4_1), (Q.MXFP4, DType.MXFP4)])
def test_quantized_tensors_stay_quantized_and_compute_exactly(hf_llama, tmp_path, qt, dtype):
    hf_dir, _ = hf_llama
    path = write_gguf(hf_dir, tmp_path / "q.gguf", quant_type=qt)
    model = load_model(path)
    types = model.module.weight_types()
    assert types["l0.ffn.up"].dtype == dtype and types["token_embd"].dtype == dtype
    assert types["l0.attn_norm"].dtype == DType.F32
    # The store keeps the file's bytes; its float view is the exact dequantization of them.
    reader = gguf.GGUFReader(str(path))
    raw = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    exact = gguf.quants.dequantize(raw.data, raw.tensor_type)
    np.testing.assert_array_equal(model.weights.f32("l1.ffn.down"), exact.reshape(types["l1.ffn.down"].shape))
    # Same float32 tolerance as the F32 file: the reference runs on the dequantized weights.
    want = reference_logits(round_trip_hf_weights(hf_dir, tmp_path / "hf_q", qt), TOKENS)
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, want) <= 1e-4


@pytest.mark.parametrize("family, variant, qt, drop", [
    ("qwen2", "base", Q.F32, ()), ("qwen3", "head-dim", Q.F32, ()), ("qwen3", "head-dim", Q.Q4_1, ()),
    ("phi3", "partial-rope", Q.F32, ()), ("phi3", "partial-rope", Q.Q8_0, ()),
    ("phi3", "longrope-partial", Q.F32, ()), ("phi3", "longrope", Q.Q8_0, ("attn_factor",)),
    ("gemma2", "six-layers", Q.F32, ()), ("gemma2", "six-layers", Q.Q4_1, ()),
    ("granite", "norm-eps", Q.F32, ()), ("granite", "base", Q.Q4_1, ()),
    ("olmo2", "norm-eps", Q.F32, ()), ("olmo2", "base", Q.Q4_1, ()),
    ("qwen3_moe", "base", Q.F32, ()), ("qwen3_moe", "three-of-eight", Q.Q4_1, ()),
    ("gpt_oss", "wide-clamp", Q.F32, ()), ("gpt_oss", "gguf-yarn", Q.Q4_0, ()),
    ("qwen2_moe", "base", Q.F32, ()), ("qwen2_moe", "wide-shared", Q.Q4_1, ()),
    ("ernie4_5", "base", Q.Q4_0, ()), ("ernie4_5_moe", "base", Q.F32, ()), ("ernie4_5_moe", "four-of-eight", Q.Q4_1, ()),
    ("mixtral", "base", Q.F32, ()), ("mixtral", "three-of-eight", Q.Q4_0, ()),
    ("mixtral", "three-of-eight", Q.MXFP4, ()),  # gpt-oss's 4-bit experts, kept as stored
    ("granitemoe", "base", Q.F32, ()), ("granitemoe", "base", Q.Q4_1, ()),
    ("gemma3_text", "six-layers", Q.F32, ()), ("gemma3_text", "six-layers", Q.Q4_1, ())])
def test_qwen_phi3_gemma_and_granite_ggufs_match_transformers(family, variant, qt, drop, tmp_path):
    # Rows as transformers has them (no permutation) and the half-split rope; Qwen2's q, k, v
    # biases; Qwen3's norms of each head's q and k, with heads wider than hidden / heads; Phi-3's
    # fused qkv and gate-up matrices, split, and its rope over 12 of each head's 16 features;
    # Phi-3.5's and Phi-4-mini's longrope: the short factors, the attention factor from the file
    # (or, where it lacks one, from the context lengths). Gemma 3 as llama.cpp runs it: norms of
    # 1 + w as stored, every sixth layer global with the file's rope, the others sliding with base
    # 1e4, the embedding scaled by sqrt(hidden). Gemma 2 likewise, with one rope, no q and k norms,
    # every even layer sliding and the file's soft caps on the scores and the logits. Granite:
    # Llama's permuted rows and its four scales. OLMo 2: its norms after the attention and the MLP,
    # and over q's and k's whole projections. Qwen3-MoE: each layer's experts as three 3-D tensors,
    # their weights renormalised as llama.cpp does. gpt-oss: sinks, every even layer sliding, the
    # router's and the experts' biases, the clamped SwiGLU at llama.cpp's limit (7, the variant's).
    hf_dir = tmp_path / family
    make_model(family, variant, hf_dir)
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
            "gpt_oss": "gpt-oss", "ernie4_5_moe": "ernie4_5-moe"}.get(family, family)
    tie = family in ("gemma2", "gemma3_text", "granite", "granitemoe", "ernie4_5", "ernie4_5_moe")  # no output.weight: the head is the embedding
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", arch=arch, quant_type=qt, drop_keys=drop, tie=tie))
    if variant.startswith("longrope"):
        assert model.module.attr("max_position") == 256 and "longrope: a --ctx up to 128" in model.notes[-1]
        assert all(len(op.long_factors) == len(op.freq_factors) for op in model.module.ops() if op.NAME == "rope")
    verify(model.module)
    assert {op.style for op in model.module.ops() if op.NAME == "rope"} == {
        "gptj" if family in ("granite", "granitemoe", "mixtral", "ernie4_5", "ernie4_5_moe") else "llama"}
    grouped = {"qwen3": 4, "gemma3_text": 12}.get(family, 0)  # q and k of every layer (OLMo 2's: not by heads)
    if family in ("qwen3_moe", "mixtral", "granitemoe", "gpt_oss", "qwen2_moe", "ernie4_5_moe"):  # (Qwen3-MoE's head_dim is 16)
        grouped, moes = 0, [op for op in model.module.ops() if op.NAME == "moe"]
        renormalised = family != "qwen2_moe"  # llama.cpp's qwen2moe: not renormalised, as the model's config
        k = 3 if "three" in variant else 4 if "four" in variant else 2
        layers = 1 if family == "ernie4_5_moe" else 2  # ERNIE's layer 0 is dense
        assert [(op.n_experts, op.top_k, op.norm_topk) for op in moes] == [(8, k, renormalised)] * layers
    assert sum(op.NAME == "rms_norm" and op.group == 32 for op in model.module.ops()) == grouped
    reference = round_trip_hf_weights(hf_dir, tmp_path / "hf_q", qt) if qt != Q.F32 else hf_dir
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, reference_logits(reference, TOKENS)) <= 1e-4


def test_a_qwen2moe_shared_expert_of_another_type_is_quantized_again_as_the_experts(tmp_path):
    # A K-quant mix may store the shared expert in another type than the experts (here Q8_0 beside
    # Q4_1): its pieces are stacked with the experts, so they take the experts' type, from the
    # values the file holds, and the import says so. Its down matrix's columns, cut into
    # expert-wide pieces, become the stacked matrix's last rows.
    hf_dir = tmp_path / "hf"
    make_model("qwen2_moe", "base", hf_dir)
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", arch="qwen2moe", quant_type=Q.Q4_1, shared_type=Q.Q8_0))
    assert "6 shared-expert matrices quantized again" in model.notes[-1]
    from safetensors.numpy import load_file

    sd = load_file(str(hf_dir / "model.safetensors"))
    e_ff, hidden = 32, 64
    for hf, ours in (("up_proj", "up"), ("down_proj", "down")):
        stacked = model.weights[f"l0.moe.{ours}"]
        assert stacked.dtype == DType.Q4_1
        shared = sd[f"model.layers.0.mlp.shared_expert.{hf}.weight"]
        if ours == "down":  # [hidden, 64] -> two pieces of [hidden, 32], one after the other
            shared = shared.reshape(hidden, 2, e_ff).transpose(1, 0, 2).reshape(2 * hidden, e_ff)
        in_file = quant.dequantize(quant.quantize(shared, "q8_0"), "q8_0", shared.shape)
        want = quant.quantize(in_file, "q4_1")
        np.testing.assert_array_equal(np.asarray(stacked.data)[-shared.shape[0]:], want)


@pytest.fixture(scope="module")
def hf_gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gemma2"
    make_model("gemma2", "six-layers", path)
    return path


def test_a_gemma2_gguf_soft_caps_and_slides_as_llama_cpp_does(hf_gemma2, tmp_path):
    # The file's soft caps on every layer's scores and on the logits (the function's result), a
    # window on the even layers only (llama.cpp's set_swa_pattern(2)), one rope for all layers, q . k
    # scaled by 1 / sqrt(head_dim). Without the keys: llama.cpp's defaults, caps of 50 and 30 and a
    # window of 4096. A cap of 0 is refused, by name.
    module = load_model(write_gguf(hf_gemma2, tmp_path / "m.gguf", arch="gemma2", tie=True)).module
    attention = [op for op in module.ops() if op.NAME == "attention"]
    assert [op.window for op in attention] == [4, None] * 3
    assert {(op.softcap, op.scale) for op in attention} == {(10.0, 1 / math.sqrt(32))}
    func = module.function()
    capped = func.producer(func.ret)
    assert capped.NAME == "softcap" and capped.cap == 3.0 and func.producer(capped.x).NAME == "linear"
    assert {(op.theta, op.scaling) for op in module.ops() if op.NAME == "rope"} == {(10000.0, "none")}
    bare = load_model(write_gguf(hf_gemma2, tmp_path / "d.gguf", arch="gemma2", tie=True,
                                 drop_keys=("attn_softcap", "final_softcap", "sliding_window"))).module
    assert [(op.window, op.softcap) for op in bare.ops() if op.NAME == "attention"] == [(4096, 50.0), (None, 50.0)] * 3
    assert [op.cap for op in bare.ops() if op.NAME == "softcap"] == [30.0]
    zero = edited_copy(hf_gemma2, tmp_path / "zero", config={"final_logit_softcapping": 0.0})
    with pytest.raises(PiccError, match=r"z\.gguf: gemma2\.final_logit_softcapping must be a number > 0, got 0\.0$"):
        load_model(write_gguf(zero, tmp_path / "z.gguf", arch="gemma2", tie=True))


def test_the_46_layer_gemma2_scales_q_k_by_hidden_over_heads(hf_gemma2, tmp_path):
    # llama.cpp takes a 46-layer gemma2 file for Gemma 2 27B, whose query_pre_attn_scalar is
    # hidden / heads (4608 / 32 = 144), not head_dim (128), and scales q . k by that: here
    # 1 / sqrt(64 / 4), which transformers computes for the same model with query_pre_attn_scalar 16.
    def deeper(sd):  # layer i is layer i % 6 of the six-layer model
        layers = {k: v for k, v in sd.items() if k.startswith("model.layers.")}
        out = {k: v for k, v in sd.items() if k not in layers}
        for i in range(46):
            prefix = f"model.layers.{i % 6}."
            out |= {f"model.layers.{i}." + k.removeprefix(prefix): v for k, v in layers.items() if k.startswith(prefix)}
        return out

    hf_dir = edited_copy(hf_gemma2, tmp_path / "hf46", config={"num_hidden_layers": 46, "query_pre_attn_scalar": 16},
                         tensors=deeper)
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", arch="gemma2", tie=True))
    assert {op.scale for op in model.module.ops() if op.NAME == "attention"} == {0.25}
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, reference_logits(hf_dir, TOKENS)) <= 1e-4


def llama_cpp_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: a Llama 3 rope scaling as one
    factor per rotary pair (rope_freqs.weight), by which llama.cpp divides the pair's frequency."""
    import math

    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1)
        elif wavelen > low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, np.float32)


def test_llama3_rope_factors_are_read_as_the_scaling_they_come_from(tmp_path):
    # A Llama 3 GGUF carries its rope scaling as rope_freqs.weight (a factor per rotary pair):
    # picc recovers the llama3 scaling that makes them (here 1, two smoothed, five x 8), and the
    # logits are transformers' for the HF model the file was converted from. No factors (all 1):
    # no scaling.
    import json

    hf_dir = tmp_path / "hf"
    make_model("llama", "rope-llama3", hf_dir)
    factors = llama_cpp_rope_factors(json.loads((hf_dir / "config.json").read_text()))
    assert (factors == 1).sum() == 1 and ((factors > 1) & (factors < 8)).sum() == 2 and (factors == 8).sum() == 5
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", extra={"rope_freqs.weight": (factors, Q.F32)}))
    rope = next(op for op in model.module.ops() if op.NAME == "rope")
    assert (rope.scaling, rope.factor, rope.original_max_position) == ("llama3", 8.0, 64)
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, reference_logits(hf_dir, TOKENS)) <= 1e-4
    plain = load_model(write_gguf(hf_dir, tmp_path / "p.gguf", extra={"rope_freqs.weight": (np.ones(8), Q.F32)}))
    assert {op.scaling for op in plain.module.ops() if op.NAME == "rope"} == {"none"}


def llama_cpp_yarn_cos_sin(pos, n_dims, base, factor, n_ctx_orig, beta_fast=32.0, beta_slow=1.0, log_mul=0.0,
                           rope_attn_factor=1.0):
    """The cosines and sines llama.cpp rotates a yarn file's pairs by at positions ``pos``, in
    float64: llama_context's attention factor, ggml_rope_yarn_corr_dims and rope_yarn (ext_factor 1)."""
    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    def get_mscale(scale, mscale):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    low, high = max(0, math.floor(corr_dim(beta_fast))), min(n_dims - 1, math.ceil(corr_dim(beta_slow)))
    freq_scale = 1 / factor
    attn_factor = get_mscale(factor, 1.0) / get_mscale(factor, log_mul) if log_mul else get_mscale(factor, 1.0)
    attn_factor *= rope_attn_factor / (1 + 0.1 * math.log(factor))
    cos, sin = np.zeros((len(pos), n_dims // 2)), np.zeros((len(pos), n_dims // 2))
    for row, p in enumerate(pos):
        for i0 in range(0, n_dims, 2):
            theta_extrap = p * base ** (-i0 / n_dims)
            theta_interp = freq_scale * theta_extrap
            ramp_mix = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
            theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
            mscale = attn_factor * (1 + 0.1 * math.log(1 / freq_scale))
            cos[row, i0 // 2], sin[row, i0 // 2] = math.cos(theta) * mscale, math.sin(theta) * mscale
    return cos, sin


def test_a_yarn_gguf_rotates_as_llama_cpp_and_transformers(tmp_path):
    # A LLaMA GGUF with yarn (convert_hf_to_gguf.py's keys: factor 4, original context 32): llama.cpp
    # rotates as transformers does with truncate true and no mscale, so the logits are
    # transformers' for the HF model, and the rope's cosines and sines are llama.cpp's.
    from picc.interpreter import rope_cos_sin

    hf_dir = tmp_path / "hf"
    make_model("llama", "rope-yarn", hf_dir)
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf"))
    verify(model.module)
    rope = next(op for op in model.module.ops() if op.NAME == "rope")
    assert (rope.scaling, rope.factor, rope.original_max_position) == ("yarn", 4.0, 32)
    pos = np.arange(0, 300, 7)
    for got, want in zip(rope_cos_sin(rope, pos), llama_cpp_yarn_cos_sin(pos, 16, 10000.0, 4.0, 32), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, reference_logits(hf_dir, TOKENS)) <= 1e-4


@pytest.mark.parametrize("keys, drop, expect", [
    # the file's betas (ends 1.05 and 2.9 of 8 pairs: 1 and 3), log multiplier and attention factor
    (dict(rope_scaling_yarn_beta_fast=16.0, rope_scaling_yarn_beta_slow=2.0, rope_scaling_yarn_log_mul=0.5,
          rope_scaling_attn_factors=0.9), (),
     dict(beta_fast=16.0, beta_slow=2.0, log_mul=0.5, rope_attn_factor=0.9)),
    # gpt-oss's theta and factor, its original context from context_length, betas 32 and 1
    (dict(context_length=4096, rope_freq_base=150000.0, rope_scaling_factor=32.0), ("original_context", "factor"),
     dict(base=150000.0, factor=32.0, n_ctx_orig=4096)),
    # an original context of 1: the ramp's ends cross (-2 and 0), which llama.cpp makes a step
    (dict(rope_scaling_orig_ctx_len=1, rope_scaling_yarn_beta_slow=2.0), ("original_context",),
     dict(n_ctx_orig=1, beta_slow=2.0)),
])
def test_yarn_gguf_keys_are_read_as_llama_cpp_reads_them(tmp_path, keys, drop, expect):
    from picc.interpreter import rope_cos_sin

    hf_dir = tmp_path / "hf"
    make_model("llama", "rope-yarn", hf_dir)
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", keys=keys, drop_keys=drop))
    rope = next(op for op in model.module.ops() if op.NAME == "rope")
    pos = np.arange(0, 5000, 97)
    args = {"n_dims": 16, "base": 10000.0, "factor": 4.0, "n_ctx_orig": 32, **expect}
    for got, want in zip(rope_cos_sin(rope, pos), llama_cpp_yarn_cos_sin(pos, **args), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def k_quant_bytes(qt, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of K-quant ``qt`` (Q4_K or Q6_K: gguf cannot quantize them) with sane f16 scales."""
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    scale = (rng.uniform(0.002, 0.02, size=(len(raw), 1)) * rng.choice([-1, 1], size=(len(raw), 1))).astype(np.float16)
    if qt == Q.Q4_K:  # d, dmin first
        raw[:, 0:2] = np.abs(scale).view(np.uint8)
        raw[:, 2:4] = (np.abs(scale) / 2).astype(np.float16).view(np.uint8)
    else:  # Q6_K: d last
        raw[:, -2:] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def test_q4_k_blocks_become_q4_1_blocks_with_the_same_quants():
    # Each 32-element sub-block of Q4_K is d sc q - dmin m: a Q4_1 block whose scale and offset
    # are rounded to f16, so each weight moves by at most 2^-11 of (15 |d sc| + |dmin m|).
    from picc.frontend.gguf import converted

    raw = k_quant_bytes(Q.Q4_K, 8, 512)
    tensor = converted("Q4_K", raw, (8, 512), "t")
    assert tensor.dtype == DType.Q4_1 and tensor.shape == (8, 512)
    want = gguf.quants.dequantize(raw, Q.Q4_K).reshape(8, 512)
    blocks = raw.reshape(-1, 144)
    d, dmin = (blocks[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    bound = (2.0**-11 * (15 * np.abs(d * sc) + np.abs(dmin * mn)) + 2.0**-24).reshape(8, 16, 1)
    error = np.abs(tensor.to_f32() - want).reshape(8, 16, 32)
    assert np.all(error <= bound) and error.max() > 0  # the f16 rounding is there, and bounded


@pytest.mark.parametrize("type_name, target", [("Q6_K", DType.Q8_0), ("Q5_0", DType.Q8_0), ("Q5_1", DType.Q8_0),
                                               ("Q3_K", DType.Q4_1), ("Q2_K", DType.Q4_1)])
def test_other_quants_are_decoded_and_quantized_again(type_name, target):
    # Decoded by the gguf package, quantized as picc quantizes (ggml's Q8_0 / Q4_1): each weight
    # within half a step of its block's new grid, plus the f16 rounding of the block's scale.
    from picc.frontend.gguf import converted

    qt = getattr(Q, type_name)
    values = np.random.default_rng(1).normal(0, 0.05, size=(4, 512)).astype(np.float32)
    raw = k_quant_bytes(qt, 4, 512) if qt == Q.Q6_K else np.zeros(0)
    if qt != Q.Q6_K:  # K quants gguf can decode but not encode: random blocks; the others: encoded
        raw = (gguf.quants.quantize(values, qt) if type_name in ("Q5_0", "Q5_1") else
               np.random.default_rng(2).integers(0, 256, size=(4, 512 // 256 * gguf.GGML_QUANT_SIZES[qt][1]),
                                                 dtype=np.uint8))
        if type_name in ("Q3_K", "Q2_K"):  # their f16 scales (d, dmin) are the last bytes of a block
            block = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qt][1])
            block[:, -2:] = np.float16(0.01).reshape(1, 1).view(np.uint8)
            if type_name == "Q2_K":
                block[:, -4:-2] = np.float16(0.01).reshape(1, 1).view(np.uint8)
    tensor = converted(type_name, raw, (4, 512), "t")
    assert tensor.dtype == target
    want = gguf.quants.dequantize(raw, qt).reshape(4, 512)
    amax = np.abs(want.reshape(4, 16, 32)).max(axis=2, keepdims=True)
    steps = 127 if target == DType.Q8_0 else 15 / 2  # Q4_1: the range over 15 steps, at most 2 max|x| wide
    bound = amax / steps / 2 * (1 + 1e-3) + amax * 2.0**-10
    assert np.all(np.abs(tensor.to_f32() - want).reshape(4, 16, 32) <= bound)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # random blocks are not zero-mean: silu saturates
def test_a_gguf_of_k_quants_loads_as_q4_1_and_q8_0(tmp_path):
    # A Q4_K_M-like file (Q4_K matrices, Q6_K for v, down and the head): imported with notes that
    # say what was converted, and it computes what an F32 file of the converted values computes
    # (1e-5: the order of sums): every tensor lands where it belongs. (How far a conversion moves
    # each weight: the two tests above.)
    from picc.frontend.gguf import converted

    hidden, n_ff, vocab = 256, 512, 64
    parts = {"blk.0.attn_q.weight": (Q.Q4_K, hidden, hidden), "blk.0.attn_k.weight": (Q.Q4_K, hidden, hidden),
             "blk.0.attn_v.weight": (Q.Q6_K, hidden, hidden), "blk.0.attn_output.weight": (Q.Q4_K, hidden, hidden),
             "blk.0.ffn_gate.weight": (Q.Q4_K, n_ff, hidden), "blk.0.ffn_up.weight": (Q.Q4_K, n_ff, hidden),
             "blk.0.ffn_down.weight": (Q.Q6_K, hidden, n_ff), "output.weight": (Q.Q6_K, vocab, hidden)}
    norms = {"blk.0.attn_norm.weight": hidden, "blk.0.ffn_norm.weight": hidden, "output_norm.weight": hidden}

    def write(path, as_f32: bool):
        w = gguf.GGUFWriter(str(path), "llama")
        for add, value in ((w.add_block_count, 1), (w.add_embedding_length, hidden), (w.add_feed_forward_length, n_ff),
                           (w.add_head_count, 4), (w.add_head_count_kv, 4), (w.add_layer_norm_rms_eps, 1e-5)):
            add(value)
        w.add_tensor("token_embd.weight", np.random.default_rng(4).normal(0, 1, (vocab, hidden)).astype(np.float32))
        for i, (name, (qt, rows, cols)) in enumerate(parts.items()):
            raw = k_quant_bytes(qt, rows, cols, seed=i)
            if as_f32:
                w.add_tensor(name, converted(qt.name, raw, (rows, cols), name).to_f32())
            else:
                w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
        rng = np.random.default_rng(3)
        for name, n in norms.items():
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    model = load_model(write(tmp_path / "k.gguf", as_f32=False))
    types = model.module.weight_types()
    assert types["l0.ffn.up"].dtype == DType.Q4_1 and types["l0.ffn.down"].dtype == DType.Q8_0
    assert model.notes == ("5 Q4_K tensors converted to Q4_1 (the same 4-bit values), which picc's kernels read",
                           "3 Q6_K tensors converted to Q8_0 (decoded and quantized again), which picc's kernels read")
    reference = load_model(write(tmp_path / "f.gguf", as_f32=True))
    tokens = [3, 9, 27, 50, 1, 14]
    got = Interpreter(model.module, model.weights).run(tokens)
    assert rel_l2(got, Interpreter(reference.module, reference.weights).run(tokens)) <= 1e-5


def test_missing_output_means_tied_embeddings(hf_llama, tmp_path):
    hf_dir, _ = hf_llama
    model = load_model(write_gguf(hf_dir, tmp_path / "t.gguf", tie=True))
    logits_op = model.module.function().producer("logits")
    assert logits_op.weight == "token_embd"
    assert "output" not in model.module.weight_types()


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt2"),
     "GGUF architecture 'gpt2' is not supported (supported: llama, granite, granitemoe, qwen2, qwen2moe, qwen3, qwen3moe, "
     "phi3, olmo2, gemma2, gemma3, gpt-oss, ernie4_5, ernie4_5-moe, deepseek2, glm4moe)"),
    (dict(drop_keys=("head_count",)), "GGUF metadata key 'llama.attention.head_count' is missing"),
    (dict(extra={"blk.0.ffn_up.weight.q5": (np.zeros((8, 64)), Q.F32)}),
     "tensor 'blk.0.ffn_up.weight.q5' is not part of a llama model picc knows"),
    (dict(extra={"rope_freqs.weight": (np.linspace(1, 3, 8), Q.F32)}),
     "rope_freqs.weight does not hold llama3 rope scaling factors"),
    (dict(extra={"rope_freqs.weight": (np.ones(5), Q.F32)}), "rope_freqs.weight must hold 8 positive factors"),
    (dict(extra={"rope_factors_long.weight": (np.ones(8), Q.F32)}),
     "longrope needs both rope_factors_short.weight and rope_factors_long.weight"),
    (dict(extra={"rope_factors_long.weight": (np.ones(8), Q.F32), "rope_factors_short.weight": (np.ones(8), Q.F32)}),
     "longrope needs llama.rope.scaling.original_context_length"),
    (dict(keys=dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0)),
     "yarn rope needs llama.rope.scaling.original_context_length (an integer >= 1)"),
    (dict(keys=dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0, context_length=64,
                    rope_scaling_yarn_beta_fast=1.0, rope_scaling_yarn_beta_slow=32.0)),
     "yarn rope needs yarn_beta_fast >= yarn_beta_slow, got 1.0 and 32.0"),
    (dict(keys=dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=-4.0, context_length=64)),
     "llama.rope.scaling.factor must be a number > 0, got -4.0"),
    (dict(keys=dict(rope_scaling_type=gguf.RopeScalingType.YARN, context_length=64),
          extra={"rope_freqs.weight": (np.ones(8), Q.F32)}),
     "rope_freqs.weight and rope scaling 'yarn' together are not supported"),
])
def test_unsupported_files_are_refused_in_one_line(hf_llama, tmp_path, kwargs, message):
    hf_dir, _ = hf_llama
    path = write_gguf(hf_dir, tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(PiccError) as e:
        load_model(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


def test_mxfp4_experts_are_kept_as_stored(tmp_path):
    # gpt-oss's 4-bit experts: a 3-D MXFP4 tensor (experts, rows, blocks) keeps its bytes as one
    # mxfp4 matrix of the experts' rows, as the file's other stacked experts do; nothing converted.
    from picc.frontend.gguf import read_tensors
    from picc.frontend.gguf_file import GgufFile

    rng = np.random.default_rng(5)
    experts, rows, cols = 4, 8, 64
    values = rng.normal(0, 0.05, (experts, rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(values.reshape(-1, cols), Q.MXFP4).reshape(experts, rows, -1)
    path = tmp_path / "mx.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_shape=raw.shape, raw_dtype=Q.MXFP4)
    w.add_tensor("blk.0.ffn_down.weight", raw[0], raw_shape=raw[0].shape, raw_dtype=Q.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    store, changed = read_tensors(GgufFile(path), path)
    assert changed == {}
    up, down = store["l0.moe.up"], store["l0.ffn.down"]
    assert (up.dtype, up.shape, down.dtype, down.shape) == (DType.MXFP4, (experts * rows, cols), DType.MXFP4, (rows, cols))
    np.testing.assert_array_equal(np.asarray(up.data).reshape(-1), raw.reshape(-1))
    np.testing.assert_array_equal(store.f32("l0.moe.up"), gguf.quants.dequantize(raw, Q.MXFP4).reshape(-1, cols))


def test_unsupported_quant_type_is_named(hf_llama, tmp_path):
    hf_dir, _ = hf_llama
    path = tmp_path / "q5.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_shape=(4, 40), raw_dtype=Q.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PiccError, match=r"tensor 'token_embd.weight' has quant type Q8_1, which picc cannot decode; "
                                        r"supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, MXFP4, and the K and I quants"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    with pytest.raises(PiccError, match="junk.gguf: not a readable GGUF file"):
        load_model(path)
