"""The runtime running compiled .pib files on the CPU, against the reference interpreter.

Tolerances: the generated kernels accumulate in f32 like the interpreter, from the same stored
weights (quantized blocks are dequantized exactly), but in another order (SIMD lanes, threads'
partial sums); over a few layers that is ~1e-6 relative. The bounds below (1e-4 dense, 1e-3
sparse, the issue's) leave room for that and would still catch a wrong row, block or scale.
A sparse FFN is also sensitive to a score sitting at its threshold, which ordering can flip.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import narrow_values, tiny_llama, tiny_mla, with_tokenizer
from runtime_cases import LONG, TOKENS, check_batch_rows, check_prefill, compiled, rel_err, runtime_logits

from picc.cli import main
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.types import DType
from runtime import hostmem
from runtime.contracts import ContractError
from runtime.cpu import ExecutorError
from runtime.cpu_manifest import CpuBuffer, CpuManifest
from runtime.pib import PibFile
from runtime.sampling import SamplingOptions, sample, token_logprob
from runtime.session import Session


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.Q8_0, DType.Q4_0, DType.Q4_1])
@pytest.mark.parametrize("form", ["swiglu", "relu"])
def test_dense_models_match_the_interpreter(dtype, form, tmp_path):
    model = tiny_llama(form, n_layers=2, hidden=64, n_ff=96, matrix_dtype=dtype, tied=dtype == DType.Q8_0)
    path, pib = compiled(model, tmp_path, "dense", dense=True, kv_cache="f32")  # f16 caches: below
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    # Dot products differ from the interpreter's only in the order of their sums (1e-4). The 4-bit
    # GEMVs dot x rounded to int16 per block of 32 (the _xi16 kernels), eight rows at a time from
    # matrices the .pib stores in the rows8 layout, and the interpreter rounds x as they do (on
    # the weights load_pib puts back in rows); the prefill calls those kernels' batched twins
    # (the chunk's tokens as their rows; no batch step is built here). A q8_0 LM head dots x
    # rounded to int8 from the rows8 layout, which the embedding tied to it reads too.
    int_dots, head_i8 = dtype in (DType.Q4_0, DType.Q4_1), dtype == DType.Q8_0
    tol = 1e-4
    with PibFile(path) as f:
        assert ("_r8_xi16(" in f.text("cpu/ir")) == int_dots
        assert ("_r8_xi16_rows(" in f.text("cpu/ir")) == int_dots
        assert ("picc_gemv_q8_0_r8_xi8(" in f.text("cpu/ir")) == ("picc_embed_q8_0_r8(" in f.text("cpu/ir")) == head_i8
        layouts = {name: f.tensor(name).layout for name in f.tensor_names}
    in_rows8 = {name for name, layout in layouts.items() if layout == "rows8"}
    assert bool(in_rows8) == (int_dots or head_i8) and set(layouts.values()) <= {None, "rows8"}
    assert not head_i8 or in_rows8 == {"token_embd"}
    for name in in_rows8:  # stored rearranged, read back as the source's rows
        np.testing.assert_array_equal(pib.weights[name].data, model.weights[name].data)
    assert rel_err(runtime_logits(path, TOKENS), reference) <= tol
    # Two threads split the rows and overlap the independent kernels (no barrier between them).
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= tol
    check_prefill(path, pib, tol)


def test_qwen3s_heads_are_normalised_one_at_a_time_by_every_program(tmp_path):
    # Qwen3 RMS-normalises each head's q and k (rms_norm with a group): the step and the chunk
    # programs call the grouped norm kernel, which takes a token's heads as rows of their own (the
    # threads split them), here with heads wider than hidden / heads (32 x 4 in 64). A norm over the
    # whole row, or over another run length, moves the logits by far more than the tolerance.
    from hf_models import make_model

    from picc.frontend import load_model

    make_model("qwen3", "head-dim", tmp_path / "hf")
    path, pib = compiled(load_model(tmp_path / "hf"), tmp_path, "qwen3", dense=True, kv_cache="f32")
    with PibFile(path) as f:
        assert f.text("cpu/ir").count("call void @picc_rms_norm_grouped(") >= 2 * 2 * 2  # q, k; 2 layers; 2+ programs
    norms = [op for op in pib.module.ops() if isinstance(op, O.RMSNorm) and op.group is not None]
    assert len(norms) == 4 and {op.group for op in norms} == {32}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    for threads in (1, 2):
        assert rel_err(runtime_logits(path, TOKENS, threads), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


@pytest.mark.parametrize("family, variant", [("phi3", "partial-rope"), ("phi3", "longrope-partial"),
                                             ("smollm3", "sliding")])
def test_hf_families_layers_compile_as_they_compute(family, variant, tmp_path):
    # Phi-4-mini's rope: the first 12 of 16 features of each head rotated (half-split among them),
    # the other 4 passed through; with longrope, each frequency divided by its factor and the
    # cosines and sines scaled (the CPU's tables). SmolLM3: a layer without rope (attention
    # straight on the projections), which slides a window of 4 here. The step and the chunk
    # programs against the interpreter.
    from hf_models import make_model

    from picc.frontend import load_model

    make_model(family, variant, tmp_path / "hf")
    path, pib = compiled(load_model(tmp_path / "hf"), tmp_path, family, dense=True, kv_cache="f32")
    ropes = [op for op in pib.module.ops() if isinstance(op, O.Rope)]
    windows = [op.window for op in pib.module.ops() if isinstance(op, O.Attention)]
    assert ({op.rotated for op in ropes}, len(ropes), windows) == (({12}, 4, [None, None]) if family == "phi3" else
                                                                   ({16}, 2, [None, 4]))
    assert {op.attention_factor > 1 for op in ropes} == {variant == "longrope-partial"}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


def test_yarn_compiles_as_it_computes(tmp_path):
    # YaRN: each frequency divided by its factor and the cosines and sines scaled (the CPU's
    # tables), past the original context (8 positions here) as before it.
    from hf_models import make_model

    from picc.frontend import load_model

    make_model("llama", "rope-yarn-mscale", tmp_path / "hf")
    path, pib = compiled(load_model(tmp_path / "hf"), tmp_path, "llama", dense=True, kv_cache="f32")
    assert {(op.scaling, op.original_max_position) for op in pib.module.ops() if isinstance(op, O.Rope)} == {("yarn", 8)}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "granite", "gemma2"])
def test_olmo2s_granites_and_gemma2s_layers_compile_as_they_compute(family, tmp_path):
    # OLMo 2: no norm before the attention or the MLP, one after each, q and k normalised over the
    # whole projection (a norm of 64 features, not of each head's 16). Granite: its multipliers as
    # the embedding's scale, the norms' eps and the attention's scale. Gemma 2: soft caps, sandwich
    # norms, a sliding layer. OLMo 3: OLMo 2's layer with a sliding one, a rope per layer type.
    # The step and the chunk programs against the interpreter.
    from hf_models import make_model

    from picc.frontend import load_model

    make_model(family, "base", tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    path, pib = compiled(model, tmp_path, family, dense=True, kv_cache="f32")
    norms = [op for op in model.module.ops() if isinstance(op, O.RMSNorm)]
    assert len(norms) == {"olmo2": 4 * 2 + 1, "olmo3": 4 * 2 + 1, "granite": 2 * 2 + 1, "gemma2": 4 * 2 + 1}[family]
    if family == "olmo3":
        ropes = {op.theta: op.block for op in model.module.ops() if isinstance(op, O.Rope)}
        assert ropes == {1e4: 0, 5e5: 1}
    if family.startswith("olmo"):
        assert {op.group for op in norms if op.result.endswith(("q_norm", "k_norm"))} == {None}
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


@pytest.mark.parametrize("family, variant", [("qwen3_moe", "dense-layer"), ("olmoe", "base"), ("mixtral", "base"),
                                             ("granitemoe", "base"), ("gpt_oss", "base"), ("qwen2_moe", "base"),
                                             ("ernie4_5_moe", "base"), ("deepseek_v2", "group-limited"),
                                             ("deepseek_v3", "base"), ("glm4_moe", "base"), ("glm4_moe_lite", "base")])
def test_mixtures_of_experts_compile_as_they_compute(family, variant, tmp_path):
    # Each token through its router's top experts (a picc_moe kernel a token): the step, the
    # chunk programs (a call per token) and the server's batch step (a call per row, each the
    # step's bits) against the interpreter. Qwen3-MoE's layer 0 keeps a dense MLP; OLMoE's
    # weights are not renormalised, Mixtral's and Granite-MoE's are (with Granite's multipliers);
    # gpt-oss's experts have biases and the clamped SwiGLU (their kernel variant), its attention
    # sinks and every other layer a window; Qwen2-MoE's shared expert is two more experts every
    # token takes, gated by the router's extra row; ERNIE 4.5's layer 0 is dense, its experts ranked
    # by probability plus a bias, with two shared ones. DeepSeek V2 (three of the best two of four
    # groups, times 16), V3 (sigmoid plus a bias, the groups' two best, times 2.5), GLM-4.5 and
    # GLM-4.7-Flash (V3's routing in one group) and their dense layer 0; the latent attentions of
    # V2, V3 and GLM-4.7-Flash (keys joined head by head, values narrower than keys, the
    # concat_heads and v_head_dim kernels). Compiled by default (no --dense): the dense MLP may go sparse,
    # the experts stay as they are; all-expert OLMoE says so.
    from hf_models import make_model

    from picc.compile import CompileOptions, compile_model, write_compiled
    from picc.frontend import load_model
    from picc.pib import load_pib

    make_model(family, variant, tmp_path / "hf")
    model = with_tokenizer(load_model(tmp_path / "hf"))
    said: list[str] = []
    result = compile_model(model, CompileOptions(kv_cache="f32"), say=said.append)
    path = tmp_path / f"{family}.pib"
    write_compiled(result, path)
    pib = load_pib(path)
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    kernel = "picc_moe_swiglu_f32_f32_f32_f32" + {"gpt_oss": "_brugd_clamped", "qwen2_moe": "_sharedg",
                                                  "ernie4_5_moe": "_shared_cb", "deepseek_v2": "_shared_gmax_scaled",
                                                  "deepseek_v3": "_shared_cb_sigmoid_gtop2_scaled",
                                                  "glm4_moe": "_shared_cb_sigmoid_scaled",
                                                  "glm4_moe_lite": "_shared_cb_sigmoid_scaled"}.get(family, "")
    dense_layer = family in ("qwen3_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite")
    assert [op.kernel for op in moes] == [kernel] * (1 if dense_layer else 2)
    assert any("every FFN is a mixture of experts" in line for line in said) == (not dense_layer)
    layers = 1 if dense_layer else 2  # picc inspect's note, as the table shows FFNs only
    shared = {"qwen2_moe": 2, "ernie4_5_moe": 2, "deepseek_v2": 2, "deepseek_v3": 1, "glm4_moe": 1,
              "glm4_moe_lite": 1}.get(family)
    shared = f" and {shared} shared" if shared else ""
    top_k = 3 if variant == "group-limited" else 2
    assert (f"{layers} layer{'s' * (layers > 1)} a mixture of experts ({top_k} of 8{shared} a token)"
            in " ".join(result.report["notes"]))
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    with PibFile(path) as f:  # the batch step takes its rows through the experts in one call, as a chunk's
        ir = f.text("cpu/ir")
    batch = ir[ir.index("define void @picc_batch_step("):]
    assert batch[: batch.index("\n}")].count(f"@{kernel}_chunk(") == len(moes)
    check_batch_rows(path, TOKENS[:3])


@pytest.mark.parametrize("routing", ["deepseek-v2", "deepseek-v3", "glm-4.5"])
def test_deepseeks_and_glms_routers_compile_as_they_compute(routing, tmp_path):
    # A tiny ERNIE 4.5 MoE's mixture routed as DeepSeek V2 (softmax, the top k from the better of
    # two groups by their largest probability, the weights times 16), V3 (sigmoids plus a
    # correction bias, the two best of four groups by their two largest, renormalised, times 2.5)
    # or GLM-4.5 (V3's without groups), each with its kernel variant (tests/moe_routers.py): the
    # step, the chunk programs and the server's batch step against the interpreter.
    from hf_models import make_model
    from moe_routers import with_routing

    from picc.frontend import load_model

    make_model("ernie4_5_moe", "base", tmp_path / "hf")
    model = with_tokenizer(with_routing(load_model(tmp_path / "hf"), routing))
    path, pib = compiled(model, tmp_path, routing, kv_cache="f32", batch_step=True)
    moes = [op for op in pib.module.ops() if isinstance(op, O.MoE)]
    kernel = "picc_moe_swiglu_f32_f32_f32_f32_shared" + {"deepseek-v2": "_gmax_scaled",
                                                         "deepseek-v3": "_cb_sigmoid_gtop2_scaled",
                                                         "glm-4.5": "_cb_sigmoid_scaled"}[routing]
    assert [op.kernel for op in moes] == [kernel]
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    with PibFile(path) as f:
        ir = f.text("cpu/ir")
    batch = ir[ir.index("define void @picc_batch_step("):]
    assert batch[: batch.index("\n}")].count(f"@{kernel}_chunk(") == 1
    check_batch_rows(path, TOKENS[:3])


def test_gemma3s_layer_compiles_as_it_computes(tmp_path):
    # Gemma 3: the embedding's rows times sqrt(hidden) (a scaled embedding kernel, the table left
    # as the tied LM head reads it), the attention's and the FFN's outputs normalised before their
    # residual adds, a rope per layer (theta 1e4 on the sliding layer, 1e6 on the global one) and
    # q . k scaled by query_pre_attn_scalar. The step and the chunk programs against the interpreter.
    from hf_models import make_model

    from picc.frontend import load_model

    make_model("gemma3_text", "base", tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    path, pib = compiled(model, tmp_path, "gemma3", dense=True, kv_cache="f32")
    with PibFile(path) as f:
        assert "call void @picc_embed_f32_scaled(" in f.text("cpu/ir")
    ops = list(model.module.ops())
    assert [op.scale for op in ops if isinstance(op, O.Embed)] == [pytest.approx(8.0)]  # sqrt(64)
    assert sorted({op.theta for op in ops if isinstance(op, O.Rope)}) == [1e4, 1e6]
    assert sum(isinstance(op, O.RMSNorm) and op.result.endswith(("post_attn_norm", "post_ffn_norm")) for op in ops) == 4
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)


@pytest.mark.parametrize("sparse", [False, True])
def test_gemma2s_soft_caps_compile_as_they_compute(tmp_path, sparse):
    # Gemma 2 caps the attention's scores and the final logits at cap * tanh(x / cap): the
    # attention kernels' _softcap variants and a softcap kernel after the head, in the step, the
    # chunk programs and the server's batch step, against the interpreter (dense, and sparse
    # gate-first FFNs). Caps where this model's scores and logits (~N(0, 1)) bend.
    from picc.sparsity.sparsify import SparsifyOptions

    model = with_tokenizer(tiny_llama("geglu_tanh", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.F32,
                                      softcaps=(0.7, 0.8)))
    plain = Interpreter(tiny_llama("geglu_tanh", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.F32).module,
                        model.weights).run(TOKENS)
    options = dict(sparse=True, sparsity=SparsifyOptions(mode="gate-first", tokens=256, window=64, target_sparsity=0.3,
                                                         fisher_tokens=64)) if sparse else dict(dense=True)
    path, pib = compiled(model, tmp_path, "gemma2", batch_step=True, **options)
    assert [getattr(op, "mode", None) for op in pib.module.ops() if op.NAME == "fused_ffn"] == ["gate-first"] * 2 * sparse
    with PibFile(path) as f:
        ir = f.text("cpu/ir")
    for program in ("picc_stage_0", "picc_batch_step"):
        body = ir[ir.index(f"define void @{program}("):]
        body = body[: body.index("\n}")]
        assert body.count("@picc_attention_kvf16_softcap") == 2 and body.count("call void @picc_softcap(") == 1
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert np.abs(reference).max() < 0.8 and rel_err(reference, plain) > 0.1  # the caps bend them
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    check_batch_rows(path, TOKENS[:3])


@pytest.mark.parametrize("kwargs", [dict(), dict(yarn=True, a_heads=4, b_heads=1)], ids=["mla", "yarn-b-shared"])
def test_keys_joined_head_by_head_compile_as_they_compute(tmp_path, kwargs):
    # DeepSeek's decompressed MLA: each head's key joined from a one-head rope of k_pe (its 8
    # features in GPT-J pairs) and the head's own 16 features of a linear (concat_heads), the
    # queries' rope turning the first 8 of each head's 24; and the other way round, a k_pe head
    # each and one k_nope head for all, with YaRN's frequencies. The step (heads split between the
    # threads), the chunk programs (rows) and the server's batch step (a call per row) against the
    # interpreter.
    model = with_tokenizer(tiny_mla(**kwargs))
    path, pib = compiled(model, tmp_path, "mla", batch_step=True, dense=True, kv_cache="f32")
    assert [op.kernel for op in pib.module.ops() if isinstance(op, O.ConcatHeads)] == ["picc_concat_heads"] * 2
    with PibFile(path) as f:
        ir = f.text("cpu/ir")
    for program in ("picc_stage_0", "picc_prefill_chunk", "picc_batch_step"):
        body = ir[ir.index(f"define void @{program}("):]
        body = body[: body.index("\n}")]
        assert body.count("call void @picc_concat_heads(") == 2 and body.count("call void @picc_rope_gptj(") == 4
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    check_batch_rows(path, TOKENS[:3])


def test_gpt_oss_attention_sinks_compile_as_they_compute(tmp_path):
    # gpt-oss's sink logit per query head in each attention's softmax, with a sliding window: the
    # attention kernels' _sinks variants (a pointer to the layer's sinks, a CPU weight of the .pib),
    # in the step, the chunk programs and the server's batch step, against the interpreter.
    from runtime.sequences import SequencePool

    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, window=5, sinks=True))
    plain = Interpreter(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, window=5).module,
                        model.weights).run(TOKENS)
    path, pib = compiled(model, tmp_path, "sinks", batch_step=True, dense=True)
    with PibFile(path) as f:
        ir, tensors = f.text("cpu/ir"), set(f.tensor_names)
    assert {"l0.attn.sinks", "l1.attn.sinks"} <= tensors
    for program in ("picc_stage_0", "picc_prefill_chunk", "picc_batch_step"):
        body = ir[ir.index(f"define void @{program}("):]
        body = body[: body.index("\n}")]
        assert body.count("@picc_attention_kvf16_sinks") == 2
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(reference, plain) > 0.1  # the sinks weigh
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    with Session(path, 2) as s:
        expected = [s.feed([t]).copy() for t in TOKENS[:3]]
    with Session(path, 2) as session:
        cpu, pool = session.executor.cpu, SequencePool(session.executor, 2)
        slots = [pool.acquire() for _ in range(2)]
        for step, token in enumerate(TOKENS[:3]):  # two rows, the same tokens: each row the step's bits
            cpu.batch_step([token, token], [step, step], pool.pointers(slots))
            for row in range(2):
                np.testing.assert_array_equal(cpu.batch_logits(row).view(np.uint32), expected[step].view(np.uint32))


@pytest.mark.parametrize(("kv_cache", "window"), [("f32", None), ("f16", 5)])
def test_values_narrower_than_keys_compile_as_they_compute(tmp_path, kv_cache, window):
    # DeepSeek's MLA decompressed: value heads of 24 features (v_head_dim) under key heads of 32.
    # The attention kernels and their batch rows twin take v_head_dim, in the step, the chunk
    # programs and the server's batch step, against the interpreter (f32 caches, and f16 ones,
    # which the interpreter rounds alike, with a window). Each KV cache holds its KV heads' k
    # planes, then their v planes of 24-element rows (cpu/manifest's k_nbytes says where), which
    # a server's pool copies from one sequence's slot to another's for a prompt that shares rows.
    from runtime.sequences import SequencePool

    hd, vd, n_kv = 32, 24, 2
    model = with_tokenizer(narrow_values(tiny_llama("swiglu", n_layers=2, hidden=128, n_ff=96, window=window), vd))
    path, pib = compiled(model, tmp_path, "narrow", batch_step=True, dense=True, kv_cache=kv_cache)
    assert {(op.head_dim, op.v_head_dim) for op in pib.module.ops() if isinstance(op, O.Attention)} == {(hd, vd)}
    with PibFile(path) as f:
        ir, manifest, plan = f.text("cpu/ir"), CpuManifest.from_json(f.json("cpu/manifest")), f.plan()
    kernel = {"f32": "@picc_attention(", "f16": "@picc_attention_kvf16("}[kv_cache]
    for program, call in (("picc_stage_0", kernel), ("picc_prefill_chunk", kernel),
                          ("picc_batch_step", kernel.replace("(", "_rows("))):
        body = ir[ir.index(f"define void @{program}("):]
        assert body[: body.index("\n}")].count(call) == 2, program
    element, ctx = {"f32": 4, "f16": 2}[kv_cache], plan.ctx
    caches = [(b.nbytes, b.k_nbytes) for b in manifest.buffers if b.kind == "kv"]
    assert caches == [(ctx * n_kv * (hd + vd) * element, ctx * n_kv * hd * element)] * 2
    assert [b.nbytes for b in plan.buffers if b.kind == "kv-cache"] == [ctx * n_kv * (hd + vd) * element] * 2
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= 1e-4
    check_prefill(path, pib, 1e-4)
    check_batch_rows(path, TOKENS[:3])
    with Session(path, 2) as s:  # slot 1 from slot 0's copied rows: the next step's bits
        pool = SequencePool(s.executor, 2)
        s.feed(LONG[:40])
        pool.copy(0, 1, 0, 40)
        want = s.feed(LONG[40:41]).copy()
        pool.bind(1)
        s.rewind(40)
        np.testing.assert_array_equal(s.feed(LONG[40:41]).view(np.uint32), want.view(np.uint32))


def test_every_positions_logits_come_in_chunks_and_the_session_goes_on(tmp_path):
    # feed(all_logits=True) (picc logits) runs all but the last token through picc_logits_chunk,
    # 32 at a time: the same logits as one step per token (GEMMs instead of GEMVs: the sums
    # differ in order only, 1e-5 in f32), and the KV caches it leaves let the session go on.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.F32)
    path, pib = compiled(model, tmp_path, "dense", dense=True)
    with PibFile(path) as f:
        assert "define void @picc_logits_chunk(" in f.text("cpu/ir")
    with Session(path, 2) as s:
        chunked = s.feed(list(LONG), all_logits=True)
        after = s.feed([7, 8], all_logits=True)
    with Session(path, 2) as s:
        stepwise = np.concatenate([s.feed([t], all_logits=True) for t in [*LONG, 7, 8]])
    assert chunked.shape == (len(LONG), stepwise.shape[1])
    assert rel_err(chunked, stepwise[: len(LONG)]) <= 1e-5
    assert rel_err(after, stepwise[len(LONG):]) <= 1e-5
    reference = Interpreter(pib.module, pib.weights).run([*LONG, 7, 8])
    assert rel_err(np.concatenate([chunked, after]), reference) <= 1e-4


@pytest.mark.parametrize("dtype", [DType.Q4_1, DType.Q4_0, DType.F32])
def test_chunk_programs_say_whether_they_compute_the_steps_bits_and_do(dtype, tmp_path, capsys):
    # CpuChunkProgram.step_bits, on which a server takes the KV rows of a reply's steps for a prompt
    # (runtime.sequences): where every matrix op of the chunk is a step kernel's batched twin
    # (4-bit rows8 with int16 x) the chunk programs leave the step's KV rows and logits bit for bit,
    # at any chunk boundaries; an f32 model's GEMMs sum in other orders, and it says so.
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=dtype))
    tok = replace(model.tokenizer, stop_ids=(5, 2))
    path, pib = compiled(replace(model, tokenizer=tok), tmp_path, "bits", dense=True)
    assert main(["inspect", str(path)]) == 0
    printed = capsys.readouterr().out
    assert ("compute each token's decode-step bits" in printed) == (dtype != DType.F32)
    assert f"replies end at: {tok.id_to_token(2)} (2), {tok.id_to_token(5)} (5)\n" in printed
    with Session(path, 2) as s:
        cpu = s.executor.cpu
        assert cpu.step_bits == (dtype != DType.F32)
        if not cpu.step_bits:
            return
        s.executor.prefill(LONG[:3], 0)
        chunked = s.executor.logits_of(LONG[3:], 3)  # boundaries at 3, 35: not a session's
        rows = {i: cpu.cache_array(i)[:n].copy() for i, n in cpu.kv_caches().items()}
    with Session(path, 2) as s:
        stepped = np.concatenate([s.feed([t], all_logits=True) for t in LONG])
        cpu = s.executor.cpu
        for i in cpu.kv_caches():  # every position: chunks of 3, 32, 10 in one, steps in the other
            for at, n, runs in cpu.kv_parts(i):  # k rows, v rows
                got, want = rows[i][at : at + n].reshape(runs, -1), cpu.cache_array(i)[at : at + n].reshape(runs, -1)
                per = got.shape[1] // s.max_ctx
                np.testing.assert_array_equal(got[:, : len(LONG) * per], want[:, : len(LONG) * per])
    np.testing.assert_array_equal(chunked.view(np.uint32), stepped[3:].view(np.uint32))


def test_code_without_the_native_thread_team_runs_on_python_barriers(tmp_path, monkeypatch):
    # .pib files compiled before picc_team_worker existed: the same steps, handed over by Python.
    from runtime.cpu import CpuExecutor

    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.F32)
    path, _ = compiled(model, tmp_path, "dense", dense=True)
    with Session(path, 2) as s:
        assert s.executor.cpu.team.native
        native = s.feed(list(TOKENS), all_logits=True)
    monkeypatch.setattr(CpuExecutor, "_native_team", lambda self: None)
    with Session(path, 2) as s:
        assert not s.executor.cpu.team.native
        np.testing.assert_array_equal(s.feed(list(TOKENS), all_logits=True), native)


def _smaps_entry(address: int) -> dict[str, str]:
    """The fields of /proc/self/smaps for the mapping that holds ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            if entry is not None:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                entry = {}
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    assert entry is not None, hex(address)
    return entry


