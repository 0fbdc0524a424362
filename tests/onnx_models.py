"""ONNX exports of the tiny random checkpoints of hf_models.py, and onnxruntime as the reference.

Also graphs other toolchains make (onnxruntime-genai's builder; onnxruntime's fused-attention
layout, written by hand) and rewrites of exports into equivalent layouts, for the patterns
exporters emit only in some configurations.

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
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["export_hf", "export_torchscript", "ort_logits", "build_genai", "rotary_outside_attention",
           "cache_inside_attention", "build_contrib_attention_opt", "upcast_fp16", "write_word_tokenizer"]


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


def export_hf(hf_dir: Path, out_dir: Path, *, cache: bool, attn: str = "eager", dtype: str = "float32",
              opset: int | None = None) -> Path:
    """Export the checkpoint in ``hf_dir`` to ``out_dir/model.onnx`` (config files copied beside it).
    ``opset``: the exporter's default (20 with torch 2.13) unless given; from 23 on, torch.onnx's optimizer fuses
    SDPA, RMSNorm and rotate_half into ONNX's ``Attention``, ``RMSNormalization`` and
    ``RotaryEmbedding``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype), attn_implementation=attn,
                                                 local_files_only=True).eval()
    cfg = model.config
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    ids = torch.tensor([[1, 5, 9, 3]])
    extra = {"opset_version": opset} if opset else {}
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
                            "past": tuple({2: "past"} for _ in past)}, **extra)
    else:
        program = torch.onnx.export(_logits_wrapper(model), (ids,), dynamo=True, optimize=True,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes={"input_ids": {1: "seq"}}, **extra)
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
    Cache inputs are ``past_key_values.N.key/value`` [1, kv_heads, past, head_dim] (outputs
    ``present.N.key/value``) or, for com.microsoft's Attention, ``past_N`` [2, 1, heads, past,
    head_dim] (outputs ``present_N``).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    past: dict[str, np.ndarray] = {}
    for name, i in inputs.items():
        if name.startswith("past"):
            dtype = np.float16 if "float16" in i.type else np.float32
            *lead, _, head = i.shape  # [..., batch, heads, past, head_dim]: batch 1, past 0
            lead = [d if isinstance(d, int) else 1 for d in lead]
            past[name] = np.zeros((*lead, 0, _head_size(path, head)), dtype)
    cut = (prefill or len(ids)) if past else len(ids)
    chunks = [ids[:cut]] + [[t] for t in ids[cut:]]
    done, logits = 0, []
    for chunk in chunks:
        done += len(chunk)
        feeds = {"input_ids": np.array([chunk], np.int64), **past}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, done), _int_type(inputs["attention_mask"].type))
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(done - len(chunk), done, dtype=np.int64)[None]
        result = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        logits.append(result["logits"][0].astype(np.float32))
        past = {n: result[re.sub(r"^past(_key_values)?", "present", n)] for n in past}
    return np.concatenate(logits)


