"""One decode step of a compiled model on both devices: the stages of its schedule.

The ``.pib``'s ``schedule`` lists the step's stages; in each, the GPU runs its ops while the CPU
runs its own -- the two parts of a split FFN layer side by side -- and before each, the values
one device made and the other reads are copied across. A model compiled for the CPU alone is one
stage and costs one call of generated code per thread; a hybrid one adds, per stage, the GPU's
launches and the copies. A CUDA device queues a stage's work and returns at once, so this thread
goes on with the CPU's part and the next stage's downloads wait for the GPU; the host-emulated GPU
runs its kernels on a worker thread, so that it too really runs beside the CPU.

Prompts run in chunks of tokens, stage by stage (:meth:`Executor.prefill`, :meth:`Executor.logits_of`):
the CPU's chunk program of a stage computes all the chunk's tokens at once (GEMMs: each weight read
once a chunk) while the GPU, whose kernels see one token, runs the stage's ops for each token in
turn, copying that token's inputs from the chunk's rows in the host and its outputs back (a CUDA
device gets every token's work queued before the CPU's part starts, and is waited for once).

The GPU is a real CUDA device when there is one and the ``.pib`` carries code for it, else the
host-emulated GPU (``runtime.gpu``); ``Executor.gpu_kind`` says which, so that the caller can say
so.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime import hostmem
from runtime.contracts import GPU, GREEDY_LAUNCH, Schedule
from runtime.cpu import ChunkProgram, ChunkStage, CpuExecutor, ExecutorError, through_stop
from runtime.gpu import GREEDY_RECORD, GREEDY_START, EmulatedGpu, GpuError, cuda_device_count
from runtime.pib import PibFile

GPU_MODES = ("auto", "cuda", "emulate")
EOS_BATCH = 16  # greedy steps the GPU's loop runs between looks for an end of sequence


@dataclass
class DeviceTimes:
    """Where a run's step time went: GPU work, CPU stages, copies between them; and how the GPU's
    work was started (kernel launches one by one, CUDA graphs replayed)."""

    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    launches: int = 0
    graph_launches: int = 0


class _GpuWorker:
    """A thread that runs the GPU's ops of a stage while the caller's thread runs the CPU's."""

    def __init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self._job: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="picc-gpu")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._job is None:
                return
            fn, arg = self._job
            try:
                fn(arg)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e
            self._done.set()

    def start(self, fn, arg) -> None:  # noqa: ANN001
        self._error = None
        self._done.clear()
        self._job = (fn, arg)
        self._go.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._job = None
        self._go.set()
        self._thread.join()


def _make_gpu(pib: PibFile, mode: str):  # noqa: ANN202 - EmulatedGpu or CudaGpu
    if mode not in GPU_MODES:
        raise ExecutorError(f"--gpu {mode}: expected one of {', '.join(GPU_MODES)}")
    devices = cuda_device_count() if mode != "emulate" else 0
    if mode == "cuda" and devices == 0:
        raise ExecutorError("--gpu cuda: no CUDA device is visible here (no NVIDIA driver or no GPU)")
    try:
        if devices > 0:
            from runtime.cuda import CudaGpu

            return CudaGpu(pib)
        return EmulatedGpu(pib)
    except GpuError as e:
        raise ExecutorError(str(e)) from None


