"""What ``picc compile`` writes into a ``.pib`` for the runtime to read about the step and the GPU:
typed records that both sides import, serialized here and nowhere else.

* ``schedule``: the decode step's :class:`Stage` s (the ops each device runs, the values copied
  across before each), the head's ops (skipped for prompt tokens) and where the logits are;
* ``gpu/launches``: per GPU op, the :class:`Call` s of its kernels, each parameter bound to a
  place in the memory plan's arena (:class:`Binding`);
* ``cuda/manifest``: the CUDA module's architecture, what was compiled (PTX, cubin) and per kernel
  the :class:`KernelLaunch` es of its ``__global__`` functions (grid, block, pointer arguments).

The CPU's manifest (``cpu/manifest``) has its records beside these, in :mod:`runtime.cpu_manifest`.

Their JSON is part of the ``.pib`` format (``runtime.pib.FORMAT_VERSION``): a change of shape here
changes the version. A field missing from a file is an error naming the section, not a default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.gpu_layout import element_bytes

GPU, CPU = "gpu", "cpu"
GREEDY_LAUNCH = "@greedy_next"  # gpu/launches' entry of the greedy loop's kernel (not an IR op: no IR name has '@')


class ContractError(ValueError):
    """A ``.pib`` section that does not have the shape its record needs."""


def _get(data: object, key: str, section: str) -> Any:  # noqa: ANN401 - JSON values
    if not isinstance(data, dict) or key not in data:
        raise ContractError(f"{section}: missing {key!r}")
    return data[key]


@dataclass
class Stage:
    """Ops each device runs in this stage (in order) and the values copied across before it."""

    gpu: list[str] = field(default_factory=list)
    cpu: list[str] = field(default_factory=list)
    to_gpu: list[str] = field(default_factory=list)
    to_cpu: list[str] = field(default_factory=list)


@dataclass
class Schedule:
    """A decode step: its stages, the ops after the last decoder layer (``head``, skipped for
    prompt tokens whose logits nobody reads), the returned value and the device that makes it."""

    stages: list[Stage]
    head: list[str]
    logits: str
    logits_device: str

    @property
    def devices(self) -> set[str]:
        return {d for s in self.stages for d in (GPU, CPU) if getattr(s, d)}

    def stage_of(self, op: str) -> int:
        return next(i for i, s in enumerate(self.stages) if op in s.gpu or op in s.cpu)

    def to_json(self) -> dict:
        return {"stages": [{"gpu": s.gpu, "cpu": s.cpu, "to_gpu": s.to_gpu, "to_cpu": s.to_cpu}
                           for s in self.stages],
                "head": self.head, "logits": self.logits, "logits_device": self.logits_device}

    @classmethod
    def from_json(cls, data: object) -> Schedule:
        stages = [Stage(*(list(_get(st, key, "schedule")) for key in ("gpu", "cpu", "to_gpu", "to_cpu")))
                  for st in _get(data, "stages", "schedule")]
        return cls(stages, list(_get(data, "head", "schedule")), str(_get(data, "logits", "schedule")),
                   str(_get(data, "logits_device", "schedule")))


@dataclass(frozen=True, slots=True)
class Binding:
    """Kernel parameter ``param``: ``shape`` elements of ``dtype`` at byte ``offset`` of the arena."""

    param: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class Call:
    """One call of kernel ``kernel`` (all of its launches) with its parameters bound, in ABI order."""

    kernel: str
    args: tuple[Binding, ...]

    def offsets(self) -> dict[str, int]:
        return {a.param: a.offset for a in self.args}


def launches_to_json(launches: dict[str, list[Call]]) -> dict:
    return {op: [{"kernel": c.kernel, "args": [{"param": a.param, "offset": a.offset, "shape": list(a.shape),
                                                "dtype": a.dtype} for a in c.args]} for c in calls]
            for op, calls in launches.items()}


def launches_from_json(data: object) -> dict[str, list[Call]]:
    """``gpu/launches``: per op, its calls."""
    if not isinstance(data, dict):
        raise ContractError("gpu/launches: expected a mapping of ops to calls")
    return {op: [Call(str(_get(c, "kernel", "gpu/launches")),
                      tuple(Binding(str(_get(a, "param", "gpu/launches")), int(_get(a, "offset", "gpu/launches")),
                                    tuple(int(d) for d in _get(a, "shape", "gpu/launches")),
                                    str(_get(a, "dtype", "gpu/launches")))
                            for a in _get(c, "args", "gpu/launches")))
                 for c in calls]
            for op, calls in data.items()}


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """How to launch one ``__global__`` function of a kernel without TVM's runtime: its grid and
    block, and its pointer arguments by kernel parameter name, in the function's order."""

    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[str, ...]

    def to_json(self) -> dict:
        return {"entry": self.entry, "grid": list(self.grid), "block": list(self.block), "params": list(self.params)}

    @classmethod
    def from_json(cls, data: object) -> KernelLaunch:
        def dims(key: str) -> tuple[int, int, int]:
            x, y, z = (int(v) for v in _get(data, key, "cuda/manifest"))
            return x, y, z

        return cls(str(_get(data, "entry", "cuda/manifest")), dims("grid"), dims("block"),
                   tuple(str(p) for p in _get(data, "params", "cuda/manifest")))


@dataclass(frozen=True)
class CudaManifest:
    """The CUDA module of a ``.pib``: its architecture, what nvcc made of it (``ptx``, ``cubin``;
    empty: the sources only, compiled when loaded), per kernel its launches in order, and whether
    every kernel waits for the ones before it itself (``dependent_launch``: it starts with
    ``griddepcontrol.wait``, so a device that has it may launch it with programmatic stream
    serialization, before the kernel ahead of it is done)."""

    arch: str
    compiled: tuple[str, ...]
    kernels: dict[str, tuple[KernelLaunch, ...]]
    dependent_launch: bool = False

    @property
    def entries(self) -> list[str]:
        return [launch.entry for launches in self.kernels.values() for launch in launches]

    def to_json(self) -> dict:
        return {"arch": self.arch, "compiled": list(self.compiled),
                "kernels": {name: [la.to_json() for la in launches] for name, launches in self.kernels.items()},
                "dependent_launch": self.dependent_launch}

    @classmethod
    def from_json(cls, data: object) -> CudaManifest:
        kernels = _get(data, "kernels", "cuda/manifest")
        return cls(str(_get(data, "arch", "cuda/manifest")), tuple(_get(data, "compiled", "cuda/manifest")),
                   {name: tuple(KernelLaunch.from_json(la) for la in launches) for name, launches in kernels.items()},
                   bool(_get(data, "dependent_launch", "cuda/manifest")))