def _int_type(onnx_type: str) -> type:
    return np.int32 if onnx_type == "tensor(int32)" else np.int64


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

    The builder loads the tokenizer, so a checkpoint without one is copied next to ``out_dir``
    with a local word-level one (``hf_dir`` itself is left alone); the hub is never contacted
    (HF_HUB_OFFLINE=1).
    """
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    if not (hf_dir / "tokenizer.json").is_file():
        hf_dir = Path(shutil.copytree(hf_dir, out_dir.with_name(out_dir.name + "-src"), dirs_exist_ok=True))
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
    """A genai model rewritten to the layout the builder emits for execution providers without
    rotary inside GroupQueryAttention: the packed QKV MatMul split into q, k and v MatMuls, q and
    k rotated by ``RotaryEmbedding`` nodes (reading a new ``position_ids`` input), GQA with
    separate q/k/v and ``do_rotary=0``. (Rewriting the packed model saves a second builder run.)"""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    nodes, dropped = [], set()
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            heads = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
            packed = producer[node.input[0]]
            assert packed.op_type == "MatMul" and packed.input[1] in weights, packed
            dropped.update((packed.output[0], packed.input[1]))
            w = numpy_helper.to_array(weights[packed.input[1]])
            d = w.shape[1] // (heads["num_heads"] + 2 * heads["kv_num_heads"])
            cuts = np.cumsum([0, heads["num_heads"] * d, heads["kv_num_heads"] * d, heads["kv_num_heads"] * d])
            cos, sin = node.input[7], node.input[8]
            for k, part in enumerate("qkv"):
                name = f"{node.name}/{part}_proj"
                graph.initializer.append(numpy_helper.from_array(w[:, cuts[k]:cuts[k + 1]], name + ".weight"))
                nodes.append(helper.make_node("MatMul", [packed.input[0], name + ".weight"], [name], name=name))
                node.input[k] = name
                if part != "v":
                    rotated = name + "/rotary"
                    nodes.append(helper.make_node("RotaryEmbedding", [name, "position_ids", cos, sin], [rotated],
                                                  name=rotated, domain="com.microsoft", interleaved=0))
                    node.input[k] = rotated
            node.input[7] = node.input[8] = ""
            next(a for a in node.attribute if a.name == "do_rotary").i = 0
        nodes.append(node)
    kept = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(n for n in nodes if n.output[0] not in dropped)
    graph.input.insert(1, helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, "seq"]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    shutil.copy(src.parent / "genai_config.json", dst.parent / "genai_config.json")
    return dst


def cache_inside_attention(src: Path, dst: Path) -> Path:
    """An opset-23 export rewritten so that each ``Attention`` node reads the cache itself: K and V
    are the new rows only, with ``past_key`` / ``past_value`` inputs and ``present`` outputs,
    grouped natively (fewer K/V heads than Q heads, no repeat_kv) and masked by ``is_causal``
    instead of a mask input. (Without KV-cache inputs, the same with K and V taken before
    repeat_kv.) The exporter's Concat / repeat_kv / mask nodes become dead and are dropped."""
    import onnx

    model = onnx.load(str(src))
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}

    def before_repeat(name: str) -> str:  # Reshape <- Expand <- Unsqueeze <- x
        for op in ("Reshape", "Expand", "Unsqueeze"):
            assert producer[name].op_type == op, (name, producer[name].op_type)
            name = producer[name].input[0]
        return name

    for node in [n for n in graph.node if n.op_type == "Attention"]:
        k, v = before_repeat(node.input[1]), before_repeat(node.input[2])
        if k in producer and producer[k].op_type == "Concat":  # Concat(past, new) -> present
            concat_k, concat_v = producer[k], producer[v]
            node.input[:] = [node.input[0], concat_k.input[1], concat_v.input[1], "",
                             concat_k.input[0], concat_v.input[0]]
            node.output[:] = [node.output[0], concat_k.output[0], concat_v.output[0]]
            graph.node.remove(concat_k)
            graph.node.remove(concat_v)
        else:
            node.input[:] = [node.input[0], k, v]
        for a in node.attribute:
            if a.name == "is_causal":
                a.i = 1
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for field in (graph.input, graph.initializer):
        used = [i for i in field if i.name in live]
        del field[:]
        field.extend(used)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    for name in ("config.json", "generation_config.json"):
        if (src.parent / name).is_file():
            shutil.copy(src.parent / name, dst.parent / name)
    return dst


def upcast_fp16(src: Path, dst: Path) -> Path:
    """``src`` with every float16 tensor, cast and type made float32: the same weights (float16
    values held exactly in float32), computed in float32 as picc does, so onnxruntime's logits
    can be held to float32 tolerances."""
    import onnx
    from onnx import numpy_helper

    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    model = onnx.load(str(src))
    graph = model.graph

    def widen(t: onnx.TensorProto) -> None:
        if t.data_type == f16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    for t in graph.initializer:
        widen(t)
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                widen(a.t)
            elif node.op_type == "Cast" and a.name == "to" and a.i == f16:
                a.i = f32
            assert a.type != onnx.AttributeProto.GRAPH, f"subgraphs are not upcast ({node.name})"
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.tensor_type.elem_type == f16:
            vi.type.tensor_type.elem_type = f32
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return dst