class Executor:
    """``step(token, pos)`` then ``logits()`` / ``greedy()``, on whatever devices the model uses."""

    def __init__(self, pib: PibFile, threads: int | None = 1, gpu: str = "auto") -> None:
        sched = Schedule.from_json(pib.json("schedule"))
        self.stages = sched.stages
        self.head = set(sched.head)
        self.logits_value = sched.logits
        self.logits_on_gpu = sched.logits_device == GPU
        self.cpu = CpuExecutor(pib, threads)
        uses_gpu = any(st.gpu for st in self.stages)
        self.gpu = _make_gpu(pib, gpu) if uses_gpu else None
        self.gpu_kind = self.gpu.kind if self.gpu is not None else None
        self.vocab = self.cpu.vocab
        self.plan = pib.plan()
        self.ctx = self.plan.ctx  # positions the KV caches hold
        # The worker runs a GPU's part of a stage beside the CPU's where the GPU does not queue work.
        self._worker = _GpuWorker() if self.gpu is not None and not self.gpu.asynchronous else None
        # A queuing GPU copies straight from and into the CPU's memory, a chunk's positions from a
        # page of their own (token t's at [t]), and the greedy loop's state through pages of its own.
        self._positions = hostmem.page_zeros(4 * self.cpu.chunk).view(np.int32)
        self._loop_state = hostmem.page_zeros(4 * (self.ctx + 2)).view(np.int32)  # see _gpu_greedy
        if self.gpu is not None and self.gpu.asynchronous:
            own = [hostmem.page_span(a) for a in (self._positions, self._loop_state)]
            spans = [*self.cpu.crossing_spans(), *((start, end - start) for start, end in own)]
            self.gpu.map_host(spans, snapshot=self.cpu.shared_values())
        # Greedy steps in a loop on the GPU: the whole step is the GPU's and the file has the loop
        # (PICC_GPU_LOOP=0 turns it off, to compare).
        self._gpu_ops = [op for st in self.stages for op in st.gpu]
        self.gpu_loops = (self.gpu is not None and self.gpu.loops and self.logits_on_gpu
                          and not any(st.cpu for st in self.stages) and os.environ.get("PICC_GPU_LOOP", "1") != "0")
        self.times = DeviceTimes()
        self._plans: dict[bool, list[tuple]] = {}  # by logits: what each stage launches (a queuing GPU)

    def _inputs(self, token: int, pos: int) -> None:
        self.cpu.set_token(token, pos)
        if self.gpu is not None:  # the function's arguments, where GPU ops read them
            for name, value in self._arguments():
                self.gpu.upload(name, value)

    def _arguments(self) -> list[tuple[str, np.ndarray]]:
        """The step's arguments that GPU ops read, as the host arrays to copy there: where the
        CPU's step reads them too (set by ``cpu.set_token``)."""
        assert self.gpu is not None
        return [(name, self.cpu.step_argument(name)) for name in ("tokens", "pos") if self.gpu.has(name)]

    def step(self, token: int, pos: int, *, logits: bool = True) -> None:
        """Run the model on ``token`` at position ``pos`` (its KV cache holds positions < pos).

        ``logits=False`` skips the output head (a prompt token whose logits nobody reads).
        """
        gpu, cpu = self.gpu, self.cpu
        if gpu is not None and gpu.asynchronous:
            cpu.set_token(token, pos)
            self._queued_stages(logits)
        else:
            self._inputs(token, pos)
            for i, stage in enumerate(self.stages):
                if gpu is not None:
                    for v in stage.to_gpu:
                        if logits or v not in self.head:
                            gpu.upload(v, cpu.value(v))
                    gpu.download_many([(v, cpu.value(v)) for v in stage.to_cpu if logits or v not in self.head])
                gpu_ops = [op for op in stage.gpu if logits or op not in self.head]
                self._side_by_side(gpu.run if gpu_ops and gpu is not None else None, gpu_ops,
                                   cpu.run_stage if stage.cpu else None, (i, not logits))
            if logits and self.logits_on_gpu:
                assert gpu is not None
                gpu.download(self.logits_value, self.cpu.logits())
        self._sync_gpu_times()

    def _queued_stages(self, logits: bool) -> None:
        """The stages on a device that queues work (CUDA): each stage's GPU part -- the values it
        reads from the CPU copied in (the first that launches with the step's token and
        position), its kernels, and the values the next stage's CPU part reads copied out -- is
        launched, then this thread runs the stage's CPU part; the next stage first collects what
        the GPU copied out (waiting for it). What each stage launches, host arrays included, is
        worked out once (:meth:`_queue_plan`): the host's time a stage is the driver's calls."""
        gpu = self.gpu
        assert gpu is not None
        plan = self._plans.get(logits) or self._plans.setdefault(logits, self._queue_plan(logits))
        prefill = not logits
        for i, (first_out, ops, uploads, downloads, cpu_part) in enumerate(plan):
            gpu.collect()
            if first_out:  # nothing launched before the first stage could copy these out
                gpu.download_many(first_out)
            if ops or uploads or downloads:
                gpu.launch(ops, uploads, downloads, key=(logits, i))
            if cpu_part:
                self._side_by_side(None, None, self.cpu.run_stage, (i, prefill))
        gpu.collect()
        gpu.wait()  # the step's last GPU work (KV rows, say) is done before the next step

    def _queue_plan(self, logits: bool) -> list[tuple]:
        """Per stage, for :meth:`_queued_stages`: the values to download before it (the first
        stage only), its GPU ops, the copies in before them (the step's token and position with
        the first stage that launches) and out after them (what the next stage's CPU part reads;
        the logits after the last stage, if the GPU makes them), each with its host array, and
        whether the stage has a CPU part."""

        def wanted(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
            return tuple(v for v in values if logits or v not in self.head)

        plan, arguments = [], self._arguments()
        for i, stage in enumerate(self.stages):
            if i + 1 < len(self.stages):
                out = wanted(self.stages[i + 1].to_cpu)
            else:
                out = (self.logits_value,) if logits and self.logits_on_gpu else ()
            ops, into = wanted(stage.gpu), wanted(stage.to_gpu)
            last = i + 1 == len(self.stages)
            launches = bool(ops or into or out) or (bool(arguments) and last)
            uploads = [*(arguments if launches else []), *((v, self.cpu.value(v)) for v in into)]
            plan.append(([(v, self._host(v)) for v in wanted(stage.to_cpu)] if i == 0 else [], ops, uploads,
                         [(v, self._host(v)) for v in out], bool(stage.cpu)))
            arguments = [] if launches else arguments
        return plan

    def _host(self, value: str) -> np.ndarray:
        """The host array a value the GPU makes is downloaded into."""
        return self.cpu.logits() if value == self.logits_value and self.logits_on_gpu else self.cpu.value(value)

    def _side_by_side(self, gpu_fn: Callable[[Any], None] | None, gpu_arg: Any,
                      cpu_fn: Callable[..., None] | None, cpu_args: tuple) -> None:
        """One stage: ``gpu_fn(gpu_arg)`` on the worker thread while ``cpu_fn(*cpu_args)`` runs on
        this one (either None: that device has nothing to do), the CPU's time counted."""
        start = time.perf_counter()
        if gpu_fn is not None and cpu_fn is not None:
            assert self._worker is not None
            self._worker.start(gpu_fn, gpu_arg)
            cpu_fn(*cpu_args)
            self.times.cpu_seconds += time.perf_counter() - start
            self._worker.wait()
        elif gpu_fn is not None:
            gpu_fn(gpu_arg)
        elif cpu_fn is not None:
            cpu_fn(*cpu_args)
            self.times.cpu_seconds += time.perf_counter() - start

    def _sync_gpu_times(self) -> None:
        """The GPU's launch and copy times so far, into :attr:`times`."""
        if self.gpu is not None:
            self.times.gpu_seconds = self.gpu.times.gpu_seconds
            self.times.wait_seconds = self.gpu.times.wait_seconds
            self.times.transfer_seconds = self.gpu.times.transfer_seconds
            self.times.transfer_bytes = self.gpu.times.transfer_bytes
            self.times.launches = self.gpu.times.launches
            self.times.graph_launches = self.gpu.times.graph_launches

    def prefill(self, tokens: list[int], pos: int) -> None:
        """Run ``tokens`` at positions ``pos ..`` in chunks, without computing their logits."""
        for start in range(0, len(tokens), self.cpu.chunk):
            self._run_chunk(self.cpu.prefill_chunks, tokens[start : start + self.cpu.chunk], pos + start)

    def logits_of(self, tokens: list[int], pos: int) -> np.ndarray:
        """Run ``tokens`` at positions ``pos ..`` in chunks, head included: every token's logits
        ([len(tokens), vocab], a copy). The step's own logits and greedy token are not updated."""
        program = self.cpu.logits_chunks
        assert program.logits is not None  # the manifest's logits_chunk computes them
        out = np.empty((len(tokens), self.vocab), np.float32)
        for start in range(0, len(tokens), self.cpu.chunk):
            part = tokens[start : start + self.cpu.chunk]
            self._run_chunk(program, part, pos + start)
            out[start : start + len(part)] = program.logits[: len(part)]
        return out

    def _run_chunk(self, program: ChunkProgram, tokens: list[int], pos: int) -> None:
        """One chunk through ``program``: per stage, the CPU's program takes the chunk at once while
        the GPU runs its ops token by token between the chunk's rows (queued before the CPU's part
        on a device that queues work, :meth:`_queue_chunk_stage`; else on the worker)."""
        self.cpu.load_chunk(tokens, pos)
        queued = self.gpu is not None and self.gpu.asynchronous
        if queued:
            self._positions[: len(tokens)] = np.arange(pos, pos + len(tokens), dtype=np.int32)
        for s, stage in enumerate(program.stages):
            if queued and stage.gpu:
                assert self.gpu is not None
                self._queue_chunk_stage(program, s, len(tokens))
                if stage.cpu is not None:
                    self._side_by_side(None, None, self.cpu.run_chunk_stage, (stage,))
                self.gpu.collect()
                self.gpu.wait()  # the next stage's CPU part may write what this one's copies read
            else:
                self._side_by_side(self._gpu_chunk if stage.gpu else None, (stage, tokens, pos),
                                   self.cpu.run_chunk_stage if stage.cpu is not None else None, (stage,))
        self._sync_gpu_times()

    def _queue_chunk_stage(self, program: ChunkProgram, s: int, n: int) -> None:
        """Stage ``s`` of ``program``'s GPU part for the chunk's ``n`` tokens, queued back to back on
        a device that queues work: per token its arguments and input rows copied in, the stage's
        ops, its output rows copied out, as one launch (a graph from the second chunk on, its
        copies in place: the chunk's rows, tokens and positions stay where they are), with no
        wait between tokens."""
        assert self.gpu is not None
        stage = program.stages[s]
        for t in range(n):
            args = [(name, self.cpu.chunk_tokens[t : t + 1] if name == "tokens" else self._positions[t : t + 1])
                    for name in stage.gpu_args]
            self.gpu.launch(stage.gpu, args + [(name, rows[t]) for name, rows in stage.gpu_in],
                            [(name, rows[t]) for name, rows in stage.gpu_out], key=("chunk", id(program), s, t))

    def _gpu_chunk(self, job: tuple[ChunkStage, list[int], int]) -> None:
        """A chunk stage's GPU ops for each token in turn, on a GPU that runs them as it is called
        (the emulated one, on the worker): its inputs from the chunk's rows into the GPU's
        one-token slots, the ops, and its outputs back into the rows."""
        stage, tokens, pos = job
        gpu = self.gpu
        assert gpu is not None
        for t, token in enumerate(tokens):
            for name in stage.gpu_args:
                gpu.upload(name, np.array([token if name == "tokens" else pos + t], np.int32))
            for name, rows in stage.gpu_in:
                gpu.upload(name, rows[t])
            gpu.run(stage.gpu)
            gpu.download_many([(name, rows[t]) for name, rows in stage.gpu_out])

    def logits(self) -> np.ndarray:
        """The last step's logits (a view, overwritten by the next step)."""
        return self.cpu.logits()

    def greedy(self) -> int:
        """The last step's most likely token (the first index of the largest logit)."""
        if self.logits_on_gpu:
            return int(np.argmax(self.cpu.logits()))
        return self.cpu.greedy()

    def greedy_steps(self, token: int, pos: int, steps: int, stops: Collection[int] = ()) -> list[int]:
        """``steps`` decode steps, the first on ``token`` at ``pos`` and each next one on the greedy
        token of the one before, stopping after a step whose greedy token is one of ``stops``:
        their greedy tokens (the logits are the last step's). On a model that runs on the CPU
        alone, in a loop in generated code (``CpuExecutor.decode_greedy``); elsewhere a step at a
        time."""
        if pos + steps > self.ctx:  # the loop writes a KV cache row a step, unchecked
            raise ExecutorError(f"{steps} decode steps from position {pos} need {pos + steps} positions but the KV "
                                f"cache holds {self.ctx}")
        if self.gpu is None and self.cpu.loops:
            return self.cpu.decode_greedy(token, pos, steps, stops)
        if self.gpu_loops and steps > 1:
            return self._gpu_greedy(token, pos, steps, stops)
        tokens: list[int] = []
        for _ in range(steps):
            self.step(token, pos)
            token, pos = self.greedy(), pos + 1
            tokens.append(token)
            if token in stops:
                break
        return tokens

    def _gpu_greedy(self, token: int, pos: int, steps: int, stops: Collection[int]) -> list[int]:
        """:meth:`greedy_steps` on a model whose whole step is the GPU's, in batches (of
        :data:`EOS_BATCH` steps when there are ``stops`` to stop at) that the GPU runs without the
        host between their steps: the first step's token and position copied in, then each step
        but the batch's last followed by the loop's kernel (``GREEDY_LAUNCH``: the next token and
        position on the device, the token recorded at its position in the loop's state), the last
        step's logits and the record copied out; that step's token is the logits' argmax here.
        On a CUDA device a batch is queued graph after graph and waited for once. A batch may run
        past a stop token (the KV rows it wrote are past the position the caller goes on from)."""
        gpu = self.gpu
        assert gpu is not None
        loop, record = [*self._gpu_ops, GREEDY_LAUNCH], self._loop_state[1:]
        downloads = [(self.logits_value, self.cpu.logits()), (GREEDY_RECORD, record)]
        tokens: list[int] = []
        while len(tokens) < steps:
            n = min(steps - len(tokens), EOS_BATCH if stops else steps)
            self.cpu.set_token(token, pos)
            self._loop_state[0] = pos
            uploads = [*self._arguments(), (GREEDY_START, self._loop_state[:1])]
            if n == 1:
                self.step(token, pos)
            elif gpu.asynchronous:
                gpu.launch(loop, uploads, key=("greedy", "first"))
                for _ in range(n - 2):
                    gpu.launch(loop, key=("greedy", "next"))
                gpu.launch(self._gpu_ops, (), downloads, key=("greedy", "last"))
                gpu.collect()
                gpu.wait()
            else:
                for name, host in uploads:
                    gpu.upload(name, host)
                for _ in range(n - 1):
                    gpu.run(loop)
                gpu.run(self._gpu_ops)
                gpu.download_many(downloads)
            made = through_stop([int(t) for t in record[pos : pos + n - 1]] + [self.greedy()], stops)
            tokens += made
            token, pos = made[-1], pos + len(made)
            if len(made) < n or made[-1] in stops:
                break
        self._sync_gpu_times()
        return tokens

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the caller's thread stays on its CPU thread's core (steps inside it
        skip pinning it each time: see ``runtime.threads``)."""
        return self.cpu.team.pinned()

    @property
    def gpu_peak_bytes(self) -> int:
        """The device memory the GPU part allocated (0 without one)."""
        return self.gpu.peak_bytes if self.gpu is not None else 0

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self.gpu is not None:
            self.gpu.close()
        self.cpu.close()
