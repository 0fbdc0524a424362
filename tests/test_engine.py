"""The serving engine: many sequences through one compiled model, each exactly as ``picc run``.

Exact means token for token, not close: a sparse FFN's gate decisions flip on differences of 1e-7,
so the engine must do each sequence's arithmetic exactly as a session alone would. The prompts
differ in length (one needs two prefill chunks of 32, one is a single token), requests join while
others decode, and greedy and seeded sampling are both checked.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import tiny_llama, with_tokenizer

from picc.compile import CompileOptions, compile_model, write_compiled
from picc.ir.types import DType
from picc.sparsity.sparsify import SparsifyOptions
from runtime.cpu import BATCH_STAGE, ExecutorError
from runtime.cpu_manifest import CpuBatchProgram
from runtime.engine import Engine, QueueFull, Request
from runtime.generation import Generation
from runtime.pib import PibFile
from runtime.sampling import SamplingOptions, token_logprob
from runtime.sequences import SequencePool
from runtime.session import Session

PROMPTS = [[1, 5, 9, 2, 17], [1, *((7 * i + 3) % 61 for i in range(44))], [3], [1, 8, 8, 8, 8, 40, 41],
           [1, 22, 23], [1, *range(10, 40)], [1, 60, 2], [1, 9, 9, 14, 15, 16, 17, 18, 19, 20, 21, 50]]
SAMPLED = SamplingOptions(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)


def compiled(tmp_path, name: str, **options):
    form = "reglu" if options.get("sparse") else "swiglu"
    model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_1))
    result = compile_model(model, CompileOptions(**options), say=lambda _: None)
    path = tmp_path / f"{name}.pib"
    write_compiled(result, path)
    return path


@pytest.fixture(scope="module", params=["dense", "gate-first"])
def model(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "dense":
        return compiled(tmp, "dense", dense=True)
    sparsity = SparsifyOptions(mode="gate-first", tokens=512, window=64, budget=0.5)
    return compiled(tmp, "sparse", sparse=True, sparsity=sparsity)


def alone(path, prompt, n, options=SamplingOptions(), seed=0) -> list[int]:  # noqa: B008
    with Session(path, 2) as s:
        return list(s.generate(list(prompt), n, options, seed=seed))


def until(condition, seconds: float = 60) -> None:
    """Wait for ``condition()`` (polling), failing after ``seconds`` rather than hanging."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class Collector:
    """A request's events, and when it is over."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reports = 0  # "tokens" events
        self.end: tuple[str, object] | None = None
        self.done = threading.Event()
        self.logprobs: list = []  # "logprobs" events, where the request asks
        self.prompt_logprobs: list | None = None

    def __call__(self, kind: str, value: object) -> None:
        if kind == "tokens":
            self.tokens += value
            self.reports += 1
        elif kind == "logprobs":
            assert len(self.logprobs) == len(self.tokens)  # each report's come before its tokens
            self.logprobs += value
        elif kind == "prompt_logprobs":
            assert not self.tokens and self.prompt_logprobs is None  # once, before any token
            self.prompt_logprobs = value
        else:
            self.end = (kind, value)
            self.done.set()


def serve(path, requests, max_batch=4, joins_after=3, batched=True):
    """``requests`` through one engine: the first ``joins_after`` at once, the others one by one
    while the first are decoding. Their collectors, in order."""
    with Session(path, 2) as session:
        engine = Engine(session, max_batch=max_batch)
        got = [Collector() for _ in requests]
        for r, c in list(zip(requests, got, strict=True))[:joins_after]:
            engine.submit(r, c)
        for r, c in list(zip(requests, got, strict=True))[joins_after:]:
            until(lambda: got[0].tokens)
            engine.submit(r, c)
        for c in got:
            assert c.done.wait(120)
        assert engine.pool.free == max_batch and engine.active == 0  # every slot given back
        assert (engine.stats.batch_steps > 0) == batched  # sequences did decode together
        engine.close()
    return got


def test_concurrent_requests_decode_exactly_as_single_runs(model):
    n = [12, 20, 8, 16, 5, 24, 9, 14]
    requests = [Request(p, k) for p, k in zip(PROMPTS, n, strict=True)]
    got = serve(model, requests)
    for p, k, c in zip(PROMPTS, n, got, strict=True):
        assert c.tokens == alone(model, p, k)
        assert c.end in (("done", "length"), ("done", "stop"))


def turns(path, prompts, n) -> int:
    """The engine's turns with a decode step while ``prompts``, queued at once, each make ``n``
    tokens (each checked against a session alone)."""
    with Session(path, 2) as session:
        engine = Engine(session, max_batch=len(prompts))
        assert session.executor.cpu.chunk == 32
        got = [Collector() for _ in prompts]
        engine.submit_all([(Request(p, n, stop_at_eos=False), c) for p, c in zip(prompts, got, strict=True)])
        for c in got:
            assert c.done.wait(120)
        steps = engine.stats.steps
        engine.close()
    for p, c in zip(prompts, got, strict=True):
        assert c.tokens == alone(path, p, n)
    return steps


def test_a_reply_ends_at_the_first_of_the_models_stop_tokens(model):
    # A model may end its replies with several tokens (Llama 3 Instruct: <|eot_id|> and
    # <|eom_id|>; Phi-3: <|end|> and <|endoftext|>): each ends a sequence, in the batch step and in
    # the decode loop of a sequence alone, and the reply is the single run's up to it.
    free = [alone(model, p, 24) for p in PROMPTS[:3]]
    with Session(model, 2) as session:
        stops = frozenset(session.text.stop_ids | {free[0][6], free[1][9]})
        session.text.stop_ids = stops
        engine = Engine(session, max_batch=4)
        got = [Collector() for _ in range(4)]
        for prompt, c in zip(PROMPTS[:3], got[:3], strict=True):
            engine.submit(Request(prompt, 24), c)
        for c in got[:3]:
            assert c.done.wait(120)
        engine.submit(Request(PROMPTS[0], 24), got[3])  # alone: the decode loop
        assert got[3].done.wait(120)
        assert engine.stats.batch_steps > 0
        engine.close()
    for run, c in zip([*free, free[0]], got, strict=True):
        cut = next((i + 1 for i, t in enumerate(run) if t in stops), len(run))
        assert c.tokens == run[:cut]
        assert c.end == ("done", "stop" if cut < 24 else "length")
    assert len(got[0].tokens) <= 7 and len(got[1].tokens) <= 10  # the added tokens did end them
    # A request's own stop tokens (the server's stop_token_ids) end it too, even one that ignores
    # the model's: the single run up to the first of them.
    with Session(model, 2) as session:
        session.text.stop_ids = frozenset({free[0][2]})
        engine = Engine(session, max_batch=4)
        mine = [Collector() for _ in range(2)]
        for c, prompt in zip(mine, PROMPTS[1:3], strict=True):
            engine.submit(Request(prompt, 24, stop_at_eos=False, stop_ids=frozenset({free[2][5]})), c)
        for c in mine:
            assert c.done.wait(120)
        engine.close()
    for run, c in zip(free[1:], mine, strict=True):
        cut = next((i + 1 for i, t in enumerate(run) if t == free[2][5]), len(run))
        assert c.tokens == run[:cut] and c.end == ("done", "stop" if cut < 24 else "length")
    assert len(mine[1].tokens) <= 6


def test_short_prompts_that_arrive_together_decode_together(model):
    # A turn prefills chunks while they come to one chunk's tokens (32; the first whatever its
    # length). Three short prompts (4, 6 and 2 tokens before the last) and a one-token one all
    # decode from the first turn: 10 tokens, 10 turns. One chunk a turn had them join a step
    # apart (12 turns). Two long prompts (30 tokens before the last; and 44: chunks of 32 and 12)
    # do not share a turn's chunk: the first decodes from the first turn, the other from the
    # third, 12 turns (both prompts' first chunks in the first turn would have made it 11).
    assert turns(model, [PROMPTS[i] for i in (0, 2, 3, 4)], 10) == 10
    assert turns(model, [PROMPTS[5], PROMPTS[1]], 10) == 12


def test_an_owner_that_wants_the_whole_reply_hears_of_it_once(model):
    # Each report wakes the server's event loop, which competes with the step's threads for the
    # cores; a reply that is not streamed needs none but the last. (The first token of a request
    # is reported at once, so without that rule the quiet request would hear twice at least.)
    requests = [Request(PROMPTS[0], 30, progress=False), Request(PROMPTS[1], 30)]
    quiet, followed = serve(model, requests, max_batch=2, joins_after=2)
    assert quiet.reports == 1 and len(quiet.tokens) == 30 and quiet.end == ("done", "length")
    assert quiet.tokens == alone(model, PROMPTS[0], 30)
    assert followed.reports >= 2 and len(followed.tokens) == 30


def test_seeded_sampling_is_reproducible_per_request(model):
    requests = [Request(p, 10, SAMPLED, seed=100 + i) for i, p in enumerate(PROMPTS)]
    got = serve(model, requests, max_batch=8, joins_after=5)
    for i, (p, c) in enumerate(zip(PROMPTS, got, strict=True)):
        assert c.tokens == alone(model, p, 10, SAMPLED, seed=100 + i), i
    # A different seed gives a different continuation somewhere (else the check above is vacuous).
    assert any(alone(model, p, 10, SAMPLED, seed=7) != c.tokens for p, c in zip(PROMPTS, got, strict=True))


def test_logprobs_are_each_steps_own_distribution(model):
    # A request with logprobs gets, for each of its tokens, the token's log-probability in the
    # softmax of its step's logits and the k most likely tokens': the very numbers a session alone
    # computes from its own logits, which are the same bits; greedy or sampled, batched or not.
    requests = [Request(p, 8, SAMPLED if i % 2 else SamplingOptions(), seed=i, logprobs=3)
                for i, p in enumerate(PROMPTS[:4])]
    got = serve(model, requests, max_batch=4, joins_after=2)
    for i, (request, c) in enumerate(zip(requests, got, strict=True)):
        assert [r.token for r in c.logprobs] == c.tokens and len(c.tokens) == 8, i
        with Session(model, 2) as s:
            logits = s.feed(list(request.prompt))
            for record, token in zip(c.logprobs, c.tokens, strict=True):
                assert record == token_logprob(logits, token, 3), i
                assert len(record.top) == 3 and record.logprob <= record.top[0][1] <= 0
                if not i % 2:  # greedy: the most likely token
                    assert record.top[0][0] == token
                logits = s.feed([token])
    # One greedy sequence alone (the engine's generated decode loop keeps no step's logits).
    (alone_got,) = serve(model, [Request(PROMPTS[0], 6, logprobs=0)], joins_after=1, batched=False)
    assert [r.token for r in alone_got.logprobs] == alone_got.tokens == alone(model, PROMPTS[0], 6)
    assert all(r.top == () for r in alone_got.logprobs)


def test_prompt_logprobs_come_from_the_prompts_chunks(model):
    # Each prompt token after the first gets its log-probability given the ones before it, from
    # the logits of the chunk program that runs the prompt (the same chunks as a session's); with
    # max_tokens 0 that is all a request gets, with more the tokens follow as for any request.
    long = PROMPTS[1]  # 45 tokens: two chunks
    requests = [Request(long, 0, prompt_logprobs=2), Request(PROMPTS[0], 3, prompt_logprobs=0, logprobs=0),
                Request(PROMPTS[2], 0, prompt_logprobs=1)]  # one token: nothing to score
    got = serve(model, requests, max_batch=4, joins_after=3, batched=False)
    for request, c in zip(requests, got, strict=True):
        prompt = request.prompt
        with Session(model, 2) as s:
            rows = s.executor.logits_of(prompt[:-1], 0) if len(prompt) > 1 else []
        expected = [token_logprob(row, token, request.prompt_logprobs)
                    for row, token in zip(rows, prompt[1:], strict=True)]
        assert c.prompt_logprobs == expected and len(expected) == len(prompt) - 1
        assert c.tokens == alone(model, prompt, request.max_tokens) and c.end == ("done", "length")
    assert got[1].tokens and [r.token for r in got[1].logprobs] == got[1].tokens


def _exact(model, request: Request, c: Collector) -> None:
    """``c`` got a session's own tokens for ``request`` and, for each, the log-probabilities of the
    session's own logits (float64 of the same bits: a logit one ulp off changes them)."""
    assert c.tokens == alone(model, request.prompt, request.max_tokens, request.options, request.seed)
    with Session(model, 2) as s:
        logits = s.feed(list(request.prompt))
        for record, token in zip(c.logprobs, c.tokens, strict=True):
            assert record == token_logprob(logits, token, request.logprobs)
            logits = s.feed([token])
    assert len(c.logprobs) == len(c.tokens) == request.max_tokens


