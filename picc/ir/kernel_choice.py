"""The kernel choices of the ops that read weight matrices, which ``select-kernels`` records."""

from __future__ import annotations

from dataclasses import dataclass

from picc.ir.core import Op, expect

X_FORMATS = ("f32", "i16")
LAYOUTS = ("rows", "rows8")


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixOp(Op):
    """An op whose kernel reads weight matrices row by row (``linear``, ``ffn``, ``fused_ffn``),
    with the two choices ``select-kernels`` makes for it, printed in every dump after that pass:

    * ``x_format``: how its 4-bit rows (q4_0 / q4_1) are dotted with ``x``: ``"f32"``, or
      ``"i16"``, ``x`` rounded to int16 per block of 32 first (:func:`picc.quant.round_to_int16_blocks`,
      each element within 1/254 of its block's largest ``|x|``). The rounding is part of what
      the op computes: the interpreter rounds as the kernel does. Rows in other formats, and
      the down rows a fused FFN adds rather than dots, always meet the float ``x``.
    * ``layout``: how the matrices the kernel reads whole are stored: ``"rows"`` (the source
      format's rows) or ``"rows8"`` (4-bit rows in eights, ``picc.codegen_cpu.rows8``). Storage
      only; the values are the same.
    """

    x_format: str = "f32"
    layout: str = "rows"

    def check_kernel_choice(self) -> None:
        expect(self.x_format in X_FORMATS, f"x_format must be one of {X_FORMATS}, got {self.x_format!r}")
        expect(self.layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def rounds_x(self) -> bool:
        return self.x_format == "i16"
