"""Chat templates: carried from the model's tokenizer into the .pib, rendered by runtime.chat as
transformers' apply_chat_template renders them, to the same token ids."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import tiny_llama, word_tokenizer
from test_tokenizer import write_tiny_hf_dir

from picc.frontend.aliases import resolve_alias
from picc.frontend.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from picc.pib import load_pib, write_pib
from runtime.chat import ChatTemplateError, render_chat
from runtime.pib import PibFile
from runtime.text import TextCodec

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French, naïvement. 🎉"},
        {"role": "user", "content": "Hi there <|im_end|> sneaky"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  spaces\tand\nnewlines  "},
    ],
    # No system message: SmolLM2's template writes its own default one.
    [{"role": "user", "content": "Hello"}],
]

# Exercises what apply_chat_template's Jinja setup changes from plain Jinja: trim_blocks /
# lstrip_blocks, loop controls, a tojson that keeps non-ASCII and HTML characters, `tools` given as
# none (undefined would pass `is not none`), and bos_token / eos_token.
FEATURE_TEMPLATE = """{{ bos_token }}
{% if tools is not none %}TOOLS{% endif %}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% if loop.index is even %}{% continue %}{% endif %}
    {{ message | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_alias("smollm2")


@pytest.fixture(scope="module")
def smollm2(gguf_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' tokenizer for the GGUF, loaded offline as picc loads it."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)


def test_smollm2_gguf_carries_its_chat_template(smollm2: Tokenizer, reference: Any) -> None:
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert smollm2.chat_template == reference.chat_template


def test_json_round_trip_keeps_the_template(smollm2: Tokenizer) -> None:
    text = smollm2.to_json()
    assert json.loads(text)["chat_template"] == smollm2.chat_template
    restored = Tokenizer.from_json(text)
    assert restored == smollm2 and restored.chat_template == smollm2.chat_template
    codec = TextCodec(text)
    assert codec.chat_template == smollm2.chat_template
    assert (codec.bos_token, codec.eos_token) == ("<|im_start|>", "<|im_end|>")
    # A template is part of what a tokenizer is: two that differ only there are not equal.
    assert replace(smollm2, chat_template=None) != smollm2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system-user", "four-turns", "user-only"])
def test_chat_ids_match_transformers(smollm2: Tokenizer, reference: Any, messages: list[dict],
                                     add_generation_prompt: bool) -> None:
    codec = TextCodec(smollm2.to_json())
    text = render_chat(codec.chat_template, messages, bos_token=codec.bos_token, eos_token=codec.eos_token,
                       add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
    theirs = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                           return_dict=False)
    assert codec.encode_chat(text) == theirs
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_features_render_as_transformers_renders_them() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "<b>café</b> & \"quotes\""}, {"role": "assistant", "content": "skipped"},
                {"role": "user", "content": "ünïcode"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "after the break"}]
    ours = render_chat(FEATURE_TEMPLATE, messages, bos_token="<s>", eos_token="</s>")
    theirs = render_jinja_template(conversations=[messages], chat_template=FEATURE_TEMPLATE,
                                   add_generation_prompt=True, bos_token="<s>", eos_token="</s>")[0][0]
    assert ours == theirs
    assert "TOOLS" not in ours and "café" in ours and "after the break" not in ours


def test_template_variables_render_as_transformers_passes_them() -> None:
    # A request's chat_template_kwargs (Qwen3's enable_thinking, gpt-oss's reasoning_effort) are
    # the template's variables, as apply_chat_template's **kwargs; the renderer's own are refused.
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        ours = render_chat(template, messages, bos_token=None, eos_token=None, variables=variables)
        theirs = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                       **variables)[0][0]
        assert ours == theirs
    assert render_chat(template, messages, bos_token=None, eos_token=None,
                       variables={"enable_thinking": False}).endswith("<think></think>")
    for variables, message in (({"eos_token": "x"}, "chat template variable 'eos_token' is set by picc"),
                               ([("a", 1)], "chat template variables must be an object of names")):
        with pytest.raises(ChatTemplateError, match=message):
            render_chat(template, messages, bos_token=None, eos_token=None, variables=variables)


