"""The ONNX frontend against onnxruntime and against the Hugging Face frontend.

Models are the tiny random checkpoints of hf_models.py, exported with torch.onnx (dynamo) by
onnx_models.py, with and without KV-cache inputs, plus relu-demo and a model built by
onnxruntime-genai's builder (fused contrib ops).

Two checks per model:
- the IR text equals the HF frontend's for the same checkpoint (config.json is copied next to the
  .onnx, as optimum does, so BOS/EOS and context length agree too); only the module name line,
  which comes from the file name, is left out;
- the reference interpreter's logits match onnxruntime's: relative L2 error <= 1e-4 over all
  logits. Both compute in float32 from the same weights and differ in summation order only
  (observed ~1e-6); weights are drawn large enough (hf_models.py) that a wrong mapping moves the
  logits by far more. Graphs with a KV cache are run as prefill + single-token decode steps on
  both sides, so the cache path of the graph is what is compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from hf_models import make_model
from onnx_models import build_genai, export_hf, export_torchscript, ort_logits, rotary_outside_attention

from picc.cli import main as picc_main
from picc.errors import PiccError
from picc.frontend import load_model
from picc.frontend.llama import RopeSpec
from picc.frontend.model import LoadedModel
from picc.frontend.onnx_decoder import fit_rope
from picc.frontend.onnx_match import Rec
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir import print_module, verify
from picc.ir.types import DType, f32

TOL = 1e-4
IDS = [1, 7, 3, 200, 45, 9, 17, 100, 23, 5, 66, 88]  # 12 > every test window (4)
PREFILL = 8  # graphs with a KV cache: 8 tokens, then 4 decode steps


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def body(model: LoadedModel) -> list[str]:
    """The IR text without the module header line (its name comes from the file name)."""
    return print_module(model.module).splitlines()[1:]


def picc_logits(model: LoadedModel, ids: list[int], prefill: int | None) -> np.ndarray:
    """Prefill then one token per step, as ort_logits does for cached graphs."""
    interp = Interpreter(model.module, model.weights)
    cut = prefill or len(ids)
    parts = [interp.run(ids[:cut])] + [interp.run([t]) for t in ids[cut:]]
    return np.concatenate(parts)


class Exports:
    """HF checkpoints and their ONNX exports, made on first use and shared by the session."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def hf(self, family: str, variant: str) -> Path:
        p = self.root / "hf" / family / variant
        if not p.exists():
            make_model(family, variant, p)
        return p

    def onnx(self, family: str, variant: str, *, cache: bool, attn: str = "eager") -> Path:
        out = self.root / "onnx" / f"{family}-{variant}-{attn}-{'kv' if cache else 'nokv'}"
        if not (out / "model.onnx").exists():
            export_hf(self.hf(family, variant), out, cache=cache, attn=attn)
        return out / "model.onnx"


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("onnx_exports"))


# (family, variant, KV cache, attention implementation of the exported model)
CASES = [
    ("llama", "gqa", False, "eager"),  # SwiGLU, grouped KV heads
    ("llama", "gqa", True, "eager"),
    ("llama", "relu", False, "sdpa"),  # SDPA decomposition: sqrt-scaled q and k, isnan guard
    ("qwen2", "sliding", True, "eager"),  # q/k/v biases, per-layer sliding window, trimmed cache
    ("opt", "pre-ln", True, "eager"),  # LayerNorm, learned positions, Gemm, ReLU, scaled q
    ("mistral", "no-window-key", False, "eager"),  # window 4096: beyond the probe, from config.json
]


@pytest.mark.parametrize("family,variant,cache,attn", CASES,
                         ids=[f"{f}-{v}-{a}-{'kv' if c else 'nokv'}" for f, v, c, a in CASES])
def test_export_matches_onnxruntime_and_hf_ir(exports, family, variant, cache, attn):
    path = exports.onnx(family, variant, cache=cache, attn=attn)
    model = load_model(path)
    verify(model.module)
    assert body(model) == body(load_model(exports.hf(family, variant)))
    prefill = PREFILL if cache else None
    assert rel_l2(picc_logits(model, IDS, prefill), ort_logits(path, IDS, prefill)) <= TOL


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_torchscript_export_with_decomposed_gelu(exports, tmp_path, activation):
    """The legacy exporter spells GELU out: x/sqrt(2) -> Erf -> +1 -> *x -> *0.5, or the tanh form
    (0.5*x first, then x^3 * 0.044715 + x, * sqrt(2/pi), Tanh, +1)."""
    hf_dir = exports.hf("opt", "gelu")
    if activation != "gelu":  # same weights, another activation
        hf_dir = Path(shutil.copytree(hf_dir, tmp_path / "hf"))
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "activation_function": activation}))
    path = export_torchscript(hf_dir, tmp_path / "onnx")
    assert {"Erf" if activation == "gelu" else "Tanh"} <= {n.op_type for n in onnx.load(str(path)).graph.node}
    model = load_model(path)
    assert body(model) == body(load_model(hf_dir))
    assert rel_l2(picc_logits(model, IDS, None), ort_logits(path, IDS)) <= TOL


