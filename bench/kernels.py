"""Benchmark of the fused sparse FFN kernel against the host's read bandwidth and numpy.

    python bench/kernels.py [--reps 7] [--threads 1,2] [--shapes small,medium,large] [--dtypes f16,q4_0,f32]
    python bench/kernels.py --batched [--batches 1,2,4,8] [--threads 2] [--reps 7] [--simd avx512] [--x i16,i8]

(``--dtypes`` also takes ``q4_0-int`` / ``q4_1-int``: the kernel variant that dots int16 x, and
``q4_0-i8`` / ``q4_1-i8``: int8 x, against the dense GEMV with int8 x too; with rounded x, the
gathered rows are stored where ``select-kernels`` would store them: from hidden 4096 in the
dotplanes layout, "/dp" in the table.)

For each FFN shape (SmolLM2: hidden 576, n_ff 1536; a 1B-like layer: 2048 x 5632; a 7B-like layer:
4096 x 11008), weight format
and thread count, it times one compiled step that runs the kernel (predictor mode, a sorted random
list of active neurons, new for every run) over 1 GiB of layers, so that the rows come from
memory as in a real decode step (weights in 2 MiB pages, see ``runtime.hostmem``). It prints medians of ``--reps``
runs: time per layer, GB/s of *active rows read* (up, gate and down rows of the active neurons),
that rate as a share of the read bandwidth measured in the same run (``picc.targets``: every
core streaming), the same rate with the rows in cache (one layer's active rows read over and over, shown
when they take at most half of the L3 cache: what the kernel's arithmetic allows; when it is no
higher than the rate from memory, the kernel is bound by its arithmetic, not by memory), and the
speed-up over numpy's dense FFN (three f32 GEMVs over the full matrices, the better
of its BLAS on one thread and on all) on the same shape. Beside each, the rate of picc's own dense
GEMV over the same matrices (what a dense model runs: 4-bit formats in the rows8
layout with int16 x, ``select-kernels``' choice; others rows with float x), timed once in every
round of the sparse kernel's configurations so that both medians come from the same minutes, and
the sparse kernel's rate as a share of it ("vs dense"): the ratio the CPU sparsity issue judges
(>= 90% at 10-50% active). And, timed in the same rounds, a loop that only reads the same active
rows (:func:`gathered_read`, the kernel's prefetches and nothing else): the rate at which this
machine serves rows gathered a neuron at a time, below its streaming rate, and the kernel's share
of it ("vs read": near 100%, the kernel is bound by the memory's gathered reads; well under, by
its own work). On a shared machine the numbers move by tens of percent between runs: compare
ratios within one run.

``--batched`` times the batched decode kernels instead (``picc.codegen_cpu.kernels_batch``: B
sequences' x rows against one read of the weights, each row the bits of the one-row kernel) on
SmolLM2's decode GEMVs and FFN and a 7B-like down projection, the weights from memory (copies
over 1 GiB, one call each): time per call, and rows per second (batch / time) as a ratio to the
one-row kernel's rate, the speed-up that batching the decode step gives these kernels.
``--simd`` compiles them for a SIMD level instead of the host's (the ``cpu`` target's; the batched
rows8 int-x kernels differ between the two AVX-512 levels, and use VNNI);
``--x`` the formats x is rounded to in the rows8 kernels (``i16``, what a dense compile chooses;
``i8``, ``picc compile --int8-dots``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llvmlite  # noqa: E402
import llvmlite.binding as llvm  # noqa: E402

from picc import kernel_names as names  # noqa: E402
from picc import quant  # noqa: E402
from picc.codegen_cpu import (  # noqa: E402
    SYNC_BYTES,
    Buf,
    Null,
    Param,
    Program,
    ThreadTeam,
    aligned_zeros,
    buffer_table,
    compile_kernels,
    dotplanes,
    effective_simd,
    rowplanes,
)
from picc.codegen_cpu.compiler import SIMD_CHOICES, CpuModule  # noqa: E402
from picc.codegen_cpu.irtext import chunk_bounds  # noqa: E402
from picc.codegen_cpu.kernel import Kernel, kernel_fn  # noqa: E402
from picc.codegen_cpu.kernels_batch import dense_ffn_rows, dense_ffn_rows_scratch_bytes, gemv_rows  # noqa: E402
from picc.codegen_cpu.kernels_dense import dense_ffn, gemv  # noqa: E402
from picc.codegen_cpu.kernels_ffn import ffn_scratch_bytes, sparse_ffn  # noqa: E402
from picc.codegen_cpu.rows8 import to_rows8  # noqa: E402
from picc.kernel_names import has_rate_key  # noqa: E402
from picc.targets.host import host_cores, host_cpu_name, host_vnni, measure_memory_bandwidth  # noqa: E402
from runtime.hostmem import huge_zeros  # noqa: E402
from runtime.threads import ThreadTeam as RuntimeTeam  # noqa: E402

SHAPES = {"small": (576, 1536), "medium": (2048, 5632), "large": (4096, 11008)}
FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.6, 1.0)
# Bytes of weights per step: even the 10% of them read at 10% active is several times a 32 MiB
# L3, and each timed run reads a fresh random set of rows, so the rows come from memory.
WORKING_SET = 2**30


class Layers:
    """``count`` copies of one FFN layer's up / gate / down_t in ``dtype``, in 2 MiB pages;
    ``planes``: up and gate in the dotplanes layout (what the kernel with rounded x reads)."""

    def __init__(self, hidden: int, n: int, dtype: str, rng: np.random.Generator, planes: bool = False) -> None:
        w = rng.normal(0, hidden**-0.5, size=(n, hidden)).astype(np.float32)
        raw = quant.quantize(w, dtype).reshape(-1).view(np.uint8)
        self.matrix_bytes = raw.nbytes
        self.row_bytes = raw.nbytes // n
        self.count = max(1, WORKING_SET // (3 * raw.nbytes))
        self.data = huge_zeros(3 * self.count * raw.nbytes)
        # down_t in the layout the kernel reads (the same bytes as up's, regrouped for block formats)
        down_t = rowplanes.to_rowplanes(raw, dtype, (n, hidden)).reshape(-1) if dtype in rowplanes.DTYPES else raw
        dotted = dotplanes.to_dotplanes(raw, dtype, (n, hidden)).reshape(-1) if planes else raw
        for i in range(3 * self.count):
            self.data[i * raw.nbytes : (i + 1) * raw.nbytes] = down_t if i % 3 == 2 else dotted

    def up_gate(self, layer: int) -> np.ndarray:
        """Matrices 0 and 1 of the layer, read as one [n, 2, hidden] interleaved up/gate."""
        start = 3 * layer * self.matrix_bytes
        return self.data[start : start + 2 * self.matrix_bytes]

    def matrix(self, layer: int, which: int) -> np.ndarray:
        start = (3 * layer + which) * self.matrix_bytes
        return self.data[start : start + self.matrix_bytes]


def median_time(run, reps: int, prepare=None) -> float:
    """Median seconds of ``run()`` over ``reps`` runs after a warm-up; ``prepare()`` before each."""
    if prepare:
        prepare()
    run()  # warm up (page faults, thread start)
    times = []
    for _ in range(reps):
        if prepare:
            prepare()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def numpy_dense_ffn(hidden: int, n: int, reps: int) -> float:
    """Median seconds per layer of numpy's dense f32 FFN over 1 GiB of layers."""
    layers = Layers(hidden, n, "f32", np.random.default_rng(1))
    x = np.ones(hidden, np.float32)
    mats = [[layers.matrix(i, j).view(np.float32).reshape(n, hidden) for j in range(3)] for i in range(layers.count)]

    def run() -> None:
        for up, gate, down in mats:
            h = (gate @ x) * (up @ x)
            down.T @ h  # noqa: B018 - down is neuron-major, as the kernel reads it

    return median_time(run, reps) / layers.count


