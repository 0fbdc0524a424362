"""Recognising a decoder in an ONNX graph: an abstract interpretation of its data path.

Every node is visited once, in graph order. Nodes whose inputs are all known arrays (constants,
or auxiliary values computed from input shapes, positions and the attention mask for the probe)
are evaluated with numpy. Every other node is on the *data path* (it depends on the hidden states
or the KV cache) and must be explained by a handler: the handler maps the abstract values of its
inputs to abstract values of its outputs, and completes a *recognised op* (``Rec``: embed,
rms_norm, layer_norm, linear, rope, attention, act, mul, add, pos_embed) when a pattern closes.
Partial patterns (``x**2``, ``mean(x**2)``, ``sigmoid(x)``, attention scores, ...) are abstract
values of their own, so decompositions in any order and split over several nodes are matched
without look-ahead. A data-path node no handler explains is a ``Problem``; they are collected,
not raised one by one, so the user sees every unsupported op at once.

The recognised ops form a small graph in picc's own vocabulary; ``onnx_decoder`` reads the layer
structure from it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx

from picc.frontend.onnx_graph import (
    CONTRIB_OPS,
    Evaluator,
    Probe,
    attrs,
    first_line,
    float_dtype,
    static_shape,
    to_array,
)


@dataclass
class Rec:
    """A recognised op: ``op`` over the recognised ops ``inputs``, with weights and attributes."""

    id: int
    op: str
    inputs: tuple[int, ...]
    node: str
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)

    def number(self, key: str) -> float:
        """Numeric attribute ``key`` (it must be there)."""
        v = self.attrs[key]
        assert isinstance(v, int | float), (key, v)
        return float(v)

    def integer(self, key: str) -> int:
        v = self.attrs[key]
        assert isinstance(v, int), (key, v)
        return v


@dataclass(frozen=True)
class Known:
    """A concrete array: a constant (``const``) or an auxiliary value for the probe."""

    value: np.ndarray
    const: bool
    tokens: bool = False  # the token-id input itself


@dataclass(frozen=True)
class Act:
    """A picc activation [seq, width] (in ONNX [1, seq, width] or [seq, width]), the output of
    recognised op ``rec``, times the pending scalar ``scale``."""

    rec: int
    shape: tuple[int, ...]
    scale: float = 1.0


@dataclass(frozen=True)
class Heads:
    """Activation ``rec`` split into heads. ``layout``: bsnd, bnsd, bndt (keys transposed for
    q @ k^T), bn1sd / bngsd (repeat_kv in progress), kvbnsd (keys and values stacked, as
    com.microsoft's Attention caches them). ``past`` marks keys/values that include the
    cache; ``groups`` is the repeat_kv factor."""

    rec: int
    shape: tuple[int, ...]
    layout: str
    n: int
    d: int
    groups: int = 1
    past: bool = False
    scale: float = 1.0
    offset: int = 0  # position of the first key row (a sliding-window cache keeps only the last)


@dataclass(frozen=True)
class Partial:
    """A pattern in progress: ``kind`` of ``base``.

    RMSNorm: sq (x^2), meansq, meansq_eps (info: eps), rms (sqrt), inv_rms, normed (x * inv_rms).
    SiLU: sigmoid. GELU: erf / erf1 (1 + erf) / half_erf1 / x_erf1, and cube, cube_c, tanh_inner0,
    tanh_inner, tanh, tanh1, ... for the tanh form. Rotary (base: heads): lo / hi (halves),
    neg_hi, rot (rotate_half), cos_term / sin_term (info: table, its tolerance). Attention (base:
    queries): scores (info: keys, scale, window or None before the mask), probs, isnan (SDPA's
    guard; info: the probs).
    """

    kind: str
    base: Act | Heads
    shape: tuple[int, ...]
    info: tuple[object, ...] = ()


@dataclass(frozen=True)
class Unknown:
    """The output of a node that did not match: its consumers are not reported again. ``data``:
    a tensor of the data path (else a value that would have been evaluated, e.g. its shape)."""

    data: bool = True


Value = Known | Act | Heads | Partial | Unknown


class NoMatch(Exception):
    """A data-path node that fits no pattern; the message says why."""


@dataclass(frozen=True)
class Problem:
    op_type: str
    node: str
    layer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op_type} node {self.node!r} ({self.layer}): {self.reason}"


_LAYER_IN_NAME = re.compile(r"(?:layers?|h|blocks?)[._/](\d+)[._/]")
_PAST = re.compile(r"past[_.]?key[_.]?values?[._](\d+)[._](key|value)|past_(key|value)[._](\d+)")
_PAST_STACKED = re.compile(r"^past[_.](\d+)$")  # com.microsoft Attention: [2, batch, heads, past, d]


class Matcher:
    """The abstract interpreter; ``run`` fills ``recs`` and ``problems``."""

    def __init__(self, model: onnx.ModelProto, probe: Probe, opset: int) -> None:
        self.graph = model.graph
        self.probe = probe
        self.eval = Evaluator(opset)
        self.recs: list[Rec] = []
        self.problems: list[Problem] = []
        self.env: dict[str, Value] = {}
        self.residuals_seen = 0
        self.layer_hints: dict[str, tuple[int | None, int | None, int | None]] = {}
        self.outputs: dict[str, Value] = {}

    # ---------------------------------------------------------------- recognised ops

    def rec(self, op: str, inputs: tuple[int, ...], node: onnx.NodeProto | str, **kw: object) -> int:
        """Record a recognised op completed at ``node``; array keywords are its weights (and
        tables), the others its attributes. Returns the op's id."""
        weights = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
        rest = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}
        where = node if isinstance(node, str) else node.name or node.op_type
        self.recs.append(Rec(len(self.recs), op, inputs, where, weights, rest))
        if op == "add" and all(self.recs[i].op != "pos_embed" for i in inputs):
            self.residuals_seen += 1
        return len(self.recs) - 1

    def layer_of(self, node: onnx.NodeProto) -> str:
        """Where ``node`` sits, for error messages.

        The layer its own name gives (``/model/layers.3/...``), else what the layer-named weights
        around it say: it comes after those of layer ``up`` (the highest upstream) and before
        those of layer ``down`` (the lowest downstream). Exporters that rename weights keep only
        the norms' names, so a layer's FFN and the next layer's first norm both lie between the
        same two norms; the count of residual adds so far (two a layer) decides between them.
        """
        own, up, down = self.layer_hints.get(node.output[0] if node.output else "", (None, None, None))
        count = self.residuals_seen // 2
        if own is not None:
            return f"layer {own}"
        if up is None:
            return f"layer {down if down is not None else count}"
        if down is None:
            return f"after layer {up}" if count > up else f"layer {up}"
        return f"layer {min(max(count, up), down)}"

    def _hint_layers(self) -> None:
        """``layer_hints``: per node (by its first output), the layer its own name gives, the
        highest layer named upstream and the lowest named downstream (weights and node names)."""
        def named(name: str) -> int | None:
            m = _LAYER_IN_NAME.search(name)
            return int(m.group(1)) if m else None

        weights = {i.name: h for i in self.graph.initializer if (h := named(i.name)) is not None}
        nodes = [n for n in self.graph.node if n.output]
        up: dict[str, int] = dict(weights)
        ups: list[int | None] = []
        for node in nodes:
            found = [h for x in node.input if (h := up.get(x)) is not None]
            if (h := named(node.name)) is not None:
                found.append(h)
            ups.append(max(found) if found else None)
            for out in node.output if found else ():
                up[out] = max(found)
        down: dict[str, int] = {}
        downs: list[int | None] = []
        for node in reversed(nodes):
            found = [h for x in node.input if (h := weights.get(x)) is not None]
            found += [h for x in node.output if (h := down.get(x)) is not None]
            if (h := named(node.name)) is not None:
                found.append(h)
            downs.append(min(found) if found else None)
            for x in node.input if found else ():
                down[x] = min(down.get(x, min(found)), min(found))
        self.layer_hints = {n.output[0]: (named(n.name), u, d)
                            for n, u, d in zip(nodes, ups, reversed(downs), strict=True)}


    # ---------------------------------------------------------------- driver

    def run(self) -> None:
        self._hint_layers()
        for init in self.graph.initializer:
            self.env[init.name] = Known(to_array(init), const=True)
        self._bind_inputs()
        for node in self.graph.node:
            self.visit(node)
        for out in self.graph.output:
            self.outputs[out.name] = self.env.get(out.name, Unknown())

    def _bind_inputs(self) -> None:
        tokens = self._token_input()
        p = self.probe
        for vi in self.graph.input:
            if vi.name in self.env:
                continue  # an initializer also listed as input (old exporters)
            shape = static_shape(vi)
            elem = vi.type.tensor_type.elem_type
            m = _PAST.search(vi.name)
            if vi.name == tokens:
                self.env[vi.name] = Known(np.zeros((1, p.seq), np.int64), const=False, tokens=True)
            elif m and float_dtype(elem) is not None and len(shape) == 4:
                layer = int(m.group(1) or m.group(4))
                kind = m.group(2) or m.group(3)
                # 0 = not fixed by the graph input (then the consumer's is taken)
                n, d = shape[1] or 0, shape[3] or 0
                r = self.rec("past", (), vi.name, layer=layer, kind=kind)
                self.env[vi.name] = Heads(r, (1, n, p.past, d), "bnsd", n, d, past=True)
            elif (ms := _PAST_STACKED.search(vi.name)) and float_dtype(elem) is not None and len(shape) == 5:
                n, d = shape[2] or 0, shape[4] or 0
                r = self.rec("past", (), vi.name, layer=int(ms.group(1)), kind="key_value")
                self.env[vi.name] = Heads(r, (2, 1, n, p.past, d), "kvbnsd", n, d, past=True)
            elif "position" in vi.name:
                self.env[vi.name] = Known(p.positions[None].astype(_np_int(elem)), const=False)
            elif "mask" in vi.name:
                dt = float_dtype(elem)
                arr = np.ones((1, p.total), np.float32 if dt is not None else _np_int(elem))
                self.env[vi.name] = Known(arr, const=False)
            else:
                raise NoMatch(f"graph input {vi.name!r} is none of the inputs picc knows (token ids, "
                              "position_ids, attention_mask, past_key_values.N.key/value)")

    def _token_input(self) -> str | None:
        """The graph input that (through reshapes and casts) indexes a Gather over a 2-D float
        initializer, else the one named ``input_ids``: the token ids."""
        inits = {i.name: i for i in self.graph.initializer}
        names = {vi.name for vi in self.graph.input}
        producer = {o: n for n in self.graph.node for o in n.output}
        for node in self.graph.node:
            table = inits.get(node.input[0]) if node.op_type == "Gather" and len(node.input) == 2 else None
            if table is None or len(table.dims) != 2 or float_dtype(table.data_type) is None:
                continue
            idx = node.input[1]
            while idx in producer and producer[idx].op_type in _SHAPE_ONLY:
                idx = producer[idx].input[0]
            if idx in names:
                return idx
        # no such Gather (e.g. the lookup is an op picc does not know): the conventional name,
        # so that the lookup is what gets reported
        return next((vi.name for vi in self.graph.input if "input_ids" in vi.name), None)

    def visit(self, node: onnx.NodeProto) -> None:
        """Give ``node``'s outputs abstract values (see the module docstring)."""
        ins: list[Value | None] = [self.env.get(n, Unknown()) if n else None for n in node.input]
        outs: list[Value]
        try:
            if any(isinstance(v, Unknown) for v in ins):
                # Downstream of a node that did not match: an op type without any pattern on the
                # data path is still listed (the user wants all of those at once); the rest would
                # repeat the cause.
                data = node.op_type != "Shape" and any(isinstance(v, Unknown) and v.data for v in ins)
                if data and node.op_type not in HANDLERS:
                    raise NoMatch("op type not supported on the data path")
                outs = [Unknown(data)] * len(node.output)
            elif self._evaluable(node, ins):
                const = all(v is None or (isinstance(v, Known) and v.const) for v in ins)
                arrays = [v.value if isinstance(v, Known) else None for v in ins]
                tokens = node.op_type in _SHAPE_ONLY and isinstance(ins[0], Known) and ins[0].tokens
                try:
                    outs = [Known(a, const, tokens) for a in self.eval.run(node, arrays)]
                except Exception as e:  # onnx.reference raises whatever its op implementations do
                    if any(isinstance(v, Known) and v.tokens for v in ins):
                        raise NoMatch("not supported on the token ids (picc's embedding is a Gather from a "
                                      "2-D table)") from None
                    raise NoMatch(f"cannot evaluate this constant/position node ({first_line(e)})") from None
            else:
                handler = HANDLERS.get(node.op_type)
                if handler is None:
                    raise NoMatch("op type not supported on the data path")
                outs = handler(self, node, ins, attrs(node))
        except Exception as e:  # noqa: BLE001 - one listed problem per node, never a traceback
            # Besides NoMatch: numpy on shapes that cannot broadcast, attributes or inputs a
            # handler expects but the node lacks, ...
            reason = first_line(e)
            if not isinstance(e, NoMatch):
                reason = f"unexpected form ({type(e).__name__}: {reason})"
            self.problems.append(Problem(node.op_type, node.name or "<unnamed>", self.layer_of(node), reason))
            outs = [Unknown()] * len(node.output)
        for name, v in zip(node.output, outs, strict=False):
            if name:
                self.env[name] = v

    @staticmethod
    def _evaluable(node: onnx.NodeProto, ins: list[Value | None]) -> bool:
        """Whether ``node`` only reads known arrays (and is no embedding lookup of the tokens)."""
        return (all(v is None or isinstance(v, Known) for v in ins) and node.domain in ("", "ai.onnx")
                and node.op_type not in CONTRIB_OPS
                and not (node.op_type == "Gather" and isinstance(ins[1], Known) and ins[1].tokens))


