"""A stand-in for ``libcuda`` that keeps the driver's rules and runs kernels on the host.

``runtime.cuda.CudaGpu`` talks to the NVIDIA driver through ctypes; this object answers the same
calls, with the same argument conventions (output parameters by pointer, result codes), so the CUDA
executor can be run where there is no GPU. It keeps the rules whose breach a real driver punishes
and an emulator would forgive:

* **one current context per thread**: a call other than the few that need none, from a thread that
  never made a context current, fails with ``CUDA_ERROR_INVALID_CONTEXT`` (201), as on a real device;
* **streams are queues**: asynchronous copies and launches run only when the stream is waited
  for, in order, so a host buffer changed before its queued copy ran shows up as wrong numbers;
* **graphs**: launches on a capturing stream are recorded, not run; ``cuGraphLaunch`` replays them;
* **events** mark a place in a stream's queue: ``cuEventSynchronize`` runs the queue up to there
  and no further, so work queued after it has not happened yet;
* **asynchronous copies need page-locked host memory** (``cuMemHostAlloc``'s, or memory
  ``cuMemHostRegister`` locked): a copy from or to other memory is refused. (Stricter than the
  driver, which makes such a copy synchronous -- and cannot capture it into a graph -- but picc
  never means to ask for that.) Registering memory twice, or unregistering what was not, fails.

A launched kernel runs through the ``.pib``'s host build of the same kernels (``gpu/host.so``),
bound to the fake device memory at the addresses the launch passed: so the executor's bindings,
copies and graphs are checked by the numbers they produce.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import numpy as np

from runtime.contracts import Call, CudaManifest, launches_from_json
from runtime.gpu import _load_host_library
from runtime.pib import PibFile

INVALID_CONTEXT = 201
NEEDS_NO_CONTEXT = {"cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
                    "cuDevicePrimaryCtxRelease", "cuCtxSetCurrent", "cuGetErrorName", "cuDeviceGetCount"}


def _out(arg: object) -> ctypes._SimpleCData:
    """The object behind a ``ctypes.byref`` argument (where the driver writes a result)."""
    return arg._obj  # type: ignore[attr-defined]


def _value(arg: object) -> int:
    """An integer argument as ctypes passes it (a plain int or a ctypes scalar)."""
    return int(getattr(arg, "value", arg) or 0)


class FakeCuda:
    """The driver calls ``runtime.cuda`` makes, on host memory (see the module docstring)."""

    def __init__(self, pib: PibFile, arch: str | None = None) -> None:
        manifest = CudaManifest.from_json(pib.json("cuda/manifest"))
        self.arch = arch or manifest.arch  # by default the device is the one the file was compiled for
        self.dependent_launches = 0  # kernels launched with programmatic stream serialization
        self._current = threading.local()
        self.calls: list[tuple[str, str]] = []  # (thread name, call) of every call
        self.blocks: dict[int, np.ndarray] = {}  # device and pinned allocations by address
        self.locked: dict[int, int] = {}  # page-locked host memory: start -> end
        self.copies: list[tuple[str, int, int]] = []  # every asynchronous copy queued: (call, host address, bytes)
        self.streams: dict[int, list[Callable[[], None]]] = {}
        self.capturing: dict[int, list[Callable[[], None]]] = {}
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        self.functions: dict[int, str] = {}
        self.records: dict[int, int] = {}  # event -> how many times it was recorded
        self.fired: dict[int, int] = {}  # event -> the latest of its records the stream has reached
        self.recorded_on: dict[int, int] = {}  # event -> the stream it was last recorded on
        self.kernel_runs = 0
        self._handles = 0x1000
        self._library = _load_host_library(pib)
        self._launches = launches_from_json(pib.json("gpu/launches"))
        self._first_entry = {name: launches[0] for name, launches in manifest.kernels.items()}
        self._arena: np.ndarray | None = None
        self._base = 0
        self._by_call: dict[tuple[str, tuple[int, ...]], Callable[[], None]] | None = None

    def __getattr__(self, name: str) -> Callable[..., int]:
        if not name.startswith("cu"):
            raise AttributeError(name)
        method = getattr(type(self), f"_{name}", None)
        if method is None:
            raise AttributeError(f"the fake driver has no {name}")

        def call(*args: object) -> int:
            self.calls.append((threading.current_thread().name, name))
            if name not in NEEDS_NO_CONTEXT and getattr(self._current, "ctx", None) is None:
                return INVALID_CONTEXT
            return method(self, *args) or 0

        return call

    def _handle(self) -> int:
        self._handles += 0x10
        return self._handles

    # --- device and context ---------------------------------------------------------------------------

    def _cuInit(self, flags: int) -> None: ...

    def _cuDeviceGet(self, device: object, ordinal: int) -> None:
        _out(device).value = 0

    def _cuDeviceGetAttribute(self, out: object, attribute: int, device: object) -> None:
        major, minor = int(self.arch[3:-1]), int(self.arch[-1])
        _out(out).value = {75: major, 76: minor}[attribute]

    def _cuDevicePrimaryCtxRetain(self, ctx: object, device: object) -> None:
        _out(ctx).value = 0xC0

    def _cuDevicePrimaryCtxRelease(self, device: object) -> None: ...

    def _cuCtxSetCurrent(self, ctx: object) -> None:
        self._current.ctx = _value(ctx)

    def _cuGetErrorName(self, code: int, text: object) -> None:
        _out(text).value = b"CUDA_ERROR_INVALID_CONTEXT" if code == INVALID_CONTEXT else b"CUDA_ERROR"

    # --- memory -------------------------------------------------------------------------------------------

    def _cuMemGetInfo_v2(self, free: object, total: object) -> None:
        _out(free).value = _out(total).value = 16 * 2**30

    def _allocate(self, nbytes: int) -> int:
        raw = np.zeros(nbytes + 256, np.uint8)  # 256-byte aligned, as cuMemAlloc's
        block = raw[(-raw.ctypes.data) % 256 :][:nbytes]
        self.blocks[block.ctypes.data] = block
        return block.ctypes.data

    def _cuMemAlloc_v2(self, ptr: object, nbytes: object) -> None:
        address = self._allocate(_value(nbytes))
        _out(ptr).value = address
        if self._arena is None:  # the executor's one arena
            self._arena, self._base = self.blocks[address], address

    def _cuMemHostAlloc(self, ptr: object, nbytes: object, flags: int) -> None:
        address = _out(ptr).value = self._allocate(_value(nbytes))
        self.locked[address] = address + _value(nbytes)

    def _cuMemHostRegister_v2(self, ptr: object, nbytes: object, flags: int) -> int | None:
        start = _value(ptr)
        end = start + _value(nbytes)
        if any(a < end and start < b for a, b in self.locked.items()):
            return 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.locked[start] = end
        return None

    def _cuMemHostUnregister(self, ptr: object) -> int | None:
        return None if self.locked.pop(_value(ptr), None) is not None else 713  # ..._NOT_REGISTERED

    def _cuMemFree_v2(self, ptr: object) -> None:
        self.blocks.pop(_value(ptr))

    def _cuMemFreeHost(self, ptr: object) -> None:
        self.blocks.pop(_value(ptr))
        self.locked.pop(_value(ptr))

    def _page_locked(self, call: str, host: int, nbytes: int) -> bool:
        self.copies.append((call, host, nbytes))
        return any(a <= host and host + nbytes <= b for a, b in self.locked.items())

    def _cuMemcpyHtoD_v2(self, dst: object, src: object, nbytes: object) -> None:
        ctypes.memmove(_value(dst), _value(src), _value(nbytes))

    def _queue(self, stream: object, work: Callable[[], None]) -> None:
        key = _value(stream)
        (self.capturing[key] if key in self.capturing else self.streams[key]).append(work)

    def _cuMemcpyHtoDAsync_v2(self, dst: object, src: object, nbytes: object, stream: object) -> int | None:
        d, s, n = _value(dst), _value(src), _value(nbytes)
        if not self._page_locked("HtoD", s, n):
            return 1  # CUDA_ERROR_INVALID_VALUE (see the module docstring)
        self._queue(stream, lambda: ctypes.memmove(d, s, n))
        return None

    def _cuMemcpyDtoHAsync_v2(self, dst: object, src: object, nbytes: object, stream: object) -> int | None:
        d, s, n = _value(dst), _value(src), _value(nbytes)
        if not self._page_locked("DtoH", d, n):
            return 1
        self._queue(stream, lambda: ctypes.memmove(d, s, n))
        return None

    # --- streams and graphs ---------------------------------------------------------------------------------

    def _cuStreamCreate(self, stream: object, flags: int) -> None:
        key = self._handle()
        self.streams[key] = []
        _out(stream).value = key

    def _cuStreamDestroy_v2(self, stream: object) -> None:
        self.streams.pop(_value(stream))

    def _cuStreamSynchronize(self, stream: object) -> None:
        queue = self.streams[_value(stream)]
        while queue:
            queue.pop(0)()

    def _cuStreamBeginCapture_v2(self, stream: object, mode: int) -> None:
        self.capturing[_value(stream)] = []

    def _cuStreamEndCapture(self, stream: object, graph: object) -> None:
        key = self._handle()
        self.graphs[key] = self.capturing.pop(_value(stream))
        _out(graph).value = key

    def _cuGraphInstantiateWithFlags(self, executable: object, graph: object, flags: object) -> None:
        key = self._handle()
        self.graphs[key] = list(self.graphs[_value(graph)])
        _out(executable).value = key

    def _cuGraphLaunch(self, executable: object, stream: object) -> None:
        for work in self.graphs[_value(executable)]:
            self._queue(stream, work)

    def _cuGraphExecDestroy(self, executable: object) -> None:
        self.graphs.pop(_value(executable))

    def _cuGraphDestroy(self, graph: object) -> None:
        self.graphs.pop(_value(graph))

    def _cuEventCreate(self, event: object, flags: int) -> None:
        _out(event).value = self._handle()

    def _cuEventRecord(self, event: object, stream: object) -> None:
        # An event stands for its latest record: waiting for it waits for that one, not an earlier.
        key = _value(event)
        self.records[key] = record = self.records.get(key, 0) + 1
        self._queue(stream, lambda: self.fired.__setitem__(key, record))
        self.recorded_on[key] = _value(stream)

    def _cuEventSynchronize(self, event: object) -> None:
        key = _value(event)
        if key not in self.records:  # never recorded: nothing to wait for, as the driver says
            return
        queue = self.streams[self.recorded_on[key]]
        while self.fired.get(key, 0) < self.records[key]:
            queue.pop(0)()

    def _cuEventRecordWithFlags(self, event: object, stream: object, flags: int) -> None: ...

    def _cuEventElapsedTime(self, ms: object, start: object, end: object) -> None:
        _out(ms).value = 0.001

    def _cuEventDestroy_v2(self, event: object) -> None: ...

    # --- modules and kernels ----------------------------------------------------------------------------------

    def _cuModuleLoadData(self, module: object, image: object) -> None:
        _out(module).value = self._handle()

    def _cuModuleUnload(self, module: object) -> None: ...

    def _cuModuleGetFunction(self, fn: object, module: object, name: bytes) -> None:
        key = self._handle()
        self.functions[key] = name.decode()
        _out(fn).value = key

    def _cuLaunchKernel(self, fn: object, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                        stream: object, params: object, extra: object) -> None:
        entry = self.functions[_value(fn)]
        count = len(params)  # type: ignore[arg-type]
        pointers = tuple(ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64))[0] - self._base  # type: ignore[index]
                         for i in range(count))
        work = self._kernel(entry, pointers)
        if work is not None:
            self._queue(stream, work)

    def _cuLaunchKernelEx(self, config: object, fn: object, params: object, extra: object) -> int | None:
        from runtime.cuda_driver import LaunchConfig

        c = ctypes.cast(config, ctypes.POINTER(LaunchConfig)).contents
        attrs = [(c.attrs[i].id, c.attrs[i].value[0]) for i in range(c.count)]
        if attrs != [(6, 1)]:  # programmatic stream serialization, allowed: the only one picc sets
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.dependent_launches += 1
        return self._cuLaunchKernel(fn, *c.grid, *c.block, c.shared, c.stream, params, extra)

    def _kernel(self, entry: str, offsets: tuple[int, ...]) -> Callable[[], None] | None:
        """The host build of the kernel whose first launch is ``entry`` with these arguments, bound
        to the arena (later launches of a kernel are parts of the same host call: None)."""
        if self._by_call is None:
            self._by_call = {}
            for calls in self._launches.values():
                for call in calls:
                    first = self._first_entry[call.kernel]
                    where = call.offsets()
                    key = (first.entry, tuple(where[p] for p in first.params))
                    self._by_call[key] = self._host_call(call)
        if (entry, offsets) not in self._by_call:
            if any(entry == first.entry for first in self._first_entry.values()):
                raise AssertionError(f"launch of {entry} with arguments at {offsets} matches no call of the plan")
            return None
        return self._by_call[(entry, offsets)]

    def _host_call(self, call: Call) -> Callable[[], None]:
        import tvm

        assert self._arena is not None
        fn = self._library[call.kernel]
        views = []
        for a in call.args:
            view = self._arena[a.offset : a.offset + a.nbytes].view(a.dtype).reshape(a.shape)
            views.append(tvm.runtime.from_dlpack(view))

        def run() -> None:
            self.kernel_runs += 1
            fn(*views)

        return run
