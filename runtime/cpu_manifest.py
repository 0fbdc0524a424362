"""``cpu/manifest``: what the runtime needs to know about the CPU's code besides the code itself,
as typed records that ``picc.codegen_cpu`` writes and ``runtime.cpu`` reads, serialized here and
nowhere else (beside the schedule's and the GPU's records in :mod:`runtime.contracts`).

* the ``bufs`` table the generated functions index (:class:`CpuBuffer`: the barrier state, the
  per-token parameters, weights mapped from the file, memory the runtime allocates);
* per stage of the decode step its programs (:class:`CpuStage`: the step, the step without the
  head for prompt tokens, and the step's profiled twin);
* where the values that cross to the GPU and the logits live (:class:`ValueBytes`,
  :class:`LogitsRow`);
* the chunk programs for prompts (:class:`CpuChunkProgram`, ``prefill`` and ``logits_chunk``),
  the greedy decode loop (:class:`DecodeLoop`) and the batch step for a server's sequences
  (:class:`CpuBatchProgram`), the last two only where the CPU computes the whole step.

The JSON is part of the ``.pib`` format (``runtime.pib.FORMAT_VERSION``, 7 since these records): a
change of shape here changes the version. A field missing from a file is an error naming the
section, not a default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from runtime.contracts import ContractError, _get

_SECTION = "cpu/manifest"

BUFFER_FIELDS: dict[str, tuple[str, ...]] = {
    "sync": ("nbytes",),  # the barrier state
    "params": ("nbytes",),  # the per-token i32 parameters (PARAM_SLOTS)
    "zeros": ("nbytes",),  # a vector of zeros
    "weight": ("name",),  # a tensor of the .pib, mapped from the file
    "alloc": ("name", "nbytes"),  # zeroed memory the code owns: activations, scratch
    # a KV cache, zeroed: ``planes`` runs of the context's positions, the first half (its KV heads' k
    # rows) ``k_nbytes`` in all, the other (their v rows) the rest: narrower where values are
    "kv": ("name", "nbytes", "planes", "k_nbytes"),
    "profile": ("slots",),  # a profiled step's counters: ``slots`` i64 per thread, while profiling
    "function": ("name",),  # the address of a function, set by the runtime (the decode loop's step)
}
"""The kinds of ``bufs`` entries and the fields each has (in their JSON order)."""

STOP_SLOTS = 8
"""The decode loop's stop tokens: ``params[stops]`` and the next, -1 where unused (a model may
end a reply with any of several tokens: Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``)."""


def _field(data: object, key: str) -> Any:  # noqa: ANN401 - JSON values
    return _get(data, key, _SECTION)


def _int(data: object, key: str) -> int:
    return int(_field(data, key))


def _optional_str(data: object, key: str) -> str | None:
    value = _field(data, key)
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class CpuBuffer:
    """One entry of the ``bufs`` table: a ``kind`` of :data:`BUFFER_FIELDS` with that kind's
    fields set and the others None."""

    kind: str
    name: str | None = None
    nbytes: int | None = None
    slots: int | None = None
    planes: int | None = None  # a KV cache's: each KV head's k rows, then each one's v rows
    k_nbytes: int | None = None  # a KV cache's: the bytes of its k rows (its v rows follow them)

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_FIELDS:
            raise ContractError(f"{_SECTION}: unknown buffer kind {self.kind!r}")
        for key in ("name", "nbytes", "slots", "planes", "k_nbytes"):
            if (getattr(self, key) is None) == (key in BUFFER_FIELDS[self.kind]):
                raise ContractError(f"{_SECTION}: a {self.kind} buffer " +
                                    ("needs" if key in BUFFER_FIELDS[self.kind] else "has no") + f" {key!r}")

    def to_json(self) -> dict:
        return {"kind": self.kind, **{key: getattr(self, key) for key in BUFFER_FIELDS[self.kind]}}

    @classmethod
    def from_json(cls, data: object) -> CpuBuffer:
        kind = str(_field(data, "kind"))
        if kind not in BUFFER_FIELDS:
            raise ContractError(f"{_SECTION}: unknown buffer kind {kind!r}")
        fields = {key: str(_field(data, key)) if key == "name" else _int(data, key) for key in BUFFER_FIELDS[kind]}
        return cls(kind, **fields)


class _IntRecord:
    """A record whose fields are all integers: a JSON object of them, in field order."""

    __slots__ = ()

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: object) -> Any:  # noqa: ANN401 - the subclass
        return cls(*(_int(data, f.name) for f in fields(cls)))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ValueBytes:
    """One token's bytes of a value at byte ``offset`` of ``bufs[buffer]``. ``shared``: another
    value of the step lives in the same bytes (an in-place kernel writes them later in the step),
    so a copy that reads them while the CPU runs on must take its own snapshot first; the other
    values' bytes are written once a step, by their producer."""

    buffer: int
    offset: int
    nbytes: int
    shared: bool

    def to_json(self) -> dict:
        return {"buffer": self.buffer, "offset": self.offset, "nbytes": self.nbytes, "shared": self.shared}

    @classmethod
    def from_json(cls, data: object) -> ValueBytes:
        return cls(_int(data, "buffer"), _int(data, "offset"), _int(data, "nbytes"), bool(_field(data, "shared")))


