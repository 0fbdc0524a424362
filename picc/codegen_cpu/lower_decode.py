"""The decode step: the CPU's ops of each stage of the schedule as one program for one token.

The hybrid step (``picc.placement.schedule``) is a sequence of stages; the CPU's ops of each stage become
one :class:`~picc.codegen_cpu.program.Program`, ``picc_stage_<i>(bufs, tid, nthreads)``, that the
runtime's threads call once per token (a module that runs on the CPU alone is one stage: one call
per token). A stage that holds ops of the head (the output norm and LM head) also gets
``picc_stage_<i>_prefill`` without them: prompt tokens whose logits are not read skip a large
share of the bytes a step reads. When the logits are computed on the CPU, the step ends with their
argmax, the greedy token. ``picc_stage_<i>_profile`` is the step with a clock around each call
(:meth:`~picc.codegen_cpu.program.Program.profiled`; the manifest's ``profile`` of the stage names
its calls' kernels and IR values), for ``picc bench --profile``. A model that runs on the CPU
alone also gets ``picc_decode``, greedy decode steps in a loop that stays in generated code
(:meth:`DecodeLowering.decode_loop`).

Linears are GEMVs, and an add of a residual and a linear's or FFN's result is done by that op's
kernel where it can (:meth:`DecodeLowering._residual_adds`). The step's values live in one buffer
(``bufs[ACTIVATIONS]``), each at its own 64-byte aligned offset, including the values that arrive
from the GPU.
"""

from __future__ import annotations

from picc.codegen_cpu import kernels_dense, kernels_ffn, kernels_misc
from picc.codegen_cpu.buffers import ACTIVATIONS, MAX_THREADS, PARAM_SLOTS, PARAMS, SYNC, CpuBuffers
from picc.codegen_cpu.chunks import aligned, bytes_one_token
from picc.codegen_cpu.lower_ops import OpLowering, _layout, _rows8, _x_format
from picc.codegen_cpu.program import Access, Buf, GreedyLoop, Null, Program, place_barriers, profile_slots
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function
from picc.ir.types import Placement
from picc.ir.weights import WeightStore
from picc.placement.schedule import Schedule, crossing_values
from runtime.contracts import Stage
from runtime.cpu_manifest import STOP_SLOTS, CpuBuffer, CpuStage, DecodeLoop, LogitsRow, ProfiledStep, ValueBytes

DECODE_SYMBOL = "picc_decode"
DECODE_CAPACITY = 256  # greedy tokens per call of the decode loop (its output buffer)


def stage_symbol(stage: int, prefill: bool = False) -> str:
    return f"picc_stage_{stage}" + ("_prefill" if prefill else "")


