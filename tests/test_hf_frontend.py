"""The Hugging Face frontend against transformers, on the tiny random checkpoints of hf_models.py.

Tolerance: relative L2 error ``||picc - ref|| / ||ref||`` over all logits <= 1e-4. Both sides
compute in float32 from the same weights and differ only in summation order and in the libm
behind exp/erf/tanh; observed ~1e-6. The fixtures draw weights large enough that the mistakes a
frontend can make (a wrong default, a missing bias, a window off by one, the wrong fused-QKV
rows) move the logits by far more than 1e-4 (test_hf_models_fixture.test_variants_differ checks
> 5% for each config field).

Error cases are in test_hf_frontend_errors.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hf_edit import edited_copy, read_config, resaved
from hf_models import FAMILIES, VARIANTS, make_model, reference_greedy, reference_logits

from picc.cli import main as picc_main
from picc.frontend import load_model
from picc.frontend.model import LoadedModel
from picc.frontend.picc_file import save_picc
from picc.generate import generate_ids
from picc.interpreter import Interpreter
from picc.ir import DType, parse, print_module, verify
from picc.ir import ops as O

TOL = 1e-4
# 20 tokens: longer than every test sliding window (4), so windows are exercised.
IDS = [1, 7, 3, 200, 45, 9, 17, 100, 23, 5, 66, 88, 12, 250, 4, 31, 2, 77, 19, 140]
ALL = [(f, v) for f in FAMILIES for v in VARIANTS[f]]


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def picc_logits(model: LoadedModel, ids: list[int] = IDS) -> np.ndarray:
    return Interpreter(model.module, model.weights).run(ids)


class Zoo:
    """Checkpoints built on first use and shared by the whole module (each takes ~50 ms)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[tuple[str, str], LoadedModel] = {}

    def path(self, family: str, variant: str) -> Path:
        p = self.root / family / variant
        if not p.exists():
            make_model(family, variant, p)
        return p

    def load(self, family: str, variant: str) -> LoadedModel:
        key = (family, variant)
        if key not in self.models:
            self.models[key] = load_model(self.path(family, variant))
        return self.models[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("hf_zoo"))


def ops_of(model: LoadedModel, cls: type) -> list:
    return [op for op in model.module.ops() if isinstance(op, cls)]


# ---------------------------------------------------------------- every variant vs transformers


@pytest.mark.parametrize("family,variant", ALL, ids=[f"{f}-{v}" for f, v in ALL])
def test_variant_matches_transformers(zoo, family, variant):
    model = zoo.load(family, variant)
    verify(model.module)
    model.weights.check_against(model.module)
    assert parse(print_module(model.module)) == model.module
    cfg = read_config(zoo.path(family, variant))
    cfg = cfg.get("text_config", cfg)  # a vision-language model's language model (Gemma 3 4B)
    # every FFN is one ffn op (what profiling and partitioning work on), or a mixture's one moe op,
    # nothing primitive
    assert len(ops_of(model, O.FFN)) + len(ops_of(model, O.MoE)) == cfg["num_hidden_layers"]
    assert not ops_of(model, O.Relu) + ops_of(model, O.Silu) + ops_of(model, O.Gelu) + ops_of(model, O.Mul)
    got = picc_logits(model)
    want = reference_logits(zoo.path(family, variant), IDS)
    assert got.shape == want.shape == (len(IDS), cfg["vocab_size"])
    assert rel_l2(got, want) <= TOL


