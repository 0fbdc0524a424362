"""A reasoning model's thoughts apart from its answer (``runtime.reasoning``): both formats (the
``<think>`` block and gpt-oss's harmony channels), fed whole, at every split in two and a
character at a time (a marker split across stream chunks must not show in either field), a block
the prompt opened, one never closed, replies without thoughts and text that only resembles a
marker; and the markers as a real tokenizer's tokens, through the codec and the text stream."""

from __future__ import annotations

import json

import pytest

from runtime.reasoning import ReasoningSplit, reasoning_format, served_format
from runtime.text import TextCodec

QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"  # DeepSeek-R1-0528's: the block opened
NO_THINKING_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3's enable_thinking=false
HARMONY_PROMPT = ("<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>What is 2+2?<|end|>"
                  "<|start|>assistant")  # gpt-oss's, with the generation prompt


def pieces_of(text: str) -> list[list[str]]:
    """``text`` whole, split in two at every character boundary, and a character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def split(format: str, prompt: str, pieces: list[str]) -> tuple[str, str]:
    """The thoughts and answer of a reply streamed as ``pieces``."""
    s = ReasoningSplit(format, prompt)
    parts = [s.add(p) for p in pieces] + [s.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


def split_everywhere(format: str, prompt: str, reply: str) -> tuple[str, str]:
    """The split of ``reply``, the same however it was cut into pieces."""
    results = {tuple(split(format, prompt, pieces)) for pieces in pieces_of(reply)}
    assert len(results) == 1, results
    return results.pop()


@pytest.mark.parametrize(("prompt", "reply", "expected"), [
    # Qwen3: the reply opens the block; whitespace around the thoughts and before the answer goes.
    (QWEN3_PROMPT, "<think>\nThe user adds 2 and 2.\n</think>\n\nIt is 4.", ("The user adds 2 and 2.", "It is 4.")),
    (QWEN3_PROMPT, "\n<think>a</think>b", ("a", "b")),
    # DeepSeek-R1-0528: the prompt opened it; a model that writes it again is understood too.
    (R1_PROMPT, "The user adds.\n</think>\n\nIt is 4.", ("The user adds.", "It is 4.")),
    (R1_PROMPT, "<think>\nThe user adds.</think>It is 4.", ("The user adds.", "It is 4.")),
    # Never closed (max_tokens reached): all thoughts, an empty answer; a close tag cut short by
    # the end of the reply was never a tag, so it is thoughts' text.
    (QWEN3_PROMPT, "<think>\nStill thinking about", ("Still thinking about", "")),
    (R1_PROMPT, "Still thinking\n", ("Still thinking", "")),
    (R1_PROMPT, "Still thinking </thi", ("Still thinking </thi", "")),
    (R1_PROMPT, "", ("", "")),
    # No thoughts: the reply as it was, its whitespace included.
    (QWEN3_PROMPT, "  It is 4.\n", ("", "  It is 4.\n")),
    (NO_THINKING_PROMPT, "It is 4.", ("", "It is 4.")),
    (QWEN3_PROMPT, "", ("", "")),
    # Only a block that opens the reply is one; what resembles a marker is text.
    (QWEN3_PROMPT, "<thinking>a</thinking>", ("", "<thinking>a</thinking>")),
    (QWEN3_PROMPT, "<think", ("", "<think")),
    (QWEN3_PROMPT, "a <think>b</think> c", ("", "a <think>b</think> c")),
    (QWEN3_PROMPT, "</think> a", ("", "</think> a")),
    (QWEN3_PROMPT, "<think>a</think>b <think>c</think>", ("a", "b <think>c</think>")),
    (QWEN3_PROMPT, "<think>a </thinker> b</think>c", ("a </thinker> b", "c")),
])
def test_think_blocks_split_however_the_text_is_cut(prompt, reply, expected):
    assert split_everywhere("think", prompt, reply) == expected


@pytest.mark.parametrize(("prompt", "reply", "expected"), [
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant"
                     "<|channel|>final<|message|>2 + 2 = 4.", ("User asks 2+2. Answer 4.", "2 + 2 = 4.")),
    # A preamble (commentary) and the final answer are both answer; a tool call's header's
    # recipient and constraint are no channel name.
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary"
                     "<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     ("Think.", "Let me check.\n\nDone.")),
    (HARMONY_PROMPT, "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 2}",
     ("", "{\"a\": 2}")),
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.",
     ("A.\n\nB.", "")),
    # Never closed: the analysis so far, an empty answer.
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>Still thinking", ("Still thinking", "")),
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>Still thinking<|en", ("Still thinking<|en", "")),
    # A prompt that opened the analysis channel itself.
    (HARMONY_PROMPT + "<|channel|>analysis<|message|>", "Think.<|end|><|start|>assistant<|channel|>final"
                                                        "<|message|>Yes.", ("Think.", "Yes.")),
    # No harmony in the reply: the reply as it was.
    (HARMONY_PROMPT, "It is 4.", ("", "It is 4.")),
    (HARMONY_PROMPT, "<|chan", ("", "<|chan")),
    (HARMONY_PROMPT, "<|channel> analysis", ("", "<|channel> analysis")),
    ("", "It is <|channel|> 4.", ("", "It is <|channel|> 4.")),
])
def test_harmony_channels_split_however_the_text_is_cut(prompt, reply, expected):
    assert split_everywhere("harmony", prompt, reply) == expected


def test_the_format_is_the_chat_templates():
    qwen3 = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
             "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
    r1 = "{% set content = message['content'].split('</think>')[-1] %}{{ content }}"  # R1's first template
    gpt_oss = "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    smollm2 = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% endfor %}"
    assert [reasoning_format(t) for t in (qwen3, r1, gpt_oss, smollm2, None)] == ["think", "think", "harmony",
                                                                                  None, None]
    assert served_format("auto", qwen3) == "think" and served_format("none", qwen3) is None
    with pytest.raises(ValueError, match="unknown reasoning format option 'deepseek'"):
        served_format("deepseek", qwen3)


def bpe_codec(specials: list[str]) -> TextCodec:
    """A byte-level BPE codec (as gpt-oss's and Qwen3's are) with ``specials`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["the user asks what two and two make, and the answer is four"] * 10,
                                trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    backend.add_special_tokens(specials)
    return TextCodec(json.dumps({"format": "picc-tokenizer", "version": 1, "bos_id": None, "eos_id": None,
                                 "add_bos": False, "backend": json.loads(backend.to_str())}))


def streamed(codec: TextCodec, prompt: str, format: str, reply: str) -> tuple[str, str]:
    """``reply`` encoded, and its tokens run through the server's text stream one by one into a split."""
    from runtime.generation import TextStream

    stream, s = TextStream(codec, []), ReasoningSplit(format, prompt)
    parts = [s.add(stream.add(token)) for token in codec.encode(reply)] + [s.add(stream.finish()), s.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


def test_harmonys_special_tokens_reach_the_split_through_the_codec():
    # gpt-oss's markers are special tokens: the codec decodes them as text (as 'picc run' prints
    # them), so the split sees them, and the fields do not.
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    codec = bpe_codec(markers)
    reply = ("<|channel|>analysis<|message|>the user asks what two and two make<|end|><|start|>assistant"
             "<|channel|>final<|message|>four")
    ids = codec.encode(reply)
    assert {codec.backend.token_to_id(m) for m in markers[:4]} <= set(ids)  # each a token of its own
    assert codec.decode(ids) == reply
    assert streamed(codec, HARMONY_PROMPT, "harmony", reply) == ("the user asks what two and two make", "four")


def test_a_think_tag_split_over_tokens_never_shows():
    # A tokenizer without <think> as a token spells the tags in pieces ("<", "th", "ink", ">"): the
    # stream delivers them across several deltas, and the split holds each piece until it is decided.
    codec = bpe_codec([])
    reply = "<think>\nthe user asks what two and two make\n</think>\n\nthe answer is four"
    assert len(codec.encode("</think>")) > 2
    assert streamed(codec, QWEN3_PROMPT, "think", reply) == ("the user asks what two and two make",
                                                            "the answer is four")
