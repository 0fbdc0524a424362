"""GGUF frontend: ``llama``, ``qwen2``, ``qwen3``, ``phi3``, ``gemma2`` and ``gemma3`` GGUF files,
quantized tensors kept in their quant type where picc's kernels read it, converted to one they read
where not (:func:`converted`).

For ``llama`` files (and ``granite`` ones, Llama's layer with four multipliers: :func:`_granite`)
llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that each
head's rotary pairs are adjacent ((2i, 2i+1), llama.cpp's "normal" rope). picc keeps the tensors
exactly as stored and uses the ``gptj`` (interleaved) rope style, which computes the same function
as transformers' half-split rope on the un-permuted weights. ``qwen2`` and ``qwen3`` files keep
transformers' rows (llama.cpp runs them with its "neox" rope, the half-split one): picc's ``llama``
style. Qwen2 has biases on q, k and v; Qwen3 normalises each head's q and k (``attn_q_norm``,
``attn_k_norm``, [head_dim]) before the rope. ``phi3`` files keep transformers' rows too, with q, k
and v in one ``attn_qkv`` and the gate's rows then up's in one ``ffn_up``, as in the checkpoint:
picc splits them. ``olmo2`` files keep transformers' rows and OLMo 2's layer (its norms after the
attention and the MLP, q's and k's over the whole projection). ``gemma2`` files and ``gemma3``
ones (Gemma 3 1B's text model) keep transformers' rows, their norms already ``1 + w`` (llama.cpp's
converter adds the 1), and are run as llama.cpp runs them (:func:`_gemma2`, :func:`_gemma3`).
``deepseek2`` (DeepSeek V2/V3, GLM-4.7-Flash: their latent attention) and ``glm4moe`` (GLM-4.5)
files are run as llama.cpp runs them too (``picc.frontend.gguf_deepseek``); the blocks past
``block_count - nextn_predict_layers`` (their multi-token-prediction layers) are left out, as
llama.cpp's main graph leaves them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from picc import quant
from picc.errors import PiccError
from picc.frontend.gguf_file import GgufFile
from picc.frontend.llama import LlamaSpec, MoeSpec, RopeSpec, build_llama, longrope_notes
from picc.frontend.model import LoadedModel
from picc.ir import positional
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore

if TYPE_CHECKING:
    from picc.frontend.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "granite", "granitemoe", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "olmo2",
                   "gemma2", "gemma3", "gpt-oss", "ernie4_5", "ernie4_5-moe", "deepseek2", "glm4moe")
# see above: llama.cpp's converter permutes the q and k rows of llama (and Granite) files, keeps the others'
_ROPE_STYLES = {"llama": "gptj", "granite": "gptj", "granitemoe": "gptj", "qwen2": "llama", "qwen3": "llama",
                "qwen3moe": "llama", "qwen2moe": "llama", "phi3": "llama", "olmo2": "llama", "gemma2": "llama",
                "gemma3": "llama", "gpt-oss": "llama", "ernie4_5": "gptj", "ernie4_5-moe": "gptj", "deepseek2": "gptj",
                "glm4moe": "llama"}
_GGML_TYPES = {"F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16, "Q4_0": DType.Q4_0,
               "Q4_1": DType.Q4_1, "Q8_0": DType.Q8_0, "MXFP4": DType.MXFP4}

_GLOBAL_NAMES = {"token_embd.weight": "token_embd", "output_norm.weight": "output_norm",
                 "output.weight": "output"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope scaling, one factor per rotary pair (llama3_rope)
LONGROPE_SHORT, LONGROPE_LONG = "rope_factors_short.weight", "rope_factors_long.weight"  # Phi-3.5's (_longrope)
ROPE_TENSORS = (ROPE_FREQS, LONGROPE_SHORT, LONGROPE_LONG)
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm",
    "attn_q.weight": "attn.q", "attn_k.weight": "attn.k", "attn_v.weight": "attn.v",
    "attn_output.weight": "attn.o", "attn_q.bias": "attn.q_bias", "attn_k.bias": "attn.k_bias",
    "attn_v.bias": "attn.v_bias", "attn_output.bias": "attn.o_bias",
    "attn_q_norm.weight": "attn.q_norm", "attn_k_norm.weight": "attn.k_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm",  # Gemma 2's and 3's
    "attn_qkv.weight": "attn.qkv",  # Phi-3's q, k and v in one matrix (split by load_gguf)
    "ffn_up.weight": "ffn.up", "ffn_gate.weight": "ffn.gate", "ffn_down.weight": "ffn.down",
    # a mixture's router and its experts' matrices, [n_experts, rows, cols] read as one [n_experts * rows, cols]
    "ffn_gate_inp.weight": "moe.router", "ffn_up_exps.weight": "moe.up", "ffn_gate_exps.weight": "moe.gate",
    "ffn_down_exps.weight": "moe.down",
    # gpt-oss's: the router's and the experts' biases ([n_experts, rows], read as one vector), the sinks
    "ffn_gate_inp.bias": "moe.router_bias", "ffn_up_exps.bias": "moe.up_bias", "ffn_gate_exps.bias": "moe.gate_bias",
    "ffn_down_exps.bias": "moe.down_bias", "attn_sinks.weight": "attn.sinks",
    # qwen2moe's shared expert and its gate (stacked into the experts and the router by _qwen2moe)
    "ffn_gate_inp_shexp.weight": "moe.shared_router", "ffn_gate_shexp.weight": "moe.shared_gate",
    "ffn_up_shexp.weight": "moe.shared_up", "ffn_down_shexp.weight": "moe.shared_down",
    "exp_probs_b.bias": "moe.choice_bias",  # ernie4_5-moe's: added to the probabilities that rank the experts
    # deepseek2's latent attention, as stored (made MlaSpec's weights by gguf_deepseek.latent_weights)
    "attn_q_a.weight": "attn.q_a", "attn_q_a_norm.weight": "attn.q_a_norm", "attn_q_b.weight": "attn.q_b",
    "attn_kv_a_mqa.weight": "attn.kv_a_mqa", "attn_kv_a_norm.weight": "attn.kv_a_norm",
    "attn_kv_b.weight": "attn.kv_b", "attn_k_b.weight": "attn.k_b", "attn_v_b.weight": "attn.v_b",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def picc_name(gguf_name: str) -> str | None:
    """picc's weight name for a GGUF tensor name, or None for tensors picc does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"l{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


