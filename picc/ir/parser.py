"""Parse the text form written by ``picc.ir.printer`` back into a ``Module``.

Errors are ``ParseError`` with the 1-based line and column and what was expected there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from picc.ir.core import OPS, Attr, FieldKind, Op
from picc.ir.module import Arg, Function, Module, WeightDecl
from picc.ir.types import Dim, DType, Placement, TensorType


class ParseError(Exception):
    """Malformed IR text; the message starts with ``line L, column C:``."""


_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>//.*)
  | (?P<value>%[\w.]+)
  | (?P<symbol>@[\w.]+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<arrow>->)
  | (?P<number>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf\b|nan\b))
  | (?P<ident>[A-Za-z_][\w]*)
  | (?P<punct>[{}()\[\],:=])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    text: str
    col: int


def tokenize(line: str, lineno: int) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if not m:
            raise ParseError(f"line {lineno}, column {pos + 1}: unexpected character {line[pos]!r}")
        kind = m.lastgroup or ""
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, m.group(), pos + 1))
        pos = m.end()
    return tokens


class _Line:
    """A cursor over the tokens of one line."""

    def __init__(self, text: str, lineno: int) -> None:
        self.lineno = lineno
        self.tokens = tokenize(text, lineno)
        self.i = 0

    def error(self, expected: str) -> ParseError:
        if self.i < len(self.tokens):
            tok = self.tokens[self.i]
            return ParseError(f"line {self.lineno}, column {tok.col}: expected {expected}, "
                              f"got {tok.text!r}")
        return ParseError(f"line {self.lineno}: expected {expected} at end of line")

    def peek(self, text: str | None = None, kind: str | None = None) -> bool:
        if self.i >= len(self.tokens):
            return False
        tok = self.tokens[self.i]
        return (text is None or tok.text == text) and (kind is None or tok.kind == kind)

    def take(self, text: str | None = None, kind: str | None = None, what: str = "") -> str:
        if not self.peek(text, kind):
            raise self.error(what or repr(text) if text else what or kind or "a token")
        self.i += 1
        return self.tokens[self.i - 1].text

    def done(self) -> bool:
        return self.i >= len(self.tokens)

    def end(self) -> None:
        if not self.done():
            raise self.error("end of line")

    # ---- composite pieces

    def type_(self) -> TensorType:
        name = self.take(kind="ident", what="a dtype such as f32")
        try:
            dtype = DType(name)
        except ValueError:
            self.i -= 1
            raise self.error(f"a dtype (one of {', '.join(d.value for d in DType)})") from None
        self.take("[")
        dims: list[Dim] = []
        while not self.peek("]"):
            if dims:
                self.take(",")
            if self.peek(kind="number"):
                dims.append(int(self.take(kind="number")))
            else:
                dims.append(self.take(kind="ident", what="a dimension"))
        self.take("]")
        placement = None
        if self.peek(kind="symbol"):
            text = self.take(kind="symbol")[1:]
            try:
                placement = Placement(text)
            except ValueError:
                self.i -= 1
                raise self.error("a placement (@cpu or @gpu)") from None
        return TensorType(dtype, tuple(dims), placement)

    def attr_value(self, want: type | None) -> Attr:
        tok = self.tokens[self.i] if self.i < len(self.tokens) else None
        if tok is None:
            raise self.error("an attribute value")
        self.i += 1
        if tok.text == "[" and want in (None, tuple):
            numbers: list[float] = []
            while not self.peek("]"):
                if numbers:
                    self.take(",")
                numbers.append(float(self.take(kind="number", what="a number")))
            self.take("]")
            return tuple(numbers)
        try:
            if tok.kind == "string" and want in (None, str):
                return str(json.loads(tok.text))
            if tok.kind == "ident" and tok.text in ("true", "false") and want in (None, bool):
                return tok.text == "true"
            if tok.kind == "number":
                looks_float = any(c in tok.text for c in ".eEn")
                if want is float or want is None and looks_float:
                    return float(tok.text)
                if want in (None, int):
                    return int(tok.text)
        except ValueError:
            pass
        self.i -= 1
        raise self.error("a list of numbers, like [1.0, 2.5]" if want is tuple else
                         f"a value of type {want.__name__}" if want else "an attribute value")

    def attr_dict(self, kinds: dict[str, FieldKind] | None) -> dict[str, Attr]:
        attrs: dict[str, Attr] = {}
        self.take("{")
        while not self.peek("}"):
            if attrs:
                self.take(",")
            key = self.take(kind="ident", what="an attribute name")
            if kinds is not None and key not in kinds:
                self.i -= 1
                raise self.error(f"one of the attributes {sorted(kinds)}")
            self.take("=")
            attrs[key] = self.attr_value(kinds[key].attr_type if kinds is not None else None)
        self.take("}")
        return attrs


def _parse_op(line: _Line) -> Op:
    result = line.take(kind="value", what="%result")[1:]
    line.take("=")
    name = line.take(kind="ident", what="an op name")
    cls = OPS.get(name)
    if cls is None:
        line.i -= 1
        raise line.error(f"a known op ({', '.join(sorted(OPS))})")
    kinds = cls.field_kinds()
    refs = [f for f in kinds if f.kind != "attr"]
    required = [f for f in refs if not f.optional]
    optional = {f.name: f for f in refs if f.optional}
    fields: dict[str, object] = {}
    count = 0
    while not line.peek("{") and not line.peek(":"):
        if count:
            line.take(",")
        if line.peek(kind="ident"):
            key = line.take(kind="ident")
            if key not in optional:
                line.i -= 1
                raise line.error(f"an optional operand of {name} ({', '.join(optional) or 'none'})")
            line.take("=")
            field = optional[key]
        else:
            if count >= len(required):
                raise line.error(f"':' ({name} takes {len(required)} positional operands)")
            field = required[count]
        sigil_kind = "value" if field.kind == "value" else "symbol"
        sigil = "%" if field.kind == "value" else "@"
        fields[field.name] = line.take(kind=sigil_kind, what=f"{sigil}{field.name}")[1:]
        count += 1
    missing = [f.name for f in required if f.name not in fields]
    if missing:
        raise line.error(f"operand {missing[0]!r} of {name}")
    if line.peek("{"):
        fields.update(line.attr_dict({f.name: f for f in kinds if f.kind == "attr"}))
    line.take(":")
    type_ = line.type_()
    line.end()
    absent = [f.name for f in kinds if f.kind == "attr" and f.name not in fields
              and f.default is None and not f.optional]
    if absent:
        raise ParseError(f"line {line.lineno}: {name} needs attribute {absent[0]!r}")
    return cls(result=result, type=type_, **fields)  # type: ignore[arg-type]


def _parse_function(lines: list[tuple[int, str]], start: int) -> tuple[Function, int]:
    lineno, text = lines[start]
    head = _Line(text, lineno)
    head.take("func")
    fname = head.take(kind="symbol", what="@function_name")[1:]
    head.take("(")
    args: list[Arg] = []
    while not head.peek(")"):
        if args:
            head.take(",")
        aname = head.take(kind="value", what="%argument")[1:]
        head.take(":")
        args.append(Arg(aname, head.type_()))
    head.take(")")
    if head.peek("->"):
        head.take("->")
        head.type_()  # informative only: the returned value's type is authoritative
    head.take("{")
    head.end()
    ops: list[Op] = []
    i = start + 1
    while i < len(lines):
        lineno, text = lines[i]
        body = _Line(text, lineno)
        if body.peek("return"):
            body.take("return")
            ret = body.take(kind="value", what="%value")[1:]
            body.end()
            if i + 1 >= len(lines) or lines[i + 1][1].strip() != "}":
                raise ParseError(f"line {lineno}: expected '}}' after return")
            return Function(fname, tuple(args), tuple(ops), ret), i + 2
        ops.append(_parse_op(body))
        i += 1
    raise ParseError(f"line {lines[start][0]}: function @{fname} has no 'return'")


def parse(text: str) -> Module:
    """Parse a whole module."""
    lines = [(n, t) for n, t in enumerate(text.splitlines(), 1)
             if t.strip() and not t.strip().startswith("//")]
    if not lines:
        raise ParseError("line 1: expected 'module @name', got an empty text")
    head = _Line(lines[0][1], lines[0][0])
    head.take("module", what="'module @name'")
    name = head.take(kind="symbol", what="@module_name")[1:]
    attrs = head.attr_dict(None) if head.peek("{") else {}
    head.end()
    weights: list[WeightDecl] = []
    functions: list[Function] = []
    i = 1
    while i < len(lines):
        lineno, text = lines[i]
        line = _Line(text, lineno)
        if line.peek("weight"):
            line.take("weight")
            wname = line.take(kind="symbol", what="@weight_name")[1:]
            line.take(":")
            weights.append(WeightDecl(wname, line.type_()))
            line.end()
            i += 1
        elif line.peek("func"):
            func, i = _parse_function(lines, i)
            functions.append(func)
        else:
            raise line.error("'weight' or 'func'")
    return Module(name, tuple(attrs.items()), tuple(weights), tuple(functions))
