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
from picc.ir.types import DType, Placement
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


def _target(tmp_path, rows8_int_rate: float, other_rate: float, rows8_rate: float | None = None,
            rows_int_rate: float | None = None, name: str = "t") -> str:
    bw = 40e9
    rates = {"q4_0": other_rate, "q4_0_xi16": rows_int_rate or other_rate, "q4_0_r8": rows8_rate or other_rate,
             "q4_0_r8_xi16": rows8_int_rate}
    path = tmp_path / f"{name}.yaml"
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
        # with --int-dots a sparse model's gathered rows read at int16's rate: where that is fast
        # too, worth profiling
        said.clear()
        fast_rows = _target(tmp_path, 40e9, 2e9, rows_int_rate=40e9, name="int")
        compile_model(model, replace(options, int_dots=True, target=fast_rows), say=said.append)
        assert not any("without profiling" in line for line in said)


def test_a_sparse_models_gathered_rows_count_at_the_rate_of_rows_one_at_a_time(tmp_path, monkeypatch):
    # Active rows are gathered, so a sparse FFN reads them one at a time (a target without
    # _gathered rates: at the one-row GEMV's); only a matrix it reads whole (a gate-first gate)
    # goes eight rows at a time. The rates of a Zen 4 on the fence: float
    # x reads rows at 20 GB/s and eight rows at 28, the dense model's integer dots at 32. Counting
    # 70% of every matrix at 28 GB/s, a sparse model looked faster and was profiled; at the rows'
    # rate (or reading whole at 28) it cannot be, and the sparse model compiled anyway is slower
    # than the bound.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    target = _target(tmp_path, 32e9, 20e9, rows8_rate=28e9)
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    options = CompileOptions(target=target, sparsity=SparsifyOptions(mode="gate-first", tokens=256, window=64,
                                                                     target_sparsity=0.3))
    said: list[str] = []
    chosen = compile_model(model, options, say=said.append)
    assert any(line.startswith("compiling the dense model without profiling") for line in said)
    sparse = compile_model(model, replace(options, sparse=True), say=lambda _: None)
    assert sparse.report["estimate_tokens_per_s"] <= chosen.report["sparse_estimate_at_most_tokens_per_s"]


def test_a_model_whose_calibration_would_take_too_long_or_too_much_memory_compiles_dense(tmp_path, monkeypatch):
    # Calibrating a SwiGLU 7B on 2 cores takes ~3/4 of an hour (Fisher scales and profiling, both
    # bound by float32 matrix products), against a minute for the dense model: past
    # CALIBRATION_SECONDS by the estimate at this machine's measured rates, or past its memory,
    # the compile goes dense and says why; --sparse calibrates anyway.
    import runtime.sequences
    from picc import compile as C
    from picc.sparsity import calibration_cost

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    profiled = []
    calibrate = profile_activations.calibrate
    monkeypatch.setattr(profile_activations, "calibrate", lambda *a, **k: profiled.append(1) or calibrate(*a, **k))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    target = _target(tmp_path, 40e9, 40e9)  # a sparse model could win: the CPU rule does not skip
    options = CompileOptions(target=target, sparsity=SparsifyOptions(mode="gate-first", tokens=256, window=64,
                                                                     target_sparsity=0.3))
    # Per token: 2 layers x (q, o 64 x 64, k, v 32 x 64; 3 x 128 x 64 FFN) + the 128 x 64 head multiply-adds;
    # the Fisher pass (which takes the profile too) is three forwards. (Dequantizing the tiny
    # model's weights takes microseconds: it does not move the line.)
    forward = 2 * (3 * 64 * 64 + 3 * 128 * 64) + 128 * 64
    slow = 2 * 3 * forward * 256 / (C.CALIBRATION_SECONDS * calibration_cost.EFFICIENCY)
    said: list[str] = []
    for rate, dense in ((1.01 * slow, False), (0.99 * slow, True)):
        monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes, r=rate: (r, r))
        profiled.clear()
        said.clear()
        chosen = compile_model(model, options, say=said.append)
        skipped = [line for line in said if line.startswith("compiling the dense model without profiling")]
        assert bool(skipped) == dense and bool(profiled) != dense
    assert "calibrating it on 256 tokens would take ~10 min (Fisher scales and the profile in one pass)" in skipped[0]
    assert "past the 10 min a compile spends on it unasked; --tokens 192 would fit (--sparse calib" in skipped[0]
    assert all(op.mode == "dense" for op in chosen.model.module.ops() if isinstance(op, FusedFFN))
    assert any("calibrating it on 256 tokens" in note for note in chosen.report["notes"])
    compile_model(model, replace(options, sparse=True), say=lambda _: None)
    assert profiled
    # 10x too slow: not even one window would fit, and the compile does not suggest fewer tokens
    monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes: (slow / 10, slow / 10))
    said.clear()
    compile_model(model, options, say=said.append)
    assert any("~100 min" in line and "would fit" not in line for line in said)
    # memory: profiling holds every token's scores of each thresholded layer, beside the f32 cache
    monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes: (1e15, 1e15))
    need = 2 * 4 * 256 * 128 + W.F32_CACHE_BYTES
    monkeypatch.setattr(runtime.sequences, "available_memory", lambda: need)  # 0.8 x that: too little
    said.clear()
    profiled.clear()
    compile_model(model, options, say=said.append)
    assert any(f"would hold ~{need / 2**30:.1f} GiB, more than this machine has" in line for line in said)
    assert not profiled