@dataclass(frozen=True, slots=True)
class LogitsRow(_IntRecord):
    """``n`` f32 logits at byte ``offset`` of ``bufs[buffer]`` (in a chunk: the first token's)."""

    buffer: int
    offset: int
    n: int


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """A value's rows in a chunk's buffer: token t's ``nbytes`` at ``offset + t * stride`` of
    ``bufs[buffer]``."""

    value: str
    buffer: int
    offset: int
    stride: int
    nbytes: int

    def to_json(self) -> dict:
        return {"value": self.value, "buffer": self.buffer, "offset": self.offset, "stride": self.stride,
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: object) -> ChunkRows:
        return cls(str(_field(data, "value")), _int(data, "buffer"), _int(data, "offset"), _int(data, "stride"),
                   _int(data, "nbytes"))


@dataclass(frozen=True, slots=True)
class ProfiledStep:
    """A stage's step with a clock around each call: its symbol, the ``bufs`` entry of its
    counters (a ``profile`` buffer) and per call its kernel and the IR value it computes."""

    step: str
    buffer: int
    calls: tuple[tuple[str, str], ...]

    def to_json(self) -> dict:
        return {"step": self.step, "buffer": self.buffer, "calls": [list(c) for c in self.calls]}

    @classmethod
    def from_json(cls, data: object) -> ProfiledStep:
        calls = tuple((str(kernel), str(label)) for kernel, label in _field(data, "calls"))
        return cls(str(_field(data, "step")), _int(data, "buffer"), calls)


@dataclass(frozen=True, slots=True)
class CpuStage:
    """The CPU's programs of a stage of the decode step: ``step``, ``prefill`` (the step without
    the head, for prompt tokens; the step itself in a stage without head ops) and ``profile``
    (the step's profiled twin). All None: the CPU has no ops in the stage."""

    step: str | None
    prefill: str | None
    profile: ProfiledStep | None = None

    def __post_init__(self) -> None:
        if (self.step is None) != (self.profile is None):
            raise ContractError(f"{_SECTION}: a stage's step and its profiled twin go together")

    def to_json(self) -> dict:
        data: dict = {"step": self.step, "prefill": self.prefill}
        if self.profile is not None:
            data["profile"] = self.profile.to_json()
        return data

    @classmethod
    def from_json(cls, data: object) -> CpuStage:
        step = _optional_str(data, "step")
        profile = ProfiledStep.from_json(_field(data, "profile")) if step is not None else None
        return cls(step, _optional_str(data, "prefill"), profile)


