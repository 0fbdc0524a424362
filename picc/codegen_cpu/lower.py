"""Lowering the CPU ops of a fused, placed module to step programs of CPU kernels.

The hybrid step (``picc.schedule``) is a sequence of stages; the CPU's ops of each stage become
one :class:`~picc.codegen_cpu.program.Program`, ``picc_stage_<i>(bufs, tid, nthreads)``, that the
runtime's threads call once per token (a module that runs on the CPU alone is one stage: one call
per token). A stage that holds ops of the head (the output norm and LM head) also gets
``picc_stage_<i>_prefill`` without them: prompt tokens whose logits are not read skip a large
share of the bytes a step reads. When the logits are computed on the CPU, the step ends with their
argmax, the greedy token. ``picc_stage_<i>_profile`` is the step with a clock around each call
(:meth:`~picc.codegen_cpu.program.Program.profiled`; the manifest's ``profile`` of the stage names
its calls' kernels and IR values), for ``picc bench --profile``. A model that runs on the CPU
alone also gets ``picc_decode``, greedy decode steps in a loop that stays in generated code
(:meth:`_Lowering.decode_loop`).

Every op names its kernel (``select-kernels``); the lowering checks that the kernel it calls is
that one. Memory is named by index into ``bufs``:

* ``bufs[0]`` the barrier state, ``bufs[1]`` the per-token parameters (i32, :data:`PARAM_SLOTS`:
  ``pos``, ``token``, the greedy token the step writes, and the decode loop's), ``bufs[2]`` a
  vector of zeros;
* then each weight the kernels read, by name (the .pib's tensors; vectors that kernels read as
  f32 -- norms, biases, rotary frequencies -- are stored as extra f32 tensors ``cpu.f32.<name>``;
  the 4-bit matrices of ``_r8_xi16`` kernels are stored in the rows8 layout, and the block-format
  neuron-major down projections of fused FFNs in the rowplanes layout, :attr:`CpuProgram.layouts`);
* then the activations (one buffer; each value at a 64-byte aligned offset, including the values
  that arrive from the GPU), the KV caches, and the kernels' shared scratch.

Steps are for one token at a time (decode). Prompts run in chunks of up to :data:`PREFILL_CHUNK`
tokens (``bufs[...]`` of the manifest's ``prefill`` holds their ids, ``params[seq]`` their count):
``picc_prefill_chunk`` (:meth:`_Lowering.prefill_programs`) is the step without its head for a
chunk, linears as GEMMs. Its sparse FFNs still see one token at a time, so they compute exactly the
active sets the interpreter computes. ``picc_logits_chunk`` (:meth:`_Lowering.logits_programs`) is
the same with the head, every token's logits left in the chunk's buffer (the manifest's
``logits_chunk``), for ``picc logits``. In a hybrid step each is one program per stage
(``picc_prefill_chunk_<i>``), and the manifest says which of the chunk's rows the GPU's ops of the
stage read and write, token by token (:meth:`_Lowering._chunk_programs`; which values a chunk
computes and where their rows live: :mod:`picc.codegen_cpu.chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from picc import kernel_names as names
from picc.codegen_cpu import kernels_attention, kernels_dense, kernels_ffn, kernels_misc, kernels_prefill, rowplanes
from picc.codegen_cpu.chunks import ChunkRegions, aligned, bytes_one_token, plan_chunk
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Access, Buf, GreedyLoop, Null, Param, Program, place_barriers, profile_slots
from picc.codegen_cpu.rowops import row_bytes
from picc.codegen_cpu.rows8 import LAYOUT as ROWS8
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore
from picc.schedule import Schedule, crossing_values

SYNC, PARAMS, ZEROS = 0, 1, 2
PARAM_SLOTS = {"pos": 0, "token": 1, "greedy": 2, "seq": 3, "steps": 4, "eos": 5, "done": 6}
PREFILL_CHUNK = 32  # prompt tokens per call of the prefill program
PREFILL_SYMBOL = "picc_prefill_chunk"
LOGITS_SYMBOL = "picc_logits_chunk"
DECODE_SYMBOL = "picc_decode"
DECODE_CAPACITY = 256  # greedy tokens per call of the decode loop (its output buffer)
MAX_THREADS = 64  # the scratch is sized for this many threads
_KERNEL_DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")


# Ops whose kernels have one phase and touch no memory but their operands and result: one may
# start while another is still running on other threads when neither reads or writes what the
# other writes (the q, k and v projections of a layer; the rope of q and of k).
_BARRIER_FREE = (O.Linear, O.Rope, O.Add, O.RMSNorm, O.LayerNorm, O.Embed)


_XI16 = "<rows rounded to int16>"  # the access name of the chunk programs' int16 slot


def _int_dots(op: Op) -> bool:
    """Whether ``select-kernels`` chose int16 x for ``op``'s kernel (``x_format``)."""
    return isinstance(op, O.MatrixOp) and op.rounds_x


