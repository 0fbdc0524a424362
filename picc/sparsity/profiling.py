"""Activation profiling: how often each FFN neuron is active on real text, and how strongly.

A neuron is active on a token when its activity score (``picc.ir.ops.FFN``) exceeds the layer's
threshold. For ReLU forms (relu, reglu, drelu) the threshold is 0, which is exact: an inactive
neuron contributes nothing. For the others (SwiGLU, GeGLU, ...) nothing is exactly zero, so the
threshold is calibrated to ``target_sparsity`` by one of two rules (``THRESHOLD_RULES``):

* ``fisher`` (the default for GLU forms): each neuron's score ``|act(g_i)|`` is scaled by its
  Fisher scale (``picc.sparsity.fisher``), and one threshold for all layers is the ``target_sparsity``
  quantile of the scaled scores of every layer: sparsity goes where it costs the loss least.
  On SmolLM2 at 30% (PTB valid): +2.1% perplexity and 0.89 top-1 agreement, against +3.4% and
  0.83 for CATS (docs/smollm2_sparsity_curve.md).
* ``cats``: per layer, the ``target_sparsity`` quantile of the layer's unscaled scores over all
  calibration tokens and neurons (CATS), so every layer is equally sparse.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from picc.digest import hash_model, hash_sources
from picc.errors import PiccError
from picc.fsutil import atomic_path, cache_root, cached, keep_cached
from picc.interpreter import FfnTrace, Interpreter
from picc.ir import ops as O
from picc.ir.core import Attr
from picc.ir.module import Module, WeightDecl
from picc.ir.weights import Tensor, WeightStore
from picc.progress import progress_bar
from picc.sparsity.calib import Windows
from picc.sparsity.fisher import fisher_scales

RELU_FORMS = ("relu", "reglu", "drelu")
SKEW_SHARES = (0.1, 0.2, 0.5)
THRESHOLD_RULES = ("fisher", "cats")


@dataclass(frozen=True)
class LayerProfile:
    """The profile of one FFN op."""

    ffn: str  # the result name of the ffn op, e.g. "l3.ffn.out"
    freq: np.ndarray  # [n_ff] share of tokens on which each neuron is active
    mag: np.ndarray  # [n_ff] mean |h| (the value that multiplies the neuron's down column)
    threshold: float
    down_threshold: float
    score_scale: np.ndarray | None = None  # [n_ff] the Fisher scales the threshold applies to

    @property
    def sparsity(self) -> float:
        """Share of (token, neuron) pairs that are inactive."""
        return float(1.0 - self.freq.mean())

    def top_share(self, share: float) -> float:
        """Share of all activations that the ``share`` most active neurons account for."""
        total = float(self.freq.sum())
        if total == 0:
            return 0.0
        ranked = np.sort(self.freq)[::-1]
        k = max(1, int(np.ceil(share * len(ranked))))
        return float(ranked[:k].sum() / total)


@dataclass(frozen=True)
class Profile:
    """Per-layer profiles and where they came from."""

    layers: tuple[LayerProfile, ...]
    calib: str
    tokens: int
    window: int
    seed: int
    target_sparsity: float | None  # None when every layer is a ReLU form
    rule: str | None = "cats"  # how thresholds were calibrated (THRESHOLD_RULES); None: ReLU only

    @property
    def mean_sparsity(self) -> float:
        return float(np.mean([layer.sparsity for layer in self.layers]))

    def summary(self) -> dict[str, object]:
        """The numbers ``picc profile --json`` prints."""
        layers = [{"ffn": layer.ffn, "sparsity": layer.sparsity, "threshold": layer.threshold,
                   "down_threshold": layer.down_threshold,
                   **{f"top{round(s * 100)}": layer.top_share(s) for s in SKEW_SHARES}}
                  for layer in self.layers]
        return {"calib": self.calib, "tokens": self.tokens, "seed": self.seed,
                "target_sparsity": self.target_sparsity, "rule": self.rule, "layers": layers,
                "mean_sparsity": self.mean_sparsity}


def ffn_ops(module: Module) -> list[O.FFN]:
    return [op for op in module.function().ops if isinstance(op, O.FFN)]


def _profiling_function(module: Module) -> Module:
    """``forward`` cut after its last ffn op (the LM head is not needed to profile), its ffn ops'
    scores unscaled (a module profiled before carries the scales of its last profile)."""
    func = module.function()
    last = ffn_ops(module)[-1].result
    ops = tuple(replace(op, score_scale=None) if isinstance(op, O.FFN) else op for op in func.ops)
    return module.with_function(replace(func, ops=ops, ret=last).pruned())


def scaled_layers(module: Module) -> list[str]:
    """The ffn ops the ``fisher`` rule scales: gated forms that are not ReLU-sparse."""
    return [op.result for op in ffn_ops(module) if op.spec.gated and op.form not in RELU_FORMS]


def calibrate(module: Module, weights: WeightStore, windows: Windows, targets: Sequence[float | None],
              rule: str = "fisher", cache: bool = True, fisher_tokens: int | None = None,
              record: Callable[[FfnTrace], None] | None = None) -> list[Profile]:
    """:func:`profile_sweep` with a progress bar, or, when ``rule`` is ``fisher`` and the model has
    layers it scales, the Fisher scales (from the first windows holding ``fisher_tokens``, all by
    default) and the profile in one pass (:func:`_fisher_profile`). The profiles are cached
    (:func:`profile_cache_path`): calibrating the same model on the same tokens again reads them
    back (``cache=False``: computes them again, and caches the result). ``record`` sees every ffn
    op's trace of :func:`profile_sweep`'s forward, where there is one."""
    if rule not in THRESHOLD_RULES:
        raise PiccError(f"threshold rule must be one of {', '.join(THRESHOLD_RULES)}, got {rule!r}")
    cached = profile_cache_path(module, weights, windows, targets, rule, fisher_tokens)
    profiles = _load_profiles(cached) if cache else None
    if profiles is not None:
        return profiles
    wanted = scaled_layers(module)
    if rule == "fisher" and wanted and any(t is not None for t in targets):
        # The Fisher pass's forward over the windows is the profile's forward too: one pass less.
        with progress_bar(windows.n_tokens, "Fisher scales and profile", "tok") as advance:
            profiles = _fisher_profile(module, weights, windows, targets, advance, wanted, fisher_tokens)
    else:
        with progress_bar(windows.n_tokens, "profiling", "tok") as advance:
            profiles = profile_sweep(module, weights, windows, targets, advance, record=record)
    _save_profiles(cached, profiles)
    return profiles


def _fisher_profile(module: Module, weights: WeightStore, windows: Windows, targets: Sequence[float | None],
                    progress: Callable[[int], None], wanted: list[str], fisher_tokens: int | None) -> list[Profile]:
    """:func:`profile_sweep`'s profiles under the ``fisher`` rule for the layers in ``wanted``,
    observed in the Fisher pass's own forward (torch's float32 products instead of the
    interpreter's numpy ones: the same statistics, not the same bits) rather than in a pass of
    their own, and scaled once the pass has the scales."""
    observer = _observer(module, weights, windows, targets, wanted)
    scales = fisher_scales(module, weights, windows, windows.seed, progress, on_ffn=observer, tokens=fisher_tokens)
    return _profiles(observer, windows, targets, {name: scales[name] for name in wanted})


# ---------------------------------------------------------------- the profile cache

PROFILE_CACHE_VERSION = 1
# The code a profile's numbers come from (the two passes over the model, the ops' semantics and
# the weights' dequantization): a change to any of these files is a cache miss.
_PROFILE_SOURCES = ("sparsity/profiling.py", "sparsity/fisher.py", "interpreter.py", "quant.py", "ir/ops.py")


def profile_cache_path(module: Module, weights: WeightStore, windows: Windows, targets: Sequence[float | None],
                       rule: str, fisher_tokens: int | None = None) -> Path:
    """Where :func:`calibrate` keeps its profiles of ``module``: ``$PICC_CACHE_DIR/profiles``,
    keyed by the model (IR text and weight bytes), the calibration tokens themselves (so the
    corpus, tokenizer, window and seed), the targets and rule, the profiling code and torch's
    and numpy's versions (the Fisher scales are computed with torch)."""
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(f"v{PROFILE_CACHE_VERSION} torch {version('torch')} numpy {np.__version__}".encode())
    hash_sources(h, _PROFILE_SOURCES)
    hash_model(h, module, weights)
    h.update(json.dumps({"windows": windows.windows, "source": windows.source, "seed": windows.seed,
                         "targets": list(targets), "rule": rule, "fisher_tokens": fisher_tokens}).encode())
    return cache_root() / "profiles" / f"{h.hexdigest()[:32]}.npz"


