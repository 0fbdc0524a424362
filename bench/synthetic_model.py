"""Synthetic checkpoints in real formats, at real sizes, for measuring picc at scale.

    python bench/synthetic_model.py gguf /work/scale-data/llama7b-q4_0.gguf --shape 7b [--ffn relu]
    python bench/synthetic_model.py hf /work/scale-data/llama1b-f16 --shape 1b [--shard-size 1GB]
    python bench/synthetic_model.py gguf build/bench/moe.gguf --shape moe --experts 32 --experts-used 4
    python bench/synthetic_model.py gguf build/bench/oss.gguf --shape moe --experts 32 --experts-used 4 --arch gpt-oss
    python bench/synthetic_model.py gguf build/bench/ds.gguf --shape moe --experts 32 --experts-used 4 --arch deepseek2

``gguf``: a ``llama``-architecture GGUF with every matrix in Q4_0 (as ``llama-quantize --pure``
writes it: LLaMA-2-7B's shape makes 3.8 GB) and the norms in F32. ``hf``: a Hugging Face directory
(``config.json``, f16 safetensors in shards with their index, ``tokenizer.json``). Both carry the
byte-level BPE tokenizer of ``examples/models/relu-llama-ptb`` with its vocabulary padded to the
shape's (the padding tokens are never produced), so calibration text goes through them.

The weights are random and claim no accuracy, but profiling finds what it finds in real models:
a power-law spread of activation frequencies. Every token embedding is a shared direction ``u``
plus noise, and attention and the FFNs add little to the residual, so every layer's normed input
``x`` has ``u/sqrt(d) . x`` close to ``sqrt(d/2)``. Neuron ``i``'s gate row is ``b_i u / d`` plus
noise of variance ``1/d``, so its pre-activation is about ``N(b_i / sqrt(2), 1)`` and it fires
(``> 0``) with probability ``p_i = Phi(b_i / sqrt(2))``. The ``p_i`` of a layer follow
``min(P_MAX, P_MIN (n / rank)^BETA)`` over its neurons in a random order: a few fire for almost
every token, most for one in fifty (about 10% of a layer active on average, ReLU-LLaMA's order).
``--ffn relu`` makes the FFNs ``relu(gate) * up`` (ReLU-LLaMA; marked by the GGUF key
``picc.ffn_activation``, which picc's GGUF frontend reads), ``swiglu`` ``silu(gate) * up``.
``--experts E --experts-used K`` (GGUF): each FFN a mixture of E experts of ``n_ff`` neurons, K a
token, as a Mixtral file has them (``ffn_gate_inp``, ``ffn_gate_exps`` [E, n_ff, hidden], ...):
the router's rows are noise of variance ``1/d``, so its logits are about ``N(0, 1)`` and each
token's choice follows the noise of its own embedding (a router that saw ``u`` in every token
would give every token the same experts, with all the weight on the first); the experts' gate
rows carry no bias (their neurons are not profiled). ``--arch gpt-oss`` (with ``--experts``) writes
those experts as a ``gpt-oss`` file has them: MXFP4 experts with biases, the router's bias, biases
on q, k, v and o, each attention's sinks, every even layer sliding by 128, yarn rope (factor 32
over 4096, 20B's); the biases and sinks are small noise. ``--arch deepseek2`` (with ``--experts``)
writes DeepSeek-V2-Lite's layer at the shape's width, as llama.cpp's converter writes it today: the
latent attention (q straight from x, a latent of ``kv_rank`` (:func:`deepseek2_latent`),
``rope``-wide rotated keys shared by the heads, heads of ``nope + rope`` and values of ``v``;
``attn_k_b`` and ``attn_v_b`` per head), layer 0 a dense FFN of ``4 hidden``, the others the
experts with :data:`DEEPSEEK2_SHARED` shared ones, the softmax's top k.

Tensors are made and written one at a time, into a temp file (or folder) renamed into place when
complete: memory stays at a few hundred MB whatever the shape, and an interrupted run leaves
nothing half-written. The generator refuses to start without room for what it writes, and says
how much it needs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import ndtri

from picc import quant
from picc.errors import PiccError
from picc.frontend.gguf import ACTIVATION_KEY
from picc.fsutil import atomic_path
from picc.ir.types import DType
from picc.progress import progress_bar

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "examples" / "models" / "relu-llama-ptb"
P_MIN, P_MAX, BETA = 0.02, 0.98, 0.8  # the activation frequencies' power law (module docstring)
RESIDUAL_SHARE = 0.1  # each attention and FFN output's std, against the residual's ~1.4


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    n_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


SHAPES = {
    "7b": Shape(4096, 11008, 32, 32, 32, 32000),  # LLaMA-2-7B
    "1b": Shape(2048, 8192, 16, 32, 8, 32000),  # LLaMA-3.2-1B's blocks, LLaMA-2's vocabulary
    "tiny": Shape(64, 256, 2, 4, 2, 8192),  # the generator's test
    "moe": Shape(1024, 1024, 8, 16, 8, 8192),  # with --experts: n_ff is an expert's (bench/moe.py)
}


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor to make: its GGUF name, shape (rows, columns) and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "ones", "embed", "gate", "normal"
    std: float = 1.0
    layer: int = -1


def tensor_specs(shape: Shape, experts: int = 0, arch: str = "llama") -> list[Spec]:
    """Every tensor of the model in GGUF's order and naming (HF names come from :func:`hf_name`);
    with ``experts``, each FFN a mixture of them (GGUF only), as ``arch`` (llama or gpt-oss) names them."""
    if arch == "gpt-oss":
        return _gpt_oss_specs(shape, experts)
    if arch == "deepseek2":
        return _deepseek2_specs(shape, experts)
    d, kv = shape.hidden, shape.n_kv_heads * shape.head_dim
    # The FFN's output std is about std * sqrt(active neurons * E[act^2]); ~10% active, E ~ 1.
    down_std = RESIDUAL_SHARE / math.sqrt(0.1 * shape.n_ff)
    specs = [Spec("token_embd.weight", (shape.vocab, d), "embed")]
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        specs += [
            Spec(b + "attn_norm.weight", (d,), "ones", layer=i),
            Spec(b + "attn_q.weight", (d, d), "normal", 1 / math.sqrt(d), i),
            Spec(b + "attn_k.weight", (kv, d), "normal", 1 / math.sqrt(d), i),
            Spec(b + "attn_v.weight", (kv, d), "normal", 1 / math.sqrt(d), i),
            Spec(b + "attn_output.weight", (d, d), "normal", RESIDUAL_SHARE / math.sqrt(d), i),
            Spec(b + "ffn_norm.weight", (d,), "ones", layer=i),
        ]
        if experts:
            specs += [
                Spec(b + "ffn_gate_inp.weight", (experts, d), "normal", 1 / math.sqrt(d), i),
                Spec(b + "ffn_gate_exps.weight", (experts, shape.n_ff, d), "normal", 1 / math.sqrt(d), i),
                Spec(b + "ffn_up_exps.weight", (experts, shape.n_ff, d), "normal", 1 / math.sqrt(d), i),
                Spec(b + "ffn_down_exps.weight", (experts, d, shape.n_ff), "normal", RESIDUAL_SHARE / math.sqrt(
                    shape.n_ff), i),
            ]
            continue
        specs += [
            Spec(b + "ffn_gate.weight", (shape.n_ff, d), "gate", 1 / math.sqrt(d), i),
            Spec(b + "ffn_up.weight", (shape.n_ff, d), "normal", 1 / math.sqrt(d), i),
            Spec(b + "ffn_down.weight", (d, shape.n_ff), "normal", down_std, i),
        ]
    specs += [Spec("output_norm.weight", (d,), "ones"), Spec("output.weight", (shape.vocab, d), "normal",
                                                            1 / math.sqrt(d))]
    return specs


BIAS_STD = 0.02  # gpt-oss's biases and sinks: small noise
DEEPSEEK2_SHARED, DEEPSEEK2_DENSE = 2, 1  # deepseek2: its shared experts and leading dense layers


def deepseek2_latent(shape: Shape) -> tuple[int, int, int, int]:
    """A deepseek2 file's (kv_rank, nope, rope, v) at ``shape``'s heads, in V2-Lite's proportions
    (512, 128, 64, 128 at heads of 128); nope at least a Q4_0 block (attn_k_b's rows)."""
    hd = shape.head_dim
    return 4 * hd, max(hd, 32), hd // 2, hd


def _gpt_oss_specs(shape: Shape, experts: int) -> list[Spec]:
    """A ``gpt-oss`` file's tensors (``convert_hf_to_gguf.py``'s ``GptOssModel``) of ``shape``."""
    d, kv, q = shape.hidden, shape.n_kv_heads * shape.head_dim, shape.n_heads * shape.head_dim
    specs = [Spec("token_embd.weight", (shape.vocab, d), "embed")]
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        specs += [Spec(b + "attn_norm.weight", (d,), "ones", layer=i)]
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            specs += [Spec(b + name + ".weight", (rows, d), "normal", 1 / math.sqrt(d), i),
                      Spec(b + name + ".bias", (rows,), "normal", BIAS_STD, i)]
        specs += [
            Spec(b + "attn_output.weight", (d, q), "normal", RESIDUAL_SHARE / math.sqrt(q), i),
            Spec(b + "attn_output.bias", (d,), "normal", BIAS_STD, i),
            Spec(b + "attn_sinks.weight", (shape.n_heads,), "normal", BIAS_STD, i),
            Spec(b + "post_attention_norm.weight", (d,), "ones", layer=i),
            Spec(b + "ffn_gate_inp.weight", (experts, d), "normal", 1 / math.sqrt(d), i),
            Spec(b + "ffn_gate_inp.bias", (experts,), "normal", BIAS_STD, i),
        ]
        into = 1 / math.sqrt(d)
        for name, rows, cols, std in (("gate", shape.n_ff, d, into), ("up", shape.n_ff, d, into),
                                      ("down", d, shape.n_ff, RESIDUAL_SHARE / math.sqrt(shape.n_ff))):
            specs += [Spec(f"{b}ffn_{name}_exps.weight", (experts, rows, cols), "normal", std, i),
                      Spec(f"{b}ffn_{name}_exps.bias", (experts, rows), "normal", BIAS_STD, i)]
    return specs + [Spec("output_norm.weight", (d,), "ones"),
                    Spec("output.weight", (shape.vocab, d), "normal", 1 / math.sqrt(d))]


def _deepseek2_specs(shape: Shape, experts: int) -> list[Spec]:
    """A ``deepseek2`` file's tensors (``DeepseekV2Model``, the split latent layout) of ``shape``."""
    d, heads = shape.hidden, shape.n_heads
    rank, nope, rope, v = deepseek2_latent(shape)
    into = 1 / math.sqrt(d)
    specs = [Spec("token_embd.weight", (shape.vocab, d), "embed")]
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        specs += [
            Spec(b + "attn_norm.weight", (d,), "ones", layer=i),
            Spec(b + "attn_q.weight", (heads * (nope + rope), d), "normal", into, i),
            Spec(b + "attn_kv_a_mqa.weight", (rank + rope, d), "normal", into, i),
            Spec(b + "attn_kv_a_norm.weight", (rank,), "ones", layer=i),
            Spec(b + "attn_k_b.weight", (heads, rank, nope), "normal", 1 / math.sqrt(rank), i),
            Spec(b + "attn_v_b.weight", (heads, v, rank), "normal", 1 / math.sqrt(rank), i),
            Spec(b + "attn_output.weight", (d, heads * v), "normal", RESIDUAL_SHARE / math.sqrt(heads * v), i),
            Spec(b + "ffn_norm.weight", (d,), "ones", layer=i),
        ]
        if i < DEEPSEEK2_DENSE:
            n_ff = 4 * d  # write_gguf's feed_forward_length
            specs += [Spec(b + "ffn_gate.weight", (n_ff, d), "normal", into, i),
                      Spec(b + "ffn_up.weight", (n_ff, d), "normal", into, i),
                      Spec(b + "ffn_down.weight", (d, n_ff), "normal", RESIDUAL_SHARE / math.sqrt(n_ff), i)]
            continue
        down = RESIDUAL_SHARE / math.sqrt(shape.n_ff)
        shared = DEEPSEEK2_SHARED * shape.n_ff
        specs += [
            Spec(b + "ffn_gate_inp.weight", (experts, d), "normal", into, i),
            Spec(b + "ffn_gate_exps.weight", (experts, shape.n_ff, d), "normal", into, i),
            Spec(b + "ffn_up_exps.weight", (experts, shape.n_ff, d), "normal", into, i),
            Spec(b + "ffn_down_exps.weight", (experts, d, shape.n_ff), "normal", down, i),
            Spec(b + "ffn_gate_shexp.weight", (shared, d), "normal", into, i),
            Spec(b + "ffn_up_shexp.weight", (shared, d), "normal", into, i),
            Spec(b + "ffn_down_shexp.weight", (d, shared), "normal", down, i),
        ]
    return specs + [Spec("output_norm.weight", (d,), "ones"), Spec("output.weight", (shape.vocab, d), "normal", into)]


def activation_frequencies(n: int, rng: np.random.Generator) -> np.ndarray:
    """The firing probability each of a layer's ``n`` neurons is built for, in a random order."""
    rank = np.arange(1, n + 1, dtype=np.float64)
    p = np.minimum(P_MAX, P_MIN * (n / rank) ** BETA)
    return rng.permutation(p)


def make_tensor(spec: Spec, shape: Shape, seed: int) -> np.ndarray:
    """The float32 values of ``spec``: the same for the same ``seed``, whatever else is made."""
    rng = np.random.default_rng([seed, zlib_crc(spec.name)])
    if spec.kind == "ones":
        return np.ones(spec.shape, np.float32)
    u = shared_direction(shape.hidden, seed)
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    if spec.kind == "embed":
        return x + u  # noise and the shared direction, each of rms 1
    x *= np.float32(spec.std)
    if spec.kind == "gate":
        b = np.sqrt(2.0) * ndtri(activation_frequencies(spec.shape[0], rng))
        x += (b[:, None] / shape.hidden).astype(np.float32) * u
    return x


def shared_direction(hidden: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal(hidden, dtype=np.float32)


def zlib_crc(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def stored_dtype(spec: Spec, fmt: str, arch: str = "llama") -> DType:
    """Q4_0 for the GGUF's matrices (F32 norms, biases and routers, as llama-quantize keeps them;
    a gpt-oss file's experts MXFP4, as released); f16 for everything in an HF directory."""
    if fmt == "hf":
        return DType.F16
    if len(spec.shape) == 1 or "gate_inp" in spec.name or spec.name.endswith(".bias"):
        return DType.F32
    return DType.MXFP4 if arch == "gpt-oss" and "_exps" in spec.name else DType.Q4_0


def nbytes(specs: list[Spec], fmt: str, arch: str = "llama") -> int:
    return sum(quant.raw_nbytes(stored_dtype(s, fmt, arch).value, s.shape) for s in specs)


def check_room(directory: Path, needed: int) -> None:
    """Refuse to start unless ``directory``'s file system has ``needed`` bytes free (and 1% more)."""
    free = shutil.disk_usage(directory).free
    if free < needed * 1.01:
        raise PiccError(f"{directory}: the checkpoint needs {needed / 1e9:.2f} GB and only "
                        f"{free / 1e9:.2f} GB are free there")


def encoded(specs: list[Spec], shape: Shape, seed: int, fmt: str,
            arch: str = "llama") -> Iterator[tuple[Spec, np.ndarray]]:
    """Each tensor's stored data (Q4_0 or MXFP4 blocks, f32 or f16), one at a time, with a progress bar."""
    with progress_bar(len(specs), f"making {fmt} weights", "tensor") as advance:
        for spec in specs:
            values = make_tensor(spec, shape, seed)
            yield spec, quant.quantize(values, stored_dtype(spec, fmt, arch).value)
            advance(1)


# ----------------------------------------------------------------------------- tokenizer

def tokenizer_json(vocab: int) -> dict:
    """relu-demo's tokenizer.json, its vocabulary padded to ``vocab`` with unused tokens."""
    doc = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    table = doc["model"]["vocab"]
    if vocab < len(table):
        raise PiccError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(table)} tokens")
    for i in range(len(table), vocab):
        table[f"<unused{i}>"] = i
    return doc


def write_gguf_tokenizer(writer, vocab: int, pre: str = "default") -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """relu-demo's tokenizer as GGUF metadata; ``pre``: the pre-tokenizer's name (a file picc reads
    through transformers ignores it; one it reads as llama.cpp does must name one it knows)."""
    doc = tokenizer_json(vocab)
    tokens = sorted(doc["model"]["vocab"], key=doc["model"]["vocab"].__getitem__)
    specials = {t["content"] for t in doc["added_tokens"]}
    # GGUF token types: 1 normal, 3 control, 5 unused
    types = [3 if t in specials else 5 if t.startswith("<unused") else 1 for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)


# ----------------------------------------------------------------------------- writers

def write_gguf(path: Path, shape: Shape, ffn: str, seed: int, experts: int = 0, experts_used: int = 0,
               arch: str = "llama") -> None:
    import gguf

    specs = tensor_specs(shape, experts, arch)
    check_room(path.parent, nbytes(specs, "gguf", arch))
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(f"picc synthetic {ffn} {arch}")
        w.add_context_length(4096)
        w.add_embedding_length(shape.hidden)
        w.add_block_count(shape.n_layers)
        deepseek2 = arch == "deepseek2"  # its dense layers' width; one K/V head (the split latent's)
        w.add_feed_forward_length(4 * shape.hidden if deepseek2 else shape.n_ff)
        w.add_head_count(shape.n_heads)
        w.add_head_count_kv(1 if deepseek2 else shape.n_kv_heads)
        w.add_rope_dimension_count(deepseek2_latent(shape)[2] if deepseek2 else shape.head_dim)
        w.add_rope_freq_base(150000.0 if arch == "gpt-oss" else 10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        if arch == "llama":
            w.add_string(ACTIVATION_KEY, "relu" if ffn == "relu" else "silu")
        if experts:
            w.add_expert_count(experts)
            w.add_expert_used_count(experts_used)
        if arch == "gpt-oss":  # as GptOssModel writes 20B's
            w.add_expert_feed_forward_length(shape.n_ff)
            w.add_key_length(shape.head_dim)
            w.add_value_length(shape.head_dim)
            w.add_sliding_window(128)
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(32.0)
            w.add_rope_scaling_orig_ctx_len(4096)
        if deepseek2:  # as DeepseekV2Model writes V2-Lite's (the split latent layout)
            rank, nope, rope, v = deepseek2_latent(shape)
            w.add_expert_feed_forward_length(shape.n_ff)
            w.add_leading_dense_block_count(DEEPSEEK2_DENSE)
            w.add_expert_shared_count(DEEPSEEK2_SHARED)
            w.add_expert_weights_scale(1.0)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
            w.add_kv_lora_rank(rank)
            w.add_q_lora_rank(0)  # none; llama.cpp wants the key unless the layer count is V2-Lite's 27
            w.add_key_length(rank + rope)
            w.add_value_length(rank)
            w.add_key_length_mla(nope + rope)
            w.add_value_length_mla(v)
            w.add_vocab_size(shape.vocab)
        # deepseek2: GPT-2's split (relu-demo's, but for its leading space), as picc reads the file itself
        write_gguf_tokenizer(w, shape.vocab, "gpt-2" if arch == "deepseek2" else "default")
        for s in specs:
            dtype = stored_dtype(s, "gguf", arch)
            raw = quant.raw_shape(dtype.value, s.shape)
            size = quant.raw_nbytes(dtype.value, s.shape)
            if len(s.shape) == 3:  # experts (and deepseek2's k_b, v_b): [experts, rows, cols] of the rows' blocks
                raw = (s.shape[0], *quant.raw_shape(dtype.value, s.shape[1:]))
            if dtype == DType.F32:
                w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), size)
            else:
                w.add_tensor_info(s.name, raw, np.dtype(np.uint8), size, gguf.GGMLQuantizationType[dtype.name])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, data in encoded(specs, shape, seed, "gguf", arch):
            w.write_tensor_data(data)
        w.close()


_HF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
_HF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _HF_GLOBAL:
        return _HF_GLOBAL[gguf_name]
    _, layer, what, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_HF_LAYER[what]}.weight"


