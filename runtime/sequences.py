"""Per-sequence KV caches: a pool of them, one slot per sequence a server decodes at once.

A compiled model's generated code indexes its KV caches through the ``bufs`` table (one entry per
layer: k rows, then v rows, ``ctx`` positions each), and every program -- the step, the greedy
decode loop, the prompt's chunk programs -- reaches them only through it. A pool of ``slots``
caches per layer therefore gives each sequence its own: :meth:`SequencePool.bind` points the
table's entries at a slot's caches before that sequence's step, and its arithmetic is exactly the
one-sequence step's (the same code on the same values), whatever else the pool holds.

Slot 0 is the executor's own caches; the other ``slots - 1`` are allocated here, at start, and
refused with a clear error when they would not fit in the memory this machine has available. A
model that keeps a KV cache on the GPU holds one sequence's there: it is served one sequence at a
time (``slots`` 1).

The pool also remembers, per slot, which tokens' KV rows its caches hold (:meth:`hold`). A row
depends only on the tokens up to its position, so a later prompt that begins with the same
tokens may take those rows as they are (:meth:`cached`: the sequence given the slot,
:meth:`acquire` prefers it) or copied from another slot (:meth:`take`), and
compute only the rest -- where the rows it takes are the ones it would have computed, bit for
bit. Where the chunk programs compute the decode step's bits (``CpuChunkProgram.step_bits``),
every row is, whichever program wrote it: a prompt takes any prefix, a reply's rows included
(``unit`` 1). Elsewhere only rows the chunk programs wrote for whole chunks at the boundaries
every prompt is cut at (multiples of the chunk from position 0) are taken (``unit``: the chunk),
and the positions after them are computed in the chunks the prompt's own run would use.
"""

from __future__ import annotations

import numpy as np

from runtime.cpu import ExecutorError
from runtime.executor import Executor
from runtime.hostmem import aligned_zeros
from runtime.plan import MemoryPlan

MEMORY_HEADROOM = 0.8  # the share of MemAvailable the pool may take: the rest is the process's and the OS's


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_kv_caches(plan: MemoryPlan) -> int:
    """How many of the model's KV caches live on the GPU (each holds one sequence's positions)."""
    return sum(1 for b in plan.buffers if b.kind == "kv-cache" and b.device == "gpu")


