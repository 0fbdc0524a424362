"""Hugging Face checkpoint directories (config.json + safetensors, optional tokenizer) as picc IR.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, OPTForCausalLM and
FalconForCausalLM, read exactly as transformers 5.x reads them (defaults, legacy keys, quirks:
see docs/hf_semantics.md). Each family's config is read completely before any weight is
touched, so a bad config is reported as such. Weights keep their stored dtype; names are mapped
to picc's (``l3.attn.q``, ``l3.ffn.up``, ...); Falcon's fused ``query_key_value`` is split into
q, k and v here.

Where transformers would run something other than the checkpoint (an untied model without
``lm_head.weight`` gets a random head; a missing tensor is randomly initialised) or crash later,
picc refuses with a one-line ``PiccError`` instead.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from picc import quant
from picc.errors import PiccError
from picc.frontend.falcon import FalconSpec, build_falcon, fused_qkv_rows
from picc.frontend.hf_checkpoint import Checkpoint
from picc.frontend.hf_config import HFConfig, ffn_form, rope_from_config, rope_parameters
from picc.frontend.llama import LlamaSpec, MlaSpec, MoeSpec, RopeSpec, build_llama, layer_weight_names, longrope_notes
from picc.frontend.model import LoadedModel
from picc.frontend.opt import UNIT_NORM, OptSpec, build_opt
from picc.ir.module import Module
from picc.ir.positional import yarn_mscale
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "opt": "OPTForCausalLM",
    "falcon": "FalconForCausalLM",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_hf(path: Path) -> LoadedModel:
    """Import the Hugging Face checkpoint directory ``path``."""
    path = Path(path)
    cfg = HFConfig.read(path)
    supported = ", ".join(f"{a} (model_type {t!r})" for t, a in ARCHITECTURES.items())
    model_type = cfg.raw.get("model_type")
    if model_type is None:
        raise PiccError(f"{cfg.path}: required field 'model_type' is missing (supported: {supported})")
    if model_type not in ARCHITECTURES:
        archs = cfg.raw.get("architectures")
        named = f" ({', '.join(map(str, archs))})" if isinstance(archs, list) and archs else ""
        raise PiccError(f"{cfg.path}: model_type {json.dumps(model_type)}{named} is not supported "
                        f"(supported: {supported})")
    quant = cfg.raw.get("quantization_config")
    mxfp4 = model_type == "gpt_oss" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    if quant and not mxfp4:  # gpt-oss's MXFP4 experts are kept as they are (_gpt_oss_experts)
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise PiccError(f"{cfg.path}: quantized checkpoints (quantization_config, method "
                        f"{method!r}) are not supported; picc imports f32, f16 and bf16 weights")
    name = re.sub(r"[^\w.]", "_", path.resolve().name) or "model"
    importer = _llama_family if model_type in LLAMA_FAMILIES else {"opt": _opt, "falcon": _falcon,
                                                                    "gemma3": _gemma3_text_of}[model_type]
    module, store = importer(cfg, path, name)
    notes = longrope_notes(module)
    tokenizer = None
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        from picc.frontend.tokenizer import tokenizer_from_hf_dir

        tokenizer = tokenizer_from_hf_dir(path)
    return LoadedModel(module, store, tokenizer, source=str(path), notes=notes)


# ---------------------------------------------------------------- shared helpers


def _prefix(ckpt: Checkpoint, full: str, base: str, probe: str) -> str:
    """The name prefix of the checkpoint's tensors: the task model's, or the base model's.

    transformers also loads checkpoints saved from the base model (``layers.0...`` instead of
    ``model.layers.0...``; older OPT files use ``decoder.``). The full prefix is the default, so
    that a tensor missing from both forms is reported under its usual name.
    """
    if any(n.startswith(full) for n in ckpt.names) or base + probe not in ckpt:
        return full
    return base


def _lm_head(ckpt: Checkpoint, store: WeightStore, shape: tuple[int, int], tie: bool) -> bool:
    """Add ``output`` from ``lm_head.weight`` when the file has it; True when tied instead.

    transformers 5.x uses a stored ``lm_head.weight`` even when ``tie_word_embeddings`` is true,
    and ties only when it is absent.
    """
    if "lm_head.weight" in ckpt:
        store.add("output", ckpt.tensor("lm_head.weight", shape))
        return False
    if tie:
        return True
    raise PiccError(f"{ckpt.directory}: tensor 'lm_head.weight' is {ckpt.where('lm_head.weight')} "
                    "and tie_word_embeddings is false; transformers would initialise the head at "
                    "random, picc refuses")


def special_ids(cfg: HFConfig, directory: Path, bos: int | None,
                 eos: int | None) -> tuple[int | None, int | None]:
    """BOS and EOS ids as ``generate`` uses them: generation_config.json first, then config.json
    (with the class defaults ``bos`` / ``eos``). For a list of EOS ids the first is kept."""
    ids = (cfg.token_id("bos_token_id", bos), cfg.token_id("eos_token_id", eos))
    gen_path = directory / "generation_config.json"
    if not gen_path.is_file():
        return ids
    gen = HFConfig.read_json(gen_path)
    return (gen.token_id("bos_token_id", ids[0]), gen.token_id("eos_token_id", ids[1]))


# ---------------------------------------------------------------- LLaMA, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3

@dataclass(frozen=True, slots=True)
class LlamaFamily:
    """What sets a LLaMA-like family apart at import: its transformers config class's defaults,
    which biases it has, and the parts of the layer only it has (sliding windows: ``_windows``)."""

    kv_heads: int | None  # num_key_value_heads' default (None: num_attention_heads)
    max_position: int  # max_position_embeddings' default
    special_ids: tuple[int | None, int | None]  # bos_token_id's and eos_token_id's defaults
    tied: bool = False  # tie_word_embeddings' default
    eps: float = 1e-6  # rms_norm_eps' default
    head_dim: int | None = None  # head_dim's default (None: hidden_size / num_attention_heads)
    attn_bias: bool = False  # attention_bias puts biases on q, k, v and o
    qkv_bias: bool = False  # q, k and v always have biases, o never
    mlp_bias: bool = False  # mlp_bias puts biases on gate, up and down
    qk_norm: bool = False  # each head's q and k RMS-normalised before the rope (Qwen3)
    partial_rope: bool = False  # default rope honours partial_rotary_factor (Phi-3)
    fused: bool = False  # qkv_proj and gate_up_proj instead of q/k/v_proj and gate/up_proj (Phi-3)
    gemma: bool = False  # Gemma's layer: norms of 1 + w, four a layer, the embedding scaled, q . k scaled its way
    olmo: bool = False  # OLMo 2's layer: the attention's and the MLP's outputs normalised, not their inputs
    qk_norm_whole: bool = False  # q's and k's norms over the whole projection (OLMo 2, OLMoE)
    moe: bool = False  # experts in place of the MLP (``moe_spec``)
    ernie: bool = False  # ERNIE 4.5: interleaved rope pairs (gptj), use_bias for every projection's bias
    mla: bool = False  # DeepSeek V2/V3's latent attention (``_mla_spec``); attention_bias: on q_a, kv_a and o


LLAMA_FAMILIES = {
    "llama": LlamaFamily(None, 2048, (1, 2), attn_bias=True, mlp_bias=True),
    "mistral": LlamaFamily(8, 131072, (1, 2)),  # no biases, whatever the config says
    "mixtral": LlamaFamily(8, 131072, (1, 2), eps=1e-5, moe=True),
    "qwen2": LlamaFamily(32, 32768, (None, None), qkv_bias=True),
    "qwen3": LlamaFamily(32, 32768, (None, None), head_dim=128, attn_bias=True, qk_norm=True),
    "qwen3_moe": LlamaFamily(4, 32768, (None, None), attn_bias=True, qk_norm=True, moe=True),
    "qwen2_moe": LlamaFamily(16, 32768, (None, None), qkv_bias=True, moe=True),  # qkv_bias: the config's, default true
    "olmoe": LlamaFamily(None, 4096, (None, 50279), eps=1e-5, attn_bias=True, qk_norm=True, qk_norm_whole=True,
                         moe=True),
    "phi3": LlamaFamily(None, 4096, (1, 32000), eps=1e-5, partial_rope=True, fused=True),
    "smollm3": LlamaFamily(4, 32768, (128000, 128001), tied=True, attn_bias=True, mlp_bias=True),
    "granite": LlamaFamily(None, 2048, (1, 2), attn_bias=True, mlp_bias=True),
    "granitemoe": LlamaFamily(None, 2048, (1, 2), attn_bias=True, moe=True),
    "olmo2": LlamaFamily(None, 2048, (None, 50279), eps=1e-5, attn_bias=True, qk_norm=True, qk_norm_whole=True,
                         olmo=True),
    "olmo3": LlamaFamily(None, 2048, (None, 50279), eps=1e-5, attn_bias=True, qk_norm=True, qk_norm_whole=True,
                         olmo=True),
    "gemma2": LlamaFamily(4, 8192, (2, 1), tied=True, head_dim=256, attn_bias=True, gemma=True),
    "gemma3_text": LlamaFamily(4, 131072, (2, 1), tied=True, head_dim=256, attn_bias=True, qk_norm=True, gemma=True),
    "gpt_oss": LlamaFamily(8, 131072, (None, None), eps=1e-5, head_dim=64, attn_bias=True, moe=True),
    "ernie4_5": LlamaFamily(2, 131072, (1, 2), tied=True, eps=1e-5, head_dim=128, ernie=True),
    "ernie4_5_moe": LlamaFamily(4, 131072, (1, 2), tied=True, eps=1e-5, moe=True, ernie=True),
    "deepseek_v2": LlamaFamily(None, 2048, (1, 2), attn_bias=True, moe=True, mla=True),
    "deepseek_v3": LlamaFamily(None, 4096, (0, 1), attn_bias=True, moe=True, mla=True),
    "glm4_moe_lite": LlamaFamily(None, 202752, (0, 1), eps=1e-5, attn_bias=True, moe=True, mla=True),
    # GLM-4.5: attention_bias on q, k and v only (``_llama_family``), use_qk_norm, half the head rotated
    "glm4_moe": LlamaFamily(8, 131072, (None, None), eps=1e-5, partial_rope=True, moe=True),
}
GLM4_MOE_DEFAULTS = {"partial_rotary_factor": 0.5}  # Glm4MoeConfig.__post_init__'s


def qwen2_windows(cfg: HFConfig, n_layers: int) -> tuple[int | None, ...]:
    """Qwen2's and Qwen3's per-layer sliding windows (``Qwen2Config.__post_init__``).

    ``use_sliding_window: false`` nulls ``sliding_window`` (real Qwen2 configs carry a window
    they do not use); without ``layer_types``, layers from ``max_window_layers`` on slide.
    """
    window = cfg.opt_integer("sliding_window", 4096) if cfg.flag("use_sliding_window", False) else None
    types = cfg.raw.get("layer_types")
    if types is None:
        first = cfg.integer("max_window_layers", 28, minimum=0)
        return tuple(window if window is not None and i >= first else None for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers:
        raise cfg.bad("layer_types", types, f"a list of {n_layers} layer types (num_hidden_layers)")
    known = {"full_attention": None, "attention": None, "sliding_attention": window}
    for t in types:
        if t not in known:
            raise PiccError(f"{cfg.path}: layer type {json.dumps(t)} is not supported for {cfg.raw['model_type']} "
                            "(supported: full_attention, sliding_attention)")
    if "sliding_attention" in types and window is None:
        raise PiccError(f"{cfg.path}: layer_types has sliding_attention layers but no window "
                        "(use_sliding_window is false or sliding_window is null); transformers "
                        "cannot run this either")
    return tuple(known[t] for t in types)


def smollm3_layers(cfg: HFConfig, n_layers: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """SmolLM3's per-layer rope and sliding windows (``SmolLM3Config.__post_init__``): a layer
    rotates q and k where ``no_rope_layers`` says 1 (default: all but every
    ``no_rope_layer_interval``-th); it slides where ``layer_types`` says so, by default the layers
    without rope when ``use_sliding_window`` is true."""
    flags = cfg.raw.get("no_rope_layers")
    if flags is None:
        interval = cfg.integer("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) for f in flags):
        raise cfg.bad("no_rope_layers", flags, f"a list of {n_layers} zeros and ones (num_hidden_layers)")
    window = cfg.opt_integer("sliding_window", None) if cfg.flag("use_sliding_window", False) else None
    types = cfg.raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and not f else "full_attention" for f in flags]
    known = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
        raise cfg.bad("layer_types", types, f"a list of {n_layers} of {', '.join(known)}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return tuple(bool(f) for f in flags), windows if any(w is not None for w in windows) else ()


def _windows(cfg: HFConfig, family: str, n_layers: int) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """Each layer's sliding window (empty: none anywhere) and whether it rotates q and k (empty:
    all do). Llama ignores sliding_window; Mistral slides every layer (default 4096), Phi-3 too
    (default none); Qwen2 and 3 per layer; SmolLM3 per layer, and leaves the rope out of some;
    Gemma 2 and 3 per layer type."""
    windows: tuple[int | None, ...] = ()
    if family in ("mistral", "mixtral", "phi3"):
        window = cfg.opt_integer("sliding_window", 4096 if family == "mistral" else None)
        windows = (window,) * n_layers if window is not None else ()
    elif family == "qwen2_moe":
        if cfg.flag("use_sliding_window", False):
            raise PiccError(f"{cfg.path}: use_sliding_window is not supported for qwen2_moe (the released models do "
                            "not slide)")
    elif family == "qwen3_moe":  # every layer slides where use_sliding_window says so (Qwen3MoeConfig)
        window = cfg.opt_integer("sliding_window", 4096) if cfg.flag("use_sliding_window", False) else None
        windows = (window,) * n_layers if window is not None else ()
    elif family in ("qwen2", "qwen3"):
        windows = qwen2_windows(cfg, n_layers)
        windows = windows if any(w is not None for w in windows) else ()
    elif family == "smollm3":
        rope_layers, windows = smollm3_layers(cfg, n_layers)
        return windows, rope_layers
    elif family in ("gemma2", "gemma3_text", "gpt_oss", "olmo3"):
        types = gemma_layer_types(cfg, n_layers)
        window = cfg.opt_integer("sliding_window", 128 if family == "gpt_oss" else 4096)
        if window is None and "sliding_attention" in types:
            raise PiccError(f"{cfg.path}: layer_types has sliding_attention layers but sliding_window is null; "
                            "transformers cannot run this either")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        windows = windows if any(w is not None for w in windows) else ()
    return windows, ()


def gemma_layer_types(cfg: HFConfig, n_layers: int) -> list[str]:
    """``layer_types``, or every ``pattern``-th layer full and the others sliding: Gemma 2's and
    gpt-oss's every second (``Gemma2Config.__post_init__``, ``GptOssConfig``'s), OLMo 3's every
    fourth, Gemma 3's every ``sliding_window_pattern``-th (hub configs;
    ``Gemma3TextConfig.__post_init__``, default 6)."""
    types = cfg.raw.get("layer_types")
    if types is None:
        fixed = {"gemma2": 2, "gpt_oss": 2, "olmo3": 4}.get(cfg.raw["model_type"])
        pattern = fixed or cfg.integer("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    known = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
        raise cfg.bad("layer_types", types, f"a list of {n_layers} of {', '.join(known)}")
    return types


def gemma3_ropes(cfg: HFConfig, head_dim: int, max_position: int, n_layers: int) -> tuple[RopeSpec, ...]:
    """Each layer's rope (``Gemma3TextConfig.convert_rope_params_to_dict``): one per layer type,
    ``rope_parameters`` nested by type, or (hub configs) ``rope_theta`` (default 1e6) and
    ``rope_scaling`` for the full-attention layers and ``rope_local_base_freq`` (default 1e4) for
    the sliding ones."""
    params = cfg.raw.get("rope_parameters")
    if params is None:
        legacy = cfg.raw.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise cfg.bad("rope_scaling", legacy, "an object or null")
        params = {"full_attention": {"rope_type": "default", "rope_theta": cfg.raw.get("rope_theta", 1e6), **legacy},
                  "sliding_attention": {"rope_type": "default", "rope_theta": cfg.raw.get("rope_local_base_freq", 1e4)}}
    if not isinstance(params, dict) or set(params) != {"full_attention", "sliding_attention"}:
        raise cfg.bad("rope_parameters", params, "an object of full_attention and sliding_attention rope parameters")
    return _ropes_by_layer_type(cfg, params, {"full_attention": 1e6, "sliding_attention": 1e4}, head_dim,
                                max_position, n_layers)


def _ropes_by_layer_type(cfg: HFConfig, params: dict, thetas: dict[str, float], head_dim: int, max_position: int,
                         n_layers: int) -> tuple[RopeSpec, ...]:
    """Each layer's rope from ``params`` nested by layer type (a type it lacks: default rope), a
    type's ``rope_theta`` defaulting to ``thetas``' (the config class's)."""
    ropes = {}
    for kind, default in thetas.items():
        one = params.get(kind) or {"rope_type": "default"}
        if not isinstance(one, dict):
            raise cfg.bad(f"rope_parameters.{kind}", one, "an object")
        one = {"rope_theta": default, **one}
        ropes[kind] = rope_from_config(HFConfig(cfg.path, {"rope_parameters": one}), head_dim, max_position)
    return tuple(ropes[t] for t in gemma_layer_types(cfg, n_layers))


OLMO3_THETA = 500000.0  # Olmo3Config.default_theta


def olmo3_ropes(cfg: HFConfig, head_dim: int, max_position: int, n_layers: int) -> tuple[RopeSpec, ...]:
    """Each layer's rope (``Olmo3Config.convert_rope_params_to_dict``): one per layer type,
    ``rope_parameters`` nested by type, or (hub configs) ``rope_scaling`` on the full-attention
    layers only with ``rope_theta`` there; a type that names no theta takes 500000 (as
    transformers does: it pops ``rope_theta`` for the full layers before it looks for the sliding
    ones')."""
    params = cfg.raw.get("rope_parameters")
    if params is None:
        legacy = cfg.raw.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise cfg.bad("rope_scaling", legacy, "an object or null")
        params = {"full_attention": {"rope_type": "default", **legacy,
                                     "rope_theta": cfg.raw.get("rope_theta", OLMO3_THETA)}}
    if not isinstance(params, dict) or not set(params) <= {"full_attention", "sliding_attention"}:
        raise cfg.bad("rope_parameters", params, "an object of full_attention and sliding_attention rope parameters")
    return _ropes_by_layer_type(cfg, params, {"full_attention": OLMO3_THETA, "sliding_attention": OLMO3_THETA},
                                head_dim, max_position, n_layers)


def _llama_family(cfg: HFConfig, directory: Path, name: str,
                  prefixes: tuple[str, ...] = ()) -> tuple[Module, WeightStore]:
    """A LLaMA-like family's model; ``prefixes``: where its tensors may be (the first that holds
    the embedding), instead of ``model.`` or none."""
    family = str(cfg.raw["model_type"])
    rules = LLAMA_FAMILIES[family]
    if family == "gemma3_text":
        cfg = HFConfig(cfg.path, {**GEMMA3_TEXT_DEFAULTS, **cfg.raw})
    if family == "glm4_moe":
        cfg = HFConfig(cfg.path, {**GLM4_MOE_DEFAULTS, **cfg.raw})
    vocab, hidden = cfg.integer("vocab_size"), cfg.integer("hidden_size")
    n_layers, n_heads = cfg.integer("num_hidden_layers"), cfg.integer("num_attention_heads")
    n_ff = cfg.integer("intermediate_size")
    n_kv = cfg.opt_integer("num_key_value_heads", rules.kv_heads) or n_heads
    if family in ("llama", "gemma2") and hidden % n_heads:
        raise PiccError(f"{cfg.path}: hidden_size {hidden} is not a multiple of num_attention_heads "
                        f"{n_heads} ({ARCHITECTURES[family].removesuffix('ForCausalLM')}Config requires it, "
                        "even with head_dim)")
    if n_heads % n_kv:
        raise PiccError(f"{cfg.path}: num_attention_heads {n_heads} is not a multiple of "
                        f"num_key_value_heads {n_kv}")
    head_dim = cfg.opt_integer("head_dim", rules.head_dim) or hidden // n_heads
    mla = _mla_spec(cfg, family) if rules.mla else None
    if mla is not None:  # a head's q and k: its rotated features and the others; as many K/V heads as q's
        n_kv, head_dim = n_heads, mla.qk_dim
    max_position = cfg.integer("max_position_embeddings", rules.max_position)
    windows, rope_layers = _windows(cfg, family, n_layers)
    attn_bias = rules.attn_bias and cfg.flag("attention_bias", family == "gpt_oss")
    if rules.ernie:  # one key for every projection's bias (the released models have none)
        attn_bias = cfg.flag("use_bias", False)
        if attn_bias and rules.moe:
            raise PiccError(f"{cfg.path}: use_bias with experts is not supported (the experts have no biases there)")
    qkv_bias = attn_bias or (cfg.flag("qkv_bias", True) if family == "qwen2_moe" else rules.qkv_bias)
    if family == "glm4_moe":  # attention_bias: on q, k and v, never o
        qkv_bias = cfg.flag("attention_bias", False)
    mlp_bias = rules.mlp_bias and cfg.flag("mlp_bias", False) or rules.ernie and attn_bias
    if family == "deepseek_v2" and cfg.flag("mlp_bias", False):
        raise PiccError(f"{cfg.path}: mlp_bias with experts is not supported (the released DeepSeek-V2 models "
                        "have none)")
    bos, eos = special_ids(cfg, directory, *rules.special_ids)
    tie = cfg.flag("tie_word_embeddings", rules.tied)
    layer: dict = dict(sandwich=True, pre_norm=False) if rules.olmo else {}  # the family's own layer
    if rules.gemma:  # soft caps: Gemma 2's; Gemma 3 caps the logits where its config says so
        _refuse_gemma_options(cfg)  # and never the scores (transformers' Gemma3Attention ignores its cap)
        two = family == "gemma2"
        layer = dict(sandwich=True, attn_softcap=_softcap(cfg, "attn_logit_softcapping", 50.0) if two else None,
                     logit_softcap=_softcap(cfg, "final_logit_softcapping", 30.0 if two else None))
    if family == "gemma3_text":
        ropes = gemma3_ropes(cfg, head_dim, max_position, n_layers)
        layer.update(layer_ropes=ropes, attn_scale=cfg.number("query_pre_attn_scalar", 256.0) ** -0.5)
        rope = ropes[0]
    elif family == "olmo3":
        ropes = olmo3_ropes(cfg, head_dim, max_position, n_layers)
        layer.update(layer_ropes=ropes)
        rope = ropes[0]
    elif mla is not None:  # the rope of the rotated features alone
        rope = rope_from_config(cfg, mla.rope_dim, max_position)
        layer.update(mla=mla, attn_scale=_mla_scale(cfg, mla.qk_dim))
    else:
        rope = rope_from_config(cfg, head_dim, max_position, partial=rules.partial_rope)
    # rotate_half over interleaved pairs (2i, 2i + 1), each at frequency i: ERNIE's; DeepSeek V2's
    # complex rotation of pairs; V3's (and GLM-4.7-Flash's) where rope_interleave, as released
    if rules.ernie or family == "deepseek_v2" or mla is not None and cfg.flag("rope_interleave", True):
        rope = replace(rope, style="gptj")
    if family == "gemma2":  # Gemma 3's layer with one rope and no q and k norms
        layer.update(attn_scale=cfg.integer("query_pre_attn_scalar", 256) ** -0.5)
    act = ("hidden_activation", "gelu_pytorch_tanh") if rules.gemma else ("hidden_act", "silu")
    if family in DEEPSEEK_MOE:
        moe = deepseek_moe_spec(cfg, family, n_layers)
    else:
        moe = moe_spec(cfg, family, n_layers) if rules.moe else None
    spec = LlamaSpec(
        name=name, arch=family, vocab=vocab, hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, n_ff=n_ff, eps=cfg.number("rms_norm_eps", rules.eps),
        ffn_form=ffn_form(cfg, *act, gated=True), rope=rope, tied=False, window=windows, **layer,
        bos_id=bos, eos_id=eos, max_position=max_position, rope_layers=rope_layers,
        qk_norm=rules.qk_norm or family == "glm4_moe" and cfg.flag("use_qk_norm", False),
        qk_norm_whole=rules.qk_norm_whole, moe=moe,
        attn_sinks=family == "gpt_oss",
    )

    logits_scaling = 1.0
    if family in ("granite", "granitemoe"):
        spec, logits_scaling = _granite(cfg, spec)

    ckpt = Checkpoint(directory)
    if prefixes:
        p = next((pre for pre in prefixes if pre + "embed_tokens.weight" in ckpt), prefixes[0])
    else:
        p = _prefix(ckpt, "model.", "", "embed_tokens.weight")
    store = WeightStore()

    def add(picc: str, hf: str, shape: tuple[int, ...]) -> None:
        store.add(picc, ckpt.tensor(p + hf, shape))

    def norm(picc: str, hf: str, shape: tuple[int, ...]) -> None:
        """A norm's weight: Gemma's multiply by 1 + w, in f32 as its forward computes it; the
        final norm's divided by Granite's logits_scaling."""
        w = ckpt.tensor(p + hf, shape)
        if rules.gemma:
            w = Tensor.from_f32(1.0 + w.to_f32())
        elif picc == "output_norm" and logits_scaling != 1.0:
            w = Tensor.from_f32(w.to_f32() / np.float32(logits_scaling))
        store.add(picc, w)

    def split(hf: str, shape: tuple[int, ...], parts: tuple[tuple[str, int], ...]) -> None:
        """A fused matrix (Phi-3's qkv_proj, gate_up_proj) as its parts' rows, in order."""
        fused, start = ckpt.tensor(p + hf, shape), 0
        for picc, rows in parts:
            store.add(picc, fused.take_rows(np.arange(start, start + rows)))
            start += rows

    def experts(n: dict[str, str], mlp: str) -> None:
        """A layer's router (``gate``) and its experts' matrices, each stacked into one (Mixtral's
        w1, w3 and w2 are the gate, up and down projections; Granite-MoE's are 3-D already)."""
        assert spec.moe is not None
        e_ff, count = spec.moe.n_ff, spec.moe.n_experts
        if family == "gpt_oss":
            _gpt_oss_experts(ckpt, store, n, p + mlp, spec.moe, hidden)
            return
        if family == "granitemoe":  # input_linear: each expert's gate rows, then its up rows
            add(n["router"], mlp + "router.layer.weight", (count, hidden))
            both = ckpt.tensor(f"{p}{mlp}input_linear.weight", (count, 2 * e_ff, hidden))
            rows = Tensor(both.dtype, (count * 2 * e_ff, hidden), np.asarray(both.data).reshape(count * 2 * e_ff, -1))
            first = np.arange(count)[:, None] * 2 * e_ff + np.arange(e_ff)[None, :]
            store.add(n["experts_gate"], rows.take_rows(first.reshape(-1)))
            store.add(n["experts_up"], rows.take_rows((first + e_ff).reshape(-1)))
            down = ckpt.tensor(f"{p}{mlp}output_linear.weight", (count, hidden, e_ff))
            store.add(n["experts_down"], Tensor(down.dtype, (count * hidden, e_ff),
                                                np.asarray(down.data).reshape(count * hidden, -1)))
            return
        router = ckpt.tensor(p + mlp + "gate.weight", (spec.moe.n_experts, hidden))
        if spec.moe.shared_gated:  # Qwen2-MoE: the shared expert's gate is the router's last row
            router = Tensor.stacked([router, ckpt.tensor(p + mlp + "shared_expert_gate.weight", (1, hidden))])
        store.add(n["router"], router)
        if spec.moe.choice_bias:  # ERNIE 4.5's, DeepSeek V3's and GLM-4.5's
            bias = ckpt.tensor(p + mlp + "moe_statics.e_score_correction_bias", (1, spec.moe.n_experts)) \
                if rules.ernie else ckpt.tensor(p + mlp + "gate.e_score_correction_bias", (spec.moe.n_experts,))
            store.add(n["router_choice_bias"],
                      Tensor(bias.dtype, (spec.moe.n_experts,), np.asarray(bias.data).reshape(-1)))
        shared_name = "shared_expert" if family == "qwen2_moe" else "shared_experts"
        gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        matrices = (("experts_gate", gate, (e_ff, hidden)), ("experts_up", up, (e_ff, hidden)),
                    ("experts_down", down, (hidden, e_ff)))
        shared = spec.moe.n_shared * e_ff
        for key, proj, shape in matrices:
            parts = [ckpt.tensor(f"{p}{mlp}experts.{e}.{proj}.weight", shape) for e in range(spec.moe.n_experts)]
            if shared and proj == "down_proj":  # the shared expert's columns, n_ff at a time, as experts' rows
                whole = ckpt.tensor(f"{p}{mlp}{shared_name}.{proj}.weight", (hidden, shared))
                parts.append(whole.column_pieces(spec.moe.n_shared))
            elif shared:  # its rows, n_ff at a time, are experts' already
                parts.append(ckpt.tensor(f"{p}{mlp}{shared_name}.{proj}.weight", (shared, hidden)))
            store.add(n[key], Tensor.stacked(parts))

    def latent_attention(n: dict[str, str], attn: str) -> None:
        """A latent attention's matrices as ``picc.frontend.llama.MlaSpec`` reads them: the query's
        rows each head's rotated ones first; ``kv_a_proj_with_mqa``'s rows as the latent's and the
        shared rotated key's; ``kv_b_proj``'s, each head's k_nope then its v, as k's and v's."""
        assert mla is not None
        qk, kv_rank = mla.qk_dim, mla.kv_rank
        if mla.q_rank is None:
            q = ckpt.tensor(p + attn + "q_proj.weight", (n_heads * qk, hidden))
        else:
            add(n["q_a"], attn + "q_a_proj.weight", (mla.q_rank, hidden))
            if attn_bias:
                add(n["q_a_bias"], attn + "q_a_proj.bias", (mla.q_rank,))
            add(n["q_a_norm"], attn + "q_a_layernorm.weight", (mla.q_rank,))
            q = ckpt.tensor(p + attn + "q_b_proj.weight", (n_heads * qk, mla.q_rank))
        store.add(n["q"], mla.query_rows(q, n_heads))
        kv_a_name = p + attn + "kv_a_proj_with_mqa."
        parts = [("", ckpt.tensor(kv_a_name + "weight", (kv_rank + mla.rope_dim, hidden)))]
        if attn_bias:
            parts.append(("_bias", ckpt.tensor(kv_a_name + "bias", (kv_rank + mla.rope_dim,))))
        for suffix, kv_a in parts:
            latent, shared = mla.latent_parts(kv_a)
            store.add(n["kv_a" + suffix], latent)
            store.add(n["k_pe" + suffix], shared)
        add(n["kv_a_norm"], attn + "kv_a_layernorm.weight", (kv_rank,))
        kv_b = ckpt.tensor(p + attn + "kv_b_proj.weight", (n_heads * (mla.nope_dim + mla.v_dim), kv_rank))
        k_nope, v = mla.kv_b_parts(kv_b, n_heads)
        store.add(n["k"], k_nope)
        store.add(n["v"], v)

    add("token_embd", "embed_tokens.weight", (vocab, hidden))
    q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
    o_cols = n_heads * mla.v_dim if mla is not None else q_rows
    for i in range(n_layers):
        n, hf = layer_weight_names(i), f"layers.{i}."
        if spec.pre_norm:
            norm(n["attn_norm"], hf + "input_layernorm.weight", (hidden,))
        projections = (("q", "q_proj", q_rows), ("k", "k_proj", kv_rows), ("v", "v_proj", kv_rows))
        if mla is not None:
            latent_attention(n, hf + "self_attn.")
            projections = ()
        if rules.fused:  # one qkv_proj: q's rows, k's, v's
            split(hf + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden),
                  tuple((n[key], rows) for key, _, rows in projections))
            projections = ()
        for key, proj, rows in projections:
            add(n[key], f"{hf}self_attn.{proj}.weight", (rows, hidden))
            if qkv_bias:
                add(n[f"{key}_bias"], f"{hf}self_attn.{proj}.bias", (rows,))
        if spec.qk_norm:
            norm(n["q_norm"], hf + "self_attn.q_norm.weight", (q_rows if spec.qk_norm_whole else head_dim,))
            norm(n["k_norm"], hf + "self_attn.k_norm.weight", (kv_rows if spec.qk_norm_whole else head_dim,))
        add(n["o"], hf + "self_attn.o_proj.weight", (hidden, o_cols))
        if spec.attn_sinks:
            add(n["sinks"], hf + "self_attn.sinks", (n_heads,))
        if attn_bias:
            add(n["o_bias"], hf + "self_attn.o_proj.bias", (hidden,))
        if spec.sandwich:  # post_attention_layernorm is the attention's output norm
            norm(n["post_attn_norm"], hf + "post_attention_layernorm.weight", (hidden,))
            if spec.pre_norm:
                norm(n["ffn_norm"], hf + "pre_feedforward_layernorm.weight", (hidden,))
            norm(n["post_ffn_norm"], hf + "post_feedforward_layernorm.weight", (hidden,))
        else:
            add(n["ffn_norm"], hf + "post_attention_layernorm.weight", (hidden,))
        if spec.moe is not None and (not spec.moe.layers or spec.moe.layers[i]):
            experts(n, hf + ("block_sparse_moe." if family in ("mixtral", "granitemoe") else "mlp."))
            continue
        mlp = (("gate", "gate_proj", (n_ff, hidden)), ("up", "up_proj", (n_ff, hidden)),
               ("down", "down_proj", (hidden, n_ff)))
        if rules.fused:  # one gate_up_proj: the gate's rows, then up's
            split(hf + "mlp.gate_up_proj.weight", (2 * n_ff, hidden), ((n["gate"], n_ff), (n["up"], n_ff)))
            mlp = mlp[2:]
        for key, proj, shape in mlp:
            add(n[key], f"{hf}mlp.{proj}.weight", shape)
            if mlp_bias:
                add(n[f"{key}_bias"], f"{hf}mlp.{proj}.bias", shape[:1])
    norm("output_norm", "norm.weight", (hidden,))
    spec = replace(spec, tied=_lm_head(ckpt, store, (vocab, hidden), tie))
    if rules.gemma:
        spec = replace(spec, embed_scale=_gemma_embed_scale(hidden, store["token_embd"].dtype))
    return build_llama(spec, store), store