def build_contrib_attention_opt(hf_dir: Path, out_dir: Path, *, cache: bool) -> Path:
    """A pre-LN OPT checkpoint written by hand as the graph onnxruntime's transformer optimizer
    makes of GPT-2-style models: com.microsoft ``Attention`` (packed QKV weights [hidden,
    3 * hidden] and bias, ``unidirectional=1``, an int32 ``attention_mask`` as mask_index) and,
    with ``cache``, stacked ``past_N`` / ``present_N`` [2, batch, heads, seq, head_dim]; learned
    positions read at ``position_ids + 2``; LayerNormalization; the head tied to the embedding.
    config.json / generation_config.json are copied beside it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = load_file(str(hf_dir / "model.safetensors"))
    hidden, n = cfg["hidden_size"], cfg["num_attention_heads"]
    d, p = hidden // n, "model.decoder."
    inits: list = []
    nodes: list = []

    def init(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, ins: list[str], outs: list[str], **kw: object) -> str:
        nodes.append(helper.make_node(op, ins, outs, name=f"/{outs[0]}/{op}", **kw))
        return outs[0]

    def linear(x: str, name: str) -> str:
        y = node("MatMul", [x, init(name + ".weight", w[name + ".weight"].T)], [name + "/matmul"])
        return node("Add", [y, init(name + ".bias", w[name + ".bias"])], [name])

    def layer_norm(x: str, name: str) -> str:
        return node("LayerNormalization", [x, init(name + ".weight", w[name + ".weight"]),
                                           init(name + ".bias", w[name + ".bias"])], [name], epsilon=1e-5)

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT32, [1, "total"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", cfg["vocab_size"]])]
    tokens = node("Gather", [init(p + "embed_tokens.weight", w[p + "embed_tokens.weight"]), "input_ids"], ["tokens"])
    shifted = node("Add", ["position_ids", init("position_offset", np.array(2, np.int64))], ["shifted"])
    pos = node("Gather", [init(p + "embed_positions.weight", w[p + "embed_positions.weight"]), shifted], ["pos"])
    x = node("Add", [tokens, pos], ["embed"])
    for i in range(cfg["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        proj = [f"{q}self_attn.{k}_proj" for k in "qkv"]
        qkv_w = init(f"{q}self_attn.qkv.weight", np.concatenate([w[k + ".weight"].T for k in proj], axis=1))
        qkv_b = init(f"{q}self_attn.qkv.bias", np.concatenate([w[k + ".bias"] for k in proj]))
        ins, outs = [layer_norm(x, q + "self_attn_layer_norm"), qkv_w, qkv_b, "attention_mask"], [f"{q}attn"]
        if cache:
            ins.append(f"past_{i}")
            outs.append(f"present_{i}")
            inputs.append(helper.make_tensor_value_info(f"past_{i}", TensorProto.FLOAT, [2, 1, n, "past", d]))
            outputs.append(helper.make_tensor_value_info(f"present_{i}", TensorProto.FLOAT, [2, 1, n, "total", d]))
        attn = node("Attention", ins, outs, domain="com.microsoft", num_heads=n, unidirectional=1)
        x = node("Add", [x, linear(attn, q + "self_attn.out_proj")], [f"{q}attn_residual"])
        h = node("Relu", [linear(layer_norm(x, q + "final_layer_norm"), q + "fc1")], [f"{q}relu"])
        x = node("Add", [x, linear(h, q + "fc2")], [f"{q}ffn_residual"])
    x = layer_norm(x, p + "final_layer_norm")
    node("MatMul", [x, init("lm_head.weight", w[p + "embed_tokens.weight"].T)], ["logits"])
    graph = helper.make_graph(nodes, "opt", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out_dir / "model.onnx"))
    for name in ("config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    return out_dir / "model.onnx"