def test_predictor_training_counts_in_the_calibration_estimate(tmp_path, monkeypatch):
    # A ReLU model trains predictors after profiling (auto mode): their data (another forward) and
    # their training count in the estimate, so a model whose profiling alone would fit the budget
    # but whose predictors would not (a ReLU 7B: ~6 min of profiling, ~8 of predictors) compiles
    # dense; with exact masks only (no predictors to train) the same profiling fits.
    from picc import compile as C
    from picc.passes.insert_predictors import TRAIN_TOKENS, training_tokens
    from picc.sparsity import calibration_cost
    from picc.sparsity.predictors import starting_rank, training_flops

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    options = CompileOptions(target=_target(tmp_path, 40e9, 40e9), sparsity=SparsifyOptions(tokens=256, window=64))
    monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes: (1e15, 1e15))  # profiling: ~free
    ffns = [op for op in model.module.ops() if op.NAME == "ffn"]
    tokens = training_tokens(model.weights, ffns, 256)  # predictors train on more than profiling reads
    assert tokens == TRAIN_TOKENS
    flops = 2 * calibration_cost.SEARCH_ROUNDS * training_flops(64, 128, starting_rank(64, 128, 0.5, 1.0), tokens)
    rate = 0.99 * flops / (C.CALIBRATION_SECONDS * calibration_cost.EFFICIENCY * 2)  # just too slow, 2 cores
    monkeypatch.setattr(calibration_cost, "host_cores", lambda: 2)
    monkeypatch.setattr(calibration_cost, "_torch_one_thread_rate", lambda: rate)
    said: list[str] = []
    chosen = compile_model(model, options, say=said.append)
    (line,) = [line for line in said if line.startswith("compiling the dense model without profiling")]
    assert "(profiling ~0, training predictors ~10)" in line
    assert "would fit" not in line  # predictors train on 16384 tokens however few --tokens profile
    assert all(op.mode == "dense" for op in chosen.model.module.ops() if isinstance(op, FusedFFN))
    said.clear()
    exact = replace(options, sparsity=replace(options.sparsity, mode="gate-first"))
    compile_model(model, exact, say=said.append)
    assert not any(line.startswith("compiling the dense model without profiling") for line in said)


