"""The GPU's part of a compiled model, on a host-emulated GPU.

A ``.pib`` compiled for a GPU target carries the GPU's launches bound to the memory plan's arena
(``gpu/launches``: per op, each kernel with the arena offset, shape and dtype of every parameter),
the kernels as CUDA for the target's architecture, and the same kernels built for the host
(``gpu/host.so``, TVM's LLVM build of the same TensorIR). The executors here share everything but
the memory and the kernels they call:

* :class:`EmulatedGpu` keeps the "device" memory in host RAM, allocates it through an
  :class:`EmulatedDevice` that refuses to go over the VRAM budget, and runs the host build: so
  the hybrid split can be run and tested on a machine without a GPU, and a ``.pib`` compiled for
  pc-low runs anywhere (slowly: the host kernels are the GPU's, one thread each).
* ``runtime.cuda.CudaGpu`` does the same on a real device.

Everything lives in one arena of exactly the plan's GPU bytes: weights (uploaded once, laid out
as ``runtime.gpu_layout`` says), constants, KV caches, the activations of one token and the
kernels' workspace. Only activation vectors cross between the host and the device per token.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from runtime import gpu_layout
from runtime.contracts import GREEDY_LAUNCH, Call, launches_from_json
from runtime.pib import PibFile
from runtime.plan import ARENA_ALIGN, GREEDY, MemoryPlan


class GpuError(Exception):
    """A GPU part that cannot run here, or a device out of budget; the message says which."""


class EmulatedDevice:
    """Host memory standing in for a GPU's: allocations are counted against a VRAM budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.allocated = 0
        self.peak = 0
        self._blocks: list[np.ndarray] = []

    def allocate(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of zeroed device memory, ``ARENA_ALIGN``-aligned; over the budget is an error."""
        if self.allocated + nbytes > self.budget:
            raise GpuError(f"the emulated GPU has {self.budget} bytes of VRAM (the plan's budget) and "
                           f"{self.allocated} in use; {nbytes} more do not fit")
        raw = np.zeros(nbytes + ARENA_ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ARENA_ALIGN
        block = raw[start : start + nbytes]
        self._blocks.append(raw)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        return block


GREEDY_RECORD = "@greedy.record"  # the greedy loop's state: a token per position, then the next position
GREEDY_START = "@greedy.start"  # its last word: the position of the loop's first step


def slots(plan: MemoryPlan) -> dict[str, int]:
    """Where each value the runtime copies lives, from the start of the GPU's activations: the
    plan's activation slots and, where the plan has the greedy loop's buffer, its two views
    (:data:`GREEDY_RECORD`, :data:`GREEDY_START`)."""
    out = dict(plan.activation_offsets)
    greedy, activations = plan.buffer(GREEDY), plan.buffer("activations")
    if greedy is not None and activations is not None:
        out[GREEDY_RECORD] = greedy.offset - activations.offset
        out[GREEDY_START] = greedy.offset + 4 * plan.ctx - activations.offset
    return out


@dataclass
class GpuTimes:
    """Seconds spent in GPU work and in copies between host and device, bytes copied, and how the
    work was started: kernels launched one by one (``launches``) or as CUDA graphs replayed
    (``graph_launches``: one per stage). On a CUDA device, ``gpu_seconds`` is device time and
    ``wait_seconds`` the host's time blocked until the GPU's kernels were done (the GPU ahead of
    the CPU on the critical path); the emulated GPU runs its kernels on a host thread and waits
    for nothing."""

    gpu_seconds: float = 0.0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    launches: int = 0
    graph_launches: int = 0


class EmulatedGpu:
    """The GPU part of a ``.pib`` on the host-emulated GPU (see the module docstring)."""

    kind = "emulated"
    asynchronous = False  # run() returns when the kernels are done

    def __init__(self, pib: PibFile) -> None:
        plan = pib.plan()
        self.arena_bytes, budget = plan.gpu_bytes, plan.budget
        if self.arena_bytes > budget:
            raise GpuError(f"{pib.path}: the plan needs {self.arena_bytes} GPU bytes but its budget is {budget}")
        self.device = EmulatedDevice(budget)
        self.arena = self.device.allocate(self.arena_bytes)
        self.arena[:] = arena_image(pib, self.arena_bytes)
        self.times = GpuTimes()
        self._library = _load_host_library(pib)
        self._launches = self._bind(launches_from_json(pib.json("gpu/launches")))
        activations = plan.buffer("activations")
        self._act = activations.offset if activations else 0
        self._slots = slots(plan)

    # --- memory -------------------------------------------------------------------------------------

    def view(self, offset: int, shape: list[int], dtype: str) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if offset < 0 or offset + nbytes > self.arena_bytes:
            raise GpuError(f"a kernel argument of {nbytes} bytes at {offset} lies outside the "
                           f"{self.arena_bytes}-byte GPU arena")
        return self.arena[offset : offset + nbytes].view(dtype).reshape(shape)

    def _bind(self, launches: dict[str, list[Call]]) -> dict[str, list[tuple]]:
        import tvm

        bound: dict[str, list[tuple]] = {}
        for op, calls in launches.items():
            bound[op] = []
            for call in calls:
                fn = self._library[call.kernel]
                args = [tvm.runtime.from_dlpack(self.view(a.offset, list(a.shape), a.dtype)) for a in call.args]
                bound[op].append((fn, args))
        return bound

    @property
    def loops(self) -> bool:
        """Whether the file has the greedy decode loop's kernel (``GREEDY_LAUNCH``)."""
        return GREEDY_LAUNCH in self._launches

    def _slot(self, value: str) -> int:
        return self._act + self._slots[value]

    def has(self, value: str) -> bool:
        return value in self._slots

    def upload(self, value: str, host: np.ndarray) -> None:
        """Host bytes of ``value`` -> its slot on the device (a host-to-device copy)."""
        start = time.perf_counter()
        at = self._slot(value)
        self.arena[at : at + host.nbytes] = host.view(np.uint8).reshape(-1)
        self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += host.nbytes

    def download(self, value: str, host: np.ndarray) -> None:
        """``value``'s slot on the device -> ``host`` (a device-to-host copy of ``host.nbytes``)."""
        start = time.perf_counter()
        at = self._slot(value)
        host.view(np.uint8).reshape(-1)[:] = self.arena[at : at + host.nbytes]
        self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += host.nbytes

    def download_many(self, pairs: list[tuple[str, np.ndarray]]) -> None:
        """Each ``(value, host)`` as :meth:`download` (one wait on a real device)."""
        for value, host in pairs:
            self.download(value, host)

    # --- running ------------------------------------------------------------------------------------

    def run(self, ops: list[str]) -> None:
        """Launch the kernels of ``ops`` in order."""
        start = time.perf_counter()
        for op in ops:
            for fn, args in self._launches.get(op, ()):
                fn(*args)
                self.times.launches += 1
        self.times.gpu_seconds += time.perf_counter() - start

    @property
    def peak_bytes(self) -> int:
        """The most device memory allocated at once."""
        return self.device.peak

    def close(self) -> None:
        self._launches.clear()


def arena_image(pib: PibFile, nbytes: int) -> np.ndarray:
    """The GPU arena as it starts: each weight and constant of the plan at its offset, in the GPU
    layout, and zeros elsewhere (KV caches, activations, workspace)."""
    image = np.zeros(nbytes, np.uint8)
    for b in pib.plan().buffers:
        if b.device != "gpu":
            continue
        name, at, size = b.name, b.offset, b.nbytes
        if at + size > nbytes:
            raise GpuError(f"{pib.path}: plan buffer {name} lies past the {nbytes}-byte GPU arena")
        if b.kind == "weight":
            t = pib.tensor(name)
            need = gpu_layout.gpu_nbytes(t.dtype, t.shape)
            if need != size:
                raise GpuError(f"{pib.path}: weight {name} needs {need} GPU bytes but the plan gives it {size}")
            gpu_layout.write_planes(image[at : at + size], t.data, t.dtype, t.shape)
        elif b.kind == "constant":
            values = np.ascontiguousarray(pib.tensor(f"gpu.const.{name}").data, np.float32)
            image[at : at + size] = values.view(np.uint8)
    return image


def _load_host_library(pib: PibFile):  # noqa: ANN202 - a tvm runtime Module
    """The host build of the GPU kernels, loaded from the ``.pib``."""
    if not pib.has("gpu/host.so"):
        raise GpuError(f"{pib.path}: has GPU ops but no host build of their kernels")
    import tvm

    fd, path = tempfile.mkstemp(prefix="picc-gpu-host-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pib.section("gpu/host.so"))
        return tvm.runtime.load_module(path)  # the loader maps the file; it may go once loaded
    except Exception as e:  # TVM's loader raises its own types
        raise GpuError(f"{pib.path}: cannot load the host build of its GPU kernels: {e}") from None
    finally:
        os.unlink(path)


def cuda_device_count() -> int:
    """How many CUDA devices the NVIDIA driver sees here (0 without a driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if cuda.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    return count.value if cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0
