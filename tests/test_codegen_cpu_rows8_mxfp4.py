"""gpt-oss's mxfp4 matrices in the rows8 layout: the layout's bytes, the GEMV and the mixture's
kernels eight rows at a time with rounded x, on each SIMD level this host runs (the others
compiled), against the float64 product of the decoded weights and x rounded as the kernels
round it; the prefill GEMM's rows read back as the row layout's floats."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_kernels import rel_err, run, weights
from test_codegen_cpu_moe import HIDDEN, OAI, E, Experts, N

from picc import quant
from picc.codegen_cpu import build_ir
from picc.codegen_cpu.compiler import CpuModule
from picc.codegen_cpu.kernels_batch import gemv_rows
from picc.codegen_cpu.kernels_dense import gemm, gemv
from picc.codegen_cpu.kernels_moe import moe, moe_chunk, moe_chunk_scratch_bytes
from picc.codegen_cpu.rows8 import MXFP4_OFFSET, MXFP4_UNSIGNED, from_rows8, to_rows8
from picc.errors import PiccError
from runtime.cpu import host_has

LEVELS = ("avx2", "avx512", "avx512-vnni")
GEMVS = [gemv("mxfp4", x, True) for x in ("i16", "i8")]
MOES = [make("swiglu", "f32", "mxfp4", "mxfp4", "mxfp4", "i16", True, *extra)
        for make in (moe, moe_chunk) for extra in ((), (OAI,))]
BATCHED = [gemv_rows("mxfp4", x, True) for x in ("i16", "i8")]
KERNELS = [*GEMVS, *BATCHED, gemm("mxfp4"), gemm("mxfp4", True), *MOES]


@pytest.fixture(scope="module")
def by_level():
    return {level: CpuModule(build_ir(KERNELS, (), level), level) for level in LEVELS}


def _runnable(level: str) -> None:
    if not host_has(level):
        pytest.skip(f"this host cannot run {level} code (compiled only)")


def test_the_layout_holds_eight_exponents_then_the_nibble_chunks():
    rng = np.random.default_rng(50)
    rows, k = 24, 96
    raw, _ = weights(rng, (rows, k), "mxfp4")
    stored = to_rows8(raw, "mxfp4", (rows, k))
    assert stored.nbytes == raw.nbytes
    np.testing.assert_array_equal(from_rows8(stored, "mxfp4", (rows, k)), raw.reshape(rows, -1).view(np.uint8))
    # Group 1, block 2: the eight rows' e bytes, then chunk c's byte 4r + e = element 4c + e of
    # row r (low nibble) and element 16 + 4c + e (high nibble), as q4_0's.
    blocks = raw.reshape(rows, k // 32, 17).view(np.uint8)
    group_block = stored.reshape(rows // 8, k // 32, 136)[1, 2]
    mine = blocks[8:16, 2]
    np.testing.assert_array_equal(group_block[:8], mine[:, 0])
    q = np.concatenate([mine[:, 1:] & 15, mine[:, 1:] >> 4], axis=1)
    chunks = group_block[8:].reshape(4, 8, 4)
    for c in range(4):
        np.testing.assert_array_equal(chunks[c] & 15, q[:, 4 * c : 4 * c + 4])
        np.testing.assert_array_equal(chunks[c] >> 4, q[:, 16 + 4 * c : 20 + 4 * c])
    assert [v - MXFP4_OFFSET for v in MXFP4_UNSIGNED] == list(quant.MXFP4_VALUES)
    with pytest.raises(PiccError, match="rows8"):
        gemv("mxfp4", "f32", True)  # float x reads mxfp4 in rows alone


def _mxfp4_matrix(rng: np.random.Generator, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random mxfp4 blocks, exponents around 127; the first group's exponents 0 and 1 (the
    denormal scales); row 10's block 1 every nibble, row 11's all 12s (the largest integer sums)."""
    raw, _ = weights(rng, (rows, k), "mxfp4")
    blocks = raw.reshape(rows, k // 32, 17).view(np.uint8)
    blocks[..., 0] = rng.integers(110, 140, size=blocks.shape[:2])
    blocks[:8, :, 0] = rng.integers(0, 2, size=(8, k // 32))
    blocks[10, 1, 1:] = np.arange(16, dtype=np.uint8) * 17
    blocks[11, 1, 1:] = 0x66  # value 12 in both nibbles
    return raw, quant.dequantize(raw.reshape(-1), "mxfp4", (rows, k))


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("level", LEVELS)
def test_rows8_mxfp4_gemv_is_the_float_product_on_rounded_x(by_level, teams, level, threads):
    # 2e-6 of the output's norm: float sums in another order than float64's; the integer sums are
    # exact (their int16 runs cannot overflow: row 11's block 1 of 12s meets x at int16's top,
    # every element positive). x ~1e30 keeps the first group's scales times x's (2^-128 x 1e26)
    # normal floats, so those rows are checked on their own.
    _runnable(level)
    rng = np.random.default_rng(51)
    rows, k = 40, 256
    raw, w = _mxfp4_matrix(rng, rows, k)
    x = rng.normal(size=k).astype(np.float32) * np.float32(1e30)
    x[32:64] = 1e30  # every element the block's top: the largest sums
    x[64:96] = 0.0
    stored = to_rows8(raw, "mxfp4", (rows, k))
    for kernel, x_format in zip(GEMVS, ("i16", "i8"), strict=True):
        exact = w.astype(np.float64) @ quant.round_x_blocks(x, x_format).astype(np.float64)
        y = np.zeros(rows, np.float32)
        run(by_level[level], teams[threads], kernel, stored, x, None, y, rows, k, 0)
        assert rel_err(y[8:], exact[8:]) <= 2e-6, x_format
        assert rel_err(y[:8], exact[:8]) <= 2e-6, x_format


@pytest.mark.parametrize("level", LEVELS)
def test_batched_rows8_mxfp4_gemv_rows_are_the_one_row_gemvs_bits(by_level, teams, level):
    # x rows two to a 512-bit vector on AVX-512 (rows8_pairs), one to a 256-bit one on AVX2, an
    # odd batch's last alone: every row the one-row kernel's bits.
    _runnable(level)
    rng = np.random.default_rng(55)
    rows, k, batch = 24, 128, 5
    raw, _ = _mxfp4_matrix(rng, rows, k)
    stored = to_rows8(raw, "mxfp4", (rows, k))
    x = rng.normal(size=(batch, k)).astype(np.float32)
    bias = rng.normal(size=rows).astype(np.float32)
    for one, many in zip(GEMVS, BATCHED, strict=True):
        y = np.zeros((batch, rows), np.float32)
        run(by_level[level], teams[2], many, stored, x, bias, y, rows, k, 0, batch, x.strides[0], y.strides[0])
        for b in range(batch):
            single = np.zeros(rows, np.float32)
            run(by_level[level], teams[2], one, stored, np.ascontiguousarray(x[b]), bias, single, rows, k, 0)
            assert np.array_equal(y[b].view(np.uint32), single.view(np.uint32)), (many.symbol, b)


@pytest.mark.parametrize("level", LEVELS)
def test_rows8_mxfp4_gemm_reads_the_rows_floats(by_level, teams, level):
    _runnable(level)
    rng = np.random.default_rng(52)
    seq, rows, k = 6, 24, 96
    raw, _ = _mxfp4_matrix(rng, rows, k)
    x, bias = rng.normal(size=(seq, k)).astype(np.float32), rng.normal(size=rows).astype(np.float32)
    y, y8 = np.zeros((seq, rows), np.float32), np.zeros((seq, rows), np.float32)
    run(by_level[level], teams[3], gemm("mxfp4"), raw, x, bias, y, seq, rows, k, 0)
    run(by_level[level], teams[3], gemm("mxfp4", True), to_rows8(raw, "mxfp4", (rows, k)), x, bias, y8, seq, rows,
        k, 0)
    np.testing.assert_array_equal(y8, y)


@pytest.mark.parametrize("oai", (False, True))
@pytest.mark.parametrize("level", LEVELS)
def test_rows8_mxfp4_mixture_is_the_interpreters_and_a_chunk_each_tokens(by_level, teams, level, oai):
    # The experts in the rows8 layout (gpt-oss's, with and without its biases and clamped SwiGLU):
    # the float64 reference with x and h rounded to int16 at 1e-5 of the output's largest element,
    # the rows kernel's tolerance; a chunk of tokens gets the one-token kernel's bits for each.
    _runnable(level)
    module, team = by_level[level], teams[2]
    experts, rng = Experts("swiglu", "mxfp4", 53, "i16", True, oai=oai), np.random.default_rng(54)
    assert experts.kernel.symbol.endswith("_r8_xi16" + ("_brugd_clamped" if oai else ""))
    for k, norm in ((4, True), (1, False), (E, True)):
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(module, team, x, k, norm), experts.reference(x, k, norm)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (k, norm)
    seq, k = 5, 4
    x = rng.normal(size=(seq, HIDDEN)).astype(np.float32)
    y = np.full((seq, HIDDEN), np.nan, np.float32)
    scratch = np.zeros(moe_chunk_scratch_bytes(E, k, N, HIDDEN, seq) // 4, np.float32)
    run(module, team, experts.chunk, x, experts.router, experts.up_raw, experts.gate_raw, experts.down_raw, y,
        scratch, E, k, N, HIDDEN, 1, *experts.extras, seq, x.strides[0], y.strides[0])
    want = np.stack([experts.run(module, team, row, k, True) for row in x])
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
