"""Choosing the next token from a row of logits."""

from __future__ import annotations

import numpy as np


def sample_next(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy (``temperature == 0``, ties to the lowest id) or softmax sampling at ``temperature``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(len(p), p=p))
