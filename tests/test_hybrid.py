"""The hybrid step: fused IR, the schedule, and the CPU + host-emulated GPU executors together.

Small random models, compiled for pc-low with budgets that put nothing, part, or all of their
FFNs on the GPU, must give the interpreter's logits (the fused IR's own semantics) to 1e-3
relative, the issue's bound for sparse models. The kernels sum in other orders than numpy
(SIMD lanes, threads, GPU warps): ~1e-6 relative over two layers; a sparse FFN is also sensitive
to a score at its threshold, which ordering can flip, hence the margin.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import half_the_ffn, narrow_values, tiny_llama, tiny_mla, with_tokenizer

import picc.passes.insert_predictors as insert_predictors_pass
from picc.compile import CompileOptions, compile_model, write_compiled
from picc.errors import PiccError
from picc.interpreter import Interpreter
from picc.ir import parse, print_module, verify
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module
from picc.ir.types import DType, Placement
from picc.ir.weights import Tensor, WeightStore
from picc.passes import parse_pipeline, run_pipeline
from picc.pib import load_pib
from picc.placement.schedule import schedule
from picc.sparsity.sparsify import SparsifyOptions
from picc.targets import load_target
from runtime.gpu import EmulatedDevice, GpuError
from runtime.pib import PibFile
from runtime.session import Session

TOKENS = [1, 5, 9, 2, 17, 33, 4, 60, 8, 3]
SPARSE = SparsifyOptions(mode="predictor", tokens=512, window=64, budget=0.5)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def model():
    return with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128))


def placed(model, vram: str, mode: str = "predictor") -> tuple[Module, WeightStore]:
    """The model through the compile pipeline up to fusion, for pc-low with ``vram``, and its weights."""
    s = SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5)
    text = (f"canonicalize,neuron-major-down,{s.pipeline(None)},partition-neurons{{target=pc-low,vram={vram}}},"
            "fuse-gather-gemv,select-kernels")
    weights = model.weights.copy()
    return run_pipeline(model.module, weights, parse_pipeline(text), tokenizer=model.tokenizer), weights


@pytest.fixture(scope="module")
def compiled(model, tmp_path_factory):
    """The model compiled for pc-low twice, once and for all the tests that read them: ``full``
    (everything on the GPU) and ``split`` (half the FFN weights on the GPU), and the split one's
    .pib."""
    root = tmp_path_factory.mktemp("hybrid")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICC_CACHE_DIR", str(root / "cache"))
        full = compile_model(model, CompileOptions(target="pc-low", vram="4MiB", sparsity=SPARSE), say=lambda _: None)
        split = compile_model(model, CompileOptions(target="pc-low", vram=str(half_the_ffn(full)), sparsity=SPARSE),
                              say=lambda _: None)
    write_compiled(split, root / "split.pib")
    return full, split, root / "split.pib"


def test_split_parts_run_side_by_side_and_cross_once(model, compiled, monkeypatch):
    full, _, path = compiled
    monkeypatch.setenv("PICC_CACHE_DIR", str(path.parent / "cache"))  # the compiles' predictors
    module, _ = placed(model, str(half_the_ffn(full)))
    steps = schedule(module)
    ops = {op.result: op for op in module.ops()}
    merges = [op for op in module.ops() if isinstance(op, Merge)]
    assert merges
    for merge in merges:
        hot, cold = ops[merge.a], ops[merge.b]
        assert {hot.type.placement, cold.type.placement} == {Placement.GPU, Placement.CPU}
        assert steps.stage_of(hot.result) == steps.stage_of(cold.result) < steps.stage_of(merge.result)
        gpu_part = hot if hot.type.placement == Placement.GPU else cold
        cpu_part = cold if gpu_part is hot else hot
        # The CPU part's input and the predictor's mask cross to the CPU before the parts run;
        # its partial sum crosses back before the merge.
        before = steps.stages[steps.stage_of(cpu_part.result)]
        assert cpu_part.x in before.to_cpu and cpu_part.mask in before.to_cpu
        assert cpu_part.result in steps.stages[steps.stage_of(merge.result)].to_gpu
        assert gpu_part.neuron_offset == 0 and cpu_part.neuron_offset > 0
    # A value crosses at most once per direction per step.
    moved = [(v, d) for st in steps.stages for d, vs in (("gpu", st.to_gpu), ("cpu", st.to_cpu)) for v in vs]
    assert len(moved) == len(set(moved))


@pytest.mark.parametrize("mode, form, dtype", [("predictor", "reglu", None), ("gate-first", "swiglu", None),
                                               ("predictor", "relu", None), ("dense", "swiglu", None),
                                               ("dense", "swiglu", DType.Q4_1)])
def test_hybrid_logits_match_the_interpreter_for_every_split(mode, form, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    trainings = []
    train_all = insert_predictors_pass.train_all
    monkeypatch.setattr(insert_predictors_pass, "train_all", lambda *a, **k: trainings.append(1) or train_all(*a, **k))
    extra = {"matrix_dtype": dtype} if dtype else {}
    model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, seed=3, **extra))
    names = list(model.weights)
    sparsity = SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5)

    def options(vram: str) -> CompileOptions:
        if mode == "dense":  # the baseline: dense FFN kernels on both devices, layers split all the same
            return CompileOptions(target="pc-low", vram=vram, dense=True)
        return CompileOptions(target="pc-low", vram=vram, sparsity=sparsity)

    shares = set()
    full = compile_model(model, options("4MiB"), say=lambda _: None)
    for vram in ("0", str(half_the_ffn(full)), "4MiB"):
        result = full if vram == "4MiB" else compile_model(model, options(vram), say=lambda _: None)
        path = tmp_path / f"m{vram}.pib"
        write_compiled(result, path)
        pib = load_pib(path)
        if dtype is not None and vram != "4MiB":
            # A dense module's CPU FFNs (whole layers in the source layout, or the CPU parts of split
            # ones, fused in dense mode) dot int16 x, as its GEMVs do (whole layers from the rows8
            # layout); the interpreter rounds as they do.
            cpu_ffns = {op.kernel for op in pib.module.ops()
                        if op.NAME in ("ffn", "fused_ffn") and op.type.placement != Placement.GPU}
            split = vram != "0"
            assert cpu_ffns == {"picc_ffn_dense_swiglu_q4_1_q4_1_q4_1_il_xi16" if split
                                else "picc_ffn_gemv_swiglu_q4_1_q4_1_q4_1_r8_xi16"}, cpu_ffns
        reference = Interpreter(pib.module, pib.weights).run(TOKENS)
        with Session(path, threads=2, gpu="emulate") as session:
            got = session.feed(TOKENS, all_logits=True)
            assert rel_err(got, reference) <= 1e-3, vram
            # The emulated GPU allocates exactly the plan's bytes, and nothing when all is on the CPU.
            assert session.executor.gpu_peak_bytes == result.plan.gpu_bytes
        layers = result.report["layers"]
        shares.add(round(sum(la["gpu_neurons"] for la in layers) / sum(la["gpu_neurons"] + la["cpu_neurons"]
                                                                       for la in layers), 2))
    assert 0.0 in shares and 1.0 in shares and len(shares) == 3  # none, part, and all on the GPU
    # Compiling left the model's store alone (the passes add to a copy), so the three compiles saw
    # the same module and the predictors were trained once, then found in the cache.
    assert list(model.weights) == names
    assert len(trainings) == (mode == "predictor")


def test_hybrid_prompts_run_in_chunks_stage_by_stage(compiled, monkeypatch):
    """A hybrid model's prompt runs in chunks like a CPU-only one's: in each stage the CPU's chunk
    program takes all the chunk's tokens while the GPU runs its ops token by token between the
    chunk's rows. Same logits as the interpreter's, across chunk boundaries, and the KV caches
    both devices leave are the ones the next step reads."""
    from runtime.executor import Executor

    path = compiled[2]
    pib = load_pib(path)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 128, size=70)]  # chunks of 32, 32, 5 + a step
    reference = Interpreter(pib.module, pib.weights).run([*tokens, 7])
    with Session(path, threads=2, gpu="emulate") as session:
        executor = session.executor
        program = executor.cpu.logits_chunks
        assert program is not None and any(st.gpu and st.cpu for st in program.stages)  # side by side
        assert any(st.gpu_in for st in program.stages) and any(st.gpu_out for st in program.stages)
        steps = []
        monkeypatch.setattr(executor, "step", lambda *a, **k: steps.append(a) or Executor.step(executor, *a, **k))
        launches = executor.gpu.times.launches
        got = session.feed(tokens, all_logits=True)
        assert len(steps) == 1 and executor.gpu.times.launches > launches  # one step: the last token
        assert rel_err(got, reference[: len(tokens)]) <= 1e-3
        session.reset()
        last = session.feed(tokens)  # the prefill programs (no head), then the last token's step
        assert len(steps) == 2
        assert rel_err(last, reference[len(tokens) - 1]) <= 1e-3
        assert rel_err(session.feed([7]), reference[len(tokens)]) <= 1e-3


@pytest.mark.parametrize("mode, form", [("down-only", "swiglu"), ("gate-first", "drelu")])
def test_ffns_without_a_gpu_kernel_stay_on_the_cpu(mode, form, tmp_path, monkeypatch):
    """Down-only and dReLU gate-first FFNs have CPU kernels only: with any VRAM budget the
    partitioner leaves all their neurons on the CPU (attention still goes to the GPU), and the
    hybrid run still gives the interpreter's logits."""
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, seed=3))
    sparsity = SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5)
    result = compile_model(model, CompileOptions(target="pc-low", vram="4MiB", sparsity=sparsity),
                           say=lambda _: None)
    assert all(la["gpu_neurons"] == 0 and la["cpu_neurons"] == 128 for la in result.report["layers"])
    ops = list(result.model.module.ops())
    assert any(op.type.placement is Placement.GPU for op in ops if op.NAME == "attention")
    assert all(op.type.placement is Placement.CPU for op in ops if isinstance(op, FusedFFN))
    path = tmp_path / "m.pib"
    write_compiled(result, path)
    pib = load_pib(path)
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-3
        assert session.executor.gpu_peak_bytes == result.plan.gpu_bytes > 0


