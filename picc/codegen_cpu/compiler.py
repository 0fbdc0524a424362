"""Compiling kernel IR to machine code with llvmlite, and loading object code back.

A :class:`CpuModule` owns an MCJIT execution engine. Function pointers it hands out are only
valid while the module object lives: llvmlite frees the machine code with the engine, and a call
through a dangling pointer is a segfault, so keep the module referenced (the ctypes functions it
returns hold a reference back to it).

``simd`` chooses the instruction set: ``"host"`` (this CPU and all its features),
``"avx512-vnni"`` (x86-64-v4, and AVX-512 VNNI in the functions that ask for it), ``"avx512"``
(x86-64-v4) or ``"avx2"`` (x86-64-v3: AVX2, FMA, F16C; no AVX-512, so the code runs on any
Haswell-or-later x86). The object code of one SIMD level runs on every CPU that has its features;
both AVX-512 levels come from the same kernel IR (``vector_isa``), but for the kernels written
for the level (``Kernel.by_level``: the batched rows8 int-x kernels, the q8_0 LM head's, the
sparse FFN with rounded x), which sum with ``vpdpbusd`` on ``avx512-vnni`` and alone get
VNNI (their functions' ``target-features``): compiled for a VNNI CPU, LLVM would turn the other
kernels' int16 ``vpmaddwd`` + add into ``vpdpwssd``, and the one-row step decoded 3-4% slower
for it on a Zen 4 (SmolLM2 dense, `picc bench`, alternating).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from picc.errors import PiccError
from picc.fsutil import cache_root, prune_cache, write_bytes_atomic
from runtime.cpu import host_features, simd_level

SIMD_CHOICES = ("host", "avx512-vnni", "avx512", "avx2")
# (LLVM CPU, extra features): avx512-vnni's VNNI is in its VNNI kernels' own attributes (prelude's #3)
_CPU_FOR_SIMD = {"avx512-vnni": ("x86-64-v4", ""), "avx512": ("x86-64-v4", ""), "avx2": ("x86-64-v3", "")}

_init_lock = threading.Lock()
_initialized = False


def _init_llvm() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _initialized = True


def host_simd() -> str:
    """The host's AVX-512 level (``avx512-vnni``, ``avx512``) when it has what the AVX-512 kernels
    use (``runtime.cpu.SIMD_NEEDS``), else ``avx2`` (the floor the kernels are written for)."""
    level = simd_level(host_features())
    return level if level.startswith("avx512") else "avx2"


def target_machine(simd: str = "host") -> llvm.TargetMachine:
    """An LLVM target machine for ``simd`` (see the module docstring), optimising at -O3."""
    _init_llvm()
    if simd not in SIMD_CHOICES:
        raise PiccError(f"codegen_cpu: simd {simd!r} is not supported; expected one of {', '.join(SIMD_CHOICES)}")
    target = llvm.Target.from_triple(llvm.get_process_triple())
    if simd == "host":
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    else:
        cpu, features = _CPU_FOR_SIMD[simd]
    return target.create_target_machine(cpu=cpu, features=features, opt=3, reloc="pic", codemodel="jitdefault")


def effective_simd(simd: str) -> str:
    """The SIMD level the kernels are generated for: ``host`` resolves to the host's level."""
    return host_simd() if simd == "host" else simd


