"""Tiny random Hugging Face checkpoints + transformers reference outputs for picc tests.

Usage (from a test)::

    from hf_models import VARIANTS, make_model, reference_logits, reference_greedy

    make_model("llama", "gqa", tmp_path / "m")
    ref = reference_logits(tmp_path / "m", [1, 5, 9, 3])   # np.float32, (tokens, vocab)

Every variant is a 2-layer, hidden-64-ish model built with transformers from a
config, with all weights re-drawn (fixed seed) at a large scale -- norm weights
around 1 +- 0.25, biases std 0.25, embeddings std 0.5, linear weights std 0.2 --
so a wrong implementation changes the logits visibly.  Weights are drawn per
parameter from a seed derived from (seed, parameter name), so two variants of a
family that have the same parameter names and shapes (e.g. mistral "base" vs
"sliding-window") get *identical* weights and differ only in the config field
being exercised.

Checkpoints are written with ``save_pretrained`` (transformers 5.x always writes
``model.safetensors``; tied ``lm_head.weight`` is *omitted* from the file).  Some
variants then rewrite config.json into the older "hub" layout real checkpoints
use (top-level ``rope_theta`` / ``rope_scaling``; Qwen2 without ``layer_types``),
see ``_HUB_STYLE`` below.  No tokenizer is written: tests pass token ids.

Reference outputs use eager attention in float32, except Falcon with ALiBi,
which uses SDPA: in transformers 5.x Falcon's *eager* ALiBi path adds the ALiBi
bias twice (once folded into the mask, once in the attention code), SDPA (the
default implementation for Falcon, and the one matching the original model)
adds it once.  See docs/hf_semantics.md.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import zlib
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402

__all__ = [
    "FAMILIES",
    "VARIANTS",
    "EXTRA_VARIANTS",
    "SAME_WEIGHTS_DIFFERENT_LOGITS",
    "SAME_LOGITS",
    "variant_config",
    "make_model",
    "reference_logits",
    "reference_greedy",
    "load_reference_model",
]

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "ernie4_5", "ernie4_5_moe",
            "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "olmoe", "phi3", "smollm3", "granite",
            "granitemoe", "olmo2", "olmo3", "gemma2", "gemma3_text", "gemma3", "gpt_oss", "opt", "falcon")

# --------------------------------------------------------------------------------------
# Config variants.  Each entry is the kwargs given to the transformers config class on
# top of the family's base kwargs.  Keys starting with "_" are handled here, not passed
# to transformers:
#   _hub_style: rewrite config.json after saving (see _HUB_STYLE)
# --------------------------------------------------------------------------------------

_TINY = dict(  # the shape every LLaMA-like family's variants share
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
             "short_factor": [1.0, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0], "long_factor": [2.0] * 8}
_QWEN = dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
             sliding_window=4, max_window_layers=1, rope_parameters=_ROPE)

# DeepSeek's yarn (factor 40 over 4096 as released), here factor 4 past an original context of 8
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                  "beta_fast": 32.0, "beta_slow": 1.0}

_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(_TINY, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=_ROPE),
    "mistral": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=None,
                    rope_parameters=_ROPE),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=16),
    # Mixtral: Mistral's layer with eight experts (block_sparse_moe's w1, w3, w2) of
    # intermediate_size neurons, two a token, their softmax weights renormalised
    "mixtral": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                    rope_parameters=_ROPE, num_local_experts=8, num_experts_per_tok=2),
    # Qwen3-MoE: Qwen3's attention, each layer's MLP eight experts of 32 neurons, two a token
    "qwen3_moe": dict(_QWEN, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B's layout): Qwen2's attention (q, k, v biases), eight experts of 32
    # neurons, two a token, not renormalised, and a shared expert of 64 neurons gated by the
    # sigmoid of its own row (picc: two more experts, always taken)
    "qwen2_moe": dict(_QWEN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # ERNIE 4.5 (0.3B's layout): LLaMA's layer rotating interleaved pairs, heads of 16, tied head
    "ernie4_5": dict(_TINY, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     rope_parameters=_ROPE),
    # ERNIE 4.5 MoE (21B-A3B's layout): layer 0 dense, layer 1 eight experts of 32, two a token
    # ranked by probability plus a bias, renormalised, and two shared experts
    "ernie4_5_moe": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters=_ROPE, moe_intermediate_size=32, moe_k=2, moe_num_experts=8,
                         moe_num_shared_experts=2, moe_layer_start_index=1),
    # DeepSeek-V2-Lite's layout: latent attention (q straight from x; a latent of 32 for k and v;
    # heads of 16 + 8 rotated features in q and k, values of 12), layer 0 dense, layer 1 eight
    # experts of 32, two a token by softmax, and two shared experts
    "deepseek_v2": dict(_TINY, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=_ROPE,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1),
    # DeepSeek V3's layout: V2's attention with q through a latent of 48 too, experts ranked by
    # sigmoid plus a correction bias within the best two of four groups, renormalised, times 2.5
    "deepseek_v3": dict(_TINY, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=_ROPE,
                        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5),
    # GLM-4.5's layout: LLaMA's attention with biases on q, k, v and half of each head rotated;
    # V3's experts without groups (layer 0 dense)
    "glm4_moe": dict(_TINY, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, pad_token_id=0),
    # GLM-4.7-Flash's layout: V3's latent attention and experts, one group, values wider than keys
    "glm4_moe_lite": dict(_TINY, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=_ROPE,
                          q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=24,
                          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          routed_scaling_factor=1.8),
    # OLMoE: LLaMA's layer with q and k normalised over the whole projection, and eight experts
    # of intermediate_size neurons, two a token, their softmax weights not renormalised
    "olmoe": dict(_TINY, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=_ROPE,
                  num_experts=8, num_experts_per_tok=2, pad_token_id=1, eos_token_id=2),
    "phi3": dict(_TINY, num_key_value_heads=4, original_max_position_embeddings=128, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, sliding_window=None, pad_token_id=0, rope_parameters=_ROPE),
    "smollm3": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    no_rope_layer_interval=2,  # layer 1 without rope (SmolLM3-3B: every 4th)
                    rope_parameters=_ROPE),
    # Granite 3's multipliers (2B's: embedding 12, residual 0.22; the attention's scale 1 / head_dim,
    # not its square root; its logits / 8, here / 2, which leaves these tiny logits spread)
    "granite": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=_ROPE,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16,
                    logits_scaling=2.0),
    # Granite-MoE (Granite 3.0 1B-A400M's layout): Granite's multipliers, eight experts of 32
    # neurons in 3-D input_linear / output_linear, two a token
    "granitemoe": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=_ROPE,
                       intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=2.0),
    # gpt-oss (20B's layout): every even layer slides (a window of 4), learned sinks in every
    # attention, biases on q, k, v, o, the router and the experts; eight experts of 32 neurons, two
    # a token, the softmax of their logits; its clamped SwiGLU at a limit these tiny projections
    # reach (20B's: 7)
    "gpt_oss": dict(_TINY, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}, sliding_window=4,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.5,
                    pad_token_id=0, eos_token_id=2),
    # OLMo 2: the attention's and the MLP's outputs normalised (not their inputs), q and k each
    # normalised over the whole projection before the rope
    "olmo2": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=_ROPE,
                  pad_token_id=1, eos_token_id=2),
    # OLMo 3: OLMo 2's layer, layer 0 sliding (a window of 4), layer 1 attending to everything,
    # each type with its own rope
    "olmo3": dict(_TINY, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=1,
                  eos_token_id=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    # Gemma 2: Gemma 3's layer without the q and k norms, one rope for all layers, and soft caps on
    # the attention's scores and on the logits, small enough to bend these tiny models' (scores
    # of median 8, logits of median 2): 10 * tanh(s / 10), 3 * tanh(l / 3)
    "gemma2": dict(_TINY, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0,
                   attn_logit_softcapping=10.0, final_logit_softcapping=3.0, rope_parameters=_ROPE),
    # Gemma 3 (1B's layout): layer 0 slides (a window of 4), layer 1 attends to everything, each
    # with its own rope; heads wider than hidden / heads, q . k scaled by query_pre_attn_scalar
    "gemma3_text": dict(_TINY, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    # Gemma 3 4B's layout: Gemma3ForConditionalGeneration, the text model beside a (tiny) SigLIP
    # vision tower; text_config as the 4B's leaves out the heads and the vocabulary (defaults)
    "gemma3": dict(text_config=None, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=28, patch_size=14),
                   mm_tokens_per_image=4, image_token_index=250, boi_token_index=251, eoi_token_index=252),
    "opt": dict(
        vocab_size=256,
        hidden_size=64,
        ffn_dim=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        do_layer_norm_before=True,
        word_embed_proj_dim=None,
        enable_bias=True,
        activation_function="relu",
        tie_word_embeddings=True,
        dropout=0.1,  # must be ignored in eval mode
    ),
    "falcon": dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=160,
        max_position_embeddings=128,
        layer_norm_epsilon=1e-5,
        bias=False,
        alibi=False,
        activation="gelu",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, 199, ... -> with 64 there is one
    # unscaled frequency, two smoothed ones and five divided by `factor`.
    "original_max_position_embeddings": 64,
}

_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

_SPECS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        "swiglu": {},
        "relu": dict(hidden_act="relu"),
        "gelu": dict(hidden_act="gelu"),
        "gqa": dict(num_key_value_heads=2),
        "mqa": dict(num_key_value_heads=1),
        "rope-theta": dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "rope-llama3": dict(rope_parameters=dict(_LLAMA3_ROPE)),
        # same as rope-linear / rope-llama3 but config.json in the pre-5.x hub layout:
        # top-level "rope_theta" + "rope_scaling" (with the legacy "type" key for linear)
        "rope-linear-legacy": dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, _hub_style="rope"
        ),
        "rope-llama3-legacy": dict(rope_parameters=dict(_LLAMA3_ROPE), _hub_style="rope"),
        # YaRN (head_dim 16, theta 1e4, 32 positions of old: pair 0 kept, pair 1 half-way, the
        # rest divided by 4; cos and sin times 1 + 0.1 ln 4)
        "rope-yarn": dict(rope_parameters=dict(_YARN_ROPE)),
        # gpt-oss's: the ramp's ends (pairs 2.02 and 4.35) not rounded outwards
        "rope-yarn-untruncated": dict(max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}),
        # DeepSeek's attention factor (1 + 0.05 ln 8) / (1 + 0.1 ln 8), other betas, and an original
        # context of 8: the test's positions go past it
        "rope-yarn-mscale": dict(rope_parameters=dict(_YARN_ROPE, factor=8.0, mscale=0.5, mscale_all_dim=1.0,
                                                      beta_fast=16.0, beta_slow=2.0,
                                                      original_max_position_embeddings=8)),
        # Qwen3's hub layout (rope_scaling) with an explicit attention_factor
        "rope-yarn-legacy": dict(rope_parameters=dict(_YARN_ROPE, attention_factor=0.75), _hub_style="rope"),
        "tied": dict(tie_word_embeddings=True),
        "attn-bias": dict(attention_bias=True),
        "mlp-bias": dict(mlp_bias=True),
        "head-dim": dict(head_dim=24, num_key_value_heads=2),
        "norm-eps": dict(rms_norm_eps=0.5),
    },
    "mistral": {
        "base": {},
        "sliding-window": dict(sliding_window=4),
        "head-dim": dict(head_dim=32),
        "tied": dict(tie_word_embeddings=True),
        # a hub config.json without "sliding_window" key -> class default 4096 (> test length)
        "no-window-key": dict(_hub_style="drop-sliding-window"),
    },
    "qwen2": {
        # all qwen2 variants have config.json without "layer_types" (like hub checkpoints),
        # so the loader must derive it from use_sliding_window / max_window_layers.
        "base": dict(_hub_style="qwen2"),
        "tied": dict(tie_word_embeddings=True, _hub_style="qwen2"),
        # layer 0 full attention, layer 1 (>= max_window_layers) sliding window 4
        "sliding": dict(use_sliding_window=True, _hub_style="qwen2"),
        # every layer sliding
        "sliding-all": dict(use_sliding_window=True, max_window_layers=0, _hub_style="qwen2"),
        # use_sliding_window False: sliding_window=4 / max_window_layers=1 must be IGNORED
        "sliding-off": dict(use_sliding_window=False, _hub_style="qwen2-keep-window"),
        # explicit layer_types (kept in config.json) override max_window_layers
        "layer-types": dict(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]),
        "mha": dict(num_key_value_heads=4, _hub_style="qwen2"),
    },
    "qwen3": {
        # q and k RMS-normalised a head at a time (q_norm / k_norm, [head_dim]) before the rope
        "base": {},
        "tied": dict(tie_word_embeddings=True),
        "attn-bias": dict(attention_bias=True),  # q, k, v and o
        # a head wider than hidden / heads (Qwen3-0.6B: 16 heads of 128 in a hidden of 1024)
        "head-dim": dict(head_dim=32),
        # config.json without "head_dim": Qwen3Config's default 128, not hidden / heads
        "head-dim-default": dict(head_dim=128, _hub_style="drop-head-dim"),
        "sliding": dict(use_sliding_window=True, _hub_style="qwen2"),  # layer 1 slides
        "norm-eps": dict(rms_norm_eps=0.5),  # the q and k norms' eps too
    },
    "phi3": {
        # q, k, v in one qkv_proj and gate, up in one gate_up_proj (the gate's rows first)
        "base": {},
        "gqa": dict(num_key_value_heads=2),  # Phi-3-medium's grouped heads
        "sliding": dict(sliding_window=4),  # Phi-3-mini-4k slides every layer (2047)
        # Phi-4-mini rotates 3/4 of each head (here 12 of 16 features), the rest passes through
        "partial-rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75}),
        "tied": dict(tie_word_embeddings=True),
        # Phi-3.5-mini and Phi-3-mini-128k: a factor per frequency (the short ones up to
        # original_max_position_embeddings) and cos/sin scaled by sqrt(1 + ln(256/128) / ln(128))
        "longrope": dict(max_position_embeddings=256, rope_parameters=_LONGROPE),
        # Phi-4-mini: the same on 3/4 of each head (6 factors for 12 of 16 features)
        "longrope-partial": dict(max_position_embeddings=256, rope_parameters=dict(
            _LONGROPE, partial_rotary_factor=0.75, short_factor=[1.0, 1.5, 2.5, 4.0, 7.0, 11.0], long_factor=[3.0] * 6)),
    },
    "mixtral": {
        "base": {},
        "sliding-window": dict(sliding_window=4),
        "three-of-eight": dict(num_experts_per_tok=3),
    },
    "qwen3_moe": {
        "base": {},
        "unnormalised": dict(norm_topk_prob=False),
        "dense-layer": dict(mlp_only_layers=[0]),  # layer 0 keeps a dense MLP of intermediate_size
        "three-of-eight": dict(num_experts_per_tok=3),
    },
    "qwen2_moe": {
        "base": {},
        "normalised": dict(norm_topk_prob=True),
        "dense-layer": dict(mlp_only_layers=[1]),  # layer 1 keeps a dense MLP of intermediate_size
        "wide-shared": dict(shared_expert_intermediate_size=128),  # four pieces
    },
    "olmoe": {
        "base": {},
        "normalised": dict(norm_topk_prob=True),
    },
    "ernie4_5": {
        "base": {},
        "biases": dict(use_bias=True),
    },
    "deepseek_v2": {
        "base": {},
        "q-latent": dict(q_lora_rank=48),  # DeepSeek-V2's own
        # DeepSeek-V2 (236B): the best 3 experts among the best 2 of 4 groups, times 16
        "group-limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
                              routed_scaling_factor=16.0),
        "biases": dict(attention_bias=True),
        # V2's yarn (mscale 0.707 as released)
        "yarn": dict(rope_parameters=dict(_DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707)),
    },
    "deepseek_v3": {
        "base": {},
        "rotate-half": dict(rope_interleave=False),
        "ungrouped": dict(n_group=1, topk_group=1),
        "unnormalised": dict(norm_topk_prob=False),
        "q-direct": dict(q_lora_rank=None),
        # V3's yarn (mscale and mscale_all_dim 1): the scores scaled by mscale^2
        "yarn": dict(rope_parameters=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0)),
    },
    "glm4_moe": {
        "base": {},
        "qk-norm": dict(use_qk_norm=True),
        "groups": dict(n_group=2, topk_group=1),
        "unbiased": dict(attention_bias=False, norm_topk_prob=False),
        # GLM-4.5-Air's config.json: rope_theta and partial_rotary_factor at the top level
        "hub": dict(_hub_style="rope"),
    },
    "glm4_moe_lite": {
        "base": {},
        "all-sparse": dict(mlp_layer_types=["sparse", "sparse"]),
    },
    "ernie4_5_moe": {
        "base": {},
        "all-experts": dict(moe_layer_start_index=0, moe_num_shared_experts=0),
        "four-of-eight": dict(moe_k=4),
    },
    "granite": {
        "base": {},
        "untied": dict(tie_word_embeddings=False),
        "biases": dict(attention_bias=True, mlp_bias=True),
        "norm-eps": dict(rms_norm_eps=0.5),  # an eps that the residual multiplier's rescaling must follow
        # GraniteConfig's defaults: every multiplier 1 (LLaMA's layer with an attention scale of 1)
        "unscaled": dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                         logits_scaling=1.0),
    },
    "granitemoe": {
        "base": {},
        "unscaled": dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                         logits_scaling=1.0),
    },
    "olmo2": {
        "base": {},
        "biases": dict(attention_bias=True),
        "tied": dict(tie_word_embeddings=True),
        "norm-eps": dict(rms_norm_eps=0.5),  # the q and k norms' eps too
    },
    "olmo3": {
        "base": {},
        # OLMo 3's long-context configs: yarn on the full-attention layers only
        "yarn-full": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": dict(_YARN_ROPE, rope_theta=500000.0, factor=8.0)}),
        # the default layer types (every fourth layer full) and the hub's legacy keys: rope_theta
        # and rope_scaling, which transformers puts on the full layers (the sliding ones: theta 500000)
        "hub": dict(num_hidden_layers=4, layer_types=None, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": dict(_YARN_ROPE, rope_theta=20000.0)}, _hub_style="olmo3"),
    },
    "gemma2": {
        "base": {},
        "no-softcap": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
        # a hub config.json (transformers 4.x): rope_theta, no layer_types (layer i slides when i is even)
        "hub": dict(_hub_style="gemma2"),
        "untied": dict(tie_word_embeddings=False),
        # llama.cpp's pattern (every even layer slides) from the default layer_types, and
        # query_pre_attn_scalar = head_dim (GGUF files carry no query_pre_attn_scalar: llama.cpp
        # takes head_dim)
        "six-layers": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32, _hub_style="drop-layer-types"),
    },
    "gemma3_text": {
        "base": {},
        # a hub config.json: rope_theta, rope_local_base_freq and rope_scaling, sliding_window_pattern
        "hub": dict(_hub_style="gemma3"),
        # Gemma 3 4B / 12B / 27B: the global layers' rope scaled by 8
        "scaled-global": dict(rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        "untied": dict(tie_word_embeddings=False),
        # Gemma 3 1B's pattern as llama.cpp hard-codes it (five sliding layers, then a global one),
        # and its query_pre_attn_scalar, head_dim (GGUF files carry neither: llama.cpp takes head_dim)
        "six-layers": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32),
        # Gemma3TextConfig's soft caps (null in the released models): transformers caps the logits
        # and ignores the attention's cap
        "softcap": dict(attn_logit_softcapping=10.0, final_logit_softcapping=3.0),
    },
    "gemma3": {
        "base": dict(text_config="gemma3_text"),
        # the hub's 4B: rope_scaling (linear, 8) on the global layers, legacy keys, tensors under
        # language_model.model. as transformers 4.x saved them
        "hub": dict(text_config="gemma3_text:scaled-global", _hub_style="gemma3-vlm"),
    },
    "gpt_oss": {
        "base": {},
        "wide-clamp": dict(swiglu_limit=7.0),  # 20B's limit, which these projections seldom reach
        "four-of-eight": dict(num_experts_per_tok=4),
        "all-full": dict(layer_types=["full_attention", "full_attention"]),
        # 20B's rope (yarn, not truncated) at an original length of 32 and a factor of 4
        "yarn": dict(rope_parameters=dict(_YARN_ROPE, rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False)),
        # llama.cpp's gpt-oss (limit 7; its yarn rounds the ramp's ends outwards, as truncate does)
        "gguf-yarn": dict(swiglu_limit=7.0, rope_parameters=dict(_YARN_ROPE, rope_theta=150000.0)),
    },
    "smollm3": {
        # tied embeddings by default; the no-rope layers derived from no_rope_layer_interval
        "base": dict(_hub_style="smollm3"),
        "all-rope": dict(no_rope_layers=[1, 1]),
        "untied": dict(tie_word_embeddings=False),
        "biases": dict(attention_bias=True, mlp_bias=True),
        "sliding": dict(use_sliding_window=True, sliding_window=4, _hub_style="smollm3"),  # the no-rope layer slides
    },
    "opt": {
        "pre-ln": {},  # opt-125m / 1.3b / ... layout
        "post-ln": dict(do_layer_norm_before=False),
        "proj-dim": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # opt-350m layout
        "proj-dim-pre-ln": dict(word_embed_proj_dim=32),
        "no-bias": dict(enable_bias=False),
        "no-final-ln": dict(_remove_final_layer_norm=True),
        "untied": dict(tie_word_embeddings=False),
        "no-affine": dict(layer_norm_elementwise_affine=False),
        "gelu": dict(activation_function="gelu"),
    },
    "falcon": {
        # falcon-40b / 180b: grouped fused qkv, ln_attn + ln_mlp
        "new-arch": dict(new_decoder_architecture=True, num_kv_heads=2),
        # falcon2-11b: new arch with a single shared input_layernorm
        "new-arch-1ln": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
        "new-arch-mqa": dict(new_decoder_architecture=True, num_kv_heads=1),
        "new-arch-mha": dict(new_decoder_architecture=True, num_kv_heads=4),
        # falcon-7b: multi-query fused qkv, parallel attn+mlp, one input_layernorm
        "multi-query": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True),
        # interleaved per-head fused qkv, parallel
        "classic": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=True),
        # sequential attn -> mlp (input_layernorm + post_attention_layernorm)
        "sequential": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False),
        "sequential-mq": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=False),
        # falcon-rw-1b layout: alibi, interleaved qkv, sequential, biases
        "alibi": dict(
            new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True, bias=True
        ),
        # 24 heads: closest power of two 16 (irrational slopes) + 8 "extra" heads;
        # exercises the bfloat16 rounding transformers applies to the alibi bias
        "alibi-24heads": dict(
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            alibi=True,
            bias=True,
            hidden_size=96,
            num_attention_heads=24,
        ),
        "alibi-mq-parallel": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=True),
        "bias": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
        "untied": dict(new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False),
        "relu": dict(new_decoder_architecture=True, num_kv_heads=2, activation="relu"),
        "rope-linear": dict(
            new_decoder_architecture=True,
            num_kv_heads=2,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        "rope-theta-legacy": dict(
            new_decoder_architecture=True,
            num_kv_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            _hub_style="rope",
        ),
        "ln-eps": dict(new_decoder_architecture=True, num_kv_heads=2, layer_norm_epsilon=0.5),
    },
}

# Variants make_model accepts but that are not in VARIANTS: RoPE types picc may choose to
# reject (it should then raise a clear error rather than compute something else).
_EXTRA_SPECS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        # identical to default RoPE while sequence length <= max_position_embeddings (8 here);
        # longer sequences recompute inv_freq from the current length (see notes)
        "rope-dynamic": dict(
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
    },
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "smollm3": {},
    "phi3": {},
    "granite": {},
    "granitemoe": {},
    "mixtral": {},
    "qwen3_moe": {},
    "qwen2_moe": {
        "uneven-shared": dict(shared_expert_intermediate_size=48),  # refused: not a multiple of 32
        "sliding": dict(use_sliding_window=True),  # refused
    },
    "olmoe": {},
    "ernie4_5": {},
    "ernie4_5_moe": {},
    "deepseek_v2": {
        "mlp-bias": dict(mlp_bias=True),  # refused
        "layer-freq": dict(moe_layer_freq=2),  # refused (transformers ignores it)
    },
    "deepseek_v3": {
        "wide-nope": dict(qk_nope_head_dim=32),  # GGUF tests: attn_k_b's rows (nope wide) whole Q8_0 blocks
    },
    "glm4_moe": {},
    "glm4_moe_lite": {},
    "olmo2": {},
    "olmo3": {},
    "gemma2": {},
    "gemma3_text": {},
    "gemma3": {},
    "gpt_oss": {},
    "opt": {},
    "falcon": {},
}

VARIANTS: dict[str, list[str]] = {fam: list(specs) for fam, specs in _SPECS.items()}
EXTRA_VARIANTS: dict[str, list[str]] = {fam: list(specs) for fam, specs in _EXTRA_SPECS.items()}

# Pairs of variants whose logits must differ at a test length >= 12.  Parameters with the same
# name and shape get identical weights for the same seed, and in these pairs the config field
# being exercised is (close to) the only difference.
SAME_WEIGHTS_DIFFERENT_LOGITS: list[tuple[str, str, str]] = [
    ("llama", "swiglu", "relu"),
    ("llama", "swiglu", "gelu"),
    ("llama", "swiglu", "rope-theta"),
    ("llama", "swiglu", "rope-linear"),
    ("llama", "swiglu", "rope-llama3"),
    ("llama", "rope-linear", "rope-llama3"),
    ("llama", "swiglu", "norm-eps"),
    ("llama", "swiglu", "rope-dynamic"),  # differs only because the test length exceeds 8
    ("llama", "swiglu", "rope-yarn"),
    ("llama", "rope-yarn", "rope-yarn-mscale"),
    ("llama", "rope-yarn", "rope-yarn-legacy"),
    ("mistral", "base", "sliding-window"),
    ("qwen2", "base", "sliding"),
    ("qwen2", "sliding", "sliding-all"),
    ("qwen2", "sliding", "layer-types"),
    ("qwen3", "base", "sliding"),
    ("qwen3", "base", "norm-eps"),
    ("phi3", "base", "sliding"),
    ("phi3", "base", "partial-rope"),
    ("phi3", "base", "longrope"),
    ("phi3", "partial-rope", "longrope-partial"),
    ("smollm3", "base", "all-rope"),
    ("gemma2", "base", "no-softcap"),
    ("granite", "base", "unscaled"),
    ("granitemoe", "base", "unscaled"),
    ("mixtral", "base", "sliding-window"),
    ("mixtral", "base", "three-of-eight"),
    ("qwen3_moe", "base", "unnormalised"),
    ("qwen3_moe", "base", "three-of-eight"),
    ("olmoe", "base", "normalised"),
    ("qwen2_moe", "base", "normalised"),
    ("qwen2_moe", "base", "wide-shared"),
    ("ernie4_5", "base", "biases"),
    ("ernie4_5_moe", "base", "four-of-eight"),
    ("deepseek_v2", "base", "group-limited"),
    ("deepseek_v2", "base", "yarn"),
    ("deepseek_v3", "base", "rotate-half"),
    ("deepseek_v3", "base", "ungrouped"),
    ("deepseek_v3", "base", "unnormalised"),
    ("deepseek_v3", "base", "yarn"),
    ("glm4_moe", "base", "groups"),
    ("glm4_moe_lite", "base", "all-sparse"),
    ("olmo2", "base", "norm-eps"),
    ("olmo3", "base", "yarn-full"),
    ("gpt_oss", "base", "wide-clamp"),
    ("gpt_oss", "base", "four-of-eight"),
    ("gpt_oss", "base", "all-full"),
    ("gpt_oss", "base", "yarn"),
    ("gemma3_text", "base", "scaled-global"),
    ("gemma3_text", "base", "softcap"),
    ("smollm3", "base", "sliding"),
    ("opt", "pre-ln", "post-ln"),
    ("opt", "pre-ln", "gelu"),
    ("opt", "proj-dim", "proj-dim-pre-ln"),
    ("falcon", "classic", "sequential"),
    ("falcon", "new-arch", "relu"),
    ("falcon", "new-arch", "rope-linear"),
    ("falcon", "new-arch", "rope-theta-legacy"),
    ("falcon", "new-arch", "ln-eps"),
    ("falcon", "multi-query", "alibi-mq-parallel"),
]

# Pairs whose logits must be equal (the config difference must be ignored / is equivalent).
SAME_LOGITS: list[tuple[str, str, str]] = [
    ("llama", "rope-linear", "rope-linear-legacy"),
    ("llama", "rope-llama3", "rope-llama3-legacy"),
    ("qwen2", "base", "sliding-off"),
    ("mistral", "base", "no-window-key"),  # default window 4096 > test length
    ("gemma2", "base", "hub"),  # the default layer types of two layers are base's
]


def _all_specs(family: str) -> dict[str, dict[str, Any]]:
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return {**_SPECS[family], **_EXTRA_SPECS[family]}


def variant_config(family: str, variant: str) -> dict[str, Any]:
    """The transformers config kwargs for (family, variant) (private "_" keys included)."""
    specs = _all_specs(family)
    if variant not in specs:
        raise ValueError(f"unknown {family} variant {variant!r}; expected one of {list(specs)}")
    kw = copy.deepcopy(_BASE[family])
    kw.update(copy.deepcopy(specs[variant]))
    if isinstance(kw.get("text_config"), str):  # a vision-language model: its text model is a family's variant
        text_family, _, text_variant = kw["text_config"].partition(":")
        kw["text_config"] = variant_config(text_family, text_variant or "base")
    return kw


def _config_and_class(family: str, kw: dict[str, Any]):
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM),
        "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "gemma3": (tf.Gemma3Config, tf.Gemma3ForConditionalGeneration),
        "opt": (tf.OPTConfig, tf.OPTForCausalLM),
        "falcon": (tf.FalconConfig, tf.FalconForCausalLM),
    }[family]
    return cfg_cls(**kw), model_cls


def _randomize(model, seed: int) -> None:
    """Redraw every parameter at a scale where mistakes are visible.

    Each parameter gets its own generator seeded from (seed, parameter name), so variants
    sharing parameter names/shapes share weights.
    """
    import torch
    from torch import nn

    seen: set[int] = set()
    for mod_name, mod in sorted(model.named_modules(), key=lambda t: t[0]):
        is_norm = isinstance(mod, nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm")
        is_emb = isinstance(mod, nn.Embedding)
        for p_name, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(full.encode())) % (2**63))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            with torch.no_grad():
                if is_norm and p_name == "weight":
                    p.copy_(1.0 + 0.25 * noise)
                elif p_name == "bias":
                    p.copy_(0.25 * noise)
                elif is_emb:
                    p.copy_(0.5 * noise)
                else:
                    p.copy_(0.2 * noise)
        for b_name, buf in mod.named_buffers(recurse=False):
            if b_name == "e_score_correction_bias":  # DeepSeek V3's, GLM's: a buffer, zero unless drawn here
                g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{mod_name}.{b_name}".encode()))
                                                  % (2**63))
                with torch.no_grad():
                    buf.copy_(0.25 * torch.randn(buf.shape, generator=g, dtype=torch.float32))


def _rewrite_hub_style(cfg_path: pathlib.Path, style: str) -> None:
    cfg = json.loads(cfg_path.read_text())
    if style == "rope":
        # pre-5.x layout: top-level rope_theta, rope_scaling without rope_theta, legacy "type" key
        rp = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rp.pop("rope_theta")
        rtype = rp.pop("rope_type")
        if rtype != "default":
            key = "type" if rtype == "linear" else "rope_type"
            cfg["rope_scaling"] = {key: rtype, **rp}
    elif style == "drop-sliding-window":
        cfg.pop("sliding_window", None)
    elif style == "smollm3":  # hub configs name the interval, not the derived lists
        cfg.pop("no_rope_layers", None)
        cfg.pop("layer_types", None)
    elif style in ("gemma2", "drop-layer-types"):  # Gemma 2: the default layer types, not written out
        assert cfg.pop("layer_types") == ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)
        if style == "gemma2":  # and the hub's config.json (transformers 4.x): rope_theta
            cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    elif style == "gemma3":  # Gemma 3 1B's config.json on the hub (written by transformers 4.x)
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rp["full_attention"]["rope_theta"]
        cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        cfg["rope_scaling"] = None
        assert cfg.pop("layer_types") == ["sliding_attention", "full_attention"]
        cfg["sliding_window_pattern"] = 2
    elif style == "gemma3-vlm":  # the hub's Gemma 3 4B: config.json and tensor names of transformers 4.x
        text = cfg["text_config"]
        rp = text.pop("rope_parameters")
        text["rope_theta"] = rp["full_attention"]["rope_theta"]
        text["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        text["rope_scaling"] = {k: v for k, v in rp["full_attention"].items() if k != "rope_theta"}
        _rename_tensors(cfg_path.parent, {"model.language_model.": "language_model.model.",
                                          "model.vision_tower.": "vision_tower.",
                                          "model.multi_modal_projector.": "multi_modal_projector."})
    elif style == "olmo3":  # a hub config.json (transformers 4.x): rope_theta and the full layers' rope_scaling
        assert cfg.pop("layer_types") == ["sliding_attention"] * 3 + ["full_attention"]
        full = cfg.pop("rope_parameters")["full_attention"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_scaling"] = full
    elif style == "drop-head-dim":
        assert cfg.pop("head_dim") == 128
    elif style in ("qwen2", "qwen2-keep-window"):
        cfg.pop("layer_types", None)
        if style == "qwen2-keep-window":
            # transformers nulls sliding_window when use_sliding_window is False; hub configs don't
            cfg["sliding_window"] = 4
    else:  # pragma: no cover
        raise ValueError(style)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _rename_tensors(directory: pathlib.Path, prefixes: dict[str, str]) -> None:
    """Rename the tensors of ``directory/model.safetensors`` whose names begin with a key of
    ``prefixes`` (to that key's value)."""
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {}
    for name, value in tensors.items():
        old = next((k for k in prefixes if name.startswith(k)), None)
        renamed[prefixes[old] + name[len(old):] if old else name] = value
    save_file(renamed, str(path), metadata={"format": "pt"})


def make_model(family: str, variant: str, path: pathlib.Path, seed: int = 0) -> None:
    """Build a tiny random (family, variant) model and save it as a HF checkpoint dir."""
    import torch

    path = pathlib.Path(path)
    kw = variant_config(family, variant)
    hub_style = kw.pop("_hub_style", None)
    cfg, model_cls = _config_and_class(family, kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    # transformers 5.x always writes safetensors (the safe_serialization kwarg is gone)
    model.save_pretrained(path)
    if hub_style:
        _rewrite_hub_style(path / "config.json", hub_style)
    _MODEL_CACHE.pop(str(path.resolve()), None)


# --------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------

_MODEL_CACHE: dict[str, tuple[tuple, Any]] = {}


def _stamp(path: pathlib.Path) -> tuple:
    return tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(path.iterdir())
        if f.suffix in (".json", ".safetensors")
    )


def _is_stateful(path: pathlib.Path) -> bool:
    """Dynamic-NTK RoPE keeps the largest length seen so far inside the module (stateful)."""
    cfg = json.loads((path / "config.json").read_text())
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return "dynamic" in str(rp.get("rope_type", rp.get("type", "")))


def _default_attn_impl(path: pathlib.Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") == "falcon" and cfg.get("alibi"):
        return "sdpa"  # eager double-adds alibi in transformers 5.x (see module docstring)
    return "eager"


def load_reference_model(path, attn_implementation: str | None = None):
    """Load a checkpoint dir with transformers (float32, eval mode, cached by file stamps)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = pathlib.Path(path).resolve()
    impl = attn_implementation or _default_attn_impl(path)
    key = f"{path}::{impl}"
    stamp = _stamp(path)
    hit = _MODEL_CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=impl, local_files_only=True
    ).eval()
    if not _is_stateful(path):
        _MODEL_CACHE[key] = (stamp, model)
    return model


def reference_logits(path, token_ids: list[int], attn_implementation: str | None = None) -> np.ndarray:
    """transformers float32 logits for one unpadded sequence: shape (len(token_ids), vocab)."""
    import torch

    model = load_reference_model(path, attn_implementation)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32).numpy().copy()


def reference_greedy(path, token_ids: list[int], n: int, attn_implementation: str | None = None) -> list[int]:
    """n greedily generated token ids (no eos stopping), recomputing the full prefix each step."""
    import torch

    model = load_reference_model(path, attn_implementation)
    ids = list(token_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0, -1]
            nxt = int(torch.argmax(logits).item())
            out.append(nxt)
            ids.append(nxt)
    return out
