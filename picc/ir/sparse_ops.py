"""Sparse FFN ops: a predictor of the active neurons, and an FFN that computes only those.

Three ways to know a layer's active set (``SparseFFN.mode``):

* ``predictor`` (PowerInfer): a low-rank MLP ``predict`` op guesses it from the FFN input before
  any FFN weight is read; misses cost accuracy, extras cost time.
* ``gate-first`` (exact, GLU forms): the gate projection is computed densely; neurons whose
  activity score is at most ``threshold`` are skipped in up and down.
* ``down-only`` (exact, TEAL-style): gate and up are computed densely; the columns of down whose
  ``|h_i|`` is at most ``down_threshold`` are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from picc.ir.core import Op, Sym, TypeEnv, Val, expect, expect_rank, register_op, weight_shape_is
from picc.ir.ops import FFN, _activation_input
from picc.ir.types import DType, TensorType

SPARSITY_MODES = ("predictor", "gate-first", "down-only")


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class Predict(Op):
    """The predicted active set of the FFN named ``ffn``: ``fc2(relu(fc1(x))) > threshold``.

    ``fc1`` is [rank, hidden], ``fc2`` [n_ff, rank] (biases optional); the result is
    bool[seq, n_ff]. ``threshold`` is on the logit and is chosen for recall: a missed active
    neuron costs accuracy, an extra one only time. ``recall`` records what the predictor reached
    on held-out calibration tokens (informative).
    """

    NAME: ClassVar[str] = "predict"
    x: Val
    fc1: Sym
    fc2: Sym
    fc1_bias: Sym | None = None
    fc2_bias: Sym | None = None
    ffn: str
    threshold: float = 0.0
    recall: float | None = None

    def rank(self, env: TypeEnv) -> int:
        r = env.weight(self.fc1).shape[0]
        assert isinstance(r, int)
        return r

    def infer(self, env: TypeEnv) -> TensorType:
        t = _activation_input(env, self.x)
        fc1, fc2 = env.weight(self.fc1), env.weight(self.fc2)
        expect_rank(f"fc1 @{self.fc1}", fc1, 2)
        expect_rank(f"fc2 @{self.fc2}", fc2, 2)
        rank, hidden = fc1.shape
        n_ff = fc2.shape[0]
        expect(hidden == t.shape[1], f"fc1 @{self.fc1} takes {hidden} inputs but %{self.x} has {t.shape[1]}")
        expect(fc2.shape[1] == rank, f"fc2 @{self.fc2} takes {fc2.shape[1]} inputs but fc1 has rank {rank}")
        assert isinstance(rank, int) and isinstance(n_ff, int) and isinstance(hidden, int)
        expect(0 < rank < min(hidden, n_ff),
               f"predictor rank {rank} must be below min(hidden, n_ff) = {min(hidden, n_ff)}: "
               "a full-rank predictor costs more than the FFN it predicts")
        weight_shape_is(env, self.fc1_bias, (rank,), "fc1_bias")
        weight_shape_is(env, self.fc2_bias, (n_ff,), "fc2_bias")
        expect(bool(self.ffn), "ffn (the op the predictor was trained for) must be named")
        return TensorType(DType.BOOL, (t.shape[0], n_ff))


@register_op
@dataclass(frozen=True, slots=True, kw_only=True)
class SparseFFN(FFN):
    """An ``ffn`` that computes only its active neurons; the others contribute exactly zero.

    ``mode`` says how the active set is known (see the module docstring): ``mask`` (a
    ``predict`` op trained for this op) in ``predictor`` mode; ``threshold`` on the activity
    score in ``gate-first`` mode; ``down_threshold`` on ``|h_i|`` in ``down-only`` mode.
    """

    NAME: ClassVar[str] = "sparse_ffn"
    mask: Val | None = None
    mode: str

    def infer(self, env: TypeEnv) -> TensorType:
        t = FFN.infer(self, env)
        expect(self.mode in SPARSITY_MODES, f"mode must be one of {SPARSITY_MODES}, got {self.mode!r}")
        n_ff = self.n_ff(env)
        if self.mode == "predictor":
            expect(self.mask is not None, "mode 'predictor' needs a mask operand")
            assert self.mask is not None
            m = env.value(self.mask)
            expect(m.dtype == DType.BOOL and m.rank == 2 and m.shape[0] == t.shape[0],
                   f"mask %{self.mask} must be bool[{t.shape[0]}, neurons], got {m}")
            width = m.shape[1]
            if self.part_of is None:
                expect(width == n_ff, f"mask %{self.mask} must be bool[{t.shape[0]}, {n_ff}], got {m}")
            else:
                end = self.neuron_offset + n_ff
                expect(isinstance(width, int) and width >= end,
                       f"mask %{self.mask} {m} has no neurons {self.neuron_offset}..{end - 1} for this part")
        else:
            expect(self.mask is None, f"mode {self.mode!r} computes its own mask; got mask %{self.mask}")
        if self.mode == "gate-first":
            expect(self.spec.gated, f"mode 'gate-first' needs a gated form, got {self.form!r}")
            expect(self.threshold is not None, "mode 'gate-first' needs the layer's threshold")
        if self.mode == "down-only":
            expect(self.down_threshold is not None, "mode 'down-only' needs the layer's down_threshold")
        return t

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        check_mask_producer(self.mask, self.x, self.part_of or self.result, producer)


def check_mask_producer(mask: str | None, x: str, layer: str, producer: Callable[[str], Op | None]) -> None:
    """A sparse or fused FFN's ``mask`` (if any) comes from the predict op trained for ``layer``
    that reads the FFN's own input ``x``."""
    if mask is None:
        return
    pred = producer(mask)
    expect(isinstance(pred, Predict), f"mask %{mask} must come from a predict op")
    assert isinstance(pred, Predict)
    expect(pred.ffn == layer, f"mask %{mask} comes from a predictor trained for %{pred.ffn}, not %{layer}")
    expect(pred.x == x, f"mask %{mask} predicts from %{pred.x} but the FFN reads %{x}")
