"""What the step's lowering and the chunk programs' lowering share: one op to its kernel calls.

:class:`OpLowering` turns an op into calls of CPU kernels appended to :attr:`OpLowering.program`,
with what each call reads and writes (:attr:`OpLowering.access`, for ``place_barriers``). Ops
whose kernels take any number of rows (embedding, norms, rope, joined heads, attention) and the
one-token kernels (merge, predictor) are lowered here, reading and placing values through the
hooks a lowering defines: where a value lives (:meth:`~OpLowering.activation`, :meth:`~OpLowering.value`,
:meth:`~OpLowering.alias`), how many rows a call computes (:meth:`~OpLowering.rows`) and whether
a one-token kernel runs once per row (:meth:`~OpLowering.per_token`). Linears, adds and FFNs
differ between the step (GEMVs, residual adds done by the producer: ``lower_decode``) and a
chunk of tokens (GEMMs: ``lower_chunk``).

Every op names its kernel (``select-kernels``); :meth:`OpLowering.call` checks that the
kernel it calls is that one. The helpers :func:`_x_format`, :func:`_rows8` and :func:`_layout`
read what ``select-kernels`` chose for an op (its ``x_format`` and ``layout``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from picc import kernel_names as names
from picc.codegen_cpu import (
    kernels_attention,
    kernels_batch,
    kernels_dense,
    kernels_ffn,
    kernels_misc,
    kernels_moe,
    rowplanes,
)
from picc.codegen_cpu.buffers import PARAM_SLOTS, PARAMS, SYNC, CpuBuffers
from picc.codegen_cpu.dotplanes import LAYOUT as DOTPLANES
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.program import Access, Buf, Null, Param, Program
from picc.codegen_cpu.rowops import row_bytes
from picc.codegen_cpu.rows8 import LAYOUT as ROWS8
from picc.errors import PiccError
from picc.interpreter import rope_cos_sin
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Function
from picc.ir.sparse_ops import Predict
from picc.ir.weights import WeightStore
from picc.placement.memory_plan import kv_cache_bytes
from picc.placement.schedule import Schedule

# Ops whose kernels have one phase and touch no memory but their operands and result: one may
# start while another is still running on other threads when neither reads or writes what the
# other writes (the q, k and v projections of a layer; the rope of q and of k).
_BARRIER_FREE = (O.Linear, O.Rope, O.ConcatHeads, O.Add, O.RMSNorm, O.LayerNorm, O.Embed)


def _x_format(op: Op) -> str:
    """The x format ``select-kernels`` chose for ``op``'s kernel (``"f32"`` for ops without one)."""
    return op.x_format if isinstance(op, O.MatrixOp) else "f32"


def _moe_counts(op: O.MoE) -> tuple[int, int]:
    """A mixture's router rows (a gated shared expert's gate too) and the experts a token takes
    (its top k and the shared ones): what its kernels' scratch holds per token."""
    return op.n_experts + int(op.shared_gated), op.top_k + op.n_shared


def _rows8(op: Op) -> bool:
    """Whether ``op``'s kernel reads its matrices in the rows8 layout (``layout``: 4-bit ones, a
    q8_0 LM head and the embedding tied to it)."""
    return isinstance(op, O.MatrixOp | O.Embed | O.MoE) and op.layout == "rows8"


def _layout(op: Op) -> str | None:
    """The layout ``op``'s kernel reads its weight matrices in: rows8, or GGUF's rows (None)."""
    return ROWS8 if _rows8(op) else None


def _down_layout(dtype: str) -> str | None:
    """The layout the fused FFN kernels read a neuron-major down projection of ``dtype`` in."""
    return rowplanes.LAYOUT if dtype in rowplanes.DTYPES else None


@dataclass(frozen=True)
class FusedOperands:
    """A fused FFN's weights as its kernels (step or chunk) take them: ``n`` neurons of
    ``hidden`` inputs; up and gate (interleaved rows: gate one row after up), their biases, the
    neuron-major down projection and the predictor's mask (Null in other modes)."""

    n: int
    hidden: int
    up: Buf | Null
    gate: Buf | Null
    down_t: Buf | Null
    up_bias: Buf | Null
    gate_bias: Buf | Null
    mask: Buf | Null
    up_dtype: str
    gate_dtype: str | None
    down_dtype: str
    dense_rows8: bool  # what the op's mode reads whole is in the rows8 layout


