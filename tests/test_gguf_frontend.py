"""The GGUF frontend on small files written here, from random HF LLaMAs, Qwen2s and Qwen3s, the way
llama.cpp does.

llama.cpp's converter permutes the rows of a LLaMA's q/k per head for its interleaved rope (not a
Qwen's, which it runs with the half-split rope) and stores tensors with reversed dims; importing
such a file must reproduce transformers' logits for the original HF model. Tolerance: relative L2 <= 1e-4 (float32 on both sides, only the summation
order differs).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
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
               drop_keys=()):
    """Write the HF model in ``hf_dir`` (a llama, or a qwen2 / qwen3 with ``arch`` saying so) as a
    GGUF file, matrices in ``quant_type``."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    meta = {
        "block_count": (w.add_block_count, cfg["num_hidden_layers"]),
        "embedding_length": (w.add_embedding_length, cfg["hidden_size"]),
        "feed_forward_length": (w.add_feed_forward_length, cfg["intermediate_size"]),
        "head_count": (w.add_head_count, h),
        "head_count_kv": (w.add_head_count_kv, kv),
        "rms_eps": (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
        "rope_freq_base": (w.add_rope_freq_base, cfg["rope_parameters"]["rope_theta"]),
    }
    if cfg.get("head_dim"):
        meta["key_length"] = (w.add_key_length, cfg["head_dim"])
    permute = llama_cpp_permute if arch == "llama" else lambda x, heads: x
    for key, (add, value) in meta.items():
        if key not in drop_keys:
            add(value)

    def tensor(name, x, qt=Q.F32):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if qt == Q.F32 or x.ndim == 1:
            w.add_tensor(name, x)
        elif qt == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            raw = quant.quantize(x, qt.name.lower())
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)

    tensor("token_embd.weight", sd["model.embed_tokens.weight"], quant_type)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
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
        tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            tensor(f"blk.{i}.ffn_{ours}.weight", sd[p + f"mlp.{theirs}.weight"], quant_type)
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


def round_trip_hf_weights(hf_dir, out_dir, qt):
    """A copy of the HF model whose matrices are what ``qt`` stores: dequantize(quantize(w)).

    Quantizing rows in blocks commutes with llama.cpp's row permutation, so this is exactly the
    model the GGUF file holds, and transformers' logits for it are the reference.
    """
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_dir, out_dir)
    sd = load_file(str(hf_dir / "model.safetensors"))
    name = qt.name.lower()
    for key, w in sd.items():
        if w.ndim == 2:
            sd[key] = quant.dequantize(quant.quantize(w, name), name, w.shape)
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("qt, dtype", [(Q.F16, DType.F16), (Q.Q8_0, DType.Q8_0), (Q.Q4_0, DType.Q4_0),
                                       (Q.Q4_1, DType.Q4_1)])
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


@pytest.mark.parametrize("family, qt", [("qwen2", Q.F32), ("qwen3", Q.F32), ("qwen3", Q.Q4_1)])
def test_qwen_ggufs_match_transformers(family, qt, tmp_path):
    # Rows as transformers has them (no permutation) and the half-split rope; Qwen2's q, k, v
    # biases; Qwen3's norms of each head's q and k, with heads wider than hidden / heads.
    hf_dir = tmp_path / family
    make_model(family, "head-dim" if family == "qwen3" else "base", hf_dir)
    model = load_model(write_gguf(hf_dir, tmp_path / "m.gguf", arch=family, quant_type=qt))
    verify(model.module)
    assert {op.style for op in model.module.ops() if op.NAME == "rope"} == {"llama"}
    assert sum(op.NAME == "rms_norm" and op.group == 32 for op in model.module.ops()) == 4 * (family == "qwen3")
    reference = round_trip_hf_weights(hf_dir, tmp_path / "hf_q", qt) if qt != Q.F32 else hf_dir
    got = Interpreter(model.module, model.weights).run(TOKENS)
    assert rel_l2(got, reference_logits(reference, TOKENS)) <= 1e-4


def test_missing_output_means_tied_embeddings(hf_llama, tmp_path):
    hf_dir, _ = hf_llama
    model = load_model(write_gguf(hf_dir, tmp_path / "t.gguf", tie=True))
    logits_op = model.module.function().producer("logits")
    assert logits_op.weight == "token_embd"
    assert "output" not in model.module.weight_types()


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported (supported: llama, qwen2, qwen3)"),
    (dict(drop_keys=("head_count",)), "GGUF metadata key 'llama.attention.head_count' is missing"),
    (dict(extra={"blk.0.ffn_up.weight.q5": (np.zeros((8, 64)), Q.F32)}),
     "tensor 'blk.0.ffn_up.weight.q5' is not part of a llama model picc knows"),
    (dict(extra={"rope_freqs.weight": (np.ones(8), Q.F32)}),
     "per-frequency rope factors (rope_freqs.weight"),
])
def test_unsupported_files_are_refused_in_one_line(hf_llama, tmp_path, kwargs, message):
    hf_dir, _ = hf_llama
    path = write_gguf(hf_dir, tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(PiccError) as e:
        load_model(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


def test_unsupported_quant_type_is_named(hf_llama, tmp_path):
    hf_dir, _ = hf_llama
    path = tmp_path / "q5.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 22), np.uint8), raw_shape=(4, 22), raw_dtype=Q.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PiccError, match=r"tensor 'token_embd.weight' has quant type Q5_0; supported: F32, F16, BF16, "
                                        r"Q4_0, Q4_1, Q8_0"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    with pytest.raises(PiccError, match="junk.gguf: not a readable GGUF file"):
        load_model(path)
