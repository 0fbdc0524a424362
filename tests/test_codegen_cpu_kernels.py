"""The CPU kernels (picc.codegen_cpu) against numpy, on 1, 2 and 3 threads.

Tolerances, as relative errors ``max|out - ref| / max|ref|`` against a float64 numpy reference:

* f32 weights: 1e-5. The kernels accumulate in float32 in a different order than numpy; the sum of
  k products carries ~sqrt(k) * 6e-8 relative rounding error (measured ~1e-7 at k <= 1000), so
  1e-5 fails only on a real mistake (a wrong element, a missed row, a dropped bias).
* f16 / q8_0 / q4_0 / q4_1 weights: 1e-4 against numpy on the *same dequantised weights*
  (``picc.quant.dequantize``), so quantisation error is not part of it; the kernels scale once per
  32-block instead of per element, a few extra roundings (measured ~3e-7).
* Dequantisation alone (embedding lookup) and anything a thread count could change only by a race
  are checked bit for bit.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from scipy.special import erf

from picc import kernel_names as names
from picc import quant
from picc.codegen_cpu import (
    SYNC_BYTES,
    Buf,
    CpuModule,
    Null,
    Param,
    Program,
    ThreadTeam,
    aligned_zeros,
    buffer_table,
    compile_kernels,
    dotplanes,
    rowplanes,
)
from picc.codegen_cpu.irtext import Fn
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.kernels_attention import attention
from picc.codegen_cpu.kernels_dense import dense_ffn, dense_ffn_scratch_bytes, embed, gemm, gemv
from picc.codegen_cpu.kernels_ffn import FORMS, ffn_scratch_bytes, predictor, predictor_scratch_bytes, sparse_ffn
from picc.codegen_cpu.kernels_misc import (
    add,
    argmax,
    ffn_activation,
    layer_norm,
    merge,
    mul,
    rms_norm,
    rope,
    round_x,
)
from picc.codegen_cpu.program import profile_slots
from picc.codegen_cpu.rowops import emit_axpys, emit_dots, emit_x_sums
from picc.codegen_cpu.rows8 import from_rows8, to_rows8
from picc.errors import PiccError
from picc.interpreter import KVCache, rope_cos_sin
from picc.interpreter import attention as attention_ref
from picc.interpreter import rope as rope_ref
from picc.ir import ops as O
from picc.ir.types import f32

DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
THREADS = (1, 2, 3)
GATED_FORMS = tuple(f for f, s in FORMS.items() if s.gated)
F32_TOL, QUANT_TOL = 1e-5, 1e-4


def tol(dtype: str) -> float:
    return F32_TOL if dtype == "f32" else QUANT_TOL


PLANES_MODES = (("predictor", True), ("predictor", False), ("gate-first", False))  # int x: dotplanes rows


def ffn_kernels() -> list[Kernel]:
    ks = [sparse_ffn("predictor", "swiglu", d, d, d, il) for d in DTYPES for il in (False, True)]
    ks += [sparse_ffn("predictor", f, "f16", "f16" if s.gated else None, "f16") for f, s in FORMS.items()]
    ks += [sparse_ffn("predictor", f, "f16", "f16", "f16", True) for f, s in FORMS.items() if s.gated]
    ks += [dense_ffn(f, d, d if FORMS[f].gated else None, d) for f in ("swiglu", "relu") for d in ("f32", "q4_1")]
    ks += [dense_ffn("swiglu", d, d, d, x_format) for d in ("q4_0", "q4_1") for x_format in ("f32", "i16")]
    ks += [dense_ffn("swiglu", d, d, d, x, True) for d in ("q4_0", "q4_1") for x in ("f32", "i16", "i8")]
    ks += [sparse_ffn(m, "swiglu", d, d, d) for m in ("dense", "gate-first", "down-only") for d in ("f16", "q4_0")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, il, x_format="i16") for m, il in (("predictor", True), ("gate-first", False))
           for d in ("q4_0", "q4_1")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, il, x_format=x, gathered="dotplanes") for m, il in PLANES_MODES
           for d in ("q4_0", "q4_1") for x in ("i16", "i8")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, False, x, dense_rows8=True) for d in ("q4_0", "q4_1")
           for x in ("f32", "i16", "i8") for m in ("gate-first", "down-only")]
    ks += [sparse_ffn("gate-first", "swiglu", "q4_1", "q4_1", "q4_1")]
    ks += [sparse_ffn("down-only", "relu", d, None, d, dense_rows8=True) for d in ("q4_0", "q4_1")]
    ks += [sparse_ffn("gate-first", "drelu", "f32", "f32", "f32"), sparse_ffn("down-only", "relu", "q8_0", None, "q8_0"),
           sparse_ffn("down-only", "drelu", "f16", "f16", "f16"), sparse_ffn("predictor", "swiglu", "q4_1", "q8_0", "f16")]
    return ks


KERNELS = ([k(d) for k in (gemv, gemm, embed) for d in DTYPES] + [gemv(d, x_format="i16") for d in ("q4_0", "q4_1")]
           + [gemv(d, x, True) for d in ("q4_0", "q4_1") for x in ("f32", "i16", "i8")] + [gemm(d, True) for d in ("q4_0", "q4_1")]
           + ffn_kernels()
           + [predictor("f32", "f32"), predictor("f16", "f16"), rms_norm(), layer_norm(), add(), mul(), merge(), argmax(),
              attention(), attention("f16"), round_x("i16"), round_x("i8")] + [rope(s) for s in ("llama", "gptj")]
           + [ffn_activation(f) for f in FORMS])
# The AVX2 build: one kernel of each kind, every weight format.
AVX2_KERNELS = ([gemv(d) for d in DTYPES] + [sparse_ffn("predictor", "swiglu", d, d, d) for d in DTYPES]
                + [sparse_ffn(m, "swiglu", d, d, d, il, x_format="i16", gathered="dotplanes") for m, il in PLANES_MODES
                   for d in ("q4_0", "q4_1")]
                + [sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"), gemm("q4_1"), attention("f16"), rms_norm(),
                   ffn_activation("geglu")])


@pytest.fixture(scope="module")
def host() -> CpuModule:
    return compile_kernels(KERNELS, simd="host")


@pytest.fixture(scope="module")
def avx2() -> CpuModule:
    return compile_kernels(AVX2_KERNELS, simd="avx2")


def run(module: CpuModule, team: ThreadTeam, kernel: Kernel, *args: object) -> None:
    """Call ``kernel`` on every thread of ``team``; numpy arrays are passed as pointers."""
    fn = module.function(kernel.symbol, kernel.argtypes)
    team.run(fn, [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args])


def weights(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0):
    """(raw bytes in ``dtype``, the float32 values they decode to)."""
    raw = quant.quantize(rng.normal(0, scale, size=shape).astype(np.float32), dtype)
    return raw, quant.dequantize(raw, dtype, shape)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def width(dtype: str, plain: int = 100) -> int:
    """Row length: a multiple of 32 for block formats, one with a tail (not a multiple of 32) else."""
    return 96 if quant.BLOCK_SIZE.get(dtype) else plain


def act64(name: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    if name == "relu":
        return np.maximum(x, 0)
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + erf(x / np.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gap_threshold(scores: np.ndarray, keep: float) -> float:
    """A threshold keeping about ``keep`` of ``scores``, halfway across a gap between two of them,
    so float32-vs-float64 rounding cannot move any score across it."""
    s = np.sort(np.abs(scores))
    i = int(np.clip(len(s) * (1 - keep), 1, len(s) - 1))
    while i < len(s) - 1 and s[i] - s[i - 1] < 1e-3 * s[-1]:
        i += 1
    return float((s[i] + s[i - 1]) / 2)


# ------------------------------------------------------------------ dense kernels


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
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
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
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


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm(host, teams, dtype, threads):
    rng = np.random.default_rng(2)
    seq, rows, k = 7, 19, width(dtype)  # 7 = one 4-row tile and 3 single rows
    raw, w = weights(rng, (rows, k), dtype)
    x, bias = rng.normal(size=(seq, k)).astype(np.float32), rng.normal(size=rows).astype(np.float32)
    y = np.zeros((seq, rows), np.float32)
    run(host, teams[threads], gemm(dtype), raw, x, bias, y, seq, rows, k, 0)
    assert rel_err(y, x.astype(np.float64) @ w.T.astype(np.float64) + bias) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_is_exact_dequantisation(host, teams, dtype):
    rng = np.random.default_rng(3)
    vocab, dim = 50, width(dtype, 70)
    raw, table = weights(rng, (vocab, dim), dtype)
    tokens = np.array([3, 0, 49, 3, 17], np.int32)
    out = np.zeros((len(tokens), dim), np.float32)
    run(host, teams[2], embed(dtype), raw, tokens, out, len(tokens), dim)
    np.testing.assert_array_equal(out, table[tokens])  # the same float32 operations as picc.quant


# ------------------------------------------------------------------ the fused sparse FFN


class FfnCase:
    """Random FFN weights of one form and the float64 reference of every mode."""

    def __init__(self, form: str, dtypes: tuple[str, str | None, str], n: int = 101, hidden: int | None = None,
                 biases: bool = False, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.spec = FORMS[form]
        self.n = n
        self.hidden = hidden or (96 if any(quant.BLOCK_SIZE.get(d or "") for d in dtypes) else 100)
        h = self.hidden
        self.x = rng.normal(size=h).astype(np.float32)
        self.up_dtype, self.gate_dtype = dtypes[0], dtypes[1]
        self.up_raw, self.up = weights(rng, (n, h), dtypes[0], h**-0.5)
        self.gate_raw, self.gate = weights(rng, (n, h), dtypes[1], h**-0.5) if dtypes[1] else (None, None)
        self.down_raw, self.down = weights(rng, (n, h), dtypes[2], n**-0.5)
        # The kernels read a block-format down_t in the rowplanes layout (the .pib stores it so).
        self.down_t = (rowplanes.to_rowplanes(self.down_raw, dtypes[2], (n, h)) if dtypes[2] in rowplanes.DTYPES
                       else self.down_raw)
        rand = (lambda size: rng.normal(0, 0.1, size=size).astype(np.float32)) if biases else (lambda size: None)
        self.up_bias, self.gate_bias, self.down_bias = rand(n), rand(n) if dtypes[1] else None, rand(h)

    def act_gate(self) -> np.ndarray:
        g = self.gate.astype(np.float64) @ self.x + (0 if self.gate_bias is None else self.gate_bias)
        return act64(self.spec.act, g)

    def h(self) -> np.ndarray:
        u = self.up.astype(np.float64) @ self.x + (0 if self.up_bias is None else self.up_bias)
        if not self.spec.gated:
            return act64(self.spec.act, u)
        return self.act_gate() * (act64(self.spec.act, u) if self.spec.act_on_up else u)

    def reference(self, active: np.ndarray) -> np.ndarray:
        y = np.where(active, self.h(), 0) @ self.down.astype(np.float64)
        return y + (0 if self.down_bias is None else self.down_bias)

    def run(self, module, team, kernel, *, active=None, threshold=0.0, score_scale=None, interleaved=False,
            y0=None, planes=()):
        """(y after the call, the kernel's count). ``y`` starts as garbage, which the kernel
        overwrites, or as ``y0``, which it adds its result to (``accumulate``). ``planes``: the
        matrices ("up", "gate") the kernel reads in the dotplanes layout (:func:`planes_of`)."""
        y = np.full(self.hidden, np.nan, np.float32) if y0 is None else y0.astype(np.float32)
        mask = np.zeros(self.n, np.uint8) if active is None else active.astype(np.uint8)
        count = np.array([-1], np.int32)
        scratch = aligned_zeros(ffn_scratch_bytes(self.n, self.hidden, team.nthreads))
        up, gate, up_bias, gate_bias = self.up_raw, self.gate_raw, self.up_bias, self.gate_bias
        if "up" in planes:
            up = dotplanes.to_dotplanes(up, self.up_dtype, (self.n, self.hidden))
        if "gate" in planes:
            gate = dotplanes.to_dotplanes(gate, self.gate_dtype, (self.n, self.hidden))
        if interleaved:  # up_gate [n, 2, row]: the gate argument points one row further
            both = np.ascontiguousarray(np.stack([up.reshape(self.n, -1), gate.reshape(self.n, -1)], 1))
            up, gate = both, both.reshape(-1)[both.shape[2]:]
            if self.up_bias is not None:
                biases = np.ascontiguousarray(np.stack([self.up_bias, self.gate_bias], 1))
                up_bias, gate_bias = biases, biases.reshape(-1)[1:]
        run(module, team, kernel, self.x, up, gate, self.down_t, up_bias, gate_bias,
            self.down_bias, y, mask, count, scratch, self.n, self.hidden, threshold, score_scale, int(y0 is not None))
        return y, int(count[0])


def planes_of(mode: str) -> tuple[str, ...]:
    """The matrices a fused FFN kernel with ``gathered="dotplanes"`` reads in that layout (as ``lower_ops`` stores them)."""
    return names.gathered_dotted(mode, "up", "gate")


def active_sets(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"empty": np.zeros(n, bool), "all": np.ones(n, bool), "some": rng.random(n) < 0.3,
            "one": np.arange(n) == n - 1}


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
        logits = np.maximum(fc1.astype(np.float64) @ x + _or0(bias1), 0) @ fc2.T.astype(np.float64) + _or0(bias2)
        for keep in (0.0, 0.3, 1.0):
            thr = {0.0: 1e9, 1.0: -1e9}.get(keep) or gap_threshold(logits - logits.min() + 1, keep) + logits.min() - 1
            mask = np.full(n, 7, np.uint8)
            scratch = aligned_zeros(predictor_scratch_bytes(rank))
            run(host, teams[threads], predictor(dtype, dtype), x, fc1_raw, bias1, fc2t, bias2, mask, scratch,
                hidden, rank, n, thr)
            np.testing.assert_array_equal(mask, (logits > thr).astype(np.uint8))


def _or0(bias: np.ndarray | None) -> np.ndarray | float:
    return 0.0 if bias is None else bias


# ------------------------------------------------------------------ small kernels


@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
@pytest.mark.parametrize(("seq", "threads"), [(3, 2), (1, 3), (2, 3)])
def test_norms(host, teams, kind, seq, threads):
    # Fewer rows than threads (a decode step's one row): every thread takes each row's statistics
    # and a share of its elements; the same bits as one thread, and in place as out of place.
    rng = np.random.default_rng(15)
    n, eps = 100, 1e-5
    x = rng.normal(size=(seq, n)).astype(np.float32)
    w, b = (1 + 0.1 * rng.normal(size=n)).astype(np.float32), rng.normal(size=n).astype(np.float32)
    kernel, bias = (rms_norm(), None) if kind == "rms_norm" else (layer_norm(), b)
    out, alone, in_place = np.zeros_like(x), np.zeros_like(x), x.copy()
    run(host, teams[threads], kernel, x, w, bias, out, seq, n, eps)
    run(host, teams[1], kernel, x, w, bias, alone, seq, n, eps)
    run(host, teams[threads], kernel, in_place, w, bias, in_place, seq, n, eps)
    np.testing.assert_array_equal(out, alone)
    np.testing.assert_array_equal(in_place, alone)
    xd = x.astype(np.float64)
    if kind == "rms_norm":
        ref = xd / np.sqrt((xd**2).mean(-1, keepdims=True) + eps) * w
    else:
        c = xd - xd.mean(-1, keepdims=True)
        ref = c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * w + b
    assert rel_err(out, ref) <= F32_TOL


@pytest.mark.parametrize("style", ("llama", "gptj"))
@pytest.mark.parametrize("rotary_dim", (16, 8))
@pytest.mark.parametrize("seq", (3, 1))  # one row on two threads: they split its heads
def test_rope_matches_interpreter(host, teams, style, rotary_dim, seq):
    rng = np.random.default_rng(16)
    pos, heads, hd = 1000, 3, 16  # a large position: the angle's float32 rounding matters
    op = O.Rope(result="r", type=f32(seq, heads * hd), x="x", pos="p", n_heads=heads, head_dim=hd,
                rotary_dim=rotary_dim, style=style, theta=500000.0)
    x = rng.normal(size=(seq, heads * hd)).astype(np.float32)
    ref = rope_ref(op, x, np.arange(pos, pos + seq, dtype=np.int32))
    out = x.copy()
    cos, sin = rope_cos_sin(op, np.arange(pos + seq))  # the tables the lowering stores, rows 0 .. pos + seq
    run(host, teams[2], rope(style), out, cos, sin, seq, pos, heads, hd, rotary_dim)
    # The interpreter's cosines and sines, the same products and sums: the same bits.
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("hd", (20, 84))  # 16 + a tail; 64 (the wide V pass) + 16 + a tail
@pytest.mark.parametrize("window", (None, 3))
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kv_format", ("f32", "f16"))
def test_attention_matches_interpreter(host, teams, threads, window, hd, kv_format):
    rng = np.random.default_rng(17)
    heads, kv, ctx = 6, 2, 16  # up to 10 positions: scored four at a time, then one
    op = O.Attention(result="a", type=f32(1, heads * hd), q="q", k="k", v="v", pos="p", n_heads=heads,
                     n_kv_heads=kv, head_dim=hd, scale=hd**-0.5, cache="c", window=window, kv_format=kv_format)
    dtype = np.float16 if kv_format == "f16" else np.float32
    cache, kcache, vcache = KVCache(kv * hd), np.zeros((ctx, kv * hd), dtype), np.zeros((ctx, kv * hd), dtype)
    pos = 0
    for seq in (5, 1, 1, 3):  # a prefill chunk, then decode steps, then another chunk
        q = rng.normal(size=(seq, heads * hd)).astype(np.float32)
        k, v = (rng.normal(size=(seq, kv * hd)).astype(np.float32) for _ in range(2))
        ref = attention_ref(op, q, k, v, np.arange(pos, pos + seq, dtype=np.int32), cache)
        out = np.zeros_like(q)
        run(host, teams[threads], attention(kv_format), q, k, v, kcache, vcache, out, seq, pos, heads, kv, hd,
            hd**-0.5, window or 0, ctx)
        # The cache holds k and v as numpy rounds them (to nearest even), each KV head's rows in
        # its own plane [ctx, hd], and the interpreter, which rounds alike, attends over the same values.
        for cached, new in ((kcache, k), (vcache, v)):
            planes = cached.reshape(kv, ctx, hd)[:, pos : pos + seq]
            np.testing.assert_array_equal(planes, new.reshape(seq, kv, hd).transpose(1, 0, 2).astype(dtype))
        assert rel_err(out, ref) <= F32_TOL, seq
        pos += seq


def test_add_mul_and_ffn_activations(host, teams):
    rng = np.random.default_rng(18)
    n = 1000 + 7
    a, b = (rng.normal(size=n).astype(np.float32) * 3 for _ in range(2))
    out = np.zeros(n, np.float32)
    run(host, teams[3], add(), a, b, out, n)
    np.testing.assert_array_equal(out, a + b)  # one float32 addition per element, as numpy
    run(host, teams[3], mul(), a, b, out, n)
    np.testing.assert_array_equal(out, a * b)
    for form, spec in FORMS.items():
        run(host, teams[2], ffn_activation(form), a, b, out, n)
        up = act64(spec.act, b) if spec.act_on_up or not spec.gated else b
        ref = act64(spec.act, a) * up if spec.gated else up
        # exp / erf / tanh are polynomial approximations good to a few float32 ulp.
        assert rel_err(out, ref) <= 1e-6, form


def test_argmax_first_of_ties(host, teams):
    x = np.random.default_rng(19).normal(size=49157).astype(np.float32)
    out = np.zeros(1, np.int32)
    for where in (0, 17, 49156, 30000):
        y = x.copy()
        y[where] = y[30001] = 10.0  # a tie: the first index wins, as np.argmax
        run(host, teams[2], argmax(), y, out, len(y))
        assert out[0] == np.argmax(y)


def test_argmax_at_every_length_and_place_ignoring_nans(host, teams):
    # Four 16-lane chains then 16-wide tails, and the scan 16 at a time then one by one: lengths
    # on and off those steps, the largest (and a tie after it) in the chains, the 16-wide part
    # and the last elements, and NaNs anywhere (ignored, as np.nanargmax does).
    rng = np.random.default_rng(23)
    out = np.zeros(1, np.int32)
    for n in (1, 5, 16, 20, 64, 70, 100, 1000, 1037):
        x = rng.normal(size=n).astype(np.float32)
        for where in sorted({0, n // 2, max(0, n - 17), n - 1}):
            y = x.copy()
            y[where] = 10.0
            y[n - 1 if where < n - 1 else 0] = 10.0 if where < n - 1 else y[0]  # a later tie
            if n > 2:
                y[(where + 1) % n] = np.nan if y[(where + 1) % n] != 10.0 else y[(where + 1) % n]
            run(host, teams[2], argmax(), y, out, n)
            assert out[0] == np.nanargmax(y), (n, where)
    y = np.full(40, -np.inf, np.float32)
    run(host, teams[2], argmax(), y, out, 40)
    assert out[0] == 0


# ------------------------------------------------------------------ programs, barriers, builds


def _decode_like_program(buffers: dict[str, int]) -> list[tuple[Kernel, tuple]]:
    """A norm -> projections -> rope -> attention -> residual -> sparse FFN -> argmax chain."""
    b = {k: Buf(v) for k, v in buffers.items()}
    hid, heads, kv, hd, n = 64, 4, 2, 16, 96
    return [
        (rms_norm(), (b["x"], b["norm"], Null(), b["h"], 1, hid, 1e-5)),
        (gemv("q4_0"), (b["wq"], b["h"], Null(), b["q"], heads * hd, hid, 0)),
        (gemv("q8_0"), (b["wk"], b["h"], Null(), b["k"], kv * hd, hid, 0)),
        (gemv("f16"), (b["wv"], b["h"], Null(), b["v"], kv * hd, hid, 0)),
        (rope("llama"), (b["q"], b["cos"], b["sin"], 1, Param(buffers["params"], 0), heads, hd, hd)),
        (rope("llama"), (b["k"], b["cos"], b["sin"], 1, Param(buffers["params"], 0), kv, hd, hd)),
        (attention(), (b["q"], b["k"], b["v"], b["kc"], b["vc"], b["att"], 1, Param(buffers["params"], 0), heads, kv,
                       hd, 0.25, 0, 8)),
        (gemv("q4_1"), (b["wo"], b["att"], Null(), b["x"], hid, heads * hd, 1)),
        (sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"),
         (b["x"], b["up"], b["gate"], b["down"], Null(), Null(), Null(), b["x2"], Null(), Null(), b["scratch"], n, hid,
          0.05, Null(), 0)),
        (sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"),  # x2 += the FFN of x2: a residual add
         (b["x2"], b["up"], b["gate"], b["down"], Null(), Null(), Null(), b["x2"], Null(), Null(), b["scratch"], n,
          hid, 0.05, Null(), 1)),
        (argmax(), (b["x2"], b["out"], hid)),
    ]


def test_program_equals_kernels_one_by_one(host, teams):
    names = ["sync", "params", "x", "norm", "h", "wq", "wk", "wv", "q", "k", "v", "cos", "sin", "kc", "vc", "att", "wo", "up",
             "gate", "down", "x2", "scratch", "out"]
    index = {name: i for i, name in enumerate(names)}
    calls = _decode_like_program(index)
    prog = Program("test_step", sync=index["sync"])
    for kernel, args in calls:
        prog.call(kernel, *args)
    module = compile_kernels([], [prog])

    def fresh() -> dict[str, np.ndarray]:
        r = np.random.default_rng(21)
        angles = np.arange(3, dtype=np.float32)[:, None] / 10000 ** (np.arange(0, 16, 2) / 16)  # 3 positions
        data = {"x": r.normal(size=64).astype(np.float32), "norm": np.ones(64, np.float32),
                "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
        for name, shape, dt in (("wq", (64, 64), "q4_0"), ("wk", (32, 64), "q8_0"), ("wv", (32, 64), "f16"),
                                ("wo", (64, 64), "q4_1"), ("up", (96, 64), "q4_0"), ("gate", (96, 64), "q4_0"),
                                ("down", (96, 64), "q4_0")):
            data[name] = weights(r, shape, dt, 0.2)[0]
        data["down"] = rowplanes.to_rowplanes(data["down"], "q4_0", (96, 64))
        for name, size in (("h", 64), ("q", 64), ("k", 32), ("v", 32), ("att", 64), ("x2", 64)):
            data[name] = np.zeros(size, np.float32)
        data["kc"], data["vc"] = np.zeros((8, 32), np.float32), np.zeros((8, 32), np.float32)
        data["scratch"] = aligned_zeros(ffn_scratch_bytes(96, 64, 3))
        data["out"], data["params"], data["sync"] = np.zeros(1, np.int32), np.zeros(4, np.int32), aligned_zeros(SYNC_BYTES)
        return data

    stepped, single = fresh(), fresh()
    table = buffer_table([stepped[n] for n in names])
    step = module.function("test_step", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
    for pos in range(3):  # the same compiled step at three positions (pos read from params)
        stepped["params"][0] = pos
        teams[3].run_each(lambda tid: step(ctypes.addressof(table), tid, 3))
        for kernel, args in calls:
            values = [single[names[a.index]] if isinstance(a, Buf) else None if isinstance(a, Null)
                      else pos if isinstance(a, Param) else a for a in args]
            run(host, teams[3], kernel, *values)
        for name in ("x", "q", "kc", "att", "x2", "out"):
            np.testing.assert_array_equal(stepped[name], single[name], err_msg=f"{name} at pos {pos}")


def test_barriers_order_a_chain_of_dependent_kernels(teams):
    # y1 = W y0, y0 = W y1, ... : each GEMV reads all of the previous one's rows, written by every
    # thread; without the barriers a thread would read stale rows. Each row's sum does not depend
    # on the thread count, so the 3-thread result must equal the 1-thread one bit for bit.
    rng = np.random.default_rng(22)
    rows = 64
    w = (rng.normal(size=(rows, rows)) / 8).astype(np.float32)
    prog = Program("chain", sync=0)
    for i in range(40):
        src, dst = (2, 3) if i % 2 == 0 else (3, 2)
        prog.call(gemv("f32"), Buf(1), Buf(src), Null(), Buf(dst), rows, rows, 0)
    module = compile_kernels([], [prog])
    step = module.function("chain", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
    results = []
    for n in (1, 3):
        bufs = [aligned_zeros(SYNC_BYTES), w, np.ones(rows, np.float32), np.zeros(rows, np.float32)]
        table = buffer_table(bufs)
        for _ in range(5):
            bufs[2][:], bufs[3][:] = 1, 0
            teams[n].run_each(lambda tid, t=table, n=n: step(ctypes.addressof(t), tid, n))
            results.append(bufs[2].copy())
    ref = np.ones(rows)
    for _ in range(20):
        ref = w @ (w @ ref)
    for r in results:
        np.testing.assert_array_equal(r, results[0])
    assert rel_err(results[0], ref) <= 1e-4  # 40 chained products of float32 rounding


def test_a_profiled_program_counts_each_calls_cycles_and_computes_the_same(teams):
    # A GEMV of 512 x 512, one of 8 x 8 (4096 times fewer products), and the big one again on the
    # first one's result (the last call: no barrier after it). The profiled twin must leave the
    # same results and count, per thread, the runs, more cycles in each big GEMV than in the small
    # one, time at the barriers after the first two calls and none after the last.
    rng = np.random.default_rng(27)
    big, small = ((rng.normal(size=(n, n)) / n).astype(np.float32) for n in (512, 8))
    prog = Program("timed", sync=0)
    prog.call(gemv("f32"), Buf(1), Buf(3), Null(), Buf(4), 512, 512, 0, label="big")
    prog.call(gemv("f32"), Buf(2), Buf(3), Null(), Buf(5), 8, 8, 0, label="small")
    prog.call(gemv("f32"), Buf(1), Buf(4), Null(), Buf(6), 512, 512, 0, label="big again")
    profiled = prog.profiled(7)
    assert profiled.name == "timed_profile" and [c.label for c in profiled.calls] == ["big", "small", "big again"]
    module = compile_kernels([], [prog, profiled])
    slots = profile_slots(3)
    runs, threads = 9, 2
    outputs = []
    counters = np.zeros((threads, slots), np.int64)
    for name in ("timed", "timed_profile"):
        step = module.function(name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
        bufs = [aligned_zeros(SYNC_BYTES), big, small, np.linspace(-1, 1, 512, dtype=np.float32),
                np.zeros(512, np.float32), np.zeros(8, np.float32), np.zeros(512, np.float32), counters]
        table = buffer_table(bufs)
        for _ in range(runs):
            teams[threads].run_each(lambda tid, t=table, s=step: s(ctypes.addressof(t), tid, threads))
        outputs.append([bufs[4].copy(), bufs[5].copy(), bufs[6].copy()])
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_array_equal(a, b)
    kernel, wait = counters[:, 0:6:2], counters[:, 1:6:2]
    assert (counters[:, slots - 1] == runs).all()
    assert (kernel[:, 0] > kernel[:, 1]).all() and (kernel[:, 2] > kernel[:, 1]).all()
    assert (wait[:, :2] > 0).all() and (wait[:, 2] == 0).all()


def test_avx2_build_computes_the_same_bits(host, avx2, teams):
    rng = np.random.default_rng(23)
    for dtype in DTYPES:
        raw, _ = weights(rng, (37, width(dtype)), dtype)
        x = rng.normal(size=width(dtype)).astype(np.float32)
        ys = []
        for module in (host, avx2):
            ys.append(np.zeros(37, np.float32))
            run(module, teams[2], gemv(dtype), raw, x, None, ys[-1], 37, width(dtype), 0)
        np.testing.assert_array_equal(ys[0], ys[1], err_msg=dtype)
        # 224: a rowplanes down row of a four-, a two- and a one-block unit
        case = FfnCase("swiglu", (dtype, dtype, dtype), hidden=224 if dtype in rowplanes.DTYPES else None, seed=24)
        active = rng.random(case.n) < 0.4
        kernel = sparse_ffn("predictor", "swiglu", dtype, dtype, dtype)
        np.testing.assert_array_equal(case.run(host, teams[3], kernel, active=active)[0],
                                      case.run(avx2, teams[3], kernel, active=active)[0], err_msg=dtype)
    # Rounded x: gathered rows from the dotplanes layout, four blocks a piece in one vector or two
    # (224: a four-, a two- and a one-block piece), the same float operations lane by lane.
    for dtype in ("q4_0", "q4_1"):
        case = FfnCase("swiglu", (dtype,) * 3, hidden=224, seed=26)
        for mode, il in PLANES_MODES:
            kernel = sparse_ffn(mode, "swiglu", dtype, dtype, dtype, il, x_format="i16", gathered="dotplanes")
            thr = 0.0 if mode == "predictor" else gap_threshold(case.act_gate(), 0.4)
            outs = [case.run(m, teams[2], kernel, active=active[: case.n], threshold=thr, interleaved=il,
                             planes=planes_of(mode)) for m in (host, avx2)]
            assert outs[0][1] == outs[1][1] > 0
            np.testing.assert_array_equal(outs[0][0], outs[1][0], err_msg=f"{dtype} {mode} {il}")
    case = FfnCase("swiglu", ("q4_0",) * 3, seed=25)
    kernel = sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0")
    np.testing.assert_array_equal(case.run(host, teams[2], kernel, threshold=0.1)[0],
                                  case.run(avx2, teams[2], kernel, threshold=0.1)[0])
    # 11 positions, scored four at a time, then one at a time; head size 20, a 16-element slice
    # and a tail.
    q = rng.normal(size=(11, 80)).astype(np.float32)
    k, v = rng.normal(size=(11, 40)).astype(np.float32), rng.normal(size=(11, 40)).astype(np.float32)
    outs = []
    for module in (host, avx2):
        outs.append(np.zeros_like(q))
        run(module, teams[2], attention("f16"), q, k, v, np.zeros((12, 40), np.float16),
            np.zeros((12, 40), np.float16), outs[-1], 11, 0, 4, 2, 20, 0.25, 0, 12)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert "zmm" not in avx2.emit_assembly()  # really no AVX-512 in the AVX2 build


def test_object_code_loads_back(host, teams):
    obj = host.emit_object()
    assert obj[:4] == b"\x7fELF"
    assert "define void @picc_gemv_q4_0" in host.ir  # the optimised IR, stored beside the object
    loaded = CpuModule.from_object(obj)
    rng = np.random.default_rng(26)
    raw, _ = weights(rng, (37, 96), "q4_0")
    x = rng.normal(size=96).astype(np.float32)
    ys = []
    for module in (host, loaded):
        ys.append(np.zeros(37, np.float32))
        run(module, teams[2], gemv("q4_0"), raw, x, None, ys[-1], 37, 96, 0)
    np.testing.assert_array_equal(ys[0], ys[1])


def test_compiled_objects_are_cached_by_their_ir(tmp_path, monkeypatch, teams):
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir = build_ir([gemv("f32")], (), "avx2")
    first = compiler.compiled_object(ir, "avx2")
    assert first[1][:4] == b"\x7fELF" and "define void @picc_gemv_f32" in first[0]
    # A hit runs no LLVM: the same optimised IR and object come back from the cache, and run.
    real = compiler.CpuModule
    monkeypatch.setattr(compiler, "CpuModule", lambda *_, **__: pytest.fail("compiled again"))
    assert compiler.compiled_object(ir, "avx2") == first
    with monkeypatch.context() as m:  # a cache it cannot write to still serves its entries
        m.setattr(compiler.Path, "touch", lambda *_, **__: (_ for _ in ()).throw(PermissionError("read-only")))
        assert compiler.compiled_object(ir, "avx2") == first
    rng = np.random.default_rng(27)
    w, x = rng.normal(size=(5, 64)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    y = np.zeros(5, np.float32)
    run(real.from_object(first[1], "avx2"), teams[1], gemv("f32"), w, x, None, y, 5, 64, 0)
    np.testing.assert_allclose(y, w @ x, rtol=1e-5)
    # Another IR, or another SIMD level, is compiled; so is an entry whose object was damaged
    # (cut short: it would otherwise go into a .pib); the cache keeps the most recent entries.
    for other in ((ir + "\n", "avx2"), (ir, "avx512")):
        with pytest.raises(pytest.fail.Exception, match="compiled again"):
            compiler.compiled_object(*other)
    (obj_path,) = (tmp_path / "cpu-objects").glob("*.o")
    obj_path.write_bytes(first[1][:-100])
    with pytest.raises(pytest.fail.Exception, match="compiled again"):
        compiler.compiled_object(ir, "avx2")
    monkeypatch.setattr(compiler, "CpuModule", real)
    assert compiler.compiled_object(ir, "avx2") == first  # and the entry is whole again
    monkeypatch.setattr(compiler, "OBJECT_CACHE_ENTRIES", 1)
    compiler.compiled_object(build_ir([gemv("f16")], (), "avx2"), "avx2")
    assert [len(list((tmp_path / "cpu-objects").glob(f"*{s}"))) for s in (".ll", ".o", ".sha256")] == [1, 1, 1]


def test_the_fallback_ir_is_optimised_without_code_generation(tmp_path, monkeypatch):
    # A VNNI compile's AVX-512 fallback is carried as IR: the same optimised IR as a whole
    # compile's, no object code made for it (half of LLVM's time), and its cache entry apart from
    # the object's (a later compile that wants the object still gets one).
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir = build_ir([gemv("q4_1", x_format="i16")], (), "avx512")
    real = compiler.CpuModule

    class NoCodegen(real):
        def emit_object(self) -> bytes:
            raise AssertionError("generated object code")

    monkeypatch.setattr(compiler, "CpuModule", NoCodegen)
    optimised, obj = compiler.compiled_object(ir, "avx512", object_code=False)
    assert obj == b"" and "define void @picc_gemv_q4_1_xi16" in optimised
    monkeypatch.setattr(compiler, "CpuModule", lambda *_, **__: pytest.fail("compiled again"))
    assert compiler.compiled_object(ir, "avx512", object_code=False) == (optimised, b"")  # from the cache
    monkeypatch.setattr(compiler, "CpuModule", real)
    whole = compiler.compiled_object(ir, "avx512")
    assert whole[0] == optimised and whole[1][:4] == b"\x7fELF"


def test_bad_inputs_are_one_line_errors(host):
    with pytest.raises(PiccError, match="weight dtype 'q5_k' is not supported"):
        gemv("q5_k")
    with pytest.raises(PiccError, match="gate-first' needs a gated form"):
        sparse_ffn("gate-first", "relu", "f16", None, "f16")
    with pytest.raises(PiccError, match="picc_add takes 4 arguments"):
        Program("p").call(add(), Buf(0))
    with pytest.raises(PiccError, match="argument n must be an int or Param"):
        Program("p").call(add(), Buf(0), Buf(1), Buf(2), 1.5)
    with pytest.raises(PiccError, match="no function 'nope'"):
        host.address("nope")
    with pytest.raises(PiccError, match="simd 'neon' is not supported"):
        compile_kernels([add()], simd="neon")


def test_4bit_rows_need_the_sums_their_constant_parts_moved_to():
    """A kernel that dots or AXPYs q4_0 / q4_1 rows without x's block sums (or without the
    per-block constants array) would silently drop the rows' -8 / m terms: refused at IR time.
    So are AXPYs of block-format rows in GGUF's rows: the kernels read them as rowplanes."""
    fn = Fn("f", [("ptr", "row"), ("ptr", "x"), ("ptr", "y")])
    for dtype in ("q4_0", "q4_1"):
        with pytest.raises(PiccError, match=rf"dot products of \['{dtype}'\] rows need x's sums"):
            emit_dots(fn, [(dtype, "%row")], "%x", "64", "avx2")
        with pytest.raises(PiccError, match=f"{dtype} rows need per-block constants"):
            rowplanes.emit_axpys(fn, [(dtype, "%row", "1.0")], "%y", "64", ["%c"], None)
        with pytest.raises(PiccError, match="AXPYs of block-format rows read the rowplanes layout"):
            emit_axpys(fn, [(dtype, "%row", "1.0")], "%y", "64", "avx2")
    sums = emit_x_sums(fn, "%x", "64", {"q4_0"})
    assert sums is not None and sums.offsets and sums.folded is None
    with pytest.raises(PiccError, match="need x's sums"):  # q4_1 needs the folded sums too
        emit_dots(fn, [("q4_1", "%row")], "%x", "64", "avx2", xsums=sums)
    assert emit_x_sums(fn, "%x", "64", {"f16", "q8_0"}) is None


