"""``picc serve``: the real server on a free loopback port, spoken to with the official ``openai``
client and, for what a client library would refuse to send, with raw HTTP (httpx).

The model is a tiny random one with a word-level tokenizer and a small chat template; what the
server returns is compared with what a session alone generates for the same prompt (``picc run``'s
path), token for token through the text.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import served_model

from runtime.sampling import SamplingOptions, token_logprob
from runtime.session import Session

KEY = "test-key"
CTX = 2048  # long enough that a 2000-token stream is still going while the tests ask the server more
PROMPTS = ["the company said", "it is", "in the new york stock exchange the", "a year", "and the",
           "mr. said the company", "of the", "but"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return served_model(tmp_path_factory.mktemp("serve") / "tiny.pib", CTX)


class Endpoint:
    """A server at ``url``: a client for it, and its metrics (those of the process that answers)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


class Server(Endpoint):
    """``picc serve`` in a subprocess, on the port it reports."""

    def __init__(self, path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "picc.cli", "serve", str(path), "--port", "0",
                                      "--threads", "1", *args], stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        match = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        assert match, line + self.proc.stderr.read() if self.proc.poll() is not None else line
        super().__init__(match.group(1))
        self.log = [line]  # what it says on stderr, read as it comes (keeping the pipe drained)
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        for _ in range(200):
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--max-batch", "4", "--api-key", KEY)
    yield s
    s.close()


def alone(path, prompt_ids, n, options=SamplingOptions(), seed=0) -> list[int]:  # noqa: B008
    with Session(path, 1) as s:
        return list(s.generate(list(prompt_ids), n, options, seed=seed))


def text_of(path, ids) -> str:
    with Session(path, 1) as s:
        return s.text.decode([t for t in ids if t != s.text.eos_id])


def encode(path, text: str, chat: bool = False) -> list[int]:
    with Session(path, 1) as s:
        return s.text.encode_chat(text) if chat else s.text.encode(text)


def test_completions_and_chat_through_the_openai_client_are_picc_runs_tokens(server, model):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ids = encode(model, PROMPTS[0])
    expected = text_of(model, alone(model, ids, 12))
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 12)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12
    # Chat: the template's text, encoded as transformers would (no BOS added to it).
    chat_ids = encode(model, "user hello there system be brief the company", chat=True)
    messages = [{"role": "user", "content": "hello there"}, {"role": "system", "content": "be brief"}]
    expected = text_of(model, alone(model, chat_ids, 10))
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(chat_ids)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def reference_logprobs(path, prompt_ids, tokens, top):
    """Each token's log-probability record as a session alone computes it from its logits."""
    with Session(path, 1) as s:
        logits, records = s.feed(list(prompt_ids)), []
        for token in tokens:
            records.append(token_logprob(logits, token, top))
            logits = s.feed([token])
    return records


