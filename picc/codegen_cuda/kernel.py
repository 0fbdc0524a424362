"""What a kernel is: an unscheduled TensorIR function plus its calling convention (ABI).

Every kernel factory in this package returns a ``Kernel``. Its ``func`` is the *definition*: the
plain TensorIR the host build compiles as is and the GPU schedules (``schedules.py``) rewrite.
``params`` lists the buffers in call order; a buffer's ``role`` says who provides it:

* ``in``      read only, provided by the caller (weights, activations, index lists);
* ``out``     written by the kernel (the caller allocates it on the device);
* ``inout``   read and written in place (the KV cache);
* ``scratch`` workspace the caller allocates (intermediates that cross kernel launches, e.g. the
  per-neuron dot products of a sparse FFN); explicit so the runtime can count it in its budget.

``guards`` names the reductions whose rows may be skipped: for each block, a function of the
function's buffers and the output index that says whether the row is computed. The definition
already yields zero for a skipped row (an ``if_then_else`` in its reduction); the GPU schedule
additionally wraps the row's whole loop nest in the guard so that no weight of a skipped row is
loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr

from picc.errors import PiccError
from runtime.gpu_layout import element_bytes

ROLES = ("in", "out", "inout", "scratch")

Guard = Callable[..., PrimExpr]
"""``guard(buffers_by_name, *index) -> bool PrimExpr``: whether the reduction at output ``index``
(the block's spatial axes, in order) is computed."""


@dataclass(frozen=True, slots=True)
class Param:
    """One buffer of a kernel's calling convention."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_bytes(self.dtype)


@dataclass(frozen=True, slots=True, eq=False)
class Kernel:
    """A named TensorIR kernel with its ABI; ``kind`` selects its GPU schedule."""

    name: str
    kind: str
    func: tirx.PrimFunc
    params: tuple[Param, ...]
    guards: dict[str, Guard] = field(default_factory=dict)
    options: dict[str, int] = field(default_factory=dict)  # schedule knobs fixed by the factory

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise PiccError(f"kernel {self.name} has no parameter {name!r}; it takes "
                        f"{', '.join(p.name for p in self.params)}")


def make_kernel(name: str, kind: str, tensors: list[tuple[te.Tensor, str]], *,
                guards: dict[str, Guard] | None = None, options: dict[str, int] | None = None) -> Kernel:
    """Build a ``Kernel`` from TE tensors in call order, each with its role."""
    for t, role in tensors:
        if role not in ROLES:
            raise ValueError(f"role of {t.name} must be one of {ROLES}, got {role!r}")
    func = te.create_prim_func([t for t, _ in tensors]).with_attr("global_symbol", name)
    params = tuple(Param(t.name, tuple(int(s) for s in t.shape), str(t.dtype), role) for t, role in tensors)
    return Kernel(name, kind, func, params, guards or {}, options or {})


def kernel_from_func(name: str, kind: str, func: tirx.PrimFunc, roles: dict[str, str],
                     options: dict[str, int] | None = None) -> Kernel:
    """A ``Kernel`` from a hand-written TVMScript function (for scatters and scans TE cannot say)."""
    params = []
    for buf in func.params:  # in this TVM, a PrimFunc's params are its buffers
        params.append(Param(buf.name, tuple(int(s) for s in buf.shape), str(buf.dtype), roles[buf.name]))
    return Kernel(name, kind, func.with_attr("global_symbol", name), tuple(params), {}, options or {})


def f32(value: float) -> PrimExpr:
    return tirx.const(value, "float32")


def activation(name: str, x: PrimExpr) -> PrimExpr:
    """``picc.interpreter.activation`` as a TIR expression (float32)."""
    if name == "relu":
        return tirx.max(x, f32(0))
    if name == "silu":
        return x / (f32(1) + tirx.exp(-x))
    if name == "gelu":
        return f32(0.5) * x * (f32(1) + tirx.erf(x / f32(1.4142135623730951)))
    if name == "gelu_tanh":
        inner = f32(0.7978845608028654) * (x + f32(0.044715) * x * x * x)
        return f32(0.5) * x * (f32(1) + tirx.tanh(inner))
    raise PiccError(f"activation {name!r} has no GPU kernel; expected relu, silu, gelu or gelu_tanh")


def check_positive(**dims: int) -> None:
    for name, value in dims.items():
        if int(value) <= 0:
            raise PiccError(f"kernel shape {name} must be > 0, got {value}")
