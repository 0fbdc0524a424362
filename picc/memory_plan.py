"""The memory plan: every byte a compiled model puts on the GPU, and where it sits.

PowerInfer's VRAM budget is not what it uses; picc's is. The plan is computed from a placed
module (the ``partition-neurons`` pass records each weight's and op's device in its type) and is
the one statement of GPU memory: ``picc compile`` writes it into the ``.pib`` as JSON, ``picc
inspect`` reports it, and the runtime allocates exactly its buffers at its offsets in one arena.

What lives on the GPU (each buffer starts at a multiple of ``ALIGN`` in the arena):

* every weight declared ``@gpu`` (dense weights of the layers placed there, predictors, the hot
  part of each FFN, the LM head if placed) in its storage format;
* the KV cache of every attention op placed there: ``ctx`` positions of K and V, f32;
* the rotary frequencies of every rope op placed there (f32);
* one activation arena for ``ubatch`` tokens: every value an op computes on the GPU, and every
  value a GPU op reads from the CPU, gets an offset in it, reused once the value is dead (first
  fit, in op order);
* one workspace for the kernels' temporaries, the largest any GPU op needs (``workspace_bytes``).

CPU buffers are listed too (weights are mapped from the file, the KV cache of CPU layers is
allocated), so ``cpu_bytes`` is the host memory the model holds beside its activations.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Function, Module
from picc.ir.sparse_ops import Predict
from picc.ir.types import DType, Placement, TensorType
from picc.ir.weights import WeightStore
from picc.quant import raw_nbytes

ALIGN = 256  # what cudaMalloc guarantees; 16-byte vector loads and 64-byte CPU lines divide it
KV_BYTES = 4  # the KV cache holds f32, as the interpreter does, so GPU and CPU layers agree
DEFAULT_CTX = 512
DEFAULT_UBATCH = 32  # tokens per prefill chunk: sizes the activation arena
PLAN_VERSION = 1

_ELEMENT = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I32: 4, DType.I64: 8, DType.BOOL: 1}


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def tensor_bytes(t: TensorType, seq: int = 1) -> int:
    """Bytes of a value or weight of type ``t``, with symbolic dims taken as ``seq``."""
    shape = [d if isinstance(d, int) else seq for d in t.shape]
    if t.dtype.is_quantized:
        return raw_nbytes(t.dtype.value, shape)
    return math.prod(shape) * _ELEMENT[t.dtype]


def layer_of(name: str) -> int | None:
    """The decoder layer a value belongs to, by its name (``l3.attn.q`` -> 3), or None."""
    m = re.match(r"l(\d+)\.", name)
    return int(m.group(1)) if m else None


def workspace_bytes(op: Op, ubatch: int, ctx: int, weights: dict[str, TensorType]) -> int:
    """The temporaries a GPU kernel for ``op`` needs beyond its inputs and result.

    An FFN (or part) holds its gate and up activations and an int32 index list of its active
    neurons per token (plus a count); a predictor its hidden layer; attention its scores for
    ``ctx`` positions per head. This is the contract codegen's kernels are written to.
    """
    if isinstance(op, O.FFN):
        n = weights[op.up].shape[0]
        assert isinstance(n, int)
        return ubatch * (2 * 4 * n + 4 * (n + 1))
    if isinstance(op, Predict):
        rank = weights[op.fc1].shape[0]
        assert isinstance(rank, int)
        return ubatch * 4 * rank
    if isinstance(op, O.Attention):
        return ubatch * op.n_heads * ctx * 4
    return 0


def kv_cache_bytes(op: O.Attention, k_width: int, ctx: int) -> int:
    """K and V for ``ctx`` positions of an attention op whose K rows are ``k_width`` wide."""
    return 2 * ctx * k_width * KV_BYTES


@dataclass(frozen=True, slots=True)
class Buffer:
    """One allocation: a weight (by name), a layer's KV cache, the activations or the workspace.

    ``offset`` is its place in its device's arena (GPU buffers only; -1 on the CPU).
    """

    name: str
    kind: str  # "weight" | "constant" | "kv-cache" | "activations" | "workspace"
    device: str  # "gpu" | "cpu"
    nbytes: int
    offset: int = -1
    layer: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The buffers of a placed module for ``ctx`` positions and prefill chunks of ``ubatch``."""

    ctx: int
    ubatch: int
    budget: int
    buffers: tuple[Buffer, ...]
    activation_offsets: dict[str, int]  # GPU value -> offset in the activation arena
    notes: tuple[str, ...] = ()

    @property
    def gpu_bytes(self) -> int:
        """The GPU arena: every GPU buffer at its aligned offset."""
        return max((b.offset + aligned(b.nbytes) for b in self.buffers if b.device == "gpu"), default=0)

    @property
    def cpu_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.device == "cpu")

    def device_bytes(self, device: str, kind: str | None = None, layer: int | None = None) -> int:
        """Bytes (aligned on the GPU) of the buffers on ``device``, optionally of one kind / layer."""
        return sum(aligned(b.nbytes) if device == "gpu" else b.nbytes for b in self.buffers
                   if b.device == device and (kind is None or b.kind == kind)
                   and (layer is None or b.layer == layer))

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "ctx": self.ctx, "ubatch": self.ubatch, "budget": self.budget,
                "gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes, "notes": list(self.notes),
                "buffers": [asdict(b) for b in self.buffers],
                "activation_offsets": self.activation_offsets}

    @staticmethod
    def from_json(data: dict) -> MemoryPlan:
        return MemoryPlan(int(data["ctx"]), int(data["ubatch"]), int(data["budget"]),
                          tuple(Buffer(**b) for b in data["buffers"]),
                          {k: int(v) for k, v in data["activation_offsets"].items()},
                          tuple(data.get("notes", ())))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def activation_arena(func: Function, on_gpu: Callable[[Op], bool], ubatch: int) -> tuple[dict[str, int], int]:
    """Offsets in one arena of every value the GPU holds, reusing dead values' space (first fit).

    The GPU holds what its ops compute and what they read from the CPU (the input uploaded
    before the first GPU op that reads it: token ids, positions, a CPU layer's output). A value
    is live from then to its last reader (the returned value to the end).
    """
    types = func.value_types()
    last_use: dict[str, int] = {}
    for i, op in enumerate(func.ops):
        for v in op.values():
            last_use[v] = i
    last_use[func.ret] = len(func.ops)
    live: list[tuple[int, int, str]] = []  # (offset, size, value), sorted by offset
    offsets: dict[str, int] = {}
    size = 0

    def place(value: str) -> None:
        nonlocal live, size
        need = aligned(tensor_bytes(types[value], ubatch))
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
        if not on_gpu(op):
            continue
        for v in op.values():
            if v not in offsets:
                place(v)  # an upload from the CPU
        place(op.result)
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
    layers = sorted({i for op in func.ops if (i := layer_of(op.result)) is not None})
    cpu_dense = [i for i in layers if any(layer_of(op.result) == i and not isinstance(op, O.FFN) and on_cpu(op)
                                          for op in func.ops)]
    if cpu_dense:
        notes.append(f"layers {cpu_dense[0]}..{cpu_dense[-1]}: attention and norms on the CPU (the budget "
                     f"holds the dense parts of {len(layers) - len(cpu_dense)} of {len(layers)} layers)")
    if on_cpu(func.ops[-1]):
        notes.append("the output norm and LM head are on the CPU")
    return tuple(notes)


