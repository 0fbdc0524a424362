"""The prefill program's pieces: the chunk FFN kernel against numpy, and per-token calls.

``chunk_ffn`` must give each token of a chunk what the decode kernel gives it alone: the FFN over
that token's own active set. References are float64 numpy on the same dequantised weights, with
the tolerances of ``cpu_kernels`` (1e-5 for f32 weights, 1e-4 for the others; see
there why). Thresholds sit in gaps between the scores of all tokens (``gap_threshold``), so
rounding cannot move a decision.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_kernels import QUANT_TOL, act64, gap_threshold, rel_err, run, tol, weights

from picc import quant
from picc.codegen_cpu import (
    SYNC_BYTES,
    Buf,
    Param,
    Program,
    aligned_zeros,
    buffer_table,
    build_ir,
    compile_kernels,
    rowplanes,
)
from picc.codegen_cpu.compiler import CpuModule
from picc.codegen_cpu.kernels_ffn import FORMS, ffn_scratch_bytes, predictor, predictor_scratch_bytes, sparse_ffn
from picc.codegen_cpu.kernels_prefill import chunk_ffn, chunk_ffn_scratch_bytes
from picc.codegen_cpu.rows8 import to_rows8
from runtime.cpu import host_has

DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
THREADS = (1, 2, 3)
CASES = ([("predictor", "swiglu", d, il) for d in DTYPES for il in (False, True)]
         + [(m, "swiglu", d, False) for m in ("dense", "gate-first", "down-only") for d in ("f16", "q4_0")]
         + [("predictor", "relu", "q8_0", False), ("down-only", "relu", "f32", False),
            ("gate-first", "drelu", "f32", False), ("down-only", "geglu", "f16", True), ("predictor", "reglu", "q4_1", True)])


MXFP4_CASES = (("predictor", False), ("predictor", True), ("gate-first", False))


def _kernels():
    ks = [chunk_ffn(m, f, d, d if FORMS[f].gated else None, d, il) for m, f, d, il in CASES]
    ks += [chunk_ffn(m, "swiglu", d, d, d, dense_rows8=r8) for d in ("q4_0", "q4_1") for r8 in (False, True)
           for m in ("gate-first", "down-only")]
    ks += [chunk_ffn(m, "swiglu", "mxfp4", "mxfp4", "q8_0", il) for m, il in MXFP4_CASES]
    return ks + [predictor("f32", "f32")]


@pytest.fixture(scope="module")
def host():
    return compile_kernels(_kernels(), simd="host")


class ChunkCase:
    """An FFN of one form, ``seq`` token rows of x, and the float64 reference per token."""

    def __init__(self, form: str, dtype: str, seq: int, n: int = 67, biases: bool = True, seed: int = 0,
                 hidden: int | None = None, down_dtype: str | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.spec, self.n, self.seq = FORMS[form], n, seq
        self.hidden = h = hidden or (96 if dtype in quant.BLOCK_SIZE else 100)
        down_dtype = down_dtype or dtype
        self.x = rng.normal(size=(seq, h)).astype(np.float32)
        self.up_raw, self.up = weights(rng, (n, h), dtype, h**-0.5)
        self.gate_raw, self.gate = weights(rng, (n, h), dtype, h**-0.5) if self.spec.gated else (None, None)
        self.down_raw, self.down = weights(rng, (n, h), down_dtype, n**-0.5)
        # A block-format down_t is in the rowplanes layout, as the decode kernel reads it.
        self.down_t = (rowplanes.to_rowplanes(self.down_raw, down_dtype, (n, h)) if down_dtype in rowplanes.DTYPES
                       else self.down_raw)
        rand = (lambda size: rng.normal(0, 0.1, size=size).astype(np.float32)) if biases else (lambda size: None)
        self.up_bias = rand(n)
        self.gate_bias = rand(n) if self.spec.gated else None
        self.down_bias = rand(h)

    def act_gate(self) -> np.ndarray:
        return act64(self.spec.act, self.x.astype(np.float64) @ self.gate.T.astype(np.float64) + _or0(self.gate_bias))

    def h(self) -> np.ndarray:
        u = self.x.astype(np.float64) @ self.up.T.astype(np.float64) + _or0(self.up_bias)
        if not self.spec.gated:
            return act64(self.spec.act, u)
        return self.act_gate() * (act64(self.spec.act, u) if self.spec.act_on_up else u)

    def reference(self, active: np.ndarray) -> np.ndarray:
        return np.where(active, self.h(), 0) @ self.down.astype(np.float64) + _or0(self.down_bias)

    def run(self, module, team, kernel, *, mask=None, threshold=0.0, score_scale=None, interleaved=False,
            stride=None):
        y = np.full((self.seq, self.hidden), np.nan, np.float32)
        stride = stride or self.n
        masks = np.zeros((self.seq, stride), np.uint8)
        if mask is not None:
            masks[:, : self.n] = mask
        scratch = aligned_zeros(chunk_ffn_scratch_bytes(self.seq, self.n))
        up, gate, up_bias, gate_bias = self.up_raw, self.gate_raw, self.up_bias, self.gate_bias
        if interleaved:
            both = np.ascontiguousarray(np.stack([self.up_raw.reshape(self.n, -1), self.gate_raw.reshape(self.n, -1)], 1))
            up, gate = both, both.reshape(-1)[both.shape[2]:]
            if up_bias is not None:
                biases = np.ascontiguousarray(np.stack([self.up_bias, self.gate_bias], 1))
                up_bias, gate_bias = biases, biases.reshape(-1)[1:]
        run(module, team, kernel, self.x, up, gate, self.down_t, up_bias, gate_bias, self.down_bias, y, masks,
            scratch, self.seq, stride, self.n, self.hidden, threshold, score_scale)
        return y


def _or0(bias):
    return 0 if bias is None else bias


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("mode, form, dtype, interleaved", CASES)
def test_chunk_ffn_gives_each_token_its_own_active_set(host, teams, mode, form, dtype, interleaved, threads):
    # 7 tokens: one tile of four, then three alone.
    case = ChunkCase(form, dtype, seq=7, seed=CASES.index((mode, form, dtype, interleaved)))
    kernel = chunk_ffn(mode, form, dtype, dtype if case.spec.gated else None, dtype, interleaved)
    rng = np.random.default_rng(1)
    if mode == "predictor":
        for density in (0.0, 0.05, 0.4, 1.0):
            active = rng.random((case.seq, case.n)) < density
            active[3] = False  # a token with nothing active: y = its bias alone
            y = case.run(host, teams[threads], kernel, mask=active, interleaved=interleaved, stride=case.n + 13)
            assert rel_err(y, case.reference(active)) <= tol(dtype), density
            np.testing.assert_array_equal(y[3], case.down_bias)
        return
    if mode == "dense":
        y = case.run(host, teams[threads], kernel, interleaved=interleaved)
        assert rel_err(y, case.reference(np.ones((case.seq, case.n), bool))) <= tol(dtype)
        return
    # gate-first decides on act(gate); down-only, and dReLU in gate-first mode, on |h|.
    scores = case.act_gate() if mode == "gate-first" and not case.spec.act_on_up else case.h()
    for keep in (0.1, 0.5):
        thr = gap_threshold(scores.ravel(), keep)
        y = case.run(host, teams[threads], kernel, threshold=thr, interleaved=interleaved)
        assert rel_err(y, case.reference(np.abs(scores) > thr)) <= tol(dtype), keep


@pytest.mark.parametrize("mode, interleaved", MXFP4_CASES)
def test_chunk_ffn_reads_mxfp4_up_and_gate_rows(host, teams, mode, interleaved):
    # gpt-oss's mxfp4 rows, dequantised once a chunk (a table value times a power of two, exact);
    # the down rows q8_0 (neuron-major-down makes an mxfp4 down so).
    case = ChunkCase("swiglu", "mxfp4", seq=7, seed=50, down_dtype="q8_0")
    kernel = chunk_ffn(mode, "swiglu", "mxfp4", "mxfp4", "q8_0", interleaved)
    if mode == "predictor":
        active = np.random.default_rng(51).random((case.seq, case.n)) < 0.4
        y = case.run(host, teams[2], kernel, mask=active, interleaved=interleaved)
    else:
        thr = gap_threshold(case.act_gate().ravel(), 0.4)
        active = np.abs(case.act_gate()) > thr
        y = case.run(host, teams[2], kernel, threshold=thr)
    assert rel_err(y, case.reference(active)) <= 1e-5


@pytest.mark.parametrize("hidden", [32, 64, 128, 160, 192, 224, 288])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_chunk_ffn_reads_down_rows_of_every_length(host, teams, dtype, hidden):
    # A rowplanes down row's 4-bit quants come in units of four blocks, then one of two and one
    # of one: 1 to 9 blocks cover every mix (a one-block unit after a two-block one included).
    case = ChunkCase("swiglu", dtype, seq=5, n=40, hidden=hidden, seed=hidden)
    kernel = chunk_ffn("predictor", "swiglu", dtype, dtype, dtype, False)
    active = np.random.default_rng(hidden).random((case.seq, case.n)) < 0.5
    y = case.run(host, teams[2], kernel, mask=active)
    assert rel_err(y, case.reference(active)) <= tol(dtype)


@pytest.mark.parametrize("form, dtype", [("swiglu", "f16"), ("drelu", "f32")])
def test_chunk_ffn_gate_first_decides_on_the_scaled_score(host, teams, form, dtype):
    # Each token's |act(g)| (dReLU: |h|) times the neuron's score_scale against the threshold,
    # as the decode kernel decides.
    case = ChunkCase(form, dtype, seq=6, seed=9)
    scale = np.exp(np.random.default_rng(2).uniform(np.log(0.05), np.log(20), case.n)).astype(np.float32)
    raw = case.act_gate() if form == "swiglu" else case.h()
    scores = np.abs(raw) * scale
    thr = gap_threshold(scores.ravel(), 0.4)
    assert ((scores > thr) != (np.abs(raw) > thr)).sum() >= 3  # the scale matters here
    y = case.run(host, teams[3], chunk_ffn("gate-first", form, dtype, dtype, dtype), threshold=thr,
                 score_scale=scale)
    assert rel_err(y, case.reference(scores > thr)) <= tol(dtype)


@pytest.mark.parametrize("mode", ["gate-first", "down-only"])
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_chunk_ffn_reads_rows8_matrices_as_their_rows(host, teams, dtype, mode):
    # The matrices a gate-first (gate) or down-only (gate, up) decode kernel reads eight rows at a
    # time (rows8 layout): the prefill dequantises each row to the floats of the row layout, the
    # same bits.
    case = ChunkCase("swiglu", dtype, seq=6, n=64, seed=5)
    scores = case.act_gate() if mode == "gate-first" else case.h()
    thr = gap_threshold(scores.ravel(), 0.4)
    rows = case.run(host, teams[3], chunk_ffn(mode, "swiglu", dtype, dtype, dtype), threshold=thr)
    case.gate_raw = to_rows8(case.gate_raw, dtype, (case.n, case.hidden))
    if mode == "down-only":
        case.up_raw = to_rows8(case.up_raw, dtype, (case.n, case.hidden))
    kernel = chunk_ffn(mode, "swiglu", dtype, dtype, dtype, dense_rows8=True)
    np.testing.assert_array_equal(case.run(host, teams[3], kernel, threshold=thr), rows)
    assert rel_err(rows, case.reference(np.abs(scores) > thr)) <= tol(dtype)


# The rows8 matrices dotted with rounded x: (mode, dtype, x format), built for each SIMD level.
LEVELS = ("avx2", "avx512", "avx512-vnni")
ROUNDED_CASES = [("down-only", "q4_1", "i16"), ("down-only", "q4_0", "i8"), ("gate-first", "q4_0", "i16"),
                 ("gate-first", "q4_1", "i8")]


def _rounded_pair(mode: str, dtype: str, x_format: str) -> tuple:
    """(the decode kernel, its prefill twin) of a rows8 SwiGLU FFN with x rounded to ``x_format``."""
    return (sparse_ffn(mode, "swiglu", dtype, dtype, dtype, False, x_format, dense_rows8=True),
            chunk_ffn(mode, "swiglu", dtype, dtype, dtype, dense_rows8=True, x_format=x_format))


@pytest.fixture(scope="module")
def by_level():
    kernels = [k for case in ROUNDED_CASES for k in _rounded_pair(*case)]
    return {level: CpuModule(build_ir(kernels, (), level), level) for level in LEVELS}


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("level", LEVELS)
def test_chunk_ffn_dots_rows8_matrices_with_rounded_x_as_the_decode_kernel(by_level, teams, level, threads):
    # With rounded x, the matrices a gate-first (gate) or down-only (gate, up) kernel reads whole go
    # through the decode kernel's integer products, the chunk's tokens together: each token's h is
    # the one the decode kernel computes for that token alone, so every token's y is the decode
    # kernel's up to the order of the down rows' sum (2e-6 of the largest |y|: 64 products
    # summed in f32, ~1e-7 measured). Thresholds sit at the median score, not in a gap, so a
    # product off by its last bit could flip a neuron (~0.1 of y). Down-only gets raw x (the
    # kernel rounds it as the decode kernel does); float products of it would miss by ~1e-5.
    # Gate-first gets the rounded floats the prefill passes it, its gathered up rows dotted as
    # floats (they differ from the decode kernel's integer sums by float order alone).
    if not host_has(level):
        pytest.skip(f"this host cannot run {level} code (compiled only)")
    module, team = by_level[level], teams[threads]
    for mode, dtype, x_format in ROUNDED_CASES:
        decode, chunk = _rounded_pair(mode, dtype, x_format)
        assert chunk.by_level and chunk.symbol.endswith(f"_xi{x_format[1:]}")
        for seq in (1, 7, 32):  # one token; x rows in pairs and one alone; a whole chunk
            case = ChunkCase("swiglu", dtype, seq=seq, n=64, seed=seq + len(mode))
            if mode == "gate-first":
                case.x = quant.round_x_blocks(case.x, x_format)
            case.gate_raw = to_rows8(case.gate_raw, dtype, (case.n, case.hidden))
            if mode == "down-only":
                case.up_raw = to_rows8(case.up_raw, dtype, (case.n, case.hidden))
            rounded = quant.round_x_blocks(case.x, x_format).astype(np.float64)
            gate = rounded @ case.gate.T.astype(np.float64) + case.gate_bias
            scores = act64("silu", gate) if mode == "gate-first" else case.h()
            thr = float(np.median(np.abs(scores)))
            y = case.run(module, team, chunk, threshold=thr)
            for s in range(seq):
                one, count = np.full(case.hidden, np.nan, np.float32), np.array([-1], np.int32)
                run(module, team, decode, np.ascontiguousarray(case.x[s]), case.up_raw, case.gate_raw, case.down_t,
                    case.up_bias, case.gate_bias, case.down_bias, one, np.zeros(case.n, np.uint8), count,
                    aligned_zeros(ffn_scratch_bytes(case.n, case.hidden, threads)), case.n, case.hidden, thr, None, 0)
                assert 0 < count[0] < case.n
                assert rel_err(y[s], one.astype(np.float64)) <= 2e-6, (mode, dtype, x_format, seq, s)


def test_chunk_ffn_of_one_token_is_deterministic_and_skips_dead_neurons(host, teams):
    case = ChunkCase("swiglu", "q4_1", seq=1, n=200, biases=False, seed=3)
    kernel = chunk_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1")
    active = np.zeros((1, case.n), bool)
    active[0, [0, 57, 199]] = True
    y = case.run(host, teams[3], kernel, mask=active)
    assert rel_err(y, case.reference(active)) <= QUANT_TOL
    for _ in range(3):  # neurons in a fixed order whatever the threads: the same bits every run
        np.testing.assert_array_equal(case.run(host, teams[2], kernel, mask=active), y)
    np.testing.assert_array_equal(case.run(host, teams[2], kernel, mask=np.zeros_like(active)), 0.0)


def test_a_per_token_call_runs_once_per_token_with_strided_operands(teams):
    # The predictor sees one token; repeated over ``seq`` tokens (a parameter read when the program
    # runs), each token reads its own row of x and writes its own row of the mask.
    rng = np.random.default_rng(5)
    hidden, rank, n, chunk = 40, 8, 50, 6
    fc1, fc2 = rng.normal(size=(rank, hidden)).astype(np.float32), rng.normal(size=(n, rank)).astype(np.float32)
    x = rng.normal(size=(chunk, hidden)).astype(np.float32)
    masks = np.full((chunk, n), 7, np.uint8)
    params = np.zeros(4, np.int32)
    scratch = aligned_zeros(predictor_scratch_bytes(rank))
    prog = Program("per_token", sync=0)
    prog.call(predictor("f32", "f32"), Buf(1, stride=4 * hidden), Buf(2), Buf(5), Buf(3), Buf(5),
              Buf(4, stride=n), Buf(6), hidden, rank, n, 0.0, repeat=Param(7, 0))
    module = compile_kernels([predictor("f32", "f32")], [prog], simd="host")
    sync = aligned_zeros(SYNC_BYTES)
    fc2t = np.ascontiguousarray(fc2.T)  # the kernel reads fc2 transposed; the table only points at it
    table = buffer_table([sync, x, fc1, fc2t, masks, None, scratch, params])
    fn = module.function("per_token", [type(table), np.ctypeslib.ctypes.c_int32, np.ctypeslib.ctypes.c_int32])
    params[0] = 4  # four of the six rows
    teams[2].run_each(lambda tid: fn(table, tid, 2))
    logits = np.maximum(x @ fc1.T, 0) @ fc2.T
    np.testing.assert_array_equal(masks[:4], (logits[:4] > 0).astype(np.uint8))
    np.testing.assert_array_equal(masks[4:], 7)  # rows past seq untouched
