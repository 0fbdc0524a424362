"""The dense CPU kernels (GEMV, GEMM, embedding), the weight layouts and x's rounding, against numpy
on 1, 2 and 3 threads (tolerances: ``tests/cpu_kernels.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_kernels import DTYPES, THREADS, FfnCase, gap_threshold, rel_err, run, tol, weights, width

from picc import kernel_names as names
from picc import quant
from picc.codegen_cpu import CpuModule, compile_kernels, dotplanes, rowplanes
from picc.codegen_cpu.kernels_dense import embed, gemm, gemv
from picc.codegen_cpu.kernels_ffn import sparse_ffn
from picc.codegen_cpu.kernels_misc import round_x
from picc.codegen_cpu.rows8 import from_rows8, to_rows8
from picc.errors import PiccError

# the dense kernels read gpt-oss's mxfp4 rows too (one row at a time; no FFN layout holds them)
ROW_DTYPES = (*DTYPES, "mxfp4")
KERNELS = ([k(d) for k in (gemv, gemm, embed) for d in ROW_DTYPES]
           + [gemv(d, x_format="i16") for d in ("q4_0", "q4_1", "mxfp4")]
           + [gemv(d, x, True) for d in ("q4_0", "q4_1") for x in ("f32", "i16", "i8")]
           + [gemm(d, True) for d in ("q4_0", "q4_1")] + [round_x("i16"), round_x("i8")]
           # the fused FFNs with int16 x of test_integer_dots_are_float_dots_of_the_rounded_x
           + [sparse_ffn(m, "swiglu", d, d, d, il, x_format="i16") for m, il in (("predictor", True), ("gate-first", False))
              for d in ("q4_0", "q4_1")])


@pytest.fixture(scope="module")
def host() -> CpuModule:
    return compile_kernels(KERNELS, simd="host")


# ------------------------------------------------------------------ dense kernels


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_gemv(host, teams, dtype, threads):
    rng = np.random.default_rng(1)
    rows, k = 37, width(dtype)  # 37 rows: not a multiple of 2, 3 or the 4-row tile
    raw, w = weights(rng, (rows, k), dtype)
    x, bias = rng.normal(size=k).astype(np.float32), rng.normal(size=rows).astype(np.float32)
    y = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype), raw, x, None, y, rows, k, 0)
    assert rel_err(y, w.astype(np.float64) @ x) <= tol(dtype)
    y0 = rng.normal(size=rows).astype(np.float32)
    y = y0.copy()
    run(host, teams[threads], gemv(dtype), raw, x, bias, y, rows, k, 1)  # y += W x + b
    assert rel_err(y, y0 + w.astype(np.float64) @ x + bias) <= tol(dtype)


@pytest.mark.parametrize("dtype, k", [("f16", 96), ("f16", 2048), ("q8_0", 96), ("q8_0", 4096), ("f32", 100)])
def test_gemv_rows_do_not_depend_on_the_rows_beside_them(host, teams, dtype, k):
    # Short f16 / q8_0 rows (under 4 KiB) go four at a time from four ranges of a thread's rows,
    # long ones and other formats in tiles of four consecutive rows (rowops.emit_tiled_rows):
    # either way each row's sum is its own, in one order, so a row gives the same bits alone as
    # among others, on any number of threads. 23 rows: on one thread four ranges of 5 rows and 3
    # left over, on three threads ranges of 2 or 1 rows (and leftovers).
    rng = np.random.default_rng(3)
    rows = 23
    raw, w = weights(rng, (rows, k), dtype)
    x = rng.normal(size=k).astype(np.float32)
    row_bytes = raw.nbytes // rows
    alone = np.zeros(rows, np.float32)
    for r in range(rows):
        run(host, teams[1], gemv(dtype), raw.reshape(-1).view(np.uint8)[r * row_bytes:], x, None, alone[r:], 1, k, 0)
    for threads in (1, 3):
        together = np.zeros(rows, np.float32)
        run(host, teams[threads], gemv(dtype), raw, x, None, together, rows, k, 0)
        assert rel_err(together, w.astype(np.float64) @ x) <= tol(dtype)
        for r in range(rows):
            assert alone[r] == together[r], (threads, r)


def int_x_error_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per row, the most that rounding x to int16 per block of 32 (the ``_xi16`` kernels) can move
    ``w @ x``: each element by half a step, the step being its block's largest |x| / 32767, plus a
    float32 rounding per block term (its int32 sum is exact; scaling and accumulating round)."""
    aw, ax = np.abs(w.astype(np.float64)), np.abs(x.astype(np.float64))
    step = np.repeat(ax.reshape(-1, 32).max(axis=1) / 32767, 32)
    return aw @ (step / 2) + 2.0**-22 * (aw @ ax)


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "mxfp4"])
def test_integer_dot_gemv_stays_within_the_rounding_of_x(host, teams, dtype, threads):
    rng = np.random.default_rng(11)
    rows, k = 37, 256
    raw, w = weights(rng, (rows, k), dtype)
    x = rng.normal(size=k).astype(np.float32)
    x[32:64] *= 1e-3  # a block of small values keeps its own scale
    x[64:96] = 0.0  # and an all-zero block has none
    y = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype, x_format="i16"), raw, x, None, y, rows, k, 0)
    exact = w.astype(np.float64) @ x
    err = np.abs(y - exact)
    assert np.all(err <= int_x_error_bound(w, x)), (err / int_x_error_bound(w, x)).max()
    # The rounding is there (an int16 x is not the float x): not the float kernel's bits.
    y_float = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype), raw, x, None, y_float, rows, k, 0)
    assert not np.array_equal(y, y_float)


