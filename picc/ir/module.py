"""Functions and modules: the containers of the picc IR.

A module has attributes (the model's facts: architecture, vocabulary size, special tokens), a table
of weight declarations (name and type; the data lives in a ``WeightStore`` beside the module) and
functions. Decoder models have one function, ``forward(%tokens: i32[seq], %pos: i32[seq])``, that
returns the logits of every position; the KV cache is the state of its attention ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from picc.ir.core import Attr, Op
from picc.ir.types import TensorType


@dataclass(frozen=True, slots=True)
class Arg:
    """A function argument: an SSA value defined on entry."""

    name: str
    type: TensorType


@dataclass(frozen=True, slots=True)
class WeightDecl:
    """A named weight of the module; its data is in the weight store under the same name."""

    name: str
    type: TensorType


@dataclass(frozen=True, slots=True)
class Function:
    """A straight-line SSA function: arguments, ops in order, one returned value."""

    name: str
    args: tuple[Arg, ...]
    ops: tuple[Op, ...]
    ret: str

    def value_types(self) -> dict[str, TensorType]:
        types = {a.name: a.type for a in self.args}
        types.update((op.result, op.type) for op in self.ops)
        return types

    def producer(self, value: str) -> Op | None:
        return next((op for op in self.ops if op.result == value), None)

    def pruned(self) -> Function:
        """A copy without the ops whose results do not reach the returned value."""
        live = {self.ret}
        kept = []
        for op in reversed(self.ops):
            if op.result in live:
                kept.append(op)
                live.update(op.values())
        return replace(self, ops=tuple(reversed(kept)))

    def readers(self) -> dict[str, list[int]]:
        """The indices of the ops that read each value, in order (once per op)."""
        found: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            for v in dict.fromkeys(op.values()):
                found.setdefault(v, []).append(i)
        return found

    def uses(self) -> dict[str, int]:
        """How many times each value is read (the returned value counts once)."""
        counts: dict[str, int] = {}
        for op in self.ops:
            for v in op.values():
                counts[v] = counts.get(v, 0) + 1
        counts[self.ret] = counts.get(self.ret, 0) + 1
        return counts


@dataclass(frozen=True, slots=True)
class Module:
    """A whole model: attributes, weight declarations and functions."""

    name: str
    attrs: tuple[tuple[str, Attr], ...]
    weights: tuple[WeightDecl, ...]
    functions: tuple[Function, ...]

    def attr(self, key: str, default: Attr = None) -> Attr:
        return next((v for k, v in self.attrs if k == key), default)

    def weight_types(self) -> dict[str, TensorType]:
        return {w.name: w.type for w in self.weights}

    def function(self, name: str = "forward") -> Function:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(f"module @{self.name} has no function @{name}")

    def ops(self) -> Iterator[Op]:
        for f in self.functions:
            yield from f.ops

    def with_function(self, func: Function) -> Module:
        """A copy with ``func`` replacing the function of the same name."""
        funcs = tuple(func if f.name == func.name else f for f in self.functions)
        return replace(self, functions=funcs)

    def with_used_weights_only(self) -> Module:
        """A copy whose weight table lists only the weights some op reads (table order kept)."""
        used = {w for op in self.ops() for w in op.weights()}
        return replace(self, weights=tuple(w for w in self.weights if w.name in used))