class _Meta:
    """Typed access to GGUF metadata with errors that name the file and key."""

    def __init__(self, file: GgufFile, path: Path) -> None:
        self.file = file
        self.path = path

    def get(self, key: str, default: object = None) -> object:
        return self.file.get(key, default)

    def positive(self, key: str, default: float, zero_means_default: bool = False) -> float:
        """The number > 0 at ``key``: ``default`` where the file names none (or 0, with
        ``zero_means_default``: llama.cpp's reading of keys it treats as unset at 0)."""
        value = self.get(key, default)
        if zero_means_default and value == 0 and not isinstance(value, bool):
            value = default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise PiccError(f"{self.path}: {key} must be a number > 0, got {value!r}")
        return float(value)

    def need(self, key: str) -> object:
        value = self.get(key)
        if value is None:
            raise PiccError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value


def read_tensors(file: GgufFile, path: Path, blocks: int | None = None) -> tuple[WeightStore, dict[str, int]]:
    """The file's tensors under picc's names, and how many of each quant type picc converted
    (:func:`converted`) instead of keeping; those of the blocks from ``blocks`` on left out."""
    store, changed = WeightStore(), {}
    for t in file.tensors:
        if t.name in ROPE_TENSORS:
            continue  # part of the rope op's attributes (llama3_rope, _longrope), not a weight
        block = _LAYER_TENSOR.fullmatch(t.name)
        if blocks is not None and block and int(block.group(1)) >= blocks:
            continue  # a multi-token-prediction layer (gguf_deepseek.mtp_layers)
        name = picc_name(t.name)
        if name is None:
            raise PiccError(f"{path}: tensor {t.name!r} is not part of a llama model picc knows "
                            f"(known: {', '.join(list(_GLOBAL_NAMES) + ['blk.N.' + k for k in _LAYER_NAMES])})")
        shape = tuple(reversed(t.dims))
        if len(shape) == 3:  # experts: their matrices' rows one after another (picc.ir.ops.MoE)
            shape = (shape[0] * shape[1], shape[2])
        elif name.endswith("_bias") and ".moe." in name and len(shape) == 2:  # experts' biases
            shape = (shape[0] * shape[1],)
        dtype = _GGML_TYPES.get(t.type_name)
        if dtype is None:
            tensor = converted(t.type_name, t.data, shape, f"{path}: tensor {t.name!r}")
            changed[t.type_name] = changed.get(t.type_name, 0) + 1
        else:
            data = t.data.view(np.uint16) if dtype == DType.BF16 else t.data
            tensor = Tensor(dtype, shape, data.reshape(shape[0], -1) if len(shape) == 2 else data.reshape(shape))
        store.add(name, tensor)
    return store, changed


