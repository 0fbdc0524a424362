"""``neuron-major-down``: store each FFN's down projection transposed, one row per neuron.

Models store ``down`` as [hidden, n_ff]: neuron i is column i. The gather kernels read one
contiguous row per active neuron, and partitioning moves neurons between devices, so both want
``down`` neuron-major, [n_ff, hidden]. For float dtypes the transpose is exact. A quantized
``down`` is quantized in blocks along n_ff, which a neuron's column cuts across, so it is
dequantized, transposed and quantized again along hidden (what PowerInfer's converter does):
that changes the numbers by about one quantization step, which is why the pass runs before
profiling, so that thresholds, predictors and every later check see the weights that will run.

Option ``dtype``: ``same`` (default: the down's own dtype) or one of f32, f16, q8_0, q4_0, q4_1.
A quantized result needs hidden to be a multiple of the block size (32); otherwise the pass
falls back to f16 (the weight's declared type shows it). bf16 becomes f16 likewise. An mxfp4
``down`` (gpt-oss's format) becomes q8_0: the AXPYs of neuron-major rows read the rowplanes
layout, which holds no mxfp4, and the transpose quantizes again anyway (q8_0 adds the least).

Needs: ffn ops (``canonicalize``). Guarantees: every ffn / sparse_ffn has ``neuron_major``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Module, WeightDecl
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore
from picc.passes.options import PassOptions, option
from picc.passes.registry import PassContext, register_pass
from picc.progress import progress_bar
from picc.quant import BLOCK_SIZE

DTYPES = ("same", "f32", "f16", "q8_0", "q4_0", "q4_1")


def transposed_down(down: Tensor, dtype: DType) -> Tensor:
    """``down`` [hidden, n_ff] as [n_ff, hidden] in ``dtype``; exact when neither is quantized."""
    if not down.dtype.is_quantized and dtype == down.dtype:
        return Tensor(dtype, down.shape[::-1], down.data.T.copy())
    return Tensor.from_f32(down.to_f32().T, dtype)


def _target_dtype(down: Tensor, wanted: str) -> DType:
    dtype = down.dtype if wanted == "same" else DType(wanted)
    if dtype == DType.BF16:
        return DType.F16  # bf16 -> f32 -> f16 would round twice; kernels read f16
    if dtype == DType.MXFP4:
        return DType.Q8_0  # see the module doc
    hidden = down.shape[0]
    if dtype.is_quantized and hidden % BLOCK_SIZE[dtype.value]:
        return DType.F16
    return dtype


def _transpose(op: O.FFN, weights: WeightStore, decls: list[WeightDecl], wanted: str, done: dict[str, str]) -> Op:
    if op.neuron_major:
        return op
    if op.down not in done:
        down = weights[op.down]
        name = weights.fresh_name(f"{op.down}_t")
        weights.add(name, transposed_down(down, _target_dtype(down, wanted)))
        decls.append(WeightDecl(name, weights[name].type))
        done[op.down] = name
    return replace(op, down=done[op.down], neuron_major=True)


@dataclass(frozen=True)
class NeuronMajorOptions(PassOptions):
    """``dtype``: the neuron-major copy's weight format, ``same`` as the down projection's by default."""

    dtype: str = option("same", choices=DTYPES)


@register_pass("neuron-major-down", options=NeuronMajorOptions)
def neuron_major_down(module: Module, ctx: PassContext[NeuronMajorOptions]) -> Module:
    """Store every FFN's down projection neuron-major ([n_ff, hidden]) for the gather kernels."""
    dtype = ctx.options.dtype
    decls = list(module.weights)
    done: dict[str, str] = {}
    funcs = []
    todo = {op.down for op in module.ops() if isinstance(op, O.FFN) and not op.neuron_major}
    # A quantized down is dequantized, transposed and quantized again: ~0.7 s a layer of a 7B.
    with progress_bar(len(todo), "neuron-major down projections", "layer") as advance:
        for func in module.functions:
            ops = []
            for op in func.ops:
                if isinstance(op, O.FFN):
                    before = len(done)
                    op = _transpose(op, ctx.weights, decls, dtype, done)
                    advance(len(done) - before)
                ops.append(op)
            funcs.append(replace(func, ops=tuple(ops)))
    return replace(module, weights=tuple(decls), functions=tuple(funcs)).with_used_weights_only()
