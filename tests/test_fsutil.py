"""picc's cache folders: entries written whole or not at all, and only the most recently used kept."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from picc.fsutil import cached, keep_cached, prune_cache


def _entries(folder: Path, count: int, suffix: str = ".npz") -> list[Path]:
    """``count`` entries, the first the least recently used (mtimes an hour apart, in the past)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"{i:02d}{suffix}"
        path.write_text(str(i))
        stamp = time.time() - 3600 * (count - i + 1)
        os.utime(path, (stamp, stamp))
        paths.append(path)
    return paths


def test_a_new_entry_pushes_out_the_least_recently_used_ones(tmp_path):
    old = _entries(tmp_path / "kind", 5)
    assert cached(old[0]) == old[0]  # read now: the most recently used of the old ones
    keep_cached(tmp_path / "kind" / "new.npz", lambda f: f.write(b"new"), entries=3)
    kept = sorted(p.name for p in (tmp_path / "kind").iterdir())
    assert kept == ["00.npz", "04.npz", "new.npz"]
    assert (tmp_path / "kind" / "new.npz").read_text() == "new"


def test_pruning_counts_only_the_entries_own_kind(tmp_path):
    folder = tmp_path / "kind"
    _entries(folder, 3, ".json")
    (folder / "notes.txt").write_text("not an entry")
    keep_cached(folder / "new.json", lambda f: f.write(b"{}"), entries=2)
    assert sorted(p.name for p in folder.iterdir()) == ["02.json", "new.json", "notes.txt"]


def test_an_entry_goes_with_its_companions(tmp_path):
    folder = tmp_path / "objects"
    for path in _entries(folder, 3, ".sha256"):
        for suffix in (".o", ".ll"):
            path.with_suffix(suffix).write_text("part")
    prune_cache(folder, "*.sha256", 1, companions=(".o", ".ll"))
    assert sorted(p.name for p in folder.iterdir()) == ["02.ll", "02.o", "02.sha256"]


def test_a_missing_entry_is_not_cached(tmp_path):
    assert cached(tmp_path / "absent.npz") is None
    (tmp_path / "folder.npz").mkdir()
    assert cached(tmp_path / "folder.npz") is None


def test_an_unwritable_cache_is_ignored(tmp_path):
    (tmp_path / "kind").write_text("a file where the cache's folder should be")
    keep_cached(tmp_path / "kind" / "entry.npz", lambda f: f.write(b"x"))
    assert (tmp_path / "kind").is_file()


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "kind"
    old = _entries(folder, 2)

    def write(f: BinaryIO) -> None:
        f.write(b"half of an entry")
        raise OSError("disk full")

    keep_cached(folder / "new.npz", write, entries=1)
    assert sorted(folder.iterdir()) == old  # no entry, no temp file, and nothing pruned for it


def test_other_errors_of_the_writer_are_not_swallowed(tmp_path):
    def write(f: BinaryIO) -> None:
        raise ValueError("a bug in the caller")

    with pytest.raises(ValueError, match="a bug"):
        keep_cached(tmp_path / "kind" / "new.npz", write)
    assert list((tmp_path / "kind").iterdir()) == []