@pytest.mark.parametrize("x_format", ["i16", "i8"])
def test_rounding_x_is_the_interpreters_bit_for_bit(host, teams, x_format):
    # The prefill program's GEMMs read x rounded by this kernel where the step's _xi16 / _xi8
    # kernels round it themselves; the interpreter rounds with picc.quant.round_x_blocks.
    rng = np.random.default_rng(30)
    x = rng.normal(size=(5, 96)).astype(np.float32)
    x[1, 32:64] *= 1e-30  # tiny values keep their own scale
    x[2, :32] = 0.0  # an all-zero block stays zero
    x[3, 64:] = rng.integers(-3, 4, size=32)  # ties, exact values
    out = np.full_like(x, np.nan)
    run(host, teams[3], round_x(x_format), x, out, 5, 96)
    expected = quant.round_x_blocks(x, x_format)
    np.testing.assert_array_equal(out, expected)
    assert not np.array_equal(expected, x) and np.all(expected[2, :32] == 0)
    step = np.repeat(np.abs(x).reshape(5, 3, 32).max(axis=2) / quant.INT_X_MAX[x_format], 32, axis=1)
    assert np.all(np.abs(expected.astype(np.float64) - x) <= step * (0.5 + 1e-6))


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_integer_dots_are_float_dots_of_the_rounded_x(host, teams, dtype):
    # What the interpreter computes for an _xi16 kernel: the float op on round_to_int16_blocks(x).
    # The kernels agree with it to float rounding (the int32 sums are exact; scaling rounds), well
    # inside the 1e-4 of the float kernels, and far closer than to the unrounded x (measured
    # 1e-7 to 5e-7 against 2e-5 to 4e-5).
    rng = np.random.default_rng(31)
    rows, k = 64, 256
    raw, w = weights(rng, (rows, k), dtype)
    x = rng.normal(size=k).astype(np.float32)
    xq = quant.round_to_int16_blocks(x).astype(np.float64)
    y = np.zeros(rows, np.float32)
    run(host, teams[2], gemv(dtype, x_format="i16"), raw, x, None, y, rows, k, 0)
    errors = {"gemv": (rel_err(y, w.astype(np.float64) @ xq), rel_err(y, w.astype(np.float64) @ x))}
    case = FfnCase("swiglu", (dtype, dtype, dtype), n=128, hidden=k, seed=32)
    rounded = FfnCase("swiglu", (dtype, dtype, dtype), n=128, hidden=k, seed=32)
    rounded.x = quant.round_to_int16_blocks(case.x)
    active = np.random.default_rng(33).random(case.n) < 0.4
    for mode, interleaved in (("predictor", True), ("gate-first", False)):
        kernel = sparse_ffn(mode, "swiglu", dtype, dtype, dtype, interleaved, x_format="i16")
        assert kernel.symbol.endswith("_xi16")
        thr = gap_threshold(rounded.act_gate(), 0.4) if mode == "gate-first" else 0.0
        chosen = active if mode == "predictor" else np.abs(rounded.act_gate()) > thr
        out, count = case.run(host, teams[2], kernel, active=active, threshold=thr, interleaved=interleaved)
        assert count == chosen.sum(), mode
        errors[mode] = (rel_err(out, rounded.reference(chosen)), rel_err(out, case.reference(chosen)))
    for name, (to_rounded, to_float) in errors.items():
        assert to_rounded <= 2e-6 and to_float > 10 * to_rounded, (name, to_rounded, to_float)


