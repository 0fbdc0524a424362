"""GPU schedules of attention (``layers.attention`` and ``layers.attention_decode``).

Both build on the pieces of ``schedules.py`` (``block_reduce``, guards, staging through
registers); they live here to keep that module short.

* ``schedule_attention``: five launches, one a stage, communicating through scratch buffers in
  global memory (prefill, and caches too long for ``schedule_attention_decode``).
* ``schedule_attention_decode``: a decode step's attention (one query) in one launch, one thread
  block per head. TVM makes one ``__global__`` function of every loop nest under one
  ``blockIdx.x`` loop, so every stage is ``compute_at`` the head loop of ``out``; the stages
  between them live in shared memory (``scores``, ``probs``: one float a position) or in
  registers (``smax``, ``ssum``: TVM's cross-thread reduction leaves its result in every
  thread). Each thread tag has one extent in a kernel, so every stage runs on the same
  ``threadIdx.x`` (``tx``) x ``threadIdx.y`` (``ty``) block (``decode_tiles``).
"""

from __future__ import annotations

import math

from tvm import s_tir

from picc.codegen_cuda.kernel import Kernel
from picc.codegen_cuda.schedules import (
    GUARD,
    accumulate_in_register,
    block_reduce,
    flat_threads,
    power_of_two_divisor,
    stage_vector,
)

# Threads per block of the one-launch decode attention. A decode step has only n_heads blocks
# (5 to 32), far fewer than an H100's 132 SMs, so each block is wide. Not tuned.
DECODE_THREADS = 256


