"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, repetition
penalty, as llama.cpp and transformers define them.

Order of operations (transformers' logits processors): the repetition penalty on the raw
logits (a token already seen has a positive logit divided by the penalty, a negative one
multiplied), then temperature, then top-k, then top-p (the smallest set of most likely tokens
whose probability reaches p), then a draw from what is left. Temperature 0 is greedy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off

    def check(self) -> None:
        """Raise ValueError naming the option when one is out of range (NaN and infinities are)."""
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite value >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition penalty must be a finite value > 0 (1 turns it off), got "
                             f"{self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is just the argmax of the logits."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


def sample_next(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy (``temperature == 0``, ties to the lowest id) or softmax sampling at ``temperature``."""
    return sample(logits, SamplingOptions(temperature=temperature), rng)


def sample(logits: np.ndarray, options: SamplingOptions, rng: np.random.Generator,
           seen: Iterable[int] = ()) -> int:
    """The next token under ``options``; ``seen`` are the ids the repetition penalty applies to."""
    options.check()
    z = logits.astype(np.float64)
    if options.repetition_penalty != 1.0:
        ids = np.unique(np.fromiter(seen, dtype=np.int64))
        if ids.size:
            z = z.copy()
            vals = z[ids]
            z[ids] = np.where(vals > 0, vals / options.repetition_penalty, vals * options.repetition_penalty)
    if options.temperature == 0:
        return int(np.argmax(z))
    z = z / options.temperature
    if 0 < options.top_k < z.size:
        kth = np.partition(z, -options.top_k)[-options.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if options.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cumulative, options.top_p)) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))
