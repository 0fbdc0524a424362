"""The CPU executor: runs a .pib's generated decode step on this machine's cores.

The .pib carries the CPU's step programs (one per stage of the hybrid step; one in all for a model
that runs on the CPU alone) as object code for its SIMD level (``cpu/object``), the same code as
LLVM IR (``cpu/ir``) and a manifest (``cpu/manifest``, :class:`runtime.cpu_manifest.CpuManifest`:
the stages' symbols, the buffers behind their ``bufs`` table, where crossing values and the logits
are). Loading copies the weights out of the file into memory in 2 MiB pages, with the rest
(activations, KV caches, scratch) beside them (:mod:`runtime.hostmem`; where the kernel has no
such pages the weights stay mapped from the file), and fills the table once; a stage then costs
one call of its program per thread. When this CPU lacks the SIMD level the object code was built
for (AVX-512 code on an AVX2 machine), the IR is compiled for this CPU
instead. Prompts run through the chunk programs (``prefill``, ``logits_chunk``: per stage, a
program over a chunk of tokens and the chunk rows the GPU's ops read and write), which
``runtime.executor`` drives.

``decode_greedy()`` runs many greedy decode steps in one call of the generated decode loop
(``picc_decode``: each step fed the greedy token of the one before, no return to Python between
them), where the code has one: a model that runs on the CPU alone.

``start_profile()`` swaps each stage's step for its profiled twin (a clock around every kernel
call and barrier, ``picc.codegen_cpu.program.Program.profiled``) and gives its counters memory;
``stop_profile()`` swaps back and returns what they counted (:class:`StageProfile`).
``start_profile(batch=True)`` does the same for the batch step alone.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import numpy as np

from runtime import hostmem
from runtime.cpu_manifest import STOP_SLOTS, ChunkRows, CpuChunkProgram, CpuManifest, ProfiledStep
from runtime.pib import PibFile
from runtime.threads import ThreadTeam

_STEP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
_BARRIER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
_WORKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
_CLOCK = ctypes.CFUNCTYPE(ctypes.c_int64)
_init_lock = threading.Lock()


@dataclass
class ChunkStage:
    """A stage of a chunk program: the CPU's program (None: no CPU ops) and the GPU's ops, with
    the chunk rows ([chunk, bytes] views) its tokens upload before them and download after."""

    cpu: ctypes._CFuncPtr | None
    gpu: list[str]
    gpu_args: list[str]  # function arguments (``tokens``, ``pos``) the GPU's ops read
    gpu_in: list[tuple[str, np.ndarray]]
    gpu_out: list[tuple[str, np.ndarray]]


@dataclass
class ChunkProgram:
    """A step for a chunk of tokens, stage by stage; ``logits``: each token's logits row after it."""

    stages: list[ChunkStage]
    logits: np.ndarray | None


BATCH_STAGE = -1  # the stage number of the batch step's profile (StageProfile.stage)


@dataclass
class StageProfile:
    """What stage ``stage``'s profiled step (:data:`BATCH_STAGE`: the batch step's) counted: per
    call (``calls``: its kernel and the IR value it computes), per thread, the cycles in the call
    (``kernel[t, n]``) and in the barrier after it (``wait[t, n]``), over ``runs`` steps; ``hz``:
    the clock's cycles per second."""

    stage: int
    calls: list[tuple[str, str]]
    kernel: np.ndarray
    wait: np.ndarray
    runs: int
    hz: float


class ExecutorError(Exception):
    """A compiled model that cannot run here; the message says why."""


def _llvm():  # noqa: ANN202 - the llvmlite.binding module, imported when first needed
    import llvmlite.binding as llvm

    with _init_lock:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
    return llvm


SIMD_NEEDS = {"avx512-vnni": ("avx512f", "avx512bw", "avx512vl", "avx512vnni"),
              "avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c")}
"""The instruction set extensions each SIMD level of the generated code uses, widest first: the one
rule the targets (from /proc/cpuinfo's flags, ``avx512_vnni`` read as ``avx512vnni``), the code
generator and the runtime (from LLVM's host features) decide a CPU's level by. ``avx512-vnni`` is
the AVX-512 code with the int16 dot products' multiply-adds fused into ``vpdpwssd``."""


