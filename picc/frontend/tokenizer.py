"""picc's tokenizer: a `tokenizers` backend plus the BOS/EOS rules of the model.

The backend (a Hugging Face *fast* tokenizer, i.e. `tokenizer.json`) turns text
into ids without special tokens; `Tokenizer` then adds BOS / EOS itself, exactly
when the model's own tokenizer would. Keeping that rule outside the backend
means one code path serves every source: a `tokenizer.json` whose post-processor
adds BOS, a GGUF whose metadata says `add_bos_token`, or neither.

Serialized form (`to_json`), meant to be readable by a runtime that knows only
the `tokenizers` library:

    {"format": "picc-tokenizer", "version": 1,
     "bos_id": 1, "eos_id": 2, "add_bos": false, "add_eos": false,
     "stop_ids": [2, 7], "sampling": {"temperature": 0.6, "top_k": 20},
     "chat_template": "{% for message in messages %}..." or null,
     "backend": { ...tokenizer.json... }}

`stop_ids` are the tokens that end generation: EOS and any others the model
names (generation_config.json's list of `eos_token_id`s, as transformers'
`generate` stops at each: Llama 3's `<|eot_id|>`, Phi-3's `<|end|>`; a GGUF's
end-of-turn tokens, as llama.cpp finds them). A document without it (it came
after version 1 was fixed) stops at EOS alone. `sampling` holds the sampling
parameters the model's authors recommend (generation_config.json's
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, as vLLM reads
them), which a server takes where a request names none; absent: none.

`chat_template` is the model's Jinja chat template as transformers holds it
(`tokenizer_config.json`, or a GGUF's `tokenizer.chat_template`), so that a
runtime can turn chat messages into the prompt the model was trained on
(`runtime.chat.render_chat`). It came after version 1 was fixed; a document
without it reads as a tokenizer without a template.

Loaders go through `transformers` so that ids match what
`AutoTokenizer.from_pretrained(...)` gives, which the tests check; they never
touch the network. GGUF files of the architectures transformers refuses are
read by `picc.frontend.gguf_vocab` instead, as llama.cpp reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tokenizers

from picc.errors import PiccError
from picc.fsutil import cache_root, cached, keep_cached

FORMAT_NAME = "picc-tokenizer"
FORMAT_VERSION = 1

# Text used to discover which special tokens a transformers tokenizer adds
# around plain text; any text that encodes to at least one token would do.
_PROBE_TEXT = "picc probe"


@dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids for one model.

    `backend_json` is a `tokenizer.json` document (normalized to the backend's
    own serialization, so equal tokenizers compare equal). `encode` prepends
    `bos_id` when `add_bos` and appends `eos_id` when `add_eos`; the backend's
    own post-processor is never applied. `chat_template` is the model's Jinja
    chat template, carried as text and never rendered by the compiler.
    `stop_ids` are the ids that end generation, sorted, EOS among them.
    `sampling` the model's recommended sampling parameters, (name, value) pairs.
    """

    backend_json: str = field(repr=False)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool = False
    chat_template: str | None = field(default=None, repr=False)
    stop_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, float], ...] = ()
    backend: tokenizers.Tokenizer = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            backend = tokenizers.Tokenizer.from_str(self.backend_json)
        except Exception as error:  # tokenizers raises a bare Exception
            raise PiccError(f"invalid tokenizer.json document: {_first_line(error)}") from error
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "backend_json", backend.to_str())
        vocab_size = self.vocab_size
        stops = tuple(sorted(set(self.stop_ids) | ({self.eos_id} if self.eos_id is not None else set())))
        object.__setattr__(self, "stop_ids", stops)
        for name, token_id in [("bos_id", self.bos_id), ("eos_id", self.eos_id), *(("stop id", t) for t in stops)]:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise PiccError(f"tokenizer {name} {token_id} is outside the vocabulary of {vocab_size}")
        if self.add_bos and self.bos_id is None:
            raise PiccError("tokenizer says to add BOS but has no BOS token")
        if self.add_eos and self.eos_id is None:
            raise PiccError("tokenizer says to add EOS but has no EOS token")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise PiccError(f"tokenizer chat_template must be text, got {type(self.chat_template).__name__}")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS / EOS added as the model's tokenizer does."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids.insert(0, self.bos_id)
        if self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens such as `<|im_end|>` are kept unless skipped."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (as spelled in the vocabulary), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of an id, or None if out of range."""
        return self.backend.id_to_token(token_id)

    def to_json(self) -> str:
        """The serialized form described in the module docstring."""
        document = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "stop_ids": list(self.stop_ids),
            "sampling": dict(self.sampling),
            "chat_template": self.chat_template,
            "backend": json.loads(self.backend_json),
        }
        return json.dumps(document, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        """Inverse of `to_json`."""
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise PiccError(f"picc tokenizer is not valid JSON: {error}") from error
        if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
            raise PiccError(f'picc tokenizer JSON lacks "format": "{FORMAT_NAME}"')
        if document.get("version") != FORMAT_VERSION:
            raise PiccError(f"picc tokenizer JSON has version {document.get('version')!r}, expected {FORMAT_VERSION}")
        try:
            return cls(
                backend_json=json.dumps(document["backend"], ensure_ascii=False),
                bos_id=_optional_int(document["bos_id"]),
                eos_id=_optional_int(document["eos_id"]),
                add_bos=bool(document["add_bos"]),
                add_eos=bool(document["add_eos"]),
                chat_template=document.get("chat_template"),
                stop_ids=tuple(_optional_int(t) for t in document.get("stop_ids", ())),
                sampling=tuple((str(k), float(v)) for k, v in (document.get("sampling") or {}).items()),
            )
        except (KeyError, TypeError) as error:
            raise PiccError(f"picc tokenizer JSON is missing or mistypes {error}") from error


def tokenizer_from_hf_dir(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory.

    Anything `AutoTokenizer` can load offline works (`tokenizer.json`, or slow
    tokenizer files it can convert to a fast one).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise PiccError(f"{directory}: expected a Hugging Face model directory")
    with _transformers_offline() as transformers:
        try:
            hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise PiccError(
                f"{directory}: expected tokenizer files transformers can load "
                f"(tokenizer.json, tokenizer.model, ...): {_first_line(error)}"
            ) from error
    tokenizer = _from_transformers(hf_tokenizer, source=directory)
    return replace(tokenizer, stop_ids=hf_stop_ids(directory), sampling=hf_sampling(directory))


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""What vLLM takes from generation_config.json as a request's defaults."""


def hf_sampling(directory: Path) -> tuple[tuple[str, float], ...]:
    """generation_config.json's :data:`SAMPLING_KEYS` (those it has), checked as a request's are."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    from picc.frontend.hf_config import HFConfig

    raw = HFConfig.read_json(path).raw
    return checked_sampling({k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None}, path)


def checked_sampling(found: dict[str, object], source: Path) -> tuple[tuple[str, float], ...]:
    """A model's recommended sampling parameters (``found``, by :data:`SAMPLING_KEYS`' names, read
    from ``source``) as :attr:`Tokenizer.sampling` holds them, checked as a request's are."""
    from runtime.sampling import SamplingOptions

    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in found.values()):
        raise PiccError(f"{source}: {', '.join(found)} must be numbers, got {json.dumps(found)}")
    numbers = {k: float(v) for k, v in found.items()}  # type: ignore[arg-type] - checked above
    if numbers.get("top_k", 0) != int(numbers.get("top_k", 0)):
        raise PiccError(f"{source}: top_k must be a whole number, got {found['top_k']}")
    try:  # the keys are SamplingOptions' own names
        SamplingOptions(**{k: int(v) if k == "top_k" else v for k, v in numbers.items()}).check()
    except ValueError as e:
        raise PiccError(f"{source}: {e}") from None
    return tuple(numbers.items())


