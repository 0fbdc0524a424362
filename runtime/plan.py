"""``plan``: the memory plan of a compiled model, as the typed record both sides import.

``picc.placement.memory_plan`` builds it (every weight, KV cache, constant and the activation
arena of each device, with the GPU buffers' offsets in one arena); the runtime reads it to size
the GPU arena, find the activation slots and know how many positions the KV caches hold. The
JSON form (``to_json`` / ``from_json``, here only) is the ``.pib``'s ``plan`` section; a field
missing from a file is an error naming the section, and a plan of another ``PLAN_VERSION`` is
refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from runtime.contracts import ContractError, _get

ARENA_ALIGN = 256  # what cudaMalloc guarantees; 16-byte vector loads and 64-byte CPU lines divide it
GREEDY = "greedy"  # the GPU buffer of the greedy decode loop: a token per position, then the next position
PLAN_VERSION = 1
_SECTION = "plan"


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ARENA_ALIGN``: where the next GPU buffer may start."""
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


@dataclass(frozen=True, slots=True)
class Buffer:
    """One allocation: a weight (by name), a layer's KV cache, the activations or the workspace.

    ``offset`` is its place in its device's arena (GPU buffers only; -1 on the CPU).
    """

    name: str
    kind: str  # "weight" | "constant" | "kv-cache" | "activations" | "workspace" | "greedy"
    device: str  # "gpu" | "cpu"
    nbytes: int
    offset: int = -1
    layer: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The buffers of a placed module for ``ctx`` positions, under a GPU budget of ``budget`` bytes."""

    ctx: int
    budget: int
    buffers: tuple[Buffer, ...]
    activation_offsets: dict[str, int]  # GPU value -> offset in the activation arena
    notes: tuple[str, ...] = ()

    @property
    def gpu_bytes(self) -> int:
        """The GPU arena: every GPU buffer at its aligned offset."""
        return max((b.offset + aligned(b.nbytes) for b in self.buffers if b.device == "gpu"), default=0)

    @property
    def cpu_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.device == "cpu")

    def device_bytes(self, device: str, kind: str | None = None, layer: int | None = None) -> int:
        """Bytes (aligned on the GPU) of the buffers on ``device``, optionally of one kind / layer."""
        return sum(aligned(b.nbytes) if device == "gpu" else b.nbytes for b in self.buffers
                   if b.device == device and (kind is None or b.kind == kind)
                   and (layer is None or b.layer == layer))

    def buffer(self, name: str) -> Buffer | None:
        return next((b for b in self.buffers if b.name == name), None)

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "ctx": self.ctx, "budget": self.budget,
                "gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes, "notes": list(self.notes),
                "buffers": [asdict(b) for b in self.buffers],
                "activation_offsets": self.activation_offsets}

    @staticmethod
    def from_json(data: object) -> MemoryPlan:
        version = _get(data, "version", _SECTION)
        if version != PLAN_VERSION:
            raise ContractError(f"{_SECTION}: version {version!r}; this picc reads version {PLAN_VERSION}")
        try:
            buffers = tuple(Buffer(**b) for b in _get(data, "buffers", _SECTION))
        except TypeError as e:
            raise ContractError(f"{_SECTION}: a buffer entry: {e}") from None
        return MemoryPlan(int(_get(data, "ctx", _SECTION)), int(_get(data, "budget", _SECTION)), buffers,
                          {k: int(v) for k, v in _get(data, "activation_offsets", _SECTION).items()},
                          tuple(_get(data, "notes", _SECTION)))
