"""``profile-activations``: measure how often each FFN neuron fires on calibration text.

Options (``ProfileOptions``): ``calib`` (a built-in corpus, ``ptb`` by default, or a path), ``tokens`` (default 4096),
``window`` (tokens per window, default 256), ``seed`` (default 0), ``target-sparsity`` (needed for
non-ReLU FFNs: their thresholds are calibrated to it), ``rule`` (how: ``fisher``, the default, one
threshold for all GLU layers on Fisher-scaled scores, each such ffn then carries its
``score_scale``; or ``cats``, one quantile per layer; see ``picc.sparsity.profiling``), ``fisher-tokens``
(how many of the tokens the fisher rule's gradients are taken on, default ``FISHER_TOKENS``), ``cache`` (``off`` to
compute the profile again rather than read it from ``$PICC_CACHE_DIR/profiles``), ``keep-inputs``
(``on``: keep the inputs and active neurons of the ReLU ffn ops that the profile's forward saw, for
an ``insert-predictors`` later in the same pipeline that trains on the same tokens, which then
skips a forward of its own: a ReLU LLaMA-7B's 4096 tokens, ~6 minutes on 2 cores, 3.6 GB held).

Needs: a verified module with ``ffn`` ops (run ``canonicalize`` first on graph imports) and the
model's tokenizer. Guarantees: every ffn op carries ``freq``/``mag`` weights and its
``threshold``; module attributes ``profile_*`` record the calibration data. The computation the
module describes is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.errors import PiccError
from picc.ir.module import Module
from picc.passes.options import PassOptions, option
from picc.passes.registry import FfnInputs, PassContext, register_pass
from picc.sparsity import FISHER_TOKENS
from picc.sparsity.calib import token_windows
from picc.sparsity.predictors import LayerDataRecorder
from picc.sparsity.profiling import RELU_FORMS, THRESHOLD_RULES, attach, calibrate, ffn_ops


@dataclass(frozen=True)
class ProfileOptions(PassOptions):
    """The options of ``profile-activations`` (see the module's docstring)."""

    calib: str = option("ptb")
    tokens: int = option(4096, at_least=1)
    window: int = option(256, at_least=2)
    seed: int = option(0)
    target_sparsity: float | None = option(None, key="target-sparsity")
    rule: str = option("fisher", choices=THRESHOLD_RULES)
    fisher_tokens: int = option(FISHER_TOKENS, key="fisher-tokens", at_least=1)
    cache: bool = option(True)
    keep_inputs: bool = option(False, key="keep-inputs")

    def check(self) -> None:
        super().check()
        if self.target_sparsity is not None and not 0 <= self.target_sparsity < 1:
            raise PiccError(f"option target-sparsity={self.target_sparsity}: expected a value in [0, 1)")


@register_pass("profile-activations", options=ProfileOptions)
def profile_activations(module: Module, ctx: PassContext[ProfileOptions]) -> Module:
    """Record per-neuron activation frequency, magnitude and per-layer thresholds."""
    if ctx.tokenizer is None:
        raise PiccError("profile-activations needs the model's tokenizer to read calibration text")
    o = ctx.options
    windows = token_windows(ctx.tokenizer, o.calib, o.tokens, o.window, o.seed)
    relu = {op.result: (ctx.weights[op.up].shape[1], ctx.weights[op.up].shape[0])
            for op in ffn_ops(module) if op.form in RELU_FORMS}
    record = LayerDataRecorder(relu, windows.n_tokens) if o.keep_inputs and relu else None
    (profile,) = calibrate(module, ctx.weights, windows, [o.target_sparsity], o.rule, cache=o.cache,
                           fisher_tokens=o.fisher_tokens, record=record)
    if record is not None and record.complete:  # not when the profile came from the cache
        ctx.artifacts.ffn_inputs = FfnInputs(o.calib, o.tokens, o.window, o.seed, record.data)
    return attach(module, ctx.weights, profile)
