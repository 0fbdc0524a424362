"""The batched decode kernels (picc.codegen_cpu.kernels_batch) against the one-row kernels, bit for bit.

A server decoding B sequences in one step must give each the bits of the one-sequence step (a
greedy token, a sparse gate's decision on 1e-7), so every output row of a batched kernel is
compared with the one-row kernel's output for that row's x with ``np.array_equal`` on the float32
bits: on 1, 2 and 3 threads, batches of 1, 3 and 8, ``accumulate`` 0 and 1, with biases, and x
and y rows strided with padding between them (NaN in x's padding, which a row must not read; a
sentinel in y's, which it must not write). The rows8 int16-x kernels take x rows two to a
512-bit vector on AVX-512 (``rows8_pairs``, with ``vpdpbusd`` on avx512-vnni) and an odd batch's
last row alone: each level's build is checked with batches that end in pairs and single rows.
"""

from __future__ import annotations

import re
from dataclasses import fields

import numpy as np
import pytest
from cpu_kernels import run, weights

from picc import quant
from picc.codegen_cpu import aligned_zeros, build_ir, compile_kernels
from picc.codegen_cpu.compiler import CpuModule, effective_simd
from picc.codegen_cpu.kernels_attention import attention, attention_rows
from picc.codegen_cpu.kernels_batch import (
    _BLOCK_BYTES,
    BATCH_PARAMS,
    dense_ffn_rows,
    dense_ffn_rows_scratch_bytes,
    gemv_rows,
)
from picc.codegen_cpu.kernels_dense import dense_ffn, dense_ffn_scratch_bytes, gemv
from picc.codegen_cpu.rows8 import to_rows8
from runtime.cpu import host_has, vector_isa

THREADS = (1, 2, 3)
BATCHES = (1, 3, 8)
X_PAD, Y_PAD = 7, 5  # floats between rows: strides that are no multiple of a vector or a line
SENTINEL = np.float32(-12345.5)

# (dtype, x format, rows8, rows, k): rows8 q4_0 / q4_1 with each x; rows one at a time in tiles of
# consecutive rows with prefetches (q4_*, f32, long f16 / q8_0 rows) or in four ranges (short f16 /
# q8_0 rows); 37 rows: no multiple of 2, 3 or the tile; k = 100: a tail after the blocks.
GEMV_CASES = [("q4_0", "i16", True, 40, 128), ("q4_0", "f32", True, 40, 128), ("q4_1", "i16", True, 40, 128),
              ("q4_1", "f32", True, 40, 128), ("q8_0", "f32", False, 37, 96), ("q8_0", "f32", False, 23, 4096),
              ("f16", "f32", False, 37, 100), ("f16", "f32", False, 23, 2048), ("f32", "f32", False, 37, 100),
              ("q4_1", "f32", False, 37, 96), ("q4_1", "i16", False, 37, 96), ("q4_0", "i16", False, 37, 96),
              ("q4_0", "i8", True, 40, 128), ("q4_1", "i8", True, 40, 128), ("q8_0", "i8", True, 40, 128),
              ("mxfp4", "f32", False, 37, 96), ("mxfp4", "i16", False, 37, 96)]  # gpt-oss's format: rows
# (form, up / gate / down dtype, x format, rows8): SmolLM2's FFN (swiglu, q4_1, rows8, int16 x) and its
# neighbours; relu has no gate.
FFN_CASES = [("swiglu", "q4_1", "i16", True), ("relu", "q4_1", "i16", True), ("swiglu", "q4_0", "f32", True),
             ("swiglu", "q4_1", "f32", False), ("relu", "q4_1", "f32", False), ("swiglu", "q4_1", "i16", False),
             ("swiglu", "f32", "f32", False), ("swiglu", "q4_1", "i8", True), ("relu", "q4_0", "i8", True),
             ("swiglu", "q8_0", "i8", True), ("swiglu", "mxfp4", "i16", False)]
FFN_N, FFN_HIDDEN = 128, 96


def gemv_kernels(case: tuple) -> tuple:
    dtype, x_format, rows8, _, _ = case
    return gemv(dtype, x_format, rows8), gemv_rows(dtype, x_format, rows8)


def ffn_kernels(case: tuple) -> tuple:
    form, dtype, x_format, rows8 = case
    gate = None if form == "relu" else dtype
    return (dense_ffn(form, dtype, gate, dtype, x_format, rows8),
            dense_ffn_rows(form, dtype, gate, dtype, x_format, rows8))


