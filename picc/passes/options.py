"""Pass options: one frozen dataclass per pass, parsed once from the pipeline text.

A pass declares its options as a subclass of :class:`PassOptions` whose fields are made by
:func:`option` (xDSL's ``ModulePass`` fields): ``int``, ``float``, ``str``, ``bool`` or one of
them ``| None``, each with a default, and optionally a set of ``choices``, a lower bound, the key
the pipeline text spells it with (``target-sparsity``), or, for values that are not plain text (a
target), functions that read and print it. ``{k=v,...}`` becomes that dataclass in
:func:`parse_options`; :func:`format_options` prints the fields that differ from their defaults,
so a spec's text parses back to the same options.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

from picc.errors import PiccError

_TRUE, _FALSE = ("on", "yes", "true"), ("off", "no", "false")


def option(default: Any = None, *, key: str | None = None, choices: tuple[str, ...] = (),
           at_least: float | None = None, default_factory: Callable[[], Any] | None = None,
           parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] | None = None,
           default_text: str | None = None, kind: str | None = None) -> Any:
    """A field of a :class:`PassOptions` dataclass.

    ``key``: the name in pipeline text, when it is not the field's; ``choices``: the accepted
    values of a ``str``; ``at_least``: a lower bound for a number. A value that is not plain text
    (a target) gives ``parse`` (text to value), ``show`` (value to text), the default's text and
    what ``--help`` calls it (``kind``); its default may come from ``default_factory``.
    """
    meta = {"key": key, "choices": choices, "at_least": at_least, "parse": parse, "show": show,
            "default_text": default_text, "kind": kind}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class OptionField:
    """One option of a pass as the parser sees it: its key, field name, base type, whether it may be None."""

    key: str
    name: str
    base: type
    optional: bool
    field: dataclasses.Field

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    def read(self, text: str) -> Any:
        """The value ``text`` spells, or a PiccError saying what was expected."""
        if self.meta.get("parse"):
            return self.meta["parse"](text)
        if self.base is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise PiccError(f"option {self.key}={text!r}: expected on or off")
        if self.base is int:
            try:
                return int(text)
            except ValueError:
                raise PiccError(f"option {self.key}={text!r}: expected an integer") from None
        if self.base is float:
            try:
                return float(text)
            except ValueError:
                raise PiccError(f"option {self.key}={text!r}: expected a number") from None
        return text

    def show(self, value: Any) -> str:
        """``value`` (not None) as pipeline text."""
        if self.meta.get("show"):
            return self.meta["show"](value)
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value)

    def default_text(self) -> str | None:
        """The default as pipeline text (None: no default value, the option is optional)."""
        if self.meta.get("default_text") is not None:
            return self.meta["default_text"]
        if self.field.default is None or self.field.default is dataclasses.MISSING:
            return None
        return self.show(self.field.default)

    def describe(self) -> str:
        """``tokens: int = 4096`` (``target-sparsity: float`` when it has no default), as ``--help`` lists it."""
        kind = self.meta.get("kind") or ("|".join(self.meta["choices"]) if self.meta.get("choices")
                                        else "on|off" if self.base is bool else self.base.__name__)
        default = self.default_text()
        return f"{self.key}: {kind}" + ("" if default is None else f" = {default}")


@functools.cache
def option_fields(cls: type[PassOptions]) -> tuple[OptionField, ...]:
    """The options ``cls`` declares, in order."""
    hints = typing.get_type_hints(cls)
    result = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else ()
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if args else hint
        if not f.metadata.get("parse") and base not in (int, float, str, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: an option is int, float, str or bool (or gives parse=)")
        if optional and f.default is not None:
            raise TypeError(f"{cls.__name__}.{f.name}: an optional option's default is None (not given)")
        result.append(OptionField(f.metadata.get("key") or f.name, f.name, base, optional, f))
    return tuple(result)


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """The options of a pass that takes none; the base of every pass's options dataclass.

    Construction checks each field's ``choices`` and lower bound (:meth:`check`); a subclass
    that has more to check extends :meth:`check`.
    """

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a one-line PiccError naming the option whose value is not accepted."""
        for f in option_fields(type(self)):
            value = getattr(self, f.name)
            if value is None:
                continue
            choices, low = f.meta.get("choices"), f.meta.get("at_least")
            if choices and value not in choices:
                raise PiccError(f"option {f.key}={f.show(value)!r}: expected one of {', '.join(choices)}")
            if low is not None and value < low:
                what = "an integer" if f.base is int else "a number"
                raise PiccError(f"option {f.key}={f.show(value)!r}: expected {what} >= {low}")


def parse_options(cls: type[PassOptions], pass_name: str, items: list[str]) -> PassOptions:
    """``cls`` from ``["tokens=4096", ...]``; errors name the pass and, when there is one, the option."""
    fields = {f.key: f for f in option_fields(cls)}
    values: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        f = fields.get(key.strip())
        if not eq or f is None:
            accepted = ", ".join(fields) or "none"
            raise PiccError(f"pipeline: pass {pass_name!r} got option {item!r}; accepted options: {accepted}")
        try:
            values[f.name] = f.read(text.strip())
        except PiccError as e:
            raise PiccError(f"pipeline: pass {pass_name!r}: {e}") from None
    try:
        return cls(**values)
    except PiccError as e:
        raise PiccError(f"pipeline: pass {pass_name!r}: {e}") from None


def format_options(options: PassOptions) -> str:
    """The options that differ from their defaults as ``key=value,...`` (empty when none do)."""
    items = []
    for f in option_fields(type(options)):
        value = getattr(options, f.name)
        if value is not None and (text := f.show(value)) != f.default_text():
            items.append(f"{f.key}={text}")
    return ",".join(items)


def describe_options(cls: type[PassOptions]) -> str:
    """What ``--help`` says of a pass's options: ``tokens: int = 4096, ...``."""
    return ", ".join(f.describe() for f in option_fields(cls))