def test_native_thread_team_runs_steps_in_generated_code(monkeypatch):
    """A team whose workers loop in generated code (``picc_team_worker``): each step runs once on
    every thread with its tid, consecutive steps see each other's results (the barriers order
    them), Python jobs are refused, and closing ends the workers. Inside ``pinned()`` the caller
    keeps thread 0's core across steps (pinned once, not per step) and gets its affinity back."""
    from runtime import threads as runtime_threads
    from runtime.threads import ThreadTeam as RuntimeTeam

    assert runtime_threads._SYNC_BYTES == SYNC_BYTES  # the runtime imports nothing of picc: kept in step

    step_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
    prog = Program("count_step", sync=0)
    prog.call(add(), Buf(1), Buf(2), Buf(1), 64)  # acc += one, rows split across the threads
    module = compile_kernels([], [prog])
    native = (step_t(module.address("picc_team_worker")),
              ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(module.address("picc_team_barrier")))
    step = step_t(module.address("count_step"))
    acc, one = np.zeros(64, np.float32), np.ones(64, np.float32)
    table = buffer_table([aligned_zeros(SYNC_BYTES), acc, one])
    team = RuntimeTeam(2, native=native)
    try:
        for _ in range(50):
            team.run_step(step, ctypes.addressof(table))
        np.testing.assert_array_equal(acc, np.full(64, 50, np.float32))
        own = os.sched_getaffinity(0)
        pins: list[set[int]] = []
        set_affinity = os.sched_setaffinity
        monkeypatch.setattr(runtime_threads.os, "sched_setaffinity",
                            lambda pid, cores: pins.append(set(cores)) or set_affinity(pid, cores))
        with team.pinned():
            with team.pinned():  # nested: free
                for _ in range(10):
                    team.run_step(step, ctypes.addressof(table))
            inside = os.sched_getaffinity(0)
        np.testing.assert_array_equal(acc, np.full(64, 60, np.float32))
        assert os.sched_getaffinity(0) == own
        if team._cores is None:  # fewer cores than threads: nothing is pinned
            assert pins == [] and inside == own
        else:
            assert pins == [{team._cores[0]}, own] and inside == {team._cores[0]}
        with pytest.raises(RuntimeError, match="step functions only"):
            team.run_each(lambda tid: None)
    finally:
        team.close()
    assert not any(w.is_alive() for w in team._workers)


