"""The NVIDIA driver API as picc's CUDA executor calls it (``runtime.cuda``): loading ``libcuda``,
one checked entry point for every call (:class:`Driver`, which also keeps a context current on
every calling thread), the structures of ``cuLaunchKernelEx`` for dependent launches, a kernel
launch bound to its arguments once, and nvcc for a file that carries CUDA sources only."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from runtime.gpu import GpuError

u64 = ctypes.c_uint64

ATTR_CC_MAJOR, ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream
CAPTURE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: other threads' calls stay legal
EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL: in a capture, a timing record node
EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING: an event only waited for is cheaper
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("count", ctypes.c_uint)]


class BoundLaunch(NamedTuple):
    """One launch of an op's kernel, its arguments bound to the arena once: the function, grid and
    block, the argument array (and the pointers it points at, kept alive), the entry's name, and
    the same launch as a dependent launch's config."""

    fn: ctypes.c_void_p
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: ctypes.Array
    pointers: list
    entry: str
    config: LaunchConfig


def dependent_launch_config(grid: tuple[int, int, int], block: tuple[int, int, int],
                            stream: ctypes.c_void_p) -> LaunchConfig:
    """A launch that may start before the kernel ahead of it in ``stream`` is done (programmatic
    stream serialization): for kernels that wait for their predecessors themselves."""
    attr = LaunchAttribute(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0, stream,
                          ctypes.pointer(attr), 1)
    config._attr = attr  # type: ignore[attr-defined] - keeps the attribute alive with the config
    return config
def libcuda() -> ctypes.CDLL:
    """The NVIDIA driver library."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GpuError(f"cannot load the NVIDIA driver (libcuda.so.1): {e}") from None


class Driver:
    """The driver calls picc makes, each checked (a failure is a GpuError naming the call).

    The one place every call goes through: once :meth:`use` has named a context, a thread's first
    call makes that context current on it (the driver keeps one per thread; a thread that never set
    one, like the executor's worker, has none and every call there would fail with
    ``CUDA_ERROR_INVALID_CONTEXT``). ``lib`` is ``libcuda`` unless a test passes a stand-in.
    """

    def __init__(self, lib: object | None = None) -> None:
        self.lib = lib if lib is not None else libcuda()
        self._ctx: ctypes.c_void_p | None = None
        self._ctx_value: int | None = None  # the context's handle, as threads record it
        self._current = threading.local()  # .ctx: the context this thread made current
        self._fns: dict[str, Callable[..., int]] = {}  # the library's entry points, looked up once

    def use(self, ctx: ctypes.c_void_p) -> None:
        """Make ``ctx`` current on every thread that calls the driver from now on."""
        self._ctx, self._ctx_value = ctx, ctx.value
        self._current.ctx = None
        self._ensure_current()

    def _ensure_current(self) -> None:
        if self._ctx is not None and getattr(self._current, "ctx", None) != self._ctx_value:
            self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self._ctx))
            self._current.ctx = self._ctx_value

    def _fn(self, name: str) -> Callable[..., int]:
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = getattr(self.lib, name)
        return fn

    def __call__(self, name: str, *args: object) -> None:
        # A decode step makes a few dozen calls: the common case (context current, call
        # succeeded) is kept to a thread-local read, a dict lookup and the call.
        if getattr(self._current, "ctx", None) != self._ctx_value:
            self._ensure_current()
        result = self._fn(name)(*args)
        if result != 0:
            self._check(name, result)

    def status(self, name: str, *args: object) -> int:
        """Call ``name`` and return its result code unchecked (for calls whose failure is an answer)."""
        self._ensure_current()
        return int(self._fn(name)(*args))

    def _check(self, name: str, result: int) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(text))
            raise GpuError(f"CUDA {name} failed: {(text.value or b'?').decode()} ({result})")


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