def test_mxfp4_gemv_int_dots_are_float_dots_of_the_rounded_x(host, teams):
    # What the interpreter computes for an mxfp4 _xi16 GEMV: the float op on the rounded x,
    # to float rounding (as the float kernel is the float op's). A block of scale 2^-128 (e = 0,
    # a denormal) and one of 2^100 (e = 228) decode to their exact values.
    rng = np.random.default_rng(34)
    rows, k = 64, 256
    raw, w = weights(rng, (rows, k), "mxfp4")
    blocks = raw.reshape(rows, -1, quant.BLOCK_BYTES["mxfp4"])
    blocks[0, 1, 0], blocks[1, 2, 0] = 0, 228
    w = quant.dequantize(raw, "mxfp4", (rows, k))
    x = rng.normal(size=k).astype(np.float32)
    xq = quant.round_to_int16_blocks(x).astype(np.float64)
    for kernel, want in ((gemv("mxfp4", x_format="i16"), xq), (gemv("mxfp4"), x.astype(np.float64))):
        y = np.zeros(rows, np.float32)
        run(host, teams[2], kernel, raw, x, None, y, rows, k, 0)
        exact = w.astype(np.float64) @ want
        assert rel_err(y[1:2], exact[1:2]) <= 2e-6, kernel.symbol  # the row of the 2^100 block
        others = np.r_[0, 2:rows]
        assert rel_err(y[others], exact[others]) <= 2e-6, kernel.symbol


