"""Text generation on the reference interpreter: prefill the prompt, then decode with a KV cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from picc.errors import PiccError
from picc.frontend.model import LoadedModel
from picc.interpreter import Interpreter
from runtime.sampling import sample_next


@dataclass(frozen=True)
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float


def check_token_ids(ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise PiccError(f"token id {bad[0]} is out of range for a vocabulary of {vocab}")
    if not ids:
        raise PiccError("the prompt is empty: at least one token is needed")


def generate_ids(model: LoadedModel, prompt: list[int], n: int, temperature: float = 0.0,
                 seed: int = 0, stop_at_eos: bool = True,
                 clock: Callable[[], float] | None = None) -> Iterator[int]:
    """Yield up to ``n`` new token ids; greedy when ``temperature`` is 0 (as transformers does,
    generation ends after a stop token when ``stop_at_eos``: the tokenizer's ``stop_ids``, or the
    module's EOS for a model without a tokenizer)."""
    vocab = int(model.module.attr("vocab", 0) or 0)
    if vocab:
        check_token_ids(prompt, vocab)
    eos = model.module.attr("eos_id")
    stops = set(model.tokenizer.stop_ids) if model.tokenizer is not None else {eos} - {None}
    interp = Interpreter(model.module, model.weights)
    rng = np.random.default_rng(seed)
    logits = interp.run(prompt)
    for _ in range(n):
        token = sample_next(logits[-1], temperature, rng)
        yield token
        if stop_at_eos and token in stops:
            return
        logits = interp.run([token])
