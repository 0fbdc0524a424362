"""q8_0 rows in the rows8 layout, dotted with int8 x: the integer sums of a group block.

An LM head of a 4-bit GGUF is usually q8_0 (SmolLM2's: 49152 x 576, 28 MiB, the largest matrix of
the model). Read one row at a time with float x it costs about as much as the 30 FFNs of a
batched decode step, each x row two FMAs per row and block. In the rows8 layout
(:mod:`.rows8`: eight rows' blocks side by side, chunk ``c`` holding bytes ``4c .. 4c + 3`` of
each row in that row's int32 lane) and against x rounded to int8 per block
(:class:`~picc.codegen_cpu.int16x.IntX` with ``int8``), a block of eight rows is eight integer
multiply-adds per x row, each summing four products into every row's lane, then the float part
every rows8 int-x dot product has (:func:`.rows8.scaled_sum`).

The sums are exact integers, whatever instructions make them, so every SIMD level computes the
same bits:

* ``avx512-vnni``: ``vpdpbusd`` (unsigned by signed bytes) on 256 bits. The rows' signed bytes
  ``w`` are read as unsigned ``w + 128`` (an exclusive or with 0x80, once per chunk for all x
  rows), which adds ``128 sum x`` to every lane: each lane's sum starts at ``-128 sum q8``
  (:attr:`IntX.qsums`, made once per x), so it ends at ``w . q8``. No saturation: products are
  summed in int32.
* otherwise: ``vpsignb`` / ``vpmaddubsw`` / ``vpmaddwd``. ``|w|`` (``vpabsb``, once per chunk; -128
  becomes 128 as an unsigned byte) times ``x`` with ``w``'s sign (``vpsignb``, per x row): two such
  products fit an int16 (2 x 128 x 127), then ``vpmaddwd`` makes int32 a chunk.

The int8 x of the rows8 form holds ``256 q8`` with the scale times 2^-8 (:mod:`.int16x`): the sums
are shifted left by 8 to that form's units, so the float part is the 4-bit kernels' own.
"""

from __future__ import annotations

from picc.codegen_cpu.irtext import Fn, vconst, vec
from picc.codegen_cpu.rowformats import V16

_B32, _I8 = vec(32, "i8"), "<8 x i32>"
_CHAINS = 2  # independent sums per block (vpdpbusd's latency is ~5 cycles)


def byte_sums(fn: Fn, chunks: list[str], xs: list[str], qsum: str | None, vnni: bool) -> str:
    """``<8 x i32>``: lane r, ``256 (w_r . q8)`` of one block: ``chunks`` its eight chunks of
    signed bytes (``<32 x i8>``), ``xs`` x's eight four-byte groups of q8, each in every lane
    (``<32 x i8>``), ``qsum`` ``-128 sum q8`` in every lane (needed with ``vnni`` alone)."""
    chains: list[str] = []
    if vnni:
        assert qsum is not None, "vpdpbusd reads the rows' bytes biased by 128: x's qsums undo it"
        bias = vconst(32, "-128", "i8")
        chains = [qsum] + ["zeroinitializer"] * (_CHAINS - 1)
        for c, (raw, x) in enumerate(zip(chunks, xs, strict=True)):
            unsigned = fn.v(f"xor {_B32} {raw}, {bias}", "wu")
            chains[c % _CHAINS] = fn.v(f"call {_I8} @llvm.x86.avx512.vpdpbusd.256({_I8} {chains[c % _CHAINS]}, "
                                       f"{_B32} {unsigned}, {_B32} {x})", "dp")
    else:
        ones = vconst(16, "1", "i16")
        for c, (raw, x) in enumerate(zip(chunks, xs, strict=True)):
            mag = fn.v(f"call {_B32} @llvm.abs.v32i8({_B32} {raw}, i1 false)", "wa")
            signed = fn.v(f"call {_B32} @llvm.x86.avx2.psign.b({_B32} {x}, {_B32} {raw})", "xs")
            words = fn.v(f"call {vec(16, 'i16')} @llvm.x86.avx2.pmadd.ub.sw({_B32} {mag}, {_B32} {signed})", "pw")
            ints = fn.v(f"call {_I8} @llvm.x86.avx2.pmadd.wd({vec(16, 'i16')} {words}, {vec(16, 'i16')} {ones})", "pd")
            if c < _CHAINS:
                chains.append(ints)
            else:
                chains[c % _CHAINS] = fn.v(f"add {_I8} {chains[c % _CHAINS]}, {ints}", "pd")
    total = chains[0]
    for chain in chains[1:]:
        total = fn.v(f"add {_I8} {total}, {chain}", "dt")
    return fn.v(f"shl {_I8} {total}, {vconst(8, '8', 'i32')}", "d8")


def byte_floats(fn: Fn, raw: str) -> list[str]:
    """A row's 32 signed bytes of a block (``<32 x i8>``) as two halves of 16 floats."""
    halves = []
    for h in (0, 1):
        pick = "<" + ", ".join(f"i32 {16 * h + i}" for i in range(16)) + ">"
        half = fn.v(f"shufflevector {_B32} {raw}, {_B32} poison, <16 x i32> {pick}", "q8")
        halves.append(fn.v(f"sitofp {vec(16, 'i8')} {half} to {V16}", "qf"))
    return halves