ALL = ([k for case in GEMV_CASES for k in gemv_kernels(case)] + [k for case in FFN_CASES for k in ffn_kernels(case)]
       + [make(softcap=cap, sinks=sinks) for make in (attention, attention_rows) for cap in (False, True)
          for sinks in (False, True)] + [make("f16") for make in (attention, attention_rows)])


@pytest.fixture(scope="module")
def host():
    # The host's SIMD level, built as `picc compile` builds it (the level's target, not the host
    # CPU's own tuning): the build the other levels' bits are checked against.
    return compile_kernels(ALL, simd=effective_simd("host"))


def x_rows(rng: np.random.Generator, batch: int, k: int) -> np.ndarray:
    """``batch`` x rows of ``k`` floats, NaN padding after each; a third of the rows have a block
    of small values (its own int16 scale), a third an all-zero block. Most blocks stay ordinary,
    so that a row summed in another order or with another row's rounding gives other bits."""
    x = np.full((batch, k + X_PAD), np.nan, np.float32)
    x[:, :k] = rng.normal(size=(batch, k))
    if k >= 96:
        x[1::3, 32:64] *= 1e-3
        x[2::3, 64:96] = 0.0
    return x


def y_rows(rng: np.random.Generator, batch: int, rows: int, accumulate: int) -> np.ndarray:
    """Output rows: what ``accumulate`` adds to (random), or NaN to be overwritten; sentinel padding."""
    y = np.full((batch, rows + Y_PAD), SENTINEL, np.float32)
    y[:, :rows] = rng.normal(size=(batch, rows)) if accumulate else np.nan
    return y


def assert_rows_equal(batched: np.ndarray, single: np.ndarray, rows: int, what: str) -> None:
    """Every row's floats, bit for bit, and the padding untouched."""
    for b in range(single.shape[0]):
        assert np.array_equal(batched[b, :rows].view(np.uint32), single[b].view(np.uint32)), (what, b)
    assert np.all(batched[:, rows:] == SENTINEL), what


def run_gemv_rows(host, team, case, w, x, bias, y, accumulate) -> None:
    _, _, _, rows, k = case
    run(host, team, gemv_kernels(case)[1], w, x, bias, y, rows, k, accumulate, x.shape[0], x.strides[0], y.strides[0])


def gemv_weights(case: tuple, seed: int) -> np.ndarray:
    dtype, _, rows8, rows, k = case
    raw, _ = weights(np.random.default_rng(seed), (rows, k), dtype)
    return to_rows8(raw, dtype, (rows, k)) if rows8 else raw


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: f"{c[0]}{'_r8' * c[2]}_x{c[1]}_{c[3]}x{c[4]}")
def test_gemv_rows_are_the_one_row_gemvs_bits(host, teams, case, threads):
    _, _, _, rows, k = case
    single = gemv_kernels(case)[0]
    w = gemv_weights(case, 50)
    rng = np.random.default_rng(51)
    bias = rng.normal(size=rows).astype(np.float32)
    for batch in BATCHES:
        for accumulate in (0, 1):
            x, y = x_rows(rng, batch, k), y_rows(rng, batch, rows, accumulate)
            expected = np.empty((batch, rows), np.float32)
            for b in range(batch):
                yb = y[b, :rows].copy()
                run(host, teams[threads], single, w, np.ascontiguousarray(x[b, :k]), bias, yb, rows, k, accumulate)
                expected[b] = yb
            run_gemv_rows(host, teams[threads], case, w, x, bias, y, accumulate)
            assert_rows_equal(y, expected, rows, (batch, accumulate))
    # Without a bias (null): still each row's own bits.
    x, y = x_rows(rng, 3, k), y_rows(rng, 3, rows, 0)
    run_gemv_rows(host, teams[threads], case, w, x, None, y, 0)
    for b in range(3):
        yb = np.empty(rows, np.float32)
        run(host, teams[threads], single, w, np.ascontiguousarray(x[b, :k]), None, yb, rows, k, 0)
        assert np.array_equal(y[b, :rows].view(np.uint32), yb.view(np.uint32)), b