LONG = [1, *((5 * i + 2) % 61 for i in range(80))]  # 81 tokens: two whole chunks before the last token


def test_prompts_that_begin_alike_compute_what_they_share_once(model, monkeypatch):
    # A prompt takes the KV rows of its beginning that a slot holds: in place, in the slot it is
    # given (the free one that holds most of it), or copied from another slot, whose sequence may
    # still be running. The dense model's chunk programs compute the step's bits (rows8, int16 x),
    # so any rows are taken ("unit" 1); the gate-first model's chunk FFN does not, so only rows of
    # whole chunks (32), and the rest of the prompt runs at the chunk boundaries a session's would.
    # Either way the tokens and log-probabilities are a session's own.
    def request(prompt, n=6, **kw):
        return Request(prompt, n, SAMPLED, seed=len(prompt), logprobs=2, **kw)

    with Session(model, 2) as session:
        engine = Engine(session, max_batch=3)
        unit = engine.pool.unit
        assert unit == (1 if "dense" in model.name else 32)

        def whole(n: int) -> int:
            return n // unit * unit

        copies = []
        copy = engine.pool.copy
        monkeypatch.setattr(engine.pool, "copy", lambda *a: (copies.append(a[2:]), copy(*a)))

        def one(r):
            c = Collector()
            seq = engine.submit(r, c)
            assert c.done.wait(60)
            return seq, c

        first, again = request(LONG), request([*LONG[:70], 3, 4, 5])  # 73 tokens, 70 alike
        done = [(first, *one(first)), (again, *one(again))]
        assert [seq.cached for _, seq, _ in done] == [0, whole(70)]
        # In place where the slot holds nothing more (LONG's two chunks); else copied to another
        # slot, which keeps first's 86 rows (its prompt, then its reply) for a prompt that wants them.
        assert copies == ([] if unit == 32 else [(0, 70)])
        # One that runs a third chunk past LONG's, and while it decodes one that shares 100 tokens.
        longer = request([*LONG, *[7] * 40], n=40)
        c_longer = Collector()
        seq_longer = engine.submit(longer, c_longer)
        until(lambda: c_longer.tokens)
        during = request([*longer.prompt[:100], 9])
        done += [(during, *one(during))]
        assert c_longer.done.wait(60)
        done += [(longer, seq_longer, c_longer)]
        assert seq_longer.cached == whole(81) and done[2][1].cached == whole(100) and copies[-1][1] == whole(100)
        # The choices of one request: the first computes each chunk, the others copy it a turn later.
        fresh = [3, *((11 * i + 5) % 61 for i in range(70))]
        choices = [Request(fresh, 6, SAMPLED, seed=j, logprobs=2) for j in range(3)]
        got = [Collector() for _ in choices]
        seqs = engine.submit_all(list(zip(choices, got, strict=True)))
        assert all(c.done.wait(60) for c in got)
        assert [seq.cached for seq in seqs] == [0, 64, 64]  # whole chunks, as the first computes them
        done += list(zip(choices, seqs, got, strict=True))
        # A prompt whose log-probabilities were asked for computes every chunk (they come from the
        # chunks' logits) and leaves rows that a later prompt takes: the chunk program with the
        # head writes the rows the one without it writes.
        scored = Request([2, *fresh[1:]], 0, prompt_logprobs=1)
        after = request([*scored.prompt, 8])
        done += [(after, *one(after))] if one(scored)[0].cached == 0 else []
        assert done[-1][0] is after and done[-1][1].cached == whole(70)  # scored's last token never ran
        assert engine.stats.cached_tokens == sum(seq.cached for _, seq, _ in done) > 0
        engine.close()
    for r, _, c in done:
        _exact(model, r, c)
    with Session(model, 2) as session:  # the cache switched off: every prompt computed whole
        engine = Engine(session, max_batch=3, prefix_cache=False)
        seqs = [engine.submit(r, Collector()) for r in (first, first)]
        until(lambda: engine.active == 0 and not engine.waiting)
        assert [s.cached for s in seqs] == [0, 0] and engine.stats.cached_tokens == 0
        engine.close()