def test_cached_and_uncached_exports_give_the_same_ir(exports):
    with_cache = load_model(exports.onnx("llama", "gqa", cache=True))
    without = load_model(exports.onnx("llama", "gqa", cache=False))
    assert body(with_cache) == body(without)


@pytest.mark.slow
def test_relu_demo_fp16_export(tmp_path):
    """relu-demo exported in float16: weights stay f16 and the IR is the HF frontend's."""
    from picc.frontend.aliases import resolve_alias

    hf_dir = resolve_alias("relu-demo")
    path = export_hf(hf_dir, tmp_path / "relu-demo", cache=False, dtype="float16")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "relu-demo" / name).write_bytes((hf_dir / name).read_bytes())
    model = load_model(path)
    reference = load_model(hf_dir)
    assert body(model) == body(reference)
    assert model.module.weight_types()["l0.ffn.up"].dtype == DType.F16
    ids = model.tokenizer.encode("the company said its shares rose N cents in new york trading")
    ours = picc_logits(model, ids, None)
    # Same IR, same weights: the HF import computes exactly the same numbers.
    assert np.array_equal(ours, picc_logits(reference, ids, None))
    # onnxruntime computes this graph in float16 (picc in float32): its rounding (2^-11 relative
    # per op, six layers) leaves ~2e-4; an error of the mapping would be O(1).
    assert rel_l2(ours, ort_logits(path, ids)) <= 2e-3


@pytest.mark.slow
def test_onnxruntime_genai_builder_model(exports, tmp_path):
    """GroupQueryAttention (packed QKV, rotary inside), SimplifiedLayerNormalization,
    SkipSimplifiedLayerNormalization; metadata from genai_config.json."""
    hf_dir = exports.hf("llama", "gqa")
    path = build_genai(hf_dir, tmp_path / "genai")
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"} <= ops
    model = load_model(path)
    assert body(model) == body(load_model(hf_dir))
    assert rel_l2(picc_logits(model, IDS, PREFILL), ort_logits(path, IDS, PREFILL)) <= TOL