@pytest.mark.parametrize("variant", ["longrope", "longrope-partial"])
def test_longrope_contexts_past_the_original_length_take_the_long_factors(zoo, variant):
    """transformers rotates a sequence longer than original_max_position_embeddings (128 here)
    with the long factors at every position; a compile for a longer context does the same
    (llama.cpp's choice: a KV cache's rows are not rotated again as a sequence grows), a shorter
    one keeps the short factors."""
    from picc.compile import CompileOptions, compile_model
    from picc.frontend.llama import longrope_for_context

    model = zoo.load("phi3", variant)
    ids = [(7 * i + 3) % 250 + 1 for i in range(150)]
    want = reference_logits(zoo.path("phi3", variant), ids)
    assert longrope_for_context(model.module, 128) is model.module
    longer = longrope_for_context(model.module, 256)
    assert rel_l2(Interpreter(longer, model.weights).run(ids), want) <= TOL
    assert rel_l2(Interpreter(model.module, model.weights).run(ids), want) > 100 * TOL  # the short factors
    said: list[str] = []
    compiled = compile_model(model, CompileOptions(dense=True, ctx=256, batch_step=False), say=said.append)
    assert any(line.startswith("longrope: --ctx 256 is past the short factors' positions") for line in said)
    ropes = [op for op in compiled.model.module.ops() if isinstance(op, O.Rope)]
    assert ropes and all(op.freq_factors == op.long_factors != () for op in ropes)


def test_yarn_rotates_positions_past_the_original_context_as_transformers(zoo):
    """YaRN is static: every position rotates with the same blended frequencies and the same
    attention factor, so 100 tokens of a model whose original context is 32 match transformers,
    and the rope op says which pairs it keeps (1), blends and divides by the factor (4)."""
    model = zoo.load("llama", "rope-yarn")
    rope = ops_of(model, O.Rope)[0]
    assert (rope.scaling, rope.factor, rope.original_max_position) == ("yarn", 4.0, 32)
    assert rope.freq_factors == pytest.approx((1.0, 1.6, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0))
    assert rope.attention_factor == pytest.approx(1 + 0.1 * np.log(4.0))
    ids = [(7 * i + 3) % 250 + 1 for i in range(100)]
    assert rel_l2(picc_logits(model, ids), reference_logits(zoo.path("llama", "rope-yarn"), ids)) <= TOL


def test_yarn_truncate_rounds_the_ramps_ends_outwards_or_not(zoo, tmp_path):
    """gpt-oss's truncate false keeps the ramp's fractional ends (2.02 and 4.35 here); true (the
    default) rounds them to 2 and 5. transformers' logits differ between the two, picc's follow."""
    untruncated = zoo.path("llama", "rope-yarn-untruncated")
    rope = read_config(untruncated)["rope_parameters"]
    truncated = edited_copy(untruncated, tmp_path / "truncated", config={"rope_parameters": dict(rope, truncate=True)})
    ids = [(11 * i + 5) % 250 + 1 for i in range(60)]
    want = {path: reference_logits(path, ids) for path in (untruncated, truncated)}
    assert rel_l2(want[untruncated], want[truncated]) > 100 * TOL
    for path in (untruncated, truncated):
        assert rel_l2(picc_logits(load_model(path), ids), want[path]) <= TOL


# ---------------------------------------------------------------- the config reaches the IR


def attn_windows(model):
    return tuple(op.window for op in ops_of(model, O.Attention))


FFN_FORMS = [
    ("llama", "swiglu", "swiglu"), ("llama", "relu", "reglu"), ("llama", "gelu", "geglu"),
    ("opt", "pre-ln", "relu"), ("opt", "gelu", "gelu"),
    ("falcon", "new-arch", "gelu"), ("falcon", "relu", "relu"), ("qwen2", "base", "swiglu"),
]


@pytest.mark.parametrize("family,variant,form", FFN_FORMS)
def test_ffn_form_follows_the_activation(zoo, family, variant, form):
    assert {op.form for op in ops_of(zoo.load(family, variant), O.FFN)} == {form}


WINDOWS = [
    ("llama", "swiglu", (None, None)),
    ("mistral", "base", (None, None)),  # sliding_window: null
    ("mistral", "sliding-window", (4, 4)),
    ("mistral", "no-window-key", (4096, 4096)),  # the class default when the key is absent
    ("qwen2", "base", (None, None)),
    ("qwen2", "sliding", (None, 4)),  # layers >= max_window_layers (1) slide
    ("qwen2", "sliding-all", (4, 4)),
    ("qwen2", "sliding-off", (None, None)),  # use_sliding_window false beats sliding_window: 4
    ("qwen2", "layer-types", (4, None)),  # explicit layer_types beat max_window_layers
    ("gemma2", "base", (4, None)),
    ("gemma2", "six-layers", (4, None) * 3),  # without layer_types: every even layer slides
]


