"""A persistent team of threads that run one job together: how generated code uses every core.

Each thread of a :class:`ThreadTeam` calls the same job with its own ``tid``. Jobs are ctypes
calls into generated code, which release the GIL, so the threads run truly in parallel; the
Python cost is one hand-off per :meth:`ThreadTeam.run_each` (tens of microseconds), which is why
a whole decode step is one generated function that every thread calls once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ThreadTeam:
    """``nthreads`` threads (the caller is thread 0) that run one job at a time together.

    Not re-entrant: one ``run_each`` at a time. ``close`` (or leaving a ``with`` block) ends the
    worker threads.
    """

    def __init__(self, nthreads: int) -> None:
        if nthreads < 1:
            raise ValueError(f"a thread team needs at least 1 thread, got {nthreads}")
        self.nthreads = nthreads
        self._start = threading.Barrier(nthreads)
        self._done = threading.Barrier(nthreads)
        self._job: Callable[[int], None] | None = None
        self._closing = False
        self._errors: list[BaseException] = []
        self._workers = [threading.Thread(target=self._work, args=(t,), daemon=True, name=f"picc-cpu-{t}")
                         for t in range(1, nthreads)]
        for w in self._workers:
            w.start()

    def _work(self, tid: int) -> None:
        while True:
            self._start.wait()
            if self._closing:
                return
            try:
                assert self._job is not None
                self._job(tid)
            except BaseException as e:  # noqa: BLE001 - reported by run_each() on the caller's thread
                self._errors.append(e)
            self._done.wait()

    def run_each(self, job: Callable[[int], None]) -> None:
        """Call ``job(tid)`` on every thread (tid 0 on the caller); return when all have returned."""
        if self._closing:
            raise RuntimeError("the thread team is closed")
        self._job = job
        self._errors.clear()
        if self.nthreads > 1:
            self._start.wait()
        try:
            job(0)
        finally:
            if self.nthreads > 1:
                self._done.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            if self.nthreads > 1:
                self._start.wait()
            for w in self._workers:
                w.join()

    def __enter__(self) -> ThreadTeam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
