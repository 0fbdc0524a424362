"""The GPU's part of a compiled model on a real CUDA device, through the NVIDIA driver API.

The pip build of TVM has no CUDA runtime linked in, so this executor does not go through TVM: it
loads the kernels' PTX or cubin that ``picc compile`` put in the ``.pib`` (``cuda/<arch>/model.*``,
one module holding every kernel) with ``cuModuleLoadData`` and launches each ``__global__``
function with the grid, block and argument order recorded at compile time (``cuda/manifest``:
TVM's launch configuration, read off the scheduled kernels). Only ``libcuda`` (the driver) is
needed at run time -- and nvcc, for a file written where nvcc was missing, whose CUDA sources are
compiled to PTX when it is loaded.

Memory is the same as on the host-emulated GPU (``runtime.gpu``): one allocation of exactly the
plan's GPU bytes, weights uploaded once in ``runtime.gpu_layout``'s layout, activation vectors
copied per token. Kernels run in order on the default stream; ``run`` waits for them, so its time
is the device's.

This file cannot be exercised on a machine without a GPU; the tests marked ``gpu`` run it.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from runtime.gpu import GpuError, GpuTimes, arena_image
from runtime.pib import PibFile

_u64 = ctypes.c_uint64


class _Driver:
    """The few driver calls picc needs, each checked (a failure is a GpuError naming the call)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise GpuError(f"cannot load the NVIDIA driver (libcuda.so.1): {e}") from None

    def __call__(self, name: str, *args: object) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(text))
            raise GpuError(f"CUDA {name} failed: {(text.value or b'?').decode()} ({result})")