@pytest.mark.skipif(not hostmem.huge_pages_enabled(), reason="this kernel gives no transparent huge pages")
def test_weights_live_in_memory_advised_2_mib_pages_and_compute_as_when_mapped(tmp_path, monkeypatch):
    # The .pib's mapping is file-backed in 4 KiB pages; the executor copies the weights into an
    # anonymous region advised MADV_HUGEPAGE. Without huge pages the weights stay mapped from the
    # file: the same bytes, so the same logits, bit for bit.
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.Q4_1)
    path, _ = compiled(model, tmp_path, "dense", dense=True)
    with Session(path, 2) as s:
        cpu = s.executor.cpu
        weights = [a for a, b in zip(cpu._keep, cpu._manifest.buffers, strict=True) if b.kind == "weight"]
        assert weights
        for w in weights:
            smaps = _smaps_entry(w.ctypes.data)
            assert smaps["THPeligible"] == "1" and smaps["Anonymous"] != "0 kB", smaps
            assert w.ctypes.data % 64 == 0
        copied = s.feed(list(TOKENS), all_logits=True)
    monkeypatch.setattr(hostmem, "huge_pages_enabled", lambda: False)
    with Session(path, 2) as s:
        cpu = s.executor.cpu
        w = next(a for a, b in zip(cpu._keep, cpu._manifest.buffers, strict=True) if b.kind == "weight")
        assert _smaps_entry(w.ctypes.data)["Anonymous"] == "0 kB"  # the file's own pages
        np.testing.assert_array_equal(s.feed(list(TOKENS), all_logits=True), copied)


