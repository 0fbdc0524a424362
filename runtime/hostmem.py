"""Host memory the generated code reads: anonymous memory in 2 MiB pages (Linux transparent huge pages).

A decode step reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB of a
streamed matrix (and the hardware prefetchers stop at each page's end), and nearly one a row where
a sparse FFN gathers scattered rows; in 2 MiB pages a TLB entry covers 512 times as much. The
executor therefore copies the weights out of the .pib's file mapping (the page cache gives a file
just written small pages) into one anonymous region advised ``MADV_HUGEPAGE``, beside the buffers
the step allocates (activations, KV caches, scratch).

Measured on a 2-core Zen 4 (KVM guest, THP ``madvise``), weights of 40 SmolLM2 FFN layers (64 MB,
past the L3), one thread, the fused down-only FFN at ~22% active: its dense up and gate GEMV 50.5
-> 47.2 us, its gathered down AXPYs 19.5 -> 16.4 us, in 4 KiB and 2 MiB pages alternately.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 * 2**20
PAGE = mmap.PAGESIZE  # the ordinary page
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_enabled() -> bool:
    """Whether this kernel gives anonymous memory advised ``MADV_HUGEPAGE`` 2 MiB pages (THP mode
    ``always`` or ``madvise``; not ``never``, nor a system without THP)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def aligned_zeros(nbytes: int, align: int = 64) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary (ordinary pages)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def huge_zeros(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` backed by anonymous memory advised to use 2 MiB pages; its
    base is 2 MiB aligned. Ordinary pages where ``madvise`` is unavailable."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    return raw[start : start + nbytes]


def page_zeros(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` in anonymous memory of its own, starting on a page and
    filling whole pages (so that it can be page-locked without touching anything else)."""
    size = -(-max(nbytes, 1) // PAGE) * PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8)[:nbytes]


def page_span(array: np.ndarray) -> tuple[int, int]:
    """``(start, end)``: the addresses of the whole pages ``array``'s bytes lie on (for
    page-locking it; the pages must belong to one mapping, as :func:`page_zeros`' and
    :func:`carve`'s do)."""
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    return start - start % PAGE, end + -end % PAGE


def carve(sizes: list[int], align: int = 64) -> list[np.ndarray]:
    """Zeroed uint8 arrays of ``sizes`` bytes, each starting on an ``align``-byte boundary, cut from
    one :func:`huge_zeros` region (they keep it alive)."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-max(size, 1) // align) * align
    region = huge_zeros(total)
    return [region[off : off + size] for off, size in zip(offsets, sizes, strict=True)]
