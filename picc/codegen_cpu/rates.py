"""How fast this CPU's kernels read weights of each format from memory.

Decode reads every weight once per token, so what a token costs is the weight bytes over the rate
at which the kernels get through them. That rate is not the memory's bandwidth alone: each format
also takes arithmetic per byte (a 4-bit byte holds two weights to unpack, convert and multiply),
and where the two are close they do not overlap perfectly. On the 2-core build machine, two
threads, against 35 GB/s of read bandwidth: the q4_1 GEMV reads ~15 GB/s from cache as from
memory (its arithmetic bounds it); the q8_0 GEMV ~33 GB/s from L2 but ~21 from memory; the f32
GEMV ~27 (the first version's figures; ``docs/codegen_cpu.md`` has today's). The cost model
(``picc.placement.plan_report``, ``picc.placement.partition``) needs these rates to estimate quantized models, whose
bytes alone promised 258 tok/s for SmolLM2 Q4_1 where it decoded ~175.

:func:`measure_kernel_rates` times picc's own GEMV in each format (and the ``_xi16`` variants,
which dot int16-rounded x, and the rows8 layout's, eight rows at a time)
streaming a matrix several times the size of any L3 cache, with every thread the caller asks
for, and reports bytes of weights read per second; and, for the ``_gathered`` keys, the fused
sparse FFN reading half of its neurons' up and down rows, a neuron at a time, over layers as
large in all (the rate at which the cost model prices a sparse FFN's active rows: the one-row
GEMV's, which it used before, moves with prefetch choices that gathered rows do not share). Three
measurements on the 2-core Zen 4, two threads: q4_1 with int16 x 13.9-16.8 GB/s gathered,
16.3-20.3 a row at a time, 25.0-32.5 eight rows at a time (gathered over eight at a time
0.51-0.55); with float x gathered over eight at a time 0.60-0.70. ``picc.targets``
measures it once per host and caches it beside the bandwidth.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from picc import kernel_names as names
from picc import quant
from picc.codegen_cpu.kernels_dense import gemv
from picc.codegen_cpu.kernels_ffn import ffn_scratch_bytes, sparse_ffn
from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Buf, Null, Program, buffer_table
from picc.codegen_cpu.rowformats import row_bytes
from picc.codegen_cpu.rowplanes import DTYPES as ROWPLANES_DTYPES
from picc.codegen_cpu.rowplanes import to_rowplanes
from picc.codegen_cpu.rows8 import to_rows8
from picc.codegen_cpu.threads import ThreadTeam
from picc.errors import PiccError
from runtime.hostmem import aligned_zeros, huge_zeros

_K = 1024  # row length
_TILE_ROWS = 256  # rows quantized once and copied over the whole matrix
_BYTES = 128 * 2**20  # the matrix: four times a 32 MiB L3, so it streams from memory
_GATHER_N = 2048  # neurons of a gathered-rate layer (up and down rows of _K)
_GATHER_ACTIVE = 0.5  # their share active: between a ReLU model's ~10-20% and a SwiGLU's 50-70%
_MAX_THREADS = 256  # threads a gathered-rate step's scratch has room for


def measure_kernel_rates(threads: int, repeats: int = 5, nbytes: int = _BYTES) -> dict[str, float]:
    """Bytes of weights per second the kernel of each key of ``kernel_names.CPU_RATE_KEYS`` reads
    from memory on ``threads`` threads (the median of ``repeats`` rounds, each kernel's timed run
    after its weights are written and read once): each GEMV over a matrix of about ``nbytes``, and
    each ``_gathered`` key's fused sparse FFN over layers of about ``nbytes`` in all
    (:func:`_gathered_programs`)."""
    from picc.codegen_cpu import compile_kernels, host_simd

    rng = np.random.default_rng(0)
    x = rng.normal(size=_K).astype(np.float32)
    programs, shapes = [], []
    for key, dtype, x_format, in_rows8 in names.cpu_rate_variants():
        rows = max(_TILE_ROWS, nbytes // row_bytes(dtype, _K) // _TILE_ROWS * _TILE_ROWS)
        prog = Program(f"picc_rate_{key}", sync=0)
        prog.call(gemv(dtype, x_format, in_rows8), Buf(2), Buf(1), Null(), Buf(3), rows, _K, 0)
        programs.append(prog)
        shapes.append((dtype, rows, in_rows8))
    gathered, layers = _gathered_programs(nbytes)
    module = compile_kernels([], programs + gathered, simd=host_simd())  # the level and code the cpu target compiles
    steps = [module.function(p.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]) for p in programs + gathered]
    # One matrix (or set of layers) at a time, in 2 MiB pages, holding real weights: random bits
    # could be denormals, which some CPUs multiply slowly.
    w = huge_zeros(max(max(rows * row_bytes(dtype, _K) for dtype, rows, _ in shapes),
                       max(2 * count * row_bytes(dtype, _K) * _GATHER_N for _, dtype, count in layers)))
    y = aligned_zeros(4 * max(rows for _, rows, _ in shapes))
    runs = [_gemv_run(rng, key, step, w, x, y, *shape)
            for key, step, shape in zip(names.CPU_GEMV_RATE_KEYS, steps[: len(programs)], shapes, strict=True)]
    runs += [_gathered_run(rng, key, step, w, x, dtype, count)
             for step, (key, dtype, count) in zip(steps[len(programs):], layers, strict=True)]
    # Round by round, every kernel once in turn (its weights written into w first, and read once
    # untimed, which writes the written lines back): a slow phase of a shared machine then hits
    # every rate alike, as the cost model compares them with each other (one kernel's runs after
    # another's had q4_1_r8_xi16 at 21-40 GB/s between measurements, enough to flip the
    # compile's choice between the sparse and the dense model).
    times: dict[str, list[float]] = {run.key: [] for run in runs}
    with ThreadTeam(threads) as team:
        for _ in range(repeats):
            for run in runs:
                run.fill()
                for timed in (False, True):
                    start = time.perf_counter()
                    team.run_each(lambda tid, run=run: run.step(ctypes.addressof(run.table), tid, threads))
                    if timed:
                        times[run.key].append(time.perf_counter() - start)
    for run in runs:
        run.check()
    return {run.key: run.nbytes / statistics.median(times[run.key]) for run in runs}


@dataclass
class _Run:
    """One rate key's measurement: ``fill`` writes its weights into the shared buffer, ``step``
    reads ``nbytes`` of them through ``table``, ``check`` raises if it computed something else."""

    key: str
    step: ctypes._CFuncPtr
    table: ctypes.Array
    nbytes: int
    fill: Callable[[], None]
    check: Callable[[], None] = lambda: None


def _gemv_run(rng: np.random.Generator, key: str, step: ctypes._CFuncPtr, w: np.ndarray, x: np.ndarray,
              y: np.ndarray, dtype: str, rows: int, in_rows8: bool) -> _Run:
    """The GEMV of ``key`` over ``rows`` rows: copies of a tile of random rows."""
    tile = _tile(rng, dtype)
    if in_rows8:  # whole groups of eight rows: copies of the tile are a rows8 matrix too
        tile = to_rows8(tile, dtype, (_TILE_ROWS, _K))
    tile = tile.reshape(-1).view(np.uint8)
    size = rows * row_bytes(dtype, _K)

    def fill() -> None:
        w[:size].reshape(-1, tile.size)[:] = tile

    return _Run(key, step, buffer_table([aligned_zeros(SYNC_BYTES), x, w, y]), size, fill)


def _tile(rng: np.random.Generator, dtype: str) -> np.ndarray:
    """``_TILE_ROWS`` rows of ``_K`` random weights in ``dtype``, as stored."""
    return quant.quantize(rng.normal(0, _K**-0.5, size=(_TILE_ROWS, _K)).astype(np.float32), dtype)


def _gathered_programs(nbytes: int) -> tuple[list[Program], list[tuple[str, str, int]]]:
    """For each ``_gathered`` rate key, a step that runs the fused sparse FFN the key names (a
    ReLU predictor-mode FFN: each active neuron's up row dotted, its down row added, as a
    gate-first layer reads its gathered rows) over ``count`` layers of ``_GATHER_N`` neurons,
    about ``nbytes`` of up and down rows in all; with (key, dtype, count). Buffers:
    0 sync, 1 x, 2 the weights (layer l's up, then its neuron-major down), 3 y, 4 mask, 5 count,
    6 scratch."""
    programs, layers = [], []
    for key, dtype, x_format in names.cpu_gathered_rate_variants():
        matrix = _GATHER_N * row_bytes(dtype, _K)
        count = max(1, nbytes // (2 * matrix))
        kernel = sparse_ffn("predictor", "relu", dtype, None, dtype, x_format=x_format)
        prog = Program(f"picc_rate_{key}", sync=0)
        for layer in range(count):
            up = 2 * layer * matrix
            prog.call(kernel, Buf(1), Buf(2, up), Null(), Buf(2, up + matrix), Null(), Null(), Null(), Buf(3),
                      Buf(4), Buf(5), Buf(6), _GATHER_N, _K, 0.0, Null(), 0)
        programs.append(prog)
        layers.append((key, dtype, count))
    return programs, layers


def _gathered_run(rng: np.random.Generator, key: str, step: ctypes._CFuncPtr, w: np.ndarray, x: np.ndarray,
                  dtype: str, count: int) -> _Run:
    """The ``_gathered`` key's step (of :func:`_gathered_programs`): the bytes of active up and
    down rows it reads with ``_GATHER_ACTIVE`` of each layer's neurons active, a random set (the
    same in every layer: scattered rows, in order, as a mask gives them)."""
    tile = _tile(rng, dtype)
    down = to_rowplanes(tile, dtype, (_TILE_ROWS, _K)) if dtype in ROWPLANES_DTYPES else tile
    matrix = _GATHER_N * row_bytes(dtype, _K)

    def fill() -> None:
        for layer in range(count):
            for part, rows in ((0, tile), (1, down)):
                start = (2 * layer + part) * matrix
                w[start : start + matrix].reshape(-1, rows.nbytes)[:] = rows.reshape(-1).view(np.uint8)

    active = int(_GATHER_N * _GATHER_ACTIVE)
    mask = np.zeros(_GATHER_N, np.uint8)
    mask[rng.choice(_GATHER_N, active, replace=False)] = 1
    found = np.zeros(1, np.int32)
    scratch = aligned_zeros(ffn_scratch_bytes(_GATHER_N, _K, _MAX_THREADS))
    table = buffer_table([aligned_zeros(SYNC_BYTES), x, w, aligned_zeros(4 * _K), mask, found, scratch])

    def check() -> None:
        if found[0] != active:
            raise PiccError(f"codegen_cpu: the rate step found {found[0]} active neurons of {active}")

    return _Run(key, step, table, 2 * count * active * row_bytes(dtype, _K), fill, check)
