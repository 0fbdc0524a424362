"""Lowering the GPU ops of a fused, placed module to kernel launches bound to the memory plan.

Every GPU op names its kernel (``select-kernels``); here each op becomes the launches that
compute it -- usually that one kernel; attention first appends the token's keys and values to
the cache, unless its k rope's launch does (``appended_by_rope``), then runs one kernel (or five
with scratch where the cache is too long for that one); a predictor-mode FFN part first compacts
its mask columns into an index list, a whole FFN layer with a down bias adds it after; an ``add``
whose ``accumulated_by`` names an operand launches nothing, since that operand's producer runs
the variant of its kernel that reads the residual (``r``) and writes the add's result; a rope
``launched_with`` another launches nothing, the other's launch (``rope_pair``) rotates both --
and every parameter of every launch is bound to a
place in the GPU arena of the memory plan: a weight's plane (``runtime.gpu_layout``), a value's
slot in the activations, a constant, a KV cache, or a scratch buffer in the workspace (where
``memory_plan.gpu_scratch`` says). A binding is ``{"offset", "shape", "dtype"}``: the runtime makes
a tensor view of the arena from it, nothing more.

Kernels of the same name are the same kernel (the 30 layers of SmolLM2 share one attention
kernel); a split layer's hot part has its own neuron count and so its own FFN kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from picc import kernel_names as names
from picc.codegen_cuda import dense, ffn, greedy, layers
from picc.codegen_cuda.kernel import Kernel
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN, Merge
from picc.ir.module import Module
from picc.ir.sparse_ops import Predict
from picc.ir.types import Placement, TensorType
from picc.ir.weights import WeightStore
from picc.placement import memory_plan as mp
from runtime import gpu_layout
from runtime.contracts import GREEDY_LAUNCH, Binding, Call
from runtime.plan import GREEDY


@dataclass
class GpuProgram:
    """The distinct kernels, the calls of each GPU op (in order), and the f32 constants the
    kernels read (rotary frequencies, thresholds) by plan buffer name."""

    kernels: dict[str, Kernel] = field(default_factory=dict)
    launches: dict[str, list[Call]] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)


class _Binder:
    """Where each kernel parameter of one op lives in the plan's GPU arena."""

    def __init__(self, plan: mp.MemoryPlan, weights: WeightStore, types: dict[str, TensorType],
                 weight_types: dict[str, TensorType]) -> None:
        self.weights, self.types, self.weight_types = weights, types, weight_types
        self.buffers = {b.name: b for b in plan.buffers if b.device == "gpu"}
        self.plan = plan

    def _buffer(self, name: str) -> mp.Buffer:
        if name not in self.buffers:
            raise PiccError(f"codegen_cuda: the memory plan has no GPU buffer {name!r}")
        return self.buffers[name]

    def weight(self, name: str, prefix: str, kernel: Kernel) -> list[Binding]:
        """Bindings of the kernel parameters ``prefix``, ``prefix_qs``, ... to weight ``name``'s planes."""
        t = self.weights[name]
        base = self._buffer(name).offset
        out = []
        for plane in gpu_layout.planes(t.dtype.value, t.shape):
            p = kernel.param(prefix + plane.suffix)
            out.append(_binding(kernel, p.name, base + plane.offset, plane.nbytes))
        return out

    def vector(self, name: str, param: str, kernel: Kernel) -> Binding:
        """A weight of one plane (a vector, or an f32 / f16 matrix) bound to ``param``."""
        (binding,) = self.weight(name, param, kernel)
        return binding

    def value(self, name: str, param: str, kernel: Kernel) -> Binding:
        if name not in self.plan.activation_offsets:
            raise PiccError(f"codegen_cuda: %{name} has no slot in the GPU activations")
        at = self._buffer("activations").offset + self.plan.activation_offsets[name]
        return _binding(kernel, param, at, mp.tensor_bytes(self.types[name], 1))

    def constant(self, name: str, param: str, kernel: Kernel) -> Binding:
        b = self._buffer(name)
        return _binding(kernel, param, b.offset, b.nbytes)

    def kv(self, op: O.Attention, part: str, param: str, kernel: Kernel) -> Binding:
        """``op``'s keys (``part`` "k") or values ("v") in its KV cache: the k rows of every
        position, then the v rows (narrower where ``v_head_dim`` is: ``memory_plan.kv_cache_bytes``)."""
        b = self._buffer(f"kv.{op.cache}")
        k_bytes = mp.kv_cache_bytes(op, self.plan.ctx, "k")
        at, room = (0, k_bytes) if part == "k" else (k_bytes, b.nbytes - k_bytes)
        return _binding(kernel, param, b.offset + at, room)

    def scratch(self, op: Op, kernel: Kernel, params: tuple[str, ...], slots: tuple[str, ...] = ()) -> list[Binding]:
        """Kernel parameters ``params`` bound to the op's workspace buffers of the same names (or
        of the names ``slots``), laid out as ``memory_plan.gpu_scratch`` says."""
        layout, at = {}, 0
        for name, nbytes in mp.gpu_scratch(op, self.plan.ctx, self.weight_types):
            at = gpu_layout.aligned(at)
            layout[name] = (at, nbytes)
            at += nbytes
        base = self._buffer("workspace").offset
        return [_binding(kernel, p, base + layout[slot][0], layout[slot][1])
                for p, slot in zip(params, slots or params, strict=True)]