def _save_profiles(path: Path, profiles: list[Profile]) -> None:
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for p, profile in enumerate(profiles):
        layers = []
        for i, layer in enumerate(profile.layers):
            arrays[f"{p}.{i}.freq"], arrays[f"{p}.{i}.mag"] = layer.freq, layer.mag
            if layer.score_scale is not None:
                arrays[f"{p}.{i}.score_scale"] = layer.score_scale
            layers.append({"ffn": layer.ffn, "threshold": layer.threshold, "down_threshold": layer.down_threshold})
        meta.append({"layers": layers, "calib": profile.calib, "tokens": profile.tokens, "window": profile.window,
                     "seed": profile.seed, "target_sparsity": profile.target_sparsity, "rule": profile.rule})
    arrays["meta"] = np.array(json.dumps(meta))
    keep_cached(path, lambda f: np.savez(f, **arrays))


def _load_profiles(path: Path) -> list[Profile] | None:
    if cached(path) is None:
        return None
    try:
        with np.load(path) as z:
            out = []
            for p, m in enumerate(json.loads(str(z["meta"]))):
                layers = tuple(
                    LayerProfile(layer["ffn"], z[f"{p}.{i}.freq"], z[f"{p}.{i}.mag"], layer["threshold"],
                                 layer["down_threshold"],
                                 z.get(f"{p}.{i}.score_scale"))
                    for i, layer in enumerate(m["layers"]))
                out.append(Profile(layers, m["calib"], m["tokens"], m["window"], m["seed"], m["target_sparsity"],
                                   m["rule"]))
            return out
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
        return None  # a damaged entry is recomputed, not trusted


