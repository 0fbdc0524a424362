"""From recognised ops to a decoder: read the layer structure, fit rotary settings, fill a spec.

The recognised ops (``onnx_match.Rec``) are walked backwards from the logits: final norm, then
blocks ``x + ffn(norm(x + attn(norm(x))))`` down to the embedding. Every recognised op must be
used by exactly this structure; anything left over means the graph computes something picc's
builders would not, and is refused. The result is a ``LlamaSpec`` or ``OptSpec`` and a weight
store under picc's names, which the shared builders turn into IR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from picc.errors import PiccError
from picc.frontend.llama import LlamaSpec, RopeSpec, layer_weight_names
from picc.frontend.onnx_match import Rec, f32_round
from picc.frontend.opt import POSITION_OFFSET, OptSpec
from picc.ir import ops as O
from picc.ir.types import DType, f32
from picc.ir.weights import Tensor, WeightStore

T = TypeVar("T")
_GATED = {"relu": "reglu", "silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


def tensor(data: np.ndarray) -> Tensor:
    """A weight in the initializer's own float type (bf16 arrives as uint16 bit patterns)."""
    data = np.ascontiguousarray(data)
    dtype = {np.dtype(np.float16): DType.F16, np.dtype(np.uint16): DType.BF16}.get(data.dtype, DType.F32)
    if dtype == DType.F32:
        data = data.astype(np.float32, copy=False)
    return Tensor(dtype, data.shape, data)


@dataclass
class Block:
    """One decoder layer's recognised ops."""

    attn_norm: Rec
    ffn_norm: Rec
    q: Rec
    k: Rec
    v: Rec
    qkv_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # fused projection split
    rope: tuple[Rec, ...]  # where the rotary tables are (empty: no rope)
    attention: Rec
    o: Rec
    up: Rec
    gate: Rec | None
    down: Rec
    act: str


class Structure:
    """The walk over recognised ops; ``used`` records every op the structure explains."""

    def __init__(self, recs: list[Rec], where: str) -> None:
        self.recs = recs
        self.where = where
        self.used: set[int] = set()

    def get(self, rid: int, *ops: str) -> Rec:
        r = self.recs[rid]
        if r.op not in ops:
            raise PiccError(f"{self.where}: expected {' or '.join(ops)} but found {r.op} at node "
                            f"{r.node!r}; the graph is not a decoder picc can map")
        self.used.add(rid)
        return r

    def residual(self, add: Rec) -> tuple[int, int]:
        """(residual stream, branch) of a residual add: the branch ends in a projection."""
        a, b = add.inputs
        a_lin, b_lin = self.recs[a].op == "linear", self.recs[b].op == "linear"
        if b_lin and not a_lin:
            return a, b
        if a_lin and not b_lin:
            return b, a
        raise PiccError(f"{self.where}: cannot tell the residual stream from the branch at node {add.node!r}")

    def same(self, a: int, b: int, what: str, node: str) -> None:
        if a != b:
            raise PiccError(f"{self.where}: {what} read different inputs (at node {node!r}); "
                            "picc's decoders compute them from the same normalised hidden state")

    def block(self, out: int, norm: str) -> tuple[Block, int]:
        """The layer whose output is ``out``, and the layer's input."""
        mid, down_id = self.residual(self.get(out, "add"))
        down = self.get(down_id, "linear")
        inner = self.get(down.inputs[0], "mul", "act")
        if inner.op == "mul":
            a, b = inner.inputs
            act_id, up_id = (a, b) if self.recs[a].op == "act" else (b, a)
            act = self.get(act_id, "act")
            gate, up = self.get(act.inputs[0], "linear"), self.get(up_id, "linear")
            self.same(gate.inputs[0], up.inputs[0], "gate and up projections", inner.node)
            form = _GATED[str(act.attrs["kind"])]
        else:
            act, gate = inner, None
            up = self.get(inner.inputs[0], "linear")
            form = str(act.attrs["kind"])
        ffn_norm = self.get(up.inputs[0], norm)
        self.same(ffn_norm.inputs[0], mid, "the FFN norm and the attention residual", ffn_norm.node)
        x_in, o_id = self.residual(self.get(mid, "add"))
        o = self.get(o_id, "linear")
        att = self.get(o.inputs[0], "attention")
        rows = None
        if att.attrs.get("packed"):
            q = k = v = self.get(att.inputs[0], "linear")
            hd, n, n_kv = (att.integer(k) for k in ("head_dim", "n_heads", "n_kv_heads"))
            cut = np.cumsum([0, n * hd, n_kv * hd, n_kv * hd])
            rows = tuple(np.arange(cut[i], cut[i + 1]) for i in range(3))
            ropes: tuple[Rec, ...] = (att,) if "cos" in att.weights else ()
        else:
            qr, kr = self.recs[att.inputs[0]], self.recs[att.inputs[1]]
            ropes = tuple(self.get(r.id, "rope") for r in (qr, kr) if r.op == "rope")
            if "cos" in att.weights:
                ropes += (att,)
            q = self.get(qr.inputs[0] if qr.op == "rope" else qr.id, "linear")
            k = self.get(kr.inputs[0] if kr.op == "rope" else kr.id, "linear")
            v = self.get(att.inputs[2], "linear")
            if len(ropes) not in (0, 2) and not (len(ropes) == 1 and ropes[0] is att):
                raise PiccError(f"{self.where}: rotary embedding on only one of q and k at node {att.node!r}")
            for a, b in ((q, k), (q, v)):
                self.same(a.inputs[0], b.inputs[0], "q, k and v projections", att.node)
        attn_norm = self.get(q.inputs[0], norm)
        self.same(attn_norm.inputs[0], x_in, "the attention norm and the layer input", attn_norm.node)
        return Block(attn_norm, ffn_norm, q, k, v, rows, ropes, att, o, up, gate, down, form), x_in


