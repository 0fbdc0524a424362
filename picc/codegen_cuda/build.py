"""Builds of the kernels: CUDA source / PTX / cubin per GPU architecture, and the host build.

``build_cuda`` schedules every kernel for an architecture, lets TVM generate its CUDA C, and,
where ``nvcc`` is on the PATH, compiles that source to PTX and cubin. Each source is one
self-contained translation unit (TVM prepends the headers it needs), so ``nvcc -ptx NAME.cu``
compiles it alone.

``build_host`` compiles the same TensorIR definition with LLVM for the CPU (with a simple CPU
schedule, ``schedules.cpu_schedule``, or exactly as defined): the engine of the host-emulated GPU
executor. Host builds are cached per process by the kernel's
structure (building takes ~0.05-0.5 s per kernel; tests and the runtime ask for the same kernel
many times).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from picc.codegen_cuda.kernel import Kernel
from picc.codegen_cuda.schedules import arch_params, cpu_schedule, schedule
from picc.errors import PiccError
from runtime.contracts import KernelLaunch


@dataclass(frozen=True, slots=True)
class CudaArtifact:
    """One kernel built for one architecture: its CUDA source and, with nvcc, PTX and cubin.

    ``entry_points`` are the ``__global__`` functions in launch order (TVM splits a kernel with
    several stages into several launches, named ``<name>_kernel``, ``<name>_kernel_1``, ...).
    """

    name: str
    arch: str
    source: str
    entry_points: tuple[str, ...]
    ptx: bytes | None = None
    cubin: bytes | None = None
    launches: tuple[KernelLaunch, ...] = ()  # per entry point


def cuda_source(kernel: Kernel, arch: str) -> str:
    """The CUDA C TVM generates for ``kernel`` scheduled for ``arch``."""
    return _cuda_build(kernel, arch)[0]


def _cuda_build(kernel: Kernel, arch: str, func: tirx.PrimFunc | None = None) -> tuple[str, tirx.PrimFunc]:
    """``kernel``'s CUDA source and scheduled function (``func``: already scheduled for ``arch``)."""
    arch_params(arch)
    func = schedule(kernel, arch) if func is None else func
    mod = tvm.IRModule({kernel.name: func})
    try:
        lib = tvm.compile(mod, target={"kind": "cuda", "arch": arch})
    except Exception as err:  # TVM raises its own error types; say which kernel failed
        raise PiccError(f"TVM could not build kernel {kernel.name} for {arch}: "
                        f"{str(err).strip().splitlines()[-1]}") from err
    return with_dependent_launch(str(lib.mod.imports[0].inspect_source("cuda"))), func


GRID_DEPENDENCY = """\
// picc: programmatic dependent launch (sm_90 and newer). Every kernel first waits until the
// kernels before it in the stream have finished and their writes are visible, so the runtime may
// launch it before they are done: its launch's latency hides behind them. No kernel triggers its
// dependents early: inside a CUDA graph a dependent may then read only what was written before the
// trigger (measured on an H100: wrong logits from the second token on). Elsewhere (and for a
// launch without the attribute) the wait is a no-op.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define PICC_GRID_DEPENDENCY() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PICC_GRID_DEPENDENCY()
#endif
"""


def with_dependent_launch(source: str) -> str:
    """``source`` with :data:`GRID_DEPENDENCY` first and its macro at the start of every
    ``__global__`` function, so the runtime may launch the kernels with programmatic stream
    serialization (``CudaManifest.dependent_launch``)."""
    body = re.sub(r'^(extern "C" __global__ void .*\{)$', r"\1\n  PICC_GRID_DEPENDENCY();", source, flags=re.M)
    return GRID_DEPENDENCY + body


_THREAD_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")


