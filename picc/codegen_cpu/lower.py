"""Lowering the CPU ops of a fused, placed module to programs of CPU kernels: :func:`lower_module`.

A module's CPU code is a few kinds of programs that share one table of buffers (``bufs``:
weights, activations, KV caches, scratch) and the runtime's threads call with it:

* the decode step, one program per stage of the schedule, with its twin without the head for
  prompt tokens, its profiled twin and, on a model that runs on the CPU alone, the greedy decode
  loop (:mod:`.lower_decode`);
* the chunk programs for prompts, ``picc_prefill_chunk`` and ``picc_logits_chunk``
  (:mod:`.lower_chunk`; where a chunk's values live: :mod:`.chunks`);
* both lowered op by op by :class:`~picc.codegen_cpu.lower_ops.OpLowering`, which checks that
  each op's ``kernel`` (named by ``select-kernels``) is the kernel it calls;
* the ``bufs`` table and the extra tensors the kernels read: :mod:`.buffers`.

What the runtime needs besides the code is the manifest (``cpu/manifest``), typed records of
:mod:`runtime.cpu_manifest` that :meth:`CpuProgram.manifest` assembles.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cpu.buffers import MAX_THREADS, PARAM_SLOTS, CpuBuffers
from picc.codegen_cpu.lower_batch import BatchLowering
from picc.codegen_cpu.lower_chunk import ChunkSlots, logits_programs, prefill_programs
from picc.codegen_cpu.lower_decode import DecodeLowering
from picc.codegen_cpu.program import GreedyLoop, Program
from picc.errors import PiccError
from picc.ir.module import Module
from picc.ir.weights import Tensor, WeightStore
from picc.placement.schedule import Schedule
from runtime.cpu_manifest import (
    CpuBatchProgram,
    CpuBuffer,
    CpuChunkProgram,
    CpuManifest,
    CpuStage,
    DecodeLoop,
    LogitsRow,
    ValueBytes,
)


@dataclass(frozen=True)
class CpuProgram:
    """A lowered module: its programs (in the order they are emitted), the extra tensors and the
    weights stored in another layout (weight -> ``rows8`` / ``rowplanes``) that the .pib holds
    for them, and what the manifest says about them."""

    programs: list[Program | GreedyLoop]
    extra: dict[str, Tensor]
    layouts: dict[str, str]
    buffers: tuple[CpuBuffer, ...]
    stages: tuple[CpuStage, ...]
    values: dict[str, ValueBytes]  # the host side of each value that crosses devices
    logits: LogitsRow
    greedy: bool  # the CPU step writes the greedy token to params
    prefill: CpuChunkProgram
    logits_chunk: CpuChunkProgram
    decode: DecodeLoop | None
    batch: CpuBatchProgram | None

    def manifest(self, simd: str) -> CpuManifest:
        """What the runtime needs besides the code."""
        return CpuManifest(simd, MAX_THREADS, dict(PARAM_SLOTS), self.buffers, self.stages, self.values, self.logits,
                           self.greedy, self.prefill, self.logits_chunk, self.decode, self.batch)


def lower_module(module: Module, weights: WeightStore, sched: Schedule, ctx: int, *,
                 batch_step: bool = True) -> CpuProgram:
    """The CPU step programs of ``module`` (scheduled by ``sched``) with KV caches for ``ctx`` positions;
    ``batch_step``: with the server's batch step where the model runs on the CPU alone."""
    func = module.function()
    for arg in func.args:
        if arg.name not in ("tokens", "pos"):
            raise PiccError(f"codegen_cpu: function argument %{arg.name} is not supported")
    types = func.value_types()
    hidden = max((int(t.shape[-1]) for t in types.values() if t.shape and isinstance(t.shape[-1], int)), default=1)
    bufs = CpuBuffers(weights, 4 * hidden)
    step = DecodeLowering(func, weights, sched, ctx, bufs)
    step.lower_stages()
    loop = step.decode_loop()
    slots = ChunkSlots.allocate(bufs)
    prefill, prefill_info = prefill_programs(func, weights, sched, ctx, bufs, slots)
    logits, logits_info = logits_programs(func, weights, sched, ctx, bufs, slots)
    where_logits, values = step.host_places()
    programs = [*step.programs, *prefill, *logits]
    batch_info = None
    if batch_step and loop is not None and not sched.stages[0].gpu:  # CPU alone: a server batches its sequences
        batch, batch_info = BatchLowering(step, bufs).lower_batch()
        programs += batch
    return CpuProgram(programs, bufs.extra, bufs.layouts, tuple(bufs.entries), tuple(step.stages), values,
                      where_logits, step.greedy, prefill_info, logits_info, loop, batch_info)