@pytest.mark.parametrize("family,variant,windows", WINDOWS)
def test_sliding_windows(zoo, family, variant, windows):
    assert attn_windows(zoo.load(family, variant)) == windows


@pytest.mark.parametrize("variant,caps", [("base", (10.0, 3.0)), ("untied", (10.0, 3.0)),
                                          ("no-softcap", (None, None))])
def test_gemma2_soft_caps_reach_the_ir(zoo, variant, caps):
    """attn_logit_softcapping on every attention op, final_logit_softcapping as a softcap op on the
    logits, which the function returns; null: neither."""
    model = zoo.load("gemma2", variant)
    assert {op.softcap for op in ops_of(model, O.Attention)} == {caps[0]}
    func = model.module.function()
    assert [op.cap for op in ops_of(model, O.Softcap)] == ([caps[1]] if caps[1] else [])
    assert isinstance(func.producer(func.ret), O.Softcap if caps[1] else O.Linear)


def test_gemma2_config_without_the_optional_keys_takes_gemma2configs_defaults(zoo, tmp_path):
    """Soft caps 50 and 30, q . k scaled by 256 ** -0.5, a window of 4096 (Gemma2Config's)."""
    path = edited_copy(zoo.path("gemma2", "base"), tmp_path / "m", drop=(
        "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window"))
    model = load_model(path)
    assert {(op.softcap, op.scale) for op in ops_of(model, O.Attention)} == {(50.0, 1 / 16)}
    assert [op.cap for op in ops_of(model, O.Softcap)] == [30.0] and attn_windows(model) == (4096, None)
    assert rel_l2(picc_logits(model), reference_logits(path, IDS)) <= TOL


LLAMA3 = dict(scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position=64, theta=10000.0)
ROPES = [
    ("llama", "swiglu", dict(scaling="none", theta=10000.0)),
    ("llama", "rope-theta", dict(scaling="none", theta=100.0)),
    ("llama", "rope-linear", dict(scaling="linear", factor=4.0)),
    ("llama", "rope-linear-legacy", dict(scaling="linear", factor=4.0)),
    ("llama", "rope-llama3", LLAMA3),
    ("llama", "rope-llama3-legacy", LLAMA3),
    ("falcon", "rope-theta-legacy", dict(scaling="none", theta=500.0)),
    ("falcon", "rope-linear", dict(scaling="linear", factor=4.0)),
]


@pytest.mark.parametrize("family,variant,attrs", ROPES)
def test_rope_attributes_come_from_the_config(zoo, family, variant, attrs):
    ropes = ops_of(zoo.load(family, variant), O.Rope)
    assert len(ropes) == 2 * read_config(zoo.path(family, variant))["num_hidden_layers"]
    for op in ropes:
        assert op.style == "llama" and op.rotary_dim is None  # half-split, full head
        assert {k: getattr(op, k) for k in attrs} == attrs


PRECEDENCE = [
    # a non-empty legacy rope_scaling wins over rope_parameters; top-level rope_theta fills in
    ("swiglu", {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 300.0,
                "rope_parameters": {"rope_type": "default"}}, dict(scaling="linear", factor=2.0, theta=300.0)),
    # "rope_type" beats the legacy "type"
    ("swiglu", {"rope_scaling": {"type": "linear", "rope_type": "default", "factor": 2.0}},
     dict(scaling="none", theta=10000.0)),
    # a top-level original_max_position_embeddings overrides the llama3 dict's (the Phi3 rule)
    ("rope-llama3", {"original_max_position_embeddings": 32}, dict(scaling="llama3", original_max_position=32)),
]


@pytest.mark.parametrize("variant,edit,attrs", PRECEDENCE)
def test_rope_key_precedence(zoo, tmp_path, variant, edit, attrs):
    path = edited_copy(zoo.path("llama", variant), tmp_path / "m", config=edit)
    model = load_model(path)
    for op in ops_of(model, O.Rope):
        assert {k: getattr(op, k) for k in attrs} == attrs
    assert rel_l2(picc_logits(model), reference_logits(path, IDS)) <= TOL


