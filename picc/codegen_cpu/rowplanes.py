"""The *rowplanes* layout of a sparse FFN's neuron-major down projection, and the code that reads it.

A fused sparse FFN adds ``h_i down_t[i]`` to y for each active neuron i: an AXPY per row of the
neuron-major down projection. In GGUF's rows every block of 32 elements starts with its f16 scale
(and q4_1's minimum), so an AXPY spends, for every row and block, vector-pipe work on the scalars
alone: load and convert ``d`` (and ``m``), multiply by ``h``, broadcast, and add ``h m`` to the
block's constant term -- six of the twenty operations of a q4_1 row block. In the rowplanes layout
a row holds the same bytes regrouped into planes::

    q4_1  f16 d[nb], f16 m[nb], 16 B of nibbles[nb]
    q4_0  f16 d[nb],            16 B of nibbles[nb]
    q8_0  f16 d[nb],            32 B of int8[nb]

(``nb`` = k / 32 blocks), so a row's coefficients ``h d_b`` and constant terms (``h m_b``, q4_0's
``-8 h d_b``) are computed eight blocks at a time into a stack array, and the block loop reads one
coefficient per row and block with a broadcast load, which needs no vector pipe.

The 4-bit quants come in *units* of four blocks (then one of two and one of one for a row's last
``nb % 4`` blocks): a unit of ``u`` blocks starting at block ``s`` is sixteen little-endian lanes
of ``8 u`` bits, and nibble ``c`` of lane ``l`` (bits ``4c .. 4c + 3``) is element
``32 s + 16 c + l`` of the row (a one-block unit is GGUF's block as it is). A four-block unit
read as sixteen 32-bit lanes gives each of its eight runs of 16 elements with one mask and no
shuffle: ``lanes & (15 << 4c)`` converts to ``q 2^(4c)`` exactly, and its coefficient is stored
scaled by ``2^(-4c)`` (the top run, ``c = 7``, whose int32 would be negative, is shifted down
instead and keeps its coefficient as it is). That is a mask, a conversion and an FMA per 16
elements: no lane-crossing instruction, where GGUF's order needs a widening, a shift and two
table lookups per block, all on the shuffle pipes (FP1 and FP2 on Zen 4, which bound that loop).

The arithmetic and its order are those of the AXPYs of GGUF rows this replaced (``(h d) q`` in
f32, the constant terms summed per block in row order): the same bits, as long as ``h d 2^-24``
is a normal float (``|h d| >= 2^-102``; below that the products are under 1e-30 anyway).

The block loop is :func:`emit_axpys`; prefill reads a slice of a row back as floats
(:func:`emit_row_to_f32`). :func:`to_rowplanes` and :func:`from_rowplanes` convert a matrix
between GGUF's rows and this layout, bit for bit. Measured: docs/codegen_cpu.md.
"""

from __future__ import annotations

import numpy as np

from picc.codegen_cpu.irtext import F32, I32, Fn, Var, fconst, vconst, vec
from picc.codegen_cpu.rowformats import (
    BLOCK,
    BLOCK_BYTES,
    NIBBLE_DTYPES,
    V16,
    Block,
    Prefetch,
    dequantized,
)
from picc.codegen_cpu.rowops import zero_floats
from picc.errors import PiccError

LAYOUT = "rowplanes"
DTYPES = frozenset({"q8_0", "q4_0", "q4_1"})  # the formats with f16 per-block scales (not mxfp4)
_GROUP = 8  # blocks whose coefficients one vector operation makes
_QUAD = 4  # blocks of a full 4-bit quant unit: sixteen 32-bit lanes of eight nibbles
_LINE = 64  # bytes of a cache line: the later rows are prefetched a line at a time
COEFS_PER_BLOCK = {"q8_0": 1, "q4_0": 2, "q4_1": 2}  # coefficient floats a row and block
V8 = vec(8)
V16I = vec(16, I32)


def _has_m(dtype: str) -> bool:
    return dtype == "q4_1"


def head_bytes(dtype: str) -> int:
    """Bytes of one block's f16 scale (and q4_1's minimum): the planes before the quants, per block."""
    return 4 if _has_m(dtype) else 2


