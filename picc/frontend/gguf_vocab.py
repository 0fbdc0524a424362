"""A GGUF file's tokenizer built from its own ``tokenizer.ggml.*`` metadata, as llama.cpp builds it.

picc reads most GGUF tokenizers through transformers' conversion (``picc.frontend.tokenizer``),
which (5.24) refuses every file of an architecture it does not load: :data:`OWN_VOCAB_ARCHS`. For
those this module builds the ``tokenizers.Tokenizer`` the file describes, from llama.cpp's reading
of the keys (src/llama-vocab.cpp, ``llama_vocab::impl::load`` and ``tokenize``):

- ``tokenizer.ggml.model`` "gpt2": byte-level BPE. ``tokens`` are the vocabulary in GPT-2's byte
  alphabet, ``merges`` ranked in file order; ``tokenizer.ggml.pre`` names the pre-tokenizer, the
  regexes llama.cpp splits the text with one after another, each match and each gap between matches
  a piece (transformers' ``Split(..., "isolated")``), before the pieces' bytes are spelled in the
  alphabet (``ByteLevel`` without its own regex). :data:`PRE_TOKENIZERS` holds the pre types of the
  released files of those architectures (DeepSeek V2 ``deepseek-llm``, V3 and R1 ``deepseek-v3``,
  Kimi K2 ``kimi-k2``, GLM-4.5 and 4.7-Flash ``glm4``, Granite 3 ``refact``, OLMo 2 ``dbrx``) and of
  the common families; another is refused by name.
- "llama": SentencePiece's BPE. Pieces are merged by the ``scores`` of what they make (the best
  first), characters no piece covers fall back to the ``<0xXX>`` byte tokens, spaces are ``▁``,
  and with ``add_space_prefix`` (default true) each stretch of text between special tokens starts
  with one (each such stretch is normalized apart, ``Prepend("▁")`` then ``Replace(" ", "▁")``).

Tokens of type control (3), user-defined (4) and unknown (2) are matched whole in the text before
anything else (llama.cpp's ``tokenizer_st_partition``, which picc runs with ``parse_special``);
control and unknown ones are special (``decode(skip_special_tokens=True)`` drops them). BOS and EOS
are the ``*_token_id`` keys, ``add_bos_token`` / ``add_eos_token`` whether ``Tokenizer.encode``
adds them, each with llama.cpp's default where the file has none (BPE: BOS = EOS = 11, BOS added
for the ``llama3`` types only, no BOS at all for ``glm4``; SentencePiece: 1 and 2, BOS added).
Decoding is lossless: llama.cpp's ``clean_up_tokenization_spaces`` is not applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from picc.errors import PiccError
from picc.frontend.tokenizer import Tokenizer, _first_line

OWN_VOCAB_ARCHS = frozenset({"deepseek2", "glm4moe", "granite", "granitemoe", "olmo2", "ernie4_5", "ernie4_5-moe"})
"""The architectures of picc's GGUF frontend whose files transformers (5.24) will not read a
tokenizer from (``GGUF model with architecture ... is not supported yet``)."""

Metadata = Callable[[str], object]  # a GGUF metadata key -> its value (a list for an array), None if absent

# Token types as llama.cpp's converter writes them (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes of llama.cpp's llm_tokenizer_bpe, by its LLAMA_VOCAB_PRE_TYPE_*. Where llama.cpp
# rewrote a model's pattern for std::regex it says so, and the rewriting matches what the model's
# own pattern matches ((?i:'s|'t..) as (?:'[sS]|'[tT]..)); GPT-4o's and Kimi K2's are the models'
# own (llama.cpp runs an approximation of the first and hand-written code for the second).
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
           "|\\s+(?!\\S)|\\s+")
_QWEN2 = _LLAMA3.replace("\\p{N}{1,3}", "\\p{N}")
_UPPER, _LOWER = "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]", "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
_SUFFIX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_TAIL = "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_GPT4O = (f"[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}*{_LOWER}+{_SUFFIX}|[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}+{_LOWER}*{_SUFFIX}"
          + _O200K_TAIL)
# tokenization_kimi.py's pat_str: o200k's, but Han characters are a piece of their own and "/" ends no piece
_HAN_APART = [c[:-1] + "&&[^\\p{Han}]]" for c in (_UPPER, _LOWER)]
_KIMI_K2 = (f"[\\p{{Han}}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?{_HAN_APART[0]}*{_HAN_APART[1]}+{_SUFFIX}"
            f"|[^\\r\\n\\p{{L}}\\p{{N}}]?{_HAN_APART[0]}+{_HAN_APART[1]}*{_SUFFIX}" + _O200K_TAIL.replace("/", ""))
_DEEPSEEK3 = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _DEEPSEEK_CJK,
    "\\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _DEEPSEEK_CJK, "\\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's BPE pre-tokenizers: ``splits`` applied in turn (matches and gaps kept),
    and the flags llama.cpp sets with it: ``ignore_merges`` (a piece that is a token is taken
    whole), ``add_bos`` (BOS is added where the file does not say), ``bos`` (a default BOS id)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    bos: bool = True


_LLAMA3_TYPE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), _LLAMA3_TYPE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),  # OLMo 2's
    # GLM-4.5's and 4.7-Flash's; their tokenizer.json takes a whole piece that is a token (as llama.cpp
    # since its fix for " \u738b"), GLM-4-9B's (chatglm-bpe) does not
    "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True, bos=False),
    "chatglm-bpe": PreTokenizer((_LLAMA3,), bos=False),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), PreTokenizer((_QWEN2,))),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizer((_GPT4O,))),
    "deepseek-v3": PreTokenizer(_DEEPSEEK3),  # DeepSeek V3's, R1's
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),  # DeepSeek V2's
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER),
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    **dict.fromkeys(("refact", "starcoder", "smollm"), PreTokenizer(("\\p{N}", _GPT2))),  # Granite 3's
    **dict.fromkeys(("gpt-2", "gigachat"), PreTokenizer((_GPT2,))),
}
"""llama.cpp's ``tokenizer.ggml.pre`` names picc builds, by what llama.cpp maps each to."""