def _kernel_asm(kernels: list, simd: str) -> dict[str, str]:
    import llvmlite.binding as llvm

    from picc.codegen_cpu import build_ir, compiler

    optimised = llvm.parse_assembly(compiler.CpuModule(build_ir(kernels, (), simd), simd).ir)
    text = compiler.target_machine(simd).emit_assembly(optimised)
    return {k.symbol: text[text.index(f"{k.symbol}:") : text.index(".Lfunc_end", text.index(f"{k.symbol}:"))]
            for k in kernels}


def test_on_avx512_vnni_the_one_row_int16_gemv_does_not_use_vnni():
    """The ``avx512-vnni`` level gives VNNI to the kernels written for it (``by_level``: the batched
    rows8 ones, ``vpdpbusd``) and to no other: compiled with VNNI, LLVM turned the one-row int16
    kernels' ``vpmaddwd`` + add into ``vpdpwssd``, and the one-row step decoded slower for it.
    Their IR and their instructions are plain AVX-512's (compiled here whatever this host has)."""
    from picc.codegen_cpu import build_ir
    from picc.codegen_cpu.kernels_batch import gemv_rows

    kernel, batched = gemv("q4_1", x_format="i16"), gemv_rows("q4_1", "i16", rows8=True)
    assert build_ir([kernel], (), "avx512-vnni") == build_ir([kernel], (), "avx512")  # the same kernel IR
    asm = {simd: _kernel_asm([kernel, batched], simd) for simd in ("avx512", "avx512-vnni")}
    for simd in asm:
        assert "vpmaddwd" in asm[simd][kernel.symbol] and "vpdpwssd" not in asm[simd][kernel.symbol], simd
    assert "vpdpbusd" in asm["avx512-vnni"][batched.symbol] and "vpdpbusd" not in asm["avx512"][batched.symbol]


