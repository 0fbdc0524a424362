"""The serving engine: one compiled model decoding many sequences, requests joining and leaving
between steps (continuous batching), each sequence's tokens exactly those of ``picc run``.

One thread owns the model. Each turn of its loop it admits waiting requests into free sequence
slots (:class:`runtime.sequences.SequencePool`: a KV cache per slot), runs prompt chunks of the
prefilling sequences up to one chunk's tokens in all (so a long prompt delays the others by one
chunk a turn, not by its whole length, and short prompts that arrive together start together),
then one decode step for every sequence that is decoding, and hands each its next token.
Cancelled and finished sequences give their slot back at once.

Exactness: a sequence's work is the one-sequence session's, call for call -- its prompt but the
last token through the chunk programs in chunks of the same boundaries (``Session.feed``), then a
step per token with the same code on its own caches, the same sampler with a generator seeded per
request (``Session.generate``). Nothing in a step depends on which other sequences are in the
pool, so its logits are bit-identical to ``picc run``'s whatever else is served. The decoding
sequences step together where the model has a batch step (``CpuExecutor.batch_step``: each row
the one-sequence step's arithmetic, the weights read once for all), ``rows_per_step`` at a time;
a greedy sequence alone runs the generated decode loop (``Executor.greedy_steps``).

Prompts that begin alike (a system prompt, a conversation's earlier turns and replies, the
choices of one request) compute what they share once: a sequence takes the KV rows of its
prompt's beginning that a slot already holds (its own, as :meth:`SequencePool.acquire` chooses
it, or another's, copied) where they are the rows its own run would write, so its tokens stay
``picc run``'s: rows of whole chunks at the same boundaries, or, where the chunk programs compute
the step's bits, any rows, a reply's included (:mod:`runtime.sequences`).
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.cpu import ExecutorError
from runtime.plan import MemoryPlan
from runtime.sampling import SamplingOptions, TokenLogprob, sample, token_logprob
from runtime.sequences import SequencePool, gpu_kv_caches
from runtime.session import Session

Emit = Callable[[str, object], None]
"""How the engine reports to a request's owner, from the engine's thread: for a request with
``prompt_logprobs``, once its prompt has run, ``("prompt_logprobs", [TokenLogprob])`` (prompt
tokens 1 on: the first has nothing before it); ``("tokens", [ids])`` for new tokens (for a request
with ``logprobs``, right after ``("logprobs", [TokenLogprob])`` of the same tokens); then
``("done", finish_reason)`` (``stop``: EOS; ``length``: ``max_tokens`` or a full context;
``cancelled``) or ``("error", message)``."""

DEFAULT_MAX_BATCH = 8  # sequences decoded at once unless told
RATE_WINDOW = 5.0  # seconds of decode steps the reported tok/s covers
FLUSH_SECONDS = 0.04
"""A sequence's new tokens go to its owner at most this often (the first at once), and only where
the owner follows them (``Request.progress``): each report wakes the server's event loop, whose
thread then competes for a core with the step's threads, which wait for each other at spinning
barriers (runtime.threads). Reported per token, a 2-core host served SmolLM2 at 170 tok/s,
against 279 for picc run; 40 ms is as smooth as text streams. Whole replies (8 clients, SmolLM2, a
2-core Zen 4): the event loop's thread took 0.07 s of CPU in a 1.57 s load with a report every
40 ms, 0.04 s with one at the end."""


class QueueFull(Exception):
    """Every slot is taken and ``max_queue`` requests are waiting for one already."""


@dataclass(frozen=True)
class Request:
    """What to generate: up to ``max_tokens`` tokens after ``prompt`` (ids), sampled with
    ``options`` from a generator seeded with ``seed`` (None: a random seed). ``progress``: the
    owner hears of the tokens as they come (a stream, or stop strings to watch for); otherwise
    all of them at the end."""

    prompt: list[int]
    max_tokens: int
    options: SamplingOptions = SamplingOptions()
    seed: int | None = None
    stop_at_eos: bool = True  # the model's stop tokens end the sequence
    stop_ids: frozenset[int] = frozenset()  # more tokens that end it, whatever stop_at_eos says
    progress: bool = True
    logprobs: int | None = None  # each token's log-probability, and this many most likely tokens'
    prompt_logprobs: int | None = None  # the same for each prompt token after the first


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: where its prompt and its decoding stand."""

    request: Request
    emit: Emit
    stops: frozenset[int] = frozenset()  # the tokens that end it (Engine.stops_of its request)
    slot: int = -1
    fed: int = 0  # prompt tokens but the last run through the chunk programs
    pos: int = 0
    made: int = 0
    history: list[int] = field(default_factory=list)
    rng: np.random.Generator | None = None
    cancelled: bool = False
    pending: list[int] = field(default_factory=list)  # tokens not reported yet
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, where asked for
    prompt_records: list[TokenLogprob] = field(default_factory=list)  # the prompt's, where asked for
    started: bool = False  # its prompt has run (but the last token, which the first step runs)
    cached: int = 0  # prompt positions whose KV rows it took from a slot instead of computing them
    reported: float = 0.0  # when tokens were last reported (perf_counter)

    def report(self) -> None:
        """Hand the pending tokens (and their log-probabilities) to the owner."""
        if self.pending:
            tokens, self.pending = self.pending, []
            self.reported = time.perf_counter()
            if self.request.logprobs is not None:
                logprobs, self.pending_logprobs = self.pending_logprobs, []
                self.emit("logprobs", logprobs)
            self.emit("tokens", tokens)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt) - 1


