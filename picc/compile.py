"""``picc compile``: the whole pipeline from a model to a ``.pib``.

Stages: canonical FFNs with neuron-major down projections; profiling and sparsity (predictors,
gate-first or down-only masks, per the sparsity options; skipped with ``dense``, when the
source is already sparse, e.g. a ``picc sparsify`` output, or, unless ``sparse``, when calibrating
is estimated to outlast ``CALIBRATION_SECONDS`` here); placement under the VRAM budget,
weighed against the CPU alone; on the CPU alone, the sparse model weighed against the dense one
(the faster by the cost model's estimate is compiled, unless ``sparse`` or ``dense`` says which);
the memory plan, the report and the stages of the step; then the CPU's code (llvmlite) and the
GPU's (TVM: CUDA, PTX / cubin with nvcc, and the host build), all written with the IR, weights
and tokenizer into one ``.pib``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from picc.errors import PiccError
from picc.frontend.llama import longrope_for_context
from picc.frontend.model import LoadedModel
from picc.ir import ops as O
from picc.ir.module import Module
from picc.ir.sparse_ops import SparseFFN
from picc.ir.types import Placement
from picc.ir.weights import Tensor, WeightStore
from picc.passes import Instruments, PassSpec, run_pipeline
from picc.passes.fuse_gather_gemv import FuseOptions
from picc.passes.insert_predictors import predictor_budget, training_tokens, trains_on_profiled_tokens
from picc.passes.partition_neurons import PartitionOptions
from picc.passes.select_kernels import SelectOptions
from picc.placement import memory_plan as mp
from picc.placement.plan_report import build_report
from picc.placement.schedule import Schedule, schedule
from picc.sparsity.sparsify import SparsifyOptions, target_sparsity
from picc.targets import Target, load_target, parse_size
from picc.targets.host import is_host
from runtime.contracts import CudaManifest, launches_to_json


@dataclass(frozen=True)
class CompileOptions:
    target: str | Target = "cpu"  # a name or YAML path, or the Target loaded from one
    vram: str | None = None  # default: the target's VRAM
    ctx: int = mp.DEFAULT_CTX
    dense: bool = False  # no sparsity
    sparse: bool = False  # sparsity even where the cost model estimates the dense model faster
    float_dots: bool = False  # keep float dot products where a dense model could round x to int16
    int_dots: bool = False  # round x to int16 for 4-bit dot products in sparse models too
    int8_dots: bool = False  # round to int8, not int16, where the kernel reads eight rows at a time (rows8)
    kv_cache: str = "f16"  # what the KV caches of attention on the CPU hold (f16 or f32)
    batch_step: bool = True  # the server's batch step (a CPU-only model; ~2-3 s more LLVM a compile)
    solver: str = "greedy"
    sparsity: SparsifyOptions = field(default_factory=SparsifyOptions)


    def check(self) -> Target:
        """Refuse bad options before any slow work; the target, loaded (unless it already is)."""
        target = self.target if isinstance(self.target, Target) else load_target(self.target)
        if self.vram is not None:
            target.check_budget(parse_size(self.vram, what="--vram"), self.vram)
        if self.ctx < 1:
            raise PiccError(f"--ctx {self.ctx}: expected a positive number of positions")
        if self.dense and self.sparse:
            raise PiccError("--dense and --sparse ask for opposite models; give one of them")
        if self.float_dots and (self.int_dots or self.int8_dots):
            flag = "--int-dots" if self.int_dots else "--int8-dots"
            raise PiccError(f"--float-dots and {flag} ask for opposite dot products; give one of them")
        return target

    @property
    def int_x(self) -> str:
        """What x is rounded to where a kernel reading eight rows at a time rounds it."""
        return "i8" if self.int8_dots else "i16"


@dataclass(frozen=True)
class Compiled:
    model: LoadedModel
    plan: mp.MemoryPlan
    report: dict
    meta: dict
    sections: dict[str, bytes] = field(default_factory=dict)  # generated code, by section name
    tensors: dict[str, Tensor] = field(default_factory=dict)  # what generated code reads besides weights
    layouts: dict[str, str] = field(default_factory=dict)  # weights the .pib stores in another layout (rows8)


def _is_sparse(model: LoadedModel) -> bool:
    return any(isinstance(op, SparseFFN) for op in model.module.ops())


def _partition(options: CompileOptions, target: Target, vram: str | None = None) -> PassSpec:
    vram = options.vram if vram is None else vram
    return PassSpec("partition-neurons", PartitionOptions(target, vram, options.ctx, options.solver))


def _fuse(options: CompileOptions) -> list[PassSpec]:
    """fuse-gather-gemv, dce and select-kernels, with the dot products ``options`` ask for."""
    dots = "no" if options.float_dots else "yes" if options.int_dots else "auto"
    return [PassSpec("fuse-gather-gemv", FuseOptions()), PassSpec("dce"),
            PassSpec("select-kernels", SelectOptions(int_dots=dots, int_x=options.int_x, kv=options.kv_cache))]


def compile_model(model: LoadedModel, options: CompileOptions, instruments: Instruments | None = None,
                  say: Callable[[str], None] = print) -> Compiled:
    """Run the pipeline on ``model``; ``say`` gets one line per stage."""
    target = options.check()
    options = replace(options, target=target)  # loaded once: the CPU-only compile below reuses it
    if any(op.type.placement is not None for op in model.module.ops()):
        raise PiccError(f"{model.source}: already compiled for a target (its IR is placed); "
                        "compile the model it came from")
    ffns = any(isinstance(op, O.FFN) for op in model.module.ops())
    if not ffns and not any(isinstance(op, O.MoE) for op in model.module.ops()):
        raise PiccError(f"{model.source}: no FFN layers found; picc compiles decoder LLMs")
    if (module := longrope_for_context(model.module, options.ctx)) is not model.module:
        say(f"longrope: --ctx {options.ctx} is past the short factors' positions, so every position rotates "
            "with the long factors (as llama.cpp chooses)")
        model = replace(model, module=module)
    if not ffns and not options.dense:  # nothing to sparsify, nor to weigh against its dense build
        say("every FFN is a mixture of experts, whose neurons picc does not sparsify: compiling the model as it is")
        options = replace(options, dense=True, sparse=False)
    # A dense model for the CPU keeps its own down layout (a quantized down would be requantized);
    # neurons that may move to a GPU need it neuron-major.
    cpu_only = target.gpu is None or (options.vram is not None and parse_size(options.vram) == 0)
    passes = [PassSpec("canonicalize")] + ([] if options.dense and cpu_only else [PassSpec("neuron-major-down")])
    s = options.sparsity
    if options.dense:
        say("dense: FFNs stay dense (the baseline)")
    elif _is_sparse(model):
        say(f"{model.source} is already sparse: keeping its profile and predictors")
    else:
        if model.tokenizer is None:
            raise PiccError(f"{model.source}: the model has no tokenizer, so calibration text cannot be "
                            "read; pass --dense or a model with a tokenizer")
        if cpu_only:
            s = replace(s, gathered_rate=_gathered_rate(model, options, target))
        sparsity = target_sparsity(model, s, say)
        if cpu_only and not options.sparse and sparsity is not None:
            dense = _dense_unless_sparse_can_win(model, options, target, 1.0 - sparsity, instruments, say)
            if dense is not None:
                return dense
        costly = None if options.sparse else _calibration_too_costly(model, s, sparsity)
        if costly is not None:
            say(f"compiling the dense model without profiling: {costly} (--sparse calibrates anyway)")
            return _compiled_dense(model, options, instruments, f"dense, chosen before profiling: {costly}")
        passes += s.passes(sparsity, model)
    passes += [_partition(options, target), *_fuse(options)]
    start = time.perf_counter()
    say(f"pipeline: {','.join(map(str, passes))}")
    # The passes add weights (neuron-major copies, predictors) to a copy of the store: the caller's
    # model is unchanged, so compiling it again names them the same (and finds its predictors cached).
    weights = model.weights.copy()
    after: list[tuple[str, Module]] = [("", model.module)]  # each pass's result, for the CPU-only plan

    def remember(name: str, module: Module) -> None:
        after.append((name, module))
        if instruments is not None and instruments.on_pass is not None:
            instruments.on_pass(name, module)

    inst = replace(instruments or Instruments(), on_pass=remember)
    module = run_pipeline(model.module, weights, passes, inst, tokenizer=model.tokenizer)
    chosen = _placed(module, weights, options, target)
    if chosen.plan.gpu_bytes:  # weigh the GPU part against the same model on the CPU alone
        names = [name for name, _ in after]
        unplaced = after[names.index("partition-neurons") - 1][1]
        cpu_weights = weights.copy()
        cpu_passes = [_partition(options, target, vram="0"), *_fuse(options)]
        cpu_module = run_pipeline(unplaced, cpu_weights, cpu_passes, tokenizer=model.tokenizer)
        alone = _placed(cpu_module, cpu_weights, options, target).report["estimate_tokens_per_s"]
        if _cpu_is_faster(chosen.report, alone, options, target, say):
            cpu = compile_model(model, replace(options, vram="0"), instruments, say)
            cpu.report["notes"].append(f"nothing on the GPU: the cost model estimates ~{alone:.0f} tokens/s on the "
                                       f"CPU alone, ~{chosen.report['estimate_tokens_per_s']:.0f} with a GPU part")
            return cpu
    module, weights, plan, report = chosen.module, chosen.weights, chosen.plan, chosen.report
    compiled = replace(model, module=module, weights=weights)
    weigh = cpu_only and not options.dense and not _is_sparse(model)
    if weigh and (dense := _dense_if_faster(model, options, target, report, instruments, say)) is not None:
        return dense
    steps = schedule(module)
    say(f"generating CPU code ({target.cpu.simd}{_dot_products(module)})")
    sections, tensors, layouts = cpu_code(module, weights, steps, options.ctx, target.cpu.simd, options.batch_step)
    sections["schedule"] = json.dumps(steps.to_json()).encode("utf-8")
    if target.gpu is not None and "gpu" in steps.devices:
        say(f"generating GPU code ({target.gpu.arch})")
        gpu_sections, gpu_tensors = gpu_code(module, weights, plan, target.gpu.arch, say)
        sections.update(gpu_sections)
        tensors.update(gpu_tensors)
    meta = {"picc_version": _version(), "source": model.source, "target": target.name,
            "options": {"vram": options.vram, "ctx": options.ctx,
                        "dense": options.dense, "solver": options.solver},
            "compile_seconds": round(time.perf_counter() - start, 3)}
    result = Compiled(compiled, plan, report, meta, sections, tensors, layouts)
    if weigh and not options.sparse and is_host(target.cpu):
        from picc.decode_trial import faster_on_this_cpu

        return faster_on_this_cpu(model, options, result, instruments, say)
    return result


def _dot_products(module: Module) -> str:
    """How the CPU's matrix ops dot 4-bit rows, for the compile's output: ``""`` when none rounds x.
    (A q8_0 LM head rounds to int8 by default; ``--int8-dots`` is about the others.)"""
    ops = [op for op in module.ops() if isinstance(op, O.MatrixOp) and op.type.placement != Placement.GPU]
    formats = Counter(op.x_format for op in ops)
    if not formats.keys() - {"f32"}:
        return ""
    rounded = [(n, "int8" if x == "i8" else "int16") for x, n in sorted(formats.items(), key=lambda i: -i[1])
               if x != "f32"]
    said = ", ".join(f"{n} to {to}" for n, to in rounded[1:])
    head = module.function().ret
    # --int8-dots turns int16 into int8 where the kernels read eight rows at a time: offered while
    # some op rounds to int16 and none but the head to int8.
    offer = formats["i16"] and not any(op.x_format == "i8" for op in ops if op.result != head)
    hint = "; --int8-dots: int8 where they read eight rows at a time" if offer else ""
    n, to = rounded[0]
    return f"; {n} matrix op{'s' if n > 1 else ''} dot{'' if n > 1 else 's'} x rounded to {to}" \
        f"{', ' + said if said else ''}{hint}"


@dataclass(frozen=True)
class _Placed:
    """A placed, fused module with its weights, memory plan and report."""

    module: Module
    weights: WeightStore
    plan: mp.MemoryPlan
    report: dict


def _placed(module: Module, weights: WeightStore, options: CompileOptions, target: Target) -> _Placed:
    plan = mp.plan_memory(module, weights, ctx=options.ctx, budget=int(dict(module.attrs)["vram_budget"]))
    if plan.gpu_bytes > plan.budget:  # partition-neurons planned the unfused module; fusing only merges buffers
        raise PiccError(f"internal error: the fused module needs {plan.gpu_bytes} GPU bytes, over the "
                        f"{plan.budget}-byte budget; please report it")
    return _Placed(module, weights, plan, build_report(module, weights, target, plan))


def _cpu_is_faster(report: dict, alone: float, options: CompileOptions, target: Target,
                   say: Callable[[str], None]) -> bool:
    """Whether to compile for the CPU alone instead of the plan of ``report``, which has a GPU part:
    when the cost model expects the CPU alone (``alone`` tokens/s) to be faster -- a small model's
    GPU part is kernel launches and copies more than bytes -- and the budget was picc's to choose.
    An explicit ``--vram`` is kept, with a note."""
    with_gpu = report["estimate_tokens_per_s"]
    report["cpu_only_estimate_tokens_per_s"] = alone
    if alone <= with_gpu:
        return False
    assert target.gpu is not None
    why = (f"the cost model estimates ~{alone:.0f} tokens/s on the CPU alone against ~{with_gpu:.0f} with a GPU part "
           f"on {target.gpu.name} ({report['gpu_launches_per_token']} kernel launches and "
           f"{report['transfers_per_token']} copies a token)")
    if options.vram is not None:
        say(f"note: {why}; --vram 0 would be faster")
        return False
    say(f"placing nothing on the GPU: {why}; --vram SIZE keeps a GPU part")
    return True


def _dense_if_faster(model: LoadedModel, options: CompileOptions, target: Target, report: dict,
                     instruments: Instruments | None, say: Callable[[str], None]) -> Compiled | None:
    """The dense model compiled, when the cost model estimates it faster than the sparse one
    whose ``report`` is given and ``--sparse`` does not keep sparsity; else None (the estimate
    goes in ``report`` either way, and a note when it is kept despite being slower)."""
    dense = _dense_estimate(model, options, target)
    sparse = report["estimate_tokens_per_s"]
    report["dense_estimate_tokens_per_s"] = dense
    if dense <= sparse:
        return None
    if options.sparse:
        say(f"note: the cost model estimates ~{dense:.0f} tokens/s for this model compiled with --dense on "
            f"{target.name}, against ~{sparse:.0f} sparse (kept: --sparse)")
        return None
    why = (f"the cost model estimates ~{dense:.0f} tokens/s for the dense model on {target.name}, "
           f"~{sparse:.0f} for the sparse one")
    say(f"compiling the dense model: {why} (--sparse keeps sparsity)")
    return _compiled_dense(model, options, instruments, f"dense, chosen: {why}", sparse_estimate_tokens_per_s=sparse)


def _dense_estimate(model: LoadedModel, options: CompileOptions, target: Target) -> float:
    """The cost model's tokens/s for ``model`` compiled ``--dense``: on a CPU whose 4-bit kernels
    are bound by their arithmetic, a dense model's integer dot products can outrun a sparse one's
    float ones (SmolLM2 Q4_1 on Zen 4: ~290 against ~200 estimated, 295 against 208 measured)."""
    return _dense_report(model, options, target)["estimate_tokens_per_s"]


def _dense_report(model: LoadedModel, options: CompileOptions, target: Target) -> dict:
    weights = model.weights.copy()
    passes = [PassSpec("canonicalize"), _partition(options, target), *_fuse(options)]
    module = run_pipeline(model.module, weights, passes)
    plan = mp.plan_memory(module, weights, ctx=options.ctx, budget=int(dict(module.attrs)["vram_budget"]))
    return build_report(module, weights, target, plan)


CALIBRATION_SECONDS = 600
"""The longest calibration ``picc compile`` starts unasked; past it, it builds the dense model."""
CALIBRATION_MEMORY_SHARE = 0.8
"""The share of the machine's available memory profiling may hold."""


