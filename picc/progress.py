"""Progress bars for long work, on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Advance:
    """What :func:`progress_bar` yields: ``advance(n)`` counts ``n`` units done (shares of a unit
    add up; the bar shows whole ones); ``advance.expect(n)`` adds ``n`` units to the total, for
    work whose amount is learned as it goes (each round of a search)."""

    def __init__(self, bar) -> None:  # noqa: ANN001 - a tqdm bar
        self._bar = bar
        self._done = 0.0

    def __call__(self, n: float) -> None:
        before = round(self._done)
        self._done += n
        if round(self._done) > before:
            self._bar.update(round(self._done) - before)

    def expect(self, n: int) -> None:
        self._bar.total = (self._bar.total or 0) + n
        self._bar.refresh()


@contextlib.contextmanager
def progress_bar(total: int | None, what: str, unit: str = "it", in_bytes: bool = False) -> Iterator[Advance]:
    """Yield an :class:`Advance` (``total=None`` when the amount of work is not known, 0 when
    :meth:`Advance.expect` will tell); draws a tqdm bar on stderr (disabled when stderr is not a
    tty). ``in_bytes``: the amounts are bytes, shown in KiB, MiB, GiB."""
    from tqdm import tqdm

    scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if in_bytes else {"unit": unit}
    with tqdm(total=total, desc=what, disable=None, leave=False, dynamic_ncols=True, **scale) as bar:
        yield Advance(bar)