def test_on_avx512_vnni_the_int_x_sparse_ffn_sums_eight_rows_with_vpdpbusd():
    """The sparse FFN with rounded x is written for the level too: its eight-row dot products
    (the gathered rows, a dense rows8 part) sum with ``vpdpbusd`` there, the same integers
    (tests/test_codegen_cpu_batch.py checks the bits across levels). In-process A/B, 4096 x
    11008 q4_1, int16 x, three alternations, Zen 4: 1.02-1.04x at 10-50% active on one and two
    threads, though LLVM also turns some of its one-row ``vpmaddwd`` into ``vpdpwssd``."""
    from picc.codegen_cpu import build_ir
    from runtime.cpu import host_has

    kernel = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True, x_format="i16")
    floats = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True)
    assert kernel.by_level and not floats.by_level
    assert build_ir([floats], (), "avx512-vnni") == build_ir([floats], (), "avx512")
    asm = {simd: _kernel_asm([kernel], simd)[kernel.symbol] for simd in ("avx512", "avx512-vnni")}
    assert "vpdpbusd" in asm["avx512-vnni"] and "vpdpbusd" not in asm["avx512"]
    if not host_has("avx512-vnni"):
        pytest.skip("this host cannot run avx512-vnni code (compiled only)")
    case, active = FfnCase("swiglu", ("q4_1",) * 3, n=136, hidden=96, seed=34), np.random.default_rng(35).random(136) < 0.4
    with ThreadTeam(2) as team:  # 136 neurons: octets and a pair of leftovers on each thread
        outs = [case.run(compile_kernels([kernel], simd=simd), team, kernel, active=active, interleaved=True)
                for simd in ("avx512", "avx512-vnni")]
    assert outs[0][1] == outs[1][1] == active.sum()
    assert np.array_equal(outs[0][0].view(np.uint32), outs[1][0].view(np.uint32))
    # Rows one at a time from the dotplanes layout: vpdpbusd there too, the same bits (224: a
    # four-, a two- and a one-block piece a row).
    planes = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True, x_format="i16", gathered="dotplanes")
    asm = {simd: _kernel_asm([planes], simd)[planes.symbol] for simd in ("avx512", "avx512-vnni")}
    assert "vpdpbusd" in asm["avx512-vnni"] and "vpdpbusd" not in asm["avx512"]
    case = FfnCase("swiglu", ("q4_1",) * 3, n=136, hidden=224, seed=36)
    with ThreadTeam(2) as team:
        outs = [case.run(compile_kernels([planes], simd=simd), team, planes, active=active, interleaved=True,
                         planes=("up", "gate")) for simd in ("avx512", "avx512-vnni")]
    assert outs[0][1] == outs[1][1] == active.sum()
    assert np.array_equal(outs[0][0].view(np.uint32), outs[1][0].view(np.uint32))


