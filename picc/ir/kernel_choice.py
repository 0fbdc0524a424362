"""The kernel choices of the ops that read weight matrices, which ``select-kernels`` records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from picc.ir.core import Op, expect
from picc.kernel_names import X_FORMATS

LAYOUTS = ("rows", "rows8")


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixOp(Op):
    """An op whose kernel reads weight matrices row by row (``linear``, ``ffn``, ``fused_ffn``),
    with the two choices ``select-kernels`` makes for it, printed in every dump after that pass:

    * ``x_format``: how its 4-bit rows (q4_0 / q4_1 / mxfp4) are dotted with ``x``: ``"f32"``, or
      ``"i16"`` / ``"i8"``, ``x`` rounded to int16 / int8 per block of 32 first
      (:func:`picc.quant.round_x_blocks`, each element within 2^-16 / 1/254 of its block's
      largest ``|x|``). The rounding is part of what the op computes: the interpreter rounds as
      the kernel does. Rows in other formats, and
      the down rows a fused FFN adds rather than dots, always meet the float ``x``.
    * ``layout``: how the matrices the kernel reads whole are stored: ``"rows"`` (the source
      format's rows) or ``"rows8"`` (q4_0 / q4_1 rows in eights, ``picc.codegen_cpu.rows8``). Storage
      only; the values are the same.
    """

    x_format: str = "f32"
    layout: str = "rows"

    def check_kernel_choice(self) -> None:
        expect(self.x_format in X_FORMATS, f"x_format must be one of {X_FORMATS}, got {self.x_format!r}")
        expect(self.layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def rounds_x(self) -> bool:
        return self.x_format != "f32"

    @property
    def can_accumulate(self) -> bool:
        """Whether its decode kernel can add its result to the residual (an ``add``'s
        ``accumulated_by`` may name it): every matrix op but a sparse or neuron-major ``ffn``,
        which has no kernel of its own. The CPU's kernel adds into the residual's buffer; the
        GPU's variant reads the residual and writes the add's result."""
        return True


class Accumulated:
    """What ``add`` gets from its ``accumulated_by`` ("a" | "b"), the residual add that the kernel
    of that operand's producer does itself (``select-kernels``; the decode step on either device)."""

    # No annotations here: the op's field annotations (``a``, ``b``: values) must stay the only ones.
    __slots__ = ()

    @property
    def accumulated(self) -> tuple[str, str] | None:
        """(the operand whose producer's kernel does the add, the residual it adds into), or None."""
        if not self.accumulated_by:
            return None
        return (self.a, self.b) if self.accumulated_by == "a" else (self.b, self.a)

    def check_producers(self, producer: Callable[[str], Op | None]) -> None:
        if (accumulated := self.accumulated) is not None:
            made_by = producer(accumulated[0])
            expect(made_by is not None and made_by.can_accumulate,
                   f"accumulated_by = {self.accumulated_by!r}: %{accumulated[0]} must come from a linear or an "
                   "ffn (or, on the GPU, a merge) whose kernel can add into its output")
