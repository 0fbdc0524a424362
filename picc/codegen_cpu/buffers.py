"""The ``bufs`` table of a lowered module: every buffer the generated programs index, in order.

The step, its profiled twin, the decode loop and the chunk programs share one table, which the
runtime fills once (``runtime.cpu_manifest.CpuBuffer``: the kinds and their fields):

* ``bufs[0]`` the barrier state, ``bufs[1]`` the per-token parameters (i32, :data:`PARAM_SLOTS`:
  ``pos``, ``token``, the greedy token the step writes, and the chunk's and the decode loop's),
  ``bufs[2]`` a vector of zeros, ``bufs[3]`` the step's activations, ``bufs[4]`` the kernels'
  shared scratch (sized for :data:`MAX_THREADS`);
* then, in the order the lowering first asks for them: each weight the kernels read, by name (the
  .pib's tensors; vectors that kernels read as f32 -- norms, biases, rotary frequencies -- are
  stored as extra f32 tensors ``cpu.f32.<name>``, a predictor's second matrix transposed as
  ``cpu.t.<name>``; a matrix read in another layout than GGUF's rows is stored in it,
  :attr:`CpuBuffers.layouts`), the KV caches, the profile counters, the chunk programs' memory.

:class:`CpuBuffers` hands these out; the lowerings (``lower_decode``, ``lower_chunk``) decide what
goes where in the activation buffers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Buf, Null
from picc.errors import PiccError
from picc.ir.types import DType
from picc.ir.weights import Tensor, WeightStore
from picc.kernel_names import CPU_READ_FORMATS
from runtime.cpu_manifest import STOP_SLOTS, CpuBuffer

SYNC, PARAMS, ZEROS, ACTIVATIONS, SCRATCH = 0, 1, 2, 3, 4
PARAM_SLOTS = {"pos": 0, "token": 1, "greedy": 2, "seq": 3, "steps": 4, "done": 5, "batch": 6, "stops": 8}
"""Where each per-token parameter is (i32 index); ``stops`` is the first of :data:`STOP_SLOTS`."""
MAX_THREADS = 64  # the scratch is sized for this many threads
_KERNEL_DTYPES = CPU_READ_FORMATS


class CpuBuffers:
    """The ``bufs`` table under construction, the extra tensors the .pib stores for the kernels
    (``extra``) and the weights stored in another layout (``layouts``: name -> ``rows8`` /
    ``rowplanes``). ``zeros`` bytes of zeros (the widest row a kernel may read as absent)."""

    def __init__(self, weights: WeightStore, zeros: int) -> None:
        self.weights = weights
        self.entries: list[CpuBuffer] = [CpuBuffer("sync", nbytes=SYNC_BYTES),
                                         CpuBuffer("params", nbytes=4 * (PARAM_SLOTS["stops"] + STOP_SLOTS)),
                                         CpuBuffer("zeros", nbytes=zeros)]
        self.extra: dict[str, Tensor] = {}
        self.layouts: dict[str, str] = {}
        self.row_weights: set[str] = set()  # weights some kernel reads in their own (row) layout
        self.weight_index: dict[str, int] = {}
        self.caches: dict[str, Buf] = {}  # KV cache name -> its buffer (k rows, then v rows)
        self.slot("activations")  # ACTIVATIONS: the step's values (lower_decode)
        self.slot("scratch")  # SCRATCH: grown by need_scratch

    def add(self, entry: CpuBuffer) -> int:
        """Append ``entry``; its index."""
        self.entries.append(entry)
        return len(self.entries) - 1

    def slot(self, name: str, nbytes: int = 0) -> int:
        """A new ``alloc`` buffer (zeroed memory the code owns), grown later by :meth:`grow`."""
        return self.add(CpuBuffer("alloc", name=name, nbytes=nbytes))

    def grow(self, index: int, nbytes: int) -> None:
        """Make ``alloc`` buffer ``index`` at least ``nbytes`` long."""
        entry = self.entries[index]
        assert entry.nbytes is not None
        self.entries[index] = replace(entry, nbytes=max(entry.nbytes, nbytes))

    def need_scratch(self, nbytes: int) -> Buf:
        """The kernels' shared scratch, at least ``nbytes`` long."""
        self.grow(SCRATCH, nbytes)
        return Buf(SCRATCH)

    def own(self, nbytes: int, name: str) -> Buf:
        return Buf(self.slot(name, nbytes))

    def kv_cache(self, name: str, nbytes: int, planes: int, k_nbytes: int) -> Buf:
        """The KV cache ``name``, shared by the step and the chunk programs: ``planes`` runs of the
        context's positions (each KV head's k rows, ``k_nbytes`` in all, then each one's v rows),
        ``nbytes`` in all."""
        if name not in self.caches:
            entry = CpuBuffer("kv", name=f"kv.{name}", nbytes=nbytes, planes=planes, k_nbytes=k_nbytes)
            self.caches[name] = Buf(self.add(entry))
        return self.caches[name]

    def weight(self, name: str | None, *, as_f32: bool = False, offset: int = 0,
               layout: str | None = None) -> Buf | Null:
        """A weight's buffer; ``as_f32`` stores vectors the kernels read as f32 in f32; ``layout``
        (``rows8``, ``rowplanes``) stores a matrix in that layout instead of GGUF's rows (every
        kernel that reads it must ask for the same one)."""
        if name is None:
            return Null()
        t = self.weights[name]
        if not as_f32:
            held = self.layouts.get(name, "row" if name in self.row_weights else None)
            if held is not None and held != (layout or "row"):
                raise PiccError(f"codegen_cpu: weight @{name} is read both in the {held} layout and in the "
                                f"{layout or 'row'} layout")
            if layout is not None:
                self.layouts[name] = layout
            else:
                self.row_weights.add(name)
        if as_f32 and t.dtype != DType.F32:
            converted = f"cpu.f32.{name}"
            if converted not in self.extra:
                self.extra[converted] = Tensor.from_f32(t.to_f32())
            name = converted
        elif not as_f32 and t.dtype.value not in _KERNEL_DTYPES:
            raise PiccError(f"codegen_cpu: weight @{name} is {t.dtype.value}; the CPU kernels read "
                            f"{', '.join(_KERNEL_DTYPES)}")
        return self.tensor_buffer(name, offset)

    def tensor_buffer(self, name: str, offset: int = 0) -> Buf:
        """The ``bufs`` entry of the .pib tensor ``name`` (a weight or an extra tensor)."""
        if name not in self.weight_index:
            self.weight_index[name] = self.add(CpuBuffer("weight", name=name))
        return Buf(self.weight_index[name], offset)

    def transposed(self, name: str) -> Buf:
        """A matrix stored transposed, in its own format (f32 / f16: exact), as an extra tensor."""
        converted = f"cpu.t.{name}"
        if converted not in self.extra:
            t = self.weights[name]
            self.extra[converted] = Tensor.from_f32(np.ascontiguousarray(t.to_f32().T), t.dtype)
        return self.tensor_buffer(converted)

    def array(self, name: str, values: np.ndarray) -> Buf:
        """A constant f32 array (the rotary tables) stored as an extra tensor."""
        if name not in self.extra:
            self.extra[name] = Tensor.from_f32(values)
        return self.tensor_buffer(name)
