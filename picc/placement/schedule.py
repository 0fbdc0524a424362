"""The hybrid step: which ops each device runs when, and which values cross between them.

A decode step of a placed module is a sequence of *stages*. In a stage the GPU runs its ops in
program order while the CPU runs its own, concurrently; before a stage starts, every value that
one of its ops reads from the other device is copied across (one activation vector over PCIe).
Ops are put in the earliest stage their inputs allow: a value made on the same device can be read
in the same stage (each device runs its ops in program order), one made on the other device only
in a later stage. Then the two parts of a split FFN layer are moved to the same stage, so that the GPU's
hot neurons and the CPU's cold neurons are computed at the same time -- the point of the hybrid
split -- and their ``merge`` follows in the next stage.

The *head* is what follows the last decoder layer (the output norm and LM head): prompt tokens
whose logits nobody reads skip it. Function arguments (``tokens``, ``pos``) are written by the
runtime to wherever they are read, every step.

Backends and the runtime read the schedule: ``runtime.contracts.Schedule``, whose JSON form is the
``.pib``'s ``schedule`` section.
"""

from __future__ import annotations

from picc.ir import ops as O
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function, Module
from picc.ir.types import Placement
from runtime.contracts import CPU, GPU, Schedule, Stage


def device_of(placement: Placement | None) -> str:
    return GPU if placement == Placement.GPU else CPU


def _stage_numbers(func: Function) -> dict[str, int]:
    device = {op.result: device_of(op.type.placement) for op in func.ops}

    def settle(stage: dict[str, int]) -> dict[str, int]:
        """Each op no earlier than its inputs allow and than the op before it on its device (so a
        device runs its ops in program order, which the GPU's activation arena relies on)."""
        last = {GPU: 0, CPU: 0}
        for op in func.ops:
            s = max(stage.get(op.result, 0), last[device[op.result]])
            for v in op.values():
                if v in stage:  # function arguments are written by the runtime wherever they are read
                    s = max(s, stage[v] + (device[v] != device[op.result]))
            stage[op.result] = last[device[op.result]] = s
        return stage

    stage = settle({})
    # The parts of a split layer run side by side: each moves to the later one's stage. Nothing
    # else reads a part but its merge, which is at least one stage later.
    parts: dict[str, list[str]] = {}
    for op in func.ops:
        if isinstance(op, FusedFFN) and not op.whole_layer:
            parts.setdefault(op.layer, []).append(op.result)
        elif isinstance(op, O.FFN) and op.part_of is not None:  # not fused yet (the partitioner's trials)
            parts.setdefault(op.part_of, []).append(op.result)
    for names in parts.values():
        latest = max(stage[n] for n in names)
        for n in names:
            stage[n] = latest
    return settle(stage)


def schedule(module: Module) -> Schedule:
    """The stages of ``module``'s decode step (see the module docstring)."""
    func = module.function()
    number = _stage_numbers(func)
    device = {op.result: device_of(op.type.placement) for op in func.ops}
    stages = [Stage() for _ in range(max(number.values(), default=-1) + 1)]
    for op in func.ops:
        getattr(stages[number[op.result]], device[op.result]).append(op.result)
    # A value crosses once, before the first stage that reads it on the other device.
    first_read: dict[tuple[str, str], int] = {}
    for op in func.ops:
        for v in op.values():
            if v in device and device[v] != device[op.result]:
                key = (v, device[op.result])
                first_read[key] = min(first_read.get(key, number[op.result]), number[op.result])
    for (v, dest), at in first_read.items():
        (stages[at].to_gpu if dest == GPU else stages[at].to_cpu).append(v)
    last = max((i for i, op in enumerate(func.ops) if op.block is not None), default=len(func.ops) - 1)
    head = [op.result for op in func.ops[last + 1 :]]
    return Schedule(stages, head, func.ret, device.get(func.ret, CPU))


def crossing_values(s: Schedule) -> set[str]:
    """Values copied between the devices in some stage."""
    return {v for st in s.stages for v in (*st.to_gpu, *st.to_cpu)}
