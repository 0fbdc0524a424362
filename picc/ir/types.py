"""Tensor types of the picc IR: a dtype, a shape of static or symbolic dims, and a placement.

Text form: ``f32[seq, 576]``, ``q4_1[1536, 576]``, ``i32[seq]``, ``f32[]`` (a scalar), and after
partitioning ``f16[640, 576] @gpu``. A symbolic dim (``seq``) is a name that stands for the same
size wherever it appears in one function.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DType(enum.Enum):
    """Element types. Quantized types are GGUF block formats (32 values per block)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q8_0 = "q8_0"
    MXFP4 = "mxfp4"  # gpt-oss's experts: 4-bit E2M1 values, a power-of-two scale a block
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"

    @property
    def is_quantized(self) -> bool:
        return self in (DType.Q4_0, DType.Q4_1, DType.Q8_0, DType.MXFP4)

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16)

    @property
    def is_int(self) -> bool:
        return self in (DType.I32, DType.I64)


class Placement(enum.Enum):
    """Where a value or weight lives once the partitioner has decided."""

    CPU = "cpu"
    GPU = "gpu"


Dim = int | str
"""A dimension: a static size, or the name of a symbolic size such as ``seq``."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of a value or weight: element dtype, shape, and (optionally) placement."""

    dtype: DType
    shape: tuple[Dim, ...]
    placement: Placement | None = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def with_shape(self, shape: tuple[Dim, ...]) -> TensorType:
        return TensorType(self.dtype, shape, self.placement)

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        text = f"{self.dtype.value}[{dims}]"
        return f"{text} @{self.placement.value}" if self.placement else text


def f32(*shape: Dim) -> TensorType:
    """Shorthand for the activation type every decoder op produces."""
    return TensorType(DType.F32, tuple(shape))