@pytest.mark.parametrize("case", [GEMV_CASES[2], GEMV_CASES[5], GEMV_CASES[10]], ids=lambda c: c[0])
def test_one_rows_x_changes_that_row_only(host, teams, case):
    # Each row's x is rounded (and summed) on its own: another x in row 5 leaves the other rows'
    # bits alone, while row 5's result moves.
    _, _, _, rows, k = case
    w = gemv_weights(case, 52)
    rng = np.random.default_rng(53)
    x = x_rows(rng, 8, k)
    y, y2 = y_rows(rng, 8, rows, 0), y_rows(rng, 8, rows, 0)
    run_gemv_rows(host, teams[3], case, w, x, None, y, 0)
    x[5, :k] = rng.normal(size=k) * 100
    run_gemv_rows(host, teams[3], case, w, x, None, y2, 0)
    others = [b for b in range(8) if b != 5]
    assert np.array_equal(y[others].view(np.uint32), y2[others].view(np.uint32))
    assert not np.array_equal(y[5], y2[5])


class Ffn:
    """Random dense FFN weights (the source layout, down [hidden, n]) in one format, and biases."""

    def __init__(self, case: tuple, seed: int) -> None:
        form, dtype, _, rows8 = case
        rng = np.random.default_rng(seed)
        n, hidden = FFN_N, FFN_HIDDEN
        up, _ = weights(rng, (n, hidden), dtype, hidden**-0.5)
        gate = None if form == "relu" else weights(rng, (n, hidden), dtype, hidden**-0.5)[0]
        down, _ = weights(rng, (hidden, n), dtype, n**-0.5)
        if rows8:
            up, down = to_rows8(up, dtype, (n, hidden)), to_rows8(down, dtype, (hidden, n))
            gate = None if gate is None else to_rows8(gate, dtype, (n, hidden))
        self.mats = (up, gate, down)
        self.biases = (rng.normal(0, 0.1, n).astype(np.float32), None if gate is None else
                       rng.normal(0, 0.1, n).astype(np.float32), rng.normal(0, 0.1, hidden).astype(np.float32))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("case", FFN_CASES, ids=lambda c: f"{c[0]}_{c[1]}{'_r8' * c[3]}_x{c[2]}")
def test_dense_ffn_rows_are_the_one_row_ffns_bits(host, teams, case, threads):
    single, batched = ffn_kernels(case)
    ffn = Ffn(case, 54)
    rng = np.random.default_rng(55)
    team = teams[threads]
    for batch in BATCHES:
        for accumulate in (0, 1):
            x, y = x_rows(rng, batch, FFN_HIDDEN), y_rows(rng, batch, FFN_HIDDEN, accumulate)
            expected = np.empty((batch, FFN_HIDDEN), np.float32)
            scratch = aligned_zeros(dense_ffn_scratch_bytes(FFN_N))
            for b in range(batch):
                yb = y[b, :FFN_HIDDEN].copy()
                run(host, team, single, np.ascontiguousarray(x[b, :FFN_HIDDEN]), *ffn.mats, *ffn.biases, yb, scratch,
                    FFN_N, FFN_HIDDEN, accumulate)
                expected[b] = yb
            scratch = aligned_zeros(dense_ffn_rows_scratch_bytes(FFN_N, batch))
            run(host, team, batched, x, *ffn.mats, *ffn.biases, y, scratch, FFN_N, FFN_HIDDEN, accumulate, batch,
                x.strides[0], y.strides[0])
            assert_rows_equal(y, expected, FFN_HIDDEN, (batch, accumulate))


def test_parameters_and_scratch():
    kernel = gemv_rows("q4_1", "i16", True)
    assert kernel.symbol == gemv("q4_1", "i16", True).symbol + "_rows" == "picc_gemv_q4_1_r8_xi16_rows"
    assert kernel.params == gemv("q4_1", "i16", True).params + BATCH_PARAMS
    assert [name for name, _ in BATCH_PARAMS] == ["batch", "x_stride", "y_stride"]
    ffn = dense_ffn_rows("swiglu", "q4_1", "q4_1", "q4_1", "i8", True)
    assert ffn.symbol == "picc_ffn_gemv_swiglu_q4_1_q4_1_q4_1_r8_xi8_rows"
    assert ffn.params == dense_ffn("swiglu", "q4_1", "q4_1", "q4_1", "i8", True).params + BATCH_PARAMS
    assert dense_ffn_rows_scratch_bytes(1536, 8) == 8 * dense_ffn_scratch_bytes(1536)
    for form, per_block in _BLOCK_BYTES.items():  # every array of each x form moves with the row
        arrays = {f.name for f in fields(form) if f.type in ("str", "str | None")}
        assert arrays == set(per_block), form


