"""Build functions op by op, with result types inferred by the ops' own rules."""

from __future__ import annotations

from picc.ir.core import Op, RuleError
from picc.ir.module import Arg, Function
from picc.ir.types import TensorType
from picc.ir.verifier import VerifyError, infer_type


class FunctionBuilder:
    """Appends ops to a function under construction; each op is checked as it is added."""

    def __init__(self, name: str, weights: dict[str, TensorType]) -> None:
        self.name = name
        self.weights = weights
        self.args: list[Arg] = []
        self.ops: list[Op] = []
        self.types: dict[str, TensorType] = {}
        self.block: int | None = None  # the decoder block the ops added now belong to

    def in_block(self, block: int | None) -> FunctionBuilder:
        """Add the following ops to decoder block ``block`` (None: outside the blocks)."""
        self.block = block
        return self

    def arg(self, name: str, type_: TensorType) -> str:
        self._fresh(name)
        self.args.append(Arg(name, type_))
        self.types[name] = type_
        return name

    def op(self, cls: type[Op], result: str, **fields: object) -> str:
        """Add ``cls(**fields)`` defining ``%result`` (in the current block); return ``result``."""
        self._fresh(result)
        if self.block is not None:
            fields.setdefault("block", self.block)
        probe = cls(result=result, type=TensorType.__new__(TensorType), **fields)  # type: ignore[arg-type]
        try:
            type_ = infer_type(probe, self.types, self.weights)
        except RuleError as e:
            raise VerifyError(f"building %{result} = {cls.NAME}: {e}") from None
        self.ops.append(cls(result=result, type=type_, **fields))  # type: ignore[arg-type]
        self.types[result] = type_
        return result

    def finish(self, ret: str) -> Function:
        return Function(self.name, tuple(self.args), tuple(self.ops), ret)

    def _fresh(self, name: str) -> None:
        if name in self.types:
            raise VerifyError(f"building @{self.name}: %{name} is defined twice")
