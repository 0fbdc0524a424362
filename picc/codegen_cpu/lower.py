"""Lowering the CPU ops of a fused, placed module to step programs of CPU kernels.

The hybrid step (``picc.schedule``) is a sequence of stages; the CPU's ops of each stage become
one :class:`~picc.codegen_cpu.program.Program`, ``picc_stage_<i>(bufs, tid, nthreads)``, that the
runtime's threads call once per token (a module that runs on the CPU alone is one stage: one call
per token). A stage that holds ops of the head (the output norm and LM head) also gets
``picc_stage_<i>_prefill`` without them: prompt tokens whose logits are not read skip a large
share of the bytes a step reads. When the logits are computed on the CPU, the step ends with their
argmax, the greedy token.

Every op names its kernel (``fuse-gather-gemv``); the lowering checks that the kernel it calls is
that one. Memory is named by index into ``bufs``:

* ``bufs[0]`` the barrier state, ``bufs[1]`` the per-token parameters (i32: ``pos``, ``token``,
  and the greedy token the step writes), ``bufs[2]`` a vector of zeros;
* then each weight the kernels read, by name (the .pib's tensors; vectors that kernels read as
  f32 -- norms, biases, rotary frequencies -- are stored as extra f32 tensors ``cpu.f32.<name>``);
* then the activations (one buffer; each value at a 64-byte aligned offset, including the values
  that arrive from the GPU), the KV caches, and the kernels' shared scratch.

Steps are for one token at a time (decode; the runtime feeds a prompt token by token), so the
sparse FFN kernels see exactly the active sets the interpreter computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from picc.codegen_cpu import kernels_attention, kernels_dense, kernels_ffn, kernels_misc
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Buf, Call, Null, Param, Program
from picc.codegen_cpu.rowops import row_bytes
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict
from picc.ir.types import DType, TensorType
from picc.ir.weights import Tensor, WeightStore
from picc.schedule import Schedule, crossing_values

SYNC, PARAMS, ZEROS = 0, 1, 2
PARAM_SLOTS = {"pos": 0, "token": 1, "greedy": 2}
MAX_THREADS = 64  # the scratch is sized for this many threads
_KERNEL_DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# Ops whose kernels have one phase and touch no memory but their operands and result: one may
# start while another is still running on other threads when neither reads or writes what the
# other writes (the q, k and v projections of a layer; the rope of q and of k).
_BARRIER_FREE = (O.Linear, O.Rope, O.Add, O.RMSNorm, O.LayerNorm, O.Embed)


@dataclass(frozen=True, slots=True)
class _Access:
    """What a call reads and writes (value names), and whether it may run without a barrier
    before it (a single-phase kernel of :data:`_BARRIER_FREE`)."""

    reads: frozenset[str]
    writes: frozenset[str]
    barrier_free: bool


def place_barriers(calls: list[Call], access: list[_Access]) -> list[Call]:
    """``calls`` with a barrier after a call only where the next one needs it: when the next
    reads or writes a value written since the last barrier, writes one read since, or is not
    barrier-free (a kernel with phases of its own starts with every thread there)."""
    out: list[Call] = []
    reads: set[str] = set()
    writes: set[str] = set()
    for call, acc in zip(calls, access, strict=True):
        if out:
            need = not acc.barrier_free or bool(acc.reads & writes or acc.writes & (reads | writes))
            out[-1] = replace(out[-1], barrier_after=need)
            if need:
                reads, writes = set(), set()
        reads |= acc.reads
        writes |= acc.writes
        out.append(replace(call, barrier_after=True))
    return out


def stage_symbol(stage: int, prefill: bool = False) -> str:
    return f"picc_stage_{stage}" + ("_prefill" if prefill else "")


@dataclass
class CpuProgram:
    """A lowered module: the stage programs, the buffers behind ``bufs``, the extra f32 tensors,
    and where the values that cross devices (and the logits) live on the host."""

    programs: list[Program] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # per stage: {"step": symbol | None, "prefill": ...}
    buffers: list[dict] = field(default_factory=list)  # {"kind": "sync"|"params"|"zeros"|"weight"|"alloc", ...}
    extra: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, dict] = field(default_factory=dict)  # value -> {"buffer", "offset", "nbytes"}
    logits: dict = field(default_factory=dict)  # {"buffer", "offset", "n"}
    greedy: bool = False  # the CPU step writes the greedy token to params

    def manifest(self, simd: str) -> dict:
        """What the runtime needs besides the code."""
        return {"simd": simd, "max_threads": MAX_THREADS, "params": PARAM_SLOTS, "buffers": self.buffers,
                "stages": self.stages, "values": self.values, "logits": self.logits, "greedy": self.greedy}


class _Lowering:
    def __init__(self, module: Module, weights: WeightStore, sched: Schedule, ctx: int) -> None:
        self.module, self.weights, self.sched, self.ctx = module, weights, sched, ctx
        self.func = module.function()
        self.types = self.func.value_types()
        self.uses = self.func.uses()
        self.out = CpuProgram()
        hidden = max((int(t.shape[-1]) for t in self.types.values() if t.shape and isinstance(t.shape[-1], int)),
                     default=1)
        self.out.buffers += [{"kind": "sync", "nbytes": SYNC_BYTES}, {"kind": "params", "nbytes": 64},
                             {"kind": "zeros", "nbytes": 4 * hidden}]
        self.weight_index: dict[str, int] = {}
        self.values: dict[str, Buf] = {}  # value -> where it lives
        self.arena = 0  # bytes of the activation buffer so far
        self.scratch = 0
        self.act_index = self._alloc_slot("activations")
        self.scratch_index = self._alloc_slot("scratch")
        self.program = Program("")
        self.access: list[_Access] = []  # per call of self.program

    # --- buffers ---------------------------------------------------------------------------------

    def _alloc_slot(self, name: str, nbytes: int = 0) -> int:
        self.out.buffers.append({"kind": "alloc", "name": name, "nbytes": nbytes})
        return len(self.out.buffers) - 1

    def weight(self, name: str | None, *, as_f32: bool = False, offset: int = 0) -> Buf | Null:
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
        return Buf(self.weight_index[name], offset)

    def array(self, name: str, values: np.ndarray) -> Buf:
        """A constant f32 vector (rotary frequencies) stored as an extra tensor."""
        if name not in self.out.extra:
            self.out.extra[name] = Tensor.from_f32(values)
        if name not in self.weight_index:
            self.out.buffers.append({"kind": "weight", "name": name})
            self.weight_index[name] = len(self.out.buffers) - 1
        return Buf(self.weight_index[name])

    def activation(self, value: str) -> Buf:
        if value not in self.values:
            self.values[value] = Buf(self.act_index, self.arena)
            self.arena += _aligned(_bytes_one_token(self.types[value]))
        return self.values[value]

    def value(self, name: str) -> Buf:
        if name not in self.values:
            raise PiccError(f"codegen_cpu: %{name} is read before the CPU has it")
        return self.values[name]

    def own(self, nbytes: int, name: str) -> Buf:
        return Buf(self._alloc_slot(name, nbytes))

    # --- ops ---------------------------------------------------------------------------------------

    def call(self, op: Op, kernel: Kernel, *args: object, check: bool = True) -> None:
        if check and op.kernel != kernel.symbol:
            raise PiccError(f"codegen_cpu: %{op.result} names kernel {op.kernel!r} but the CPU computes it with "
                            f"{kernel.symbol!r}" + ("; run fuse-gather-gemv first" if op.kernel is None else ""))
        self.program.call(kernel, *args)  # type: ignore[arg-type]
        writes = {op.result, op.x} if isinstance(op, O.Rope) else {op.result}  # rope rotates in place
        self.access.append(_Access(frozenset(op.values()), frozenset(writes), isinstance(op, _BARRIER_FREE)))

    def width(self, value: str) -> int:
        d = self.types[value].shape[-1]
        assert isinstance(d, int)
        return d

    def lower(self, op: Op) -> None:  # noqa: C901 - one case per op
        pos = Param(PARAMS, PARAM_SLOTS["pos"])
        match op:
            case O.Embed():
                table = self.weights[op.table]
                self.call(op, kernels_dense.embed(table.dtype.value), self.weight(op.table),
                          Buf(PARAMS, 4 * PARAM_SLOTS["token"]), self.activation(op.result), 1, self.width(op.result))
            case O.RMSNorm():
                self.call(op, kernels_misc.rms_norm(), self.value(op.x), self.weight(op.weight, as_f32=True), Null(),
                          self.activation(op.result), 1, self.width(op.x), float(op.eps))
            case O.LayerNorm():
                self.call(op, kernels_misc.layer_norm(), self.value(op.x), self.weight(op.weight, as_f32=True),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), 1, self.width(op.x),
                          float(op.eps))
            case O.Linear():
                w = self.weights[op.weight]
                self.call(op, kernels_dense.gemv(w.dtype.value), self.weight(op.weight), self.value(op.x),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), int(w.shape[0]),
                          int(w.shape[1]), 0)
            case O.Rope():
                # In place: the rotated value takes its input's buffer (the input has no other reader).
                if self.uses.get(op.x, 0) != 1:
                    raise PiccError(f"codegen_cpu: %{op.x} is read by more than the rope op; cannot rotate in place")
                self.values[op.result] = self.value(op.x)
                freq = self.array(f"cpu.rope.{op.result}", op.inv_freq())
                self.call(op, kernels_misc.rope(op.style), self.values[op.result], freq, 1, pos, op.n_heads,
                          op.head_dim, op.rotated)
            case O.Attention():
                kv = self.width(op.k)
                caches = self.own(2 * self.ctx * kv * 4, f"kv.{op.cache}")
                self.call(op, kernels_attention.attention(), self.value(op.q), self.value(op.k), self.value(op.v),
                          caches, Buf(caches.index, self.ctx * kv * 4), self.activation(op.result), 1, pos,
                          op.n_heads, op.n_kv_heads, op.head_dim, float(op.scale), op.window or 0)
            case O.Add():
                self.call(op, kernels_misc.add(), self.value(op.a), self.value(op.b), self.activation(op.result),
                          self.width(op.result))
            case Merge():
                self.call(op, kernels_misc.merge(), self.value(op.a), self.value(op.b),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), self.width(op.result))
            case Predict():
                fc1, fc2 = self.weights[op.fc1], self.weights[op.fc2]
                rank, hidden = int(fc1.shape[0]), int(fc1.shape[1])
                self.scratch = max(self.scratch, kernels_ffn.predictor_scratch_bytes(rank))
                self.call(op, kernels_ffn.predictor(fc1.dtype.value, fc2.dtype.value), self.value(op.x),
                          self.weight(op.fc1), self.weight(op.fc1_bias, as_f32=True), self.weight(op.fc2),
                          self.weight(op.fc2_bias, as_f32=True), self.activation(op.result),
                          Buf(self.scratch_index), hidden, rank, int(fc2.shape[0]), float(op.threshold))
            case FusedFFN():
                self.fused_ffn(op)
            case O.FFN() if not op.neuron_major and type(op) is O.FFN:
                self.dense_ffn(op)
            case _:
                raise PiccError(f"codegen_cpu: op {op.NAME} (%{op.result}) has no CPU kernel")

    def dense_ffn(self, op: O.FFN) -> None:
        """A dense FFN in the model's own layout (the numbers of the source model, where a
        neuron-major down would be requantized): two GEMV phases in one kernel."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        gate = self.weights[op.gate].dtype.value if op.gate else None
        kernel = kernels_dense.dense_ffn(op.form, up.dtype.value, gate, self.weights[op.down].dtype.value)
        self.scratch = max(self.scratch, kernels_dense.dense_ffn_scratch_bytes(n))
        self.call(op, kernel, self.value(op.x), self.weight(op.up), self.weight(op.gate), self.weight(op.down),
                  self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True),
                  self.weight(op.down_bias, as_f32=True), self.activation(op.result), Buf(self.scratch_index), n,
                  hidden)

    def fused_ffn(self, op: FusedFFN) -> None:
        down = self.weights[op.down]
        n, hidden = int(down.shape[0]), int(down.shape[1])
        if op.up_gate is not None:
            # Interleaved rows: the gate of neuron i starts one row after its up row.
            dtype = self.weights[op.up_gate].dtype.value
            up, gate = self.weight(op.up_gate), self.weight(op.up_gate, offset=row_bytes(dtype, hidden))
            up_bias, gate_bias = (self.weight(op.up_gate_bias, as_f32=True),
                                  self.weight(op.up_gate_bias, as_f32=True, offset=4) if op.up_gate_bias else Null())
            up_dtype, gate_dtype = dtype, dtype
        else:
            assert op.up is not None
            up, gate = self.weight(op.up), self.weight(op.gate)
            up_bias, gate_bias = self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True)
            up_dtype = self.weights[op.up].dtype.value
            gate_dtype = self.weights[op.gate].dtype.value if op.gate else None
        mask: Buf | Null = Null()
        if op.mode == "predictor":
            assert op.mask is not None
            m = self.value(op.mask)
            mask = Buf(m.index, m.offset + op.neuron_offset)  # one byte per neuron of the layer
        kernel = kernels_ffn.sparse_ffn(op.mode, op.form, up_dtype, gate_dtype, down.dtype.value, op.interleaved)
        self.scratch = max(self.scratch, kernels_ffn.ffn_scratch_bytes(n, hidden, MAX_THREADS))
        self.call(op, kernel, self.value(op.x), up, gate, self.weight(op.down), up_bias, gate_bias,
                  self.weight(op.down_bias, as_f32=True), self.activation(op.result), mask, Null(),
                  Buf(self.scratch_index), n, hidden, float(op.threshold))

    # --- stages ------------------------------------------------------------------------------------

    def run(self) -> CpuProgram:
        for arg in self.func.args:
            if arg.name not in ("tokens", "pos"):
                raise PiccError(f"codegen_cpu: function argument %{arg.name} is not supported")
        for v in sorted(crossing_values(self.sched)):  # the host side of every copy
            self.activation(v)
        ops = {op.result: op for op in self.func.ops}
        head = set(self.sched.head)
        logits_here = self.sched.logits_device == "cpu"
        for i, stage in enumerate(self.sched.stages):
            if not stage.cpu:
                self.out.stages.append({"step": None, "prefill": None})
                continue
            self.program = Program(stage_symbol(i), sync=SYNC)
            self.access = []
            calls_of: dict[str, slice] = {}
            for name in stage.cpu:
                start = len(self.program.calls)
                self.lower(ops[name])
                calls_of[name] = slice(start, len(self.program.calls))
            full = self.program
            prefill_symbol = None
            if head & set(stage.cpu):
                prefill = Program(stage_symbol(i, prefill=True), sync=SYNC)
                kept = [k for name in stage.cpu if name not in head for k in range(len(full.calls))[calls_of[name]]]
                prefill.calls = place_barriers([full.calls[k] for k in kept], [self.access[k] for k in kept])
                if prefill.calls:
                    self.out.programs.append(prefill)
                    prefill_symbol = prefill.name
            if logits_here and self.func.ret in stage.cpu:
                self.program.call(kernels_misc.argmax(), self.value(self.func.ret),
                                  Buf(PARAMS, 4 * PARAM_SLOTS["greedy"]), self.width(self.func.ret))
                self.access.append(_Access(frozenset({self.func.ret}), frozenset(), False))
                self.out.greedy = True
            full.calls = place_barriers(full.calls, self.access)
            self.out.programs.append(full)
            self.out.stages.append({"step": full.name, "prefill": prefill_symbol if head & set(stage.cpu)
                                    else full.name})
        ret = self.activation(self.func.ret)  # a GPU's logits are copied here
        self.out.buffers[self.act_index]["nbytes"] = self.arena
        self.out.buffers[self.scratch_index]["nbytes"] = self.scratch
        self.out.logits = {"buffer": ret.index, "offset": ret.offset, "n": self.width(self.func.ret)}
        for v in sorted(crossing_values(self.sched)):
            b = self.values[v]
            self.out.values[v] = {"buffer": b.index, "offset": b.offset, "nbytes": _bytes_one_token(self.types[v])}
        return self.out


def _bytes_one_token(t: TensorType) -> int:
    size = 4 if t.dtype in (DType.F32, DType.I32) else 1
    for d in t.shape:
        size *= d if isinstance(d, int) else 1
    return size


def lower_module(module: Module, weights: WeightStore, sched: Schedule, ctx: int) -> CpuProgram:
    """The CPU step programs of ``module`` (scheduled by ``sched``) with KV caches for ``ctx`` positions."""
    return _Lowering(module, weights, sched, ctx).run()