def test_a_conversations_next_turn_takes_the_replys_rows_where_chunks_compute_the_steps_bits(model):
    # The next turn of a chat is the last prompt, its reply, and a new message. Where the chunk
    # programs compute the step's bits (the dense model) the rows the decode steps wrote for the
    # reply are the rows a chunk would write, and they are taken too: all but the new message is
    # cached. Elsewhere (gate-first) only the last prompt's whole chunks are. Exact either way.
    with Session(model, 2) as session:
        engine = Engine(session, max_batch=2)
        turns, history = [], list(LONG[:40])
        for message in ([5, 6, 7], [9, 10], [11, 12, 13, 14]):
            c = Collector()
            r = Request([*history, *message], 7, SAMPLED, seed=len(turns), logprobs=2)
            seq = engine.submit(r, c)
            assert c.done.wait(60)
            turns.append((r, seq, c))
            history = [*r.prompt, *c.tokens]
        engine.close()
    for i, (_, seq, _) in enumerate(turns[1:]):
        last, reply = turns[i][0].prompt, turns[i][2].tokens
        written = len(last) + len(reply) - 1  # the last reply token was never stepped
        assert seq.cached == (written if engine.pool.unit == 1 else (len(last) - 1) // 32 * 32)
    for r, _, c in turns:
        _exact(model, r, c)


def test_presence_and_frequency_penalties_are_picc_runs_in_a_batch(model):
    # The penalties count each sequence's own generated tokens, whatever else is in the batch. (The
    # tiny model seldom repeats a token within 12: a negative presence penalty makes it, and the
    # frequency penalty then counts the repeats.)
    penalised = SamplingOptions(presence_penalty=-1.0, frequency_penalty=0.4)
    requests = [Request(p, 12, penalised) for p in PROMPTS]
    got = serve(model, requests, max_batch=8, joins_after=5)
    for i, (p, c) in enumerate(zip(PROMPTS, got, strict=True)):
        assert c.tokens == alone(model, p, 12, penalised), i
    # They change the tokens somewhere (else the check above is vacuous).
    assert any(alone(model, p, 12) != c.tokens for p, c in zip(PROMPTS, got, strict=True))


def test_cancelled_and_refused_requests_free_their_slots(model):
    with Session(model, 1) as session:
        engine = Engine(session, max_batch=2, max_queue=1)
        long = [Collector(), Collector()]
        most = session.ctx - len(PROMPTS[1])  # as long as the context allows: still running when cancelled
        seqs = []
        for n, c in enumerate(long, 1):
            seqs.append(engine.submit(Request(PROMPTS[1], most, SAMPLED), c))  # sampled: a step a turn
            until(lambda n=n: engine.active == n)  # admitted: the queue is empty again
        # A request's choices are queued all or none: two where one place is free, none queued
        # (choices queued one by one and taken back held their places until the engine's next
        # turn, and a request right after got a 429 too); a queued request taken back leaves at once.
        with pytest.raises(QueueFull, match="room for 1 of the 2 sequences"):
            engine.submit_all([(Request(PROMPTS[0], 4), Collector()), (Request(PROMPTS[0], 4), Collector())])
        assert engine.waiting == 0
        gone = Collector()
        engine.cancel(engine.submit(Request(PROMPTS[0], 4), gone))
        assert engine.waiting == 0 and gone.end == ("done", "cancelled") and not gone.tokens
        queued = Collector()
        engine.submit(Request(PROMPTS[0], 4), queued)
        with pytest.raises(QueueFull):
            engine.submit(Request(PROMPTS[0], 4), Collector())
        with pytest.raises(ValueError, match="context holds"):
            engine.submit(Request(PROMPTS[0], session.ctx), Collector())
        with pytest.raises(ValueError, match="out of range"):
            engine.submit(Request([1, 10**6], 4), Collector())
        with pytest.raises(ValueError, match="outside the vocabulary"):  # numpy's IndexError on the engine's thread
            engine.submit(Request(PROMPTS[0], 4, SamplingOptions(logit_bias=((10**6, 1.0),))), Collector())
        until(lambda: long[0].tokens)
        for seq in seqs:
            engine.cancel(seq)
        assert queued.done.wait(60) and queued.tokens == alone(model, PROMPTS[0], 4)
        assert all(c.done.wait(60) and c.end == ("done", "cancelled") for c in long)
        assert all(len(c.tokens) < most for c in long)
        assert engine.pool.free == 2
        engine.close()


def test_each_slot_has_its_own_kv_caches(model):
    with Session(model, 1) as session:
        pool = SequencePool(session.executor, 3)
        assert pool.caches and pool.bytes_per_slot == sum(pool.caches.values())
        slots = [pool.acquire() for _ in range(3)]
        with pytest.raises(ExecutorError, match="no free"):
            pool.acquire()
        arrays = [[pool._own[s][i] for i in pool.caches] for s in slots]
        assert len({a.ctypes.data for row in arrays for a in row}) == 3 * len(pool.caches)
        pool.bind(slots[2])
        session.feed([1, 5, 9])
        assert all(np.any(a) for a in arrays[2]) and not any(np.any(a) for a in arrays[1])
        with pytest.raises(ExecutorError, match="available"):
            SequencePool(session.executor, 10**9)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_batch_step_gives_each_row_the_bits_of_its_own_step(model, threads):
    # Four sequences of different lengths through the batch step, token by token, joining one step
    # after another (each row at its own position) and dropping out as their prompts end: each
    # row's logits are the one-sequence step's, bit for bit.
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[7]]
    expected = []
    for p in prompts:
        with Session(model, threads) as s:
            expected.append([s.feed([t]).copy() for t in p])
    with Session(model, threads) as session:
        cpu = session.executor.cpu
        assert cpu.batch_capacity >= len(prompts)
        pool = SequencePool(session.executor, len(prompts))
        slots = [pool.acquire() for _ in prompts]
        for step in range(max(i + len(p) for i, p in enumerate(prompts))):
            rows = [i for i, p in enumerate(prompts) if 0 <= step - i < len(p)]  # sequence i joins at step i
            cpu.batch_step([prompts[i][step - i] for i in rows], [step - i for i in rows],
                           pool.pointers([slots[i] for i in rows]))
            greedy = cpu.batch_greedy(len(rows))
            for r, i in enumerate(rows):
                np.testing.assert_array_equal(cpu.batch_logits(r).view(np.uint32),
                                              expected[i][step - i].view(np.uint32))
                assert greedy[r] == int(np.argmax(expected[i][step - i]))
        with pytest.raises(ExecutorError, match="batch step takes"):
            cpu.batch_step([1] * (cpu.batch_capacity + 1), [0] * (cpu.batch_capacity + 1),
                           pool.pointers([0] * (cpu.batch_capacity + 1)))