def test_logprobs_in_both_apis_are_picc_runs(server, model):
    client = server.client()
    ids = encode(model, PROMPTS[0])
    tokens = alone(model, ids, 6)
    expected = reference_logprobs(model, ids, tokens, 2)
    # Each token's text: what it adds to the completion (a word-level tokenizer's space included).
    spell = [text_of(model, tokens[: k + 1])[len(text_of(model, tokens[:k])) :] for k in range(6)]
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    got = done.choices[0].logprobs
    assert got.token_logprobs == [r.logprob for r in expected]  # JSON carries a float64 exactly
    assert got.tokens == spell and "".join(got.tokens) == done.choices[0].text
    assert got.text_offset == [sum(len(t) for t in spell[:k]) for k in range(6)]
    assert [list(d.values()) for d in got.top_logprobs] == [[lp for _, lp in r.top] for r in expected]
    # Streamed, the chunks' records add up to the same, their offsets running on across chunks.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == got.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == got.text_offset
    # Chat: each token's text, log-probability, bytes and the top ones' (top_logprobs 0: none).
    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = encode(model, "user hello there the company", chat=True)
    tokens = alone(model, chat_ids, 5)
    expected = reference_logprobs(model, chat_ids, tokens, 3)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == [r.logprob for r in expected]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[lp for _, lp in r.top] for r in expected]
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True)
    assert [c.logprob for c in bare.choices[0].logprobs.content] == [r.logprob for r in expected]
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_a_tokens_text_is_what_it_adds_even_inside_a_character():
    # Byte-level BPE splits "é" and "ï" over two tokens each. A token's text in the logprobs is
    # what it adds to the text before it: U+FFFD or nothing for a character's first byte, the
    # character for its last; never the text before it again.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from runtime.sampling import TokenLogprob
    from runtime.server import _LogprobShape
    from runtime.text import TextCodec

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["the cat sat", "café naïve"] * 10, trainers.BpeTrainer(
        vocab_size=262, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    codec = TextCodec(json.dumps({"format": "picc-tokenizer", "version": 1, "bos_id": None, "eos_id": None,
                                  "add_bos": False, "backend": json.loads(backend.to_str())}))
    ids = codec.encode("Café naïve")
    assert "\ufffd" in codec.decode(ids[2:3])  # the test splits a character, or it shows nothing
    shown = _LogprobShape(codec, chat=False)([TokenLogprob(t, -1.0) for t in ids])
    assert "".join(shown["tokens"]).replace("\ufffd", "") == "Café naïve"
    assert shown["text_offset"] == [sum(len(t) for t in shown["tokens"][:k]) for k in range(len(ids))]


def test_echo_gives_the_prompt_and_its_tokens_logprobs_first(server, model):
    # lm-eval-harness's loglikelihood request: echo, logprobs and max_tokens 0 score a prompt.
    client = server.client()
    ids = encode(model, PROMPTS[1])
    with Session(model, 1) as s:
        rows = s.executor.logits_of(ids[:-1], 0)
    expected = [None] + [token_logprob(row, t, 1).logprob for row, t in zip(rows, ids[1:], strict=True)]
    scored = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == expected and choice.logprobs.top_logprobs[0] is None
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    # With tokens to generate: the prompt, then the completion, and both's records in order.
    tokens = alone(model, ids, 4)
    done = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                     logprobs=0)
    assert done.choices[0].text == PROMPTS[1] + text_of(model, tokens)
    assert done.choices[0].logprobs.token_logprobs[: len(ids)] == expected
    assert done.choices[0].logprobs.token_logprobs[len(ids) :] == [r.logprob for r in
                                                                  reference_logprobs(model, ids, tokens, 0)]
    streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def test_logit_bias_is_picc_runs(server, model):
    client = server.client()
    ids = encode(model, PROMPTS[0])
    first = alone(model, ids, 1)[0]
    biased = SamplingOptions(logit_bias=((first, -100.0),))  # the greedy first token banned
    expected = alone(model, ids, 6, biased)
    assert expected[0] != first
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logit_bias={str(first): -100})
    assert done.choices[0].text == text_of(model, expected)


def test_presence_and_frequency_penalties_are_picc_runs(server, model):
    client = server.client()
    ids = encode(model, PROMPTS[0])
    penalised = SamplingOptions(presence_penalty=-1.0, frequency_penalty=0.4)  # see tests/test_engine.py
    expected = text_of(model, alone(model, ids, 12, penalised))
    assert expected != text_of(model, alone(model, ids, 12))  # the penalties change these tokens
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     presence_penalty=-1.0, frequency_penalty=0.4)
    assert done.choices[0].text == expected


