"""``select-kernels``: every backend choice, as typed attributes in the IR; then each op's kernel.

After this pass a dump shows everything that decides what the kernels compute and how they read
memory, and nothing downstream infers a choice from a name:

* ``x_format`` (``linear``, ``ffn``, ``fused_ffn`` on the CPU): ``"i16"`` where the kernel dots
  4-bit rows (q4_0 / q4_1, or gpt-oss's mxfp4, a row at a time) with x rounded to int16 per
  block of 32 (each element within 2^-16 of its block's largest ``|x|``): twice as fast as float
  dot products on Zen 3. ``int_x=i8``
  rounds to int8 instead (within 1/254, as llama.cpp does) where the kernel reads the rows8
  layout, whose dot products then do half the integer work; rows one at a time keep int16,
  which costs them the same. The rounding is part of what the op computes
  (the interpreter rounds as the kernel does). By default (``int_dots=auto``) only modules in
  which nothing decides sparsity round: rounding makes a dot product a step function of x, so
  the float-rounding noise between the runtime and the interpreter (~1e-7) now and then moves an
  element across a rounding boundary, a whole rounding step, and gate decisions near their
  threshold flip (docs/codegen_cpu.md has the measurements). ``int_dots=no`` keeps float dot
  products everywhere, ``int_dots=yes`` rounds in sparse modules too.
* ``layout`` (the same ops): ``"rows8"`` where the matrices the kernel reads whole are q4_0 / q4_1
  with rows in multiples of 8 and no other op reads them: GEMVs, dense FFNs and the dense
  projections of gate-first (gate) and down-only (gate and up) FFNs. The ``.pib`` stores such
  matrices eight rows at a time. A q8_0 LM head (``head_x=i8``, the default unless
  ``int_dots=no``) dots x rounded to int8 from that layout too, and an ``embed`` tied to it reads
  its table there (``layout`` on the embed): the head decides nothing after it, so it rounds even
  in sparse modules; its batched kernel is 2.6x faster than float x's rows (8 x rows, VNNI; PTB
  perplexity +0.1% on SmolLM2, logits ~1e-2 from the interpreter's where float noise moves an
  element of its x across an int8 rounding boundary).
* ``gathered_layout`` (``fused_ffn`` on the CPU): ``"dotplanes"`` where the kernel dots the rows it
  gathers (up; gate too in predictor and dense modes) with rounded x, they are 4-bit in one
  format and at least ``DOTPLANES_MIN_HIDDEN`` (4096) long, and no other op reads them: each
  row's nibbles, then its scales, dotted a row at a time with no transpose (1.1-1.5x on one
  core of a Zen 4 at hidden 4096; shorter rows keep GGUF's rows, read eight at a time, which is
  as fast at 2048 and faster at 576).
* ``kv_format`` (``attention`` on the CPU): ``"f16"`` (``kv=f16``, the default): the KV cache
  holds keys and values rounded to half precision, as llama.cpp's does, half the bytes a step
  reads back from it (a third of SmolLM2's step at 450 positions); the interpreter rounds alike.
  ``kv=f32`` keeps f32. GPU attention keeps f32.
* ``accumulated_by`` (``add``): the residual adds of the decode step that the kernel of an
  operand's producer does itself: on the CPU it adds into the residual's buffer
  (:func:`accumulated_adds`), on the GPU a variant of it reads the residual and writes the add's
  result, one launch fewer (:func:`gpu_accumulated_adds`; the producer's kernel name says so).
* ``launched_with`` (``rope`` on the GPU): a layer's k rope is rotated by the launch of its q
  rope (:func:`paired_ropes`), and ``appended_by_rope`` (``attention``): that launch also writes
  the attention's KV cache rows: two launches fewer a layer.
* ``kernel`` (every op): the kernel's symbol, a pure function of the op
  (:mod:`picc.passes.kernel_selection`); the backends generate kernels under exactly these names.

Needs: ``fuse-gather-gemv`` (no ``sparse_ffn`` and no neuron-major ``ffn`` left); after
``partition-neurons`` when there is one (an op's placement picks its device; unplaced ops run on
the CPU). Guarantees: every op has a kernel; the module computes the same function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeGuard

from picc import kernel_names as names
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function, Module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import Placement
from picc.passes.kernel_selection import Types, kernel_of, rows8_fits
from picc.passes.options import PassOptions, option
from picc.passes.registry import PassContext, register_pass
from picc.placement import memory_plan as mp
from picc.placement.schedule import Schedule, crossing_values, schedule


def decides_sparsity(op: Op) -> bool:
    """Whether ``op`` decides which neurons run (a predictor, a sparse FFN): what makes a module
    keep float dot products by default (see the module docstring)."""
    return isinstance(op, (Predict, SparseFFN)) or (isinstance(op, FusedFFN) and op.mode != "dense")


def _choose(op: Op, t: Types, rounded: str | None, byte_x: str | None, shared: frozenset[str],
            tied: frozenset[str]) -> Op:
    """``op`` with its ``x_format`` and ``layout`` chosen (CPU matrix ops only); ``rounded``: the
    integer format x is rounded to where its kernel reads the rows8 layout, None for float x;
    ``byte_x``: the same for q8_0 rows; ``shared``: weights more than one op reads, ``tied``: the
    same but for embeddings on the CPU (which can read a q8_0 table in the rows8 layout)."""
    four_bit = names.INT_DOT_DTYPES
    if isinstance(op, O.MoE):  # int16 x where an expert matrix is 4-bit; rows8 for those, in whole groups
        four = tuple(w for w in (op.up, op.gate, op.down) if w and t.fmt(w) in four_bit)
        if rounded is None or not four:
            return op
        n, hidden = t.dims(op.up)[0] // (op.n_experts + op.n_shared), t.dims(op.up)[1]
        rows8 = n % 8 == 0 and hidden % 8 == 0 and rows8_fits(t, four, shared, x_format="i16")
        return replace(op, x_format="i16", layout="rows8" if rows8 else "rows")
    if not isinstance(op, O.MatrixOp) or op.type.placement == Placement.GPU:
        return op
    match op:
        case O.Linear() if t.fmt(op.weight) in names.BYTE_ROWS8_DTYPES:
            # q8_0 rows (an LM head) dot int8 x from the rows8 layout, or float x in rows.
            fits = byte_x == "i8" and rows8_fits(t, (op.weight,), tied, x_format="i8")
            return replace(op, x_format="i8", layout="rows8") if fits else op
        case FusedFFN():
            # Up and gate rows share one rounded x; the down rows are added, not dotted.
            up, gate = t.fmt(op.up_gate or op.up) or "", t.fmt(op.up_gate or op.gate)
            int_x = names.ffn_x_format("i16", up, gate) != "f32"
            whole = names.read_whole(op.mode, op.up, op.gate)
            rows8 = bool(whole) and rows8_fits(t, whole, shared)
        case O.Linear():
            # mxfp4 rows read the rows8 layout with rounded x alone (kernel_names.INT_ROWS8_DTYPES)
            int_x = t.fmt(op.weight) in four_bit
            rows8 = rows8_fits(t, (op.weight,), shared, x_format="f32" if rounded is None else "i16")
        case O.FFN() if type(op) is O.FFN and not op.neuron_major:
            weights = (op.up, op.gate, op.down) if op.gate else (op.up, op.down)
            if rounded == "i8" and names.BYTE_ROWS8_DTYPES & {t.fmt(w) for w in weights}:
                # q8_0 rows (a Q8_0 model's FFN) read the rows8 layout with int8 x alone.
                fits = rows8_fits(t, weights, shared, x_format="i8")
                return replace(op, x_format="i8", layout="rows8") if fits else op
            # Rounded x where 4-bit rows are dotted, unless q8_0 rows (a Q4_K_M file's down
            # projection, converted to Q8_0) are too: those take only int8 x from the rows8 layout.
            formats = {t.fmt(w) for w in weights}
            int_x = bool(four_bit & formats) and not names.BYTE_ROWS8_DTYPES & formats
            rows8 = rows8_fits(t, weights, shared)
        case _:
            return op
    x_format = "f32" if rounded is None or not int_x else rounded if rows8 else "i16"
    chosen = replace(op, x_format=x_format, layout="rows8" if rows8 else "rows")
    if isinstance(chosen, FusedFFN):
        return replace(chosen, gathered_layout=_gathered_layout(chosen, t, shared))
    return chosen


def _gathered_layout(op: FusedFFN, t: Types, shared: frozenset[str]) -> str:
    """Where ``op``'s gathered, dotted rows are stored (``picc.kernel_names.gathered_layout``):
    in the dotplanes layout only when no other op reads them."""
    up, gate = op.up_gate or op.up, op.up_gate or op.gate
    if up is None or {up, gate} & shared:
        return "rows"
    return names.gathered_layout(op.mode, op.x_format, t.fmt(up) or "", t.fmt(gate), t.dims(op.down)[1])


def accumulated_adds(func: Function, sched: Schedule) -> dict[int, str]:
    """The adds of a decode step (by op index) that the kernel of an operand's producer can do
    itself, and which operand (``"a"`` / ``"b"``): ``add(r, p)`` with ``p`` a linear or an FFN
    (dense or fused) whose result has no other reader, and ``r`` computed before ``p``, read by
    nothing after it but the add, and kept on the CPU in the add's stage (not returned, not copied
    to another device). ``p``'s kernel then adds its rows into r's buffer and the add's result
    lives there: one call and one barrier fewer per residual add, the same bits (``r + t``, ``t``
    the kernel's rounded result, as the add computes it). The prefill programs run the add."""
    ops = func.ops
    index = {op.result: i for i, op in enumerate(ops)}
    readers = func.readers()
    pinned = crossing_values(sched) | {func.ret}
    stage_of = {v: i for i, stage in enumerate(sched.stages) for v in stage.cpu}  # CPU values only
    chosen: dict[int, str] = {}
    for i, op in enumerate(ops):
        if not isinstance(op, O.Add) or op.a == op.b or op.result not in stage_of:
            continue
        for which, src, res in (("a", op.a, op.b), ("b", op.b, op.a)):
            j, k = index.get(src), index.get(res)
            if (j is None or k is None or not (isinstance(ops[j], O.MatrixOp) and ops[j].can_accumulate)
                    or readers.get(src) != [i] or k >= j or any(j <= r < i for r in readers[res])
                    or readers[res][-1] != i
                    or pinned & {src, res, op.result}
                    or stage_of.get(src) != stage_of[op.result] or stage_of.get(res) != stage_of[op.result]):
                continue
            chosen[i] = which
            break
    return chosen


def gpu_accumulated_adds(func: Function, sched: Schedule) -> dict[int, str]:
    """The adds on the GPU (by op index) whose residual add the kernel of an operand's producer
    does, and which operand (``"a"`` / ``"b"``): ``add(r, p)`` with ``p`` made on the GPU by an op
    that ``can_accumulate`` (a linear, a fused FFN, a merge), read by nothing else and not copied
    to the CPU, and ``r`` on the GPU before ``p`` is made (made there earlier, or copied there by
    then). ``p``'s kernel then writes ``r + t`` (``t`` its rounded result: the add's bits, f32
    addition commutes) where the add's result lives, and the add launches nothing: on an H100 a
    decode step is bound by its launches."""
    ops = func.ops
    index = {op.result: i for i, op in enumerate(ops)}
    readers = func.readers()
    crossing = crossing_values(sched)
    uploads, _ = mp.copy_points(func, sched)

    def on_gpu(i: int | None) -> bool:
        return i is not None and ops[i].type.placement == Placement.GPU

    def there_by(res: str, j: int) -> bool:
        k = index.get(res)
        return (on_gpu(k) and k is not None and k < j) or uploads.get(res, len(ops)) <= j

    chosen: dict[int, str] = {}
    for i, op in enumerate(ops):
        if not isinstance(op, O.Add) or op.a == op.b or not on_gpu(i) or op.result == func.ret:
            continue
        for which, src, res in (("a", op.a, op.b), ("b", op.b, op.a)):
            j = index.get(src)
            if (on_gpu(j) and j is not None and ops[j].can_accumulate and readers.get(src) == [i]
                    and src not in crossing and there_by(res, j)):
                chosen[i] = which
                break
    return chosen


def paired_ropes(func: Function) -> dict[int, int]:
    """GPU ropes (by op index) that the launch of an earlier rope computes too, and which: the
    nearest earlier GPU rope of the same rotation, itself not paired, whose launch comes after
    this rope's input is made (a layer's k rope, for its q rope)."""
    ops = func.ops
    index = {op.result: i for i, op in enumerate(ops)}
    ropes = [i for i, op in enumerate(ops) if isinstance(op, O.Rope) and op.type.placement == Placement.GPU]
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    for n, i in enumerate(ropes):
        second = ops[i]
        assert isinstance(second, O.Rope)
        for j in reversed(ropes[:n]):
            first = ops[j]
            assert isinstance(first, O.Rope)
            if j in taken or j in pairs or not first.same_rotation(second):
                continue
            if index.get(second.x, len(ops)) < j:
                pairs[i] = j
                taken.add(j)
            break
    return pairs


def _shared(ops: Iterable[Op]) -> frozenset[str]:
    """The weights that more than one of ``ops`` reads."""
    readers = Counter(w for op in ops for w in set(op.weights()) if w is not None)
    return frozenset(w for w, n in readers.items() if n > 1)


def _cpu_embed(op: Op) -> TypeGuard[O.Embed]:
    return isinstance(op, O.Embed) and op.type.placement != Placement.GPU


@dataclass(frozen=True)
class SelectOptions(PassOptions):
    """``int_dots``: round x for 4-bit dot products -- ``auto`` where no op decides sparsity,
    ``yes`` everywhere, ``no`` nowhere; ``int_x``: to what, where the kernel reads the rows8
    layout (rows one at a time round to int16); ``head_x``: to what a q8_0 LM head rounds its x
    (int8, reading the rows8 layout; ``f32``: it does not), unless ``int_dots`` is ``no``;
    ``kv``: what the KV caches of attention on the CPU hold."""

    int_dots: str = option("auto", choices=("auto", "no", "yes"))
    int_x: str = option("i16", choices=("i16", "i8"))
    head_x: str = option("i8", choices=("f32", "i8"))
    kv: str = option("f16", choices=("f32", "f16"))


@register_pass("select-kernels", options=SelectOptions)
def select_kernels(module: Module, ctx: PassContext[SelectOptions]) -> Module:
    """Record every kernel choice as op attributes (x_format, layout, accumulated_by), name each kernel."""
    int_dots = ctx.options.int_dots
    func = module.function()
    if any(op.kernel is not None for op in func.ops):
        raise PiccError("the module's kernels are already selected (its ops name them)")
    if unfused := next((op for op in func.ops if isinstance(op, O.FFN) and (isinstance(op, SparseFFN)
                                                                             or op.neuron_major)), None):
        raise PiccError(f"%{unfused.result}: a sparse or neuron-major ffn has no kernel of its own; "
                        "run fuse-gather-gemv before select-kernels")
    types = Types(func.value_types(), module.weight_types())
    rounds = int_dots == "yes" or (int_dots == "auto" and not any(decides_sparsity(op) for op in func.ops))
    rounded = ctx.options.int_x if rounds else None
    # The LM head decides nothing after it: it may round where the module's other ops may not.
    head_x = ctx.options.head_x if int_dots != "no" else None
    shared, tied = _shared(func.ops), _shared(op for op in func.ops if not _cpu_embed(op))
    ops = [_choose(op, types, rounded, head_x if op.result == func.ret else rounded, shared, tied) for op in func.ops]
    ops = [replace(op, kv_format=ctx.options.kv) if isinstance(op, O.Attention) and op.alibi == "none"
           and op.type.placement != Placement.GPU else op for op in ops]
    rows8_tables = {op.weight for op in ops if isinstance(op, O.Linear) and op.layout == "rows8"}
    ops = [replace(op, layout="rows8") if _cpu_embed(op) and op.table in rows8_tables else op for op in ops]
    chosen_func, steps = replace(func, ops=tuple(ops)), schedule(module)
    for i, which in (accumulated_adds(chosen_func, steps) | gpu_accumulated_adds(chosen_func, steps)).items():
        ops[i] = replace(ops[i], accumulated_by=which)
    adding = {op.accumulated[0] for op in ops if isinstance(op, O.Add) and op.accumulated is not None}
    kv_ctx = int(module.attr("ctx", mp.DEFAULT_CTX) or mp.DEFAULT_CTX)
    named = [replace(op, kernel=kernel_of(op, types, kv_ctx, op.result in adding)) for op in ops]
    index = {op.result: n for n, op in enumerate(named)}
    for i, j in paired_ropes(replace(func, ops=tuple(named))).items():
        first, second = named[j], named[i]
        assert isinstance(first, O.Rope) and isinstance(second, O.Rope)
        # The attention the pair feeds, if the pair's launch can write its cache rows: its v is
        # made on the GPU before that launch.
        att = next((n for n, op in enumerate(named) if isinstance(op, O.Attention) and op.q == first.result
                    and op.k == second.result and op.type.placement == Placement.GPU
                    and index.get(op.v, j) < j and named[index[op.v]].type.placement == Placement.GPU), None)
        v_width = types.width(named[att].v) if att is not None else None  # narrower than k's where v_head_dim is
        pair = names.gpu_rope_pair(first.style, first.n_heads, second.n_heads, first.head_dim, first.rotated,
                                   kv_ctx if att is not None else None, v_width)
        named[j] = replace(first, kernel=pair)
        named[i] = replace(second, kernel=pair, launched_with=first.result)
        if att is not None:
            named[att] = replace(named[att], appended_by_rope=True)
    return module.with_function(replace(func, ops=tuple(named)))
