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
for, and reports bytes of weights read per second. ``picc.targets``
measures it once per host and caches it beside the bandwidth.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

from picc import kernel_names as names
from picc import quant
from picc.codegen_cpu.kernels_dense import gemv
from picc.codegen_cpu.program import Buf, Null, Program, buffer_table
from picc.codegen_cpu.rowformats import row_bytes
from picc.codegen_cpu.rows8 import to_rows8
from picc.codegen_cpu.threads import ThreadTeam
from runtime.hostmem import aligned_zeros, huge_zeros

_K = 1024  # row length
_TILE_ROWS = 256  # rows quantized once and copied over the whole matrix
_BYTES = 128 * 2**20  # the matrix: four times a 32 MiB L3, so it streams from memory


def measure_kernel_rates(threads: int, repeats: int = 5, nbytes: int = _BYTES) -> dict[str, float]:
    """Bytes of weights per second the GEMV of each key of ``kernel_names.CPU_RATE_KEYS`` reads
    from memory on ``threads`` threads (the median of ``repeats`` runs after a warm-up), over a
    matrix of about ``nbytes``."""
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
    module = compile_kernels([], programs, simd=host_simd())  # the level and code the cpu target compiles
    steps = [module.function(p.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]) for p in programs]
    # One matrix at a time, in 2 MiB pages, holding real weights: random bits could be
    # denormals, which some CPUs multiply slowly.
    w = huge_zeros(max(rows * row_bytes(dtype, _K) for dtype, rows, _ in shapes))
    y = aligned_zeros(4 * max(rows for _, rows, _ in shapes))
    rates = {}
    with ThreadTeam(threads) as team:
        for key, step, (dtype, rows, in_rows8) in zip(names.CPU_RATE_KEYS, steps, shapes, strict=True):
            tile = quant.quantize(rng.normal(0, _K**-0.5, size=(_TILE_ROWS, _K)).astype(np.float32), dtype)
            if in_rows8:  # whole groups of eight rows: copies of the tile are a rows8 matrix too
                tile = to_rows8(tile, dtype, (_TILE_ROWS, _K))
            tile = tile.reshape(-1).view(np.uint8)
            size = rows * row_bytes(dtype, _K)
            w[:size].reshape(-1, tile.size)[:] = tile
            table = buffer_table([aligned_zeros(64), x, w, y])
            times = []
            for rep in range(repeats + 1):  # the first run warms up
                start = time.perf_counter()
                team.run_each(lambda tid, step=step, table=table: step(ctypes.addressof(table), tid, threads))
                if rep:
                    times.append(time.perf_counter() - start)
            rates[key] = size / statistics.median(times)
    return rates