def test_the_step_has_barriers_only_where_a_kernel_needs_the_last_ones_results(tmp_path):
    model = tiny_llama("swiglu", n_layers=1, hidden=64, n_ff=96, matrix_dtype=DType.F32)
    path, _ = compiled(model, tmp_path, "dense", dense=True, batch_step=True)
    with PibFile(path) as f:
        ir = f.text("cpu/ir")
    step = ir[ir.index("define void @picc_stage_0("):]
    step = step[: step.index("\n}")]
    calls = [line.split("@")[1].split("(")[0] for line in step.splitlines() if " call " in line and "@" in line]
    # embed | norm | q k v | rope rope | attention | o + residual | norm | ffn + residual | norm | head | argmax
    assert calls == ["picc_embed_f32", "picc_barrier", "picc_rms_norm", "picc_barrier", "picc_gemv_f32",
                     "picc_gemv_f32", "picc_gemv_f32", "picc_barrier", "picc_rope_llama",
                     "picc_rope_llama", "picc_barrier", "picc_attention_kvf16", "picc_barrier", "picc_gemv_f32",
                     "picc_barrier", "picc_rms_norm", "picc_barrier", "picc_ffn_gemv_swiglu_f32_f32_f32",
                     "picc_barrier", "picc_rms_norm", "picc_barrier", "picc_gemv_f32", "picc_barrier", "picc_argmax"]
    # The output projection and the FFN add their rows to the residual themselves (accumulate = 1,
    # the argument before tid), the q / k / v projections and the head do not.
    lines = [line for line in step.splitlines() if "@picc_gemv_f32(" in line or "@picc_ffn_" in line]
    assert [line.split(", i32 ")[-3] for line in lines] == ["0", "0", "0", "1", "1", "0"]
    # The batch step waits where the step does: its per-row loops of one-phase kernels on each
    # row's own memory (the two ropes) follow one another without a barrier between them.
    batch = ir[ir.index("define void @picc_batch_step("):]
    batch = batch[: batch.index("\n}")]
    assert batch.count("@picc_barrier(") == calls.count("picc_barrier")
    # A norm's or a rope's row is one thread's work: the threads take the batch's rows whole (each
    # call a team of one) instead of each row's call leaving the other threads waiting.
    per_row = [line for line in batch.splitlines() if "@picc_rms_norm(" in line or "@picc_rope_llama(" in line]
    assert per_row and all(", i32 0, i32 1, ptr " in line for line in per_row)