def converted(type_name: str, raw: np.ndarray, shape: tuple[int, ...], what: str) -> Tensor:
    """A tensor of a quant type picc's kernels do not read, as one they do. Q4_K's 32-element
    sub-blocks are each an affine 4-bit block (``d sc q - dmin m``): they become Q4_1 blocks with
    the same quants, each block's scale and offset rounded to f16 (Q4_K_M files are mostly
    Q4_K). The other types are decoded (by the gguf package) and quantized again: those of 5 bits
    a weight or more (Q5_0, Q5_1, Q5_K, Q6_K) to Q8_0, the rest (Q2_K, Q3_K, IQ4_NL, ...) to
    Q4_1, which adds at most half a step of the new grid to each weight."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name, None)
    supported = ", ".join([*_GGML_TYPES, "and the K and I quants, converted"])
    if qtype is None or len(shape) != 2 or shape[1] % 32:
        raise PiccError(f"{what} has quant type {type_name}; supported: {supported}")
    if type_name == "Q4_K":
        return Tensor(DType.Q4_1, shape, _q4_k_as_q4_1(np.ascontiguousarray(raw).view(np.uint8), what)
                      .reshape(shape[0], -1))
    try:
        values = gguf.quants.dequantize(np.ascontiguousarray(raw).view(np.uint8), qtype).reshape(shape)
    except NotImplementedError:
        raise PiccError(f"{what} has quant type {type_name}, which picc cannot decode; supported: "
                        f"{supported}") from None
    target = _target(type_name)
    return Tensor(DType(target), shape, quant.quantize(values, target).reshape(shape[0], -1))


def _target(type_name: str) -> str:
    """The type :func:`converted` makes of a tensor of GGML quant type ``type_name``."""
    import gguf

    if type_name == "Q4_K":
        return "q4_1"
    block, nbytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, type_name)]
    return "q8_0" if 8 * nbytes / block >= 5 else "q4_1"


def _q4_k_as_q4_1(raw: np.ndarray, what: str) -> np.ndarray:
    """Q4_K super-blocks (d, dmin: f16; 12 bytes of eight 6-bit scales and minimums; 128 bytes of
    quants, 64 elements to each 32 bytes: the low nibbles, then the high ones) as Q4_1 blocks (d,
    m: f16; 16 bytes, element i in the low nibble of byte i, element i + 16 in its high one)."""
    blocks = raw.reshape(-1, 144)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, high, both = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], axis=1)
    quants = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    quants = (quants & 0x0F).reshape(n * 8, 32)
    scale = (d * scales).astype(np.float16).reshape(-1, 1)
    offset = (-(dmin * mins)).astype(np.float16).reshape(-1, 1)
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(offset))):
        raise PiccError(f"{what}: a Q4_K block's scale does not fit in f16")
    out = np.concatenate([scale.view(np.uint8), offset.view(np.uint8), quants[:, :16] | (quants[:, 16:] << 4)],
                         axis=1)
    return np.ascontiguousarray(out).reshape(-1)


END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
               "_<EOT>", "<|end_of_text|>")
"""Tokens llama.cpp ends generation at by their text (GGUF files seldom name them): a chat model's
end of turn, which its metadata's EOS often is not (Llama 3 Instruct ends turns with <|eot_id|>,
Phi-3 with <|end|>)."""


def _end_of_generation(meta: _Meta, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end generation, as llama.cpp decides them: EOS, the metadata's end of turn and
    end of message, and the vocabulary's :data:`END_OF_TURN` tokens."""
    named = (_opt_int(meta.get(f"tokenizer.ggml.{key}_token_id")) for key in ("eos", "eot", "eom"))
    spelled = (tokenizer.token_to_id(text) for text in END_OF_TURN)
    return tuple(sorted({t for t in (*named, *spelled) if t is not None}))


GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}
"""The file's recommended sampling parameters that llama.cpp takes as its defaults, by the names
of a request's. Not ``penalty_repeat``: llama.cpp's penalty looks back ``penalty_last_n`` tokens
(64), a request's ``repetition_penalty`` at the whole sequence."""


def _sampling(meta: _Meta, path: Path) -> tuple[tuple[str, float], ...]:
    """:data:`GGUF_SAMPLING` as the file has them; a float32 value as the shortest decimal that
    is it (the 0.6 a model card says, not 0.6000000238)."""
    from picc.frontend.tokenizer import checked_sampling

    found = {name: meta.get(key) for key, name in GGUF_SAMPLING.items() if meta.get(key) is not None}
    shortest = {k: float(str(np.float32(v))) if isinstance(v, float | np.floating) else v for k, v in found.items()}
    return checked_sampling(shortest, path)


