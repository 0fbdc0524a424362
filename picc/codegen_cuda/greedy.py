"""The GPU's greedy decode loop: after a step's logits, the next step's token and position.

For a model whose whole step runs on the GPU (the embedding reads ``tokens`` there and the GPU
makes the logits), the runtime can queue many greedy decode steps without returning to the host
between them (``runtime.executor.Executor.greedy_steps``): each step's launches are followed by
``greedy_next``, which picks the step's most likely token (the first index of the largest logit,
as ``numpy.argmax``; a NaN logit is never picked), writes it where the next step's embedding reads
``tokens``, records it in the plan's ``greedy`` buffer at the step's position, and writes the next
position where the next step reads ``pos``.

The ``greedy`` buffer holds ``ctx`` token slots and, after them, the position of the step to come
(``state[ctx]``, set by the runtime before the loop): the kernel keeps the position there, not in
the ``pos`` slot, which the activation arena may reuse once the step's last attention has read it.
The ``tokens`` and ``pos`` slots are only written, after every logit was read, so whatever value
shares their bytes by then (the logits themselves, say) is no longer needed: the runtime reads a
loop's last logits from a step run without this kernel.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from picc.codegen_cuda.kernel import Kernel, check_positive, kernel_from_func

WARP = 32
GREEDY_THREADS = 256  # one block; each thread scans every 256th logit, then a warp and a block reduction


def greedy_next(name: str, vocab: int, ctx: int) -> Kernel:
    """The definition (the host build's): a serial scan of the logits."""
    check_positive(vocab=vocab, ctx=ctx)

    @T.prim_func(s_tir=True)
    def func(logits: T.Buffer((vocab,), "float32"), tokens: T.Buffer((1,), "int32"),
             pos: T.Buffer((1,), "int32"), state: T.Buffer((ctx + 1,), "int32")):
        for t in range(1):
            with T.sblock("greedy"):
                vt = T.axis.spatial(1, t)
                T.reads(logits[0:vocab], state[ctx])
                T.writes(tokens[vt], pos[vt], state[0 : ctx + 1])
                best = T.sblock_alloc_buffer((1,), "int32", scope="local")
                top = T.sblock_alloc_buffer((1,), "float32", scope="local")
                best[0] = 0
                top[0] = logits[0]
                for i in range(vocab):
                    if logits[i] > top[0]:
                        top[0] = logits[i]
                        best[0] = i
                # The position, clamped into the record (the runtime keeps it there), is read
                # again in each index rather than kept in a local: so the bounds are provable.
                tokens[vt] = best[0]
                pos[vt] = T.max(T.min(state[ctx], ctx - 1), 0) + 1
                state[T.max(T.min(state[ctx], ctx - 1), 0)] = best[0]
                state[ctx] = T.max(T.min(state[ctx], ctx - 1), 0) + 1

    return kernel_from_func(name, "greedy_next", func,
                            {"logits": "in", "tokens": "out", "pos": "out", "state": "inout"},
                            options={"vocab": vocab, "ctx": ctx})


def block_greedy_next(kernel: Kernel) -> tirx.PrimFunc:
    """``greedy_next`` for the GPU, in one block of :data:`GREEDY_THREADS`: thread ``t`` keeps the
    first largest of logits ``t, t + 256, ...``; shuffles reduce each warp and thread 0 the warps'
    winners (the larger value; of equal ones the smaller index, so the result is the definition's).
    """
    vocab, ctx = kernel.options["vocab"], kernel.options["ctx"]
    threads, warps = GREEDY_THREADS, GREEDY_THREADS // WARP
    steps = -(-vocab // threads)
    lanes_mask = T.uint32(0xFFFFFFFF)

    @T.prim_func(s_tir=True)
    def func(logits: T.Buffer((vocab,), "float32"), tokens: T.Buffer((1,), "int32"),
             pos: T.Buffer((1,), "int32"), state: T.Buffer((ctx + 1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            with T.sblock("greedy"):
                T.reads(logits[0:vocab], state[ctx])
                T.writes(tokens[0], pos[0], state[0 : ctx + 1])
                best = T.sblock_alloc_buffer((1,), "int32", scope="local")
                top = T.sblock_alloc_buffer((1,), "float32", scope="local")
                other = T.sblock_alloc_buffer((1,), "int32", scope="local")
                value = T.sblock_alloc_buffer((1,), "float32", scope="local")
                tops = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                bests = T.sblock_alloc_buffer((warps,), "int32", scope="shared")
                best[0] = 0
                top[0] = logits[0]
                for s in range(steps):
                    if s * threads + tx < vocab:  # noqa: SIM102 - the load must not run past the end
                        if logits[s * threads + tx] > top[0]:
                            top[0] = logits[s * threads + tx]
                            best[0] = s * threads + tx
                for d in range(5):  # each warp: lane 0 ends with the warp's winner
                    value[0] = T.call_extern("float32", "__shfl_down_sync", lanes_mask, top[0], 16 >> d, WARP)
                    other[0] = T.call_extern("int32", "__shfl_down_sync", lanes_mask, best[0], 16 >> d, WARP)
                    if value[0] > top[0] or (value[0] == top[0] and other[0] < best[0]):
                        top[0] = value[0]
                        best[0] = other[0]
                if tx % WARP == 0:
                    tops[tx // WARP] = top[0]
                    bests[tx // WARP] = best[0]
                T.tvm_storage_sync("shared")
                if tx == 0:
                    for w in range(1, warps):
                        value[0] = tops[w]  # into registers first: a condition may not read shared memory
                        other[0] = bests[w]
                        if value[0] > top[0] or (value[0] == top[0] and other[0] < best[0]):
                            top[0] = value[0]
                            best[0] = other[0]
                    tokens[0] = best[0]
                    pos[0] = T.max(T.min(state[ctx], ctx - 1), 0) + 1
                    state[T.max(T.min(state[ctx], ctx - 1), 0)] = best[0]
                    state[ctx] = T.max(T.min(state[ctx], ctx - 1), 0) + 1

    return func.with_attr("global_symbol", kernel.name)