def test_bos_written_by_the_template_is_not_doubled(tmp_path: Path) -> None:
    # A Llama-2-like tokenizer that adds BOS to plain text, whose template also writes it.
    write_tiny_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
                               "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    codec = TextCodec(tokenizer_from_hf_dir(tmp_path).to_json())
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "abc ab"}]
    text = render_chat(codec.chat_template, messages, bos_token=codec.bos_token, eos_token=codec.eos_token)
    assert codec.add_bos and codec.encode(text)[:2] == [1, 1]  # what plain encode would do
    assert codec.encode_chat(text) == reference.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False)
    assert codec.encode_chat(text)[:2] == [1, codec.backend.token_to_id("s")]


@pytest.mark.parametrize(("named", "expected"), [
    ({"default": "D{{ messages[0]['content'] }}", "tool_use": "T"}, "D{{ messages[0]['content'] }}"),
    ({"tool_use": "T"}, None),
])
def test_named_templates_keep_the_default_one(tmp_path: Path, named: dict[str, str], expected: str | None) -> None:
    write_tiny_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": name, "template": template} for name, template in named.items()]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_from_hf_dir(tmp_path).chat_template == expected


def test_a_tokenizer_without_a_template_serializes_null() -> None:
    relu_demo = tokenizer_from_hf_dir(resolve_alias("relu-demo"))
    assert relu_demo.chat_template is None
    text = relu_demo.to_json()
    assert json.loads(text)["chat_template"] is None
    assert TextCodec(text).chat_template is None
    # Documents written before the template was kept load as tokenizers without one.
    document = json.loads(text)
    del document["chat_template"]
    assert Tokenizer.from_json(json.dumps(document)) == relu_demo
    assert TextCodec(json.dumps(document)).chat_template is None


def test_the_pib_carries_the_template(tmp_path: Path) -> None:
    # picc compile writes the tokenizer through write_pib, so this is the path a compiled model takes.
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = replace(tiny_llama(n_layers=1), tokenizer=replace(word_tokenizer(128), chat_template=template))
    path = tmp_path / "tiny.pib"
    write_pib(path, model, plan={"gpu_bytes": 0}, report={}, meta={})
    with PibFile(path) as pib:
        assert TextCodec(pib.text("tokenizer")).chat_template == template
    assert load_pib(path).tokenizer == model.tokenizer


@pytest.mark.parametrize(("messages", "message"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "chat message 0: expected a dict"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], 'chat message 1: "role"'),
    ([{"role": 3, "content": "a"}], 'chat message 0: "role"'),
    ([{"role": "user"}], 'chat message 0: "content"'),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image", "url": "x"}]}],
     'chat message 1: "content"'),
])
def test_bad_messages_are_refused_naming_the_message(messages: Any, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        render_chat("{{ messages }}", messages, bos_token=None, eos_token=None)


def test_text_parts_are_joined() -> None:
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    ours = render_chat(template, [{"role": "user", "content": parts}], bos_token=None, eos_token=None)
    assert ours == "[one\ntwo]"


@pytest.mark.parametrize(("template", "message"), [
    ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}",
     "Conversations must start with user"),
    ("{{ messages[0]['content'] + 1 }}", "chat template failed"),
    ("line one\n{% for m in messages %}{{ m }", "chat template line 2"),
    # The sandbox refuses, as a template error: Python internals, and changing the messages.
    ("{{ ''.__class__.__mro__ }}", "chat template failed"),
    ("{{ messages.append(1) }}", "chat template failed: .*append"),
])
def test_template_errors_become_one_line_chat_template_errors(template: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message) as caught:
        render_chat(template, [{"role": "system", "content": "x"}], bos_token=None, eos_token=None)
    assert "\n" not in str(caught.value)
