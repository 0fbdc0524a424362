"""Running generated code on several threads: a persistent team of Python threads.

Each thread of a :class:`ThreadTeam` calls the same ctypes function with its own ``tid``. ctypes
releases the GIL for the duration of a foreign call, so the threads run the generated code truly
in parallel; the Python cost is one hand-off per :meth:`ThreadTeam.run` (tens of microseconds),
which is why a whole decode step should be one :class:`~picc.codegen_cpu.program.Program` call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.errors import PiccError
from runtime.hostmem import aligned_zeros
from runtime.threads import ThreadTeam as _RuntimeTeam


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
