"""The pass registry: every pass is a named pure function ``(Module, PassContext) -> Module``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from picc.errors import PiccError
from picc.ir.module import Module
from picc.ir.weights import WeightStore

if TYPE_CHECKING:
    from picc.frontend.tokenizer import Tokenizer


@dataclass(frozen=True)
class PassContext:
    """What a pass may use besides the module: the weight store, its options, the tokenizer.

    The store is append-only, so a pass that changes a weight adds it under a new name and the
    module it was given stays valid.
    """

    weights: WeightStore
    options: dict[str, str] = field(default_factory=dict)
    tokenizer: Tokenizer | None = None

    def option(self, key: str, default: str) -> str:
        return self.options.get(key, default)

    def int_option(self, key: str, default: int) -> int:
        text = self.options.get(key, str(default))
        try:
            return int(text)
        except ValueError:
            raise PiccError(f"option {key}={text!r}: expected an integer") from None

    def float_option(self, key: str, default: float | None) -> float | None:
        text = self.options.get(key)
        if text is None:
            return default
        try:
            return float(text)
        except ValueError:
            raise PiccError(f"option {key}={text!r}: expected a number") from None


PassFn = Callable[[Module, PassContext], Module]


@dataclass(frozen=True)
class PassInfo:
    """A registered pass: its name, function, one-line summary and accepted options."""

    name: str
    fn: PassFn
    summary: str
    options: tuple[str, ...]


PASSES: dict[str, PassInfo] = {}


def register_pass(name: str, options: tuple[str, ...] = ()) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as pass ``name``; its docstring's first line is its summary."""

    def wrap(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise ValueError(f"pass {name!r} is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        PASSES[name] = PassInfo(name, fn, summary, options)
        return fn

    return wrap
