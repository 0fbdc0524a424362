"""``profile-activations``: measure how often each FFN neuron fires on calibration text.

Options (``ProfileOptions``): ``calib`` (a built-in corpus, ``ptb`` by default, or a path), ``tokens`` (default 4096),
``window`` (tokens per window, default 256), ``seed`` (default 0), ``target-sparsity`` (needed for
non-ReLU FFNs: their thresholds are calibrated to it), ``rule`` (how: ``fisher``, the default, one
threshold for all GLU layers on Fisher-scaled scores, each such ffn then carries its
``score_scale``; or ``cats``, one quantile per layer; see ``picc.sparsity.profiling``), ``fisher-tokens``
(how many of the tokens the fisher rule's gradients are taken on, default ``FISHER_TOKENS``), ``cache`` (``off`` to
compute the profile again rather than read it from ``$PICC_CACHE_DIR/profiles``).

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
from picc.passes.registry import PassContext, register_pass
from picc.sparsity import FISHER_TOKENS
from picc.sparsity.calib import token_windows
from picc.sparsity.profiling import THRESHOLD_RULES, attach, calibrate


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
    (profile,) = calibrate(module, ctx.weights, windows, [o.target_sparsity], o.rule, cache=o.cache,
                           fisher_tokens=o.fisher_tokens)
    return attach(module, ctx.weights, profile)