def test_stop_token_ids_end_a_choice_even_with_ignore_eos(server, model):
    # vLLM's stop_token_ids: the choice ends after the first of them (not text, like EOS), with
    # finish_reason "stop", whether or not the request ignores the model's own stop tokens.
    client = server.client()
    free = alone(model, encode(model, PROMPTS[0]), 12)
    stop = free[4]
    cut = free.index(stop) + 1
    for ignore_eos in (False, True):
        done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body={"stop_token_ids": [stop], "ignore_eos": ignore_eos})
        assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == cut
        assert done.choices[0].text == text_of(model, free[: cut - 1])


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(tmp_path):
    # vLLM's --generation-config auto: a model whose generation_config.json recommends sampling
    # parameters (Qwen3: temperature 0.6, top_p 0.95, top_k 20) is sampled so where the request
    # names none; a request's own fields win (temperature 0: greedy).
    path = served_model(tmp_path / "sampled.pib", 256, sampling=(("temperature", 0.7), ("top_k", 5.0)))
    recommended = SamplingOptions(temperature=0.7, top_k=5)
    ids = encode(path, PROMPTS[0])
    s = Server(path, "--max-batch", "2")
    try:
        said = "the model's sampling defaults (generation_config.json) for requests that leave them out: " \
               "temperature 0.7, top_k 5"
        until = time.monotonic() + 10
        while not any(said in line for line in s.log) and time.monotonic() < until:
            time.sleep(0.01)
        assert any(said in line for line in s.log), s.log
        client = s.client()
        for seed in (1, 2):
            done = client.completions.create(model="sampled", prompt=PROMPTS[0], max_tokens=8, seed=seed)
            assert done.choices[0].text == text_of(path, alone(path, ids, 8, recommended, seed=seed))
        greedy = client.completions.create(model="sampled", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert greedy.choices[0].text == text_of(path, alone(path, ids, 8))
    finally:
        s.close()
    assert text_of(path, alone(path, ids, 8, recommended, seed=1)) != text_of(path, alone(path, ids, 8,
                                                                               SamplingOptions(temperature=1.0), seed=1))


def test_n_choices_and_lists_of_prompts_are_single_runs_each(server, model):
    # Choice j of prompt p is the request for prompt p alone with seed + j: sequences of their own,
    # decoded in the same batches as any others.
    client = server.client()
    options = SamplingOptions(temperature=0.8, top_p=0.9, min_p=0.1)  # min_p changes these draws
    prompts = PROMPTS[:2]
    expected = [text_of(model, alone(model, encode(model, p), 8, options, seed=5 + j)) for p in prompts for j in range(3)]
    done = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=8, temperature=0.8, top_p=0.9,
                                     seed=5, extra_body={"min_p": 0.1})
    assert [c.index for c in done.choices] == list(range(6))
    assert [c.text for c in done.choices] == expected
    assert done.usage.prompt_tokens == sum(len(encode(model, p)) for p in prompts)
    assert done.usage.completion_tokens == 6 * 8
    streamed = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=8, temperature=0.8,
                                         top_p=0.9, seed=5, stream=True, extra_body={"min_p": 0.1})
    texts = [""] * 6
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6, temperature=0)
    assert len(reply.choices) == 2 and reply.choices[0].message.content == reply.choices[1].message.content
    streamed = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6, temperature=0,
                                              stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [reply.choices[0].message.content] * 2
    assert server.metric("picc_active_sequences") == 0


