"""picc.frontend.tokenizer against transformers' own tokenizers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import models, processors

from picc.errors import PiccError
from picc.frontend import tokenizer as tokenizer_module
from picc.frontend.aliases import resolve_alias
from picc.frontend.tokenizer import (
    Tokenizer,
    tokenizer_from_gguf,
    tokenizer_from_hf_dir,
)

SAMPLES = [
    "Hello world",
    "",
    " leading space, then  two  spaces and a tab\tand\n\nnewlines\r\n",
    "Numbers 12345 and 3.14159, 1e-9; code: `x = f(a, b)  # ok`",
    "héllo wörld, naïve café, Ελληνικά, русский",
    "你好，世界。日本語のテキスト。한국어",
    "emoji 🎉👍🏽 and combining e\u0301 and zero\u200bwidth",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>special tokens glued<|im_end|>to text",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_alias("smollm2")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' tokenizer for the GGUF: the behaviour picc must reproduce."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)


@pytest.fixture(scope="module")
def smollm2(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Converted from the GGUF here (an empty cache), not read from an earlier conversion."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICC_CACHE_DIR", str(tmp_path_factory.mktemp("tokenizer_cache")))
        return tokenizer_from_gguf(gguf_path)


def test_gguf_tokenizer_is_cached_per_file_state(smollm2: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The conversion (stubbed here with its result) runs once per file state: a second load reads
    # the cache; a file with another modification time, or a damaged entry, is converted again.
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    conversions: list[Path] = []
    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", lambda p: conversions.append(p) or smollm2)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF stand-in")
    assert tokenizer_from_gguf(model) == smollm2 and len(conversions) == 1
    assert tokenizer_from_gguf(model) == smollm2 and len(conversions) == 1
    os.utime(model, ns=(1, 1))
    assert tokenizer_from_gguf(model) == smollm2 and len(conversions) == 2
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2  # one entry per file state
    entry = tokenizer_module._gguf_cache_path(model)
    entry.write_text("{not json")
    assert tokenizer_from_gguf(model) == smollm2 and len(conversions) == 3
    assert Tokenizer.from_json(entry.read_text()) == smollm2  # rewritten whole


def test_gguf_encode_matches_transformers(smollm2: Tokenizer, reference: Any) -> None:
    for text in SAMPLES:
        assert smollm2.encode(text) == reference(text)["input_ids"], text
    # Special tokens in the text stay whole instead of being split into bytes.
    assert smollm2.encode("<|im_start|>") == [1]


def test_gguf_special_tokens_and_bos_rule(smollm2: Tokenizer) -> None:
    # SmolLM2's GGUF: bos 1 = <|im_start|>, eos 2 = <|im_end|>, add_bos_token false.
    assert (smollm2.bos_id, smollm2.eos_id) == (1, 2)
    assert smollm2.id_to_token(1) == "<|im_start|>"
    assert smollm2.id_to_token(2) == "<|im_end|>"
    assert smollm2.add_bos is False and smollm2.add_eos is False
    assert smollm2.encode("Hello")[0] != smollm2.bos_id
    assert smollm2.vocab_size == 49152


def test_decode_round_trips_and_matches_transformers(smollm2: Tokenizer, reference: Any) -> None:
    for text in SAMPLES:
        ids = smollm2.encode(text)
        # Byte-level BPE is lossless, special tokens included.
        assert smollm2.decode(ids) == text
        assert smollm2.decode(ids) == reference.decode(ids)
    ids = smollm2.encode("<|im_start|>hi<|im_end|>")
    assert smollm2.decode(ids, skip_special_tokens=True) == "hi"


def test_json_round_trip(smollm2: Tokenizer) -> None:
    text = smollm2.to_json()
    document = json.loads(text)
    assert document["format"] == "picc-tokenizer" and document["version"] == 1
    assert (document["bos_id"], document["eos_id"], document["add_bos"]) == (1, 2, False)

    restored = Tokenizer.from_json(text)
    assert restored == smollm2
    for sample in SAMPLES:
        assert restored.encode(sample) == smollm2.encode(sample)

    # A runtime that only has the tokenizers library can use the backend as is.
    backend = tokenizers.Tokenizer.from_str(json.dumps(document["backend"]))
    assert backend.encode(SAMPLES[4], add_special_tokens=False).ids == smollm2.encode(SAMPLES[4])


def test_from_json_rejects_other_documents(smollm2: Tokenizer) -> None:
    with pytest.raises(PiccError, match="not valid JSON"):
        Tokenizer.from_json("{")
    with pytest.raises(PiccError, match="format"):
        Tokenizer.from_json(json.dumps({"model": {}}))
    document = json.loads(smollm2.to_json())
    document["bos_id"] = 10**6
    with pytest.raises(PiccError, match="outside the vocabulary"):
        Tokenizer.from_json(json.dumps(document))
    del document["add_bos"]
    with pytest.raises(PiccError, match="add_bos"):
        Tokenizer.from_json(json.dumps(document))


def test_hf_dir_saved_from_gguf_matches(smollm2: Tokenizer, reference: Any, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    loaded = tokenizer_from_hf_dir(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.add_bos) == (1, 2, False)
    for text in SAMPLES:
        assert loaded.encode(text) == smollm2.encode(text), text


def write_tiny_hf_dir(directory: Path) -> None:
    """A byte-free toy BPE whose tokenizer.json post-processor prepends <s>,
    like Llama 2's: picc must learn that BOS rule from transformers."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {char: len(vocab) + i for i, char in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    vocab["ab"] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_dir_whose_tokenizer_adds_bos(tmp_path: Path) -> None:
    write_tiny_hf_dir(tmp_path)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    loaded = tokenizer_from_hf_dir(tmp_path)
    assert loaded.add_bos is True and loaded.bos_id == 1
    for text in ("abc ab", "", "zz", "ab?"):
        assert loaded.encode(text) == reference(text)["input_ids"], text
    assert loaded.encode("abc") == [1, vocab_id(loaded, "ab"), vocab_id(loaded, "c")]
    assert Tokenizer.from_json(loaded.to_json()).encode("abc") == loaded.encode("abc")


