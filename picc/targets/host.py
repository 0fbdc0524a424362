"""The host's CPU as a target (``cpu: host`` in a target file, the ``cpu`` target): its model name,
the cores this process may run on, its SIMD level, its memory's read bandwidth and the rate picc's
own GEMV reads each weight format at. The measurements take a few seconds and vary between runs, so
they are made once and cached (see ``picc.targets``)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import threading
import time
from pathlib import Path

import numpy as np

from picc.blas import blas_threads
from picc.errors import PiccError
from picc.fsutil import cache_root, keep_cached
from picc.kernel_names import CPU_RATE_KEYS
from picc.targets import CpuSpec
from runtime.cpu import simd_level

# 2: the bandwidth is read by every core at once (1: one stream); 3: kernel rates beside it;
# 4: int16 x and the rows8 layout's rates (the _xi16 keys are gone).
# 5: the fused sparse FFN's rates on gathered rows (the _gathered keys).
HOST_CACHE_VERSION = 5


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def host_cpu_name(cpuinfo: str | None = None) -> str:
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    m = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    return m.group(1).strip() if m else (platform.processor() or platform.machine() or "host CPU")


def host_simd(cpuinfo: str | None = None) -> str:
    """The SIMD level the ``cpu`` target compiles for: ``avx512-vnni``, ``avx512``, ``avx2`` or
    ``sse`` (``runtime.cpu.simd_level`` of the first ``flags`` line of /proc/cpuinfo, whose
    ``avx512_vnni`` is LLVM's ``avx512vnni``). On ``avx512-vnni`` only the kernels written for it use
    VNNI (``vpdpbusd``: the batched rows8 ones, the batch step 6-12% faster on a Zen 4; the q8_0 LM
    head; the sparse FFN with rounded x); every other kernel is compiled as for ``avx512``, whose
    one-row step was 3-4% faster than the same kernels compiled with VNNI."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    m = re.search(r"^flags\s*:\s*(.*)$", info, re.MULTILINE)
    return simd_level(f.replace("avx512_vnni", "avx512vnni") for f in (m.group(1).split() if m else ()))


def host_vnni(cpuinfo: str | None = None) -> str:
    """The VNNI extensions the host has (``avx512_vnni``, ``avx_vnni``), for naming the machine of
    a measurement ("none" without)."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    m = re.search(r"^flags\s*:\s*(.*)$", info, re.MULTILINE)
    found = [f for f in ("avx512_vnni", "avx_vnni") if m and f in m.group(1).split()]
    return ", ".join(found) or "no VNNI"


def is_host(cpu) -> bool:  # noqa: ANN001 - a picc.targets.CpuSpec (imported from there)
    """Whether ``cpu`` describes the machine this runs on: its model, cores and SIMD level."""
    return (cpu.name, cpu.cores, cpu.simd) == (host_cpu_name(), host_cores(), host_simd())


def host_cores() -> int:
    """The cores this process may run on (affinity, so containers and ``taskset`` are honoured)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Host memory read bandwidth in bytes/s, all cores reading: the best of ``repeats`` streams
    over ``nbytes``, split between :func:`host_cores` threads.

    Each thread streams its share with a BLAS dot product of two halves (numpy releases the GIL
    for it), which runs at the memory's speed; ``np.sum`` does pairwise summation and is
    compute-bound at about half of it. One BLAS dot is one thread here, and one core does not
    saturate the memory: on the 2-core build machine one stream reads ~21 GB/s, two ~32 GB/s,
    what picc's own f32 GEMV reaches on two threads. The array is far larger than any cache, so
    it is read from memory every time.
    """
    data = np.ones(max(nbytes // 4, 2), dtype=np.float32)  # ones, not empty: every page is touched
    threads = max(1, min(host_cores(), data.size // 2))
    # Thread t dots the t-th pieces of the two halves of ``data``.
    half = data.size // 2
    edges = np.linspace(0, half, threads + 1).astype(int)
    pieces = [(data[a:b], data[half + a : half + b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    start_line = threading.Barrier(threads)
    spans: list[list[tuple[float, float]]] = [[] for _ in pieces]

    def reader(t: int) -> None:
        left, right = pieces[t]
        for _ in range(repeats + 1):
            start_line.wait()
            begin = time.perf_counter()
            float(np.dot(left, right))
            spans[t].append((begin, time.perf_counter()))

    # Each round's time runs from its first reader's start to its last reader's end, as the
    # readers time themselves: a thread waking from the barrier late (the GIL) would otherwise
    # shorten the round. The first round warms up.
    with blas_threads(1):  # one BLAS thread per reader: the readers are the parallelism
        workers = [threading.Thread(target=reader, args=(t,), daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    rounds = [(min(b for b, _ in r), max(e for _, e in r)) for r in zip(*spans, strict=True)][1:]
    best = min(end - begin for begin, end in rounds)
    return 2 * int(edges[-1]) * 4 / max(best, 1e-9)


def host_cache_path() -> Path:
    return cache_root() / "targets" / "host-cpu.json"


def measure_kernel_rates(threads: int) -> dict[str, float]:
    """``picc.codegen_cpu.rates.measure_kernel_rates``, or {} where the kernels cannot be built
    (a CPU without AVX2): the cost model then takes every format to be bound by memory."""
    from picc.codegen_cpu.rates import measure_kernel_rates as measure

    try:
        return measure(threads)
    except (PiccError, RuntimeError, OSError):
        return {}


def kernels_fingerprint() -> str:
    """A hash of the sources of ``picc.codegen_cpu``: a changed code generator may change its
    kernels' rates, so cached rates are only good for the kernels they were measured on."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parent.parent / "codegen_cpu").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def detect_host_cpu() -> CpuSpec:
    """This machine's CPU; bandwidth and kernel rates are measured on first use and cached per CPU
    model and core count (the rates are for all the cores this process may use)."""
    info = _cpuinfo()
    name, cores, kernels = host_cpu_name(info), host_cores(), kernels_fingerprint()
    path = host_cache_path()
    bandwidth, rates = None, None
    try:
        cached = json.loads(path.read_text())
        if (cached.get("version"), cached.get("cpu"), cached.get("cores")) == (HOST_CACHE_VERSION, name, cores):
            bandwidth = float(cached["mem_bandwidth"])
            if cached.get("kernels") == kernels:
                rates = {str(k): float(v) for k, v in cached["kernel_rates"].items() if k in CPU_RATE_KEYS and v > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache or a damaged one: measure again
    if bandwidth is None or not bandwidth > 0 or rates is None:  # measured together: the same moment
        bandwidth = measure_memory_bandwidth()
        rates = measure_kernel_rates(cores)
        entry = json.dumps({"version": HOST_CACHE_VERSION, "cpu": name, "cores": cores, "kernels": kernels,
                            "mem_bandwidth": bandwidth, "kernel_rates": rates})
        keep_cached(path, lambda f: f.write(entry.encode()))
    return CpuSpec(name, cores, bandwidth, host_simd(info), tuple(sorted(rates.items())))
