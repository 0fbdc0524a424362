"""A reasoning model's chat replies through ``picc serve`` and ``picc run --chat``: thoughts in
``reasoning_content``, the answer in ``content``, streamed as thoughts' chunks then the answer's;
``--reasoning-format none`` and completions give the raw text.

The model is the servers' tiny random one with a word tokenizer in which some words are spelled
as tags, and a chat template whose generation prompt opens the block, as DeepSeek-R1-0528's does:
the rarest word is ``<think>``, and ``</think>`` is a word the greedy reply to the test's chat
writes a few tokens in (found by running the model, whose weights do not depend on how its words
are spelled; the word is in neither the prompt nor the reply before it). The word before it is
spelled ``</think`` -- text that only looks like the start of the tag, which the split holds back
until the next text (or the reply's end) shows it is not. What the server returns is compared with
the tokens a session alone generates, cut at ``</think>``.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, replace

import pytest
from conftest import served_model, word_tokenizer
from test_server import KEY, Server, alone, encode, text_of

from picc.cli import main
from picc.frontend.tokenizer import Tokenizer
from runtime.chat import render_chat
from runtime.session import Session

CTX = 256
THINK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}the company <think>{% endif %}")
MESSAGES = [{"role": "user", "content": "hello there"}]
THINK_ID = 126  # the rarest of the word tokenizer's words
AFTER = 6  # answer tokens the tests generate after </think>
LOOKALIKE = "</think"  # the last word of the thoughts


def spelled(words: dict[int, str]) -> Tokenizer:
    """The servers' word tokenizer with the words of ``words``' ids spelled as given, and ``THINK_TEMPLATE``."""
    tokenizer = word_tokenizer(128)
    document = json.loads(tokenizer.backend_json)
    vocab = document["model"]["vocab"]
    by_id = {i: word for word, i in vocab.items()}
    for i, word in words.items():
        del vocab[by_id[i]]
        vocab[word] = i
    return replace(tokenizer, backend_json=json.dumps(document), chat_template=THINK_TEMPLATE)


@dataclass
class ThinkModel:
    path: object
    prompt: list[int]  # the chat's prompt ids (MESSAGES rendered)
    close: int  # </think>
    thoughts: int  # tokens of thoughts the greedy reply writes before </think>
    tokens: list[int]  # the greedy reply: thoughts, </think>, AFTER tokens of answer

    def text(self, ids: list[int]) -> str:
        return text_of(self.path, ids)

    def parts(self) -> tuple[str, str]:
        """The greedy reply's thoughts and answer: its text before and after </think>."""
        return self.text(self.tokens[: self.thoughts]), self.text(self.tokens[self.thoughts + 1 :])


@pytest.fixture(scope="module")
def think(tmp_path_factory) -> ThinkModel:
    folder = tmp_path_factory.mktemp("think")
    probe = served_model(folder / "probe.pib", CTX, tokenizer=spelled({THINK_ID: "<think>"}))
    with Session(probe, 1) as s:
        rendered = render_chat(THINK_TEMPLATE, MESSAGES, bos_token=s.text.bos_token, eos_token=s.text.eos_token)
    prompt = encode(probe, rendered, chat=True)
    assert prompt[-1] == THINK_ID and rendered.endswith("<think>")
    tokens = alone(probe, prompt, 40)
    k = next(k for k in range(3, 40 - AFTER) if tokens[k] != tokens[k - 1] and
             not {tokens[k - 1], tokens[k]} & {0, 1, THINK_ID, *tokens[: k - 1], *prompt})
    assert THINK_ID not in tokens[: k + 1 + AFTER]
    words = {THINK_ID: "<think>", tokens[k - 1]: LOOKALIKE, tokens[k]: "</think>"}
    path = served_model(folder / "think.pib", CTX, tokenizer=spelled(words))
    return ThinkModel(path, prompt, tokens[k], k, tokens[: k + 1 + AFTER])


@pytest.fixture(scope="module")
def server(think):
    s = Server(think.path, "--max-batch", "2", "--api-key", KEY)
    yield s
    s.close()


def test_a_chat_reply_comes_as_thoughts_and_answer(server, think):
    # What a session alone generates, cut at </think>: thoughts, then the answer; the word
    # tokenizer's spaces around the tags are the whitespace the split strips.
    thoughts, answer = think.parts()
    assert thoughts.endswith(" " + LOOKALIKE) and answer and "</think>" in think.text(think.tokens)
    client = server.client()
    n = len(think.tokens)
    reply = client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=n, temperature=0,
                                           logprobs=True)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (thoughts, answer)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == n  # the thoughts' tokens count
    assert len(reply.choices[0].logprobs.content) == n  # and have their log-probabilities
    # Streamed: the thoughts' chunks, then the answer's, none with both, none with a tag.
    chunks = list(client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, logprobs=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    records = [len(c.choices[0].logprobs.content) if c.choices and c.choices[0].logprobs else 0 for c in chunks]
    assert sum(records) == n and records[1] == 1  # the first thought's token, with its text
    kinds = [("r" if getattr(d, "reasoning_content", None) else "") + ("c" if d.content else "") for d in deltas]
    assert "rc" not in kinds and kinds.index("c") > max(i for i, kind in enumerate(kinds) if kind == "r")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thoughts
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].usage.completion_tokens == n