def test_hf_dir_stops_at_every_eos_that_generate_stops_at(tmp_path: Path) -> None:
    # transformers' generate stops at each id of generation_config.json's eos_token_id (Llama 3
    # Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>; Phi-3: <|endoftext|>, <|end|>), else at
    # config.json's; the tokenizer's EOS ends a reply too.
    from transformers import GenerationConfig

    write_tiny_hf_dir(tmp_path)
    assert tokenizer_from_hf_dir(tmp_path).stop_ids == (2,)  # no config: the tokenizer's EOS
    ab = vocab_id(tokenizer_from_hf_dir(tmp_path), "ab")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert tokenizer_from_hf_dir(tmp_path).stop_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ab, 0]}))
    loaded = tokenizer_from_hf_dir(tmp_path)
    assert set(GenerationConfig.from_pretrained(tmp_path).eos_token_id) < set(loaded.stop_ids)
    assert loaded.stop_ids == tuple(sorted({0, 2, ab}))  # generation_config's list, and EOS 2
    assert Tokenizer.from_json(loaded.to_json()) == loaded
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(PiccError, match="eos_token_id"):
        tokenizer_from_hf_dir(tmp_path)


def test_hf_dir_carries_the_sampling_its_generation_config_recommends(tmp_path: Path) -> None:
    # generation_config.json's temperature, top_p, top_k, min_p and repetition_penalty (what vLLM
    # takes as a request's defaults): kept as given, checked as a request's are.
    from runtime.text import TextCodec

    write_tiny_hf_dir(tmp_path)
    assert tokenizer_from_hf_dir(tmp_path).sampling == ()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 9}))
    loaded = tokenizer_from_hf_dir(tmp_path)
    assert loaded.sampling == (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20.0))
    assert TextCodec(loaded.to_json()).sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0}
    assert Tokenizer.from_json(loaded.to_json()) == loaded
    for bad, message in (({"top_p": 1.5}, r"top-p must be in \(0, 1\]"), ({"top_k": 2.5}, "top_k must be a whole"),
                         ({"temperature": "hot"}, "must be numbers")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(PiccError, match=message):
            tokenizer_from_hf_dir(tmp_path)


def test_a_document_without_stop_ids_stops_at_eos(smollm2: Tokenizer) -> None:
    # Documents written before stop_ids (version 1 all the same) stop at EOS alone, in the
    # compiler and in the runtime; stop ids outside the vocabulary are refused.
    from runtime.text import TextCodec

    document = json.loads(smollm2.to_json())
    assert document["stop_ids"] == list(smollm2.stop_ids) and smollm2.eos_id in smollm2.stop_ids
    assert TextCodec(json.dumps(document)).stop_ids == frozenset(smollm2.stop_ids)
    del document["stop_ids"]
    assert Tokenizer.from_json(json.dumps(document)).stop_ids == (smollm2.eos_id,)
    assert TextCodec(json.dumps(document)).stop_ids == {smollm2.eos_id}
    document["stop_ids"] = [2, 10**6]
    with pytest.raises(PiccError, match="stop id 1000000 is outside the vocabulary"):
        Tokenizer.from_json(json.dumps(document))


def test_a_gguf_stops_where_llama_cpp_ends_generation(smollm2: Tokenizer, gguf_path: Path) -> None:
    # GGUF metadata names EOS and seldom the end of a turn: llama.cpp also ends generation at the
    # vocabulary's end-of-turn tokens by their text (SmolLM2's <|endoftext|> beside its EOS
    # <|im_end|>), and at tokenizer.ggml.eot_token_id / eom_token_id where a file has them.
    from picc.frontend.gguf import END_OF_TURN, _end_of_generation, _Meta
    from picc.frontend.gguf_file import GgufFile

    meta = _Meta(GgufFile(gguf_path), gguf_path)
    spelled = {smollm2.id_to_token(t) for t in _end_of_generation(meta, smollm2)}
    assert spelled == {"<|im_end|>", "<|endoftext|>"} and smollm2.id_to_token(smollm2.eos_id) == "<|im_end|>"
    assert {t for t in spelled if t in END_OF_TURN} == spelled

    class Named:  # a file that names its end-of-turn and end-of-message tokens
        def get(self, key: str) -> object:
            return {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 40,
                    "tokenizer.ggml.eom_token_id": 41}.get(key)

    end_of_text = smollm2.token_to_id("<|endoftext|>")
    assert set(_end_of_generation(Named(), smollm2)) == {end_of_text, 2, 40, 41}  # type: ignore[arg-type]


def test_a_gguf_recommends_the_sampling_llama_cpp_takes_as_its_defaults(gguf_path: Path) -> None:
    # general.sampling.temp, top_p, top_k and min_p (llama.cpp's defaults where a user sets none)
    # become the tokenizer's sampling, as generation_config.json's do; float32 values as the
    # decimals written; penalty_repeat is left out (llama.cpp's looks back 64 tokens only). SmolLM2's
    # file names none; a value no request could carry is refused, naming the file.
    import numpy as np

    from picc.frontend.gguf import _Meta, _sampling
    from picc.frontend.gguf_file import GgufFile

    assert _sampling(_Meta(GgufFile(gguf_path), gguf_path), gguf_path) == ()

    class Recommending:
        def __init__(self, **values: object) -> None:
            self.values = {f"general.sampling.{k}": v for k, v in values.items()}

        def get(self, key: str) -> object:
            return self.values.get(key)

    meta = Recommending(temp=float(np.float32(0.6)), top_p=np.float32(0.95), top_k=20, min_p=0.0, penalty_repeat=1.1)
    assert _sampling(meta, gguf_path) == (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20.0),  # type: ignore[arg-type]
                                          ("min_p", 0.0))
    with pytest.raises(PiccError, match=r"\.gguf: top-p must be in \(0, 1\], got 1\.5$"):
        _sampling(Recommending(top_p=1.5), gguf_path)  # type: ignore[arg-type]


def vocab_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None
    return token_id


def test_loader_errors_name_the_file(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf at all")
    for load, path in [
        (tokenizer_from_gguf, tmp_path / "missing.gguf"),
        (tokenizer_from_gguf, not_gguf),
        (tokenizer_from_hf_dir, tmp_path / "missing"),
        (tokenizer_from_hf_dir, tmp_path),  # a directory without tokenizer files
    ]:
        with pytest.raises(PiccError) as caught:
            load(path)
        message = str(caught.value)
        assert str(path) in message and "\n" not in message, message
