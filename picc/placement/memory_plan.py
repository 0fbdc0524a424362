"""The memory plan: every byte a compiled model puts on the GPU, and where it sits.

PowerInfer's VRAM budget is not what it uses; picc's is. The plan is computed from a placed
module (the ``partition-neurons`` pass records each weight's and op's device in its type) and is
the one statement of GPU memory: ``picc compile`` writes it into the ``.pib`` as JSON, ``picc
inspect`` reports it, and the runtime allocates exactly its buffers at its offsets in one arena.

What lives on the GPU (each buffer starts at a multiple of ``runtime.plan.ARENA_ALIGN`` in the arena):

* every weight declared ``@gpu`` (dense weights of the layers placed there, predictors, the hot
  part of each FFN, the LM head if placed) in the GPU layout of ``runtime.gpu_layout``: matrices
  in their storage format (block formats split into planes), vectors in f32;
* the KV cache of every attention op placed there: ``ctx`` positions of K, then of V, f32 (a
  value row ``v_head_dim`` wide where the op's values are narrower than its keys);
* constants the GPU kernels read: the rotary frequencies of every rope op placed there (and the
  factor of its cosines and sines: ``codegen_cuda.layers.rope_table``), the
  threshold of every predictor and gate-first FFN there, and the ones an unscaled gate-first FFN
  scales its scores by (f32);
* one activation arena for a token (the runtime runs one token per step, prompt tokens too):
  every value an op computes on the GPU, and every value a GPU op reads from the CPU, gets an
  offset in it, reused once the value is dead (first fit, in op order, which is the order the GPU
  runs its ops in);
* one workspace for the kernels' temporaries between their launches, the largest any GPU op
  needs (``gpu_scratch``: exactly the scratch buffers of the op's kernels);
* where the GPU reads the token and makes the logits, the greedy decode loop's state
  (``runtime.plan.GREEDY``, ``picc.codegen_cuda.greedy``): a token per position and the position
  to come, ``4 * (ctx + 1)`` bytes.

CPU buffers are listed too (weights are mapped from the file, the KV cache of CPU layers is
allocated), so ``cpu_bytes`` is the host memory the model holds beside its activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Function, Module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import DType, Placement, TensorType
from picc.ir.weights import WeightStore
from picc.placement.schedule import Schedule, schedule
from picc.quant import raw_nbytes
from runtime import gpu_layout
from runtime.plan import GREEDY, Buffer, MemoryPlan, aligned

KV_BYTES = {"f32": 4, "f16": 2}  # bytes per cached element, by the attention op's kv_format
DEFAULT_CTX = 512

_ELEMENT = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I32: 4, DType.I64: 8, DType.BOOL: 1}


def tensor_bytes(t: TensorType, seq: int = 1) -> int:
    """Bytes of a value or weight of type ``t``, with symbolic dims taken as ``seq``."""
    shape = [d if isinstance(d, int) else seq for d in t.shape]
    if t.dtype.is_quantized:
        return raw_nbytes(t.dtype.value, shape)
    return math.prod(shape) * _ELEMENT[t.dtype]


def gpu_scratch(op: Op, ctx: int, weights: dict[str, TensorType]) -> list[tuple[str, int]]:
    """The scratch buffers ``(name, bytes)`` of ``op``'s GPU kernels, in the order they sit in
    the workspace (each at a multiple of ``gpu_layout.PLANE_ALIGN``): the contract the kernels of
    ``picc.codegen_cuda`` are written to, which its lowering checks.

    An FFN part in predictor mode holds the index list of its active neurons (padded to the
    kernels' row tile), their count and their up (and gate) dot products; in dense mode the dot
    products of every neuron; in gate-first mode the gate and up values of every neuron; in every
    mode the partial rows of its down-projection's row slices (``gpu_layout.axpy_slices``). A
    predictor holds its hidden layer; attention, where its cache is too long for the one-kernel
    decode attention (``gpu_layout.fused_attention``), its scores, row maxima, row sums and
    probabilities for ``ctx`` positions per head (the one kernel keeps them in shared memory).
    An unfused FFN (the partitioner's trials) counts as the predictor-mode kernel, the largest. A
    whole FFN layer with a down bias also holds its partial sum, to which a second kernel adds the
    bias.
    """
    if isinstance(op, O.FFN | FusedFFN):
        n = int(weights[op.down].shape[0] if isinstance(op, FusedFFN) else weights[op.up].shape[0])
        hidden = int(weights[op.down].shape[1] if isinstance(op, FusedFFN) else weights[op.up].shape[1])
        j = 2 if O.FFN_FORMS[op.form].gated else 1
        mode = op.mode if isinstance(op, FusedFFN) else "predictor"
        rows = gpu_layout.padded_rows(n) if mode == "predictor" else n

        def y_part() -> tuple[str, int]:  # the AXPY's partial rows, one per row slice
            return ("y_part", 4 * gpu_layout.axpy_slices(rows, hidden) * hidden)
        # A whole layer with a down bias: the kernel's partial sum, before the bias is added.
        partial = [("partial", 4 * hidden)] if op.down_bias is not None else []
        if mode == "gate-first":
            return [("g", 4 * n), ("u", 4 * n), y_part(), *partial]
        if mode == "dense":
            return [("ug", 4 * n * j), y_part(), *partial]
        return [("idx", 4 * rows), ("count", 4), ("ug", 4 * rows * j), y_part(), *partial]
    if isinstance(op, Predict):
        return [("hid", 4 * int(weights[op.fc1].shape[0]))]
    if isinstance(op, O.Attention) and not gpu_layout.fused_attention(ctx):
        return [("scores", 4 * op.n_heads * ctx), ("smax", 4 * op.n_heads), ("ssum", 4 * op.n_heads),
                ("probs", 4 * op.n_heads * ctx)]
    return []


def gpu_launch_count(op: Op, ctx: int) -> int:
    """Kernel launches ``op`` costs on the GPU with a KV cache of ``ctx`` positions
    (``picc.codegen_cuda``'s lowering and schedules, which a test holds this to): a fused FFN's
    gather-GEMV, its down-projection AXPY in row slices and their sum, after a predictor-mode
    part's index list or before a gate-first one's up rows, and a whole layer's down bias;
    attention's cache append (unless ``appended_by_rope``) and then one kernel
    (``gpu_layout.fused_attention``), or for a longer cache its scores, max, sum, probabilities and
    output; a predictor's two layers; none for an add whose producer's kernel does it
    (``accumulated_by``) or a rope rotated by another's launch (``launched_with``); one kernel for
    the rest."""
    if (isinstance(op, O.Add) and op.accumulated is not None) or (isinstance(op, O.Rope) and op.launched_with):
        return 0
    if isinstance(op, O.FFN | FusedFFN):
        mode = op.mode if isinstance(op, FusedFFN) else "predictor"
        return (3 if mode == "dense" else 4) + (op.down_bias is not None)
    if isinstance(op, O.Attention):  # the cache append, unless the rope of k does it
        return (1 if gpu_layout.fused_attention(ctx) else 5) + (not op.appended_by_rope)
    if isinstance(op, Predict):
        return 2
    return 1


def workspace_bytes(op: Op, ctx: int, weights: dict[str, TensorType]) -> int:
    """Bytes of the workspace ``op``'s GPU kernels need (``gpu_scratch`` laid out)."""
    end = 0
    for _, nbytes in gpu_scratch(op, ctx, weights):
        end = gpu_layout.aligned(end) + nbytes
    return end


def gpu_constants(op: Op, weights: WeightStore) -> list[tuple[str, int]]:
    """Constants ``(name, f32 count)`` a GPU op's kernels read besides its weights."""
    if isinstance(op, O.Rope):  # a rope launched with another reads that one's frequencies
        return [] if op.launched_with else [(f"rope.{op.result}", op.rotated // 2 + 1)]
    if isinstance(op, Predict):
        return [(f"threshold.{op.result}", 1)]
    # A gate-first FFN, fused or not yet (partitioning plans the module before fusion).
    if isinstance(op, FusedFFN | SparseFFN) and op.mode == "gate-first":
        assert op.gate is not None
        if op.score_scale is not None:
            return [(f"threshold.{op.result}", 1)]
        # An unscaled layer's kernel scales its scores by ones.
        return [(f"threshold.{op.result}", 1), (f"score_scale.{op.result}", int(weights[op.gate].shape[0]))]
    return []


def kv_cache_bytes(op: O.Attention, ctx: int, part: str = "kv") -> int:
    """Bytes of ``op``'s keys and values for ``ctx`` positions (``part`` "kv"), or of its keys
    ("k") or values ("v") alone: ``n_kv_heads`` rows a position of ``head_dim`` and of
    ``v_head_dim`` elements."""
    dims = {"k": op.head_dim, "v": op.v_dim, "kv": op.head_dim + op.v_dim}[part]
    return ctx * op.n_kv_heads * dims * KV_BYTES[op.kv_format]


def copy_points(func: Function, steps: Schedule) -> tuple[dict[str, int], dict[str, int]]:
    """When, in the GPU's op order, each value crosses: ``(uploads, downloads)``, value -> index
    of the op before which the copy happens.

    A value is copied across before the stage that reads it, i.e. before the first GPU op of
    that stage (or later). The function's arguments are written before the first op.
    """
    index = {op.result: i for i, op in enumerate(func.ops)}
    starts = []  # per stage: the first GPU op at or after it
    nxt = len(func.ops)
    for st in reversed(steps.stages):
        if st.gpu:
            nxt = index[st.gpu[0]]
        starts.append(nxt)
    starts.reverse()
    uploads = {a.name: 0 for a in func.args}
    downloads = {}
    for i, st in enumerate(steps.stages):
        uploads.update({v: starts[i] for v in st.to_gpu})
        downloads.update({v: starts[i] for v in st.to_cpu})
    return uploads, downloads


def activation_arena(func: Function, on_gpu: Callable[[Op], bool],
                     steps: Schedule) -> tuple[dict[str, int], int]:
    """Offsets in one arena of every value the GPU holds, reusing dead values' space (first fit).

    The GPU holds what its ops compute and what they read from the CPU. A value computed there is
    live from its op to its last GPU reader, or to its copy to the CPU if that comes later; a
    value copied in (or a function argument) is live from the copy (``copy_points``) to its last
    reader. The returned value is live to the end. The GPU runs its ops in this order. An add whose
    operand's producer does it (``accumulated_by``) is written by that producer: its result is
    live from there, and the operand itself is never written. A rope rotated by an earlier rope's
    launch (``launched_with``) is live from that launch.
    """
    types = func.value_types()
    uploads, downloads = copy_points(func, steps)
    last_use: dict[str, int] = {}
    for i, op in enumerate(func.ops):
        if on_gpu(op):
            for v in op.values():
                last_use[v] = i
    for v, at in downloads.items():
        last_use[v] = max(last_use.get(v, at), at)
    last_use[func.ret] = len(func.ops)
    arriving: dict[int, list[str]] = {}
    for v, at in uploads.items():
        if v in last_use:  # some GPU op reads it
            arriving.setdefault(at, []).append(v)
    # The producer (by index) that writes an add's result instead of its own, on the GPU.
    index = {op.result: i for i, op in enumerate(func.ops)}
    writes: dict[int, list[str]] = {}  # op index -> values its launch writes besides (or instead of) its own
    skipped: set[str] = set()  # values its own op does not write
    for op in func.ops:
        if isinstance(op, O.Add) and op.accumulated is not None and on_gpu(op):
            writes.setdefault(index[op.accumulated[0]], []).append(op.result)
            skipped.add(op.accumulated[0])
        elif isinstance(op, O.Rope) and op.launched_with is not None and on_gpu(op):
            writes.setdefault(index[op.launched_with], []).append(op.result)
    written_early = {v for values in writes.values() for v in values}
    live: list[tuple[int, int, str]] = []  # (offset, size, value), sorted by offset
    offsets: dict[str, int] = {}
    size = 0

    def place(value: str) -> None:
        nonlocal live, size
        need = aligned(tensor_bytes(types[value], 1))
        at = 0
        for start, length, _ in live:  # the first gap that holds it
            if start - at >= need:
                break
            at = max(at, start + length)
        offsets[value] = at
        live = sorted([*live, (at, need, value)])
        size = max(size, at + need)

    for i, op in enumerate(func.ops):
        live = [item for item in live if last_use.get(item[2], -1) >= i]
        for v in arriving.get(i, ()):
            place(v)
        if on_gpu(op) and op.result not in written_early and op.result not in skipped:
            place(op.result)
        for v in writes.get(i, ()):
            place(v)
    return offsets, size


def _is_gpu(t: TensorType) -> bool:
    return t.placement == Placement.GPU


def placement_notes(func: Function) -> tuple[str, ...]:
    """What the placement left on the CPU that a user may not expect, read off the placed IR."""
    def on_cpu(op: Op) -> bool:
        return op.type.placement != Placement.GPU

    if all(on_cpu(op) for op in func.ops):
        return ("everything is on the CPU",)
    notes = []
    layers: set[int] = set()
    cpu_dense_set: set[int] = set()
    for op in func.ops:
        if (i := op.block) is not None:
            layers.add(i)
            if on_cpu(op) and not isinstance(op, O.FFN | FusedFFN | Merge):
                cpu_dense_set.add(i)
    cpu_dense = sorted(cpu_dense_set)
    if cpu_dense:
        notes.append(f"layers {cpu_dense[0]}..{cpu_dense[-1]}: attention and norms on the CPU (the budget "
                     f"holds the dense parts of {len(layers) - len(cpu_dense)} of {len(layers)} layers)")
    if on_cpu(func.ops[-1]):
        notes.append("the output norm and LM head are on the CPU")
    elif (cpu_ops := [op for op in func.ops if on_cpu(op)]) and all(isinstance(op, O.Embed) for op in cpu_ops):
        notes.append("the embedding is on the CPU (it is not the LM head's table), so each step starts on the host "
                     "and greedy steps cannot run as a loop on the GPU")
    return tuple(notes)


def plan_memory(module: Module, weights: WeightStore, *, ctx: int, budget: int) -> MemoryPlan:
    """The exact buffers of a placed module (see the module docstring)."""
    func = module.function()
    decls = module.weight_types()
    buffers: list[Buffer] = []
    gpu_at = 0

    def add(name: str, kind: str, gpu: bool, nbytes: int, layer: int | None) -> None:
        nonlocal gpu_at
        if gpu:
            buffers.append(Buffer(name, kind, "gpu", nbytes, gpu_at, layer))
            gpu_at += aligned(nbytes)
        else:
            buffers.append(Buffer(name, kind, "cpu", nbytes, -1, layer))

    block_of: dict[str, int | None] = {}  # weight -> the block of its first reader
    for op in func.ops:
        for w in op.weights():
            block_of.setdefault(w, op.block)
    for decl in module.weights:
        layer = block_of.get(decl.name)
        on_gpu = _is_gpu(decl.type)
        t = weights[decl.name]
        nbytes = gpu_layout.gpu_nbytes(t.dtype.value, t.shape) if on_gpu else int(t.data.nbytes)
        add(decl.name, "weight", on_gpu, nbytes, layer)
    gpu_ops = [op for op in func.ops if _is_gpu(op.type)]
    for op in gpu_ops:
        for name, count in gpu_constants(op, weights):
            add(name, "constant", True, 4 * count, op.block)
    for op in func.ops:
        if isinstance(op, O.Attention):
            add(f"kv.{op.cache}", "kv-cache", _is_gpu(op.type), kv_cache_bytes(op, ctx), op.block)
    offsets: dict[str, int] = {}
    if gpu_ops:
        offsets, arena = activation_arena(func, lambda op: _is_gpu(op.type), schedule(module))
        add("activations", "activations", True, arena, None)
        add("workspace", "workspace", True, max(workspace_bytes(op, ctx, decls) for op in gpu_ops), None)
        made_by = {op.result: op for op in func.ops}
        if "tokens" in offsets and "pos" in offsets and func.ret in made_by and _is_gpu(made_by[func.ret].type):
            add(GREEDY, "greedy", True, 4 * (ctx + 1), None)
    return MemoryPlan(ctx, budget, tuple(buffers), offsets, placement_notes(func))