def test_the_profiled_batch_step_computes_the_same_and_counts_every_call(model):
    # bench/serve_load.py --batch-steps --profile: the batch step's profiled twin gives each row the
    # plain step's bits, and counts each of its calls (cycles in the kernel, on every thread) in
    # every run; stop_profile() puts the plain step back.
    with Session(model, 2) as session:
        cpu = session.executor.cpu
        pool = SequencePool(session.executor, 3)
        slots = [pool.acquire() for _ in range(3)]

        def run() -> list[np.ndarray]:
            for pos, tokens in enumerate(([1, 5, 9], [7, 2, 3])):
                cpu.batch_step(tokens, [pos] * 3, pool.pointers(slots))
            return [cpu.batch_logits(r).copy() for r in range(3)]

        plain = run()
        cpu.start_profile(batch=True)
        with pytest.raises(ExecutorError, match="while profiling"):
            cpu.start_profile()
        profiled = run()
        (got,) = cpu.stop_profile()
        for a, b in zip(plain, profiled, strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        assert got.stage == BATCH_STAGE and got.runs == 2
        assert got.kernel.shape == (2, len(got.calls)) and np.all(got.kernel > 0)
        assert {"greedy", "logits"} <= {label for _, label in got.calls}
        assert any(symbol.startswith("picc_attention") for symbol, _ in got.calls)
        with pytest.raises(ExecutorError, match="without start_profile"):
            cpu.stop_profile()
        again = run()  # the plain step again
        np.testing.assert_array_equal(again[0].view(np.uint32), plain[0].view(np.uint32))
        cpu.start_profile(batch=True)  # counters from zero each time
        run()
        assert cpu.stop_profile()[0].runs == 2
    with PibFile(model) as pib:
        data = pib.json("cpu/manifest")["batch"]
    assert CpuBatchProgram.from_json(data).to_json() == data
    older = CpuBatchProgram.from_json({k: v for k, v in data.items() if k != "profile"})  # a file from before
    assert older.profile is None and "profile" not in older.to_json()


def _per_row_loops(ir: str, function: str) -> list[str]:
    """The bodies of ``function``'s loops over rows or tokens (a kernel called once per row), in
    the .pib's optimized IR."""
    start = ir.index(f"@{function}(")
    text = ir[start : ir.index("\n}\n", start)]
    return [body for _, body in re.findall(r"\nb(\d+)\.body:[^\n]*\n(.*?)\n  %b\1\.next = ", text, re.S)]


def test_the_batch_steps_rows_wait_for_each_other_only_where_they_share_memory(model):
    # A batch's rows live apart (their values, their KV caches): the threads go on to the next row
    # without a barrier -- except for a kernel that uses the shared scratch (the sparse FFN). A
    # prompt's tokens always wait: each reads the KV cache the one before wrote.
    with PibFile(model) as pib:
        ir = pib.text("cpu/ir")
    rows = _per_row_loops(ir, "picc_batch_step")
    waiting = [body for body in rows if "@picc_barrier" in body]
    assert len(rows) > 10 and all("@picc_ffn_" in body for body in waiting)  # per row: sparse FFNs only
    assert bool(waiting) == ("sparse" in model.name)
    tokens = _per_row_loops(ir, "picc_prefill_chunk")
    assert all("@picc_barrier" in body for body in tokens)


def test_vnni_code_runs_where_the_host_lacks_vnni(tmp_path, monkeypatch):
    # An avx512-vnni .pib's object code is for CPUs with VNNI; its IR is what any other CPU compiles
    # instead (runtime.cpu.MachineCode.rejit), so it holds the VNNI kernels' AVX-512 twins and no
    # VNNI at all. Compiled from it, the batch step gives every row the object code's bits.
    import runtime.cpu as rc
    from picc.targets import load_target

    cpu = load_target("cpu")
    target = replace(cpu, cpu=replace(cpu.cpu, simd="avx512-vnni"))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_1))
    path = tmp_path / "vnni.pib"
    write_compiled(compile_model(model, CompileOptions(target=target, dense=True), say=lambda _: None), path)
    with PibFile(path) as pib:
        ir = pib.text("cpu/ir")
    assert "_rows(" in ir and "vnni" not in ir and "vpdpbusd" not in ir

    def batch_logits(rejit: bool) -> list[np.ndarray]:
        with Session(path, 2) as session:
            assert session.executor.cpu.code.rejit == rejit
            pool = SequencePool(session.executor, 3)
            slots = [pool.acquire() for _ in range(3)]
            session.executor.cpu.batch_step([5, 9, 17], [0, 0, 0], pool.pointers(slots))
            return [session.executor.cpu.batch_logits(r).copy() for r in range(3)]

    as_compiled = batch_logits(rejit=not rc.host_has("avx512-vnni"))
    have = rc.host_features()
    monkeypatch.setattr(rc, "host_features", lambda: have - {"avx512vnni"})
    for got, expected in zip(batch_logits(rejit=True), as_compiled, strict=True):
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_model_without_the_batch_step_steps_its_sequences_one_by_one(tmp_path):
    # picc compile --no-batch-step: the engine steps each sequence alone, still exactly.
    path = compiled(tmp_path, "plain", dense=True, batch_step=False)
    with Session(path, 1) as session:
        assert session.executor.cpu.batch_capacity == 0
    requests = [Request(p, 6) for p in PROMPTS[:4]]
    got = serve(path, requests, max_batch=4, joins_after=4, batched=False)
    assert [c.tokens for c in got] == [alone(path, p, 6) for p in PROMPTS[:4]]


