"""Lowering a placed module to one decode-step program of CPU kernels.

Every op of the IR becomes one kernel call (a few become two, see below) in a single
:class:`~picc.codegen_cpu.program.Program`, ``picc_decode_step(bufs, tid, nthreads)``: the
runtime's threads call it once per token. Memory is named by index into ``bufs``:

* ``bufs[0]`` the barrier state, ``bufs[1]`` the per-token parameters (i32: ``pos``, ``token``,
  and the greedy token the step writes), ``bufs[2]`` a vector of zeros;
* then each weight the kernels read, by name (the .pib's tensors; vectors that kernels read as
  f32 -- norms, biases, rotary frequencies -- are stored as extra f32 tensors ``cpu.f32.<name>``);
* then the activations (one buffer; each value at a 64-byte aligned offset), the KV caches, the
  kernels' shared scratch, and each predictor's active list.

The program is for one token at a time (decode; the runtime feeds a prompt token by token), so
the sparse FFN kernels see exactly the active sets the interpreter computes. A ``sparse_ffn``
accumulates into its output, so that output is first set to zero. The program ends with an
argmax of the logits into ``params[2]`` for greedy decoding. A second program,
``picc_prefill_step``, stops before the output norm and LM head: prompt tokens whose logits are
not read skip a large share of the bytes a step reads.

Placement is not a restriction here: the CPU executor runs every op, whatever device the plan
gives it, until a GPU executor takes those (so a .pib compiled for pc-low still runs on a CPU).
Layers split between devices in predictor mode are the exception: their parts would need the
predictor's list cut in two, which the GPU executor does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from picc.codegen_cpu import kernels_attention, kernels_dense, kernels_ffn, kernels_misc
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Buf, Null, Param, Program
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import DType, TensorType
from picc.ir.weights import Tensor, WeightStore
from picc.memory_plan import layer_of

STEP = "picc_decode_step"
PREFILL_STEP = "picc_prefill_step"  # the same without the final norm, LM head and argmax
SYNC, PARAMS, ZEROS = 0, 1, 2
PARAM_SLOTS = {"pos": 0, "token": 1, "greedy": 2}
MAX_THREADS = 64  # the scratch is sized for this many threads
_KERNEL_DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class CpuProgram:
    """A lowered module: the program, the buffers behind ``bufs`` and the extra f32 tensors."""

    program: Program
    buffers: list[dict] = field(default_factory=list)  # {"kind": "sync"|"params"|"zeros"|"weight"|"alloc", ...}
    extra: dict[str, Tensor] = field(default_factory=dict)
    logits: dict = field(default_factory=dict)  # {"buffer", "offset", "n"}
    prefill: Program | None = None  # the step without the output head, for prompt tokens

    @property
    def programs(self) -> list[Program]:
        return [self.program] + ([self.prefill] if self.prefill else [])

    def manifest(self, simd: str) -> dict:
        """What the runtime needs besides the code: the steps' symbols, buffers and outputs."""
        return {"step": STEP, "prefill_step": PREFILL_STEP if self.prefill else None, "simd": simd,
                "max_threads": MAX_THREADS, "params": PARAM_SLOTS, "buffers": self.buffers, "logits": self.logits}


