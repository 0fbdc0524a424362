"""Passes: golden Before / Expected IR, pipelines, instruments, and error reporting."""

from __future__ import annotations

import io
from dataclasses import dataclass, replace

import numpy as np
import pytest
from conftest import tiny_llama

from picc.errors import PiccError
from picc.interpreter import Interpreter
from picc.ir import parse, print_module, verify
from picc.ir.weights import WeightStore
from picc.passes import PASSES, Instruments, PassContext, parse_pipeline, register_pass, run_pipeline
from picc.passes.options import PassOptions, option

WEIGHTS = """\
module @m

weight @wg : f32[24, 8]
weight @wu : f32[24, 8]
weight @wd : f32[8, 24]
weight @bu : f32[24]
weight @bd : f32[8]
"""


def run(text: str, *passes: str) -> str:
    module = parse(text)
    verify(module)
    out = run_pipeline(module, WeightStore(), parse_pipeline(",".join(passes)))
    return print_module(out)


def func(*ops: str, ret: str) -> str:
    lines = "\n".join(f"  {op}" for op in ops)
    return f"\nfunc @forward(%x: f32[seq, 8]) -> f32[seq, 8] {{\n{lines}\n  return {ret}\n}}\n"


class TestCanonicalizeFoldsFFNs:
    def test_swiglu(self):
        before = WEIGHTS + func(
            "%g = linear %x, @wg : f32[seq, 24]",
            "%u = linear %x, @wu, bias=@bu : f32[seq, 24]",
            "%a = silu %g : f32[seq, 24]",
            "%h = mul %a, %u : f32[seq, 24]",
            "%y = linear %h, @wd, bias=@bd : f32[seq, 8]", ret="%y")
        expected = WEIGHTS + func(
            "%y = ffn %x, @wu, @wd, gate=@wg, up_bias=@bu, down_bias=@bd {form = \"swiglu\"} "
            ": f32[seq, 8]", ret="%y")
        assert run(before, "canonicalize") == expected

    @pytest.mark.parametrize("act, form", [("relu", "reglu"), ("gelu", "geglu"),
                                           ("gelu_tanh", "geglu_tanh")])
    def test_other_glus_with_operands_swapped(self, act, form):
        before = WEIGHTS + func(
            "%g = linear %x, @wg : f32[seq, 24]",
            "%u = linear %x, @wu : f32[seq, 24]",
            f"%a = {act} %g : f32[seq, 24]",
            "%h = mul %u, %a : f32[seq, 24]",
            "%y = linear %h, @wd : f32[seq, 8]", ret="%y")
        expected = WEIGHTS + func(
            f"%y = ffn %x, @wu, @wd, gate=@wg {{form = \"{form}\"}} : f32[seq, 8]", ret="%y")
        assert run(before, "canonicalize") == expected

    def test_drelu(self):
        before = WEIGHTS + func(
            "%g = linear %x, @wg : f32[seq, 24]",
            "%u = linear %x, @wu : f32[seq, 24]",
            "%ga = relu %g : f32[seq, 24]",
            "%ua = relu %u : f32[seq, 24]",
            "%h = mul %ga, %ua : f32[seq, 24]",
            "%y = linear %h, @wd : f32[seq, 8]", ret="%y")
        expected = WEIGHTS + func(
            "%y = ffn %x, @wu, @wd, gate=@wg {form = \"drelu\"} : f32[seq, 8]", ret="%y")
        assert run(before, "canonicalize") == expected

    def test_plain_mlp(self):
        before = WEIGHTS + func(
            "%u = linear %x, @wu, bias=@bu : f32[seq, 24]",
            "%a = relu %u : f32[seq, 24]",
            "%y = linear %a, @wd : f32[seq, 8]", ret="%y")
        expected = WEIGHTS + func(
            "%y = ffn %x, @wu, @wd, up_bias=@bu {form = \"relu\"} : f32[seq, 8]", ret="%y")
        assert run(before, "canonicalize") == expected

    def test_an_intermediate_with_two_readers_is_not_folded(self):
        before = WEIGHTS + func(
            "%u = linear %x, @wu : f32[seq, 24]",
            "%a = relu %u : f32[seq, 24]",
            "%y = linear %a, @wd : f32[seq, 8]",
            "%z = linear %a, @wd : f32[seq, 8]",
            "%s = add %y, %z : f32[seq, 8]", ret="%s")
        assert run(before, "canonicalize") == before

    def test_gate_and_up_from_different_inputs_are_not_folded(self):
        before = WEIGHTS + func(
            "%x2 = relu %x : f32[seq, 8]",
            "%g = linear %x, @wg : f32[seq, 24]",
            "%u = linear %x2, @wu : f32[seq, 24]",
            "%a = silu %g : f32[seq, 24]",
            "%h = mul %a, %u : f32[seq, 24]",
            "%y = linear %h, @wd : f32[seq, 8]", ret="%y")
        assert run(before, "canonicalize") == before


