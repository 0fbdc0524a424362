"""bench/kernels.py's reference loop reads exactly the rows the fused FFN gathers.

Its rate is what the benchmark shows the fused kernel's rate against ("vs read"), so it must read
the same bytes: each active neuron's up/gate record and its down row, every line once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from picc.codegen_cpu import aligned_zeros, compile_kernels

_PATH = Path(__file__).resolve().parent.parent / "bench" / "kernels.py"
_spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
bench = sys.modules["bench_kernels"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def read_module():
    return compile_kernels([bench.gathered_read()], simd="host")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gathered_read_reads_each_active_neurons_rows(read_module, teams, threads):
    rng = np.random.default_rng(threads)
    n, row_bytes = 40, 192  # three lines a row
    up_gate = rng.integers(0, 2**32, size=(n, 2 * row_bytes // 4), dtype=np.uint32)
    down = rng.integers(0, 2**32, size=(n, row_bytes // 4), dtype=np.uint32)
    active = np.sort(rng.choice(n, 17, replace=False)).astype(np.int32)
    out = aligned_zeros(64 * threads).view(np.uint32).reshape(threads, 16)  # a 64-byte accumulator a thread
    fn = read_module.function("bench_gathered_read", bench.gathered_read().argtypes)
    teams[threads].run(fn, [up_gate.ctypes.data, down.ctypes.data, active.ctypes.data, len(active), row_bytes,
                            out.ctypes.data])
    lines = np.concatenate([up_gate[active].reshape(-1, 16), down[active].reshape(-1, 16)])
    np.testing.assert_array_equal(np.bitwise_xor.reduce(out, axis=0), np.bitwise_xor.reduce(lines, axis=0))