def _calibration_too_costly(model: LoadedModel, sparsity: SparsifyOptions, target: float | None) -> str | None:
    """Why calibrating ``model`` is not worth starting here, or None: when the estimate
    (``picc.sparsity.calibration_cost``) says it would outlast ``CALIBRATION_SECONDS`` (a SwiGLU
    LLaMA-7B on 2 cores: ~14 minutes for 4096 tokens, against a minute for the dense model; a
    ReLU one with its predictors, ~16) or hold more memory than the machine has, with the
    most ``--tokens`` that would fit. A cached profile would cost nothing: ``--sparse``
    calibrates (or reads the cache) anyway."""
    from picc.sparsity.calibration_cost import CalibrationCost, PredictorWork, calibration_cost
    from runtime.sequences import available_memory

    trained = sparsity.trained_layers(model.module)
    budget = predictor_budget(model.weights, trained, sparsity.budget)

    def cost_of(tokens: int) -> CalibrationCost:
        kept = trains_on_profiled_tokens(model.weights, trained, tokens)
        work = PredictorWork(trained, training_tokens(model.weights, trained, tokens), budget, own_forward=not kept)
        return calibration_cost(model, tokens, sparsity.rule, target is not None, sparsity.window,
                                sparsity.fisher_tokens, work)

    cost = cost_of(sparsity.tokens)
    have = available_memory()
    if have is not None and cost.memory_bytes > CALIBRATION_MEMORY_SHARE * have:
        return (f"profiling it on {sparsity.tokens} tokens would hold ~{cost.memory_bytes / 2**30:.1f} GiB, more "
                f"than this machine has available (~{have / 2**30:.1f} GiB)")
    if cost.seconds <= CALIBRATION_SECONDS:
        return None
    # The most whole windows that fit (the cost grows with the tokens, though not in proportion:
    # the Fisher scales' share and the predictors' training tokens have floors of their own).
    low, high = 0, sparsity.tokens // sparsity.window
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost_of(mid * sparsity.window).seconds <= CALIBRATION_SECONDS else (low, mid - 1)
    hint = f"; --tokens {low * sparsity.window} would fit" if low else ""
    return (f"calibrating it on {sparsity.tokens} tokens would take {cost.describe()} on this machine, past the "
            f"{CALIBRATION_SECONDS // 60} min a compile spends on it unasked{hint}")


