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
copied per token.

What a token costs besides the kernels' own time:

* **Launches.** The ops of a stage always launch the same kernels on the same arena addresses (the
  kernels read the token and its position from device memory), so the second time a stage runs,
  its launches are captured into a CUDA graph on the executor's stream and from then on the stage
  is one ``cuGraphLaunch``: a few microseconds instead of one ctypes ``cuLaunchKernel`` per kernel.
* **Copies.** A decode stage's copies are part of its graph: the values the stage reads from the
  CPU are copied in before its kernels, and the values the next stage's CPU part reads are copied
  out after them, so a stage costs the host one ``cuGraphLaunch`` and one wait, not a driver call
  and a wait per copy (on an H100 those cost ~17 us a copy). They copy straight from and into the
  CPU executor's own memory, page-locked for it (:meth:`CudaGpu.map_host`), so the host does no
  copying of its own: a value an in-place CPU kernel writes again while its copy is queued (its
  manifest says ``shared``), and every copy of a prompt's chunk, goes through a pinned staging
  buffer laid out like the device's activation slots instead (a numpy copy on the host each).
* **Waits.** :meth:`CudaGpu.launch` queues a stage and returns at once, so the caller's thread
  runs the CPU's part of the stage while the GPU runs its own, with no second host thread (a
  hand-off between Python threads costs tens of microseconds); :meth:`CudaGpu.collect`, before
  the next stage, waits for it and hands over what it copied out. Device time is measured with
  CUDA events on one stage launch in ``TIMING_EVERY`` (recording every one would cost more host
  time than it measures) and scaled up; it includes the copies inside the graphs.
* **Dependent launches** (sm_90 and newer, when the manifest says the kernels wait for their
  predecessors): a kernel that follows a kernel of its stage goes out through ``cuLaunchKernelEx``
  with programmatic stream serialization, so its launch overlaps the end of the one before it.

**Threads.** The driver keeps one *current context* per thread, and a split model's prompt runs
the GPU's part on the executor's worker thread, not on the thread that opened the session. Every
driver call therefore goes through :class:`~runtime.cuda_driver.Driver`, which makes this
executor's context current on the calling thread before its first call there.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.contracts import GREEDY_LAUNCH, Call, CudaManifest, launches_from_json
from runtime.cuda_driver import (
    ATTR_CC_MAJOR,
    ATTR_CC_MINOR,
    CAPTURE_THREAD_LOCAL,
    EVENT_DISABLE_TIMING,
    EVENT_RECORD_EXTERNAL,
    STREAM_NON_BLOCKING,
    BoundLaunch,
    Driver,
    compile_at_load,
    dependent_launch_config,
    u64,
)
from runtime.gpu import GpuError, GpuTimes, arena_image, slots
from runtime.pib import PibFile

TIMING_EVERY = 8  # one stage launch in this many is timed on the device (see the module docstring)


@dataclass(slots=True)
class _StageWork:
    """What :meth:`CudaGpu.launch` queues for one stage, worked out once per key: ``work``, its
    ops and copies in and out, each copy ``(value, bytes, host address)`` (0: through the staging
    buffer), which also names its graph; the indices of the staged copies in and out; the bytes
    copied; and the graph, once captured: ``(graph, executable)``."""

    work: tuple
    staged_in: tuple[int, ...]
    staged_out: tuple[int, ...]
    nbytes: int
    graph: tuple[ctypes.c_void_p, ctypes.c_void_p] | None = None