def thread_extents(func: tirx.PrimFunc) -> list[dict[str, int]]:
    """Per launch of a scheduled kernel, in order, the extent of each thread axis it binds.

    Each outermost thread-bound loop nest becomes one ``__global__`` function (TVM's
    ``<name>_kernel``, ``<name>_kernel_1``, ...); its grid and block are the extents bound
    inside it. Shapes are static, so these are the launch configuration the host side of a TVM
    module would compute.
    """
    launches: list[dict[str, int]] = []

    def walk(node: tirx.Stmt, current: dict[str, int] | None) -> None:
        if isinstance(node, tirx.For):
            tag = node.thread_binding.thread_tag if node.thread_binding is not None else ""
            if tag in _THREAD_AXES:
                if current is None:
                    current = {}
                    launches.append(current)
                current[tag] = max(current.get(tag, 1), int(node.extent))
            walk(node.body, current)
        elif isinstance(node, tirx.SeqStmt):
            for child in node.seq:
                walk(child, current)
        elif isinstance(node, s_tir.SBlockRealize):
            walk(node.block.body, current)
            if node.block.init is not None:
                walk(node.block.init, current)
        elif isinstance(node, tirx.IfThenElse):
            walk(node.then_case, current)
            if node.else_case is not None:
                walk(node.else_case, current)
        elif getattr(node, "body", None) is not None:
            walk(node.body, current)

    walk(func.body, None)
    return launches


_GLOBAL = re.compile(r'^extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\((.*)\) \{$', re.M)


