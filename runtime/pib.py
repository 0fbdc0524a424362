"""The ``.pib`` container: one file holding everything a compiled model needs to run.

Layout (all integers little-endian)::

    0    preamble, 128 bytes:
           magic        8 bytes  b"PICCPIB\\0"
           version      u32      FORMAT_VERSION
           flags        u32      0 (reserved)
           index_offset u64      where the index (JSON) starts
           index_length u64
           file_length  u64      the whole file's size
           sha256       32 bytes of bytes [128, file_length): everything after the preamble
           zero padding to 128
    128  sections and tensors, each starting at a multiple of ALIGN (64) bytes
    ...  the index: JSON {"sections": {name: [offset, length]},
                          "tensors": {name: {"dtype", "shape", "offset", "nbytes"[, "layout"]}}}

Sections are named blobs: ``ir`` (the final IR text), ``plan`` (the memory plan, JSON), ``report``
(the placement report, JSON), ``tokenizer`` (JSON), ``meta`` (JSON), and the code the backends add
(``cpu/...``, ``cuda/...``). The JSON of ``schedule``, ``gpu/launches`` and ``cuda/manifest`` is
written and read by the records of ``runtime.contracts``, that of ``cpu/manifest`` by those of
``runtime.cpu_manifest``. Tensors are the weights in their storage format (quantized blocks as
GGUF lays them out), mapped read-only from the file without copying. A tensor with a ``layout``
is stored in another order for the kernels that read it (the same bytes, rearranged): ``rows8``,
a 4-bit matrix in groups of eight rows (``picc.codegen_cpu.rows8``), ``rowplanes``, each row's
block scales before its quants (``picc.codegen_cpu.rowplanes``), or ``dotplanes``, each row's 4-bit
quants before its scales (``picc.codegen_cpu.dotplanes``).

A file that is too short, not a .pib, of another format version, truncated, or whose checksum does
not match is refused with a :class:`PibError` that says which. This module is the runtime's: it
never imports the compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.contracts import ContractError
from runtime.plan import MemoryPlan

MAGIC = b"PICCPIB\0"
FORMAT_VERSION = 17  # 2: staged CPU programs and the hybrid schedule; 3: tensor layouts (rows8); 4: rowplanes;
# 5: chunk programs by stage (hybrid models prefill in chunks too); 6: the GPU's FFN kernels sum their
# down rows in slices (y_part scratch); version 5's wrote past their outputs on a real GPU; 7: cpu/manifest
# as the typed records of runtime.cpu_manifest, every field required (the chunk programs, each stage's
# profiled twin, the decode loop or null): the runtime no longer guesses for files that lack one; 8: GPU
# kernels that wait for their predecessors themselves (cuda/manifest's dependent_launch) and GPU residual
# adds done by their producers' kernels; 9: cpu/manifest's batch step (a server's sequences decoded together)
# 10: rowplanes' 4-bit quants in units of four blocks (sixteen lanes of eight nibbles); 11: the dotplanes
# layout (a fused FFN's gathered 4-bit rows: nibbles, then scales) and the IR's gathered_layout
# 12: cpu/manifest's crossing values say whether another value shares their bytes (copied without a snapshot)
# 13: cpu/manifest's KV caches are buffers of their own kind with their layout (a server copies a prompt's rows)
# 14: cpu/manifest's chunk programs say whether they compute the step's bits (a server takes a reply's rows too)
# 15: the decode loop stops at any of several tokens (params[stops], STOP_SLOTS of them; no params[eos]), and
# the GPU's rope kernels read the cosines' and sines' factor after the frequencies (longrope's attention factor)
# 16: mxfp4 tensors (gpt-oss's experts, 17-byte blocks), and the GPU's attention kernels of an op with sinks
# take them after the value cache
# 17: cpu/manifest's KV caches say how many bytes their k rows take (k_nbytes): v rows may be narrower (v_head_dim)
PREAMBLE = 128
ALIGN = 64
_HEAD = struct.Struct("<8sIIQQQ32s")  # magic, version, flags, index offset/length, file length, sha256

# How each IR dtype is stored: numpy element type and, for block formats, (block size, bytes).
STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32, "i64": np.int64,
           "bool": np.uint8, "q4_0": np.uint8, "q4_1": np.uint8, "q8_0": np.uint8, "mxfp4": np.uint8}
BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "mxfp4": (32, 17)}


class PibError(Exception):
    """A .pib file that cannot be used; the message names the file and what is wrong."""


def storage_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the stored array: block formats store each row's blocks as bytes."""
    if dtype not in BLOCKS:
        return shape
    size, nbytes = BLOCKS[dtype]
    return (*shape[:-1], shape[-1] // size * nbytes)


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as the file holds it: IR dtype, logical shape, the stored array (a view), and its
    layout when not GGUF's rows (``rows8``, ``rowplanes``, ``dotplanes``)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    layout: str | None = None


class PibFile:
    """An opened .pib: its sections and tensors, memory-mapped; ``close`` releases the mapping."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise PibError(f"{self.path}: no such file") from None
        except ValueError:  # an empty file cannot be mapped
            raise PibError(f"{self.path}: truncated: the file is empty") from None
        except OSError as e:
            raise PibError(f"{self.path}: cannot read ({e.strerror})") from None
        try:
            self._index = self._open(verify)
        except BaseException:
            self._map.close()
            raise

    def _fail(self, what: str) -> PibError:
        return PibError(f"{self.path}: {what}")

    def _open(self, verify: bool) -> dict:
        size = len(self._map)
        if size < 8 or self._map[:8] != MAGIC:
            raise self._fail("not a picc .pib file (bad magic bytes)")
        if size < PREAMBLE:
            raise self._fail(f"truncated: {size} bytes, shorter than the {PREAMBLE}-byte header")
        magic, version, _, index_offset, index_length, file_length, digest = _HEAD.unpack_from(self._map, 0)
        if version != FORMAT_VERSION:
            raise self._fail(f"format version {version}; this picc reads version {FORMAT_VERSION} "
                             "(recompile the model with this picc)")
        if size < file_length:
            raise self._fail(f"truncated: the header says {file_length} bytes, the file has {size}")
        if size > file_length:
            raise self._fail(f"corrupted: {size - file_length} bytes beyond the {file_length} the header says")
        if verify and hashlib.sha256(memoryview(self._map)[PREAMBLE:]).digest() != digest:
            raise self._fail("corrupted: the checksum does not match the contents")
        if not PREAMBLE <= index_offset <= index_offset + index_length <= file_length:
            raise self._fail("corrupted: the index lies outside the file")
        try:
            index = json.loads(bytes(self._map[index_offset : index_offset + index_length]))
            for off, length in index["sections"].values():
                if not PREAMBLE <= off <= off + length <= index_offset:
                    raise ValueError("a section lies outside the data")
            for t in index["tensors"].values():
                if not PREAMBLE <= t["offset"] <= t["offset"] + t["nbytes"] <= index_offset:
                    raise ValueError("a tensor lies outside the data")
        except (ValueError, KeyError, TypeError) as e:
            raise self._fail(f"corrupted: unreadable index ({e})") from None
        return index

    @property
    def sections(self) -> tuple[str, ...]:
        return tuple(self._index["sections"])

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self._index["tensors"])

    def has(self, section: str) -> bool:
        return section in self._index["sections"]

    def section(self, name: str) -> bytes:
        if name not in self._index["sections"]:
            raise self._fail(f"has no section {name!r} (it has: {', '.join(self.sections)})")
        offset, length = self._index["sections"][name]
        return bytes(self._map[offset : offset + length])

    def text(self, name: str) -> str:
        return self.section(name).decode("utf-8")

    def json(self, name: str) -> dict:
        return json.loads(self.section(name))

    def plan(self) -> MemoryPlan:
        """The memory plan (the ``plan`` section), typed; a malformed one is a ``PibError``."""
        try:
            return MemoryPlan.from_json(self.json("plan"))
        except ContractError as e:
            raise self._fail(str(e)) from None

    def tensor(self, name: str) -> StoredTensor:
        """The stored array of tensor ``name``: a read-only view of the mapped file (no copy)."""
        t = self._index["tensors"].get(name)
        if t is None:
            raise self._fail(f"has no tensor {name!r}")
        dtype, shape = t["dtype"], tuple(t["shape"])
        element = np.dtype(STORAGE[dtype])
        data = np.frombuffer(self._map, dtype=element, count=t["nbytes"] // element.itemsize, offset=t["offset"])
        return StoredTensor(dtype, shape, data.reshape(storage_shape(dtype, shape)), t.get("layout"))

    def release_pages(self) -> None:
        """Unmap the file's pages from this process (``MADV_DONTNEED``: they stay in the page cache,
        and reading the mapping again maps them back): for a caller that has copied what it reads."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Release the mapping; arrays from ``tensor`` must not be used afterwards."""
        # With views still alive the mapping cannot close now; it goes when they do.
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> PibFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PibWriter:
    """Writes a .pib to an open binary file: ``add_section`` / ``add_tensor``, then ``finish``.

    The caller makes the file appear atomically (the compiler writes to a temp file and renames).
    """

    def __init__(self, f) -> None:  # noqa: ANN001 - any writable, seekable binary file
        self._f = f
        self._hash = hashlib.sha256()
        self._pos = PREAMBLE
        self._sections: dict[str, list[int]] = {}
        self._tensors: dict[str, dict] = {}
        f.write(b"\0" * PREAMBLE)

    def _write(self, data: bytes | memoryview) -> int:
        pad = -self._pos % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            self._hash.update(b"\0" * pad)
            self._pos += pad
        start = self._pos
        self._f.write(data)
        self._hash.update(data)
        self._pos += len(data)
        return start

    def add_section(self, name: str, data: bytes | str) -> None:
        if name in self._sections:
            raise ValueError(f"section {name!r} written twice")
        blob = data.encode("utf-8") if isinstance(data, str) else data
        self._sections[name] = [self._write(blob), len(blob)]

    def add_tensor(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray,
                   layout: str | None = None) -> None:
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} written twice")
        blob = memoryview(np.ascontiguousarray(data)).cast("B")
        self._tensors[name] = {"dtype": dtype, "shape": list(shape), "offset": self._write(blob),
                               "nbytes": len(blob)}
        if layout is not None:
            self._tensors[name]["layout"] = layout

    def finish(self) -> None:
        index = json.dumps({"sections": self._sections, "tensors": self._tensors}).encode("utf-8")
        index_offset = self._write(index)
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, index_offset, len(index), self._pos, self._hash.digest())
        self._f.seek(0)
        self._f.write(head.ljust(PREAMBLE, b"\0"))
        self._f.flush()
