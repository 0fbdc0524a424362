"""Running generated code on several threads: a persistent team of Python threads.

Each thread of a :class:`ThreadTeam` calls the same ctypes function with its own ``tid``. ctypes
releases the GIL for the duration of a foreign call, so the threads run the generated code truly
in parallel; the Python cost is one hand-off per :meth:`ThreadTeam.run` (tens of microseconds),
which is why a whole decode step should be one :class:`~picc.codegen_cpu.program.Program` call.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Callable, Sequence

import numpy as np

from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.errors import PiccError
from runtime.threads import ThreadTeam as _RuntimeTeam


def aligned_zeros(nbytes: int, align: int = 64) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


class ThreadTeam(_RuntimeTeam):
    """The runtime's team of threads, plus the barrier state kernels share (``sync``).

    ``run(fn, args)`` calls ``fn(*args, tid, nthreads, sync)`` on every thread and returns when
    all have returned. ``sync`` is :data:`~picc.codegen_cpu.prelude.SYNC_BYTES` zeroed bytes,
    kept for the team's life.
    """

    def __init__(self, nthreads: int) -> None:
        if nthreads < 1:
            raise PiccError(f"codegen_cpu: a thread team needs at least 1 thread, got {nthreads}")
        super().__init__(nthreads)
        self.sync = aligned_zeros(SYNC_BYTES)

    def run(self, fn: Callable[..., object], args: Sequence[object]) -> None:
        """Call ``fn(*args, tid, nthreads, sync)`` on all threads; wait for all of them."""
        sync = ctypes.c_void_p(self.sync.ctypes.data)
        self.run_each(lambda tid: fn(*args, tid, self.nthreads, sync))


def huge_zeros(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array backed by anonymous memory advised to use 2 MiB pages (Linux THP).

    Gathering scattered rows touches a new 4 KiB page almost every row; with 2 MiB pages the
    TLB covers the weights and the row reads run at memory speed. Falls back to ordinary pages
    where ``madvise`` is unavailable. The array's base is 2 MiB aligned.
    """
    huge = 2 * 2**20
    size = -(-nbytes // huge) * huge + huge
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = (-raw.ctypes.data) % huge
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    return raw[start : start + nbytes]
