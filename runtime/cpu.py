"""The CPU executor: runs a .pib's generated decode step on this machine's cores.

The .pib carries the step as object code for its SIMD level (``cpu/object``), the same code as
LLVM IR (``cpu/ir``) and a manifest (``cpu/manifest``: the step's symbol, the buffers behind its
``bufs`` table, where the logits are). Loading maps the weights straight from the file, allocates
the rest (activations, KV caches, scratch) and fills the table once; a token then costs one call
of the step per thread. When this CPU lacks the SIMD level the object code was built for
(AVX-512 code on an AVX2 machine), the IR is compiled for this CPU instead.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from runtime.pib import PibFile
from runtime.threads import ThreadTeam

_STEP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
_init_lock = threading.Lock()


class ExecutorError(Exception):
    """A compiled model that cannot run here; the message says why."""


def _llvm():  # noqa: ANN202 - the llvmlite.binding module, imported when first needed
    import llvmlite.binding as llvm

    with _init_lock:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
    return llvm


def host_has(simd: str) -> bool:
    features = _llvm().get_host_cpu_features()
    need = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c")}[simd]
    return all(features.get(f, False) for f in need)


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


def _zeros(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


class CpuExecutor:
    """One decode step at a time: ``step(token, pos)`` then ``logits()`` / ``greedy()``."""

    def __init__(self, pib: PibFile, threads: int = 1) -> None:
        if not pib.has("cpu/manifest"):
            raise ExecutorError(f"{pib.path}: has no CPU code (compiled by an older picc?); recompile it")
        manifest = pib.json("cpu/manifest")
        if not 1 <= threads <= manifest["max_threads"]:
            raise ExecutorError(f"--threads {threads}: expected 1 to {manifest['max_threads']}")
        self.code = MachineCode(pib.section("cpu/object") if pib.has("cpu/object") else None,
                                pib.text("cpu/ir"), manifest["simd"])
        self._step = self.code.function(manifest["step"], _STEP)
        prefill = manifest.get("prefill_step")
        self._prefill = self.code.function(prefill, _STEP) if prefill else self._step
        self._keep: list[np.ndarray] = []
        table = (ctypes.c_void_p * len(manifest["buffers"]))()
        self.params = np.zeros(16, dtype=np.int32)
        for i, spec in enumerate(manifest["buffers"]):
            kind = spec["kind"]
            if kind == "weight":
                array = pib.tensor(spec["name"]).data
            elif kind == "params":
                array = self.params
            else:  # sync, zeros, alloc: zeroed memory the step owns
                array = _zeros(max(int(spec["nbytes"]), 64))
            self._keep.append(array)
            table[i] = array.ctypes.data
        self._table = table
        self._slots = manifest["params"]
        where = manifest["logits"]
        base = self._keep[where["buffer"]]
        self._logits = np.frombuffer(base, dtype=np.float32, count=where["n"], offset=where["offset"])
        self.vocab = int(where["n"])
        self.team = ThreadTeam(threads)
        table_ptr = ctypes.cast(self._table, ctypes.c_void_p)
        n = ctypes.c_int32(threads)
        self._job = lambda tid: self._step(table_ptr, tid, n)
        self._prefill_job = lambda tid: self._prefill(table_ptr, tid, n)

    def step(self, token: int, pos: int, *, logits: bool = True) -> None:
        """Run the model on ``token`` at position ``pos`` (its KV cache holds positions < pos).

        ``logits=False`` skips the output head (a prompt token whose logits nobody reads); the
        logits and greedy token of such a step are stale.
        """
        self.params[self._slots["pos"]] = pos
        self.params[self._slots["token"]] = token
        self.team.run_each(self._job if logits else self._prefill_job)

    def logits(self) -> np.ndarray:
        """The last step's logits (a view, overwritten by the next step)."""
        return self._logits

    def greedy(self) -> int:
        """The last step's most likely token (computed by the step itself)."""
        return int(self.params[self._slots["greedy"]])

    def close(self) -> None:
        self.team.close()
