"""bench/synthetic_model.py at its tiny shape: the files picc's frontends read, the hot neurons
profiling finds, the refusal without disk room, and nothing left behind by an interrupted run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from picc.errors import PiccError
from picc.frontend.gguf import load_gguf
from picc.frontend.hf import load_hf
from picc.ir import ops as O
from picc.ir.types import DType
from picc.sparsity.calib import token_windows
from picc.sparsity.profiling import profile_model

_PATH = Path(__file__).resolve().parent.parent / "bench" / "synthetic_model.py"
_spec = importlib.util.spec_from_file_location("synthetic_model", _PATH)
synth = sys.modules["synthetic_model"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synth)
TINY = synth.SHAPES["tiny"]


@pytest.fixture(scope="module")
def relu_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny-relu.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--ffn", "relu"]) == 0
    return path


def test_gguf_is_a_q4_0_llama_picc_reads(relu_gguf: Path) -> None:
    model = load_gguf(relu_gguf)
    ffns = [op for op in model.module.ops() if isinstance(op, O.FFN)]
    assert len(ffns) == TINY.n_layers and {op.form for op in ffns} == {"reglu"}
    assert model.weights["l1.ffn.up"].dtype == DType.Q4_0
    assert model.weights["l1.ffn.up"].shape == (TINY.n_ff, TINY.hidden)
    assert model.weights["l0.attn.k"].shape == (TINY.n_kv_heads * TINY.head_dim, TINY.hidden)
    assert model.weights["output"].shape == (TINY.vocab, TINY.hidden)
    assert model.weights["l0.attn_norm"].dtype == DType.F32
    assert relu_gguf.stat().st_size >= synth.nbytes(synth.tensor_specs(TINY), "gguf")
    ids = model.tokenizer.encode("the market fell")
    assert ids[0] == 1 and len(ids) > 2 and max(ids) < 8192


def test_profiling_finds_a_power_law_of_hot_neurons(relu_gguf: Path) -> None:
    model = load_gguf(relu_gguf)
    windows = token_windows(model.tokenizer, "ptb", 512, 128, 0)
    profile = profile_model(model.module, model.weights, windows)
    for layer in profile.layers:
        # built for: ~10% of a layer active, the top 1% of neurons nearly always
        assert 0.8 < layer.sparsity < 0.97, layer.sparsity
        assert layer.top_share(0.1) > 0.4, layer.top_share(0.1)
        assert np.sort(layer.freq)[-2] > 0.8  # the two hottest of 256 neurons fire for most tokens
        assert np.median(layer.freq) < 0.08


def test_hf_directory_is_sharded_and_holds_the_same_model(tmp_path: Path, relu_gguf: Path) -> None:
    out = tmp_path / "tiny-hf"
    assert synth.main(["hf", str(out), "--shape", "tiny", "--ffn", "relu", "--shard-size", "300KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "relu"
    hf, gguf = load_hf(out), load_gguf(relu_gguf)
    assert hf.weights["l1.ffn.gate"].dtype == DType.F16
    assert {op.form for op in hf.module.ops() if isinstance(op, O.FFN)} == {"reglu"}
    # the same values, up to Q4_0's rounding: a step is 1/8 of a block's largest |value|, and the
    # end opposite the largest clips by up to a step
    f16, q4 = hf.weights.f32("l1.ffn.gate"), gguf.weights.f32("l1.ffn.gate")
    step = np.abs(f16).reshape(-1, 32).max(axis=1) / 8
    assert np.all(np.abs(f16 - q4).reshape(-1, 32) <= step[:, None] * 1.01 + 1e-4)
    # relu-demo's BPE in both (the HF one adds a space before the text, as relu-demo does)
    for tokenizer in (hf.tokenizer, gguf.tokenizer):
        ids = tokenizer.encode("the market fell")
        assert tokenizer.decode(ids, skip_special_tokens=True).strip() == "the market fell"


def test_refuses_without_room_and_says_how_much(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda _: type("U", (), {"free": 3_000_000_000})())
    with pytest.raises(PiccError, match=r"needs 3\.79 GB and only 3\.00 GB are free"):
        synth.write_gguf(tmp_path / "big.gguf", synth.SHAPES["7b"], "relu", 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_an_interrupted_run_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    made = []

    def make_then_fail(spec, shape, seed):  # noqa: ANN001, ANN202
        made.append(spec.name)
        if len(made) == 5:
            raise KeyboardInterrupt
        return np.zeros(spec.shape, np.float32)

    monkeypatch.setattr(synth, "make_tensor", make_then_fail)
    with pytest.raises(KeyboardInterrupt):
        synth.main([fmt, str(tmp_path / "out"), "--shape", "tiny"])
    assert list(tmp_path.iterdir()) == []


def test_a_q4_0_mixture_of_experts_runs_as_the_interpreter_computes_it(tmp_path: Path) -> None:
    # --experts: a Mixtral-style llama file (F32 routers, [experts, rows, cols] Q4_0 matrices).
    # Compiled by default, each layer's experts are stored eight rows to a group and dot them with
    # x and h rounded to int16 (a _r8_xi16 kernel), which the interpreter rounds alike: the step and the chunk programs
    # against it, as for every other int16-x kernel (1e-4). The chunk programs take a prompt's
    # tokens through the experts together (an expert's rows read once), each token's logits the
    # step's bits, so a server may take their KV rows for a reply's; so does the batch step.
    from runtime_cases import LONG, TOKENS, check_batch_rows, check_prefill, compiled, rel_err, runtime_logits

    from picc.interpreter import Interpreter
    from runtime.pib import PibFile
    from runtime.session import Session

    path = tmp_path / "tiny-moe.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--experts", "4", "--experts-used", "2"]) == 0
    model = load_gguf(path)
    assert model.weights["l1.moe.up"].dtype == DType.Q4_0 and model.weights["l1.moe.router"].dtype == DType.F32
    assert model.weights["l1.moe.up"].shape == (4 * TINY.n_ff, TINY.hidden)
    pib_path, pib = compiled(model, tmp_path, "moe", batch_step=True)
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    assert len(moes) == TINY.n_layers and {op.kernel for op in moes} == {"picc_moe_swiglu_f32_q4_0_q4_0_q4_0_r8_xi16"}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(pib_path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(pib_path, pib, 1e-4)
    with PibFile(pib_path) as f:
        assert "call void @picc_moe_swiglu_f32_q4_0_q4_0_q4_0_r8_xi16_chunk(" in f.text("cpu/ir")
    with Session(pib_path, 2) as s:
        assert s.executor.cpu.step_bits
        chunked = s.feed(list(LONG), all_logits=True)
    with Session(pib_path, 2) as s:
        stepped = np.concatenate([s.feed([t], all_logits=True) for t in LONG])
    np.testing.assert_array_equal(chunked.view(np.uint32), stepped.view(np.uint32))
    check_batch_rows(pib_path, TOKENS[:4], others=LONG[:4])  # two rows, their own experts, in one call
    assert synth.main(["hf", str(tmp_path / "hf"), "--shape", "tiny", "--experts", "4"]) == 1  # GGUF only


def test_a_mixture_whose_down_rows_are_q8_0_reads_its_4_bit_rows_eight_at_a_time(tmp_path: Path) -> None:
    # A Q4_K_M file's experts: up and gate 4-bit, down q8_0 in some layers (Q6_K, converted). The
    # 4-bit matrices go to the rows8 layout, the q8_0 down rows stay rows, dotted with float h:
    # the step and the chunk programs against the interpreter.
    from dataclasses import replace

    from runtime_cases import TOKENS, check_prefill, compiled, rel_err, runtime_logits

    from picc.frontend.model import LoadedModel
    from picc.interpreter import Interpreter
    from picc.ir.module import WeightDecl
    from picc.ir.types import TensorType
    from picc.ir.weights import Tensor, WeightStore

    path = tmp_path / "tiny-moe.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--experts", "4", "--experts-used", "2"]) == 0
    model = load_gguf(path)
    down = {f"l{i}.moe.down" for i in range(TINY.n_layers)}
    store = WeightStore({n: Tensor.from_f32(model.weights.f32(n), DType.Q8_0) if n in down else model.weights[n]
                         for n in model.weights})
    decls = tuple(WeightDecl(d.name, TensorType(DType.Q8_0, d.type.shape)) if d.name in down else d
                  for d in model.module.weights)
    mixed = LoadedModel(replace(model.module, weights=decls), store, model.tokenizer, source=str(path))
    pib_path, pib = compiled(mixed, tmp_path, "mixed")
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    assert {(op.kernel, op.layout) for op in moes} == {("picc_moe_swiglu_f32_q4_0_q4_0_q8_0_r8_xi16", "rows8")}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(pib_path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(pib_path, pib, 1e-4)


def test_a_mixture_of_mxfp4_experts_runs_from_its_blocks(tmp_path: Path) -> None:
    # gpt-oss's experts: up, gate and down in mxfp4 (4-bit values, a power-of-two scale a block).
    # The .pib keeps their blocks, eight rows to a group (the rows8 layout, read back as GGUF's
    # rows); the mixture's kernel reads them eight rows at a time with x and h rounded to int16,
    # as the interpreter rounds: the step and the chunk programs against it (1e-4), and the batch
    # step's rows.
    from dataclasses import replace

    from runtime_cases import TOKENS, check_batch_rows, check_prefill, compiled, rel_err, runtime_logits

    from picc.frontend.model import LoadedModel
    from picc.interpreter import Interpreter
    from picc.ir.module import WeightDecl
    from picc.ir.types import TensorType
    from picc.ir.weights import Tensor, WeightStore
    from picc.pib import open_pib

    path = tmp_path / "tiny-moe.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--experts", "4", "--experts-used", "2"]) == 0
    model = load_gguf(path)
    experts = {f"l{i}.moe.{m}" for i in range(TINY.n_layers) for m in ("up", "gate", "down")}
    store = WeightStore({n: Tensor.from_f32(model.weights.f32(n), DType.MXFP4) if n in experts else model.weights[n]
                         for n in model.weights})
    decls = tuple(WeightDecl(d.name, TensorType(DType.MXFP4, d.type.shape)) if d.name in experts else d
                  for d in model.module.weights)
    mx = LoadedModel(replace(model.module, weights=decls), store, model.tokenizer, source=str(path))
    pib_path, pib = compiled(mx, tmp_path, "mxfp4", batch_step=True)
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    assert {(op.kernel, op.layout) for op in moes} == {("picc_moe_swiglu_f32_mxfp4_mxfp4_mxfp4_r8_xi16", "rows8")}
    stored = open_pib(pib_path)
    for name in experts:  # the blocks as made, through the .pib
        assert stored.tensor(name).layout == "rows8"
        assert pib.weights[name].dtype == DType.MXFP4
        np.testing.assert_array_equal(np.asarray(pib.weights[name].data).reshape(-1),
                                      np.asarray(store[name].data).reshape(-1))
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(pib_path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(pib_path, pib, 1e-4)
    check_batch_rows(pib_path, TOKENS[:4])


def test_a_gpt_oss_file_loads_with_its_tokenizer_and_compiles_as_it_computes(tmp_path: Path, relu_gguf: Path) -> None:
    # --arch gpt-oss: MXFP4 experts with biases, the router's bias, sinks, every even layer
    # sliding, yarn keys (which transformers' GGUF reader cannot parse: picc converts the
    # tokenizer from the metadata without them, the same ids as the llama file's). Compiled for
    # the CPU: the experts' clamped, biased mxfp4 kernel (rows8), the step, the chunks and the
    # batch step against the interpreter (1e-4).
    from runtime_cases import check_runs_as_interpreted, compiled

    path = tmp_path / "tiny-oss.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--experts", "4", "--experts-used", "2",
                       "--arch", "gpt-oss"]) == 0
    model = load_gguf(path)
    text = "the market closed higher"
    assert model.tokenizer.encode(text) == load_gguf(relu_gguf).tokenizer.encode(text)
    assert model.weights["l1.moe.up"].dtype == DType.MXFP4 and model.weights["l1.moe.up_bias"].shape == (4 * TINY.n_ff,)
    ops = list(model.module.ops())
    assert [op.window for op in ops if isinstance(op, O.Attention)] == [128, None]
    assert all(op.sinks for op in ops if isinstance(op, O.Attention))
    assert {op.scaling for op in ops if isinstance(op, O.Rope)} == {"yarn"}
    pib_path, pib = compiled(model, tmp_path, "oss", batch_step=True)
    assert {op.kernel for op in pib.module.ops() if isinstance(op, O.MoE)} == {
        "picc_moe_swiglu_f32_mxfp4_mxfp4_mxfp4_r8_xi16_brugd_clamped"}
    check_runs_as_interpreted(pib_path, pib)
    assert synth.main(["gguf", str(tmp_path / "x.gguf"), "--shape", "tiny", "--arch", "gpt-oss"]) == 1  # experts


def test_a_deepseek2_file_loads_with_its_tokenizer_and_compiles_as_it_computes(tmp_path: Path) -> None:
    # --arch deepseek2: V2-Lite's layer as llama.cpp's converter writes it (the split latent:
    # attn_k_b and attn_v_b, one K/V head in the metadata), layer 0 dense, two shared experts.
    # picc's import decompresses the latent (values narrower than keys, keys joined head by head);
    # compiled for the CPU, the step, the chunks and the batch step against the interpreter (1e-4).
    from runtime_cases import check_runs_as_interpreted, compiled

    path = tmp_path / "tiny-ds.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny", "--experts", "4", "--experts-used", "2",
                       "--arch", "deepseek2"]) == 0
    model = load_gguf(path)
    assert model.tokenizer is not None and model.tokenizer.encode("the market closed higher")
    rank, nope, rope, v = synth.deepseek2_latent(TINY)
    attentions = [op for op in model.module.ops() if isinstance(op, O.Attention)]
    assert [(op.n_kv_heads, op.head_dim, op.v_dim) for op in attentions] == [(TINY.n_heads, nope + rope, v)] * 2
    assert sum(isinstance(op, O.ConcatHeads) for op in model.module.ops()) == 2
    moes = [op for op in model.module.ops() if isinstance(op, O.MoE)]
    assert [(op.block, op.n_shared, op.top_k) for op in moes] == [(1, 2, 2)]
    pib_path, pib = compiled(model, tmp_path, "ds", batch_step=True)
    check_runs_as_interpreted(pib_path, pib)
    assert synth.main(["gguf", str(tmp_path / "x.gguf"), "--shape", "tiny", "--arch", "deepseek2"]) == 1  # experts


def test_ops_that_read_mxfp4_stay_on_the_cpu_beside_the_gpus(tmp_path: Path) -> None:
    # No GPU kernel reads mxfp4: compiled for pc-low, a layer's mxfp4 q projection and FFN run on
    # the CPU (the FFN's down neuron-major in q8_0, the AXPYs' format), the rest on the emulated
    # GPU, and the logits are the interpreter's.
    from dataclasses import replace

    from runtime_cases import TOKENS, compiled, rel_err

    from picc.frontend.model import LoadedModel
    from picc.interpreter import Interpreter
    from picc.ir.module import WeightDecl
    from picc.ir.types import Placement, TensorType
    from picc.ir.weights import Tensor, WeightStore
    from picc.passes.kernel_selection import gpu_ffn_unsupported
    from runtime.session import Session

    path = tmp_path / "tiny.gguf"
    assert synth.main(["gguf", str(path), "--shape", "tiny"]) == 0
    model = load_gguf(path)
    mx = {n for n in model.weights if n.endswith((".attn.q", ".ffn.up", ".ffn.gate", ".ffn.down"))}
    store = WeightStore({n: Tensor.from_f32(model.weights.f32(n), DType.MXFP4) if n in mx else model.weights[n]
                         for n in model.weights})
    decls = tuple(WeightDecl(d.name, TensorType(DType.MXFP4, d.type.shape)) if d.name in mx else d
                  for d in model.module.weights)
    mixed = LoadedModel(replace(model.module, weights=decls), store, model.tokenizer, source=str(path))
    pib_path, pib = compiled(mixed, tmp_path, "mx", target="pc-low", vram="64MiB", dense=True)
    where = {(op.NAME, op.type.placement) for op in pib.module.ops() if op.NAME in ("linear", "fused_ffn", "attention")}
    assert where == {("linear", Placement.CPU), ("linear", Placement.GPU), ("fused_ffn", Placement.CPU),
                     ("attention", Placement.GPU)}
    types = pib.module.weight_types()
    for op in pib.module.ops():
        if any(w and types[w].dtype == DType.MXFP4 for w in op.weights()):
            assert op.type.placement == Placement.CPU, op.result
    # (an FFN's mxfp4 down is q8_0 once neuron-major: its formats differ, which keeps it off the
    # GPU already; one of mxfp4 alone is refused by name)
    ffn = next(op for op in pib.module.ops() if op.NAME == "fused_ffn")
    assert gpu_ffn_unsupported(ffn, {"mxfp4"}) == "the GPU kernels read no mxfp4 weights"
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(pib_path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4
