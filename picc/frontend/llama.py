"""The LLaMA-family decoder (LLaMA, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite, Gemma 2 and 3, OLMo 2,
gpt-oss, and GGUF files) as picc IR.

Frontends translate their checkpoint into a ``LlamaSpec`` and a weight store whose tensors use
picc's weight names (``l3.attn.q``, ``l3.ffn.up``, ...); ``build_llama`` emits the IR.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from picc.ir import ops as O
from picc.ir.builder import FunctionBuilder
from picc.ir.core import Attr
from picc.ir.module import Module, WeightDecl
from picc.ir.types import DType, TensorType
from picc.ir.weights import Tensor, WeightStore


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary settings as the ``rope`` op takes them."""

    theta: float = 10000.0
    style: str = "llama"
    rotary_dim: int | None = None
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()  # longrope (the short ones) and yarn: a factor per rotary pair
    long_factors: tuple[float, ...] = ()  # longrope: those of contexts past original_max_position
    attention_factor: float = 1.0  # longrope and yarn: the cosines' and sines' factor

    def op_attrs(self) -> dict[str, object]:
        """The ``rope`` op's attributes for these settings."""
        return {f: getattr(self, f) for f in ("style", "theta", "rotary_dim", "scaling", "factor", "low_freq_factor",
                                              "high_freq_factor", "original_max_position", "freq_factors",
                                              "long_factors", "attention_factor")}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture of experts in place of a layer's FFN (the ``moe`` op's attributes)."""

    n_experts: int
    top_k: int
    n_ff: int  # an expert's neurons
    norm_topk: bool
    layers: tuple[bool, ...] = ()  # per layer, whether its FFN is the experts (Qwen3-MoE's mlp_only_layers); empty: all
    swiglu_limit: float | None = None  # gpt-oss: its clamped SwiGLU (picc.ir.ops.MoE)
    swiglu_alpha: float = 1.0
    n_shared: int = 0  # Qwen2-MoE: its shared expert, in n_ff-wide pieces stacked after the routed experts
    shared_gated: bool = False  # ... weighted by the sigmoid of the router's last row
    choice_bias: bool = False  # ERNIE 4.5: the experts ranked by probability plus a bias (weights l{i}.moe.choice_bias)
    scoring: str = "softmax"  # DeepSeek V3, GLM-4.5: "sigmoid" (picc.ir.ops.MoE)
    n_group: int = 1  # DeepSeek: the experts in n_group groups, only the topk_group best groups' chosen
    topk_group: int = 1
    group_score: str = "max"  # ... a group scored by its best member's score ("max") or its best two's ("top2")
    routed_scale: float = 1.0  # DeepSeek, GLM-4.5: the routed experts' weights times routed_scaling_factor

    def op_attrs(self) -> dict[str, object]:
        """The ``moe`` op's routing attributes for these settings."""
        return {f: getattr(self, f) for f in ("n_experts", "top_k", "norm_topk", "swiglu_limit", "swiglu_alpha",
                                              "n_shared", "shared_gated", "scoring", "n_group", "topk_group",
                                              "group_score", "routed_scale")}


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek V2/V3's multi-head latent attention, run decompressed: each head's query and key
    are ``rope_dim`` rotated features (the key's shared by every head) and ``nope_dim`` others,
    its value ``v_dim`` features; keys and values come from a ``kv_rank``-wide latent (normalised),
    queries from x directly or (``q_rank``) through a normalised latent of their own."""

    q_rank: int | None
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def query_rows(self, q: Tensor, n_heads: int) -> Tensor:
        """A checkpoint's query rows (``q_proj``, ``q_b_proj``: each head's ``nope`` then ``rope``)
        as :func:`_mla_qkv` reads them: each head's rotated ones first."""
        head = np.roll(np.arange(self.qk_dim), self.rope_dim)
        return q.take_rows((np.arange(n_heads)[:, None] * self.qk_dim + head[None, :]).reshape(-1))

    def latent_parts(self, kv_a: Tensor) -> tuple[Tensor, Tensor]:
        """``kv_a_proj_with_mqa``'s rows (or its bias) as the latent's and the shared rotated key's."""
        return (kv_a.take_rows(np.arange(self.kv_rank)),
                kv_a.take_rows(np.arange(self.kv_rank, self.kv_rank + self.rope_dim)))

    def kv_b_parts(self, kv_b: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
        """``kv_b_proj``'s rows (each head's ``nope`` key rows, then its ``v_dim`` value rows) as the
        k_nope and v projections of the latent."""
        heads = np.arange(n_heads)[:, None] * (self.nope_dim + self.v_dim)
        return (kv_b.take_rows((heads + np.arange(self.nope_dim)).reshape(-1)),
                kv_b.take_rows((heads + self.nope_dim + np.arange(self.v_dim)).reshape(-1)))


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """Everything that shapes a LLaMA-style decoder's computation."""

    name: str
    arch: str
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    eps: float
    ffn_form: str
    rope: RopeSpec
    tied: bool
    window: tuple[int | None, ...] = ()  # per layer; empty means no sliding window anywhere
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalised (weights [head_dim]) before the rope
    qk_norm_whole: bool = False  # OLMo 2: q's and k's norms over the whole projection (weights [heads * head_dim])
    pre_norm: bool = True  # the attention and the FFN read the normalised stream; OLMo 2: the stream itself
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it rotates q and k (SmolLM3's NoPE layers); empty: all
    layer_ropes: tuple[RopeSpec, ...] = ()  # per layer, its own rotation (Gemma 3's local and global); empty: rope
    embed_scale: float = 1.0  # the embedding's rows times it (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # the attention's scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim's
    sandwich: bool = False  # Gemma: the attention's and the FFN's outputs RMS-normalised before their residual adds
    attn_softcap: float | None = None  # Gemma 2: the attention's scores soft-capped, cap * tanh(s / cap)
    logit_softcap: float | None = None  # Gemma 2: the final logits soft-capped alike
    attn_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax (weights l{i}.attn.sinks)
    moe: MoeSpec | None = None  # Mixtral, Qwen3-MoE, OLMoE: experts instead of the FFN
    mla: MlaSpec | None = None  # DeepSeek V2/V3: latent attention (head_dim: its q and k heads', rope_dim + nope_dim)
    bos_id: int | None = None
    eos_id: int | None = None
    max_position: int | None = None


def layer_weight_names(i: int) -> dict[str, str]:
    """picc's names for the weights of layer ``i`` (shared by every decoder family)."""
    p = f"l{i}"
    return {
        "attn_norm": f"{p}.attn_norm", "ffn_norm": f"{p}.ffn_norm",
        "attn_norm_bias": f"{p}.attn_norm_bias", "ffn_norm_bias": f"{p}.ffn_norm_bias",
        "q": f"{p}.attn.q", "k": f"{p}.attn.k", "v": f"{p}.attn.v", "o": f"{p}.attn.o",
        "q_bias": f"{p}.attn.q_bias", "k_bias": f"{p}.attn.k_bias", "v_bias": f"{p}.attn.v_bias",
        "o_bias": f"{p}.attn.o_bias", "q_norm": f"{p}.attn.q_norm", "k_norm": f"{p}.attn.k_norm",
        "sinks": f"{p}.attn.sinks",
        "post_attn_norm": f"{p}.post_attn_norm", "post_ffn_norm": f"{p}.post_ffn_norm",
        "up": f"{p}.ffn.up", "gate": f"{p}.ffn.gate", "down": f"{p}.ffn.down",
        "up_bias": f"{p}.ffn.up_bias", "gate_bias": f"{p}.ffn.gate_bias",
        "down_bias": f"{p}.ffn.down_bias",
        "router": f"{p}.moe.router", "experts_up": f"{p}.moe.up", "experts_gate": f"{p}.moe.gate",
        "experts_down": f"{p}.moe.down", "router_bias": f"{p}.moe.router_bias", "experts_up_bias": f"{p}.moe.up_bias",
        "experts_gate_bias": f"{p}.moe.gate_bias", "experts_down_bias": f"{p}.moe.down_bias",
        "router_choice_bias": f"{p}.moe.choice_bias",
        "q_a": f"{p}.attn.q_a", "q_a_bias": f"{p}.attn.q_a_bias", "q_a_norm": f"{p}.attn.q_a_norm",
        "kv_a": f"{p}.attn.kv_a", "kv_a_bias": f"{p}.attn.kv_a_bias", "kv_a_norm": f"{p}.attn.kv_a_norm",
        "k_pe": f"{p}.attn.k_pe", "k_pe_bias": f"{p}.attn.k_pe_bias",
    }


class ModelFacts(Protocol):
    """What a decoder spec tells the module's attributes (LlamaSpec, OptSpec, FalconSpec)."""

    @property
    def arch(self) -> str: ...
    @property
    def vocab(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def max_position(self) -> int | None: ...


def module_attrs(spec: ModelFacts) -> tuple[tuple[str, Attr], ...]:
    attrs: list[tuple[str, Attr]] = [
        ("arch", spec.arch), ("vocab", spec.vocab), ("hidden", spec.hidden),
        ("n_layers", spec.n_layers), ("n_ff", spec.n_ff),
    ]
    if spec.bos_id is not None:
        attrs.append(("bos_id", spec.bos_id))
    if spec.eos_id is not None:
        attrs.append(("eos_id", spec.eos_id))
    if spec.max_position is not None:
        attrs.append(("max_position", spec.max_position))
    return tuple(attrs)


def declare_weights(store: WeightStore) -> tuple[WeightDecl, ...]:
    return tuple(WeightDecl(name, store[name].type) for name in store)


@dataclass(frozen=True)
class DecoderStart:
    """What every decoder graph builder starts from: the builder and its two arguments."""

    decls: tuple[WeightDecl, ...]
    b: FunctionBuilder
    tokens: str
    pos: str
    store: WeightStore

    def maybe(self, name: str) -> str | None:
        """``name`` if the checkpoint has that (optional) weight, else None."""
        return name if name in self.store else None


def start_decoder(store: WeightStore) -> DecoderStart:
    """A ``forward(%tokens: i32[seq], %pos: i32[seq])`` builder over every weight in ``store``."""
    decls = declare_weights(store)
    b = FunctionBuilder("forward", {d.name: d.type for d in decls})
    tokens = b.arg("tokens", TensorType(DType.I32, ("seq",)))
    pos = b.arg("pos", TensorType(DType.I32, ("seq",)))
    return DecoderStart(decls, b, tokens, pos, store)


def build_llama(spec: LlamaSpec, store: WeightStore) -> Module:
    """The IR of a LLaMA-style decoder whose weights are in ``store`` under picc's names."""
    start = start_decoder(store)
    decls, b, tokens, pos, maybe = start.decls, start.b, start.tokens, start.pos, start.maybe
    x = b.op(O.Embed, "embed", tokens=tokens, table="token_embd", scale=spec.embed_scale)
    scale = spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(spec.head_dim)
    for i in range(spec.n_layers):
        b.in_block(i)
        n = layer_weight_names(i)
        p = f"l{i}"
        rope_attrs = (spec.layer_ropes[i] if spec.layer_ropes else spec.rope).op_attrs()
        h = b.op(O.RMSNorm, f"{p}.attn_norm", x=x, weight=n["attn_norm"], eps=spec.eps) if spec.pre_norm else x
        if spec.mla is not None:
            q, k, v = _mla_qkv(b, spec, spec.mla, n, p, h, pos, rope_attrs, maybe)
        else:
            q = b.op(O.Linear, f"{p}.attn.q", x=h, weight=n["q"], bias=maybe(n["q_bias"]))
            k = b.op(O.Linear, f"{p}.attn.k", x=h, weight=n["k"], bias=maybe(n["k_bias"]))
            v = b.op(O.Linear, f"{p}.attn.v", x=h, weight=n["v"], bias=maybe(n["v_bias"]))
        if spec.qk_norm:
            group = None if spec.qk_norm_whole else spec.head_dim
            q = b.op(O.RMSNorm, f"{p}.attn.q_norm", x=q, weight=n["q_norm"], eps=spec.eps, group=group)
            k = b.op(O.RMSNorm, f"{p}.attn.k_norm", x=k, weight=n["k_norm"], eps=spec.eps, group=group)
        if spec.mla is None and (not spec.rope_layers or spec.rope_layers[i]):
            q = b.op(O.Rope, f"{p}.attn.q_rope", x=q, pos=pos, n_heads=spec.n_heads,
                     head_dim=spec.head_dim, **rope_attrs)
            k = b.op(O.Rope, f"{p}.attn.k_rope", x=k, pos=pos, n_heads=spec.n_kv_heads,
                     head_dim=spec.head_dim, **rope_attrs)
        window = spec.window[i] if spec.window else None
        ctx = b.op(O.Attention, f"{p}.attn.ctx", q=q, k=k, v=v, pos=pos, n_heads=spec.n_heads,
                   n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                   v_head_dim=spec.mla.v_dim if spec.mla is not None else None,
                   scale=scale, cache=f"l{i}", window=window, softcap=spec.attn_softcap,
                   sinks=n["sinks"] if spec.attn_sinks else None)
        o = b.op(O.Linear, f"{p}.attn.out", x=ctx, weight=n["o"], bias=maybe(n["o_bias"]))
        if spec.sandwich:
            o = b.op(O.RMSNorm, f"{p}.post_attn_norm", x=o, weight=n["post_attn_norm"], eps=spec.eps)
        x = b.op(O.Add, f"{p}.attn.resid", a=x, b=o)
        h = b.op(O.RMSNorm, f"{p}.ffn_norm", x=x, weight=n["ffn_norm"], eps=spec.eps) if spec.pre_norm else x
        gated = O.FFN_FORMS[spec.ffn_form].gated
        if spec.moe is not None and (not spec.moe.layers or spec.moe.layers[i]):
            f = b.op(O.MoE, f"{p}.moe.out", x=h, router=n["router"], up=n["experts_up"],
                     gate=n["experts_gate"] if gated else None, down=n["experts_down"], form=spec.ffn_form,
                     router_bias=maybe(n["router_bias"]), up_bias=maybe(n["experts_up_bias"]),
                     gate_bias=maybe(n["experts_gate_bias"]), down_bias=maybe(n["experts_down_bias"]),
                     choice_bias=maybe(n["router_choice_bias"]), **spec.moe.op_attrs())
        else:
            f = b.op(O.FFN, f"{p}.ffn.out", x=h, up=n["up"], gate=n["gate"] if gated else None,
                     down=n["down"], up_bias=maybe(n["up_bias"]),
                     gate_bias=maybe(n["gate_bias"]) if gated else None,
                     down_bias=maybe(n["down_bias"]), form=spec.ffn_form)
        if spec.sandwich:
            f = b.op(O.RMSNorm, f"{p}.post_ffn_norm", x=f, weight=n["post_ffn_norm"], eps=spec.eps)
        x = b.op(O.Add, f"{p}.out", a=x, b=f)
    b.in_block(None)
    x = b.op(O.RMSNorm, "final_norm", x=x, weight="output_norm", eps=spec.eps)
    head = "token_embd" if spec.tied else "output"
    logits = b.op(O.Linear, "logits", x=x, weight=head)
    if spec.logit_softcap is not None:
        logits = b.op(O.Softcap, "logits_capped", x=logits, cap=spec.logit_softcap)
    module = Module(spec.name, module_attrs(spec), decls, (b.finish(logits),))
    return module.with_used_weights_only()


def _mla_qkv(b: FunctionBuilder, spec: LlamaSpec, mla: MlaSpec, n: dict[str, str], p: str, h: str, pos: str,
             rope_attrs: dict[str, object], maybe: Callable[[str], str | None]) -> tuple[str, str, str]:
    """A latent attention's q, k and v as multi-head attention reads them (``MlaSpec``).

    The frontend stores each head's query rows rotated part first, ``[pe | nope]``, so that the
    rope's ``rotary_dim`` (the leading features) is the rotated part; the key is built alike, the
    one rotated key that every head shares (``k_pe``) joined to each head's ``k_nope``. Scores are
    unchanged: q . k sums over the same pairs of features in another order."""
    if mla.q_rank is None:
        q = b.op(O.Linear, f"{p}.attn.q", x=h, weight=n["q"])
    else:
        q = b.op(O.Linear, f"{p}.attn.q_a", x=h, weight=n["q_a"], bias=maybe(n["q_a_bias"]))
        q = b.op(O.RMSNorm, f"{p}.attn.q_a_norm", x=q, weight=n["q_a_norm"], eps=spec.eps)
        q = b.op(O.Linear, f"{p}.attn.q", x=q, weight=n["q"])
    latent = b.op(O.Linear, f"{p}.attn.kv_a", x=h, weight=n["kv_a"], bias=maybe(n["kv_a_bias"]))
    latent = b.op(O.RMSNorm, f"{p}.attn.kv_a_norm", x=latent, weight=n["kv_a_norm"], eps=spec.eps)
    k_nope = b.op(O.Linear, f"{p}.attn.k", x=latent, weight=n["k"])
    v = b.op(O.Linear, f"{p}.attn.v", x=latent, weight=n["v"])
    k_pe = b.op(O.Linear, f"{p}.attn.k_pe", x=h, weight=n["k_pe"], bias=maybe(n["k_pe_bias"]))
    rope = {**rope_attrs, "rotary_dim": mla.rope_dim}
    q = b.op(O.Rope, f"{p}.attn.q_rope", x=q, pos=pos, n_heads=spec.n_heads, head_dim=mla.qk_dim, **rope)
    k_pe = b.op(O.Rope, f"{p}.attn.k_rope", x=k_pe, pos=pos, n_heads=1, head_dim=mla.rope_dim, **rope)
    k = b.op(O.ConcatHeads, f"{p}.attn.k_heads", a=k_pe, b=k_nope, n_heads=spec.n_heads, a_dim=mla.rope_dim,
             b_dim=mla.nope_dim)
    return q, k, v


def longrope_notes(module: Module) -> tuple[str, ...]:
    """What ``picc compile`` says of a model with longrope scaling: which factors picc uses."""
    rope = next((op for op in module.function().ops if isinstance(op, O.Rope) and op.scaling == "longrope"), None)
    if rope is None:
        return ()
    return (f"longrope: a --ctx up to {rope.original_max_position} rotates with the short factors, a longer one "
            "with the long factors at every position, as llama.cpp chooses (transformers switches a sequence to "
            f"them once it passes {rope.original_max_position} tokens)",)


def longrope_for_context(module: Module, ctx: int) -> Module:
    """``module`` for a KV cache of ``ctx`` positions: its longrope ropes with their long factors
    where ``ctx`` is past the original length (llama.cpp's choice, for every position: a cache's
    rows cannot be rotated again as a sequence grows, which is what transformers does)."""
    func = module.function()
    ops = tuple(replace(op, freq_factors=op.long_factors)
                if isinstance(op, O.Rope) and op.long_factors and ctx > op.original_max_position else op
                for op in func.ops)
    if ops == func.ops:
        return module
    return replace(module, functions=tuple(replace(f, ops=ops) if f is func else f for f in module.functions))