def test_no_fast_math_flags_in_the_batched_kernels():
    # LLVM may reassociate or contract only float operations that carry these flags; without
    # them a row's sum is computed in the IR's order, the one-row kernel's. (nnan is allowed on a
    # maximum, whose value does not depend on the order it is taken in: x's rounding scales.)
    flags = re.compile(r"\b(fast|reassoc|contract|ninf|nsz|arcp|afn)\b")
    for level in ("avx2", "avx512", "avx512-vnni"):
        for kernel in ALL:
            text = kernel.emit(level if kernel.by_level else vector_isa(level))
            assert "fadd" in text or "fma" in text
            assert not flags.search(text), (kernel.symbol, level, flags.search(text))
            for line in text.splitlines():
                assert " nnan " not in line or re.search(r"@llvm\.(maxnum|vector\.reduce\.fmax)\.", line), line


@pytest.mark.parametrize("simd", [level for level in ("avx2", "avx512", "avx512-vnni") if level != effective_simd("host")])
def test_other_simd_levels_compile_and_compute_the_same_bits(host, teams, simd):
    # Every other level's build is compiled to machine code (the host's own level is the `host`
    # fixture's build); a level this host can run must give the host level's bits (SmolLM2's
    # kernels: q4_1 rows8 int16 x, and the q8_0 head's rows).
    batched = [k for k in ALL if k.symbol.endswith("_rows")]
    module = CpuModule(build_ir(batched, (), simd), simd)
    asm = module.emit_assembly()
    for kernel in batched:
        assert f"{kernel.symbol}:" in asm, kernel.symbol
    if simd == "avx2":
        assert "zmm" not in asm
    if not host_has(simd):
        pytest.skip(f"this host cannot run {simd} code (compiled only)")
    rng = np.random.default_rng(56)
    for case in (GEMV_CASES[2], GEMV_CASES[5]):
        w, (_, _, _, rows, k) = gemv_weights(case, 57), case
        x = x_rows(rng, 3, k)
        ys = [y_rows(rng, 3, rows, 0), y_rows(rng, 3, rows, 0)]
        for mod, y in zip((host, module), ys, strict=True):
            run(mod, teams[2], gemv_kernels(case)[1], w, x, None, y, rows, k, 0, 3, x.strides[0], y.strides[0])
        assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32)), case
    ffn_case = FFN_CASES[0]
    ffn, x = Ffn(ffn_case, 58), x_rows(rng, 3, FFN_HIDDEN)
    ys = [y_rows(rng, 3, FFN_HIDDEN, 0), y_rows(rng, 3, FFN_HIDDEN, 0)]
    for mod, y in zip((host, module), ys, strict=True):
        scratch = aligned_zeros(dense_ffn_rows_scratch_bytes(FFN_N, 3))
        run(mod, teams[2], ffn_kernels(ffn_case)[1], x, *ffn.mats, *ffn.biases, y, scratch, FFN_N, FFN_HIDDEN, 0, 3,
            x.strides[0], y.strides[0])
    assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))


@pytest.mark.parametrize("case", [GEMV_CASES[2], GEMV_CASES[13], GEMV_CASES[14]], ids=lambda c: f"{c[0]}_x{c[1]}")
def test_rounded_rows_are_rounded_each_on_its_own(host, teams, case):
    # The int16 / int8 kernels' rows are the float kernel on each row rounded by its own block
    # scales (picc.quant.round_x_blocks, the interpreter's rounding), not on a shared rounding:
    # rows of very different size each keep their precision.
    dtype, x_format, _, rows, k = case
    raw, w = weights(np.random.default_rng(59), (rows, k), dtype)
    x = x_rows(np.random.default_rng(60), 3, k)
    x[1, :k] *= 1e-4
    y = y_rows(np.random.default_rng(61), 3, rows, 0)
    run_gemv_rows(host, teams[2], case, to_rows8(raw, dtype, (rows, k)), x, None, y, 0)
    for b in range(3):
        ref = w.astype(np.float64) @ quant.round_x_blocks(x[b, :k], x_format).astype(np.float64)
        assert np.max(np.abs(y[b, :rows] - ref)) <= 2e-6 * np.max(np.abs(ref)), b


