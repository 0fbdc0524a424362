"""The IR verifier: SSA form, declared weights, per-op type rules.

Every message names where the problem is, as ``line N: %result = opname: the rule broken``, where
N is the line of the op in the module's text form (``picc.ir.printer``).
"""

from __future__ import annotations

from picc.ir.core import Op, RuleError
from picc.ir.module import Function, Module
from picc.ir.printer import module_lines
from picc.ir.types import TensorType


class VerifyError(Exception):
    """The module breaks a rule of the IR."""


class _Env:
    """The types visible to an op: values defined so far, and declared weights."""

    def __init__(self, values: dict[str, TensorType], weights: dict[str, TensorType]) -> None:
        self.values = values
        self.weights = weights

    # Type rules are about dtypes and shapes; placement is checked on its own (_check_placement).
    def value(self, name: str) -> TensorType:
        if name not in self.values:
            raise RuleError(f"%{name} is used before it is defined")
        t = self.values[name]
        return TensorType(t.dtype, t.shape)

    def weight(self, name: str) -> TensorType:
        if name not in self.weights:
            raise RuleError(f"weight @{name} is not declared")
        t = self.weights[name]
        return TensorType(t.dtype, t.shape)


# Weights an op carries as facts about itself (profiled statistics), not data its kernel reads.
_METADATA_FIELDS = frozenset({"freq", "mag"})


def _check_placement(op: Op, weights: dict[str, TensorType]) -> None:
    """An op placed on a device reads its weights there (values may cross; weights never do)."""
    where = op.type.placement
    if where is None:
        return
    for f in op.field_kinds():
        name = getattr(op, f.name)
        if f.kind != "weight" or name is None or f.name in _METADATA_FIELDS:
            continue
        placed = weights[name].placement
        if placed is not None and placed != where:
            raise RuleError(f"the op runs @{where.value} but its {f.name} @{name} is @{placed.value}")


def _same_ignoring_placement(a: TensorType, b: TensorType) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape


def infer_type(op: Op, values: dict[str, TensorType], weights: dict[str, TensorType]) -> TensorType:
    """The result type of ``op`` given the types in scope; raises ``RuleError`` on a broken rule."""
    env = _Env(values, weights)
    for v in op.values():
        env.value(v)
    for w in op.weights():
        env.weight(w)
    return op.infer(env)


def _verify_function(func: Function, weights: dict[str, TensorType], line_of: dict) -> None:
    values: dict[str, TensorType] = {}
    for arg in func.args:
        if arg.name in values:
            raise VerifyError(f"function @{func.name}: argument %{arg.name} is defined twice")
        values[arg.name] = arg.type
    caches: dict[str, str] = {}
    producers: dict[str, Op] = {}
    for i, op in enumerate(func.ops):
        where = f"line {line_of.get((func.name, i), '?')}: %{op.result} = {op.NAME}"
        try:
            if op.result in values:
                raise RuleError(f"%{op.result} is already defined (SSA values are defined once)")
            inferred = infer_type(op, values, weights)
            if not _same_ignoring_placement(inferred, op.type):
                raise RuleError(f"result type is {op.type} but the operands give {inferred}")
            _check_placement(op, weights)
            cache = getattr(op, "cache", None)
            if isinstance(cache, str):
                if cache in caches:
                    raise RuleError(f"cache slot {cache!r} is already used by %{caches[cache]}")
                caches[cache] = op.result
            op.check_producers(producers.get)
        except RuleError as e:
            raise VerifyError(f"{where}: {e}") from None
        values[op.result] = op.type
        producers[op.result] = op
    if func.ret not in values:
        raise VerifyError(f"function @{func.name}: returned value %{func.ret} is not defined")


def verify(module: Module) -> None:
    """Raise ``VerifyError`` with the first broken rule of ``module``; return None if it is valid."""
    weights: dict[str, TensorType] = {}
    for w in module.weights:
        if w.name in weights:
            raise VerifyError(f"weight @{w.name} is declared twice")
        if not w.type.is_static:
            raise VerifyError(f"weight @{w.name} must have a static shape, got {w.type}")
        weights[w.name] = w.type
    names = [f.name for f in module.functions]
    if len(set(names)) != len(names):
        raise VerifyError(f"module @{module.name} defines a function twice: {names}")
    _, line_of = module_lines(module)
    for func in module.functions:
        _verify_function(func, weights, line_of)
