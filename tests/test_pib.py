"""The .pib container: what goes in comes out, mapped without copies; damaged files are refused."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from conftest import tiny_llama, word_tokenizer

from picc.errors import PiccError
from picc.frontend import load_model
from picc.interpreter import Interpreter
from picc.ir.printer import print_module
from picc.ir.types import DType
from picc.pib import load_pib, write_pib
from runtime.pib import ALIGN, FORMAT_VERSION, PREAMBLE, PibError, PibFile, PibWriter


@pytest.fixture
def pib(tmp_path):
    model = tiny_llama("swiglu", n_layers=2, matrix_dtype=DType.Q4_1)
    model = type(model)(model.module, model.weights, word_tokenizer(128), "tiny")
    path = tmp_path / "tiny.pib"
    size = write_pib(path, model, plan={"gpu_bytes": 0}, report={"target": "cpu"}, meta={"source": "tiny"},
                     extra={"cpu/code.ll": b"; llvm ir"})
    assert size == path.stat().st_size
    return model, path


def test_round_trip_keeps_ir_weights_tokenizer_and_sections(pib):
    model, path = pib
    with PibFile(path) as f:
        assert f.text("ir") == print_module(model.module)
        assert f.json("report") == {"target": "cpu"}
        assert f.section("cpu/code.ll") == b"; llvm ir"
        for name in model.weights:
            stored = f.tensor(name)
            t = model.weights[name]
            assert (stored.dtype, stored.shape) == (t.dtype.value, t.shape)
            assert stored.data.tobytes() == np.ascontiguousarray(t.data).tobytes()
            # Mapped, not copied: a read-only view into the file, 64-byte aligned within it.
            assert not stored.data.flags.owndata and not stored.data.flags.writeable
            offset = f._index["tensors"][name]["offset"]
            assert offset % ALIGN == 0
    loaded = load_pib(path)
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("the company") == model.tokenizer.encode("the company")
    tokens = np.arange(5, 15)
    np.testing.assert_array_equal(Interpreter(loaded.module, loaded.weights).run(tokens),
                                  Interpreter(model.module, model.weights).run(tokens))
    assert load_model(path).module == model.module  # the frontend dispatches .pib too


def damage(path, edit) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d[: len(d) // 2], "truncated: the header says"),
    (lambda d: d[:100], "truncated: 100 bytes, shorter than the 128-byte header"),
    (lambda d: d + b"xx", "corrupted: 2 bytes beyond"),
    (lambda d: d[:PREAMBLE + 10] + bytes([d[PREAMBLE + 10] ^ 0x40]) + d[PREAMBLE + 11 :], "corrupted: the checksum"),
    (lambda d: d[:8] + struct.pack("<I", FORMAT_VERSION + 1) + d[12:], f"format version {FORMAT_VERSION + 1}; this picc reads version {FORMAT_VERSION}"),
    # Version 6, whose cpu/manifest the runtime read key by key with fallbacks, is refused, not half-read.
    (lambda d: d[:8] + struct.pack("<I", 6) + d[12:], f"format version 6; this picc reads version {FORMAT_VERSION}"),
    (lambda d: b"GGUF" + d[4:], "not a picc .pib file"),
    (lambda d: b"", "truncated: the file is empty"),
])
def test_damaged_files_are_refused_saying_how(pib, edit, message):
    _, path = pib
    damage(path, edit)
    with pytest.raises(PibError, match=message) as e:
        PibFile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PiccError, match=message):
        load_model(path)


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    model = tiny_llama("swiglu", n_layers=1)
    path = tmp_path / "m.pib"

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PibWriter, "add_tensor", boom)
    with pytest.raises(OSError, match="disk full"):
        write_pib(path, model, plan={}, report={}, meta={})
    assert list(tmp_path.iterdir()) == []


def test_the_memory_plan_is_one_typed_record_on_both_sides():
    # picc writes the plan and the runtime reads it through runtime.plan.MemoryPlan: a round trip
    # keeps every field; a plan of another version or without a field is refused by name.
    from runtime.contracts import ContractError
    from runtime.plan import PLAN_VERSION, Buffer, MemoryPlan

    plan = MemoryPlan(64, 1 << 20, (Buffer("w", "weight", "gpu", 1000, 0, 3), Buffer("kv.l0", "kv-cache", "cpu", 512)),
                      {"x": 0}, ("a note",))
    data = json.loads(json.dumps(plan.to_json()))
    assert MemoryPlan.from_json(data) == plan and data["gpu_bytes"] == 1024 and data["cpu_bytes"] == 512
    with pytest.raises(ContractError, match=f"plan: version 0; this picc reads version {PLAN_VERSION}"):
        MemoryPlan.from_json({**data, "version": 0})
    with pytest.raises(ContractError, match="plan: missing 'activation_offsets'"):
        MemoryPlan.from_json({k: v for k, v in data.items() if k != "activation_offsets"})
