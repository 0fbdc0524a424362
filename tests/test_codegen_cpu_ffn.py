"""The fused FFN kernels (sparse in every mode, dense, the predictor, the merge of partial sums)
against float64 numpy on 1, 2 and 3 threads (tolerances: ``tests/cpu_kernels.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_kernels import (
    DTYPES,
    F32_TOL,
    PLANES_MODES,
    QUANT_TOL,
    THREADS,
    FfnCase,
    active_sets,
    ffn_kernels,
    gap_threshold,
    or_zero,
    planes_of,
    rel_err,
    run,
    tol,
    weights,
)

from picc import quant
from picc.codegen_cpu import CpuModule, aligned_zeros, compile_kernels
from picc.codegen_cpu.kernels_dense import dense_ffn, dense_ffn_scratch_bytes
from picc.codegen_cpu.kernels_ffn import FORMS, predictor, predictor_scratch_bytes, sparse_ffn
from picc.codegen_cpu.kernels_misc import merge
from picc.codegen_cpu.rows8 import to_rows8
from picc.errors import PiccError

# gpt-oss's mxfp4 up and gate (its down q8_0, as neuron-major-down makes it), float and int16 x
MXFP4_MODES = (("predictor", False), ("predictor", True), ("gate-first", False), ("dense", False))
MXFP4_KERNELS = ([sparse_ffn(m, "swiglu", "mxfp4", "mxfp4", "q8_0", il, x_format=x) for m, il in MXFP4_MODES
                  for x in ("f32", "i16")]
                 + [dense_ffn("swiglu", "mxfp4", "mxfp4", "mxfp4", x) for x in ("f32", "i16")])
KERNELS = ffn_kernels() + [predictor("f32", "f32"), predictor("f16", "f16"), merge()] + MXFP4_KERNELS


@pytest.fixture(scope="module")
def host() -> CpuModule:
    return compile_kernels(KERNELS, simd="host")


@pytest.mark.parametrize("hidden", [32, 64, 96, 128, 160, 192, 224, 288])
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_sparse_ffn_dots_dotplanes_rows_of_every_length(host, teams, dtype, hidden):
    # Rows of 1 to 9 blocks (select-kernels stores only rows of 4096 or more so, but a kernel reads any):
    # pieces of four blocks, then one of two and one of one, in every mix;
    # int16 and int8 x (whose low bytes the dots skip), against the float op on the rounded x
    # (the int32 sums are exact, the float part rounds: measured up to 9e-7 over these cases). 25
    # of 40 neurons: six fours and a last one alone on the thread. A dot that read a piece's lanes,
    # scales or offsets out of place is off by far more (a block's share of a row).
    active = np.zeros(40, bool)
    active[np.random.default_rng(hidden).permutation(40)[:25]] = True
    for x_format in ("i16", "i8"):
        case = FfnCase("swiglu", (dtype,) * 3, n=40, hidden=hidden, seed=hidden + 1)
        rounded = FfnCase("swiglu", (dtype,) * 3, n=40, hidden=hidden, seed=hidden + 1)
        rounded.x = quant.round_x_blocks(case.x, x_format)
        for mode, il in PLANES_MODES:
            thr = 0.0 if mode == "predictor" else gap_threshold(rounded.act_gate(), 0.4)
            chosen = active if mode == "predictor" else np.abs(rounded.act_gate()) > thr
            kernel = sparse_ffn(mode, "swiglu", dtype, dtype, dtype, il, x_format=x_format, gathered="dotplanes")
            y, count = case.run(host, teams[1], kernel, active=active, threshold=thr, interleaved=il,
                                planes=planes_of(mode))
            assert count == chosen.sum(), (x_format, mode, il)
            assert rel_err(y, rounded.reference(chosen)) <= 2e-6, (x_format, mode, il)


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_integer_dot_dense_ffns_compute_the_rounded_ffn(host, teams, dtype):
    # Both phases dot rounded vectors (x, then h), rows one at a time or eight at a time from the
    # rows8 layout: what the interpreter computes, the float FFN on round_to_int16_blocks(x) and
    # then on the rounded h. Held to 1e-5 of the output's scale (float rounding in the kernels
    # and in h's rounding), and ten times closer to it than to the float FFN (rounding x and h
    # to int16 moves the result by ~5e-5).
    case = FfnCase("swiglu", (dtype, dtype, dtype), n=128, biases=True, seed=26)
    down_raw, down = weights(np.random.default_rng(27), (case.hidden, 128), dtype)
    ref_float = down.astype(np.float64) @ case.h() + case.down_bias
    refs = {}
    for x_format in ("i16", "i8"):
        rounded = FfnCase("swiglu", (dtype, dtype, dtype), n=128, biases=True, seed=26)
        rounded.x = quant.round_x_blocks(case.x, x_format)
        h = quant.round_x_blocks(rounded.h().astype(np.float32), x_format).astype(np.float64)
        refs[x_format] = down.astype(np.float64) @ h + case.down_bias
    for x_format, in_rows8 in (("f32", False), ("f32", True), ("i16", False), ("i16", True), ("i8", True)):
        y = np.zeros(case.hidden, np.float32)
        scratch = aligned_zeros(dense_ffn_scratch_bytes(case.n))
        up, gate, dn = case.up_raw, case.gate_raw, down_raw
        if in_rows8:
            up, gate = (to_rows8(m, dtype, (case.n, case.hidden)) for m in (up, gate))
            dn = to_rows8(dn, dtype, (case.hidden, case.n))
        kernel = dense_ffn("swiglu", dtype, dtype, dtype, x_format, in_rows8)
        run(host, teams[3], kernel, case.x, up, gate, dn, case.up_bias, case.gate_bias, case.down_bias, y, scratch,
            case.n, case.hidden, 0)
        if x_format != "f32":
            ref_rounded = refs[x_format]
            assert rel_err(y, ref_rounded) <= 1e-5, (kernel.symbol, rel_err(y, ref_rounded))
            assert rel_err(y, ref_float) > 10 * rel_err(y, ref_rounded), kernel.symbol
        else:
            assert rel_err(y, ref_float) <= tol(dtype)





@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_ffn_predictor_mode_every_dtype(host, teams, dtype, threads):
    case = FfnCase("swiglu", (dtype, dtype, dtype), seed=4)
    for interleaved in (False, True):
        kernel = sparse_ffn("predictor", "swiglu", dtype, dtype, dtype, interleaved)
        for name, active in active_sets(case.n, np.random.default_rng(6)).items():
            y, count = case.run(host, teams[threads], kernel, active=active, interleaved=interleaved)
            assert count == active.sum(), (name, interleaved)
            # y = the partial sum: with no active neuron y must be exactly zero.
            if name == "empty":
                np.testing.assert_array_equal(y, np.zeros(case.hidden, np.float32))
            assert rel_err(y, case.reference(active)) <= tol(dtype), (name, interleaved)


@pytest.mark.parametrize("hidden", [32, 64, 128, 160, 192, 224, 288])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_sparse_ffn_axpys_down_rows_of_every_length(host, teams, dtype, hidden):
    # A rowplanes down row's 4-bit quants come in units of four blocks, then one of two and one
    # of one: 1 to 9 blocks cover every mix (a one-block unit after a two-block one included),
    # each with eight-neuron octets, pairs and a last neuron alone (19 active of 40).
    case = FfnCase("swiglu", (dtype, dtype, dtype), n=40, hidden=hidden, seed=hidden)
    active = np.zeros(case.n, bool)
    active[np.random.default_rng(hidden).permutation(case.n)[:19]] = True
    y, count = case.run(host, teams[1], sparse_ffn("predictor", "swiglu", dtype, dtype, dtype, False), active=active)
    assert count == 19 and rel_err(y, case.reference(active)) <= tol(dtype)


@pytest.mark.parametrize("form", list(FORMS))
def test_sparse_ffn_every_form_with_biases(host, teams, form):
    spec = FORMS[form]
    case = FfnCase(form, ("f16", "f16" if spec.gated else None, "f16"), biases=True, seed=7)
    active = np.random.default_rng(8).random(case.n) < 0.5
    for interleaved in (False, True) if spec.gated else (False,):
        kernel = sparse_ffn("predictor", form, "f16", "f16" if spec.gated else None, "f16", interleaved)
        y, _ = case.run(host, teams[2], kernel, active=active, interleaved=interleaved)
        assert rel_err(y, case.reference(active)) <= QUANT_TOL, interleaved


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", ("f16", "q4_0"))
def test_sparse_ffn_dense_gate_first_down_only(host, teams, dtype, threads):
    case = FfnCase("swiglu", (dtype, dtype, dtype), biases=True, seed=9)
    y, _ = case.run(host, teams[threads], sparse_ffn("dense", "swiglu", dtype, dtype, dtype))
    assert rel_err(y, case.reference(np.ones(case.n, bool))) <= QUANT_TOL
    for mode, scores in (("gate-first", case.act_gate()), ("down-only", case.h())):
        for keep in (0.1, 0.5, 1.0):
            thr = 0.0 if keep == 1.0 else gap_threshold(scores, keep)
            active = np.abs(scores) > thr
            y, count = case.run(host, teams[threads], sparse_ffn(mode, "swiglu", dtype, dtype, dtype), threshold=thr)
            assert count == active.sum(), (mode, keep)
            assert rel_err(y, case.reference(active)) <= QUANT_TOL, (mode, keep)


def test_sparse_ffn_drelu_and_relu_thresholds(host, teams):
    # dReLU's activity score is |h| = relu(g) relu(u), decided in gate-first mode after up.
    case = FfnCase("drelu", ("f32", "f32", "f32"), seed=10)
    thr = gap_threshold(case.h(), 0.2)
    y, _ = case.run(host, teams[3], sparse_ffn("gate-first", "drelu", "f32", "f32", "f32"), threshold=thr)
    assert rel_err(y, case.reference(np.abs(case.h()) > thr)) <= F32_TOL
    for form, dt, gate in (("relu", "q8_0", None), ("drelu", "f16", "f16")):
        case = FfnCase(form, (dt, gate, dt), seed=11)
        thr = gap_threshold(case.h(), 0.3)
        y, count = case.run(host, teams[2], sparse_ffn("down-only", form, dt, gate, dt), threshold=thr)
        assert count == (np.abs(case.h()) > thr).sum()
        assert rel_err(y, case.reference(np.abs(case.h()) > thr)) <= QUANT_TOL


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_gate_first_reads_a_rows8_gate_eight_rows_at_a_time(host, teams, dtype, threads):
    # The dense gate projection of gate-first mode from the rows8 layout (threads split n at
    # multiples of 8: 64 neurons on three threads are 16, 24 and 24), with float x and with
    # int16 and int8 x (the gathered up rows' dots skip int8's zero low bytes too); the down
    # AXPYs as before.
    case = FfnCase("swiglu", (dtype, dtype, dtype), n=64, hidden=96, biases=True, seed=44)
    refs = {"f32": case}
    for x_format in ("i16", "i8"):
        refs[x_format] = FfnCase("swiglu", (dtype, dtype, dtype), n=64, hidden=96, biases=True, seed=44)
        refs[x_format].x = quant.round_x_blocks(case.x, x_format)
    case.gate_raw = to_rows8(case.gate_raw, dtype, (case.n, case.hidden))
    for x_format, ref in refs.items():
        thr = gap_threshold(ref.act_gate(), 0.4)
        chosen = np.abs(ref.act_gate()) > thr
        kernel = sparse_ffn("gate-first", "swiglu", dtype, dtype, dtype, False, x_format, dense_rows8=True)
        assert "_r8" in kernel.symbol
        y, count = case.run(host, teams[threads], kernel, threshold=thr)
        assert count == chosen.sum()
        assert rel_err(y, ref.reference(chosen)) <= (2e-6 if x_format != "f32" else tol(dtype)), x_format
    with pytest.raises(PiccError, match="rows8"):
        sparse_ffn("predictor", "swiglu", dtype, dtype, dtype, dense_rows8=True)


@pytest.mark.parametrize("threads", (1, 3))
def test_gate_first_decides_on_the_scaled_score(host, teams, threads):
    # score_scale (Fisher scales, picc.sparsity.fisher) multiplies each neuron's |act(g)| before the
    # threshold: in the row layout (101 neurons: whole spans of 32 and a tail) and the rows8 one,
    # and for dReLU, whose score |h| is scaled after up. A kernel that ignored the scale keeps
    # other neurons: the scales span 0.05..20, so the two rules disagree on many of them.
    rng = np.random.default_rng(46)
    for form, dtype, n, rows8 in (("swiglu", "f16", 101, False), ("swiglu", "q4_1", 64, True),
                                  ("drelu", "f32", 101, False)):
        case = FfnCase(form, (dtype, dtype, dtype), n=n, biases=True, seed=47)
        scale = np.exp(rng.uniform(np.log(0.05), np.log(20), n)).astype(np.float32)
        raw = case.act_gate() if form == "swiglu" else case.h()
        scores = np.abs(raw) * scale
        thr = gap_threshold(scores, 0.4)
        chosen = scores > thr
        assert (chosen != (np.abs(raw) > thr)).sum() >= 3  # the scale matters here
        if rows8:
            case.gate_raw = to_rows8(case.gate_raw, dtype, (case.n, case.hidden))
        kernel = sparse_ffn("gate-first", form, dtype, dtype, dtype, dense_rows8=rows8)
        y, count = case.run(host, teams[threads], kernel, threshold=thr, score_scale=scale)
        if form == "swiglu":  # dReLU counts the neurons whose gate passed (relu(g) > 0)
            assert count == chosen.sum(), form
        assert rel_err(y, case.reference(chosen)) <= tol(dtype), form


@pytest.mark.parametrize("form", ["swiglu", "relu"])
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_down_only_reads_its_whole_matrices_eight_rows_at_a_time(host, teams, dtype, form):
    # Down-only computes gate (when gated) and up for every neuron: from the rows8 layout, with
    # float x and with int16 x, then skips the down rows of small |h|.
    gated = FORMS[form].gated
    dts = (dtype, dtype if gated else None, dtype)
    case, rounded = (FfnCase(form, dts, n=64, hidden=96, biases=True, seed=45) for _ in range(2))
    rounded.x = quant.round_x_blocks(case.x, "i16")
    case.up_raw = to_rows8(case.up_raw, dtype, (case.n, case.hidden))
    if gated:
        case.gate_raw = to_rows8(case.gate_raw, dtype, (case.n, case.hidden))
    for x_format, ref in (("f32", case), ("i16", rounded)):
        if form == "relu" and x_format != "f32":
            continue  # compiled only with float x (the kernel list stays short)
        thr = gap_threshold(ref.h(), 0.5)
        kernel = sparse_ffn("down-only", form, *dts, False, x_format, dense_rows8=True)
        y, count = case.run(host, teams[3], kernel, threshold=thr)
        assert count == (np.abs(ref.h()) > thr).sum()
        assert rel_err(y, ref.reference(np.abs(ref.h()) > thr)) <= (2e-6 if x_format != "f32" else tol(dtype))


@pytest.mark.parametrize("x_format", ["f32", "i16"])
def test_fused_ffns_read_mxfp4_up_and_gate_rows(host, teams, x_format):
    # mxfp4 rows gathered a pair at a time (no layout of eight rows holds them) and read whole
    # (gate-first's gate, dense mode), with float or int16 x: against the float FFN of the x
    # the kernel dots (rounded as the interpreter rounds it), to float rounding.
    dtypes = ("mxfp4", "mxfp4", "q8_0")
    case = FfnCase("swiglu", dtypes, n=77, hidden=128, biases=True, seed=40)
    rounded = FfnCase("swiglu", dtypes, n=77, hidden=128, biases=True, seed=40)
    if x_format == "i16":
        rounded.x = quant.round_to_int16_blocks(case.x)
    active = np.random.default_rng(41).random(case.n) < 0.4
    for mode, il in MXFP4_MODES:
        kernel = sparse_ffn(mode, "swiglu", *dtypes, il, x_format=x_format)
        assert kernel.symbol.endswith("_xi16") == (x_format == "i16")
        thr = gap_threshold(rounded.act_gate(), 0.4) if mode == "gate-first" else 0.0
        chosen = {"predictor": active, "dense": np.ones(case.n, bool)}.get(mode, np.abs(rounded.act_gate()) > thr)
        y, count = case.run(host, teams[2], kernel, active=active, threshold=thr, interleaved=il)
        if mode != "dense":
            assert count == chosen.sum(), (mode, il)
        assert rel_err(y, rounded.reference(chosen)) <= 2e-6, (mode, il)
    down_raw, down = weights(np.random.default_rng(42), (case.hidden, 96), "mxfp4")
    case = FfnCase("swiglu", ("mxfp4", "mxfp4", "mxfp4"), n=96, hidden=128, biases=True, seed=43)
    h = case.h() if x_format == "f32" else None
    if h is None:
        case.x = quant.round_to_int16_blocks(case.x)
        h = quant.round_to_int16_blocks(case.h().astype(np.float32)).astype(np.float64)
    y = np.full(case.hidden, np.nan, np.float32)
    scratch = aligned_zeros(dense_ffn_scratch_bytes(case.n))
    run(host, teams[2], dense_ffn("swiglu", "mxfp4", "mxfp4", "mxfp4", x_format), case.x, case.up_raw, case.gate_raw,
        down_raw, case.up_bias, case.gate_bias, case.down_bias, y, scratch, case.n, case.hidden, 0)
    assert rel_err(y, down.astype(np.float64) @ h + case.down_bias) <= 1e-5  # h's rounding in float32


def test_no_fused_ffn_axpys_mxfp4_down_rows():
    with pytest.raises(PiccError, match="not mxfp4"):
        sparse_ffn("predictor", "swiglu", "mxfp4", "mxfp4", "mxfp4")


def test_fused_ffn_dots_int16_x_only_when_up_and_gate_are_both_4_bit():
    # The step's kernel and its prefill twin read one x for up and gate: rounded for both or neither.
    assert sparse_ffn("dense", "swiglu", "q4_1", "q4_1", "f16", x_format="i16").symbol.endswith("_xi16")
    assert sparse_ffn("dense", "relu", "q4_0", None, "q4_0", x_format="i16").symbol.endswith("_xi16")
    for up, gate in (("q4_1", "q8_0"), ("q8_0", "q4_1"), ("f16", "f16")):
        assert not sparse_ffn("dense", "swiglu", up, gate, "q4_1", x_format="i16").symbol.endswith("_xi16")


def test_sparse_ffn_mixed_formats_and_determinism(host, teams):
    case = FfnCase("swiglu", ("q4_1", "q8_0", "f16"), n=77, seed=12)
    active = np.random.default_rng(13).random(case.n) < 0.4
    kernel = sparse_ffn("predictor", "swiglu", "q4_1", "q8_0", "f16")
    y, _ = case.run(host, teams[3], kernel, active=active)
    assert rel_err(y, case.reference(active)) <= QUANT_TOL
    # Threads split the list and each sums into its own buffer: the same bits on every run.
    for _ in range(3):
        np.testing.assert_array_equal(case.run(host, teams[3], kernel, active=active)[0], y)
    # accumulate = 1 adds the result to y: the bits of a separate float32 add of the two.
    y0 = np.random.default_rng(14).normal(size=case.hidden).astype(np.float32)
    np.testing.assert_array_equal(case.run(host, teams[3], kernel, active=active, y0=y0)[0], y0 + y)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("form, dtype", [("swiglu", "f32"), ("swiglu", "q4_1"), ("relu", "q4_1")])
def test_dense_ffn_in_the_source_layout(host, teams, form, dtype, threads):
    # The dense FFN of a CPU-only dense compile reads down as stored, [hidden, n]: a GEMV per phase.
    gated = FORMS[form].gated
    case = FfnCase(form, (dtype, dtype if gated else None, dtype), biases=True, seed=26)
    down_raw, down = weights(np.random.default_rng(27), (case.hidden, case.n if dtype == "f32" else 128), dtype)
    if dtype != "f32":  # block rows need a multiple of 32 neurons
        case = FfnCase(form, (dtype, dtype if gated else None, dtype), n=128, biases=True, seed=26)
    y = np.full(case.hidden, np.nan, np.float32)
    scratch = aligned_zeros(dense_ffn_scratch_bytes(case.n))
    run(host, teams[threads], dense_ffn(form, dtype, dtype if gated else None, dtype), case.x, case.up_raw,
        case.gate_raw, down_raw, case.up_bias, case.gate_bias, case.down_bias, y, scratch, case.n, case.hidden, 0)
    ref = down.astype(np.float64) @ case.h() + case.down_bias
    assert rel_err(y, ref) <= tol(dtype)
    # accumulate = 1 adds the result to y: the bits of a separate float32 add of the two.
    y0 = np.random.default_rng(28).normal(size=case.hidden).astype(np.float32)
    y2 = y0.copy()
    run(host, teams[threads], dense_ffn(form, dtype, dtype if gated else None, dtype), case.x, case.up_raw,
        case.gate_raw, down_raw, case.up_bias, case.gate_bias, case.down_bias, y2, scratch, case.n, case.hidden, 1)
    np.testing.assert_array_equal(y2, y0 + y)


def test_merge_adds_partial_sums_and_the_bias(host, teams):
    rng = np.random.default_rng(28)
    a, b, bias = (rng.normal(size=131).astype(np.float32) for _ in range(3))
    out = np.zeros(131, np.float32)
    run(host, teams[3], merge(), a, b, bias, out, 131)
    np.testing.assert_array_equal(out, (a + b) + bias)
    run(host, teams[2], merge(), a, b, None, out, 131)
    np.testing.assert_array_equal(out, a + b)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", ("f32", "f16"))
def test_predictor(host, teams, dtype, threads):
    rng = np.random.default_rng(14)
    hidden, rank, n = 100, 24, 131
    fc1_raw, fc1 = weights(rng, (rank, hidden), dtype, hidden**-0.5)
    _, fc2 = weights(rng, (n, rank), dtype, rank**-0.5)
    fc2t = quant.quantize(np.ascontiguousarray(fc2.T), dtype)  # the kernel reads fc2 transposed (exact)
    b1, b2 = rng.normal(0, 0.1, size=rank).astype(np.float32), rng.normal(0, 0.1, size=n).astype(np.float32)
    x = rng.normal(size=hidden).astype(np.float32)
    for bias1, bias2 in ((b1, b2), (None, None)):
        logits = np.maximum(fc1.astype(np.float64) @ x + or_zero(bias1), 0) @ fc2.T.astype(np.float64) + or_zero(bias2)
        for keep in (0.0, 0.3, 1.0):
            thr = {0.0: 1e9, 1.0: -1e9}.get(keep) or gap_threshold(logits - logits.min() + 1, keep) + logits.min() - 1
            mask = np.full(n, 7, np.uint8)
            scratch = aligned_zeros(predictor_scratch_bytes(rank))
            run(host, teams[threads], predictor(dtype, dtype), x, fc1_raw, bias1, fc2t, bias2, mask, scratch,
                hidden, rank, n, thr)
            np.testing.assert_array_equal(mask, (logits > thr).astype(np.uint8))
