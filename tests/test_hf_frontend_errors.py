"""What the Hugging Face frontend refuses, and that it says so in one line naming the culprit.

Where picc refuses a config combination because transformers cannot run it either, the test also
shows that transformers indeed fails on it, so picc never rejects a model transformers can run.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from hf_edit import edited_copy, resaved
from hf_models import EXTRA_VARIANTS, make_model, reference_logits

from picc.cli import main as picc_main
from picc.errors import PiccError
from picc.frontend import load_model

IDS = [1, 7, 3, 200, 45, 9, 17, 100]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Pristine checkpoints to copy and break: family -> variant -> path."""
    root = tmp_path_factory.mktemp("hf_base")
    paths = {}
    for family, variant in (("llama", "swiglu"), ("llama", "tied"), ("qwen2", "base"), ("opt", "pre-ln"),
                            ("falcon", "new-arch"), ("falcon", "classic"), ("phi3", "base"),
                            ("gemma2", "base"), ("gemma3_text", "base"), ("granite", "base")):
        make_model(family, variant, root / family / variant)
        paths[(family, variant)] = root / family / variant
    return paths


def refused(path, *fragments: str) -> str:
    """Load ``path``, expect a one-line PiccError containing every fragment; return it."""
    with pytest.raises(PiccError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- config.json


def test_unsupported_architecture_lists_the_supported_ones(base, tmp_path):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m",
                       config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    refused(path, "config.json", 'model_type "gpt2" (GPT2LMHeadModel) is not supported',
            "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "OPTForCausalLM",
            "FalconForCausalLM")
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "n", drop=("model_type",))
    refused(path, "required field 'model_type' is missing")


def test_malformed_config_json(base, tmp_path):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m")
    (path / "config.json").write_text('{"model_type": "llama", ')
    refused(path, "config.json: not valid JSON")
    (path / "config.json").write_text("[1, 2]")
    refused(path, "config.json: expected a JSON object")


@pytest.mark.parametrize("family,field", [("llama", "hidden_size"), ("llama", "intermediate_size"),
                                          ("opt", "ffn_dim"), ("falcon", "num_attention_heads")])
def test_missing_required_field_is_named(base, tmp_path, family, field):
    variant = {"llama": "swiglu", "opt": "pre-ln", "falcon": "new-arch"}[family]
    path = edited_copy(base[(family, variant)], tmp_path / "m", drop=(field,))
    refused(path, "config.json", f"required field {field!r} is missing")


@pytest.mark.parametrize("field,value,expected", [
    ("num_hidden_layers", 2.0, "must be an integer >= 1, got 2.0"),
    ("num_attention_heads", True, "must be an integer >= 1, got true"),
    ("rms_norm_eps", "1e-6", 'must be a number, got "1e-6"'),
    ("tie_word_embeddings", 1, "must be true or false, got 1"),
])
def test_mistyped_field_is_named(base, tmp_path, field, value, expected):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m", config={field: value})
    refused(path, f"field {field!r} {expected}")


@pytest.mark.parametrize("family,field,value", [("llama", "hidden_act", "quick_gelu"),
                                                ("opt", "activation_function", "relu6"),
                                                ("falcon", "activation", None)])
def test_unsupported_activation(base, tmp_path, family, field, value):
    variant = {"llama": "swiglu", "opt": "pre-ln", "falcon": "new-arch"}[family]
    path = edited_copy(base[(family, variant)], tmp_path / "m", config={field: value})
    refused(path, f"{field} {json.dumps(value)} is not supported", "supported: relu, silu", "gelu_pytorch_tanh")


@pytest.mark.parametrize("variant", EXTRA_VARIANTS["llama"])
def test_extra_rope_variants_are_refused(tmp_path, variant):
    """dynamic NTK (stateful in transformers): a clear refusal, not other numbers."""
    make_model("llama", variant, tmp_path / variant)
    rope_type = variant.removeprefix("rope-")
    refused(tmp_path / variant, f'rope type "{rope_type}" is not supported (supported: default, linear, llama3, '
            'longrope, yarn)')


@pytest.mark.parametrize("variant, message", [
    ("uneven-shared", "shared_expert_intermediate_size 48 is not a multiple of moe_intermediate_size 32"),
    ("sliding", "use_sliding_window is not supported for qwen2_moe"),
])
def test_qwen2_moe_configs_picc_cannot_run_are_refused(tmp_path, variant, message):
    make_model("qwen2_moe", variant, tmp_path / variant)
    refused(tmp_path / variant, message)