def schedule_attention(sch: s_tir.Schedule, kernel: Kernel, threads: int) -> None:
    """``layers.attention`` in five launches (see the module docstring)."""
    # scores: a thread per (query, head, position), a serial dot product over head_dim that is
    # skipped (guard) for positions the query does not see.
    *spatial, kd = sch.get_loops(sch.get_sblock("scores"))
    bx, tx = sch.split(sch.fuse(*spatial), [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.annotate(kd, GUARD, "scores")
    accumulate_in_register(sch, "scores", tx, kd)
    # softmax statistics: a block per (query, head), a cross-thread reduction over positions.
    for name in ("smax", "ssum"):
        block_reduce(sch, name, None, threads, local=False)
    flat_threads(sch, "probs", threads)
    # out: a block per (query, head), a thread per feature (V rows are read coalesced) and
    # ``threadIdx.y`` taking every ``split``-th position, merged through shared memory: the
    # positions' loop is ``split`` times shorter than one thread walking all of them.
    dv = kernel.options["v_head_dim"]  # features of an output head: a value head's
    s, c, j = sch.get_loops(sch.get_sblock("out"))
    split = power_of_two_divisor(int(sch.get(j).extent), max(1, min(8, 1024 // dv)))
    jo, jy = sch.split(j, [None, split])
    rf = sch.rfactor(jy, 0)
    s, c, jo, jy = sch.get_loops(rf)
    head, lane = sch.split(c, [None, dv])
    sch.reorder(s, head, lane, jy, jo)
    sch.bind(sch.fuse(s, head), "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    sch.bind(jy, "threadIdx.y")
    sch.decompose_reduction(rf, jo)
    sch.set_scope(rf, 0, "local")
    final = sch.get_sblock("out")
    sch.reverse_compute_at(final, lane)
    sch.bind(sch.get_loops(final)[-1], "threadIdx.y")


def decode_tiles(head_dim: int, max_ctx: int, threads: int = DECODE_THREADS) -> tuple[int, int]:
    """``(tx, ty)``: the thread block of ``schedule_attention_decode``, at most ``threads``.

    ``tx`` threads take adjacent features of the output (coalesced V reads; ``head_dim`` is an
    output head's, a value head's) and ``ty`` split its positions; the other stages take
    ``tx * ty`` positions at a time. Both are powers of two that divide their loops
    (``power_of_two_divisor``): ``tx`` divides head_dim and max_ctx, ``ty`` divides max_ctx / tx,
    so no thread has a feature or position past the buffers. ``tx`` is at most half of max_ctx,
    so that ``ty`` is at least 2 (TVM cannot merge an output split one way).
    """
    tx = power_of_two_divisor(math.gcd(head_dim, max_ctx), min(64, threads, max_ctx // 2))
    return tx, power_of_two_divisor(max_ctx // tx, threads // tx)


def schedule_attention_decode(sch: s_tir.Schedule, kernel: Kernel, threads: int = DECODE_THREADS) -> None:
    """``layers.attention_decode`` in one launch, a block per head (see the module docstring).

    ``out`` fixes the block (its head loop is ``blockIdx.x``); its producers are then placed
    under that loop, consumers first, as ``compute_at`` requires.
    """
    dv, max_ctx = kernel.options["v_head_dim"], kernel.param("k_cache").shape[0]  # an output head's features
    tx, ty = decode_tiles(dv, max_ctx, threads)
    head = _decode_out(sch, dv, tx, ty)
    for name, scope in (("probs", "shared"), ("ssum", "local"), ("smax", "local")):
        block = sch.get_sblock(name)
        sch.compute_at(block, head, preserve_unit_loops=True)
        _over_positions(sch, sch.get_loops(block)[-1], tx, ty)
        sch.set_scope(block, 0, scope)
    _decode_scores(sch, head, tx, ty)


def _over_positions(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, tx: int, ty: int) -> None:
    """Position ``loop`` split ``[rest, ty, tx]``, bound to the block's threads: ``tx * ty``
    positions a step (for a reduction, an in-thread partial then TVM's cross-thread reduction
    over both axes)."""
    _, y, x = sch.split(loop, [None, ty, tx])
    sch.bind(y, "threadIdx.y")
    sch.bind(x, "threadIdx.x")


def _decode_out(sch: s_tir.Schedule, head_dim: int, tx: int, ty: int) -> s_tir.schedule.LoopRV:
    """``out[c] = sum_j probs[j] * V[j, c]`` (``head_dim``: a value head's features): a block per
    head, thread ``x`` takes the ``head_dim / tx`` adjacent features from ``x * head_dim / tx``
    (one vector load of a V row where that is 2 or 4, and a warp reads adjacent bytes), thread
    ``y`` every ``ty``-th position, in registers (``rfactor``), and a shared-memory reduction
    over ``threadIdx.y`` merges them. Returns the head loop, bound to ``blockIdx.x``."""
    _, _, j = sch.get_loops(sch.get_sblock("out"))
    _, jy = sch.split(j, [None, ty])
    rf = sch.rfactor(jy, 0)
    s, c, jo, jy = sch.get_loops(rf)
    head, x, vec = sch.split(c, [None, tx, head_dim // tx])
    head = sch.fuse(s, head)
    sch.reorder(head, x, jy, jo, vec)
    sch.bind(head, "blockIdx.x")
    sch.bind(x, "threadIdx.x")
    sch.bind(jy, "threadIdx.y")
    if head_dim // tx in (2, 4):  # CUDA has float2 and float4 (TVM's codegen no wider)
        sch.vectorize(vec)
    sch.decompose_reduction(rf, jo)
    sch.set_scope(rf, 0, "local")
    final = sch.get_sblock("out")
    sch.reverse_compute_at(final, x)
    if head_dim > tx:  # the merge's loops are (positions, features): one merge a feature
        red, col = sch.get_loops(final)[-2:]
        sch.reorder(col, red)
    sch.bind(sch.get_loops(final)[-1], "threadIdx.y")
    return head


def _decode_scores(sch: s_tir.Schedule, head: s_tir.schedule.LoopRV, tx: int, ty: int) -> None:
    """``scores[j] = q . K[j]`` into shared memory: a thread per position, its dot product over
    head_dim in a register, K and q read 16 bytes (a ``float4``) a load, and the whole dot skipped
    (guard) for a position the query does not see, so its K row is never loaded."""
    block = sch.get_sblock("scores")
    sch.compute_at(block, head, preserve_unit_loops=True)
    *_, j, kd = sch.get_loops(block)
    _over_positions(sch, j, tx, ty)
    x = sch.get_loops(block)[-2]
    sch.set_scope(block, 0, "shared")
    d = int(sch.get(kd).extent)
    ko, kl = sch.split(kd, [None, power_of_two_divisor(d, 4)])
    for buffer in ("k_cache", "q"):
        stage_vector(sch, block, buffer, ko)
    sch.unroll(kl)
    sch.annotate(ko, GUARD, "scores")
    accumulate_in_register(sch, "scores", x, ko)
