"""``fuse-gather-gemv``: each FFN layer, or each device's part of one, becomes one fused kernel
call, and a layer split between devices gets an explicit merge of its partial sums.

The fused FFN is PowerInfer's hot path: which neurons are active (the predictor's mask, the
thresholded gate, or all), the gather-GEMV over their rows of up and gate, the activation, and
the down projection as an AXPY over the same neurons' rows of the neuron-major down matrix, in
one kernel per device. Where that kernel gathers both up and gate rows (predictor and dense
modes of a gated form), their rows are interleaved into one ``up_gate`` weight, so each active
neuron is one contiguous stream instead of two (``interleave=no`` keeps them apart). The split
layer's ``add`` of its hot and cold parts becomes a ``merge`` that also adds the down bias.
``select-kernels`` then chooses and names each op's kernel.

Needs: neuron-major down projections for sparse FFNs (``neuron-major-down``); after
``partition-neurons`` when there is one. Guarantees: no ``sparse_ffn`` and no neuron-major
``ffn`` is left; the module computes the same function (partial sums are added in another order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module, WeightDecl
from picc.ir.sparse_ops import SparseFFN
from picc.ir.types import TensorType
from picc.ir.weights import Tensor, WeightStore
from picc.passes.options import PassOptions, option
from picc.passes.registry import PassContext, register_pass


@dataclass(frozen=True)
class FuseOptions(PassOptions):
    """``interleave``: ``auto`` interleaves the up and gate rows a kernel gathers both of, ``no`` keeps them apart."""

    interleave: str = option("auto", choices=("auto", "no"))


def _threshold(op: O.FFN) -> float:
    """The fused op's threshold: on the activity score (gate-first; in predictor mode, the level
    the predictor was trained to recall, informative) or on ``|h|`` (down-only)."""
    if isinstance(op, SparseFFN) and op.mode == "down-only":
        return float(op.down_threshold or 0.0)
    if isinstance(op, SparseFFN):
        return float(op.threshold or 0.0)
    return 0.0


def _packed_name(weights: WeightStore, name: str, role: str) -> str:
    """``l3.ffn.up`` -> ``l3.ffn.up.up_gate`` (a fresh name in the store; a name only)."""
    return weights.fresh_name(f"{name}.{role}")


def _interleave(weights: WeightStore, up: str, gate: str) -> Tensor:
    """Rows of ``up`` and ``gate`` side by side per neuron: [n, 2, hidden], in their storage format."""
    a, b = weights[up], weights[gate]
    if a.dtype != b.dtype:
        raise PiccError(f"@{up} is {a.dtype.value} but @{gate} is {b.dtype.value}; interleaving needs one format")
    n, hidden = a.shape
    rows = np.stack([np.asarray(a.data).reshape(n, -1), np.asarray(b.data).reshape(n, -1)], axis=1)
    return Tensor(a.dtype, (n, 2, hidden), np.ascontiguousarray(rows))


def _interleave_biases(weights: WeightStore, n: int, up_bias: str | None, gate_bias: str | None) -> Tensor:
    zero = np.zeros(n, np.float32)
    up = weights.f32(up_bias) if up_bias else zero
    gate = weights.f32(gate_bias) if gate_bias else zero
    return Tensor.from_f32(np.stack([up, gate], axis=1))


class _Fuser:
    def __init__(self, module: Module, weights: WeightStore, interleave: bool) -> None:
        self.weights, self.interleave = weights, interleave
        self.decls = list(module.weights)
        self.placement = {d.name: d.type.placement for d in module.weights}

    def _add_weight(self, name: str, tensor: Tensor, like: str) -> None:
        self.weights.add(name, tensor)
        self.decls.append(WeightDecl(name, TensorType(tensor.dtype, tensor.shape, self.placement[like])))

    def fuse(self, op: O.FFN) -> FusedFFN:
        if not op.neuron_major:
            raise PiccError(f"%{op.result}: a sparse or split FFN needs its down projection neuron-major; "
                            "run neuron-major-down before fuse-gather-gemv")
        mode = op.mode if isinstance(op, SparseFFN) else "dense"
        rows: dict[str, str | None] = {"up": op.up, "gate": op.gate, "up_bias": op.up_bias, "gate_bias": op.gate_bias}
        if self.interleave and op.spec.gated and mode in ("predictor", "dense"):
            assert op.gate is not None
            name = _packed_name(self.weights, op.up, "up_gate")
            self._add_weight(name, _interleave(self.weights, op.up, op.gate), op.up)
            rows = {"up_gate": name}
            if op.up_bias or op.gate_bias:
                bias = _packed_name(self.weights, op.up, "up_gate_bias")
                n = int(self.weights[op.up].shape[0])
                self._add_weight(bias, _interleave_biases(self.weights, n, op.up_bias, op.gate_bias),
                                 op.up_bias or op.gate_bias or op.up)
                rows["up_gate_bias"] = bias
        layer = op.part_of or op.result
        return FusedFFN(result=op.result, type=op.type, x=op.x, mask=op.mask if isinstance(op, SparseFFN) else None,
                        down=op.down, down_bias=op.down_bias if op.part_of is None else None, freq=op.freq,
                        score_scale=op.score_scale if mode == "gate-first" else None, form=op.form, mode=mode,
                        threshold=_threshold(op), layer=layer, neuron_offset=op.neuron_offset, block=op.block,
                        **rows)


def _merge_of(op: Op, parts: dict[str, O.FFN]) -> Merge | None:
    """The ``add`` of a split layer's two parts as a ``merge`` carrying the layer's down bias."""
    if not isinstance(op, O.Add):
        return None
    a, b = parts.get(op.a), parts.get(op.b)
    if a is None or b is None or a.part_of != op.result or b.part_of != op.result:
        return None
    return Merge(result=op.result, type=op.type, a=op.a, b=op.b, bias=a.down_bias or b.down_bias, block=op.block)


@register_pass("fuse-gather-gemv", options=FuseOptions)
def fuse_gather_gemv(module: Module, ctx: PassContext[FuseOptions]) -> Module:
    """Fuse each FFN (part) into one kernel call and merge split layers."""
    func = module.function()
    if any(op.kernel is not None or isinstance(op, FusedFFN) for op in func.ops):
        raise PiccError("the module is already fused (fuse-gather-gemv comes before select-kernels)")
    fuser = _Fuser(module, ctx.weights, ctx.options.interleave == "auto")
    parts = {op.result: op for op in func.ops if isinstance(op, O.FFN) and op.part_of is not None}
    ops: list[Op] = []
    for op in func.ops:
        if isinstance(op, O.FFN) and (isinstance(op, SparseFFN) or op.neuron_major):
            ops.append(fuser.fuse(op))
        else:
            ops.append(_merge_of(op, parts) or op)
    fused = replace(module, weights=tuple(fuser.decls)).with_function(replace(func, ops=tuple(ops)))
    return fused.with_used_weights_only()