@dataclass(frozen=True, slots=True)
class CpuChunkStage:
    """A stage of a chunk program: the CPU's program over the chunk (None: no CPU ops), the GPU's
    ops (run token by token), the function arguments they read, and the chunk rows each of the
    GPU's tokens uploads before its ops (``gpu_in``) and downloads after them (``gpu_out``)."""

    cpu: str | None
    gpu: tuple[str, ...]
    gpu_args: tuple[str, ...]
    gpu_in: tuple[ChunkRows, ...]
    gpu_out: tuple[ChunkRows, ...]

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "gpu": list(self.gpu), "gpu_args": list(self.gpu_args),
                "gpu_in": [r.to_json() for r in self.gpu_in], "gpu_out": [r.to_json() for r in self.gpu_out]}

    @classmethod
    def from_json(cls, data: object) -> CpuChunkStage:
        def rows(key: str) -> tuple[ChunkRows, ...]:
            return tuple(ChunkRows.from_json(r) for r in _field(data, key))

        return cls(_optional_str(data, "cpu"), tuple(str(op) for op in _field(data, "gpu")),
                   tuple(str(a) for a in _field(data, "gpu_args")), rows("gpu_in"), rows("gpu_out"))


@dataclass(frozen=True, slots=True)
class CpuChunkProgram:
    """The step for up to ``chunk`` tokens (ids in ``bufs[tokens]``, their count in
    ``params[seq]``), stage by stage; ``logits``: where the first token's logits row is (the
    others follow it), when the program computes them. ``step_bits``: every token's values are
    the decode step's bit for bit, whatever the chunk (its matrix ops are the step kernels'
    batched twins, no GEMM and no chunk FFN), so the KV rows a step writes are the rows the
    program writes, and a server may take either for the other."""

    stages: tuple[CpuChunkStage, ...]
    tokens: int
    chunk: int
    logits: LogitsRow | None = None
    step_bits: bool = False

    def to_json(self) -> dict:
        data: dict = {"stages": [st.to_json() for st in self.stages], "tokens": self.tokens, "chunk": self.chunk,
                      "step_bits": self.step_bits}
        if self.logits is not None:
            data["logits"] = self.logits.to_json()
        return data

    @classmethod
    def from_json(cls, data: object) -> CpuChunkProgram:
        logits = LogitsRow.from_json(data["logits"]) if isinstance(data, dict) and "logits" in data else None
        return cls(tuple(CpuChunkStage.from_json(st) for st in _field(data, "stages")),
                   _int(data, "tokens"), _int(data, "chunk"), logits, bool(_field(data, "step_bits")))


@dataclass(frozen=True, slots=True)
class DecodeLoop:
    """``symbol``: greedy decode steps in a loop, each calling the step whose address is in
    ``bufs[step]`` (a ``function`` buffer) and writing its token to ``bufs[out]``, which holds
    ``capacity`` of them."""

    symbol: str
    step: int
    out: int
    capacity: int

    def to_json(self) -> dict:
        return {"symbol": self.symbol, "step": self.step, "out": self.out, "capacity": self.capacity}

    @classmethod
    def from_json(cls, data: object) -> DecodeLoop:
        return cls(str(_field(data, "symbol")), _int(data, "step"), _int(data, "out"), _int(data, "capacity"))


