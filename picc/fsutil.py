"""Files that are either fully written or not there at all, and where picc caches what it derives."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from picc.errors import PiccError


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
