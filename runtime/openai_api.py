"""OpenAI's completions and chat completions, as requests checked field by field and responses.

The server (``runtime.server``) reads a request's JSON, and :func:`completion_params` /
:func:`chat_params` check every field a client sends against what the OpenAI API accepts, raising
:class:`ApiError` -- OpenAI's error object and its HTTP status -- for the first that is wrong, with
the field named in ``param``. What passes becomes :class:`Params`, which the server turns into an
engine request for each of its choices: ``n`` of them for each prompt (completions take a list
of prompts too), choice ``j`` sampled with ``seed + j``. ``logprobs`` (completions: the number of
most likely tokens to list, 0-5; chat: ``logprobs`` and ``top_logprobs``) asks for each generated
token's log-probability, in each API's own shape (:func:`completion_logprobs`,
:func:`chat_logprobs`). ``echo`` (completions) puts the prompt before the completion, and with
``logprobs`` its tokens' log-probabilities before the generated ones' (``max_tokens`` 0 then
scores a prompt without generating). ``logit_bias``, ``presence_penalty`` and
``frequency_penalty`` apply as OpenAI defines them (``runtime.sampling``). ``best_of`` above 1
is refused with a message that says so; fields OpenAI defines that do not change what picc
computes (``user``) are checked and ignored. ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos`` (generate ``max_tokens`` tokens whatever they are: benchmarks) and
``stop_token_ids`` (more tokens that end a choice, even with ``ignore_eos``) are the usual
extensions (vLLM takes them too). Chat messages' roles are OpenAI's (:data:`ROLES`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from runtime.sampling import SamplingOptions, TokenLogprob

MAX_STOPS = 4  # OpenAI's limit on "stop" strings
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids a request may give
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat's "top_logprobs"
MAX_COMPLETION_LOGPROBS = 5  # and on completions' "logprobs"
MAX_CHOICES = 128  # OpenAI's limit on "n"; the server's queue may refuse fewer (429)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the chat roles OpenAI accepts


class ApiError(Exception):
    """An OpenAI error object (``{"error": {message, type, param, code}}``) with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Params:
    """A checked request: the prompt (text, ids or chat messages), how much to generate, how."""

    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one or more
    messages: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)  # chat: the template's extra variables
    n: int = 1  # choices per prompt
    max_tokens: int | None = None
    options: SamplingOptions = SamplingOptions()
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # each token's log-probability and this many alternatives'
    echo: bool = False  # completions: the prompt (and its tokens' log-probabilities) first


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Fields:
    """Typed reads of a request body's fields; each wrong one an ApiError naming it."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        self.body = body

    def get(self, name: str) -> Any:  # noqa: ANN401 - a JSON value
        return self.body.get(name)

    def number(self, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_number(v):
            raise invalid(f"'{name}' must be a number, got {type(v).__name__}", name)
        if not (lo < v if lo_open else lo <= v) or v > hi:
            raise invalid(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
        return float(v)

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_int(v):
            raise invalid(f"'{name}' must be an integer, got {type(v).__name__}", name)
        if v < lo or (hi is not None and v > hi):
            raise invalid(f"'{name}' must be {'>= ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, got {v}", name)
        return v

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(f"'{name}' must be a boolean, got {type(v).__name__}", name)
        return v


def _model(f: _Fields) -> str | None:
    model = f.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    return model


def _messages(f: _Fields) -> list:
    """Chat ``messages``: a non-empty list whose roles are OpenAI's (the rest the chat template's
    renderer checks, ``runtime.chat``)."""
    messages = f.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in ROLES:  # other shapes: the renderer's message says what
            raise invalid(f"messages[{i}].role '{role}' is not one of {', '.join(ROLES)}", f"messages[{i}].role")
    return messages


def _common(f: _Fields, defaults: Mapping[str, float], max_tokens_name: str = "max_tokens",
            least_tokens: int = 1) -> Params:
    """The fields completions and chat completions share (``max_tokens`` at least ``least_tokens``);
    ``defaults``: the model's sampling parameters for the fields the request leaves out (vLLM's
    ``--generation-config auto``), else OpenAI's."""
    model = _model(f)
    n = f.integer("n", 1, 1, MAX_CHOICES)
    if f.get("user") is not None and not isinstance(f.get("user"), str):
        raise invalid(f"'user' must be a string, got {type(f.get('user')).__name__}", "user")
    logit_bias = _logit_bias(f.get("logit_bias"))
    presence, frequency = (f.number(name, 0.0, -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty"))
    temperature = f.number("temperature", defaults.get("temperature", 1.0), 0.0, 2.0)
    top_p = f.number("top_p", defaults.get("top_p", 1.0), 0.0, 1.0, lo_open=True)
    top_k = f.integer("top_k", int(defaults.get("top_k", 0)), 0)
    min_p = f.number("min_p", defaults.get("min_p", 0.0), 0.0, 1.0)
    penalty = f.number("repetition_penalty", defaults.get("repetition_penalty", 1.0), 0.0, 10.0, lo_open=True)
    seed = f.integer("seed", None, -(2**63), 2**64 - 1)
    stream = f.boolean("stream")
    stream_options = f.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
            raise invalid("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = bool(stream_options.get("include_usage", False))
    max_tokens = f.integer(max_tokens_name, None, least_tokens)
    options = SamplingOptions(temperature, top_k or 0, top_p, penalty, presence, frequency, logit_bias, min_p=min_p)
    return Params(model, n=n, max_tokens=max_tokens, options=options,
                  seed=None if seed is None else seed % 2**63, stop=_stops(f.get("stop")), stream=stream,
                  include_usage=include_usage, ignore_eos=f.boolean("ignore_eos"),
                  stop_token_ids=_stop_token_ids(f.get("stop_token_ids")))


def _logit_bias(v: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias``, checked as OpenAI checks it (token ids to numbers in [-100, 100]), as
    (id, bias) pairs; whether the ids are in the vocabulary the server checks (it knows it)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid(f"'logit_bias' must be an object of token ids to numbers, got {type(v).__name__}", "logit_bias")
    for token, bias in v.items():
        if not token.isdigit() or not _is_number(bias) or not -100 <= bias <= 100:
            raise invalid(f"'logit_bias' maps token ids to numbers in [-100, 100], got {token!r}: {bias!r}",
                          "logit_bias")
    return tuple(sorted((int(token), float(bias)) for token, bias in v.items()))


def _stops(v: object) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' strings must not be empty", "stop")
    return list(stops)


def _stop_token_ids(v: object) -> frozenset[int]:
    if v is None:
        return frozenset()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}", "stop_token_ids")
    return frozenset(v)


def completion_params(body: object, defaults: Mapping[str, float] = MappingProxyType({})) -> Params:
    """``POST /v1/completions``'s body, checked. The prompt: a string, a list of token ids, or a list
    of strings or of lists of ids (OpenAI's batch forms: a choice for each)."""
    f = _Fields(body)
    echo = f.boolean("echo")
    logprobs = f.integer("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    if f.get("suffix") is not None:
        raise invalid("'suffix' is not supported", "suffix")
    best_of = f.integer("best_of", 1, 1)
    if best_of != 1:
        raise invalid(f"'best_of' {best_of}: not supported (ask for 'n' choices instead)", "best_of")
    params = _common(f, defaults, least_tokens=0 if echo else 1)  # echo with max_tokens 0: the prompt alone
    prompt = f.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt")
    def ids(p: object) -> bool:
        return isinstance(p, list) and bool(p) and all(_is_int(t) for t in p)

    if isinstance(prompt, str) or ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(map(ids, prompt))):
        prompts = list(prompt)
    else:
        raise invalid("'prompt' must be a string, a non-empty list of token ids, or a list of either",
                      "prompt")
    if len(prompts) * params.n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts of {params.n} choices each: at most {MAX_CHOICES} choices a request",
                      "n")
    params.prompts = prompts
    params.logprobs, params.echo = logprobs, echo
    if params.max_tokens is None:
        params.max_tokens = 16  # OpenAI's default for completions
    return params


def chat_params(body: object, defaults: Mapping[str, float] = MappingProxyType({})) -> Params:
    """``POST /v1/chat/completions``'s body, checked (the messages themselves by the chat template's
    renderer, ``runtime.chat``). ``max_completion_tokens`` is the newer name of ``max_tokens``."""
    f = _Fields(body)
    logprobs = f.boolean("logprobs")
    top_logprobs = f.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    for name in ("tools", "functions", "response_format"):
        if f.get(name) is not None:
            raise invalid(f"'{name}' is not supported", name)
    f.integer("max_tokens", None, 1)  # checked where max_completion_tokens, its newer name, is used
    name = "max_completion_tokens" if f.get("max_completion_tokens") is not None else "max_tokens"
    params = _common(f, defaults, name)
    params.messages = _messages(f)
    params.template_kwargs = _template_kwargs(f)
    params.logprobs = (top_logprobs or 0) if logprobs else None
    return params


def _template_kwargs(f: _Fields) -> dict:
    """``chat_template_kwargs`` (vLLM's and llama.cpp's): more variables for the chat template,
    e.g. ``{"enable_thinking": false}`` for Qwen3; checked by ``runtime.chat``."""
    from runtime.chat import ChatTemplateError, check_template_variables

    value = f.get("chat_template_kwargs")
    try:
        return {} if value is None else check_template_variables(value)
    except ChatTemplateError as e:
        raise invalid(f"'chat_template_kwargs': {e}", "chat_template_kwargs") from None


@dataclass
class TokenizeParams:
    """``POST /tokenize``'s body (vLLM's): text, or chat messages to render first."""

    model: str | None
    prompt: str | None
    messages: list | None
    add_special_tokens: bool  # text: the BOS (EOS) the model's tokenizer adds to a prompt
    add_generation_prompt: bool  # messages: end with the header of an assistant turn
    template_kwargs: dict  # messages: the chat template's extra variables


def tokenize_params(body: object) -> TokenizeParams:
    f = _Fields(body)
    model = _model(f)
    if (f.get("prompt") is None) == (f.get("messages") is None):
        raise invalid("give 'prompt' (text) or 'messages' (a chat), one of them", "prompt")
    prompt = f.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
    messages = _messages(f) if prompt is None else None
    return TokenizeParams(model, prompt, messages, f.boolean("add_special_tokens", True),
                          f.boolean("add_generation_prompt", True), _template_kwargs(f))


def detokenize_params(body: object, vocab: int) -> tuple[str | None, list[int]]:
    """``POST /detokenize``'s body (vLLM's): the model and the ``tokens``, ids of the vocabulary."""
    f = _Fields(body)
    tokens = f.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range for a vocabulary of {vocab}", "tokens")
    return _model(f), tokens


def context_error(prompt_tokens: int, max_tokens: int | None, ctx: int, prompt_field: str) -> ApiError | None:
    """OpenAI's ``context_length_exceeded`` when the prompt, or it and ``max_tokens``, outgrow
    ``ctx`` (``param``: the prompt's field, or ``max_tokens`` when the prompt alone fits)."""
    if prompt_tokens + (max_tokens if max_tokens is not None else 1) <= ctx:
        return None
    asked = f"{prompt_tokens} tokens in the prompt" + (f" and {max_tokens} to generate" if max_tokens else "")
    return invalid(f"This model's maximum context length is {ctx} tokens; the request asks for {asked}",
                   "max_tokens" if prompt_tokens < ctx else prompt_field, "context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; ``cached_tokens``: of the prompt tokens, those whose KV rows were
    taken from an earlier prompt's instead of computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Choice(NamedTuple):
    """A choice of a response: its index, its text (a streamed chunk's part of it), finish reason,
    log-probabilities (:func:`completion_logprobs` / :func:`chat_logprobs`, or None) and, for a
    reasoning model's chat reply, its thoughts (``reasoning_content``; ``text`` is then the answer)."""

    index: int
    text: str | None
    finish: str | None
    logprobs: dict | None
    reasoning: str | None = None


def completion_logprobs(records: list[TokenLogprob], texts: list[str], spell: Callable[[int], str],
                        offset: int = 0) -> dict:
    """The completions API's ``logprobs`` of ``records``: each token's text (``texts``: what it
    adds to the completion), its log-probability, the most likely tokens' (``spell``-ed text ->
    log-probability) and where each token's text starts (``offset``: the text before these)."""
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [None if r.logprob is None else {spell(i): lp for i, lp in r.top} for r in records],
            "text_offset": starts}


def chat_logprobs(records: list[TokenLogprob], texts: list[str], spell: Callable[[int], str]) -> dict:
    """The chat API's ``logprobs`` of ``records``: for each token its text (``texts``), log-probability,
    UTF-8 bytes and the most likely tokens' (``spell``-ed), ``top_logprobs``."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(text, r.logprob), "top_logprobs": [entry(spell(i), lp) for i, lp in r.top]}
                        for r, text in zip(records, texts, strict=True)], "refusal": None}


def completion_body(rid: str, model: str, choices: list[Choice], *, chunk: bool = False,
                    created: int | None = None, first: bool = False) -> dict:
    """A ``text_completion`` (or one streamed chunk of it; ``first`` chunks are only chat's)."""
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": c.text or "", "logprobs": c.logprobs, "finish_reason": c.finish}
                        for c in choices]}


def chat_body(rid: str, model: str, choices: list[Choice], *, chunk: bool = False,
              created: int | None = None, first: bool = False) -> dict:
    """A ``chat.completion``, or a ``chat.completion.chunk`` (``first``: the one naming the role)."""
    created = created or int(time.time())
    if not chunk:
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text,
                                                           **_thoughts(c.reasoning)},
                             "logprobs": c.logprobs, "finish_reason": c.finish} for c in choices]}

    def delta(c: Choice) -> dict:
        if first:
            return {"role": "assistant", "content": ""}
        return {**_thoughts(c.reasoning), **({"content": c.text} if c.text else {})}

    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": c.index, "delta": delta(c), "logprobs": c.logprobs, "finish_reason": c.finish}
                        for c in choices]}


def _thoughts(reasoning: str | None) -> dict:
    """A chat message's (or delta's) ``reasoning_content``, as llama.cpp's server gives it: there
    where the reply has thoughts."""
    return {"reasoning_content": reasoning} if reasoning else {}
