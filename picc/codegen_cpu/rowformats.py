"""How a row of each weight format is stored, and IR that loads, dequantises and prefetches its blocks.

A *row* of a weight matrix is ``k`` logical elements stored in one of the formats below; rows are
stored back to back (``row_bytes(dtype, k)`` apart). The block formats are GGUF's: 32 elements per
block, an f16 scale first::

    q8_0  34 B: f16 d, 32 x int8 q                      w = d * q
    q4_0  18 B: f16 d, 16 B nibbles                     w = d * (q - 8)
    q4_1  20 B: f16 d, f16 m, 16 B nibbles              w = d * q + m
    mxfp4 17 B: E8M0 e, 16 B nibbles                    w = 2^(e - 128) * MXFP4_VALUES[q]

Byte j of a nibble block holds element j (low nibble) and element j + 16 (high nibble). mxfp4's
nibbles index a 16-entry table of int8 (``picc.quant.MXFP4_VALUES``: 0..12 and their negatives),
looked up with ``vpshufb`` (:func:`mxfp4_values`; as floats, on AVX-512, with ``vpermps``:
:func:`table_floats`); its scale is a power of two made from ``e``'s
bits (:func:`mxfp4_scale`), so ``d * q`` is exact. It has no constant part: its dot products are
q4_0's without the ``- 8`` (no sums of x), in floats or, with int16 x, in ``vpmaddwd``.

A block is read as two ``<16 x float>`` halves (one AVX-512 register, two AVX2 ones). q4_0 / q4_1
nibbles become floats through a 16-entry table (``vpermps``) on AVX-512, through integer
arithmetic and a conversion elsewhere; both give exactly ``q`` (or ``q - 8``). What is built from
these blocks lives beside this module: dot products, AXPYs and GEMV tiles in
:mod:`picc.codegen_cpu.rowops`, x rounded to int16 and the integer dot products of 4-bit blocks
in :mod:`picc.codegen_cpu.int16x`, the down rows' rowplanes layout in
:mod:`picc.codegen_cpu.rowplanes`, eight rows at a time in :mod:`picc.codegen_cpu.rows8`.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cpu.irtext import F32, I32, Fn, fconst, vconst, vec
from picc.errors import PiccError
from picc.kernel_names import CPU_READ_FORMATS
from picc.quant import MXFP4_VALUES

BLOCK = 32
V16 = vec(16)
V8 = vec(8)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "mxfp4": 17}
ELEMENT_BYTES = {"f32": 4, "f16": 2}
WEIGHT_DTYPES = CPU_READ_FORMATS
NIBBLE_DTYPES = frozenset({"q4_0", "q4_1"})  # 4-bit formats: x sums needed in dot products


def check_dtype(dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise PiccError(f"codegen_cpu: weight dtype {dtype!r} is not supported; expected one of "
                        f"{', '.join(WEIGHT_DTYPES)}")


def is_blocked(dtype: str) -> bool:
    return dtype in BLOCK_BYTES


def block_bytes(dtype: str) -> int:
    """Bytes of 32 consecutive elements of a row."""
    return BLOCK_BYTES[dtype] if is_blocked(dtype) else BLOCK * ELEMENT_BYTES[dtype]


def row_bytes(dtype: str, k: int) -> int:
    """Bytes of one row of ``k`` elements (``k`` a multiple of 32 for block formats)."""
    check_dtype(dtype)
    if is_blocked(dtype):
        if k % BLOCK:
            raise PiccError(f"codegen_cpu: a {dtype} row needs a multiple of 32 elements, got {k}")
        return k // BLOCK * BLOCK_BYTES[dtype]
    return k * ELEMENT_BYTES[dtype]


def emit_row_bytes(fn: Fn, dtype: str, k: str) -> str:
    """IR for :func:`row_bytes` of an i64 ``k``."""
    if is_blocked(dtype):
        return fn.v(f"mul i64 {fn.v(f'lshr i64 {k}, 5', 'nb')}, {BLOCK_BYTES[dtype]}", "rowb")
    return fn.v(f"mul i64 {k}, {ELEMENT_BYTES[dtype]}", "rowb")


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a row: the two halves (unscaled quants for block formats), scale and minimum."""

    lo: str
    hi: str
    d: str | None = None
    m: str | None = None


def _nibble_floats(fn: Fn, qptr: str, signed: bool, simd: str) -> tuple[str, str]:
    """The low and high nibbles of 16 bytes as floats (``q - 8`` when ``signed``)."""
    return nibble_value_floats(fn, fn.load(vec(16, "i8"), qptr, 1, "nib"), signed, simd)