def launch_configs(kernel: Kernel, source: str, func: tirx.PrimFunc) -> tuple[KernelLaunch, ...]:
    """How to launch each ``__global__`` function of ``kernel``'s CUDA ``source`` without TVM's
    runtime: its grid, block and pointer arguments by kernel parameter, in the function's order.
    Checked against the source: as many launches as functions, and each block of the size its
    ``__launch_bounds__`` says."""
    functions = _GLOBAL.findall(source)
    extents = thread_extents(func)
    if len(functions) != len(extents):
        raise PiccError(f"kernel {kernel.name}: {len(functions)} CUDA functions but {len(extents)} launch nests")
    known = {p.name for p in kernel.params}
    out = []
    for (bound, entry, params), ext in zip(functions, extents, strict=True):
        gx, gy, gz = (ext.get(f"blockIdx.{a}", 1) for a in "xyz")
        bx, by, bz = (ext.get(f"threadIdx.{a}", 1) for a in "xyz")
        grid, block = (gx, gy, gz), (bx, by, bz)
        if bound and int(bound) != bx * by * bz:
            raise PiccError(f"kernel {kernel.name}: {entry} is bounded to {bound} threads, the schedule has {block}")
        names = [p.strip().rsplit(" ", 1)[-1].removesuffix("_ptr") for p in params.split(",") if p.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PiccError(f"kernel {kernel.name}: {entry} takes {unknown}, which are not kernel buffers")
        out.append(KernelLaunch(entry, grid, block, tuple(names)))
    return tuple(out)


def cuda_bundle(kernels: list[Kernel], arch: str, funcs: dict[str, tirx.PrimFunc] | None = None) -> str:
    """One CUDA translation unit holding every kernel scheduled for ``arch`` (headers once;
    ``funcs``: the kernels already scheduled, by name).

    Handy to compile or read a whole model at once; the per-kernel sources of ``build_cuda`` hold
    the same device functions.
    """
    arch_params(arch)
    funcs = funcs or {}
    mod = tvm.IRModule({k.name: funcs[k.name] if k.name in funcs else schedule(k, arch) for k in kernels})
    source = str(tvm.compile(mod, target={"kind": "cuda", "arch": arch}).mod.imports[0].inspect_source("cuda"))
    return with_dependent_launch(source)


def compile_cuda_module(kernels: list[Kernel], arch: str) -> tvm.runtime.Executable:
    """Every kernel scheduled for ``arch`` in one TVM module, for a CUDA executor on TVM's runtime.

    On a machine with a CUDA device, ``module[kernel.name](*tensors)`` runs a kernel on
    ``tvm.cuda()`` tensors in ABI order (TVM's host side computes the launch grid);
    ``export_library`` saves it for the runtime to ``tvm.runtime.load_module``.
    """
    arch_params(arch)
    mod = tvm.IRModule({k.name: schedule(k, arch) for k in kernels})
    return tvm.compile(mod, target={"kind": "cuda", "arch": arch})


def _entry_points(source: str) -> tuple[str, ...]:
    found = re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(.*\{$', source, re.M)
    return tuple(found)


def nvcc_path() -> str | None:
    """The nvcc on PATH (or in /usr/local/cuda/bin), or None."""
    return shutil.which("nvcc") or (str(p) if (p := Path("/usr/local/cuda/bin/nvcc")).exists() else None)


def nvcc_compile(sources: dict[str, str], arch: str, outputs: tuple[str, ...] = ("ptx", "cubin"),
                 jobs: int = 2) -> dict[str, dict[str, bytes]]:
    """Compile each CUDA source alone with nvcc for ``arch``; ``{name: {"ptx": ..., "cubin": ...}}``.

    Asked for both, nvcc makes the PTX from the source and the cubin from that PTX (only
    ``ptxas`` runs again): the same cubin, bytes for bytes, as from the source, without a
    second pass of the front end (a model's bundle: ~0.2 s instead of ~1 s).
    Raises PiccError naming the kernel and nvcc's first error line when one fails to compile.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise PiccError("nvcc is not on PATH; install the CUDA toolkit to compile PTX/cubin")
    with tempfile.TemporaryDirectory(prefix="picc-nvcc-") as tmp:
        work = Path(tmp)

        def one(item: tuple[str, str]) -> tuple[str, dict[str, bytes]]:
            name, src = item
            cu = work / f"{name}.cu"
            cu.write_text(src)
            result: dict[str, bytes] = {}
            # PTX first, so that a cubin asked for with it is made from it.
            for kind in sorted(outputs, key=lambda k: k != "ptx"):
                out = work / f"{name}.{arch}.{kind}"
                given = work / f"{name}.{arch}.ptx" if kind == "cubin" and "ptx" in result else cu
                proc = subprocess.run([nvcc, f"-{kind}", f"-arch={arch}", "-w", "-o", str(out), str(given)],
                                      capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip())
                    raise PiccError(f"nvcc -{kind} -arch={arch} failed on kernel {name}: {first}")
                result[kind] = out.read_bytes()
            return name, result

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return dict(pool.map(one, sources.items()))


def build_cuda(kernels: list[Kernel], arch: str, *, nvcc: bool = True, outputs: tuple[str, ...] = ("ptx", "cubin"),
               jobs: int = 2, advance: Callable[[int], None] | None = None,
               funcs: dict[str, tirx.PrimFunc] | None = None) -> dict[str, CudaArtifact]:
    """Every kernel's CUDA artifacts for ``arch``; PTX/cubin only when ``nvcc`` and nvcc exists.
    ``advance(1)`` after each kernel's source (a progress bar's); ``funcs``: the kernels already
    scheduled for ``arch``, by name."""
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise PiccError(f"kernel names must be unique, got duplicates in {names}")
    built = {}
    for k in kernels:
        built[k.name] = (k, *_cuda_build(k, arch, (funcs or {}).get(k.name)))
        if advance is not None:
            advance(1)
    sources = {name: src for name, (_, src, _) in built.items()}
    compiled = nvcc_compile(sources, arch, outputs, jobs) if nvcc and nvcc_path() else {}
    return {name: CudaArtifact(name, arch, src, _entry_points(src), compiled.get(name, {}).get("ptx"),
                               compiled.get(name, {}).get("cubin"), launch_configs(k, src, func))
            for name, (k, src, func) in built.items()}


def build_model_cuda(kernels: list[Kernel], arch: str,
                     advance: Callable[[int], None] | None = None) -> tuple[dict[str, CudaArtifact], dict[str, bytes]]:
    """A model's kernels for ``arch``: each kernel's source and launch configuration, and the PTX
    and cubin of all of them together (nvcc once for all kernels instead of once per kernel:
    the same device functions, as ``cuda_bundle`` puts every kernel in one translation unit).
    No PTX or cubin when nvcc is not installed. ``advance(1)`` after each kernel's source and
    after the bundle's PTX and cubin.

    Each kernel is scheduled once, for both. The bundle and its nvcc run go on a thread of their
    own beside the per-kernel builds: TVM's code generation and nvcc do not hold the GIL, so on
    two cores the two take about the time of the longer."""
    if not kernels or nvcc_path() is None:
        return build_cuda(kernels, arch, nvcc=False, advance=advance), {}
    arch_params(arch)
    funcs = {k.name: schedule(k, arch) for k in kernels}

    def bundle() -> dict[str, bytes]:
        compiled = nvcc_compile({"model": cuda_bundle(kernels, arch, funcs)}, arch, ("ptx", "cubin"), 1)["model"]
        if advance is not None:
            advance(1)
        return compiled

    with ThreadPoolExecutor(1) as pool:
        compiled = pool.submit(bundle)
        artifacts = build_cuda(kernels, arch, nvcc=False, advance=advance, funcs=funcs)
        return artifacts, compiled.result()


def write_cuda_sources(artifacts: dict[str, CudaArtifact], directory: str | Path) -> list[Path]:
    """Write each artifact's source as ``DIR/<kernel>.cu``; returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for art in artifacts.values():
        path = out / f"{art.name}.cu"
        path.write_text(art.source)
        paths.append(path)
    return paths


class HostKernel:
    """A kernel compiled for the CPU; call it with numpy arrays by parameter name.

    ``__call__`` copies the inputs in, allocates outputs and scratch (zeroed), runs, and returns
    every written buffer (``out``, ``inout`` and ``scratch``) as numpy arrays. ``run`` takes ``tvm.runtime.Tensor``s in
    ABI order and writes them in place (what an executor that keeps buffers resident uses).
    """

    def __init__(self, kernel: Kernel, func: tvm.runtime.Module) -> None:
        self.kernel = kernel
        self._func = func

    def run(self, *tensors: tvm.runtime.Tensor) -> None:
        self._func(*tensors)

    def __call__(self, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        k = self.kernel
        unknown = set(arrays) - {p.name for p in k.params}
        if unknown:
            raise PiccError(f"kernel {k.name} has no parameter(s) {sorted(unknown)}; it takes "
                            f"{', '.join(p.name for p in k.params)}")
        tensors = []
        for p in k.params:
            if p.name in arrays:
                a = np.ascontiguousarray(arrays[p.name])
                if a.shape != p.shape or str(a.dtype) != p.dtype:
                    raise PiccError(f"kernel {k.name}: {p.name} must be {p.dtype}{list(p.shape)}, "
                                    f"got {a.dtype}{list(a.shape)}")
            elif p.role in ("in", "inout"):
                raise PiccError(f"kernel {k.name}: missing input {p.name} ({p.dtype}{list(p.shape)})")
            else:
                a = np.zeros(p.shape, dtype=p.dtype)
            tensors.append(tvm.runtime.tensor(a))
        self.run(*tensors)
        return {p.name: t.numpy() for p, t in zip(k.params, tensors, strict=True) if p.role != "in"}


_HOST_CACHE: dict[tuple[str, int, str, bool], HostKernel] = {}


def host_target() -> dict[str, str]:
    """LLVM for this machine's CPU (f16 conversions and SIMD widths need the real ``mcpu``)."""
    return {"kind": "llvm", "mcpu": str(tvm.target.codegen.llvm_get_system_cpu())}


def build_host(kernel: Kernel, target: dict[str, str] | None = None, *, scheduled: bool = True) -> HostKernel:
    """``kernel`` compiled for the CPU: its definition with ``cpu_schedule`` (or as defined).

    Cached per process by the kernel's structure, the target and ``scheduled``.
    """
    target = target or host_target()
    key = (kernel.name, tvm_ffi.structural_hash(kernel.func), repr(sorted(target.items())), scheduled)
    if key not in _HOST_CACHE:
        func = cpu_schedule(kernel) if scheduled else kernel.func
        lib = tvm.compile(tvm.IRModule({kernel.name: func}), target=target)
        _HOST_CACHE[key] = HostKernel(kernel, lib[kernel.name])
    return _HOST_CACHE[key]


def export_host_library(kernels: list[Kernel], path: str | Path, target: dict[str, str] | None = None) -> Path:
    """Compile ``kernels`` (CPU-scheduled) into one shared library at ``path``.

    The runtime loads it without the compiler: ``tvm.runtime.load_module(path)`` and
    ``module.get_function(kernel.name)``, called with ``tvm.runtime.Tensor``s in ABI order.
    Needs a C toolchain to link; ``target`` defaults to this machine's CPU (pass a generic
    ``{"kind": "llvm"}`` for a library that runs on any x86-64).
    """
    # Each kernel is its own LLVM module, the others imported into the first: compiled together,
    # LLVM inlined each kernel's body into its entry point and lost its buffers' noalias, and the
    # loops stayed scalar (SmolLM2 on the emulated GPU: the q8_0 LM head 111 -> 7.3 ms a call, the
    # SwiGLU FFN 7.3 -> 2.0 ms, the same bits).
    if not kernels:
        raise PiccError("export_host_library: no kernels to build")
    target = target or host_target()
    libs = [tvm.compile(tvm.IRModule({k.name: cpu_schedule(k)}), target=target) for k in kernels]
    for lib in libs[1:]:
        libs[0].mod.import_module(lib.mod)
    out = Path(path)
    libs[0].export_library(str(out))
    return out