def _quant_bytes(dtype: str) -> int:
    """Bytes of one block's quants."""
    return BLOCK_BYTES[dtype] - head_bytes(dtype)


def _check(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
    if dtype not in DTYPES or len(shape) != 2 or int(shape[1]) % BLOCK:
        raise PiccError(f"rowplanes layout: holds q8_0 / q4_0 / q4_1 matrices with rows of whole blocks, "
                        f"not a {dtype} matrix of shape {tuple(shape)}")
    rows, nb = int(shape[0]), int(shape[1]) // BLOCK
    if nbytes != rows * nb * BLOCK_BYTES[dtype]:
        raise PiccError(f"rowplanes layout: {nbytes} bytes are not a {dtype} matrix of shape {tuple(shape)}")
    return rows, nb


def _units(nb: int) -> list[tuple[int, int]]:
    """The 4-bit quant units of a row of ``nb`` blocks: ``(first block, blocks)``."""
    quads = nb // _QUAD * _QUAD
    units = [(s, _QUAD) for s in range(0, quads, _QUAD)]
    if nb & 2:
        units.append((quads, 2))
    if nb & 1:
        units.append((nb - 1, 1))
    return units


def _reorder_quants(q: np.ndarray, forward: bool) -> np.ndarray:
    """4-bit quants ``[rows, nb, 16]`` (GGUF's per block) into units (``forward``), or back: a
    unit of ``u`` blocks is the transpose of its ``[u, 16]`` bytes, so lane l's byte j is byte l
    of the unit's block j."""
    rows, nb, _ = q.shape
    out = np.empty_like(q)
    for s, u in _units(nb):
        if forward:
            out[:, s : s + u] = q[:, s : s + u].transpose(0, 2, 1).reshape(rows, u, 16)
        else:
            out[:, s : s + u] = q[:, s : s + u].reshape(rows, 16, u).transpose(0, 2, 1)
    return out


def block_parts(raw: np.ndarray, dtype: str, rows: int, nb: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A matrix's GGUF blocks (``rows`` of ``nb`` blocks, any array of their bytes) split into its
    f16 scale planes (``[rows, nb, 2]`` each: ``d``, then q4_1's ``m``) and its quants (``[rows,
    nb, quant bytes]``): what the planes layouts regroup (this one, :mod:`.dotplanes`)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, BLOCK_BYTES[dtype])
    head = head_bytes(dtype)
    return [blocks[..., at : at + 2] for at in range(0, head, 2)], blocks[..., head:]


def blocks_of(scales: list[np.ndarray], quants: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of :func:`block_parts`: the blocks in GGUF's rows, ``[rows, row bytes]``."""
    rows, nb = quants.shape[:2]
    out = np.empty((rows, nb, BLOCK_BYTES[dtype]), np.uint8)
    for i, plane in enumerate(scales):
        out[..., 2 * i : 2 * i + 2] = plane.reshape(rows, nb, 2)
    out[..., head_bytes(dtype) :] = quants.reshape(rows, nb, -1)
    return out.reshape(rows, -1)


def to_rowplanes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A matrix's GGUF blocks (any array of its bytes, rows one after another) in the rowplanes
    layout, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, raw.nbytes)
    scales, quants = block_parts(raw, dtype, rows, nb)
    if dtype in NIBBLE_DTYPES:
        quants = _reorder_quants(quants, forward=True)
    return np.concatenate([p.reshape(rows, -1) for p in (*scales, quants)], axis=1)


