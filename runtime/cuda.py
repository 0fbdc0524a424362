"""The GPU's part of a compiled model on a real CUDA device, through the NVIDIA driver API.

The pip build of TVM has no CUDA runtime linked in, so this executor does not go through TVM: it
loads the kernels' PTX or cubin that ``picc compile`` put in the ``.pib`` (``cuda/<arch>/model.*``,
one module holding every kernel) with ``cuModuleLoadData`` and launches each ``__global__``
function with the grid, block and argument order recorded at compile time (``cuda/manifest``:
TVM's launch configuration, read off the scheduled kernels). Only ``libcuda`` (the driver) is needed at run time.

Memory is the same as on the host-emulated GPU (``runtime.gpu``): one allocation of exactly the
plan's GPU bytes, weights uploaded once in ``runtime.gpu_layout``'s layout, activation vectors
copied per token. Kernels run in order on the default stream; ``run`` waits for them, so its time
is the device's.

This file cannot be exercised on a machine without a GPU; the tests marked ``gpu`` run it.
"""

from __future__ import annotations

import ctypes
import time

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
        arch = manifest["arch"]
        # A cubin runs only on its own architecture; PTX is JIT-compiled for this one or newer.
        use_cubin = arch == self.device_arch and "cubin" in manifest["compiled"]
        if not use_cubin and "ptx" not in manifest["compiled"]:
            raise GpuError(f"{pib.path} holds CUDA for {arch} without PTX (nvcc was not found at compile time) "
                           f"and this device is {self.device_arch}; recompile where nvcc is installed")
        if int(arch[3:]) > int(self.device_arch[3:]):
            raise GpuError(f"{pib.path} was compiled for {arch}; this device is {self.device_arch}: "
                           f"recompile with a target for it")
        data = pib.section(f"cuda/{arch}/model.{'cubin' if use_cubin else 'ptx'}")
        module = ctypes.c_void_p()
        self.cu("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(data if use_cubin else data + b"\0"))
        self._modules.append(module)
        functions = {}
        for launches in manifest["kernels"].values():
            for launch in launches:
                fn = ctypes.c_void_p()
                self.cu("cuModuleGetFunction", ctypes.byref(fn), module, launch["entry"].encode())
                functions[launch["entry"]] = fn
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