def nibble_value_floats(fn: Fn, raw: str, signed: bool, simd: str) -> tuple[str, str]:
    """:func:`_nibble_floats` of a ``<16 x i8>`` value."""
    if simd == "avx512":
        return table_floats(fn, raw, [q - 8 if signed else q for q in range(16)])
    wide = fn.v(f"zext {vec(16, 'i8')} {raw} to {vec(16, 'i32')}", "nibw")
    hi_i = fn.v(f"lshr {vec(16, 'i32')} {wide}, {vconst(16, '4', 'i32')}", "hi4")
    lo_i = fn.v(f"and {vec(16, 'i32')} {wide}, {vconst(16, '15', 'i32')}", "lo4")
    out = []
    for i in (lo_i, hi_i):
        if signed:
            i = fn.v(f"sub {vec(16, 'i32')} {i}, {vconst(16, '8', 'i32')}", "qs")
        out.append(fn.v(f"sitofp {vec(16, 'i32')} {i} to {V16}", "qf"))
    return out[0], out[1]


_MXFP4_TABLE = "<" + ", ".join(f"i8 {v}" for v in MXFP4_VALUES) + ">"


def mxfp4_scale(fn: Fn, bptr: str) -> str:
    """The scale of the mxfp4 block at ``bptr``, ``2^(e - 128)`` as a float, bit for bit as ggml's
    GGML_E8M0_TO_FP32_HALF (``picc.quant.e8m0_to_f32_half``): ``(e - 1) << 23``, a denormal
    ``0x00200000 << e`` for e < 2."""
    e = fn.v(f"zext i8 {fn.load('i8', bptr, 1, 'e8')} to i32", "e")
    normal = fn.v(f"shl i32 {fn.v(f'sub i32 {e}, 1', 'em1')}, 23", "dn")
    denormal = fn.v(f"shl i32 2097152, {e}", "dd")
    bits = fn.v(f"select i1 {fn.v(f'icmp ult i32 {e}, 2', 'small')}, {I32} {denormal}, {I32} {normal}", "db")
    return fn.v(f"bitcast i32 {bits} to float", "d")


def mxfp4_values(fn: Fn, raw: str) -> tuple[str, str]:
    """The int8 values (``<16 x i8>``) of the low and the high nibbles of 16 bytes ``raw``: a
    ``vpshufb`` of the table by each nibble."""
    b16 = vec(16, "i8")
    nibbles = (fn.v(f"and {b16} {raw}, {vconst(16, '15', 'i8')}", "lo4"),
               fn.v(f"lshr {b16} {raw}, {vconst(16, '4', 'i8')}", "hi4"))
    return tuple(fn.v(f"call {b16} @llvm.x86.ssse3.pshuf.b.128({b16} {_MXFP4_TABLE}, {b16} {i})", "mxq")
                 for i in nibbles)  # type: ignore[return-value]


def table_lookup(fn: Fn, nibbles: str, nbytes: int, table: tuple[int, ...]) -> str:
    """``table[q]`` for each byte ``q`` (< 16) of ``nibbles`` (``<nbytes x i8>``, 32 or 64): ``vpshufb``
    with the 16 entries in every 128-bit lane."""
    ty = vec(nbytes, "i8")
    entries = "<" + ", ".join(f"i8 {table[i % 16]}" for i in range(nbytes)) + ">"
    name = "avx2.pshuf.b" if nbytes == 32 else "avx512.pshuf.b.512"
    return fn.v(f"call {ty} @llvm.x86.{name}({ty} {entries}, {ty} {nibbles})", "tq")


def table_floats(fn: Fn, raw: str, table: list[int] | tuple[int, ...]) -> tuple[str, str]:
    """``table[q]`` as floats for the low and the high nibbles of 16 bytes ``raw`` (AVX-512):
    ``vpermps`` reads only the low 4 bits of each index, so the lookup is the conversion."""
    wide = fn.v(f"zext {vec(16, 'i8')} {raw} to {vec(16, 'i32')}", "nibw")
    hi_i = fn.v(f"lshr {vec(16, 'i32')} {wide}, {vconst(16, '4', 'i32')}", "hi4")
    floats = "<" + ", ".join(f"float {fconst(v)}" for v in table) + ">"
    return tuple(fn.v(f"call {V16} @llvm.x86.avx512.permvar.sf.512({V16} {floats}, {vec(16, 'i32')} {i})", "qf")
                 for i in (wide, hi_i))  # type: ignore[return-value]