@pytest.mark.parametrize("variant,n_kv,alibi", [
    ("new-arch", 2, "none"), ("new-arch-mqa", 1, "none"), ("new-arch-mha", 4, "none"),
    ("multi-query", 1, "none"), ("classic", 4, "none"), ("alibi", 4, "falcon"),
    ("alibi-24heads", 24, "falcon"), ("alibi-mq-parallel", 1, "falcon"),
])
def test_falcon_heads_and_positions(zoo, variant, n_kv, alibi):
    model = zoo.load("falcon", variant)
    assert {(op.n_kv_heads, op.alibi) for op in ops_of(model, O.Attention)} == {(n_kv, alibi)}
    assert bool(ops_of(model, O.Rope)) == (alibi == "none")


def test_module_attributes_and_head_tying(zoo):
    m = zoo.load("qwen2", "tied").module
    assert dict(m.attrs) == {"arch": "qwen2", "vocab": 256, "hidden": 64, "n_layers": 2,
                             "n_ff": 160, "max_position": 128}  # Qwen2 has no default bos/eos
    assert m.function().producer("logits").weight == "token_embd"
    assert "output" not in {w.name for w in m.weights}
    m = zoo.load("opt", "untied").module
    assert (m.attr("arch"), m.attr("bos_id"), m.attr("eos_id"), m.attr("max_position")) == ("opt", 2, 2, 64)
    assert m.function().producer("logits").weight == "output"
    assert zoo.load("falcon", "new-arch").module.attr("eos_id") == 11


# ---------------------------------------------------------------- checkpoint forms


@pytest.mark.parametrize("act,form", [("gelu_pytorch_tanh", "geglu_tanh"), ("gelu_new", "geglu_tanh"),
                                      ("swish", "swiglu")])
def test_llama_activation_aliases(zoo, tmp_path, act, form):
    """ReLU-LLaMA style edits of hidden_act: the form and the numbers follow."""
    path = edited_copy(zoo.path("llama", "swiglu"), tmp_path / act, config={"hidden_act": act})
    model = load_model(path)
    assert {op.form for op in ops_of(model, O.FFN)} == {form}
    assert rel_l2(picc_logits(model), reference_logits(path, IDS)) <= TOL


@pytest.mark.parametrize("family,variant,prefix", [("llama", "gqa", "model."), ("opt", "proj-dim", "model."),
                                                   ("falcon", "multi-query", "transformer.")])
def test_base_model_checkpoints_without_the_task_prefix(zoo, tmp_path, family, variant, prefix):
    """Checkpoints saved from the base model (``layers.0...``, OPT's old ``decoder.``) load too."""
    def strip(sd):
        return {k.removeprefix(prefix): v for k, v in sd.items()}

    src = zoo.path(family, variant)
    path = edited_copy(src, tmp_path / "m", tensors=strip)
    assert rel_l2(picc_logits(load_model(path)), reference_logits(src, IDS)) <= TOL


IGNORED = [
    ("mistral", "base", {"attention_bias": True, "mlp_bias": True}),  # Mistral never has biases
    ("llama", "gqa", {"sliding_window": 4, "pretraining_tp": 2}),  # Llama never slides
    ("falcon", "multi-query", {"num_kv_heads": 2}),  # old-arch multi-query: always one k/v head
    ("falcon", "sequential", {"num_ln_in_parallel_attn": 2}),  # sequential blocks: two norms anyway
    ("qwen2", "base", {"partial_rotary_factor": 0.5}),  # default rope always rotates the full head
]


@pytest.mark.parametrize("family,variant,edit", IGNORED, ids=[",".join(e[2]) for e in IGNORED])
def test_fields_transformers_ignores_are_ignored(zoo, tmp_path, family, variant, edit):
    src = zoo.path(family, variant)
    path = edited_copy(src, tmp_path / "m", config=edit)
    want = reference_logits(path, IDS)
    assert rel_l2(want, reference_logits(src, IDS)) < 1e-6  # transformers: no effect
    assert rel_l2(picc_logits(load_model(path)), want) <= TOL


