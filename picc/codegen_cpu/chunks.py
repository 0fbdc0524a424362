"""Where the chunk programs keep a chunk's values, and which values a chunk must compute.

A chunk program (``picc_prefill_chunk``, ``picc_logits_chunk``: see ``picc.codegen_cpu.lower_chunk``)
computes up to a chunk of tokens at once, each value as ``size`` rows, one per token, back to
back. Two pieces decide its memory, both independent of the kernels:

* :func:`plan_chunk` -- the ops a chunk needs (those that feed a KV cache or the result the
  caller reads), stage by stage, what the GPU's ops of each stage read from earlier stages and
  leave for later ones, and the last event that reads each value (the allocator frees a value's
  rows after it);
* :class:`ChunkRegions` -- the allocator: a value's rows take a free region (or a new one) and
  return it once their last reader is lowered, so the chunk's working set is a few regions, not
  one per value of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cpu.program import Buf
from picc.errors import PiccError
from picc.ir import ops as O
from picc.ir.module import Function
from picc.ir.types import DType, TensorType
from picc.placement.schedule import Schedule
from runtime.cpu_manifest import ChunkRows

ALIGN = 64  # bytes: every value's rows start on a cache line


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bytes_one_token(t: TensorType) -> int:
    """Bytes of one token's row of a value of type ``t``."""
    size = 4 if t.dtype in (DType.F32, DType.I32) else 1
    for d in t.shape:
        size *= d if isinstance(d, int) else 1
    return size


@dataclass(frozen=True)
class ChunkPlan:
    """What a chunk program computes, in events: per stage, its start (the GPU's rows are
    placed), each of its CPU ops, its end (the GPU has read its inputs).

    ``stages``: per stage, the kept ops' results on the GPU and on the CPU; ``gpu_in`` /
    ``gpu_out``: per stage, the values its GPU ops read from earlier stages / leave for later
    ones (or for the caller); ``cpu_event``: each CPU op's event; ``end_event``: each stage's
    end; ``last_read``: the last event that reads each value's rows."""

    stages: list[tuple[list[str], list[str]]]
    gpu_in: list[list[str]]
    gpu_out: list[list[str]]
    cpu_event: dict[str, int]
    end_event: list[int]
    last_read: dict[str, int]


def plan_chunk(func: Function, sched: Schedule, result: str | None, skip: set[str]) -> ChunkPlan:
    """The ops of ``func`` but ``skip`` that a chunk needs, by stage of ``sched``, and the events
    that read each value. Only the KV caches (and ``result``, read by the caller afterwards,
    never released) outlive a chunk: what feeds neither them nor later layers is dropped (for
    the prefill: the last layer's output projection, its FFN and adds)."""
    live: set[str] = {result} if result else set()
    kept: set[str] = set()
    for op in reversed(func.ops):
        if op.result not in skip and (isinstance(op, O.Attention) or op.result in live):
            kept.add(op.result)
            live.update(op.values())
    ops = {op.result: op for op in func.ops}
    stages = [([n for n in st.gpu if n in kept], [n for n in st.cpu if n in kept]) for st in sched.stages]
    made_in = {n: i for i, (gpu, cpu) in enumerate(stages) for n in gpu + cpu}
    read_until = dict.fromkeys(made_in, -1)  # the last stage that reads each value
    for n in kept:
        for v in ops[n].values():
            if v in made_in:
                read_until[v] = max(read_until[v], made_in[n])
    gpu_in: list[list[str]] = []
    gpu_out: list[list[str]] = []
    event, last, cpu_event, end_event = 0, {}, {}, []
    for i, (gpu, cpu) in enumerate(stages):
        gpu_out.append([v for v in gpu if read_until[v] > i or v == result])
        made_here = set(gpu)
        reads = {v for n in gpu for v in ops[n].values()}
        gpu_in.append(sorted(v for v in reads if v not in made_here))
        for v in gpu_out[-1]:
            last.setdefault(v, event)
        event += 1
        for n in cpu:
            cpu_event[n] = event
            last.setdefault(n, event)
            for v in ops[n].values():
                last[v] = event
            event += 1
        for v in gpu_in[-1]:
            last[v] = event
        end_event.append(event)
        event += 1
    for n in reversed(cpu_event):  # a rotated value keeps its input's rows alive
        if isinstance(ops[n], O.Rope):
            last[ops[n].x] = max(last[ops[n].x], last.get(n, 0))
    if result:
        last[result] = event
    return ChunkPlan(stages, gpu_in, gpu_out, cpu_event, end_event, last)


class ChunkRegions:
    """Where a chunk program keeps values: ``size`` rows of each (one per token, back to back) in
    buffer ``index``; ``tokens``: the buffer of the chunk's token ids. A value's region returns
    to a free list once its last reader is lowered (:meth:`release`).

    ``key`` names a value's memory for ``place_barriers``: two values sharing a region (a rotated
    value and its input; a value and a later one reusing its region) conflict.
    """

    def __init__(self, index: int, tokens: int, size: int, types: dict[str, TensorType],
                 last_read: dict[str, int]) -> None:
        self.index, self.tokens, self.size = index, tokens, size
        self.types, self.last_read = types, last_read
        self.places: dict[str, Buf] = {}
        self.owners: dict[str, int] = {}  # value -> bytes of the region it owns (aliases own none)
        self.free: list[tuple[int, int]] = []  # (bytes, offset) of released regions
        self.nbytes = 0

    def place(self, value: str) -> Buf:
        if value not in self.places:
            row = bytes_one_token(self.types[value])
            need = aligned(row * self.size)
            fits = [f for f in self.free if f[0] >= need]
            if fits:
                size, offset = min(fits)
                self.free.remove((size, offset))
            else:
                size, offset = need, self.nbytes
                self.nbytes += need
            self.places[value] = Buf(self.index, offset, stride=row)
            self.owners[value] = size
        return self.places[value]

    def get(self, value: str) -> Buf:
        if value not in self.places:
            raise PiccError(f"codegen_cpu: %{value} is read by the prefill program before it is computed")
        return self.places[value]

    def alias(self, value: str, of: str) -> Buf:
        self.places[value] = self.get(of)
        return self.places[value]

    def key(self, value: str) -> str:
        b = self.places.get(value)
        return f"@{b.offset}" if b is not None else value

    def release(self, event: int) -> None:
        """Free the regions whose owner's last reader is event ``event`` (or earlier)."""
        for value in [v for v in self.owners if self.last_read.get(v, -1) <= event]:
            self.free.append((self.owners.pop(value), self.places[value].offset))

    def rows(self, value: str) -> ChunkRows:
        """Where ``value``'s rows are, for the runtime's copies to and from the GPU."""
        where, nbytes = self.get(value), bytes_one_token(self.types[value])
        if where.stride != nbytes:
            raise PiccError(f"codegen_cpu: %{value}'s rows in the chunk are not back to back")
        return ChunkRows(value, where.index, where.offset, where.stride, nbytes)