def load_block(fn: Fn, dtype: str, row: str, b: str, simd: str, q4_0_raw: bool = False) -> Block:
    """Block ``b`` (i64) of ``row``; with ``q4_0_raw``, q4_0's quants as stored (``q``, not ``q - 8``)."""
    bptr = fn.at(row, block_bytes(dtype), b, "blk")
    if dtype == "mxfp4":
        raw = fn.load(vec(16, "i8"), fn.gep(bptr, "1"), 1, "nib")
        if simd == "avx512":  # the same exact values either way
            lo, hi = table_floats(fn, raw, MXFP4_VALUES)
        else:
            lo, hi = (fn.v(f"sitofp {vec(16, 'i8')} {q} to {V16}", "qf") for q in mxfp4_values(fn, raw))
        return Block(lo, hi, mxfp4_scale(fn, bptr))
    if dtype in ("f32", "f16"):
        first = fn.v(f"shl i64 {b}, 5", "b32")
        return Block(*(load_floats16(fn, dtype, row, fn.v(f"add i64 {first}, {16 * h}", "bh") if h else first)
                       for h in (0, 1)))
    # The scale (and q4_1's minimum) as one 4-byte load and one conversion: two scalar f16 loads
    # cost Zen 3 more FP-pipe work (an insert and a convert each) than it is worth.
    dm = fn.v(f"fpext <2 x half> {fn.load('<2 x half>', bptr, 2, 'dmh')} to <2 x float>", "dm")
    d = fn.v(f"extractelement <2 x float> {dm}, i64 0", "d")
    if dtype == "q8_0":
        lo, hi = (fn.v(f"sitofp {vec(16, 'i8')} {fn.load(vec(16, 'i8'), fn.gep(bptr, str(2 + 16 * h)), 1, 'q8')} "
                       f"to {V16}", "qf") for h in (0, 1))
        return Block(lo, hi, d)
    if dtype == "q4_0":
        lo, hi = _nibble_floats(fn, fn.gep(bptr, "2"), not q4_0_raw, simd)
        return Block(lo, hi, d)
    lo, hi = _nibble_floats(fn, fn.gep(bptr, "4"), False, simd)
    return Block(lo, hi, d, fn.v(f"extractelement <2 x float> {dm}, i64 1", "m"))


def dequantized(fn: Fn, blk: Block) -> tuple[str, str]:
    """The block's f32 values, computed exactly as ``picc.quant.dequantize`` (``d * q (+ m)``)."""
    if blk.d is None:
        return blk.lo, blk.hi
    ds = fn.splat(16, blk.d)
    out = [fn.v(f"fmul {V16} {q}, {ds}", "w") for q in (blk.lo, blk.hi)]
    if blk.m is not None:
        ms = fn.splat(16, blk.m)
        out = [fn.v(f"fadd {V16} {w}, {ms}", "w") for w in out]
    return out[0], out[1]


def load_floats16(fn: Fn, dtype: str, row: str, j: str) -> str:
    """Elements ``j .. j + 15`` of a plain (f32 / f16) row as <16 x float>."""
    if dtype == "f32":
        return fn.load(V16, fn.at(row, 4, j), 4, "w")
    return fn.v(f"fpext {vec(16, 'half')} {fn.load(vec(16, 'half'), fn.at(row, 2, j), 2, 'w16')} to {V16}", "w")


def load_element(fn: Fn, dtype: str, row: str, j: str) -> str:
    """Element ``j`` of a plain (f32 / f16) row as a float."""
    if dtype == "f32":
        return fn.load(F32, fn.at(row, 4, j), 4, "e")
    return fn.v(f"fpext half {fn.load('half', fn.at(row, 2, j), 2, 'e16')} to float", "e")


def prefetch_block(fn: Fn, dtype: str, row: str, b: str, into: str) -> None:
    """Prefetch the cache lines of block ``b`` of ``row`` (one per 64 bytes; blocks under 64
    bytes get one each, which covers every line since consecutive blocks are < 64 bytes apart)."""
    bb = block_bytes(dtype)
    start = fn.v(f"mul i64 {b}, {bb}", "pfo")
    for off in range(0, bb, 64):
        p = fn.gep(row, fn.v(f"add i64 {start}, {off}", "pfo") if off else start, "pfp")
        fn.prefetch(p, into)


Prefetch = list[tuple[str, str]]
"""Rows to prefetch alongside a loop over blocks: ``(dtype, row pointer)``."""


def fold8(fn: Fn, v16: str) -> str:
    """Lanes 0-7 plus lanes 8-15 of a ``<16 x float>`` (free on AVX2: two registers)."""
    halves = [fn.v(f"shufflevector {V16} {v16}, {V16} poison, <8 x i32> "
                   f"<{', '.join(f'i32 {i}' for i in range(h, h + 8))}>", "half") for h in (0, 8)]
    return fn.v(f"fadd {V8} {halves[0]}, {halves[1]}", "fold")


def emit_row_to_f32(fn: Fn, dtype: str, row: str, out: str, k: str, simd: str) -> None:
    """``out[j] = row[j]`` dequantised exactly as ``picc.quant``, for j < k (i64)."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    with fn.loop("0", nblocks, "1", "b") as b:
        lo, hi = dequantized(fn, load_block(fn, dtype, row, b, simd))
        op = fn.at(out, 4 * BLOCK, b, "op")
        fn.store(V16, lo, op, 4)
        fn.store(V16, hi, fn.gep(op, "64"), 4)
    if not is_blocked(dtype):
        with fn.loop(fn.v(f"shl i64 {nblocks}, 5", "tail"), k, "1", "j") as j:
            fn.store(F32, load_element(fn, dtype, row, j), fn.at(out, 4, j, "op"), 4)
