"""A persistent team of threads that run one job together: how generated code uses every core.

Each thread of a :class:`ThreadTeam` calls the same job with its own ``tid``. Jobs are ctypes
calls into generated code, which release the GIL, so the threads run truly in parallel; the
Python cost is one hand-off per :meth:`ThreadTeam.run_each` (tens of microseconds), which is why
a whole decode step is one generated function that every thread calls once.

Each thread runs on its own core (``pin``, the default when there are enough cores): between the
kernels of a step the threads meet at barriers that spin, and two threads that the scheduler put
on one core (it does so readily with threads that often wait for each other, e.g. when another
process keeps the second core busy for a while) take turns through a context switch at every
barrier: measured on a 2-core KVM guest, 10 us per barrier unpinned against 0.3 us pinned, which
decided between 2 threads being slower or faster than 1. The caller's thread (tid 0) is pinned
only while it runs a job, or through a :meth:`ThreadTeam.pinned` block (a decode loop), so that
threads it starts elsewhere (a BLAS pool, say) inherit its own affinity.

A team made with ``native`` (generated code's ``picc_team_worker`` and ``picc_team_barrier``, see
``picc/codegen_cpu/prelude.py``) keeps Python out of the hand-off: its workers wait, run step
functions and meet in generated code until the team closes, and :meth:`ThreadTeam.run_step` hands
them a step by address. Measured on a 2-core KVM guest, a step of one tiny kernel: ~40 us through
Python barriers (futex wake-ups and GIL hand-offs; ~100 us when the job is a Python lambda), ~10 us
native, 6 of them the two affinity calls that pin the caller for the step (none inside a
``pinned()`` block).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator

_SYNC_BYTES = 192  # picc.codegen_cpu.prelude.SYNC_BYTES: the barrier's state
TEAM_BYTES = _SYNC_BYTES + 64  # a native team's state: barrier, then _TeamSlots


class _TeamSlots(ctypes.Structure):
    """What follows the barrier in a native team's state (the offsets picc_team_worker reads)."""

    _fields_ = (("job", ctypes.c_void_p), ("table", ctypes.c_void_p), ("closing", ctypes.c_int32))


def _cores(nthreads: int) -> list[int] | None:
    """The cores to pin threads 0..nthreads-1 to, or None when there are not enough (or no
    affinity API: then the scheduler places them)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[:nthreads] if len(cores) >= nthreads else None


class ThreadTeam:
    """``nthreads`` threads (the caller is thread 0) that run one job at a time together.

    Not re-entrant: one ``run_each`` at a time. ``close`` (or leaving a ``with`` block) ends the
    worker threads.
    """

    def __init__(self, nthreads: int, *, pin: bool = True,
                 native: tuple[Callable[..., object], Callable[..., object]] | None = None) -> None:
        if nthreads < 1:
            raise ValueError(f"a thread team needs at least 1 thread, got {nthreads}")
        self.nthreads = nthreads
        self._cores = _cores(nthreads) if pin and nthreads > 1 else None
        self._start = threading.Barrier(nthreads)
        self._done = threading.Barrier(nthreads)
        self._job: Callable[[int], None] | None = None
        self._closing = False
        self._errors: list[BaseException] = []
        self._pinned = False  # inside a pinned() block
        self.native = native is not None
        if native is not None:
            # The functions keep their module alive; the state must stay put while workers run.
            self._worker_fn, self._barrier_fn = native
            self._raw = ctypes.create_string_buffer(TEAM_BYTES + 64)
            self._state = ctypes.addressof(self._raw) + (-ctypes.addressof(self._raw)) % 64
            self._slots = _TeamSlots.from_address(self._state + _SYNC_BYTES)
            self._state_arg = ctypes.c_void_p(self._state)
            self._addresses: dict[int, tuple[ctypes._CFuncPtr, int]] = {}  # id(step) -> (step, its address)
        self._workers = [threading.Thread(target=self._work, args=(t,), daemon=True, name=f"picc-cpu-{t}")
                         for t in range(1, nthreads)]
        for w in self._workers:
            w.start()

    def _work(self, tid: int) -> None:
        if self._cores is not None:
            os.sched_setaffinity(0, {self._cores[tid]})
        if self.native:
            self._worker_fn(ctypes.c_void_p(self._state), tid, self.nthreads)  # returns when the team closes
            return
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

    def run_step(self, step: ctypes._CFuncPtr, table: int) -> None:
        """Call the generated step function ``step(table, tid, nthreads)`` on every thread."""
        if not self.native:
            n = ctypes.c_int32(self.nthreads)
            self.run_each(lambda tid: step(table, tid, n))
            return
        if self._closing:
            raise RuntimeError("the thread team is closed")
        # Per token on a small model, each Python-level operation here shows (relu-demo: ~17 us a
        # token outside the step, of ~250): the job's address and the state's argument are made
        # once, and a caller already pinned (a decode loop) skips the pinning block.
        known = self._addresses.get(id(step))
        if known is None or known[0] is not step:  # (function pointers are not hashable)
            known = self._addresses[id(step)] = (step, ctypes.cast(step, ctypes.c_void_p).value)
        self._slots.job = known[1]
        self._slots.table = table
        if self.nthreads > 1:
            self._barrier_fn(self._state_arg, self.nthreads)
        try:
            if self._pinned or self._cores is None:
                step(table, 0, self.nthreads)
            else:
                with self.pinned():
                    step(table, 0, self.nthreads)
        finally:
            if self.nthreads > 1:
                self._barrier_fn(self._state_arg, self.nthreads)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """The caller's thread on its core (thread 0's) for the block, its own affinity after.

        Every step pins the caller for its own length (two affinity calls, ~6 us, and measured
        ~25 us a relu-demo token in all); a loop of steps (a decode) can hold the pin across them
        instead. Nested blocks are free. Threads the caller starts inside the block inherit its
        single core."""
        if self._cores is None or self._pinned:
            yield
            return
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self._cores[0]})
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            os.sched_setaffinity(0, mask)

    def run_each(self, job: Callable[[int], None]) -> None:
        """Call ``job(tid)`` on every thread (tid 0 on the caller); return when all have returned.
        Not on a native team, whose workers run only step functions (:meth:`run_step`)."""
        if self._closing:
            raise RuntimeError("the thread team is closed")
        if self.native and self.nthreads > 1:
            raise RuntimeError("a native thread team runs step functions only (run_step)")
        self._job = job
        self._errors.clear()
        if self.nthreads > 1:
            self._start.wait()
        try:
            with self.pinned():
                job(0)
        finally:
            if self.nthreads > 1:
                self._done.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            if self.native and self.nthreads > 1:
                self._slots.closing = 1
                self._barrier_fn(ctypes.c_void_p(self._state), self.nthreads)
            elif self.nthreads > 1:
                self._start.wait()
            for w in self._workers:
                w.join()

    def __enter__(self) -> ThreadTeam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
