"""``vpdpbusd`` (AVX-512 VNNI) sums of rows8 nibble chunks with x's int16 (or int8) form.

:func:`picc.codegen_cpu.rows8.int_sums` computes a block's exact integer ``q . x`` per int32 lane
with ``vpmaddubsw`` / ``vpmaddwd``; :func:`vnni_sums` computes the same integers with
``vpdpbusd``, four products summed into an int32 lane without saturation (high bytes: at most
32 x 15 x 128, low: 32 x 15 x 255), on 512 bits (two x rows a vector, :mod:`.rows8_pairs`) or on
256 bits (one x row: the eight-row dot products of the one-row kernels that say so).
"""

from __future__ import annotations

from picc.codegen_cpu.irtext import Fn, vconst, vec
from picc.codegen_cpu.rowformats import table_lookup

_VNNI_CHAINS = 2  # independent vpdpbusd chains per sum (vpdpbusd's latency is ~5 cycles)


def vnni_sums(fn: Fn, chunks: list[str], xs: list[list[str]], lanes: int = 16,
              table: tuple[int, ...] | None = None) -> str:
    """:func:`rows8.int_sums` with ``vpdpbusd`` (16 lanes, or 8 on 256 bits): the nibbles as the
    unsigned operand against x's high bytes (signed), x's low bytes (unsigned) against the nibbles
    (0..15 as signed bytes); int32 sums, split in chains for the instruction's latency. int8 x
    (``xs`` holds the high bytes alone): the low bytes' products are zero and skipped. ``table``:
    each nibble stands for ``table[q]`` (unsigned bytes under 128: mxfp4's values plus 12)."""
    bytes_t, ints = vec(4 * lanes, "i8"), vec(lanes, "i32")
    mask, four = vconst(4 * lanes, "15", "i8"), vconst(4 * lanes, "4", "i8")
    width = 32 * lanes

    def dot(acc: str, unsigned: str, signed: str) -> str:
        return fn.v(f"call {ints} @llvm.x86.avx512.vpdpbusd.{width}({ints} {acc}, {bytes_t} {unsigned}, "
                    f"{bytes_t} {signed})", "dp")

    high, low = ["zeroinitializer"] * _VNNI_CHAINS, ["zeroinitializer"] * _VNNI_CHAINS
    for c, raw in enumerate(chunks):
        shifted = fn.v(f"lshr {bytes_t} {raw}, {four}", "sh")
        nibbles = (fn.v(f"and {bytes_t} {raw}, {mask}", "lo4"), fn.v(f"and {bytes_t} {shifted}, {mask}", "hi4"))
        if table is not None:
            nibbles = tuple(table_lookup(fn, nib, 4 * lanes, table) for nib in nibbles)
        for nib, j in zip(nibbles, (c, 4 + c), strict=True):
            high[j % _VNNI_CHAINS] = dot(high[j % _VNNI_CHAINS], nib, xs[0][j])
            if len(xs) > 1:
                low[j % _VNNI_CHAINS] = dot(low[j % _VNNI_CHAINS], xs[1][j], nib)
    total_high, total_low = high[0], low[0]
    for i in range(1, _VNNI_CHAINS):
        total_high = fn.v(f"add {ints} {total_high}, {high[i]}", "ht")
        total_low = fn.v(f"add {ints} {total_low}, {low[i]}", "lt")
    shifted = fn.v(f"shl {ints} {total_high}, {vconst(lanes, '8', 'i32')}", "hi8")
    return shifted if len(xs) == 1 else fn.v(f"add {ints} {shifted}, {total_low}", "dots")