def numpy_baseline(shape: str, reps: int) -> tuple[float, str]:
    """numpy's best time per layer with its BLAS on one thread and on its default threads, each
    measured in a fresh process (the thread count is fixed when numpy loads); and which won.

    Taking the better of the two keeps the comparison fair on a loaded machine, where a
    multi-threaded BLAS GEMV can be many times slower than a single-threaded one.
    """
    results = {}
    for label, env in (("1 BLAS thread", {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}), ("BLAS default", {})):
        out = subprocess.run([sys.executable, __file__, "--numpy-only", shape, "--reps", str(reps)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        results[label] = float(out.stdout.strip().splitlines()[-1])
    best = min(results, key=results.__getitem__)
    return results[best], best


def l3_bytes() -> int | None:
    """The size of this CPU's L3 cache (Linux sysfs), or None when it is not known."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale if text.rstrip("KM").isdigit() else None


_READ_PARAMS = (("up_gate", "ptr"), ("down", "ptr"), ("active", "ptr"), ("count", "i32"), ("row_bytes", "i32"),
                ("out", "ptr"))
# Neurons ahead whose lines the read loop prefetches into L2 (the fused kernel: six for its dotted rows,
# the next four for its AXPYs; a C loop like this one read alike one, two, four or eight ahead).
_READ_AHEAD = 4


@cache
def gathered_read() -> Kernel:
    """A loop that only reads the rows the fused FFN gathers: for each neuron of ``active[0:count]``
    (thread t its share of the list), its up/gate record (two rows of ``row_bytes``) and its down
    row, one 512-bit load a line xor-ed into an accumulator, each line of the neuron four later
    prefetched into L2 as it goes; the accumulator goes to ``out`` (so the loads stay). Its rate
    is what this machine's memory serves rows gathered a neuron at a time: the reference the
    fused kernel's rate is shown against beside the dense GEMV's streaming one."""

    def emit(simd: str) -> str:
        fn = kernel_fn("bench_gathered_read", _READ_PARAMS)
        v16 = "<16 x i32>"
        k0, k1 = chunk_bounds(fn, fn.sext("%count"), fn.sext("%tid"), fn.sext("%nthreads"))
        rb = fn.sext("%row_bytes")
        last = fn.v(f"sub i64 {k1}, 1", "last")
        acc = fn.var(v16, "zeroinitializer", "acc")
        with fn.loop(k0, k1, hint="k") as k:
            ahead = fn.min64(fn.v(f"add i64 {k}, {_READ_AHEAD}", "ka"), last)
            i, j = (fn.sext(fn.load("i32", fn.at("%active", 4, at), 4, "n")) for at in (k, ahead))
            for base, span in (("%up_gate", fn.v(f"shl i64 {rb}, 1", "rec")), ("%down", rb)):
                row, later = (fn.gep(base, fn.v(f"mul i64 {neuron}, {span}", "off")) for neuron in (i, j))
                with fn.loop("0", span, "64", "o") as o:
                    fn.prefetch(fn.gep(later, o), "l2")
                    acc.set(fn.v(f"xor {v16} {acc.get()}, {fn.load(v16, fn.gep(row, o), 1, 'w')}", "acc"))
        fn.store(v16, acc.get(), fn.at("%out", 64, fn.sext("%tid")), 64)
        fn.ret_void()
        return fn.text()

    return Kernel("bench_gathered_read", _READ_PARAMS, emit)


def native_team(module: CpuModule, nthreads: int) -> RuntimeTeam:
    """A team of ``nthreads`` threads that wait for steps in ``module``'s generated code, as the
    runtime's do (its steps may come from any module that outlives the team)."""
    worker = module.function("picc_team_worker", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
    barrier = module.function("picc_team_barrier", [ctypes.c_void_p, ctypes.c_int32])
    return RuntimeTeam(nthreads, native=(worker, barrier))


class DenseGemv:
    """picc's dense GEMV over an [n, hidden] matrix of ``dtype`` (copies over 1 GiB, one GEMV each,
    so that it reads from memory): the kernel a dense model runs (4-bit rows in the rows8 layout
    with x rounded to ``x_format``), compiled once; :meth:`run` is one step over every copy."""

    def __init__(self, hidden: int, n: int, dtype: str, rng: np.random.Generator, x_format: str = "i16") -> None:
        four_bit = dtype in ("q4_0", "q4_1")
        w = rng.normal(0, hidden**-0.5, size=(n, hidden)).astype(np.float32)
        raw = quant.quantize(w, dtype).reshape(-1).view(np.uint8)
        if four_bit:
            raw = to_rows8(raw, dtype, (n, hidden)).reshape(-1)
        count = max(1, WORKING_SET // raw.nbytes)
        self.data = huge_zeros(count * raw.nbytes)
        for i in range(count):
            self.data[i * raw.nbytes : (i + 1) * raw.nbytes] = raw
        self.nbytes = count * raw.nbytes  # read by one step
        x = rng.normal(size=hidden).astype(np.float32)
        self.buffers = [aligned_zeros(SYNC_BYTES), x, aligned_zeros(4 * n), self.data]
        prog = Program("dense_gemv_step", sync=0)
        kernel = gemv(dtype, x_format if four_bit else "f32", rows8=four_bit)
        for i in range(count):
            prog.call(kernel, Buf(3, i * raw.nbytes), Buf(1), Null(), Buf(2), n, hidden, 0)
        self.module = compile_kernels([], [prog], effective_simd("host"))
        self.step = self.module.function(prog.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
        self.table = buffer_table(self.buffers)

    def run(self, team: RuntimeTeam) -> float:
        """Seconds of one step on ``team``'s threads."""
        start = time.perf_counter()
        team.run_step(self.step, ctypes.addressof(self.table))
        return time.perf_counter() - start


def bench_kernel(layers: Layers, hidden: int, n: int, dtype: str, x_format: str, threads: list[int], reps: int,
                 rng: np.random.Generator, gathered: str = "rows",
                 dense: DenseGemv | None = None) -> tuple[dict[tuple[int, float, str], float], dict[int, float]]:
    """Median seconds per layer, by (threads, active fraction, run): the fused kernel's rows from
    ``"memory"``; ``"cached"``, every call of the step on layer 0 with one active set, so after
    the first call its rows come from cache; ``"read"``, :func:`gathered_read` over the same rows
    as the ``"memory"`` run. And ``dense``'s read rate (bytes per second) by thread count. All
    timed in the same rounds."""
    # As fuse-gather-gemv lays them out: up and gate rows interleaved ([n, 2, hidden]), so an
    # active neuron's two rows are one stream; down neuron-major; float dot products, as in every
    # sparse module (a dtype given as e.g. "q4_0-int" times the _xi16 variant, which dense modules
    # use for the CPU part of a split layer).
    kernel = sparse_ffn("predictor", "swiglu", dtype, dtype, dtype, interleaved=True, x_format=x_format,
                        gathered=gathered)
    x, y = rng.normal(size=hidden).astype(np.float32), np.zeros(hidden, np.float32)
    mask, count = np.zeros(n, np.uint8), np.zeros(1, np.int32)  # a predictor's output: a byte per neuron
    scratch = aligned_zeros(ffn_scratch_bytes(n, hidden, max(threads)))
    active, read_out = np.zeros(n + 1, np.int32), aligned_zeros(64 * max(threads))  # the list, then its length
    buffers = [aligned_zeros(SYNC_BYTES), x, y, mask, count, scratch, active, read_out]
    progs = [Program("ffn_step", sync=0), Program("ffn_step_cached", sync=0)]
    read = Program("read_step", sync=0)
    first = len(buffers)
    for layer in range(layers.count):
        base = len(buffers)
        buffers += [layers.up_gate(layer), layers.matrix(layer, 2)]
        for prog, b in zip(progs, (base, first), strict=True):
            prog.call(kernel, Buf(1), Buf(b), Buf(b, layers.row_bytes), Buf(b + 1), Null(), Null(), Null(),
                      Buf(2), Buf(3), Buf(4), Buf(5), n, hidden, 0.0, Null(), 0)
        read.call(gathered_read(), Buf(base), Buf(base + 1), Buf(6), Param(6, n), layers.row_bytes, Buf(7),
                  barrier_after=False)
    module = compile_kernels([], [*progs, read], effective_simd("host"))  # the level and code picc compile makes
    steps = {kind: module.function(p.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
             for kind, p in zip(("memory", "cached", "read"), (*progs, read), strict=True)}
    table = buffer_table(buffers)
    times: dict[tuple[int, float, str], list[float]] = {}
    dense_times: dict[int, list[float]] = {}
    for t in threads:
        # The runtime's team (its workers wait in generated code, ~10 us a step): Python's
        # hand-off took 0.1-0.2 ms a step on two threads (steps with no active neuron), a few
        # per cent of a step at 10% active.
        with native_team(module, t) as team:
            # Round by round, every configuration (and the dense GEMV) once in turn: a slow phase
            # of a shared machine (seconds long here) then hits every configuration's median
            # alike, instead of all the runs of one of them, and "vs dense" compares rates taken
            # in the same minutes.
            for rep in range(reps + 1):  # the first round warms up (page faults, thread start)
                if dense is not None:
                    secs = dense.run(team)
                    if rep:
                        dense_times.setdefault(t, []).append(secs)
                for frac in FRACTIONS:
                    size = int(round(frac * n))
                    for kind, step in steps.items():
                        mask[:] = 0
                        mask[rng.choice(n, size, replace=False)] = 1
                        active[:size], active[n] = np.flatnonzero(mask), size
                        start = time.perf_counter()
                        team.run_step(step, ctypes.addressof(table))
                        if rep:
                            times.setdefault((t, frac, kind), []).append(time.perf_counter() - start)
                        if kind != "read" and count[0] != size:
                            raise RuntimeError(f"the kernel found {count[0]} active neurons, the mask has {size}")
    rates = {t: dense.nbytes / statistics.median(runs) for t, runs in dense_times.items()} if dense else {}
    return {key: statistics.median(runs) / layers.count for key, runs in times.items()}, rates


# (label, rows, k, dtype, rows8 with rounded x): the decode GEMVs of SmolLM2-135M as select-kernels
# picks them (q4_1 in the rows8 layout with int16 or int8 x; the q8_0 head rows one at a time with
# float x, or in the rows8 layout with int8 x), and a 7B-like layer's down projection; "ffn":
# SmolLM2's dense FFN (swiglu, up / gate [1536, 576]).
BATCHED_CASES = (("SmolLM2 q/o", 576, 576, "q4_1", True), ("SmolLM2 up", 1536, 576, "q4_1", True),
                 ("SmolLM2 down", 576, 1536, "q4_1", True), ("SmolLM2 head", 49152, 576, "q8_0", False),
                 ("SmolLM2 head", 49152, 576, "q8_0", True),
                 ("7B down", 4096, 11008, "q4_1", True), ("SmolLM2 ffn", 1536, 576, "q4_1", True))


def _matrix(rng: np.random.Generator, rows: int, k: int, dtype: str, rows8: bool) -> np.ndarray:
    raw = quant.quantize(rng.normal(0, k**-0.5, size=(rows, k)).astype(np.float32), dtype).reshape(-1).view(np.uint8)
    return to_rows8(raw, dtype, (rows, k)).reshape(-1) if rows8 else raw


def batched_times(case: tuple, threads: int, batches: list[int], reps: int, rng: np.random.Generator,
                  simd: str = "host", x_format: str = "i16") -> tuple[dict[int | None, float], int]:
    """Median seconds per call by batch (None: the one-row kernel), and the bytes of weights a
    call reads. Each configuration is one compiled step that calls its kernel on every copy of
    the weights in turn (``repeat``), so they come from memory as in a real decode step. The rows8
    cases round x to ``x_format``; the others dot float x."""
    label, rows, k, dtype, rows8 = case
    ffn = label.endswith("ffn")
    x_format = x_format if rows8 else "f32"
    mats = ([_matrix(rng, rows, k, dtype, rows8) for _ in range(2)] + [_matrix(rng, k, rows, dtype, rows8)] if ffn
            else [_matrix(rng, rows, k, dtype, rows8)])
    unit = sum(m.nbytes for m in mats)
    count = max(1, WORKING_SET // unit)
    data = huge_zeros(count * unit)
    flat = np.concatenate(mats)
    for i in range(count):
        data[i * unit : (i + 1) * unit] = flat
    most = max(batches)
    xw, yw = (k, k) if ffn else (k, rows)  # floats of an x row and of a y row
    x = rng.normal(size=most * xw).astype(np.float32)
    scratch = aligned_zeros(dense_ffn_rows_scratch_bytes(rows, most))
    buffers = [aligned_zeros(SYNC_BYTES), np.array([count], np.int32), x, aligned_zeros(4 * most * yw), data, scratch]
    weights = [Buf(4, sum(m.nbytes for m in mats[:i]), unit) for i in range(len(mats))]
    progs = {}
    for batch in [None, *batches]:
        prog = Program(f"batched_{batch or 'single'}", sync=0)
        tail = () if batch is None else (batch, 4 * xw, 4 * yw)
        if ffn:
            kernel = (dense_ffn if batch is None else dense_ffn_rows)("swiglu", dtype, dtype, dtype, x_format, rows8)
            prog.call(kernel, Buf(2), *weights, Null(), Null(), Null(), Buf(3), Buf(5), rows, k, 0, *tail,
                      repeat=Param(1, 0))
        else:
            kernel = (gemv if batch is None else gemv_rows)(dtype, x_format, rows8)
            prog.call(kernel, weights[0], Buf(2), Null(), Buf(3), rows, k, 0, *tail, repeat=Param(1, 0))
        progs[batch] = prog
    module = compile_kernels([], list(progs.values()), simd)
    steps = {b: module.function(p.name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]) for b, p in progs.items()}
    table = buffer_table(buffers)
    times: dict[int | None, list[float]] = {b: [] for b in steps}
    with ThreadTeam(threads) as team:
        for rep in range(reps + 1):  # every configuration once a round (see bench_kernel); round 0 warms up
            for batch, step in steps.items():
                start = time.perf_counter()
                team.run_each(lambda tid, step=step: step(ctypes.addressof(table), tid, threads))
                if rep:
                    times[batch].append(time.perf_counter() - start)
    return {b: statistics.median(t) / count for b, t in times.items()}, unit


def batched_main(args: argparse.Namespace) -> None:
    """The ``--batched`` table: the batched kernels against the one-row kernels, per batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    print(f"{'kernel':>13} {'shape':>11} {'dtype':>12} {'thr':>3} {'batch':>6} {'us/call':>8} {'GB/s':>6} "
          f"{'rows/s vs 1-row':>15}")
    for threads in (int(t) for t in args.threads.split(",")):
        for case in BATCHED_CASES:
            label, rows, k, dtype, rows8 = case
            for x_format in [x for x in args.x.split(",") if has_rate_key(dtype, x, rows8)] if rows8 else ("f32",):
                times, unit = batched_times(case, threads, batches, args.reps, rng, args.simd, x_format)
                kind = dtype + (f"_r8_x{x_format}" if rows8 else "")
                for batch, secs in times.items():
                    ratio = (batch or 1) * times[None] / secs
                    print(f"{label:>13} {rows:>5}x{k:<5} {kind:>12} {threads:>3} {batch or '1-row':>6} "
                          f"{secs * 1e6:>8.1f} {unit / secs / 1e9:>6.1f} {ratio:>14.2f}x")
    print()
    print("shape: rows x k of the GEMV (ffn: n_ff x hidden of up and gate; down is its transpose); batch 1-row:")
    print("the one-row kernel (kernels_dense). GB/s: weights read per second (read once per call, whatever the")
    print("batch); rows/s vs 1-row: (batch / time) / (1 / the one-row kernel's time).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--dtypes", default="f16,q4_0,f32")
    parser.add_argument("--batched", action="store_true", help="time the batched decode kernels instead")
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes of --batched")
    parser.add_argument("--simd", default="host", choices=SIMD_CHOICES, help="the SIMD level of --batched's kernels")
    parser.add_argument("--x", default="i16", help="--batched: the formats x is rounded to in rows8 kernels (i16,i8)")
    parser.add_argument("--numpy-only", help=argparse.SUPPRESS)  # internal: one numpy baseline
    args = parser.parse_args()
    if args.numpy_only:
        print(numpy_dense_ffn(*SHAPES[args.numpy_only], args.reps))
        return
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)

    print(f"machine: {host_cpu_name()}, {host_cores()} cores, {platform.machine()}, "
          f"kernels for {effective_simd('host')} (llvmlite {llvmlite.__version__}, LLVM "
          f"{'.'.join(map(str, llvm.llvm_version_info))}), numpy {np.__version__}")
    if args.batched:
        print(f"batched decode kernels for {effective_simd(args.simd)}, medians of {args.reps} runs, weights from "
              f"memory (copies over {WORKING_SET / 2**30:.0f} GiB)")
        print()
        batched_main(args)
        return
    bandwidths = [measure_memory_bandwidth()]
    print(f"read bandwidth (every core streaming, picc.targets): {bandwidths[0] / 1e9:.1f} GB/s")
    print(f"VNNI: the host has {host_vnni()}; the kernels with rounded x use it at avx512-vnni (vpdpbusd in "
          "their eight-row dot products; vpmaddwd elsewhere); float x with FMAs")
    print()
    header = (f"{'shape':>11} {'dtype':>10} {'x':>6} {'thr':>3} {'active':>6} {'us/layer':>9} {'GB/s':>6} {'%bw':>5} "
              f"{'cached GB/s':>11} {'read GB/s':>9} {'vs read':>7} {'dense GB/s':>10} {'vs dense':>8} {'vs numpy':>8}")
    l3 = l3_bytes()
    rows = []
    for shape in args.shapes.split(","):
        hidden, n = SHAPES[shape]
        numpy_time, how = numpy_baseline(shape, args.reps)
        print(f"{hidden}x{n}: numpy dense f32 FFN {numpy_time * 1e6:.0f} us/layer "
              f"({3 * 4 * hidden * n / numpy_time / 1e9:.1f} GB/s, {how})")
        for spec in args.dtypes.split(","):
            dtype, _, dots = spec.partition("-")
            x_format = {"": "f32", "int": "i16", "i8": "i8"}[dots]
            gemv_x = "i8" if dots == "i8" else "i16"
            gathered = names.gathered_layout("predictor", x_format, dtype, dtype, hidden)  # select-kernels' choice
            layers = Layers(hidden, n, dtype, rng, planes=gathered == "dotplanes")
            dense_gemv = DenseGemv(hidden, n, dtype, rng, gemv_x)
            times, dense = bench_kernel(layers, hidden, n, dtype, x_format, threads, args.reps, rng, gathered,
                                        dense_gemv)
            del dense_gemv
            bandwidths.append(measure_memory_bandwidth())
            for (t, frac, kind), secs in times.items():
                if kind != "memory":
                    continue
                active = 3 * layers.row_bytes * round(frac * n)
                in_cache = active / times[(t, frac, "cached")] if l3 and active <= l3 // 2 else None
                x_label = x_format + ("/dp" if gathered == "dotplanes" else "")
                rows.append((f"{hidden}x{n}", spec, x_label, t, frac, secs, active / secs,
                             in_cache, active / times[(t, frac, "read")], dense[t], numpy_time / secs))
            del layers
    bw = statistics.median(bandwidths)
    print(f"read bandwidth, median of {len(bandwidths)} measurements in this run: {bw / 1e9:.1f} GB/s "
          f"(min {min(bandwidths) / 1e9:.1f}, max {max(bandwidths) / 1e9:.1f})")
    print()
    print(header)
    for shape, dtype, x, t, frac, secs, rate, in_cache, read, dense, speedup in rows:
        cached = f"{in_cache / 1e9:.1f}" if in_cache else "-"
        print(f"{shape:>11} {dtype:>10} {x:>6} {t:>3} {frac:>6.0%} {secs * 1e6:>9.1f} {rate / 1e9:>6.1f} "
              f"{rate / bw:>5.0%} {cached:>11} {read / 1e9:>9.1f} {rate / read:>6.0%} {dense / 1e9:>10.1f} "
              f"{rate / dense:>7.0%} {speedup:>7.2f}x")
    print()
    print("GB/s: bytes of the active rows of up, gate and down read per second; %bw: of the median read bandwidth;")
    if l3:
        print(f"cached GB/s: the same with one layer's active rows read again and again (from cache; shown when "
              f"they take at most half of the {l3 / 2**20:.0f} MiB L3)")
    else:
        print("cached GB/s: not measured (L3 size unknown)")
    print("x: how the sparse kernel dots its rows (f32, or i16 / i8: x rounded to int16 / int8 per block of 32; /dp: "
          "its gathered rows from the dotplanes layout, one at a time, where select-kernels would store them so).")
    print("read GB/s: a loop that only reads the same active rows (a 512-bit load a line, the neuron four ahead "
          "prefetched into L2, as the kernel prefetches), timed between the kernel's runs: what this machine "
          "serves rows gathered a neuron at a time; vs read: the kernel's GB/s as a share of it.")
    print("dense GB/s: picc's dense GEMV of the same matrices (4-bit: rows8 layout, int16 x; int8 x for an i8 "
          "row), timed once a round between the sparse runs; vs dense: the sparse kernel's GB/s as a share of it.")
    print("vs numpy: numpy's dense f32 FFN time / this kernel's time on the same shape (> 1: faster).")


if __name__ == "__main__":
    main()