# x rows in pairs (rows8_pairs): the rows8 int16-x batched kernels, compiled for each level.
LEVELS = ("avx2", "avx512", "avx512-vnni")
PAIR_BATCHES = (2, 5, 7, 11, 16)  # tiles of 8 (4 for up and gate), 4 and 2 rows, and a last row alone
PAIR_GEMVS = [c for c in GEMV_CASES if c[1] != "f32" and c[2]]
PAIR_FFNS = [c for c in FFN_CASES if c[2] != "f32" and c[3]]


@pytest.fixture(scope="module")
def by_level():
    kernels = [gemv_kernels(c)[1] for c in PAIR_GEMVS] + [ffn_kernels(c)[1] for c in PAIR_FFNS]
    return {level: CpuModule(build_ir(kernels, (), level), level) for level in LEVELS}


def test_only_the_rows8_int_x_kernels_differ_between_the_avx512_levels():
    # Kernels are written for a vector ISA; only those that say so (by_level) see VNNI, so every
    # other kernel's IR is the same on both AVX-512 levels: the batched rows8 int-x ones, and the
    # q8_0 rows8 GEMV one row at a time too (its int8 sums are vpdpbusd's work in either).
    varying = r"_r8_xi(16|8)_rows$|_q8_0_r8_xi8$"
    assert {k.symbol for k in ALL if k.by_level} == {k.symbol for k in ALL if re.search(varying, k.symbol)}
    for kernel in ALL:
        same = build_ir([kernel], (), "avx512") == build_ir([kernel], (), "avx512-vnni")
        assert same != kernel.by_level, kernel.symbol


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_sums_pairs_with_its_instructions(by_level, level):
    # What the bit tests below run: 512-bit vpmaddubsw on avx512, vpdpbusd on avx512-vnni, and on
    # AVX2 the 256-bit code of rows one at a time.
    asm = by_level[level].emit_assembly()
    found = (bool(re.search(r"vpmaddubsw\s+%zmm", asm)), "vpdpbusd" in asm, "zmm" in asm)
    assert found == {"avx2": (False, False, False), "avx512": (True, False, True),
                     "avx512-vnni": (False, True, True)}[level]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("level", LEVELS)
def test_pairs_of_x_rows_keep_each_rows_bits(host, by_level, teams, level, threads):
    if not host_has(level):
        pytest.skip(f"this host cannot run {level} code (compiled only)")
    module, team, rng = by_level[level], teams[threads], np.random.default_rng(62)
    for case in PAIR_GEMVS:
        (_, _, _, rows, k), (single, batched) = case, gemv_kernels(case)
        w, bias = gemv_weights(case, 63), rng.normal(size=rows).astype(np.float32)
        for batch in PAIR_BATCHES:
            accumulate = batch % 2
            x, y = x_rows(rng, batch, k), y_rows(rng, batch, rows, accumulate)
            expected = y[:, :rows].copy()
            for b in range(batch):
                run(host, team, single, w, np.ascontiguousarray(x[b, :k]), bias, expected[b], rows, k, accumulate)
            run(module, team, batched, w, x, bias, y, rows, k, accumulate, batch, x.strides[0], y.strides[0])
            assert_rows_equal(y, expected, rows, (case, batch))
    for case in PAIR_FFNS:
        (single, batched), ffn = ffn_kernels(case), Ffn(case, 64)
        for batch in PAIR_BATCHES:
            accumulate = batch % 2
            x, y = x_rows(rng, batch, FFN_HIDDEN), y_rows(rng, batch, FFN_HIDDEN, accumulate)
            expected = y[:, :FFN_HIDDEN].copy()
            scratch = aligned_zeros(dense_ffn_scratch_bytes(FFN_N))
            for b in range(batch):
                run(host, team, single, np.ascontiguousarray(x[b, :FFN_HIDDEN]), *ffn.mats, *ffn.biases, expected[b],
                    scratch, FFN_N, FFN_HIDDEN, accumulate)
            scratch = aligned_zeros(dense_ffn_rows_scratch_bytes(FFN_N, batch))
            run(module, team, batched, x, *ffn.mats, *ffn.biases, y, scratch, FFN_N, FFN_HIDDEN, accumulate, batch,
                x.strides[0], y.strides[0])
            assert_rows_equal(y, expected, FFN_HIDDEN, (case, batch))


# ------------------------------------------------------------------ attention of a batch's rows

ATTN_HEADS, ATTN_KV, ATTN_CTX = 6, 2, 16
ATTN_COLUMNS = 3  # pointers per row of the KV table: the layer's in column 1, others between rows