@pytest.mark.slow
def test_rotary_embedding_contrib_op(exports, tmp_path):
    """Separate q/k/v projections into GroupQueryAttention, rotated by RotaryEmbedding nodes."""
    hf_dir = exports.hf("llama", "gqa")
    built = build_genai(hf_dir, tmp_path / "genai", "disable_qkv_fusion=true")
    path = rotary_outside_attention(built, tmp_path / "rotary" / "model.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("RotaryEmbedding") == 4 and ops.count("MatMul") == 2 * 7 + 1
    model = load_model(path)
    assert body(model) == body(load_model(hf_dir))
    assert rel_l2(picc_logits(model, IDS, PREFILL), ort_logits(path, IDS, PREFILL)) <= TOL


def test_boolean_mask_with_where(exports, tmp_path):
    """``Where(allowed, scores, -inf)`` instead of adding a float mask: the same model."""
    path = exports.onnx("llama", "gqa", cache=False)

    def edit(graph: onnx.GraphProto) -> None:
        producer = {o: n for n in graph.node for o in n.output}
        for add in [n for n in graph.node if n.op_type == "Add" and n.input[1] in producer
                    and producer[n.input[1]].op_type == "Where"]:
            allowed = producer[add.input[1]].input[0]
            add.op_type = "Where"
            add.input[:] = [allowed, add.input[0], "minus_inf"]
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"))

    edited = _edited(path, tmp_path / "where" / "model.onnx", edit)
    assert sum(n.op_type == "Where" for n in onnx.load(str(edited)).graph.node) == 3  # the mask's + 2 layers
    model = load_model(edited)
    assert body(model) == body(load_model(path))
    assert rel_l2(picc_logits(model, IDS, None), ort_logits(edited, IDS)) <= TOL


# ---------------------------------------------------------------- errors


def _edited(path: Path, out: Path, edit) -> Path:  # noqa: ANN001
    model = onnx.load(str(path))
    edit(model.graph)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out


def test_unsupported_ops_are_listed_with_node_and_layer(exports, tmp_path):
    path = exports.onnx("llama", "gqa", cache=False)

    def edit(graph: onnx.GraphProto) -> None:
        sigmoids = [n for n in graph.node if n.op_type == "Sigmoid"]  # SiLU of layers 0 and 1
        sigmoids[1].op_type = "HardSigmoid"
        softmax = [n for n in graph.node if n.op_type == "Softmax"][0]
        softmax.op_type = "LogSoftmax"

    bad = _edited(path, tmp_path / "bad" / "model.onnx", edit)
    with pytest.raises(PiccError) as err:
        load_model(bad)
    msg = str(err.value)
    assert "\n" not in msg
    assert "cannot map 2 node(s) to picc IR (op types: HardSigmoid, LogSoftmax)" in msg
    # the ops' own nodes, in graph order, with their layers; their consumers are not listed again
    assert "LogSoftmax node 'node_Softmax_" in msg and "(layer 0)" in msg
    assert "HardSigmoid node 'node_Sigmoid_" in msg and "(layer 1)" in msg
    assert msg.index("LogSoftmax") < msg.index("HardSigmoid node")


def test_a_pattern_that_does_not_close_is_reported(exports, tmp_path):
    """An RMSNorm whose epsilon is added after the square root is no RMSNorm picc knows."""
    path = exports.onnx("llama", "gqa", cache=False)

    def edit(graph: onnx.GraphProto) -> None:
        sqrt = [n for n in graph.node if n.op_type == "Sqrt"][0]
        add = next(n for n in graph.node if n.output[0] == sqrt.input[0])
        sqrt.input[0], add.input[0] = add.input[0], sqrt.output[0]  # mean -> sqrt -> +eps
        reciprocal = next(n for n in graph.node if n.input and n.input[0] == sqrt.output[0]
                          and n.op_type == "Reciprocal")
        reciprocal.input[0] = add.output[0]
        graph.node.remove(add)
        graph.node.insert(list(graph.node).index(sqrt) + 1, add)

    bad = _edited(path, tmp_path / "bad" / "model.onnx", edit)
    with pytest.raises(PiccError, match=r"Sqrt node 'node_Sqrt_\w+' \(layer 0\): operands \(partial meansq\) "
                                        r"fit no recognised pattern"):
        load_model(bad)


def test_not_an_onnx_file(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x00\x01not protobuf at all")
    with pytest.raises(PiccError, match=r"model.onnx: not a readable ONNX model"):
        load_model(bad)


# ---------------------------------------------------------------- rotary fitting


def _tables(spec: RopeSpec, positions: np.ndarray, dtype: type = np.float32) -> Rec:
    rope = O.Rope(result="r", type=f32(1, 16), x="x", pos="p", n_heads=1, head_dim=16, theta=spec.theta,
                  scaling=spec.scaling, factor=spec.factor)
    angles = positions.astype(np.float32)[:, None] * rope.inv_freq()[None, :]
    return Rec(0, "rope", (0,), "n", {"cos": np.cos(angles).astype(dtype), "sin": np.sin(angles).astype(dtype),
                                      "positions": positions},
               {"table_tol": 0.0 if dtype == np.float32 else 2e-3})


@pytest.mark.parametrize("spec", [RopeSpec(theta=10000.0), RopeSpec(theta=500000.0), RopeSpec(theta=12345.6),
                                  RopeSpec(theta=10000.0, scaling="linear", factor=4.0)],
                         ids=["default", "theta-5e5", "odd-theta", "linear"])
def test_fit_rope_recovers_the_settings(spec):
    # a probe's few positions (as dynamo exports give) and a long cos_cache (as genai's)
    assert fit_rope(_tables(spec, np.arange(3, 7)), 16, "m") == spec
    assert fit_rope(_tables(spec, np.arange(128)), 16, "m") == spec


def test_fit_rope_from_fp16_tables():
    assert fit_rope(_tables(RopeSpec(theta=10000.0), np.arange(128), np.float16), 16, "m") == RopeSpec()


# ---------------------------------------------------------------- command line


def test_cli_import_and_logits(exports, tmp_path, capsys):
    path = exports.onnx("llama", "gqa", cache=False)
    assert picc_main(["import", str(path), "-o", str(tmp_path / "m.picc")]) == 0
    npy = tmp_path / "l.npy"
    assert picc_main(["logits", str(path), "--tokens", "1,2,3", "--out", str(npy)]) == 0
    model = load_model(path)
    assert np.array_equal(np.load(npy), Interpreter(model.module, model.weights).run([1, 2, 3]))
    capsys.readouterr()
    # no tokenizer next to this export: text input is refused with a hint
    assert picc_main(["logits", str(path), "--text", "hello", "--out", str(npy)]) != 0
    assert "has no tokenizer; pass --tokens instead" in capsys.readouterr().err