def from_rowplanes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`to_rowplanes`: the matrix's blocks in GGUF's rows, ``[rows, row bytes]``."""
    rows, nb = _check(dtype, shape, data.nbytes)
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    head = head_bytes(dtype)
    scales = [flat[:, at * nb : (at + 2) * nb] for at in range(0, head, 2)]
    quants = flat[:, head * nb :].reshape(rows, nb, -1)
    return blocks_of(scales, _reorder_quants(quants, forward=False) if dtype in NIBBLE_DTYPES else quants, dtype)


def _plane(fn: Fn, dtype: str, row: str, nblocks: str, which: str) -> str:
    """The start of plane ``which`` ("m" or "q") of ``row`` (``nblocks`` i64 blocks in the row)."""
    before = 2 if which == "m" else head_bytes(dtype)  # bytes per block of the planes before it
    return fn.gep(row, fn.v(f"mul i64 {nblocks}, {before}", "plo"), which + "p")


def _half(fn: Fn, plane: str, b: str, n: int) -> str:
    """Elements ``b .. b + n`` of an f16 plane as floats (one float when ``n`` is 1)."""
    ty = "half" if n == 1 else vec(n, "half")
    out = F32 if n == 1 else vec(n)
    return fn.v(f"fpext {ty} {fn.load(ty, fn.at(plane, 2, b), 2, 'h16')} to {out}", "hf")


def _q8_quants(fn: Fn, qplane: str, b: str) -> tuple[str, str]:
    """Block ``b``'s q8_0 quants as two ``<16 x float>`` halves."""
    at = fn.at(qplane, _quant_bytes("q8_0"), b, "qb")
    return tuple(fn.v(f"sitofp {vec(16, 'i8')} {fn.load(vec(16, 'i8'), fn.gep(at, str(16 * h)), 1, 'q8')} "
                      f"to {V16}", "qf") for h in (0, 1))  # type: ignore[return-value]


def _run(fn: Fn, lanes: str, c: str | int) -> str:
    """Run ``c`` of a unit's ``<16 x i32>`` lanes as floats ``q 2^(4c)`` (``c`` < 7, masked in
    place), or ``q`` (``c`` == 7: shifted down); ``c`` an int or an i32 value."""
    if c == 7:
        return fn.v(f"sitofp {V16I} {fn.v(f'lshr {V16I} {lanes}, {vconst(16, str(28), I32)}', 'top')} to {V16}", "qf")
    if isinstance(c, int):
        mask = vconst(16, str(15 << 4 * c), I32)
    else:
        place = fn.splat(16, fn.v(f"shl i32 {c}, 2", "c4"), I32, "c4")
        mask = fn.v(f"shl {V16I} {vconst(16, '15', I32)}, {place}", "mask")
    return fn.v(f"sitofp {V16I} {fn.v(f'and {V16I} {lanes}, {mask}', 'run')} to {V16}", "qf")


def _unit_lanes(fn: Fn, qplane: str, s: str, u: int) -> str:
    """The ``<16 x i32>`` lanes of the ``u``-block unit starting at block ``s``."""
    at = fn.at(qplane, 16, s, "qu")
    if u == _QUAD:
        return fn.load(V16I, at, 1, "lanes")
    narrow = vec(16, f"i{8 * u}")
    return fn.v(f"zext {narrow} {fn.load(narrow, at, 1, 'nib')} to {V16I}", "lanes")


