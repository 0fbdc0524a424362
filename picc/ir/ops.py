"""The ops of a decoder LLM in the picc IR.

Activations are 2-D ``f32[seq, features]`` (one sequence; decode is ``seq = 1``). Weights are
referenced by name and may be quantized wherever a matrix is read row by row (embedding tables,
linear and FFN weights); norms, biases and position tables are float.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from picc import kernel_names as names
from picc.ir import positional
from picc.ir.core import Op, RuleError, Sym, TypeEnv, Val, expect, expect_rank, register_op, weight_shape_is
from picc.ir.kernel_choice import LAYOUTS, X_FORMATS, Accumulated, MatrixOp
from picc.ir.types import DType, Placement, TensorType, f32

ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")


def _activation_input(env: TypeEnv, name: str) -> TensorType:
    t = env.value(name)
    expect(t.dtype == DType.F32, f"operand %{name} must be f32, got {t}")
    expect_rank(f"operand %{name}", t, 2)
    return t


def _float_weight(env: TypeEnv, name: str | None, role: str) -> None:
    if name is not None:
        w = env.weight(name)
        expect(w.dtype.is_float, f"{role} @{name} must be a float tensor, got {w}")


# ---------------------------------------------------------------- embeddings


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Embed(Op):
    """Token embedding: row ``tokens[i]`` of ``table`` [vocab, dim] for every position i, times
    ``scale`` (Gemma's ``sqrt(hidden)``, rounded as its checkpoint's dtype rounds it; the table
    itself stays as an LM head tied to it reads it). ``layout`` (``select-kernels``): how the
    table is stored, ``"rows8"`` where an LM head tied to it reads it eight rows at a time
    (:class:`~picc.ir.kernel_choice.MatrixOp`)."""

    NAME: ClassVar[str] = "embed"
    tokens: Val
    table: Sym
    scale: float = 1.0
    layout: str = "rows"

    def infer(self, env: TypeEnv) -> TensorType:
        expect(self.layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        expect(self.scale > 0, f"scale must be > 0, got {self.scale}")
        t = env.value(self.tokens)
        expect(t.dtype.is_int and t.rank == 1, f"tokens %{self.tokens} must be i32[seq], got {t}")
        w = env.weight(self.table)
        expect_rank(f"table @{self.table}", w, 2)
        return f32(t.shape[0], w.shape[1])


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class PosEmbed(Op):
    """Learned absolute positions (OPT): row ``pos[i] + offset`` of ``table`` [n_pos, dim]."""

    NAME: ClassVar[str] = "pos_embed"
    pos: Val
    table: Sym
    offset: int = 0

    def infer(self, env: TypeEnv) -> TensorType:
        t = env.value(self.pos)
        expect(t.dtype.is_int and t.rank == 1, f"positions %{self.pos} must be i32[seq], got {t}")
        w = env.weight(self.table)
        expect_rank(f"table @{self.table}", w, 2)
        expect(self.offset >= 0, f"offset must be >= 0, got {self.offset}")
        return f32(t.shape[0], w.shape[1])


# ---------------------------------------------------------------- norms and projections


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class RMSNorm(Op):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (LLaMA's RMSNorm); with ``group``,
    over each run of ``group`` elements of it separately, ``weight`` [group] (Qwen3's norm of each
    attention head's q and k)."""

    NAME: ClassVar[str] = "rms_norm"
    x: Val
    weight: Sym
    eps: float
    group: int | None = None

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        width = t.shape[1]
        if self.group is not None:
            expect(self.group > 0 and isinstance(width, int) and width % self.group == 0,
                   f"group must be > 0 and divide the width {width}, got {self.group}")
        weight_shape_is(env, self.weight, (self.group or width,), "weight")
        _float_weight(env, self.weight, "weight")
        expect(self.eps > 0, f"eps must be > 0, got {self.eps}")
        return t


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class LayerNorm(Op):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis."""

    NAME: ClassVar[str] = "layer_norm"
    x: Val
    weight: Sym
    bias: Sym | None = None
    eps: float

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        for name, role in ((self.weight, "weight"), (self.bias, "bias")):
            weight_shape_is(env, name, (t.shape[1],), role)
            _float_weight(env, name, role)
        expect(self.eps > 0, f"eps must be > 0, got {self.eps}")
        return t


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Linear(MatrixOp):
    """``x @ weight.T + bias``; weight is [out, in] in any weight dtype, bias [out] float."""

    NAME: ClassVar[str] = "linear"
    x: Val
    weight: Sym
    bias: Sym | None = None

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        w = env.weight(self.weight)
        expect_rank(f"weight @{self.weight}", w, 2)
        expect(
            w.shape[1] == t.shape[1],
            f"weight @{self.weight} {w} takes {w.shape[1]} inputs but %{self.x} has {t.shape[1]}",
        )
        weight_shape_is(env, self.bias, (w.shape[0],), "bias")
        _float_weight(env, self.bias, "bias")
        self.check_kernel_choice()
        return f32(t.shape[0], w.shape[0])


# ---------------------------------------------------------------- rotary embedding

ROPE_STYLES = ("llama", "gptj")
ROPE_SCALINGS = ("none", "linear", "llama3", "longrope", "yarn")
PER_PAIR_SCALINGS = ("longrope", "yarn")  # a frequency factor per rotary pair


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Rope(Op):
    """Rotary position embedding of each head of ``x`` [seq, n_heads * head_dim] at ``pos``.

    The first ``rotary_dim`` (default: all) features of each head are rotated by angle
    ``pos * inv_freq[i]``. Style ``llama`` pairs feature i with i + rotary_dim/2 (rotate_half);
    ``gptj`` pairs 2i with 2i + 1. ``scaling`` adjusts ``inv_freq`` as transformers does:
    ``linear`` divides it by ``factor``; ``llama3`` divides only the low frequencies, smoothing
    between ``low_freq_factor`` and ``high_freq_factor`` relative to ``original_max_position``;
    ``longrope`` divides each by its own ``freq_factors[i]`` (Phi-3.5's and Phi-4-mini's short
    factors; ``long_factors``: the ones a context past ``original_max_position`` takes instead,
    :func:`picc.frontend.llama.longrope_for_context`); ``yarn`` likewise, its factors blending 1
    and ``factor`` along YaRN's ramp (:func:`picc.ir.positional.yarn_freq_factors`; ``factor``
    and ``original_max_position`` are the frontend's, for the reader). The cosines and sines are
    multiplied by ``attention_factor`` (longrope's and yarn's scaling of attention, as
    transformers applies it: the rotated features only).

    ``launched_with`` (``select-kernels``, on the GPU): an earlier rope of the same rotation (a
    layer's q rope, for its k rope) whose launch computes this one too; the value is the same.
    """

    NAME: ClassVar[str] = "rope"
    x: Val
    pos: Val
    launched_with: Val | None = None
    n_heads: int
    head_dim: int
    rotary_dim: int | None = None
    style: str = "llama"
    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0

    @property
    def rotated(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def same_rotation(self, other: Rope) -> bool:
        """Whether ``other`` rotates by the same angles: what lets one kernel launch rotate both."""
        return all(getattr(self, f) == getattr(other, f) for f in positional.ROTATION)

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        if self.launched_with is not None:
            partner = producer(self.launched_with)
            expect(isinstance(partner, Rope) and partner.launched_with is None and partner.same_rotation(self)
                   and partner.type.placement == Placement.GPU == self.type.placement,
                   f"launched_with: %{self.launched_with} must be a rope on the GPU, not itself launched with "
                   "another, rotating by the same angles")

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        p = env.value(self.pos)
        expect(p.dtype.is_int and p.shape == (t.shape[0],), f"positions %{self.pos} must be "
               f"i32[{t.shape[0]}], got {p}")
        expect(t.shape[1] == self.n_heads * self.head_dim,
               f"%{self.x} has {t.shape[1]} features, expected n_heads * head_dim = "
               f"{self.n_heads} * {self.head_dim}")
        expect(self.style in ROPE_STYLES, f"style must be one of {ROPE_STYLES}, got {self.style!r}")
        expect(self.scaling in ROPE_SCALINGS,
               f"scaling must be one of {ROPE_SCALINGS}, got {self.scaling!r}")
        expect(0 < self.rotated <= self.head_dim and self.rotated % 2 == 0,
               f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotated}")
        expect(self.theta > 0 and self.factor > 0, "theta and factor must be > 0")
        expect(self.scaling != "llama3" or self.high_freq_factor > self.low_freq_factor,
               "llama3 scaling needs high_freq_factor > low_freq_factor")
        expect((self.scaling in PER_PAIR_SCALINGS) == bool(self.freq_factors)
               and (not self.freq_factors or len(self.freq_factors) == self.rotated // 2),
               f"freq_factors: one per rotary pair ({self.rotated // 2}) with longrope or yarn scaling, none "
               f"otherwise; got {len(self.freq_factors)} with {self.scaling!r}")
        expect(not self.long_factors
               or (self.scaling == "longrope" and len(self.long_factors) == len(self.freq_factors)),
               f"long_factors: one per rotary pair ({self.rotated // 2}), with longrope's freq_factors; "
               f"got {len(self.long_factors)}")
        expect(all(f > 0 for f in self.freq_factors + self.long_factors) and self.attention_factor > 0,
               "freq_factors, long_factors and attention_factor must be > 0")
        return t

    def inv_freq(self) -> np.ndarray:
        """Per-pair angular frequency, float32, computed as transformers computes it."""
        return positional.inv_freq(self.rotated, self.theta, self.scaling, self.factor, self.low_freq_factor,
                                   self.high_freq_factor, self.original_max_position, self.freq_factors)


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class ConcatHeads(Op):
    """``n_heads`` heads of ``a_dim + b_dim`` features, head h a head of ``a`` then a head of ``b``.

    ``a`` is [seq, a_dim] (one head, the same in every output head) or [seq, n_heads * a_dim] (a
    head each); likewise ``b`` with ``b_dim``. The result is [seq, n_heads * (a_dim + b_dim)],
    head h = ``[a's head h (or its one head) | b's head h (or its one head)]``: DeepSeek's
    multi-head latent attention, decompressed, joins each head's key from the rotated part every
    head shares (a one-head ``rope``) and the head's own part. Nothing is computed: a copy.
    """

    NAME: ClassVar[str] = "concat_heads"
    a: Val
    b: Val
    n_heads: int
    a_dim: int
    b_dim: int

    def infer(self, env: TypeEnv) -> TensorType:
        expect(self.n_heads > 0 and self.a_dim > 0 and self.b_dim > 0,
               f"n_heads, a_dim and b_dim must be > 0, got {self.n_heads}, {self.a_dim}, {self.b_dim}")
        a, b = _activation_input(env, self.a), _activation_input(env, self.b)
        expect(a.shape[0] == b.shape[0], f"%{self.a} and %{self.b} must have the same rows, got {a} and {b}")
        for name, t, dim, role in ((self.a, a, self.a_dim, "a_dim"), (self.b, b, self.b_dim, "b_dim")):
            expect(t.shape[1] in (dim, self.n_heads * dim),
                   f"%{name} has {t.shape[1]} features, expected {role} = {dim} (one head for every head) "
                   f"or n_heads * {role} = {self.n_heads * dim} (a head each)")
        return f32(a.shape[0], self.n_heads * (self.a_dim + self.b_dim))


# ---------------------------------------------------------------- attention

ALIBI_KINDS = ("none", "falcon")
KV_FORMATS = ("f32", "f16")


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Attention(Op):
    """Causal multi-head attention with grouped K/V heads and a KV cache.

    ``q`` and ``k`` are [seq, n_heads * head_dim] and [seq, n_kv_heads * head_dim]; ``v`` is [seq,
    n_kv_heads * v_head_dim] and so is each cached value row, the result [seq, n_heads * v_head_dim]
    (``v_head_dim``, when set: values narrower than keys, as DeepSeek's multi-head latent attention
    decompressed, 192-feature keys and 128-feature values; else head_dim). Query head h uses K/V
    head ``h // (n_heads / n_kv_heads)``. The keys and values of this call are written to
    the cache slot named ``cache`` at positions ``pos``; then the query at position p attends to
    every cached position j <= p (and p - j < window, when ``window`` is set) with scores
    ``(q . k) * scale``, softmax over j. With ``softcap`` (Gemma 2's ``attn_logit_softcapping``)
    a score s is ``softcap * tanh(s / softcap)`` before the softmax. With ``sinks`` (gpt-oss's
    attention sinks, f32 [n_heads]) query head h's softmax has one more logit, ``sinks[h]``, with
    no value: ``m = max(max_j s_j, sinks[h])``, ``p_j = exp(s_j - m) / (sum_j exp(s_j - m) +
    exp(sinks[h] - m))``, so the probabilities sum to less than 1.

    ``alibi = "falcon"`` adds ALiBi biases instead of using rotary positions, as Falcon does:
    scores ``(q . k + b[h, j]) * scale`` with ``b[h, j] = bf16(bf16(slope_h) * j)`` (transformers
    computes the bias in bfloat16; with 16+ heads the rounding visibly changes the logits).

    ``appended_by_rope`` (``select-kernels``, on the GPU): this call's keys and values go to the
    cache in the launch that rotates ``k`` (``launched_with`` ``q``'s rope), not in one of its own.

    ``kv_format`` (``select-kernels``, on the CPU): what the cache holds, ``"f32"`` or ``"f16"``
    (keys and values rounded to half precision as they are written: half the bytes each step
    reads back). The rounding is part of what the op computes; the interpreter rounds alike.
    """

    NAME: ClassVar[str] = "attention"
    q: Val
    k: Val
    v: Val
    pos: Val
    sinks: Sym | None = None
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    scale: float
    cache: str
    window: int | None = None
    softcap: float | None = None
    alibi: str = "none"
    appended_by_rope: bool = False
    kv_format: str = "f32"

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        if self.appended_by_rope:
            k, q = producer(self.k), producer(self.q)
            expect(isinstance(k, Rope) and k.launched_with == self.q and isinstance(q, Rope)
                   and self.type.placement == Placement.GPU,
                   f"appended_by_rope: %{self.k} must be a rope launched with %{self.q}'s rope, on the GPU")

    def infer(self, env: TypeEnv) -> TensorType:
        q = _activation_input(env, self.q)
        k = _activation_input(env, self.k)
        v = _activation_input(env, self.v)
        expect(self.n_heads > 0 and self.n_kv_heads > 0 and self.head_dim > 0,
               "n_heads, n_kv_heads and head_dim must be > 0")
        expect(self.v_head_dim is None or self.v_head_dim > 0, f"v_head_dim must be > 0, got {self.v_head_dim}")
        expect(self.n_heads % self.n_kv_heads == 0,
               f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        expect(q.shape[1] == self.n_heads * self.head_dim,
               f"q %{self.q} has {q.shape[1]} features, expected n_heads * head_dim = "
               f"{self.n_heads * self.head_dim}")
        for name, t, dim, what in ((self.k, k, self.head_dim, "head_dim"),
                                   (self.v, v, self.v_dim, "v_head_dim" if self.v_head_dim else "head_dim")):
            expect(t.shape == (q.shape[0], self.n_kv_heads * dim),
                   f"%{name} must be f32[{q.shape[0]}, {self.n_kv_heads * dim}] (n_kv_heads * {what}), got {t}")
        p = env.value(self.pos)
        expect(p.dtype.is_int and p.shape == (q.shape[0],),
               f"positions %{self.pos} must be i32[{q.shape[0]}], got {p}")
        expect(self.window is None or self.window > 0, f"window must be > 0, got {self.window}")
        expect(self.softcap is None or self.softcap > 0, f"softcap must be > 0, got {self.softcap}")
        weight_shape_is(env, self.sinks, (self.n_heads,), "sinks")
        _float_weight(env, self.sinks, "sinks")
        expect(bool(self.cache), "cache slot name must not be empty")
        expect(self.alibi in ALIBI_KINDS, f"alibi must be one of {ALIBI_KINDS}, got {self.alibi!r}")
        expect(self.kv_format in KV_FORMATS, f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        return q.with_shape((q.shape[0], self.n_heads * self.v_dim))

    @property
    def v_dim(self) -> int:
        """Features of a value head (and of an output head): ``v_head_dim``, or ``head_dim``."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def alibi_slopes(self) -> np.ndarray:
        """ALiBi slopes per head, as BLOOM/Falcon compute them (also for non-powers of two)."""
        return positional.alibi_slopes(self.n_heads)


# ---------------------------------------------------------------- elementwise


@dataclass(frozen=True, slots=True, kw_only=True)
class _Unary(Op):
    x: Val

    def infer(self, env: TypeEnv) -> TensorType:
        return _activation_input(env, self.x)


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Relu(_Unary):
    """``max(x, 0)``."""

    NAME: ClassVar[str] = "relu"


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Silu(_Unary):
    """``x * sigmoid(x)``."""

    NAME: ClassVar[str] = "silu"


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Gelu(_Unary):
    """``x * Phi(x)`` with the exact normal CDF (erf)."""

    NAME: ClassVar[str] = "gelu"


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class GeluTanh(_Unary):
    """The tanh approximation of GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    NAME: ClassVar[str] = "gelu_tanh"


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Softcap(_Unary):
    """``cap * tanh(x / cap)``: Gemma 2's soft cap of its final logits (``final_logit_softcapping``)."""

    NAME: ClassVar[str] = "softcap"
    cap: float

    def infer(self, env: TypeEnv) -> TensorType:
        expect(self.cap > 0, f"cap must be > 0, got {self.cap}")
        return _Unary.infer(self, env)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Binary(Op):
    a: Val
    b: Val

    def infer(self, env: TypeEnv) -> TensorType:
        a = _activation_input(env, self.a)
        b = _activation_input(env, self.b)
        expect(a == b, f"operands must have the same type, got %{self.a}: {a} and %{self.b}: {b}")
        return a


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Add(Accumulated, _Binary):
    """Elementwise ``a + b`` (residual connections).

    ``accumulated_by`` (``"a"`` or ``"b"``, set by ``select-kernels`` for the CPU's decode step):
    the kernel of that operand's producer adds its result into the other operand's buffer, so
    the add itself costs nothing. Same value either way.
    """

    NAME: ClassVar[str] = "add"
    accumulated_by: str = ""

    def infer(self, env: TypeEnv) -> TensorType:
        expect(self.accumulated_by in ("", "a", "b"), f"accumulated_by must be a or b, got {self.accumulated_by!r}")
        return _Binary.infer(self, env)



@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Mul(_Binary):
    """Elementwise ``a * b`` (the gating product of a GLU)."""

    NAME: ClassVar[str] = "mul"


# ---------------------------------------------------------------- the feed-forward block


@dataclass(frozen=True, slots=True)
class FfnForm:
    """How an FFN form combines its projections: ``h = act(gate) * up`` or ``h = act(up)``."""

    gated: bool
    act: str
    act_on_up: bool = False  # dReLU: relu(gate) * relu(up)


FFN_FORMS: dict[str, FfnForm] = {
    "relu": FfnForm(False, "relu"),
    "silu": FfnForm(False, "silu"),
    "gelu": FfnForm(False, "gelu"),
    "gelu_tanh": FfnForm(False, "gelu_tanh"),
    "swiglu": FfnForm(True, "silu"),
    "reglu": FfnForm(True, "relu"),
    "geglu": FfnForm(True, "gelu"),
    "geglu_tanh": FfnForm(True, "gelu_tanh"),
    "drelu": FfnForm(True, "relu", act_on_up=True),
}


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class FFN(MatrixOp):
    """A feed-forward block: ``down(h)`` with ``h`` per ``form`` (see ``FFN_FORMS``).

    ``up`` and ``gate`` are [n_ff, hidden], ``down`` is [hidden, n_ff]; biases are optional.
    Neuron i of the block is row i of up/gate and column i of down: the unit that profiling,
    prediction and partitioning work on.

    A neuron's *activity score* is ``|act(gate_i)|`` for gated forms (``|h_i|`` for dReLU, where
    both projections are rectified) and ``|act(up_i)|`` otherwise, times ``score_scale[i]`` when
    the op has one; the neuron is *active* when its score exceeds ``threshold`` (0 for ReLU forms,
    where that is exact; for the others a calibrated threshold). ``score_scale`` (f32 [n_ff]) puts
    the neurons of all layers on one scale of importance (``picc.sparsity.fisher``): without it, CATS.
    Profiling fills ``freq`` (per neuron, the share of calibration tokens on which it is active),
    ``mag`` (mean ``|h_i|``), ``threshold``, ``score_scale`` and ``down_threshold`` (the ``|h_i|``
    level with the same sparsity, for TEAL-style down-only skipping); they describe the block and
    do not change what a dense ``ffn`` computes.

    ``neuron_major`` says ``down`` is stored transposed, [n_ff, hidden] (row i is neuron i's down
    column), the layout the gather kernels read. After partitioning, a layer split between devices
    is several ffn ops, one per part, whose outputs are added: ``part_of`` names the value of the
    whole layer and ``neuron_offset`` is the index of the part's first neuron in the layer (in the
    partitioned order; a predictor's mask is indexed in that order).
    """

    NAME: ClassVar[str] = "ffn"
    x: Val
    up: Sym
    gate: Sym | None = None
    down: Sym
    up_bias: Sym | None = None
    gate_bias: Sym | None = None
    down_bias: Sym | None = None
    freq: Sym | None = None
    mag: Sym | None = None
    score_scale: Sym | None = None
    form: str
    threshold: float | None = None
    down_threshold: float | None = None
    neuron_major: bool = False
    part_of: str | None = None
    neuron_offset: int = 0

    @property
    def spec(self) -> FfnForm:
        return FFN_FORMS[self.form]

    @property
    def can_accumulate(self) -> bool:
        return type(self) is FFN and not self.neuron_major

    def n_ff(self, env: TypeEnv) -> int:
        n = env.weight(self.up).shape[0]
        assert isinstance(n, int)
        return n

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        expect(self.form in FFN_FORMS, f"form must be one of {tuple(FFN_FORMS)}, got {self.form!r}")
        up = env.weight(self.up)
        expect_rank(f"up @{self.up}", up, 2)
        n_ff, hidden = up.shape
        expect(hidden == t.shape[1], f"up @{self.up} {up} takes {hidden} inputs but %{self.x} "
               f"has {t.shape[1]}")
        if self.spec.gated:
            expect(self.gate is not None, f"form {self.form!r} needs a gate weight")
            weight_shape_is(env, self.gate, (n_ff, hidden), "gate")
        else:
            expect(self.gate is None and self.gate_bias is None,
                   f"form {self.form!r} has no gate, but one is given")
        weight_shape_is(env, self.down, (n_ff, hidden) if self.neuron_major else (hidden, n_ff), "down")
        weight_shape_is(env, self.up_bias, (n_ff,), "up_bias")
        weight_shape_is(env, self.gate_bias, (n_ff,), "gate_bias")
        weight_shape_is(env, self.down_bias, (hidden,), "down_bias")
        weight_shape_is(env, self.freq, (n_ff,), "freq")
        weight_shape_is(env, self.mag, (n_ff,), "mag")
        weight_shape_is(env, self.score_scale, (n_ff,), "score_scale")
        for name, role in ((self.up_bias, "up_bias"), (self.gate_bias, "gate_bias"),
                           (self.down_bias, "down_bias"), (self.freq, "freq"), (self.mag, "mag"),
                           (self.score_scale, "score_scale")):
            _float_weight(env, name, role)
        for name in ("threshold", "down_threshold"):
            value = getattr(self, name)
            expect(value is None or value >= 0, f"{name} must be >= 0, got {value}")
        expect(self.neuron_offset >= 0, f"neuron_offset must be >= 0, got {self.neuron_offset}")
        self.check_kernel_choice()
        expect(self.part_of is not None or self.neuron_offset == 0,
               "neuron_offset is the place of a part in its layer; it needs part_of")
        return t


__all__ = ["ACTIVATIONS", "FFN_FORMS", "LAYOUTS", "X_FORMATS", "MatrixOp", "RuleError"]


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class MoE(Op):
    """A mixture of experts (Mixtral, Qwen3-MoE, OLMoE): ``n_experts`` FFNs of one ``form``, of
    which each token runs the ``top_k`` its router ranks first.

    ``router`` is [n_experts, hidden]; ``up`` and ``gate`` are the experts' matrices one after
    another, [n_experts * n_ff, hidden] (expert e's rows ``e n_ff ..``), ``down`` likewise
    [n_experts * hidden, n_ff] (expert e's [hidden, n_ff] at rows ``e hidden ..``). For a token x:
    ``p = softmax(router x)``; the experts of the ``top_k`` largest ``p`` (the lower index first
    among equals), with weights ``p_e``, divided by their sum where ``norm_topk``; the output is
    ``sum_e w_e down_e(h_e)`` with ``h_e`` as an ``ffn`` of ``form`` computes it from x. Not an
    ``ffn``: its neurons are not profiled, predicted or split; its weights stay on the CPU.

    gpt-oss's additions: biases (``router_bias`` [n_experts] on the logits; ``up_bias`` and
    ``gate_bias`` [n_experts * n_ff] and ``down_bias`` [n_experts * hidden], each expert's slice
    added to its projections before the weighting) and, with ``swiglu_limit`` (form ``swiglu``
    only), its clamped SwiGLU: ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``,
    ``h = g' sigmoid(swiglu_alpha g') (u' + 1)``.

    Qwen2-MoE's shared expert: ``n_shared`` more experts of the same width after the routed ones
    in the stacked matrices (its neurons cut into ``n_ff``-wide pieces), taken by every token after
    its top k, with weight 1, or (``shared_gated``) ``sigmoid(router[n_experts] . x)``: the router
    then has one more row, the shared expert's gate.

    ERNIE 4.5's ``choice_bias`` [n_experts] ranks the experts by ``p_e + choice_bias[e]`` (the
    softmax's probabilities), while their weights stay the ``p_e`` (renormalised where ``norm_topk``).

    DeepSeek's and GLM-4.5's routing. ``scoring`` ``"sigmoid"`` (DeepSeek V3, GLM-4.5): ``p_e =
    1 / (1 + exp(-logit_e))``, each expert's own, in place of the softmax. With a ``choice_bias``,
    sigmoids or groups the experts are ranked by ``s_e = p_e + choice_bias[e]`` (``p_e`` without a
    bias: V3's ``e_score_correction_bias`` is the choice bias), else by their logits (the
    softmax's order). ``n_group`` > 1: the experts form ``n_group`` groups of ``n_experts /
    n_group`` consecutive ones, each scored by the largest ``s_e`` of its members
    (``group_score`` ``"max"``, V2's ``group_limited_greedy``) or by the sum of its two largest
    (``"top2"``, V3's); the top k are taken from the ``topk_group`` best groups' experts only (the
    lower index first among equal groups). ``routed_scale`` multiplies the routed experts' weights
    after any ``norm_topk`` (V2's and V3's ``routed_scaling_factor``), not the shared experts'.
    ``norm_topk`` divides by the k weights' plain sum: V3's 1e-20 added to it is not (it moves a
    float32 sum only below ~1e-13, where every chosen sigmoid's logit is below -29).

    ``x_format`` (``select-kernels``): ``"i16"`` where the experts' 4-bit rows are dotted with x
    (and h) rounded to int16 per block, as a ``MatrixOp``'s; the interpreter rounds alike.
    ``layout``: ``"rows8"`` where the 4-bit ones of the three matrices are stored eight rows to a
    group (an expert's rows a whole number of groups) and read so with int16 x.
    """

    NAME: ClassVar[str] = "moe"
    x: Val
    router: Sym
    up: Sym
    gate: Sym | None = None
    down: Sym
    n_experts: int
    top_k: int
    form: str
    norm_topk: bool = False
    router_bias: Sym | None = None
    up_bias: Sym | None = None
    gate_bias: Sym | None = None
    down_bias: Sym | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    n_shared: int = 0
    shared_gated: bool = False
    choice_bias: Sym | None = None
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scale: float = 1.0
    x_format: str = "f32"
    layout: str = "rows"

    @property
    def spec(self) -> FfnForm:
        return FFN_FORMS[self.form]

    @property
    def biases(self) -> str:
        """Which biases the op has, a letter each (router, up, gate, down): ``"rugd"`` for all."""
        return "".join(c for c, b in zip("rugd", (self.router_bias, self.up_bias, self.gate_bias, self.down_bias),
                                         strict=True) if b is not None)

    @property
    def variant(self) -> names.MoeVariant:
        """Its kernels' variant (``picc.kernel_names.MoeVariant``)."""
        shared = ("gated" if self.shared_gated else "plain") if self.n_shared else ""
        return names.MoeVariant(self.biases, self.swiglu_limit is not None, shared, self.choice_bias is not None,
                                self.scoring, self.group_score if self.n_group > 1 else "", self.routed_scale != 1.0)

    @property
    def ranks_by_probability(self) -> bool:
        """Whether its experts are ranked by ``p_e`` (plus the choice bias), not by their logits."""
        return self.variant.ranks_by_probability

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        hidden = t.shape[1]
        expect(self.x_format in ("f32", "i16"), f"x_format must be f32 or i16, got {self.x_format!r}")
        expect(self.layout in LAYOUTS and (self.layout == "rows" or self.x_format == "i16"),
               f"layout must be rows, or rows8 with i16 x, got {self.layout!r} with {self.x_format!r}")
        expect(self.form in FFN_FORMS, f"form must be one of {tuple(FFN_FORMS)}, got {self.form!r}")
        expect(self.n_experts > 0 and 0 < self.top_k <= self.n_experts,
               f"top_k must be in 1..n_experts, got top_k={self.top_k}, n_experts={self.n_experts}")
        expect(self.n_shared >= 0 and (self.n_shared or not self.shared_gated),
               f"shared_gated needs n_shared > 0, got n_shared={self.n_shared}")
        expect(not (self.shared_gated and self.router_bias), "a gated shared expert's router row has no bias")
        self._check_routing()
        weight_shape_is(env, self.router, (self.n_experts + int(self.shared_gated), hidden), "router")
        up = env.weight(self.up)
        expect_rank(f"up @{self.up}", up, 2)
        rows, cols = up.shape
        stacked = self.n_experts + self.n_shared
        expect(cols == hidden and isinstance(rows, int) and rows % stacked == 0,
               f"up @{self.up} must be [(n_experts + n_shared) * n_ff, {hidden}], got {up}")
        n_ff = rows // stacked
        expect((self.gate is not None) == self.spec.gated,
               f"form {self.form!r} " + ("needs a gate weight" if self.spec.gated else "has no gate, but one is given"))
        weight_shape_is(env, self.gate, (rows, hidden), "gate")
        weight_shape_is(env, self.down, (stacked * hidden, n_ff), "down")
        weight_shape_is(env, self.router_bias, (self.n_experts,), "router_bias")
        weight_shape_is(env, self.choice_bias, (self.n_experts,), "choice_bias")
        weight_shape_is(env, self.up_bias, (rows,), "up_bias")
        expect(self.gate is not None or self.gate_bias is None, "gate_bias without a gate")
        weight_shape_is(env, self.gate_bias, (rows,), "gate_bias")
        weight_shape_is(env, self.down_bias, (stacked * hidden,), "down_bias")
        if self.swiglu_limit is None:
            expect(self.swiglu_alpha == 1.0, "swiglu_alpha is the clamped SwiGLU's: it needs swiglu_limit")
        else:
            expect(self.form == "swiglu" and self.swiglu_limit > 0 and self.swiglu_alpha > 0,
                   f"swiglu_limit and swiglu_alpha (> 0) are form swiglu's, got form {self.form!r}, "
                   f"limit {self.swiglu_limit}, alpha {self.swiglu_alpha}")
        return t

    def _check_routing(self) -> None:
        """DeepSeek's and GLM-4.5's attributes: the scoring, the groups, the scale."""
        expect(self.scoring in ("softmax", "sigmoid"), f"scoring must be softmax or sigmoid, got {self.scoring!r}")
        expect(self.group_score in ("max", "top2"), f"group_score must be max or top2, got {self.group_score!r}")
        expect(self.n_group >= 1 and self.n_experts % self.n_group == 0,
               f"n_group must divide n_experts, got n_group={self.n_group}, n_experts={self.n_experts}")
        expect(1 <= self.topk_group <= self.n_group,
               f"topk_group must be in 1..n_group, got topk_group={self.topk_group}, n_group={self.n_group}")
        size = self.n_experts // self.n_group
        expect(self.top_k <= self.topk_group * size,
               f"top_k must fit in the topk_group best groups' experts, got top_k={self.top_k}, "
               f"topk_group={self.topk_group} groups of {size}")
        expect(self.group_score != "top2" or self.n_group == 1 or size >= 2,
               f"group_score top2 needs groups of 2 or more experts, got {size}")
        expect(math.isfinite(self.routed_scale) and self.routed_scale > 0,
               f"routed_scale must be finite and > 0, got {self.routed_scale}")

    def n_ff(self, env: TypeEnv) -> int:
        """Neurons of one expert."""
        rows = env.weight(self.up).shape[0]
        assert isinstance(rows, int)
        return rows // (self.n_experts + self.n_shared)