@pytest.mark.parametrize("family, variant", [("qwen3", "head-dim"), ("phi3", "longrope-partial"),
                                             ("gemma3_text", "base"), ("olmo2", "base"), ("granite", "base")])
def test_hf_families_layers_run_on_the_gpu(family, variant, tmp_path, monkeypatch):
    # The GPU's rms_norm kernel takes a token's heads as its rows for Qwen3's q and k norms
    # (rms_norm with a group); its rope reads longrope's factor of the cosines and sines after the
    # frequencies; Gemma 3's embedding kernel scales the rows; OLMo 2's q and k norms take the whole
    # projection; Granite's multipliers are an embedding scale and small eps (the host build of the
    # same TensorIR on the emulated device).
    from hf_models import make_model

    from picc.frontend import load_model

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    make_model(family, variant, tmp_path / "hf")
    path = tmp_path / f"{family}.pib"
    write_compiled(compile_model(load_model(tmp_path / "hf"), CompileOptions(target="pc-low", vram="4MiB", dense=True),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    if family == "qwen3":
        grouped = [op for op in pib.module.ops() if op.NAME == "rms_norm" and op.group]
        assert len(grouped) == 4 and all(op.type.placement == Placement.GPU for op in grouped)
        assert {op.kernel.split("_eps")[0] for op in grouped} == {"rms_norm_128_g32", "rms_norm_64_g32"}  # q, k
    elif family == "phi3":
        ropes = [op for op in pib.module.ops() if op.NAME == "rope"]
        assert ropes and all(op.type.placement == Placement.GPU and op.attention_factor > 1 for op in ropes)
    elif family == "olmo2":
        whole = [op for op in pib.module.ops() if op.NAME == "rms_norm" and op.result.endswith(("q_norm", "k_norm"))]
        assert len(whole) == 4 and all(op.type.placement == Placement.GPU and op.group is None for op in whole)
    elif family == "granite":
        (embed,) = [op for op in pib.module.ops() if op.NAME == "embed"]
        assert embed.type.placement == Placement.GPU and embed.scale == pytest.approx(12 / 0.22)
    else:
        (embed,) = [op for op in pib.module.ops() if op.NAME == "embed"]
        assert embed.type.placement == Placement.GPU and embed.scale == 8.0 and embed.kernel.endswith("_s41000000")
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4


@pytest.mark.parametrize("ctx", [64, 100])
def test_gemma2s_soft_caps_run_on_the_gpu(tmp_path, monkeypatch, ctx):
    # The GPU's attention kernels cap the scores (cap * tanh(s / cap)) in their one-launch form
    # and their five-launch form (a cache not a multiple of 32 positions), and a softcap kernel caps
    # the logits that the greedy kernel then reads: the host build of the same TensorIR on the
    # emulated device against the interpreter. Caps where these scores and logits (~N(0, 1)) bend.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_llama("geglu_tanh", n_layers=2, hidden=64, n_ff=96, softcaps=(0.7, 0.8))
    path = tmp_path / "gemma2.pib"
    write_compiled(compile_model(model, CompileOptions(target="pc-low", vram="4MiB", dense=True, ctx=ctx),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    kernels = {op.NAME: op.kernel for op in pib.module.ops() if op.NAME in ("attention", "softcap")}
    assert all(op.type.placement == Placement.GPU for op in pib.module.ops() if op.NAME in kernels)
    assert kernels["attention"].endswith("_c3f333333") and kernels["softcap"] == "softcap_128_c3f4ccccd"
    with PibFile(path) as f:  # the one-launch kernel, or the five stages through scratch
        (call,) = f.json("gpu/launches")["l0.attn.ctx"]
        assert ("smax" in {a["param"] for a in call["args"]}) == (ctx == 100)
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4
        session.reset()
        assert session.feed(TOKENS[:3]).argmax() == reference[2].argmax()  # the greedy kernel reads the capped logits


@pytest.mark.parametrize("v_dim", [None, 16])
@pytest.mark.parametrize("vram", ["4MiB", "200KiB"])
def test_keys_joined_head_by_head_run_on_the_gpu(tmp_path, monkeypatch, vram, v_dim):
    # DeepSeek's keys (concat_heads of a one-head rope of k_pe and each head's k_nope, YaRN's
    # frequencies) on the GPU with their layer: a TensorIR kernel, the host build of the same
    # TensorIR on the emulated device against the interpreter; with 200 KiB layer 1 stays on the
    # CPU, its heads joined by the CPU's kernel. With ``v_dim``, DeepSeek's whole latent attention:
    # value heads of 16 features under key heads of 24, appended to the cache by a launch of their
    # own (the keys are no rope's) and attended to on the GPU where the layer is.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mla.pib"
    model = tiny_mla(yarn=True) if v_dim is None else narrow_values(tiny_mla(yarn=True), v_dim)
    write_compiled(compile_model(model, CompileOptions(target="pc-low", vram=vram, dense=True, ctx=64),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    joins = [op for op in pib.module.ops() if op.NAME == "concat_heads"]
    on_gpu = ["concat_heads_4h_a1x8_b4x16", "concat_heads_4h_a1x8_b4x16" if vram == "4MiB" else "picc_concat_heads"]
    assert [op.kernel for op in joins] == on_gpu
    where = [Placement.GPU, Placement.GPU if vram == "4MiB" else Placement.CPU]
    assert [op.type.placement for op in joins] == where
    attentions = [op for op in pib.module.ops() if op.NAME == "attention"]
    assert [op.type.placement for op in attentions] == where
    gpu_name = f"attention_4x4x24{f'_v{v_dim}' if v_dim else ''}_ctx64"
    assert attentions[0].kernel == gpu_name and not attentions[0].appended_by_rope
    with PibFile(path) as f:  # the cache append: k rows 4 heads of 24, v rows 4 of v_dim
        append, _ = f.json("gpu/launches")["l0.attn.ctx"]
    assert append["kernel"] == f"kv_append_96{f'_v{4 * v_dim}' if v_dim else ''}_ctx64"
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4


@pytest.mark.parametrize(("vram", "ctx"), [("4MiB", 64), ("4MiB", 100), ("100KiB", 64)])
def test_gpt_oss_attention_sinks_run_on_the_gpu(tmp_path, monkeypatch, vram, ctx):
    # The GPU's attention kernels take each layer's sinks (a weight in the GPU's memory, as the
    # attention that reads it) in their one-launch form and their five-launch form, with a
    # sliding window and soft-capped scores besides; with 100 KiB the second layer's attention,
    # and its sinks, stay on the CPU: the host build of the same TensorIR on the emulated device
    # and the CPU's kernels against the interpreter.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, window=5, softcaps=(0.7, 0.8), sinks=True)
    path = tmp_path / "sinks.pib"
    write_compiled(compile_model(model, CompileOptions(target="pc-low", vram=vram, dense=True, ctx=ctx),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    attentions = [op for op in pib.module.ops() if op.NAME == "attention"]
    placement = {d.name: d.type.placement for d in pib.module.weights}
    where = [Placement.GPU, Placement.GPU if vram == "4MiB" else Placement.CPU]
    assert [(op.type.placement, placement[op.sinks]) for op in attentions] == list(zip(where, where, strict=True))
    assert attentions[0].kernel.endswith("_c3f333333_sinks")
    assert attentions[1].kernel.endswith("_c3f333333_sinks" if vram == "4MiB" else "picc_attention_kvf16_softcap_sinks")
    with PibFile(path) as f:  # the one-launch kernel, or the five stages through scratch
        (call,) = f.json("gpu/launches")["l0.attn.ctx"]
        assert {"sinks", "smax"} & {a["param"] for a in call["args"]} == {"sinks"} | ({"smax"} if ctx == 100 else set())
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    plain = Interpreter(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, window=5, softcaps=(0.7, 0.8)).module,
                        model.weights).run(TOKENS)
    assert rel_err(plain, reference) > 0.1  # the sinks weigh
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4


@pytest.mark.parametrize(("ctx", "variants"), [(64, {}), (100, dict(window=5, softcaps=(0.7, 0.8), sinks=True))])
def test_attention_whose_values_are_narrower_than_its_keys_runs_on_the_gpu(tmp_path, monkeypatch, ctx, variants):
    # Value heads of 12 features under key heads of 16 (DeepSeek's MLA decompressed), compiled
    # for pc-low with room for it all: each layer's attention and its KV cache (k rows of every
    # position, then the narrower v rows, f32) are the GPU's, the k rope's launch writing both
    # rows; its kernels the one-launch decode attention (ctx 64) or the five launches (100, with
    # a window, soft caps and sinks). The logits are the interpreter's on the emulated GPU for a
    # step a token, for a prompt run in chunks, and for the step after it. The estimate reads
    # half of each cache a token: ctx positions more add half their k and v rows' bytes.
    from picc.placement.memory_plan import plan_memory
    from picc.placement.plan_report import build_report

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    model = narrow_values(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, **variants), 12)
    path = tmp_path / "narrow.pib"
    write_compiled(compile_model(model, CompileOptions(target="pc-low", vram="4MiB", dense=True, ctx=ctx),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    ops = {op.result: op for op in pib.module.ops()}
    attentions = [op for op in ops.values() if op.NAME == "attention"]
    assert len(attentions) == 2 and {op.type.placement for op in attentions} == {Placement.GPU}
    assert all(op.appended_by_rope and f"_4x2x16_v12_ctx{ctx}" in op.kernel for op in attentions)
    assert {ops[op.q].kernel.split("_append")[1] for op in attentions} == {f"_ctx{ctx}_v24"}  # 2 KV heads of 12
    with PibFile(path) as f:
        plan, launches = f.plan(), f.json("gpu/launches")
    k_bytes = ctx * 2 * 16 * 4
    caches = [b for b in plan.buffers if b.kind == "kv-cache"]
    assert [(b.device, b.nbytes) for b in caches] == [("gpu", k_bytes + ctx * 2 * 12 * 4)] * 2
    assert not [n for n in plan.notes if "attention" in n]
    for att, cache in zip(attentions, caches, strict=True):
        (call,) = launches[att.result]  # the attention alone: its k rope's launch appends the rows
        (pair,) = launches[att.q]
        for args in (call["args"], pair["args"]):
            kv = {a["param"]: (a["offset"], a["shape"]) for a in args if a["param"].endswith("_cache")}
            assert kv == {"k_cache": (cache.offset, [ctx, 32]), "v_cache": (cache.offset + k_bytes, [ctx, 24])}
    target = load_target("pc-low")
    reads = [build_report(pib.module, pib.weights, target, plan_memory(pib.module, pib.weights, ctx=n,
                                                                      budget=plan.budget))["bytes_per_token"]
             for n in (64, 128)]
    assert reads[1] - reads[0] == 2 * 64 * 2 * (16 + 12) * 4 // 2  # layers, positions, KV heads, k + v, f32, half
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 128, size=ctx - 10)]  # chunks of 32, a rest
    reference = Interpreter(pib.module, pib.weights).run([*prompt, 7])
    with Session(path, threads=2, gpu="emulate") as session:
        for token, row in zip(prompt[:8], reference, strict=False):  # a step a token
            assert rel_err(session.feed([token]), row) <= 1e-4
        session.reset()
        assert rel_err(session.feed(prompt, all_logits=True), reference[: len(prompt)]) <= 1e-4
        session.reset()
        assert rel_err(session.feed(prompt), reference[len(prompt) - 1]) <= 1e-4  # the prefill programs, a step
        assert rel_err(session.feed([7]), reference[len(prompt)]) <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "glm4_moe", "deepseek_v2"])
def test_a_mixtures_experts_stay_on_the_cpu_beside_the_gpus_layers(tmp_path, monkeypatch, family):
    # The GPU has no kernel for a mixture of experts: compiled for pc-low, the attention runs on
    # the (emulated) GPU and each layer's experts on the CPU in between, their weights in the
    # CPU's memory; the logits are the interpreter's. gpt-oss: its sinks on the GPU with the
    # attention, its experts' biases on the CPU with them. DeepSeek V2's latent attention (values
    # narrower than keys, keys joined head by head) on the GPU too.
    from hf_models import make_model

    from picc.frontend import load_model

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    make_model(family, "base", tmp_path / "hf")
    path = tmp_path / "moe.pib"
    write_compiled(compile_model(load_model(tmp_path / "hf"), CompileOptions(target="pc-low", vram="4MiB", dense=True),
                                 say=lambda _: None), path)
    pib = load_pib(path)
    where = {op.NAME: op.type.placement for op in pib.module.ops() if op.NAME in ("attention", "moe")}
    assert where == {"attention": Placement.GPU, "moe": Placement.CPU}
    experts = {w.name: w.type.placement for w in pib.module.weights if ".moe." in w.name}
    assert experts and set(experts.values()) == {Placement.CPU}
    sinks = {w.type.placement for w in pib.module.weights if w.name.endswith(".attn.sinks")}
    assert sinks == ({Placement.GPU} if family == "gpt_oss" else set())
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(path, threads=2, gpu="emulate") as session:
        assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-4


def test_emulated_device_refuses_to_go_over_its_budget():
    device = EmulatedDevice(1000)
    block = device.allocate(600)
    assert block.nbytes == 600 and block.ctypes.data % 256 == 0
    with pytest.raises(GpuError, match="1000 bytes of VRAM .* 600 in use; 500 more do not fit"):
        device.allocate(500)
    assert device.peak == 600


FUSE_BEFORE = """\
module @m {ctx = 64}

weight @wu : f32[6, 8] @gpu
weight @wg : f32[6, 8] @gpu
weight @wd : f32[6, 8] @gpu
weight @cu : f32[10, 8] @cpu
weight @cg : f32[10, 8] @cpu
weight @cd : f32[10, 8] @cpu
weight @bd : f32[8] @gpu

func @forward(%x: f32[seq, 8]) -> f32[seq, 8] {
  %l0.ffn.hot = sparse_ffn %x, @wu, @wd, gate=@wg {form = "swiglu", threshold = 0.5, neuron_major = true, part_of = "l0.ffn.out", mode = "gate-first"} : f32[seq, 8] @gpu
  %l0.ffn.cold = sparse_ffn %x, @cu, @cd, gate=@cg {form = "swiglu", threshold = 0.5, neuron_major = true, part_of = "l0.ffn.out", neuron_offset = 6, mode = "gate-first"} : f32[seq, 8] @cpu
  %l0.ffn.out = add %l0.ffn.hot, %l0.ffn.cold : f32[seq, 8] @gpu
  return %l0.ffn.out
}
"""

FUSE_EXPECTED = """\
module @m {ctx = 64}

weight @wu : f32[6, 8] @gpu
weight @wg : f32[6, 8] @gpu
weight @wd : f32[6, 8] @gpu
weight @cu : f32[10, 8] @cpu
weight @cg : f32[10, 8] @cpu
weight @cd : f32[10, 8] @cpu

func @forward(%x: f32[seq, 8]) -> f32[seq, 8] @gpu {
  %l0.ffn.hot = fused_ffn %x, @wd, up=@wu, gate=@wg {form = "swiglu", mode = "gate-first", threshold = 0.5, layer = "l0.ffn.out", kernel = "gate_first_ffn_swiglu_8x6_f32"} : f32[seq, 8] @gpu
  %l0.ffn.cold = fused_ffn %x, @cd, up=@cu, gate=@cg {form = "swiglu", mode = "gate-first", threshold = 0.5, layer = "l0.ffn.out", neuron_offset = 6, kernel = "picc_ffn_gate_first_swiglu_f32_f32_f32"} : f32[seq, 8] @cpu
  %l0.ffn.out = merge %l0.ffn.hot, %l0.ffn.cold {kernel = "merge_8"} : f32[seq, 8] @gpu
  return %l0.ffn.out
}
"""


def _store(text: str, seed: int = 0) -> WeightStore:
    rng = np.random.default_rng(seed)
    store = WeightStore()
    for w in parse(text).weights:
        store.add(w.name, Tensor.from_f32(rng.normal(size=w.type.shape).astype(np.float32)))
    return store


def test_fuse_gather_gemv_golden():
    # A split gate-first layer: one fused kernel per device, the add becomes a merge, every op
    # names its kernel (the GPU's by shape, the CPU's generic symbol).
    before = parse(FUSE_BEFORE)
    verify(before)
    store = _store(FUSE_BEFORE)
    after = run_pipeline(before, store, parse_pipeline("fuse-gather-gemv,select-kernels"))
    assert print_module(after) == FUSE_EXPECTED
    assert parse(print_module(after)) == after
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)

    def run(m):  # the function reads %x: evaluate its ops one by one
        interp, env = Interpreter(m, store), {"x": x}
        for op in m.function().ops:
            env[op.result] = interp.eval(op, env)
        return env[m.function().ret]

    assert rel_err(run(after), run(before)) <= 1e-6


def test_fused_ops_verifier_rules():
    text = FUSE_EXPECTED.replace("%l0.ffn.out = merge %l0.ffn.hot, %l0.ffn.cold",
                                 "%l0.ffn.out = merge %l0.ffn.hot, %x")
    with pytest.raises(Exception, match=r"line \d+: %l0.ffn.out = merge: %x must be a fused_ffn part of layer"):
        verify(parse(text))
    text = FUSE_EXPECTED.replace('mode = "gate-first", threshold = 0.5, layer = "l0.ffn.out", kernel = "gate',
                                 'mode = "predictor", threshold = 0.5, layer = "l0.ffn.out", kernel = "gate')
    with pytest.raises(Exception, match="mode 'predictor' needs a mask operand"):
        verify(parse(text))


def test_fusing_twice_or_partitioning_after_is_an_error(model, compiled, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(compiled[2].parent / "cache"))  # the compiles' predictors
    module, weights = placed(model, "0")
    assert all(isinstance(op, FusedFFN) for op in module.ops() if "ffn." in op.result and op.NAME != "predict")
    with pytest.raises(PiccError, match="already fused"):
        run_pipeline(module, weights, parse_pipeline("fuse-gather-gemv"))
    with pytest.raises(PiccError, match="partition-neurons comes before fuse-gather-gemv"):
        run_pipeline(module, weights, parse_pipeline("partition-neurons{target=pc-low,vram=1MB}"))


def test_run_and_bench_report_time_per_device_and_transfers(compiled, capsys):
    import json

    from picc.cli import main

    path = compiled[2]
    assert PibFile(path).json("cpu/manifest")["decode"] is None  # greedy steps go a step at a time
    assert main(["run", str(path), "-p", "the company", "-n", "4", "--json", "--threads", "2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "host-emulated GPU" in captured.err and captured.err.count("\n") == 1
    devices = out["devices"]
    assert devices["gpu"] == "emulated" and devices["gpu_ms"] > 0 and devices["cpu_ms"] > 0
    # Per token: the CPU part's input and mask go one way, its partial sums and the logits the other.
    assert devices["transfer_bytes"] > 0 and devices["transfer_ms"] >= 0
    assert main(["bench", str(path), "--repeat", "1", "-n", "2", "--prompt-tokens", "2", "--json"]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert bench["devices"]["gpu_ms_per_token"] > 0 and bench["devices"]["transfer_bytes_per_token"] > 0
    # Beside the measurement, the cost model's estimate from compile time (the .pib's report).
    assert bench["estimate_tokens_per_s"] == PibFile(path).json("report")["estimate_tokens_per_s"] > 0


def test_bench_profile_times_the_cpu_stages_of_a_hybrid_step(compiled, capsys):
    import json

    from picc.cli import main

    argv = ["bench", "--repeat", "1", "-n", "3", "--prompt-tokens", "2", "--profile"]
    assert main([*argv, str(compiled[2]), "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    stages = PibFile(compiled[2]).json("cpu/manifest")["stages"]
    expected = [[i, *call] for i, st in enumerate(stages) if st["step"] for call in st["profile"]["calls"]]
    assert [[c["stage"], c["kernel"], c["op"]] for c in profile["calls"]] == expected and len(expected) > 0
    assert profile["steps"] == 3 and 0 < profile["step_us"] <= profile["wall_us_per_token"]
    # A plan with every op on the GPU (relu-demo for pc-low) leaves the CPU no step to time.
    from picc.cli_runtime import print_profile

    print_profile({**profile, "calls": [], "step_us": 0.0})
    assert "this model's step has no CPU work" in capsys.readouterr().out


def test_eval_of_a_compiled_file_compares_its_fused_ffns_with_dense(compiled, capsys):
    # picc eval on a .pib: the fused IR's own sparsity, and its dense twin (every fused FFN computing
    # all its neurons, split layers included) as the reference.
    import json

    from picc.cli import main

    path = compiled[2]
    assert main(["eval", str(path), "--ppl", "ptb-valid", "--max-tokens", "256", "--compare-dense", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.2 < out["ffn_sparsity"] < 1.0 and out["ppl_dense"] != out["ppl"]
    assert out["recall"] is not None and out["recall"] > 0.8
    assert set(out["layer_recall"]) == {"l0.ffn.out", "l1.ffn.out"}  # the split parts count as their layer


def test_cuda_sources_compile_at_load_when_the_file_has_no_ptx(compiled, tmp_path):
    # A .pib written where nvcc was missing carries sources only; the CUDA executor compiles them
    # when it loads the file (here: the same function, without a device to load them on).
    from picc.codegen_cuda import nvcc_path
    from picc.pib import open_pib
    from runtime.cuda import compile_at_load

    if nvcc_path() is None:
        pytest.skip("nvcc is not installed: CUDA sources cannot be compiled")
    write_compiled(compiled[0], tmp_path / "g.pib")
    with open_pib(tmp_path / "g.pib") as pib:
        manifest = pib.json("cuda/manifest")
        sources = {k: pib.text(f"cuda/sm_75/{k}.cu") for k in manifest["kernels"]}
    ptx = compile_at_load(sources, "sm_86")
    for kernel, launches in manifest["kernels"].items():
        assert all(f".entry {launch['entry']}(".encode() in ptx[kernel] for launch in launches), kernel


def test_a_gpu_part_that_costs_more_than_it_saves_is_not_chosen(model, tmp_path, monkeypatch):
    """A tiny model's GPU part is kernel launches and copies, not bytes: the cost model expects
    the CPU alone to be faster. With the budget left to picc, nothing goes to the GPU (and the
    report says why); an explicit --vram is the user's choice, kept with a note."""
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    said: list[str] = []
    chosen = compile_model(model, CompileOptions(target="pc-low", sparsity=SPARSE), say=said.append)
    assert chosen.plan.gpu_bytes == 0
    assert any(line.startswith("placing nothing on the GPU: the cost model estimates") for line in said), said
    assert any(note.startswith("nothing on the GPU") for note in chosen.report["notes"])
    said.clear()
    kept = compile_model(model, CompileOptions(target="pc-low", vram="4MiB", sparsity=SPARSE), say=said.append)
    report = kept.report
    assert kept.plan.gpu_bytes > 0
    assert report["cpu_only_estimate_tokens_per_s"] > report["estimate_tokens_per_s"]
    assert any(line.endswith("--vram 0 would be faster") for line in said), said
    # The GPU's fixed costs are in the estimate: every launch at the target's kernel overhead.
    gpu = load_target("pc-low").gpu
    assert report["estimate_ms_per_token"]["gpu_launches"] == pytest.approx(
        1e3 * report["gpu_launches_per_token"] * gpu.kernel_overhead)
    assert report["estimate_ms_per_token"]["gpu_syncs"] == pytest.approx(
        1e3 * report["gpu_stages_per_token"] * gpu.sync_overhead)
