"""Files that are either fully written or not there at all, and picc's cache of what it derives:
where it lives, entries written whole, and only the most recently used kept."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from picc.errors import PiccError

# Entries kept in each of the cache's folders (the most recently used): enough for the test
# suite's models and a user's few, small enough that a folder stays within some hundreds of MB.
CACHE_ENTRIES = 32


def cache_root() -> Path:
    """Where picc keeps what it derives and can rebuild (trained predictors, the host's measured
    bandwidth, converted tokenizers): ``$PICC_CACHE_DIR``, default ``~/.cache/picc``."""
    return Path(os.environ.get("PICC_CACHE_DIR") or Path.home() / ".cache" / "picc")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success rename it to ``path``, on error delete it."""
    path = Path(path)
    if not path.parent.is_dir():
        raise PiccError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def cached(path: Path) -> Path | None:
    """``path`` if the cache holds it, marked as just used (its mtime, which :func:`prune_cache`
    reads); None if it is not there."""
    if not path.is_file():
        return None
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        path.touch()
    return path


def keep_cached(path: Path, write: Callable[[BinaryIO], object], entries: int = CACHE_ENTRIES) -> None:
    """Put an entry in picc's cache: ``write(f)`` fills a temp file (open for binary writing) that
    becomes ``path`` once complete, then the folder keeps its ``entries`` most recently used entries (files with
    ``path``'s suffix). A cache that cannot be written only costs the next run its time: an
    OSError is ignored (the temp file is gone either way)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            write(f)
        prune_cache(path.parent, f"*{path.suffix}", entries)
    except OSError:
        pass


def prune_cache(folder: Path, pattern: str, entries: int, companions: tuple[str, ...] = ()) -> None:
    """Delete all but the ``entries`` most recently used files of ``folder`` matching
    ``pattern`` (by mtime), each with its ``companions`` (the same name with those suffixes).
    Another process may prune the same folder at the same time: what has gone is skipped."""

    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(folder.glob(pattern), key=used, reverse=True)[entries:]:
        for suffix in (old.suffix, *companions):
            with contextlib.suppress(OSError):
                old.with_suffix(suffix).unlink(missing_ok=True)