def _dense_unless_sparse_can_win(model: LoadedModel, options: CompileOptions, target: Target, density: float,
                                 instruments: Instruments | None, say: Callable[[str], None]) -> Compiled | None:
    """The dense model compiled, without profiling, when the cost model estimates it faster than
    the sparse model could be at its best: no predictor, and each FFN matrix either read whole,
    eight rows at a time, or only ``density`` of its rows, gathered and so read one at a time,
    whichever is faster at the rates a sparse model's CPU kernels read its format (rounded x only
    with ``int_dots``). Calibrating a 7B model takes a quarter of an hour on two cores, spent in
    vain where the dense model wins anyway. (Counting the gathered rows at the eight-rows rate, as this
    did before, put a 1B Q4_0 model on the fence: it profiled for 5 minutes on a Zen 4, then chose
    dense at 51 against 39 tokens/s.)"""
    report = _dense_report(model, options, target)
    ms = report["estimate_ms_per_token"]
    seconds = (ms["total"] - ms["ffn"]) / 1e3
    for nbytes, rows, rows8 in _ffn_matrix_rates(model, options, target):
        seconds += nbytes * min(density / rows, 1.0 / rows8)
    dense, best = report["estimate_tokens_per_s"], 1.0 / seconds
    if best >= dense:
        return None
    why = (f"the cost model estimates ~{dense:.1f} tokens/s for the dense model on {target.name}, at most "
           f"~{best:.1f} for a sparse one at sparsity {1 - density:.2f}")
    say(f"compiling the dense model without profiling: {why} (--sparse keeps sparsity)")
    return _compiled_dense(model, options, instruments, f"dense, chosen before profiling: {why}",
                           sparse_estimate_at_most_tokens_per_s=best)


