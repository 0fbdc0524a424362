"""GGUF frontend: ``llama``, ``qwen2`` and ``qwen3`` GGUF files, quantized tensors kept in their
quant type.

For ``llama`` files llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that each
head's rotary pairs are adjacent ((2i, 2i+1), llama.cpp's "normal" rope). picc keeps the tensors
exactly as stored and uses the ``gptj`` (interleaved) rope style, which computes the same function
as transformers' half-split rope on the un-permuted weights. ``qwen2`` and ``qwen3`` files keep
transformers' rows (llama.cpp runs them with its "neox" rope, the half-split one): picc's ``llama``
style. Qwen2 has biases on q, k and v; Qwen3 normalises each head's q and k (``attn_q_norm``,
``attn_k_norm``, [head_dim]) before the rope.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from picc.errors import PiccError
from picc.frontend.gguf_file import GgufFile
from picc.frontend.llama import LlamaSpec, RopeSpec, build_llama
from picc.frontend.model import LoadedModel
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_ROPE_STYLES = {"llama": "gptj", "qwen2": "llama", "qwen3": "llama"}  # see the module's docstring
_GGML_TYPES = {"F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16, "Q4_0": DType.Q4_0,
               "Q4_1": DType.Q4_1, "Q8_0": DType.Q8_0}

_GLOBAL_NAMES = {"token_embd.weight": "token_embd", "output_norm.weight": "output_norm",
                 "output.weight": "output"}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm",
    "attn_q.weight": "attn.q", "attn_k.weight": "attn.k", "attn_v.weight": "attn.v",
    "attn_output.weight": "attn.o", "attn_q.bias": "attn.q_bias", "attn_k.bias": "attn.k_bias",
    "attn_v.bias": "attn.v_bias", "attn_output.bias": "attn.o_bias",
    "attn_q_norm.weight": "attn.q_norm", "attn_k_norm.weight": "attn.k_norm",
    "ffn_up.weight": "ffn.up", "ffn_gate.weight": "ffn.gate", "ffn_down.weight": "ffn.down",
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

    def need(self, key: str) -> object:
        value = self.get(key)
        if value is None:
            raise PiccError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value


def read_tensors(file: GgufFile, path: Path) -> WeightStore:
    store = WeightStore()
    for t in file.tensors:
        name = picc_name(t.name)
        if name is None:
            raise PiccError(f"{path}: tensor {t.name!r} is not part of a llama model picc knows "
                            f"(known: {', '.join(list(_GLOBAL_NAMES) + ['blk.N.' + k for k in _LAYER_NAMES])})")
        dtype = _GGML_TYPES.get(t.type_name)
        if dtype is None:
            raise PiccError(f"{path}: tensor {t.name!r} has quant type {t.type_name}; "
                            f"supported: {', '.join(_GGML_TYPES)}")
        shape = tuple(reversed(t.dims))
        data = t.data.view(np.uint16) if dtype == DType.BF16 else t.data
        store.add(name, Tensor(dtype, shape, data.reshape(shape[0], -1) if len(shape) == 2 else data.reshape(shape)))
    return store


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
    if "rope_freqs.weight" in {t.name for t in file.tensors}:
        raise PiccError(f"{path}: per-frequency rope factors (rope_freqs.weight, llama3 rope "
                        "scaling in GGUF) are not supported yet")
    store = read_tensors(file, path)

    def key(k: str) -> str:
        return f"{arch}.{k}"

    hidden = int(meta.need(key("embedding_length")))  # type: ignore[arg-type]
    n_heads = int(meta.need(key("attention.head_count")))  # type: ignore[arg-type]
    n_kv = int(meta.get(key("attention.head_count_kv"), n_heads))  # type: ignore[arg-type]
    head_dim = int(meta.get(key("attention.key_length"), hidden // n_heads))  # type: ignore[arg-type]
    rope_dim = int(meta.get(key("rope.dimension_count"), head_dim))  # type: ignore[arg-type]
    scaling = str(meta.get(key("rope.scaling.type"), "none"))
    if scaling not in ("none", "linear"):
        raise PiccError(f"{path}: rope scaling {scaling!r} is not supported (supported: none, linear)")
    rope = RopeSpec(
        theta=float(meta.get(key("rope.freq_base"), 10000.0)),  # type: ignore[arg-type]
        style=_ROPE_STYLES[arch],
        rotary_dim=None if rope_dim == head_dim else rope_dim,
        scaling=scaling,
        factor=float(meta.get(key("rope.scaling.factor"), 1.0)) if scaling == "linear" else 1.0,  # type: ignore[arg-type]
    )
    vocab = store["token_embd"].shape[0]
    spec = LlamaSpec(
        name=re.sub(r"[^\w.]", "_", path.stem),
        arch=arch,
        vocab=vocab,
        hidden=hidden,
        n_layers=int(meta.need(key("block_count"))),  # type: ignore[arg-type]
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_ff=int(meta.need(key("feed_forward_length"))),  # type: ignore[arg-type]
        eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),  # type: ignore[arg-type]
        ffn_form=_ffn_form(meta),
        rope=rope,
        tied="output" not in store,
        bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        max_position=_opt_int(meta.get(key("context_length"))),
        qk_norm=arch == "qwen3",
    )
    module = build_llama(spec, store)
    # A GGUF without tokenizer metadata still imports; it runs on token ids only.
    has_tokenizer = meta.get("tokenizer.ggml.model") is not None
    tokenizer = tokenizer_from_gguf(path) if has_tokenizer else None
    return LoadedModel(module, store, tokenizer, source=str(path))


# GGUF has no standard key for the FFN's activation (llama.cpp's ``llama`` is always SwiGLU);
# picc reads its own, so a ReLU-LLaMA (``relu(gate) * up``) can come as a GGUF too.
ACTIVATION_KEY = "picc.ffn_activation"
_GATED_FORMS = {"silu": "swiglu", "relu": "reglu"}


def _ffn_form(meta: _Meta) -> str:
    act = str(meta.get(ACTIVATION_KEY, "silu"))
    if act not in _GATED_FORMS:
        raise PiccError(f"{meta.path}: {ACTIVATION_KEY} is {act!r}; expected one of {', '.join(_GATED_FORMS)}")
    return _GATED_FORMS[act]


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