def test_ernie_experts_with_biases_are_refused(tmp_path):
    make_model("ernie4_5_moe", "base", tmp_path / "src")
    path = edited_copy(tmp_path / "src", tmp_path / "biased", config={"use_bias": True})
    refused(path, "use_bias with experts is not supported")


@pytest.mark.parametrize("variant, message", [
    ("mlp-bias", "mlp_bias with experts is not supported"),
    ("layer-freq", "moe_layer_freq 2 is not supported (1 is; transformers' DeepseekV2 runs experts in every layer"),
])
def test_deepseek_v2_configs_transformers_misreads_are_refused(tmp_path, variant, message):
    # transformers runs both, but not as DeepSeek's own code does (its experts have no biases; it
    # ignores moe_layer_freq): picc refuses rather than guess
    make_model("deepseek_v2", variant, tmp_path / variant)
    refused(tmp_path / variant, message)


@pytest.mark.parametrize("edit, message", [
    ({"n_group": 3}, "n_group 3 and topk_group 2 do not fit 8 experts, 2 a token"),
    ({"n_group": 8, "topk_group": 4}, "groups of one expert (8 in 8); a group's score is its best two experts'"),
    ({"topk_group": 5}, "n_group 4 and topk_group 5 do not fit"),
    ({"routed_scaling_factor": 0.0}, "field 'routed_scaling_factor' must be a number > 0"),
])
def test_deepseek_v3_routings_that_cannot_be_run_are_refused(tmp_path, edit, message):
    # transformers crashes on uneven groups and on groups of one expert (topk(2) of one)
    make_model("deepseek_v3", "base", tmp_path / "src")
    refused(edited_copy(tmp_path / "src", tmp_path / "edited", config=edit), message)


def test_deepseek_v2_routing_methods_transformers_lacks_are_refused(tmp_path):
    make_model("deepseek_v2", "base", tmp_path / "src")
    path = edited_copy(tmp_path / "src", tmp_path / "noaux", config={"topk_method": "noaux_tc"})
    refused(path, "field 'topk_method' must be \"greedy\" or \"group_limited_greedy\"")


def test_longrope_needs_a_factor_per_rotary_pair_and_a_rope_that_rotates_them(base, tmp_path):
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    path = edited_copy(base[("phi3", "base")], tmp_path / "short", config={
        "rope_parameters": dict(longrope, short_factor=[1.0] * 7)})
    refused(path, "field 'rope_parameters.short_factor' must be a list of 8 numbers > 0 (one per rotary pair)")
    path = edited_copy(base[("phi3", "base")], tmp_path / "long", config={
        "rope_parameters": dict(longrope, long_factor=[2.0] * 7 + [0.0])})
    refused(path, "field 'rope_parameters.long_factor' must be a list of 8 numbers > 0")
    # LLaMA's rope rotates the whole head whatever partial_rotary_factor says: transformers
    # computes a quarter head's frequencies for it and fails; Phi-3's rotates the quarter.
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "llama", config={
        "rope_parameters": dict(longrope, partial_rotary_factor=0.5, short_factor=[1.0] * 4, long_factor=[1.0] * 4)})
    refused(path, "partial_rotary_factor 0.5 with rope type 'longrope' is not supported")


@pytest.mark.parametrize("edit, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention (an embedding model's) is not supported"),
    ({"final_logit_softcapping": 0.0}, "field 'final_logit_softcapping' must be a number > 0 or null, got 0.0"),
    ({"layer_types": ["sliding_attention"]}, "field 'layer_types' must be a list of 2 of full_attention, sliding"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "field 'rope_parameters' must be an object of full_attention and sliding_attention rope parameters"),
])
def test_gemma3_options_picc_does_not_compute_are_refused(base, tmp_path, edit, message):
    refused(edited_copy(base[("gemma3_text", "base")], tmp_path / "m", config=edit), message)


@pytest.mark.parametrize("edit, message", [
    ({"residual_multiplier": 0}, "field 'residual_multiplier' must be a number > 0, got 0"),
    ({"logits_scaling": -8.0}, "field 'logits_scaling' must be a number > 0, got -8.0"),
    ({"embedding_multiplier": "12"}, "field 'embedding_multiplier' must be a number, got \"12\""),
])
def test_granite_multipliers_that_are_not_positive_numbers_are_refused(base, tmp_path, edit, message):
    refused(edited_copy(base[("granite", "base")], tmp_path / "m", config=edit), message)