def test_choices_and_stop_strings_split_too(server, think):
    client = server.client()
    n = len(think.tokens)
    thoughts, answer = think.parts()
    reply = client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=n, temperature=0, n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in reply.choices] == [(thoughts, answer)] * 2
    # A stop string is the raw text's: one in the answer cuts the answer, the thoughts stay whole.
    stop = " ".join(answer.split()[2:4])
    assert stop not in thoughts
    cut = client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=n, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.reasoning_content == thoughts
    assert cut.choices[0].message.content == answer[: answer.index(stop)]


def test_a_reply_that_never_closes_its_thoughts_is_all_thoughts(server, think):
    client = server.client()
    thoughts, _ = think.parts()
    reply = client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=think.thoughts,
                                           temperature=0)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content, reply.choices[0].finish_reason) == (thoughts, "", "length")
    chunks = list(client.chat.completions.create(model="think", messages=MESSAGES, max_tokens=think.thoughts,
                                                 temperature=0, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks[1:])
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == thoughts


def test_completions_are_the_raw_text(server, think):
    # The chat's prompt ids as a completion's prompt: the same reply, whole.
    done = server.client().completions.create(model="think", prompt=think.prompt, max_tokens=len(think.tokens),
                                              temperature=0)
    assert done.choices[0].text == think.text(think.tokens)  # "</think>" and all
    assert "reasoning_content" not in done.choices[0].model_extra


def test_reasoning_format_none_keeps_replies_whole(server, think):
    said = "chat replies' thoughts in reasoning_content, apart from the answer (the chat template's think format"
    until = time.monotonic() + 10
    while not any(said in line for line in server.log) and time.monotonic() < until:
        time.sleep(0.01)
    assert any(said in line for line in server.log), server.log
    raw = Server(think.path, "--reasoning-format", "none")
    try:
        reply = raw.client().chat.completions.create(model="think", messages=MESSAGES, max_tokens=len(think.tokens),
                                                     temperature=0)
        assert reply.choices[0].message.content == think.text(think.tokens)  # "</think>" and all
        assert "reasoning_content" not in reply.choices[0].message.model_extra
        assert not any(said in line for line in raw.log)
    finally:
        raw.close()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_chat_prints_the_thoughts_apart(think, capsys, monkeypatch):
    n = str(len(think.tokens))
    thoughts, answer = think.parts()
    argv = ["run", str(think.path), "--chat", "-p", MESSAGES[0]["content"], "-n", n]
    assert main(argv) == 0
    assert capsys.readouterr().out == f"thinking: {thoughts}\n{answer}\n"
    assert main([*argv, "--hide-thoughts"]) == 0
    assert capsys.readouterr().out == f"{answer}\n"
    assert main([*argv[:-1], str(think.thoughts)]) == 0  # never closed: thoughts to the end (the held lookalike)
    assert capsys.readouterr().out == f"thinking: {thoughts}\n"
    assert main([*argv, "--reasoning-format", "none"]) == 0
    assert capsys.readouterr().out == think.text(think.tokens) + "\n"
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["reasoning_content"], result["content"], result["text"]) == (thoughts, answer,
                                                                                think.text(think.tokens))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(argv) == 0
    assert terminal.getvalue() == f"\x1b[2mthinking: {thoughts}\x1b[0m\n{answer}\n"  # dimmed
    monkeypatch.undo()
    assert main(["run", str(think.path), "-p", "the", "--hide-thoughts"]) == 1
    assert "--hide-thoughts: only with --chat" in capsys.readouterr().err


def test_run_chat_keeps_the_answer_alone_in_the_conversation(think, capsys, monkeypatch):
    # The next turn's prompt has the first reply's answer as the assistant's message, not its
    # thoughts (as an API client sends it back): the second reply is a fresh session's on that
    # (and another than on the whole first reply).
    n = len(think.tokens)
    thoughts, answer = think.parts()

    def second_reply(first: str) -> list[int]:
        messages = [*MESSAGES, {"role": "assistant", "content": first}, {"role": "user", "content": "and the market"}]
        with Session(think.path, 1) as s:
            rendered = render_chat(THINK_TEMPLATE, messages, bos_token=s.text.bos_token, eos_token=s.text.eos_token)
        return alone(think.path, encode(think.path, rendered, chat=True), n)

    second = second_reply(answer)
    assert second != second_reply(think.text(think.tokens))
    cut = second.index(think.close) if think.close in second else n
    expected = [f"thinking: {think.text(second[:cut])}", *([think.text(second[cut + 1 :])] if cut < n else [])]
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{MESSAGES[0]['content']}\nand the market\n"))
    assert main(["run", str(think.path), "--chat", "-n", str(n)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"thinking: {thoughts}", answer, *expected]
