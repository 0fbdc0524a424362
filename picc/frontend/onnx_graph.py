"""An ONNX file as the ONNX frontend reads it: checked, indexed, with initializers as numpy arrays.

The frontend never runs the model's data path. It does evaluate, with numpy (``onnx.reference``),
the nodes that do not depend on the hidden states: constant folding, and the "auxiliary" subgraphs
exporters emit for positions, causal masks and rotary tables, which depend only on the inputs'
shapes, ``position_ids`` and ``attention_mask``. They are evaluated for one *probe*: a concrete
sequence length and past length (see ``Probe``), and the pattern matcher checks the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from picc.errors import PiccError
from picc.ir.types import DType

# Ops of onnxruntime's contrib set that the matcher understands. Some live in the default domain
# (SimplifiedLayerNormalization), so onnx.checker does not know them; see ``check``.
CONTRIB_OPS = frozenset({
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization",
    "GroupQueryAttention", "RotaryEmbedding", "MultiHeadAttention", "Attention",
})
_FLOAT_TYPES = {onnx.TensorProto.FLOAT: DType.F32, onnx.TensorProto.FLOAT16: DType.F16,
                onnx.TensorProto.BFLOAT16: DType.BF16, onnx.TensorProto.DOUBLE: DType.F32}


@dataclass(frozen=True)
class Probe:
    """The concrete shapes the auxiliary subgraphs are evaluated for: batch 1, ``seq`` new tokens
    after ``past`` cached ones (``past`` is 0 for graphs without KV-cache inputs)."""

    seq: int
    past: int

    @property
    def total(self) -> int:
        return self.seq + self.past

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.past, self.total, dtype=np.int64)


def load(path: Path) -> onnx.ModelProto:
    """The model in ``path`` with its external data, checked; one-line ``PiccError`` otherwise."""
    if not path.is_file():
        raise PiccError(f"{path}: ONNX file not found")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as e:  # protobuf DecodeError, missing external data (OSError), ...
        raise PiccError(f"{path}: not a readable ONNX model ({type(e).__name__}: {first_line(e)})") from None
    check(model, path)
    return model


def check(model: onnx.ModelProto, path: Path) -> None:
    """onnx.checker on ``model``; a failure that only says an onnxruntime contrib op is unknown to
    the checker is accepted (the matcher checks those nodes itself)."""
    try:
        onnx.checker.check_model(path if model.ByteSize() > 2**31 - 1 else model)
    except onnx.checker.ValidationError as e:
        msg = first_line(e)
        if msg.startswith("No Op registered for ") and msg.split()[4] in CONTRIB_OPS:
            return
        raise PiccError(f"{path}: invalid ONNX model ({msg})") from None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    """The node's attributes as Python values (tensors as numpy arrays, strings decoded)."""
    out: dict[str, object] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v)
        elif isinstance(v, bytes):
            v = v.decode()
        out[a.name] = v
    return out


def to_array(t: onnx.TensorProto) -> np.ndarray:
    """An initializer's value; bfloat16 is returned as its uint16 bit patterns."""
    if t.data_type == onnx.TensorProto.BFLOAT16:
        return np.asarray(numpy_helper.to_array(t)).view(np.uint16)
    return numpy_helper.to_array(t)


def float_dtype(elem_type: int) -> DType | None:
    return _FLOAT_TYPES.get(elem_type)


class Evaluator:
    """Runs single standard ONNX nodes on numpy inputs (onnx's reference implementation)."""

    def __init__(self, opset: int) -> None:
        self.opset = opset

    def run(self, node: onnx.NodeProto, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        names = [f"i{k}" if x is not None else "" for k, x in enumerate(inputs)]
        outs = [f"o{k}" for k in range(len(node.output))]
        copy = helper.make_node(node.op_type, names, outs, domain=node.domain or None)
        copy.attribute.extend(node.attribute)
        graph = helper.make_graph(
            [copy], "n",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
             for n, x in zip(names, inputs, strict=True) if x is not None],
            [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        feeds = {n: x for n, x in zip(names, inputs, strict=True) if x is not None}
        result = ReferenceEvaluator(model).run(None, feeds)
        return [np.asarray(r) for r in result]


def opset_of(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 17


def static_shape(vi: onnx.ValueInfoProto) -> list[int | None]:
    """A graph input's shape, None for symbolic dims."""
    dims = vi.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]