@pytest.mark.parametrize("edit, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention (an embedding model's) is not supported"),
    ({"attn_logit_softcapping": 0.0}, "field 'attn_logit_softcapping' must be a number > 0 or null, got 0.0"),
    ({"final_logit_softcapping": "30.0"}, 'field \'final_logit_softcapping\' must be a number > 0 or null, got "30.0"'),
    ({"final_logit_softcapping": True}, "field 'final_logit_softcapping' must be a number > 0 or null, got true"),
    ({"layer_types": ["full_attention"] * 3}, "field 'layer_types' must be a list of 2 of full_attention, sliding"),
])
def test_gemma2_options_picc_does_not_compute_and_bad_soft_caps_are_refused(base, tmp_path, edit, message):
    refused(edited_copy(base[("gemma2", "base")], tmp_path / "m", config=edit), message)


def test_legacy_rope_scaling_types_are_refused(base, tmp_path):
    path = edited_copy(base[("falcon", "new-arch")], tmp_path / "m", drop=("rope_parameters",),
                       config={"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    refused(path, 'rope type "dynamic" is not supported')


def test_llama3_rope_needs_its_keys(base, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "high_freq_factor": 4.0}
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m", config={"rope_parameters": rope})
    refused(path, "rope_parameters of rope type 'llama3' needs 'low_freq_factor'")


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("edit, message", [
    ({"factor": "drop"}, "rope_parameters of rope type 'yarn' needs 'factor'"),
    ({"factor": 0.5}, "field 'rope_parameters.factor' must be a number >= 1, got 0.5"),
    ({"original_max_position_embeddings": 31.5},
     "field 'rope_parameters.original_max_position_embeddings' must be an integer >= 1, got 31.5"),
    ({"beta_fast": 1.0, "beta_slow": 32.0}, "rope_parameters needs beta_fast >= beta_slow for yarn rope, got 1.0 and 32.0"),
    ({"beta_slow": "1"}, "field 'rope_parameters.beta_slow' must be a number >= 0 or null, got \"1\""),
    ({"truncate": None}, "field 'rope_parameters.truncate' must be true or false, got null"),
    ({"mscale": -1.0, "mscale_all_dim": 1.0}, "field 'rope_parameters.mscale' must be a number >= 0 or null, got -1.0"),
    ({"attention_factor": 0.0}, "rope_parameters.attention_factor must be a number > 0, got 0.0"),
])
def test_bad_yarn_parameters_are_refused(base, tmp_path, edit, message):
    rope = {k: v for k, v in {**YARN, **edit}.items() if v != "drop"}
    refused(edited_copy(base[("llama", "swiglu")], tmp_path / "m", config={"rope_parameters": rope}), message)


# Combinations transformers builds but cannot run. Each is also run through transformers.
IMPOSSIBLE = [
    ("falcon", "new-arch", {"parallel_attn": False}, "new_decoder_architecture needs parallel_attn true"),
    ("falcon", "classic", {"num_ln_in_parallel_attn": 2}, "num_ln_in_parallel_attn 2 needs new_decoder_architecture"),
    ("falcon", "classic", {"num_kv_heads": 2}, "num_kv_heads 2 must equal num_attention_heads 4"),
    ("falcon", "new-arch", {"num_kv_heads": 3}, "num_attention_heads 4 is not a multiple of num_kv_heads 3"),
    ("llama", "swiglu", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("qwen2", "base", {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
     "layer_types has sliding_attention layers but no window"),
    ("llama", "swiglu", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 with rope type 'linear' is not supported"),
    ("gemma2", "base", {"sliding_window": None}, "layer_types has sliding_attention layers but sliding_window is null"),
    ("gemma3_text", "base", {"sliding_window": None},
     "layer_types has sliding_attention layers but sliding_window is null"),
]


@pytest.mark.parametrize("family,variant,edit,fragment", IMPOSSIBLE, ids=[x[3][:40] for x in IMPOSSIBLE])
def test_combinations_transformers_cannot_run(base, tmp_path, family, variant, edit, fragment):
    path = edited_copy(base[(family, variant)], tmp_path / "m", config=edit)
    refused(path, "config.json", fragment)
    with pytest.raises(Exception):  # noqa: B017 - transformers fails in various ways
        reference_logits(path, IDS)


@pytest.mark.parametrize("family,variant,edit,fragment", [
    ("falcon", "new-arch", {"head_dim": 16}, "field 'head_dim' is not allowed for falcon"),
    ("llama", "swiglu", {"hidden_size": 60, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16},
     "hidden_size 60 is not a multiple of num_attention_heads 8"),
    ("gemma2", "base", {"hidden_size": 60, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16},
     "hidden_size 60 is not a multiple of num_attention_heads 8 (Gemma2Config requires it"),
    ("gemma2", "base", {"query_pre_attn_scalar": 24.0}, "field 'query_pre_attn_scalar' must be an integer >= 1, got 24.0"),
])
def test_configs_transformers_rejects(base, tmp_path, family, variant, edit, fragment):
    path = edited_copy(base[(family, variant)], tmp_path / "m", config=edit)
    refused(path, fragment)
    with pytest.raises(Exception):  # noqa: B017 - AttributeError / strict validation error
        reference_logits(path, IDS)


def test_quantized_checkpoints_are_refused(base, tmp_path):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m",
                       config={"quantization_config": {"quant_method": "gptq", "bits": 4}})
    refused(path, "quantized checkpoints", "'gptq'")


def test_bytes_where_floats_belong_and_floats_where_mxfp4_blocks_belong_are_named(tmp_path):
    # A U8 tensor is read only as a quantized format's bytes (gpt-oss's MXFP4 blocks); one in a
    # float weight's place, or float blocks, are refused with the tensor's name.
    import numpy as np

    make_model("gpt_oss", "base", tmp_path / "src")
    router = "model.layers.0.mlp.router.weight"
    path = edited_copy(tmp_path / "src", tmp_path / "u8", tensors=lambda sd: {
        **sd, router: sd[router].view(np.uint8)[:, :64].copy()})
    refused(path, f"tensor '{router}' is bytes (U8), not the float weights picc expects there")
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    path = edited_copy(tmp_path / "src", tmp_path / "f32", config={"quantization_config": {"quant_method": "mxfp4"}},
                       tensors=lambda sd: {**sd, experts + "_blocks": np.zeros((8, 64, 2, 16), np.float32),
                                           experts + "_scales": np.zeros((8, 64, 2), np.uint8)})
    refused(path, f"tensor '{experts}_blocks' is F32 [8, 64, 2, 16], but config.json implies U8 [8, 64, 2, 16]")


# ---------------------------------------------------------------- weights


def test_missing_tensor_names_tensor_and_file(base, tmp_path):
    def drop(sd):
        return {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}

    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m", tensors=drop)
    refused(path, "tensor 'model.layers.1.mlp.up_proj.weight' is missing from", "model.safetensors")


def test_shape_mismatch_names_tensor_and_shapes(base, tmp_path):
    path = edited_copy(base[("opt", "pre-ln")], tmp_path / "m", config={"ffn_dim": 128})
    refused(path, "tensor 'model.decoder.layers.0.fc1.weight' has shape [160, 64], but config.json "
                  "implies [128, 64]")


def test_untied_model_without_lm_head_is_refused(base, tmp_path):
    def drop(sd):
        return {k: v for k, v in sd.items() if k != "lm_head.weight"}

    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m", tensors=drop)
    refused(path, "tensor 'lm_head.weight' is missing", "tie_word_embeddings is false",
            "transformers would initialise the head at random")
    # the tied variant has no lm_head.weight in its file and is fine
    assert load_model(base[("llama", "tied")]).module.function().producer("logits").weight == "token_embd"


def test_no_safetensors_files(base, tmp_path):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    refused(path, "no safetensors weights", "model.safetensors", "(found pytorch_model.bin)")


def test_missing_shard(base, tmp_path):
    path = resaved(base[("llama", "swiglu")], tmp_path / "m", max_shard_size="40KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[1].unlink()
    refused(path, f"shard {shards[1].name!r} listed in model.safetensors.index.json is missing")


def test_truncated_safetensors_file(base, tmp_path):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = refused(path, "model.safetensors")
    assert re.search(r"truncated|not a safetensors file", message)


def test_cli_reports_frontend_errors_in_one_line(base, tmp_path, capsys):
    path = edited_copy(base[("llama", "swiglu")], tmp_path / "m", config={"hidden_act": "mish"})
    out = tmp_path / "x.npy"
    assert picc_main(["logits", str(path), "--tokens", "1,2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("picc: error: ") and 'hidden_act "mish"' in err
    assert not os.path.exists(out)


def test_opt_positions_end_at_max_position_embeddings(base):
    """OPT learns max_position_embeddings (64 here) positions; the 65th is refused by name."""
    from picc.interpreter import Interpreter

    model = load_model(base[("opt", "pre-ln")])
    run = Interpreter(model.module, model.weights).run
    assert run([5] * 64).shape == (64, 256)
    with pytest.raises(PiccError, match=r"position 64 is beyond the 64 positions of @pos_embd"):
        Interpreter(model.module, model.weights).run([5] * 65)