def _round_sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def fit_rope(tables: Rec, head_dim: int, where: str) -> RopeSpec:
    """The simplest ``RopeSpec`` (fewest significant digits in theta and factor) whose inv_freq
    reproduces the rotary tables of ``tables`` within their dtype's rounding."""
    cos, sin = (np.asarray(tables.weights[k], np.float64) for k in ("cos", "sin"))
    pos = np.asarray(tables.weights["positions"])
    half = cos.shape[1]
    if 2 * half != head_dim or len(pos) < 2:
        raise PiccError(f"{where}: rotary tables at node {tables.node!r} cover {2 * half} of "
                        f"{head_dim} head features; partial rotary embeddings are not supported")
    # float32 tables: the angle pos * inv_freq is rounded to float32 (relative 6e-8) and cos/sin
    # add an ulp; fp16 / bf16 tables are rounded to 2^-11 / 2^-8 (their table_tol).
    tol = float(tables.attrs.get("table_tol", 0.0)) or 2e-6 + 2e-7 * float(np.abs(pos).max())
    z = cos + 1j * sin
    inv = np.angle(z[1] * np.conj(z[0])) / float(pos[1] - pos[0])  # every inv_freq is < pi
    if half < 2 or np.any(inv <= 0):
        raise PiccError(f"{where}: the rotary tables at node {tables.node!r} do not rotate by "
                        "positive frequencies")
    theta = inv[1] ** (-head_dim / 2)
    factor, scaled_theta = 1 / inv[0], (inv[1] / inv[0]) ** (-head_dim / 2)
    style = str(tables.attrs.get("style", "llama"))
    for digits in range(1, 8):
        candidates = [RopeSpec(theta=_round_sig(theta, digits))]
        if not math.isclose(factor, 1.0, rel_tol=1e-3):
            candidates.append(RopeSpec(theta=_round_sig(scaled_theta, digits), scaling="linear",
                                       factor=_round_sig(factor, digits)))
        for spec in candidates:
            rope = O.Rope(result="r", type=f32(1, head_dim), x="x", pos="p", n_heads=1,
                          head_dim=head_dim, theta=spec.theta, scaling=spec.scaling, factor=spec.factor)
            angles = pos.astype(np.float32)[:, None] * rope.inv_freq()[None, :]
            if np.allclose(np.cos(angles), cos, atol=tol) and np.allclose(np.sin(angles), sin, atol=tol):
                return RopeSpec(theta=spec.theta, style=style, scaling=spec.scaling, factor=spec.factor)
    raise PiccError(f"{where}: the rotary tables at node {tables.node!r} match no supported rope "
                    "(default or linear scaling)")


