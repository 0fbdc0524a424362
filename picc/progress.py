"""Progress bars for long work, on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int | None, what: str, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)`` (``total=None`` when the amount of work is not known); draws a tqdm
    bar on stderr (disabled when stderr is not a tty)."""
    from tqdm import tqdm

    with tqdm(total=total, desc=what, unit=unit, disable=None, leave=False, dynamic_ncols=True) as bar:
        yield bar.update