def load_gguf(path: Path) -> LoadedModel:
    """Import a GGUF file of an architecture in SUPPORTED_ARCHS."""
    from picc.frontend.tokenizer import tokenizer_from_gguf

    path = Path(path)
    if not path.is_file():
        raise PiccError(f"{path}: GGUF file not found")
    try:
        file = GgufFile(path)
    except (ValueError, OSError) as e:
        raise PiccError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = _Meta(file, path)
    arch = str(meta.need("general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise PiccError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def key(k: str) -> str:
        return f"{arch}.{k}"

    from picc.frontend import gguf_deepseek as latent

    n_layers = int(meta.need(key("block_count"))) - latent.mtp_layers(meta, key, path)  # type: ignore[arg-type]
    store, changed = read_tensors(file, path, n_layers)
    factors = {t.name: np.asarray(t.data, np.float32).reshape(-1) for t in file.tensors
               if t.name in ROPE_TENSORS and t.type_name in ("F32", "F16")}
    for name in ROPE_TENSORS:
        if name not in factors and any(t.name == name for t in file.tensors):
            raise PiccError(f"{path}: {name} must be F32 or F16")
    rope_factors = factors.get(ROPE_FREQS)
    hidden = int(meta.need(key("embedding_length")))  # type: ignore[arg-type]
    n_heads = int(meta.need(key("attention.head_count")))  # type: ignore[arg-type]
    n_kv = int(meta.get(key("attention.head_count_kv"), n_heads))  # type: ignore[arg-type]
    head_dim = int(meta.get(key("attention.key_length"), hidden // n_heads))  # type: ignore[arg-type]
    rope_dim = int(meta.get(key("rope.dimension_count"), head_dim))  # type: ignore[arg-type]
    scaling = str(meta.get(key("rope.scaling.type"), "none"))
    if scaling not in ("none", "linear", "yarn"):
        raise PiccError(f"{path}: rope scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    theta = float(meta.get(key("rope.freq_base"), 10000.0))  # type: ignore[arg-type]
    rope = RopeSpec(
        theta=theta,
        style=_ROPE_STYLES[arch],
        rotary_dim=None if rope_dim == head_dim else rope_dim,
        scaling="linear" if scaling == "linear" else "none",
        factor=float(meta.get(key("rope.scaling.factor"), 1.0)) if scaling == "linear" else 1.0,  # type: ignore[arg-type]
    )
    if rope_factors is not None:
        if scaling != "none":
            raise PiccError(f"{path}: rope_freqs.weight and rope scaling {scaling!r} together are not supported")
        rope = llama3_rope(rope_factors, rope, rope_dim, path)
    max_position = _opt_int(meta.get(key("context_length")))
    if scaling == "yarn":
        rope = _yarn(meta, key, rope, rope_dim, max_position, path, deepseek2=arch == "deepseek2")
    if LONGROPE_SHORT in factors or LONGROPE_LONG in factors:
        if scaling != "none" or rope_factors is not None:
            raise PiccError(f"{path}: longrope factors and other rope scaling together are not supported")
        rope = _longrope(meta, key, factors, rope, rope_dim, max_position, path)
    n_ff = int(meta.need(key("feed_forward_length")))  # type: ignore[arg-type]
    if arch == "phi3":
        store = _split_phi3(store, n_layers, n_heads * head_dim, n_kv * head_dim, n_ff, path)
    vocab = store["token_embd"].shape[0]
    spec = LlamaSpec(
        name=re.sub(r"[^\w.]", "_", path.stem),
        arch=arch,
        vocab=vocab,
        hidden=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),  # type: ignore[arg-type]
        ffn_form=_ffn_form(meta),
        rope=rope,
        tied="output" not in store,
        bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        max_position=max_position,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        moe=latent.deepseek_moe(meta, key, arch, n_layers, n_ff, _vocab_size(meta, key), path)
        if arch in ("deepseek2", "glm4moe") else _moe(meta, key, arch, n_ff, path),
    )
    if arch in ("granite", "granitemoe"):
        spec, store = _granite(spec, store, meta, key)
    elif arch == "olmo2":  # the attention's and the MLP's outputs normalised; q's and k's norms over all heads
        spec = replace(spec, qk_norm=True, qk_norm_whole=True, pre_norm=False, sandwich=True)
    elif arch == "gemma2":
        spec = _gemma2(spec, meta, key)
    elif arch == "gemma3":
        spec = _gemma3(spec, meta, key, path)
    elif arch == "gpt-oss":
        spec, store = _gpt_oss(spec, store, meta, key)
    requantized, decoded = 0, ()
    if arch == "deepseek2":
        spec, store, decoded = latent.deepseek2(spec, store, meta, key, path)
    elif arch == "glm4moe":
        spec, store = latent.glm4moe(spec, store, path)
    if arch in ("deepseek2", "glm4moe") and spec.moe is not None and spec.moe.n_shared:
        latent.shared_width_checked(spec, store, path)
        store, requantized = _shared_experts(spec, store)
    elif arch in ("qwen2moe", "ernie4_5-moe"):
        store, requantized = _shared_experts(spec, store)
    module = build_llama(spec, store)
    # A GGUF without tokenizer metadata still imports; it runs on token ids only.
    has_tokenizer = meta.get("tokenizer.ggml.model") is not None
    tokenizer = tokenizer_from_gguf(path) if has_tokenizer else None
    if tokenizer is not None:
        tokenizer = replace(tokenizer, stop_ids=_end_of_generation(meta, tokenizer), sampling=_sampling(meta, path))
    notes = tuple(f"{count} {kind} tensor{'s' if count > 1 else ''} converted to {_target(kind).upper()} "
                  + ("(the same 4-bit values)" if kind == "Q4_K" else "(decoded and quantized again)")
                  + ", which picc's kernels read" for kind, count in sorted(changed.items())) + decoded
    notes += longrope_notes(module)
    if requantized:
        notes += (f"{requantized} shared-expert matrices quantized again as their layer's experts' type "
                  "(picc stacks them with the experts)",)
    return LoadedModel(module, store, tokenizer, source=str(path), notes=notes)


def _moe(meta: _Meta, key: Callable[[str], str], arch: str, n_ff: int, path: Path) -> MoeSpec | None:
    """A file's experts, where it has ``expert_count`` (``qwen3moe`` and ``granitemoe`` files
    always; a ``llama`` one for Mixtral): ``expert_used_count`` of them a token, their softmax
    weights renormalised (llama.cpp's ``build_moe_ffn(.., norm_w = true)`` for all three), of
    ``expert_feed_forward_length`` neurons (qwen3moe; llama.cpp's default ``feed_forward_length /
    expert_used_count``) or ``feed_forward_length`` (llama, granitemoe)."""
    n_experts, top_k = (_opt_int(meta.get(key(k))) or 0 for k in ("expert_count", "expert_used_count"))
    if arch not in ("qwen3moe", "qwen2moe", "granitemoe", "gpt-oss", "ernie4_5-moe") and n_experts == 0:
        return None
    if arch not in ("qwen3moe", "qwen2moe", "granitemoe", "llama", "gpt-oss", "ernie4_5-moe"):
        raise PiccError(f"{path}: {arch} files with experts ({key('expert_count')} {n_experts}) are not supported")
    if not 0 < top_k <= n_experts:
        raise PiccError(f"{path}: {key('expert_used_count')} {top_k} and {key('expert_count')} {n_experts}: "
                        "expected 1 to expert_count experts a token")
    width = _opt_int(meta.get(key("expert_feed_forward_length"))) or (n_ff // top_k if arch == "qwen3moe" else n_ff)
    clamp = dict(swiglu_limit=GPT_OSS_SWIGLU[1], swiglu_alpha=GPT_OSS_SWIGLU[0]) if arch == "gpt-oss" else {}
    shared: dict = {}
    if arch == "qwen2moe":  # llama.cpp's build_moe_ffn(.., norm_w = false); its shared expert, gated
        neurons = _opt_int(meta.get(key("expert_shared_feed_forward_length"))) or 0
        if neurons <= 0 or neurons % width:
            raise PiccError(f"{path}: {key('expert_shared_feed_forward_length')} {neurons} must be a multiple of "
                            f"{key('expert_feed_forward_length')} {width} (picc runs the shared expert as pieces of "
                            "an expert's width)")
        shared = dict(n_shared=neurons // width, shared_gated=True)
    elif arch == "ernie4_5-moe":  # llama.cpp's: leading dense layers, then every step-th; plain shared experts
        lead = _opt_int(meta.get(key("leading_dense_block_count"))) or 0
        step = _opt_int(meta.get(key("interleave_moe_layer_step"))) or 1
        n_layers = int(meta.need(key("block_count")))  # type: ignore[arg-type]
        shared = dict(n_shared=_opt_int(meta.get(key("expert_shared_count"))) or 0,
                      layers=tuple(i >= lead and (i + 1) % step == 0 for i in range(n_layers)))
    return MoeSpec(n_experts=n_experts, top_k=top_k, n_ff=width, norm_topk=arch != "qwen2moe", **clamp, **shared)


def _shared_experts(spec: LlamaSpec, store: WeightStore) -> tuple[WeightStore, int]:
    """A ``qwen2moe`` or ``ernie4_5-moe`` file's shared expert(s) stacked after its experts, in
    expert-wide pieces (the down matrix's columns cut at block boundaries, its bytes as they are),
    qwen2moe's gate (``ffn_gate_inp_shexp``, [hidden]) after the router's rows
    (``picc.ir.ops.MoE``'s ``n_shared``, ``shared_gated``). Where a shared matrix's type is not the
    experts' (a K-quant mix), it is decoded and quantized again as theirs: how many were."""
    assert spec.moe is not None
    moved, requantized = {}, 0

    def like(t: Tensor, other: Tensor) -> Tensor:
        nonlocal requantized
        if t.dtype == other.dtype:
            return t
        requantized += 1
        return Tensor.from_f32(t.to_f32(), other.dtype)

    pieces, hidden = spec.moe.n_shared, spec.hidden
    for i in range(spec.n_layers):
        p = f"l{i}.moe."
        if p + "router" not in store:
            continue
        if spec.moe.shared_gated:
            router = store[p + "router"]
            gate = store[p + "shared_router"]
            gate_row = Tensor(gate.dtype, (1, hidden), np.asarray(gate.data).reshape(1, -1))
            moved[p + "router"] = Tensor.stacked([router, like(gate_row, router)])
        if not pieces:
            continue
        for m in ("gate", "up"):
            moved[p + m] = Tensor.stacked([store[p + m], like(store[p + "shared_" + m], store[p + m])])
        down = store[p + "down"]
        # [hidden, pieces * width]: a piece's columns are an expert's down matrix
        moved[p + "down"] = Tensor.stacked([down, like(store[p + "shared_down"], down).column_pieces(pieces)])
    gone = {f"l{i}.moe.shared_{m}" for i in range(spec.n_layers) for m in ("router", "gate", "up", "down")}
    return WeightStore({n: moved.get(n, store[n]) for n in store if n not in gone}), requantized


GPT_OSS_SWIGLU = (1.702, 7.0)  # llama.cpp's alpha and limit of gpt-oss's clamped SwiGLU (files name none)
GPT_OSS_WINDOW = 128  # llama.cpp's n_swa where a gpt-oss file names no attention.sliding_window


def _gpt_oss(spec: LlamaSpec, store: WeightStore, meta: _Meta,
             key: Callable[[str], str]) -> tuple[LlamaSpec, WeightStore]:
    """A ``gpt-oss`` file's model as llama.cpp runs it (``LLM_ARCH_OPENAI_MOE``): every even layer
    sliding (``set_swa_pattern(2)``) by ``attention.sliding_window``, each attention's sinks, the
    experts' biases and clamped SwiGLU (:data:`GPT_OSS_SWIGLU`), the softmax of the k chosen
    logits (the renormalised top k). The FFN's input norm is the file's ``post_attention_norm``."""
    window = _opt_int(meta.get(key("attention.sliding_window"), GPT_OSS_WINDOW))
    renamed = {f"l{i}.post_attn_norm": f"l{i}.ffn_norm" for i in range(spec.n_layers)}
    store = WeightStore({renamed.get(n, n): store[n] for n in store})
    return replace(spec, window=tuple(None if i % 2 else window for i in range(spec.n_layers)), attn_sinks=True), store


def _granite(spec: LlamaSpec, store: WeightStore, meta: _Meta,
             key: Callable[[str], str]) -> tuple[LlamaSpec, WeightStore]:
    """A ``granite`` (or ``granitemoe``) file's model: Llama's layer with ``embedding_scale``,
    ``residual_scale``, ``attention.scale`` and ``logit_scale`` (llama.cpp's names for
    GraniteConfig's multipliers; 1, 1, head_dim's and 1 where a file names none or 0, as llama.cpp
    reads them) as the HF frontend maps them
    (``picc.frontend.hf._granite``: the embedding scaled by ``embedding / residual``, every
    norm's eps divided by ``residual^2``, the final norm's weight by ``logit_scale``)."""
    scales = {name: meta.positive(key(name), 1.0 if name != "attention.scale" else 1 / math.sqrt(spec.head_dim),
                                  zero_means_default=True)
              for name in ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")}
    m = scales["residual_scale"]
    norm = Tensor.from_f32(store["output_norm"].to_f32() / np.float32(scales["logit_scale"]))
    store = WeightStore({n: norm if n == "output_norm" else store[n] for n in store})
    return replace(spec, eps=spec.eps / m**2, embed_scale=scales["embedding_scale"] / m,
                   attn_scale=scales["attention.scale"]), store


def _gemma(spec: LlamaSpec, layers_27b: int) -> LlamaSpec:
    """What llama.cpp's Gemma 2 and 3 share: the embedding times ``sqrt(hidden)`` (f32), GELU-tanh
    gated FFNs, the attention's and the FFN's outputs normalised, and q . k scaled by
    ``1 / sqrt(head_dim)``, or ``1 / sqrt(hidden / heads)`` in the 27B (the only model with
    ``layers_27b`` layers; its ``query_pre_attn_scalar``). llama.cpp's src/llama-model.cpp sets
    ``f_attention_scale`` so in ``load_hparams`` (LLM_ARCH_GEMMA2: 46 layers, LLM_ARCH_GEMMA3: 62),
    after gemma_pytorch's config.py; src/models/gemma2-iswa.cpp and gemma3.cpp scale q by it."""
    scale_of = spec.hidden // spec.n_heads if spec.n_layers == layers_27b else spec.head_dim
    return replace(spec, ffn_form="geglu_tanh", sandwich=True, embed_scale=float(np.float32(math.sqrt(spec.hidden))),
                   attn_scale=1.0 / math.sqrt(scale_of))


GEMMA2_WINDOW = 4096  # llama.cpp's n_swa where a gemma2 file names no attention.sliding_window
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # llama.cpp's defaults (hparams)


def _gemma2(spec: LlamaSpec, meta: _Meta, key: Callable[[str], str]) -> LlamaSpec:
    """A ``gemma2`` file's model as llama.cpp runs it (:func:`_gemma`): one rope (the file's) for all
    layers, a window of ``attention.sliding_window`` on every even layer (``set_swa_pattern(2)``),
    the attention's scores soft-capped by ``attn_logit_softcapping`` and the logits by
    ``final_logit_softcapping``: ``cap * tanh(x / cap)``, 50 and 30 where the file names none."""
    window = _opt_int(meta.get(key("attention.sliding_window"), GEMMA2_WINDOW))
    caps = [meta.positive(key(name), default) for name, default in GEMMA2_SOFTCAPS.items()]
    return replace(_gemma(spec, 46), window=tuple(None if i % 2 else window for i in range(spec.n_layers)),
                   attn_softcap=caps[0], logit_softcap=caps[1])


GEMMA3_SWA_PATTERN = 6  # llama.cpp's: every sixth layer attends to everything, the others slide
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's rope base for the sliding layers (the file names the global one)


def _gemma3(spec: LlamaSpec, meta: _Meta, key: Callable[[str], str], path: Path) -> LlamaSpec:
    """A ``gemma3`` file's model as llama.cpp runs it (:func:`_gemma`): windows of
    ``attention.sliding_window`` on all but every sixth layer, whose rope is the file's (base and
    linear scaling) where the sliding layers' is base 1e4 unscaled."""
    softcap = meta.get(key("final_logit_softcapping"))
    if softcap:
        raise PiccError(f"{path}: {key('final_logit_softcapping')} {softcap} is not supported (Gemma 3 has none)")
    window = _opt_int(meta.get(key("attention.sliding_window")))
    full = [window is None or (i + 1) % GEMMA3_SWA_PATTERN == 0 for i in range(spec.n_layers)]
    local = replace(spec.rope, theta=GEMMA3_LOCAL_THETA, scaling="none", factor=1.0)
    return replace(_gemma(spec, 62), layer_ropes=tuple(spec.rope if f else local for f in full),
                   window=tuple(None if f else window for f in full) if window is not None else ())


def _split_phi3(store: WeightStore, n_layers: int, q_rows: int, kv_rows: int, n_ff: int, path: Path) -> WeightStore:
    """``store`` with each layer's fused ``attn_qkv`` as q, k and v and fused ``ffn_up`` as the gate
    (its first ``n_ff`` rows) and up."""
    tensors = {name: store[name] for name in store}
    for i in range(n_layers):
        for fused, parts in ((f"l{i}.attn.qkv", ((f"l{i}.attn.q", q_rows), (f"l{i}.attn.k", kv_rows),
                                                   (f"l{i}.attn.v", kv_rows))),
                             (f"l{i}.ffn.up", ((f"l{i}.ffn.gate", n_ff), (f"l{i}.ffn.up", n_ff)))):
            whole, want = tensors.pop(fused, None), sum(rows for _, rows in parts)
            if whole is None or whole.shape[0] != want:
                gguf_name = f"blk.{i}." + ("attn_qkv.weight" if fused.endswith("qkv") else "ffn_up.weight")
                raise PiccError(f"{path}: phi3 tensor {gguf_name!r} must hold {want} rows (q, k, v or gate, up), "
                                + ("but it is missing" if whole is None else f"got {whole.shape[0]}"))
            start = 0
            for name, rows in parts:
                tensors[name] = whole.take_rows(np.arange(start, start + rows))
                start += rows
    return WeightStore(tensors)


def llama3_rope(factors: np.ndarray, rope: RopeSpec, rotated: int, path: Path) -> RopeSpec:
    """``rope`` with the llama3 scaling whose per-pair factors are ``factors`` (``rope_freqs.weight``).

    llama.cpp's converter writes Llama 3's rope scaling as one factor per rotary pair, by which
    the pair's frequency is divided: 1 for short wavelengths, ``factor`` for long ones, and in
    between ``1 / ((1 - s) / factor + s)`` with ``s`` linear in ``1 / wavelength``. Only the
    ratios of ``original_max_position`` to ``low_freq_factor`` and ``high_freq_factor`` shape
    that, so the pairs in between (at least two: Llama 3's have three to seven) give them with
    ``low_freq_factor`` 1; the frequencies this makes must be the file's to 1e-5, else the file
    is refused.
    """
    half = rotated // 2
    if factors.shape != (half,) or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise PiccError(f"{path}: rope_freqs.weight must hold {half} positive factors (one per rotary pair), "
                        f"got shape {factors.shape}")
    f = factors.astype(np.float64)
    if np.all(f == 1):
        return rope
    factor = float(f.max())
    inv = rope.theta ** -(np.arange(0, rotated, 2, dtype=np.float64) / rotated)
    between = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    fit = None
    if between.sum() >= 2 and factor > 1:
        s = (1 / f[between] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv[between] / (2 * np.pi), s, 1)  # s = a / wavelength + b
        if b < 0 and a > 0:
            fit = replace(rope, scaling="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=1 - 1 / b,
                          original_max_position=round(-a / b))
    want = (inv / f).astype(np.float32)
    if fit is None or not np.allclose(_inv_freq(fit, rotated), want, rtol=1e-5, atol=0):
        raise PiccError(f"{path}: rope_freqs.weight does not hold llama3 rope scaling factors (1 for short "
                        "wavelengths, a constant for long ones, smoothed in between); other per-frequency "
                        "factors are not supported")
    return fit


def _longrope(meta: _Meta, key: Callable[[str], str], factors: dict[str, np.ndarray], rope: RopeSpec,
              rotated: int, context: int | None, path: Path) -> RopeSpec:
    """Phi-3.5's, Phi-4-mini's and Phi-3-128k's longrope as llama.cpp runs it: the short factors
    (``rope_factors_short``) for contexts up to ``rope.scaling.original_context_length``, the long
    ones past it (``longrope_for_context``), the cosines and sines times
    ``rope.scaling.attn_factor`` (convert_hf_to_gguf.py writes transformers' default,
    ``sqrt(1 + ln(context / original) / ln(original))``, computed here where a file lacks it)."""
    short, long = factors.get(LONGROPE_SHORT), factors.get(LONGROPE_LONG)
    if short is None or long is None:
        raise PiccError(f"{path}: longrope needs both {LONGROPE_SHORT} and {LONGROPE_LONG}")
    for name, f in ((LONGROPE_SHORT, short), (LONGROPE_LONG, long)):
        if f.shape != (rotated // 2,) or not np.all(f > 0):
            raise PiccError(f"{path}: {name} must hold {rotated // 2} positive factors (one per rotary pair), got "
                            f"shape {f.shape}")
    original = _opt_int(meta.get(key("rope.scaling.original_context_length")))
    if original is None or original < 2:
        raise PiccError(f"{path}: longrope needs {key('rope.scaling.original_context_length')} (an integer >= 2)")
    attention = meta.get(key("rope.scaling.attn_factor"))
    if attention is None:
        scale = (context or original) / original
        attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    if not float(attention) > 0:  # type: ignore[arg-type]
        raise PiccError(f"{path}: {key('rope.scaling.attn_factor')} must be > 0, got {attention}")
    return replace(rope, scaling="longrope", original_max_position=original,
                   freq_factors=tuple(float(f) for f in short), long_factors=tuple(float(f) for f in long),
                   attention_factor=float(attention))  # type: ignore[arg-type]


def _yarn(meta: _Meta, key: Callable[[str], str], rope: RopeSpec, rotated: int, context: int | None,
          path: Path, deepseek2: bool = False) -> RopeSpec:
    """YaRN as llama.cpp runs it (ggml's ``rope_yarn``, ``ext_factor`` 1): ``rope.scaling.factor``
    over ``rope.scaling.original_context_length`` (else ``context_length``), the ramp's ends
    always rounded outwards (llama.cpp has no ``truncate``: a gpt-oss file rotates as transformers
    would with it true), ``yarn_beta_fast`` and ``yarn_beta_slow`` where the file has them
    (convert_hf_to_gguf.py writes a config's), else 32 and 1. The cosines and sines are
    multiplied by ``yarn_mscale(factor)``, or with ``yarn_log_multiplier`` by
    ``yarn_mscale(factor) / yarn_mscale(factor, multiplier)`` (what llama.cpp's context makes of
    its own factor and ggml's), times ``rope.scaling.attn_factor``. A ``deepseek2`` file's
    multiplier is 0.1 ``mscale_all_dim``, whose factor llama.cpp makes 1
    (``gguf_deepseek.deepseek2_yarn_factor``)."""
    factor = meta.positive(key("rope.scaling.factor"), 1.0, zero_means_default=True)
    original = _opt_int(meta.get(key("rope.scaling.original_context_length"))) or context
    if original is None or original < 1:
        raise PiccError(f"{path}: yarn rope needs {key('rope.scaling.original_context_length')} (an integer >= 1)")
    beta_fast = meta.positive(key("rope.scaling.yarn_beta_fast"), 32.0)
    beta_slow = meta.positive(key("rope.scaling.yarn_beta_slow"), 1.0)
    if beta_fast < beta_slow:
        raise PiccError(f"{path}: yarn rope needs yarn_beta_fast >= yarn_beta_slow, got {beta_fast} and {beta_slow}")
    multiplier = meta.get(key("rope.scaling.yarn_log_multiplier"), 0.0)
    if isinstance(multiplier, bool) or not isinstance(multiplier, int | float) or multiplier < 0:
        raise PiccError(f"{path}: {key('rope.scaling.yarn_log_multiplier')} must be a number >= 0, got {multiplier!r}")
    attention = positional.yarn_mscale(factor) / (positional.yarn_mscale(factor, multiplier) if multiplier else 1.0)
    if deepseek2:
        from picc.frontend.gguf_deepseek import deepseek2_yarn_factor

        attention = deepseek2_yarn_factor(meta, key, factor, path)
    attention *= meta.positive(key("rope.scaling.attn_factor"), 1.0)
    factors = positional.yarn_freq_factors(rotated, rope.theta, factor, original, beta_fast, beta_slow, True,
                                           llama_cpp=True)
    return replace(rope, scaling="yarn", factor=factor, original_max_position=original, freq_factors=factors,
                   attention_factor=attention)


def _inv_freq(rope: RopeSpec, rotated: int) -> np.ndarray:
    """The per-pair frequencies of ``rope`` (the rope op's ``inv_freq``)."""
    return positional.inv_freq(rotated, rope.theta, rope.scaling, rope.factor, rope.low_freq_factor,
                               rope.high_freq_factor, rope.original_max_position, rope.freq_factors)


# GGUF has no standard key for the FFN's activation (llama.cpp's ``llama`` is always SwiGLU);
# picc reads its own, so a ReLU-LLaMA (``relu(gate) * up``) can come as a GGUF too.
ACTIVATION_KEY = "picc.ffn_activation"
_GATED_FORMS = {"silu": "swiglu", "relu": "reglu"}


def _ffn_form(meta: _Meta) -> str:
    act = str(meta.get(ACTIVATION_KEY, "silu"))
    if act not in _GATED_FORMS:
        raise PiccError(f"{meta.path}: {ACTIVATION_KEY} is {act!r}; expected one of {', '.join(_GATED_FORMS)}")
    return _GATED_FORMS[act]


def _vocab_size(meta: _Meta, key: Callable[[str], str]) -> int:
    """The vocabulary's size as llama.cpp's loader reads it: ``vocab_size``, else the tokenizer's
    token count (0 where the file has neither)."""
    size = meta.get(key("vocab_size"))
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    tokens = meta.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, list | tuple) else 0


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
