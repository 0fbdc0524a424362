"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, repetition
penalty, as llama.cpp and transformers define them, and OpenAI's logit bias and presence and
frequency penalties; and a token's log-probability under the model (:func:`token_logprob`).

Order of operations (transformers' logits processors, with OpenAI's fields where vLLM puts
them): the logit bias (a number added to given tokens' logits), the repetition penalty (a token
already seen, in the prompt or since, has a positive logit divided by the penalty, a negative one
multiplied), then the frequency and presence penalties (a token generated c times so far loses
``c * frequency + (c > 0) * presence``: OpenAI's definition, counted over the generated tokens
only, as vLLM counts them), then temperature, then top-k, then top-p (the smallest set of most
likely tokens whose probability reaches p), then min-p (tokens less likely than ``min_p`` times
the most likely one are dropped: transformers' ``MinPLogitsWarper``, llama.cpp's and vLLM's
``min_p``), then a draw from what is left. Temperature 0 is greedy: the argmax of the biased and
penalised logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # 0: off; OpenAI's range -2..2
    frequency_penalty: float = 0.0  # 0: off; likewise
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), -100..100 each
    min_p: float = 0.0  # 0: off; keep tokens at least min_p times as likely as the most likely one

    def check(self) -> None:
        """Raise ValueError naming the option when one is out of range (NaN and infinities are)."""
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite value >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min-p must be in [0, 1] (0 turns it off), got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition penalty must be a finite value > 0 (1 turns it off), got "
                             f"{self.repetition_penalty}")
        for name, value in (("presence", self.presence_penalty), ("frequency", self.frequency_penalty)):
            if not -2 <= value <= 2:
                raise ValueError(f"{name} penalty must be in [-2, 2] (0 turns it off), got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"a logit bias maps a token id >= 0 to a number in [-100, 100], got {token}: {bias}")

    def vocabulary_error(self, vocab: int) -> str | None:
        """Why these options cannot sample from ``vocab`` tokens (a logit bias on a token past
        them), or None."""
        outside = [t for t, _ in self.logit_bias if t >= vocab]
        return f"the logit bias names token {outside[0]}, outside the vocabulary of {vocab}" if outside else None

    @property
    def greedy(self) -> bool:
        """Whether the next token is just the argmax of the logits (no penalty moves them)."""
        return (self.temperature == 0 and self.repetition_penalty == 1.0 and self.presence_penalty == 0
                and self.frequency_penalty == 0 and not self.logit_bias)


def sample_next(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy (``temperature == 0``, ties to the lowest id) or softmax sampling at ``temperature``."""
    return sample(logits, SamplingOptions(temperature=temperature), rng)


def sample(logits: np.ndarray, options: SamplingOptions, rng: np.random.Generator,
           seen: Iterable[int] = (), generated: Sequence[int] = ()) -> int:
    """The next token under ``options``; ``seen`` are the ids the repetition penalty applies to
    (the prompt's and the generated ones), ``generated`` the tokens generated so far (what the
    presence and frequency penalties count)."""
    options.check()
    z = logits.astype(np.float64)
    for token, bias in options.logit_bias:
        z[token] += bias
    if options.repetition_penalty != 1.0:
        ids = np.unique(np.fromiter(seen, dtype=np.int64))
        if ids.size:
            vals = z[ids]
            z[ids] = np.where(vals > 0, vals / options.repetition_penalty, vals * options.repetition_penalty)
    if (options.presence_penalty or options.frequency_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        z[ids] -= counts * options.frequency_penalty + options.presence_penalty
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
    if options.min_p > 0:
        p = np.where(p >= options.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model given the tokens before it, and the ``top`` most
    likely tokens' (id, log-probability) pairs, most likely first (ties: the lower id first).
    ``logprob`` None: a prompt's first token, which nothing before it predicts."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s log-probability in the softmax of ``logits`` (the model's own distribution: no
    temperature, penalty or truncation, as vLLM reports them), with the ``top`` most likely tokens'.
    In float64, from the logits the step computed."""
    z = logits.astype(np.float64)
    z -= z.max()
    log_p = z - math.log(float(np.exp(z).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, log_p.size)
        ids = np.argpartition(-log_p, k - 1)[:k]
        ids = ids[np.lexsort((ids, -log_p[ids]))]
        best = tuple((int(i), float(log_p[i])) for i in ids)
    return TokenLogprob(int(token), float(log_p[token]), best)
