"""``picc serve``'s HTTP side: an OpenAI-compatible API over the serving engine, on FastAPI.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events
through sse-starlette when ``stream`` is true, ending with ``data: [DONE]``), ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health`` and ``GET /metrics`` (Prometheus text from
prometheus_client). With an API key every ``/v1`` route wants ``Authorization: Bearer KEY``.

Every error is OpenAI's error object with OpenAI's status (``runtime.openai_api.ApiError``): 400
for a body that is not JSON (or not valid Unicode) or a field that is wrong, 401 without the key,
404 for an unknown route or model, 413 for a body larger than :func:`max_body_bytes`, 429 with
``Retry-After`` when the engine's queue is full; an unexpected exception is a 500 with the same
object and one line in the server's log, never a traceback. Prompts are tokenized off the event
loop, so a long one does not hold up the other requests. A client that disconnects -- mid-stream,
or while waiting for a whole completion -- cancels its sequence. A reasoning model's chat replies
come as thoughts (``reasoning_content``) and answer (``content``), split by ``runtime.reasoning``
(``ServedModel.reasoning``); completions stay the raw text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from runtime.chat import ChatTemplateError, render_chat
from runtime.engine import Engine
from runtime.engine import Request as EngineRequest
from runtime.generation import Generation
from runtime.metrics import CountRequests, Metrics
from runtime.openai_api import (
    ApiError,
    Choice,
    Params,
    chat_body,
    chat_logprobs,
    chat_params,
    completion_body,
    completion_logprobs,
    completion_params,
    context_error,
    detokenize_params,
    invalid,
    new_id,
    tokenize_params,
    usage,
)
from runtime.reasoning import ReasoningSplit
from runtime.sampling import TokenLogprob
from runtime.text import TextCodec

DISCONNECT_POLL_SECONDS = 0.25
LOG = logging.getLogger("picc.serve")


def max_body_bytes(ctx: int) -> int:
    """The largest request body the server reads: 4 MiB, or 256 bytes a position of the context
    for a longer one -- far more than any prompt that fits the context takes (a token is rarely
    over 16 bytes of text, ~100 with JSON's escapes), and bounded, so that a huge body is refused
    before it is read, let alone tokenized."""
    return max(4 << 20, 256 * ctx)


@dataclass
class ServedModel:
    """What the server serves: the engine over one compiled model, its name and tokenizer;
    ``reasoning``: the format of its chat replies' thoughts (``runtime.reasoning``; None: replies
    come back whole, as ``content``)."""

    engine: Engine
    codec: TextCodec
    name: str
    created: int
    api_key: str | None = None
    reasoning: str | None = None


def create_app(served: ServedModel) -> FastAPI:
    """The ASGI application serving ``served``."""
    # No redirects from "/v1/completions/" to "/v1/completions": an unknown route is a 404.
    app = FastAPI(title="picc serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    metrics = Metrics(served.engine)
    app.state.metrics = metrics
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_middleware(ContainErrors)  # outermost: CountRequests sees the 500 it makes
    _errors(app)
    limit = max_body_bytes(served.engine.ctx)

    async def authorized(request: Request) -> None:
        if served.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "picc"}

    @app.get("/health")
    async def health() -> dict:
        if not served.engine.alive:
            raise ApiError(503, "the serving engine has stopped", kind="server_error")
        return {"status": "ok", "model": served.name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def one_model(model: str) -> dict:
        _check_model(served, model)
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        params = completion_params(await _json(request, limit), served.codec.sampling)
        _check_model(served, params.model)

        def prompt_ids() -> list[list[int]]:
            return [served.codec.encode(p) if isinstance(p, str) else list(p) for p in params.prompts]

        # Off the event loop (the tokenizer lets go of the GIL): a long prompt holds up nobody.
        prompts = await asyncio.to_thread(prompt_ids)
        return await _respond(request, served, metrics, params, prompts, "prompt", chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request) -> Response:
        params = chat_params(await _json(request, limit), served.codec.sampling)
        _check_model(served, params.model)
        ids, rendered = await _chat_ids(served, params.messages or [], variables=params.template_kwargs)
        return await _respond(request, served, metrics, params, [ids], "messages", chat=True, rendered=rendered)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request) -> dict:
        """vLLM's: a prompt's ids (or a chat's, as the chat route would render it), to count them."""
        params = tokenize_params(await _json(request, limit))
        _check_model(served, params.model)
        if params.messages is not None:
            ids, _ = await _chat_ids(served, params.messages, params.add_generation_prompt, params.template_kwargs)
        else:
            ids = await asyncio.to_thread(served.codec.encode, params.prompt or "", params.add_special_tokens)
        return {"count": len(ids), "max_model_len": served.engine.ctx, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request) -> dict:
        model, tokens = detokenize_params(await _json(request, limit), served.engine.executor.vocab)
        _check_model(served, model)
        return {"prompt": served.codec.decode(tokens)}

    return app


async def _chat_ids(served: ServedModel, messages: list, add_generation_prompt: bool = True,
                    variables: dict | None = None) -> tuple[list[int], str]:
    """``messages`` rendered by the model's chat template and encoded, off the event loop (the
    tokenizer lets go of the GIL: a long prompt holds up nobody), and the rendered text; a 400
    where the model has no template or the template refuses them."""
    codec = served.codec
    if codec.chat_template is None:
        raise invalid(f"model '{served.name}' has no chat template (its tokenizer carries none): use "
                      "/v1/completions with a prompt", "messages", "chat_template_missing")

    def ids() -> tuple[list[int], str]:
        try:
            text = render_chat(codec.chat_template, messages, bos_token=codec.bos_token, eos_token=codec.eos_token,
                               add_generation_prompt=add_generation_prompt, variables=variables)
        except ChatTemplateError as e:
            raise invalid(str(e), "messages") from None
        return codec.encode_chat(text), text

    return await asyncio.to_thread(ids)


def _errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            error = ApiError(404, f"Unknown route: {request.method} {request.url.path}", code="unknown_url")
        elif e.status_code == 405:
            error = ApiError(405, f"Method {request.method} is not allowed on {request.url.path}",
                             code="method_not_allowed")
        else:
            error = ApiError(e.status_code, str(e.detail))
        return JSONResponse(error.body(), status_code=error.status, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(invalid(str(first.get("msg", "invalid request")), param).body(), status_code=400)


class ContainErrors:
    """ASGI middleware: an exception that no handler took becomes OpenAI's error object with status
    500 and one line in the log. (Starlette's own last resort answers too, but then raises the
    exception on, so that the server logs its traceback and drops the client's connection.) Once a
    response has started -- a stream -- it can only end it."""

    def __init__(self, app) -> None:  # noqa: ANN001 - an ASGI app
        self.app = app

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 - the last resort, by design
            what = f"internal error: {type(e).__name__}: {e}"
            LOG.error("picc serve: %s %s: %s", scope.get("method"), scope.get("path"), what)
            if not started:
                response = JSONResponse(ApiError(500, what, kind="server_error").body(), status_code=500)
                await response(scope, receive, send)


async def _json(request: Request, limit: int) -> object:
    """The body's JSON: a 413 past ``limit`` bytes (read no further), a 400 where it is not JSON,
    or holds text that is not Unicode (a lone surrogate escaped as ``\\ud800``)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
        raise invalid(f"the request body is not valid JSON: {_first_line(e)}") from None
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise invalid(f"the request body holds text that is not valid Unicode: {e.reason} "
                      f"({e.object[e.start:e.end]!a})") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    return value


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server reads ({limit >> 20} MiB)",
                    code="request_too_large")


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _check_model(served: ServedModel, model: str | None) -> None:
    if model is not None and model != served.name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served.name}'",
                       param="model", code="model_not_found")


def _start(served: ServedModel, params: Params, prompts: list[list[int]], prompt_field: str) -> list[Generation]:
    """The request's generations, choice ``p * n + j`` for prompt ``p``'s ``j``-th (seed + j), all
    submitted at once or none (a refusal -- a full queue, a prompt that does not fit -- raises
    before any response)."""
    engine = served.engine
    error = params.options.vocabulary_error(engine.executor.vocab)
    if error:
        raise invalid(error, "logit_bias")
    if any(t >= engine.executor.vocab for t in params.stop_token_ids):
        raise invalid(f"'stop_token_ids' names token {max(params.stop_token_ids)}, outside the vocabulary of "
                      f"{engine.executor.vocab}", "stop_token_ids")
    for ids in prompts:
        error = context_error(len(ids), params.max_tokens, engine.ctx, prompt_field)
        if error is not None:
            raise error
        if not ids:
            raise invalid("the prompt is empty", prompt_field)
    choices, room = len(prompts) * params.n, engine.max_batch + engine.max_queue
    if choices > room:  # not a 429: retrying would not help
        raise invalid(f"{choices} choices: this server decodes {engine.max_batch} sequences and queues "
                      f"{engine.max_queue} more, so at most {room} choices a request", "n")
    requests = [EngineRequest(ids, engine.ctx - len(ids) if params.max_tokens is None else params.max_tokens,
                              params.options, None if params.seed is None else (params.seed + j) % 2**63,
                              stop_at_eos=not params.ignore_eos, stop_ids=params.stop_token_ids,
                              progress=params.stream or bool(params.stop),
                              logprobs=params.logprobs, prompt_logprobs=params.logprobs if params.echo else None)
                for ids in prompts for j in range(params.n)]
    return Generation.all_or_none(engine, served.codec, requests, params.stop)


async def _respond(request: Request, served: ServedModel, metrics: Metrics, params: Params,
                   prompts: list[list[int]], prompt_field: str, *, chat: bool, rendered: str = "") -> Response:
    """Start the generations (refusals raise here, before a response) and answer: a stream of
    chunks, or the whole completion with a choice for each; a reasoning model's chat replies as
    thoughts and answer (``rendered``: the chat's prompt text, which may open a thought block)."""
    gens = _start(served, params, prompts, prompt_field)
    splits = [ReasoningSplit(served.reasoning, rendered) if chat and served.reasoning else None for _ in gens]
    prompt_tokens = sum(len(ids) for ids in prompts)  # as OpenAI counts: each prompt once, whatever n
    rid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    body = chat_body if chat else completion_body
    shapes = [_LogprobShape(served.codec, chat) if params.logprobs is not None else None for _ in gens]
    # echo: each choice's text starts with its prompt (as sent, or its ids' text)
    echoes = ([p if isinstance(p, str) else served.codec.decode(ids) for p, ids in zip(params.prompts, prompts,
                                                                                         strict=True)
               for _ in range(params.n)] if params.echo else [""] * len(gens))
    if params.stream:
        return EventSourceResponse(_events(gens, params, served.name, rid, created, prompt_tokens, chat, metrics,
                                           shapes, echoes, splits), ping=15)
    choices = await _collect(request, gens, shapes, echoes, splits)
    generated = sum(gen.tokens for gen in gens)
    metrics.finished(prompt_tokens, generated)
    return JSONResponse({**body(rid, served.name, choices, created=created),
                         "usage": usage(prompt_tokens, generated, _cached(gens, params.n))})


class _LogprobShape:
    """One choice's log-probabilities as its API shows them (chat's or completions'). A token's
    text is what it adds to the ones before it (decoded after the last few, as the text stream
    decodes: a word-level tokenizer's space; a byte-level one's character completed, where the
    token before it showed U+FFFD); a listed alternative's, its own decoding. :attr:`offset`:
    where the next token's text starts in the choice's text."""

    CONTEXT = 4  # tokens before one that its text is decoded after

    def __init__(self, codec: TextCodec, chat: bool) -> None:
        self.codec, self.chat, self.offset = codec, chat, 0
        self.ids: list[int] = []

    def spell(self, token: int) -> str:
        return self.codec.decode([token])

    def _added(self, token: int) -> str:
        before = self.codec.decode(self.ids[-self.CONTEXT :])
        after = self.codec.decode([*self.ids[-self.CONTEXT :], token])
        self.ids.append(token)
        return after[len(os.path.commonprefix([before, after])) :]

    def __call__(self, records: list[TokenLogprob]) -> dict:
        texts = [self._added(r.token) for r in records]
        if self.chat:
            return chat_logprobs(records, texts, self.spell)
        shown = completion_logprobs(records, texts, self.spell, self.offset)
        self.offset += sum(len(t) for t in texts)
        return shown


async def _drain(index: int, gen: Generation, shape: _LogprobShape | None, echo: str,
                 split: ReasoningSplit | None) -> Choice:
    """Choice ``index``: its whole text (after ``echo``; with ``split``, its answer and thoughts),
    finish reason and log-probabilities (where asked)."""
    parts, last, records = [echo], None, []
    async for text, finish, logprobs in gen:
        parts.append(text)
        records += logprobs
        last = finish
    shown = None if shape is None else shape(records)
    if split is None:
        return Choice(index, "".join(parts), last, shown)
    thoughts, answer = _split(split, "".join(parts), True)
    return Choice(index, answer, last, shown, thoughts)


async def _collect(request: Request, gens: list[Generation], shapes: list[_LogprobShape | None],
                   echoes: list[str], splits: list[ReasoningSplit | None]) -> list[Choice]:
    """Each choice's whole text, finish reason and log-probabilities; cancelled (and so the
    sequences) when the client goes away."""
    tasks = [asyncio.ensure_future(_drain(i, gen, shapes[i], echoes[i], splits[i])) for i, gen in enumerate(gens)]
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_SECONDS)
            if not pending:
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the request", code="client_closed_request")
    finally:
        for task in tasks:
            task.cancel()


def _split(split: ReasoningSplit, text: str, last: bool) -> tuple[str, str]:
    """The thoughts and answer ``text`` completes (``last``: the reply's end, what was held too)."""
    thoughts, answer = split.add(text)
    if last:
        more_thoughts, more_answer = split.finish()
        thoughts, answer = thoughts + more_thoughts, answer + more_answer
    return thoughts, answer


def _cached(gens: list[Generation], n: int) -> int:
    """The prompt tokens that took their KV rows from a slot, counted as the usage counts the prompts:
    once each, by its first choice (its other choices take the rows that one computes)."""
    return sum(gen.seq.cached for gen in gens[::n])


async def _events(gens: list[Generation], params: Params, model: str, rid: str, created: int, prompt_tokens: int,
                  chat: bool, metrics: Metrics, shapes: list[_LogprobShape | None],
                  echoes: list[str], splits: list[ReasoningSplit | None]) -> AsyncIterator[dict]:
    """The stream's events: chunks of text (chat: first the role of each choice), the last of each
    choice with its finish reason, the usage when asked for, then ``[DONE]``. The choices' chunks
    come as their tokens do, each naming its choice's index, with the log-probabilities of the
    tokens that came since the last (where asked: held-back text may follow its tokens later).
    A reasoning model's chat chunks carry thoughts (``reasoning_content``) or answer, each in a
    chunk of its own, the thoughts first where the same tokens made both."""
    if chat:
        first = [Choice(i, None, None, None) for i in range(len(gens))]
        yield {"data": json.dumps(chat_body(rid, model, first, chunk=True, created=created, first=True))}
    body = chat_body if chat else completion_body
    queue: asyncio.Queue[Choice | ApiError | None] = asyncio.Queue()

    async def forward(index: int, gen: Generation) -> None:
        shown, echo, split = shapes[index], echoes[index], splits[index]
        try:
            async for text, finish, logprobs in gen:
                text, echo, thoughts = echo + text, "", ""  # the prompt, echoed, comes with the first chunk
                if split is not None:
                    thoughts, text = _split(split, text, finish is not None)
                    if thoughts and (text or finish):  # a chunk of each, the thoughts first
                        await queue.put(Choice(index, None, None, None, thoughts))
                        thoughts = ""
                if thoughts or text or finish or logprobs:
                    await queue.put(Choice(index, text, finish, None if shown is None else shown(logprobs),
                                           thoughts))
        except ApiError as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(forward(i, gen)) for i, gen in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ApiError):
                yield {"data": json.dumps(item.body())}
            else:
                yield {"data": json.dumps(body(rid, model, [item], chunk=True, created=created))}
    finally:
        for task in tasks:  # the client went away mid-stream: every choice's sequence is cancelled
            task.cancel()
    generated = sum(gen.tokens for gen in gens)
    metrics.finished(prompt_tokens, generated)
    if params.include_usage:
        yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": created, "model": model, "choices": [],
                                   "usage": usage(prompt_tokens, generated, _cached(gens, params.n))})}
    yield {"data": "[DONE]"}