def one(values: list[T], what: str, where: str) -> T:
    """The single value all layers agree on."""
    if len(set(map(repr, values))) != 1:
        raise PiccError(f"{where}: layers differ in {what} ({sorted(set(map(repr, values)))}); "
                        "picc's decoders use one value for all layers")
    return values[0]


@dataclass(frozen=True)
class Metadata:
    """What the graph does not say, from config files beside it (see ``onnx.sidecar_metadata``)."""

    arch: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    max_position: int | None = None
    windows: tuple[int | None, ...] | None = None  # per layer, as the HF frontend reads them
    probe_keys: int = 0  # key positions in the probe's masks (windows this long are invisible)


@dataclass
class Decoder:
    """What the walk found: the spec for a shared builder, and the weights under picc's names."""

    spec: LlamaSpec | OptSpec
    store: WeightStore


@dataclass
class _Walk:
    head: Rec
    final: Rec
    blocks: list[Block]
    embed: Rec
    positions: Rec | None


def _walk(recs: list[Rec], logits: int, where: str) -> _Walk:
    """Logits <- final norm <- blocks <- embedding (+ learned positions); every op accounted for."""
    s = Structure(recs, where)
    head = s.get(logits, "linear")
    if "bias" in head.weights:
        raise PiccError(f"{where}: the output projection at node {head.node!r} has a bias")
    final = s.get(head.inputs[0], "rms_norm", "layer_norm")
    x = final.inputs[0]
    blocks: list[Block] = []
    while recs[x].op == "add" and not any(recs[i].op == "pos_embed" for i in recs[x].inputs):
        block, x = s.block(x, final.op)
        blocks.insert(0, block)
    positions = None
    if recs[x].op == "add":
        a, b = s.get(x, "add").inputs
        x, p = (a, b) if recs[b].op == "pos_embed" else (b, a)
        positions = s.get(p, "pos_embed")
    embed = s.get(x, "embed")
    s.used.update(r.id for r in recs if r.op == "past" or "superseded" in r.attrs)
    left = [r for r in recs if r.id not in s.used]
    if left:
        raise PiccError(f"{where}: the graph computes more than a decoder picc can map: "
                        + "; ".join(f"{r.op} at node {r.node!r}" for r in left[:8]))
    if not blocks:
        raise PiccError(f"{where}: no decoder layers found between the embedding and the logits")
    return _Walk(head, final, blocks, embed, positions)