class CpuModule:
    """Machine code for one LLVM IR module (or one object file), loaded into this process.

    ``CpuModule(ir_text, simd)`` parses, verifies and optimises the IR with LLVM's -O3 pipeline
    (the new pass builder, which vectorises to the target's width); it is JIT-compiled when
    a function is first asked for.
    ``CpuModule.from_object(obj, simd)`` loads object code made by :meth:`emit_object` instead.
    """

    def __init__(self, ir_text: str, simd: str = "host", *, optimize: bool = True) -> None:
        self.simd = simd
        self.source_ir = ir_text
        self._tm = target_machine(simd)
        try:
            mod = llvm.parse_assembly(ir_text)
            mod.verify()
        except RuntimeError as e:
            raise PiccError(f"codegen_cpu: the generated LLVM IR does not verify: {str(e).strip()}") from None
        mod.triple = self._tm.triple
        mod.data_layout = str(self._tm.target_data)
        if optimize:
            pto = llvm.create_pipeline_tuning_options(speed_level=3)
            pto.loop_vectorization = True
            pto.slp_vectorization = True
            pb = llvm.create_pass_builder(self._tm, pto)
            pb.getModulePassManager().run(mod, pb)
        self._llvm_module = mod
        self.ir = str(mod)
        # Machine code for this process is made on first use: `picc compile` only emits the
        # object (one code generation instead of two, a third of its CPU code time).
        self._jit: llvm.ExecutionEngine | None = None
        self._jit_lock = threading.Lock()
        self._objects: list[object] = []

    @property
    def _engine(self) -> llvm.ExecutionEngine:
        with self._jit_lock:
            if self._jit is None:
                self._jit = llvm.create_mcjit_compiler(self._llvm_module, self._tm)
                self._jit.finalize_object()
            return self._jit

    @classmethod
    def from_object(cls, obj: bytes, simd: str = "host") -> CpuModule:
        """Load object code (from :meth:`emit_object`) into a fresh engine; no IR is compiled."""
        self = cls.__new__(cls)
        self.simd = simd
        self.source_ir = ""
        self.ir = ""
        self._tm = target_machine(simd)
        empty = llvm.parse_assembly("")
        empty.triple = self._tm.triple
        self._llvm_module = empty
        self._jit_lock = threading.Lock()
        self._jit = llvm.create_mcjit_compiler(empty, self._tm)
        objf = llvm.ObjectFileRef.from_data(obj)
        self._objects = [objf]  # the engine refers to it; keep it alive with the engine
        self._jit.add_object_file(objf)
        self._jit.finalize_object()
        return self

    def emit_object(self) -> bytes:
        """The module's relocatable object code (ELF), loadable with :meth:`from_object`."""
        if not self.ir:
            raise PiccError("codegen_cpu: a module loaded from object code cannot emit it again")
        return self._tm.emit_object(self._llvm_module)

    def emit_assembly(self) -> str:
        """The module's assembly, for reading what the kernels compiled to."""
        return self._tm.emit_assembly(self._llvm_module)

    def address(self, symbol: str) -> int:
        """The address of function ``symbol``; a PiccError when the module has none."""
        addr = self._engine.get_function_address(symbol)
        if not addr:
            raise PiccError(f"codegen_cpu: the compiled module has no function {symbol!r}")
        return addr

    def function(self, symbol: str, argtypes: Sequence[type]) -> ctypes._CFuncPtr:
        """``symbol`` as a ctypes function returning void; it keeps this module alive."""
        proto = ctypes.CFUNCTYPE(None, *argtypes)
        fn = proto(self.address(symbol))
        fn._picc_module = self  # type: ignore[attr-defined]  # the engine must outlive the pointer
        return fn


# Compiled objects kept in the cache (the most recently used); a SmolLM2 entry is ~2.4 MB.
OBJECT_CACHE_ENTRIES = 24


def compiled_object(ir_text: str, simd: str, *, object_code: bool = True) -> tuple[str, bytes]:
    """The optimised IR and the object code of ``ir_text`` for ``simd`` ("avx2", "avx512" or
    "avx512-vnni", whose CPUs are fixed, unlike "host"'s): what a .pib carries. With
    ``object_code=False``, the optimised IR alone and ``b""``: no code generation, about half of
    LLVM's time (a VNNI compile's AVX-512 fallback IR, which the .pib carries as IR).

    Cached in ``$PICC_CACHE_DIR/cpu-objects``: LLVM takes seconds on a model, and the same CPU
    program comes back whenever a model's CPU part does not change (a recompile, a VRAM budget
    that moves nothing to the GPU, the test suite's compiles of the same small models). Keyed by
    the IR, the SIMD level, LLVM's version and this file (the pipeline and target options). An
    entry that cannot be read or written, or whose files do not match the digest stored beside
    them, costs only the time of compiling."""
    if simd not in _CPU_FOR_SIMD:
        raise PiccError(f"codegen_cpu: cached objects are for a fixed SIMD level ({', '.join(_CPU_FOR_SIMD)}), "
                        f"not {simd!r}")
    key = hashlib.sha256("\0".join((simd, ".".join(map(str, llvm.llvm_version_info)), llvmlite.__version__,
                                      Path(__file__).read_text(encoding="utf-8"), ir_text,
                                      *(() if object_code else ("ir only",)))).encode()).hexdigest()
    folder = cache_root() / "cpu-objects"
    ir_path, obj_path, sum_path = (folder / f"{key[:32]}{suffix}" for suffix in (".ll", ".o", ".sha256"))
    try:
        ir_bytes, obj, digest = ir_path.read_bytes(), obj_path.read_bytes(), sum_path.read_text(encoding="ascii")
        found = (ir_bytes.decode("utf-8"), obj) if digest == _entry_digest(ir_bytes, obj) else None
    except (OSError, UnicodeDecodeError):
        found = None
    if found is not None:
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
            sum_path.touch()  # recently used
        return found
    module = CpuModule(ir_text, simd)
    optimised, obj = module.ir, module.emit_object() if object_code else b""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        ir_bytes = optimised.encode("utf-8")
        write_bytes_atomic(ir_path, ir_bytes)
        write_bytes_atomic(obj_path, obj)
        # last: an entry counts once its digest is there, and a damaged one is compiled again
        write_bytes_atomic(sum_path, _entry_digest(ir_bytes, obj).encode("ascii"))
        prune_cache(folder, "*.sha256", OBJECT_CACHE_ENTRIES, companions=(".o", ".ll"))
    except OSError:
        pass  # a read-only or full cache only costs the next compile its time
    return optimised, obj


def _entry_digest(ir: bytes, obj: bytes) -> str:
    h = hashlib.sha256(ir)
    h.update(b"\0")
    h.update(obj)
    return h.hexdigest()
