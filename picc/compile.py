"""``picc compile``: the whole pipeline from a model to a ``.pib``.

Stages: canonical FFNs with neuron-major down projections; profiling and sparsity (predictors,
gate-first or down-only masks, per the sparsity options; skipped with ``dense`` or when the
source is already sparse, e.g. a ``picc sparsify`` output); placement under the VRAM budget;
then the memory plan and report, written with the IR and weights into one file. Code generation
adds its artifacts here as the backends land.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from picc import memory_plan as mp
from picc.errors import PiccError
from picc.frontend.model import LoadedModel
from picc.ir import ops as O
from picc.ir.sparse_ops import SparseFFN
from picc.ir.weights import Tensor
from picc.passes import Instruments, parse_pipeline, run_pipeline
from picc.plan_report import build_report
from picc.sparsify import SparsifyOptions, target_sparsity
from picc.targets import load_target, parse_size


@dataclass(frozen=True)
class CompileOptions:
    target: str = "cpu"
    vram: str | None = None  # default: the target's VRAM
    ctx: int = mp.DEFAULT_CTX
    ubatch: int = mp.DEFAULT_UBATCH
    dense: bool = False
    solver: str = "greedy"
    sparsity: SparsifyOptions = field(default_factory=SparsifyOptions)


    def check(self) -> None:
        """Refuse bad options before any slow work."""
        target = load_target(self.target)
        if self.vram is not None and parse_size(self.vram, what="--vram") > 0 and target.gpu is None:
            raise PiccError(f"--vram {self.vram}: target {target.name!r} has no GPU; use --vram 0 or a GPU target")
        if self.ctx < 1 or self.ubatch < 1:
            raise PiccError(f"--ctx {self.ctx} / --ubatch {self.ubatch}: expected positive integers")


@dataclass(frozen=True)
class Compiled:
    model: LoadedModel
    plan: mp.MemoryPlan
    report: dict
    meta: dict
    sections: dict[str, bytes] = field(default_factory=dict)  # generated code, by section name
    tensors: dict[str, Tensor] = field(default_factory=dict)  # what generated code reads besides weights


def _is_sparse(model: LoadedModel) -> bool:
    return any(isinstance(op, SparseFFN) for op in model.module.ops())


def _partition_options(options: CompileOptions) -> str:
    items = [f"target={options.target}", f"ctx={options.ctx}", f"ubatch={options.ubatch}",
             f"solver={options.solver}"]
    if options.vram is not None:
        items.append(f"vram={options.vram}")
    return "partition-neurons{" + ",".join(items) + "}"


def compile_model(model: LoadedModel, options: CompileOptions, instruments: Instruments | None = None,
                  say: Callable[[str], None] = print) -> Compiled:
    """Run the pipeline on ``model``; ``say`` gets one line per stage."""
    options.check()
    target = load_target(options.target)
    if any(op.type.placement is not None for op in model.module.ops()):
        raise PiccError(f"{model.source}: already compiled for a target (its IR is placed); "
                        "compile the model it came from")
    if not any(isinstance(op, O.FFN) for op in model.module.ops()):
        raise PiccError(f"{model.source}: no FFN layers found; picc compiles decoder LLMs")
    # A dense model for the CPU keeps its own down layout (a quantized down would be requantized);
    # neurons that may move to a GPU need it neuron-major.
    cpu_only = target.gpu is None or (options.vram is not None and parse_size(options.vram) == 0)
    passes = ["canonicalize"] + ([] if options.dense and cpu_only else ["neuron-major-down"])
    s = options.sparsity
    if options.dense:
        say("dense: FFNs stay dense (the baseline)")
    elif _is_sparse(model):
        say(f"{model.source} is already sparse: keeping its profile and predictors")
    else:
        if model.tokenizer is None:
            raise PiccError(f"{model.source}: the model has no tokenizer, so calibration text cannot be "
                            "read; pass --dense or a model with a tokenizer")
        passes.append(s.pipeline(target_sparsity(model, s, say)))
    passes += [_partition_options(options), "dce"]
    start = time.perf_counter()
    say(f"pipeline: {','.join(passes)}")
    module = run_pipeline(model.module, model.weights, parse_pipeline(",".join(passes)), instruments,
                          tokenizer=model.tokenizer)
    attrs = dict(module.attrs)
    plan = mp.plan_memory(module, model.weights, ctx=options.ctx, ubatch=options.ubatch,
                          budget=int(attrs["vram_budget"]))
    compiled = replace(model, module=module)
    report = build_report(module, model.weights, target, plan)
    say(f"generating CPU code ({target.cpu.simd})")
    sections, tensors = cpu_code(module, model.weights, options.ctx, target.cpu.simd)
    if target.gpu is not None and any(op.type.placement is not None and op.type.placement.value == "gpu"
                                      for op in module.ops()):
        say(f"generating CUDA code ({target.gpu.arch})")
        sections.update(cuda_code(module, model.weights, options.ctx, target.gpu.arch))
    meta = {"picc_version": _version(), "source": model.source, "target": target.name,
            "options": {"vram": options.vram, "ctx": options.ctx, "ubatch": options.ubatch,
                        "dense": options.dense, "solver": options.solver},
            "compile_seconds": round(time.perf_counter() - start, 3)}
    return Compiled(compiled, plan, report, meta, sections, tensors)


def cpu_code(module, weights, ctx: int, simd: str) -> tuple[dict[str, bytes], dict[str, Tensor]]:  # noqa: ANN001
    """The CPU decode step of ``module``: object code, its LLVM IR, the manifest, extra tensors."""
    from picc.codegen_cpu import compile_kernels
    from picc.codegen_cpu.lower import lower_module

    if simd not in ("avx512", "avx2"):
        raise PiccError(f"the target's CPU has SIMD level {simd!r}; picc's CPU kernels need avx2 or avx512")
    lowered = lower_module(module, weights, ctx)
    code = compile_kernels([], lowered.programs, simd)
    sections = {"cpu/object": code.emit_object(), "cpu/ir": code.ir.encode("utf-8"),
                "cpu/manifest": json.dumps(lowered.manifest(simd)).encode("utf-8")}
    return sections, lowered.extra


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("picc")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def cuda_code(module, weights, ctx: int, arch: str) -> dict[str, bytes]:  # noqa: ANN001
    """The CUDA kernels of the GPU ops: sources (each compiles alone), PTX and cubin where nvcc
    exists, and a manifest of which kernels each GPU op launches."""
    from picc.codegen_cuda import build_cuda
    from picc.codegen_cuda.lower import gpu_kernels

    lowered = gpu_kernels(module, weights, ctx)
    artifacts = build_cuda(list(lowered.kernels.values()), arch)
    sections: dict[str, bytes] = {}
    for name, a in artifacts.items():
        sections[f"cuda/{arch}/{name}.cu"] = a.source.encode("utf-8")
        for kind in ("ptx", "cubin"):
            if getattr(a, kind) is not None:
                sections[f"cuda/{arch}/{name}.{kind}"] = getattr(a, kind)
    manifest = {"arch": arch, "calls": lowered.calls,
                "kernels": {name: list(a.entry_points) for name, a in artifacts.items()},
                "compiled": sorted({k for a in artifacts.values() for k in ("ptx", "cubin") if getattr(a, k)})}
    sections["cuda/manifest"] = json.dumps(manifest).encode("utf-8")
    return sections


def write_compiled(compiled: Compiled, path: Path) -> int:
    from picc.pib import write_pib

    return write_pib(path, compiled.model, plan=compiled.plan.to_json(), report=compiled.report,
                     meta=compiled.meta, extra=compiled.sections, extra_tensors=compiled.tensors)


def summary_line(compiled: Compiled, path: Path, size: int) -> str:
    r = compiled.report
    gpu_n = sum(x["gpu_neurons"] for x in r["layers"])
    all_n = gpu_n + sum(x["cpu_neurons"] for x in r["layers"])
    return (f"wrote {path} ({size / 2**20:.1f} MiB): {r['target']}, GPU {r['gpu_bytes'] / 2**20:.1f} of "
            f"{r['vram_budget_bytes'] / 2**20:.1f} MiB budget, {gpu_n} of {all_n} FFN neurons on the GPU, "
            f"~{r['estimate_tokens_per_s']:.0f} tokens/s estimated")


def report_json(compiled: Compiled) -> str:
    return json.dumps(compiled.report)