@dataclass(frozen=True, slots=True)
class CpuBatchProgram:
    """``symbol``: the decode step of up to ``capacity`` sequences at once (``params[batch]`` rows;
    ``picc.codegen_cpu.lower_batch``). Row s reads its token from ``bufs[tokens]`` (i32 [s]), its
    position from ``bufs[positions]``, its KV caches through row s of ``bufs[kv_table]`` (one
    pointer per entry of ``caches``, the ``bufs`` indices of the step's KV caches, in that order),
    and leaves its logits at ``logits`` plus ``s * stride`` bytes and its greedy token in
    ``bufs[greedy]`` [s]. ``profile``: the same step with a clock around each call (files
    compiled before it had one: None)."""

    symbol: str
    capacity: int
    stride: int
    logits: LogitsRow
    tokens: int
    positions: int
    greedy: int
    kv_table: int
    caches: tuple[int, ...]
    profile: ProfiledStep | None = None

    def to_json(self) -> dict:
        data = {"symbol": self.symbol, "capacity": self.capacity, "stride": self.stride,
                "logits": self.logits.to_json(), "tokens": self.tokens, "positions": self.positions,
                "greedy": self.greedy, "kv_table": self.kv_table, "caches": list(self.caches)}
        if self.profile is not None:
            data["profile"] = self.profile.to_json()
        return data

    @classmethod
    def from_json(cls, data: object) -> CpuBatchProgram:
        profile = data.get("profile") if isinstance(data, dict) else None
        return cls(str(_field(data, "symbol")), _int(data, "capacity"), _int(data, "stride"),
                   LogitsRow.from_json(_field(data, "logits")), _int(data, "tokens"), _int(data, "positions"),
                   _int(data, "greedy"), _int(data, "kv_table"), tuple(int(i) for i in _field(data, "caches")),
                   ProfiledStep.from_json(profile) if profile is not None else None)


@dataclass(frozen=True)
class CpuManifest:
    """The CPU's code of a ``.pib``: its SIMD level, the most threads it may run on, the slots of
    the per-token parameters, the ``bufs`` table, the stages, where the crossing values and the
    logits live, whether the step writes the greedy token to ``params[greedy]``, the chunk
    programs, the decode loop and the batch step (both None: the model has a GPU part)."""

    simd: str
    max_threads: int
    params: dict[str, int]
    buffers: tuple[CpuBuffer, ...]
    stages: tuple[CpuStage, ...]
    values: dict[str, ValueBytes]
    logits: LogitsRow
    greedy: bool
    prefill: CpuChunkProgram
    logits_chunk: CpuChunkProgram
    decode: DecodeLoop | None
    batch: CpuBatchProgram | None  # None: the model has a GPU part

    def __post_init__(self) -> None:
        if self.logits_chunk.logits is None:
            raise ContractError(f"{_SECTION}: logits_chunk: missing 'logits'")

    def to_json(self) -> dict:
        return {"simd": self.simd, "max_threads": self.max_threads, "params": dict(self.params),
                "buffers": [b.to_json() for b in self.buffers], "stages": [st.to_json() for st in self.stages],
                "values": {name: v.to_json() for name, v in self.values.items()}, "logits": self.logits.to_json(),
                "greedy": self.greedy, "prefill": self.prefill.to_json(), "logits_chunk": self.logits_chunk.to_json(),
                "decode": self.decode.to_json() if self.decode is not None else None,
                "batch": self.batch.to_json() if self.batch is not None else None}

    @classmethod
    def from_json(cls, data: object) -> CpuManifest:
        params = _field(data, "params")
        values = _field(data, "values")
        if not isinstance(params, dict) or not isinstance(values, dict):
            raise ContractError(f"{_SECTION}: 'params' and 'values' are mappings")
        decode, batch = _field(data, "decode"), _field(data, "batch")
        return cls(str(_field(data, "simd")), _int(data, "max_threads"),
                   {str(k): int(v) for k, v in params.items()},
                   tuple(CpuBuffer.from_json(b) for b in _field(data, "buffers")),
                   tuple(CpuStage.from_json(st) for st in _field(data, "stages")),
                   {str(k): ValueBytes.from_json(v) for k, v in values.items()},
                   LogitsRow.from_json(_field(data, "logits")), bool(_field(data, "greedy")),
                   CpuChunkProgram.from_json(_field(data, "prefill")),
                   CpuChunkProgram.from_json(_field(data, "logits_chunk")),
                   DecodeLoop.from_json(decode) if decode is not None else None,
                   CpuBatchProgram.from_json(batch) if batch is not None else None)
