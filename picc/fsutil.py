"""Files that are either fully written or not there at all, and picc's cache of what it derives:
where it lives, entries written whole, and only the most recently used kept."""

from __future__ import annotations

import contextlib
import errno
import functools
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


# Errors of writing a file that say nothing about the program: the disk, the quota, the mount
# (a refused permission is one where it names the file written).
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def writable(path: Path | str, *, directory: bool = False) -> Path:
    """``path`` as a Path once it is known that it can be written, before any work is done for it:
    a file (its folder exists and may be written, and it is not itself a folder) or, with
    ``directory``, a folder to create or fill. A ``PiccError`` saying what is wrong otherwise."""
    path = Path(path)
    if not str(path) or not path.name:
        raise PiccError(f"{str(path)!r}: expected a {'directory' if directory else 'file'} name")
    if directory:
        if path.exists() and not path.is_dir():
            raise PiccError(f"{path}: exists and is not a directory")
        parent = path
        while not parent.exists():  # the folder is made with its parents
            parent = parent.parent
        if not parent.is_dir():
            raise PiccError(f"{path}: {parent} is not a directory")
    else:
        if path.is_dir():
            raise PiccError(f"{path}: is a directory")
        parent = path.parent
        if not parent.is_dir():
            what = "is not a directory" if parent.exists() else "does not exist"
            raise PiccError(f"{path}: directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PiccError(f"cannot write {path}: {parent} is not writable")
    return path


@functools.cache
def _file_mode() -> int:
    """The mode a new file gets under this process's umask (``mkstemp`` makes its files 0600)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return 0o666 & ~int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success rename it to ``path`` (with the mode a new
    file gets under the umask), on error delete it. A write that fails for the disk's sake (full,
    read-only, not permitted) is a ``PiccError`` naming ``path``."""
    path = writable(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise PiccError(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno in _WRITE_ERRORS or e.filename in (tmp, str(path)):
            raise PiccError(f"cannot write {path}: {e.strerror or e}") from None
        raise
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
