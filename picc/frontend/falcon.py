"""The Falcon decoder as picc IR.

Falcon blocks use LayerNorm (with bias) and either compute attention and the MLP in parallel from
the same input, ``x + (mlp(ln_mlp(x)) + attn(ln_attn(x)))`` (Falcon-7B/40B/180B, Falcon2; the
two norms may be one), or one after the other (Falcon-RW). Positions come from RoPE or, in
Falcon-RW, from ALiBi biases. Checkpoints fuse q, k and v into one matrix; the frontend splits it
(``split_fused_qkv``) so that here, as in every picc model, q, k and v are separate linears.

Weights use picc's names: ``token_embd``, ``l{i}.attn_norm`` and ``l{i}.ffn_norm`` (+ ``_bias``;
the FFN norm is absent when one norm feeds both branches), ``l{i}.attn.{q,k,v,o}`` (+ ``_bias``),
``l{i}.ffn.{up,down}`` (+ ``_bias``), ``output_norm`` (+ ``_bias``), ``output``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from picc.frontend.llama import RopeSpec, layer_weight_names, module_attrs, start_decoder
from picc.ir import ops as O
from picc.ir.module import Module
from picc.ir.weights import WeightStore


@dataclass(frozen=True, slots=True)
class FalconSpec:
    """Everything that shapes a Falcon decoder's computation."""

    name: str
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_ff: int
    eps: float
    ffn_form: str
    parallel: bool  # attention and MLP side by side (else sequential, with a second norm)
    rope: RopeSpec | None  # None: ALiBi
    tied: bool
    arch: str = "falcon"
    bos_id: int | None = None
    eos_id: int | None = None
    max_position: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def fused_qkv_rows(n_groups: int, q_per_group: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """Row indices of q, k and v in a fused ``query_key_value`` weight.

    All three Falcon layouts are one layout: ``n_groups`` groups of ``q_per_group`` query heads
    followed by that group's key head and value head, each ``head_dim`` rows. The new decoder
    architecture has ``(num_kv_heads, H / num_kv_heads)``; multi-query Falcon-7B is one group of
    all H heads, ``(1, H)``; the classic per-head interleaving is ``(H, 1)``. Query head
    ``g * q_per_group + t`` uses key/value head ``g``, which is the attention op's convention.
    """
    rows = np.arange(n_groups * (q_per_group + 2) * head_dim).reshape(n_groups, q_per_group + 2,
                                                                       head_dim)
    return (rows[:, :q_per_group].reshape(-1), rows[:, q_per_group].reshape(-1),
            rows[:, q_per_group + 1].reshape(-1))


def build_falcon(spec: FalconSpec, store: WeightStore) -> Module:
    """The IR of a Falcon decoder whose weights are in ``store`` under picc's names."""
    start = start_decoder(store)
    decls, b, tokens, pos, maybe = start.decls, start.b, start.tokens, start.pos, start.maybe

    def norm(result: str, x: str, weight: str) -> str:
        return b.op(O.LayerNorm, result, x=x, weight=weight, bias=maybe(f"{weight}_bias"),
                    eps=spec.eps)

    rope_attrs = spec.rope.op_attrs() if spec.rope is not None else {}
    hd = spec.head_dim
    x = b.op(O.Embed, "embed", tokens=tokens, table="token_embd")
    for i in range(spec.n_layers):
        b.in_block(i)
        n = layer_weight_names(i)
        pre = f"l{i}"
        h = norm(f"{pre}.attn_norm", x, n["attn_norm"])
        # A parallel block's MLP reads its own norm of x (Falcon-40B/180B) or the attention's
        # (Falcon-7B, Falcon2); a sequential block normalises after the attention residual.
        hm = h
        if spec.parallel and n["ffn_norm"] in store:
            hm = norm(f"{pre}.ffn_norm", x, n["ffn_norm"])
        q = b.op(O.Linear, f"{pre}.attn.q", x=h, weight=n["q"], bias=maybe(n["q_bias"]))
        k = b.op(O.Linear, f"{pre}.attn.k", x=h, weight=n["k"], bias=maybe(n["k_bias"]))
        v = b.op(O.Linear, f"{pre}.attn.v", x=h, weight=n["v"], bias=maybe(n["v_bias"]))
        if spec.rope is not None:
            q = b.op(O.Rope, f"{pre}.attn.q_rope", x=q, pos=pos, n_heads=spec.n_heads,
                     head_dim=hd, **rope_attrs)
            k = b.op(O.Rope, f"{pre}.attn.k_rope", x=k, pos=pos, n_heads=spec.n_kv_heads,
                     head_dim=hd, **rope_attrs)
        ctx = b.op(O.Attention, f"{pre}.attn.ctx", q=q, k=k, v=v, pos=pos, n_heads=spec.n_heads,
                   n_kv_heads=spec.n_kv_heads, head_dim=hd, scale=1.0 / math.sqrt(hd), cache=pre,
                   alibi="none" if spec.rope is not None else "falcon")
        a = b.op(O.Linear, f"{pre}.attn.out", x=ctx, weight=n["o"], bias=maybe(n["o_bias"]))
        if not spec.parallel:
            x = b.op(O.Add, f"{pre}.attn.resid", a=x, b=a)
            hm = norm(f"{pre}.ffn_norm", x, n["ffn_norm"])
        f = b.op(O.FFN, f"{pre}.ffn.out", x=hm, up=n["up"], down=n["down"],
                 up_bias=maybe(n["up_bias"]), down_bias=maybe(n["down_bias"]), form=spec.ffn_form)
        if spec.parallel:
            # transformers adds the branches first, then the residual: x + (mlp + attn).
            f = b.op(O.Add, f"{pre}.branches", a=f, b=a)
        x = b.op(O.Add, f"{pre}.out", a=x, b=f)
    b.in_block(None)
    x = norm("final_norm", x, "output_norm")
    logits = b.op(O.Linear, "logits", x=x, weight="token_embd" if spec.tied else "output")
    module = Module(spec.name, module_attrs(spec), decls, (b.finish(logits),))
    return module.with_used_weights_only()