def _rows8(op: Op) -> bool:
    """Whether ``op``'s kernel reads its 4-bit matrices in the rows8 layout (``layout``)."""
    return isinstance(op, O.MatrixOp) and op.layout == "rows8"


def _layout(op: Op) -> str | None:
    """The layout ``op``'s kernel reads its weight matrices in: rows8, or GGUF's rows (None)."""
    return ROWS8 if _rows8(op) else None


def _down_layout(dtype: str) -> str | None:
    """The layout the fused FFN kernels read a neuron-major down projection of ``dtype`` in."""
    return rowplanes.LAYOUT if dtype in rowplanes.DTYPES else None


def _adds_in_place(op: Op) -> bool:
    """Whether ``op``'s decode kernel can add its result to what its output buffer holds."""
    return isinstance(op, (O.Linear, FusedFFN)) or (type(op) is O.FFN and not op.neuron_major)


def stage_symbol(stage: int, prefill: bool = False) -> str:
    return f"picc_stage_{stage}" + ("_prefill" if prefill else "")


@dataclass
class CpuProgram:
    """A lowered module: the stage programs, the buffers behind ``bufs``, the extra f32 tensors,
    and where the values that cross devices (and the logits) live on the host."""

    programs: list[Program | GreedyLoop] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # per stage: {"step": symbol | None, "prefill": ...}
    buffers: list[dict] = field(default_factory=list)  # {"kind": "sync"|"params"|"zeros"|"weight"|"alloc", ...}
    extra: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, dict] = field(default_factory=dict)  # value -> {"buffer", "offset", "nbytes"}
    logits: dict = field(default_factory=dict)  # {"buffer", "offset", "n"}
    greedy: bool = False  # the CPU step writes the greedy token to params
    prefill: dict | None = None  # {"symbol", "tokens" (buffer index), "chunk"}: the batched prefill program
    decode: dict | None = None  # {"symbol", "step" (buffer index), "out" (buffer index), "capacity"}: the greedy loop
    logits_chunk: dict | None = None  # the same, with the head: + {"logits": {"buffer", "offset", "n"}}
    layouts: dict[str, str] = field(default_factory=dict)  # weight -> "rows8" / "rowplanes": how the .pib stores it

    def manifest(self, simd: str) -> dict:
        """What the runtime needs besides the code."""
        return {"simd": simd, "max_threads": MAX_THREADS, "params": PARAM_SLOTS, "buffers": self.buffers,
                "stages": self.stages, "values": self.values, "logits": self.logits, "greedy": self.greedy,
                "prefill": self.prefill, "logits_chunk": self.logits_chunk, "decode": self.decode}


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
        self.access: list[Access] = []  # per call of self.program
        self.caches: dict[str, Buf] = {}  # KV cache name -> its buffer (k rows, then v rows)
        self.chunk: ChunkRegions | None = None  # set while lowering a chunk program
        self.chunk_slots: tuple[int, int] | None = None  # the chunk programs' activations and tokens
        self.xi16_slot: int | None = None  # the chunk programs' rows rounded to int16 (see gemm_input)
        self.xi16_holds: str | None = None  # the value whose rounded rows the slot holds now
        self.row_weights: set[str] = set()  # weights some kernel reads in their own (row) layout
        # Decode: producer's result -> (the add that reads it, the residual it is added to).
        self.residual_adds = self._residual_adds()
        self.adds_done_by_producers = {add.result for add, _ in self.residual_adds.values()}

    def _residual_adds(self) -> dict[str, tuple[O.Add, str]]:
        """The adds of the decode step that ``select-kernels`` gave to the kernel of an operand's
        producer (``accumulated_by``): that kernel adds its rows into the residual's buffer and
        the add's result lives there."""
        fused: dict[str, tuple[O.Add, str]] = {}
        for op in self.func.ops:
            if isinstance(op, O.Add) and (accumulated := op.accumulated) is not None:
                src, res = accumulated
                producer = self.func.producer(src)
                if producer is None or not _adds_in_place(producer):
                    raise PiccError(f"codegen_cpu: %{op.result} is accumulated by %{src}, whose kernel "
                                    "cannot add into its output")
                fused[src] = (op, res)
        return fused

    def output(self, op: Op) -> tuple[Buf, int, set[str]]:
        """Where ``op``'s kernel writes its result, its ``accumulate`` flag and the values it
        writes besides the result: the residual's buffer, 1 and the residual and the add's
        result when ``op`` does a residual add (see :meth:`_residual_adds`)."""
        if self.chunk is None and op.result in self.residual_adds:
            add_op, res = self.residual_adds[op.result]
            self.alias(add_op.result, res)
            return self.value(res), 1, {res, add_op.result}
        return self.activation(op.result), 0, set()

    # --- buffers ---------------------------------------------------------------------------------

    def _alloc_slot(self, name: str, nbytes: int = 0) -> int:
        self.out.buffers.append({"kind": "alloc", "name": name, "nbytes": nbytes})
        return len(self.out.buffers) - 1

    def weight(self, name: str | None, *, as_f32: bool = False, offset: int = 0,
               layout: str | None = None) -> Buf | Null:
        """A weight's buffer; ``as_f32`` stores vectors the kernels read as f32 in f32; ``layout``
        (``rows8``, ``rowplanes``) stores a matrix in that layout instead of GGUF's rows (every
        kernel that reads it must ask for the same one)."""
        if name is None:
            return Null()
        t = self.weights[name]
        if not as_f32:
            held = self.out.layouts.get(name, "row" if name in self.row_weights else None)
            if held is not None and held != (layout or "row"):
                raise PiccError(f"codegen_cpu: weight @{name} is read both in the {held} layout and in the "
                                f"{layout or 'row'} layout")
            if layout is not None:
                self.out.layouts[name] = layout
            else:
                self.row_weights.add(name)
        if as_f32 and t.dtype != DType.F32:
            converted = f"cpu.f32.{name}"
            if converted not in self.out.extra:
                self.out.extra[converted] = Tensor.from_f32(t.to_f32())
            name = converted
        elif not as_f32 and t.dtype.value not in _KERNEL_DTYPES:
            raise PiccError(f"codegen_cpu: weight @{name} is {t.dtype.value}; the CPU kernels read "
                            f"{', '.join(_KERNEL_DTYPES)}")
        return self.tensor_buffer(name, offset)

    def tensor_buffer(self, name: str, offset: int = 0) -> Buf:
        """The ``bufs`` entry of the .pib tensor ``name`` (a weight or an extra tensor)."""
        if name not in self.weight_index:
            self.out.buffers.append({"kind": "weight", "name": name})
            self.weight_index[name] = len(self.out.buffers) - 1
        return Buf(self.weight_index[name], offset)

    def transposed(self, name: str) -> Buf:
        """A matrix stored transposed, in its own format (f32 / f16: exact), as an extra tensor."""
        converted = f"cpu.t.{name}"
        if converted not in self.out.extra:
            t = self.weights[name]
            self.out.extra[converted] = Tensor.from_f32(np.ascontiguousarray(t.to_f32().T), t.dtype)
        return self.tensor_buffer(converted)

    def array(self, name: str, values: np.ndarray) -> Buf:
        """A constant f32 vector (rotary frequencies) stored as an extra tensor."""
        if name not in self.out.extra:
            self.out.extra[name] = Tensor.from_f32(values)
        return self.tensor_buffer(name)

    def activation(self, value: str) -> Buf:
        if self.chunk is not None:
            return self.chunk.place(value)
        if value not in self.values:
            self.values[value] = Buf(self.act_index, self.arena)
            self.arena += aligned(bytes_one_token(self.types[value]))
        return self.values[value]

    def alias(self, value: str, of: str) -> Buf:
        """``value`` lives where ``of`` does (an in-place kernel)."""
        if self.chunk is not None:
            return self.chunk.alias(value, of)
        self.values[value] = self.value(of)
        return self.values[value]

    def value(self, name: str) -> Buf:
        if self.chunk is not None:
            return self.chunk.get(name)
        if name not in self.values:
            raise PiccError(f"codegen_cpu: %{name} is read before the CPU has it")
        return self.values[name]

    def own(self, nbytes: int, name: str) -> Buf:
        return Buf(self._alloc_slot(name, nbytes))

    # --- ops ---------------------------------------------------------------------------------------

    def call(self, op: Op, kernel: Kernel, *args: object, check: bool = True, batched: bool = False,
             writes: set[str] | None = None, access: Access | None = None) -> None:
        """Call ``kernel`` for ``op``. In the prefill program, a kernel that is not ``batched``
        (it sees one token) is called once per token of the chunk. ``writes``: values it writes
        besides ``op``'s result. ``access``: what the call reads and writes, when it is one of
        several calls of ``op`` and not the whole op (:func:`place_barriers` reads it)."""
        if check and op.kernel != kernel.symbol:
            raise PiccError(f"codegen_cpu: %{op.result} names kernel {op.kernel!r} but the CPU computes it with "
                            f"{kernel.symbol!r}" + ("; run select-kernels first" if op.kernel is None else ""))
        per_token = self.chunk is not None and not batched
        self.program.call(kernel, *args, repeat=self.rows() if per_token else None,  # type: ignore[arg-type]
                          label=op.result)
        if access is None:
            extra = writes or set()  # a residual add's buffer: read, then written
            written = {op.result, op.x} if isinstance(op, O.Rope) else {op.result}  # rope rotates in place
            access = Access(frozenset(set(op.values()) | extra), frozenset(written | extra),
                             isinstance(op, _BARRIER_FREE))
        key = self.chunk.key if self.chunk is not None else str
        self.access.append(Access(frozenset(map(key, access.reads)), frozenset(map(key, access.writes)),
                                   access.barrier_free and not per_token))

    def rows(self) -> Param | int:
        """The tokens a call computes: one in a step, the chunk's ``seq`` in the prefill program."""
        return Param(PARAMS, PARAM_SLOTS["seq"]) if self.chunk is not None else 1

    def tokens(self) -> Buf:
        return Buf(self.chunk.tokens) if self.chunk is not None else Buf(PARAMS, 4 * PARAM_SLOTS["token"])

    def kv_cache(self, name: str, width: int) -> Buf:
        """The KV cache ``name`` (ctx rows of k, then ctx rows of v), shared by step and prefill."""
        if name not in self.caches:
            self.caches[name] = self.own(2 * self.ctx * width * 4, f"kv.{name}")
        return self.caches[name]

    def width(self, value: str) -> int:
        d = self.types[value].shape[-1]
        assert isinstance(d, int)
        return d

    def lower(self, op: Op) -> None:  # noqa: C901 - one case per op
        pos = Param(PARAMS, PARAM_SLOTS["pos"])
        match op:
            case O.Embed():
                table = self.weights[op.table]
                self.call(op, kernels_dense.embed(table.dtype.value), self.weight(op.table), self.tokens(),
                          self.activation(op.result), self.rows(), self.width(op.result), batched=True)
            case O.RMSNorm():
                self.call(op, kernels_misc.rms_norm(), self.value(op.x), self.weight(op.weight, as_f32=True), Null(),
                          self.activation(op.result), self.rows(), self.width(op.x), float(op.eps), batched=True)
            case O.LayerNorm():
                self.call(op, kernels_misc.layer_norm(), self.value(op.x), self.weight(op.weight, as_f32=True),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), self.rows(),
                          self.width(op.x), float(op.eps), batched=True)
            case O.Linear() if self.chunk is not None:
                # Prefill: a GEMM reads each weight row once for all the chunk's tokens.
                w = self.weights[op.weight]
                x, access = self.gemm_input(op, op.x, int(w.shape[1]), op.weight)
                self.call(op, kernels_dense.gemm(w.dtype.value, _rows8(op)), self.weight(op.weight, layout=_layout(op)),
                          x, self.weight(op.bias, as_f32=True), self.activation(op.result), self.rows(),
                          int(w.shape[0]), int(w.shape[1]), 0, check=False, batched=True, access=access)
            case O.Linear():
                w = self.weights[op.weight]
                y, accumulate, writes = self.output(op)
                self.call(op, kernels_dense.gemv(w.dtype.value, _int_dots(op), _rows8(op)),
                          self.weight(op.weight, layout=_layout(op)),
                          self.value(op.x), self.weight(op.bias, as_f32=True), y, int(w.shape[0]), int(w.shape[1]),
                          accumulate, writes=writes)
            case O.Add() if self.chunk is None and op.result in self.adds_done_by_producers:
                pass  # done by the kernel of the op that feeds it (see _residual_adds)
            case O.Rope():
                # In place: the rotated value takes its input's buffer (the input has no other reader).
                if self.uses.get(op.x, 0) != 1:
                    raise PiccError(f"codegen_cpu: %{op.x} is read by more than the rope op; cannot rotate in place")
                rotated = self.alias(op.result, op.x)
                freq = self.array(f"cpu.rope.{op.result}", op.inv_freq())
                self.call(op, kernels_misc.rope(op.style), rotated, freq, self.rows(), pos, op.n_heads,
                          op.head_dim, op.rotated, batched=True)
            case O.Attention():
                kv = self.width(op.k)
                caches = self.kv_cache(op.cache, kv)
                self.call(op, kernels_attention.attention(), self.value(op.q), self.value(op.k), self.value(op.v),
                          caches, Buf(caches.index, self.ctx * kv * 4), self.activation(op.result), self.rows(), pos,
                          op.n_heads, op.n_kv_heads, op.head_dim, float(op.scale), op.window or 0, batched=True)
            case O.Add():
                # Elementwise over the chunk's whole buffer (rows past seq are computed and never read).
                tokens = self.chunk.size if self.chunk is not None else 1
                self.call(op, kernels_misc.add(), self.value(op.a), self.value(op.b), self.activation(op.result),
                          tokens * self.width(op.result), batched=True)
            case Merge():
                self.call(op, kernels_misc.merge(), self.value(op.a), self.value(op.b),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), self.width(op.result))
            case Predict():
                fc1, fc2 = self.weights[op.fc1], self.weights[op.fc2]
                rank, hidden = int(fc1.shape[0]), int(fc1.shape[1])
                self.scratch = max(self.scratch, kernels_ffn.predictor_scratch_bytes(rank))
                self.call(op, kernels_ffn.predictor(fc1.dtype.value, fc2.dtype.value), self.value(op.x),
                          self.weight(op.fc1), self.weight(op.fc1_bias, as_f32=True), self.transposed(op.fc2),
                          self.weight(op.fc2_bias, as_f32=True), self.activation(op.result),
                          Buf(self.scratch_index), hidden, rank, int(fc2.shape[0]), float(op.threshold))
            case FusedFFN():
                self.fused_ffn(op)
            case O.FFN() if not op.neuron_major and type(op) is O.FFN:
                self.dense_ffn(op)
            case _:
                raise PiccError(f"codegen_cpu: op {op.NAME} (%{op.result}) has no CPU kernel")

    def xi16_buffer(self, width: int) -> Buf:
        """The chunk programs' slot for rows rounded to int16 (grown to ``width`` floats a row)."""
        if self.xi16_slot is None:
            self.xi16_slot = self._alloc_slot("chunk rows rounded to int16")
        slot = self.out.buffers[self.xi16_slot]
        slot["nbytes"] = max(slot["nbytes"], 4 * PREFILL_CHUNK * width)
        return Buf(self.xi16_slot, 0, stride=4 * width)

    def gemm_input(self, op: Op, value: str, width: int, weight: str) -> tuple[Buf, Access | None]:
        """What a prefill GEMM of ``op`` over ``weight`` reads for ``value`` and the access of that
        call (None: the op's own). Where the step dots ``weight``'s rows with int16 x (4-bit rows
        of an ``_xi16`` kernel), the prefill dots the same rounded values
        (``kernels_misc.round_int16``, once per value while the slot holds it): the programs then
        compute one function, as the interpreter does."""
        if not (_int_dots(op) and self.weights[weight].dtype.value in names.INT_DOT_DTYPES):
            return self.value(value), None
        slot = self.xi16_buffer(width)
        if self.xi16_holds != value:
            self.call(op, kernels_misc.round_int16(), self.value(value), slot, self.rows(), width, check=False,
                      batched=True, access=Access(frozenset({value}), frozenset({_XI16}), True))
            self.xi16_holds = value
        return slot, Access(frozenset(set(op.values()) | {_XI16}), frozenset({op.result}),
                             isinstance(op, _BARRIER_FREE))

    def dense_ffn(self, op: O.FFN) -> None:
        """A dense FFN in the model's own layout (the numbers of the source model, where a
        neuron-major down would be requantized): two GEMV phases in one kernel."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        if self.chunk is not None:
            self.dense_ffn_chunk(op, n, hidden)
            return
        gate = self.weights[op.gate].dtype.value if op.gate else None
        kernel = kernels_dense.dense_ffn(op.form, up.dtype.value, gate, self.weights[op.down].dtype.value,
                                         _int_dots(op), _rows8(op))
        self.scratch = max(self.scratch, kernels_dense.dense_ffn_scratch_bytes(n))
        y, accumulate, writes = self.output(op)
        layout = _layout(op)
        self.call(op, kernel, self.value(op.x), self.weight(op.up, layout=layout), self.weight(op.gate, layout=layout),
                  self.weight(op.down, layout=layout),
                  self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True),
                  self.weight(op.down_bias, as_f32=True), y, Buf(self.scratch_index), n, hidden, accumulate,
                  writes=writes)

    def dense_ffn_chunk(self, op: O.FFN, n: int, hidden: int) -> None:
        """A dense FFN in prefill: GEMMs of up (and gate) into the scratch, the form's activation,
        the GEMM of down -- each weight read once per chunk."""
        assert self.chunk is not None
        rows, floats = self.rows(), self.chunk.size * n
        self.scratch = max(self.scratch, 2 * 4 * floats)
        u, g = Buf(self.scratch_index), Buf(self.scratch_index, 4 * floats)
        x, up_access = self.gemm_input(op, op.x, hidden, op.up)

        def gemm(weight: str, bias: str | None, src: Buf, dst: Buf, out: int, k: int,
                 access: Access | None = None) -> None:
            kernel = kernels_dense.gemm(self.weights[weight].dtype.value, _rows8(op))
            self.call(op, kernel, self.weight(weight, layout=_layout(op)), src, self.weight(bias, as_f32=True), dst,
                      rows, out, k, 0, check=False, batched=True, access=access)

        gemm(op.up, op.up_bias, x, u, n, hidden, up_access)
        if op.gate:
            # Independent of the up GEMM before it (each writes its own half of the scratch): no
            # barrier between the two. (The up GEMM keeps the op's access and its barrier before.)
            xg, gate_access = self.gemm_input(op, op.x, hidden, op.gate)
            reads = {op.x} | (gate_access.reads & {_XI16} if gate_access else set())
            gemm(op.gate, op.gate_bias, xg, g, n, hidden,
                 access=Access(frozenset(reads), frozenset({f"{op.result}.gate"}), True))
        self.call(op, kernels_misc.ffn_activation(op.form), g, u, u, floats, check=False, batched=True)
        h, down_access = u, None
        if _int_dots(op) and self.weights[op.down].dtype.value in names.INT_DOT_DTYPES:
            # The step's kernel dots the down rows with h rounded to int16: so does the prefill.
            self.call(op, kernels_misc.round_int16(), u, self.xi16_buffer(n), rows, n, check=False, batched=True,
                      access=Access(frozenset({op.result}), frozenset({_XI16}), False))
            self.xi16_holds = None
            h, down_access = self.xi16_buffer(n), Access(frozenset({_XI16}), frozenset({op.result}), False)
        gemm(op.down, op.down_bias, h, self.activation(op.result), hidden, n, down_access)

    def fused_ffn(self, op: FusedFFN) -> None:
        down = self.weights[op.down]
        n, hidden = int(down.shape[0]), int(down.shape[1])
        dense_rows8 = _rows8(op)  # for a fused FFN: what its mode reads whole is in the rows8 layout
        if op.up_gate is not None:
            # Interleaved rows: the gate of neuron i starts one row after its up row.
            dtype = self.weights[op.up_gate].dtype.value
            up, gate = self.weight(op.up_gate), self.weight(op.up_gate, offset=row_bytes(dtype, hidden))
            up_bias, gate_bias = (self.weight(op.up_gate_bias, as_f32=True),
                                  self.weight(op.up_gate_bias, as_f32=True, offset=4) if op.up_gate_bias else Null())
            up_dtype, gate_dtype = dtype, dtype
        else:
            assert op.up is not None
            whole = names.read_whole(op.mode, op.up, op.gate) if dense_rows8 else ()
            up, gate = (self.weight(w, layout=ROWS8 if w in whole else None) for w in (op.up, op.gate))
            up_bias, gate_bias = self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True)
            up_dtype = self.weights[op.up].dtype.value
            gate_dtype = self.weights[op.gate].dtype.value if op.gate else None
        down_t = self.weight(op.down, layout=_down_layout(down.dtype.value))
        mask: Buf | Null = Null()
        if op.mode == "predictor":
            assert op.mask is not None
            m = self.value(op.mask)
            mask = replace(m, offset=m.offset + op.neuron_offset)  # one byte per neuron of the layer
        if self.chunk is not None:
            # Prefill: every token keeps its own active set; each weight row is read once per chunk.
            kernel = kernels_prefill.chunk_ffn(op.mode, op.form, up_dtype, gate_dtype, down.dtype.value,
                                               op.interleaved, dense_rows8)
            stride = self.width(op.mask) if op.mask is not None else 0
            self.scratch = max(self.scratch, kernels_prefill.chunk_ffn_scratch_bytes(self.chunk.size, n))
            x, access = self.gemm_input(op, op.x, hidden, op.up_gate or op.up or "")
            self.call(op, kernel, x, up, gate, down_t, up_bias, gate_bias,
                      self.weight(op.down_bias, as_f32=True), self.activation(op.result), mask,
                      Buf(self.scratch_index), self.rows(), stride, n, hidden, float(op.threshold),
                      self.weight(op.score_scale, as_f32=True), check=False,
                      batched=True, access=access)
            return
        kernel = kernels_ffn.sparse_ffn(op.mode, op.form, up_dtype, gate_dtype, down.dtype.value, op.interleaved,
                                        _int_dots(op), dense_rows8)
        self.scratch = max(self.scratch, kernels_ffn.ffn_scratch_bytes(n, hidden, MAX_THREADS))
        y, accumulate, writes = self.output(op)
        self.call(op, kernel, self.value(op.x), up, gate, down_t, up_bias, gate_bias,
                  self.weight(op.down_bias, as_f32=True), y, mask, Null(), Buf(self.scratch_index), n, hidden,
                  float(op.threshold), self.weight(op.score_scale, as_f32=True), accumulate, writes=writes)

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
                                  Buf(PARAMS, 4 * PARAM_SLOTS["greedy"]), self.width(self.func.ret), label="greedy")
                self.access.append(Access(frozenset({self.func.ret}), frozenset(), False))
                self.out.greedy = True
            full.calls = place_barriers(full.calls, self.access)
            # The same step with a clock around each call (picc bench --profile); its counters
            # get memory only when the runtime profiles (profile_slots i64 per thread).
            counters = len(self.out.buffers)
            self.out.buffers.append({"kind": "profile", "slots": profile_slots(len(full.calls))})
            profiled = full.profiled(counters)
            self.out.programs += [full, profiled]
            self.out.stages.append({"step": full.name, "prefill": prefill_symbol if head & set(stage.cpu)
                                    else full.name,
                                    "profile": {"step": profiled.name, "buffer": counters,
                                                "calls": [[c.kernel.symbol, c.label] for c in full.calls]}})
        self.decode_loop()
        self.prefill_programs()
        self.logits_programs()
        ret = self.activation(self.func.ret)  # a GPU's logits are copied here
        self.out.buffers[self.act_index]["nbytes"] = self.arena
        self.out.buffers[self.scratch_index]["nbytes"] = self.scratch
        self.out.logits = {"buffer": ret.index, "offset": ret.offset, "n": self.width(self.func.ret)}
        for v in sorted(crossing_values(self.sched)):
            b = self.values[v]
            self.out.values[v] = {"buffer": b.index, "offset": b.offset, "nbytes": bytes_one_token(self.types[v])}
        return self.out

    def decode_loop(self) -> None:
        """``picc_decode``: greedy decode steps in a loop in generated code (:class:`GreedyLoop`),
        for a model whose one stage is the CPU's and computes the greedy token. The table entry
        ``step`` (kind ``function``) is the address of the step it runs, set by the runtime: the
        plain step, or its profiled twin."""
        if len(self.out.stages) != 1 or not self.out.greedy:
            return
        step = len(self.out.buffers)
        self.out.buffers.append({"kind": "function", "name": "the decode step"})
        out = self._alloc_slot("greedy tokens", 4 * DECODE_CAPACITY)
        self.out.programs.append(GreedyLoop(DECODE_SYMBOL, step, PARAMS, out, SYNC, tuple(PARAM_SLOTS.items())))
        self.out.decode = {"symbol": DECODE_SYMBOL, "step": step, "out": out, "capacity": DECODE_CAPACITY}

    def prefill_programs(self) -> None:
        """``picc_prefill_chunk``: the step without its head for up to PREFILL_CHUNK prompt tokens
        at positions ``pos ..`` (tokens in their own buffer, ``seq`` a parameter), for the KV
        caches they leave behind; one program per stage with CPU ops (see :meth:`_chunk_programs`).

        Linears become GEMMs and norms, rope, attention and adds take the chunk's rows at once;
        the fused FFNs take the chunk too, each token with its own active set; the predictors (small)
        and the merges are per-token kernels called once per token inside the program.
        """
        head = set(self.sched.head)
        self.out.prefill = self._chunk_programs(PREFILL_SYMBOL, None, head)

    def logits_programs(self) -> None:
        """``picc_logits_chunk``: the whole step, head included, for up to PREFILL_CHUNK tokens
        like the prefill programs, leaving each token's logits in its row of the chunk's buffer:
        the logits of every position (``picc logits``) in chunks instead of token by token."""
        self.out.logits_chunk = self._chunk_programs(LOGITS_SYMBOL, self.func.ret, set())

    def _chunk_programs(self, symbol: str, result: str | None, skip: set[str]) -> dict:
        """The module's ops but ``skip`` for a chunk of tokens, stage by stage: the CPU's ops of
        each stage as program ``symbol`` (``symbol_<i>`` when the step has several stages) and,
        for the runtime, what the GPU's ops of the stage read and leave behind.

        The GPU's kernels see one token, so the runtime runs a stage's GPU ops token by token
        while the CPU's program takes the whole chunk. Values live in the chunk's buffer, one row
        per token, on the host; the GPU's activation slots hold one token, so each of the GPU's
        tokens first uploads what its ops read from earlier stages (``gpu_in``) and afterwards
        downloads what later stages read (``gpu_out``). A stage's GPU rows stay untouched by its
        CPU program, which runs meanwhile. ``result`` (a value whose rows the caller reads
        afterwards) keeps its rows to the end. The chunk programs share their buffers (one runs
        at a time)."""
        args = {a.name for a in self.func.args}
        plan = plan_chunk(self.func, self.sched, result, skip)
        ops = {op.result: op for op in self.func.ops}
        if self.chunk_slots is None:
            self.chunk_slots = (self._alloc_slot("chunk activations"),
                                self._alloc_slot("chunk tokens", 4 * PREFILL_CHUNK))
        self.chunk = ChunkRegions(*self.chunk_slots, PREFILL_CHUNK, self.types, plan.last_read)
        out_stages = []
        for i, (gpu, cpu) in enumerate(plan.stages):
            for v in plan.gpu_out[i]:
                self.chunk.place(v)
            self.xi16_holds = None
            self.program = Program(symbol if len(plan.stages) == 1 else f"{symbol}_{i}", sync=SYNC)
            self.access = []
            for n in cpu:
                self.lower(ops[n])
                self.chunk.release(plan.cpu_event[n])
            program = None
            if self.program.calls:
                self.program.calls = place_barriers(self.program.calls, self.access)
                self.out.programs.append(self.program)
                program = self.program.name
            out_stages.append({"cpu": program, "gpu": gpu, "gpu_args": [v for v in plan.gpu_in[i] if v in args],
                               "gpu_in": [self.chunk.rows(v) for v in plan.gpu_in[i] if v not in args],
                               "gpu_out": [self.chunk.rows(v) for v in plan.gpu_out[i]]})
            self.chunk.release(plan.end_event[i])
        arena = self.out.buffers[self.chunk.index]
        arena["nbytes"] = max(arena["nbytes"], self.chunk.nbytes)
        info: dict = {"stages": out_stages, "tokens": self.chunk.tokens, "chunk": PREFILL_CHUNK}
        if result:
            where = self.chunk.get(result)
            if where.stride != 4 * self.width(result):
                raise PiccError(f"codegen_cpu: %{result}'s rows in the chunk are not f32 rows back to back")
            info["logits"] = {"buffer": where.index, "offset": where.offset, "n": self.width(result)}
        self.chunk = None
        return info


def lower_module(module: Module, weights: WeightStore, sched: Schedule, ctx: int) -> CpuProgram:
    """The CPU step programs of ``module`` (scheduled by ``sched``) with KV caches for ``ctx`` positions."""
    return _Lowering(module, weights, sched, ctx).run()
