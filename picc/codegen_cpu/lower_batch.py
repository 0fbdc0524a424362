"""The batch step: one decode step for up to :data:`BATCH_CAPACITY` sequences at once, for a server.

``picc_batch_step(bufs, tid, nthreads)`` computes, for rows s < ``params[batch]``, the decode step
of row s's token (``bufs[tokens][s]``) at its position (``bufs[positions][s]``) against its own
KV caches (the pointers in row s of ``bufs[kv table]``, one per layer, which the runtime points at
the caches of the sequence the row belongs to), leaving each row's logits and greedy token.

Each row's arithmetic is the one-sequence step's, bit for bit, whatever the other rows hold -- a
server's batches must not change what a sequence generates (sparse gate decisions flip on 1e-7):

* the linears and dense FFNs call the batched twins of the step's kernels
  (:mod:`.kernels_batch`): each weight group is read from memory once for every row and dotted
  with each row exactly as the one-row kernel dots it, the rows split across threads as there;
* attention takes the batch in one call (``attention_rows``), each (row, head) computed by the
  emitter of the step's kernel against the row's own caches;
* a mixture of experts takes the batch in one call (``moe_chunk``, the prefill's): an expert's
  rows read once for the rows that chose it, each row's output the step kernel's bits;
* every other op (norms, rotary embedding, sparse FFNs, the argmax) calls the step's own
  kernel once per row (:meth:`Program.call`'s ``repeat``), on that row's memory: row s's values
  live in its own copy of the step's activation buffer (``stride`` bytes apart, each value at the
  step's offset), so a row's kernels see exactly what the step's would.

Only a model that runs on the CPU alone has one (a GPU part runs one sequence's step at a time).
"""

from __future__ import annotations

from picc.codegen_cpu import kernels_attention, kernels_misc
from picc.codegen_cpu.buffers import PARAM_SLOTS, PARAMS, SYNC, ZEROS, CpuBuffers
from picc.codegen_cpu.chunks import aligned
from picc.codegen_cpu.lower_decode import DecodeLowering
from picc.codegen_cpu.lower_ops import OpLowering
from picc.codegen_cpu.program import Access, Buf, Param, Program, place_barriers, profile_slots
from picc.errors import PiccError
from picc.ir import ops as O
from runtime.cpu_manifest import CpuBatchProgram, CpuBuffer, LogitsRow, ProfiledStep

BATCH_CAPACITY = 16  # rows of the batch step: sequences a server decodes in one call
BATCH_SYMBOL = "picc_batch_step"