@dataclass
class EngineStats:
    """Counters for the server's metrics, updated by the engine's thread."""

    requests: int = 0
    prompt_tokens: int = 0  # computed
    cached_tokens: int = 0  # prompt tokens whose KV rows were taken from a slot that held them
    generated_tokens: int = 0
    steps: int = 0
    batch_steps: int = 0  # calls of the batch step (several sequences' steps in one)
    batch: int = 0  # sequences decoding in the last turn
    recent: collections.deque = field(default_factory=collections.deque)  # (time, tokens) of recent turns

    def rate(self, now: float) -> float:
        """Decode tokens per second over the last RATE_WINDOW seconds."""
        while self.recent and self.recent[0][0] < now - RATE_WINDOW:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / RATE_WINDOW


def serving_limits(plan: MemoryPlan, max_batch: int | None, max_queue: int | None) -> tuple[int, int]:
    """The sequences an engine for a model with ``plan`` decodes at once and the requests it lets
    wait for a slot: as given, else 8 (1 where the model keeps KV caches on the GPU, which hold one
    sequence) and 4 x that."""
    if max_batch is None:
        max_batch = 1 if gpu_kv_caches(plan) else DEFAULT_MAX_BATCH
    return max_batch, 4 * max_batch if max_queue is None else max_queue


