"""``profile-activations``: measure how often each FFN neuron fires on calibration text.

Options: ``calib`` (a built-in corpus, ``ptb`` by default, or a path), ``tokens`` (default 4096),
``window`` (tokens per window, default 256), ``seed`` (default 0), ``target-sparsity`` (needed for
non-ReLU FFNs: their thresholds are calibrated to it), ``rule`` (how: ``fisher``, the default, one
threshold for all GLU layers on Fisher-scaled scores, each such ffn then carries its
``score_scale``; or ``cats``, one quantile per layer; see ``picc.sparsity.profiling``), ``cache`` (``off`` to
compute the profile again rather than read it from ``$PICC_CACHE_DIR/profiles``).

Needs: a verified module with ``ffn`` ops (run ``canonicalize`` first on graph imports) and the
model's tokenizer. Guarantees: every ffn op carries ``freq``/``mag`` weights and its
``threshold``; module attributes ``profile_*`` record the calibration data. The computation the
module describes is unchanged.
"""

from __future__ import annotations

from picc.errors import PiccError
from picc.ir.module import Module
from picc.passes.registry import PassContext, register_pass
from picc.sparsity.calib import token_windows
from picc.sparsity.profiling import attach, calibrate

OPTIONS = ("calib", "tokens", "window", "seed", "target-sparsity", "rule", "cache")


@register_pass("profile-activations", options=OPTIONS)
def profile_activations(module: Module, ctx: PassContext) -> Module:
    """Record per-neuron activation frequency, magnitude and per-layer thresholds."""
    if ctx.tokenizer is None:
        raise PiccError("profile-activations needs the model's tokenizer to read calibration text")
    windows = token_windows(ctx.tokenizer, ctx.option("calib", "ptb"), ctx.int_option("tokens", 4096),
                            ctx.int_option("window", 256), ctx.int_option("seed", 0))
    (profile,) = calibrate(module, ctx.weights, windows, [ctx.float_option("target-sparsity", None)],
                           ctx.option("rule", "fisher"), cache=ctx.option("cache", "on") != "off")
    return attach(module, ctx.weights, profile)
