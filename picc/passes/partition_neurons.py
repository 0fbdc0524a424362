"""``partition-neurons``: decide what lives on the GPU under a VRAM budget, and record it in the IR.

Options (``PartitionOptions``): ``target`` (a name or YAML path, default ``cpu``; from Python,
a loaded ``Target``), ``vram`` (a size, default the target's VRAM), ``ctx`` (KV-cache
positions, default 512), ``solver`` (``greedy``, the default, or ``ilp``), ``min_split`` (for
the ILP).

The budget is spent in order of what a token reads per byte: dense parts first, since every
token reads all of them (the activations and workspace, then layer by layer the attention
weights, norms, predictors and KV cache, then the LM head); a layer whose dense part does not
fit stays on the CPU with every layer after it (llama.cpp's split). What is left goes to FFN
neurons, chosen by ``picc.placement.partition`` from the profiled frequencies: greedy top-k over all
layers, or the ILP on the cost model (whose CPU reads FFN weights at :func:`ffn_cpu_read_rate`:
the rate its kernels read each format, at most the memory's bandwidth); a layer whose FFN has
no GPU kernel (down-only, dReLU or biased gate-first, mixed weight formats, mxfp4 weights) keeps
all its neurons on the CPU, and so does any other op that reads an mxfp4 weight (gpt-oss's
format, which only the CPU's kernels read), as a mixture of experts does. A split layer's
neurons are permuted so that its GPU ("hot") neurons come first, and it becomes two ffn ops,
``%lN.ffn.out.hot`` on the GPU and ``%lN.ffn.out.cold`` on the CPU, each with its own rows of up / gate /
down, whose outputs are added into the layer's value; its predictor's outputs are permuted to
match. Every op's and weight's type then says ``@gpu`` or ``@cpu``. The exact plan
(``picc.placement.memory_plan``) never exceeds the budget: if rounding makes it, the FFN budget shrinks by
the excess and the neurons are chosen again.

Needs: ``neuron-major-down`` (unless the budget is 0); ``profile-activations`` for sparse
FFNs (dense ``ffn`` layers count every neuron as always active). Guarantees: every op and
weight is placed; the module computes the same function (up to float summation order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from picc import kernel_names
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function, Module, WeightDecl
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import DType, Placement, TensorType
from picc.ir.weights import Tensor, WeightStore
from picc.passes.kernel_selection import gpu_ffn_unsupported
from picc.passes.options import PassOptions, option
from picc.passes.registry import PassContext, register_pass
from picc.placement import memory_plan as mp
from picc.placement.cost_model import cpu_weight_reads, gathered_matrices
from picc.placement.partition import SOLVERS
from picc.placement.partition.problem import DeviceCosts, FfnLayer, PartitionProblem, make_placement
from picc.placement.partition.problem import Placement as NeuronPlacement
from picc.progress import progress_bar
from picc.targets import Target, load_target, parse_size
from runtime.plan import ARENA_ALIGN

GPU, CPU = Placement.GPU, Placement.CPU
_ROW_FIELDS = ("up", "gate", "down", "up_bias", "gate_bias", "freq", "mag", "score_scale")  # indexed by neuron
_PART_TENSORS = 6  # up, gate, down, their biases and down's bias: the aligned tensors of a part


def _target_text(target: Target) -> str:
    return target.source or target.name


@dataclass(frozen=True)
class PartitionOptions(PassOptions):
    """The options of ``partition-neurons`` (see the module's docstring). ``target`` is a loaded
    :class:`Target`: pipeline text names it (a name or a YAML path), which is loaded once, when
    the text is parsed; ``picc compile`` passes the one it loaded."""

    target: Target = option(default_factory=lambda: load_target("cpu"), parse=load_target, show=_target_text,
                            default_text="cpu", kind="name|path")
    vram: str | None = option(None, kind="size")  # None: the target's VRAM
    ctx: int = option(mp.DEFAULT_CTX, at_least=1)
    solver: str = option("greedy", choices=tuple(SOLVERS))
    min_split: int = option(0, at_least=0)

    def check(self) -> None:
        super().check()
        self.target.check_budget(self.budget, str(self.vram), what="vram")

    @property
    def budget(self) -> int:
        """The VRAM budget in bytes: ``vram``, or all of the target's GPU."""
        return self.target.vram_bytes if self.vram is None else parse_size(self.vram, what="vram")


# --- what each FFN layer is, for the partitioner ----------------------------------------------


def ffn_layer(op: O.FFN | FusedFFN, weights: WeightStore, input_on_gpu: bool) -> FfnLayer:
    """The partitioner's view of ``op`` (or, for the report, of a fused FFN part): frequencies,
    bytes per neuron, what is read densely."""
    n = int(weights[op.down if isinstance(op, FusedFFN) else op.up].shape[0])
    fields = ("up", "gate", "up_bias", "gate_bias") + (("up_gate", "up_gate_bias") if isinstance(op, FusedFFN) else ())
    row = {f: (int(weights[getattr(op, f)].data.nbytes) // n if getattr(op, f) else 0) for f in fields}
    down = int(weights[op.down].data.nbytes) // n
    neuron = sum(row.values()) + down
    mode = op.mode if isinstance(op, SparseFFN | FusedFFN) else "dense"
    if mode == "dense":
        freq, dense = np.ones(n, dtype=np.float32), 1.0
    else:
        if op.freq is None:
            raise PiccError(f"%{op.result} has no profiled frequencies; run profile-activations first")
        freq = weights.f32(op.freq)
        dense = {"predictor": 0.0, "gate-first": (row["gate"] + row["gate_bias"]) / neuron,
                 "down-only": (neuron - down) / neuron}[mode]
    formats = {weights[w].dtype.value for w in (op.up, op.gate, getattr(op, "up_gate", None), op.down) if w}
    return FfnLayer(op.result, freq, neuron, input_on_gpu, dense, gpu_ffn_unsupported(op, formats) is None)


def ffn_cpu_read_rate(module: Module, weights: WeightStore, target: Target) -> float:
    """Bytes/s at which the target's CPU reads the module's FFN weights: each weight at
    ``CpuSpec.read_rate`` of the kernel that will read it, averaged over the bytes.

    ``select-kernels`` gives a module that decides no sparsity int16 dot products for 4-bit up
    and gate rows (``x_format = "i16"``); down rows, neuron-major once a layer can be split, are AXPYs; what
    a gate-first or down-only FFN reads whole (gate; gate and up), 4-bit, is read eight rows at a
    time from the rows8 layout (taken as the whole layer's: a split one's CPU part may not come
    in eights); the other matrices of a sparse FFN are read a neuron at a time, at its kernel's
    ``_gathered`` rate. (A CPU-only dense FFN reads the rows8 layout too; its placement has no
    choice to make.)
    """
    ops = module.function().ops
    x_format = "f32" if any(isinstance(op, Predict | SparseFFN) for op in ops) else "i16"

    def rows8(op: O.FFN) -> tuple[str, ...]:
        whole = kernel_names.read_whole(op.mode, op.up, op.gate) if isinstance(op, SparseFFN) else ()
        fits = all(kernel_names.rows8_fits(weights[w].dtype.value, *map(int, weights[w].shape)) for w in whole)
        return whole if fits else ()

    def gathered(op: O.FFN) -> tuple[str, ...]:
        return gathered_matrices(op.mode, op.up, op.gate, op.down) if isinstance(op, SparseFFN) else ()

    reads = [read for op in ops if isinstance(op, O.FFN)
             for read in cpu_weight_reads(weights, (op.up, op.gate, op.down), x_format, axpy=op.down, rows8=rows8(op),
                                          gathered=gathered(op))]
    seconds = target.cpu.read_seconds(reads)
    return sum(nbytes for nbytes, _ in reads) / seconds if seconds > 0 else target.cpu.mem_bandwidth


# --- the dense parts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseChoice:
    """The dense parts on the GPU: the first ``gpu_layers`` layers' attention, norms, predictors
    and KV cache; the output norm and LM head (with a tied embedding) when ``output_on_gpu``."""

    gpu_layers: int
    output_on_gpu: bool

    def layer_on_gpu(self, i: int) -> bool:
        return i < self.gpu_layers


def _tied_embedding(func: Function) -> bool:
    """Whether the embedding table is also the LM head (it must then sit beside the LM head)."""
    first = next((i for i, op in enumerate(func.ops) if op.block is not None), len(func.ops))
    last = max((i for i, op in enumerate(func.ops) if op.block is not None), default=-1)
    before = {w for op in func.ops[:first] for w in op.weights()}
    return any(w in before for op in func.ops[last + 1 :] for w in op.weights())


# --- rewriting the module ----------------------------------------------------------------------


def _placed(t: TensorType, where: Placement) -> TensorType:
    return TensorType(t.dtype, t.shape, where)


def _take(weights: WeightStore, decls: list[WeightDecl], name: str, rows: np.ndarray, suffix: str,
          where: Placement) -> str:
    """A new weight: rows ``rows`` of weight ``name`` (exact: whole rows of its storage)."""
    t = weights[name]
    new = weights.fresh_name(f"{name}.{suffix}")
    weights.add(new, Tensor(t.dtype, (len(rows), *t.shape[1:]), np.ascontiguousarray(t.data[rows])))
    decls.append(WeightDecl(new, _placed(weights[new].type, where)))
    return new


def _split_ffn(op: O.FFN, placement: NeuronPlacement, index: int, input_gpu: bool, weights: WeightStore,
               decls: list[WeightDecl]) -> list[Op]:
    layer = placement.layers[index]
    parts = []
    for suffix, rows, where, offset in (("hot", layer.perm[: layer.hot], GPU, 0),
                                        ("cold", layer.perm[layer.hot :], CPU, layer.hot)):
        fields: dict[str, str | None] = {}
        for f in _ROW_FIELDS:
            name = getattr(op, f)
            meta = f in ("freq", "mag")
            fields[f] = name and _take(weights, decls, name, rows, suffix, CPU if meta else where)
        if op.down_bias is not None:
            fields["down_bias"] = op.down_bias if suffix == "hot" else None
        parts.append(replace(op, result=f"{op.result}.{suffix}", type=_placed(op.type, where), part_of=op.result,
                             neuron_offset=offset, **fields))
    merge = O.Add(result=op.result, type=_placed(op.type, GPU if input_gpu else CPU),
                  a=parts[0].result, b=parts[1].result, block=op.block)
    return [*parts, merge]


def _reads_mxfp4(op: Op, weights: WeightStore) -> bool:
    """Whether ``op`` reads an mxfp4 weight, which no GPU kernel reads."""
    return any(weights[w].dtype == DType.MXFP4 for w in op.weights() if w is not None)


def place(module: Module, weights: WeightStore, dense: DenseChoice, ffns: list[O.FFN],
          placement: NeuronPlacement) -> Module:
    """``module`` with every op and weight placed and split layers permuted and split."""
    func = module.function()
    index = {op.result: i for i, op in enumerate(ffns)}
    hot = {op.result: placement.layers[i].hot for i, op in enumerate(ffns)}
    split = {name for name, i in index.items() if 0 < hot[name] < weights[ffns[i].up].shape[0]}
    first_layer_op = next((i for i, op in enumerate(func.ops) if op.block is not None), 0)
    tied = _tied_embedding(func)
    decls = list(module.weights)
    ops: list[Op] = []
    where_of: dict[str, Placement] = {}  # weight -> where the op reading it runs
    for i, op in enumerate(func.ops):
        layer = op.block
        if layer is not None:
            dense_where = GPU if dense.layer_on_gpu(layer) else CPU
        else:
            before = i < first_layer_op
            dense_where = GPU if dense.output_on_gpu and (not before or tied) else CPU
        if isinstance(op, O.FFN) and op.result in split:
            new = _split_ffn(op, placement, index[op.result], dense_where == GPU, weights, decls)
        elif isinstance(op, O.FFN):
            new = [replace(op, type=_placed(op.type, GPU if hot[op.result] else CPU))]
        elif isinstance(op, O.MoE) or _reads_mxfp4(op, weights):  # no GPU kernel: its weights stay on the CPU
            new = [replace(op, type=_placed(op.type, CPU))]
        elif isinstance(op, Predict) and op.ffn in split:
            perm = placement.layers[index[op.ffn]].perm
            fc2 = _take(weights, decls, op.fc2, perm, "permuted", dense_where)
            bias = op.fc2_bias and _take(weights, decls, op.fc2_bias, perm, "permuted", dense_where)
            new = [replace(op, fc2=fc2, fc2_bias=bias, type=_placed(op.type, dense_where))]
        else:
            new = [replace(op, type=_placed(op.type, dense_where))]
        for n in new:
            for f in n.field_kinds():
                name = getattr(n, f.name)
                if f.kind == "weight" and name is not None and f.name not in ("freq", "mag"):
                    where_of[name] = n.type.placement if where_of.get(name) != GPU else GPU
        ops.extend(new)
    placed_decls = tuple(WeightDecl(d.name, _placed(d.type, d.type.placement or where_of.get(d.name, CPU)))
                         for d in decls)
    args = tuple(replace(a, type=_placed(a.type, CPU)) for a in func.args)
    module = replace(module, weights=placed_decls)
    return module.with_function(replace(func, args=args, ops=tuple(ops))).with_used_weights_only()


class _Trials:
    """Candidate placements of the module and their exact memory plans.

    Trials write their permuted and split weights into a scratch copy of the store (the store
    is append-only, and a trial's names would otherwise take the final placement's).
    """

    def __init__(self, module: Module, weights: WeightStore, s: PartitionOptions) -> None:
        self.module, self.weights, self.s = module, weights, s
        self.ffns = [op for op in module.function().ops if isinstance(op, O.FFN)]
        hidden = int(module.function().value_types()[self.ffns[0].x].shape[1]) if self.ffns else 1
        rate = ffn_cpu_read_rate(module, weights, s.target)
        self.costs = DeviceCosts.for_target(s.target, hidden, cpu_read_rate=rate)
        self.planned: Callable[[int], None] = lambda n: None  # a progress bar's advance, per plan

    def problem(self, dense: DenseChoice, budget: int) -> PartitionProblem:
        layers = tuple(ffn_layer(op, self.weights, dense.layer_on_gpu(op.block or 0))
                       for op in self.ffns)
        return PartitionProblem(layers, budget if self.s.target.gpu else 0, self.costs, self.s.min_split)

    def neurons(self, dense: DenseChoice, hot: list[int] | None = None, budget: int = 0) -> NeuronPlacement:
        """The solver's placement for ``budget`` bytes, or ``hot`` neurons per layer if given."""
        problem = self.problem(dense, budget)
        if hot is not None:
            return make_placement(problem, hot, "fixed")
        return SOLVERS[self.s.solver](problem)

    def plan(self, dense: DenseChoice, neurons: NeuronPlacement | None = None) -> mp.MemoryPlan:
        scratch = WeightStore({name: self.weights[name] for name in self.weights})
        placed = place(self.module, scratch, dense, self.ffns, neurons or self.neurons(dense, [0] * len(self.ffns)))
        s = self.s
        plan = mp.plan_memory(placed, scratch, ctx=s.ctx, budget=s.budget)
        self.planned(1)
        return plan


def _overhead(plan: mp.MemoryPlan) -> int:
    return sum(plan.device_bytes("gpu", kind) for kind in ("activations", "workspace", "constant"))


def decide(trials: _Trials, s: PartitionOptions) -> tuple[DenseChoice, NeuronPlacement]:
    """Spend the budget: dense parts layer by layer, then FFN neurons, then the output."""
    func = trials.module.function()
    n_layers = 1 + max((i for op in func.ops if (i := op.block) is not None), default=-1)
    none = [0] * len(trials.ffns)
    nothing = DenseChoice(0, False)
    if s.target.gpu is None or s.budget == 0:
        return nothing, trials.neurons(nothing, none)
    # Layers' dense parts in order, as many as fit (each adds weights, KV cache, activations).
    base_plan = None
    for k in range(1, n_layers + 1):
        plan = trials.plan(DenseChoice(k, False))
        if plan.gpu_bytes > s.budget:
            dense = DenseChoice(k - 1, False)  # llama.cpp's split: the other layers run on the CPU
            return dense, trials.neurons(dense, none)
        base_plan = plan
    assert base_plan is not None or n_layers == 0
    # FFN neurons with what is left. The activations and workspace depend on which layers end up
    # split or whole; reserve the most that any of those shapes needs, so that the neurons' budget
    # only grows with the VRAM budget (and with it the GPU's share of activations).
    dense = DenseChoice(n_layers, False)
    # Per layer, the neurons the GPU can take (none where its sparsity mode has no GPU kernel).
    n_ff = [la.n_ff if la.gpu_kernel else 0 for la in trials.problem(dense, 0).layers]
    shapes = (none, [min(1, n) for n in n_ff], n_ff)
    reserve = max(_overhead(trials.plan(dense, trials.neurons(dense, hot))) for hot in shapes)
    fixed = base_plan.device_bytes("gpu", "weight") + base_plan.device_bytes("gpu", "kv-cache") if base_plan else 0
    budget = max(0, s.budget - fixed - reserve - len(n_ff) * _PART_TENSORS * ARENA_ALIGN)
    neurons = trials.neurons(dense, budget=budget)
    while (over := trials.plan(dense, neurons).gpu_bytes - s.budget) > 0:  # pragma: no cover - reserve bounds it
        budget = max(0, budget - over)
        neurons = trials.neurons(dense, budget=budget)
    # The output (final norm, LM head) last: one indivisible block, placed once everything else is.
    if list(neurons.hot) == n_ff:
        with_output = DenseChoice(n_layers, True)
        if trials.plan(with_output, neurons).gpu_bytes <= s.budget:
            return with_output, neurons
    return dense, neurons


def _with_attrs(module: Module, s: PartitionOptions) -> Module:
    new = {"target": s.target.name, "vram_budget": s.budget, "ctx": s.ctx,
           "partition_solver": s.solver}
    attrs = tuple((k, v) for k, v in module.attrs if k not in new) + tuple(new.items())
    return replace(module, attrs=attrs)


@register_pass("partition-neurons", options=PartitionOptions)
def partition_neurons(module: Module, ctx: PassContext[PartitionOptions]) -> Module:
    """Place dense parts and the hottest FFN neurons on the GPU under the VRAM budget."""
    s = ctx.options
    if any(op.type.placement is not None or op.kernel is not None or isinstance(op, FusedFFN)
           for op in module.function().ops):
        raise PiccError("the module is already partitioned (or fused); partition-neurons comes before "
                        "fuse-gather-gemv and select-kernels")
    if s.budget > 0 and (op := next((op for op in module.ops() if isinstance(op, O.FFN) and not op.neuron_major),
                                    None)):
        raise PiccError(f"%{op.result}: placing neurons on the GPU needs neuron-major down projections "
                        "(a layer may be split between devices); run neuron-major-down before partition-neurons")
    trials = _Trials(module, ctx.weights, s)
    n_layers = len({op.block for op in module.ops() if op.block is not None})
    # decide() plans memory once per layer whose dense part fits, then about five times more: a
    # 7B's plans take ~0.25 s each.
    if s.budget == 0 or s.target.gpu is None:  # nothing to plan
        dense, neurons = decide(trials, s)
    else:
        with progress_bar(n_layers + 5, "placing under the VRAM budget", "plan") as advance:
            trials.planned = advance
            dense, neurons = decide(trials, s)
    return _with_attrs(place(module, ctx.weights, dense, trials.ffns, neurons), s)
