"""``canonicalize``: bring FFN blocks into their one canonical form, the ``ffn`` op.

Frontends that see an FFN as a whole (HF, GGUF) emit ``ffn`` directly; graph importers (ONNX) see
primitive ops. This pass folds the primitive patterns

* ``linear(x) -> act -> linear``                                  (up -> act -> down)
* ``act(linear_g(x)) * linear_u(x) -> linear``                    (SwiGLU / ReGLU / GeGLU)
* ``relu(linear_g(x)) * relu(linear_u(x)) -> linear``             (dReLU)

into one ``ffn`` op named after the down projection, when every intermediate value has exactly one
reader. Needs: a verified module. Guarantees: the same function; no foldable pattern remains.
Profiling, prediction and partitioning work on ``ffn`` ops only, so they rely on this.
"""

from __future__ import annotations

from dataclasses import replace

from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Function, Module
from picc.passes.registry import PassContext, register_pass

_UNARY = (O.Relu, O.Silu, O.Gelu, O.GeluTanh)
_GLU_FORM = {"silu": "swiglu", "relu": "reglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


class _Graph:
    def __init__(self, func: Function) -> None:
        self.producers = {op.result: op for op in func.ops}
        self.uses = func.uses()

    def single(self, value: str, cls: type | tuple[type, ...]) -> Op | None:
        """The producer of ``value`` if it is a ``cls`` op and ``value`` has one reader."""
        op = self.producers.get(value)
        return op if isinstance(op, cls) and self.uses.get(value) == 1 else None


def _match_gated(g: _Graph, mul: O.Mul) -> tuple[O.FFN, list[Op]] | None:
    for act_val, up_val in ((mul.a, mul.b), (mul.b, mul.a)):
        act = g.single(act_val, _UNARY)
        gate = act and g.single(act.x, O.Linear)
        if act is None or gate is None:
            continue
        up = g.single(up_val, O.Linear)
        up_act = None
        if up is None and isinstance(act, O.Relu):
            up_act = g.single(up_val, O.Relu)
            up = up_act and g.single(up_act.x, O.Linear)
        if up is None or up.x != gate.x:
            continue
        form = "drelu" if up_act is not None else _GLU_FORM[act.NAME]
        ffn = O.FFN(result="", type=mul.type, x=gate.x, up=up.weight, gate=gate.weight,
                    down="", up_bias=up.bias, gate_bias=gate.bias, form=form)
        return ffn, [op for op in (act, gate, up, up_act, mul) if op is not None]
    return None


def _match(g: _Graph, down: O.Linear) -> tuple[O.FFN, list[Op]] | None:
    if (mul := g.single(down.x, O.Mul)) is not None:
        found = _match_gated(g, mul)
    elif (act := g.single(down.x, _UNARY)) is not None and (
        up := g.single(act.x, O.Linear)
    ) is not None:
        ffn = O.FFN(result="", type=down.type, x=up.x, up=up.weight, down="", up_bias=up.bias,
                    form=act.NAME)
        found = ffn, [up, act]
    else:
        return None
    if found is None:
        return None
    ffn, consumed = found
    return replace(ffn, result=down.result, type=down.type, down=down.weight,
                   down_bias=down.bias, block=down.block), consumed


def fold_ffns(func: Function) -> Function:
    g = _Graph(func)
    folded: dict[str, Op] = {}
    removed: set[str] = set()
    for op in func.ops:
        if isinstance(op, O.Linear) and (m := _match(g, op)) is not None:
            folded[op.result] = m[0]
            removed.update(c.result for c in m[1])
    ops = tuple(folded.get(op.result, op) for op in func.ops if op.result not in removed)
    return replace(func, ops=ops)


@register_pass("canonicalize")
def canonicalize(module: Module, ctx: PassContext) -> Module:
    """Fold primitive FFN patterns into ffn ops."""
    return replace(module, functions=tuple(fold_ffns(f) for f in module.functions))