def test_predictors_on_the_profiled_tokens_cost_no_forward_of_their_own(tmp_path, monkeypatch):
    # Where the predictors train on the tokens profiling reads (a ReLU 7B, whose training data would
    # pass DATA_BYTES at more), profiling keeps the FFN inputs for them: the estimate counts one
    # forward, not two. Here profiling alone takes 0.6 of the budget (training ~free).
    import math

    from picc import compile as C
    from picc.ir import ops as O
    from picc.passes import insert_predictors as ip
    from picc.sparsity import calibration_cost

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.F32))
    ops = list(model.module.ops())
    last_ffn = max(i for i, op in enumerate(ops) if isinstance(op, O.FFN))
    profiled = sum(math.prod(model.weights[n].shape) for op in ops[: last_ffn + 1]
                   for n in ((op.weight,) if isinstance(op, O.Linear) else (op.up, op.gate, op.down)
                             if isinstance(op, O.FFN) else ()))
    rate = 2 * profiled * 256 / (0.6 * C.CALIBRATION_SECONDS * calibration_cost.EFFICIENCY)
    monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes: (rate, rate))
    monkeypatch.setattr(calibration_cost, "_torch_one_thread_rate", lambda: 1e15)
    options = CompileOptions(target=_target(tmp_path, 40e9, 40e9), sparsity=SparsifyOptions(tokens=256, window=64))

    def too_costly() -> bool:
        said: list[str] = []
        compile_model(model, options, say=said.append)
        return any(line.startswith("compiling the dense model without profiling") for line in said)

    assert too_costly()  # 16384 training tokens: a forward of 64 times profiling's
    monkeypatch.setattr(ip, "DATA_BYTES", 1)  # the profiled 256 tokens: profiling's forward serves
    assert not too_costly()


def test_the_estimate_trains_the_ranks_the_predictor_budget_allows(monkeypatch):
    # Before profiling, each layer is estimated at the rank a half-dense layer starts from; train_all
    # halves the largest predictors until all fit --predictor-budget, and so must the estimate (a
    # ReLU LLaMA-7B: rank 1024 from the density, 128 within 10% of its FFN bytes; counting 1024 put
    # its training at ~32 minutes). Here: rank 64 from the density, and a budget for 32.
    from picc.passes.insert_predictors import predictor_budget
    from picc.sparsity import calibration_cost as cc
    from picc.sparsity.predictors import predictor_params, starting_rank, training_flops

    model = tiny_llama("reglu", n_layers=2, hidden=256, n_ff=512, matrix_dtype=DType.Q4_0)
    ffns = [op for op in model.module.ops() if op.NAME == "ffn"]
    assert starting_rank(256, 512, 0.5, 1.0) == 64
    monkeypatch.setattr(cc, "_rates", lambda width, lanes: (1e15, 1e15))
    monkeypatch.setattr(cc, "_torch_one_thread_rate", lambda: 1.0)
    monkeypatch.setattr(cc, "host_cores", lambda: 1)

    def training_seconds(share: float) -> tuple[int, float]:
        budget = predictor_budget(model.weights, ffns, share)
        work = cc.PredictorWork(ffns, 4096, budget)
        return budget, cc.calibration_cost(model, 4096, "cats", False, 256, None, work).predictor_seconds

    roomy, at_64 = training_seconds(0.5)
    tight, at_32 = training_seconds(0.25)
    assert 2 * predictor_params(64, 256, 512) <= roomy and 2 * predictor_params(32, 256, 512) <= tight \
        < predictor_params(64, 256, 512) + predictor_params(32, 256, 512)
    # The data pass costs the same in both: the difference is the training alone.
    expected = 2 * cc.SEARCH_ROUNDS * (training_flops(256, 512, 64, 4096) - training_flops(256, 512, 32, 4096)) \
        / cc.EFFICIENCY
    assert at_64 - at_32 == pytest.approx(expected, rel=1e-6)


def test_the_tokens_that_would_fit_are_found_by_the_estimate_not_by_proportion(tmp_path, monkeypatch):
    # The Fisher pass costs a forward of every token and a backward of the first --fisher-tokens:
    # at 256 tokens and 64 of them 1.3x the budget, 192 tokens (256 / 1.3 in whole windows, as a
    # proportion would say) still do not fit; 128 do.
    from picc import compile as C
    from picc.sparsity import calibration_cost

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0))
    sparsity = SparsifyOptions(mode="gate-first", tokens=256, window=64, target_sparsity=0.3, fisher_tokens=64)
    forward = 2 * (3 * 64 * 64 + 3 * 128 * 64) + 128 * 64  # multiply-adds a token (see above)
    rate = 2 * forward * (256 + 2 * 64) / (1.3 * C.CALIBRATION_SECONDS * calibration_cost.EFFICIENCY)
    monkeypatch.setattr(calibration_cost, "_rates", lambda width, lanes: (rate, rate))
    said: list[str] = []
    compile_model(model, CompileOptions(target=_target(tmp_path, 40e9, 40e9), sparsity=sparsity), say=said.append)
    assert any("would take ~13 min" in line and "--tokens 128 would fit" in line for line in said), said