def test_usage_counts_the_prompt_tokens_taken_from_an_earlier_prompt(server, model):
    # A conversation's second turn starts as its first did: the 66 tokens they share are not
    # computed again (usage.prompt_tokens_details.cached_tokens, the metric; the model's chunk
    # programs compute the step's bits, so any rows are taken), and the reply is still picc run's.
    client = server.client()
    first = encode(model, " ".join(reversed(PROMPTS)) * 4)[:70]
    second = [*first[:66], *first[:9]]
    before = server.metric("picc_prompt_tokens_cached_total")
    cached = []
    for ids in (first, second):
        done = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
        assert done.choices[0].text == text_of(model, alone(model, ids, 5))
        cached.append(done.usage.prompt_tokens_details.cached_tokens)
    # (The first takes at most the few tokens other tests' prompts began with: BOS, a word.)
    assert cached[0] < 4 and cached[1] == 66
    assert server.metric("picc_prompt_tokens_cached_total") == before + sum(cached)
    chunks = list(client.completions.create(model="tiny", prompt=second, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(second) - 1  # all it can take: it ran


def test_concurrent_requests_get_single_run_outputs(server, model):
    options = SamplingOptions(temperature=0.8, top_p=0.9)
    expected = {}
    for i, p in enumerate(PROMPTS):
        ids = encode(model, p)
        expected[i] = (text_of(model, alone(model, ids, 20)), text_of(model, alone(model, ids, 20, options, seed=i)))
    got: dict[int, tuple[str, str]] = {}

    def ask(i: int) -> None:
        client = server.client()
        greedy = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=20, temperature=0)
        sampled = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=20, temperature=0.8,
                                            top_p=0.9, seed=i)
        got[i] = (greedy.choices[0].text, sampled.choices[0].text)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    assert server.metric("picc_active_sequences") == 0
    assert server.metric("picc_free_slots") == server.metric("picc_max_batch")


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    (b"{not json", 400, None, None),
    (b"[1, 2]", 400, None, None),
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "the", "max_tokens": "5"}, 400, "max_tokens", None),
    ({"prompt": "the", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "the", "temperature": 3}, 400, "temperature", None),
    ({"prompt": "the", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "the", "min_p": 1.5}, 400, "min_p", None),
    ({"prompt": "the", "stop_token_ids": [1, "2"]}, 400, "stop_token_ids", None),
    ({"prompt": "the", "stop_token_ids": list(range(65))}, 400, "stop_token_ids", None),
    ({"prompt": "the", "stop_token_ids": [100000]}, 400, "stop_token_ids", None),
    ({"prompt": "the", "stream": "yes"}, 400, "stream", None),
    ({"prompt": "the", "n": 0}, 400, "n", None),
    ({"prompt": ["the", "a"], "n": 65}, 400, "n", None),  # 130 choices: past OpenAI's 128
    ({"prompt": ["the", [1, 2]]}, 400, "prompt", None),  # a list of prompts is all text or all ids
    ({"prompt": "the", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"prompt": [1] * (CTX + 1)}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "the", "max_tokens": CTX}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [1, 100000]}, 400, "prompt", None),
    ({"prompt": "the", "model": "gpt-4"}, 404, "model", "model_not_found"),
    # What json.loads refuses beyond syntax, and text that is not Unicode: 400s, not 500s.
    (b'{"prompt": "the", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, None),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, None),
    (b'{"prompt": "a\\ud800b"}', 400, None, None),
    (b'{"prompt": "the", "model": "\\udc80"}', 400, None, None),
    # Fields OpenAI defines, checked as it checks them; those that would change the tokens refused.
    ({"prompt": "the", "logit_bias": 5}, 400, "logit_bias", None),
    ({"prompt": "the", "logit_bias": {"5": -101}}, 400, "logit_bias", None),
    ({"prompt": "the", "logit_bias": {"100000": 1}}, 400, "logit_bias", None),  # past the vocabulary
    ({"prompt": "the", "best_of": 2}, 400, "best_of", None),
    ({"prompt": "the", "echo": 0}, 400, "echo", None),
    ({"prompt": "the", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": "the", "logprobs": 6}, 400, "logprobs", None),
    ({"prompt": "the", "logprobs": True}, 400, "logprobs", None),
    ({"prompt": "the", "frequency_penalty": "high"}, 400, "frequency_penalty", None),
    ({"prompt": "the", "user": 5}, 400, "user", None),
])
def test_bad_completions_get_openai_error_objects(server, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = error_of(r)
    assert error["param"] == param and error["code"] == code and error["message"]


def test_keys_routes_and_chat_errors(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "the"}, headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # not under /v1: no key
    r = httpx.get(server.url + "/v1/nowhere", headers=auth)
    assert r.status_code == 404 and error_of(r)["code"] == "unknown_url"
    assert httpx.get(server.url + "/v1/models/other", headers=auth).status_code == 404
    r = httpx.get(server.url + "/v1/completions", headers=auth)
    assert r.status_code == 405 and error_of(r)
    r = httpx.post(server.url + "/v1/completions/", json={"prompt": "the"}, headers=auth)
    assert r.status_code == 404 and error_of(r)["code"] == "unknown_url"  # no redirect to the route
    hi = [{"role": "user", "content": "hi"}]
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
                        ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
                        ({"messages": hi, "logprobs": 0}, "logprobs"),
                        ({"messages": hi, "top_logprobs": 5}, "top_logprobs"),
                        ({"messages": hi, "max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens")):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model="tiny", prompt="the")
    assert "picc_requests_total{" in httpx.get(server.url + "/metrics").text


def test_tokenize_and_detokenize_are_the_models_own(server, model):
    # vLLM's /tokenize and /detokenize: a prompt's ids as a completion would run them (its BOS
    # unless add_special_tokens is false), a chat's as the chat route renders it (the usage of a
    # chat completion counts the same), and ids back to text; errors as the other routes give them.
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + route, json=body, headers=auth)

    text = "the company said it is"
    got = post("/tokenize", {"model": "tiny", "prompt": text}).json()
    assert got == {"count": len(encode(model, text)), "max_model_len": CTX, "tokens": encode(model, text)}
    bare = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert [got["tokens"][0], *bare] == got["tokens"] != bare  # the tiny model's tokenizer adds BOS
    messages = [{"role": "user", "content": "hello there"}, {"role": "system", "content": "be brief"}]
    chat = post("/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == encode(model, "user hello there system be brief the company", chat=True)
    done = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert done.usage.prompt_tokens == chat["count"]
    plain = post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert plain == encode(model, "user hello there system be brief", chat=True)
    # chat_template_kwargs (vLLM's, llama.cpp's): more of the template's variables
    said = post("/tokenize", {"messages": messages, "chat_template_kwargs": {"said": True}}).json()
    assert said["tokens"] == encode(model, "user hello there system be brief the company said", chat=True)
    done = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                                   extra_body={"chat_template_kwargs": {"said": True}})
    assert done.usage.prompt_tokens == said["count"] == chat["count"] + 1
    assert post("/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": text_of(model, got["tokens"])}
    for route, body, status, param in (("/tokenize", {}, 400, "prompt"),
                                       ("/tokenize", {"prompt": "the", "messages": messages}, 400, "prompt"),
                                       ("/tokenize", {"prompt": 5}, 400, "prompt"),
                                       ("/tokenize", {"messages": [{"role": "wizard"}]}, 400, "messages[0].role"),
                                       ("/tokenize", {"messages": messages, "chat_template_kwargs": [1]}, 400,
                                        "chat_template_kwargs"),
                                       ("/tokenize", {"messages": messages, "chat_template_kwargs": {"bos_token": "x"}},
                                        400, "chat_template_kwargs"),
                                       ("/tokenize", {"prompt": "the", "model": "other"}, 404, "model"),
                                       ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
                                       ("/detokenize", {"tokens": "1 2"}, 400, "tokens")):
        r = post(route, body)
        assert r.status_code == status and error_of(r)["param"] == param, (route, body, r.text)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "the"}).status_code == 401