@pytest.mark.parametrize("threads", THREADS)
# a tail; the wide V pass + 16 + a tail; Gemma 2's soft-capped scores; gpt-oss's sinks, alone and with
# both; values narrower than keys (DeepSeek's MLA, v_head_dim: the wide V pass + a tail, 16 + a tail),
# in f32 and f16 caches
@pytest.mark.parametrize(("hd", "vd", "window", "cap", "sinks", "kv"),
                         [(20, 20, 0, None, False, "f32"), (84, 84, 3, None, False, "f32"),
                          (64, 64, 0, None, False, "f32"), (84, 84, 3, 0.7, False, "f32"),
                          (20, 20, 0, None, True, "f32"), (84, 84, 3, 0.7, True, "f32"),
                          (84, 68, 3, None, False, "f32"), (40, 20, 0, None, False, "f16")])
def test_attention_rows_are_the_one_row_attentions_bits(host, teams, threads, hd, vd, window, cap, sinks, kv):
    # Each row at its own position (0, mid-cache, the last) with its own caches, reached through a
    # table of pointers: its output is picc_attention's for that row alone, bit for bit, its k and v
    # land in its own caches at its position (the v planes after the k planes, rows of vd), and
    # nothing else is written.
    rng, team = np.random.default_rng(71), teams[threads]
    width, v_width, n, v_n = ATTN_KV * hd, ATTN_KV * vd, ATTN_HEADS * hd, ATTN_HEADS * vd
    # The sinks from below the scores to above them (the maximum then the sink's), one per query head.
    extra = ([cap] if cap is not None else []) + ([np.linspace(-2.0, 3.0, ATTN_HEADS, dtype=np.float32)] if sinks else [])
    variant = dict(kv=kv, softcap=cap is not None, sinks=sinks)
    q_at, k_at, v_at, out_at = 0, n + X_PAD, n + width + 2 * X_PAD, n + width + v_width + 3 * X_PAD
    stride = n + width + v_width + v_n + 4 * X_PAD  # floats a row: q, k, v and out with padding after each
    k_end, dtype = ATTN_CTX * width, np.float16 if kv == "f16" else np.float32  # where a row's v planes start
    for batch in BATCHES:
        positions = np.array([(0, ATTN_CTX - 1, 7)[b % 3] for b in range(batch)], np.int32)
        positions[3::4] = rng.integers(0, ATTN_CTX, size=len(positions[3::4]))
        rows = np.full((batch, stride), np.nan, np.float32)
        for at, floats in ((q_at, n), (k_at, width), (v_at, v_width)):
            rows[:, at : at + floats] = rng.normal(size=(batch, floats))
        caches = [rng.normal(size=ATTN_CTX * (width + v_width)).astype(dtype) for _ in range(batch)]
        expected_caches, expected = [c.copy() for c in caches], np.empty((batch, v_n), np.float32)
        for b in range(batch):
            run(host, team, attention(**variant), np.ascontiguousarray(rows[b, q_at : q_at + n]),
                np.ascontiguousarray(rows[b, k_at : k_at + width]), np.ascontiguousarray(rows[b, v_at : v_at + v_width]),
                expected_caches[b][:k_end], expected_caches[b][k_end:], expected[b], 1, int(positions[b]), ATTN_HEADS,
                ATTN_KV, hd, vd, hd**-0.5, window, ATTN_CTX, *extra)
        table = np.zeros((batch, ATTN_COLUMNS), np.uint64)
        table[:, 1] = [c.ctypes.data for c in caches]
        out = rows.copy()
        base = out.ctypes.data
        run(host, team, attention_rows(**variant), base + 4 * q_at, base + 4 * k_at, base + 4 * v_at,
            table.ctypes.data + 8, base + 4 * out_at, batch, positions, ATTN_HEADS, ATTN_KV, hd, vd, hd**-0.5, window,
            ATTN_CTX, out.strides[0], table.strides[0], *extra)
        for b in range(batch):
            got = out[b, out_at : out_at + v_n]
            assert np.array_equal(got.view(np.uint32), expected[b].view(np.uint32)), (batch, b)
            assert np.array_equal(caches[b], expected_caches[b]), (batch, b)
        rest = np.ones(stride, bool)
        rest[out_at : out_at + v_n] = False
        assert np.array_equal(out[:, rest], rows[:, rest], equal_nan=True)
