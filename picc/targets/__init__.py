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
      kernel_overhead: 2us            # optional: a kernel's fixed cost in a CUDA graph (default 4us)
      sync_overhead: 25us             # optional: a stage's graph launch and the host's wait (default 30us)
    pcie_bandwidth: 12GB/s            # required with a GPU (effective, not the link's peak); not allowed without
    pcie_latency: 15us                # optional: one copy between host and GPU, besides its bytes (default 15us)
    cpu:                              # a mapping, or the word ``host`` (detect this machine)
      name: Intel Core i7-12700K
      cores: 8                        # cores the CPU kernels use, a positive integer
      mem_bandwidth: 38.4GB/s         # host memory read bandwidth
      simd: avx2                      # avx512-vnni | avx512 | avx2 | sse
      kernel_rates:                   # optional: bytes/s picc's GEMV reads from memory, by weight
        q4_1: 14GB/s                  #   format (f32 f16 q8_0 q4_0 q4_1, q4_X_xi16, q4_X_r8,
                                      #   q4_X_r8_xi16, q4_X_r8_xi8)

Sizes are a number with an optional unit, case-insensitive, optionally separated by a space:
``11GiB``, ``11 GB``, ``512MiB``, ``0.5GB``, ``1073741824``. Decimal units are powers of 1000 (KB,
MB, GB, TB), binary ones powers of 1024 (KiB, MiB, GiB, TiB); ``B`` or no unit means bytes. A
bandwidth is a size followed by ``/s`` (``616GB/s``) or a plain number of bytes per second. A
duration is a number with a unit (``ns``, ``us``, ``ms``, ``s``) or a plain number of seconds.

The GPU's fixed costs are what a small model's GPU part is made of: a decode step launches ~20
kernels a layer, each costing microseconds however few bytes it reads, and every stage that hands
values between the CPU and the GPU waits for the device and copies across PCIe. The defaults are
conservative guesses; the ``h100`` target's were measured (``bench/gpu``).

``kernel_rates`` is the other half of a CPU's speed: a kernel reads weights no faster than the
memory delivers them nor than its arithmetic gets through them, and 4-bit formats are bound by
the arithmetic on small CPUs (``picc.codegen_cpu.rates``). A format without a rate is taken to
be read at the memory's bandwidth. The ``_xi16`` keys are the 4-bit kernels that dot
int16-rounded x, rows one at a time; the ``_r8``, ``_r8_xi16`` and ``_r8_xi8`` keys read 4-bit
matrices eight rows at a time from the rows8 layout (GEMVs and dense FFNs), with float, int16 and
int8 x.

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

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import TypeVar

import yaml

from picc.errors import PiccError
from picc.kernel_names import CPU_RATE_KEYS, GATHERED_SUFFIX

SIMD_LEVELS = ("avx512-vnni", "avx512", "avx2", "sse")

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
    kernel_overhead: float = 4e-6  # seconds a kernel costs in a CUDA graph besides its bytes
    sync_overhead: float = 30e-6  # seconds a stage's graph launch and the host's wait for it cost


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
        (when known; for a ``_gathered`` key not given, the rate of the same rows one at a time,
        as target files written before those keys had it), at most the memory's bandwidth."""
        rates = dict(self.kernel_rates)
        rate = rates.get(key, rates.get(key.replace(GATHERED_SUFFIX, "")))
        return self.mem_bandwidth if rate is None else min(self.mem_bandwidth, rate)

    def read_seconds(self, reads: Iterable[tuple[int, str]]) -> float:
        """Seconds to read ``(bytes, rate key)`` parts, each at :meth:`read_rate`."""
        return sum(nbytes / self.read_rate(key) for nbytes, key in reads)


@dataclass(frozen=True, slots=True)
class Target:
    """A machine to compile for. ``pcie_bandwidth`` (bytes/s) and ``pcie_latency`` (seconds a copy
    costs besides its bytes) are 0 when there is no GPU. ``source`` is the name or path
    :func:`load_target` read it from (a pipeline prints it), not part of what the target is."""

    name: str
    gpu: GpuSpec | None
    pcie_bandwidth: float
    cpu: CpuSpec
    description: str = ""
    pcie_latency: float = 0.0
    source: str = field(default="", compare=False, repr=False)

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
                            f"of the {self.gpu.name} of target {self.name}; give at most "
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


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s|)\s*$")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}


def parse_duration(text: str) -> float | None:
    """Seconds in ``3us``, ``0.02ms``, ``15 us`` or a plain number of seconds; None when not one."""
    m = _DURATION_RE.match(text)
    return None if m is None else float(m.group(1)) * _SECONDS[m.group(2)]


def _duration(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    seconds = float(v) if isinstance(v, int | float) else parse_duration(v) if isinstance(v, str) else None
    return seconds if seconds is not None and 0 <= seconds < 1 else None


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


_TOP_FIELDS = ("name", "description", "gpu", "pcie_bandwidth", "pcie_latency", "cpu")
_GPU_FIELDS = ("name", "arch", "vram", "mem_bandwidth", "kernel_overhead", "sync_overhead")
_DURATION = "a duration like 3us"
DEFAULT_PCIE_LATENCY = 15e-6
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
        **{key: _get(label, "gpu.", data, key, _duration, _DURATION)
           for key in ("kernel_overhead", "sync_overhead") if key in data},
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
    pcie, latency = 0.0, 0.0
    if isinstance(gpu_data, dict):
        gpu = _gpu(label, gpu_data)
        pcie = _get(label, "", data, "pcie_bandwidth", _bandwidth, "a positive bandwidth like 12GB/s")
        latency = (_get(label, "", data, "pcie_latency", _duration, _DURATION) if "pcie_latency" in data
                   else DEFAULT_PCIE_LATENCY)
    elif gpu_data is not None:
        raise PiccError(f"{label}: gpu: expected a mapping of GPU fields or null, got {gpu_data!r}")
    else:
        for key in ("pcie_bandwidth", "pcie_latency"):
            if key in data:
                raise PiccError(f"{label}: {key}: a target without a GPU has no PCIe link; remove the field")

    cpu_data = data.get("cpu")
    if cpu_data == "host":
        from picc.targets.host import detect_host_cpu

        cpu = detect_host_cpu()
    elif isinstance(cpu_data, dict):
        cpu = _cpu(label, cpu_data)
    elif "cpu" not in data:
        raise PiccError(f"{label}: cpu: missing, expected a mapping of CPU fields or 'host'")
    else:
        raise PiccError(f"{label}: cpu: expected a mapping of CPU fields or 'host', got {cpu_data!r}")
    return Target(name, gpu, pcie, cpu, description, latency)


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
        return replace(target_from_dict(_read_yaml(text, label), label), source=name_or_path)
    path = Path(name_or_path)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PiccError(f"{name_or_path}: cannot read the target file: {e}") from None
        return replace(target_from_dict(_read_yaml(text, name_or_path), name_or_path), source=name_or_path)
    if path.is_dir():
        raise PiccError(f"{name_or_path}: is a directory, not a target file (.yaml)")
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        raise PiccError(f"{name_or_path}: target file not found")
    raise PiccError(f"unknown target {name_or_path!r}: expected one of {', '.join(names)}, or a path to a .yaml file")