class CudaGpu:
    """The GPU part of a ``.pib`` on CUDA device 0 (see the module docstring)."""

    kind = "cuda"

    def __init__(self, pib: PibFile) -> None:
        self.cu = cu = _Driver()
        cu("cuInit", 0)
        device = ctypes.c_int()
        cu("cuDeviceGet", ctypes.byref(device), 0)
        major, minor = ctypes.c_int(), ctypes.c_int()
        cu("cuDeviceGetAttribute", ctypes.byref(major), 75, device)  # COMPUTE_CAPABILITY_MAJOR
        cu("cuDeviceGetAttribute", ctypes.byref(minor), 76, device)  # COMPUTE_CAPABILITY_MINOR
        self.device_arch = f"sm_{major.value}{minor.value}"
        self._ctx = ctypes.c_void_p()
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), device)
        cu("cuCtxSetCurrent", self._ctx)
        self._device = device
        manifest = pib.json("cuda/manifest")
        plan = pib.json("plan")
        self.arena_bytes = int(plan["gpu_bytes"])
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        cu("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        if self.arena_bytes > free.value:
            raise GpuError(f"the plan needs {self.arena_bytes} bytes of VRAM but the device has {free.value} free")
        self.base = _u64()
        cu("cuMemAlloc_v2", ctypes.byref(self.base), ctypes.c_size_t(self.arena_bytes))
        image = arena_image(pib, self.arena_bytes)  # weights and constants in place, the rest zero
        cu("cuMemcpyHtoD_v2", self.base, image.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(image.nbytes))
        self._slots = {k: int(v) for k, v in plan["activation_offsets"].items()}
        activations = next((b for b in plan["buffers"] if b["name"] == "activations"), None)
        self._act = int(activations["offset"]) if activations else 0
        self._modules: list[ctypes.c_void_p] = []
        self._functions = self._load(pib, manifest)
        self._launches = self._bind(pib.json("gpu/launches"), manifest)
        self.times = GpuTimes()

    def _load(self, pib: PibFile, manifest: dict) -> dict[str, ctypes.c_void_p]:
        """Each ``__global__`` function of the file's kernels, loaded on the device: from its cubin
        (same architecture) or PTX (this one or older), else compiled here from its CUDA sources."""
        arch = manifest["arch"]
        if int(arch[3:]) > int(self.device_arch[3:]):
            raise GpuError(f"{pib.path} was compiled for {arch}; this device is {self.device_arch}: "
                           f"recompile with a target for it")
        # A cubin runs only on its own architecture; PTX is JIT-compiled for this one or newer.
        if arch == self.device_arch and "cubin" in manifest["compiled"]:
            images = [pib.section(f"cuda/{arch}/model.cubin")]
        elif "ptx" in manifest["compiled"]:
            images = [pib.section(f"cuda/{arch}/model.ptx") + b"\0"]
        else:  # nvcc was not found at compile time: the sources, compiled at load
            sources = {k: pib.text(f"cuda/{arch}/{k}.cu") for k in manifest["kernels"]}
            images = [ptx + b"\0" for ptx in compile_at_load(sources, self.device_arch).values()]
        functions = {}
        entries = [launch["entry"] for launches in manifest["kernels"].values() for launch in launches]
        for image in images:
            module = ctypes.c_void_p()
            self.cu("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
            self._modules.append(module)
            for entry in entries:
                fn = ctypes.c_void_p()
                if self.cu.lib.cuModuleGetFunction(ctypes.byref(fn), module, entry.encode()) == 0:
                    functions[entry] = fn
        missing = [e for e in entries if e not in functions]
        if missing:
            raise GpuError(f"{pib.path}: its CUDA code lacks the kernels {missing[:3]}")
        return functions

    def _bind(self, launches: dict[str, list[dict]], manifest: dict) -> dict[str, list[tuple]]:
        bound: dict[str, list[tuple]] = {}
        for op, calls in launches.items():
            bound[op] = []
            for call in calls:
                where = {a["param"]: a["offset"] for a in call["args"]}
                for launch in manifest["kernels"][call["kernel"]]:
                    pointers = [_u64(self.base.value + where[p]) for p in launch["params"]]
                    args = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(p) for p in pointers])
                    bound[op].append((self._functions[launch["entry"]], launch["grid"], launch["block"], args,
                                      pointers))
        return bound

    def has(self, value: str) -> bool:
        return value in self._slots

    def upload(self, value: str, host: np.ndarray) -> None:
        start = time.perf_counter()
        at = _u64(self.base.value + self._act + self._slots[value])
        self.cu("cuMemcpyHtoD_v2", at, host.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(host.nbytes))
        self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += host.nbytes

    def download(self, value: str, host: np.ndarray) -> None:
        start = time.perf_counter()
        at = _u64(self.base.value + self._act + self._slots[value])
        self.cu("cuMemcpyDtoH_v2", host.ctypes.data_as(ctypes.c_void_p), at, ctypes.c_size_t(host.nbytes))
        self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += host.nbytes

    def run(self, ops: list[str]) -> None:
        """Launch the kernels of ``ops`` in order and wait for them."""
        start = time.perf_counter()
        for op in ops:
            for fn, grid, block, args, _ in self._launches.get(op, ()):
                self.cu("cuLaunchKernel", fn, *grid, *block, 0, None, args, None)
                self.times.launches += 1
        self.cu("cuCtxSynchronize")
        self.times.gpu_seconds += time.perf_counter() - start

    @property
    def peak_bytes(self) -> int:
        """Device memory this executor allocated: the one arena of the plan's GPU bytes."""
        return self.arena_bytes if self.base.value else 0

    def close(self) -> None:
        for module in self._modules:
            self.cu("cuModuleUnload", module)
        self._modules.clear()
        if self.base.value:
            self.cu("cuMemFree_v2", self.base)
            self.base = _u64()
        self.cu("cuDevicePrimaryCtxRelease", self._device)


def compile_at_load(sources: dict[str, str], arch: str) -> dict[str, bytes]:
    """PTX for ``arch`` of each CUDA source (each compiles alone), with the nvcc on this machine:
    for a ``.pib`` written where nvcc was missing."""
    nvcc = shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)
    if nvcc is None:
        raise GpuError("this .pib holds CUDA sources only (nvcc was missing when it was compiled) and nvcc is not "
                       "installed here either; install the CUDA toolkit, or recompile where nvcc is")
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="picc-cuda-") as tmp:
        for name, source in sources.items():
            cu, ptx = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.ptx"
            cu.write_text(source)
            proc = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-w", "-o", str(ptx), str(cu)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip())
                raise GpuError(f"nvcc could not compile kernel {name} for {arch}: {first}")
            out[name] = ptx.read_bytes()
    return out
