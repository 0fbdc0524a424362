"""What keeps a 7B compile within time and memory, checked on tiny models: the weight store's
bounded float32 cache, and a CPU compile that skips profiling when no sparse model could win."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml
from conftest import tiny_llama, with_tokenizer

from picc.compile import CompileOptions, compile_model
from picc.ir import weights as W
from picc.ir.fused_ops import FusedFFN
from picc.ir.types import DType
from picc.passes import profile_activations
from picc.placement.plan_report import format_report
from picc.sparsity.sparsify import SparsifyOptions


def test_the_float32_cache_keeps_the_most_recently_used_within_its_budget(monkeypatch):
    store = W.WeightStore({f"w{i}": W.Tensor.from_f32(np.full((64, 32), i, np.float32), DType.F16)
                           for i in range(4)})
    monkeypatch.setattr(W, "F32_CACHE_BYTES", 2 * 64 * 32 * 4)  # two of them
    first = store.f32("w0")
    store.f32("w1")
    assert store.f32("w0") is first  # kept, and now the most recently used
    store.f32("w2")  # evicts w1, the least recently used
    assert list(store._f32) == ["w0", "w2"]
    assert store.f32("w1") is not None and list(store._f32) == ["w2", "w1"]
    np.testing.assert_array_equal(store.f32("w3"), np.full((64, 32), 3, np.float32))
    assert sum(v.nbytes for v in store._f32.values()) <= W.F32_CACHE_BYTES


def _target(tmp_path, rows8_int_rate: float, other_rate: float) -> str:
    bw = 40e9
    rates = {"q4_0": other_rate, "q4_0_xi16": other_rate, "q4_0_r8": other_rate, "q4_0_r8_xi16": rows8_int_rate}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "gpu": None, "cpu": {
        "name": "test CPU", "cores": 2, "mem_bandwidth": bw, "simd": "avx2", "kernel_rates": rates}}))
    return str(path)


@pytest.mark.parametrize("dense_wins", [True, False])
def test_a_cpu_compile_skips_profiling_when_no_sparse_model_could_win(tmp_path, monkeypatch, dense_wins):
    # The dense model reads its 4-bit matrices eight rows at a time with integer dots; a sparse
    # model's kernels use float dots (unless --int-dots). When that kernel is 20x faster than
    # every other, even a sparse model reading 30% less at the best other rate loses, and
    # nothing is profiled.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    profiled = []
    calibrate = profile_activations.calibrate
    monkeypatch.setattr(profile_activations, "calibrate", lambda *a, **k: profiled.append(1) or calibrate(*a, **k))
    target = _target(tmp_path, 40e9, 2e9 if dense_wins else 40e9)
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    options = CompileOptions(target=target, sparsity=SparsifyOptions(mode="gate-first", tokens=256, window=64,
                                                                     target_sparsity=0.3))
    said: list[str] = []
    chosen = compile_model(model, options, say=said.append)
    skipped = any(line.startswith("compiling the dense model without profiling") for line in said)
    assert skipped == dense_wins and bool(profiled) != dense_wins
    if dense_wins:
        assert all(op.mode == "dense" for op in chosen.model.module.ops() if isinstance(op, FusedFFN))
        best = chosen.report["sparse_estimate_at_most_tokens_per_s"]
        assert best < chosen.report["estimate_tokens_per_s"]
        assert "a sparse model (not profiled): at most" in format_report(chosen.report)
        # --sparse profiles whatever the estimate, and the sparse model is slower than the bound
        sparse = compile_model(model, replace(options, sparse=True), say=lambda _: None)
        assert profiled and sparse.report["estimate_tokens_per_s"] <= best
        # with --int-dots a sparse model's kernels read at the fast rate too: worth profiling
        said.clear()
        compile_model(model, replace(options, int_dots=True), say=said.append)
        assert not any("without profiling" in line for line in said)


def test_a_model_whose_fisher_pass_would_not_fit_in_memory_compiles_dense(tmp_path, monkeypatch):
    # The Fisher scales hold every weight in float32 (27 GB for a 7B). Where that exceeds what the
    # machine has, profiling would end with the kernel killing the compile (seen: a SwiGLU 7B on a
    # 24 GB machine, exit -9), so the compile goes dense and says why; --sparse tries anyway.
    import runtime.sequences

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    profiled = []
    calibrate = profile_activations.calibrate
    monkeypatch.setattr(profile_activations, "calibrate", lambda *a, **k: profiled.append(1) or calibrate(*a, **k))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    need = sum(4 * int(np.prod(model.weights[n].shape)) for n in model.weights)
    target = _target(tmp_path, 40e9, 40e9)  # a sparse model could win: the CPU rule does not skip
    options = CompileOptions(target=target, sparsity=SparsifyOptions(mode="gate-first", tokens=256, window=64,
                                                                     target_sparsity=0.3))
    monkeypatch.setattr(runtime.sequences, "available_memory", lambda: need)  # 0.8 x that: too little
    said: list[str] = []
    chosen = compile_model(model, options, say=said.append)
    assert any("Fisher scales need every weight in float32" in line for line in said) and not profiled
    assert all(op.mode == "dense" for op in chosen.model.module.ops() if isinstance(op, FusedFFN))
    assert any("Fisher" in note for note in chosen.report["notes"])
    compile_model(model, replace(options, sparse=True), say=lambda _: None)
    assert profiled
    monkeypatch.setattr(runtime.sequences, "available_memory", lambda: 2 * need)  # room: profiled as before
    profiled.clear()
    said.clear()
    compile_model(model, options, say=said.append)
    assert profiled and not any("Fisher scales need" in line for line in said)


def test_run_many_gives_each_window_what_run_gives_it_and_dequantizes_each_weight_once(monkeypatch):
    from picc.interpreter import Interpreter

    model = tiny_llama("swiglu", n_layers=3, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0)
    windows = [[1, 5, 9, 3, 7], [2, 4], [8, 8, 8, 1, 2, 3, 4]]
    alone, traces = [], []
    interp = Interpreter(model.module, model.weights.copy())
    interp.on_ffn = lambda t: traces.append((t.op.result, t.score.copy()))
    for w in windows:
        interp.reset()
        alone.append(interp.run(w))
    expected, traces = traces, []
    # a budget of one FFN's three matrices: more than an op reads, far less than the model
    weights = model.weights.copy()
    monkeypatch.setattr(W, "F32_CACHE_BYTES", 3 * 128 * 64 * 4)
    dequantized = []
    to_f32 = W.Tensor.to_f32
    monkeypatch.setattr(W.Tensor, "to_f32", lambda t: dequantized.append(t) or to_f32(t))
    interp = Interpreter(model.module, weights)
    interp.on_ffn = lambda t: traces.append((t.op.result, t.score.copy()))
    together = interp.run_many(windows)
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, b)
    by_layer = sorted(expected, key=lambda t: int(t[0].split(".")[0][1:]))  # layer by layer, windows in order
    assert [name for name, _ in traces] == [name for name, _ in by_layer]
    for (_, a), (_, b) in zip(by_layer, traces, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(dequantized) == len({id(t) for t in dequantized}) == len(model.module.weights)
    assert interp.caches == {}


def test_a_compile_interrupted_while_writing_leaves_nothing(tmp_path, monkeypatch):
    from picc.compile import write_compiled
    from runtime.pib import PibWriter

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0)
    compiled = compile_model(model, CompileOptions(target="cpu", dense=True), say=lambda _: None)
    out = tmp_path / "out"
    out.mkdir()
    add_tensor, written = PibWriter.add_tensor, []

    def interrupted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        written.append(args[0])
        if len(written) == 5:
            raise KeyboardInterrupt
        return add_tensor(self, *args, **kwargs)

    monkeypatch.setattr(PibWriter, "add_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_compiled(compiled, out / "model.pib")
    assert len(written) == 5 and list(out.iterdir()) == []
    monkeypatch.setattr(PibWriter, "add_tensor", add_tensor)
    assert write_compiled(compiled, out / "model.pib") > 0 and [p.name for p in out.iterdir()] == ["model.pib"]