def _gathered_rate(model: LoadedModel, options: CompileOptions, target: Target) -> float:
    """How fast the target CPU's fused sparse FFN kernels read an FFN's active rows, gathered a
    neuron at a time (the ``_gathered`` rate keys), as a share of how fast its GEMVs read its
    matrices whole (eight rows at a time where a matrix has the rows8 layout): the FFNs' bytes
    over the time to read them whole, against the same over the time to read them gathered, at
    the measured kernel rates (x rounded only with ``int_dots``). Rounded to three places, as the
    pipeline text shows it; at most 1."""
    whole = gathered = 0.0
    for nbytes, rows, rows8 in _ffn_matrix_rates(model, options, target):
        whole += nbytes / max(rows, rows8)
        gathered += nbytes / rows
    return min(1.0, round(whole / gathered, 3)) if gathered else 1.0


def _ffn_matrix_rates(model: LoadedModel, options: CompileOptions,
                      target: Target) -> Iterator[tuple[int, float, float]]:
    """Each FFN matrix's bytes and the rates the target CPU's kernels read its format at: active
    rows gathered a neuron at a time by a fused sparse FFN, and the whole matrix eight rows at a
    time where it has the rows8 layout (else one at a time; x rounded only with ``int_dots``)."""
    from picc.kernel_names import cpu_rate_key
    from picc.placement.cost_model import weight_bytes

    x_format = options.int_x if options.int_dots else "f32"
    for op in model.module.ops():
        if isinstance(op, O.FFN):
            for name in (op.up, op.gate, op.down):
                if name is not None:
                    dtype = model.weights[name].dtype.value
                    gathered = target.cpu.read_rate(cpu_rate_key(dtype, x_format, gathered=True))
                    rows8 = target.cpu.read_rate(cpu_rate_key(dtype, x_format, rows8=True))
                    yield weight_bytes(model.weights, name), gathered, rows8