def profile_model(module: Module, weights: WeightStore, windows: Windows,
                  target_sparsity: float | None = None,
                  progress: Callable[[int], None] | None = None) -> Profile:
    """Run ``windows`` through the interpreter and profile every ffn op (CATS thresholds)."""
    return profile_sweep(module, weights, windows, [target_sparsity], progress)[0]


def profile_sweep(module: Module, weights: WeightStore, windows: Windows,
                  targets: Sequence[float | None],
                  progress: Callable[[int], None] | None = None,
                  scales: Mapping[str, np.ndarray] | None = None,
                  record: Callable[[FfnTrace], None] | None = None) -> list[Profile]:
    """One profile per target sparsity, from a single run of the calibration windows.

    ``scales`` (Fisher scales by ffn name, :func:`calibrate`) switches the thresholded layers they
    name to the ``fisher`` rule: their scores are scaled and share one threshold per target.
    ``record`` sees each ffn op's trace after the profile's observer.
    """
    observer = _observer(module, weights, windows, targets, list(scales or {}))
    interp = Interpreter(_profiling_function(module), weights)
    interp.on_ffn = observer if record is None else lambda trace: (observer(trace), record(trace))
    # Op by op over all the windows: a 7B model's weights are dequantized once, not once a window.
    interp.run_many([list(w) for w in windows.windows], progress)
    return _profiles(observer, windows, targets, scales or {})


def _observer(module: Module, weights: WeightStore, windows: Windows, targets: Sequence[float | None],
              scaled: Sequence[str]) -> _FfnObserver:
    """What watches the ffn ops of ``module`` profiled for ``targets`` (checked, with the layers
    to be ``scaled``, by :func:`_check_sweep`) over ``windows``."""
    ffns = ffn_ops(module)
    needs_threshold = _check_sweep(ffns, targets, scaled)
    n_ff = [weights[op.up].shape[0] for op in ffns]
    return _FfnObserver(ffns, n_ff, needs_threshold, targets, len(windows.windows))


