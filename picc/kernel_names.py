"""Which kernel computes an op on its device: the names ``select-kernels`` writes into the IR.

The IR after ``select-kernels`` names, on every op, the kernel its device runs (``{kernel =
...}``); the backends generate kernels under exactly these names, so a user who reads a dump can
find the code: a CPU name is the symbol of an LLVM function in the ``.pib``'s CPU code, a GPU
name is the file ``<name>.cu`` that ``picc inspect --emit-cuda`` writes.

CPU kernels are generic over sizes (passed at run time), so their names say the operation and
the weight formats. GPU kernels are compiled by TVM for fixed shapes, so their names also say
the shapes. This module holds the naming rules only (it imports nothing of picc): ``select-kernels`` names
the kernel of each op with them, from the op's attributes, and the backends' factories name their
kernels with the same functions, so a name in the IR and the kernel behind it cannot drift apart.
Names are written, never read back: what a kernel does is in the op's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# --- CPU: one symbol per operation and weight format ---------------------------------------------


# 4-bit formats whose kernels read the rows8, rowplanes and dotplanes layouts too (and have rates)
NIBBLE_DTYPES = frozenset({"q4_0", "q4_1"})
# formats with integer dot product variants: the nibble formats, and mxfp4 (gpt-oss's experts), whose
# rows are dotted with int16 x one row at a time (GEMVs, dense FFNs, mixtures; no other layout)
INT_DOT_DTYPES = NIBBLE_DTYPES | {"mxfp4"}
# 8-bit rows the rows8 layout holds too, dotted with int8 x only (an LM head's q8_0 rows)
BYTE_ROWS8_DTYPES = frozenset({"q8_0"})
# 4-bit rows the rows8 layout holds for rounded x alone (int16 or int8): mxfp4, whose nibbles index
# a table, so the float-x trick of masked nibbles converted in place does not read them
INT_ROWS8_DTYPES = frozenset({"mxfp4"})
ROWS8_DTYPES = NIBBLE_DTYPES | BYTE_ROWS8_DTYPES | INT_ROWS8_DTYPES
I16_ROWS8_DTYPES = NIBBLE_DTYPES | INT_ROWS8_DTYPES  # what the rows8 layout holds for int16 x (a mixture's experts)
X_FORMATS = ("f32", "i16", "i8")  # how x meets 4-bit rows: floats, or rounded to int16 / int8 per block
INT_DOTS_SUFFIX = "_xi16"
ROWS8_SUFFIX = "_r8"  # (before the x suffix) the kernel reads its 4-bit matrices eight rows at a time


def _int_suffix(x_format: str, *dtypes: str | None) -> str:
    """The suffix of the variant that dots 4-bit rows (or q8_0 rows, with int8 x) with x rounded to
    ``x_format`` (``_xi16``, ``_xi8``) where one is read; none for float x."""
    if x_format not in X_FORMATS:
        raise ValueError(f"x_format is one of {X_FORMATS}, not {x_format!r}")
    rounded = INT_DOT_DTYPES | (BYTE_ROWS8_DTYPES if x_format == "i8" else frozenset())
    return f"_x{x_format}" if x_format != "f32" and rounded & set(dtypes) else ""


CPU_WEIGHT_FORMATS = ("f32", "f16", "q8_0", "q4_0", "q4_1")  # the formats with kernel rates
# what the CPU kernels read: mxfp4 has no rate keys of its own (the cost model reads it at the
# memory's bandwidth) and is read in rows, or in rows8 with rounded x (not rowplanes nor dotplanes)
CPU_READ_FORMATS = (*CPU_WEIGHT_FORMATS, "mxfp4")
# The keys of a CPU's kernel-rate table (``picc.targets``, ``picc.codegen_cpu.rates``): how fast
# its kernels consume the weights of each format when memory is not the limit: rows one at a
# time with float x, with int16 x (``_xi16``), and the 4-bit formats eight rows at a time from
# the rows8 layout with float x (``_r8``), int16 x (``_r8_xi16``) and int8 x (``_r8_xi8``); q8_0
# from the rows8 layout with int8 x (these are GEMVs: CPU_GEMV_RATE_KEYS); and a fused sparse FFN's
# active rows, gathered a neuron at a time (``_gathered``: CPU_GATHERED_RATE_KEYS), with float x and
# (4-bit) int16 x.
GATHERED_SUFFIX = "_gathered"  # (before the x suffix) rows gathered one neuron at a time
CPU_GEMV_RATE_KEYS = (CPU_WEIGHT_FORMATS + tuple(d + INT_DOTS_SUFFIX for d in sorted(NIBBLE_DTYPES))
                      + tuple(d + ROWS8_SUFFIX for d in sorted(NIBBLE_DTYPES))
                      + tuple(d + ROWS8_SUFFIX + INT_DOTS_SUFFIX for d in sorted(NIBBLE_DTYPES))
                      + tuple(d + ROWS8_SUFFIX + "_xi8" for d in sorted(NIBBLE_DTYPES | BYTE_ROWS8_DTYPES)))
CPU_GATHERED_RATE_KEYS = (tuple(d + GATHERED_SUFFIX for d in CPU_WEIGHT_FORMATS)
                          + tuple(d + GATHERED_SUFFIX + INT_DOTS_SUFFIX for d in sorted(NIBBLE_DTYPES)))
CPU_RATE_KEYS = CPU_GEMV_RATE_KEYS + CPU_GATHERED_RATE_KEYS


def _rows8_suffix(rows8: bool, *dtypes: str | None) -> str:
    return ROWS8_SUFFIX if rows8 and {d for d in dtypes if d} <= ROWS8_DTYPES else ""


def has_rate_key(dtype: str, x_format: str, rows8: bool) -> bool:
    """Whether the GEMV of ``dtype`` rows dotting x in ``x_format`` (from the rows8 layout with
    ``rows8``) has a rate key of its own: every format with float x one row at a time; 4-bit rows
    with int16 x, and int8 x from rows8 (one row at a time int8 is read as int16: its key); 4-bit
    rows from rows8 with any x; q8_0 from rows8 with int8 x alone (its only GEMV there)."""
    if dtype in BYTE_ROWS8_DTYPES and rows8:
        return x_format == "i8"
    if dtype in INT_ROWS8_DTYPES:
        return False
    if x_format != "f32" or rows8:
        return dtype in NIBBLE_DTYPES and not (x_format == "i8" and not rows8)
    return True


def cpu_rate_variants() -> list[tuple[str, str, str, bool]]:
    """Each key of :data:`CPU_GEMV_RATE_KEYS`, in order, with what it stands for: (key, dtype, x
    format, rows8). Rows one at a time read int8 as int16: the ``_xi16`` key."""
    meaning = {cpu_rate_key(d, x, r): (d, x, r) for d in CPU_WEIGHT_FORMATS for r in (False, True)
               for x in X_FORMATS if has_rate_key(d, x, r)}
    return [(key, *meaning[key]) for key in CPU_GEMV_RATE_KEYS]


def cpu_gathered_rate_variants() -> list[tuple[str, str, str]]:
    """Each key of :data:`CPU_GATHERED_RATE_KEYS`, in order, with its (key, dtype, x format)."""
    meaning: dict[str, tuple[str, str]] = {}
    for d in CPU_WEIGHT_FORMATS:
        for x in ("f32", "i16"):  # float x first: the one format of rows that are never rounded
            meaning.setdefault(cpu_rate_key(d, x, gathered=True), (d, x))
    return [(key, *meaning[key]) for key in CPU_GATHERED_RATE_KEYS]


def cpu_rate_key(dtype: str, x_format: str, rows8: bool = False, gathered: bool = False) -> str:
    """The rate-table key of a CPU kernel reading ``dtype`` rows (``x_format``: how its x meets
    4-bit rows; ``rows8``: one that reads a 4-bit matrix in the rows8 layout; ``gathered``: a
    fused sparse FFN's active rows, a neuron at a time). Rows one at a time dot int8 x as int16
    (the int8 is held as int16), so they share the ``_xi16`` rate; so do gathered rows."""
    if x_format == "i8" and not _rows8_suffix(rows8 and not gathered, dtype):
        x_format = "i16"
    if gathered:
        return dtype + GATHERED_SUFFIX + _int_suffix(x_format, dtype)
    return dtype + _rows8_suffix(rows8, dtype) + _int_suffix(x_format, dtype)


def rows8_fits(dtype: str, rows: int, k: int, x_format: str = "f32") -> bool:
    """Whether a ``rows`` x ``k`` matrix of ``dtype`` has a rows8 layout whatever x its kernel
    dots: 4-bit, rows a multiple of 8 (q8_0 rows have one too, read with int8 x alone:
    ``rows8_fits(..., x_format="i8")``; mxfp4 rows with rounded x, ``"i16"`` or ``"i8"``)."""
    dtypes = ROWS8_DTYPES if x_format == "i8" else I16_ROWS8_DTYPES if x_format == "i16" else NIBBLE_DTYPES
    return dtype in dtypes and rows > 0 and rows % 8 == 0 and k % 32 == 0


def cpu_gemv(dtype: str, x_format: str = "f32", rows8: bool = False) -> str:
    """``rows8``: the matrix in the rows8 layout (4-bit, or q8_0 with int8 x)."""
    return f"picc_gemv_{dtype}{_rows8_suffix(rows8, dtype)}{_int_suffix(x_format, dtype)}"


def cpu_gemm(dtype: str, rows8: bool = False) -> str:
    return f"picc_gemm_{dtype}" + (ROWS8_SUFFIX if rows8 else "")


def cpu_embed(dtype: str, rows8: bool = False, scaled: bool = False) -> str:
    """``rows8``: the table in the rows8 layout (a q8_0 table that its LM head reads so);
    ``scaled``: each row times a scale the call passes (Gemma's)."""
    return f"picc_embed_{dtype}{_rows8_suffix(rows8, dtype)}" + ("_scaled" if scaled else "")


def cpu_norm(kind: str, grouped: bool = False) -> str:
    """A norm over each row, or (``grouped``) over each run of a given length within a row."""
    return f"picc_{kind}" + ("_grouped" if grouped else "")


def cpu_attention(kv_format: str, softcap: bool = False, sinks: bool = False) -> str:
    """Attention over a KV cache of ``kv_format`` (f32, or f16); ``softcap``: the variant that
    soft-caps its scores (a trailing ``softcap`` argument); ``sinks``: the variant with a sink
    logit per head (a trailing pointer to them)."""
    plain = "picc_attention" if kv_format == "f32" else f"picc_attention_kv{kv_format}"
    return plain + ("_softcap" if softcap else "") + ("_sinks" if sinks else "")


def cpu_rope(style: str) -> str:
    return f"picc_rope_{style}"


def cpu_elementwise(name: str) -> str:
    return f"picc_{name}"


def cpu_concat_heads() -> str:
    """Heads of two operands joined head by head (either may be one head that every head takes)."""
    return "picc_concat_heads"


def cpu_predictor(fc1: str, fc2: str) -> str:
    return f"picc_predict_{fc1}_{fc2}"


def read_whole(mode: str, up: T, gate: T | None) -> tuple[T, ...]:
    """Of a fused FFN's ``up`` and ``gate`` (names or formats), those its mode reads for every
    neuron, not only the active ones: gate-first's gate, down-only's gate and up. These are the
    matrices a ``dense_rows8`` kernel reads from the rows8 layout."""
    chosen = {"gate-first": (gate,), "down-only": (gate, up)}.get(mode, ())
    return tuple(m for m in chosen if m is not None)


GATHERED_LAYOUTS = ("rows", "dotplanes")  # how a fused FFN's gathered, dotted rows are stored
DOTPLANES_SUFFIX = "_dp"  # (after the x suffix) the kernel reads its gathered rows from the dotplanes layout
# The narrowest rows read from the dotplanes layout. bench/kernels.py, q4_0 / q4_1 with int16 x,
# against the eight-row form of GGUF rows, alternating, Zen 4: hidden 4096 one thread 1.11-1.47x
# (two threads within noise), 2048 within noise, 576 0.79-1.02x (a row's fixed
# costs, its horizontal sums and last pieces, weigh more on short rows).
DOTPLANES_MIN_HIDDEN = 4096


def gathered_dotted(mode: str, up: T, gate: T | None) -> tuple[T, ...]:
    """Of a fused FFN's ``up`` and ``gate`` (names or formats), those whose active rows it gathers
    and dots: up (but in down-only mode, which reads it whole), and the gate in predictor and
    dense modes (gate-first and down-only read it whole)."""
    chosen = {"predictor": (up, gate), "dense": (up, gate), "gate-first": (up,)}.get(mode, ())
    return tuple(m for m in chosen if m is not None)


def dotplanes_fit(mode: str, x_format: str, up: str, gate: str | None) -> bool:
    """Whether the dotplanes layout (``picc.codegen_cpu.dotplanes``) can hold a fused FFN's
    gathered and dotted rows (up; in predictor and dense modes, gate too): x is rounded
    (``x_format``) and every such row is 4-bit, in one format."""
    dotted = set(gathered_dotted(mode, up, gate))
    return ffn_x_format(x_format, up, gate) != "f32" and len(dotted) == 1 and dotted <= NIBBLE_DTYPES


def gathered_layout(mode: str, x_format: str, up: str, gate: str | None, hidden: int) -> str:
    """How ``select-kernels`` stores a fused FFN's gathered and dotted rows: ``"dotplanes"`` where
    it can (:func:`dotplanes_fit`) and rows are at least ``DOTPLANES_MIN_HIDDEN`` long; else
    ``"rows"``, the format's own (dotted eight rows at a time)."""
    fits = dotplanes_fit(mode, x_format, up, gate) and hidden >= DOTPLANES_MIN_HIDDEN
    return "dotplanes" if fits else "rows"


def ffn_x_format(x_format: str, up: str, gate: str | None) -> str:
    """The x format of a fused FFN kernel asked for ``x_format``: as asked when its up and gate
    rows (one x for both) are all 4-bit, else float."""
    return x_format if {up, gate or up} <= INT_DOT_DTYPES else "f32"


def cpu_fused_ffn(mode: str, form: str, up: str, gate: str | None, down: str, interleaved: bool,
                  x_format: str = "f32", dense_rows8: bool = False, gathered: str = "rows") -> str:
    """The fused FFN kernel; ``interleaved`` reads up and gate rows side by side (``up_gate``);
    ``x_format``: up and gate rows dot x rounded to it when both are 4-bit (the kernel, and
    its prefill twin, read one x for the two; down is an AXPY: no dot); ``dense_rows8``: the
    4-bit matrices a gate-first or down-only kernel reads whole (the gate; the gate and up) are
    in the rows8 layout; ``gathered``: the layout of the rows it gathers and dots
    (:func:`gathered_layout`)."""
    if gathered not in GATHERED_LAYOUTS:
        raise ValueError(f"gathered is one of {GATHERED_LAYOUTS}, not {gathered!r}")
    whole = read_whole(mode, up, gate)
    rows8 = _rows8_suffix(dense_rows8, *whole) if whole else ""
    layout = ("_il" if interleaved else "") + rows8 + _int_suffix(ffn_x_format(x_format, up, gate), up)
    layout += DOTPLANES_SUFFIX if gathered == "dotplanes" else ""
    return f"picc_ffn_{mode.replace('-', '_')}_{form}_{up}_{gate or 'none'}_{down}{layout}"


def cpu_chunk_ffn(mode: str, form: str, up: str, gate: str | None, down: str, interleaved: bool,
                  dense_rows8: bool = False, gathered: str = "rows", x_format: str = "f32") -> str:
    """The fused FFN kernel of the prefill program: a chunk of tokens, each with its own active set.
    Its rows8 matrices (``dense_rows8``) dot x as the decode kernel does (rounded to ``x_format``,
    or float); every other row is dequantized to floats, from whichever layout it is stored in."""
    return cpu_fused_ffn(mode, form, up, gate, down, interleaved, x_format if dense_rows8 else "f32",
                         dense_rows8=dense_rows8, gathered=gathered).replace("picc_ffn_", "picc_ffn_chunk_", 1)


def cpu_dense_ffn(form: str, up: str, gate: str | None, down: str, x_format: str = "f32",
                  rows8: bool = False) -> str:
    """A dense FFN in the source model's layout (down [hidden, n_ff]): GEMVs, one kernel.
    ``rows8`` (every matrix 4-bit): its matrices in the rows8 layout."""
    rows8_part = _rows8_suffix(rows8, up, gate, down)
    return f"picc_ffn_gemv_{form}_{up}_{gate or 'none'}_{down}{rows8_part}{_int_suffix(x_format, up, gate, down)}"


BATCHED_SUFFIX = "_rows"  # (last) the kernel's batched twin: several sequences' x rows, one read of the weights


def cpu_gemv_rows(dtype: str, x_format: str = "f32", rows8: bool = False) -> str:
    """The batched twin of :func:`cpu_gemv`: ``batch`` x rows, each the bits of the one-row kernel."""
    return cpu_gemv(dtype, x_format, rows8) + BATCHED_SUFFIX


@dataclass(frozen=True, slots=True)
class MoeVariant:
    """What sets a mixture's kernel apart beyond its formats and layout: gpt-oss's ``biases`` (letters
    of ``"rugd"``: router, up, gate, down) and ``clamped`` SwiGLU; Qwen2-MoE's and ERNIE 4.5's
    ``shared`` experts (``"plain"``: taken by every token with weight 1; ``"gated"``: with the
    sigmoid of the router's last row); ERNIE 4.5's ``choice_bias`` (added to the probabilities
    to rank the experts, not to weight them); DeepSeek V3's and GLM-4.5's ``scoring``
    ``"sigmoid"`` (each expert's own sigmoid, not a softmax); DeepSeek's ``groups`` (``"max"`` or
    ``"top2"``: the experts chosen from the best groups, each scored so; ``""``: no groups);
    ``scaled`` routed weights (times ``routed_scale``)."""

    biases: str = ""
    clamped: bool = False
    shared: str = ""
    choice_bias: bool = False
    scoring: str = "softmax"
    groups: str = ""
    scaled: bool = False

    @property
    def ranks_by_probability(self) -> bool:
        """Whether the experts are ranked by their probabilities (plus the choice bias), not by
        their logits: with a choice bias, sigmoids or groups (``picc.ir.ops.MoE``)."""
        return self.choice_bias or self.scoring != "softmax" or bool(self.groups)

    @property
    def suffix(self) -> str:
        return ((f"_b{self.biases}" if self.biases else "") + ("_clamped" if self.clamped else "")
                + (f"_shared{'g' if self.shared == 'gated' else ''}" if self.shared else "")
                + ("_cb" if self.choice_bias else "") + ("_sigmoid" if self.scoring == "sigmoid" else "")
                + (f"_g{self.groups}" if self.groups else "") + ("_scaled" if self.scaled else ""))


PLAIN_MOE = MoeVariant()  # Mixtral's, Qwen3-MoE's, OLMoE's, Granite-MoE's: no biases, no clamp, no shared experts


def cpu_moe(form: str, router: str, up: str, gate: str | None, down: str, x_format: str = "f32",
            rows8: bool = False, variant: MoeVariant = PLAIN_MOE) -> str:
    """A mixture of experts for one token (router, top-k, the chosen experts); ``x_format``
    ``"i16"``: the experts' 4-bit rows dotted with x and h rounded to int16; ``rows8``: the experts'
    4-bit matrices in the rows8 layout; ``variant``: :class:`MoeVariant`."""
    return (f"picc_moe_{form}_{router}_{up}_{gate or 'none'}_{down}" + (ROWS8_SUFFIX if rows8 else "")
            + _int_suffix(x_format, up, gate, down) + variant.suffix)


def cpu_dense_ffn_rows(form: str, up: str, gate: str | None, down: str, x_format: str = "f32",
                       rows8: bool = False) -> str:
    """The batched twin of :func:`cpu_dense_ffn`."""
    return cpu_dense_ffn(form, up, gate, down, x_format, rows8) + BATCHED_SUFFIX


# --- GPU: one TVM kernel per operation, shape and weight format -----------------------------------


RESIDUAL = "_res"
"""Suffix of a GPU kernel that also adds a residual vector to its result (an ``add``'s
``accumulated_by`` names its op): ``y = r + result``."""


def gpu_gemv(rows: int, cols: int, fmt: str, bias: bool, residual: bool = False) -> str:
    return f"gemv_{rows}x{cols}_{fmt}" + ("_bias" if bias else "") + (RESIDUAL if residual else "")


def gpu_embed(vocab: int, dim: int, fmt: str, scale: float = 1.0) -> str:
    """``scale``: each row times it (Gemma's), a constant of the kernel: its f32 bits in the name."""
    return f"embed_{vocab}x{dim}_{fmt}" + (f"_s{_f32_bits(scale)}" if scale != 1.0 else "")


def _f32_bits(x: float) -> str:
    """A kernel's float constant in its name: its f32 bits in hex, one name for one value."""
    return f"{int(np.float32(x).view(np.uint32)):08x}"


def _number(x: float) -> str:
    """A float as part of a C identifier: 1e-05 -> 1em05, 0.125 -> 0p125."""
    return f"{x:g}".replace("-", "m").replace("+", "").replace(".", "p")


def gpu_norm(kind: str, n: int, eps: float, bias: bool = False, group: int | None = None) -> str:
    """A norm over rows of ``n``, or over each run of ``group`` elements of them."""
    return f"{kind}_{n}" + (f"_g{group}" if group else "") + f"_eps{_number(eps)}" + ("_bias" if bias else "")


def gpu_rope(style: str, n_heads: int, head_dim: int, rotated: int) -> str:
    return f"rope_{style}_{n_heads}x{head_dim}_r{rotated}"


def gpu_rope_pair(style: str, n_first: int, n_second: int, head_dim: int, rotated: int,
                  append_ctx: int | None = None, v_width: int | None = None) -> str:
    """Two ropes of the same rotation in one launch (a layer's q and k: ``launched_with``); with
    ``append_ctx``, the launch also writes the second and the attention's v to KV caches of that
    many positions (``appended_by_rope``), ``_v`` and the values' width where that is not the
    second's (values narrower than keys)."""
    return (f"rope_{style}_{n_first}x{head_dim}_{n_second}x{head_dim}_r{rotated}"
            + (f"_append_ctx{append_ctx}" if append_ctx else "")
            + (f"_v{v_width}" if append_ctx and v_width not in (None, n_second * head_dim) else ""))


def gpu_kv_append(width: int, ctx: int, v_width: int | None = None) -> str:
    """Keys ``width`` wide to a cache of ``ctx`` positions, and values ``v_width`` wide (named
    where that is not ``width``: values narrower than keys)."""
    return f"kv_append_{width}" + (f"_v{v_width}" if v_width not in (None, width) else "") + f"_ctx{ctx}"


def gpu_attention(n_heads: int, n_kv_heads: int, head_dim: int, ctx: int, window: int | None, scale: float,
                  softcap: float | None = None, sinks: bool = False, v_head_dim: int | None = None) -> str:
    """The scale is in the name only when it is not the usual ``head_dim ** -0.5``; ``_v`` and the
    value heads' width where that is not ``head_dim`` (DeepSeek's MLA); a soft cap of the scores
    (Gemma 2's) by its f32 bits; ``_sinks``: the kernel reads a sink logit per head."""
    usual = abs(scale - head_dim**-0.5) <= 1e-7 * scale
    return (f"attention_{n_heads}x{n_kv_heads}x{head_dim}"
            + (f"_v{v_head_dim}" if v_head_dim not in (None, head_dim) else "") + f"_ctx{ctx}"
            + (f"_w{window}" if window else "")
            + ("" if usual else f"_s{_number(scale)}") + (f"_c{_f32_bits(softcap)}" if softcap is not None else "")
            + ("_sinks" if sinks else ""))


def gpu_add(n: int) -> str:
    return f"add_{n}"


def gpu_softcap(n: int, cap: float) -> str:
    return f"softcap_{n}_c{_f32_bits(cap)}"


def gpu_concat_heads(n_heads: int, a_heads: int, a_dim: int, b_heads: int, b_dim: int) -> str:
    """``n_heads`` heads joined from ``a_heads`` heads of ``a_dim`` and ``b_heads`` of ``b_dim``
    (each 1, a head that every head takes, or ``n_heads``)."""
    return f"concat_heads_{n_heads}h_a{a_heads}x{a_dim}_b{b_heads}x{b_dim}"


def gpu_merge(n: int, bias: bool, residual: bool = False) -> str:
    return f"merge_{n}" + ("_bias" if bias else "") + (RESIDUAL if residual else "")


def gpu_predictor(hidden: int, rank: int, n: int, fmt: str, b1: bool, b2: bool) -> str:
    return f"predictor_{hidden}x{rank}x{n}_{fmt}" + ("_b1" if b1 else "") + ("_b2" if b2 else "")


def gpu_greedy_next(vocab: int, ctx: int) -> str:
    """The greedy decode loop's kernel after a step of ``vocab`` logits, ``ctx`` positions."""
    return f"greedy_next_{vocab}_ctx{ctx}"


def gpu_compact(n: int, offset: int) -> str:
    """The index list of mask columns ``offset .. offset + n`` (a predictor-mode FFN part's)."""
    return f"compact_{n}" + (f"_from{offset}" if offset else "")


def gpu_fused_ffn(mode: str, form: str, hidden: int, n: int, fmt: str, bias: bool, residual: bool = False) -> str:
    """``bias``: the kernel adds up (and gate) biases."""
    kind = {"predictor": "sparse_ffn", "dense": "dense_ffn", "gate-first": "gate_first_ffn"}[mode]
    return f"{kind}_{form}_{hidden}x{n}_{fmt}" + ("_bias" if bias else "") + (RESIDUAL if residual else "")


def gpu_bias_add(n: int, residual: bool = False) -> str:
    return f"bias_add_{n}" + (RESIDUAL if residual else "")