@pytest.mark.parametrize("workers", [1, 3])
def test_run_many_gives_each_window_what_run_gives_it_and_dequantizes_each_weight_once(monkeypatch, workers):
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
    together = interp.run_many(windows, workers=workers)
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


def test_sigterm_unwinds_like_ctrl_c_and_leaves_nothing_half_written(tmp_path):
    # kill / timeout / a service manager send SIGTERM, whose default action ends the process at
    # once: a 7B compile killed while writing left its 2 GB temp file beside the output. Within
    # picc's main, SIGTERM raises instead (exit status 143), and the temp file goes as on Ctrl-C.
    # (In a child process: without the handler, SIGTERM ends the process that gets it.)
    import signal
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import os, signal, sys, time
from pathlib import Path
from picc.cli import Terminated, sigterm_raises
from picc.fsutil import atomic_path
before = signal.getsignal(signal.SIGTERM)
try:
    with sigterm_raises(), atomic_path(Path({str(tmp_path / "model.pib")!r})) as tmp:
        tmp.write_bytes(b"half a model")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises long before this ends
except Terminated:
    sys.exit(143 if signal.getsignal(signal.SIGTERM) == before else 1)
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60)
    assert done.returncode == 143, done.returncode
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process's is untouched


def test_the_long_stages_of_a_compile_show_progress(tmp_path, monkeypatch):
    # On a 7B these take tens of seconds each: the neuron-major down projections (requantized),
    # the placement's memory plans, writing the .pib (3.6 GB, some of it converted to rows8),
    # hashing the model for the profile cache; lowering the GPU's ops takes seconds.
    import tqdm

    from picc.compile import write_compiled

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    bars: dict[str, list[int]] = {}  # what -> [total, done]

    class Bar:
        def __init__(self, total=None, desc="", **kwargs):  # noqa: ANN001, ANN003
            self.state = bars.setdefault(desc, [total, 0])

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            return False

        def update(self, n=1):  # noqa: ANN001, ANN202
            self.state[1] += n

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    model = tiny_llama("swiglu", n_layers=3, hidden=64, n_ff=128, matrix_dtype=DType.Q4_0)
    compiled = compile_model(model, CompileOptions(target="pc-low", vram="64MB", dense=True), say=lambda _: None)
    size = write_compiled(compiled, tmp_path / "m.pib")
    assert bars["neuron-major down projections"] == [3, 3]
    on_gpu = [op for op in compiled.model.module.ops() if op.type.placement == Placement.GPU]
    assert on_gpu and bars["lowering the GPU's ops"] == [len(on_gpu)] * 2  # after loading TVM (seconds)
    total, done = bars["placing under the VRAM budget"]
    assert total == 3 + 5 and 3 < done <= total
    weights = sum(compiled.model.weights[d.name].data.nbytes for d in compiled.model.module.weights)
    total, done = bars["writing m.pib"]
    assert total == done and weights <= total < size
    # the profile cache's key reads every weight (from disk, for a mapped 7B not in the page cache)
    import hashlib

    from picc.digest import hash_model

    hash_model(hashlib.sha256(), model.module, model.weights)
    assert bars["hashing the model"] == [sum(model.weights[n].data.nbytes for n in model.weights)] * 2


def test_a_bar_advanced_by_shares_of_a_unit_counts_whole_units(monkeypatch):
    # Profiling and the Fisher pass advance by an op's share of the windows' tokens; the bar
    # showed "758.5185185185185/4096 tok".
    import tqdm

    from picc.progress import progress_bar

    updates: list[object] = []

    class Bar:
        def __init__(self, **kwargs):  # noqa: ANN003
            pass

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            return False

        def update(self, n):  # noqa: ANN001, ANN202
            updates.append(n)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    with progress_bar(4096, "profiling", "tok") as advance:
        for _ in range(27):
            advance(4096 / 27)
    assert all(isinstance(n, int) for n in updates) and sum(updates) == 4096