def _compiled_dense(model: LoadedModel, options: CompileOptions, instruments: Instruments | None, note: str,
                    **report: float) -> Compiled:
    """``model`` compiled ``--dense`` in place of the sparse compile asked for: ``note`` says why
    in the report's notes, ``report`` adds the estimates behind the choice."""
    chosen = compile_model(model, replace(options, dense=True), instruments, lambda _: None)
    chosen.report["notes"].append(note)
    chosen.report.update(report)
    return chosen


def cpu_code(module, weights, steps: Schedule, ctx: int,  # noqa: ANN001
             simd: str, batch_step: bool = True) -> tuple[dict[str, bytes], dict[str, Tensor], dict[str, str]]:
    """The CPU's part of the decode step: object code, its LLVM IR, the manifest, extra tensors,
    and the weights its kernels read in another layout than the source's (name -> ``rows8``)."""
    from picc.codegen_cpu import build_ir
    from picc.codegen_cpu.compiler import compiled_object
    from picc.codegen_cpu.lower import lower_module

    if simd not in ("avx512-vnni", "avx512", "avx2"):
        raise PiccError(f"the target's CPU has SIMD level {simd!r}; picc's CPU kernels need avx2 or avx512")
    lowered = lower_module(module, weights, steps, ctx, batch_step=batch_step)
    ir, obj = compiled_object(build_ir([], lowered.programs, simd), simd)
    if simd == "avx512-vnni":  # the IR a CPU without VNNI compiles instead: the VNNI kernels' AVX-512 twins
        ir, _ = compiled_object(build_ir([], lowered.programs, "avx512"), "avx512", object_code=False)
    sections = {"cpu/object": obj, "cpu/ir": ir.encode("utf-8"),
                "cpu/manifest": json.dumps(lowered.manifest(simd).to_json()).encode("utf-8")}
    return sections, lowered.extra, lowered.layouts


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("picc")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def gpu_code(module, weights, plan: mp.MemoryPlan, arch: str,  # noqa: ANN001
             say: Callable[[str], None]) -> tuple[dict[str, bytes], dict[str, Tensor]]:
    """The GPU's part of the decode step: every launch bound to the plan's arena (``gpu/launches``),
    the kernels as CUDA for ``arch`` (sources that each compile alone; PTX and cubin where nvcc is
    found), the same kernels built for the host (``gpu/host.so``, the host-emulated GPU), and the
    f32 constants the kernels read (``gpu.const.<name>`` tensors). The PTX and cubin hold every
    kernel in one module (``cuda/<arch>/model.ptx``)."""
    from picc.progress import progress_bar

    say("  loading TVM (the CUDA code generator)")  # seconds, cold
    from picc.codegen_cuda.build import build_model_cuda, export_host_library, nvcc_path
    from picc.codegen_cuda.lower import lower_gpu

    on_gpu = sum(op.type.placement == Placement.GPU for op in module.function().ops)
    with progress_bar(on_gpu, "lowering the GPU's ops", "op") as advance:
        lowered = lower_gpu(module, weights, plan, advance)
    kernels = list(lowered.kernels.values())
    nvcc = nvcc_path() is not None
    say(f"  {len(kernels)} GPU kernels for {sum(len(v) for v in lowered.launches.values())} launches per token; "
        f"CUDA for {arch}" + (" (PTX and cubin with nvcc)" if nvcc else " (sources only: nvcc not found)"))
    # Steps: each kernel's source, the bundle's PTX and cubin (with nvcc), the host library.
    steps = len(kernels) + 1 + (nvcc and bool(kernels))
    with (tempfile.TemporaryDirectory(prefix="picc-host-") as tmp, ThreadPoolExecutor(1) as pool,
          progress_bar(steps, "building GPU code", "step") as advance):
        library = Path(tmp) / "host.so"

        def host_library() -> bytes:
            # x86-64-v3 (AVX2, FMA, F16C): the CPU kernels' own floor, so the file runs where they do.
            data = export_host_library(kernels, library, {"kind": "llvm", "mcpu": "x86-64-v3"}).read_bytes()
            advance(1)
            return data

        host = pool.submit(host_library)  # beside the CUDA code: TVM releases the GIL while it compiles
        artifacts, compiled = build_model_cuda(kernels, arch, advance)
        host_so = host.result()
    sections: dict[str, bytes] = {f"cuda/{arch}/{name}.cu": a.source.encode("utf-8") for name, a in artifacts.items()}
    sections.update({f"cuda/{arch}/model.{kind}": data for kind, data in compiled.items()})
    manifest = CudaManifest(arch, tuple(sorted(compiled)), {name: a.launches for name, a in artifacts.items()},
                            dependent_launch=True)  # codegen_cuda.build.with_dependent_launch
    sections["cuda/manifest"] = json.dumps(manifest.to_json()).encode("utf-8")
    sections["gpu/launches"] = json.dumps(launches_to_json(lowered.launches)).encode("utf-8")
    sections["gpu/host.so"] = host_so
    tensors = {f"gpu.const.{name}": Tensor.from_f32(values) for name, values in lowered.constants.items()}
    return sections, tensors


def write_compiled(compiled: Compiled, path: Path) -> int:
    from picc.pib import write_pib

    return write_pib(path, compiled.model, plan=compiled.plan.to_json(), report=compiled.report,
                     meta=compiled.meta, extra=compiled.sections, extra_tensors=compiled.tensors,
                     layouts=compiled.layouts)


def summary_line(compiled: Compiled, path: Path, size: int) -> str:
    r = compiled.report
    gpu_n = sum(x["gpu_neurons"] for x in r["layers"])
    all_n = gpu_n + sum(x["cpu_neurons"] for x in r["layers"])
    return (f"wrote {path} ({size / 2**20:.1f} MiB): {r['target']}, GPU {r['gpu_bytes'] / 2**20:.1f} of "
            f"{r['vram_budget_bytes'] / 2**20:.1f} MiB budget, {gpu_n} of {all_n} FFN neurons on the GPU, "
            f"~{r['estimate_tokens_per_s']:.0f} tokens/s estimated")


def report_json(compiled: Compiled) -> str:
    return json.dumps(compiled.report)