def simd_level(features: Iterable[str]) -> str:
    """The widest level (``avx512-vnni``, ``avx512``, ``avx2``) whose extensions are all in
    ``features``, else ``sse``."""
    have = set(features)
    return next((level for level, need in SIMD_NEEDS.items() if set(need) <= have), "sse")


def vector_isa(level: str) -> str:
    """The vector instruction set the kernels of a SIMD level are written for: ``avx512`` for both
    AVX-512 levels (VNNI changes only the instructions LLVM may select), else the level."""
    return "avx512" if level.startswith("avx512") else level


def host_features() -> set[str]:
    """The extensions this process's CPU has, by LLVM's names."""
    return {name for name, on in _llvm().get_host_cpu_features().items() if on}


def host_has(simd: str) -> bool:
    return set(SIMD_NEEDS[simd]) <= host_features()


class MachineCode:
    """Code loaded into this process; its functions live as long as this object does."""

    def __init__(self, obj: bytes | None, ir: str, simd: str) -> None:
        llvm = _llvm()
        target = llvm.Target.from_triple(llvm.get_process_triple())
        self.rejit = obj is None or not host_has(simd)
        if self.rejit and not host_has("avx2"):
            raise ExecutorError("this CPU lacks AVX2 (with FMA and F16C), which picc's CPU kernels need")
        # The engine frees the code when it is collected: keep it (and its object file) referenced.
        tm = target.create_target_machine(cpu=llvm.get_host_cpu_name() if self.rejit else "",
                                          features=llvm.get_host_cpu_features().flatten() if self.rejit else "",
                                          opt=3, reloc="pic", codemodel="jitdefault")
        if self.rejit:
            module = llvm.parse_assembly(ir)
            module.verify()
            self._engine = llvm.create_mcjit_compiler(module, tm)
        else:
            empty = llvm.parse_assembly("")
            empty.triple = tm.triple
            self._engine = llvm.create_mcjit_compiler(empty, tm)
            self._object = llvm.ObjectFileRef.from_data(obj)
            self._engine.add_object_file(self._object)
        self._engine.finalize_object()

    def function(self, symbol: str, prototype: type) -> ctypes._CFuncPtr:
        address = self._engine.get_function_address(symbol)
        if not address:
            raise ExecutorError(f"the compiled code has no function {symbol!r}")
        fn = prototype(address)
        fn._owner = self  # a function pointer must not outlive the code it points into
        return fn