def test_a_body_past_the_limit_is_refused_before_it_is_read(server):
    # A 20 MB prompt took the tokenizer 12 s on the event loop, every other request waiting; now
    # anything past max_body_bytes is a 413, declared (Content-Length) or streamed in chunks.
    from runtime.server import max_body_bytes

    auth = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"prompt": "the " * (max_body_bytes(CTX) // 4)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers=auth)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = httpx.post(server.url + "/v1/completions", content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
                   headers=auth)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "the", "max_tokens": 1},
                      headers=auth).status_code == 200


def test_an_unexpected_error_is_a_500_error_object_and_one_log_line(model, caplog):
    # Starlette answers an exception no handler takes, but raises it on (a traceback in the log,
    # the connection dropped); the TestClient raises what escapes the app, so this fails without
    # the server's own last resort.
    import copy

    from fastapi.testclient import TestClient

    from runtime.engine import Engine
    from runtime.server import ServedModel, create_app

    with Session(model, 1) as session:
        engine = Engine(session, max_batch=1)
        try:
            codec = copy.copy(session.text)
            codec.encode = lambda text: 1 // 0
            with TestClient(create_app(ServedModel(engine, codec, "tiny", 0))) as client:
                r = client.post("/v1/completions", json={"prompt": "the"})
                assert r.status_code == 500
                error = error_of(r)
                assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]
                assert client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200
        finally:
            engine.close()
    logged = [r for r in caplog.records if r.name == "picc.serve"]
    assert len(logged) == 1 and "ZeroDivisionError" in logged[0].getMessage() and not logged[0].exc_info


def test_stop_strings_end_the_text_before_them(server, model):
    client = server.client()
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0)
    words = full.choices[0].text.split()
    stop = " ".join(words[3:5])
    cut = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text) and len(cut.choices[0].text) < len(full.choices[0].text)
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_sequence(model):
    s = Server(model, "--max-batch", "1", "--max-queue", "0")
    try:
        body = {"model": "tiny", "prompt": "the", "max_tokens": CTX - 48, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # decoding has started
            r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] and error_of(r)["code"] == "rate_limit_exceeded"
        for _ in range(100):  # the stream's connection is closed: its sequence is freed
            if s.metric("picc_free_slots") == 1:
                break
            time.sleep(0.05)
        assert s.metric("picc_free_slots") == 1 and s.metric("picc_active_sequences") == 0
        assert s.metric("picc_decoded_tokens_total") < CTX - 48  # freed early, not run to its end
        r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # More choices than the server can ever hold: a 400, not a 429 to retry.
        r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3, "n": 2})
        assert r.status_code == 400 and error_of(r)["param"] == "n" and "at most 1 choices" in error_of(r)["message"]
    finally:
        s.close()


def test_serve_errors_are_one_line(model, tmp_path):
    busy = Server(model)
    try:
        port = busy.url.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "picc.cli", "serve", str(model), "--port", port],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "cannot listen" in r.stderr
    finally:
        busy.close()
    r = subprocess.run([sys.executable, "-m", "picc.cli", "serve", str(model), "--port", "0", "--max-batch", "100000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--max-batch 100000" in r.stderr and r.stderr.strip().count("\n") == 0
    for args, message in ((["--ray", "--port", "0"], "--port 0: Ray's HTTP proxy needs a fixed port"),
                          (["--ray", "--replicas", "0"], "--replicas must be >= 1")):
        r = subprocess.run([sys.executable, "-m", "picc.cli", "serve", str(model), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
