"""How the runtime's matrix ops dot x, against the interpreter: the KV caches' and x's rounding
(f16 caches, int8 and int16 x, float x), which layout each matrix is stored in, and which of the
sparse and dense models a CPU compile builds.

Tolerances as in ``test_runtime.py``; where values are rounded on the way, ``check_rounds_alike``
(``runtime_cases.py``) says why its bounds are what they are.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_llama, with_tokenizer
from runtime_cases import TOKENS, check_prefill, check_rounds_alike, compiled, rel_err, runtime_logits

from picc.codegen_cpu.rowplanes import to_rowplanes
from picc.compile import CompileOptions, compile_model
from picc.errors import PiccError
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.fused_ops import FusedFFN
from picc.ir.printer import print_module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import DType
from picc.placement.plan_report import format_report
from picc.sparsity.sparsify import SparsifyOptions
from runtime.pib import PibFile
from runtime.session import Session


@pytest.mark.parametrize("dtype", [DType.F32, DType.Q4_0])
def test_f16_kv_caches_round_as_the_interpreter_does(dtype, tmp_path):
    # The default: the CPU's KV caches hold f16, keys and values rounded as they are stored, and
    # the interpreter rounds alike (kv_format on the attention ops). Rounding makes a cached
    # element a step function of its float value: where float noise (~1e-7) moves one across an
    # f16 rounding boundary it moves by a whole step, 2^-11 of it, and later layers carry that on
    # (check_rounds_alike): with f32 matrices 5.2e-5 once the prefill's GEMM summed 16 lanes at a
    # time (none crossed with 8), with int16-rounded x (Q4_0) 1.1e-4; so each token alone within
    # the unrounded bound, a dozen positions within 1e-3. Without the interpreter's rounding the
    # F32 model's logits are 2e-4 apart.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=dtype)
    path, pib = compiled(model, tmp_path, "kv16", dense=True)
    assert {op.kv_format for op in pib.module.ops() if isinstance(op, O.Attention)} == {"f16"}
    check_rounds_alike(path, pib, tight=1e-5 if dtype == DType.F32 else 1e-4, loose=1e-3)
    f32_path, _ = compiled(model, tmp_path, "kv32", dense=True, kv_cache="f32")
    with Session(path, 1) as s, Session(f32_path, 1) as t:  # each layer's caches take half the bytes
        assert 2 * sum(s.executor.cpu.kv_caches().values()) == sum(t.executor.cpu.kv_caches().values())


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q4_1])
def test_int8_dots_round_x_to_int8_as_the_interpreter_does(dtype, tmp_path):
    # picc compile --int8-dots: the rows8 GEMVs and FFNs dot x (and h) rounded to int8 (_r8_xi8,
    # whose dot products skip the zero low bytes of its int16 form), the prefill calls their
    # batched twins (_r8_xi8_rows), and the interpreter rounds as they do (check_rounds_alike).
    # Rows one at a time (k and v, 12 rows of one KV head) keep int16. SmolLM2's 30 layers over 24
    # positions drift 1e-2 to 6e-2 apart, as far as int8 rounding itself moves them (docs/serving.md).
    model = tiny_llama("swiglu", n_layers=2, hidden=96, n_heads=8, n_kv_heads=1, n_ff=96, matrix_dtype=dtype)
    path, pib = compiled(model, tmp_path, "int8", dense=True, int8_dots=True, kv_cache="f32")
    formats = {op.x_format for op in pib.module.ops() if isinstance(op, O.MatrixOp) and op.layout == "rows8"}
    assert formats == {"i8"}
    assert {op.x_format for op in pib.module.ops() if isinstance(op, O.Linear) and op.layout == "rows"} == {"i16"}
    with PibFile(path) as f:
        assert "_r8_xi8(" in f.text("cpu/ir") and "_r8_xi8_rows(" in f.text("cpu/ir")
    check_rounds_alike(path, pib)
    with pytest.raises(PiccError, match="--float-dots and --int8-dots"):
        CompileOptions(float_dots=True, int8_dots=True).check()


def test_int8_dots_give_a_q8_0_models_matrix_ops_the_heads_int8_rows8(tmp_path):
    # A Q8_0 model with --int8-dots: its linears (q, k, v, o; the head) and its FFNs read q8_0
    # rows eight at a time with int8 x, as the LM head does by default.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.Q8_0, tied=True)
    path, pib = compiled(model, tmp_path, "q8", dense=True, int8_dots=True)
    linears = [op for op in pib.module.ops() if isinstance(op, O.Linear)]
    ffns = [op for op in pib.module.ops() if isinstance(op, O.FFN)]
    assert {(op.x_format, op.layout) for op in linears + ffns} == {("i8", "rows8")}
    assert (len(linears), len(ffns)) == (2 * 4 + 1, 2)
    check_rounds_alike(path, pib)


def test_the_compile_says_how_its_matrix_ops_dot_x(tmp_path):
    # A user who reads the compile's output learns the x format and that --int8-dots exists.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.Q4_1)
    said = {}
    for flags in ({}, {"int8_dots": True}, {"float_dots": True}):
        lines: list[str] = []
        compile_model(model, CompileOptions(dense=True, batch_step=False, **flags), say=lines.append)
        said[tuple(flags)] = next(line for line in lines if line.startswith("generating CPU code"))
    ops = 2 * 5 + 1  # q, k, v, o and the (fused, dense) FFN of each layer, and the q4_1 head
    assert f"{ops} matrix ops dot x rounded to int16; --int8-dots" in said[()]
    assert f"{ops} matrix ops dot x rounded to int8" in said[("int8_dots",)] and "--int8" not in said[("int8_dots",)]
    assert "rounded" not in said[("float_dots",)]


def test_a_q8_0_head_rounds_to_int8_by_default_and_the_compile_says_so(tmp_path):
    # SmolLM2's shape: 4-bit matrices and a tied q8_0 head. The head dots int8 x (the rest
    # int16, and --int8-dots is still offered for them); --float-dots keeps it float; either way
    # the runtime computes the interpreter's function (which rounds alike), the prefill too.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.Q4_1, head_dtype=DType.Q8_0,
                       tied=True)
    lines: list[str] = []
    result = compile_model(model, CompileOptions(dense=True, batch_step=False), say=lines.append)
    said = next(line for line in lines if line.startswith("generating CPU code"))
    assert "matrix ops dot x rounded to int16, 1 to int8; --int8-dots" in said
    *_, head = result.model.module.ops()
    assert (head.x_format, head.layout, result.layouts.get("token_embd")) == ("i8", "rows8", "rows8")
    path, pib = compiled(model, tmp_path, "head", dense=True)
    check_rounds_alike(path, pib)
    path, pib = compiled(model, tmp_path, "float_head", dense=True, float_dots=True)
    *_, head = pib.module.ops()
    assert (head.x_format, head.layout) == ("f32", "rows")


def test_rows8_only_where_every_reader_of_a_matrix_can_read_it(tmp_path):
    # A tied embedding is read row by row (the embedding lookup) and by the LM head: both keep
    # the source layout, the head's GEMV dots rows one at a time. Matrices whose rows do not come
    # in eights (here k and v: one KV head of 12) do too. The rest go eight rows at a time, and
    # the runtime still computes the interpreter's function.
    model = tiny_llama("swiglu", n_layers=2, hidden=96, n_heads=8, n_kv_heads=1, n_ff=96,
                       matrix_dtype=DType.Q4_0, tied=True)
    path, pib = compiled(model, tmp_path, "tied", dense=True)
    ops = [op for op in pib.module.ops() if isinstance(op, (O.Linear, O.FFN))]
    row_by_row = {op.weight for op in ops if isinstance(op, O.Linear) and op.layout != "rows8"}
    assert all(op.x_format == "i16" for op in ops)
    assert "token_embd" in row_by_row and len(row_by_row) == 1 + 2 * 2  # the head; k and v of both layers
    assert all(pib.weights[w].shape[0] == 12 for w in row_by_row - {"token_embd"})
    with PibFile(path) as f:
        assert f.tensor("token_embd").layout is None
        assert all(f.tensor(w).layout is None for w in row_by_row)
        assert all(f.tensor(op.up).layout == "rows8" for op in ops if isinstance(op, O.FFN))
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


def test_float_dots_keep_a_dense_q4_model_at_float_rounding(tmp_path):
    # picc compile --float-dots: the float GEMVs, held to the float kernels' 1e-4 (5e-7 measured).
    # f32 caches: with f16 ones an element whose float value the two orders of summing put on
    # either side of a half-precision rounding boundary moves the logits by ~1e-4 (measured once),
    # which the f16 caches' own test allows for.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.Q4_1)
    path, pib = compiled(model, tmp_path, "dense-float", dense=True, float_dots=True, kv_cache="f32")
    kernels = {op.kernel for op in pib.module.ops()}
    assert "picc_gemv_q4_1_r8" in kernels
    assert all(op.x_format == "f32" for op in pib.module.ops() if isinstance(op, O.MatrixOp))
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4


def test_a_model_that_decides_sparsity_keeps_float_dot_products(tmp_path, monkeypatch):
    # Rounding x to int16 makes a dot product a step function of x: float-rounding noise between
    # the runtime and the interpreter moves an element across a rounding boundary now and then, and
    # the decisions a gate score or a predictor makes would flip far more often than with float
    # dots, though the interpreter rounds as the kernels do. A sparse q4 model keeps float dots.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    sparsity = SparsifyOptions(mode="gate-first", tokens=512, window=64, budget=0.5)
    path, pib = compiled(model, tmp_path, "sparse-q4", sparsity=sparsity, sparse=True)
    kernels = {op.kernel for op in pib.module.ops()}
    assert "picc_gemv_q4_0_r8" in kernels
    assert all(op.x_format == "f32" for op in pib.module.ops() if isinstance(op, O.MatrixOp))
    # The fused FFNs' neuron-major down projections are stored in the rowplanes layout, for their
    # AXPYs, and load back as the rows the interpreter reads.
    downs = [op.down for op in pib.module.ops() if isinstance(op, FusedFFN)]
    with PibFile(path) as f:
        assert downs and all(f.tensor(d).layout == "rowplanes" for d in downs)
        for d in downs:
            stored, shape = f.tensor(d).data, pib.weights[d].shape
            np.testing.assert_array_equal(to_rowplanes(pib.weights[d].data, "q4_0", shape), stored.reshape(shape[0], -1))
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


@pytest.mark.parametrize("faster", ["dense", "sparse"])
def test_a_cpu_compile_builds_the_faster_of_the_sparse_and_dense_models(tmp_path, monkeypatch, faster):
    # By default a CPU-only compile weighs the sparse model against the dense one by the cost
    # model and builds the faster, saying so; --sparse keeps sparsity and only notes the estimate.
    # The CPU's kernel rates decide: fast int16 dots (which only a model that decides no sparsity
    # uses) make the dense model faster, slow ones the sparse model.
    import yaml

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    bw, slow = 40e9, 40e9 / 20
    int_rate, float_rate = (bw, slow) if faster == "dense" else (slow, bw)
    rates = {"q4_0": float_rate, "q4_0_r8": float_rate, "q4_0_xi16": int_rate, "q4_0_r8_xi16": int_rate}
    target = tmp_path / "t.yaml"
    target.write_text(yaml.safe_dump({"name": "t", "gpu": None, "cpu": {
        "name": "test CPU", "cores": 2, "mem_bandwidth": bw, "simd": "avx2", "kernel_rates": rates}}))
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    options = CompileOptions(target=str(target), sparsity=SparsifyOptions(mode="gate-first", tokens=512,
                                                                          window=64, budget=0.5))
    said: list[str] = []
    sparse = compile_model(model, replace(options, sparse=True), say=said.append)
    dense = compile_model(model, replace(options, dense=True), say=lambda _: None)
    assert sparse.report["dense_estimate_tokens_per_s"] == pytest.approx(dense.report["estimate_tokens_per_s"])
    assert "dense_estimate_tokens_per_s" not in dense.report
    assert "the same model compiled --dense:" in format_report(sparse.report)
    dense_wins = dense.report["estimate_tokens_per_s"] > sparse.report["estimate_tokens_per_s"]
    assert dense_wins == (faster == "dense")
    assert any("(kept: --sparse)" in line for line in said) == dense_wins
    said.clear()
    chosen = compile_model(model, options, say=said.append)
    decides = any(isinstance(op, (Predict, SparseFFN)) or (isinstance(op, FusedFFN) and op.mode != "dense")
                  for op in chosen.model.module.ops())
    assert decides != dense_wins
    assert chosen.report["estimate_tokens_per_s"] == pytest.approx(max(dense.report["estimate_tokens_per_s"],
                                                                       sparse.report["estimate_tokens_per_s"]))
    assert any(line.startswith("compiling the dense model") for line in said) == dense_wins
    assert any(n.startswith("dense, chosen") for n in chosen.report["notes"]) == dense_wins
    assert ("the same model compiled sparse (--sparse):" in format_report(chosen.report)) == dense_wins
    with pytest.raises(PiccError, match="--dense and --sparse"):
        compile_model(model, replace(options, dense=True, sparse=True))


def test_int_dots_round_x_in_a_sparse_model_as_the_interpreter_does(tmp_path, monkeypatch):
    # picc compile --int-dots: the same sparse q4 model with the _xi16 kernels everywhere (the
    # gate-first FFN's dense gate rows and gathered up rows included). The interpreter rounds
    # as they do, so the two agree to the sparse bound; which one picc uses is a trade of speed
    # against sensitivity to noise at the gate's threshold (the test above).
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    sparsity = SparsifyOptions(mode="gate-first", tokens=512, window=64, budget=0.5)
    path, pib = compiled(model, tmp_path, "sparse-q4-int", sparsity=sparsity, int_dots=True, sparse=True)
    kernels = {op.kernel for op in pib.module.ops() if op.kernel}
    assert "picc_gemv_q4_0_r8_xi16" in kernels and "picc_gemv_q4_0_r8" not in kernels
    assert any(k.startswith("picc_ffn_gate_first") and k.endswith("_xi16") for k in kernels)
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-3
    check_prefill(path, pib, 1e-3)
    with pytest.raises(PiccError, match="--float-dots and --int-dots"):
        CompileOptions(float_dots=True, int_dots=True).check()


def test_int_dots_read_long_gathered_rows_from_dotplanes(tmp_path, monkeypatch):
    # Rows of 4096: select-kernels stores the gate-first FFN's gathered up rows in the dotplanes
    # layout, the .pib holds them so (and gives them back to the interpreter in GGUF's rows), the
    # step's kernel dots them a row at a time and the prefill dequantizes them from there.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu", n_layers=1, hidden=4096, n_heads=32, n_kv_heads=4, n_ff=64,
                                      matrix_dtype=DType.Q4_1))
    sparsity = SparsifyOptions(mode="gate-first", tokens=256, window=64, budget=0.5)
    path, pib = compiled(model, tmp_path, "sparse-dotplanes", sparsity=sparsity, int_dots=True, sparse=True)
    ffns = [op for op in pib.module.ops() if isinstance(op, FusedFFN)]
    assert ffns and all(op.gathered_layout == "dotplanes" and op.kernel.endswith("_xi16_dp") for op in ffns)
    assert "gathered_layout = " in print_module(pib.module)
    with PibFile(path) as f:
        assert {f.tensor(op.up).layout for op in ffns} == {"dotplanes"}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-3
    check_prefill(path, pib, 1e-3)


@pytest.mark.parametrize("mode", ["predictor", "gate-first", "down-only"])
def test_sparse_models_match_the_interpreters_sparse_execution(mode, tmp_path, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    form = "relu" if mode == "predictor" else "reglu"
    model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.F16))
    sparsity = SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5)
    path, pib = compiled(model, tmp_path, mode, sparsity=sparsity, sparse=True)
    assert any(getattr(op, "mode", None) == mode for op in pib.module.ops())
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS), reference) <= 1e-3
    # Two threads split rows and neurons differently, and agree.
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-3
    check_prefill(path, pib, 1e-3)


@pytest.mark.parametrize("how", ["dense", "int8", "gate-first", "down-only"])
def test_q4_1_layers_with_q8_0_matrices_compile_in_every_mode(how, tmp_path, monkeypatch):
    # A Q4_K_M GGUF imports as Q4_1 matrices with Q8_0 ones among them (v and down, from Q6_K).
    # A dense FFN whose down rows are q8_0 keeps float x (q8_0 rows dot int8 x alone, from the
    # rows8 layout), where a compile used to ask for int16 x and fail; the v GEMVs dot int8 x as
    # an LM head does. Every mode matches the interpreter.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu" if how in ("gate-first", "down-only") else "swiglu", n_layers=2,
                                      hidden=64, n_ff=128, matrix_dtype=DType.Q4_1,
                                      layer_dtypes={"v": DType.Q8_0, "down": DType.Q8_0}))
    options = (dict(dense=True, int8_dots=how == "int8", kv_cache="f32") if how in ("dense", "int8") else
               dict(sparse=True, sparsity=SparsifyOptions(mode=how, tokens=512, window=64, budget=0.5)))
    path, pib = compiled(model, tmp_path, how, **options)
    ffns = [op for op in pib.module.ops() if op.NAME in ("ffn", "fused_ffn")]
    assert ffns and all(op.x_format == ("i8" if how == "int8" else "f32") for op in ffns)
    if how == "int8":
        check_rounds_alike(path, pib)
        return
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


def test_the_int8_drift_example_rounds_where_it_says(tmp_path):
    # examples/int_x_drift.py stands the runtime's drift in with an interpreter that adds noise
    # before each rounding and rounds to int8 in the ops it names: without noise it must compute
    # exactly what the interpreter computes on a build that rounds there (--int8-dots: every rows8
    # op's x and h), and with no op named, what it computes on the int16 build.
    import importlib.util

    spec = importlib.util.spec_from_file_location("int_x_drift", Path(__file__).parents[1] / "examples" / "int_x_drift.py")
    drift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drift)
    model = tiny_llama("swiglu", n_layers=2, hidden=96, n_heads=8, n_kv_heads=1, n_ff=96, matrix_dtype=DType.Q4_1)
    _, i8 = compiled(model, tmp_path, "i8", dense=True, int8_dots=True)
    rows8 = [op for op in i8.module.ops() if isinstance(op, O.MatrixOp) and op.x_format == "i8"]
    assert {type(op) for op in rows8} == {O.Linear, O.FFN}
    i16_ops = tuple(replace(op, x_format="i16") if op in rows8 else op for op in i8.module.function().ops)
    i16 = i8.module.with_function(replace(i8.module.function(), ops=i16_ops))
    everywhere = {op.result: ("x", "h") for op in rows8}
    emulated = drift.NoisyInterpreter(i16, i8.weights, 0.0, everywhere).run(TOKENS)
    assert np.array_equal(emulated, Interpreter(i8.module, i8.weights).run(TOKENS))
    as_is = drift.NoisyInterpreter(i16, i8.weights, 0.0, {}).run(TOKENS)
    assert np.array_equal(as_is, Interpreter(i16, i8.weights).run(TOKENS))
    assert not np.array_equal(emulated, as_is)
    only_x = {op.result: ("x",) for op in rows8}  # a dense FFN's h stays int16
    assert not np.array_equal(drift.NoisyInterpreter(i16, i8.weights, 0.0, only_x).run(TOKENS), emulated)
