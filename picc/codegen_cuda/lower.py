"""The GPU kernels of a placed module: one kernel per distinct (op, shape, format) the plan puts
on the GPU, and which kernel each GPU op calls.

Ops of the same shape share a kernel (the 30 layers of SmolLM2 share one attention kernel); a
split layer's hot part has its own neuron count, so hot parts of different sizes get different
FFN kernels. Decode kernels only (one token): prefill kernels and the executor that launches
these arrive with the hybrid runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from picc.codegen_cuda import dense, ffn, layers
from picc.codegen_cuda.kernel import Kernel
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import Placement
from picc.ir.weights import WeightStore


@dataclass
class GpuKernels:
    """The distinct kernels, and per GPU op the names of the kernels it launches, in order."""

    kernels: dict[str, Kernel] = field(default_factory=dict)
    calls: dict[str, list[str]] = field(default_factory=dict)

    def use(self, op: Op, name: str, make) -> None:  # noqa: ANN001 - make: () -> Kernel
        if name not in self.kernels:
            self.kernels[name] = make()
        self.calls.setdefault(op.result, []).append(name)


def _fmt(weights: WeightStore, name: str) -> str:
    return weights[name].dtype.value


def _dim(module: Module, value: str) -> int:
    d = module.function().value_types()[value].shape[-1]
    assert isinstance(d, int)
    return d


def gpu_kernels(module: Module, weights: WeightStore, ctx: int) -> GpuKernels:
    """The kernels of every op ``module`` places on the GPU (see the module docstring)."""
    out = GpuKernels()
    for op in module.function().ops:
        if op.type.placement != Placement.GPU:
            continue
        _lower(op, module, weights, ctx, out)
    return out


def _lower(op: Op, module: Module, weights: WeightStore, ctx: int, out: GpuKernels) -> None:  # noqa: C901
    match op:
        case O.Embed():
            vocab, dim = (int(d) for d in weights[op.table].shape)
            fmt = _fmt(weights, op.table)
            out.use(op, f"embed_{vocab}x{dim}_{fmt}", lambda: dense.embed(f"embed_{vocab}x{dim}_{fmt}", 1, vocab, dim,
                                                                           fmt))
        case O.Linear():
            rows, cols = (int(d) for d in weights[op.weight].shape)
            fmt, bias = _fmt(weights, op.weight), op.bias is not None
            name = f"gemv_{rows}x{cols}_{fmt}" + ("_bias" if bias else "")
            out.use(op, name, lambda: dense.gemv(name, rows, cols, fmt, bias))
        case O.RMSNorm():
            n = _dim(module, op.x)
            name = f"rms_norm_{n}"
            out.use(op, name, lambda: layers.rms_norm(name, 1, n, op.eps))
        case O.LayerNorm():
            n, bias = _dim(module, op.x), op.bias is not None
            name = f"layer_norm_{n}" + ("_bias" if bias else "")
            out.use(op, name, lambda: layers.layer_norm(name, 1, n, op.eps, bias))
        case O.Rope():
            name = f"rope_{op.style}_{op.n_heads}x{op.head_dim}_r{op.rotated}"
            out.use(op, name, lambda: layers.rope(name, 1, op.n_heads, op.head_dim, op.rotated, op.style))
        case O.Attention():
            if op.alibi != "none":
                raise PiccError(f"%{op.result}: ALiBi attention has no GPU kernel yet; compile with --vram 0")
            width = _dim(module, op.k)
            append = f"kv_append_{width}_ctx{ctx}"
            out.use(op, append, lambda: layers.kv_append(append, 1, width, ctx))
            name = f"attention_{op.n_heads}x{op.n_kv_heads}x{op.head_dim}_ctx{ctx}" + (
                f"_w{op.window}" if op.window else "")
            out.use(op, name, lambda: layers.attention(name, 1, op.n_heads, op.n_kv_heads, op.head_dim, ctx,
                                                       op.scale, op.window))
        case O.Add():
            n = _dim(module, op.result)
            out.use(op, f"add_{n}", lambda: layers.add(f"add_{n}", 1, n))
        case Predict():
            rank, hidden = (int(d) for d in weights[op.fc1].shape)
            n = int(weights[op.fc2].shape[0])
            fmt = _fmt(weights, op.fc1)
            b1, b2 = op.fc1_bias is not None, op.fc2_bias is not None
            name = f"predictor_{hidden}x{rank}x{n}_{fmt}" + ("_b1" if b1 else "") + ("_b2" if b2 else "")
            out.use(op, name, lambda: dense.predictor(name, hidden, rank, n, fmt, b1, b2))
            out.use(op, f"compact_{n}", lambda: dense.compact(f"compact_{n}", n, ffn.padded(n)))
        case O.FFN():
            _lower_ffn(op, weights, out)
        case _:
            raise PiccError(f"%{op.result}: op {op.NAME} has no GPU kernel yet; compile with --vram 0")


def _lower_ffn(op: O.FFN, weights: WeightStore, out: GpuKernels) -> None:
    if not op.neuron_major:
        raise PiccError(f"%{op.result}: the GPU FFN kernels need a neuron-major down projection")
    n, hidden = (int(d) for d in weights[op.up].shape)
    fmt = _fmt(weights, op.up)
    if op.gate is not None and _fmt(weights, op.gate) != fmt or _fmt(weights, op.down) != fmt:
        raise PiccError(f"%{op.result}: the GPU FFN kernels need up, gate and down in one format")
    bias = op.up_bias is not None or op.gate_bias is not None or op.down_bias is not None
    mode = op.mode if isinstance(op, SparseFFN) else "dense"
    if mode == "gate-first":
        if bias:
            raise PiccError(f"%{op.result}: the GPU gate-first kernel takes no biases yet")
        name = f"gate_first_ffn_{op.form}_{hidden}x{n}_{fmt}"
        out.use(op, name, lambda: ffn.gate_first_ffn(name, hidden, n, op.form, fmt))
    elif mode in ("predictor", "dense"):
        # Dense: the sparse kernel over a list of every neuron computes exactly the dense FFN.
        name = f"sparse_ffn_{op.form}_{hidden}x{n}_{fmt}" + ("_bias" if bias else "")
        out.use(op, name, lambda: ffn.sparse_ffn(name, hidden, n, op.form, fmt, bias=bias))
    else:
        raise PiccError(f"%{op.result}: {mode} FFNs have no GPU kernel yet; use --sparsity-mode gate-first "
                        "or predictor, or --vram 0")
