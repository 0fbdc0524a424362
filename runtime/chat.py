"""Chat messages -> the prompt text a chat model was trained on, from the template its .pib carries.

A chat model expects its conversation laid out in one exact text format (roles, separators, special
tokens); the model's tokenizer ships that format as a Jinja template (``chat_template``, kept in the
.pib's tokenizer section). ``render_chat`` renders it as transformers' ``apply_chat_template`` does,
so that ``TextCodec.encode_chat(render_chat(...))`` gives the ids transformers gives with
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the same Jinja settings
(a sandbox that cannot change its inputs, ``trim_blocks``, ``lstrip_blocks``, loop controls), the same
``tojson`` filter and ``raise_exception`` / ``strftime_now`` functions, and the same variables
(``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``; ``tools`` and ``documents``
as none, which templates test with ``is not none``).

Differences, on purpose: content given as a list of ``{"type": "text", "text": ...}`` parts is
joined into one string with newlines (as vLLM and llama.cpp's servers do for text-only templates,
which would otherwise print the list), and any failure becomes a one-line ``ChatTemplateError``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages are malformed, or the template failed to compile or render (its own
    ``raise_exception`` included, which templates use to reject e.g. roles out of order)."""


# What a template's own mistakes raise while rendering, besides Jinja's errors: e.g. "+" of a
# string and a list. These are the template's failure, so they are reported as one.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError)


RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents")


def render_chat(template: str, messages: Sequence[dict], *, bos_token: str | None, eos_token: str | None,
                add_generation_prompt: bool = True, variables: Mapping[str, object] | None = None) -> str:
    """The prompt text of ``messages`` (dicts with a string "role" and "content") under ``template``.

    ``add_generation_prompt`` ends the text with the header of an assistant turn, so that the model
    answers rather than continuing the last message. ``bos_token`` / ``eos_token`` are the spellings
    of the model's BOS / EOS (``TextCodec.bos_token``), which templates write as text.
    ``variables``: more of the template's variables (a request's ``chat_template_kwargs``, as
    transformers' ``apply_chat_template(**kwargs)`` passes them: Qwen3's ``enable_thinking``,
    gpt-oss's ``reasoning_effort``); never one of :data:`RESERVED_VARIABLES`.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be text, got {_describe(template)}")
    extra = check_template_variables(variables or {})
    chat = [_checked_message(index, message) for index, message in enumerate(_checked_list(messages))]
    compiled = _compile(template)
    try:
        return compiled.render(**extra, messages=chat, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, tools=None, documents=None)
    except _RENDER_ERRORS as error:
        raise ChatTemplateError(f"chat template failed: {_one_line(error)}") from error


def check_template_variables(variables: object) -> dict[str, object]:
    """``variables`` as a template's extra variables: an object of names, none of them one the
    renderer sets itself (:data:`RESERVED_VARIABLES`)."""
    if not isinstance(variables, Mapping) or not all(isinstance(k, str) for k in variables):
        raise ChatTemplateError(f"chat template variables must be an object of names, got {_describe(variables)}")
    taken = sorted(set(variables) & set(RESERVED_VARIABLES))
    if taken:
        raise ChatTemplateError(f"chat template variable '{taken[0]}' is set by picc, not by the request "
                                f"(reserved: {', '.join(RESERVED_VARIABLES)})")
    return dict(variables)


def _checked_list(messages: object) -> Sequence[object]:
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError(f"chat messages must be a non-empty list of dicts, got {_describe(messages)}")
    return messages


def _checked_message(index: int, message: object) -> dict:
    """A copy of ``message`` the template may read: None values dropped (as transformers does, since
    templates handle a missing key better than a None) and list content joined into a string."""
    if not isinstance(message, dict):
        raise ChatTemplateError(f"chat message {index}: expected a dict, got {_describe(message)}")
    if not isinstance(message.get("role"), str):
        raise ChatTemplateError(f'chat message {index}: "role" must be a string, got {_describe(message.get("role"))}')
    checked = {key: value for key, value in message.items() if value is not None}
    checked["content"] = _content_text(index, message.get("content"))
    return checked


def _content_text(index: int, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    raise ChatTemplateError(f'chat message {index}: "content" must be a string or a list of '
                            f'{{"type": "text", "text": ...}} parts, got {_describe(content)}')


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The compiled template; cached because a chat renders the same template once per turn."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template line {error.lineno}: {_one_line(error)}") from error


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without the HTML escaping of Jinja's own ``tojson``: a prompt is not a web page, and
    transformers' filter (with these options) is what the templates were written against."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    """Today's date for templates that put it in the system prompt (Llama 3's)."""
    return datetime.now().strftime(format)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:57]}..."


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
