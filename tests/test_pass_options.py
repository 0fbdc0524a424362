"""Pass options: typed dataclasses parsed once from pipeline text, printed back, and passed as
objects (a loaded target) by ``picc compile``; ``picc sparsify``'s sweep through the pass manager."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import tiny_llama, with_tokenizer

from picc import compile as compile_module
from picc import targets
from picc.compile import CompileOptions, compile_model
from picc.errors import PiccError
from picc.passes import PASSES, PassSpec, parse_pipeline
from picc.passes import manager as pass_manager
from picc.passes.insert_predictors import InsertOptions
from picc.passes.options import describe_options
from picc.passes.partition_neurons import PartitionOptions
from picc.passes.profile_activations import ProfileOptions
from picc.passes.select_kernels import SelectOptions
from picc.sparsity.sparsify import SWEEP, SparsifyOptions, sweep
from picc.targets import load_target


def test_options_are_parsed_into_the_passes_dataclasses():
    specs = parse_pipeline("profile-activations{tokens=512,target-sparsity=0.4,cache=off},"
                           "insert-predictors{mode=gate-first,recall=0.9},select-kernels{int_dots=no}")
    assert specs[0].options == ProfileOptions(tokens=512, target_sparsity=0.4, cache=False)
    assert specs[1].options == InsertOptions(mode="gate-first", recall=0.9)
    assert specs[2].options == SelectOptions(int_dots="no")
    assert parse_pipeline("insert-predictors")[0].options == InsertOptions()


@pytest.mark.parametrize("text", [
    "canonicalize,neuron-major-down{dtype=f16},profile-activations{calib=ptb-valid,tokens=512,window=64,seed=3,"
    "target-sparsity=0.4,rule=cats,cache=off},insert-predictors{mode=predictor,recall=0.95,budget=0.5,tokens=1024,"
    "seed=1,predictors=/tmp/p,cache=off},partition-neurons{target=pc-low,vram=1GB,ctx=64,solver=ilp,min_split=8},"
    "fuse-gather-gemv{interleave=no},dce,select-kernels{int_dots=yes}",
    "canonicalize,dce,partition-neurons,select-kernels",
])
def test_text_to_specs_to_text_round_trips(text):
    specs = parse_pipeline(text)
    assert ",".join(map(str, specs)) == text
    assert parse_pipeline(text) == specs


def test_only_options_that_differ_from_their_defaults_are_printed():
    specs = parse_pipeline("profile-activations{tokens=4096,window=256,rule=fisher},partition-neurons{target=cpu}")
    assert [str(s) for s in specs] == ["profile-activations", "partition-neurons"]


@pytest.mark.parametrize("text, message", [
    ("profile-activations{tokenz=4}", "pipeline: pass 'profile-activations' got option 'tokenz=4'; accepted options: "
     "calib, tokens, window, seed, target-sparsity, rule, fisher-tokens, cache"),
    ("profile-activations{tokens=many}", "pipeline: pass 'profile-activations': option tokens='many': "
     "expected an integer"),
    ("insert-predictors{recall=most}", "pipeline: pass 'insert-predictors': option recall='most': expected a number"),
    ("select-kernels{int_dots=maybe}", "pipeline: pass 'select-kernels': option int_dots='maybe': "
     "expected one of auto, no, yes"),
    ("profile-activations{cache=sometimes}", "pipeline: pass 'profile-activations': option cache='sometimes': "
     "expected on or off"),
    ("partition-neurons{ctx=0}", "pipeline: pass 'partition-neurons': option ctx='0': expected an integer >= 1"),
    ("partition-neurons{solver=magic}", "pipeline: pass 'partition-neurons': option solver='magic': "
     "expected one of greedy, ilp"),
    ("partition-neurons{target=pc-mid}", "pipeline: pass 'partition-neurons': unknown target 'pc-mid'"),
    ("partition-neurons{target=cpu,vram=1GB}", "pipeline: pass 'partition-neurons': vram 1GB: target 'cpu' has no GPU"),
    ("insert-predictors{budget=2}", "pipeline: pass 'insert-predictors': option budget=2.0: expected a share in (0, 1]"),
])
def test_bad_options_are_one_line_errors_when_the_pipeline_is_parsed(text, message):
    with pytest.raises(PiccError) as e:
        parse_pipeline(text)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_options_built_in_python_are_checked_and_must_be_the_passes_own():
    with pytest.raises(PiccError, match=r"^option mode='sometimes': expected one of auto, predictor"):
        InsertOptions(mode="sometimes")
    with pytest.raises(PiccError, match="pass 'select-kernels' takes SelectOptions, not InsertOptions"):
        PassSpec("select-kernels", InsertOptions())
    with pytest.raises(PiccError, match="unknown pass 'frobnicate'"):
        PassSpec("frobnicate")
    assert PassSpec("select-kernels").options == SelectOptions()


def test_a_target_option_takes_a_loaded_target_and_prints_where_it_came_from(tmp_path):
    target = load_target("pc-low")
    spec = PassSpec("partition-neurons", PartitionOptions(target=target, vram="1GB"))
    assert spec.options.target is target and spec.options.budget == 10**9
    assert str(spec) == "partition-neurons{target=pc-low,vram=1GB}"
    path = tmp_path / "box.yaml"
    path.write_text((Path(targets.__file__).parent / "pc-low.yaml").read_text())
    (parsed,) = parse_pipeline(f"partition-neurons{{target={path}}}")
    assert parsed.options.target == target and str(parsed) == f"partition-neurons{{target={path}}}"


def test_help_lists_each_passes_options_with_their_types_and_defaults():
    text = describe_options(PASSES["profile-activations"].options)
    assert text.startswith("calib: str = ptb, tokens: int = 4096, window: int = 256, seed: int = 0, "
                           "target-sparsity: float, rule: fisher|cats = fisher, fisher-tokens: int = 2048, cache: on|off = on")
    assert describe_options(PASSES["dce"].options) == ""


def test_a_compile_loads_its_target_once(monkeypatch):
    """compile_model checks the options, runs the pipeline, weighs the GPU part against the CPU
    alone and compiles again for it: one Target object throughout."""
    loads: list[str] = []
    real = targets.target_from_dict
    monkeypatch.setattr(targets, "target_from_dict", lambda data, label: loads.append(label) or real(data, label))
    monkeypatch.setattr(compile_module, "cpu_code", lambda *a: ({}, {}, {}))  # no code generation: not tested here
    said: list[str] = []
    compiled = compile_model(tiny_llama("reglu"), CompileOptions(target="pc-low", dense=True), say=said.append)
    assert loads == ["pc-low.yaml"]
    assert any(note.startswith("nothing on the GPU") for note in compiled.report["notes"])  # compiled twice
    assert compiled.meta["target"] == "pc-low"
    assert any(line.startswith("pipeline: canonicalize,neuron-major-down,partition-neurons{target=pc-low}")
               for line in said), said


def test_the_sparsity_sweep_runs_insert_predictors_through_the_pass_manager(monkeypatch, tmp_path):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))
    verified: list[int] = []
    real = pass_manager.verify
    monkeypatch.setattr(pass_manager, "verify", lambda module: verified.append(1) or real(module))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=1, hidden=32, n_ff=64))
    points = sweep(model, replace(SparsifyOptions(), mode="gate-first", tokens=256, window=64))
    assert [p.target for p in points] == list(SWEEP)
    assert len(verified) == len(SWEEP)
