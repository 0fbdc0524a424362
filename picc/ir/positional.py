"""Position encodings' numbers, as transformers computes them: rotary frequencies (``rope``)
and ALiBi slopes (``attention``)."""

from __future__ import annotations

import math

import numpy as np

ROTATION = ("pos", "head_dim", "rotated", "style", "theta", "scaling", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position", "freq_factors", "attention_factor")
"""The fields of a ``rope`` that decide its angles: two ropes equal in all of them rotate alike."""


def inv_freq(rotated: int, theta: float, scaling: str, factor: float, low_freq_factor: float,
             high_freq_factor: float, original_max_position: int, freq_factors: tuple[float, ...] = ()) -> np.ndarray:
    """Per-pair angular frequency, float32: ``theta ** (-2i / rotated)``, then ``linear`` scaling
    divides it by ``factor``, ``llama3`` divides only the low frequencies, smoothing between
    ``low_freq_factor`` and ``high_freq_factor`` relative to ``original_max_position``, and
    ``longrope`` and ``yarn`` are ``1 / (freq_factors[i] * theta ** (2i / rotated))`` (rounded as
    transformers rounds longrope's; yarn's, :func:`yarn_freq_factors`, are transformers' blend of
    two frequencies to a float32 rounding or two)."""
    exponent = np.arange(0, rotated, 2, dtype=np.float32) / np.float32(rotated)
    power = np.power(np.float32(theta), exponent).astype(np.float32)
    if scaling in ("longrope", "yarn"):
        return (np.float32(1) / (np.asarray(freq_factors, np.float32) * power)).astype(np.float32)
    inv = (1.0 / power).astype(np.float32)
    if scaling == "linear":
        inv = inv / np.float32(factor)
    elif scaling == "llama3":
        old = float(original_max_position)
        low_wavelen = old / low_freq_factor
        high_wavelen = old / high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def yarn_freq_factors(rotated: int, theta: float, factor: float, original: int, beta_fast: float, beta_slow: float,
                      truncate: bool, *, llama_cpp: bool = False) -> tuple[float, ...]:
    """YaRN's divisor of each rotary pair's frequency: 1 (extrapolated) for the pairs that turn
    more than ``beta_fast`` times in ``original`` positions, ``factor`` (interpolated) for those
    that turn fewer than ``beta_slow`` times, and between them a blend whose share of the
    interpolated frequency ramps linearly with the pair's index. The ramp's ends are fractional
    pair indices, rounded outwards with ``truncate``. As transformers' ``_compute_yarn_parameters``
    computes it, or (``llama_cpp``) ggml's ``rope_yarn``: the two differ only where the ends cross,
    which transformers ramps backwards over and ggml makes a step."""

    def pair(rotations: float) -> float:  # the fractional pair index that turns ``rotations`` times
        return rotated * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated - 1)
    span = max(high - low, 0.001) if llama_cpp else (high + 0.001 if low == high else high) - low
    interpolated = np.clip((np.arange(rotated // 2) - low) / span, 0, 1)
    return tuple(float(f) for f in 1 / (interpolated / factor + (1 - interpolated)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling for ``factor``: ``1 + 0.1 * mscale * ln(factor)``, 1 for a factor <= 1."""
    return 1.0 if factor <= 1 else 1 + 0.1 * mscale * math.log(factor)


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi slopes per head, as BLOOM/Falcon compute them (also for non-powers of two)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(closest, n_heads - closest))]
    return np.asarray(slopes, dtype=np.float32)