def test_the_prefill_program_uses_gemms_and_stops_at_the_last_kv_cache(tmp_path):
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96, matrix_dtype=DType.F32)
    path, _ = compiled(model, tmp_path, "dense", dense=True)
    with PibFile(path) as f:
        ir = f.text("cpu/ir")
    chunk = ir[ir.index("define void @picc_prefill_chunk("):]
    chunk = chunk[: chunk.index("\n}")]
    # (LLVM may call a clone of a kernel specialised for constant arguments: kernel.specialized.N)
    calls = [line.split("@")[1].split("(")[0].split(".specialized.")[0] for line in chunk.splitlines()
             if " call " in line and "@" in line and "picc_barrier" not in line]
    layer = ["picc_rms_norm"] + ["picc_gemm_f32"] * 3 + ["picc_rope_llama"] * 2 + ["picc_attention_kvf16"]
    ffn = ["picc_gemm_f32", "picc_add", "picc_rms_norm", "picc_gemm_f32", "picc_gemm_f32", "picc_ffn_act_swiglu",
           "picc_gemm_f32", "picc_add"]
    # Layer 1's output projection and FFN, the final norm and the head feed no KV cache: absent.
    assert calls == ["picc_embed_f32", *layer, *ffn, *layer]
    # The FFN's up and gate GEMMs write their own halves of the scratch: no barrier between them.
    with_barriers = [line.split("@")[1].split("(")[0].split(".specialized.")[0] for line in chunk.splitlines()
                     if " call " in line and "@" in line]
    at = with_barriers.index("picc_ffn_act_swiglu")
    assert with_barriers[at - 4 : at + 1] == ["picc_barrier", "picc_gemm_f32", "picc_gemm_f32", "picc_barrier",
                                              "picc_ffn_act_swiglu"]