class BatchLowering(DecodeLowering):
    """Lowers the batch step from the lowered decode ``step`` (its values' offsets make a row's
    activation buffer); :meth:`lower` returns the program and its manifest record."""

    names_ir_kernels = False  # the linears call the batched twins of the kernels the IR names

    def __init__(self, step: DecodeLowering, bufs: CpuBuffers, capacity: int = BATCH_CAPACITY) -> None:
        super().__init__(step.func, step.weights, step.sched, step.ctx, bufs)
        self.step_values = step.values
        self.capacity = capacity
        self.stride = aligned(step.arena)
        self.rows_memory = bufs.slot("batch activations", capacity * self.stride)
        self.token_ids = bufs.slot("batch tokens", 4 * capacity)
        self.positions = bufs.slot("batch positions", 4 * capacity)
        self.greedy_ids = bufs.slot("batch greedy tokens", 4 * capacity)
        self.cache_names = sorted(bufs.caches)
        self.kv_table = bufs.slot("batch kv caches", 8 * capacity * max(1, len(self.cache_names)))

    # --- a row's values: the step's offsets in the row's copy of the activation buffer -----------

    def _row(self, value: str) -> Buf:
        if value not in self.step_values:
            raise PiccError(f"codegen_cpu: batch step: %{value} has no place in the decode step")
        return Buf(self.rows_memory, self.step_values[value].offset, self.stride)

    def activation(self, value: str) -> Buf:
        return self._row(value)

    def value(self, name: str) -> Buf:
        return self._row(name)

    def alias(self, value: str, of: str) -> Buf:
        return self._row(of)

    def tokens(self) -> Buf:
        return Buf(self.token_ids, 0, 4)

    def per_token(self) -> Param:
        return Param(PARAMS, PARAM_SLOTS["batch"])

    def position(self) -> Param:
        return Param(self.positions, 0, 1)

    def call(self, op, kernel, *args, batched=False, writes=None, access=None) -> None:  # noqa: ANN001
        """Every one-row kernel once per row (``batched`` kernels too: they see one row here)."""
        super().call(op, kernel, *args, batched=False, writes=writes, access=access)

    def rows_apart(self, args: tuple[object, ...]) -> bool:
        """The rows of a call are apart when it reaches memory only through row-strided buffers
        (each row's own values) and read-only ones (the weights, the zeros); not a shared scratch
        or another buffer of the code's own. (Attention, the one op that reaches each row's KV
        caches, takes the batch in one call.)"""
        read_only = {ZEROS, *self.bufs.weight_index.values()}
        return all(arg.stride or arg.index in read_only for arg in args if isinstance(arg, Buf))

    def _rows_call(self, op: O.Op, kernel, *args: object, writes: set[str]) -> None:  # noqa: ANN001
        """A batched twin: one call for every row (its last arguments: rows, x and y strides)."""
        OpLowering.call(self, op, kernel, *args, self.per_token(), self.stride, self.stride, batched=True,
                        writes=writes)

    # --- the ops whose weights the rows share ------------------------------------------------------

    def linear(self, op: O.Linear) -> None:
        y, accumulate, writes = self.output(op)
        kernel, args = self.batched_linear(op, y, accumulate)
        self._rows_call(op, kernel, *args, writes=writes)

    def dense_ffn(self, op: O.FFN) -> None:
        y, accumulate, writes = self.output(op)
        kernel, args = self.batched_dense_ffn(op, y, accumulate, self.capacity)
        self._rows_call(op, kernel, *args, writes=writes)

    def moe(self, op: O.MoE) -> None:
        """The batch's rows through their experts in one call (``kernels_moe.moe_chunk``, as a
        prompt's chunk: an expert's rows read once for the rows that chose it, each row's output
        the one-row kernel's bits)."""
        kernel, args = self.batched_moe(op, self.capacity)
        self._rows_call(op, kernel, *args, writes=set())

    def attention(self, op: O.Attention) -> None:
        """One call for the batch's rows, each against its own caches (``attention_rows``)."""
        table = Buf(self.kv_table, 8 * self.cache_names.index(op.cache))  # row 0's pointer to the layer's caches
        softcap, sinks = self.attention_extras(op)
        OpLowering.call(self, op, kernels_attention.attention_rows(op.kv_format, bool(softcap), bool(sinks)),
                        self.value(op.q), self.value(op.k), self.value(op.v), table, self.activation(op.result),
                        self.per_token(), Buf(self.positions), op.n_heads, op.n_kv_heads, op.head_dim, op.v_dim,
                        float(op.scale), op.window or 0, self.ctx, self.stride, 8 * len(self.cache_names), *softcap,
                        *sinks, batched=True)

    # --- the program -------------------------------------------------------------------------------

    def lower_batch(self) -> tuple[list[Program], CpuBatchProgram]:
        """The batch step over the one stage's ops, head and argmax included, and its profiled
        twin (``bench/serve_load.py --batch-steps --profile``)."""
        if len(self.sched.stages) != 1 or not self.sched.stages[0].cpu or self.sched.stages[0].gpu:
            raise PiccError("codegen_cpu: a batch step needs a model that runs on the CPU alone")
        self.program = Program(BATCH_SYMBOL, sync=SYNC)
        self.access = []
        for name in self.sched.stages[0].cpu:
            self.lower(self.ops[name])
        ret = self.func.ret
        args = (self.value(ret), Buf(self.greedy_ids, 0, 4), self.width(ret))
        self.program.call(kernels_misc.argmax(), *args, repeat=self.per_token(), label="greedy",
                          rows_apart=self.rows_apart(args))
        self.access.append(Access(frozenset({ret}), frozenset(), False))
        self.program.calls = place_barriers(self.program.calls, self.access)
        counters = self.bufs.add(CpuBuffer("profile", slots=profile_slots(len(self.program.calls))))
        profiled = self.program.profiled(counters)
        calls = tuple((c.kernel.symbol, c.label) for c in self.program.calls)
        logits = LogitsRow(self.rows_memory, self.step_values[ret].offset, self.width(ret))
        caches = tuple(self.bufs.caches[name].index for name in self.cache_names)
        return [self.program, profiled], CpuBatchProgram(
            BATCH_SYMBOL, self.capacity, self.stride, logits, self.token_ids, self.positions, self.greedy_ids,
            self.kv_table, caches, ProfiledStep(profiled.name, counters, calls))