def test_dce_removes_unread_ops_and_weights():
    before = WEIGHTS + func(
        "%u = linear %x, @wu : f32[seq, 24]",
        "%a = relu %u : f32[seq, 24]",
        "%y = relu %x : f32[seq, 8]", ret="%y")
    expected = "module @m\n" + func("%y = relu %x : f32[seq, 8]", ret="%y")
    assert run(before, "dce") == expected


def test_canonicalized_model_computes_the_same_logits():
    """Unfold a model's ffn ops into primitives, canonicalize them back, compare numerically."""
    model = tiny_llama("swiglu", n_layers=2)
    text = print_module(model.module)
    primitive = text
    for i in range(2):
        old = (f"  %l{i}.ffn.out = ffn %l{i}.ffn_norm, @l{i}.ffn.up, @l{i}.ffn.down, "
               f"gate=@l{i}.ffn.gate {{form = \"swiglu\", block = {i}}} : f32[seq, 64]")
        new = "\n".join([
            f"  %l{i}.g = linear %l{i}.ffn_norm, @l{i}.ffn.gate {{block = {i}}} : f32[seq, 96]",
            f"  %l{i}.u = linear %l{i}.ffn_norm, @l{i}.ffn.up {{block = {i}}} : f32[seq, 96]",
            f"  %l{i}.a = silu %l{i}.g {{block = {i}}} : f32[seq, 96]",
            f"  %l{i}.h = mul %l{i}.a, %l{i}.u {{block = {i}}} : f32[seq, 96]",
            f"  %l{i}.ffn.out = linear %l{i}.h, @l{i}.ffn.down {{block = {i}}} : f32[seq, 64]"])
        assert old in primitive
        primitive = primitive.replace(old, new)
    unfolded = parse(primitive)
    verify(unfolded)
    folded = run_pipeline(unfolded, model.weights, parse_pipeline("canonicalize,dce"))
    assert print_module(folded) == text
    tokens = [5, 17, 3, 99, 42]
    want = Interpreter(model.module, model.weights).run(tokens)
    got = Interpreter(unfolded, model.weights).run(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@dataclass(frozen=True)
class NoopOptions(PassOptions):
    tokens: int = option(1)
    mode: str = option("slow", choices=("slow", "fast"))


def noop(module, ctx: PassContext[NoopOptions]):
    """Do nothing (a test pass)."""
    return module


class TestPipelines:
    def test_parse_with_options(self):
        if "test-noop" not in PASSES:
            register_pass("test-noop", options=NoopOptions)(noop)
        specs = parse_pipeline("canonicalize, test-noop{tokens=4096, mode=fast},dce")
        assert [s.name for s in specs] == ["canonicalize", "test-noop", "dce"]
        assert specs[1].options == NoopOptions(tokens=4096, mode="fast")
        assert str(specs[1]) == "test-noop{tokens=4096,mode=fast}"
        assert str(parse_pipeline("test-noop{tokens=1}")[0]) == "test-noop"  # defaults are not printed

    @pytest.mark.parametrize("text, message", [
        ("canonicalize,frobnicate", "unknown pass 'frobnicate'; registered passes: "),
        ("dce{level=3}", "pass 'dce' got option 'level=3'; accepted options: none"),
        ("dce{{", "at character 4: expected options"),
        ("dce canonicalize", "at character 5: expected ',' between passes"),
        ("", "expected at least one pass"),
    ])
    def test_bad_pipelines(self, text, message):
        with pytest.raises(PiccError) as e:
            parse_pipeline(text)
        assert message in str(e.value)

    def test_a_pass_that_breaks_the_ir_is_named_with_what_ran_before(self):
        if "test-break" not in PASSES:
            @register_pass("test-break")
            def breaker(module, ctx: PassContext):
                """Return IR whose result value does not exist (a test pass)."""
                return module.with_function(replace(module.function(), ret="gone"))
        model = tiny_llama()
        with pytest.raises(PiccError) as e:
            run_pipeline(model.module, model.weights, parse_pipeline("canonicalize,dce,test-break"))
        assert str(e.value) == ("pass 'test-break' produced invalid IR (after: canonicalize, dce): "
                                "function @forward: returned value %gone is not defined")

    def test_dump_print_and_time(self, tmp_path):
        model = tiny_llama()
        out = io.StringIO()
        inst = Instruments(print_after=frozenset({"dce"}), dump_dir=tmp_path / "ir",
                           time_passes=True, out=out)
        run_pipeline(model.module, model.weights, parse_pipeline("canonicalize,dce"), inst)
        names = sorted(p.name for p in (tmp_path / "ir").iterdir())
        assert names == ["00_input.picc", "01_canonicalize.picc", "02_dce.picc"]
        assert parse((tmp_path / "ir" / "02_dce.picc").read_text()) == model.module
        text = out.getvalue()
        assert "// ----- IR after dce -----" in text and "after canonicalize" not in text
        assert "canonicalize" in text.split("seconds")[1]
