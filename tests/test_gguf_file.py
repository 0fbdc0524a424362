"""picc's own GGUF reader (``picc.frontend.gguf_file``) against the ``gguf`` package's reader.

The two must agree on every metadata value and every tensor's type, dimensions and bytes, on
the shipped SmolLM2 file and on a small file holding every value type; malformed files are
refused with a one-line error that says what is wrong.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from picc.errors import PiccError
from picc.frontend import aliases, load_model
from picc.frontend.gguf_file import GgufFile

_COUNTS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the gguf reader's own header fields


def assert_same_as_the_gguf_package(path) -> None:
    ours, theirs = GgufFile(path), gguf.GGUFReader(str(path))
    assert set(ours._fields) == set(theirs.fields) - _COUNTS
    for key, field in theirs.fields.items():
        if key not in _COUNTS:
            assert ours.get(key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.type_name, list(a.dims)) == (b.tensor_type.name, b.shape.tolist()), a.name
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), a.name


def test_the_shipped_smollm2_file_reads_as_the_gguf_package_reads_it():
    assert_same_as_the_gguf_package(aliases.resolve_alias("smollm2"))


def write_every_value_type(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo\n")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.empty", [])
    w.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("q4_1", np.arange(40, dtype=np.uint8).reshape(2, 20), raw_shape=(2, 20),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
    path = tmp_path / "values.gguf"
    write_every_value_type(path, alignment)
    assert_same_as_the_gguf_package(path)
    f = GgufFile(path)
    assert f.get("t.strs") == ["a", "", "ünï"] and f.get("t.u64") == 2**63 + 5 and f.get("absent", 7) == 7
    f16 = next(t for t in f.tensors if t.name == "f16")
    assert f16.data.dtype == np.float16 and f16.data.tolist() == list(range(64))


def test_a_truncated_file_is_refused_wherever_it_ends(tmp_path):
    """Cut inside the header, the metadata, the tensor table and the data: each is a one-line
    error naming the file, never a crash or a short tensor."""
    whole = tmp_path / "whole.gguf"
    write_every_value_type(whole)
    raw = whole.read_bytes()
    f = GgufFile(whole)
    starts = [t.data.ctypes.data - f._bytes.ctypes.data for t in f.tensors]
    data_start, data_end = min(starts), max(s + t.data.nbytes for s, t in zip(starts, f.tensors, strict=True))
    # magic, counts, a metadata string, the last tensor info (44 bytes, then < 32 of padding),
    # the first tensor's bytes, the last tensor's last byte
    for cut in (2, 10, 60, data_start - 40, data_start + 10, data_end - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(raw[:cut])
        with pytest.raises(PiccError) as e:
            load_model(path)
        message = str(e.value)
        assert message.startswith(f"{path}: not a readable GGUF file") and "\n" not in message, message


def test_a_version_or_byte_order_picc_does_not_read_is_named(tmp_path):
    path = tmp_path / "v9.gguf"
    write_every_value_type(path)
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 9)
    path.write_bytes(bytes(raw))
    with pytest.raises(PiccError, match=r"v9.gguf: not a readable GGUF file \(ValueError: GGUF version 9 \(picc reads "
                                        r"versions 2 and 3, little-endian\)\)"):
        load_model(path)
    raw[4:8] = struct.pack(">I", 3)  # what a big-endian writer puts there
    path.write_bytes(bytes(raw))
    with pytest.raises(PiccError, match=r"v9.gguf: not a readable GGUF file \(ValueError: a big-endian GGUF file"):
        load_model(path)