class CudaGpu:
    """The GPU part of a ``.pib`` on CUDA device 0 (see the module docstring)."""

    kind = "cuda"
    asynchronous = True  # launch() returns before the kernels are done

    def __init__(self, pib: PibFile, *, driver: Driver | None = None, graphs: bool = True) -> None:
        self.cu = cu = driver or Driver()
        self.graphs = graphs
        cu("cuInit", 0)
        device = ctypes.c_int()
        cu("cuDeviceGet", ctypes.byref(device), 0)
        major, minor = ctypes.c_int(), ctypes.c_int()
        cu("cuDeviceGetAttribute", ctypes.byref(major), ATTR_CC_MAJOR, device)
        cu("cuDeviceGetAttribute", ctypes.byref(minor), ATTR_CC_MINOR, device)
        self.device_arch = f"sm_{major.value}{minor.value}"
        self._major = major.value
        self._ctx = ctypes.c_void_p()
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), device)
        cu.use(self._ctx)
        self._device = device
        self._modules: list[ctypes.c_void_p] = []
        self._events: list[ctypes.c_void_p] = []  # every event made, destroyed by close()
        self._graphs: dict[tuple, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}  # by (ops, copies in, out)
        self._seen: set[tuple] = set()
        self._work: dict[object, _StageWork] = {}  # by launch()'s key
        self.base, self.pinned, self.stream = u64(), ctypes.c_void_p(), ctypes.c_void_p()
        manifest = CudaManifest.from_json(pib.json("cuda/manifest"))
        plan = pib.plan()
        self.arena_bytes = plan.gpu_bytes
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        cu("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        if self.arena_bytes > free.value:
            raise GpuError(f"the plan needs {self.arena_bytes} bytes of VRAM but the device has {free.value} free")
        cu("cuMemAlloc_v2", ctypes.byref(self.base), ctypes.c_size_t(self.arena_bytes))
        image = arena_image(pib, self.arena_bytes)  # weights and constants in place, the rest zero
        cu("cuMemcpyHtoD_v2", self.base, image.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(image.nbytes))
        cu("cuStreamCreate", ctypes.byref(self.stream), STREAM_NON_BLOCKING)
        self._slots = slots(plan)
        activations = plan.buffer("activations")
        self._act = activations.offset if activations else 0
        act_bytes = activations.nbytes if activations else 0
        cu("cuMemHostAlloc", ctypes.byref(self.pinned), ctypes.c_size_t(max(act_bytes, 1)), 0)
        self._staging = np.ctypeslib.as_array(ctypes.cast(self.pinned, ctypes.POINTER(ctypes.c_uint8)),
                                              (max(act_bytes, 1),))
        self._pending: list[tuple[int, int]] = []  # staging byte ranges whose upload may be pending
        self._kernels_done = self._event(timing=False)  # recorded after a launch() that copies out or stages
        self._spare: list[ctypes.c_void_p] = []  # timing events not in use
        self._timed: list[tuple[ctypes.c_void_p, ctypes.c_void_p]] = []  # recorded, not read yet
        self._launch_calls = 0
        self._incoming: list[tuple[str, np.ndarray]] = []  # staged downloads queued, not delivered yet
        self._awaiting = False  # a launch since the last collect() downloads something: it waits for that
        self._mapped: list[tuple[int, int]] = []  # host memory copies read and write directly
        self._snapshot: set[str] = set()  # values uploaded through the staging buffer even so
        self.host_mapping_error: str | None = None  # why the driver would not page-lock it, if it would not
        self._functions = self._load(pib, manifest)
        # Kernels that wait for their predecessors themselves may be launched before those are done
        # (sm_90 and newer; PICC_CUDA_PDL=0 turns it off, to compare).
        # PICC_CUDA_PDL: "0" none; "1" (default) a kernel that follows a kernel; "all" every kernel,
        # also the first after a copy (to compare on a device).
        mode = os.environ.get("PICC_CUDA_PDL", "1")
        self.dependent_launch = manifest.dependent_launch and self._major >= 9 and mode != "0"
        self._dependent_first = mode == "all"
        self.dependent_launch_error: str | None = None  # why the driver refused it, if it did
        self._launches = self._bind(launches_from_json(pib.json("gpu/launches")), manifest)
        self.times = GpuTimes()

    def _load(self, pib: PibFile, manifest: CudaManifest) -> dict[str, ctypes.c_void_p]:
        """Each ``__global__`` function of the file's kernels, loaded on the device: from its cubin
        (same architecture) or PTX (this one or older), else compiled here from its CUDA sources."""
        arch = manifest.arch
        if int(arch[3:]) > int(self.device_arch[3:]):
            raise GpuError(f"{pib.path} was compiled for {arch}; this device is {self.device_arch}: "
                           f"recompile with a target for it")
        # A cubin runs only on its own architecture; PTX is JIT-compiled for this one or newer.
        if arch == self.device_arch and "cubin" in manifest.compiled:
            images = [pib.section(f"cuda/{arch}/model.cubin")]
        elif "ptx" in manifest.compiled:
            images = [pib.section(f"cuda/{arch}/model.ptx") + b"\0"]
        else:  # nvcc was not found at compile time: the sources, compiled at load
            sources = {k: pib.text(f"cuda/{arch}/{k}.cu") for k in manifest.kernels}
            images = [ptx + b"\0" for ptx in compile_at_load(sources, self.device_arch).values()]
        functions = {}
        entries = manifest.entries
        for image in images:
            module = ctypes.c_void_p()
            self.cu("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
            self._modules.append(module)
            for entry in entries:
                fn = ctypes.c_void_p()
                if self.cu.status("cuModuleGetFunction", ctypes.byref(fn), module, entry.encode()) == 0:
                    functions[entry] = fn
        missing = [e for e in entries if e not in functions]
        if missing:
            raise GpuError(f"{pib.path}: its CUDA code lacks the kernels {missing[:3]}")
        return functions

    def _bind(self, launches: dict[str, list[Call]], manifest: CudaManifest) -> dict[str, list[BoundLaunch]]:
        """Per op, its launches with their argument arrays (pointers into the arena) built once."""
        bound: dict[str, list[BoundLaunch]] = {}
        for op, calls in launches.items():
            bound[op] = []
            for call in calls:
                where = call.offsets()
                for launch in manifest.kernels[call.kernel]:
                    pointers = [u64(self.base.value + where[p]) for p in launch.params]
                    args = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(p) for p in pointers])
                    config = dependent_launch_config(launch.grid, launch.block, self.stream)
                    bound[op].append(BoundLaunch(self._functions[launch.entry], launch.grid, launch.block, args,
                                                 pointers, launch.entry, config))
        return bound

    # --- copies -------------------------------------------------------------------------------------

    def has(self, value: str) -> bool:
        return value in self._slots

    @property
    def loops(self) -> bool:
        """Whether the greedy decode loop can run here: the file has its kernel and the host
        memory is page-locked (its state's copies go in place; the staging buffer has no room
        for them)."""
        return GREEDY_LAUNCH in self._launches and bool(self._mapped)

    def map_host(self, spans: Sequence[tuple[int, int]], snapshot: set[str] | frozenset[str] = frozenset()) -> bool:
        """Page-lock each ``(address, nbytes)`` of ``spans`` (the CPU executor's memory, where the
        values that cross devices live) for the device to copy to and from directly: from then
        on a :meth:`launch`'s copy whose host array lies inside one is queued on that array's own
        bytes, with no staging copy on the host, except uploads of the values in ``snapshot``
        (bytes the CPU may write again while the copy waits in the queue). False, and
        :attr:`host_mapping_error` says why, where the driver refuses one (then none is used and
        copies stay staged)."""
        for address, nbytes in spans:
            status = self.cu.status("cuMemHostRegister_v2", ctypes.c_void_p(address), ctypes.c_size_t(nbytes), 0)
            if status != 0:
                self.host_mapping_error = f"cuMemHostRegister of {nbytes} bytes failed ({status})"
                self._unmap()
                return False
            self._mapped.append((address, address + nbytes))
        self._snapshot = set(snapshot)
        return True

    def _unmap(self) -> None:
        for address, _ in self._mapped:
            self.cu("cuMemHostUnregister", ctypes.c_void_p(address))
        self._mapped = []

    def _direct(self, value: str, host: np.ndarray, upload: bool) -> int:
        """The host address a launch's copy of ``value`` reads or writes in place, or 0: the copy
        goes through the staging buffer (see :meth:`map_host`)."""
        if upload and value in self._snapshot or not host.flags.c_contiguous:
            return 0
        start = host.ctypes.data
        return start if any(lo <= start and start + host.nbytes <= hi for lo, hi in self._mapped) else 0

    def _stage_in(self, value: str, host: np.ndarray) -> None:
        """Write ``host`` into ``value``'s bytes of the staging buffer (first waiting for a queued
        upload that still reads those bytes)."""
        at = self._slots[value]
        end = at + host.nbytes
        if any(a < end and at < b for a, b in self._pending):
            self.synchronize()
        self._staging[at:end] = host.view(np.uint8).reshape(-1)
        self._pending.append((at, end))

    def _copy_in(self, value: str, nbytes: int, host: int = 0) -> None:
        """Queue the copy of ``value`` to its device slot from host address ``host`` (0: from its
        bytes of the staging buffer)."""
        at = self._slots[value]
        self.cu("cuMemcpyHtoDAsync_v2", u64(self.base.value + self._act + at),
                ctypes.c_void_p(host or self.pinned.value + at), ctypes.c_size_t(nbytes), self.stream)

    def _copy_out(self, value: str, nbytes: int, host: int = 0) -> None:
        """Queue the copy of ``value``'s device slot to host address ``host`` (0: to its bytes of
        the staging buffer)."""
        at = self._slots[value]
        self.cu("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(host or self.pinned.value + at),
                u64(self.base.value + self._act + at), ctypes.c_size_t(nbytes), self.stream)

    def upload(self, value: str, host: np.ndarray) -> None:
        """Queue ``host`` -> ``value``'s slot on the device (not waited for: later work on the
        stream sees it)."""
        start = time.perf_counter()
        self._stage_in(value, host)
        self._copy_in(value, host.nbytes)
        self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += host.nbytes

    def download(self, value: str, host: np.ndarray) -> None:
        """``value``'s slot on the device -> ``host``, once the work queued before it is done."""
        self.download_many([(value, host)])

    def download_many(self, pairs: list[tuple[str, np.ndarray]]) -> None:
        """Each ``(value, host)``: the device's slot into ``host``, queued together behind the work
        queued before, waited for once. The time spent waiting for that work's kernels counts as
        waiting (``GpuTimes.wait_seconds``), the rest as the copies'."""
        if not pairs:
            return
        start = time.perf_counter()
        for value, host in pairs:
            self._copy_out(value, host.nbytes)
        waited = self._wait_for_kernels()
        self.synchronize()
        self._deliver(pairs)
        self.times.transfer_bytes += sum(host.nbytes for _, host in pairs)
        self.times.transfer_seconds += time.perf_counter() - start - waited

    def _deliver(self, pairs: list[tuple[str, np.ndarray]]) -> None:
        """Downloaded staging bytes into their host arrays."""
        for value, host in pairs:
            at = self._slots[value]
            host.view(np.uint8).reshape(-1)[:] = self._staging[at : at + host.nbytes]

    def collect(self) -> None:
        """Wait for the last :meth:`launch` and hand over the values it downloaded (nothing to
        do when it downloaded none)."""
        if not self._awaiting:
            return
        self._wait_for_kernels()
        self._awaiting = False
        self._pending.clear()  # the launch waited for read its staging bytes, as did all before it
        if self._incoming:
            start = time.perf_counter()
            self._deliver(self._incoming)
            self._incoming = []
            self.times.transfer_seconds += time.perf_counter() - start

    def _wait_for_kernels(self) -> float:
        """Wait until the work of the last :meth:`launch` is done; the seconds it took."""
        start = time.perf_counter()
        self.cu("cuEventSynchronize", self._kernels_done)
        waited = time.perf_counter() - start
        self.times.wait_seconds += waited
        return waited

    def synchronize(self) -> None:
        """Wait for everything queued on the executor's stream; read the device times recorded."""
        self.cu("cuStreamSynchronize", self.stream)
        self._pending.clear()
        for begin, end in self._timed:
            ms = ctypes.c_float()
            self.cu("cuEventElapsedTime", ctypes.byref(ms), begin, end)
            self.times.gpu_seconds += TIMING_EVERY * ms.value * 1e-3
            self._spare += [begin, end]
        self._timed.clear()

    def wait(self) -> None:
        """Wait for everything queued, counting the time as waiting for the GPU."""
        start = time.perf_counter()
        self.synchronize()
        self.times.wait_seconds += time.perf_counter() - start

    def _event(self, timing: bool = True) -> ctypes.c_void_p:
        if timing and self._spare:
            return self._spare.pop()
        event = ctypes.c_void_p()
        self.cu("cuEventCreate", ctypes.byref(event), 0 if timing else EVENT_DISABLE_TIMING)
        self._events.append(event)
        return event

    # --- running ------------------------------------------------------------------------------------

    def run(self, ops: list[str]) -> None:
        """The kernels of ``ops``, in order, and wait for them."""
        self.launch(ops)
        self.wait()

    def launch(self, ops: Sequence[str], uploads: Sequence[tuple[str, np.ndarray]] = (),
               downloads: Sequence[tuple[str, np.ndarray]] = (), key: object = None) -> None:
        """Queue one stage and return: ``uploads`` (value, host array) copied in, the kernels of
        ``ops`` in order, ``downloads`` copied out; :meth:`collect` waits for it (and every launch
        queued since the last collect) and fills the download arrays. The first time a stage of
        these ops and copies runs, it is queued call by call; the second time it is captured into
        a CUDA graph, copies included (their staging bytes, and the host arrays of copies made in
        place, are fixed), which every later time replays. ``key``: what identifies this stage
        among the caller's (the same ops, copies and host arrays every time it is given), to skip
        working that out from the lists."""
        if self._incoming:  # staged downloads queued before: their staging bytes are about to be reused
            self.collect()
        stage = self._work.get(key) if key is not None else None
        if stage is None:
            stage = self._stage_work(ops, uploads, downloads)
            if key is not None:
                self._work[key] = stage
        if stage.staged_in:
            start = time.perf_counter()
            for i in stage.staged_in:
                self._stage_in(*uploads[i])
            self.times.transfer_seconds += time.perf_counter() - start
        self.times.transfer_bytes += stage.nbytes
        graph = stage.graph
        if graph is None:
            work = stage.work
            graph = self._graphs.get(work)
            if graph is None and self.graphs and work in self._seen:
                graph = self._graphs[work] = self._capture(work)
            elif graph is None and self.dependent_launch and not self._seen:
                self._try_dependent_launch(work)
            stage.graph = graph
        timed = None
        if self._launch_calls % TIMING_EVERY == 0:
            timed = (self._event(), self._event())
            self.cu("cuEventRecord", timed[0], self.stream)
        self._launch_calls += 1
        if graph is not None:
            self.cu("cuGraphLaunch", graph[1], self.stream)
            self.times.graph_launches += 1
        else:
            self._seen.add(stage.work)
            self._queue(stage.work)
        if timed is not None:
            self.cu("cuEventRecord", timed[1], self.stream)
            self._timed.append(timed)
        if downloads or stage.staged_in:  # what collect() waits for: downloads, staging bytes read
            self.cu("cuEventRecord", self._kernels_done, self.stream)
        if downloads:
            self._awaiting = True
            if stage.staged_out:
                self._incoming += [downloads[i] for i in stage.staged_out]

    def _stage_work(self, ops: Sequence[str], uploads: Sequence[tuple[str, np.ndarray]],
                    downloads: Sequence[tuple[str, np.ndarray]]) -> _StageWork:
        """What :meth:`launch` queues for these ops and copies (each copy in place where it can be,
        :meth:`_direct`)."""
        ins = tuple((v, h.nbytes, self._direct(v, h, True)) for v, h in uploads)
        outs = tuple((v, h.nbytes, self._direct(v, h, False)) for v, h in downloads)
        return _StageWork((tuple(ops), ins, outs), tuple(i for i, c in enumerate(ins) if not c[2]),
                          tuple(i for i, c in enumerate(outs) if not c[2]),
                          sum(c[1] for c in ins) + sum(c[1] for c in outs))

    def _queue(self, work: tuple) -> None:
        """A stage's copies in, kernels and copies out, on the stream (captured or run)."""
        ops, ins, outs = work
        for value, nbytes, host in ins:
            self._copy_in(value, nbytes, host)
        # Only a kernel that follows one of these kernels is a dependent launch: the wait at its
        # start covers kernels before it, not copies (nor whatever came before this call).
        after_kernel = False
        for op in ops:
            for k in self._launches.get(op, ()):
                if self.dependent_launch and (after_kernel or self._dependent_first):
                    self.cu("cuLaunchKernelEx", ctypes.byref(k.config), k.fn, k.args, None)
                else:
                    self.cu("cuLaunchKernel", k.fn, *k.grid, *k.block, 0, self.stream, k.args, None)
                after_kernel = True
                self.times.launches += 1
        for value, nbytes, host in outs:
            self._copy_out(value, nbytes, host)

    def _try_dependent_launch(self, work: tuple) -> None:
        """Before the first launch: capture ``work`` with dependent launches into a graph and
        throw it away; if the driver refuses either, launch as usual from now on (and say why in
        ``dependent_launch_error``)."""
        try:
            graph, executable = self._capture(work)
        except GpuError as e:
            self.dependent_launch, self.dependent_launch_error = False, str(e)
            return
        self.cu("cuGraphExecDestroy", executable)
        self.cu("cuGraphDestroy", graph)

    def _capture(self, work: tuple) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """A graph of a stage's copies and launches on the stream, instantiated: ``(graph, executable)``."""
        graph, executable = ctypes.c_void_p(), ctypes.c_void_p()
        launches = self.times.launches
        self.cu("cuStreamBeginCapture_v2", self.stream, CAPTURE_THREAD_LOCAL)
        try:
            self._queue(work)
        finally:  # a capture left open would break every later call on the stream
            self.cu("cuStreamEndCapture", self.stream, ctypes.byref(graph))
        self.times.launches = launches  # captured, not launched
        self.cu("cuGraphInstantiateWithFlags", ctypes.byref(executable), graph, ctypes.c_ulonglong(0))
        return graph, executable

    def launch_seconds(self, ops: list[str], before: Callable[[], None],
                       repeat: int = 20) -> list[tuple[str, str, float]]:
        """``(op, kernel entry, seconds)`` of device time per launch of ``ops``, in order: where a
        step's GPU time goes. The launches are captured into one graph with an event between every
        two, as a stage's graph runs them (timed one by one from the host, each would take the
        ~10 us a ctypes launch costs); medians of ``repeat`` replays. ``before`` puts a step's
        inputs in place before each replay (their slots are reused within a step)."""
        launches = [(op, launch) for op in ops for launch in self._launches.get(op, ())]
        events = [ctypes.c_void_p() for _ in range(len(launches) + 1)]
        graph, executable = ctypes.c_void_p(), ctypes.c_void_p()
        for e in events:
            self.cu("cuEventCreate", ctypes.byref(e), 0)
        samples: list[list[float]] = [[] for _ in launches]
        try:
            self.cu("cuStreamBeginCapture_v2", self.stream, CAPTURE_THREAD_LOCAL)
            try:
                # External: an event record node of the graph (a plain record in a capture only
                # orders streams, and its time cannot be read).
                self.cu("cuEventRecordWithFlags", events[0], self.stream, EVENT_RECORD_EXTERNAL)
                for i, (_, (fn, grid, block, args, *_)) in enumerate(launches):
                    self.cu("cuLaunchKernel", fn, *grid, *block, 0, self.stream, args, None)
                    self.cu("cuEventRecordWithFlags", events[i + 1], self.stream, EVENT_RECORD_EXTERNAL)
            finally:
                self.cu("cuStreamEndCapture", self.stream, ctypes.byref(graph))
            self.cu("cuGraphInstantiateWithFlags", ctypes.byref(executable), graph, ctypes.c_ulonglong(0))
            for _ in range(repeat):
                before()
                self.cu("cuGraphLaunch", executable, self.stream)
                self.synchronize()
                for i in range(len(launches)):
                    ms = ctypes.c_float()
                    self.cu("cuEventElapsedTime", ctypes.byref(ms), events[i], events[i + 1])
                    samples[i].append(ms.value * 1e-3)
        finally:
            if executable.value:
                self.cu("cuGraphExecDestroy", executable)
            if graph.value:
                self.cu("cuGraphDestroy", graph)
            for e in events:
                self.cu("cuEventDestroy_v2", e)
        return [(op, launch.entry, float(np.median(t))) for (op, launch), t in zip(launches, samples, strict=True)]

    @property
    def peak_bytes(self) -> int:
        """Device memory this executor allocated: the one arena of the plan's GPU bytes."""
        return self.arena_bytes if self.base.value else 0

    def close(self) -> None:
        if self.stream.value:
            self.synchronize()
        for graph, executable in self._graphs.values():
            self.cu("cuGraphExecDestroy", executable)
            self.cu("cuGraphDestroy", graph)
        self._graphs.clear()
        for event in self._events:
            self.cu("cuEventDestroy_v2", event)
        self._events.clear()
        for module in self._modules:
            self.cu("cuModuleUnload", module)
        self._modules.clear()
        if self.stream.value:
            self.cu("cuStreamDestroy_v2", self.stream)
            self.stream = ctypes.c_void_p()
        self._unmap()  # before the CPU executor lets that memory go
        if self.pinned.value:
            self.cu("cuMemFreeHost", self.pinned)
            self.pinned = ctypes.c_void_p()
        if self.base.value:
            self.cu("cuMemFree_v2", self.base)
            self.base = u64()
        self.cu("cuDevicePrimaryCtxRelease", self._device)