def _binding(kernel: Kernel, param: str, offset: int, room: int) -> Binding:
    """Parameter ``param`` of ``kernel`` at arena ``offset``, which must hold its bytes (``room``)."""
    p = kernel.param(param)
    if p.nbytes > room:
        raise PiccError(f"codegen_cuda: {kernel.name}.{param} needs {p.nbytes} bytes but the plan gives it {room}")
    if offset % gpu_layout.PLANE_ALIGN:
        raise PiccError(f"codegen_cuda: {kernel.name}.{param} would start at a misaligned offset {offset}")
    return Binding(p.name, offset, p.shape, p.dtype)


class _Lowering:
    def __init__(self, module: Module, weights: WeightStore, plan: mp.MemoryPlan) -> None:
        func = module.function()
        self.weights, self.ctx = weights, plan.ctx
        self.types = func.value_types()
        self.bind = _Binder(plan, weights, self.types, module.weight_types())
        self.out = GpuProgram()
        # A producer's result -> (the add whose residual add its kernel does, the residual).
        # A rope whose launch rotates a later one too -> that later rope (``launched_with``).
        self.second_rope = {op.launched_with: op for op in func.ops
                            if isinstance(op, O.Rope) and op.launched_with is not None}
        # The rope of k -> the attention whose cache rows its launch writes (``appended_by_rope``).
        self.appends = {op.k: op for op in func.ops if isinstance(op, O.Attention) and op.appended_by_rope}
        self.residual: dict[str, tuple[str, str]] = {
            add.accumulated[0]: (add.result, add.accumulated[1]) for add in func.ops
            if isinstance(add, O.Add) and add.accumulated is not None and add.type.placement == Placement.GPU}

    def rope_pair(self, first: O.Rope, second: O.Rope, name: str) -> None:
        """Two ropes of the same rotation in one launch (``launched_with``), which also writes the
        KV cache rows of the attention they feed when that is ``appended_by_rope``."""
        b = self.bind
        att = self.appends.get(second.result)
        ctx, v_width = (self.ctx, self.width(att.v)) if att is not None else (None, None)
        k = self.kernel(name, lambda: layers.rope_pair(name, first.n_heads, second.n_heads, first.head_dim,
                                                       first.rotated, first.style, ctx, v_width))
        self.out.constants[f"rope.{first.result}"] = layers.rope_table(first)
        v = [b.value(att.v, "v", k)] if att is not None else []
        caches = [b.kv(att, "k", "k_cache", k), b.kv(att, "v", "v_cache", k)] if att is not None else []
        self.launch(first, k, [b.value(first.x, "x1", k), b.value(second.x, "x2", k), *v, b.value(first.pos, "pos", k),
                               b.constant(f"rope.{first.result}", "inv_freq", k), b.value(first.result, "y1", k),
                               b.value(second.result, "y2", k), *caches])

    def greedy_next(self, logits: str) -> None:
        """The greedy decode loop's kernel after a step (``picc.codegen_cuda.greedy``), launched by
        the runtime under ``GREEDY_LAUNCH``: the step's logits in, the next step's ``tokens`` and
        ``pos`` slots and the plan's ``greedy`` buffer out."""
        vocab = self.width(logits)
        name = names.gpu_greedy_next(vocab, self.ctx)
        k = self.kernel(name, lambda: greedy.greedy_next(name, vocab, self.ctx))
        b, state = self.bind, self.bind.buffers[GREEDY]
        self.out.launches[GREEDY_LAUNCH] = [Call(k.name, (
            b.value(logits, "logits", k), b.value("tokens", "tokens", k), b.value("pos", "pos", k),
            _binding(k, "state", state.offset, state.nbytes)))]

    def result(self, op: Op, param: str, kernel: Kernel) -> Binding:
        """Where ``op``'s kernel writes: its result's slot, or the add's it does the residual add of."""
        added = self.residual.get(op.result)
        return self.bind.value(added[0] if added else op.result, param, kernel)

    def residual_arg(self, op: Op, kernel: Kernel) -> list[Binding]:
        """The residual ``r`` that ``op``'s kernel adds, if it does an add's work."""
        added = self.residual.get(op.result)
        return [self.bind.value(added[1], "r", kernel)] if added else []

    def kernel(self, name: str, make: Callable[[], Kernel]) -> Kernel:
        if name not in self.out.kernels:
            self.out.kernels[name] = make()
        return self.out.kernels[name]

    def launch(self, op: Op, kernel: Kernel, args: list[Binding]) -> None:
        if [a.param for a in args] != [p.name for p in kernel.params]:
            raise PiccError(f"codegen_cuda: %{op.result}: {kernel.name} takes {[p.name for p in kernel.params]}, "
                            f"bound {[a.param for a in args]}")
        self.out.launches.setdefault(op.result, []).append(Call(kernel.name, tuple(args)))

    def width(self, value: str) -> int:
        return int(self.types[value].shape[-1])

    def fmt(self, weight: str) -> str:
        return self.weights[weight].dtype.value

    def lower(self, op: Op) -> None:  # noqa: C901 - one case per op
        b = self.bind
        name = op.kernel
        if name is None:
            raise PiccError(f"codegen_cuda: %{op.result} names no kernel; run select-kernels first")
        match op:
            case O.Embed():
                vocab, dim = (int(d) for d in self.weights[op.table].shape)
                k = self.kernel(name, lambda: dense.embed(name, 1, vocab, dim, self.fmt(op.table), op.scale))
                self.launch(op, k, [*b.weight(op.table, "W", k), b.value(op.tokens, "tokens", k),
                                    b.value(op.result, "y", k)])
            case O.Linear():
                rows, cols = (int(d) for d in self.weights[op.weight].shape)
                k = self.kernel(name, lambda: dense.gemv(name, rows, cols, self.fmt(op.weight), op.bias is not None,
                                                         op.result in self.residual))
                bias = [b.vector(op.bias, "b", k)] if op.bias else []
                self.launch(op, k, [*b.weight(op.weight, "W", k), b.value(op.x, "x", k), *bias,
                                    *self.residual_arg(op, k), self.result(op, "y", k)])
            case O.RMSNorm():
                # Grouped: the token's runs of group elements are the kernel's rows.
                rows, width = (self.width(op.x) // op.group, op.group) if op.group else (1, self.width(op.x))
                k = self.kernel(name, lambda: layers.rms_norm(name, rows, width, op.eps))
                self.launch(op, k, [b.value(op.x, "x", k), b.vector(op.weight, "w", k), b.value(op.result, "y", k)])
            case O.LayerNorm():
                k = self.kernel(name, lambda: layers.layer_norm(name, 1, self.width(op.x), op.eps, op.bias is not None))
                bias = [b.vector(op.bias, "b", k)] if op.bias else []
                self.launch(op, k, [b.value(op.x, "x", k), b.vector(op.weight, "w", k), *bias,
                                    b.value(op.result, "y", k)])
            case O.Rope() if op.launched_with is not None:
                pass  # rotated by the launch of the rope it names
            case O.Rope() if op.result in self.second_rope:
                self.rope_pair(op, self.second_rope[op.result], name)
            case O.Rope():
                k = self.kernel(name, lambda: layers.rope(name, 1, op.n_heads, op.head_dim, op.rotated, op.style))
                self.out.constants[f"rope.{op.result}"] = layers.rope_table(op)
                self.launch(op, k, [b.value(op.x, "x", k), b.value(op.pos, "pos", k),
                                    b.constant(f"rope.{op.result}", "inv_freq", k), b.value(op.result, "y", k)])
            case O.ConcatHeads():
                heads = (self.width(op.a) // op.a_dim, op.a_dim, self.width(op.b) // op.b_dim, op.b_dim)
                k = self.kernel(name, lambda: layers.concat_heads(name, 1, op.n_heads, *heads))
                self.launch(op, k, [b.value(op.a, "a", k), b.value(op.b, "b", k), b.value(op.result, "y", k)])
            case O.Attention():
                self.attention(op, name)
            case O.Add() if op.accumulated is not None:
                pass  # its residual add is done by the kernel of its operand's producer
            case O.Add():
                k = self.kernel(name, lambda: layers.add(name, 1, self.width(op.result)))
                self.launch(op, k, [b.value(op.a, "a", k), b.value(op.b, "b", k), b.value(op.result, "y", k)])
            case O.Softcap():
                k = self.kernel(name, lambda: layers.softcap(name, 1, self.width(op.result), op.cap))
                self.launch(op, k, [b.value(op.x, "x", k), b.value(op.result, "y", k)])
            case Merge():
                k = self.kernel(name, lambda: layers.merge(name, self.width(op.result), op.bias is not None,
                                                           op.result in self.residual))
                bias = [b.vector(op.bias, "bias", k)] if op.bias else []
                self.launch(op, k, [b.value(op.a, "a", k), b.value(op.b, "b", k), *bias, *self.residual_arg(op, k),
                                    self.result(op, "y", k)])
            case Predict():
                self.predict(op, name)
            case FusedFFN():
                self.fused_ffn(op, name)
            case _:
                raise PiccError(f"codegen_cuda: op {op.NAME} (%{op.result}) has no GPU kernel")

    def attention(self, op: O.Attention, name: str) -> None:
        b = self.bind
        width, v_width = self.width(op.k), self.width(op.v)  # v narrower where v_head_dim is
        if not op.appended_by_rope:  # else the launch that rotates k writes the cache rows
            append = names.gpu_kv_append(width, self.ctx, v_width)
            ka = self.kernel(append, lambda: layers.kv_append(append, 1, width, self.ctx, v_width))
            self.launch(op, ka, [b.value(op.k, "k", ka), b.value(op.v, "v", ka), b.value(op.pos, "pos", ka),
                                 b.kv(op, "k", "k_cache", ka), b.kv(op, "v", "v_cache", ka)])
        shape = (op.n_heads, op.n_kv_heads, op.head_dim, self.ctx, op.scale, op.window, op.softcap,
                 op.sinks is not None, op.v_dim)
        # One launch where the head's scores fit in shared memory; else five, through scratch.
        fused = layers.attention_decode_fits(self.ctx)
        if fused:
            k = self.kernel(name, lambda: layers.attention_decode(name, *shape))
        else:
            k = self.kernel(name, lambda: layers.attention(name, 1, *shape))
        scratch = [] if fused else b.scratch(op, k, ("scores", "smax", "ssum", "probs"))
        sinks = [b.vector(op.sinks, "sinks", k)] if op.sinks else []
        self.launch(op, k, [b.value(op.q, "q", k), b.value(op.pos, "pos", k), b.kv(op, "k", "k_cache", k),
                            b.kv(op, "v", "v_cache", k), *sinks, *scratch, b.value(op.result, "out", k)])

    def predict(self, op: Predict, name: str) -> None:
        b = self.bind
        rank, hidden = (int(d) for d in self.weights[op.fc1].shape)
        n = int(self.weights[op.fc2].shape[0])
        if self.fmt(op.fc1) != self.fmt(op.fc2):
            raise PiccError(f"%{op.result}: the GPU predictor kernel needs fc1 and fc2 in one format")
        k = self.kernel(name, lambda: dense.predictor(name, hidden, rank, n, self.fmt(op.fc1), op.fc1_bias is not None,
                                                      op.fc2_bias is not None))
        self.out.constants[f"threshold.{op.result}"] = np.array([op.threshold], np.float32)
        biases = ([b.vector(op.fc1_bias, "b1", k)] if op.fc1_bias else []) + \
                 ([b.vector(op.fc2_bias, "b2", k)] if op.fc2_bias else [])
        self.launch(op, k, [*b.weight(op.fc1, "fc1", k), *b.weight(op.fc2, "fc2", k), b.value(op.x, "x", k),
                            b.constant(f"threshold.{op.result}", "threshold", k), *biases,
                            *b.scratch(op, k, ("hid",)), b.value(op.result, "mask", k)])

    def fused_ffn(self, op: FusedFFN, name: str) -> None:
        b = self.bind
        n, hidden = (int(d) for d in self.weights[op.down].shape)
        fmt = self.fmt(op.down)
        # The residual add, if the FFN does one: in its kernel, or in the down bias's after it.
        residual = op.result in self.residual and op.down_bias is None

        def out(k: Kernel) -> list[Binding]:
            """The residual the FFN kernel adds (if it does) and where it writes: the result, or
            the partial sum a bias is added to."""
            if op.down_bias is None:
                return [*self.residual_arg(op, k), self.result(op, "y", k)]
            return b.scratch(op, k, ("y",), ("partial",))
        bias = op.up_bias is not None or op.gate_bias is not None or op.up_gate_bias is not None
        if op.mode == "gate-first":
            assert op.gate is not None and op.up is not None
            k = self.kernel(name, lambda: ffn.gate_first_ffn(name, hidden, n, op.form, fmt, residual))
            self.out.constants[f"threshold.{op.result}"] = np.array([op.threshold], np.float32)
            if op.score_scale is None:  # the kernel always scales: by ones, unscaled (CATS)
                self.out.constants[f"score_scale.{op.result}"] = np.ones(n, np.float32)
                scale = b.constant(f"score_scale.{op.result}", "score_scale", k)
            else:
                scale = b.vector(op.score_scale, "score_scale", k)
            self.launch(op, k, [b.value(op.x, "x", k), b.constant(f"threshold.{op.result}", "threshold", k), scale,
                                *b.weight(op.gate, "gate", k), *b.weight(op.up, "up", k),
                                *b.weight(op.down, "down", k), *out(k)[:-1], *b.scratch(op, k, ("g", "u", "y_part")),
                                out(k)[-1]])
        else:
            rows = op.up_gate or op.up
            assert rows is not None
            ug_bias = op.up_gate_bias or op.up_bias
            if op.mode == "predictor":
                assert op.mask is not None
                n_pad = gpu_layout.padded_rows(n)
                cname = names.gpu_compact(n, op.neuron_offset)
                kc = self.kernel(cname, lambda: dense.compact(cname, n, n_pad, op.neuron_offset))
                self.launch(op, kc, [b.value(op.mask, "mask", kc), *b.scratch(op, kc, ("idx", "count"))])
                k = self.kernel(name, lambda: ffn.sparse_ffn(name, hidden, n, op.form, fmt, n_pad=n_pad, bias=bias,
                                                             residual=residual))
                head = [b.value(op.x, "x", k), *b.scratch(op, k, ("idx", "count"))]
            else:
                k = self.kernel(name, lambda: ffn.dense_ffn(name, hidden, n, op.form, fmt, bias=bias,
                                                            residual=residual))
                head = [b.value(op.x, "x", k)]
            tail = [b.vector(ug_bias, "b_ug", k)] if ug_bias else []
            self.launch(op, k, [*head, *b.weight(rows, "W_ug", k), *b.weight(op.down, "down", k), *tail,
                                *out(k)[:-1], *b.scratch(op, k, ("ug", "y_part")), out(k)[-1]])
        if op.down_bias is not None:
            added = op.result in self.residual
            bname = names.gpu_bias_add(hidden, added)
            kb = self.kernel(bname, lambda: ffn.bias_add(bname, hidden, added))
            self.launch(op, kb, [*b.scratch(op, kb, ("x",), ("partial",)), b.vector(op.down_bias, "b", kb),
                                 *self.residual_arg(op, kb), self.result(op, "y", kb)])


def lower_gpu(module: Module, weights: WeightStore, plan: mp.MemoryPlan,
              advance: Callable[[float], None] | None = None) -> GpuProgram:
    """The kernels and launches of every op ``module`` places on the GPU (see the module docstring);
    ``advance(1)`` after each (a progress bar's)."""
    lowering = _Lowering(module, weights, plan)
    for op in module.function().ops:
        if op.type.placement == Placement.GPU:
            lowering.lower(op)
            if advance is not None:
                advance(1)
    if plan.buffer(GREEDY) is not None:
        lowering.greedy_next(module.function().ret)
    return lowering.out
