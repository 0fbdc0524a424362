"""The frame every picc op shares: value and weight references, the op base class and its registry.

An op is a frozen dataclass. Its fields fall into three kinds, told apart by their annotation:

* ``Val`` (or ``Val | None``): an SSA value it reads, printed ``%name``;
* ``Sym`` (or ``Sym | None``): a weight it reads, printed ``@name``;
* anything else (``int``, ``float``, ``str``, ``bool``, optionally ``| None``): an attribute,
  printed in ``{...}``.

Every op also has ``result`` (the name of the value it defines), ``type`` (its type), ``block``
(the decoder block, or layer, it belongs to: 0, 1, ...; unset outside blocks, such as the
embedding and the head; set by the frontends and kept by every pass, so that what is per layer
never depends on a value's name) and ``kernel``, an attribute that is unset until
``select-kernels`` names the kernel that computes the op on its device (printed last, ``{...,
kernel = "picc_gemv_q4_1"}``; a pure function of the op, its types and its other attributes:
nothing reads meaning back out of it). Each op class
implements ``infer``, which computes the result type from the operand types and raises
``RuleError`` when a rule of the op is broken; the verifier compares it with ``type``, the builder
uses it to fill ``type`` in.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from picc.ir.types import Dim, TensorType


class Val(str):
    """The name of an SSA value (without the ``%``)."""

    __slots__ = ()


class Sym(str):
    """The name of a weight in the module's weight table (without the ``@``)."""

    __slots__ = ()


Attr = int | float | str | bool | tuple[float, ...] | None
"""What an attribute may hold (a tuple: numbers per something, such as a rope's per-pair factors)."""


class RuleError(Exception):
    """An op-local rule is broken; the verifier adds the op and its line to the message."""


@dataclass(frozen=True, slots=True)
class FieldKind:
    """How one dataclass field of an op is printed and parsed."""

    name: str
    kind: str  # "value" | "weight" | "attr"
    optional: bool
    attr_type: type | None  # for attributes: int, float, str, bool or tuple (of floats)
    default: Attr


class TypeEnv(typing.Protocol):
    """What ``infer`` may ask: the types of values and of weights by name."""

    def value(self, name: str) -> TensorType: ...

    def weight(self, name: str) -> TensorType: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """Base of all ops: defines ``result`` of type ``type``."""

    NAME: ClassVar[str] = ""
    result: str
    type: TensorType
    block: int | None = None
    kernel: str | None = None

    def infer(self, env: TypeEnv) -> TensorType:
        raise NotImplementedError(self.NAME)

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        """Rules that involve the ops defining this op's operands (none by default)."""

    @property
    def can_accumulate(self) -> bool:
        """Whether this op's kernel can also do the residual add that an ``add``'s
        ``accumulated_by`` gives it (no, unless the op's class says so)."""
        return False

    @classmethod
    def field_kinds(cls) -> tuple[FieldKind, ...]:
        return _FIELD_KINDS[cls]

    def values(self) -> list[str]:
        """The names of the SSA values this op reads, in field order."""
        return [v for f in self.field_kinds() if f.kind == "value" if (v := getattr(self, f.name))]

    def weights(self) -> list[str]:
        """The names of the weights this op reads, in field order."""
        return [w for f in self.field_kinds() if f.kind == "weight" if (w := getattr(self, f.name))]

    def attrs(self) -> dict[str, Attr]:
        return {f.name: getattr(self, f.name) for f in self.field_kinds() if f.kind == "attr"}


OPS: dict[str, type[Op]] = {}
_LAST = {"block": 1, "x_format": 2, "layout": 3, "kernel": 4}
_FIELD_KINDS: dict[type[Op], tuple[FieldKind, ...]] = {}
_ATTR_TYPES = (int, float, str, bool)


def register_op(cls: type[Op]) -> type[Op]:
    """Class decorator: make ``cls`` printable, parseable and known to the verifier by its NAME."""
    assert cls.NAME and cls.NAME not in OPS, cls
    hints = typing.get_type_hints(cls)
    kinds = []
    # ``block`` and the kernel choices (``MatrixOp``'s, then ``kernel``, declared on Op) go last:
    # ops print their own attributes first.
    fields = sorted(dataclasses.fields(cls), key=lambda f: _LAST.get(f.name, 0))
    for f in fields:
        if f.name in ("result", "type"):
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        default: Attr = None if f.default is dataclasses.MISSING else f.default
        if base is Val:
            kinds.append(FieldKind(f.name, "value", optional, None, None))
        elif base is Sym:
            kinds.append(FieldKind(f.name, "weight", optional, None, None))
        elif base in _ATTR_TYPES:
            kinds.append(FieldKind(f.name, "attr", optional, base, default))
        elif base == tuple[float, ...]:
            kinds.append(FieldKind(f.name, "attr", optional, tuple, default))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {hint}")
    OPS[cls.NAME] = cls
    _FIELD_KINDS[cls] = tuple(kinds)
    return cls


# ---------------------------------------------------------------- helpers for infer()


def same_dim(a: Dim, b: Dim) -> bool:
    return a == b


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise RuleError(message)


def expect_rank(what: str, t: TensorType, rank: int) -> None:
    expect(t.rank == rank, f"{what} must have rank {rank}, got {t}")


def weight_shape_is(env: TypeEnv, name: str | None, shape: tuple[Dim, ...], role: str) -> None:
    """Check that weight ``name`` (if given) has exactly ``shape``."""
    if name is None:
        return
    w = env.weight(name)
    expect(w.shape == shape, f"{role} @{name} must be {_fmt(shape)}, got {_fmt(w.shape)}")


def _fmt(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"

