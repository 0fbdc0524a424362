"""``picc eval``: perplexity on an evaluation corpus, and what sparsity costs against dense.

Perplexity is computed over non-overlapping windows of the tokenized corpus (each starting with
BOS when the tokenizer adds one): ``exp(mean NLL)`` of every token predicted from at least one
token of context. The dense reference is the same module with every ``sparse_ffn`` turned back
into its ``ffn`` (and the predictors dropped), run on the same windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from picc.errors import PiccError
from picc.frontend.tokenizer import Tokenizer
from picc.interpreter import FfnTrace, Interpreter
from picc.ir import ops as O
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Module
from picc.ir.sparse_ops import SparseFFN
from picc.ir.weights import WeightStore


def eval_windows(tokenizer: Tokenizer, corpus: str, max_tokens: int, window: int) -> list[list[int]]:
    """The first ``max_tokens`` tokens of ``corpus``, cut into windows of ``window`` tokens."""
    from picc.sparsity.calib import load_text

    ids = tokenizer.backend.encode(load_text(corpus), add_special_tokens=False).ids
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = window - len(bos)
    windows = [bos + ids[s : s + body] for s in range(0, min(len(ids), max_tokens), body)]
    windows = [w for w in windows if len(w) > len(bos) + 1]
    if not windows:
        raise PiccError(f"corpus {corpus!r} has too little text to evaluate")
    return windows


def densified(module: Module) -> Module:
    """The dense model a sparse module approximates: sparse_ffn -> ffn, a fused FFN computes
    every neuron, predictors removed."""
    func = module.function()
    ops = []
    for op in func.ops:
        if isinstance(op, SparseFFN):
            fields = {f.name: getattr(op, f.name) for f in O.FFN.field_kinds()}
            op = O.FFN(result=op.result, type=op.type, **fields)
        elif isinstance(op, FusedFFN) and op.mode != "dense":
            op = replace(op, mode="dense", mask=None, threshold=0.0, kernel=None)
        ops.append(op)
    return module.with_function(replace(func, ops=tuple(ops)).pruned()).with_used_weights_only()


def token_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of ``-log softmax(logits)[target]`` (float32 pass, float64 sums)."""
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64)) + top[:, 0]
    return float((lse - logits[np.arange(len(targets)), targets]).sum())


@dataclass
class _SparsityCounter:
    """Accumulates, over sparse_ffn executions, how many neurons ran and how well masks did."""

    computed: int = 0
    total: int = 0
    true_positive: int = 0
    predicted: int = 0
    actual: int = 0
    per_layer: dict[str, list[int]] = field(default_factory=dict)

    def __call__(self, trace: FfnTrace) -> None:
        if trace.active is None:
            return
        self.computed += int(trace.active.sum())
        self.total += trace.active.size
        op = trace.op
        if isinstance(op, SparseFFN | FusedFFN) and op.mode == "predictor":
            truth = trace.score > np.float32(op.threshold or 0.0)
            tp = int((truth & trace.active).sum())
            self.true_positive += tp
            self.predicted += int(trace.active.sum())
            self.actual += int(truth.sum())
            layer = op.layer if isinstance(op, FusedFFN) else op.result  # a split layer's parts count as one
            stats = self.per_layer.setdefault(layer, [0, 0, 0])
            stats[0] += tp
            stats[1] += int(trace.active.sum())
            stats[2] += int(truth.sum())


@dataclass(frozen=True)
class EvalResult:
    ppl: float
    tokens: int
    ppl_dense: float | None = None
    top1_agreement: float | None = None
    ffn_sparsity: float | None = None
    recall: float | None = None
    precision: float | None = None
    layer_recall: dict[str, float] | None = None

    @property
    def ppl_increase(self) -> float | None:
        return None if self.ppl_dense is None else self.ppl / self.ppl_dense - 1.0

    def summary(self) -> dict[str, object]:
        return {"ppl": self.ppl, "ppl_dense": self.ppl_dense, "ppl_increase": self.ppl_increase,
                "top1_agreement": self.top1_agreement, "ffn_sparsity": self.ffn_sparsity,
                "recall": self.recall, "precision": self.precision, "tokens": self.tokens,
                "layer_recall": self.layer_recall}


@dataclass(frozen=True)
class DenseReference:
    """The dense model's total NLL and next-token choices on the same windows."""

    nll: float
    argmax: tuple[np.ndarray, ...]


def dense_reference(module: Module, weights: WeightStore, windows: list[list[int]]) -> DenseReference:
    interp = Interpreter(densified(module), weights)
    nll, argmax = 0.0, []
    for window in windows:
        interp.reset()
        logits = interp.run(window)[:-1]
        nll += token_nll(logits, np.asarray(window[1:]))
        argmax.append(logits.argmax(-1))
    return DenseReference(nll, tuple(argmax))


def evaluate(module: Module, weights: WeightStore, windows: list[list[int]], compare_dense: bool = False,
             progress=None, reference: DenseReference | None = None) -> EvalResult:  # noqa: ANN001
    """Perplexity of ``module`` on ``windows``; with ``compare_dense`` (or a precomputed
    ``reference``), the sparse-vs-dense numbers too."""
    if compare_dense and reference is None:
        reference = dense_reference(module, weights, windows)
    sparse = Interpreter(module, weights)
    counter = _SparsityCounter()
    sparse.on_ffn = counter
    nll, agree, count = 0.0, 0, 0
    for i, window in enumerate(windows):
        sparse.reset()
        logits = sparse.run(window)[:-1]
        nll += token_nll(logits, np.asarray(window[1:]))
        if reference is not None:
            agree += int((logits.argmax(-1) == reference.argmax[i]).sum())
        count += len(window) - 1
        if progress:
            progress(len(window))
    result = EvalResult(ppl=float(np.exp(nll / count)), tokens=count)
    if counter.total:
        result = replace(result, ffn_sparsity=1.0 - counter.computed / counter.total)
    if counter.actual:
        layer_recall = {k: tp / max(1, actual) for k, (tp, _, actual) in counter.per_layer.items()}
        result = replace(result, recall=counter.true_positive / counter.actual,
                         precision=counter.true_positive / max(1, counter.predicted),
                         layer_recall=layer_recall)
    if reference is not None:
        result = replace(result, ppl_dense=float(np.exp(reference.nll / count)), top1_agreement=agree / count)
    return result
