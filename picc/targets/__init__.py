"""Targets: the machine a model is compiled for (GPU, PCIe link, CPU), read from YAML.

A target is chosen by name (``pc-high``, ``pc-low``, ``cpu``: the YAML files in this package) or
by the path of a YAML file of the same form::

    name: pc-low                      # required, a string
    description: RTX 2080 Ti box      # optional, a string
    gpu:                              # a mapping, or null / absent for a machine without a GPU
      name: NVIDIA GeForce RTX 2080 Ti
      arch: sm_75                     # the CUDA architecture, sm_NN (sm_NNN, sm_90a accepted)
      vram: 11GiB                     # a size (see below); what the driver reports as total
      mem_bandwidth: 616GB/s          # a bandwidth (see below)
    pcie_bandwidth: 12GB/s            # required with a GPU (effective, not the link's peak); not allowed without
    cpu:                              # a mapping, or the word ``host`` (detect this machine)
      name: Intel Core i7-12700K
      cores: 8                        # cores the CPU kernels use, a positive integer
      mem_bandwidth: 38.4GB/s         # host memory read bandwidth
      simd: avx2                      # avx512 | avx2 | sse
      kernel_rates:                   # optional: bytes/s picc's GEMV reads from memory, by weight
        q4_1: 14GB/s                  #   format (f32 f16 q8_0 q4_0 q4_1, q4_X_xi16, q4_X_r8, q4_X_r8_xi16)

Sizes are a number with an optional unit, case-insensitive, optionally separated by a space:
``11GiB``, ``11 GB``, ``512MiB``, ``0.5GB``, ``1073741824``. Decimal units are powers of 1000 (KB,
MB, GB, TB), binary ones powers of 1024 (KiB, MiB, GiB, TiB); ``B`` or no unit means bytes. A
bandwidth is a size followed by ``/s`` (``616GB/s``) or a plain number of bytes per second.

``kernel_rates`` is the other half of a CPU's speed: a kernel reads weights no faster than the
memory delivers them nor than its arithmetic gets through them, and 4-bit formats are bound by
the arithmetic on small CPUs (``picc.codegen_cpu.rates``). A format without a rate is taken to
be read at the memory's bandwidth. The ``_xi16`` keys are the 4-bit kernels that dot
int16-rounded x, rows one at a time; the ``_r8`` and ``_r8_xi16`` keys read 4-bit matrices eight
rows at a time from the rows8 layout (GEMVs and dense FFNs), with float and int16 x.

``cpu: host`` detects the cores this process may run on (``sched_getaffinity``), the SIMD level
(``avx512f`` / ``avx2`` in ``/proc/cpuinfo``), measures the memory read bandwidth and times
picc's own GEMV in each format streaming from memory, once; the measurements are cached in
``$PICC_CACHE_DIR/targets/host-cpu.json`` (default ``~/.cache/picc``), keyed by the CPU's model
name and core count, because they take a few seconds and vary between runs; and by a hash of
picc's CPU code generator, since the kernel rates are those of the kernels it generates.

Every mistake in a file is a one-line :class:`PiccError` naming the file and the field's path,
e.g. ``pc-x.yaml: gpu.vram: expected a size like 11GiB, got 'lots'``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import TypeVar

import numpy as np
import yaml

from picc.blas import blas_threads
from picc.errors import PiccError
from picc.fsutil import cache_root, keep_cached
from picc.kernel_names import CPU_RATE_KEYS

SIMD_LEVELS = ("avx512", "avx2", "sse")
# 2: the bandwidth is read by every core at once (1: one stream); 3: kernel rates beside it;
# 4: int16 x and the rows8 layout's rates (the _xi16 keys are gone).
HOST_CACHE_VERSION = 4

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d{1,2})?)\s*([a-z]*)\s*$", re.IGNORECASE)
_ARCH_RE = re.compile(r"^sm_\d{2,3}[a-z]?$")
SIZE_FORMS = ("11GB, 11GiB, 11000MB, 512MiB, 0.5GB, a plain byte count or 0 "
              "(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU: ``arch`` is the CUDA architecture (``sm_75``); bandwidth in bytes/s."""

    name: str
    arch: str
    vram_bytes: int
    mem_bandwidth: float


@dataclass(frozen=True, slots=True)
class CpuSpec:
    """A CPU: the cores picc's kernels use, host memory read bandwidth (bytes/s), SIMD level."""

    name: str
    cores: int
    mem_bandwidth: float
    simd: str  # one of SIMD_LEVELS
    # (key, bytes/s) for keys of kernel_names.CPU_RATE_KEYS, sorted: see the module docstring.
    kernel_rates: tuple[tuple[str, float], ...] = ()

    def read_rate(self, key: str) -> float:
        """Bytes/s at which a kernel of rate key ``key`` reads its weights: its measured rate
        (when known), at most the memory's bandwidth."""
        rate = dict(self.kernel_rates).get(key)
        return self.mem_bandwidth if rate is None else min(self.mem_bandwidth, rate)

    def read_seconds(self, reads: Iterable[tuple[int, str]]) -> float:
        """Seconds to read ``(bytes, rate key)`` parts, each at :meth:`read_rate`."""
        return sum(nbytes / self.read_rate(key) for nbytes, key in reads)