_SHAPE_ONLY = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Cast", "Flatten", "Identity"})


def _np_int(elem: int) -> type:
    return np.int32 if elem == onnx.TensorProto.INT32 else np.int64


# ---------------------------------------------------------------- helpers for handlers

Handler = Callable[[Matcher, onnx.NodeProto, list, dict], list]
HANDLERS: dict[str, Handler] = {}


def handles(*ops: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return register


def axes_of(ins: list, a: dict) -> list | None:
    """A node's ``axes``: the attribute (opsets before 13) or its known second input, else None."""
    axes = a.get("axes")
    if axes is None and len(ins) > 1 and isinstance(ins[1], Known):
        axes = ins[1].value.reshape(-1).tolist()
    return axes


def renames_partial(op: str, kind: str, to: str) -> None:
    """Register the handler of the unary ``op`` as one step of a pattern spelled out op by op:
    it turns a ``Partial`` of ``kind`` into one of kind ``to`` (anything else is no match)."""

    def step(m: Matcher, node: onnx.NodeProto, ins: list, a: dict) -> list:
        x = ins[0]
        if isinstance(x, Partial) and x.kind == kind:
            return [replace(x, kind=to)]
        raise mismatch(node, ins)

    HANDLERS[op] = step


def scalar(v: object) -> float | None:
    """The value of a one-element known array, else None."""
    if isinstance(v, Known) and v.value.size == 1 and np.issubdtype(v.value.dtype, np.number):
        return float(v.value.reshape(()))
    return None


def const_vector(v: object, n: int) -> np.ndarray | None:
    """A constant holding exactly ``n`` numbers (any leading unit dims), else None."""
    if isinstance(v, Known) and v.const and v.value.size == n and v.value.shape[-1:] == (n,):
        return v.value.reshape(n)
    return None


def f32_round(x: float) -> float:
    """``x`` as the shortest decimal that is the same float32 (1e-06, not 9.999999974752427e-07)."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def both(ins: list) -> list[tuple[object, object]]:
    """The operand pairs of a commutative op, in both orders."""
    return [(ins[0], ins[1]), (ins[1], ins[0])]


def act_width(a: Act) -> int:
    return a.shape[-1]


def describe(v: object) -> str:
    if isinstance(v, Known):
        return f"constant {list(v.value.shape)}" if v.const else f"input-derived {list(v.value.shape)}"
    if isinstance(v, Partial):
        return f"partial {v.kind}"
    return type(v).__name__.lower() + f" {list(getattr(v, 'shape', ()))}"


def mismatch(node: onnx.NodeProto, ins: list) -> NoMatch:
    return NoMatch("operands (" + ", ".join(describe(v) for v in ins if v is not None)
                   + ") fit no recognised pattern")


def axis_is_last(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


# The handlers live in onnx_handlers.py, onnx_attention.py and onnx_fused.py; importing them
# fills HANDLERS.
from picc.frontend import onnx_fused as _fused  # noqa: E402,F401
from picc.frontend import onnx_handlers as _handlers  # noqa: E402,F401