class SequencePool:
    """``slots`` sets of KV caches for ``executor``'s model; :meth:`acquire` / :meth:`release`
    hand slots to sequences, :meth:`bind` makes one the caches the next steps use."""

    def __init__(self, executor: Executor, slots: int) -> None:
        if slots < 1:
            raise ExecutorError(f"--max-batch {slots}: expected at least 1")
        gpu_caches = gpu_kv_caches(executor.plan)
        if slots > 1 and gpu_caches:
            raise ExecutorError(f"--max-batch {slots}: this model keeps {gpu_caches} KV caches on the GPU, "
                                "which hold one sequence; serve it with --max-batch 1 (or compile it with the "
                                "caches on the CPU)")
        cpu = executor.cpu
        self._cpu = cpu
        self.caches = cpu.kv_caches()  # bufs index -> bytes
        self.bytes_per_slot = sum(self.caches.values())
        extra = (slots - 1) * self.bytes_per_slot
        free = available_memory()
        if free is not None and extra > MEMORY_HEADROOM * free:
            raise ExecutorError(f"--max-batch {slots}: {slots} sequences' KV caches need {extra / 2**30:.2f} GiB more "
                                f"memory, and this machine has {free / 2**30:.2f} GiB available; use a smaller "
                                "--max-batch or --ctx")
        self.slots = slots
        self.unit = 1 if cpu.step_bits else cpu.chunk  # rows are taken this many at a time
        self._own = [{i: cpu.cache_array(i) for i in self.caches}]
        self._own += [{i: aligned_zeros(n) for i, n in self.caches.items()} for _ in range(slots - 1)]
        self._pointers = np.array([[own[i].ctypes.data for i in cpu.batch_caches] for own in self._own],
                                  dtype=np.uint64).reshape(slots, len(cpu.batch_caches))
        ctx = executor.plan.ctx
        # per cache, its k rows' and its v rows' (byte offset, bytes, runs, bytes a position in a run)
        self._parts = {i: [(at, n, runs, n // (runs * ctx)) for at, n, runs in cpu.kv_parts(i)] for i in self.caches}
        assert all(runs * row * ctx == n for parts in self._parts.values() for _, n, runs, row in parts)
        self._held: list[tuple[list[int], int]] = [([], 0)] * slots  # tokens, and how many of their rows (hold)
        self._free = list(range(slots))  # the least recently released first
        self._bound: int | None = None

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, prompt: list[int] | None = None) -> int:
        """A free slot (ExecutorError when there is none). For ``prompt``: the one that holds most of
        it (:meth:`cached`, the least recently released of equals), to take those rows in place --
        unless that would write over more than a unit of other rows it holds (a conversation that
        went another way) while another slot is free: then the free slot holding least, into which
        the sequence copies the rows (:meth:`take`). Its record keeps only what ``prompt`` may
        take. Without a prompt: the least recently released, forgotten."""
        if not self._free:
            raise ExecutorError("no free sequence slot")
        cached = {s: self.cached(s, prompt) for s in self._free}
        slot = self._free[0]
        if prompt is not None:
            slot = max(self._free, key=cached.__getitem__)
            others = [s for s in self._free if s != slot]
            if others and self._held[slot][1] - cached[slot] > self.unit:
                slot = min(others, key=lambda s: self._held[s][1])
        self._free.remove(slot)
        self.hold(slot, prompt or [], cached[slot])
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back; its caches are reused as they are (a sequence reads only the positions
        it wrote itself, or rows :meth:`cached` says it may take)."""
        assert 0 <= slot < self.slots and slot not in self._free
        self._free.append(slot)

    def hold(self, slot: int, tokens: list[int], written: int) -> None:
        """Record that ``slot``'s caches hold the rows of ``tokens``' first ``written`` positions, from
        position 0 (written by the chunk programs at the usual boundaries, or by steps where
        ``unit`` is 1; only whole units are kept)."""
        self._held[slot] = (tokens, written // self.unit * self.unit)

    def cached(self, slot: int, prompt: list[int] | None) -> int:
        """How many of ``prompt``'s first positions ``slot``'s caches hold as ``prompt``'s own run
        would write them: whole units of the same tokens, and never its last token (the step that
        runs it leaves the logits)."""
        if prompt is None:
            return 0
        held, n = self._held[slot]
        n, block, same = min(n, (len(prompt) - 1) // self.unit * self.unit), max(self.unit, 32), 0
        while same + block <= n and held[same : same + block] == prompt[same : same + block]:
            same += block  # whole blocks at list-compare speed, then a unit at a time
        while same + self.unit <= n and held[same : same + self.unit] == prompt[same : same + self.unit]:
            same += self.unit
        return same

    def take(self, slot: int, prompt: list[int], fed: int) -> int:
        """Give ``slot``, whose caches hold ``prompt``'s first ``fed`` positions, the rows of more of
        its beginning where the pool holds them: its own as they are, else copied from the slot,
        free or not, that holds most (:meth:`cached`). How many positions it holds now."""
        held = [self.cached(s, prompt) for s in range(self.slots)]
        src = max(range(self.slots), key=held.__getitem__)
        if held[src] <= fed:
            return fed
        if held[src] > held[slot]:
            self.copy(src, slot, max(fed, held[slot]), held[src])
        self.hold(slot, prompt, held[src])
        return held[src]

    def copy(self, src: int, dst: int, start: int, stop: int) -> None:
        """Copy positions ``start .. stop - 1`` of every KV cache from slot ``src`` to slot ``dst``."""
        for i, parts in self._parts.items():
            for at, n, runs, row in parts:
                frm = self._own[src][i][at : at + n].reshape(runs, -1)
                to = self._own[dst][i][at : at + n].reshape(runs, -1)
                to[:, start * row : stop * row] = frm[:, start * row : stop * row]

    @property
    def batched(self) -> int:
        """Rows of the model's batch step (0: none; sequences then step one at a time)."""
        return self._cpu.batch_capacity

    def pointers(self, slots: list[int]) -> np.ndarray:
        """The KV cache addresses of ``slots``, a row each, in the order the batch step reads them."""
        return self._pointers[slots]

    def bind(self, slot: int) -> None:
        """Make ``slot``'s caches the ones the model's programs read and write from now on."""
        if slot != self._bound:
            for index, array in self._own[slot].items():
                self._cpu.bind(index, array)
            self._bound = slot