@dataclass(frozen=True, slots=True)
class Target:
    """A machine to compile for. ``pcie_bandwidth`` (bytes/s) is 0 when there is no GPU."""

    name: str
    gpu: GpuSpec | None
    pcie_bandwidth: float
    cpu: CpuSpec
    description: str = ""

    @property
    def vram_bytes(self) -> int:
        """The GPU's memory, 0 without a GPU (the default ``--vram``)."""
        return 0 if self.gpu is None else self.gpu.vram_bytes

    def check_budget(self, budget: int, text: str, what: str = "--vram") -> None:
        """Refuse a VRAM budget (``text``, ``budget`` bytes) that this target's GPU cannot hold:
        a plan made for it would fail at load with the device out of memory."""
        if self.gpu is None:
            if budget > 0:
                raise PiccError(f"{what} {text}: target {self.name!r} has no GPU; use {what} 0 or a GPU target")
            return
        if budget > self.gpu.vram_bytes:
            raise PiccError(f"{what} {text}: {format_size(budget)} is more than the {format_size(self.gpu.vram_bytes)} "
                            f"of target {self.name!r}'s GPU ({self.gpu.name}); give at most "
                            f"{format_size(self.gpu.vram_bytes)}, or a target with a larger GPU")


def format_size(nbytes: int) -> str:
    """``nbytes`` for a message: ``11.0 GiB``, ``512.0 MiB``, ``700.0 KiB``, ``12 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


# --- sizes -----------------------------------------------------------------------------------


def _size_or_none(text: str) -> int | None:
    m = _SIZE_RE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        return None
    try:
        value = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    except InvalidOperation:
        return None
    if _UNITS[m.group(2).lower()] == 1 and value != value.to_integral_value():
        return None  # a byte count is a whole number
    # Fractions of a byte (0.3KiB) round down: a budget must never grow by parsing it.
    return int(value)


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes in ``text`` (``11GB``, ``11GiB``, ``11000MB``, ``512MiB``, ``0.5GB``, ``1234``, ``0``).

    ``what`` names the value in the error (``--vram``), which shows every accepted form.
    """
    size = _size_or_none(text)
    if size is None:
        raise PiccError(f"{what} {text!r}: expected a size such as {SIZE_FORMS}")
    return size


def parse_bandwidth(text: str) -> float | None:
    """Bytes/s in ``616GB/s`` or in a plain number (``6.16e11``); None when ``text`` is neither."""
    text = text.strip()
    if text.lower().endswith("/s"):
        size = _size_or_none(text[:-2])
        return None if size is None else float(size)
    m = _SIZE_RE.match(text)
    return float(Decimal(m.group(1))) if m is not None and m.group(2) == "" else None


# --- the schema ------------------------------------------------------------------------------
# A field parser turns a YAML value into the field's value, or returns None when it is not one;
# the field's description completes "expected ..." in the error.

T = TypeVar("T")


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v.strip() else None


