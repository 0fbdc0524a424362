"""The OPT decoder as picc IR.

OPT differs from LLaMA in its parts, not its shape: learned absolute positions (looked up at
``pos + 2``, fairseq's padding offset), LayerNorm with bias, either before each block (pre-LN,
most sizes) or after the residual add (post-LN, opt-350m), biased projections, an FFN of
``fc2(act(fc1(x)))``, and for opt-350m a projection between the embedding width and the hidden
width on the way in and out.

Weights use picc's names: ``token_embd``, ``pos_embd``, ``proj_in``, ``proj_out``,
``l{i}.attn_norm`` (+ ``_bias``), ``l{i}.attn.{q,k,v,o}`` (+ ``_bias``), ``l{i}.ffn_norm``,
``l{i}.ffn.{up,down}`` (+ ``_bias``), ``output_norm``, ``output``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from picc.frontend.llama import layer_weight_names, module_attrs, start_decoder
from picc.ir import ops as O
from picc.ir.module import Module
from picc.ir.weights import WeightStore

POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding.offset
UNIT_NORM = "norm_unit"  # all-ones scale for LayerNorms without parameters


@dataclass(frozen=True, slots=True)
class OptSpec:
    """Everything that shapes an OPT decoder's computation."""

    name: str
    vocab: int
    hidden: int
    embed_dim: int  # word_embed_proj_dim; != hidden means project_in / project_out exist
    n_layers: int
    n_heads: int
    n_ff: int
    ffn_form: str
    pre_norm: bool  # do_layer_norm_before
    final_norm: bool  # a decoder-level final LayerNorm (pre-LN only)
    tied: bool
    max_position: int
    eps: float = 1e-5  # nn.LayerNorm's default: OPT has no config key for it
    arch: str = "opt"
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def build_opt(spec: OptSpec, store: WeightStore) -> Module:
    """The IR of an OPT decoder whose weights are in ``store`` under picc's names.

    A LayerNorm whose weight is absent from the store (``layer_norm_elementwise_affine: false``)
    reads ``norm_unit``, an all-ones vector the caller adds: picc's layer_norm always scales.
    """
    start = start_decoder(store)
    decls, b, tokens, pos, maybe = start.decls, start.b, start.tokens, start.pos, start.maybe

    def norm(result: str, x: str, weight: str) -> str:
        return b.op(O.LayerNorm, result, x=x, weight=maybe(weight) or UNIT_NORM,
                    bias=maybe(f"{weight}_bias"), eps=spec.eps)

    x = b.op(O.Embed, "embed", tokens=tokens, table="token_embd")
    if spec.embed_dim != spec.hidden:
        x = b.op(O.Linear, "embed_proj", x=x, weight="proj_in")
    p = b.op(O.PosEmbed, "pos_embed", pos=pos, table="pos_embd", offset=POSITION_OFFSET)
    x = b.op(O.Add, "embed_sum", a=x, b=p)
    hd = spec.head_dim
    for i in range(spec.n_layers):
        b.in_block(i)
        n = layer_weight_names(i)
        pre = f"l{i}"
        h = norm(f"{pre}.attn_norm", x, n["attn_norm"]) if spec.pre_norm else x
        q = b.op(O.Linear, f"{pre}.attn.q", x=h, weight=n["q"], bias=maybe(n["q_bias"]))
        k = b.op(O.Linear, f"{pre}.attn.k", x=h, weight=n["k"], bias=maybe(n["k_bias"]))
        v = b.op(O.Linear, f"{pre}.attn.v", x=h, weight=n["v"], bias=maybe(n["v_bias"]))
        # OPT scales q by hd**-0.5 after its bias and then attends with scale 1: the same product.
        ctx = b.op(O.Attention, f"{pre}.attn.ctx", q=q, k=k, v=v, pos=pos, n_heads=spec.n_heads,
                   n_kv_heads=spec.n_heads, head_dim=hd, scale=1.0 / math.sqrt(hd), cache=pre)
        o = b.op(O.Linear, f"{pre}.attn.out", x=ctx, weight=n["o"], bias=maybe(n["o_bias"]))
        x = b.op(O.Add, f"{pre}.attn.resid", a=x, b=o)
        if not spec.pre_norm:
            x = norm(f"{pre}.attn_norm", x, n["attn_norm"])
        h = norm(f"{pre}.ffn_norm", x, n["ffn_norm"]) if spec.pre_norm else x
        f = b.op(O.FFN, f"{pre}.ffn.out", x=h, up=n["up"], down=n["down"],
                 up_bias=maybe(n["up_bias"]), down_bias=maybe(n["down_bias"]), form=spec.ffn_form)
        if spec.pre_norm:
            x = b.op(O.Add, f"{pre}.out", a=x, b=f)
        else:
            x = b.op(O.Add, f"{pre}.ffn.resid", a=x, b=f)
            x = norm(f"{pre}.ffn_norm", x, n["ffn_norm"])
    b.in_block(None)
    if spec.final_norm:
        x = norm("final_norm", x, "output_norm")
    if spec.embed_dim != spec.hidden:
        x = b.op(O.Linear, "output_proj", x=x, weight="proj_out")
    logits = b.op(O.Linear, "logits", x=x, weight="token_embd" if spec.tied else "output")
    module = Module(spec.name, module_attrs(spec), decls, (b.finish(logits),))
    return module.with_used_weights_only()