def test_run_cli_generates_greedy_text_like_the_interpreter(tmp_path, capsys):
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96))
    path, pib = compiled(model, tmp_path, "tiny", dense=True)
    assert main(["run", str(path), "-p", "the company", "-n", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"prompt_tokens", "tokens", "text", "prompt_tokens_per_s", "decode_tokens_per_s"}
    from picc.generate import generate_ids

    prompt = model.tokenizer.encode("the company")
    expected = list(generate_ids(replace(pib, tokenizer=model.tokenizer), prompt, 12, stop_at_eos=False))
    assert out["tokens"] == expected and out["prompt_tokens"] == len(prompt)
    assert main(["run", str(path), "-p", "the company", "-n", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("the company") and "decode:" in captured.err and "tok/s" in captured.err
    # The benchmarks' loop (greedy_tokens) is the same generation, and leaves the session where
    # generate would: positions and history after the fed tokens, the last token not fed.
    with Session(path, 2) as s:
        s.feed(prompt)
        assert s.greedy_tokens(12) == expected
        assert s.pos == len(prompt) + 11 and s.history == prompt + expected
        with pytest.raises(ExecutorError, match="greedy tokens need"):
            s.greedy_tokens(s.ctx)
    # --logit-bias (OpenAI's logit_bias, as picc serve takes it): the first greedy token banned.
    assert main(["run", str(path), "-p", "the company", "-n", "6", "--json", "--logit-bias",
                 f"{expected[0]}=-100", "--logit-bias", "3=0.5"]) == 0
    biased = json.loads(capsys.readouterr().out)["tokens"]
    options = SamplingOptions(logit_bias=((3, 0.5), (expected[0], -100.0)))
    with Session(path, 2) as s:
        assert biased == list(s.generate(prompt, 6, options, stop_at_eos=True))[: len(biased)]
    assert biased[0] != expected[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_decode_loops_in_generated_code_like_a_step_at_a_time(threads, tmp_path, monkeypatch):
    # picc_decode runs greedy steps without returning to Python: the same tokens, positions and
    # final logits as the runtime's step-at-a-time loop, across calls of the loop (its output
    # holds `capacity` tokens: 3 here, so 40 steps take 14 calls), and it stops after the first
    # of the stop tokens it is given (a model may have several: Llama 3's <|eot_id|>, <|eom_id|>).
    from runtime.cpu import CpuExecutor
    from runtime.cpu_manifest import STOP_SLOTS

    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96))
    path, _ = compiled(model, tmp_path, "dense", dense=True)
    with PibFile(path) as f:
        assert "define void @picc_decode(" in f.text("cpu/ir")
    with Session(path, threads) as s:
        s.feed(list(TOKENS))
        assert s.executor.cpu.loops
        first = s.executor.greedy()
        s.executor.cpu._decode = replace(s.executor.cpu._decode, capacity=3)
        looped = s.executor.greedy_steps(first, s.pos, 40)
        looped_logits = s.executor.logits().copy()
    # A stop token is the largest of looped[10:30] (its first time ends the run), another one
    # comes later, and unused ids fill the loop's slots: given them too, the loop compares with
    # the smallest STOP_SLOTS and runs past `stop`, and its tokens are cut after it. Otherwise
    # the loop's last step is the stop's: its logits are those of the steps one at a time.
    stop = max(looped[10:30])
    until_stop = looped[: looped.index(stop) + 1]
    later = next(t for t in looped[looped.index(stop) + 1 :] if t not in until_stop)
    unused = [t for t in range(stop) if t not in looped][:STOP_SLOTS]
    assert len(unused) == STOP_SLOTS and len(until_stop) < 40
    stop_sets = [{stop}, {later, stop}, {stop, *unused}]
    with Session(path, threads) as s:
        s.feed(list(TOKENS))
        s.executor.cpu._decode = replace(s.executor.cpu._decode, capacity=3)
        stop_logits = []
        for stops in stop_sets:
            assert s.executor.greedy_steps(first, s.pos, 40, stops) == until_stop, stops
            stop_logits.append(s.executor.logits().copy())
        with pytest.raises(ExecutorError, match="KV cache holds"):  # never past the cache's last row
            s.executor.greedy_steps(first, s.ctx - 2, 3)
    monkeypatch.setattr(CpuExecutor, "loops", property(lambda self: False))
    with Session(path, threads) as s:
        s.feed(list(TOKENS))
        assert s.executor.greedy_steps(first, s.pos, 40) == looped
        np.testing.assert_array_equal(s.executor.logits(), looped_logits)
        for stops, logits in zip(stop_sets, stop_logits, strict=True):
            assert s.executor.greedy_steps(first, s.pos, 40, stops) == until_stop, stops
            if len(stops) <= STOP_SLOTS:
                np.testing.assert_array_equal(s.executor.logits(), logits)
    # generate() decodes greedy text in growing batches of the loop and stops after a stop token
    # (the 13th token, or one of two): the step-at-a-time tokens, history and positions.
    monkeypatch.undo()
    eos = looped[12]
    expected = [first, *looped[: looped.index(eos) + 1]]
    for stops in ({eos}, {eos, later}):
        with Session(path, threads) as s:
            s.text.stop_ids = frozenset(stops)
            assert list(s.generate(list(TOKENS), 40)) == expected
            assert s.history == TOKENS + expected and s.pos == len(TOKENS) + len(expected) - 1


def test_bench_profile_times_every_call_of_the_decode_step(tmp_path, capsys):
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=96))
    path, pib = compiled(model, tmp_path, "profiled", dense=True)
    argv = ["bench", str(path), "--prompt-tokens", "4", "-n", "8", "--repeat", "2", "--threads", "2", "--profile"]
    assert main([*argv, "--json"]) == 0
    bench = json.loads(capsys.readouterr().out)
    profile = bench["profile"]
    # Each run is set against the bandwidth probed right after it (the host's rate moves between
    # runs); the share is the median of the runs' ratios (of two: their mean).
    runs = bench["runs"]
    assert len(runs) == 2
    ratios = [bench["weight_bytes_per_token"] * r["decode_tokens_per_s"] / r["read_bandwidth_bytes_per_s"] for r in runs]
    assert bench["bandwidth_share"] == pytest.approx(sum(ratios) / 2, rel=1e-12)
    assert bench["read_bandwidth_bytes_per_s"] == pytest.approx(sum(r["read_bandwidth_bytes_per_s"] for r in runs) / 2)
    (stage,) = PibFile(path).json("cpu/manifest")["stages"]
    calls = profile["calls"]
    assert [[c["kernel"], c["op"]] for c in calls] == stage["profile"]["calls"]
    ops = {op.result: op for op in pib.module.function().ops}
    assert {c["op"] for c in calls} <= set(ops) | {"greedy"} and calls[-1]["op"] == "greedy"
    assert {c["op"] for c in calls if isinstance(ops.get(c["op"]), O.Linear)} == {
        name for name, op in ops.items() if isinstance(op, O.Linear)}
    assert profile["steps"] == 2 * 8  # n decode steps a run (the prompt's are not profiled)
    assert all(c["us"] > 0 and c["wait_us"] >= 0 for c in calls)
    assert calls[-1]["wait_us"] == 0  # nothing waits after the last call
    # Each thread's time in a step is part of the decode's wall time per token (the clock is
    # calibrated against time.perf_counter: a wrong rate, or counting steps outside the timed
    # decode, would break this).
    assert 0 < profile["step_us"] <= profile["wall_us_per_token"]
    assert 1e8 < profile["clock_hz"] < 1e11
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "CPU decode step, profiled (16 steps" in text and "the step" in text and "costliest calls: %" in text


