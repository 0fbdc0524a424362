"""A static proof that a CUDA kernel's global memory accesses stay inside their buffers.

It checks the *lowered* device functions (``tvm.compile``'s CUDA pipeline, up to codegen), not the
scheduled TensorIR, which can be right where the code is not: the FFN AXPY's final block carried
``T.where(k_1 < 16)``, ``LowerCrossThreadReduction`` dropped it, and threads 16..31 stored past ``y``.

Every load and store of a kernel parameter must be provably in bounds for every thread, by a
``tvm.sym.Analyzer`` that knows the thread ranges (the launch ``thread_extents``), the loop ranges
and the conditions of enclosing ``if``s and ``if_then_else``s (``select`` and ``&&`` may evaluate
both sides: they assume nothing). A vector (``Ramp``) index is checked at both ends. Loads inside
an index or condition (``W_ug[idx[r]]``) become variables whose values are the caller's promise:
``value_ranges``, per buffer name; without one, an index that depends on them is reported.

Not ``s_tir.analysis.OOBChecker``: it finds the FFN store in lowered code too, but passes
``y[idx[t]]`` knowing nothing of ``idx`` and stops at the first violation.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call, Expr, TensorLoad
from tvm.sym import Analyzer, ConstIntBound, ProofStrength
from tvm.tirx.build import split_host_device_mods

from picc.codegen_cuda.build import thread_extents
from picc.codegen_cuda.kernel import Kernel
from picc.codegen_cuda.schedules import arch_params, schedule
from picc.errors import PiccError

ValueRanges = Mapping[str, tuple[int, int]]
"""Buffer name -> (lo, hi): every value the (integer) buffer holds lies in [lo, hi]."""


def out_of_bounds(kernel: Kernel, arch: str, value_ranges: ValueRanges | None = None,
                  func: tirx.PrimFunc | None = None) -> list[str]:
    """One message per global access of ``kernel`` that is not provably inside its buffer, for
    ``kernel`` scheduled for ``arch`` (or ``func``, already scheduled), assuming integer buffers
    hold values in ``value_ranges``. Empty: every access of every thread is in bounds."""
    func = schedule(kernel, arch) if func is None else func
    devices, launches = device_functions(kernel, arch, func), thread_extents(func)
    if len(launches) != len(devices):
        raise PiccError(f"kernel {kernel.name}: {len(devices)} device functions but {len(launches)} launches")
    sizes = {p.name: p.nbytes for p in kernel.params}
    messages: list[str] = []
    for (entry, device), launch in zip(devices, launches, strict=True):
        checker = _LaunchChecker(f"{kernel.name} ({entry})", launch_extents(device, launch), sizes, value_ranges or {})
        messages += [m for m in checker.run(device) if m not in messages]
    return messages


def device_functions(kernel: Kernel, arch: str, func: tirx.PrimFunc) -> list[tuple[str, tirx.PrimFunc]]:
    """The ``__global__`` functions (by name, in launch order) CUDA codegen gets for ``kernel``
    scheduled as ``func`` for ``arch``."""
    arch_params(arch)
    host = "llvm" if tvm.runtime.enabled("llvm") else "c"
    target = tvm.target.Target({"kind": "cuda", "arch": arch}).with_host(host)
    mod = tirx.transform.BindTarget(target)(tvm.IRModule({kernel.name: func}))
    pipeline, _, finalize_device = tirx.get_default_tir_pipeline(target)
    _, devices = split_host_device_mods(pipeline(mod))
    found = [(gv.name_hint, f) for m in devices.values() for gv, f in finalize_device()(m).functions.items()]
    return sorted(found, key=lambda item: int(re.sub(r"^.*_kernel_?", "", item[0]) or 0))  # _kernel, _kernel_1..


def launch_extents(device: tirx.PrimFunc, launch: dict[str, int] | None = None) -> dict[str, int]:
    """Per thread axis, the largest extent the device function binds or ``launch`` gives: the
    block is that large, and all its threads run every part of the function."""
    extents = dict(launch or {})

    def note(node: tirx.AttrStmt) -> None:
        if node.attr_key == "thread_extent":
            tag = node.node.thread_tag
            extents[tag] = max(extents.get(tag, 1), int(node.value))

    tvm_ffi.structural_walk(device.body, [(tirx.AttrStmt, note)])
    return extents


class _LaunchChecker:
    """Walks one device function with an analyzer that knows what holds at each access."""

    def __init__(self, where: str, extents: dict[str, int], sizes: dict[str, int], value_ranges: ValueRanges) -> None:
        self.where, self.extents, self.value_ranges = where, extents, value_ranges
        self.sizes = sizes  # bytes of each kernel parameter
        self.analyzer = Analyzer()
        self.messages: list[str] = []
        self.written: set[str] = set()
        self.shared: dict[tuple[str, int], tirx.Var] = {}  # equal loads of read-only buffers
        self.unknown: dict[str, str] = {}  # value variable -> its buffer, which has no value range
        self.numbers = itertools.count()

    def run(self, device: tirx.PrimFunc) -> list[str]:
        tvm_ffi.structural_walk(device.body, [(tirx.BufferStore, lambda s: self.written.add(s.buffer.name))])
        tvm_ffi.structural_visit(device.body, [
            (tirx.AttrStmt, self._attr), (tirx.For, self._for), (tirx.IfThenElse, self._if),
            ((tirx.Bind, tirx.Let, tirx.LetStmt), self._bind), (tirx.BufferStore, self._store),
            (TensorLoad, self._load), (Call, self._call)])
        return self.messages

    def _attr(self, node: tirx.AttrStmt, visitor: tvm_ffi.StructuralVisitor) -> None:
        if node.attr_key == "thread_extent":
            extent = self.extents[node.node.thread_tag]
            self.analyzer.bind(node.node.var, tvm.ir.Range(0, extent), allow_override=True)
        visitor.visit(node.value)
        visitor.visit(node.body)

    def _for(self, node: tirx.For, visitor: tvm_ffi.StructuralVisitor) -> None:
        visitor.visit(node.min)
        visitor.visit(node.extent)
        loop = tvm.ir.Range.from_min_extent(self._abstract(node.min), self._abstract(node.extent))
        self.analyzer.bind(node.loop_var, loop, allow_override=True)  # a superset where step > 1
        visitor.visit(node.body)

    def _if(self, node: tirx.IfThenElse, visitor: tvm_ffi.StructuralVisitor) -> None:
        self._branches(node.condition, node.then_case, node.else_case, visitor)

    def _call(self, node: Call, visitor: tvm_ffi.StructuralVisitor) -> None:
        if getattr(node.op, "name", "") == "prim.if_then_else":
            self._branches(*node.args, visitor)
        else:
            visitor.default_visit(node)

    def _branches(self, condition: Expr, then: tvm_ffi.Object, otherwise: tvm_ffi.Object | None,
                  visitor: tvm_ffi.StructuralVisitor) -> None:
        visitor.visit(condition)
        with self._assuming(condition):
            visitor.visit(then)
        if otherwise is not None:
            with self._assuming(tirx.Not(condition)):
                visitor.visit(otherwise)

    def _bind(self, node: tirx.Bind | tirx.Let | tirx.LetStmt, visitor: tvm_ffi.StructuralVisitor) -> None:
        """``v = value`` (a common subexpression): the analyzer substitutes ``value`` for ``v``."""
        visitor.visit(node.value)
        if _is_int(node.var):
            self.analyzer.bind(node.var, self._abstract(node.value), allow_override=True)
        if getattr(node, "body", None) is not None:
            visitor.visit(node.body)

    def _assuming(self, condition: Expr) -> AbstractContextManager[object]:
        """Assume ``condition`` inside, where it is one boolean (a vector says nothing alone),
        simplified first: the analyzer's bounds read ``a <= b`` but not ``!(b < a)``, an else
        branch's condition."""
        condition = condition.value if isinstance(condition, tirx.Broadcast) else condition
        if _dtype(condition).lanes > 1:
            return nullcontext()
        return self.analyzer.constraint_scope(self.analyzer.rewrite_simplify(self._abstract(condition)))

    def _abstract(self, expr: Expr) -> Expr:
        """``expr`` with every buffer load replaced by a variable for its value, and shifts and
        masks by constants written as the divisions they are (the analyzer reasons about those)."""
        divisions = ((tirx.RShift, tirx.BitwiseAnd), _as_division)
        return tvm_ffi.structural_map(expr, [(TensorLoad, self._value_of), divisions])

    def _value_of(self, load: TensorLoad) -> tirx.Var:
        """The variable for ``load`` (indices already abstracted): within the buffer's value
        range, and one for all equal loads of a buffer the function never writes."""
        name = load.source.name
        key = (name, tvm_ffi.structural_hash(load.indices))
        if name not in self.written and key in self.shared:
            return self.shared[key]
        var = tirx.Var(f"{name}_value{next(self.numbers)}", str(load.ty.dtype))
        self.shared[key] = var
        if name in self.value_ranges and _is_int(var):
            lo, hi = self.value_ranges[name]
            self.analyzer.bind(var, tvm.ir.Range(lo, hi + 1))
        else:
            self.unknown[var.name] = name
        return var

    def _store(self, node: tirx.BufferStore, visitor: tvm_ffi.StructuralVisitor) -> None:
        visitor.default_visit(node)  # its value and indices
        self._check("stores to", node.buffer, list(node.indices))

    def _load(self, node: TensorLoad, visitor: tvm_ffi.StructuralVisitor) -> None:
        visitor.visit(node.indices)  # not its source: the buffer's shape holds no access
        self._check("loads from", node.source, list(node.indices))

    def _check(self, verb: str, buffer: tirx.Var, indices: list[Expr]) -> None:
        if buffer.scope() != "global":
            return
        for index, limit in zip(indices, self._limits(buffer, len(indices)), strict=True):
            ends = _ends(self._abstract(index))
            if ends is not None and all(self._prove(e >= 0) and self._prove(e < limit) for e in ends):
                continue
            text = f"{self.where}: {verb} {buffer.name} [{limit} elements] at {index}: " + (
                self._describe(ends, limit) if ends else "a vector index this checker does not understand")
            if text not in self.messages:
                self.messages.append(text)

    def _limits(self, buffer: tirx.Var, ndim: int) -> list[int]:
        """Per index, its bound: for a flat index of a parameter, the parameter's bytes counted in
        elements of the buffer's type (a buffer may view them as another type)."""
        if ndim == 1 and buffer.name in self.sizes:
            dtype = tvm.runtime.DataType(str(buffer.dtype))
            return [self.sizes[buffer.name] * 8 // (dtype.bits * dtype.lanes)]
        return [int(s) for s in buffer.shape]

    def _prove(self, claim: Expr) -> bool:
        """The analyzer's rules first, then Z3 where this TVM has it, for what the rules do not
        see (``b * 256 + t < 320`` from ``b * 4 + t // 64 < 5``)."""
        return self.analyzer.can_prove(claim) or self.analyzer.can_prove(claim, ProofStrength.SYMBOLIC_BOUND)

    def _describe(self, ends: list[Expr], limit: int) -> str:
        """The index's range as far as known, and the buffers of unknown value it depends on."""
        bounds = [self.analyzer.const_int_bound(e) for e in ends]
        lo, hi = _bound_text(min(b.min_value for b in bounds)), _bound_text(max(b.max_value for b in bounds))
        names: list[str] = []
        tvm_ffi.structural_walk(ends, [(tirx.Var, lambda v: names.append(self.unknown.get(v.name, "")))])
        unknown = ", ".join(dict.fromkeys(n for n in names if n))
        return f"index in [{lo}, {hi}], not provably within [0, {limit - 1}]" + (
            f" (depends on the values of {unknown}: no value range given)" if unknown else "")


def _dtype(expr: Expr) -> tvm.runtime.DataType:
    return tvm.runtime.DataType(str(expr.ty.dtype))


def _is_int(expr: Expr) -> bool:
    return _dtype(expr).lanes == 1 and str(_dtype(expr)).startswith(("int", "uint"))


def _bound_text(value: int) -> str:
    return {ConstIntBound.POS_INF: "+inf", ConstIntBound.NEG_INF: "-inf"}.get(value, str(value))


def _as_division(expr: tirx.RShift | tirx.BitwiseAnd) -> Expr:
    """``x >> c`` is ``floor(x / 2^c)`` and ``x & (2^k - 1)`` is ``x mod 2^k`` (floor modulo) in
    two's complement, negative ``x`` included."""
    c = expr.b.value if isinstance(expr.b, tirx.IntImm) else -1
    if isinstance(expr, tirx.RShift) and 0 <= c < 31:
        return tirx.floordiv(expr.a, 1 << c)
    if isinstance(expr, tirx.BitwiseAnd) and 0 < c < 2**31 - 1 and c & (c + 1) == 0:
        return tirx.floormod(expr.a, c + 1)
    return expr


def _ends(index: Expr) -> list[Expr] | None:
    """The first and last element of an index (a ``Ramp`` is linear in the lane, so its ends
    bound it); None for a vector index of another form."""
    if isinstance(index, tirx.Ramp):
        return [index.base, index.base + index.stride * (int(index.lanes) - 1)]
    if isinstance(index, tirx.Broadcast):
        return [index.value]
    return [index] if _dtype(index).lanes == 1 else None