def hf_config(shape: Shape, ffn: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.n_ff, "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads,
            "head_dim": shape.head_dim, "vocab_size": shape.vocab, "hidden_act": "relu" if ffn == "relu" else "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
            "attention_bias": False, "mlp_bias": False}


def write_hf(directory: Path, shape: Shape, ffn: str, seed: int, shard_bytes: int) -> None:
    """An HF directory written as ``.<name>.tmp`` beside ``directory``, renamed when complete."""
    from safetensors.numpy import save_file

    specs = tensor_specs(shape)
    if directory.exists():
        raise PiccError(f"{directory} exists; remove it first")
    check_room(directory.parent, nbytes(specs, "hf"))
    tmp = directory.parent / f".{directory.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        for spec, data in encoded(specs, shape, seed, "hf"):
            if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + data.nbytes > shard_bytes:
                _save_shard(save_file, tmp, shards, len(shards) - 1)
                shards.append({})
            shards[-1][hf_name(spec.name)] = data
        _save_shard(save_file, tmp, shards, len(shards) - 1)
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards):
            weight_map.update({name: _shard_name(i, n) for name in names})
        for i in range(n):
            (tmp / f"part{i}.safetensors").rename(tmp / _shard_name(i, n))
        index = {"metadata": {"total_size": nbytes(specs, "hf")}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(hf_config(shape, ffn), indent=1))
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json(shape.vocab)))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(TOKENIZER_DIR / name, tmp / name)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_shard(save_file, tmp: Path, shards: list[dict[str, np.ndarray]], i: int) -> None:  # noqa: ANN001
    save_file(shards[i], str(tmp / f"part{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = dict.fromkeys(shards[i])  # the names stay for the index; the data goes


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("format", choices=("gguf", "hf"))
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--ffn", choices=("relu", "swiglu"), default="swiglu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", default="1GB", help="hf: the most bytes of weights in one shard")
    p.add_argument("--experts", type=int, default=0, help="gguf: each FFN a mixture of this many experts")
    p.add_argument("--experts-used", type=int, default=2, help="gguf: the experts a token runs (default 2)")
    p.add_argument("--arch", choices=("llama", "gpt-oss", "deepseek2"), default="llama",
                   help="gguf: llama (Mixtral's experts), gpt-oss (needs --experts; MXFP4 experts, sinks, biases) or "
                        "deepseek2 (needs --experts; V2-Lite's latent attention and shared experts)")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.experts and (args.format != "gguf" or not 0 < args.experts_used <= args.experts):
        print("error: --experts needs gguf and 1 <= --experts-used <= --experts", file=sys.stderr)
        return 1
    if args.arch != "llama" and not args.experts:
        print(f"error: --arch {args.arch} needs --experts", file=sys.stderr)
        return 1
    start = time.perf_counter()
    try:
        if args.format == "gguf":
            write_gguf(args.out, shape, args.ffn, args.seed, args.experts, args.experts_used, args.arch)
        else:
            from picc.targets import parse_size

            write_hf(args.out, shape, args.ffn, args.seed, parse_size(args.shard_size, what="--shard-size"))
    except PiccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({nbytes(tensor_specs(shape, args.experts, args.arch), args.format, args.arch) / 1e9:.2f} "
          "GB of weights) "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