@pytest.mark.parametrize("x_format", ["f32", "i16"])
def test_the_interpreter_computes_the_mxfp4_linear_of_the_gemv(host, teams, x_format):
    # A linear of mxfp4 rows in the interpreter (x rounded where the op says i16: dot_input) and
    # the GEMV of its x_format: float rounding apart, ten times closer than to the other x's op.
    from dataclasses import replace

    from picc.interpreter import Interpreter
    from picc.ir import ops as O
    from picc.ir.builder import FunctionBuilder
    from picc.ir.module import Module, WeightDecl
    from picc.ir.types import DType, f32
    from picc.ir.weights import Tensor, WeightStore

    rng = np.random.default_rng(35)
    rows, k = 64, 256
    raw, _ = weights(rng, (rows, k), "mxfp4")
    store = WeightStore({"w": Tensor(DType.MXFP4, (rows, k), raw)})
    b = FunctionBuilder("forward", {"w": store["w"].type})
    b.op(O.Linear, "y", x=b.arg("x", f32("seq", k)), weight="w", x_format=x_format)
    func = b.finish("y")
    interpreter = Interpreter(Module("m", (), (WeightDecl("w", store["w"].type),), (func,)), store)
    x = rng.normal(size=(1, k)).astype(np.float32)
    want = interpreter.eval(func.ops[0], {"x": x})[0]
    away = interpreter.eval(replace(func.ops[0], x_format="i16" if x_format == "f32" else "f32"), {"x": x})[0]
    y = np.zeros(rows, np.float32)
    run(host, teams[2], gemv("mxfp4", x_format=x_format), raw, x[0], None, y, rows, k, 0)
    assert rel_err(y, want.astype(np.float64)) <= 2e-6
    assert np.abs(y - away).max() > 10 * np.abs(y - want).max()


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_rows8_layout_holds_eight_rows_per_block_as_documented(dtype):
    rng = np.random.default_rng(40)
    rows, k = 24, 96
    raw, _ = weights(rng, (rows, k), dtype)
    stored = to_rows8(raw, dtype, (rows, k))
    assert stored.nbytes == raw.nbytes and not np.array_equal(stored.reshape(-1), raw.reshape(-1).view(np.uint8))
    np.testing.assert_array_equal(from_rows8(stored, dtype, (rows, k)), raw.reshape(rows, -1).view(np.uint8))
    # Group 1, block 2: the eight rows' f16 scales, then (q4_1) minimums, then chunk c's byte
    # 4r + e = element 4c + e of row r (low nibble) and element 16 + 4c + e (high nibble).
    bb, head = quant.BLOCK_BYTES[dtype], 16 if dtype == "q4_0" else 32
    blocks = raw.reshape(rows, k // 32, bb).view(np.uint8)
    group_block = stored.reshape(rows // 8, k // 32, 8 * bb)[1, 2]
    mine = blocks[8:16, 2]
    np.testing.assert_array_equal(group_block[:16].reshape(8, 2), mine[:, :2])
    if dtype == "q4_1":
        np.testing.assert_array_equal(group_block[16:32].reshape(8, 2), mine[:, 2:4])
    nibbles = mine[:, bb - 16:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)  # [row, element]
    chunks = group_block[head:].reshape(4, 8, 4)  # [chunk, row, e]
    for c in range(4):
        np.testing.assert_array_equal(chunks[c] & 15, q[:, 4 * c : 4 * c + 4])
        np.testing.assert_array_equal(chunks[c] >> 4, q[:, 16 + 4 * c : 20 + 4 * c])
    with pytest.raises(PiccError, match="does not fit"):
        to_rows8(raw[:20], dtype, (20, k))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_rowplanes_layout_puts_each_rows_scales_before_its_quants(dtype):
    rng = np.random.default_rng(41)
    rows, k = 5, 32 * 7  # 4-bit quants: a four-block unit, a two-block one and a one-block one
    raw, _ = weights(rng, (rows, k), dtype)
    stored = rowplanes.to_rowplanes(raw, dtype, (rows, k))
    assert stored.shape == (rows, raw.nbytes // rows) and not np.array_equal(stored.reshape(-1), raw.view(np.uint8))
    np.testing.assert_array_equal(rowplanes.from_rowplanes(stored, dtype, (rows, k)), raw.reshape(rows, -1).view(np.uint8))
    # Row 3: its seven f16 scales, then (q4_1) its seven minimums, then its quants.
    bb, nb = quant.BLOCK_BYTES[dtype], k // 32
    blocks = raw.reshape(rows, nb, bb).view(np.uint8)[3]
    head = 4 if dtype == "q4_1" else 2
    np.testing.assert_array_equal(stored[3, : 2 * nb].reshape(nb, 2), blocks[:, :2])
    if dtype == "q4_1":
        np.testing.assert_array_equal(stored[3, 2 * nb : 4 * nb].reshape(nb, 2), blocks[:, 2:4])
    quants = stored[3, head * nb :]
    if dtype == "q8_0":  # the blocks' int8 quants in order
        np.testing.assert_array_equal(quants.reshape(nb, bb - head), blocks[:, head:])
    else:  # element 32 b + t is byte t's low nibble, element 32 b + 16 + t its high one (GGUF)
        elements = np.concatenate([blocks[:, head:] & 15, blocks[:, head:] >> 4], axis=1).reshape(-1)
        for s, u in ((0, 4), (4, 2), (6, 1)):  # sixteen lanes of 8u bits; nibble c of lane l: element 32 s + 16 c + l
            lanes = quants[16 * s : 16 * (s + u)].reshape(16, u).astype(np.uint64) << (8 * np.arange(u, dtype=np.uint64))
            lanes = lanes.sum(axis=1)
            for c in range(2 * u):
                np.testing.assert_array_equal((lanes >> np.uint64(4 * c)) & np.uint64(15),
                                              elements[32 * s + 16 * c : 32 * s + 16 * c + 16])
    with pytest.raises(PiccError, match="not a .* matrix of shape"):
        rowplanes.to_rowplanes(raw.reshape(-1)[: raw.nbytes - 1], dtype, (rows, k))
    with pytest.raises(PiccError, match="rows of whole blocks"):
        rowplanes.to_rowplanes(raw, "f16", (rows, k))


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_dotplanes_layout_puts_each_rows_nibbles_before_its_scales(dtype):
    rng = np.random.default_rng(42)
    rows, k = 6, 32 * 7
    raw, _ = weights(rng, (rows, k), dtype)
    stored = dotplanes.to_dotplanes(raw, dtype, (rows, k))
    assert stored.shape == (rows, raw.nbytes // rows) and not np.array_equal(stored.reshape(-1), raw.view(np.uint8))
    np.testing.assert_array_equal(dotplanes.from_dotplanes(stored, dtype, (rows, k)), raw.reshape(rows, -1).view(np.uint8))
    # Row 4: its seven blocks' 16 nibble bytes as GGUF has them, then its f16 scales, then (q4_1) minimums.
    bb, nb, head = quant.BLOCK_BYTES[dtype], k // 32, 4 if dtype == "q4_1" else 2
    blocks = raw.reshape(rows, nb, bb).view(np.uint8)[4]
    np.testing.assert_array_equal(stored[4, : 16 * nb].reshape(nb, 16), blocks[:, head:])
    np.testing.assert_array_equal(stored[4, 16 * nb : 18 * nb].reshape(nb, 2), blocks[:, :2])
    if dtype == "q4_1":
        np.testing.assert_array_equal(stored[4, 18 * nb :].reshape(nb, 2), blocks[:, 2:4])
    # An interleaved up/gate tensor [n, 2, k] converts row by row, as a [2n, k] matrix does.
    np.testing.assert_array_equal(dotplanes.to_dotplanes(raw, dtype, (3, 2, k)), stored)
    with pytest.raises(PiccError, match="not a .* tensor of shape"):
        dotplanes.to_dotplanes(raw.reshape(-1)[: raw.nbytes - 1], dtype, (rows, k))
    with pytest.raises(PiccError, match="q4_0 / q4_1 rows"):
        dotplanes.to_dotplanes(raw, "q8_0", (rows, k))


def test_select_kernels_stores_gathered_rows_in_dotplanes_where_they_fit():
    # Rounded x, 4-bit rows of one format that the mode gathers and dots, rows of 4096 or more.
    assert names.gathered_layout("predictor", "i16", "q4_1", "q4_1", 4096) == "dotplanes"
    assert names.gathered_layout("gate-first", "i8", "q4_0", "q4_0", 5120) == "dotplanes"
    assert names.gathered_layout("gate-first", "i16", "q4_0", "q8_0", 4096) == "rows"  # one x: float unless both 4-bit
    assert names.gathered_layout("predictor", "i16", "q4_1", "q4_1", 2048) == "rows"  # short rows: eight at a time
    assert names.gathered_layout("predictor", "f32", "q4_1", "q4_1", 4096) == "rows"
    assert names.gathered_layout("down-only", "i16", "q4_1", "q4_1", 4096) == "rows"
    assert names.gathered_layout("predictor", "i16", "q4_0", "q4_1", 4096) == "rows"
    assert names.gathered_layout("predictor", "i16", "q8_0", "q8_0", 4096) == "rows"
    assert sparse_ffn("gate-first", "swiglu", "q4_1", "q4_1", "q4_1", x_format="i16", gathered="dotplanes").symbol \
        .endswith("_xi16_dp")
    with pytest.raises(PiccError, match="dotplanes layout holds"):
        sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", gathered="dotplanes")


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_rows8_gemvs_compute_what_rows_one_at_a_time_do(host, teams, dtype, threads):
    # Eight rows at a time from the rows8 layout: the same function as rows one at a time, with
    # int16 x (the float product on round_to_int16_blocks(x)) and with float x, to float
    # rounding (measured ~1e-7; the float kernels' bound is 1e-4).
    rng = np.random.default_rng(41)
    rows, k = 40, 128  # five groups of eight: three threads get 1, 2 and 2
    raw, w = weights(rng, (rows, k), dtype)
    x = rng.normal(size=k).astype(np.float32)
    x[32:64] *= 1e-3
    x[64:96] = 0.0
    bias = rng.normal(size=rows).astype(np.float32)
    y0 = rng.normal(size=rows).astype(np.float32)
    exact = w.astype(np.float64) @ quant.round_to_int16_blocks(x).astype(np.float64) + bias
    y = y0.copy()
    run(host, teams[threads], gemv(dtype, "i16", True), to_rows8(raw, dtype, (rows, k)), x, bias, y, rows, k, 1)
    assert rel_err(y - y0, exact) <= 2e-6
    y_rows = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype, "i16"), raw, x, bias, y_rows, rows, k, 0)
    assert rel_err(y_rows, exact) <= 2e-6
    y_float = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype, "f32", True), to_rows8(raw, dtype, (rows, k)), x, bias, y_float, rows, k, 0)
    assert rel_err(y_float, w.astype(np.float64) @ x + bias) <= 2e-6
    # int8 x (its low bytes' products skipped): the float product on round_x_blocks(x, "i8").
    exact8 = w.astype(np.float64) @ quant.round_x_blocks(x, "i8").astype(np.float64) + bias
    y8 = np.zeros(rows, np.float32)
    run(host, teams[threads], gemv(dtype, "i8", True), to_rows8(raw, dtype, (rows, k)), x, bias, y8, rows, k, 0)
    assert rel_err(y8, exact8) <= 2e-6 < rel_err(y8, exact)
    with pytest.raises(PiccError, match="rows8"):
        gemv("q8_0", "i16", True)


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_rows8_gemm_dequantises_the_same_rows(host, teams, dtype):
    # The prefill GEMM of a rows8 matrix reads each row back to the floats of the row layout.
    rng = np.random.default_rng(42)
    seq, rows, k = 6, 24, 96
    raw, _ = weights(rng, (rows, k), dtype)
    x, bias = rng.normal(size=(seq, k)).astype(np.float32), rng.normal(size=rows).astype(np.float32)
    y, y8 = np.zeros((seq, rows), np.float32), np.zeros((seq, rows), np.float32)
    run(host, teams[3], gemm(dtype), raw, x, bias, y, seq, rows, k, 0)
    run(host, teams[3], gemm(dtype, True), to_rows8(raw, dtype, (rows, k)), x, bias, y8, seq, rows, k, 0)
    np.testing.assert_array_equal(y8, y)



@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_gemm(host, teams, dtype, threads):
    rng = np.random.default_rng(2)
    seq, rows, k = 7, 19, width(dtype)  # 7 = one 4-row tile and 3 single rows
    raw, w = weights(rng, (rows, k), dtype)
    x, bias = rng.normal(size=(seq, k)).astype(np.float32), rng.normal(size=rows).astype(np.float32)
    y = np.zeros((seq, rows), np.float32)
    run(host, teams[threads], gemm(dtype), raw, x, bias, y, seq, rows, k, 0)
    assert rel_err(y, x.astype(np.float64) @ w.T.astype(np.float64) + bias) <= tol(dtype)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_embed_is_exact_dequantisation(host, teams, dtype):
    rng = np.random.default_rng(3)
    vocab, dim = 50, width(dtype, 70)
    raw, table = weights(rng, (vocab, dim), dtype)
    tokens = np.array([3, 0, 49, 3, 17], np.int32)
    out = np.zeros((len(tokens), dim), np.float32)
    run(host, teams[2], embed(dtype), raw, tokens, out, len(tokens), dim)
    np.testing.assert_array_equal(out, table[tokens])  # the same float32 operations as picc.quant
