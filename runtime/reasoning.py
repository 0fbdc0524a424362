"""A reasoning model's thoughts apart from its answer, as llama.cpp's server (``--reasoning-format
deepseek``) and vLLM's reasoning parsers give them to OpenAI clients: ``reasoning_content`` and
``content``.

Two formats, decided once per model from its chat template (:func:`reasoning_format`):

* ``think`` (Qwen3, DeepSeek-R1 and its distills, GLM-4.5, SmolLM3): the reply opens with
  ``<think>``, thinks, and answers after ``</think>``. Some templates open the block in the
  generation prompt itself (DeepSeek-R1-0528's ends with ``<think>\\n``): a reply whose rendered
  prompt ends with ``<think>`` starts inside it. A block is only one that opens the reply (after
  whitespace); a ``<think>`` later in the answer is text.
* ``harmony`` (gpt-oss): messages ``<|channel|>NAME<|message|>TEXT<|end|>``, each after a header
  (``<|start|>assistant``); the ``analysis`` channel's messages are thoughts, every other channel's
  (``final``, ``commentary``) the answer. The markers are special tokens, which the runtime's codec
  decodes as text (``runtime.text``), so they reach this parser; the fields never show them. Where
  the reply starts is read from the prompt's last header (the template's ``<|start|>assistant``).

:class:`ReasoningSplit` splits one reply as it streams: each piece of final text in, the thoughts'
and the answer's new text out. A marker split across pieces is held back until it is decided, as
the text stream holds back a possible stop string (``runtime.text.partial_end``), so neither field
ever shows a part of one. Thoughts are stripped of the whitespace around them, and an answer that
follows thoughts of its leading whitespace (as llama.cpp does: Qwen3 writes ``</think>\\n\\n``);
a reply with no thoughts comes back as it was. A block never closed (``max_tokens`` reached) is
thoughts to its end, with an empty answer.
"""

from __future__ import annotations

from runtime.text import partial_end

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
THOUGHTS_CHANNEL = "analysis"
FORMATS = ("think", "harmony")
OPTIONS = ("auto", "none")  # --reasoning-format
SEPARATOR = "\n\n"  # between two messages of one field (harmony: a preamble, then the final answer)

# The parser's states: which markers each looks for, and where its text goes.
_MARKERS = {
    "start": (),  # the reply's first text, undecided: see _begin
    "thought": (THINK_CLOSE,),
    "answer": (),
    "header": (START, CHANNEL, MESSAGE),  # harmony: a role, a recipient; dropped
    "channel": (MESSAGE,),  # harmony: the channel's name (and a <|constrain|>), kept until <|message|>
    "message": MESSAGE_ENDS,
}
_OPENERS = {"think": (THINK_OPEN,), "harmony": (START, CHANNEL, MESSAGE)}


def served_format(option: str, template: str | None) -> str | None:
    """The format a server (``picc serve --reasoning-format``) or ``picc run --chat`` splits replies
    by: ``auto``, the template's (:func:`reasoning_format`); ``none``, no split."""
    if option not in OPTIONS:
        raise ValueError(f"unknown reasoning format option '{option}' (expected one of {', '.join(OPTIONS)})")
    return reasoning_format(template) if option == "auto" else None


def reasoning_format(template: str | None) -> str | None:
    """The reasoning format of a model whose chat template is ``template``: ``harmony`` for one that
    writes ``<|channel|>``, ``think`` for one that writes ``<think>`` (or only strips ``</think>``
    from earlier replies, as DeepSeek-R1's first template), else None (replies are all answer)."""
    if template is None:
        return None
    if CHANNEL in template:
        return "harmony"
    if THINK_OPEN in template or THINK_CLOSE in template:
        return "think"
    return None