def hf_stop_ids(directory: Path) -> tuple[int, ...]:
    """The EOS ids ``generate`` stops at: generation_config.json's ``eos_token_id`` (a list
    in most chat models), else config.json's, else an ONNX export's genai_config.json's."""
    from picc.frontend.hf_config import HFConfig

    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            ids = HFConfig.read_json(directory / name).token_ids("eos_token_id")
            if ids:
                return ids
    genai = directory / "genai_config.json"
    if genai.is_file():
        try:
            model = json.loads(genai.read_text())["model"]
            ids = model.get("eos_token_id")
            return tuple(_optional_int(t) for t in (ids if isinstance(ids, list) else [ids]) if t is not None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PiccError(f"{genai}: not a readable genai config ({type(e).__name__}: {e})") from None
    return ()


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer embedded in a GGUF file's `tokenizer.ggml.*` metadata.

    Built by transformers' GGUF conversion, which supports `tokenizer.ggml.model`
    "gpt2" (byte-level BPE, as in SmolLM2 and Llama 3), "llama" (sentencepiece)
    and "t5"; its BOS rule comes from `tokenizer.ggml.add_bos_token`. Files of the
    architectures transformers refuses (`gguf_vocab.OWN_VOCAB_ARCHS`: DeepSeek,
    GLM-4.5, Granite, OLMo 2, ERNIE 4.5) are built by `picc.frontend.gguf_vocab`
    instead, as llama.cpp reads them. The conversion reads the whole vocabulary
    through Python (~15 s for SmolLM2's 49k tokens), so its result is cached
    (`$PICC_CACHE_DIR/tokenizers`), keyed by the file's path, size and
    modification time and the transformers version.
    """
    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise PiccError(f"{gguf_path}: expected a GGUF file")
    entry = _gguf_cache_path(gguf_path)
    if cached(entry) is not None:
        try:
            return Tokenizer.from_json(entry.read_text(encoding="utf-8"))
        except (OSError, PiccError):
            pass  # a damaged entry is rebuilt, not trusted
    tokenizer = _convert_gguf_tokenizer(gguf_path)
    keep_cached(entry, lambda f: f.write(tokenizer.to_json().encode("utf-8")))
    return tokenizer


def _gguf_cache_path(gguf_path: Path) -> Path:
    from importlib.metadata import version

    stat = gguf_path.stat()
    # "chat_template": entries written before the template was kept lack it, so they are not reused.
    key = json.dumps([str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns, version("transformers"),
                      FORMAT_VERSION, "chat_template"])
    return cache_root() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _convert_gguf_tokenizer(gguf_path: Path) -> Tokenizer:
    from picc.frontend.gguf_file import GgufFile
    from picc.frontend.gguf_vocab import OWN_VOCAB_ARCHS, tokenizer_from_metadata

    try:
        file = GgufFile(gguf_path)
    except (OSError, ValueError):  # not a GGUF file: transformers says so, in the error below
        file = None
    if file is not None and file.get("general.architecture") in OWN_VOCAB_ARCHS:
        return tokenizer_from_metadata(file.get, gguf_path)
    with _transformers_offline() as transformers, _readable_by_transformers(gguf_path) as readable:
        try:
            hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(readable.parent), gguf_file=readable.name, local_files_only=True
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise PiccError(
                f"{gguf_path}: expected a GGUF file with a supported tokenizer "
                f"(tokenizer.ggml.model gpt2, llama or t5): {_first_line(error)}"
            ) from error
    return _from_transformers(hf_tokenizer, source=gguf_path)


@contextlib.contextmanager
def _readable_by_transformers(gguf_path: Path) -> Iterator[Path]:
    """``gguf_path``, or for a ``gpt-oss`` file a copy of its metadata without its
    ``rope.scaling`` keys and without tensors: transformers (5.24) reads each of those keys' name
    length as its value and fails on every gpt-oss file llama.cpp's converter writes."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
        arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    except (OSError, ValueError):  # not a GGUF file: transformers says so, in the caller's error
        arch = None
    if arch != "gpt-oss":
        yield gguf_path
        return
    with tempfile.TemporaryDirectory(prefix="picc-gguf-") as tmp:
        copy = Path(tmp) / gguf_path.name
        writer = gguf.GGUFWriter(copy, arch)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture" \
                    or field.name.startswith(f"{arch}.rope.scaling."):
                continue
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        yield copy


def _from_transformers(hf_tokenizer: Any, source: Path) -> Tokenizer:
    """Wrap a loaded transformers tokenizer, learning its BOS / EOS rule by probing."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise PiccError(
            f"{source}: expected a tokenizer with a fast (tokenizers) backend, got {type(hf_tokenizer).__name__}"
        )
    bos_id, eos_id = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id
    plain = backend.encode(_PROBE_TEXT, add_special_tokens=False).ids
    full = list(hf_tokenizer.encode(_PROBE_TEXT))
    for add_bos, add_eos in (
        (False, False),
        (True, False),
        (False, True),
        (True, True),
    ):
        if (add_bos and bos_id is None) or (add_eos and eos_id is None):
            continue
        if full == ([bos_id] if add_bos else []) + plain + ([eos_id] if add_eos else []):
            break
    else:
        raise PiccError(
            f"{source}: tokenizer adds special tokens picc cannot reproduce "
            f"(ids {full} for text whose plain ids are {plain})"
        )
    return Tokenizer(
        backend_json=backend.to_str(),
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=_default_chat_template(hf_tokenizer),
    )


def _default_chat_template(hf_tokenizer: Any) -> str | None:
    """The template `apply_chat_template` uses when given none: the only one, or the one named
    "default" when the model names several (tokenizer_config.json may list e.g. "tool_use")."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


@contextlib.contextmanager
def _transformers_offline() -> Iterator[Any]:
    """Import transformers with the Hugging Face hub switched offline.

    huggingface_hub reads HF_HUB_OFFLINE when first imported, so the variables
    are set before the import and put back afterwards; `local_files_only=True`
    at each call covers the case where it was imported earlier.
    """
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "1" for name in names})
    try:
        import transformers

        yield transformers
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"token id {value!r}")
    return value


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