def test_the_cpu_manifest_is_typed_records_that_round_trip(tmp_path):
    # cpu/manifest as picc compile wrote it is exactly what runtime.cpu_manifest serializes, and
    # a manifest missing a field is refused naming the section and the field, not read with a default.
    model = with_tokenizer(tiny_llama("swiglu", n_layers=1, hidden=64, n_ff=96))
    path, _ = compiled(model, tmp_path, "manifest", dense=True)
    with PibFile(path) as f:
        data = f.json("cpu/manifest")
    manifest = CpuManifest.from_json(data)
    assert manifest.to_json() == data and json.dumps(manifest.to_json()) == json.dumps(data)
    assert manifest.decode is not None and manifest.logits_chunk.logits is not None
    assert all(st.profile is not None for st in manifest.stages)
    for key in ("prefill", "decode", "greedy"):
        with pytest.raises(ContractError, match=f"cpu/manifest: missing '{key}'"):
            CpuManifest.from_json({k: v for k, v in data.items() if k != key})
    del data["stages"][0]["profile"]
    with pytest.raises(ContractError, match="cpu/manifest: missing 'profile'"):
        CpuManifest.from_json(data)
    with pytest.raises(ContractError, match="a weight buffer needs 'name'"):
        CpuBuffer("weight")
    with pytest.raises(ContractError, match="a kv buffer needs 'planes'"):  # a server copies rows by them
        CpuBuffer("kv", name="kv.0", nbytes=4096)
    assert [b.planes for b in manifest.buffers if b.kind == "kv"] == [4]  # two KV heads: their k rows, their v rows
    with pytest.raises(ContractError, match="a kv buffer needs 'k_nbytes'"):  # where its v rows start
        CpuBuffer("kv", name="kv.0", nbytes=4096, planes=4)
    assert [2 * b.k_nbytes == b.nbytes for b in manifest.buffers if b.kind == "kv"] == [True]  # v rows as wide as k's


