"""Making a model sparse end to end: profile, choose thresholds, insert predictors.

``--max-ppl-increase X`` picks, for thresholded (non-ReLU) FFNs, the sparsest target in
``SWEEP`` whose perplexity on held-out calibration text stays within ``X`` of the dense model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.errors import PiccError
from picc.frontend.model import LoadedModel
from picc.ir import ops as O
from picc.ir.module import Module
from picc.ir.weights import WeightStore
from picc.passes import Instruments, PassSpec, run_pipeline
from picc.passes.insert_predictors import InsertOptions, predicted_layers, trains_on_profiled_tokens
from picc.passes.profile_activations import ProfileOptions
from picc.progress import progress_bar
from picc.sparsity import FISHER_TOKENS
from picc.sparsity.calib import token_windows
from picc.sparsity.evaluation import eval_windows, evaluate
from picc.sparsity.profiling import RELU_FORMS, attach, calibrate, ffn_ops

SWEEP = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
SWEEP_EVAL_TOKENS = 2048


@dataclass(frozen=True)
class SparsifyOptions:
    mode: str = "auto"
    target_sparsity: float | None = None
    max_ppl_increase: float | None = None
    recall: float = 0.99
    budget: float = 0.1
    predictors: str | None = None
    calib: str = "ptb"
    rule: str = "fisher"
    tokens: int = 4096
    fisher_tokens: int = FISHER_TOKENS
    window: int = 256
    seed: int = 0
    gathered_rate: float = 1.0  # insert-predictors' gathered-rate: 1, bytes decide

    def passes(self, target: float | None, model: LoadedModel | None = None) -> list[PassSpec]:
        """profile-activations (calibrated to ``target`` for non-ReLU FFNs) and insert-predictors;
        given the ``model``, profiling keeps its FFN inputs where the predictors train on its tokens."""
        keep = model is not None and trains_on_profiled_tokens(model.weights, self.trained_layers(model.module),
                                                               self.tokens)
        profile = ProfileOptions(calib=self.calib, tokens=self.tokens, window=self.window, seed=self.seed,
                                 target_sparsity=target, rule=self.rule if target is not None else "fisher",
                                 fisher_tokens=self.fisher_tokens, keep_inputs=keep)
        insert = InsertOptions(mode=self.mode, recall=self.recall, budget=self.budget, seed=self.seed,
                               predictors=self.predictors or None, gathered_rate=self.gathered_rate)
        return [PassSpec("profile-activations", profile), PassSpec("insert-predictors", insert)]

    def trained_layers(self, module: Module) -> list[O.FFN]:
        """The ffn ops of ``module`` that insert-predictors would train predictors for (none when
        they are imported)."""
        return [] if self.predictors else predicted_layers([op for op in module.ops() if type(op) is O.FFN], self.mode)

    def pipeline(self, target: float | None, model: LoadedModel | None = None) -> str:
        """:meth:`passes` as pipeline text."""
        return ",".join(map(str, self.passes(target, model)))


@dataclass(frozen=True)
class SweepPoint:
    target: float
    ppl: float
    ppl_dense: float

    @property
    def increase(self) -> float:
        return self.ppl / self.ppl_dense - 1.0


def thresholded(module: Module) -> bool:
    return any(op.form not in RELU_FORMS for op in ffn_ops(module))


def sweep(model: LoadedModel, options: SparsifyOptions) -> list[SweepPoint]:
    """Perplexity on held-out calibration text at each target sparsity of ``SWEEP``."""
    assert model.tokenizer is not None
    windows = token_windows(model.tokenizer, options.calib, options.tokens, options.window, options.seed)
    profiles = calibrate(model.module, model.weights, windows, SWEEP, options.rule)
    # Held out: the first tokens of the corpus, which profiling drew only by chance.
    held_out = eval_windows(model.tokenizer, options.calib, SWEEP_EVAL_TOKENS, options.window)
    points = []
    with progress_bar(len(SWEEP), "sweeping sparsity", "setting") as advance:
        for target, profile in zip(SWEEP, profiles, strict=True):
            store = WeightStore({n: model.weights[n] for n in model.weights})
            profiled = attach(model.module, store, profile)
            # Through the pass manager, so that the verifier checks the result like any pass's.
            insert = PassSpec("insert-predictors", InsertOptions(mode=options.mode, seed=options.seed,
                                                                 gathered_rate=options.gathered_rate))
            sparse = run_pipeline(profiled, store, [insert], tokenizer=model.tokenizer)
            result = evaluate(sparse, store, held_out, compare_dense=True)
            assert result.ppl_dense is not None
            points.append(SweepPoint(target, result.ppl, result.ppl_dense))
            advance(1)
    return points


def choose_target(points: list[SweepPoint], max_increase: float) -> SweepPoint:
    within = [p for p in points if p.increase <= max_increase]
    if not within:
        best = min(points, key=lambda p: p.increase)
        raise PiccError(f"no sparsity in {SWEEP} keeps the perplexity increase within {max_increase:.3f} "
                        f"(the gentlest, {best.target}, costs {best.increase:.3f})")
    return max(within, key=lambda p: p.target)


def target_sparsity(model: LoadedModel, options: SparsifyOptions,
                    report=print) -> float | None:  # noqa: ANN001 - report: Callable[[str], None]
    """The sparsity non-ReLU FFNs are calibrated to: ``--target-sparsity``, or the sweep's choice
    under ``--max-ppl-increase``, or 0.3; None when every FFN is ReLU-sparse."""
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer, so calibration text cannot be read")
    target = options.target_sparsity
    if options.max_ppl_increase is not None:
        if not thresholded(model.module):
            report("--max-ppl-increase: every FFN is ReLU-sparse, so the exact masks cost no accuracy; "
                   "the predictors' recall target governs it")
        else:
            points = sweep(model, options)
            chosen = choose_target(points, options.max_ppl_increase)
            report("target  ppl      dense    increase")
            for p in points:
                mark = "  <- chosen" if p is chosen else ""
                report(f"{p.target:<7} {p.ppl:<8.3f} {p.ppl_dense:<8.3f} {100 * p.increase:+.2f}%{mark}")
            target = chosen.target
    if target is None and thresholded(model.module):
        target = 0.3
        report("target sparsity defaults to 0.3 for non-ReLU FFNs (see --target-sparsity, --max-ppl-increase)")
    return target


def sparsify(model: LoadedModel, options: SparsifyOptions, instruments: Instruments | None = None,
             report=print) -> Module:  # noqa: ANN001 - report: Callable[[str], None]
    """Profile ``model`` and make its FFNs sparse as ``options`` say."""
    target = target_sparsity(model, options, report)
    return run_pipeline(model.module, model.weights, options.passes(target, model), instruments,
                        tokenizer=model.tokenizer)
