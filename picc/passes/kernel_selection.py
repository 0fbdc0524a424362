"""The kernel that computes an op on its device, for ``select-kernels``.

A kernel's name is a pure function of the op: its class, its attributes (the kernel choices
``x_format`` and ``layout`` among them), its types and its placement -- and, on the GPU, whether
an ``add``'s ``accumulated_by`` gives its kernel the residual add (a variant that reads the
residual and writes the add's result). The names come from
:mod:`picc.kernel_names`, whose rules the backends share. An op that its device has no kernel
for is a ``PiccError`` that names the op and what to do instead.
"""

from __future__ import annotations

from picc import kernel_names as names
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.sparse_ops import Predict
from picc.ir.types import Placement, TensorType


class Types:
    """The types an op's kernel depends on: its values' and its weights'."""

    def __init__(self, values: dict[str, TensorType], weights: dict[str, TensorType]) -> None:
        self.values, self.weights = values, weights

    def fmt(self, weight: str | None) -> str | None:
        return None if weight is None else self.weights[weight].dtype.value

    def dims(self, weight: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.weights[weight].shape)

    def width(self, value: str) -> int:
        return int(self.values[value].shape[-1])


def _no_kernel(op: Op, device: str, hint: str) -> PiccError:
    return PiccError(f"%{op.result}: op {op.NAME} has no {device} kernel{hint}")


def rows8_fits(t: Types, weights: tuple[str | None, ...], shared: frozenset[str], x_format: str = "f32") -> bool:
    """Whether the 4-bit ``weights`` (all given; q8_0 too with int8 ``x_format``) can be stored in
    the rows8 layout for one kernel: shapes that fit it, and no other op in ``shared`` reading them."""
    return all(w is not None and w not in shared and names.rows8_fits(t.fmt(w) or "", *t.dims(w), x_format)
               for w in weights)


def cpu_kernel(op: Op, t: Types) -> str:  # noqa: C901 - one case per op
    """The CPU kernel that computes ``op``."""
    match op:
        case O.Embed():
            return names.cpu_embed(t.fmt(op.table) or "", op.layout == "rows8", op.scale != 1.0)
        case O.RMSNorm():
            return names.cpu_norm("rms_norm", op.group is not None)
        case O.LayerNorm():
            return names.cpu_norm("layer_norm")
        case O.Linear():
            return names.cpu_gemv(t.fmt(op.weight) or "", op.x_format, op.layout == "rows8")
        case O.Rope():
            return names.cpu_rope(op.style)
        case O.ConcatHeads():
            return names.cpu_concat_heads()
        case O.Attention() if op.alibi == "none":
            return names.cpu_attention(op.kv_format, op.softcap is not None, op.sinks is not None)
        case O.Add():
            return names.cpu_elementwise("add")
        case O.Softcap():
            return names.cpu_elementwise("softcap")
        case O.MoE():
            return names.cpu_moe(op.form, t.fmt(op.router) or "", t.fmt(op.up) or "", t.fmt(op.gate),
                                 t.fmt(op.down) or "", op.x_format, op.layout == "rows8", op.variant)
        case Merge():
            return names.cpu_elementwise("merge")
        case Predict():
            return names.cpu_predictor(t.fmt(op.fc1) or "", t.fmt(op.fc2) or "")
        case FusedFFN():
            up = op.up_gate or op.up
            gate = op.up_gate or op.gate
            return names.cpu_fused_ffn(op.mode, op.form, t.fmt(up) or "", t.fmt(gate), t.fmt(op.down) or "",
                                       op.interleaved, op.x_format, op.layout == "rows8", op.gathered_layout)
        case O.FFN() if not op.neuron_major and type(op) is O.FFN:
            return names.cpu_dense_ffn(op.form, t.fmt(op.up) or "", t.fmt(op.gate), t.fmt(op.down) or "",
                                       op.x_format, op.layout == "rows8")
        case O.FFN():
            raise PiccError(f"%{op.result}: a sparse or neuron-major ffn has no kernel of its own; "
                            "run fuse-gather-gemv before select-kernels")
    hint = " (ALiBi attention runs in the interpreter only)" if isinstance(op, O.Attention) else ""
    raise _no_kernel(op, "CPU", hint)