def through_stop(tokens: list[int], stops: Collection[int]) -> list[int]:
    """``tokens`` up to and with the first of ``stops`` among them (all of them: none is)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def _buffers(pib: PibFile, manifest: CpuManifest) -> list[np.ndarray]:
    """The memory behind each of the manifest's buffers: the weights copied from the file, zeroed
    memory for the rest (params, sync, function slots, allocations), all cut from one region in
    2 MiB pages where this kernel gives them (:mod:`runtime.hostmem`); elsewhere the weights stay
    mapped from the file, as they are, and the rest is cut from one region of ordinary pages.
    Either way the memory the code writes is one page-aligned region (see :meth:`CpuExecutor.crossing_spans`)."""
    specs = manifest.buffers
    weights = {i: pib.tensor(s.name).data for i, s in enumerate(specs) if s.kind == "weight" and s.name is not None}
    sizes = [weights[i].nbytes if i in weights else max(s.nbytes or 0, 64) for i, s in enumerate(specs)]
    if not hostmem.huge_pages_enabled():
        own = iter(hostmem.carve([size for i, size in enumerate(sizes) if i not in weights]))
        return [weights[i] if i in weights else next(own) for i in range(len(sizes))]
    arrays = hostmem.carve(sizes)
    for i, w in weights.items():
        arrays[i][:] = w.reshape(-1).view(np.uint8)
    pib.release_pages()  # the copies are what the step reads; the file's pages may leave this process
    return arrays


class CpuExecutor:
    """The CPU's part of a compiled model: its stage programs, its buffers and its threads.

    ``run_stage(i)`` runs stage i's program (all threads); ``value(name)`` is the host memory of
    a value that crosses devices (the hybrid executor copies through it). On a model that runs on
    the CPU alone, ``step(token, pos)`` runs the whole step and ``logits()`` / ``greedy()`` read it.
    ``prefill_chunks`` / ``logits_chunks`` are the chunk programs; ``load_chunk`` and
    ``run_chunk_stage`` run their CPU parts.
    """

    def __init__(self, pib: PibFile, threads: int | None = None) -> None:
        manifest = CpuManifest.from_json(pib.json("cpu/manifest"))
        self._path = pib.path
        self._manifest = manifest
        if threads is None:  # every core this process may run on, as many as the code allows
            threads = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                          manifest.max_threads)
        if not 1 <= threads <= manifest.max_threads:
            raise ExecutorError(f"--threads {threads}: expected 1 to {manifest.max_threads}")
        self.code = MachineCode(pib.section("cpu/object") if pib.has("cpu/object") else None,
                                pib.text("cpu/ir"), manifest.simd)
        self._keep = _buffers(pib, manifest)
        self.params = next((a.view(np.int32) for a, b in zip(self._keep, manifest.buffers, strict=True)
                            if b.kind == "params"), np.zeros(16, np.int32))
        table = (ctypes.c_void_p * len(manifest.buffers))()
        for i, array in enumerate(self._keep):
            table[i] = array.ctypes.data
        self._table = table
        self._slots = manifest.params
        self._values = manifest.values
        where = manifest.logits
        self._logits = np.frombuffer(self._keep[where.buffer], dtype=np.float32, count=where.n, offset=where.offset)
        self.vocab = where.n
        self.computes_greedy = manifest.greedy
        self.team = ThreadTeam(threads, native=self._native_team())
        self._table_ptr = ctypes.cast(self._table, ctypes.c_void_p).value

        def job(symbol: str | None) -> ctypes._CFuncPtr | None:  # a step function, or None: no CPU ops
            return None if symbol is None else self.code.function(symbol, _STEP)

        self._jobs = [(job(st.step), job(st.prefill)) for st in manifest.stages]
        self._job = job
        self._profiling: list[tuple[int, np.ndarray]] | None = None  # (stage, counters) while profiling
        self._hz: float | None = None  # the profile clock's rate, once measured
        self.prefill_chunks = self._chunk_program(manifest.prefill, job)
        self.logits_chunks = self._chunk_program(manifest.logits_chunk, job)
        self._decode = manifest.decode  # None: the model has a GPU part
        self._decode_fn = job(self._decode.symbol) if self._decode else None
        self._decode_out = self._keep[self._decode.out].view(np.int32) if self._decode else None
        self.chunk = manifest.prefill.chunk
        self.step_bits = manifest.prefill.step_bits  # the chunk programs compute each token's step bits
        self._chunk_tokens = self._keep[manifest.prefill.tokens].view(np.int32)
        self._batch = manifest.batch
        if self._batch is not None:
            b = self._batch
            self._batch_fn = job(b.symbol)
            self._batch_rows = [self._keep[i].view(np.int32) for i in (b.tokens, b.positions, b.greedy)]
            self._batch_kv = self._keep[b.kv_table].view(np.uint64).reshape(b.capacity, -1)
            self._batch_logits = [np.frombuffer(self._keep[b.logits.buffer], np.float32, count=b.logits.n,
                                                offset=b.logits.offset + s * b.stride) for s in range(b.capacity)]

    def _native_team(self) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
        """The generated code's thread-team worker and barrier (runtime.threads; every file of this
        format has them)."""
        return self.code.function("picc_team_worker", _WORKER), self.code.function("picc_team_barrier", _BARRIER)

    @property
    def stages(self) -> int:
        return len(self._jobs)

    def set_token(self, token: int, pos: int) -> None:
        self.params[self._slots["pos"]] = pos
        self.params[self._slots["token"]] = token

    def step_argument(self, name: str) -> np.ndarray:
        """Where :meth:`set_token` put the step's argument ``name`` (``tokens``: the token;
        ``pos``: its position), as a one-element int32 array, for a GPU that reads it too."""
        slot = self._slots["token" if name == "tokens" else name]
        return self.params[slot : slot + 1]

    def run_stage(self, stage: int, prefill: bool = False) -> None:
        """Run stage ``stage``'s CPU program (``prefill``: without the output head)."""
        job = self._jobs[stage][1 if prefill else 0]
        if job is not None:
            self.team.run_step(job, self._table_ptr)

    def _chunk_program(self, spec: CpuChunkProgram,
                       job: Callable[[str | None], ctypes._CFuncPtr | None]) -> ChunkProgram:
        """The manifest's chunk program ``spec`` bound to this process's code and buffers."""
        rows = None
        if spec.logits is not None:
            where = spec.logits
            rows = np.frombuffer(self._keep[where.buffer], dtype=np.float32, count=spec.chunk * where.n,
                                 offset=where.offset).reshape(spec.chunk, where.n)
        stages = [ChunkStage(job(st.cpu), list(st.gpu), list(st.gpu_args),
                             [(r.value, self._rows_of(r, spec.chunk)) for r in st.gpu_in],
                             [(r.value, self._rows_of(r, spec.chunk)) for r in st.gpu_out])
                  for st in spec.stages]
        return ChunkProgram(stages, rows)

    def _rows_of(self, where: ChunkRows, chunk: int) -> np.ndarray:
        """A value's rows in the chunk buffer: [chunk, nbytes] bytes, row t for token t."""
        start, stride = where.offset, where.stride
        base = self._keep[where.buffer][start : start + chunk * stride]
        return base.reshape(chunk, stride)[:, : where.nbytes]

    def load_chunk(self, tokens: list[int], pos: int) -> None:
        """Set up a chunk: ``tokens`` (at most :attr:`chunk`) at positions ``pos ..``."""
        assert self._chunk_tokens is not None and len(tokens) <= self.chunk
        self._chunk_tokens[: len(tokens)] = tokens
        self.params[self._slots["pos"]] = pos
        self.params[self._slots["seq"]] = len(tokens)

    def run_chunk_stage(self, stage: ChunkStage) -> None:
        """Run a chunk stage's CPU program (all threads) on the chunk :meth:`load_chunk` set up."""
        if stage.cpu is not None:
            self.team.run_step(stage.cpu, self._table_ptr)

    def kv_caches(self) -> dict[int, int]:
        """The KV caches the generated code indexes: ``bufs`` index -> bytes (each layer's k rows
        then v rows, shared by the step, the decode loop and the chunk programs)."""
        return {i: spec.nbytes or 0 for i, spec in enumerate(self._manifest.buffers) if spec.kind == "kv"}

    def kv_parts(self, index: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """KV cache ``bufs[index]``'s k rows and v rows (those narrower where the attention's values
        are), each as (byte offset, bytes, runs of the context's positions: one a KV head): position
        p of a part's run is at ``p * row`` of the run, where ``row`` is ``bytes / runs / ctx``."""
        spec = self._manifest.buffers[index]
        assert spec.planes is not None and spec.nbytes is not None and spec.k_nbytes is not None
        runs = spec.planes // 2
        return (0, spec.k_nbytes, runs), (spec.k_nbytes, spec.nbytes - spec.k_nbytes, runs)

    def cache_array(self, index: int) -> np.ndarray:
        """The memory ``bufs[index]`` was allocated with (a KV cache's, say)."""
        return self._keep[index]

    def bind(self, index: int, array: np.ndarray) -> None:
        """Point ``bufs[index]`` at ``array`` (a KV cache of the same size, kept alive by the
        caller): the next steps read and write it instead."""
        assert array.nbytes >= (self._manifest.buffers[index].nbytes or 0)
        self._table[index] = array.ctypes.data

    def value(self, name: str) -> np.ndarray:
        """The host bytes of value ``name`` (one token), which crosses between the devices."""
        v = self._values[name]
        return self._keep[v.buffer][v.offset : v.offset + v.nbytes]

    def shared_values(self) -> set[str]:
        """The crossing values whose bytes another value of the step shares (an in-place kernel
        writes them again): a copy that reads one while the CPU runs on needs a snapshot."""
        return {name for name, v in self._values.items() if v.shared}

    def crossing_spans(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the whole pages of this executor's memory that a GPU copies to
        and from (to be page-locked for it): the buffers of the crossing values, the logits, the
        step's arguments, the chunk's tokens and the chunk rows its GPU part reads and writes;
        each buffer's pages, merged where they meet. The buffers are cut from one page-aligned
        region (:func:`_buffers`), so a span rounded out to pages stays inside it; the weights
        between them are left out."""
        m = self._manifest
        buffers = ({v.buffer for v in self._values.values()} | {m.logits.buffer, m.prefill.tokens}
                   | {i for i, b in enumerate(m.buffers) if b.kind == "params"}
                   | {r.buffer for program in (m.prefill, m.logits_chunk) for st in program.stages
                      for r in (*st.gpu_in, *st.gpu_out)}
                   | {program.logits.buffer for program in (m.prefill, m.logits_chunk) if program.logits is not None})
        spans: list[list[int]] = []
        for start, end in sorted(hostmem.page_span(self._keep[i]) for i in buffers):
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        return [(start, end - start) for start, end in spans]

    @property
    def chunk_tokens(self) -> np.ndarray:
        """The chunk's token ids (int32), as :meth:`load_chunk` wrote them."""
        return self._chunk_tokens

    def step(self, token: int, pos: int, *, logits: bool = True) -> None:
        """Run the model on ``token`` at position ``pos`` (its KV cache holds positions < pos).

        ``logits=False`` skips the output head (a prompt token whose logits nobody reads); the
        logits and greedy token of such a step are stale.
        """
        self.set_token(token, pos)
        for stage in range(self.stages):
            self.run_stage(stage, prefill=not logits)

    def logits(self) -> np.ndarray:
        """The last step's logits (a view, overwritten by the next step)."""
        return self._logits

    @property
    def loops(self) -> bool:
        """Whether greedy decode steps can run in a loop in generated code (:meth:`decode_greedy`)."""
        return self._decode is not None

    def decode_greedy(self, token: int, pos: int, steps: int, stops: Collection[int] = ()) -> list[int]:
        """``steps`` decode steps, the first on ``token`` at ``pos`` and each next one on the greedy
        token of the one before, stopping after a step whose greedy token is one of ``stops``:
        their greedy tokens. One call of generated code per ``capacity`` steps (the loop's output
        buffer); the logits are the last step's. The loop compares with :data:`STOP_SLOTS` stop
        tokens; with more, it may run past one of the others, and the tokens are cut after it
        (the KV rows written past it are beyond the position the caller goes on from)."""
        spec, fn, out = self._decode, self._decode_fn, self._decode_out
        if spec is None:
            raise ExecutorError(f"{self._path}: has no decode loop (the model has a GPU part)")
        assert fn is not None and out is not None  # set with spec
        params, slots = self.params, self._slots
        first = slots["stops"]
        listed = sorted(stops)[:STOP_SLOTS]
        params[first : first + STOP_SLOTS] = listed + [-1] * (STOP_SLOTS - len(listed))
        tokens: list[int] = []
        while len(tokens) < steps:
            want = min(steps - len(tokens), spec.capacity)
            params[slots["token"]], params[slots["pos"]] = token, pos
            params[slots["steps"]], params[slots["done"]] = want, 0
            self._table[spec.step] = ctypes.cast(self._jobs[0][0], ctypes.c_void_p).value  # or its profiled twin
            self.team.run_step(fn, self._table_ptr)
            done = int(params[slots["done"]])
            made = through_stop(out[:done].tolist(), stops)
            tokens += made
            if len(made) < want or made[-1] in stops:  # a stop token ended it
                break
            token, pos = tokens[-1], pos + done
        return tokens

    @property
    def batch_capacity(self) -> int:
        """Sequences the batch step decodes at once (0: the model has none: a GPU part)."""
        return self._batch.capacity if self._batch is not None else 0

    @property
    def batch_caches(self) -> tuple[int, ...]:
        """The ``bufs`` indices of the KV caches, in the order a batch row's cache pointers go."""
        return self._batch.caches if self._batch is not None else ()

    def batch_step(self, tokens: list[int], positions: list[int], caches: np.ndarray) -> None:
        """One decode step for each row: ``tokens[s]`` at ``positions[s]`` with the KV caches whose
        addresses are ``caches[s]`` (one per :attr:`batch_caches` entry). Each row's logits and
        greedy token are exactly those of :meth:`step` on its caches (:meth:`batch_logits`,
        :meth:`batch_greedy`)."""
        n = len(tokens)
        if self._batch is None or not 1 <= n <= self._batch.capacity:
            raise ExecutorError(f"batch_step: {n} rows, the batch step takes 1 to {self.batch_capacity}")
        token_row, pos_row, _ = self._batch_rows
        token_row[:n], pos_row[:n] = tokens, positions
        self._batch_kv[:n, : caches.shape[1]] = caches
        self.params[self._slots["batch"]] = n
        self.team.run_step(self._batch_fn, self._table_ptr)

    def batch_logits(self, row: int) -> np.ndarray:
        """Row ``row``'s logits after :meth:`batch_step` (a view, overwritten by the next one)."""
        return self._batch_logits[row]

    def batch_greedy(self, rows: int) -> list[int]:
        """The first ``rows`` rows' greedy tokens after :meth:`batch_step`."""
        return self._batch_rows[2][:rows].tolist()

    def greedy(self) -> int:
        """The last step's most likely token (the first index of the largest logit)."""
        if self.computes_greedy:
            return int(self.params[self._slots["greedy"]])
        return int(np.argmax(self._logits))

    def start_profile(self, batch: bool = False) -> None:
        """Run the profiled steps from now on, their counters zeroed (prompt chunks are not
        profiled); ``batch``: the batch step's (:meth:`batch_step`) instead of the stages'."""
        if self._profiling is not None:
            raise ExecutorError("start_profile() while profiling already")
        self._profiling = []
        if batch:
            profile = self._batch.profile if self._batch is not None else None
            if profile is None:
                raise ExecutorError(f"{self._path}: has no profiled batch step (compiled before it had one, "
                                    "or the model has a GPU part)")
            self._batch_fn = self._job(profile.step)
            self._profiling.append((BATCH_STAGE, self._counters(profile)))
            return
        for stage, st in enumerate(self._manifest.stages):
            if st.profile is not None:
                self._jobs[stage] = (self._job(st.profile.step), self._jobs[stage][1])
                self._profiling.append((stage, self._counters(st.profile)))

    def _counters(self, profile: ProfiledStep) -> np.ndarray:
        """Zeroed counters for ``profile``'s step, bound to its table entry: a row per thread."""
        slots = self._manifest.buffers[profile.buffer].slots
        assert slots is not None
        counters = hostmem.aligned_zeros(8 * self.team.nthreads * slots).view(np.int64)
        self._keep[profile.buffer] = counters
        self._table[profile.buffer] = counters.ctypes.data
        return counters.reshape(self.team.nthreads, -1)

    def stop_profile(self) -> list[StageProfile]:
        """Back to the plain steps; what each profiled step counted since :meth:`start_profile`
        (the batch step's: stage :data:`BATCH_STAGE`)."""
        if self._profiling is None:
            raise ExecutorError("stop_profile() without start_profile()")
        if self._hz is None:
            self._hz = self._clock_rate()
        out = []
        for stage, counters in self._profiling:
            if stage == BATCH_STAGE:
                assert self._batch is not None and self._batch.profile is not None
                self._batch_fn = self._job(self._batch.symbol)
                profile = self._batch.profile
            else:
                st = self._manifest.stages[stage]
                assert st.profile is not None
                self._jobs[stage] = (self._job(st.step), self._jobs[stage][1])
                profile = st.profile
            calls = list(profile.calls)
            n = len(calls)  # counters per thread: kernel, wait for each call, then the runs (profile_slots)
            out.append(StageProfile(stage, calls, counters[:, 0 : 2 * n : 2].copy(), counters[:, 1 : 2 * n : 2].copy(),
                                    int(counters[0, 2 * n]), self._hz))
        self._profiling = None
        return out

    def _clock_rate(self, seconds: float = 0.05) -> float:
        """Cycles per second of the profiled steps' clock, against ``time.perf_counter``: the two
        read together (the clock just before and just after the timer, the pair kept only when
        nothing came between them, as a preemption would) ``seconds`` apart."""
        clock = self.code.function("picc_cycles", _CLOCK)

        def together() -> tuple[int, float]:
            best = None
            for _ in range(100):
                before, t, after = clock(), time.perf_counter(), clock()
                if best is None or after - before < best[0]:
                    best = (after - before, (before + after) // 2, t)
            return best[1], best[2]

        c0, t0 = together()
        while time.perf_counter() - t0 < seconds:
            pass
        c1, t1 = together()
        return (c1 - c0) / (t1 - t0)

    def close(self) -> None:
        self.team.close()
