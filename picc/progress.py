"""Progress bars for long work, on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int | None, what: str, unit: str = "it",
                 in_bytes: bool = False) -> Iterator[Callable[[float], None]]:
    """Yield ``advance(n)`` (``total=None`` when the amount of work is not known); draws a tqdm
    bar on stderr (disabled when stderr is not a tty). ``advance`` may be given shares of a unit
    (an op's share of a window's tokens); the bar counts whole ones. ``in_bytes``: the amounts are
    bytes, shown in KiB, MiB, GiB."""
    from tqdm import tqdm

    scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if in_bytes else {"unit": unit}
    done = [0.0]

    def advance(n: float) -> None:  # shares of a unit add up; the bar shows whole units
        before = round(done[0])
        done[0] += n
        if round(done[0]) > before:
            bar.update(round(done[0]) - before)

    with tqdm(total=total, desc=what, disable=None, leave=False, dynamic_ncols=True, **scale) as bar:
        yield advance
