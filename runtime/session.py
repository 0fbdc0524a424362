"""A loaded model and its conversation: prefill, decode, sampling, timings.

``Session`` opens a .pib, builds its executor (the CPU's generated code, and the GPU's -- a CUDA
device, or the host-emulated GPU where there is none) and keeps the position in the KV cache, so
a chat loop can feed one prompt after another. A prompt's tokens but the last run in chunks
through the batched prefill program (GEMMs for the linears; its sparse FFNs still decide per
token, as the interpreter does), or through the logits program (the same with the head) when
every token's logits are wanted, and the last through the decode step, which computes the
logits. On a model with a GPU part the chunks go stage by stage, the GPU's ops token by token
between the chunk's rows (``Executor._run_chunk``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.cpu import ExecutorError
from runtime.executor import Executor
from runtime.pib import PibFile
from runtime.sampling import SamplingOptions, sample
from runtime.text import TextCodec

STREAM_SECONDS = 0.05  # a batch of greedy steps between the streamed text's updates


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0
    decode_seconds: float = 0.0
    per_token: list[float] = field(default_factory=list)

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


class Session:
    """One compiled model with its KV cache; not thread-safe."""

    def __init__(self, path: str | Path, threads: int | None = 1, ctx: int | None = None, gpu: str = "auto") -> None:
        self.pib = PibFile(path)
        self.max_ctx = self.pib.plan().ctx
        if ctx is not None and not 1 <= ctx <= self.max_ctx:
            raise ExecutorError(f"--ctx {ctx}: expected 1 to {self.max_ctx}, the positions this model was "
                                "compiled for (picc compile --ctx N)")
        self.ctx = ctx or self.max_ctx
        self.executor = Executor(self.pib, threads, gpu)
        self.text = TextCodec(self.pib.text("tokenizer")) if self.pib.has("tokenizer") else None
        self.pos = 0
        self.history: list[int] = []

    @property
    def vocab(self) -> int:
        return self.executor.vocab

    def reset(self) -> None:
        """Forget the conversation (positions restart at 0; old cache entries are never read)."""
        self.pos = 0
        self.history = []

    def rewind(self, pos: int) -> None:
        """Keep the conversation's first ``pos`` tokens and forget what came after (their cache
        rows are written over): a chat's next prompt repeats the conversation so far, and only
        where it differs from what was fed must it be fed."""
        if not 0 <= pos <= self.pos:
            raise ExecutorError(f"rewind to position {pos}: expected 0 to {self.pos}, the positions fed")
        self.pos = pos
        self.history = self.history[:pos]

    def _check(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ExecutorError(f"token id {bad[0]} is out of range for a vocabulary of {self.vocab}")
        if self.pos + len(ids) > self.ctx:
            raise ExecutorError(f"the prompt needs {self.pos + len(ids)} positions but the context holds "
                                f"{self.ctx} (picc compile --ctx N, or a shorter prompt)")

    def feed(self, ids: list[int], timings: Timings | None = None, *, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` at the next positions; the last token's logits (or every token's)."""
        if not ids:
            raise ExecutorError("the prompt is empty: at least one token is needed")
        self._check(ids)
        start = time.perf_counter()
        rows = []
        count = len(ids)
        if len(ids) > 1:
            # All but the last token in chunks; the last through a step, which leaves its logits
            # and greedy token where generation reads them.
            if all_logits:
                rows.append(self.executor.logits_of(ids[:-1], self.pos))
            else:
                self.executor.prefill(ids[:-1], self.pos)
            self.pos += len(ids) - 1
            self.history += ids[:-1]
            ids = ids[-1:]
        for i, token in enumerate(ids):
            self.executor.step(token, self.pos, logits=all_logits or i + 1 == len(ids))
            self.pos += 1
            if all_logits:
                rows.append(self.executor.logits()[None].copy())
        self.history += ids
        if timings is not None:
            timings.prompt_tokens += count
            timings.prompt_seconds += time.perf_counter() - start
        return np.concatenate(rows) if all_logits else self.executor.logits()

    def check_options(self, options: SamplingOptions) -> None:
        """ValueError for an option out of range; ExecutorError for a logit bias on a token this
        model does not have."""
        options.check()
        error = options.vocabulary_error(self.vocab)
        if error:
            raise ExecutorError(error)

    def generate(self, prompt: list[int], n: int, options: SamplingOptions = SamplingOptions(),  # noqa: B008
                 seed: int = 0, stop_at_eos: bool = True, timings: Timings | None = None) -> Iterator[int]:
        """Feed ``prompt``, then yield up to ``n`` new tokens (fewer after a stop token -- EOS or
        another that ends the model's replies -- or at a full context).

        Greedy decoding runs its steps in batches (:meth:`Executor.greedy_steps`: on a CPU model,
        a loop in generated code), sized to take about :data:`STREAM_SECONDS` each, so that the
        text still streams; other sampling runs a step at a time and samples in Python.
        """
        self.check_options(options)
        timings = timings if timings is not None else Timings()
        logits = self.feed(prompt, timings)
        stops = self.text.stop_ids if self.text is not None and stop_at_eos else frozenset()
        if n < 1:
            return
        if options.greedy:
            yield from self._generate_greedy(n, stops, timings)
            return
        rng = np.random.default_rng(seed)
        generated: list[int] = []  # what the presence and frequency penalties count
        with self.executor.pinned():  # the caller stays on its core for the whole decode
            for i in range(n):
                token = sample(logits, options, rng, self.history, generated)
                generated.append(token)
                yield token
                if token in stops or i + 1 == n or self.pos >= self.ctx:
                    self.history.append(token)
                    return
                start = time.perf_counter()
                self.executor.step(token, self.pos)
                self.pos += 1
                self.history.append(token)
                logits = self.executor.logits()
                self._count(timings, 1, time.perf_counter() - start)

    def _generate_greedy(self, n: int, stops: frozenset[int], timings: Timings) -> Iterator[int]:
        """:meth:`generate`'s greedy tokens after the prompt was fed: a batch of steps at a time,
        each batch as long as the last one's tokens took about STREAM_SECONDS (the first: 1)."""
        token = self.executor.greedy()
        yield token
        made, batch = 1, 1
        with self.executor.pinned():
            while token not in stops and made < n and self.pos < self.ctx:
                steps = min(batch, n - made, self.ctx - self.pos)
                start = time.perf_counter()
                tokens = self.executor.greedy_steps(token, self.pos, steps, stops)
                elapsed = time.perf_counter() - start
                self._count(timings, len(tokens), elapsed)
                self.pos += len(tokens)
                self.history += [token, *tokens[:-1]]  # the tokens fed
                made += len(tokens)
                token = tokens[-1]
                batch = max(1, int(STREAM_SECONDS * len(tokens) / max(elapsed, 1e-9)))
                yield from tokens
        self.history.append(token)

    @staticmethod
    def _count(timings: Timings, tokens: int, seconds: float) -> None:
        timings.tokens += tokens
        timings.decode_seconds += seconds
        timings.per_token += [seconds / tokens] * tokens

    def greedy_tokens(self, n: int) -> list[int]:
        """After :meth:`feed`: the ``n`` greedy tokens that follow, with ``n - 1`` decode steps.

        The first is the fed text's most likely next token; each step feeds the previous one (the
        last is returned, not fed: as in :meth:`generate`, which stops at EOS and samples, and
        which this is without either: the loop benchmarks time). Positions and history advance.
        """
        if n < 1:
            raise ExecutorError(f"greedy_tokens: n must be >= 1, got {n}")
        if self.pos + n - 1 > self.ctx:
            raise ExecutorError(f"{n} greedy tokens need {self.pos + n - 1} positions but the context holds "
                                f"{self.ctx}")
        executor = self.executor
        tokens = [executor.greedy()]
        with executor.pinned():  # the caller stays on its core, as in generate
            tokens += executor.greedy_steps(tokens[0], self.pos, n - 1)
        self.pos += n - 1
        self.history += tokens
        return tokens

    def close(self) -> None:
        self.executor.close()
        self.pib.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