def _profiles(observer: _FfnObserver, windows: Windows, targets: Sequence[float | None],
              scales: Mapping[str, np.ndarray]) -> list[Profile]:
    """The profiles, one per target, of what ``observer`` saw of ``windows`` (``scales``: the
    Fisher scales of the layers under the ``fisher`` rule)."""
    scale_of = [scales.get(op.result) for op in observer.ffns]
    layers = _layer_profiles(observer, scale_of, targets, windows.n_tokens)
    relu_only = not any(observer.needs_threshold)
    window = max(len(w) for w in windows.windows)
    rule = None if relu_only else "fisher" if scales else "cats"
    return [Profile(tuple(ls), windows.source, windows.n_tokens, window, windows.seed,
                    None if relu_only else target, rule)
            for ls, target in zip(layers, targets, strict=True)]


def _check_sweep(ffns: list[O.FFN], targets: Sequence[float | None], scaled: Sequence[str]) -> list[bool]:
    """Per ffn op, whether it needs a calibrated threshold (it is not a ReLU form); raises
    PiccError for a module without ffn ops, a missing or out-of-range target, or scales given
    for ops that are not thresholded."""
    if not ffns:
        raise PiccError("the module has no ffn ops to profile (run canonicalize first?)")
    needs_threshold = [op.form not in RELU_FORMS for op in ffns]
    for target in targets:
        if any(needs_threshold) and target is None:
            raise PiccError("this model's FFNs are not ReLU-sparse (forms: "
                            f"{', '.join(sorted({op.form for op in ffns}))}); give a target sparsity")
        if target is not None and not 0.0 <= target < 1.0:
            raise PiccError(f"target sparsity must be in [0, 1), got {target}")
    unknown = sorted(set(scaled) - {op.result for op, needs in zip(ffns, needs_threshold, strict=True) if needs})
    if unknown:
        raise PiccError(f"score scales given for {', '.join(unknown)}, which are not thresholded ffn ops")
    return needs_threshold


class _FfnObserver:
    """``Interpreter.on_ffn`` for profiling: per ffn op, the sum over tokens of each neuron's |h|,
    and either its active count (ReLU forms, active means score > 0) or every token's scores
    (scaled afterwards under the ``fisher`` rule), for thresholds calibrated afterwards. A thresholded
    layer's down thresholds (quantiles of its |h|, one per target) are taken as soon as it has
    seen all ``n_windows`` windows, and its |h| dropped: at most one layer's |h| is held (a
    LLaMA-7B's over 4096 tokens: 0.18 GB, against 5.8 GB for all 32)."""

    def __init__(self, ffns: list[O.FFN], n_ff: list[int], needs_threshold: list[bool],
                 targets: Sequence[float | None], n_windows: int) -> None:
        self.ffns = ffns
        self.index = {op.result: i for i, op in enumerate(ffns)}
        self.needs_threshold = needs_threshold
        self.targets = targets
        self.n_windows = n_windows
        self.windows_seen = [0] * len(ffns)
        self.relu_active = [np.zeros(n, np.int64) for n in n_ff]
        self.mag_sum = [np.zeros(n, np.float64) for n in n_ff]
        self.scores: list[list[np.ndarray]] = [[] for _ in ffns]  # one array per layer once it is complete
        self.h_abs: list[list[np.ndarray]] = [[] for _ in ffns]
        self.down_thresholds: list[list[float]] = [[0.0] * len(targets) for _ in ffns]  # ReLU forms: 0

    def __call__(self, trace: FfnTrace) -> None:
        i = self.index[trace.op.result]
        self.mag_sum[i] += np.abs(trace.h).sum(axis=0, dtype=np.float64)
        if self.needs_threshold[i]:
            self.scores[i].append(trace.score.astype(np.float32))
            self.h_abs[i].append(np.abs(trace.h).astype(np.float32))
        else:
            self.relu_active[i] += (trace.score > 0).sum(axis=0)
        self.windows_seen[i] += 1
        if self.needs_threshold[i] and self.windows_seen[i] == self.n_windows:
            h = np.concatenate(self.h_abs[i])
            self.h_abs[i] = []
            self.down_thresholds[i] = [calibrated_threshold(h, t) for t in self.targets if t is not None]
            del h
            self.scores[i] = [np.concatenate(self.scores[i])]