def test_stored_lm_head_wins_over_tie_word_embeddings(zoo, tmp_path):
    """transformers 5.x uses lm_head.weight when the file has it, even with tying on."""
    path = edited_copy(zoo.path("falcon", "untied"), tmp_path / "m", config={"tie_word_embeddings": True})
    model = load_model(path)
    assert model.module.function().producer("logits").weight == "output"
    assert rel_l2(picc_logits(model), reference_logits(path, IDS)) <= TOL


def test_sharded_checkpoint(zoo, tmp_path):
    path = resaved(zoo.path("qwen2", "sliding"), tmp_path / "m", max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 3 and (path / "model.safetensors.index.json").exists()
    assert not (path / "model.safetensors").exists()
    assert rel_l2(picc_logits(load_model(path)), reference_logits(path, IDS)) <= TOL


# f16 and bf16 weights stay f16 / bf16 in the IR. The reference loads the same file with
# dtype=float32: transformers widens each stored value exactly, as picc's dequantization does, so
# both sides again compute in float32 from identical weights and the float32 tolerance holds.
@pytest.mark.parametrize("family,variant,dtype", [
    ("llama", "attn-bias", "float16"), ("qwen2", "sliding", "bfloat16"),
    ("opt", "proj-dim", "float16"), ("falcon", "alibi", "bfloat16"),
])
def test_half_precision_checkpoints_keep_their_dtype(zoo, tmp_path, family, variant, dtype):
    path = resaved(zoo.path(family, variant), tmp_path / "m", dtype=dtype)
    model = load_model(path)
    want_dtype = DType.F16 if dtype == "float16" else DType.BF16
    assert {w.type.dtype for w in model.module.weights} == {want_dtype}
    assert rel_l2(picc_logits(model), reference_logits(path, IDS)) <= TOL
    save_picc(model, tmp_path / "m.picc")  # and they stay so in picc's own files
    again = load_model(tmp_path / "m.picc")
    assert again.module == model.module
    np.testing.assert_array_equal(picc_logits(again), picc_logits(model))


def mxfp4_checkpoints(src: Path, out: Path) -> tuple[Path, Path]:
    """gpt-oss ``src`` with its experts in MXFP4 as the released checkpoints store them
    (``quantization_config`` mxfp4; ``*_blocks`` and ``*_scales`` of the rows, HF's nibble
    order), and the float checkpoint of the same values (each expert's weights as the MXFP4 blocks
    decode, exactly) for transformers: the two, in that order."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from picc import quant

    packed, exact = out / "mxfp4", out / "exact"
    shutil.copytree(src, packed)
    shutil.copytree(src, exact)
    sd = load_file(str(src / "model.safetensors"))
    blocks_of, floats_of = {}, dict(sd)
    experts = [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for name in experts:
        w = sd[name].transpose(0, 2, 1)  # [experts, rows, cols]: the rows are the outputs
        e, rows, cols = w.shape
        raw = quant.quantize(np.ascontiguousarray(w).reshape(-1, cols), "mxfp4").reshape(-1, 17)
        elements = np.concatenate([raw[:, 1:] & 15, raw[:, 1:] >> 4], axis=1)  # ggml's: j, j + 16
        blocks_of[name + "_blocks"] = (elements[:, 0::2] | elements[:, 1::2] << 4).reshape(e, rows, cols // 32, 16)
        blocks_of[name + "_scales"] = np.ascontiguousarray(raw[:, 0]).reshape(e, rows, cols // 32)
        decoded = quant.dequantize(raw.reshape(e * rows, -1), "mxfp4", (e * rows, cols)).reshape(e, rows, cols)
        floats_of[name] = np.ascontiguousarray(decoded.transpose(0, 2, 1))
    save_file({k: v for k, v in sd.items() if k not in experts} | blocks_of, str(packed / "model.safetensors"),
              metadata={"format": "pt"})
    save_file(floats_of, str(exact / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (packed / "config.json").write_text(json.dumps(cfg))
    return packed, exact


def test_gpt_oss_mxfp4_experts_are_kept_as_they_are_stored(zoo, tmp_path):
    # The released gpt-oss checkpoints: experts in MXFP4 (quantization_config mxfp4), read into
    # mxfp4 matrices without a float step, gate and up split from their alternating rows; the logits
    # are transformers' on the float checkpoint of the same values (MXFP4 decodes exactly to f32).
    packed, exact = mxfp4_checkpoints(zoo.path("gpt_oss", "base"), tmp_path)
    model = load_model(packed)
    experts = {w.type.dtype for w in model.module.weights if w.name.endswith(("moe.up", "moe.gate", "moe.down"))}
    assert experts == {DType.MXFP4}
    assert rel_l2(picc_logits(model), reference_logits(exact, IDS)) <= TOL
    assert rel_l2(reference_logits(exact, IDS), reference_logits(zoo.path("gpt_oss", "base"), IDS)) > 1e-3


def write_tiny_tokenizer(directory: Path) -> None:
    """A toy BPE over a-z with a merge, BOS added by the post-processor (ids < 256)."""
    import json

    import tokenizers
    from tokenizers import models, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: len(vocab) + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    vocab["ab"] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def test_tokenizer_files_are_imported(zoo, tmp_path, capsys):
    assert zoo.load("llama", "gqa").tokenizer is None  # no tokenizer files, no tokenizer
    path = edited_copy(zoo.path("llama", "gqa"), tmp_path / "m")
    write_tiny_tokenizer(path)
    model = load_model(path)
    prompt = model.tokenizer.encode("abc cab")
    assert prompt[0] == 1 and len(prompt) == 6  # <s> ab c ' ' c ab
    assert picc_main(["generate", str(path), "-p", "abc cab", "-n", "6", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == prompt
    want = reference_greedy(path, prompt, 6)
    n = len(out["tokens"])  # generation stops after EOS (id 2), like transformers
    assert out["tokens"] == want[:n] and (n == 6 or want[n - 1] == 2)


# ---------------------------------------------------------------- generation and the CLI

GREEDY = [("llama", "gqa"), ("mistral", "sliding-window"), ("qwen2", "sliding"), ("opt", "proj-dim"),
          ("deepseek_v3", "base"), ("glm4_moe_lite", "base"), ("glm4_moe", "base"),
          ("falcon", "alibi-24heads")]


@pytest.mark.parametrize("family,variant", GREEDY)
def test_greedy_decoding_with_kv_cache_matches_transformers(zoo, family, variant):
    """Prefill then decode one token at a time against transformers recomputing the prefix:
    checks the KV cache, windows past their length and ALiBi at later positions."""
    prompt = IDS[:6]
    got = list(generate_ids(zoo.load(family, variant), prompt, 10, stop_at_eos=False))
    assert got == reference_greedy(zoo.path(family, variant), prompt, 10)


@pytest.mark.parametrize("family,variant", [("qwen2", "sliding"), ("falcon", "alibi-24heads"),
                                            ("opt", "no-affine")])
def test_cli_logits(zoo, tmp_path, family, variant):
    out = tmp_path / "logits.npy"
    args = ["logits", str(zoo.path(family, variant)), "--tokens", ",".join(map(str, IDS)), "--out", str(out)]
    assert picc_main(args) == 0
    assert rel_l2(np.load(out), reference_logits(zoo.path(family, variant), IDS)) <= TOL


@pytest.mark.parametrize("family,variant", [("llama", "rope-llama3"), ("opt", "post-ln"), ("opt", "no-affine"),
                                            ("falcon", "new-arch-1ln")])
def test_cli_import_opt_logits(zoo, tmp_path, family, variant):
    """import -> opt canonicalize,dce -> logits: the .picc round trip keeps the model intact."""
    src = zoo.path(family, variant)
    a, b, out = tmp_path / "a.picc", tmp_path / "b.picc", tmp_path / "l.npy"
    assert picc_main(["import", str(src), "-o", str(a)]) == 0
    assert picc_main(["opt", str(a), "-p", "canonicalize,dce", "-o", str(b)]) == 0
    assert print_module(load_model(b).module) == print_module(zoo.load(family, variant).module)
    assert picc_main(["logits", str(b), "--tokens", ",".join(map(str, IDS)), "--out", str(out)]) == 0
    assert rel_l2(np.load(out), reference_logits(src, IDS)) <= TOL
