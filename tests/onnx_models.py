"""ONNX exports of the tiny random checkpoints of hf_models.py, and onnxruntime as the reference.

Usage (from a test)::

    from onnx_models import export_hf, ort_logits
    path = export_hf(hf_dir, out_dir, cache=True)      # out_dir/model.onnx + config.json copied
    ref = ort_logits(path, [1, 5, 9, 3], prefill=2)    # (tokens, vocab), via the KV cache

Exports use ``torch.onnx.export(..., dynamo=True)`` (needs onnxscript). With ``cache=True`` the
graph takes ``attention_mask`` and ``past_key_values.N.key/value`` [1, kv_heads, past, head_dim]
and returns ``present.N.key/value``, the layout optimum and onnxruntime-genai use. The HF
checkpoint's config.json / generation_config.json are copied next to the .onnx (as optimum does),
so the ONNX frontend sees the same BOS/EOS ids and context length as the HF frontend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["export_hf", "export_torchscript", "ort_logits", "build_genai", "rotary_outside_attention", "write_word_tokenizer"]


def _cache_wrapper(model):  # noqa: ANN001, ANN202 - torch modules, imported lazily
    import torch
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers

    class WithCache(torch.nn.Module):
        """forward(input_ids, attention_mask, *past) -> (logits, *present), flat tensors only."""

        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, *past):  # noqa: ANN001, ANN202
            cache = DynamicCache(config=self.m.config)
            for i in range(n_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                         use_cache=True)
            present = []
            for layer in out.past_key_values.layers[:n_layers]:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return WithCache().eval()


def _logits_wrapper(model):  # noqa: ANN001, ANN202
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids):  # noqa: ANN001, ANN202
            return self.m(input_ids=input_ids, use_cache=False).logits

    return LogitsOnly().eval()


def export_hf(hf_dir: Path, out_dir: Path, *, cache: bool, attn: str = "eager", dtype: str = "float32") -> Path:
    """Export the checkpoint in ``hf_dir`` to ``out_dir/model.onnx`` (config files copied beside it)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype), attn_implementation=attn,
                                                 local_files_only=True).eval()
    cfg = model.config
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    ids = torch.tensor([[1, 5, 9, 3]])
    if cache:
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        past = tuple(torch.zeros(1, n_kv, 3, hd, dtype=model.dtype) for _ in range(2 * cfg.num_hidden_layers))
        names = [f"past_key_values.{i}.{kv}" for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]
        args = (ids, torch.ones(1, 3 + ids.shape[1], dtype=torch.long), *past)
        program = torch.onnx.export(
            _cache_wrapper(model), args, dynamo=True, optimize=True,
            input_names=["input_ids", "attention_mask", *names],
            output_names=["logits", *[n.replace("past_key_values", "present") for n in names]],
            dynamic_shapes={"input_ids": {1: "seq"}, "attention_mask": {1: "total"},
                            "past": tuple({2: "past"} for _ in past)})
    else:
        program = torch.onnx.export(_logits_wrapper(model), (ids,), dynamo=True, optimize=True,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes={"input_ids": {1: "seq"}})
    program.save(str(path))
    for name in ("config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    return path


def export_torchscript(hf_dir: Path, out_dir: Path) -> Path:
    """Export with the legacy TorchScript exporter (``dynamo=False``, opset 17; no KV cache): the
    layout of older optimum exports (decomposed GELU, named nodes). Works for OPT; it fails on
    LLaMA in transformers 5 (``aten::diff``)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(_logits_wrapper(model), (torch.tensor([[1, 5, 9, 3]]),), str(path), dynamo=False,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {1: "seq"}}, opset_version=17)
    for name in ("config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    return path


def ort_logits(path: Path, ids: list[int], prefill: int | None = None) -> np.ndarray:
    """onnxruntime's float32 logits for ``ids`` (tokens, vocab).

    A graph with KV-cache inputs runs ``ids[:prefill]`` first and then one token at a time,
    feeding each step's presents back as the next step's past; a graph without runs all at once.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    if not any(n.startswith("past") for n in inputs):
        return session.run(["logits"], {"input_ids": np.array([ids], np.int64)})[0][0].astype(np.float32)
    dtype = np.float16 if "float16" in inputs[next(n for n in inputs if n.startswith("past"))].type else np.float32
    past: dict[str, np.ndarray] = {}
    for name, i in inputs.items():
        if name.startswith("past"):
            past[name] = np.zeros((1, i.shape[1], 0, _head_size(path, i.shape[3])), dtype)
    chunks = [ids[: prefill or len(ids)]] + [[t] for t in ids[prefill or len(ids):]]
    done, logits = 0, []
    for chunk in chunks:
        done += len(chunk)
        feeds = {"input_ids": np.array([chunk], np.int64), **past}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, done), np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(done - len(chunk), done, dtype=np.int64)[None]
        result = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        logits.append(result["logits"][0].astype(np.float32))
        past = {n: result[n.replace("past_key_values", "present")] for n in past}
    return np.concatenate(logits)


def _head_size(path: Path, dim: object) -> int:
    """The head size of a KV input: its static dim, or genai_config.json's head_size."""
    if isinstance(dim, int):
        return dim
    return int(json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"])


def write_word_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` made-up words (``<unk>``, ``<s>``, ``</s>``, w3, w4,
    ...), saved as tokenizer.json + tokenizer_config.json: enough for tools that need one."""
    import tokenizers

    table = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}))


def build_genai(hf_dir: Path, out_dir: Path, *extra_options: str) -> Path:
    """Run onnxruntime-genai's model builder (fp32, CPU) on ``hf_dir``; returns out_dir/model.onnx.
    ``extra_options`` are the builder's ``key=value`` extra options.

    The builder loads the tokenizer, so ``hf_dir`` gets a local word-level one first; the hub is
    never contacted (HF_HUB_OFFLINE=1).
    """
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    if not (hf_dir / "tokenizer.json").is_file():
        write_word_tokenizer(hf_dir, vocab)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
           "-p", "fp32", "-e", "cpu", "-c", str(out_dir / "cache")]
    if extra_options:
        cmd += ["--extra_options", *extra_options]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"model builder failed:\n{done.stderr[-3000:]}")
    return out_dir / "model.onnx"


def rotary_outside_attention(src: Path, dst: Path) -> Path:
    """A genai model with separate q/k/v, rewritten to rotate q and k with ``RotaryEmbedding``
    nodes (reading a new ``position_ids`` input) before ``GroupQueryAttention`` (``do_rotary=0``):
    the layout the builder emits for execution providers without rotary inside GQA."""
    import onnx
    from onnx import helper

    model = onnx.load(str(src))
    graph = model.graph
    nodes = []
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            cos, sin = node.input[7], node.input[8]
            for k in (0, 1):  # query, key
                rotated = node.input[k] + "/rotary"
                nodes.append(helper.make_node("RotaryEmbedding", [node.input[k], "position_ids", cos, sin], [rotated],
                                              name=f"{node.name}/rotary{k}", domain="com.microsoft", interleaved=0))
                node.input[k] = rotated
            node.input[7] = node.input[8] = ""
            next(a for a in node.attribute if a.name == "do_rotary").i = 0
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.insert(1, helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, "seq"]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    shutil.copy(src.parent / "genai_config.json", dst.parent / "genai_config.json")
    return dst
