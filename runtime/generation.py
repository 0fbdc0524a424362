"""One request's generation as the server sees it: engine tokens in, text deltas out, on asyncio.

:class:`TextStream` turns tokens into text as it becomes final -- decoding a window of the last
tokens (a token's bytes can be half a UTF-8 character, or change how the one before it reads), as
``picc run``'s stream does -- and holds back text that may be the start of a ``stop`` string, so a
stop string never reaches the client, not even split across deltas.

:class:`Generation` submits a request to the engine -- or, :meth:`Generation.all_or_none`, the
choices of one API request together -- (its refusals -- a full queue, a prompt that does not fit
-- raise before any response is sent) and yields ``(text, finish_reason, logprobs)`` as the
engine's thread reports tokens (``logprobs``: the log-probabilities of the tokens that made this
text, where the request asked for them). Leaving it early (a stop string, a client that disconnected:
the task is cancelled) cancels the sequence, whose slot the engine then frees before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from runtime.engine import Engine, QueueFull, Request, Sequence
from runtime.openai_api import ApiError, invalid
from runtime.sampling import TokenLogprob
from runtime.text import TextCodec, partial_end

RETRY_AFTER_SECONDS = 1


class TextStream:
    """Tokens -> final text, with ``stops`` cut out: :meth:`add` per token, :meth:`finish` at the end."""

    def __init__(self, codec: TextCodec, stops: list[str]) -> None:
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decoded already: the context the next token is read in
        self.read = 0
        self.held = ""  # final text not sent yet: it may begin a stop string
        self.stopped = False

    def add(self, token: int) -> str:
        """The text ``token`` completes that can be sent; after a stop string, nothing more
        (:attr:`stopped` is then True)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix : self.read])
        now = self.codec.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # a partial character: wait for the rest of its bytes
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(now[len(before) :])

    def finish(self) -> str:
        """What is left when generation ends (held text, a last partial character)."""
        if self.stopped:
            return ""
        tail = self.codec.decode(self.ids[self.prefix :])[len(self.codec.decode(self.ids[self.prefix : self.read])) :]
        text, self.held = self.held + tail, ""
        for stop in self.stops:
            if stop in text:
                self.stopped = True
                text = text[: text.index(stop)]
        return text

    def _release(self, text: str) -> str:
        text = self.held + text
        cut = min((text.index(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = partial_end(text, self.stops)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


Delta = tuple[str, str | None, list[TokenLogprob]]
"""What a :class:`Generation` yields: text, the finish reason (None but in the last), and the
log-probabilities of the tokens consumed since the last (empty unless the request asked)."""


class Generation:
    """A request running on ``engine``: iterate for :data:`Delta` triples; ``finish_reason`` is
    None until the last (``stop``: EOS or a stop string; ``length``: ``max_tokens`` or a full
    context). :attr:`tokens` counts the tokens generated, up to one that completed a stop string."""

    def __init__(self, engine: Engine, codec: TextCodec, request: Request, stops: list[str]) -> None:
        self._prepare(engine, codec, request, stops)
        (self.seq,) = _submitted(lambda: engine.submit_all([(request, self._emit)]))

    @classmethod
    def all_or_none(cls, engine: Engine, codec: TextCodec, requests: list[Request],
                    stops: list[str]) -> list[Generation]:
        """A generation for each of ``requests`` (the choices of one API request), all submitted
        at once or none (a 429 when the queue has no room for all)."""
        gens = [cls.__new__(cls) for _ in requests]
        for gen, request in zip(gens, requests, strict=True):
            gen._prepare(engine, codec, request, stops)
        seqs = _submitted(lambda: engine.submit_all([(r, g._emit) for g, r in zip(gens, requests, strict=True)]))
        for gen, seq in zip(gens, seqs, strict=True):
            gen.seq = seq
        return gens

    def _prepare(self, engine: Engine, codec: TextCodec, request: Request, stops: list[str]) -> None:
        self.engine, self.stream = engine, TextStream(codec, stops)
        self.queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.tokens = 0
        self.stop_ids = engine.stops_of(request)
        self.logprobs: list[TokenLogprob] = []  # reported with the next tokens
        self.first = request.prompt[0]

    def _emit(self, kind: str, value: object) -> None:  # on the engine's thread
        with contextlib.suppress(RuntimeError):  # the request's event loop has closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    async def __aiter__(self) -> AsyncIterator[Delta]:
        finished = False
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "logprobs":
                    self.logprobs = value  # type: ignore[assignment]
                elif kind == "prompt_logprobs":  # before any token: the prompt's, its first unpredicted
                    yield "", None, [TokenLogprob(self.first, None), *value]  # type: ignore[misc]
                elif kind == "tokens":
                    before = self.tokens
                    text = self._text(value)  # type: ignore[arg-type]
                    logprobs, self.logprobs = self.logprobs[: self.tokens - before], []
                    if self.stream.stopped:
                        finished = True
                        yield text, "stop", logprobs
                        return
                    if text or logprobs:
                        yield text, None, logprobs
                elif kind == "done":
                    finished = True
                    text = self.stream.finish()
                    yield text, "length" if value == "length" and not self.stream.stopped else "stop", []
                    return
                else:
                    finished = True
                    raise ApiError(500, f"generation failed: {value}", kind="server_error", code="engine_error")
        finally:
            if not finished or self.stream.stopped:
                self.engine.cancel(self.seq)

    def _text(self, tokens: list[int]) -> str:
        """The text ``tokens`` add (a stop token is not text: the engine ends the sequence after it), up to
        a stop string; :attr:`tokens` counts them, up to the one that completed the stop string."""
        parts = []
        for token in tokens:
            self.tokens += 1
            if token not in self.stop_ids:
                parts.append(self.stream.add(token))
            if self.stream.stopped:
                break
        return "".join(parts)


def _submitted(submit: Callable[[], list[Sequence]]) -> list[Sequence]:
    """``submit()``'s sequences; its refusals as OpenAI's errors (429 with ``Retry-After``, 400)."""
    try:
        return submit()
    except QueueFull as e:
        raise ApiError(429, f"the server is busy ({e}); retry shortly", kind="requests",
                       code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except ValueError as e:
        raise invalid(str(e), "prompt") from None
