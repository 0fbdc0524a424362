"""GGUF files of llama.cpp's ``deepseek2`` and ``glm4moe`` architectures, run as llama.cpp runs them.

``deepseek2`` is what convert_hf_to_gguf.py writes for DeepSeek V2, V2-Lite, V3 and R1, Kimi K2,
Moonlight and GLM-4.7-Flash (``Glm4MoeLiteModel`` is a ``DeepseekV2Model`` writing
``deepseek2``); ``glm4moe`` for GLM-4.5, 4.5-Air and 4.6. Sources: the converter's
``DeepseekV2Model``, ``Glm4MoeModel`` and ``Glm4MoeLiteModel`` (conversion/deepseek.py and glm.py),
llama.cpp's ``llama_model_deepseek2`` and ``llama_model_glm4_moe`` (src/models/deepseek2.cpp,
glm4-moe.cpp: the keys read, the tensors' shapes, the graphs) and ``build_moe_ffn``
(src/llama-graph.cpp: the routing).

The latent attention (:func:`latent_spec`, :func:`latent_weights`) runs decompressed, as the HF
frontend runs it (``picc.frontend.llama.MlaSpec``): llama.cpp's "absorbed" graph of the newer
files computes the same scores and values from the latent (``q_nope . k_b c`` is ``q_nope . k_nope``
with ``k_nope = k_b c``; its values are ``v_b`` times the attention-weighted ``c``). Its rope is
llama.cpp's "normal" one (``LLAMA_ROPE_TYPE_NORM``, picc's ``gptj``: adjacent pairs ``(2i, 2i+1)``
of the ``rope.dimension_count`` rotated features, the last of each head's query and of the shared
key's, at frequency ``base^(-2i/n_rot)``) on the checkpoint's rows, which the converter does not
permute: transformers' DeepSeek V2 rotates those pairs too (a complex multiply), V3 and
GLM-4.7-Flash where ``rope_interleave`` (as released); a V3 config with ``rope_interleave`` false
rotates halves in transformers, and its GGUF still adjacent pairs in llama.cpp and here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from picc.errors import PiccError
from picc.frontend.llama import LlamaSpec, MlaSpec, MoeSpec, RopeSpec
from picc.ir.positional import yarn_mscale
from picc.ir.weights import Tensor, WeightStore

if TYPE_CHECKING:
    from picc.frontend.gguf import _Meta

Key = Callable[[str], str]
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, _SIGMOID
GLM47_FLASH = ((47, 48), 154880)  # llama.cpp's guess of GLM-4.7-Flash files without a gating key: layers, vocab
DEEPSEEK2_LOG_MUL = np.float32(0.1)  # the converter writes 0.1 mscale_all_dim; llama.cpp divides it out


def mtp_layers(meta: _Meta, key: Key, path: Path) -> int:
    """``nextn_predict_layers``: how many of the file's last blocks are multi-token-prediction
    (MTP) layers, which llama.cpp's main graph does not run (``n_layer() = block_count -
    nextn_predict_layers``; GLM-4.5's converter appends its one, GLM-4.7-Flash's too)."""
    count = meta.get(key("nextn_predict_layers"), 0)
    blocks = meta.get(key("block_count"))
    if isinstance(count, bool) or not isinstance(count, int) or count < 0 \
            or isinstance(blocks, int) and count >= blocks:
        raise PiccError(f"{path}: {key('nextn_predict_layers')} must be 0 to block_count - 1, got {count!r}")
    return count


def latent_spec(meta: _Meta, key: Key, path: Path) -> MlaSpec:
    """A ``deepseek2`` file's latent attention. Both layouts of the converter: the newer one
    (``attn_k_b`` and ``attn_v_b``, for llama.cpp's absorbed attention) writes each head's q/k
    and v widths as ``attention.key_length_mla`` and ``value_length_mla``, ``key_length`` and
    ``value_length`` being the cache's (``kv_lora_rank + rope``, ``kv_lora_rank``) and
    ``head_count_kv`` 1; the older one (one ``attn_kv_b``) has no ``_mla`` keys and the head
    widths under ``key_length`` and ``value_length``. ``q_lora_rank`` absent or 0 (V2-Lite's):
    the query straight from x (``attn_q``), else through ``attn_q_a``, ``attn_q_a_norm`` and
    ``attn_q_b``. ``rope.dimension_count`` of each head's q/k features are rotated."""
    def integer(name: str, minimum: int = 1) -> int:
        value = meta.need(key(name))
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise PiccError(f"{path}: {key(name)} must be an integer >= {minimum}, got {value!r}")
        return value

    mla = meta.get(key("attention.key_length_mla")) is not None
    qk = integer("attention.key_length_mla" if mla else "attention.key_length")
    v_dim = integer("attention.value_length_mla" if mla else "attention.value_length")
    rope_dim = integer("rope.dimension_count")
    if rope_dim % 2 or rope_dim >= qk:
        raise PiccError(f"{path}: {key('rope.dimension_count')} {rope_dim} must be even and less than the "
                        f"query/key head's {qk} features")
    q_rank = meta.get(key("attention.q_lora_rank"), 0)
    if isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 0:
        raise PiccError(f"{path}: {key('attention.q_lora_rank')} must be an integer >= 0, got {q_rank!r}")
    return MlaSpec(q_rank=q_rank or None, kv_rank=integer("attention.kv_lora_rank"), nope_dim=qk - rope_dim,
                   rope_dim=rope_dim, v_dim=v_dim)


def latent_weights(store: WeightStore, mla: MlaSpec, hidden: int, n_heads: int, n_layers: int,
                   path: Path) -> tuple[WeightStore, int]:
    """``store`` with each layer's latent-attention tensors as ``picc.frontend.llama.MlaSpec``
    reads them, and how many ``attn_k_b`` were decoded to F32: the query's rows each head's
    rotated ones first (the file has each head's ``[nope | rope]``, as the checkpoint);
    ``attn_kv_a_mqa``'s rows the latent's, then the shared rotated key's; ``attn_kv_b``'s, each
    head's k_nope then its v, as k's and v's; or (newer files) ``attn_v_b`` ([heads, v, latent],
    v's rows as they are) and ``attn_k_b`` ([heads, latent, nope]: each head's k_nope matrix
    transposed, as the converter stores it for the absorbed product), transposed back, in its
    dtype where that is elementwise (F32, F16, BF16) and decoded to F32 where the rows are
    quantized blocks, which a transpose does not keep."""
    tensors, decoded = {name: store[name] for name in store}, 0
    qk, width = mla.qk_dim, mla.nope_dim + mla.v_dim

    def take(i: int, name: str, gguf_name: str, shape: tuple[int, ...]) -> Tensor:
        t = tensors.pop(f"l{i}.attn.{name}", None)
        if t is None or t.shape != shape:
            raise PiccError(f"{path}: deepseek2 tensor 'blk.{i}.{gguf_name}.weight' must be "
                            f"[{', '.join(map(str, shape))}] (numpy order), "
                            + ("but it is missing" if t is None else f"got {list(t.shape)}"))
        return t

    for i in range(n_layers):
        p = f"l{i}.attn."
        if mla.q_rank is None:
            q = take(i, "q", "attn_q", (n_heads * qk, hidden))
        else:
            q = take(i, "q_b", "attn_q_b", (n_heads * qk, mla.q_rank))
            if p + "q" in tensors:
                raise PiccError(f"{path}: deepseek2 tensor 'blk.{i}.attn_q.weight' beside attn_q_b: "
                                "attention.q_lora_rank says the query goes through a latent")
        tensors[p + "q"] = mla.query_rows(q, n_heads)
        kv_a = take(i, "kv_a_mqa", "attn_kv_a_mqa", (mla.kv_rank + mla.rope_dim, hidden))
        tensors[p + "kv_a"], tensors[p + "k_pe"] = mla.latent_parts(kv_a)
        if p + "kv_b" in tensors:
            kv_b = take(i, "kv_b", "attn_kv_b", (n_heads * width, mla.kv_rank))
            tensors[p + "k"], tensors[p + "v"] = mla.kv_b_parts(kv_b, n_heads)
        else:
            k_b = take(i, "k_b", "attn_k_b", (n_heads * mla.kv_rank, mla.nope_dim))
            tensors[p + "v"] = take(i, "v_b", "attn_v_b", (n_heads * mla.v_dim, mla.kv_rank))
            tensors[p + "k"] = _heads_transposed(k_b, n_heads)
            decoded += k_b.dtype.is_quantized
    return WeightStore(tensors), decoded


def _heads_transposed(k_b: Tensor, n_heads: int) -> Tensor:
    """``attn_k_b``'s [heads * latent, nope] as k_nope's [heads * nope, latent]: each head's
    matrix transposed."""
    rows, nope = k_b.shape
    if k_b.dtype.is_float:
        data = np.asarray(k_b.data).reshape(n_heads, rows // n_heads, nope).transpose(0, 2, 1)
        data = np.ascontiguousarray(data).reshape(n_heads * nope, -1)
        return Tensor(k_b.dtype, (n_heads * nope, rows // n_heads), data)
    values = k_b.to_f32().reshape(n_heads, rows // n_heads, nope).transpose(0, 2, 1)
    return Tensor.from_f32(values.reshape(n_heads * nope, rows // n_heads))


def latent_scale(meta: _Meta, key: Key, rope: RopeSpec, qk_dim: int, path: Path) -> float:
    """A ``deepseek2`` file's attention scale as llama.cpp's graph computes it:
    ``mscale^2 / sqrt(qk_dim)`` with ``mscale = a (1 + 0.1 m ln(1 / freq_scale))``, ``m`` the file's
    ``rope.scaling.yarn_log_multiplier`` over 0.1 (the converter writes ``0.1 mscale_all_dim``) and
    ``a`` the rope's own factor of the cosines and sines as ggml applies it (``attn_factor (1 +
    0.1 ln(1 / freq_scale))``: the yarn rope's attention factor, ``1 + 0.1 ln(factor)`` with linear
    scaling, 1 without). With yarn and a multiplier, ``a`` is 1 (llama.cpp's context divides
    ``get_mscale(factor, mscale_all_dim)`` by itself, the DeepSeek V2 case included) and the
    scale is transformers' ``yarn_get_mscale(factor, mscale_all_dim)^2 / sqrt(qk_dim)``; with yarn
    and no multiplier llama.cpp scales both the rope and the scores by ``1 + 0.1 ln(factor)``,
    where transformers scales the rope only."""
    m = _log_multiplier(meta, key, path)
    factor = rope.factor if rope.scaling in ("yarn", "linear") else 1.0
    applied = rope.attention_factor if rope.scaling == "yarn" else 1 + 0.1 * math.log(factor)
    mscale = applied * (1 + 0.1 * m * math.log(factor))
    return mscale * mscale / math.sqrt(qk_dim)


def _log_multiplier(meta: _Meta, key: Key, path: Path) -> float:
    """``mscale_all_dim`` as llama.cpp reads it back from a ``deepseek2`` file (float32)."""
    value = meta.get(key("rope.scaling.yarn_log_multiplier"), 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise PiccError(f"{path}: {key('rope.scaling.yarn_log_multiplier')} must be a number >= 0, got {value!r}")
    return float(np.float32(value) / DEEPSEEK2_LOG_MUL)


def deepseek2_yarn_factor(meta: _Meta, key: Key, factor: float, path: Path) -> float:
    """The cosines' and sines' factor of a ``deepseek2`` file's yarn rope before
    ``rope.scaling.attn_factor`` (llama_context's ``get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim)`` with ``mscale`` taken as ``mscale_all_dim`` for this
    architecture: 1 where the file has a multiplier; ``get_mscale(factor)`` where not)."""
    m = _log_multiplier(meta, key, path)
    return 1.0 if m else yarn_mscale(factor)


def deepseek_moe(meta: _Meta, key: Key, arch: str, n_layers: int, n_ff: int, vocab: int,
                 path: Path) -> MoeSpec | None:
    """The experts of a ``deepseek2`` or ``glm4moe`` file, routed as llama.cpp's
    ``build_moe_ffn`` routes them: in each layer from ``leading_dense_block_count`` on,
    ``expert_count`` experts of ``expert_feed_forward_length`` neurons (glm4moe: ``feed_forward_length
    / expert_used_count`` where 0), ``expert_used_count`` a token, ``expert_shared_count`` shared
    experts (``ffn_*_shexp``, that many experts wide) every token takes with weight 1.

    Scores: ``expert_gating_func`` 1, the router's softmax; 2, its sigmoids. Without the key,
    llama.cpp takes sigmoids for glm4moe and for a deepseek2 file of 47 or 48 layers and a
    vocabulary of 154880 (GLM-4.7-Flash's converted files lack it), the softmax for other
    deepseek2 files (V2's did). The experts are ranked by score plus ``exp_probs_b.bias`` where
    a layer has one (V3's and GLM's correction bias; glm4moe files must). ``expert_group_count``
    > 1: only the ``expert_group_used_count`` groups (of consecutive experts) whose two best
    ranking scores sum highest are open, whatever the scores: llama.cpp implements V3's rule
    for V2's ``group_limited_greedy`` too, where transformers scores a group by its best expert.
    The chosen scores are the weights, divided by their sum where ``expert_weights_norm``, then
    times ``expert_weights_scale`` (0 or none: 1)."""
    def count(name: str, required: bool = False) -> int:
        value = meta.need(key(name)) if required else meta.get(key(name), 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PiccError(f"{path}: {key(name)} must be an integer >= 0, got {value!r}")
        return value

    n_experts, lead = count("expert_count"), count("leading_dense_block_count")
    if n_experts == 0:
        if lead < n_layers:
            raise PiccError(f"{path}: {key('expert_count')} is 0 but layers {lead} on are mixtures of experts "
                            f"({key('leading_dense_block_count')} {lead} of {n_layers} layers)")
        return None
    top_k = count("expert_used_count", required=True)
    if not 0 < top_k <= n_experts:
        raise PiccError(f"{path}: {key('expert_used_count')} {top_k} and {key('expert_count')} {n_experts}: "
                        "expected 1 to expert_count experts a token")
    width = count("expert_feed_forward_length", required=arch == "deepseek2") or n_ff // top_k
    gating = count("expert_gating_func")
    if gating == 0:
        glm47 = n_layers in GLM47_FLASH[0] and vocab == GLM47_FLASH[1]
        gating = 2 if arch == "glm4moe" or glm47 else 1
    if gating not in GATING:
        raise PiccError(f"{path}: {key('expert_gating_func')} {gating} is not supported "
                        f"({', '.join(f'{k}: {v}' for k, v in GATING.items())})")
    routing: dict = {}
    groups, used = count("expert_group_count"), count("expert_group_used_count")
    if groups > 1:  # llama.cpp's load_hparams asserts the first three
        size = n_experts // groups
        if n_experts % groups or not 0 < used < groups or size < 2 or top_k > used * size:
            raise PiccError(f"{path}: {key('expert_group_count')} {groups} and {key('expert_group_used_count')} "
                            f"{used} do not fit {n_experts} experts, {top_k} a token (groups of two or more, "
                            "fewer open than there are, holding at least expert_used_count experts)")
        routing = dict(n_group=groups, topk_group=used, group_score="top2")
    scale = meta.get(key("expert_weights_scale"), 0.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 <= scale < math.inf:
        raise PiccError(f"{path}: {key('expert_weights_scale')} must be a number >= 0 (0: none), got {scale!r}")
    norm = meta.get(key("expert_weights_norm"), False)
    if not isinstance(norm, bool):
        raise PiccError(f"{path}: {key('expert_weights_norm')} must be a boolean, got {norm!r}")
    shared = count("expert_shared_count", required=arch == "deepseek2")
    return MoeSpec(n_experts=n_experts, top_k=top_k, n_ff=width, norm_topk=norm, scoring=GATING[gating],
                   routed_scale=float(scale) or 1.0, n_shared=shared,
                   layers=tuple(i >= lead for i in range(n_layers)) if lead else (), **routing)


def deepseek2(spec: LlamaSpec, store: WeightStore, meta: _Meta, key: Key,
              path: Path) -> tuple[LlamaSpec, WeightStore, tuple[str, ...]]:
    """A ``deepseek2`` file's model (``llama_model_deepseek2``): the latent attention
    (:func:`latent_spec`, :func:`latent_weights`, :func:`latent_scale`) as many K/V heads as q's,
    each of ``qk_dim`` features, whatever ``head_count_kv`` says (1 in the newer layout); no
    attention biases (llama.cpp has none for this architecture, so a file with one is refused as
    an unknown tensor); the notes of what was decoded."""
    if meta.get(key("attention.temperature_scale")):
        raise PiccError(f"{path}: {key('attention.temperature_scale')} (Mistral Large's attention temperature) "
                        "is not supported")
    mla = latent_spec(meta, key, path)
    store, decoded = latent_weights(store, mla, spec.hidden, spec.n_heads, spec.n_layers, path)
    spec = replace(spec, n_kv_heads=spec.n_heads, head_dim=mla.qk_dim, mla=mla,
                   attn_scale=latent_scale(meta, key, spec.rope, mla.qk_dim, path))
    notes = (f"{decoded} attn_k_b tensor{'s' if decoded > 1 else ''} decoded to F32 (each head's matrix "
             "transposed back: quantized blocks cannot be)",) if decoded else ()
    return spec, store, notes


def glm4moe(spec: LlamaSpec, store: WeightStore, path: Path) -> tuple[LlamaSpec, WeightStore]:
    """A ``glm4moe`` file's model (``llama_model_glm4_moe``): LLaMA's attention with biases on q,
    k and v where the file has them, each head's q and k RMS-normalised where it has
    ``attn_q_norm`` and ``attn_k_norm`` (GLM-4.5's own), the rope over ``rope.dimension_count``
    of each head's features in llama.cpp's "neox" halves (``LLAMA_ROPE_TYPE_NEOX``: the converter
    keeps the checkpoint's rows), q . k scaled by ``1 / sqrt(head_dim)``; the FFN's input norm is
    the file's ``post_attention_norm``; every mixture layer must have its ``exp_probs_b``."""
    renamed = {f"l{i}.post_attn_norm": f"l{i}.ffn_norm" for i in range(spec.n_layers)}
    store = WeightStore({renamed.get(n, n): store[n] for n in store})
    if spec.moe is not None:
        for i in range(spec.n_layers):
            if (not spec.moe.layers or spec.moe.layers[i]) and f"l{i}.moe.choice_bias" not in store:
                raise PiccError(f"{path}: glm4moe tensor 'blk.{i}.exp_probs_b.bias' is missing (llama.cpp needs it "
                                "in every mixture layer)")
    norms = [f"l{i}.attn.{n}_norm" in store for i in range(spec.n_layers) for n in ("q", "k")]
    if any(norms) and not all(norms):
        raise PiccError(f"{path}: glm4moe files must have attn_q_norm and attn_k_norm in every layer or in none")
    return replace(spec, qk_norm=all(norms)), store


def shared_width_checked(spec: LlamaSpec, store: WeightStore, path: Path) -> None:
    """Each mixture layer's shared experts (``ffn_gate_shexp``, ``_up_shexp``, ``_down_shexp``)
    are ``expert_shared_count`` experts wide, as llama.cpp's loader requires, and present."""
    assert spec.moe is not None
    want, names = spec.moe.n_shared * spec.moe.n_ff, set(store)
    for i in range(spec.n_layers):
        if spec.moe.layers and not spec.moe.layers[i]:
            continue
        for name, axis in (("gate", 0), ("up", 0), ("down", 1)):
            ours = f"l{i}.moe.shared_{name}"
            t = store[ours] if ours in names else None
            if t is None or t.shape[axis] != want:
                raise PiccError(f"{path}: tensor 'blk.{i}.ffn_{name}_shexp.weight' must hold {want} neurons "
                                f"(expert_shared_count {spec.moe.n_shared} x expert_feed_forward_length "
                                f"{spec.moe.n_ff}), " + ("but it is missing" if t is None else f"got {t.shape[axis]}"))