def test_a_model_with_its_kv_caches_on_the_gpu_takes_shared_chunks_in_place(tmp_path):
    # Caches on the (emulated) GPU hold one sequence: it is served one at a time, and a prompt
    # that begins as the last one did takes the rows the GPU's ops left, still exactly.
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, seed=3))
    path = tmp_path / "gpu.pib"
    write_compiled(compile_model(model, CompileOptions(target="pc-low", vram="4MiB", dense=True),
                                 say=lambda _: None), path)
    requests = [Request(p, 6, SAMPLED, seed=1) for p in (LONG, [*LONG[:70], 3, 4], LONG)]
    with Session(path, 2, gpu="emulate") as session:
        engine = Engine(session)
        assert engine.max_batch == 1 and not engine.pool.caches  # every KV cache on the GPU
        got = [Collector() for _ in requests]
        seqs = [engine.submit(r, c) for r, c in zip(requests, got, strict=True)]
        assert all(c.done.wait(60) for c in got)
        unit = engine.pool.unit
        engine.close()
    assert unit == 1  # every op on the GPU, token by token: the chunk programs keep the step's bits
    assert [s.cached for s in seqs] == [0, 70, 70]  # one slot: the second's reply wrote over the first's
    for r, c in zip(requests, got, strict=True):
        with Session(path, 2, gpu="emulate") as s:
            assert c.tokens == list(s.generate(r.prompt, r.max_tokens, r.options, seed=r.seed))