class _Lowering:
    def __init__(self, module: Module, weights: WeightStore) -> None:
        self.module, self.weights = module, weights
        self.func = module.function()
        self.types = self.func.value_types()
        self.out = CpuProgram(Program(STEP, sync=SYNC))
        hidden = max((int(t.shape[-1]) for t in self.types.values() if t.shape and isinstance(t.shape[-1], int)),
                     default=1)
        self.out.buffers += [{"kind": "sync", "nbytes": SYNC_BYTES}, {"kind": "params", "nbytes": 64},
                             {"kind": "zeros", "nbytes": 4 * hidden}]
        self.weight_index: dict[str, int] = {}
        self.values: dict[str, Buf] = {}  # value -> where it lives
        self.lists: dict[str, tuple[Buf, Buf]] = {}  # predictor mask -> (idx, count)
        self.arena = 0  # bytes of the activation buffer so far
        self.scratch = 0
        self.act_index = self._alloc_slot("activations")
        self.scratch_index = self._alloc_slot("scratch")

    # --- buffers ---------------------------------------------------------------------------------

    def _alloc_slot(self, name: str, nbytes: int = 0) -> int:
        self.out.buffers.append({"kind": "alloc", "name": name, "nbytes": nbytes})
        return len(self.out.buffers) - 1

    def weight(self, name: str | None, *, as_f32: bool = False) -> Buf | Null:
        """A weight's buffer; ``as_f32`` stores vectors the kernels read as f32 in f32."""
        if name is None:
            return Null()
        t = self.weights[name]
        if as_f32 and t.dtype != DType.F32:
            converted = f"cpu.f32.{name}"
            if converted not in self.out.extra:
                self.out.extra[converted] = Tensor.from_f32(t.to_f32())
            name = converted
        elif not as_f32 and t.dtype.value not in _KERNEL_DTYPES:
            raise PiccError(f"codegen_cpu: weight @{name} is {t.dtype.value}; the CPU kernels read "
                            f"{', '.join(_KERNEL_DTYPES)}")
        if name not in self.weight_index:
            self.out.buffers.append({"kind": "weight", "name": name})
            self.weight_index[name] = len(self.out.buffers) - 1
        return Buf(self.weight_index[name])

    def array(self, name: str, values: np.ndarray) -> Buf:
        """A constant f32 vector (rotary frequencies) stored as an extra tensor."""
        if name not in self.out.extra:
            self.out.extra[name] = Tensor.from_f32(values)
        if name not in self.weight_index:
            self.out.buffers.append({"kind": "weight", "name": name})
            self.weight_index[name] = len(self.out.buffers) - 1
        return Buf(self.weight_index[name])

    def activation(self, value: str, nbytes: int | None = None) -> Buf:
        if value not in self.values:
            size = nbytes if nbytes is not None else _bytes_one_token(self.types[value])
            self.values[value] = Buf(self.act_index, self.arena)
            self.arena += _aligned(size)
        return self.values[value]

    def own(self, nbytes: int, name: str) -> Buf:
        return Buf(self._alloc_slot(name, nbytes))

    # --- ops ---------------------------------------------------------------------------------------

    def call(self, kernel: Kernel, *args: object) -> None:
        self.out.program.call(kernel, *args)  # type: ignore[arg-type]

    def width(self, value: str) -> int:
        d = self.types[value].shape[-1]
        assert isinstance(d, int)
        return d

    def lower(self, op: Op) -> None:  # noqa: C901 - one case per op
        match op:
            case O.Embed():
                table = self.weights[op.table]
                self.call(kernels_dense.embed(table.dtype.value), self.weight(op.table),
                          Buf(PARAMS, 4 * PARAM_SLOTS["token"]), self.activation(op.result), 1, self.width(op.result))
            case O.RMSNorm():
                self.call(kernels_misc.rms_norm(), self.values[op.x], self.weight(op.weight, as_f32=True), Null(),
                          self.activation(op.result), 1, self.width(op.x), float(op.eps))
            case O.LayerNorm():
                self.call(kernels_misc.layer_norm(), self.values[op.x], self.weight(op.weight, as_f32=True),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), 1, self.width(op.x),
                          float(op.eps))
            case O.Linear():
                w = self.weights[op.weight]
                self.call(kernels_dense.gemv(w.dtype.value), self.weight(op.weight), self.values[op.x],
                          self.weight(op.bias, as_f32=True), self.activation(op.result), int(w.shape[0]),
                          int(w.shape[1]), 0)
            case O.Rope():
                # In place: the rotated value takes its input's buffer (the input has no other reader).
                if self.uses.get(op.x, 0) != 1:
                    raise PiccError(f"codegen_cpu: %{op.x} is read by more than the rope op; cannot rotate in place")
                self.values[op.result] = self.values[op.x]
                freq = self.array(f"cpu.rope.{op.result}", op.inv_freq())
                self.call(kernels_misc.rope(op.style), self.values[op.result], freq, 1,
                          Param(PARAMS, PARAM_SLOTS["pos"]), op.n_heads, op.head_dim, op.rotated)
            case O.Attention():
                if op.alibi != "none":
                    raise PiccError(f"codegen_cpu: %{op.result}: ALiBi attention has no CPU kernel yet")
                kv = self.width(op.k)
                caches = self.own(2 * self.ctx * kv * 4, f"kv.{op.cache}")
                self.call(kernels_attention.attention(), self.values[op.q], self.values[op.k], self.values[op.v],
                          caches, Buf(caches.index, self.ctx * kv * 4), self.activation(op.result), 1,
                          Param(PARAMS, PARAM_SLOTS["pos"]), op.n_heads, op.n_kv_heads, op.head_dim,
                          float(op.scale), op.window or 0)
            case O.Add() | O.Mul():
                kernel = kernels_misc.add() if isinstance(op, O.Add) else kernels_misc.mul()
                self.call(kernel, self.values[op.a], self.values[op.b], self.activation(op.result),
                          self.width(op.result))
            case Predict():
                fc1, fc2 = self.weights[op.fc1], self.weights[op.fc2]
                rank, hidden = int(fc1.shape[0]), int(fc1.shape[1])
                n = int(fc2.shape[0])
                lists = (self.own(4 * n, f"idx.{op.result}"), self.own(64, f"count.{op.result}"))
                self.lists[op.result] = lists
                self.scratch = max(self.scratch, kernels_ffn.predictor_scratch_bytes(rank, n, MAX_THREADS))
                self.call(kernels_ffn.predictor(fc1.dtype.value, fc2.dtype.value), self.values[op.x],
                          self.weight(op.fc1), self.weight(op.fc1_bias, as_f32=True), self.weight(op.fc2),
                          self.weight(op.fc2_bias, as_f32=True), *lists, Buf(self.scratch_index), hidden, rank, n,
                          float(op.threshold))
            case O.FFN():
                self.ffn(op)
            case _:
                raise PiccError(f"codegen_cpu: op {op.NAME} (%{op.result}) has no CPU kernel yet")

    def dense_ffn(self, op: O.FFN) -> None:
        """A dense FFN in the model's own layout: GEMVs for up and gate, the activation, a GEMV for
        down (the numbers of the source model, where a neuron-major down would be requantized)."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        h_up = self.activation(f"{op.result}.up", 4 * n)
        self.call(kernels_dense.gemv(up.dtype.value), self.weight(op.up), self.values[op.x],
                  self.weight(op.up_bias, as_f32=True), h_up, n, hidden, 0)
        h_gate: Buf | Null = Null()
        if op.gate is not None:
            gate = self.weights[op.gate]
            h_gate = self.activation(f"{op.result}.gate", 4 * n)
            self.call(kernels_dense.gemv(gate.dtype.value), self.weight(op.gate), self.values[op.x],
                      self.weight(op.gate_bias, as_f32=True), h_gate, n, hidden, 0)
        h = self.activation(f"{op.result}.h", 4 * n)
        self.call(kernels_misc.ffn_activation(op.form), h_gate if op.gate else h_up, h_up, h, n)
        down = self.weights[op.down]
        self.call(kernels_dense.gemv(down.dtype.value), self.weight(op.down), h, self.weight(op.down_bias, as_f32=True),
                  self.activation(op.result), hidden, n, 0)

    def ffn(self, op: O.FFN) -> None:
        if not op.neuron_major:
            if isinstance(op, SparseFFN):
                raise PiccError(f"codegen_cpu: %{op.result} needs its down projection neuron-major "
                                "(the neuron-major-down pass)")
            self.dense_ffn(op)
            return
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        mode = op.mode if isinstance(op, SparseFFN) else "dense"
        idx: Buf | Null = Null()
        count: Buf | Null = Null()
        threshold = 0.0
        if mode == "predictor":
            assert isinstance(op, SparseFFN) and op.mask is not None
            if op.part_of is not None:
                raise PiccError(f"codegen_cpu: %{op.result} is part of a layer split between devices in "
                                "predictor mode; that needs the GPU executor")
            idx, count = self.lists[op.mask]
        elif mode == "gate-first":
            threshold = float(op.threshold or 0.0)
        elif mode == "down-only":
            threshold = float(op.down_threshold or 0.0)
        if mode != "predictor":  # the kernel lists the active neurons it finds here
            idx = self.own(4 * n, f"idx.{op.result}")
        kernel = kernels_ffn.sparse_ffn(mode, op.form, up.dtype.value,
                                        self.weights[op.gate].dtype.value if op.gate else None,
                                        self.weights[op.down].dtype.value)
        y = self.activation(op.result)
        self.call(kernels_misc.add(), Buf(ZEROS), Buf(ZEROS), y, hidden)  # the kernel accumulates into y
        self.scratch = max(self.scratch, kernels_ffn.ffn_scratch_bytes(n, hidden, MAX_THREADS))
        self.call(kernel, self.values[op.x], self.weight(op.up), self.weight(op.gate), self.weight(op.down),
                  self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True),
                  self.weight(op.down_bias, as_f32=True), y, idx, count, Buf(self.scratch_index), n, hidden,
                  threshold)

    def run(self, ctx: int) -> CpuProgram:
        self.ctx = ctx
        self.uses = self.func.uses()
        for arg in self.func.args:
            if arg.name == "tokens":
                continue  # read from params by the embedding
            if arg.name != "pos":
                raise PiccError(f"codegen_cpu: function argument %{arg.name} is not supported")
        last_layer = max((i for i, op in enumerate(self.func.ops) if layer_of(op.result) is not None),
                         default=len(self.func.ops) - 1)
        head = None
        for i, op in enumerate(self.func.ops):
            if i == last_layer + 1:
                head = len(self.out.program.calls)
            self.lower(op)
        if head is not None:
            # A prompt token's logits are never read: its step can stop before the output head.
            self.out.prefill = Program(PREFILL_STEP, sync=SYNC)
            self.out.prefill.calls = self.out.program.calls[:head]
        ret = self.values[self.func.ret]
        vocab = self.width(self.func.ret)
        self.call(kernels_misc.argmax(), ret, Buf(PARAMS, 4 * PARAM_SLOTS["greedy"]), vocab)
        self.out.buffers[self.act_index]["nbytes"] = self.arena
        self.out.buffers[self.scratch_index]["nbytes"] = self.scratch
        self.out.logits = {"buffer": ret.index, "offset": ret.offset, "n": vocab}
        return self.out


def _bytes_one_token(t: TensorType) -> int:
    size = 4 if t.dtype in (DType.F32, DType.I32) else 1
    for d in t.shape:
        size *= d if isinstance(d, int) else 1
    return size


def lower_module(module: Module, weights: WeightStore, ctx: int) -> CpuProgram:
    """The decode-step program of ``module`` with KV caches for ``ctx`` positions."""
    return _Lowering(module, weights).run(ctx)