DEEPSEEK_MOE = ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite")  # routed as DeepSeek routes


def _mla_spec(cfg: HFConfig, family: str) -> MlaSpec:
    """A DeepSeek V2/V3 (or GLM-4.7-Flash) config's latent attention (``MlaSpec``)."""
    defaults = {"deepseek_v2": (1536, 128), "deepseek_v3": (1536, 128), "glm4_moe_lite": (768, 192)}[family]
    rope_dim = cfg.integer("qk_rope_head_dim", 64)
    if rope_dim % 2:
        raise PiccError(f"{cfg.path}: qk_rope_head_dim {rope_dim} is odd; rotary embeddings need an even one")
    return MlaSpec(q_rank=cfg.opt_integer("q_lora_rank", defaults[0]), kv_rank=cfg.integer("kv_lora_rank", 512),
                   nope_dim=cfg.integer("qk_nope_head_dim", defaults[1]), rope_dim=rope_dim,
                   v_dim=cfg.integer("v_head_dim", 256 if family == "glm4_moe_lite" else 128))


def _mla_scale(cfg: HFConfig, qk_dim: int) -> float:
    """A latent attention's scale (``yarn_apply_mscale``): ``qk_dim ** -0.5``, times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` where a rope other than the default has a
    non-zero ``mscale_all_dim`` (DeepSeek V3's yarn)."""
    _, params = rope_parameters(cfg)
    scale = qk_dim ** -0.5
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        mscale = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def deepseek_moe_spec(cfg: HFConfig, family: str, n_layers: int) -> MoeSpec:
    """The experts of a DeepSeek V2/V3 or GLM-4.5 config (``DeepseekV3TopkRouter``): each layer
    from ``first_k_dense_replace`` on (GLM-4.7-Flash: its ``mlp_layer_types``' "sparse" ones)
    runs ``n_routed_experts`` of ``moe_intermediate_size`` neurons, ``num_experts_per_tok`` a
    token, and ``n_shared_experts`` of the same width that every token takes (weight 1); the
    routed ones' weights are multiplied by ``routed_scaling_factor``.

    V2 scores by the router's softmax and takes the top k (``topk_method`` "greedy"), or first the
    ``topk_group`` of ``n_group`` groups whose best expert scores highest
    ("group_limited_greedy"); transformers never renormalises V2's weights, whatever
    ``norm_topk_prob`` says. V3 and GLM scores by the router's sigmoid, ranks by score plus
    ``e_score_correction_bias`` and limits groups by the sum of their best two's, renormalising
    where ``norm_topk_prob``."""
    v2 = family == "deepseek_v2"
    defaults = {"deepseek_v2": (64, None, 1407, 2, 1.0, 0), "deepseek_v3": (256, 8, 2048, 1, 2.5, 3),
                "glm4_moe": (128, 8, 1408, 1, 1.0, 1), "glm4_moe_lite": (64, 4, 1536, 1, 1.8, 1)}[family]
    n_experts_default, top_k_default, width_default, shared_default, scale_default, dense_default = defaults
    n_experts = cfg.integer("n_routed_experts", n_experts_default)
    top_k = cfg.integer("num_experts_per_tok", top_k_default)
    if top_k > n_experts:
        raise PiccError(f"{cfg.path}: num_experts_per_tok {top_k} is more than n_routed_experts {n_experts}")
    routing: dict = dict(scoring="softmax" if v2 else "sigmoid", group_score="max" if v2 else "top2")
    method = cfg.string("topk_method", "greedy") if v2 else "noaux_tc"
    if v2 and method not in ("greedy", "group_limited_greedy"):
        raise cfg.bad("topk_method", method, '"greedy" or "group_limited_greedy" (transformers\' DeepseekV2TopkRouter)')
    groups = (None, None) if v2 else (8, 4) if family == "deepseek_v3" else (1, 1)
    n_group, topk_group = (1, 1) if method == "greedy" else (cfg.integer("n_group", groups[0]),
                                                             cfg.integer("topk_group", groups[1]))
    if n_group > 1:
        if n_experts % n_group or topk_group > n_group or top_k > topk_group * (n_experts // n_group):
            raise PiccError(f"{cfg.path}: n_group {n_group} and topk_group {topk_group} do not fit "
                            f"{n_experts} experts, {top_k} a token (groups of equal size, at least top_k experts "
                            "in the topk_group chosen)")
        if not v2 and n_group > 1 and n_experts // n_group < 2:
            raise PiccError(f"{cfg.path}: groups of one expert ({n_experts} in {n_group}); a group's score is "
                            "its best two experts'")
        routing.update(n_group=n_group, topk_group=topk_group)
    if family == "glm4_moe_lite":
        types = cfg.raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"dense", "sparse"}:
            raise cfg.bad("mlp_layer_types", types, f'a list of {n_layers} "dense" or "sparse"')
        layers = tuple(t == "sparse" for t in types)
    else:
        first = cfg.integer("first_k_dense_replace", dense_default, minimum=0)
        layers = tuple(i >= first for i in range(n_layers))
    if v2 and cfg.integer("moe_layer_freq", 1) != 1:  # transformers ignores it: refuse, not guess
        raise PiccError(f"{cfg.path}: moe_layer_freq {cfg.raw['moe_layer_freq']} is not supported (1 is; "
                        "transformers' DeepseekV2 runs experts in every layer from first_k_dense_replace on)")
    scale = cfg.number("routed_scaling_factor", scale_default)
    if not 0 < scale < math.inf:
        raise cfg.bad("routed_scaling_factor", scale, "a number > 0")
    return MoeSpec(n_experts=n_experts, top_k=top_k, n_ff=cfg.integer("moe_intermediate_size", width_default),
                   norm_topk=not v2 and cfg.flag("norm_topk_prob", True), layers=layers if not all(layers) else (),
                   n_shared=cfg.integer("n_shared_experts", shared_default, minimum=0), choice_bias=not v2,
                   routed_scale=scale, **routing)