def tokenizer_from_metadata(get: Metadata, source: Path) -> Tokenizer:
    """The tokenizer of the GGUF metadata ``get`` reads (of the file ``source``, named in errors)."""
    kind = get("tokenizer.ggml.model")
    tokens = _strings(get, "tokenizer.ggml.tokens", source)
    # llama.cpp names an empty token by its id, and refuses a file that spells two tokens alike
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    seen: set[str] = set()
    for token in tokens:
        if token in seen:
            raise PiccError(f"{source}: tokenizer.ggml.tokens spells {token!r} twice")
        seen.add(token)
    types = get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) < len(tokens):
        raise PiccError(f"{source}: tokenizer.ggml.token_type must give each of the {len(tokens)} tokens a type")
    if kind == "gpt2":
        pre = _pre_tokenizer(get("tokenizer.ggml.pre"), source)
        backend = _byte_level(tokens, _strings(get, "tokenizer.ggml.merges", source), pre, source)
        default_ids, add_bos = ((11, 11) if pre.bos else (None, 11)), pre.add_bos
    elif kind == "llama":
        scores = get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) < len(tokens):
            raise PiccError(f"{source}: tokenizer.ggml.scores must give each of the {len(tokens)} tokens a score")
        add_prefix = get("tokenizer.ggml.add_space_prefix")
        unknown = _token_id(get, "unknown", 0, len(tokens), source)
        backend = _sentencepiece(tokens, [float(s) for s in scores], unknown, add_prefix is not False)
        default_ids, add_bos = (1, 2), True
    else:
        raise PiccError(f"{source}: tokenizer.ggml.model {kind!r} is not supported for this architecture "
                        "(supported: gpt2, llama)")
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False)
                if k in (CONTROL, UNKNOWN)]
    added = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=False)
             if k == USER_DEFINED]
    backend.add_special_tokens(specials)
    backend.add_tokens(added)
    bos = _token_id(get, "bos", default_ids[0], len(tokens), source)
    eos = _token_id(get, "eos", default_ids[1], len(tokens), source)
    add_bos = _flag(get, "tokenizer.ggml.add_bos_token", add_bos, source)
    add_eos = _flag(get, "tokenizer.ggml.add_eos_token", False, source)
    if add_bos and bos is None:
        raise PiccError(f"{source}: tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
    template = get("tokenizer.chat_template")
    return Tokenizer(backend_json=backend.to_str(), bos_id=bos, eos_id=eos, add_bos=add_bos, add_eos=add_eos,
                     chat_template=template if isinstance(template, str) else None)


def _pre_tokenizer(name: object, source: Path) -> PreTokenizer:
    if name not in PRE_TOKENIZERS:
        said = "names none" if name is None else f"is {name!r}"
        raise PiccError(f"{source}: tokenizer.ggml.pre {said}, not a pre-tokenizer picc knows "
                        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[name]  # type: ignore[index] - checked above


def _byte_level(tokens: list[str], merges: list[str], pre: PreTokenizer, source: Path) -> tokenizers.Tokenizer:
    """Byte-level BPE over ``tokens`` with ``merges`` ("left right", cut at the first space after the
    first character, as llama.cpp cuts them), splitting the text as ``pre`` says."""
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        pairs.append((merge[:cut], merge[cut + 1:]) if cut > 0 else (merge, ""))
    try:
        model = models.BPE({t: i for i, t in enumerate(tokens)}, pairs, ignore_merges=pre.ignore_merges)
    except Exception as error:  # tokenizers raises a bare Exception
        raise PiccError(f"{source}: tokenizer.ggml.merges do not fit the tokens: {_first_line(error)}") from None
    backend = tokenizers.Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], scores: list[float], unknown: int | None,
                   add_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as llama.cpp runs it (``llm_tokenizer_spm``): two neighbours whose text
    is a token are merged, the best-scoring such token first; the merges a BPE model needs are every
    way to cut each token into two tokens, ranked by that token's score (ties: lower id first)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-scores[i], i, cut) for i, t in enumerate(tokens) for cut in range(1, len(t))
                    if t[:cut] in ids and t[cut:] in ids)
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    model = models.BPE(ids, merges, unk_token=tokens[unknown] if unknown is not None else None,
                       fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    # a normalizer, not Metaspace: llama.cpp prepends the space to text that starts with one too
    spaces = [normalizers.Replace(" ", "\u2581")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if add_prefix else []) + spaces)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return backend


def _strings(get: Metadata, key: str, source: Path) -> list[str]:
    value = get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PiccError(f"{source}: {key} must be an array of strings, got {type(value).__name__}")
    return value


def _token_id(get: Metadata, name: str, default: int | None, n_tokens: int, source: Path) -> int | None:
    """``tokenizer.ggml.{name}_token_id``, else ``default`` (None where outside the vocabulary)."""
    value = get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return default if default is not None and default < n_tokens else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tokens:
        raise PiccError(f"{source}: tokenizer.ggml.{name}_token_id must be a token id below {n_tokens}, got {value!r}")
    return value


def _flag(get: Metadata, key: str, default: bool, source: Path) -> bool:
    value = get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PiccError(f"{source}: {key} must be true or false, got {value!r}")
    return value
