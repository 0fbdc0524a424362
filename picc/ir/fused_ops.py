"""Fused FFN ops: what ``fuse-gather-gemv`` turns each FFN layer (or each device's part of it) into.

``fused_ffn`` is one kernel call: the gather-GEMV over the active rows of up (and gate), the
activation, and the down projection as an AXPY over the active neurons of the neuron-major down
matrix, giving a *partial sum* over the op's neurons. ``merge`` adds the partial sums of a layer
split between devices (and the layer's down bias): the one point where the two devices meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from picc.ir.core import Op, Sym, TypeEnv, Val, expect, register_op, weight_shape_is
from picc.ir.ops import FFN_FORMS, MatrixOp, _activation_input, _float_weight
from picc.ir.sparse_ops import SPARSITY_MODES, check_mask_producer
from picc.ir.types import Dim, DType, Placement, TensorType
from picc.kernel_names import GATHERED_LAYOUTS, dotplanes_fit

FUSED_MODES = ("dense", *SPARSITY_MODES)


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class FusedFFN(MatrixOp):
    """The partial sum of an FFN's active neurons, as one fused kernel: ``sum_i h_i down[i]``.

    The op's ``n`` neurons are rows of its weights: ``up`` and ``gate`` [n, hidden], or, in the
    layout the gather kernels prefer, ``up_gate`` [n, 2, hidden] (neuron i's up row, then its gate
    row: one contiguous stream per neuron; ``up_gate_bias`` [n, 2] likewise); and the neuron-major
    ``down`` [n, hidden] (row i is neuron i's column of the layer's down projection). ``h_i``
    follows ``form``. Which neurons are active follows ``mode``: ``dense`` every one;
    ``predictor`` columns ``neuron_offset .. neuron_offset + n`` of ``mask`` (a ``predict`` op
    trained for ``layer``; ``threshold`` is then the activity level it was trained to recall,
    informative); ``gate-first`` those whose activity score (times ``score_scale[i]``, when given:
    see ``ffn``) exceeds ``threshold``; ``down-only``
    those with ``|h_i| > threshold``. Inactive neurons contribute exactly zero.

    ``layer`` names the value of the whole FFN layer. When the op *is* the layer (``result ==
    layer``) it adds ``down_bias``; the parts of a split layer carry none and are added by a
    ``merge`` whose result is ``layer``. ``freq`` (profiled activation frequency per neuron) is
    informative, as on ``ffn``. ``x_format`` applies to the up and gate rows when both are 4-bit
    (the down rows are added, not dotted); ``layout`` to the matrices the mode reads whole
    (gate-first's gate, down-only's gate and up); ``gathered_layout`` (``select-kernels``) to the
    rows it gathers and dots (up; gate too in predictor and dense modes): ``"rows"``, or
    ``"dotplanes"`` where x is rounded (``picc.kernel_names.gathered_layout``: each row's 4-bit
    nibbles, then its scales, ``picc.codegen_cpu.dotplanes``). Storage only; the values are the same.
    """

    NAME: ClassVar[str] = "fused_ffn"
    x: Val
    mask: Val | None = None
    up: Sym | None = None
    gate: Sym | None = None
    up_gate: Sym | None = None
    down: Sym
    up_bias: Sym | None = None
    gate_bias: Sym | None = None
    up_gate_bias: Sym | None = None
    down_bias: Sym | None = None
    freq: Sym | None = None
    score_scale: Sym | None = None
    form: str
    mode: str
    threshold: float = 0.0
    layer: str
    neuron_offset: int = 0
    gathered_layout: str = "rows"

    @property
    def whole_layer(self) -> bool:
        return self.result == self.layer

    @property
    def interleaved(self) -> bool:
        return self.up_gate is not None

    def n_neurons(self, env: TypeEnv) -> int:
        n = env.weight(self.down).shape[0]
        assert isinstance(n, int)
        return n

    def _check_rows(self, env: TypeEnv, n: Dim, hidden: Dim, gated: bool) -> None:
        if self.up_gate is not None:
            expect(gated, f"up_gate @{self.up_gate} interleaves up and gate, but form {self.form!r} has no gate")
            expect(self.up is None and self.gate is None and self.up_bias is None and self.gate_bias is None,
                   "give either up_gate (interleaved) or up and gate, not both")
            weight_shape_is(env, self.up_gate, (n, 2, hidden), "up_gate")
            weight_shape_is(env, self.up_gate_bias, (n, 2), "up_gate_bias")
            _float_weight(env, self.up_gate_bias, "up_gate_bias")
            expect(self.mode != "gate-first", "mode 'gate-first' reads the gate densely: it needs up and gate "
                   "apart, not up_gate")
            return
        expect(self.up is not None, "an up weight (or up_gate) is needed")
        expect(self.up_gate_bias is None, "up_gate_bias goes with up_gate")
        weight_shape_is(env, self.up, (n, hidden), "up")
        if gated:
            expect(self.gate is not None, f"form {self.form!r} needs a gate weight")
            weight_shape_is(env, self.gate, (n, hidden), "gate")
        else:
            expect(self.gate is None and self.gate_bias is None, f"form {self.form!r} has no gate, but one is given")
        for name, role in ((self.up_bias, "up_bias"), (self.gate_bias, "gate_bias")):
            weight_shape_is(env, name, (n,), role)
            _float_weight(env, name, role)

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        expect(self.form in FFN_FORMS, f"form must be one of {tuple(FFN_FORMS)}, got {self.form!r}")
        expect(self.mode in FUSED_MODES, f"mode must be one of {FUSED_MODES}, got {self.mode!r}")
        down = env.weight(self.down)
        expect(down.rank == 2 and down.shape[1] == t.shape[1],
               f"down @{self.down} must be neuron-major [neurons, {t.shape[1]}], got {down}")
        n, hidden = down.shape
        gated = FFN_FORMS[self.form].gated
        self._check_rows(env, n, hidden, gated)
        for name, shape, role in ((self.down_bias, (hidden,), "down_bias"), (self.freq, (n,), "freq"),
                                  (self.score_scale, (n,), "score_scale")):
            weight_shape_is(env, name, shape, role)
            _float_weight(env, name, role)
        expect(bool(self.layer), "layer (the FFN value this op computes, or part of) must be named")
        expect(self.down_bias is None or self.whole_layer,
               f"only a whole layer adds down_bias; the parts of %{self.layer} leave it to their merge")
        expect(self.neuron_offset >= 0, f"neuron_offset must be >= 0, got {self.neuron_offset}")
        expect(self.threshold >= 0, f"threshold must be >= 0, got {self.threshold}")
        self.check_kernel_choice()
        expect(self.gathered_layout in GATHERED_LAYOUTS,
               f"gathered_layout must be one of {GATHERED_LAYOUTS}, got {self.gathered_layout!r}")
        if self.gathered_layout == "dotplanes":
            up_w, gate_w = self.up_gate or self.up, self.up_gate or self.gate
            up = env.weight(up_w).dtype.value if up_w else ""
            gate = env.weight(gate_w).dtype.value if gate_w else None
            expect(dotplanes_fit(self.mode, self.x_format, up, gate),
                   f"gathered_layout 'dotplanes' holds 4-bit rows of one format that a {self.mode!r} kernel dots "
                   f"with rounded x; x_format is {self.x_format!r}, up {up}, gate {gate}")
        if self.mode == "predictor":
            expect(self.mask is not None, "mode 'predictor' needs a mask operand")
            assert self.mask is not None and isinstance(n, int)
            m = env.value(self.mask)
            end = self.neuron_offset + n
            expect(m.dtype == DType.BOOL and m.rank == 2 and m.shape[0] == t.shape[0]
                   and isinstance(m.shape[1], int) and m.shape[1] >= end,
                   f"mask %{self.mask} must be bool[{t.shape[0]}, >= {end}] (neurons "
                   f"{self.neuron_offset}..{end - 1} of the layer), got {m}")
        else:
            expect(self.mask is None, f"mode {self.mode!r} computes its own active set; got mask %{self.mask}")
        expect(self.mode != "gate-first" or gated, f"mode 'gate-first' needs a gated form, got {self.form!r}")
        expect(self.score_scale is None or self.mode == "gate-first",
               f"score_scale scales the gate-first decision; mode {self.mode!r} does not make one")
        return t

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        check_mask_producer(self.mask, self.x, self.layer, producer)


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Merge(Op):
    """The output of an FFN layer split between devices: ``a + b (+ bias)``.

    ``a`` and ``b`` are the partial sums of the layer's two ``fused_ffn`` parts (their ``layer``
    is this op's result), ``bias`` the layer's down bias. The device that runs the merge receives
    the other device's partial sum: one activation vector per layer crosses between them.
    """

    NAME: ClassVar[str] = "merge"
    a: Val
    b: Val
    bias: Sym | None = None

    def infer(self, env: TypeEnv) -> TensorType:
        a = _activation_input(env, self.a)
        b = _activation_input(env, self.b)
        expect(a == b, f"partial sums must have the same type, got %{self.a}: {a} and %{self.b}: {b}")
        weight_shape_is(env, self.bias, (a.shape[1],), "bias")
        _float_weight(env, self.bias, "bias")
        return a

    @property
    def can_accumulate(self) -> bool:
        """On the GPU its kernel has a variant that also adds the residual."""
        return self.type.placement == Placement.GPU

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        parts = [producer(self.a), producer(self.b)]
        for name, part in zip((self.a, self.b), parts, strict=True):
            expect(isinstance(part, FusedFFN) and part.layer == self.result and not part.whole_layer,
                   f"%{name} must be a fused_ffn part of layer %{self.result}")
        a, b = parts
        assert isinstance(a, FusedFFN) and isinstance(b, FusedFFN)
        expect(a.neuron_offset != b.neuron_offset, f"%{self.a} and %{self.b} are the same neurons of the layer")