def plan_memory(module: Module, weights: WeightStore, *, ctx: int, ubatch: int, budget: int) -> MemoryPlan:
    """The exact buffers of a placed module (see the module docstring)."""
    func = module.function()
    decls = module.weight_types()
    types = func.value_types()
    buffers: list[Buffer] = []
    gpu_at = 0

    def add(name: str, kind: str, gpu: bool, nbytes: int, layer: int | None) -> None:
        nonlocal gpu_at
        if gpu:
            buffers.append(Buffer(name, kind, "gpu", nbytes, gpu_at, layer))
            gpu_at += aligned(nbytes)
        else:
            buffers.append(Buffer(name, kind, "cpu", nbytes, -1, layer))

    readers: dict[str, str] = {}
    for op in func.ops:
        for w in op.weights():
            readers.setdefault(w, op.result)
    for decl in module.weights:
        layer = layer_of(readers.get(decl.name, ""))
        add(decl.name, "weight", _is_gpu(decl.type), int(weights[decl.name].data.nbytes), layer)
    gpu_ops = [op for op in func.ops if _is_gpu(op.type)]
    for op in gpu_ops:
        if isinstance(op, O.Rope):  # its kernel reads the rotary frequencies (f32, rotary_dim / 2)
            add(f"rope.{op.result}", "constant", True, 4 * (op.rotated // 2), layer_of(op.result))
    for op in func.ops:
        if isinstance(op, O.Attention):
            width = types[op.k].shape[1]
            assert isinstance(width, int)
            add(f"kv.{op.cache}", "kv-cache", _is_gpu(op.type), kv_cache_bytes(op, width, ctx), layer_of(op.result))
    offsets: dict[str, int] = {}
    if gpu_ops:
        offsets, arena = activation_arena(func, lambda op: _is_gpu(op.type), ubatch)
        add("activations", "activations", True, arena, None)
        add("workspace", "workspace", True, max(workspace_bytes(op, ubatch, ctx, decls) for op in gpu_ops), None)
    return MemoryPlan(ctx, ubatch, budget, tuple(buffers), offsets, placement_notes(func))
