"""How fast this CPU's kernels work through each weight format when memory is not the limit.

Decode reads every weight once per token, so a kernel's speed is the smaller of two rates: the
memory's read bandwidth and the rate at which its arithmetic consumes the weight bytes. For f32
and f16 rows the arithmetic is far faster than memory; for 4-bit rows it is not (each byte holds
two weights to unpack, convert and multiply): on the 2-core build machine a q4_1 GEMV runs at
~14 GB/s from its caches as from memory, against ~35 GB/s of read bandwidth. The cost model
(``picc.plan_report``) needs that second rate to estimate the speed of quantized models.

:func:`measure_kernel_rates` times picc's own GEMV in each format (and the ``_xi16`` variants,
which dot int16-rounded x) on a matrix that stays in the L2/L3 caches, with every thread the
caller asks for, and reports bytes of weights per second: the arithmetic's bound. ``picc.targets``
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
from picc.codegen_cpu.rowops import row_bytes
from picc.codegen_cpu.threads import ThreadTeam, aligned_zeros

_K = 1024  # row length; rows are added until a matrix holds _BYTES
_BYTES = 512 * 2**10  # small enough for the L2 + L3 caches of any CPU picc targets
_CALLS = 32  # GEMV calls per timed run (one run: one wake-up of the thread team)


def measure_kernel_rates(threads: int, repeats: int = 7) -> dict[str, float]:
    """Bytes of weights per second the GEMV of each key of ``kernel_names.CPU_RATE_KEYS`` consumes
    from cache on ``threads`` threads (the median of ``repeats`` timed runs after a warm-up)."""
    from picc.codegen_cpu import compile_kernels

    rng = np.random.default_rng(0)
    x = rng.normal(size=_K).astype(np.float32)
    buffers: list[np.ndarray] = [aligned_zeros(64), x]
    programs, sizes = [], []
    for key in names.CPU_RATE_KEYS:
        dtype, int_dots = key.removesuffix(names.INT_DOTS_SUFFIX), key.endswith(names.INT_DOTS_SUFFIX)
        rows = max(8, _BYTES // row_bytes(dtype, _K))
        # Real weights: random bits could hold denormals, which some CPUs multiply slowly.
        raw = quant.quantize(rng.normal(0, _K**-0.5, size=(rows, _K)).astype(np.float32), dtype)
        w = aligned_zeros(rows * row_bytes(dtype, _K))
        w[:] = raw.reshape(-1).view(np.uint8)
        y = aligned_zeros(4 * rows)
        base = len(buffers)
        buffers += [w, y]
        prog = Program(f"picc_rate_{key}", sync=0)
        for _ in range(_CALLS):
            prog.call(gemv(dtype, int_dots), Buf(base), Buf(1), Null(), Buf(base + 1), rows, _K, 0)
        programs.append(prog)
        sizes.append(_CALLS * w.nbytes)
    module = compile_kernels([], programs)
    table = buffer_table(buffers)
    steps = [module.function(p.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]) for p in programs]
    times: list[list[float]] = [[] for _ in steps]
    with ThreadTeam(threads) as team:
        for rep in range(repeats + 1):  # every kernel once per round: a slow phase hits them alike
            for i, step in enumerate(steps):
                start = time.perf_counter()
                team.run_each(lambda tid, step=step: step(ctypes.addressof(table), tid, threads))
                if rep:
                    times[i].append(time.perf_counter() - start)
    return {key: size / statistics.median(t) for key, size, t in zip(names.CPU_RATE_KEYS, sizes, times, strict=True)}