def _scale_pattern(blocks: int) -> str:
    """The powers of two that scale ``blocks`` (a multiple of 4, from a unit's start) blocks'
    coefficient pairs: ``2^(-4c)`` for run c of the unit, 1 for the top run."""
    return "<" + ", ".join(f"float {fconst(1.0 if c == 7 else 2.0 ** (-4 * c))}"
                           for _ in range(blocks // _QUAD) for c in range(8)) + ">"


def emit_scratch(fn: Fn, dtype: str, k: str, rows: int) -> tuple[list[str], str | None]:
    """Stack arrays for :func:`emit_axpys` of rows of ``k`` (i64) elements: ``rows`` coefficient
    arrays and (4-bit) the per-block constant terms, zeroed. Sized for the row's blocks rounded
    up to eight, which :func:`emit_coefficients` fills eight at a time."""
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    padded = fn.v(f"and i64 {fn.v(f'add i64 {nblocks}, {_GROUP - 1}', 'nb7')}, {-_GROUP}", "nbpad")
    floats = fn.v(f"mul i64 {padded}, {COEFS_PER_BLOCK[dtype]}", "ncoef")
    coefs = [fn.alloca_array(F32, floats, "coef") for _ in range(rows)]
    consts = None
    if dtype in NIBBLE_DTYPES:
        consts = fn.alloca_array(F32, padded, "consts")
        zero_floats(fn, consts, padded)
    return coefs, consts


def emit_coefficients(fn: Fn, dtype: str, row: str, nblocks: str, a: str, coef: str, consts: str | None) -> None:
    """The row's coefficients ``a d_b`` into ``coef`` (q8_0: one a block; 4-bit: two, ``coef[2b +
    h] = a d_b 2^(-4c)`` for the run ``c = 2 (b % 4) + h`` of its unit, see the module's notes),
    and (4-bit) its constant terms added to ``consts[b]``: ``a m_b`` (q4_1), ``-8 a d_b`` (q4_0).
    Eight blocks at a time, past the row's last block up to a multiple of eight (the arrays of
    :func:`emit_scratch` have room; the scales read past a plane's end are the row's next
    plane's bytes, and what they make is never read)."""
    if (dtype != "q8_0") != (consts is not None):
        raise PiccError(f"codegen_cpu: {dtype} rows {'need' if consts is None else 'have no'} per-block constants")
    mplane = _plane(fn, dtype, row, nblocks, "m") if _has_m(dtype) else None
    per = COEFS_PER_BLOCK[dtype]
    av = fn.splat(_GROUP, a, hint="a8")
    with fn.loop("0", nblocks, str(_GROUP), "g") as g:
        c = fn.v(f"fmul {V8} {av}, {_half(fn, row, g, _GROUP)}", "c")
        cp = fn.at(coef, 4 * per, g, "cp")
        if per == 1:
            fn.store(V8, c, cp, 4)
        else:
            pairs = fn.v(f"shufflevector {V8} {c}, {V8} poison, <16 x i32> "
                         f"<{', '.join(f'i32 {i // 2}' for i in range(16))}>", "c2")
            fn.store(V16, fn.v(f"fmul {V16} {pairs}, {_scale_pattern(_GROUP)}", "cs"), cp, 4)
        if consts is not None:
            if mplane is not None:
                term = fn.v(f"fmul {V8} {av}, {_half(fn, mplane, g, _GROUP)}", "am")
            else:
                term = fn.v(f"fmul {V8} {c}, {fn.splat(_GROUP, fconst(-8.0))}", "c8")
            kp = fn.at(consts, 4, g, "kp")
            fn.store(V8, fn.v(f"fadd {V8} {fn.load(V8, kp, 4, 'k')}, {term}", "k"), kp, 4)


def emit_axpys(fn: Fn, rows: list[tuple[str, str, str]], y: str, k: str, coefs: list[str],
               consts: str | None, prefetch: Prefetch | None = None) -> None:
    """``y[j] += sum(a * row[j] for (dtype, row, a) in rows)`` for j < k (i64, a multiple of 32),
    y f32, rows in the rowplanes layout (``(a d) q`` per block, rows in order): the 4-bit
    constant terms go to ``consts[b]`` for the caller to add (:func:`rowops.emit_add_block_consts`).
    ``coefs`` and ``consts``: the arrays of :func:`emit_scratch` (at least as many coefficient
    arrays as ``rows``). ``prefetch``: rows read after these, prefetched along."""
    if len(coefs) < len(rows):
        raise PiccError(f"codegen_cpu: {len(rows)} rowplanes AXPYs need as many coefficient arrays, got {len(coefs)}")
    dtypes = {dtype for dtype, _, _ in rows}
    if len(dtypes) != 1:
        raise PiccError(f"codegen_cpu: rowplanes AXPYs of one call share a format, got {sorted(dtypes)}")
    nblocks = fn.v(f"lshr i64 {k}, 5", "nblk")
    planes = []
    for (dtype, row, a), coef in zip(rows, coefs, strict=False):
        emit_coefficients(fn, dtype, row, nblocks, a, coef, consts)
        planes.append((_plane(fn, dtype, row, nblocks, "q"), coef))
    for dtype, row in prefetch or []:  # each later row's last byte (the spans below leave its line)
        fn.prefetch(fn.gep(row, fn.v(f"sub i64 {fn.v(f'mul i64 {nblocks}, {BLOCK_BYTES[dtype]}', 'rb')}, 1", "end")),
                    "l2")
    if dtypes == {"q8_0"}:
        with fn.loop("0", nblocks, "1", "b") as b:
            _prefetch_span(fn, prefetch, b, 1)
            rows = []
            for qp, coef in planes:
                cp = fn.at(coef, 4, b)
                rows.append([(half, cp) for half in _q8_quants(fn, qp, b)])
            _add_runs(fn, y, b, rows)
        return
    quads = fn.v(f"and i64 {nblocks}, {-_QUAD}", "nquad")
    with fn.loop("0", quads, str(_QUAD), "b") as b:
        _prefetch_span(fn, prefetch, b, _QUAD)
        _unit_axpys(fn, y, planes, b, _QUAD)
    with fn.if_(fn.v(f"icmp ne i64 {fn.v(f'and i64 {nblocks}, 2', 'two')}, 0", "has2")):
        _prefetch_span(fn, prefetch, quads, 2)
        _unit_axpys(fn, y, planes, quads, 2)
    last = fn.v(f"sub i64 {nblocks}, 1", "lastb")
    with fn.if_(fn.v(f"icmp ne i64 {fn.v(f'and i64 {nblocks}, 1', 'one')}, 0", "has1")):
        _prefetch_span(fn, prefetch, last, 1)
        _unit_axpys(fn, y, planes, last, 1)


def _prefetch_span(fn: Fn, prefetch: Prefetch | None, b: str, count: int) -> None:
    """Prefetch (into L2) the ``count`` blocks' worth of bytes from block ``b``'s offset (``b``
    times the block's size) of each row of ``prefetch``, a line apart: a row's bytes spread over
    its blocks, one prefetch a cache line. A line a span ends in is the next span's first (or,
    past the last, the row's last byte's)."""
    for dtype, row in prefetch or []:
        span = count * BLOCK_BYTES[dtype]
        start = fn.v(f"mul i64 {b}, {BLOCK_BYTES[dtype]}", "pfo")
        for off in range(0, span, _LINE):
            fn.prefetch(fn.gep(row, fn.v(f"add i64 {start}, {off}", "pfo") if off else start, "pfp"), "l2")


def _unit_axpys(fn: Fn, y: str, planes: list[tuple[str, str]], s: str, u: int) -> None:
    """The AXPYs of the ``u``-block unit starting at block ``s``: its 2u runs of 16 elements, each
    a mask, a conversion and an FMA a row. A one-block unit after a two-block one sits at block
    ``s = 2 (mod 4)``: its lanes are moved up to where its coefficients' runs are."""
    runs = []
    for qplane, coef in planes:
        lanes = _unit_lanes(fn, qplane, s, u)
        first: str | int = 0
        if u == 1:
            q = fn.v(f"trunc i64 {fn.v(f'and i64 {s}, 3', 'sq')} to i32", "sq")
            shift = fn.splat(16, fn.v(f"shl i32 {q}, 3", "q8"), I32, "sh")
            lanes = fn.v(f"shl {V16I} {lanes}, {shift}", "lanes")
            first = fn.v(f"shl i32 {q}, 1", "c0")
        values = [_run(fn, lanes, c if isinstance(first, int) else fn.v(f"add i32 {first}, {c}", "c"))
                  for c in range(2 * u)]
        runs.append((values, fn.at(coef, 8, s, "cq")))
    _add_runs(fn, y, s, [[(value, fn.gep(cq, str(4 * r)) if r else cq) for r, value in enumerate(values)]
                         for values, cq in runs])


def _add_runs(fn: Fn, y: str, b: str, rows: list[list[tuple[str, str]]]) -> None:
    """y's runs of 16 elements from block ``b`` on plus, row after row, each run's value times
    the coefficient at its pointer: ``rows`` is ``[(value, coefficient pointer), ...]`` per row,
    all rows with the same number of runs."""
    ybase = fn.at(y, 4 * BLOCK, b, "yp")
    yps = [fn.gep(ybase, str(64 * r), "yr") if r else ybase for r in range(len(rows[0]))]
    ys = [fn.load(V16, yp, 4, "y") for yp in yps]
    for runs in rows:
        scales: dict[str, str] = {}  # a coefficient that serves several runs is loaded once
        for r, (value, cp) in enumerate(runs):
            if cp not in scales:
                scales[cp] = fn.splat(16, fn.load(F32, cp, 4, "c"))
            ys[r] = fn.fma(V16, value, scales[cp], ys[r], "y")
    for yp, value in zip(yps, ys, strict=True):
        fn.store(V16, value, yp, 4)


def emit_row_to_f32(fn: Fn, dtype: str, row: str, nblocks: str, b0: str, out: str, k: str) -> None:
    """``out[j]`` = element ``32 b0 + j`` of ``row`` (rowplanes, ``nblocks`` i64 blocks), j < k (i64,
    a multiple of 32), dequantised exactly as ``picc.quant`` (:func:`rowformats.dequantized`)."""
    mplane = _plane(fn, dtype, row, nblocks, "m") if _has_m(dtype) else None
    qplane = _plane(fn, dtype, row, nblocks, "q")
    quads = fn.v(f"and i64 {nblocks}, {-_QUAD}", "nquad")
    lanes_var = fn.var(V16I, hint="lanes") if dtype != "q8_0" else None
    with fn.loop("0", fn.v(f"lshr i64 {k}, 5", "nblk"), "1", "j") as j:
        b = fn.v(f"add i64 {b0}, {j}", "b")
        if lanes_var is None:
            lo, hi = _q8_quants(fn, qplane, b)
        else:
            lo, hi = _block_quants(fn, qplane, nblocks, quads, b, lanes_var)
        if dtype == "q4_0":
            eight = fn.splat(16, fconst(8.0))
            lo, hi = (fn.v(f"fsub {V16} {q}, {eight}", "qs") for q in (lo, hi))
        m = _half(fn, mplane, b, 1) if mplane is not None else None
        lo, hi = dequantized(fn, Block(lo, hi, _half(fn, row, b, 1), m))
        op = fn.at(out, 4 * BLOCK, j, "op")
        fn.store(V16, lo, op, 4)
        fn.store(V16, hi, fn.gep(op, "64"), 4)


def _block_quants(fn: Fn, qplane: str, nblocks: str, quads: str, b: str, lanes_var: Var) -> tuple[str, str]:
    """Block ``b``'s 4-bit quants (as stored) as two ``<16 x float>`` halves, from its unit."""
    in_quad = fn.v(f"icmp slt i64 {b}, {quads}", "inq")
    after = fn.v(f"sub i64 {b}, {quads}", "rb")  # blocks past the quads (negative inside them)
    pair_end = fn.v(f"and i64 {nblocks}, 2", "two")
    past, short = fn.v(f"icmp sge i64 {after}, 0", "ge"), fn.v(f"icmp slt i64 {after}, {pair_end}", "lt")
    in_pair = fn.v(f"and i1 {past}, {short}", "inp")
    quad_start = fn.v(f"and i64 {b}, {-_QUAD}", "qs")
    tail_start = fn.v(f"select i1 {in_pair}, i64 {quads}, i64 {b}", "ps")
    start = fn.v(f"select i1 {in_quad}, i64 {quad_start}, i64 {tail_start}", "us")
    with fn.if_(in_quad, "quad"):
        lanes_var.set(_unit_lanes(fn, qplane, start, _QUAD))
    with fn.if_(in_pair, "pair"):
        lanes_var.set(_unit_lanes(fn, qplane, start, 2))
    single = fn.v(f"xor i1 {fn.v(f'or i1 {in_quad}, {in_pair}', 'qp')}, true", "one")
    with fn.if_(single, "single"):
        lanes_var.set(_unit_lanes(fn, qplane, start, 1))
    lanes = lanes_var.get("lanes")
    within = fn.v(f"sub i64 {b}, {start}", "ib")
    place = fn.v(f"trunc i64 {fn.v(f'shl i64 {within}, 3', 'sh')} to i32", "sh")
    out = []
    for h in (0, 1):
        sh = place if h == 0 else fn.v(f"add i32 {place}, 4", "sh")
        moved = fn.v(f"lshr {V16I} {lanes}, {fn.splat(16, sh, I32, 'sh')}", "mv")
        nib = fn.v(f"and {V16I} {moved}, {vconst(16, '15', I32)}", "nib")
        out.append(fn.v(f"sitofp {V16I} {nib} to {V16}", "qf"))
    return out[0], out[1]