def test_a_stopped_engine_is_not_alive_and_its_replica_says_so(tmp_path):
    # What Ray Serve's health check asks a replica (runtime.ray_serve.PiccReplica.check_health):
    # whether its engine's thread still runs.
    from runtime.ray_serve import PiccReplica

    path = compiled(tmp_path, "health", dense=True, batch_step=False)
    with Session(path, 1) as session:
        replica = PiccReplica.__new__(PiccReplica)  # its model, without Ray (and without its app)
        replica.engine, replica.session = Engine(session, max_batch=1), session
        replica.check_health()  # alive: no error
        replica.engine.close()
        assert not replica.engine.alive
        with pytest.raises(RuntimeError, match="engine has stopped"):
            replica.check_health()


def test_a_request_whose_event_loop_closed_does_not_stop_the_engine(tmp_path):
    # The engine's thread hands tokens to each request's event loop; one that has closed (its
    # client's loop ended before the request did) must not end the thread, and so every request.
    path = compiled(tmp_path, "loop", dense=True, batch_step=False)
    with Session(path, 1) as session:
        engine = Engine(session, max_batch=1)
        try:
            async def start(n: int) -> Generation:
                return Generation(engine, session.text, Request(session.text.encode("the"), n), [])

            loop = asyncio.new_event_loop()
            orphan = loop.run_until_complete(start(64))
            loop.close()
            for _ in range(200):  # it decodes on, emitting to the closed loop
                if engine.active == 0:
                    break
                time.sleep(0.01)
            assert engine.alive and orphan.seq is not None

            async def whole(n: int) -> int:
                gen = await start(n)
                async for _ in gen:
                    pass
                return gen.tokens

            assert asyncio.run(asyncio.wait_for(whole(5), 30)) == 5  # a stopped engine would never answer
        finally:
            engine.close()