def _layer_profiles(seen: _FfnObserver, scale_of: list[np.ndarray | None], targets: Sequence[float | None],
                    n_tokens: int) -> list[list[LayerProfile]]:
    """Per target, each ffn op's profile from what ``seen`` gathered over ``n_tokens`` tokens,
    the scores of the layers with a Fisher scale (``scale_of``) scaled by it first (in place).

    A thresholded layer's threshold for a target is :func:`calibrated_threshold` of its own
    scores (``cats``) or of the scaled scores of every scaled layer together (``fisher``, without
    concatenating them: :func:`calibrated_threshold_of`); its down threshold, ``seen``'s. To bound
    memory, each layer's scores are dropped once used.
    """
    ffns, needs_threshold = seen.ffns, seen.needs_threshold
    assert all(len(s) == 1 for s, needs in zip(seen.scores, needs_threshold, strict=True) if needs), \
        "a thresholded layer did not see every window"
    scored = [s[0] if needs else None for s, needs in zip(seen.scores, needs_threshold, strict=True)]
    seen.scores.clear()
    for layer_scores, scale in zip(scored, scale_of, strict=True):
        if layer_scores is not None and scale is not None:
            layer_scores *= scale
    # The fisher rule: one threshold per target over the scaled scores of all the layers it scales.
    shared: list[float | None] = [None] * len(targets)
    if any(k is not None for k in scale_of):
        everything = [s for s, k in zip(scored, scale_of, strict=True) if s is not None and k is not None]
        shared = [None if t is None else calibrated_threshold_of(everything, t) for t in targets]
        del everything
    layers: list[list[LayerProfile]] = [[] for _ in targets]
    for i, op in enumerate(ffns):
        mag = (seen.mag_sum[i] / n_tokens).astype(np.float32)
        layer_scores = scored[i]
        scored[i] = None
        for t, target in enumerate(targets):
            threshold = down_threshold = 0.0  # ReLU forms: inactive means exactly zero
            active = seen.relu_active[i]
            if layer_scores is not None:
                assert target is not None
                common = shared[t] if scale_of[i] is not None else None
                threshold = calibrated_threshold(layer_scores, target) if common is None else common
                active = (layer_scores > threshold).sum(axis=0)
                down_threshold = seen.down_thresholds[i][t]
            layers[t].append(LayerProfile(op.result, (active / n_tokens).astype(np.float32), mag, threshold,
                                          down_threshold, scale_of[i]))
    return layers


def calibrated_threshold(scores: np.ndarray, sparsity: float) -> float:
    """The smallest score t with at least ``sparsity`` of ``scores`` <= t (0 for sparsity 0).

    Taking an actual score (not an interpolated quantile) makes the measured sparsity on the
    calibration tokens the target rounded up to one (token, neuron) pair.
    """
    flat = scores.ravel()
    k = int(np.ceil(sparsity * flat.size)) - 1
    if k < 0:
        return 0.0
    return float(np.partition(flat, k)[k])


def calibrated_threshold_of(arrays: Sequence[np.ndarray], sparsity: float) -> float:
    """:func:`calibrated_threshold` of the float32 ``arrays``' values together, exactly, without
    concatenating them (a LLaMA-7B's scaled scores over 4096 tokens: 5.8 GB): a histogram of the
    top 16 bits of order-preserving keys finds the bin that holds the wanted value, and only that
    bin's values are gathered and partitioned."""
    k = int(np.ceil(sparsity * sum(a.size for a in arrays))) - 1
    if k < 0:
        return 0.0
    counts = np.zeros(1 << 16, np.int64)
    for a in arrays:
        counts += np.bincount(_order_keys(a) >> 16, minlength=1 << 16)
    cumulative = np.cumsum(counts)
    b = int(np.searchsorted(cumulative, k, side="right"))  # the first bin with more than k values up to it
    k -= int(cumulative[b - 1]) if b else 0
    inside = np.concatenate([a.ravel()[(_order_keys(a) >> 16) == b] for a in arrays])
    return float(np.partition(inside, k)[k])