def gpu_kernel(op: Op, t: Types, ctx: int, residual: bool = False) -> str:  # noqa: C901 - one case per op
    """The GPU kernel that computes ``op``, for KV caches of ``ctx`` positions; ``residual``: the
    variant that also does a residual add (only ops whose ``can_accumulate`` says so)."""
    if residual and not op.can_accumulate:
        raise PiccError(f"%{op.result}: op {op.NAME} has no GPU kernel that adds a residual")
    hint = "; compile with --vram 0 to keep it on the CPU"
    match op:
        case O.Embed():
            vocab, dim = t.dims(op.table)
            return names.gpu_embed(vocab, dim, t.fmt(op.table) or "", op.scale)
        case O.Linear():
            rows, cols = t.dims(op.weight)
            return names.gpu_gemv(rows, cols, t.fmt(op.weight) or "", op.bias is not None, residual)
        case O.RMSNorm():
            return names.gpu_norm("rms_norm", t.width(op.x), op.eps, group=op.group)
        case O.LayerNorm():
            return names.gpu_norm("layer_norm", t.width(op.x), op.eps, op.bias is not None)
        case O.Rope():
            return names.gpu_rope(op.style, op.n_heads, op.head_dim, op.rotated)
        case O.ConcatHeads():
            return names.gpu_concat_heads(op.n_heads, t.width(op.a) // op.a_dim, op.a_dim, t.width(op.b) // op.b_dim,
                                          op.b_dim)
        case O.Attention() if op.alibi == "none" and op.kv_format == "f32":
            return names.gpu_attention(op.n_heads, op.n_kv_heads, op.head_dim, ctx, op.window, op.scale, op.softcap,
                                       op.sinks is not None, op.v_dim)
        case O.Add():
            return names.gpu_add(t.width(op.result))
        case O.Softcap():
            return names.gpu_softcap(t.width(op.result), op.cap)
        case Merge():
            return names.gpu_merge(t.width(op.result), op.bias is not None, residual)
        case Predict():
            rank, hidden = t.dims(op.fc1)
            (n, _) = t.dims(op.fc2)
            return names.gpu_predictor(hidden, rank, n, t.fmt(op.fc1) or "", op.fc1_bias is not None,
                                 op.fc2_bias is not None)
        case FusedFFN():
            return gpu_kernel_of_ffn(op, t, hint, residual)
    if isinstance(op, O.Attention):
        raise _no_kernel(op, "GPU", " for ALiBi" + hint)
    raise _no_kernel(op, "GPU", hint)


def gpu_ffn_unsupported(op: O.FFN | FusedFFN, formats: set[str | None]) -> str | None:
    """Why no GPU kernel computes ``op`` (an ``ffn``, ``sparse_ffn`` or ``fused_ffn`` whose
    weights are in ``formats``), or None. ``partition-neurons`` keeps such layers on the CPU."""
    mode = getattr(op, "mode", "dense")
    if "mxfp4" in formats:
        return "the GPU kernels read no mxfp4 weights"
    if mode == "down-only":
        return "down-only FFNs have no GPU kernel; use --sparsity-mode gate-first or predictor"
    if len({f for f in formats if f is not None}) != 1:
        return f"the GPU FFN kernels need up, gate and down in one format, got {sorted(f for f in formats if f)}"
    biases = (op.up_bias, op.gate_bias, getattr(op, "up_gate_bias", None))
    if mode == "gate-first" and any(b is not None for b in biases):
        return "the GPU gate-first kernel takes no biases"
    if mode == "gate-first" and op.form == "drelu":
        return "the GPU gate-first kernel has no dReLU form"
    return None


def gpu_kernel_of_ffn(op: FusedFFN, t: Types, hint: str, residual: bool = False) -> str:
    n, hidden = t.dims(op.down)
    formats = {t.fmt(w) for w in (op.up, op.gate, op.up_gate, op.down) if w is not None}
    if (reason := gpu_ffn_unsupported(op, formats)) is not None:
        raise PiccError(f"%{op.result}: {reason}{hint}")
    bias = any(b is not None for b in (op.up_bias, op.gate_bias, op.up_gate_bias))
    if op.mode in ("predictor", "dense") and O.FFN_FORMS[op.form].gated and not op.interleaved:
        raise PiccError(f"%{op.result}: the GPU gathers a neuron's up and gate rows as one stream; run "
                        f"fuse-gather-gemv with interleave=auto{hint}")
    # With a down bias, the bias_add launch after the FFN does the residual add, not the FFN.
    return names.gpu_fused_ffn(op.mode, op.form, hidden, n, formats.pop() or "", bias,
                               residual and op.down_bias is None)


def kernel_of(op: Op, t: Types, ctx: int, residual: bool = False) -> str:
    """The kernel of ``op`` on the device its type places it on (unplaced ops run on the CPU);
    ``residual``: an add's ``accumulated_by`` names ``op`` (on the CPU that is an argument of
    the same kernel, on the GPU a variant of it)."""
    if op.type.placement == Placement.GPU:
        return gpu_kernel(op, t, ctx, residual)
    return cpu_kernel(op, t)