def test_threads_default_to_the_cores_the_process_may_use(tmp_path, monkeypatch):
    import os

    from picc.codegen_cpu.buffers import MAX_THREADS

    model = with_tokenizer(tiny_llama("swiglu", n_layers=1, hidden=64, n_ff=96))
    path, _ = compiled(model, tmp_path, "cores", dense=True)
    with Session(path, threads=None) as s:
        assert s.executor.cpu.team.nthreads == min(len(os.sched_getaffinity(0)), MAX_THREADS)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with Session(path, threads=None) as s:
        assert s.executor.cpu.team.nthreads == 1


def test_runtime_errors_are_one_line(tmp_path, capsys):
    model = with_tokenizer(tiny_llama("swiglu", n_layers=1, hidden=64, n_ff=96))
    path, _ = compiled(model, tmp_path, "short", dense=True, ctx=8)
    cases = [
        (["run", str(path), "-p", " ".join(["the"] * 20)], "the prompt needs 21 positions but the context holds 8"),
        (["run", str(path), "-p", "the", "--threads", "0"], "--threads 0: expected 1 to"),
        (["run", str(path), "-p", "the", "--top-p", "0"], "top-p must be in (0, 1]"),
        (["run", str(path), "-p", "the", "--frequency-penalty", "3"], "frequency penalty must be in [-2, 2]"),
        (["run", str(path), "-p", "the", "--logit-bias", "5"], "--logit-bias 5: expected TOKEN_ID=BIAS"),
        (["run", str(path), "-p", "the", "--logit-bias", "100000=1"], "names token 100000, outside the vocabulary"),
        (["run", str(path), "-p", "the", "--ctx", "9"], "--ctx 9: expected 1 to 8, the positions this model was compiled for"),
        (["run", str(tmp_path / "missing.pib"), "-p", "x"], "no such file"),
        (["run", str(path), "-p", "the", "--chat"], "the model has no chat template (its tokenizer carries none)"),
        (["run", str(path), "-p", "the", "--system", "x"], "--system: only with --chat"),
        (["run", str(path), "-p", "the", "--chat-template-kwargs", "{}"], "--chat-template-kwargs: only with --chat"),
        (["run", str(path), "-p", "the", "--chat", "--chat-template-kwargs", "{"], "--chat-template-kwargs: Expecting"),
        (["run", str(path), "-p", "the", "--chat", "--chat-template-kwargs", '{"messages": 1}'],
         "--chat-template-kwargs: chat template variable 'messages' is set by picc, not by the request"),
        (["bench", str(path), "--prompt-tokens", "6", "-n", "6"], "exceed the 8 positions"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_sampling_options_do_what_they_say():
    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.8])
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingOptions(), rng) == 1
    draws = {sample(logits, SamplingOptions(temperature=1.0, top_k=2), rng) for _ in range(300)}
    assert draws == {1, 2}
    # p(1), p(2) ~ 0.35, 0.32 of the whole: top-p 0.5 keeps exactly those two.
    draws = {sample(logits, SamplingOptions(temperature=1.0, top_p=0.5), rng) for _ in range(300)}
    assert draws == {1, 2}
    # min-p keeps the tokens at least min_p times as likely as the most likely one: the set
    # transformers' MinPLogitsWarper keeps (p ~ 0.36, 0.33, 0.30, 0.02, 0.007 for ids 1, 2, 4, 0, 3).
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper

    for min_p, kept in ((0.85, {1, 2}), (0.5, {1, 2, 4})):
        draws = {sample(logits, SamplingOptions(temperature=1.0, min_p=min_p), rng) for _ in range(400)}
        warped = MinPLogitsWarper(min_p)(None, torch.tensor(logits[None], dtype=torch.float32))[0]
        assert draws == kept == set(np.flatnonzero(np.isfinite(warped.numpy())).tolist())
    with pytest.raises(ValueError, match="min-p must be in"):
        SamplingOptions(min_p=1.5).check()
    # A strong repetition penalty moves greedy off a seen token.
    assert sample(logits, SamplingOptions(repetition_penalty=10.0), rng, seen=[1]) == 2
    a = [sample(logits, SamplingOptions(temperature=1.0), np.random.default_rng(7)) for _ in range(20)]
    b = [sample(logits, SamplingOptions(temperature=1.0), np.random.default_rng(7)) for _ in range(20)]
    assert a == b
    # NaN passed every range check (each comparison false) and ended in numpy's "probabilities
    # contain NaN"; infinities are not values either.
    for bad in (SamplingOptions(temperature=float("nan")), SamplingOptions(temperature=float("inf")),
                SamplingOptions(temperature=1.0, repetition_penalty=float("nan")),
                SamplingOptions(repetition_penalty=float("inf"))):
        with pytest.raises(ValueError, match="finite"):
            bad.check()