class ReasoningSplit:
    """One reply's text as thoughts and answer: :meth:`add` each piece of final text as it comes,
    :meth:`finish` at the end; each returns ``(thoughts, answer)``, the new text of each field.
    ``prompt``: the rendered prompt, which says whether the reply starts inside a thought block
    (think) or message (harmony)."""

    def __init__(self, format: str, prompt: str) -> None:
        if format not in FORMATS:
            raise ValueError(f"unknown reasoning format '{format}' (expected one of {', '.join(FORMATS)})")
        self.format, self.state, self.held = format, "start", ""
        self.channel = ""  # harmony: the text of the current message's header after <|channel|>
        self.field = "content"  # where the current thought / message goes
        self.fresh = False  # a thought or message begun, none of its text written yet: strip its start
        self.written = {"reasoning": False, "content": False}
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.opened = format == "think" and prompt.rstrip().endswith(THINK_OPEN)
        if format == "harmony" and START in prompt:  # the template's header: read it as the reply's start
            self._feed(prompt[prompt.rindex(START) :], final=False)
            self.written = {"reasoning": False, "content": False}
            self.parts = {"reasoning": [], "content": []}
            if self.state == "header":  # the role written: the reply starts with a marker, or is no harmony
                self.state = "start"

    def add(self, text: str) -> tuple[str, str]:
        self._feed(text, final=False)
        return self._taken()

    def finish(self) -> tuple[str, str]:
        """What the held text was, the reply having ended (an open block's end is thoughts)."""
        self._feed("", final=True)
        return self._taken()

    def _taken(self) -> tuple[str, str]:
        reasoning, content = ("".join(self.parts[f]) for f in ("reasoning", "content"))
        self.parts = {"reasoning": [], "content": []}
        return reasoning, content

    def _feed(self, text: str, *, final: bool) -> None:
        """``text`` after what was held, through the states; ``final``: no more text comes, so
        nothing is held."""
        text, self.held = self.held + text, ""
        if self.state == "start":
            text = self._begin(text, final)
            if text is None:
                return
        while True:
            markers = _MARKERS[self.state]
            found = min(((text.index(m), m) for m in markers if m in text), default=None)
            if found is None:
                keep = 0 if final else partial_end(text, markers)
                if self.state in ("thought", "message") and not final:  # its end's whitespace may be the last
                    keep = len(text) - len(text[: len(text) - keep].rstrip())
                self.held = text[len(text) - keep :] if keep else ""
                self._text(text[: len(text) - keep], last=final)
                return
            at, marker = found
            self._text(text[:at], last=True)
            text = text[at + len(marker) :]
            self._after(marker)

    def _begin(self, text: str, final: bool) -> str | None:
        """The reply's start: its opening marker (after whitespace) decides the state, the rest of
        ``text`` returned; a possible start of one is held (None) until it is decided."""
        stripped = text.lstrip()
        opener = next((m for m in _OPENERS[self.format] if stripped.startswith(m)), None)
        if opener is not None:
            self._after(opener)
            return stripped[len(opener) :]
        if not final and any(m.startswith(stripped) for m in _OPENERS[self.format]):
            self.held = text
            return None
        if self.opened:  # the prompt opened the block: this is its text
            self._after(THINK_OPEN)
        else:  # no thoughts: the reply is all answer, as it was
            self.state, self.field = "answer", "content"
        return text

    def _after(self, marker: str) -> None:
        """The state after ``marker``."""
        if marker == THINK_OPEN:
            self.state, self.field, self.fresh = "thought", "reasoning", True
        elif marker == THINK_CLOSE:
            self.state, self.field, self.fresh = "answer", "content", True
        elif marker == START:
            self.state, self.channel = "header", ""
        elif marker == CHANNEL:
            self.state, self.channel = "channel", ""
        elif marker == MESSAGE:
            name = self.channel.split("<|", 1)[0].split()  # "commentary to=functions.f <|constrain|>json"
            self.state, self.fresh = "message", True
            self.field = "reasoning" if name[:1] == [THOUGHTS_CHANNEL] else "content"
        else:  # a message's end
            self.state = "header"

    def _text(self, text: str, *, last: bool) -> None:
        """``text`` in the current state; ``last``: the thought's or message's end follows it."""
        if self.state == "channel":
            self.channel += text
            return
        if self.state not in ("thought", "answer", "message"):
            return  # a header's role and recipient, or nothing yet
        if self.fresh:
            text = text.lstrip()
        if last and self.state != "answer":
            text = text.rstrip()
        if not text:
            return
        if self.fresh and self.written[self.field]:
            text = SEPARATOR + text
        self.fresh = False
        self.written[self.field] = True
        self.parts[self.field].append(text)
