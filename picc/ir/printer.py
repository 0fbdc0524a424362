"""The text form of the IR. ``parse(print_module(m)) == m`` holds for every module.

::

    module @smollm2 {arch = "llama", vocab = 49152}

    weight @token_embd : q8_0[49152, 576]

    func @forward(%tokens: i32[seq], %pos: i32[seq]) -> f32[seq, 49152] {
      %embed = embed %tokens, @token_embd : f32[seq, 576]
      %l0.attn.q = linear %l0.attn_norm, @l0.attn.q, bias=@l0.attn.q_bias : f32[seq, 576]
      ...
      return %logits
    }

Required operands are positional; optional ones are ``name=``; attributes equal to their default
are left out. A blank line separates the ops of consecutive decoder blocks (``block``).
"""

from __future__ import annotations

import json

from picc.ir.core import Attr, Op
from picc.ir.module import Function, Module


def format_attr(value: Attr) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(float(v)) for v in value) + "]"
    return str(value)


def format_attrs(items: list[tuple[str, Attr]]) -> str:
    return "{" + ", ".join(f"{k} = {format_attr(v)}" for k, v in items) + "}"


def format_op(op: Op) -> str:
    positional: list[str] = []
    keyword: list[str] = []
    attrs: list[tuple[str, Attr]] = []
    for f in op.field_kinds():
        value = getattr(op, f.name)
        if f.kind == "attr":
            # Required attributes have no default (None here), so they are always printed.
            if value != f.default:
                attrs.append((f.name, value))
        elif value is not None:
            text = ("%" if f.kind == "value" else "@") + value
            if f.optional:
                keyword.append(f"{f.name}={text}")
            else:
                positional.append(text)
    parts = [f"%{op.result} = {op.NAME}"]
    operands = ", ".join(positional + keyword)
    if operands:
        parts.append(operands)
    if attrs:
        parts.append(format_attrs(attrs))
    return " ".join(parts) + f" : {op.type}"


def function_lines(func: Function) -> tuple[list[str], list[int]]:
    """The text lines of ``func`` and, for each op, the index of its line among them."""
    types = func.value_types()
    args = ", ".join(f"%{a.name}: {a.type}" for a in func.args)
    ret_type = types.get(func.ret)
    header = f"func @{func.name}({args})" + (f" -> {ret_type}" if ret_type else "") + " {"
    lines = [header]
    op_lines = []
    block = None
    for op in func.ops:
        if op_lines and op.block != block:
            lines.append("")
        block = op.block
        op_lines.append(len(lines))
        lines.append("  " + format_op(op))
    lines.append(f"  return %{func.ret}")
    lines.append("}")
    return lines, op_lines


def module_lines(m: Module) -> tuple[list[str], dict[tuple[str, int], int]]:
    """All lines of ``m`` and a map (function, op index) -> 1-based line number."""
    lines = [f"module @{m.name}" + (f" {format_attrs(list(m.attrs))}" if m.attrs else "")]
    if m.weights:
        lines.append("")
        lines.extend(f"weight @{w.name} : {w.type}" for w in m.weights)
    where: dict[tuple[str, int], int] = {}
    for func in m.functions:
        lines.append("")
        flines, op_lines = function_lines(func)
        base = len(lines)
        for i, idx in enumerate(op_lines):
            where[(func.name, i)] = base + idx + 1
        lines.extend(flines)
    return lines, where


def print_module(m: Module) -> str:
    return "\n".join(module_lines(m)[0]) + "\n"