def _order_keys(a: np.ndarray) -> np.ndarray:
    """uint32 keys that sort as ``a``'s float32 values do (negative values' bits inverted, the
    others' sign bit set)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).ravel().view(np.uint32)
    return np.where(bits >> 31 == 1, ~bits, bits | np.uint32(1 << 31))


# ---------------------------------------------------------------- the profile in the IR


def attach(module: Module, weights: WeightStore, profile: Profile) -> Module:
    """``module`` with each ffn op carrying its ``freq``/``mag`` weights and ``threshold``.

    The weights are added to ``weights`` under ``<layer>.ffn.freq`` / ``.mag`` (with a numeric
    suffix if those names are taken: the store is append-only).
    """
    by_name = {layer.ffn: layer for layer in profile.layers}
    func = module.function()
    new_ops = []
    decls = list(module.weights)
    for op in func.ops:
        layer = by_name.get(op.result)
        if isinstance(op, O.FFN) and layer is not None:
            stem = f"l{op.block}.ffn" if op.block is not None else op.result  # names only
            names: list[str | None] = []
            for kind, values in (("freq", layer.freq), ("mag", layer.mag), ("score_scale", layer.score_scale)):
                if values is None:
                    names.append(None)
                    continue
                name = weights.fresh_name(f"{stem}.{kind}")
                weights.add(name, Tensor.from_f32(values))
                decls.append(WeightDecl(name, weights[name].type))
                names.append(name)
            op = replace(op, freq=names[0], mag=names[1], score_scale=names[2], threshold=layer.threshold,
                         down_threshold=layer.down_threshold)
        new_ops.append(op)
    attrs: list[tuple[str, Attr]] = [(k, v) for k, v in module.attrs if not k.startswith("profile_")]
    attrs += [("profile_calib", profile.calib), ("profile_tokens", profile.tokens),
              ("profile_window", profile.window), ("profile_seed", profile.seed)]
    if profile.target_sparsity is not None:
        attrs.append(("profile_target_sparsity", profile.target_sparsity))
    if profile.rule is not None:
        attrs.append(("profile_rule", profile.rule))
    module = replace(module, attrs=tuple(attrs), weights=tuple(decls))
    return module.with_function(replace(func, ops=tuple(new_ops))).with_used_weights_only()


# ---------------------------------------------------------------- files and plots


def save_npz(profile: Profile, path: Path) -> None:
    """Save the profile alone: per-layer ``freq``/``mag`` arrays and a JSON summary."""
    arrays: dict[str, np.ndarray] = {}
    for i, layer in enumerate(profile.layers):
        arrays[f"layer{i}.freq"] = layer.freq
        arrays[f"layer{i}.mag"] = layer.mag
        if layer.score_scale is not None:
            arrays[f"layer{i}.score_scale"] = layer.score_scale
    arrays["thresholds"] = np.array([layer.threshold for layer in profile.layers], np.float32)
    arrays["down_thresholds"] = np.array([layer.down_threshold for layer in profile.layers], np.float32)
    arrays["summary"] = np.array(json.dumps(profile.summary()))
    with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def plot(profile: Profile, path: Path) -> None:
    """Per-layer sparsity, and each layer's neuron frequencies sorted (log-log: the power law)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = len(profile.layers)
    ax1.bar(range(n), [layer.sparsity for layer in profile.layers], color="tab:blue")
    ax1.set(xlabel="layer", ylabel="sparsity (share of inactive neuron-tokens)", ylim=(0, 1),
            title=f"FFN sparsity per layer (mean {profile.mean_sparsity:.3f})")
    cmap = plt.get_cmap("viridis")
    for i, layer in enumerate(profile.layers):
        ranked = np.sort(layer.freq)[::-1]
        ax2.loglog(np.arange(1, len(ranked) + 1), np.maximum(ranked, 1e-6),
                   color=cmap(i / max(1, n - 1)), lw=1)
    ax2.set(xlabel="neuron rank", ylabel="activation frequency",
            title="neurons sorted by how often they fire (one curve per layer)")
    fig.suptitle(f"{profile.tokens} tokens of {profile.calib}")
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
