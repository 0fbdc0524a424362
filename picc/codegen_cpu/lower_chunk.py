"""The chunk programs: the step for up to :data:`PREFILL_CHUNK` prompt tokens at once.

``picc_prefill_chunk`` (:func:`prefill_programs`) is the step without its head (and without the
ops that feed no KV cache) for the tokens at positions ``pos ..`` (ids in their own buffer,
``params[seq]`` their count), for the KV caches they leave behind. ``picc_logits_chunk``
(:func:`logits_programs`) is the whole step, head included, each token's logits left in its row
of the chunk's buffer (every position's logits, for ``picc logits``).

Linears become GEMMs (each weight row read once per chunk) and norms, rope, attention, embedding
and adds take the chunk's rows at once; the fused FFNs take the chunk too (``chunk_ffn``), each
token with its own active set, so that they compute exactly the active sets the interpreter
computes; the predictors (small) and the merges are one-token kernels called once per token
inside the program. Where the step's kernel dots rounded x from the rows8 layout (``_r8_xi16``,
``_r8_xi8``), the chunk calls that kernel's batched twin (``kernels_batch``: the chunk's tokens
as its rows, each token the step's bits, the weights read once; 1.4-2.7x the GEMM on SmolLM2's
shapes); elsewhere the chunk's GEMMs read the same rounded rows the step's kernel dots
(:meth:`ChunkLowering.gemm_input`).

Where every matrix op is such a twin (no GEMM, no chunk FFN), the programs compute each token's
step bits at any chunk boundaries, and the manifest says so (``CpuChunkProgram.step_bits``): a
server then takes the KV rows a reply's steps wrote for a later prompt (``runtime.sequences``).

In a hybrid step each is one program per stage (``picc_prefill_chunk_<i>``), and the manifest says
which of the chunk's rows the GPU's ops of the stage read and write, token by token (which values
a chunk computes and where their rows live: :mod:`picc.codegen_cpu.chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from picc import kernel_names as names
from picc.codegen_cpu import kernels_dense, kernels_misc, kernels_prefill
from picc.codegen_cpu.buffers import PARAM_SLOTS, PARAMS, SCRATCH, CpuBuffers
from picc.codegen_cpu.chunks import ChunkPlan, ChunkRegions, plan_chunk
from picc.codegen_cpu.lower_ops import _BARRIER_FREE, OpLowering, _layout, _rows8, _x_format
from picc.codegen_cpu.program import Access, Buf, Param, Program, place_barriers
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function
from picc.ir.weights import WeightStore
from picc.placement.schedule import Schedule
from runtime.cpu_manifest import CpuChunkProgram, CpuChunkStage, LogitsRow

PREFILL_CHUNK = 32  # prompt tokens per call of the prefill program
PREFILL_SYMBOL = "picc_prefill_chunk"
LOGITS_SYMBOL = "picc_logits_chunk"

_ROUNDED = "<rows rounded to int16 or int8>"  # the access name of the chunk programs' rounding slot


@dataclass
class ChunkSlots:
    """The buffers the chunk programs share (one runs at a time): their activations, the chunk's
    token ids, and the rows rounded to int16 or int8 (made when a program first needs them)."""

    activations: int
    tokens: int
    rounded: int | None = None

    @classmethod
    def allocate(cls, bufs: CpuBuffers) -> ChunkSlots:
        return cls(bufs.slot("chunk activations"), bufs.slot("chunk tokens", 4 * PREFILL_CHUNK))


class ChunkLowering(OpLowering):
    """One set of chunk programs (:meth:`lower_programs`): the ops of ``plan``, stage by stage.

    The IR names the decode step's kernels; a chunk computes some ops with batched kernels of its
    own (GEMMs for GEMVs, the chunk FFN, int16 rounding into a slot), so its calls are not checked
    against those names."""

    names_ir_kernels = False

    def __init__(self, func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers,
                 slots: ChunkSlots, plan: ChunkPlan) -> None:
        super().__init__(func, weights, sched, ctx, bufs)
        self.slots, self.plan = slots, plan
        self.regions = ChunkRegions(slots.activations, slots.tokens, PREFILL_CHUNK, self.types, plan.last_read)
        self.rounded_holds: tuple[str, str] | None = None  # (value, x format) whose rounded rows the slot holds now
        self.programs: list[Program] = []
        self.step_bits = True  # no op yet computed otherwise than the step computes it (CpuChunkProgram)

    # --- where values live: seq rows each in the chunk's buffer -----------------------------------

    def activation(self, value: str) -> Buf:
        return self.regions.place(value)

    def alias(self, value: str, of: str) -> Buf:
        return self.regions.alias(value, of)

    def value(self, name: str) -> Buf:
        return self.regions.get(name)

    def rows(self) -> Param:
        """The tokens a call computes: the chunk's ``seq``."""
        return Param(PARAMS, PARAM_SLOTS["seq"])

    def tokens(self) -> Buf:
        return Buf(self.regions.tokens)

    def per_token(self) -> Param:
        return self.rows()

    def memory_key(self, value: str) -> str:
        return self.regions.key(value)

    # --- ops ---------------------------------------------------------------------------------------

    def _step_rows(self, op: Op) -> bool:
        """Whether the chunk computes ``op`` with the batched twin of the step's kernel (rounded x,
        the rows8 layout: where that beats a GEMM), its tokens as the rows."""
        return _x_format(op) != "f32" and _rows8(op)

    def _rows_call(self, op: Op, kernel, *args: object, x_width: int, y_width: int) -> None:  # noqa: ANN001
        """A batched twin of a step kernel over the chunk's tokens (its last arguments: the rows,
        and the x and y rows' strides in bytes)."""
        self.call(op, kernel, *args, self.rows(), 4 * x_width, 4 * y_width, batched=True)

    def linear(self, op: O.Linear) -> None:
        # A GEMM, or the step's batched kernel, reads each weight row once for all the chunk's tokens.
        w = self.weights[op.weight]
        rows, k = int(w.shape[0]), int(w.shape[1])
        if self._step_rows(op):
            kernel, args = self.batched_linear(op, self.activation(op.result), 0)
            self._rows_call(op, kernel, *args, x_width=k, y_width=rows)
            return
        self.step_bits = False  # a GEMM sums in another order than the step's GEMV
        x, access = self.gemm_input(op, op.x, int(w.shape[1]), op.weight)
        self.call(op, kernels_dense.gemm(w.dtype.value, _rows8(op)), self.weight(op.weight, layout=_layout(op)),
                  x, self.weight(op.bias, as_f32=True), self.activation(op.result), self.rows(),
                  int(w.shape[0]), int(w.shape[1]), 0, batched=True, access=access)

    def moe(self, op: O.MoE) -> None:
        """The chunk's tokens through their experts in one call (``kernels_moe.moe_chunk``): an
        expert's rows read once for the tokens that chose it, each token's output the step's bits."""
        kernel, args = self.batched_moe(op, self.regions.size)
        self._rows_call(op, kernel, *args, x_width=self.width(op.x), y_width=self.width(op.x))

    def add(self, op: O.Add) -> None:
        # Elementwise over the chunk's whole buffer (rows past seq are computed and never read).
        self.call(op, kernels_misc.add(), self.value(op.a), self.value(op.b), self.activation(op.result),
                  self.regions.size * self.width(op.result), batched=True)

    def rounded_buffer(self, width: int) -> Buf:
        """The chunk programs' slot for rows rounded to int16 or int8 (grown to ``width`` floats a row)."""
        if self.slots.rounded is None:
            self.slots.rounded = self.bufs.slot("chunk rows rounded to int16 or int8")
        self.bufs.grow(self.slots.rounded, 4 * PREFILL_CHUNK * width)
        return Buf(self.slots.rounded, 0, stride=4 * width)

    def gemm_input(self, op: Op, value: str, width: int, weight: str) -> tuple[Buf, Access | None]:
        """What a prefill GEMM of ``op`` over ``weight`` reads for ``value`` and the access of that
        call (None: the op's own). Where the step dots ``weight``'s rows with rounded x (4-bit rows
        of an ``_xi16`` or ``_xi8`` kernel), the prefill dots the same rounded values
        (``kernels_misc.round_x``, once per value and format while the slot holds it): the
        programs then compute one function, as the interpreter does."""
        x_format = _x_format(op)
        if not (x_format != "f32" and self.weights[weight].dtype.value in names.INT_DOT_DTYPES):
            return self.value(value), None
        slot = self.rounded_buffer(width)
        if self.rounded_holds != (value, x_format):
            self.call(op, kernels_misc.round_x(x_format), self.value(value), slot, self.rows(), width, batched=True,
                      access=Access(frozenset({value}), frozenset({_ROUNDED}), True))
            self.rounded_holds = (value, x_format)
        return slot, Access(frozenset(set(op.values()) | {_ROUNDED}), frozenset({op.result}),
                            isinstance(op, _BARRIER_FREE))

    def dense_ffn(self, op: O.FFN) -> None:
        """A dense FFN in prefill: GEMMs of up (and gate) into the scratch, the form's activation,
        the GEMM of down -- each weight read once per chunk."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        if self._step_rows(op):
            kernel, args = self.batched_dense_ffn(op, self.activation(op.result), 0, self.regions.size)
            self._rows_call(op, kernel, *args, x_width=hidden, y_width=hidden)
            return
        self.step_bits = False
        rows, floats = self.rows(), self.regions.size * n
        u, g = self.bufs.need_scratch(2 * 4 * floats), Buf(SCRATCH, 4 * floats)
        x, up_access = self.gemm_input(op, op.x, hidden, op.up)

        def gemm(weight: str, bias: str | None, src: Buf, dst: Buf, out: int, k: int,
                 access: Access | None = None) -> None:
            kernel = kernels_dense.gemm(self.weights[weight].dtype.value, _rows8(op))
            self.call(op, kernel, self.weight(weight, layout=_layout(op)), src, self.weight(bias, as_f32=True), dst,
                      rows, out, k, 0, batched=True, access=access)

        gemm(op.up, op.up_bias, x, u, n, hidden, up_access)
        if op.gate:
            # Independent of the up GEMM before it (each writes its own half of the scratch): no
            # barrier between the two. (The up GEMM keeps the op's access and its barrier before.)
            xg, gate_access = self.gemm_input(op, op.x, hidden, op.gate)
            reads = {op.x} | (gate_access.reads & {_ROUNDED} if gate_access else set())
            gemm(op.gate, op.gate_bias, xg, g, n, hidden,
                 access=Access(frozenset(reads), frozenset({f"{op.result}.gate"}), True))
        self.call(op, kernels_misc.ffn_activation(op.form), g, u, u, floats, batched=True)
        h, down_access = u, None
        if _x_format(op) != "f32" and self.weights[op.down].dtype.value in names.INT_DOT_DTYPES:
            # The step's kernel dots the down rows with h rounded as x is: so does the prefill.
            self.call(op, kernels_misc.round_x(_x_format(op)), u, self.rounded_buffer(n), rows, n, batched=True,
                      access=Access(frozenset({op.result}), frozenset({_ROUNDED}), False))
            self.rounded_holds = None
            h, down_access = self.rounded_buffer(n), Access(frozenset({_ROUNDED}), frozenset({op.result}), False)
        gemm(op.down, op.down_bias, h, self.activation(op.result), hidden, n, down_access)

    def fused_ffn(self, op: FusedFFN) -> None:
        # Every token keeps its own active set; each weight row is read once per chunk.
        self.step_bits = False  # the chunk's products, not the step kernel's (~1e-7 apart)
        w = self.fused_operands(op)
        kernel = kernels_prefill.chunk_ffn(op.mode, op.form, w.up_dtype, w.gate_dtype, w.down_dtype,
                                           op.interleaved, w.dense_rows8, op.gathered_layout, _x_format(op))
        stride = self.width(op.mask) if op.mask is not None else 0
        scratch = self.bufs.need_scratch(kernels_prefill.chunk_ffn_scratch_bytes(self.regions.size, w.n))
        x, access = self.gemm_input(op, op.x, w.hidden, op.up_gate or op.up or "")
        self.call(op, kernel, x, w.up, w.gate, w.down_t, w.up_bias, w.gate_bias,
                  self.weight(op.down_bias, as_f32=True), self.activation(op.result), w.mask,
                  scratch, self.rows(), stride, w.n, w.hidden, float(op.threshold),
                  self.weight(op.score_scale, as_f32=True), batched=True, access=access)

    # --- programs ----------------------------------------------------------------------------------

    def lower_programs(self, symbol: str, result: str | None) -> CpuChunkProgram:
        """The plan's CPU ops of each stage as program ``symbol`` (``symbol_<i>`` when the step
        has several stages) and, for the runtime, what the GPU's ops of the stage read and leave
        behind.

        The GPU's kernels see one token, so the runtime runs a stage's GPU ops token by token
        while the CPU's program takes the whole chunk. Values live in the chunk's buffer, one row
        per token, on the host; the GPU's activation slots hold one token, so each of the GPU's
        tokens first uploads what its ops read from earlier stages (``gpu_in``) and afterwards
        downloads what later stages read (``gpu_out``). A stage's GPU rows stay untouched by its
        CPU program, which runs meanwhile. ``result`` (a value whose rows the caller reads
        afterwards) keeps its rows to the end."""
        args = {a.name for a in self.func.args}
        plan, regions = self.plan, self.regions
        stages = []
        for i, (gpu, cpu) in enumerate(plan.stages):
            for v in plan.gpu_out[i]:
                regions.place(v)
            self.rounded_holds = None
            self.begin(symbol if len(plan.stages) == 1 else f"{symbol}_{i}")
            for n in cpu:
                self.lower(self.ops[n])
                regions.release(plan.cpu_event[n])
            program = None
            if self.program.calls:
                self.program.calls = place_barriers(self.program.calls, self.access)
                self.programs.append(self.program)
                program = self.program.name
            stages.append(CpuChunkStage(program, tuple(gpu), tuple(v for v in plan.gpu_in[i] if v in args),
                                        tuple(regions.rows(v) for v in plan.gpu_in[i] if v not in args),
                                        tuple(regions.rows(v) for v in plan.gpu_out[i])))
            regions.release(plan.end_event[i])
        self.bufs.grow(regions.index, regions.nbytes)
        logits = None
        if result:
            where = regions.get(result)
            if where.stride != 4 * self.width(result):
                raise PiccError(f"codegen_cpu: %{result}'s rows in the chunk are not f32 rows back to back")
            logits = LogitsRow(where.index, where.offset, self.width(result))
        return CpuChunkProgram(tuple(stages), regions.tokens, PREFILL_CHUNK, logits, self.step_bits)


def _chunk_programs(func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers,
                    slots: ChunkSlots, symbol: str, result: str | None,
                    skip: set[str]) -> tuple[list[Program], CpuChunkProgram]:
    """The module's ops but ``skip`` for a chunk of tokens (:meth:`ChunkLowering.lower_programs`)."""
    lowering = ChunkLowering(func, weights, sched, ctx, bufs, slots, plan_chunk(func, sched, result, skip))
    info = lowering.lower_programs(symbol, result)
    return lowering.programs, info


def prefill_programs(func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers,
                     slots: ChunkSlots) -> tuple[list[Program], CpuChunkProgram]:
    """``picc_prefill_chunk``: the step without its head for up to PREFILL_CHUNK prompt tokens at
    positions ``pos ..``, for the KV caches they leave behind; one program per stage with CPU ops."""
    return _chunk_programs(func, weights, sched, ctx, bufs, slots, PREFILL_SYMBOL, None, set(sched.head))


def logits_programs(func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers,
                    slots: ChunkSlots) -> tuple[list[Program], CpuChunkProgram]:
    """``picc_logits_chunk``: the whole step, head included, for up to PREFILL_CHUNK tokens like
    the prefill programs, leaving each token's logits in its row of the chunk's buffer: the logits
    of every position (``picc logits``) in chunks instead of token by token."""
    return _chunk_programs(func, weights, sched, ctx, bufs, slots, LOGITS_SYMBOL, func.ret, set())