class OpLowering(ABC):
    """Lowers ops of ``func`` into :attr:`program`, taking buffers from ``bufs`` (shared by all
    the programs of a module); ``ctx``: the positions the KV caches hold."""

    names_ir_kernels: ClassVar[bool] = True  # each call is the kernel ``select-kernels`` named for its op

    def __init__(self, func: Function, weights: WeightStore, sched: Schedule, ctx: int, bufs: CpuBuffers) -> None:
        self.func, self.weights, self.sched, self.ctx, self.bufs = func, weights, sched, ctx, bufs
        self.types = func.value_types()
        self.uses = func.uses()
        self.ops = {op.result: op for op in func.ops}
        self.program = Program("")
        self.access: list[Access] = []  # per call of self.program

    # --- where values live, and how many rows a call computes: the lowering's own ---------------

    @abstractmethod
    def activation(self, value: str) -> Buf:
        """Where ``value`` is written (placed on first use)."""

    @abstractmethod
    def value(self, name: str) -> Buf:
        """Where ``name``, computed before, is read."""

    @abstractmethod
    def alias(self, value: str, of: str) -> Buf:
        """``value`` lives where ``of`` does (an in-place kernel)."""

    @abstractmethod
    def rows(self) -> Param | int:
        """The tokens a call computes."""

    @abstractmethod
    def tokens(self) -> Buf:
        """The token ids the embedding reads."""

    @abstractmethod
    def per_token(self) -> Param | None:
        """How many times a one-token kernel is called (None: once)."""

    @abstractmethod
    def memory_key(self, value: str) -> str:
        """The name of ``value``'s memory for ``place_barriers``."""

    @abstractmethod
    def linear(self, op: O.Linear) -> None: ...

    @abstractmethod
    def add(self, op: O.Add) -> None: ...

    @abstractmethod
    def dense_ffn(self, op: O.FFN) -> None: ...

    @abstractmethod
    def fused_ffn(self, op: FusedFFN) -> None: ...

    # --- shared ------------------------------------------------------------------------------------

    def begin(self, symbol: str) -> None:
        """Start a new program ``symbol``."""
        self.program = Program(symbol, sync=SYNC)
        self.access = []

    def weight(self, name: str | None, *, as_f32: bool = False, offset: int = 0,
               layout: str | None = None) -> Buf | Null:
        return self.bufs.weight(name, as_f32=as_f32, offset=offset, layout=layout)

    def width(self, value: str) -> int:
        d = self.types[value].shape[-1]
        assert isinstance(d, int)
        return d

    def call(self, op: Op, kernel: Kernel, *args: object, batched: bool = False,
             writes: set[str] | None = None, access: Access | None = None) -> None:
        """Call ``kernel`` for ``op``. A kernel that is not ``batched`` (it sees one token) is
        called :meth:`per_token` times. ``writes``: values it writes besides ``op``'s result.
        ``access``: what the call reads and writes, when it is one of several calls of ``op``
        and not the whole op (:func:`place_barriers` reads it). Where :attr:`names_ir_kernels`,
        ``kernel`` must be the one the op names."""
        if self.names_ir_kernels and op.kernel != kernel.symbol:
            raise PiccError(f"codegen_cpu: %{op.result} names kernel {op.kernel!r} but the CPU computes it with "
                            f"{kernel.symbol!r}" + ("; run select-kernels first" if op.kernel is None else ""))
        repeat = None if batched else self.per_token()
        apart = repeat is not None and self.rows_apart(args)
        self.program.call(kernel, *args, repeat=repeat, label=op.result,  # type: ignore[arg-type]
                          rows_apart=apart)
        if access is None:
            extra = writes or set()  # a residual add's buffer: read, then written
            written = {op.result, op.x} if isinstance(op, O.Rope) else {op.result}  # rope rotates in place
            access = Access(frozenset(set(op.values()) | extra), frozenset(written | extra),
                            isinstance(op, _BARRIER_FREE))
        key = self.memory_key
        self.access.append(Access(frozenset(map(key, access.reads)), frozenset(map(key, access.writes)),
                                  access.barrier_free and (repeat is None or apart)))

    def rows_apart(self, args: tuple[object, ...]) -> bool:
        """Whether a kernel called per token with ``args`` touches nothing another token's call
        writes (:meth:`Program.call`): never for a prompt's tokens, which write the KV cache the
        next one reads."""
        return False

    def rope_tables(self, op: O.Rope) -> tuple[Buf, Buf]:
        """The cosines and sines of ``op``'s angles at every position of the context, f32 [ctx,
        rotary_dim / 2] each, as the interpreter computes them; one pair for all the ropes that
        rotate alike (every layer's q and k, as a rule). They take ``ctx * rotary_dim`` floats,
        less than one layer's KV cache."""
        key = hashlib.sha256(op.inv_freq().tobytes() + np.float32(op.attention_factor).tobytes()).hexdigest()[:16]
        cos, sin = f"cpu.rope.cos.{key}", f"cpu.rope.sin.{key}"
        if cos not in self.bufs.extra:
            for name, table in zip((cos, sin), rope_cos_sin(op, np.arange(self.ctx)), strict=True):
                self.bufs.array(name, table)
        return self.bufs.tensor_buffer(cos), self.bufs.tensor_buffer(sin)

    def kv_rows(self, op: O.Attention) -> tuple[Buf, Buf]:
        """Where ``op`` finds its KV cache's k and v (ctx rows of each KV head's k, head after head,
        then the same of v, ``v_head_dim`` elements a row, in its ``kv_format``), one cache shared by
        the step and the chunk programs."""
        k_nbytes = kv_cache_bytes(op, self.ctx, "k")
        caches = self.bufs.kv_cache(op.cache, k_nbytes + kv_cache_bytes(op, self.ctx, "v"), 2 * op.n_kv_heads, k_nbytes)
        return caches, Buf(caches.index, k_nbytes)

    def position(self) -> Param:
        """The position of the (first) token a call computes."""
        return Param(PARAMS, PARAM_SLOTS["pos"])

    def batched_linear(self, op: O.Linear, y: Buf, accumulate: int) -> tuple[Kernel, tuple[object, ...]]:
        """The batched twin of ``op``'s step kernel (``kernels_batch.gemv_rows``) and its arguments
        but the trailing rows and strides, writing ``y``: the batch step's rows and the prefill's
        tokens call it alike."""
        w = self.weights[op.weight]
        return (kernels_batch.gemv_rows(w.dtype.value, _x_format(op), _rows8(op)),
                (self.weight(op.weight, layout=_layout(op)), self.value(op.x), self.weight(op.bias, as_f32=True), y,
                 int(w.shape[0]), int(w.shape[1]), accumulate))

    def batched_dense_ffn(self, op: O.FFN, y: Buf, accumulate: int, rows: int) -> tuple[Kernel, tuple[object, ...]]:
        """:meth:`batched_linear` for a dense FFN (``kernels_batch.dense_ffn_rows``), with scratch
        for up to ``rows`` rows."""
        up = self.weights[op.up]
        n, hidden = int(up.shape[0]), int(up.shape[1])
        gate = self.weights[op.gate].dtype.value if op.gate else None
        kernel = kernels_batch.dense_ffn_rows(op.form, up.dtype.value, gate, self.weights[op.down].dtype.value,
                                              _x_format(op), _rows8(op))
        scratch = self.bufs.need_scratch(kernels_batch.dense_ffn_rows_scratch_bytes(n, rows))
        layout = _layout(op)
        return kernel, (self.value(op.x), self.weight(op.up, layout=layout), self.weight(op.gate, layout=layout),
                        self.weight(op.down, layout=layout), self.weight(op.up_bias, as_f32=True),
                        self.weight(op.gate_bias, as_f32=True), self.weight(op.down_bias, as_f32=True), y, scratch,
                        n, hidden, accumulate)

    def attention(self, op: O.Attention) -> None:
        k_rows, v_rows = self.kv_rows(op)
        softcap, sinks = self.attention_extras(op)
        self.call(op, kernels_attention.attention(op.kv_format, bool(softcap), bool(sinks)), self.value(op.q),
                  self.value(op.k), self.value(op.v), k_rows, v_rows, self.activation(op.result), self.rows(),
                  self.position(), op.n_heads, op.n_kv_heads, op.head_dim, op.v_dim, float(op.scale), op.window or 0,
                  self.ctx, *softcap, *sinks, batched=True)

    def attention_extras(self, op: O.Attention) -> tuple[tuple[float, ...], tuple[Buf | Null, ...]]:
        """The trailing arguments of ``op``'s attention kernel (one-row or batch rows): its soft
        cap and its sinks' buffer (f32), each where the op has it."""
        softcap = (float(op.softcap),) if op.softcap is not None else ()
        return softcap, (self.weight(op.sinks, as_f32=True),) if op.sinks is not None else ()

    def moe(self, op: O.MoE) -> None:
        """A mixture of experts, a call per token (its router's choice is the token's own)."""
        kernel, n, hidden = self.moe_kernel(op, kernels_moe.moe)
        scratch = self.bufs.need_scratch(kernels_moe.moe_scratch_bytes(*_moe_counts(op), n))
        self.call(op, kernel, self.value(op.x), self.weight(op.router), *self.experts(op), self.activation(op.result),
                  scratch, op.n_experts, op.top_k, n, hidden, int(op.norm_topk), *self.moe_extras(op))

    def batched_moe(self, op: O.MoE, rows: int) -> tuple[Kernel, tuple[object, ...]]:
        """``op``'s many-token kernel (``kernels_moe.moe_chunk``) and its arguments but the trailing
        rows and strides, with scratch for up to ``rows`` rows: the prefill's tokens and the batch
        step's rows call it alike."""
        kernel, n, hidden = self.moe_kernel(op, kernels_moe.moe_chunk)
        scratch = self.bufs.need_scratch(kernels_moe.moe_chunk_scratch_bytes(*_moe_counts(op), n, hidden, rows))
        return kernel, (self.value(op.x), self.weight(op.router), *self.experts(op), self.activation(op.result),
                        scratch, op.n_experts, op.top_k, n, hidden, int(op.norm_topk), *self.moe_extras(op))

    def moe_extras(self, op: O.MoE) -> tuple[object, ...]:
        """The arguments of the kernel's variant (``kernels_moe.moe_params``): gpt-oss's biases and
        clamped SwiGLU's constants, the count of shared experts, the choice bias, DeepSeek's
        groups and scale of the routed weights."""
        biases = tuple(self.weight(b, as_f32=True) for b in (op.router_bias, op.up_bias, op.gate_bias, op.down_bias)
                       if b is not None)
        clamp = (float(op.swiglu_alpha), float(op.swiglu_limit)) if op.swiglu_limit is not None else ()
        choice = (self.weight(op.choice_bias, as_f32=True),) if op.choice_bias is not None else ()
        groups = (op.n_group, op.topk_group) if op.variant.groups else ()
        scale = (float(op.routed_scale),) if op.variant.scaled else ()
        return biases + clamp + ((op.n_shared,) if op.n_shared else ()) + choice + groups + scale

    def moe_kernel(self, op: O.MoE, make: Callable[..., Kernel]) -> tuple[Kernel, int, int]:
        """``make`` (``kernels_moe.moe`` or ``moe_chunk``) for ``op``'s formats and layout, an
        expert's neurons and the hidden size."""
        rows, hidden = (int(d) for d in self.weights[op.up].shape)
        dtype = {w: self.weights[w].dtype.value for w in (op.router, op.up, op.down)}
        gate = self.weights[op.gate].dtype.value if op.gate else None
        kernel = make(op.form, dtype[op.router], dtype[op.up], gate, dtype[op.down], op.x_format, _rows8(op),
                      op.variant)
        return kernel, rows // (op.n_experts + op.n_shared), hidden

    def experts(self, op: O.MoE) -> tuple[Buf | Null, Buf | Null, Buf | Null]:
        """A mixture's up, gate (Null where the form has none) and down matrices, in the layout
        its kernels read: rows8 for the 4-bit ones of a rows8 op."""

        def of(w: str | None) -> Buf | Null:
            four_bit = w is not None and self.weights[w].dtype.value in names.I16_ROWS8_DTYPES
            return self.weight(w, layout=_layout(op) if four_bit else None)

        return of(op.up), of(op.gate), of(op.down)

    def softcap(self, op: O.Softcap) -> None:
        """Capped logits, a call per token."""
        self.call(op, kernels_misc.softcap(), self.value(op.x), self.activation(op.result), self.width(op.result),
                  float(op.cap))

    def lower(self, op: Op) -> None:  # noqa: C901 - one case per op
        pos = self.position()
        match op:
            case O.Embed():
                table = self.weights[op.table]
                scale = (float(op.scale),) if op.scale != 1.0 else ()
                self.call(op, kernels_dense.embed(table.dtype.value, _rows8(op), bool(scale)),
                          self.weight(op.table, layout=_layout(op)), self.tokens(),
                          self.activation(op.result), self.rows(), self.width(op.result), *scale, batched=True)
            case O.RMSNorm():
                group = (op.group,) if op.group is not None else ()
                self.call(op, kernels_misc.rms_norm(op.group is not None), self.value(op.x),
                          self.weight(op.weight, as_f32=True), Null(), self.activation(op.result), self.rows(),
                          self.width(op.x), float(op.eps), *group, batched=True)
            case O.LayerNorm():
                self.call(op, kernels_misc.layer_norm(), self.value(op.x), self.weight(op.weight, as_f32=True),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), self.rows(),
                          self.width(op.x), float(op.eps), batched=True)
            case O.Linear():
                self.linear(op)
            case O.Rope():
                # In place: the rotated value takes its input's buffer (the input has no other reader).
                if self.uses.get(op.x, 0) != 1:
                    raise PiccError(f"codegen_cpu: %{op.x} is read by more than the rope op; cannot rotate in place")
                rotated = self.alias(op.result, op.x)
                cos, sin = self.rope_tables(op)
                self.call(op, kernels_misc.rope(op.style), rotated, cos, sin, self.rows(), pos, op.n_heads,
                          op.head_dim, op.rotated, batched=True)
            case O.ConcatHeads():
                self.call(op, kernels_misc.concat_heads(), self.value(op.a), self.value(op.b),
                          self.activation(op.result), self.rows(), op.n_heads, op.a_dim, op.b_dim,
                          self.width(op.a) // op.a_dim, self.width(op.b) // op.b_dim, batched=True)
            case O.Attention():
                self.attention(op)
            case O.Add():
                self.add(op)
            case O.Softcap():
                self.softcap(op)
            case O.MoE():
                self.moe(op)
            case Merge():
                self.call(op, kernels_misc.merge(), self.value(op.a), self.value(op.b),
                          self.weight(op.bias, as_f32=True), self.activation(op.result), self.width(op.result))
            case Predict():
                fc1, fc2 = self.weights[op.fc1], self.weights[op.fc2]
                rank, hidden = int(fc1.shape[0]), int(fc1.shape[1])
                scratch = self.bufs.need_scratch(kernels_ffn.predictor_scratch_bytes(rank))
                self.call(op, kernels_ffn.predictor(fc1.dtype.value, fc2.dtype.value), self.value(op.x),
                          self.weight(op.fc1), self.weight(op.fc1_bias, as_f32=True), self.bufs.transposed(op.fc2),
                          self.weight(op.fc2_bias, as_f32=True), self.activation(op.result),
                          scratch, hidden, rank, int(fc2.shape[0]), float(op.threshold))
            case FusedFFN():
                self.fused_ffn(op)
            case O.FFN() if not op.neuron_major and type(op) is O.FFN:
                self.dense_ffn(op)
            case _:
                raise PiccError(f"codegen_cpu: op {op.NAME} (%{op.result}) has no CPU kernel")

    def fused_operands(self, op: FusedFFN) -> FusedOperands:
        """The buffers of a fused FFN's weights and mask, as both its kernels take them."""
        down = self.weights[op.down]
        n, hidden = int(down.shape[0]), int(down.shape[1])
        dense_rows8 = _rows8(op)  # for a fused FFN: what its mode reads whole is in the rows8 layout
        planes = DOTPLANES if op.gathered_layout == "dotplanes" else None  # the rows it gathers and dots
        if op.up_gate is not None:
            # Interleaved rows: the gate of neuron i starts one row after its up row.
            dtype = self.weights[op.up_gate].dtype.value
            up, gate = (self.weight(op.up_gate, layout=planes),
                        self.weight(op.up_gate, offset=row_bytes(dtype, hidden), layout=planes))
            up_bias, gate_bias = (self.weight(op.up_gate_bias, as_f32=True),
                                  self.weight(op.up_gate_bias, as_f32=True, offset=4) if op.up_gate_bias else Null())
            up_dtype, gate_dtype = dtype, dtype
        else:
            assert op.up is not None
            whole = names.read_whole(op.mode, op.up, op.gate) if dense_rows8 else ()
            dotted = names.gathered_dotted(op.mode, op.up, op.gate)
            up, gate = (self.weight(w, layout=ROWS8 if w in whole else planes if w in dotted else None)
                        for w in (op.up, op.gate))
            up_bias, gate_bias = self.weight(op.up_bias, as_f32=True), self.weight(op.gate_bias, as_f32=True)
            up_dtype = self.weights[op.up].dtype.value
            gate_dtype = self.weights[op.gate].dtype.value if op.gate else None
        down_t = self.weight(op.down, layout=_down_layout(down.dtype.value))
        mask: Buf | Null = Null()
        if op.mode == "predictor":
            assert op.mask is not None
            m = self.value(op.mask)
            mask = replace(m, offset=m.offset + op.neuron_offset)  # one byte per neuron of the layer
        return FusedOperands(n, hidden, up, gate, down_t, up_bias, gate_bias, mask, up_dtype, gate_dtype,
                             down.dtype.value, dense_rows8)