class DecodeLowering(OpLowering):
    """The step's programs (:meth:`lower_stages`, then :meth:`decode_loop`): ``programs`` in the
    order they are emitted, ``stages`` for the manifest, ``greedy`` when the step writes the
    greedy token to ``params``."""

    def __init__(self, func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers) -> None:
        super().__init__(func, weights, sched, ctx, bufs)
        self.values: dict[str, Buf] = {}  # value -> where it lives
        self.arena = 0  # bytes of the activation buffer so far
        self.programs: list[Program | GreedyLoop] = []
        self.stages: list[CpuStage] = []
        self.greedy = False
        # Producer's result -> (the add that reads it, the residual it is added to).
        self.residual_adds = self._residual_adds()
        self.adds_done_by_producers = {add.result for add, _ in self.residual_adds.values()}

    def _residual_adds(self) -> dict[str, tuple[O.Add, str]]:
        """The adds of the decode step that ``select-kernels`` gave to the kernel of an operand's
        producer (``accumulated_by``): that kernel adds its rows into the residual's buffer and
        the add's result lives there (the verifier checks that producer can)."""
        fused: dict[str, tuple[O.Add, str]] = {}
        for op in self.func.ops:
            if (isinstance(op, O.Add) and (accumulated := op.accumulated) is not None
                    and op.type.placement != Placement.GPU):
                src, res = accumulated
                fused[src] = (op, res)
        return fused

    def output(self, op: Op) -> tuple[Buf, int, set[str]]:
        """Where ``op``'s kernel writes its result, its ``accumulate`` flag and the values it
        writes besides the result: the residual's buffer, 1 and the residual and the add's
        result when ``op`` does a residual add (see :meth:`_residual_adds`)."""
        if op.result in self.residual_adds:
            add_op, res = self.residual_adds[op.result]
            self.alias(add_op.result, res)
            return self.value(res), 1, {res, add_op.result}
        return self.activation(op.result), 0, set()

    # --- where values live: one row each in bufs[ACTIVATIONS] --------------------------------------

    def activation(self, value: str) -> Buf:
        if value not in self.values:
            self.values[value] = Buf(ACTIVATIONS, self.arena)
            self.arena += aligned(bytes_one_token(self.types[value]))
        return self.values[value]

    def alias(self, value: str, of: str) -> Buf:
        self.values[value] = self.value(of)
        return self.values[value]

    def value(self, name: str) -> Buf:
        if name not in self.values:
            raise PiccError(f"codegen_cpu: %{name} is read before the CPU has it")
        return self.values[name]

    def rows(self) -> int:
        return 1

    def tokens(self) -> Buf:
        return Buf(PARAMS, 4 * PARAM_SLOTS["token"])

    def per_token(self) -> None:
        return None

    def memory_key(self, value: str) -> str:
        return value

    # --- ops ---------------------------------------------------------------------------------------

    def linear(self, op: O.Linear) -> None:
        w = self.weights[op.weight]
        y, accumulate, writes = self.output(op)
        self.call(op, kernels_dense.gemv(w.dtype.value, _x_format(op), _rows8(op)),
                  self.weight(op.weight, layout=_layout(op)),
                  self.value(op.x), self.weight(op.bias, as_f32=True), y, int(w.shape[0]), int(w.shape[1]),
                  accumulate, writes=writes)

    def add(self, op: O.Add) -> None:
        if op.result in self.adds_done_by_producers:
            return  # done by the kernel of the op that feeds it (see _residual_adds)
        self.call(op, kernels_misc.add(), self.value(op.a), self.value(op.b), self.activation(op.result),
                  self.width(op.result), batched=True)

    def dense_ffn(self, op: O.FFN) -> None:
        """A dense FFN in the model's own layout (the numbers of the source model, where a
        neuron-major down would be requantized): two GEMV phases in one kernel."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        gate = self.weights[op.gate].dtype.value if op.gate else None
        kernel = kernels_dense.dense_ffn(op.form, up.dtype.value, gate, self.weights[op.down].dtype.value,
                                         _x_format(op), _rows8(op))
        scratch = self.bufs.need_scratch(kernels_dense.dense_ffn_scratch_bytes(n))
        y, accumulate, writes = self.output(op)
        layout = _layout(op)
        self.call(op, kernel, self.value(op.x), self.weight(op.up, layout=layout), self.weight(op.gate, layout=layout),
                  self.weight(op.down, layout=layout),
                  self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True),
                  self.weight(op.down_bias, as_f32=True), y, scratch, n, hidden, accumulate,
                  writes=writes)

    def fused_ffn(self, op: FusedFFN) -> None:
        w = self.fused_operands(op)
        kernel = kernels_ffn.sparse_ffn(op.mode, op.form, w.up_dtype, w.gate_dtype, w.down_dtype, op.interleaved,
                                        _x_format(op), w.dense_rows8, op.gathered_layout)
        scratch = self.bufs.need_scratch(kernels_ffn.ffn_scratch_bytes(w.n, w.hidden, MAX_THREADS))
        y, accumulate, writes = self.output(op)
        self.call(op, kernel, self.value(op.x), w.up, w.gate, w.down_t, w.up_bias, w.gate_bias,
                  self.weight(op.down_bias, as_f32=True), y, w.mask, Null(), scratch, w.n, w.hidden,
                  float(op.threshold), self.weight(op.score_scale, as_f32=True), accumulate, writes=writes)

    # --- programs ----------------------------------------------------------------------------------

    def lower_stages(self) -> None:
        """Each stage's step (with its twin without the head, and its profiled twin)."""
        for v in sorted(crossing_values(self.sched)):  # the host side of every copy
            self.activation(v)
        for i, stage in enumerate(self.sched.stages):
            self.stages.append(self.lower_stage(i, stage) if stage.cpu else CpuStage(None, None))

    def lower_stage(self, i: int, stage: Stage) -> CpuStage:
        head = set(self.sched.head)
        self.begin(stage_symbol(i))
        calls_of: dict[str, slice] = {}
        for name in stage.cpu:
            start = len(self.program.calls)
            self.lower(self.ops[name])
            calls_of[name] = slice(start, len(self.program.calls))
        full = self.program
        prefill_symbol = full.name
        if head & set(stage.cpu):
            prefill = Program(stage_symbol(i, prefill=True), sync=SYNC)
            kept = [k for name in stage.cpu if name not in head for k in range(len(full.calls))[calls_of[name]]]
            prefill.calls = place_barriers([full.calls[k] for k in kept], [self.access[k] for k in kept])
            prefill_symbol = None
            if prefill.calls:
                self.programs.append(prefill)
                prefill_symbol = prefill.name
        if self.sched.logits_device == "cpu" and self.func.ret in stage.cpu:
            full.call(kernels_misc.argmax(), self.value(self.func.ret),
                      Buf(PARAMS, 4 * PARAM_SLOTS["greedy"]), self.width(self.func.ret), label="greedy")
            self.access.append(Access(frozenset({self.func.ret}), frozenset(), False))
            self.greedy = True
        full.calls = place_barriers(full.calls, self.access)
        # The same step with a clock around each call (picc bench --profile); its counters
        # get memory only when the runtime profiles (profile_slots i64 per thread).
        counters = self.bufs.add(CpuBuffer("profile", slots=profile_slots(len(full.calls))))
        profiled = full.profiled(counters)
        self.programs += [full, profiled]
        calls = tuple((c.kernel.symbol, c.label) for c in full.calls)
        return CpuStage(full.name, prefill_symbol, ProfiledStep(profiled.name, counters, calls))

    def decode_loop(self) -> DecodeLoop | None:
        """``picc_decode``: greedy decode steps in a loop in generated code (:class:`GreedyLoop`),
        for a model whose one stage is the CPU's and computes the greedy token. The table entry
        ``step`` (kind ``function``) is the address of the step it runs, set by the runtime: the
        plain step, or its profiled twin."""
        if len(self.stages) != 1 or not self.greedy:
            return None
        step = self.bufs.add(CpuBuffer("function", name="the decode step"))
        out = self.bufs.slot("greedy tokens", 4 * DECODE_CAPACITY)
        self.programs.append(GreedyLoop(DECODE_SYMBOL, step, PARAMS, out, SYNC, tuple(PARAM_SLOTS.items()),
                                        STOP_SLOTS))
        return DecodeLoop(DECODE_SYMBOL, step, out, DECODE_CAPACITY)

    def host_places(self) -> tuple[LogitsRow, dict[str, ValueBytes]]:
        """Where the logits are (a GPU's are copied here) and the values that cross devices;
        the activation buffer's size. Last: every program has placed its values."""
        ret = self.activation(self.func.ret)
        self.bufs.grow(ACTIVATIONS, self.arena)
        values = {}
        for v in sorted(crossing_values(self.sched)):
            b = self.values[v]
            shared = any(w != v and where == b for w, where in self.values.items())
            values[v] = ValueBytes(b.index, b.offset, bytes_one_token(self.types[v]), shared)
        return LogitsRow(ret.index, ret.offset, self.width(self.func.ret)), values
