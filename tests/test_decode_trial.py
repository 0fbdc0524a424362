"""A default compile for this CPU settles sparse against dense by decoding with both builds."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import pytest
from conftest import tiny_llama, with_tokenizer

from picc import compile as compile_mod
from picc import decode_trial
from picc.compile import CompileOptions, compile_model
from picc.ir.fused_ops import FusedFFN
from picc.ir.types import DType
from picc.sparsity.sparsify import SparsifyOptions
from picc.targets import load_target
from picc.targets.host import is_host

SPARSITY = SparsifyOptions(mode="gate-first", tokens=512, window=64, budget=0.5)


@pytest.fixture(scope="module")
def model():
    return with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_1))


def sparse(compiled) -> bool:
    return any(isinstance(op, FusedFFN) and op.mode != "dense" for op in compiled.model.module.ops())


@pytest.mark.parametrize(("rates", "kept"), [((100.0, 200.0), False), ((203.0, 200.0), False),
                                             ((210.0, 200.0), True)])
def test_a_default_compile_keeps_the_build_that_decodes_faster_here(model, monkeypatch, rates, kept):
    # The estimates favour sparsity (both estimate checks say so here); the builds' timed rates
    # (sparse, dense) decide: sparse only when at least MARGIN (3%) faster, as it costs accuracy.
    monkeypatch.setattr(compile_mod, "_dense_unless_sparse_can_win", lambda *a, **k: None)
    monkeypatch.setattr(compile_mod, "_dense_if_faster", lambda *a, **k: None)
    timed = []
    monkeypatch.setattr(decode_trial, "decode_rates", lambda builds, say: timed.append(builds) or list(rates))
    said: list[str] = []
    chosen = compile_model(model, CompileOptions(sparsity=SPARSITY, batch_step=False), say=said.append)
    (builds,) = timed
    assert [sparse(b) for b in builds] == [True, False]
    assert sparse(chosen) == kept
    assert chosen is builds[0 if kept else 1]
    line = next(s for s in said if "decoding here at" in s)
    assert line.startswith("keeping the sparse model" if kept else "compiling the dense model")
    assert f"~{rates[0]:.0f} tokens/s sparse, ~{rates[1]:.0f} dense" in line
    assert chosen.report["dense_measured_tokens_per_s"] == rates[1]
    assert any("chosen by timing both builds" in note for note in chosen.report["notes"])
    # --sparse keeps sparsity without timing anything.
    timed.clear()
    kept_sparse = compile_model(model, CompileOptions(sparsity=SPARSITY, sparse=True, batch_step=False),
                                say=lambda _: None)
    assert sparse(kept_sparse) and not timed


def test_decode_rates_times_each_build_and_leaves_nothing_behind(model, tmp_path, monkeypatch):
    builds = [compile_model(model, CompileOptions(sparsity=SPARSITY, sparse=True, batch_step=False),
                            say=lambda _: None),
              compile_model(model, CompileOptions(dense=True, batch_step=False), say=lambda _: None)]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    said: list[str] = []
    rates = decode_trial.decode_rates(builds, said.append)
    assert rates is not None and len(rates) == 2 and all(r > 0 for r in rates)
    assert said and "timing 2 builds" in said[0]
    assert list(tmp_path.iterdir()) == []  # the builds' files are gone
    monkeypatch.setattr(decode_trial, "MAX_BYTES", 1000)  # too large to time: the estimates decide
    assert decode_trial.decode_rates(builds) is None and list(tmp_path.iterdir()) == []


def test_only_this_machines_cpu_is_timed():
    here = load_target("cpu").cpu
    assert is_host(here)
    assert not is_host(replace(here, name=here.name + " (another)"))
    assert not is_host(replace(here, cores=here.cores + 1))
    assert not is_host(load_target("pc-low").cpu)
