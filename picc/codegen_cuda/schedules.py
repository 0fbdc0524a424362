"""GPU schedules of the kernels, per architecture, with ``tvm.s_tir.Schedule``.

The building blocks (each a few primitives; read the emitted CUDA beside them):

* ``warp_rows``: one warp per ``rows_per_warp`` adjacent output rows. The reduction ``k = kv *
  vector + kl`` is split so lane ``tx`` takes chunks ``kv = ko * 32 + tx``; ``rfactor`` gives
  each lane a private partial sum per row, and the final block, bound to ``threadIdx.x``, becomes
  TVM's cross-thread reduction, which lowers to ``__shfl_down_sync``. Weights and the vector
  operand are staged through registers with ``cache_read(..., "local")`` + ``vectorize``, so every
  weight load is one 16-byte ``uint4`` (8 f16, 4 f32, or the 16 nibble bytes of a q4_0 block),
  and a chunk of the vector operand is loaded once for the warp's rows. ``threadIdx.y`` picks the
  warp within the block (``rows`` warps per block).
* ``sliced_axpy``: ``y[k] = sum_r h_r * D[row_r, k]`` over neuron-major rows, in row slices
  (``blockIdx.y``) whose partial rows a second launch adds up: thread ``tx`` owns ``vector``
  adjacent columns (one vectorised load per row), ``threadIdx.y`` splits the slice's rows, taken
  ``axpy_unroll`` at a time (their loads in flight together; a sparse FFN skips a trip whose first
  row is past ``count``), and a shared-memory reduction over ``threadIdx.y`` merges them.
* ``block_reduce``: one thread block per row for norms and softmax statistics (in-thread partial
  sums, then a cross-thread reduction).
* guards (``guards.py``): a kernel's ``guards`` wrap the per-row loop nest in ``if (guard)``
  (annotation ``picc_guard`` on the loop, applied by ``apply_guards`` after scheduling), so
  skipped rows of an index list or of a gate-first mask load no weights at all; a schedule adds
  guards of its own blocks (``TileGuard``: the AXPY's trips).

Attention's schedules (five launches, and decode's one) are in ``schedules_attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx

from picc.codegen_cuda.dense import warp_compact
from picc.codegen_cuda.ffn import H_STAGE, LIVE_STAGE
from picc.codegen_cuda.greedy import block_greedy_next
from picc.codegen_cuda.guards import GUARD, TileGuard, apply_guards, spatial_axes
from picc.codegen_cuda.kernel import Guard, Kernel
from picc.errors import PiccError
from runtime.gpu_layout import element_bytes

ARCHS = ("sm_75", "sm_80", "sm_89", "sm_90")
# Columns per AXPY thread: TVM's CUDA codegen handles float vectors up to 4 lanes (float4, a
# 16-byte load for f32 down rows; 8 bytes for f16).
AXPY_COLUMNS = 4


@dataclass(frozen=True, slots=True)
class ArchParams:
    """Schedule knobs of one GPU architecture (chosen from the hardware's limits, not tuned).

    ``rows``: warps (rows) per GEMV block; ``axpy_split``: threads along the rows of an AXPY block;
    ``threads``: threads per block of elementwise kernels; ``unroll_chunks``: a lane's 16-byte
    chunks of a row unrolled, so all its loads are in flight at once rather than one per loop trip
    (a row of 4096 f16 is 16 chunks a lane: 16 memory latencies in a row otherwise);
    ``axpy_unroll``: rows an AXPY thread takes per trip (their loads in flight together);
    ``rows_per_warp``: rows a warp of a row-dot computes together, sharing each chunk of x it loads
    (every row reads all of x: 16 KiB a row at hidden 4096, 8 times a q4_0 row's own bytes);
    ``axpy_eager``: a sparse FFN's AXPY loads a live trip's rows without a condition per row.
    """

    rows: int
    axpy_split: int
    threads: int
    unroll_chunks: bool = True
    axpy_unroll: int = 8
    rows_per_warp: int = 2
    axpy_eager: bool = True


# Turing (sm_75) runs at most 16 blocks / 1024 threads per SM: 4-warp blocks keep enough blocks
# resident. Ampere and later allow 32 blocks / 1536-2048 threads and have larger L1, so wider
# blocks amortise the shared x vector better.
ARCH_PARAMS: dict[str, ArchParams] = {
    "sm_75": ArchParams(rows=4, axpy_split=8, threads=128),
    "sm_80": ArchParams(rows=8, axpy_split=8, threads=256),
    "sm_89": ArchParams(rows=8, axpy_split=8, threads=256),
    "sm_90": ArchParams(rows=8, axpy_split=16, threads=256),
}


def arch_params(arch: str) -> ArchParams:
    if arch not in ARCH_PARAMS:
        raise PiccError(f"GPU architecture {arch!r} has no schedule; expected one of {', '.join(ARCHS)}")
    return ARCH_PARAMS[arch]


def stage_vector(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, buffer: str,
                 at: s_tir.schedule.LoopRV) -> None:
    """Stage ``buffer``'s region read by ``block`` into registers at loop ``at``, 16 bytes a load."""
    reads = sch.get(block).reads
    index = next(i for i, r in enumerate(reads) if r.source.name == buffer)
    cache = sch.cache_read(block, index, "local", consumer_blocks=[block])
    sch.compute_at(cache, at, preserve_unit_loops=True)
    last = sch.get_loops(cache)[-1]
    extent = int(sch.get(last).extent)
    lanes = min(extent, 16 // element_bytes(str(sch.get(cache).writes[0].source.dtype)))
    if extent > 1 and extent % lanes == 0:
        _, vec = sch.split(last, [None, lanes])
        sch.vectorize(vec)


def row_lanes(chunks: int) -> int:
    """Lanes per row: a warp, or for short rows (``chunks`` 16-byte pieces < 32) the smallest
    power of two covering them, so idle lanes serve further rows (predictor fc2 has rank/8)."""
    lanes = 1
    while lanes < min(chunks, 32):
        lanes *= 2
    return lanes


def warp_rows(sch: s_tir.Schedule, name: str, rows: int, staged: list[str], guarded: bool,
              epilogues: tuple[str, ...] = (), unroll: bool = False, per_warp: int = 1) -> None:
    """Schedule row-dot block ``name`` one warp per ``per_warp`` rows (see the module docstring).

    ``rows`` is the number of warps per block; rows shorter than 32 chunks share a warp.
    ``unroll``: a lane's chunks unrolled (``ArchParams.unroll_chunks``). ``per_warp``
    (``ArchParams.rows_per_warp``): adjacent rows a warp computes together, each chunk of the
    vector operand loaded once for all of them; a guarded warp runs when its first row is live.
    """
    block = sch.get_sblock(name)
    *spatial, kv, kl = sch.get_loops(block)
    s = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    lanes = row_lanes(int(sch.get(kv).extent))
    ko, tx = sch.split(kv, [None, lanes])
    rf = sch.rfactor(tx, 0)
    s, ko, tx, kl = sch.get_loops(rf)
    extent = int(sch.get(s).extent)
    per_warp = power_of_two_divisor(extent, per_warp if lanes == 32 else 1)
    bx, ty, rr = sch.split(s, [None, power_of_two_divisor(extent // per_warp, rows * 32 // lanes), per_warp])
    sch.reorder(bx, ty, tx, ko, rr, kl)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    operand = staged[-1]  # the vector operand, shared by the warp's rows; the weights are per row
    for buffer in staged:
        stage_vector(sch, rf, buffer, ko if buffer == operand else rr)
    sch.unroll(kl)
    sch.unroll(rr)
    sch.decompose_reduction(rf, ko)
    if unroll:
        sch.unroll(ko)
    if guarded:
        sch.annotate(ko, GUARD, name)
    sch.set_scope(rf, 0, "local")
    final = sch.get_sblock(name)
    sch.reverse_compute_at(final, ty)
    *_, inner = sch.get_loops(final)
    if per_warp > 1:  # the warp's rows, then the reduction over its lanes, which the lanes share
        row, lane = sch.get_loops(final)[-2:]
        if int(sch.get(row).extent) != per_warp:
            row, lane = lane, row
        sch.reorder(row, lane)
        inner = lane
    sch.bind(inner, "threadIdx.x")
    if epilogues:  # bias / activation / threshold of the row, done by its warp
        sch.set_scope(final, 0, "local")
    for epi in epilogues:
        sch.reverse_compute_at(sch.get_sblock(epi), ty)


def power_of_two_divisor(n: int, at_most: int) -> int:
    """The largest power of two <= ``at_most`` that divides ``n``: a tile that needs no bounds
    predicate (TVM drops the predicate of a non-divisible split in the blocks that
    ``reverse_compute_at`` moves under it, and the stores there then run past their buffer)."""
    tile = 1
    while tile * 2 <= at_most and n % (tile * 2) == 0:
        tile *= 2
    return tile


def sliced_axpy(sch: s_tir.Schedule, vector: int, split: int, threads: int, unroll: int = 1,
                live: Guard | None = None) -> dict[str, TileGuard]:
    """Schedule ``y_part[s, k] = sum_i ...`` and ``y[k] = sum_s y_part[s, k]`` (``ffn.sliced_axpy``).

    ``y_part``: a block per (column tile, row slice) (``blockIdx.x``, ``blockIdx.y``); thread ``tx``
    owns ``vector`` adjacent columns (one vectorised load per row), ``threadIdx.y`` takes every
    ``split``-th row of the slice, ``unroll`` of them a trip, and a shared-memory reduction over
    ``threadIdx.y`` merges them. Every tile divides its extent exactly (``power_of_two_divisor``),
    so no thread has columns or rows past the buffers. ``y``: a thread per column adds the slices.

    ``live(buffers, row, 0)`` (the gather-GEMV's guard: row ``row`` of the index list is real)
    makes the AXPY's work follow the active count: a thread's rows ascend, so a trip whose first
    row is past ``count`` and every trip after it load nothing. Returns that trip guard, for
    ``apply_guards``.
    """
    block = sch.get_sblock("y_part")
    slices, k, i = sch.get_loops(block)
    n_slices = int(sch.get(slices).extent)
    cols, per_slice = int(sch.get(k).extent), int(sch.get(i).extent)
    vector = power_of_two_divisor(cols, vector)
    lanes = power_of_two_divisor(cols // vector, 32)
    split = power_of_two_divisor(per_slice, split)
    guards: dict[str, TileGuard] = {}
    if split == 1:  # an odd number of rows a slice: each thread sums its columns over all of them
        s, k, i = sch.get_loops(block)
        bx, tx, vec = sch.split(k, [None, lanes, vector])
        sch.bind(s, "blockIdx.y")
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.reorder(i, vec)
        accumulate_in_register(sch, "y_part", tx, i)
    else:
        guards = _split_rows(sch, block, lanes, vector, split, min(unroll, per_slice // split), n_slices, live)
    k, s = sch.get_loops(sch.get_sblock("y"))
    bx, tx = sch.split(k, [None, power_of_two_divisor(cols, threads)])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    accumulate_in_register(sch, "y", tx, s)
    return guards


def _split_rows(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, vector: int, split: int,
                unroll: int, n_slices: int, live: Guard | None) -> dict[str, TileGuard]:
    """``y_part`` with its rows split ``split`` ways over ``threadIdx.y`` (see ``sliced_axpy``)."""
    _, _, i = sch.get_loops(block)
    io, iy = sch.split(i, [None, split])
    rf = sch.rfactor(iy, 0)
    s, k, io, iy = sch.get_loops(rf)
    bx, tx, vec = sch.split(k, [None, lanes, vector])
    trip, row = sch.split(io, [None, unroll])
    sch.reorder(s, bx, tx, iy, trip, row, vec)
    sch.bind(s, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.bind(iy, "threadIdx.y")
    sch.vectorize(vec)
    sch.decompose_reduction(rf, trip)
    guards: dict[str, TileGuard] = {}
    if unroll > 1:
        sch.unroll(row)
    if live is not None:
        # The update block's axes: (the rfactor axis, slice, column) spatial, then the slice's trips.
        axes = [iv.var.name for iv in sch.get(sch.get_sblock("y_part_rf_update")).iter_vars]
        guards["y_part_rf_update"] = TileGuard(
            axes, lambda b, ry, sl, _k, ro: live(b, (ro * split + ry) * n_slices + sl, 0))
        sch.annotate(row, GUARD, "y_part_rf_update")
    sch.set_scope(rf, 0, "local")
    final = sch.get_sblock("y_part")
    sch.reverse_compute_at(final, tx)
    red, col = sch.get_loops(final)[-2:]
    sch.reorder(col, red)
    sch.bind(red, "threadIdx.y")
    return guards


def block_reduce(sch: s_tir.Schedule, name: str, at: s_tir.schedule.LoopRV | None, threads: int,
                 local: bool) -> s_tir.schedule.LoopRV:
    """One block per output element of reduction ``name``; returns the block-index loop.

    With ``at``, the reduction is computed inside that (already bound) block loop instead.
    """
    block = sch.get_sblock(name)
    if at is not None:
        sch.compute_at(block, at, preserve_unit_loops=True)
        *_, red = sch.get_loops(block)
        bx = at
    else:
        *spatial, red = sch.get_loops(block)
        bx = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        sch.bind(bx, "blockIdx.x")
    _, tx = sch.split(red, [None, threads])
    sch.bind(tx, "threadIdx.x")
    if local:
        sch.set_scope(block, 0, "local")
    return bx


def flat_threads(sch: s_tir.Schedule, name: str, threads: int) -> None:
    """Elementwise block ``name``: all loops fused, ``threads`` per block."""
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _weights(kernel: Kernel, *prefixes: str) -> list[str]:
    """Names of the weight buffers of ``kernel`` starting with one of ``prefixes``."""
    return [p.name for p in kernel.params if p.role == "in" and p.name.startswith(prefixes)]


def _schedule_norm(sch: s_tir.Schedule, kernel: Kernel, threads: int) -> None:
    s, c = sch.get_loops(sch.get_sblock("y"))
    sch.bind(s, "blockIdx.x")
    _, tx = sch.split(c, [None, threads])
    sch.bind(tx, "threadIdx.x")
    # Producers in reverse order: compute_at needs every consumer placed first.
    for name in ("sq", "total") if _has_block(kernel, "sq") else ("ss",):
        block_reduce(sch, name, s, threads, local=True)


def accumulate_in_register(sch: s_tir.Schedule, name: str, at: s_tir.schedule.LoopRV,
                            loop: s_tir.schedule.LoopRV) -> None:
    """Keep block ``name``'s running sum in a register, zeroed before its reduction ``loop`` and
    stored once after the loop at ``at`` (so a guarded-off reduction stores 0)."""
    block = sch.get_sblock(name)
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, at, preserve_unit_loops=True)
    sch.decompose_reduction(block, loop)


def _has_block(kernel: Kernel, name: str) -> bool:
    try:
        spatial_axes(kernel.func, name)
    except PiccError:
        return False
    return True


def schedule(kernel: Kernel, arch: str) -> tirx.PrimFunc:
    """The GPU-scheduled TensorIR of ``kernel`` for ``arch`` (sm_75, sm_80, sm_89, sm_90)."""
    p = arch_params(arch)
    unroll, pair = p.unroll_chunks, p.rows_per_warp
    sch = s_tir.Schedule(kernel.func)
    tiles: dict[str, TileGuard] = {}
    eager: tuple[str, ...] = ()
    for stage in (H_STAGE, LIVE_STAGE) if kernel.kind in _AXPYS else ():  # per element of the AXPY, as before
        if _has_block(kernel, stage):
            sch.compute_inline(sch.get_sblock(stage))
    match kernel.kind:
        case "gemv":
            warp_rows(sch, "acc", p.rows, [*_weights(kernel, "W"), "x"], False, ("y",), unroll, pair)
        case "gemm":
            warp_rows(sch, "acc", p.rows, [*_weights(kernel, "W"), "X"], False, ("Y",), unroll, pair)
        case "predictor":
            warp_rows(sch, "acc1", p.rows, [*_weights(kernel, "fc1"), "x"], False, ("hid",), unroll, pair)
            warp_rows(sch, "acc2", p.rows, [*_weights(kernel, "fc2"), "hid"], False, ("mask",), unroll, pair)
        case "sparse_ffn" | "dense_ffn":
            live = kernel.guards.get("ug")
            # The live rows are a prefix (r < count): a warp whose first row is live may compute
            # every one of its rows (a dead one's value is zero by the definition).
            warp_rows(sch, "ug", p.rows, [*_weights(kernel, "W_ug"), "x"], live is not None, unroll=unroll,
                      per_warp=pair)
            tiles = sliced_axpy(sch, AXPY_COLUMNS, p.axpy_split, p.threads, p.axpy_unroll, live)
            if tiles and p.axpy_eager and kernel.options.get("dead_rows_zero"):
                eager = tuple(tiles)
        case "gate_first_ffn":
            warp_rows(sch, "g", p.rows, [*_weights(kernel, "gate"), "x"], False, unroll=unroll, per_warp=pair)
            # Active neurons are scattered: a warp's guard must decide for its one row alone.
            warp_rows(sch, "u", p.rows, [*_weights(kernel, "up"), "x"], True, unroll=unroll)
            sliced_axpy(sch, AXPY_COLUMNS, p.axpy_split, p.threads, p.axpy_unroll)
        case "norm":
            _schedule_norm(sch, kernel, 128)
        case "attention" | "attention_decode":
            # Imported here: attention's schedules build on this module's pieces.
            from picc.codegen_cuda.schedules_attention import schedule_attention, schedule_attention_decode

            if kernel.kind == "attention":
                schedule_attention(sch, kernel, 128)
            else:
                schedule_attention_decode(sch, kernel)
        case "elementwise":
            flat_threads(sch, sch.get(sch.get_child_blocks(sch.get_sblock("root"))[-1]).name_hint, p.threads)
        case "compact":
            return warp_compact(kernel)
        case "greedy_next":
            return block_greedy_next(kernel)
        case _:
            raise NotImplementedError(kernel.kind)
    return apply_guards(sch.mod["main"], kernel, tiles, eager)


# Row-dot reductions and neuron-major AXPYs per kernel kind (the blocks the CPU schedule touches).
_ROW_DOTS = {"gemv": ("acc",), "gemm": ("acc",), "predictor": ("acc1", "acc2"), "sparse_ffn": ("ug",),
             "dense_ffn": ("ug",), "gate_first_ffn": ("g", "u")}
_AXPYS = {"sparse_ffn": "y_part", "dense_ffn": "y_part", "gate_first_ffn": "y_part"}


def cpu_schedule(kernel: Kernel) -> tirx.PrimFunc:
    """A simple CPU schedule of ``kernel`` for the host build (LLVM), 8-30x over the definition.

    Row dots keep ``vector`` partial sums per row (``rfactor`` of ``kl``) so LLVM emits SIMD
    multiply-adds; AXPYs walk the neuron-major down rows in storage order (rows outer, columns
    inner) instead of striding down columns. Other kernels are cheap and stay as defined.
    """
    sch = s_tir.Schedule(kernel.func)
    for name in _ROW_DOTS.get(kernel.kind, ()):
        kl = sch.get_loops(sch.get_sblock(name))[-1]
        rf = sch.rfactor(kl, 0)
        sch.vectorize(sch.get_loops(rf)[-1])
    if kernel.kind in _AXPYS:
        _, k, r = sch.get_loops(sch.get_sblock(_AXPYS[kernel.kind]))
        sch.reorder(r, k)
    return sch.mod["main"]
