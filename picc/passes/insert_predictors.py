"""``insert-predictors``: decide per FFN layer how its active set is known, and make it sparse.

Options (``InsertOptions``): ``mode`` (``auto`` by default, or ``predictor``, ``gate-first``,
``down-only``, ``dense`` for every layer), ``recall`` (predictor recall target on held-out
tokens, default 0.99), ``budget`` (predictor memory as a share of the FFN weights' bytes,
default 0.1), ``tokens`` (training tokens, default ``TRAIN_TOKENS`` or the profile's if more,
within ``DATA_BYTES`` of training data), ``seed``, ``predictors`` (a directory of PowerInfer
predictors, ``model_{layer}.pt``, to import instead of training), ``cache`` (``off`` to retrain).

``auto`` compares, per layer, what a token reads (``picc.placement.cost_model``) among the ways that
keep the profile's accuracy: for ReLU forms the exact ways (gate-first, down-only) and a trained
predictor; for other forms gate-first (GLU) or down-only at the profiled thresholds. Each way
costs the bytes of the matrices it reads whole plus those of the active rows divided by
``gathered-rate``: the rate at which the kernels read rows gathered one at a time, as a share of
the rate they read whole matrices at (default 1: bytes decide alone; ``picc compile`` passes the
target CPU's measured ratio, which makes down-only, whose up projection is read whole, the faster
way for a SwiGLU model on a CPU whose whole-matrix kernels read ~2x as fast as gathered rows).
A layer stays dense only where no way reads fewer bytes than dense.

Predictor training reads each layer's inputs over the training tokens: from a forward of its own,
or, where an earlier ``profile-activations{keep-inputs=on}`` of the same pipeline run saw exactly
these tokens (``trains_on_profiled_tokens``), from what it kept (``ctx.artifacts``).

Needs: ``profile-activations`` (every ffn carries ``freq`` and thresholds) and the tokenizer when
predictors are trained. Guarantees: every chosen ffn is a ``sparse_ffn``, predictor layers read a
``predict`` op's mask; ``dense`` layers stay ``ffn``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from picc.errors import PiccError
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.module import Module, WeightDecl
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore
from picc.passes.options import PassOptions, option
from picc.passes.registry import PassContext, register_pass
from picc.placement import cost_model
from picc.progress import progress_bar
from picc.sparsity import predictor_store
from picc.sparsity.calib import corpus_windows, token_windows
from picc.sparsity.predictors import LayerData, LayerDataRecorder, TrainedPredictor, starting_rank, train_all
from picc.sparsity.profiling import RELU_FORMS

# relu-demo's predictors at 0.99 recall predicted 20-40% fewer neurons active when trained on
# 16k tokens instead of 4k; the inputs of all layers are held in memory while training.
TRAIN_TOKENS = 16384
DATA_BYTES = 2 << 30

MODES = ("auto", "predictor", "gate-first", "down-only", "dense")


@dataclass(frozen=True)
class InsertOptions(PassOptions):
    """The options of ``insert-predictors`` (see the module's docstring)."""

    mode: str = option("auto", choices=MODES)
    recall: float = option(0.99)
    budget: float = option(0.1)
    tokens: int | None = option(None, at_least=1)  # None: default_tokens
    seed: int = option(0)
    predictors: str | None = option(None)
    cache: bool = option(True)
    gathered_rate: float = option(1.0, key="gathered-rate")

    def check(self) -> None:
        super().check()
        for key, share in (("recall", self.recall), ("budget", self.budget), ("gathered-rate", self.gathered_rate)):
            if not 0 < share <= 1:
                raise PiccError(f"option {key}={share}: expected a share in (0, 1]")


def _names(ffn: O.FFN) -> tuple[str, str]:
    """The stem of the names of a layer's predictor weights and the name of its mask: after the
    FFN's decoder block (``l3.pred.fc1``, ``%l3.ffn.mask``), or its value outside blocks. Names
    only: nothing reads them back."""
    if ffn.block is not None:
        return f"l{ffn.block}.pred", f"l{ffn.block}.ffn.mask"
    return f"{ffn.result}.pred", f"{ffn.result}.mask"


def collect_layer_data(module: Module, weights: WeightStore, windows, names: set[str]) -> dict[str, LayerData]:  # noqa: ANN001
    """FFN inputs and active sets (score > the op's threshold) of the layers in ``names`` over all
    the tokens of ``windows`` (:class:`~picc.sparsity.predictors.LayerDataRecorder`)."""
    ffns = {op.result: op for op in module.ops() if op.result in names}
    record = LayerDataRecorder({k: (weights[op.up].shape[1], weights[op.up].shape[0]) for k, op in ffns.items()},
                               windows.n_tokens)
    last = max(i for i, op in enumerate(module.function().ops) if op.result in names)
    func = module.function()
    cut = module.with_function(replace(func, ret=func.ops[last].result).pruned())
    interp = Interpreter(cut, weights)
    interp.on_ffn = record
    with progress_bar(windows.n_tokens, "collecting predictor data", "tok") as advance:
        interp.run_many([list(w) for w in windows.windows], advance)  # each weight dequantized once
    assert record.complete, (record.filled, windows.n_tokens)
    return record.data


def default_tokens(module: Module, ctx: PassContext[InsertOptions], ffns: list[O.FFN], calib: str, window: int) -> int:
    """:func:`training_tokens`, fewer when the calibration corpus is shorter."""
    profiled = int(module.attr("profile_tokens", 4096) or 4096)
    tokens = training_tokens(ctx.weights, ffns, profiled)
    return min(tokens, max(profiled, corpus_windows(ctx.tokenizer, calib, window) * window))


def training_tokens(weights: WeightStore, ffns: list[O.FFN], profiled: int) -> int:
    """``TRAIN_TOKENS`` (or the ``profiled`` tokens, if more), fewer when the layers' inputs and
    labels would exceed ``DATA_BYTES``."""
    per_token = sum(4 * weights[op.up].shape[1] + weights[op.up].shape[0] for op in ffns)
    return max(profiled, min(TRAIN_TOKENS, DATA_BYTES // max(per_token, 1)))


def predictor_budget(weights: WeightStore, ffns: list[O.FFN], share: float) -> int:
    """The parameters all predictors of ``ffns`` may hold: ``share`` of the layers' weight bytes
    (``--predictor-budget``), the predictors stored as float16."""
    return int(share * sum(cost_model.ffn_weight_bytes(op, weights) for op in ffns) / 2)


def _train(module: Module, ctx: PassContext[InsertOptions], ffns: list[O.FFN]) -> dict[str, TrainedPredictor]:
    if ctx.tokenizer is None:
        raise PiccError("insert-predictors needs the model's tokenizer to train predictors")
    calib = str(module.attr("profile_calib", "ptb"))
    window = int(module.attr("profile_window", 256) or 256)
    tokens = ctx.options.tokens
    if tokens is None:  # tokenizes the corpus to measure it: only when it matters
        tokens = default_tokens(module, ctx, ffns, calib, window)
    seed, recall, budget_share = ctx.options.seed, ctx.options.recall, ctx.options.budget
    ffn_bytes = {op.result: cost_model.ffn_weight_bytes(op, ctx.weights) for op in ffns}
    budget_params = predictor_budget(ctx.weights, ffns, budget_share)
    key = predictor_store.cache_key(module, ctx.weights, [op.result for op in ffns],
                                    dict(calib=calib, tokens=tokens, window=window, seed=seed,
                                         recall=recall, budget=budget_share))
    use_cache = ctx.options.cache
    kept, ctx.artifacts.ffn_inputs = ctx.artifacts.ffn_inputs, None  # read once: 3.6 GB for a 7B
    if use_cache and (cached := predictor_store.load_cached(key)) is not None:
        return cached
    if kept is not None and (kept.calib, kept.tokens, kept.window, kept.seed) == (calib, tokens, window, seed) \
            and all(op.result in kept.layers and not op.threshold for op in ffns):
        data = {op.result: kept.layers[op.result] for op in ffns}  # profiling's forward saw these tokens
    else:
        windows = token_windows(ctx.tokenizer, calib, tokens, window, seed)
        data = collect_layer_data(module, ctx.weights, windows, {op.result for op in ffns})
    start = {}
    for op in ffns:
        freq = ctx.weights.f32(op.freq) if op.freq else data[op.result].active.mean(0)
        ranked = np.sort(freq)[::-1]
        top20 = float(ranked[: max(1, len(ranked) // 5)].sum() / max(ranked.sum(), 1e-9))
        hidden, n_ff = data[op.result].x.shape[1], data[op.result].active.shape[1]
        start[op.result] = starting_rank(hidden, n_ff, 1.0 - float(freq.mean()), top20)
    with progress_bar(0, "training predictors", "predictor") as advance:  # the rank search adds rounds
        try:
            trained = train_all(data, start, recall, budget_params, seed, progress=lambda _: advance(1),
                                ffn_bytes=ffn_bytes, workers=len(os.sched_getaffinity(0)), expect=advance.expect)
        except ValueError as e:
            raise PiccError(str(e)) from None
    if use_cache:
        predictor_store.save_cached(key, trained)
    return trained


def trains_on_profiled_tokens(weights: WeightStore, layers: list[O.FFN], profiled: int) -> bool:
    """Whether the predictors this pass trains for ``layers`` (none: it trains none) are of ReLU
    layers only, trained on the very tokens ``profile-activations`` reads (``profiled``): their
    data would pass ``DATA_BYTES`` at more (a LLaMA-7B), so profiling may keep what it saw for them."""
    return bool(layers) and all(op.form in RELU_FORMS for op in layers) \
        and training_tokens(weights, layers, profiled) == profiled


def predicted_layers(ffns: list[O.FFN], mode: str) -> list[O.FFN]:
    """The layers that get predictors under ``mode``: all with ``predictor``, the ReLU forms with
    ``auto`` (the others' exact masks need none)."""
    return [op for op in ffns if mode == "predictor" or mode == "auto" and op.form in RELU_FORMS]


def _choose(op: O.FFN, mode: str, weights: WeightStore, predictor: TrainedPredictor | None,
            gathered_rate: float = 1.0) -> str:
    """``mode``, or under ``auto`` the way to know ``op``'s active set that costs least (see the
    module's notes), or dense where none reads fewer bytes."""
    if mode != "auto":
        return mode
    density = float(weights.f32(op.freq).mean()) if op.freq else 1.0
    ways = (["gate-first"] if op.spec.gated else []) + ["down-only"]
    reads = {way: cost_model.ffn_reads_per_token(op, weights, way, density) for way in ways}
    if predictor is not None:
        nbytes = 2 * (predictor.fc1.size + predictor.fc2.size)
        reads["predictor"] = cost_model.ffn_reads_per_token(op, weights, "predictor", predictor.predicted_density,
                                                            predictor_bytes=nbytes)
    if min(sum(r) for r in reads.values()) >= cost_model.ffn_bytes_per_token(op, weights, "dense", 1.0):
        return "dense"
    return min(reads, key=lambda way: reads[way][0] + reads[way][1] / gathered_rate)


def _add(weights: WeightStore, decls: list[WeightDecl], name: str, values: np.ndarray) -> str:
    candidate = weights.fresh_name(name)
    weights.add(candidate, Tensor.from_f32(values, DType.F16))
    decls.append(WeightDecl(candidate, weights[candidate].type))
    return candidate


@register_pass("insert-predictors", options=InsertOptions)
def insert_predictors(module: Module, ctx: PassContext[InsertOptions]) -> Module:
    """Make FFNs sparse: per layer a predictor, gate-first or down-only mask, or dense."""
    mode = ctx.options.mode
    ffns = [op for op in module.function().ops if type(op) is O.FFN]
    unprofiled = [op.result for op in ffns if op.threshold is None]
    if unprofiled:
        raise PiccError(f"ffn %{unprofiled[0]} has no profile; run profile-activations first")
    if mode == "gate-first" and (bad := [op for op in ffns if not op.spec.gated]):
        raise PiccError(f"mode gate-first needs gated FFNs; %{bad[0].result} is {bad[0].form!r}")
    wants_predictor = predicted_layers(ffns, mode)
    predictors: dict[str, TrainedPredictor] = {}
    if wants_predictor:
        if ctx.options.predictors:
            predictors = predictor_store.load_powerinfer(Path(ctx.options.predictors), wants_predictor)
        else:
            predictors = _train(module, ctx, wants_predictor)
    decls = list(module.weights)
    new_ops: list[Op] = []
    for op in module.function().ops:
        if type(op) is not O.FFN:
            new_ops.append(op)
            continue
        predictor = predictors.get(op.result)
        chosen = _choose(op, mode, ctx.weights, predictor, ctx.options.gathered_rate)
        if chosen == "dense":
            new_ops.append(op)
            continue
        fields = {f.name: getattr(op, f.name) for f in O.FFN.field_kinds()}
        mask = None
        if chosen == "predictor":
            assert predictor is not None
            stem, mask = _names(op)
            names = {part: _add(ctx.weights, decls, f"{stem}.{part}", getattr(predictor, part))
                     for part in ("fc1", "fc1_bias", "fc2", "fc2_bias")}
            pred_type = ctx.weights[names["fc2"]].shape[0]
            new_ops.append(Predict(result=mask, type=replace(op.type, dtype=DType.BOOL,
                                                             shape=(op.type.shape[0], pred_type)),
                                   x=op.x, ffn=op.result, threshold=predictor.threshold, block=op.block,
                                   recall=None if np.isnan(predictor.recall) else round(predictor.recall, 4),
                                   **names))
        new_ops.append(SparseFFN(result=op.result, type=op.type, mask=mask, mode=chosen, **fields))
    module = replace(module, weights=tuple(decls))
    return module.with_function(replace(module.function(), ops=tuple(new_ops)))