def read_decoder(recs: list[Rec], logits: int, where: str, name: str, meta: Metadata) -> Decoder:
    """The decoder whose logits are recognised op ``logits``, as a spec for the shared builders."""
    w = _walk(recs, logits, where)
    blocks, table = w.blocks, w.embed.weights["table"]
    tied = w.head.weights["weight"].shape == table.shape and np.array_equal(w.head.weights["weight"], table)
    norms = [b.attn_norm for b in blocks] + [b.ffn_norm for b in blocks] + [w.final]
    eps = f32_round(one([r.number("eps") for r in norms], "norm eps", where))
    att = blocks[0].attention
    hd, n_heads, n_kv = (att.integer(k) for k in ("head_dim", "n_heads", "n_kv_heads"))
    for b in blocks:
        scale = b.attention.number("scale")
        if not math.isclose(scale, 1 / math.sqrt(hd), rel_tol=1e-5):
            raise PiccError(f"{where}: attention at node {b.attention.node!r} scales scores by {scale}, "
                            f"not 1/sqrt(head_dim {hd}); picc's decoders use 1/sqrt(head_dim)")
    store = _store(w, tied)
    form = one([b.act for b in blocks], "FFN activation", where)
    n_ff = blocks[0].up.weights["weight"].shape[0]
    windows = _windows(tuple(_window_of(b.attention) for b in blocks), meta, where)
    if w.final.op == "rms_norm" and w.positions is None:
        ropes = [fit_rope(r, hd, where) for b in blocks for r in b.rope]
        if not all(b.rope for b in blocks):
            raise PiccError(f"{where}: LLaMA-style decoders need rotary embeddings in every layer")
        rope = one(ropes, "rotary settings", where)
        qkv_bias_only = "bias" in blocks[0].q.weights and "bias" not in blocks[0].o.weights
        spec = LlamaSpec(
            name=name, arch=meta.arch or ("qwen2" if qkv_bias_only else "llama"), vocab=table.shape[0],
            hidden=table.shape[1], n_layers=len(blocks), n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
            n_ff=n_ff, eps=eps, ffn_form=form, rope=rope, tied=tied,
            window=windows if any(windows) else (), bos_id=meta.bos_id, eos_id=meta.eos_id,
            max_position=meta.max_position)
        return Decoder(spec, store)
    if w.final.op == "layer_norm" and w.positions is not None and not any(b.rope for b in blocks):
        if n_kv != n_heads or any(windows):
            raise PiccError(f"{where}: OPT-style decoders have no grouped or windowed attention")
        offset = w.positions.integer("offset")
        if offset != POSITION_OFFSET:
            raise PiccError(f"{where}: learned positions read at offset {offset}; OPT's is {POSITION_OFFSET}")
        opt = OptSpec(
            name=name, vocab=table.shape[0], hidden=table.shape[1], embed_dim=table.shape[1],
            n_layers=len(blocks), n_heads=n_heads, n_ff=n_ff, ffn_form=form, pre_norm=True,
            final_norm=True, tied=tied, max_position=w.positions.weights["table"].shape[0] - offset,
            eps=eps, bos_id=meta.bos_id, eos_id=meta.eos_id)
        return Decoder(opt, store)
    raise PiccError(f"{where}: a decoder with {w.final.op} and {'learned' if w.positions else 'no learned'} "
                    "positions is neither LLaMA-style (RMSNorm + rotary) nor OPT-style "
                    "(LayerNorm + learned positions)")


def _store(w: _Walk, tied: bool) -> WeightStore:
    """The weights under picc's names, in the Hugging Face frontend's order (the module declares
    weights in store order, so the IR text matches)."""
    store = WeightStore()
    store.add("token_embd", tensor(w.embed.weights["table"]))
    if w.positions is not None:
        store.add("pos_embd", tensor(w.positions.weights["table"]))
    for i, b in enumerate(w.blocks):
        _add_block(store, i, b)
    store.add("output_norm", tensor(w.final.weights["weight"]))
    if "bias" in w.final.weights:
        store.add("output_norm_bias", tensor(w.final.weights["bias"]))
    if not tied:
        store.add("output", tensor(w.head.weights["weight"]))
    return store


def _window_of(attention: Rec) -> int | None:
    w = attention.attrs.get("window")
    return w if isinstance(w, int) else None


def _windows(seen: tuple[int | None, ...], meta: Metadata, where: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows: those the masks show, completed from a config beside the model.

    A window at least as long as the probe is invisible in the probe's mask; a config's window is
    taken when the graph agrees wherever it can tell.
    """
    if meta.windows is None or len(meta.windows) != len(seen):
        return seen
    for i, (got, want) in enumerate(zip(seen, meta.windows, strict=True)):
        visible = want if want is not None and want < meta.probe_keys else None
        if got != visible:
            raise PiccError(f"{where}: layer {i} attends with window {got} but the config beside the "
                            f"model says {want}")
    return meta.windows


def _add_block(store: WeightStore, i: int, b: Block) -> None:
    """Layer ``i``'s weights, in the order the Hugging Face frontend adds them."""
    n = layer_weight_names(i)

    def add(key: str, r: Rec, rows: np.ndarray | None = None) -> None:
        store.add(n[key], tensor(r.weights["weight"] if rows is None else r.weights["weight"][rows]))
        if "bias" in r.weights:
            store.add(n[f"{key}_bias"], tensor(r.weights["bias"] if rows is None else r.weights["bias"][rows]))

    add("attn_norm", b.attn_norm)
    for key, r, rows in zip(("q", "k", "v"), (b.q, b.k, b.v), b.qkv_rows or (None,) * 3, strict=True):
        add(key, r, rows)
    add("o", b.o)
    add("ffn_norm", b.ffn_norm)
    if b.gate is not None:
        add("gate", b.gate)
    add("up", b.up)
    add("down", b.down)