def moe_spec(cfg: HFConfig, family: str, n_layers: int) -> MoeSpec:
    """The experts of a Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, Granite-MoE or gpt-oss config:
    ``num_experts`` FFNs of ``moe_intermediate_size`` (the Qwens'; the others' are
    ``intermediate_size``), ``num_experts_per_tok`` of them a token, their weights renormalised
    where ``norm_topk_prob`` (always in Mixtral; Granite-MoE and gpt-oss take the softmax of the k
    logits, the same weights); the Qwens' layers in ``mlp_only_layers``, or not at a multiple of
    ``decoder_sparse_step``, keep a dense MLP. Qwen2-MoE adds a shared expert of
    ``shared_expert_intermediate_size`` neurons gated by ``sigmoid(shared_expert_gate x)``, run as
    that many expert-wide pieces (``MoeSpec.n_shared``); gpt-oss its clamped SwiGLU."""
    qwen, ernie = family in ("qwen3_moe", "qwen2_moe"), family == "ernie4_5_moe"
    key = "moe_num_experts" if ernie else "num_local_experts" if "num_local_experts" in cfg.raw else "num_experts"
    n_experts = cfg.integer(key, {"qwen3_moe": 128, "qwen2_moe": 60, "olmoe": 64, "mixtral": 8, "granitemoe": 8,
                                  "gpt_oss": 128, "ernie4_5_moe": 64}[family])
    top_k = cfg.integer("moe_k" if ernie else "num_experts_per_tok",
                        {"mixtral": 2, "granitemoe": 2, "gpt_oss": 4, "qwen2_moe": 4, "ernie4_5_moe": 6}.get(family, 8))
    if top_k > n_experts:
        raise PiccError(f"{cfg.path}: num_experts_per_tok {top_k} is more than num_experts {n_experts}")
    layers: tuple[bool, ...] = ()
    if qwen:
        dense = cfg.raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in dense):
            raise cfg.bad("mlp_only_layers", dense, f"a list of layer numbers below {n_layers}")
        step = cfg.integer("decoder_sparse_step", 1)
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    if ernie:  # Ernie4_5_MoeDecoderLayer: every interval-th layer from start to end (-1: the last)
        start, interval = cfg.integer("moe_layer_start_index", 1, minimum=0), cfg.integer("moe_layer_interval", 1)
        end = cfg.raw.get("moe_layer_end_index", -1)
        end = n_layers - 1 if end == -1 else cfg.integer("moe_layer_end_index", minimum=0)
        layers = tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n_layers))
    if cfg.raw.get("clip_qkv") is not None:
        raise PiccError(f"{cfg.path}: clip_qkv {json.dumps(cfg.raw['clip_qkv'])} is not supported")
    width = cfg.integer("moe_intermediate_size" if qwen or ernie else "intermediate_size",
                        {"gpt_oss": 2880, "qwen2_moe": 1408, "ernie4_5_moe": 1536}.get(family, 768))
    # granitemoe and gpt-oss: the softmax of the k logits, the same weights; ERNIE: renormalised
    norm = family in ("mixtral", "granitemoe", "gpt_oss", "ernie4_5_moe") or cfg.flag("norm_topk_prob", False)
    clamp = dict(swiglu_limit=cfg.number("swiglu_limit", 7.0), swiglu_alpha=cfg.number("swiglu_alpha", 1.702)) \
        if family == "gpt_oss" else {}
    for key, value in clamp.items():
        if not 0 < value < math.inf:
            raise cfg.bad(key, value, "a number > 0")
    shared: dict = {}
    if family == "qwen2_moe":  # its shared expert, in expert-wide pieces, gated
        neurons = cfg.integer("shared_expert_intermediate_size", 5632)
        if neurons % width:
            raise PiccError(f"{cfg.path}: shared_expert_intermediate_size {neurons} is not a multiple of "
                            f"moe_intermediate_size {width} (picc runs the shared expert as pieces of an "
                            "expert's width)")
        shared = dict(n_shared=neurons // width, shared_gated=True)
    elif ernie:  # shared experts of the routed ones' width, weight 1; the experts ranked by probability + bias
        shared = dict(n_shared=cfg.integer("moe_num_shared_experts", 2, minimum=0), choice_bias=True)
    return MoeSpec(n_experts=n_experts, top_k=top_k, n_ff=width, norm_topk=norm,
                   layers=layers if not all(layers) else (), **clamp, **shared)


def _gpt_oss_experts(ckpt: Checkpoint, store: WeightStore, n: dict[str, str], mlp: str, moe: MoeSpec,
                     hidden: int) -> None:
    """A gpt-oss layer's router (with its bias) and experts, stacked as ``picc.ir.ops.MoE`` reads
    them. ``gate_up_proj`` is [experts, hidden, 2 n_ff] (``x @ W``), its columns alternating a
    neuron's gate and up, and ``down_proj`` [experts, n_ff, hidden]: their transposes' rows are
    picc's. Biases alike (``gate_up_proj_bias`` alternating)."""
    count, e_ff = moe.n_experts, moe.n_ff
    store.add(n["router"], ckpt.tensor(mlp + "router.weight", (count, hidden)))
    store.add(n["router_bias"], ckpt.tensor(mlp + "router.bias", (count,)))
    x = mlp + "experts."
    if x + "gate_up_proj_blocks" in ckpt:
        _gpt_oss_mxfp4(ckpt, store, n, x, moe, hidden)
    else:
        _gpt_oss_float_experts(ckpt, store, n, x, moe, hidden)
    bias = ckpt.tensor(x + "gate_up_proj_bias", (count, 2 * e_ff))
    flat = np.asarray(bias.data).reshape(-1)
    store.add(n["experts_gate_bias"], Tensor(bias.dtype, (count * e_ff,), np.ascontiguousarray(flat[0::2])))
    store.add(n["experts_up_bias"], Tensor(bias.dtype, (count * e_ff,), np.ascontiguousarray(flat[1::2])))
    down_bias = ckpt.tensor(x + "down_proj_bias", (count, hidden))
    store.add(n["experts_down_bias"], Tensor(down_bias.dtype, (count * hidden,),
                                             np.asarray(down_bias.data).reshape(-1)))


def _gpt_oss_float_experts(ckpt: Checkpoint, store: WeightStore, n: dict[str, str], x: str, moe: MoeSpec,
                           hidden: int) -> None:
    """The experts of a float checkpoint (as ``save_pretrained`` writes them): transposed."""
    count, e_ff = moe.n_experts, moe.n_ff
    both = ckpt.tensor(x + "gate_up_proj", (count, hidden, 2 * e_ff))
    rows = np.ascontiguousarray(np.asarray(both.data).transpose(0, 2, 1)).reshape(count * 2 * e_ff, hidden)
    store.add(n["experts_gate"], Tensor(both.dtype, (count * e_ff, hidden), np.ascontiguousarray(rows[0::2])))
    store.add(n["experts_up"], Tensor(both.dtype, (count * e_ff, hidden), np.ascontiguousarray(rows[1::2])))
    down = ckpt.tensor(x + "down_proj", (count, e_ff, hidden))
    store.add(n["experts_down"], Tensor(down.dtype, (count * hidden, e_ff), np.ascontiguousarray(
        np.asarray(down.data).transpose(0, 2, 1)).reshape(count * hidden, e_ff)))


def _gpt_oss_mxfp4(ckpt: Checkpoint, store: WeightStore, n: dict[str, str], x: str, moe: MoeSpec,
                   hidden: int) -> None:
    """The experts of a released gpt-oss checkpoint (``quant_method: mxfp4``): ``*_blocks`` and
    ``*_scales`` whose rows are the matrices' output features (``gate_up``'s alternating a
    neuron's gate and up), kept as mxfp4 (the same values, the nibbles in ggml's order:
    ``picc.quant.mxfp4_from_hf``), as the CPU's mixture kernels read them."""
    count, e_ff = moe.n_experts, moe.n_ff
    for name, cols in (("gate_up_proj", hidden), ("down_proj", e_ff)):
        if cols % 32:
            raise PiccError(f"{ckpt.directory}: {x}{name}_blocks holds rows of {cols}, not a whole number of "
                            "32-element MXFP4 blocks")

    def rows(name: str, n_rows: int, cols: int) -> np.ndarray:
        blocks = ckpt.packed(f"{x}{name}_blocks", (count, n_rows, cols // 32, 16))
        scales = ckpt.packed(f"{x}{name}_scales", (count, n_rows, cols // 32))
        return quant.mxfp4_from_hf(blocks, scales).reshape(count * n_rows, -1)

    both = rows("gate_up_proj", 2 * e_ff, hidden)
    store.add(n["experts_gate"], Tensor(DType.MXFP4, (count * e_ff, hidden), np.ascontiguousarray(both[0::2])))
    store.add(n["experts_up"], Tensor(DType.MXFP4, (count * e_ff, hidden), np.ascontiguousarray(both[1::2])))
    store.add(n["experts_down"], Tensor(DType.MXFP4, (count * hidden, e_ff), rows("down_proj", hidden, e_ff)))


def _granite(cfg: HFConfig, spec: LlamaSpec) -> tuple[LlamaSpec, float]:
    """Granite's multipliers on LLaMA's layer, as the ops LLaMA's IR has, and the final norm's
    divisor (``logits_scaling``: the LM head is linear in it).

    Granite adds ``m * branch`` (``residual_multiplier``) where LLaMA adds the branch. With
    ``u = x / m`` the stream is LLaMA's, ``u + branch``, because each RMSNorm reads ``m u`` as
    it reads ``u`` with ``eps / m^2``: so the embedding is scaled by ``embedding_multiplier / m``
    and every norm's eps divided by ``m^2`` (no matrix is rescaled; float rounding apart, the same
    function). ``attention_multiplier`` is the attention's scale."""
    mult = {k: cfg.number(k, 1.0) for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                            "logits_scaling")}
    for key, value in mult.items():
        if not 0 < value < math.inf:
            raise cfg.bad(key, value, "a number > 0")
    m = mult["residual_multiplier"]
    spec = replace(spec, eps=spec.eps / m**2, embed_scale=mult["embedding_multiplier"] / m,
                   attn_scale=mult["attention_multiplier"])
    return spec, mult["logits_scaling"]


GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8}
"""Gemma3TextConfig's defaults for the fields LLaMA's configs always carry: the 4B, 12B and 27B
checkpoints' text_config leaves out those equal to them (4B: the heads and the vocabulary)."""


def _gemma3_text_of(cfg: HFConfig, directory: Path, name: str) -> tuple[Module, WeightStore]:
    """Gemma 3 4B, 12B and 27B (``Gemma3ForConditionalGeneration``): its language model alone,
    from ``text_config``, the token ids and the tying from the top level, the weights under
    ``model.language_model.`` (as transformers 5 saves them) or ``language_model.model.`` (the hub's
    files, saved by 4.x). The vision tower and its projector are not imported: prompts are text."""
    text = cfg.raw.get("text_config")
    if not isinstance(text, dict):
        raise cfg.bad("text_config", text, "an object (the language model's config)")
    top = {k: cfg.raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg.raw}
    raw = {**text, **top, "model_type": "gemma3_text"}
    return _llama_family(HFConfig(cfg.path, raw), directory, name,
                         prefixes=("model.language_model.", "language_model.model."))


def _refuse_gemma_options(cfg: HFConfig) -> None:
    """What Gemma configs may ask for and picc does not do: the embedding models' bidirectional
    attention."""
    if cfg.raw.get("use_bidirectional_attention"):
        raise PiccError(f"{cfg.path}: use_bidirectional_attention (an embedding model's) is not supported")


def _softcap(cfg: HFConfig, key: str, default: float) -> float | None:
    """Gemma 2's soft cap ``key`` (``cap * tanh(s / cap)``): a finite number > 0, or null for none
    (transformers divides by it: a cap of 0 would flatten every score to 0)."""
    cap = cfg.raw.get(key, default)
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
        raise cfg.bad(key, cap, "a number > 0 or null")
    return float(cap)


def _gemma_embed_scale(hidden: int, dtype: DType) -> float:
    """``sqrt(hidden)`` as Gemma's embedding multiplies by it: an f32 tensor cast to the table's
    dtype (bf16 checkpoints run with 34.0 for hidden 1152, not 33.94)."""
    import torch

    scale = torch.tensor(hidden**0.5)  # float32, as Gemma3TextScaledWordEmbedding holds it
    return float(scale.to({DType.BF16: torch.bfloat16, DType.F16: torch.float16}.get(dtype, torch.float32)))


# ---------------------------------------------------------------- OPT


def _opt(cfg: HFConfig, directory: Path, name: str) -> tuple[Module, WeightStore]:
    vocab, hidden = cfg.integer("vocab_size"), cfg.integer("hidden_size")
    n_layers, n_heads = cfg.integer("num_hidden_layers"), cfg.integer("num_attention_heads")
    n_ff = cfg.integer("ffn_dim")
    if hidden % n_heads:
        raise PiccError(f"{cfg.path}: hidden_size {hidden} is not a multiple of num_attention_heads "
                        f"{n_heads}")
    pre_norm = cfg.flag("do_layer_norm_before", True)
    embed_dim = cfg.opt_integer("word_embed_proj_dim", None) or hidden
    linear_bias = cfg.flag("enable_bias", True)
    affine = cfg.flag("layer_norm_elementwise_affine", True)
    bos, eos = special_ids(cfg, directory, 2, 2)
    tie = cfg.flag("tie_word_embeddings", True)
    spec = OptSpec(
        name=name, vocab=vocab, hidden=hidden, embed_dim=embed_dim, n_layers=n_layers,
        n_heads=n_heads, n_ff=n_ff, ffn_form=ffn_form(cfg, "activation_function", "relu", gated=False),
        pre_norm=pre_norm,
        # The decoder-level final norm exists only for pre-LN models not fine-tuned before
        # transformers 4.20 (those set _remove_final_layer_norm).
        final_norm=pre_norm and not cfg.flag("_remove_final_layer_norm", False),
        tied=False, max_position=cfg.integer("max_position_embeddings", 2048),
        bos_id=bos, eos_id=eos,
    )

    ckpt = Checkpoint(directory)
    p = _prefix(ckpt, "model.decoder.", "decoder.", "embed_tokens.weight")
    store = WeightStore()

    def add(picc: str, hf: str, shape: tuple[int, ...]) -> None:
        store.add(picc, ckpt.tensor(p + hf, shape))

    def norm(picc: str, hf: str) -> None:
        # LayerNorms have weight and bias unless layer_norm_elementwise_affine is false (then
        # neither); enable_bias concerns only the Linears.
        if affine:
            add(picc, hf + ".weight", (hidden,))
            add(f"{picc}_bias", hf + ".bias", (hidden,))

    def linear(picc: str, hf: str, shape: tuple[int, int]) -> None:
        add(picc, hf + ".weight", shape)
        if linear_bias:
            add(f"{picc}_bias", hf + ".bias", shape[:1])

    add("token_embd", "embed_tokens.weight", (vocab, embed_dim))
    # fairseq reserved rows 0 and 1 (padding): the table has max_position_embeddings + 2 rows.
    add("pos_embd", "embed_positions.weight", (spec.max_position + 2, hidden))
    if embed_dim != hidden:
        add("proj_in", "project_in.weight", (hidden, embed_dim))
        add("proj_out", "project_out.weight", (embed_dim, hidden))
    for i in range(n_layers):
        n, hf = layer_weight_names(i), f"layers.{i}."
        norm(n["attn_norm"], hf + "self_attn_layer_norm")
        for key, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
            linear(n[key], f"{hf}self_attn.{proj}", (hidden, hidden))
        norm(n["ffn_norm"], hf + "final_layer_norm")
        linear(n["up"], hf + "fc1", (n_ff, hidden))
        linear(n["down"], hf + "fc2", (hidden, n_ff))
    if spec.final_norm:
        norm("output_norm", "final_layer_norm")
    if not affine:
        store.add(UNIT_NORM, Tensor.from_f32(np.ones(hidden, np.float32)))
    spec = replace(spec, tied=_lm_head(ckpt, store, (vocab, embed_dim), tie))
    return build_opt(spec, store), store


# ---------------------------------------------------------------- Falcon


def _falcon_layout(cfg: HFConfig, n_heads: int) -> tuple[int, int, bool, bool]:
    """(kv groups, q heads per group, parallel, two norms), accepting exactly the combinations
    transformers' FalconDecoderLayer can run (hf_semantics.md section 5)."""
    new_arch = cfg.truthy("new_decoder_architecture", False)
    parallel = cfg.truthy("parallel_attn", True)
    n_kv = cfg.opt_integer("num_kv_heads", None) or n_heads
    n_ln = cfg.opt_integer("num_ln_in_parallel_attn", None)
    if new_arch:
        if not parallel:
            raise PiccError(f"{cfg.path}: new_decoder_architecture needs parallel_attn true "
                            "(transformers fails on this combination)")
        n_ln = 2 if n_ln is None else n_ln
        if n_ln not in (1, 2):
            raise PiccError(f"{cfg.path}: num_ln_in_parallel_attn {n_ln} is not supported with "
                            "new_decoder_architecture (supported: 1, 2)")
        if n_heads % n_kv:
            raise PiccError(f"{cfg.path}: num_attention_heads {n_heads} is not a multiple of "
                            f"num_kv_heads {n_kv}")
        return n_kv, n_heads // n_kv, True, n_ln == 2
    if parallel and n_ln == 2:
        raise PiccError(f"{cfg.path}: num_ln_in_parallel_attn 2 needs new_decoder_architecture "
                        "(transformers fails on this combination)")
    if cfg.truthy("multi_query", True):
        return 1, n_heads, parallel, False  # num_kv_heads is ignored: one shared k/v head
    if n_kv != n_heads:
        raise PiccError(f"{cfg.path}: num_kv_heads {n_kv} must equal num_attention_heads "
                        f"{n_heads} without multi_query or new_decoder_architecture")
    return n_heads, 1, parallel, False


def _falcon(cfg: HFConfig, directory: Path, name: str) -> tuple[Module, WeightStore]:
    # FalconConfig maps the legacy n_embed onto hidden_size (n_head / n_layer are not mapped).
    hidden = cfg.integer("n_embed") if cfg.raw.get("n_embed") is not None else cfg.integer("hidden_size")
    vocab = cfg.integer("vocab_size")
    n_layers, n_heads = cfg.integer("num_hidden_layers"), cfg.integer("num_attention_heads")
    if "head_dim" in cfg.raw:
        raise PiccError(f"{cfg.path}: field 'head_dim' is not allowed for falcon (its head dim is "
                        "hidden_size / num_attention_heads; transformers rejects the key)")
    if hidden % n_heads:
        raise PiccError(f"{cfg.path}: hidden_size {hidden} is not a multiple of num_attention_heads "
                        f"{n_heads}")
    head_dim = hidden // n_heads
    groups, per_group, parallel, two_norms = _falcon_layout(cfg, n_heads)
    n_ff = cfg.opt_integer("ffn_hidden_size", None) or 4 * hidden
    max_position = cfg.integer("max_position_embeddings", 2048)
    alibi = cfg.truthy("alibi", False)
    bias = cfg.truthy("bias", False)
    bos, eos = special_ids(cfg, directory, 11, 11)
    tie = cfg.flag("tie_word_embeddings", True)
    rope = None if alibi else rope_from_config(cfg, head_dim, max_position)
    spec = FalconSpec(
        name=name, vocab=vocab, hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=groups, n_ff=n_ff, eps=cfg.number("layer_norm_epsilon", 1e-5),
        ffn_form=ffn_form(cfg, "activation", "gelu", gated=False), parallel=parallel,
        rope=rope, tied=False, bos_id=bos, eos_id=eos,
        max_position=max_position,
    )

    ckpt = Checkpoint(directory)
    p = _prefix(ckpt, "transformer.", "", "word_embeddings.weight")
    store = WeightStore()

    def get(hf: str, shape: tuple[int, ...]) -> Tensor:
        return ckpt.tensor(p + hf, shape)

    def norm(picc: str, hf: str) -> None:
        store.add(picc, get(hf + ".weight", (hidden,)))  # Falcon's LayerNorms always have bias
        store.add(f"{picc}_bias", get(hf + ".bias", (hidden,)))

    def linear(picc: str, hf: str, shape: tuple[int, int]) -> None:
        store.add(picc, get(hf + ".weight", shape))
        if bias:
            store.add(f"{picc}_bias", get(hf + ".bias", shape[:1]))

    store.add("token_embd", get("word_embeddings.weight", (vocab, hidden)))
    split = fused_qkv_rows(groups, per_group, head_dim)
    fused_rows = groups * (per_group + 2) * head_dim
    for i in range(n_layers):
        n, hf = layer_weight_names(i), f"h.{i}."
        if two_norms:
            norm(n["attn_norm"], hf + "ln_attn")
            norm(n["ffn_norm"], hf + "ln_mlp")
        else:
            norm(n["attn_norm"], hf + "input_layernorm")
            if not parallel:
                norm(n["ffn_norm"], hf + "post_attention_layernorm")
        qkv = hf + "self_attention.query_key_value"
        w = get(qkv + ".weight", (fused_rows, hidden))
        b = get(qkv + ".bias", (fused_rows,)) if bias else None
        for key, rows in zip(("q", "k", "v"), split, strict=True):
            store.add(n[key], w.take_rows(rows))
            if b is not None:
                store.add(n[f"{key}_bias"], b.take_rows(rows))
        linear(n["o"], hf + "self_attention.dense", (hidden, hidden))
        linear(n["up"], hf + "mlp.dense_h_to_4h", (n_ff, hidden))
        linear(n["down"], hf + "mlp.dense_4h_to_h", (hidden, n_ff))
    norm("output_norm", "ln_f")
    spec = replace(spec, tied=_lm_head(ckpt, store, (vocab, hidden), tie))
    return build_falcon(spec, store), store