class Engine:
    """Serves ``session``'s model to many requests at once: :meth:`submit`, :meth:`cancel`."""

    def __init__(self, session: Session, max_batch: int | None = None, max_queue: int | None = None,
                 prefix_cache: bool = True) -> None:
        self.session = session
        self.prefix_cache = prefix_cache  # False: every prompt computed whole (to measure what it saves)
        self.executor = session.executor
        self.max_batch, self.max_queue = serving_limits(self.executor.plan, max_batch, max_queue)
        self.pool = SequencePool(self.executor, self.max_batch)
        self.ctx = session.ctx
        self.stops = session.text.stop_ids if session.text is not None else frozenset()  # ids that end a reply
        self.stats = EngineStats()
        self.rows_per_step = self._fastest_rows()
        self._loop_steps = 1  # greedy steps per call of the decode loop for a sequence alone
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="picc-engine")
        self._thread.start()

    def _fastest_rows(self, runs: int = 5) -> int:
        """How many sequences one call of the batch step should take: the batch size (a power of
        two up to ``max_batch``) with the most rows per second, timed here on free slots (the best of
        ``runs`` calls each). Rows are not free: the linears' batched kernels are bound by their
        arithmetic, and every other op runs once per row (a 2-core Zen 4, SmolLM2, an early batch
        step: 3.7 ms a step for 1 row, 8.9 for 4, 21.2 for 8, where two calls of 4 beat one of 8;
        now 3.0, 5.0-5.5 and 9.1: 8 is chosen)."""
        cpu, most = self.executor.cpu, min(self.max_batch, self.pool.batched)
        if most < 2:
            return 1
        slots = [self.pool.acquire() for _ in range(most)]
        best, best_rate = 1, 0.0
        try:
            with self.executor.pinned():
                rows = 1
                while rows <= most:
                    pointers = self.pool.pointers(slots[:rows])
                    times = []
                    for i in range(runs + 1):  # the first call warms the code and caches up
                        start = time.perf_counter()
                        cpu.batch_step([0] * rows, [i] * rows, pointers)
                        times.append(time.perf_counter() - start)
                    rate = rows / min(times[1:])
                    if rate > best_rate:
                        best, best_rate = rows, rate
                    rows *= 2
        finally:
            for slot in slots:
                self.pool.release(slot)
        return best

    # ---- the requests' side (any thread) ----

    def submit(self, request: Request, emit: Emit) -> Sequence:
        """Queue ``request``; ``emit`` hears of its tokens. Raises QueueFull, or ValueError for a
        request that cannot run (the message says why)."""
        return self.submit_all([(request, emit)])[0]

    def submit_all(self, requests: list[tuple[Request, Emit]]) -> list[Sequence]:
        """Queue every one of ``requests`` (each with the ``emit`` that hears of its tokens), or
        none: QueueFull where the queue has no room for all of them (the choices of one API
        request), ValueError for one that cannot run."""
        seqs = [Sequence(request, emit, self.stops_of(request), history=list(self._checked(request)))
                for request, emit in requests]
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            room = self.max_queue + self.pool.free - len(self._waiting)  # those beyond the free slots wait
            if len(seqs) > room:
                raise QueueFull(f"{self.max_batch} sequences are decoding and {self.max_queue} requests are waiting "
                                "already" if len(seqs) == 1 else
                                f"there is room for {max(room, 0)} of the {len(seqs)} sequences asked for")
            self._waiting.extend(seqs)
            self.stats.requests += len(seqs)
            self._cond.notify()
        return seqs

    def _checked(self, request: Request) -> list[int]:
        """``request``'s prompt, once it is known that the request can run (else ValueError)."""
        prompt = request.prompt
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.executor.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {self.executor.vocab}")
        error = request.options.vocabulary_error(self.executor.vocab)
        if error:
            raise ValueError(error)
        if len(prompt) + request.max_tokens > self.ctx:
            raise ValueError(f"the prompt's {len(prompt)} tokens and max_tokens {request.max_tokens} need "
                             f"{len(prompt) + request.max_tokens} positions but the context holds {self.ctx}")
        request.options.check()
        return prompt

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` (a client that went away, a request taken back): still waiting, it leaves
        the queue at once (a request submitted next finds its place free); decoding, its slot is
        freed before the next step."""
        with self._cond:
            seq.cancelled = True
            if seq in self._waiting:
                self._waiting.remove(seq)
                seq.emit("done", "cancelled")
            self._cond.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        """Whether the engine's thread still runs (it ends only when closed, or on a bug)."""
        return self._thread.is_alive() and not self._closing

    def close(self) -> None:
        """Stop the engine's thread; requests still queued or running end with an error."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        for seq in [*self._waiting, *self._active]:
            seq.emit("error", "the server is shutting down")
        self._waiting.clear()
        self._active.clear()

    # ---- the engine's thread ----

    def _admit(self) -> bool:
        """Move waiting requests into free slots; False when the engine is closing."""
        with self._cond:
            while not self._closing and not self._waiting and not self._active:
                self._cond.wait()
            if self._closing:
                return False
            kept = [s for s in self._waiting if not s.cancelled]
            for seq in self._waiting:
                if seq.cancelled:
                    seq.emit("done", "cancelled")
            self._waiting = collections.deque(kept)
            while self._waiting and self.pool.free:
                seq = self._waiting.popleft()
                seq.slot = self.pool.acquire(seq.request.prompt if self._reuses(seq) else None)
                seq.rng = np.random.default_rng(seq.request.seed if seq.request.seed is not None
                                                else secrets.randbits(63))
                self._active.append(seq)
        return True

    def _loop(self) -> None:
        while self._admit():
            with self.executor.pinned():
                self._turn()

    def _turn(self) -> None:
        """One turn: drop cancelled sequences, prompt chunks (:meth:`_prefill`), a decode step for
        each decoding sequence."""
        for seq in [s for s in self._active if s.cancelled]:
            self._finish(seq, "done", "cancelled")
        prefilling = self._prefill()
        for seq in [s for s in self._active if not s.prefilling and not s.started]:
            self._start(seq)
        decoding = [s for s in self._active if not s.prefilling]
        made = sum(s.made for s in decoding)
        rows = self.rows_per_step
        if len(decoding) > 1 and rows > 1:
            for start in range(0, len(decoding), rows):
                self._batch_step(decoding[start : start + rows])
        elif (len(decoding) == 1 and not prefilling and not self._waiting and decoding[0].request.options.greedy
              and decoding[0].request.logprobs is None):  # the loop keeps no step's logits
            self._guarded(decoding[0], self._alone)
        else:
            for seq in decoding:
                self._guarded(seq, self._decode_step)
        now = time.perf_counter()
        for seq in decoding:
            if seq.pending and seq.request.progress and now - seq.reported >= FLUSH_SECONDS:
                seq.report()
        if decoding:
            self.stats.steps += 1
            self.stats.batch = len(decoding)
            self.stats.recent.append((now, sum(s.made for s in decoding) - made))
            self.stats.rate(now)  # drops the turns older than the window

    def _guarded(self, seq: Sequence, work: Callable[[Sequence], None]) -> None:
        """``work(seq)``; a runtime error ends that sequence (with its message), not the engine."""
        try:
            work(seq)
        except (ExecutorError, ValueError) as e:
            self._finish(seq, "error", str(e))

    def _prefill(self) -> bool:
        """The next prompt chunk of each prefilling sequence in turn, while they come to at most
        one chunk's tokens together (the first whatever its length): the decoding sequences wait
        no longer than for one long prompt's chunk, and eight short prompts that arrive together
        start decoding together, where one chunk a turn had them join the batch one step apart
        (a step of 1, 2, ... 7 rows costs nearly what a step of 8 does). Whether any ran."""
        budget, ran = self.executor.cpu.chunk, False
        for seq in [s for s in self._active if s.prefilling and self._reuses(s)]:
            self._reuse(seq)
        for seq in [s for s in self._active if s.prefilling]:
            part = self._next_part(seq)
            if ran and part > budget:
                break
            budget -= part
            self._guarded(seq, self._prefill_chunk)
            ran = True
        return ran

    def _reuses(self, seq: Sequence) -> bool:
        """Whether ``seq`` may take KV rows from a slot: not where it wants its prompt's
        log-probabilities, which need every chunk's logits."""
        return self.prefix_cache and seq.request.prompt_logprobs is None

    def _reuse(self, seq: Sequence) -> None:
        """Skip the beginning of ``seq``'s prompt whose KV rows a slot holds: its own slot's as they
        are, another's copied (a prompt that begins as one that ran, or is running, before it)."""
        n = self.pool.take(seq.slot, seq.request.prompt, seq.fed)
        self.stats.cached_tokens += n - seq.fed
        seq.cached += n - seq.fed
        seq.fed = seq.pos = n

    def _start(self, seq: Sequence) -> None:
        """``seq``'s prompt has run: its log-probabilities to the owner, where asked for; with
        ``max_tokens`` 0 (a prompt scored, nothing generated) that is all."""
        seq.started = True
        if seq.request.prompt_logprobs is not None:
            seq.emit("prompt_logprobs", seq.prompt_records)
        if seq.request.max_tokens == 0:
            self._finish(seq, "done", "length")

    def _next_part(self, seq: Sequence) -> int:
        """How many of ``seq``'s prompt tokens its next chunk takes."""
        return min(self.executor.cpu.chunk, len(seq.request.prompt) - 1 - seq.fed)

    def _prefill_chunk(self, seq: Sequence) -> None:
        """The next chunk of ``seq``'s prompt (but its last token), at the boundaries Session.feed uses."""
        part = seq.request.prompt[seq.fed : seq.fed + self._next_part(seq)]
        self.pool.bind(seq.slot)
        top = seq.request.prompt_logprobs
        if top is None:
            self.executor.prefill(part, seq.pos)
        else:  # the chunk's logits too: each predicts the prompt token after it
            rows = self.executor.logits_of(part, seq.pos)
            after = seq.request.prompt[seq.fed + 1 : seq.fed + 1 + len(part)]
            seq.prompt_records += [token_logprob(row, token, top) for row, token in zip(rows, after, strict=True)]
        seq.fed += len(part)
        seq.pos += len(part)
        self.stats.prompt_tokens += len(part)
        self.pool.hold(seq.slot, seq.request.prompt, seq.fed)  # logits_of's rows are prefill's: the same ops

    def _decode_step(self, seq: Sequence) -> None:
        """A step on ``seq``'s last token (the prompt's last, at first), then its next token."""
        self.pool.bind(seq.slot)
        self.executor.step(seq.history[-1], seq.pos)  # the prompt's last token, then each new one
        self._advance(seq, self.executor.greedy, self.executor.logits)

    def _alone(self, seq: Sequence) -> None:
        """The one sequence, greedy, with nothing waiting: steps in the generated decode loop
        (``Executor.greedy_steps``, the same steps without a return to Python between them), as
        many as took about FLUSH_SECONDS the last time, then back to the turn (a request that
        arrives meanwhile waits that long at most)."""
        steps = min(self._loop_steps, seq.request.max_tokens - seq.made, self.ctx - seq.pos)
        self.pool.bind(seq.slot)
        start = time.perf_counter()
        tokens = self.executor.greedy_steps(seq.history[-1], seq.pos, steps, seq.stops)
        self._loop_steps = max(1, int(FLUSH_SECONDS * len(tokens) / max(time.perf_counter() - start, 1e-9)))
        for token in tokens:
            self._advance(seq, lambda token=token: token, self.executor.logits)

    def _batch_step(self, seqs: list[Sequence]) -> None:
        """One step of the batch program for ``seqs`` (each row exactly its own step), then each
        one's next token. A failure ends every sequence of the batch."""
        cpu = self.executor.cpu
        try:
            cpu.batch_step([s.history[-1] for s in seqs], [s.pos for s in seqs],
                           self.pool.pointers([s.slot for s in seqs]))
        except ExecutorError as e:
            for seq in seqs:
                self._finish(seq, "error", str(e))
            return
        self.stats.batch_steps += 1
        greedy = cpu.batch_greedy(len(seqs))
        for row, seq in enumerate(seqs):
            self._guarded(seq, lambda s, row=row: self._advance(s, lambda: greedy[row], lambda: cpu.batch_logits(row)))

    def _advance(self, seq: Sequence, greedy: Callable[[], int], logits: Callable[[], np.ndarray]) -> None:
        """After ``seq``'s step: its next token, greedy or sampled from the step's ``logits``."""
        if seq.made == 0:
            self.stats.prompt_tokens += 1
        seq.pos += 1
        options = seq.request.options
        if options.greedy:
            nxt = greedy()
        else:
            assert seq.rng is not None
            generated = seq.history[len(seq.history) - seq.made:] if seq.made else []
            nxt = sample(logits(), options, seq.rng, seq.history, generated)
        if seq.request.logprobs is not None:
            seq.pending_logprobs.append(token_logprob(logits(), nxt, seq.request.logprobs))
        seq.made += 1
        seq.history.append(nxt)
        if self.pool.unit == 1:  # the step's rows are the chunk programs' (CpuChunkProgram.step_bits)
            self.pool.hold(seq.slot, seq.history, seq.pos)
        self.stats.generated_tokens += 1
        seq.pending.append(nxt)
        if nxt in seq.stops:
            self._finish(seq, "done", "stop")
        elif seq.made >= seq.request.max_tokens or seq.pos >= self.ctx:
            self._finish(seq, "done", "length")

    def stops_of(self, request: Request) -> frozenset[int]:
        """The tokens that end ``request``'s sequence: the model's (unless it ignores them) and
        its own."""
        return (self.stops | request.stop_ids) if request.stop_at_eos else request.stop_ids

    def _finish(self, seq: Sequence, kind: str, detail: str) -> None:
        seq.report()
        if seq in self._active:
            self._active.remove(seq)
            self.pool.release(seq.slot)
        seq.emit(kind, detail)