def test_vnni_object_code_is_recompiled_where_the_host_lacks_vnni(monkeypatch, tmp_path):
    """A .pib's object code for ``avx512-vnni`` is loaded as it is only on a CPU with VNNI;
    elsewhere the runtime compiles the file's IR for the CPU it runs on (``MachineCode.rejit``)."""
    import runtime.cpu as rc
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir, obj = compiler.compiled_object(build_ir([gemv("q4_1", x_format="i16")], (), "avx512-vnni"), "avx512-vnni")
    have = rc.host_features()
    assert rc.MachineCode(obj, ir, "avx512-vnni").rejit == (not {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= have)
    monkeypatch.setattr(rc, "host_features", lambda: have - {"avx512vnni"})
    assert rc.MachineCode(obj, ir, "avx512-vnni").rejit


def test_a_buffer_table_keeps_its_arrays_alive():
    # A step writes through the table's pointers: an array made in buffer_table's argument list
    # (a barrier's state, say) must live as long as the table, or the step writes freed memory
    # (it corrupted the heap of picc.codegen_cpu.rates' measurement).
    import gc
    import weakref

    from picc.codegen_cpu import buffer_table

    array = np.zeros(64, np.uint8)
    alive = weakref.ref(array)
    table = buffer_table([array, None, 16])
    del array
    gc.collect()
    assert alive() is not None and table[0] == alive().ctypes.data
    del table
    gc.collect()
    assert alive() is None