def test_presence_and_frequency_penalties_count_the_generated_tokens():
    # OpenAI's definition: a token generated c times loses c * frequency + (c > 0) * presence.
    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.8])
    rng = np.random.default_rng(0)
    twice = [1, 4, 1]
    assert sample(logits, SamplingOptions(frequency_penalty=0.04), rng, generated=twice) == 1  # 3 - 0.08 > 2.9
    assert sample(logits, SamplingOptions(frequency_penalty=0.06), rng, generated=twice) == 2  # 3 - 0.12 < 2.9
    assert sample(logits, SamplingOptions(presence_penalty=0.09), rng, generated=twice) == 1  # once: 2.91
    assert sample(logits, SamplingOptions(presence_penalty=0.11), rng, generated=twice) == 2
    # They count what was generated, not the prompt (which the repetition penalty sees).
    assert sample(logits, SamplingOptions(presence_penalty=2.0), rng, seen=[1], generated=[4]) == 1
    # Negative values favour what was generated; a penalty makes the choice more than an argmax.
    assert sample(logits, SamplingOptions(frequency_penalty=-0.3), rng, generated=[4]) == 4  # 2.8 + 0.3
    assert not SamplingOptions(presence_penalty=0.5).greedy and not SamplingOptions(frequency_penalty=-1).greedy
    # OpenAI's logit_bias: added to the given tokens' logits, first.
    assert sample(logits, SamplingOptions(logit_bias=((1, -100.0),)), rng) == 2
    assert sample(logits, SamplingOptions(logit_bias=((3, 4.5),)), rng) == 3  # -1 + 4.5 > 3
    assert sample(logits, SamplingOptions(logit_bias=((3, 3.9),)), rng) == 1
    assert not SamplingOptions(logit_bias=((3, 1.0),)).greedy
    with pytest.raises(ValueError, match="logit bias"):
        SamplingOptions(logit_bias=((3, 101.0),)).check()
    for bad in (SamplingOptions(presence_penalty=2.5), SamplingOptions(frequency_penalty=float("nan"))):
        with pytest.raises(ValueError, match=r"penalty must be in \[-2, 2\]"):
            bad.check()


def test_token_logprob_is_the_log_softmax_and_its_top_tokens():
    from scipy.special import log_softmax

    rng = np.random.default_rng(3)
    logits = (rng.normal(size=1000) * 4).astype(np.float32)
    logits[[10, 20]] = logits.max() + 1  # a tie at the top: the lower id first
    expected = log_softmax(logits.astype(np.float64))
    record = token_logprob(logits, 7, top=4)
    assert record.token == 7 and record.logprob == pytest.approx(expected[7], abs=1e-12)
    order = np.argsort(-expected, kind="stable")[:4]
    assert [i for i, _ in record.top] == [10, 20, *order[2:4]]
    assert [lp for _, lp in record.top] == pytest.approx(expected[[10, 20, *order[2:4]]], abs=1e-12)
    assert token_logprob(logits, 7).top == () and len(token_logprob(logits[:3], 0, top=9).top) == 3


def test_run_without_a_prompt_reads_prompts_from_stdin(tmp_path, capsys, monkeypatch):
    import io

    model = with_tokenizer(tiny_llama("swiglu", n_layers=1, hidden=64, n_ff=96))
    path, _ = compiled(model, tmp_path, "chat", dense=True)
    # A prompt too long for the context is that prompt's error, not the session's end.
    monkeypatch.setattr("sys.stdin", io.StringIO("the company\n\n" + "the " * 600 + "\nthe market\n"))
    assert main(["run", str(path), "-n", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("decode:") == 2  # two prompts answered, the blank line skipped
    assert captured.err.count("picc: error: the prompt needs 601 positions but the context holds 512") == 1
    # 3 prompt positions (BOS and two words) of 8 leave 5 steps: 6 tokens, the last never fed back.
    assert main(["run", str(path), "-p", "the company", "--ctx", "8", "-n", "20"]) == 0
    assert "note: the context is full (8 positions) after 6 of -n 20 tokens" in capsys.readouterr().err
    # Each prompt starts a fresh conversation: the same prompt alone gives the same answer.
    first = captured.out.splitlines()[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("the company\n"))
    assert main(["run", str(path), "-n", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == first


def test_run_chat_passes_its_template_variables(tmp_path, capsys):
    # --chat-template-kwargs: the chat template's extra variables, as a request's
    # chat_template_kwargs (the served model's template ends "... the company said" with ``said``).
    from conftest import served_model

    path = served_model(tmp_path / "chat.pib", 256)
    fed = []
    for extra in ([], ["--chat-template-kwargs", '{"said": true}']):
        assert main(["run", str(path), "--chat", "-p", "the market", "-n", "2", *extra]) == 0
        fed += [int(n) for n in re.findall(r"prompt: (\d+) tokens", capsys.readouterr().err)]
    with Session(path, 2) as s:
        said = s.text.encode_chat("user the market the company said")
    assert fed == [len(said) - 1, len(said)]


def test_run_chat_continues_the_conversation_and_feeds_only_what_is_new(tmp_path, capsys, monkeypatch):
    # picc run --chat: each line is a user's message; the turn's prompt is the whole conversation
    # in the model's chat template (the earlier replies as assistant messages), and only where it
    # differs from the tokens in the KV cache is it fed. The replies are those of a fresh session
    # on the whole rendering (the served model's chunk programs compute the steps' bits).
    import io

    from conftest import served_model

    from runtime.chat import render_chat

    path = served_model(tmp_path / "chat.pib", 256)
    lines = ["the market", "said the company"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["run", str(path), "--chat", "--system", "be brief", "-n", "6"]) == 0
    captured = capsys.readouterr()
    replies = captured.out.splitlines()
    fed = [int(n) for n in re.findall(r"prompt: (\d+) tokens", captured.err)]
    messages, expected, whole = [{"role": "system", "content": "be brief"}], [], []
    with Session(path, 2) as s:
        for line in lines:
            messages.append({"role": "user", "content": line})
            text = render_chat(s.text.chat_template, messages, bos_token=s.text.bos_token, eos_token=s.text.eos_token,
                               add_generation_prompt=True)
            ids = s.text.encode_chat(text)
            s.reset()
            reply = s.text.decode([t for t in s.generate(ids, 6) if t not in s.text.stop_ids])
            messages.append({"role": "assistant", "content": reply})
            expected.append(reply)
            whole.append(len(ids))
    assert replies == expected and len(fed) == 2
    assert fed[0] == whole[0] and fed[1] < whole[1] - 3  # the system and first user messages' tokens kept
    # A message too long for the context is that turn's error; the conversation goes on without
    # it, and /reset starts another (with the same system message): the first reply again.
    long = " ".join(["the"] * 300)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{lines[0]}\n{long}\n{lines[1]}\n/reset\n{lines[0]}\n"))
    assert main(["run", str(path), "--chat", "--system", "be brief", "-n", "6", "--ctx", "64"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [*expected, expected[0]]
    assert "needs" in captured.err and "/reset starts a new conversation" in captured.err
    # -p with --chat is one turn: the reply alone, not the prompt before it.
    assert main(["run", str(path), "--chat", "--system", "be brief", "-p", "the market", "-n", "6"]) == 0
    assert capsys.readouterr().out == expected[0] + "\n"