def _size(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    size = v if isinstance(v, int) else _size_or_none(v) if isinstance(v, str) else None
    return size if size is not None and size > 0 else None


def _bandwidth(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    bw = float(v) if isinstance(v, int | float) else parse_bandwidth(v) if isinstance(v, str) else None
    return bw if bw is not None and 0 < bw < float("inf") else None


def _arch(v: object) -> str | None:
    return v if isinstance(v, str) and _ARCH_RE.match(v) else None


def _cores(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _simd(v: object) -> str | None:
    return v if isinstance(v, str) and v in SIMD_LEVELS else None


_TOP_FIELDS = ("name", "description", "gpu", "pcie_bandwidth", "cpu")
_GPU_FIELDS = ("name", "arch", "vram", "mem_bandwidth")
_CPU_FIELDS = ("name", "cores", "mem_bandwidth", "simd", "kernel_rates")
_STRING = "a non-empty string"


def _check_keys(label: str, section: str, data: Mapping[str, object], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            raise PiccError(f"{label}: {section}{key}: unknown field (expected one of {', '.join(allowed)})")


def _get(label: str, section: str, data: Mapping[str, object], key: str,
         parse: Callable[[object], T | None], expected: str) -> T:
    """``data[key]`` parsed, or the one-line error naming ``label`` and the field's path."""
    if key not in data:
        raise PiccError(f"{label}: {section}{key}: missing, expected {expected}")
    value = parse(data[key])
    if value is None:
        raise PiccError(f"{label}: {section}{key}: expected {expected}, got {data[key]!r}")
    return value


def _gpu(label: str, data: Mapping[str, object]) -> GpuSpec:
    _check_keys(label, "gpu.", data, _GPU_FIELDS)
    return GpuSpec(
        name=_get(label, "gpu.", data, "name", _str, _STRING),
        arch=_get(label, "gpu.", data, "arch", _arch, "a CUDA architecture like sm_75"),
        vram_bytes=_get(label, "gpu.", data, "vram", _size, "a size like 11GiB"),
        mem_bandwidth=_get(label, "gpu.", data, "mem_bandwidth", _bandwidth, "a positive bandwidth like 616GB/s"),
    )


def _cpu(label: str, data: Mapping[str, object]) -> CpuSpec:
    _check_keys(label, "cpu.", data, _CPU_FIELDS)
    return CpuSpec(
        name=_get(label, "cpu.", data, "name", _str, _STRING),
        cores=_get(label, "cpu.", data, "cores", _cores, "a positive integer"),
        mem_bandwidth=_get(label, "cpu.", data, "mem_bandwidth", _bandwidth, "a positive bandwidth like 38.4GB/s"),
        simd=_get(label, "cpu.", data, "simd", _simd, f"one of {', '.join(SIMD_LEVELS)}"),
        kernel_rates=_kernel_rates(label, data.get("kernel_rates", {})),
    )


def _kernel_rates(label: str, data: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(data, dict):
        raise PiccError(f"{label}: cpu.kernel_rates: expected a mapping of weight formats to bandwidths, "
                        f"got {data!r}")
    _check_keys(label, "cpu.kernel_rates.", data, CPU_RATE_KEYS)
    return tuple(sorted((key, _get(label, "cpu.kernel_rates.", data, key, _bandwidth,
                                   "a positive bandwidth like 14GB/s")) for key in data))


def target_from_dict(data: object, label: str) -> Target:
    """Validate a parsed YAML document; ``label`` (the file) starts every error message."""
    if not isinstance(data, dict):
        raise PiccError(f"{label}: expected a mapping of target fields ({', '.join(_TOP_FIELDS)}), "
                        f"got {type(data).__name__}")
    _check_keys(label, "", data, _TOP_FIELDS)
    name = _get(label, "", data, "name", _str, _STRING)
    description = _get(label, "", data, "description", _str, _STRING) if "description" in data else ""

    gpu_data = data.get("gpu")
    gpu: GpuSpec | None = None
    pcie = 0.0
    if isinstance(gpu_data, dict):
        gpu = _gpu(label, gpu_data)
        pcie = _get(label, "", data, "pcie_bandwidth", _bandwidth, "a positive bandwidth like 12GB/s")
    elif gpu_data is not None:
        raise PiccError(f"{label}: gpu: expected a mapping of GPU fields or null, got {gpu_data!r}")
    elif "pcie_bandwidth" in data:
        raise PiccError(f"{label}: pcie_bandwidth: a target without a GPU has no PCIe link; remove the field")

    cpu_data = data.get("cpu")
    if cpu_data == "host":
        cpu = detect_host_cpu()
    elif isinstance(cpu_data, dict):
        cpu = _cpu(label, cpu_data)
    elif "cpu" not in data:
        raise PiccError(f"{label}: cpu: missing, expected a mapping of CPU fields or 'host'")
    else:
        raise PiccError(f"{label}: cpu: expected a mapping of CPU fields or 'host', got {cpu_data!r}")
    return Target(name, gpu, pcie, cpu, description)


# --- loading ---------------------------------------------------------------------------------


def target_names() -> tuple[str, ...]:
    """The targets shipped with picc."""
    files = resources.files(__name__).iterdir()
    return tuple(sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml")))


def _read_yaml(text: str, label: str) -> object:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PiccError(f"{label}: not valid YAML{where}: {problem}") from None


def load_target(name_or_path: str) -> Target:
    """The target called ``name_or_path`` (see :func:`target_names`), or the one in that YAML file."""
    names = target_names()
    if name_or_path in names:
        label = f"{name_or_path}.yaml"
        text = (resources.files(__name__) / label).read_text()
        return target_from_dict(_read_yaml(text, label), label)
    path = Path(name_or_path)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PiccError(f"{name_or_path}: cannot read the target file: {e}") from None
        return target_from_dict(_read_yaml(text, name_or_path), name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        raise PiccError(f"{name_or_path}: target file not found")
    raise PiccError(f"unknown target {name_or_path!r}: expected one of {', '.join(names)}, or a path to a .yaml file")


# --- the host --------------------------------------------------------------------------------


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
    """``avx512`` (avx512f), ``avx2`` or ``sse``, from the first ``flags`` line of /proc/cpuinfo."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    m = re.search(r"^flags\s*:\s*(.*)$", info, re.MULTILINE)
    flags = set(m.group(1).split()) if m else set()
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"


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
