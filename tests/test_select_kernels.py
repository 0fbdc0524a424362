"""``select-kernels``: every kernel choice is a typed attribute in the IR, and what reads it reads
the attribute, never the kernel's name or a value's name."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from picc.errors import PiccError
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.parser import parse
from picc.ir.printer import print_module
from picc.ir.types import DType
from picc.ir.verifier import verify
from picc.ir.weights import Tensor, WeightStore
from picc.passes import parse_pipeline, run_pipeline
from picc.quant import round_x_blocks

# A residual block: @w is read by two linears (so it keeps the source layout), @v only by one.
BEFORE = """\
module @m {ctx = 64}

weight @w : q4_1[64, 64]
weight @v : q4_1[64, 64]
weight @g : f32[64]

func @forward(%x: f32[seq, 64]) -> f32[seq, 64] {
  %h = linear %x, @w : f32[seq, 64]
  %n = rms_norm %h, @g {eps = 1e-05} : f32[seq, 64]
  %p = linear %n, @v : f32[seq, 64]
  %s = add %h, %p : f32[seq, 64]
  %out = linear %s, @w : f32[seq, 64]
  return %out
}
"""

EXPECTED = """\
module @m {ctx = 64}

weight @w : q4_1[64, 64]
weight @v : q4_1[64, 64]
weight @g : f32[64]

func @forward(%x: f32[seq, 64]) -> f32[seq, 64] {
  %h = linear %x, @w {x_format = "i16", kernel = "picc_gemv_q4_1_xi16"} : f32[seq, 64]
  %n = rms_norm %h, @g {eps = 1e-05, kernel = "picc_rms_norm"} : f32[seq, 64]
  %p = linear %n, @v {x_format = "i16", layout = "rows8", kernel = "picc_gemv_q4_1_r8_xi16"} : f32[seq, 64]
  %s = add %h, %p {accumulated_by = "b", kernel = "picc_add"} : f32[seq, 64]
  %out = linear %s, @w {x_format = "i16", kernel = "picc_gemv_q4_1_xi16"} : f32[seq, 64]
  return %out
}
"""


def _store(names: tuple[str, ...] = ("w", "v"), dtype: DType = DType.Q4_1, seed: int = 0) -> WeightStore:
    """Random [64, 64] matrices ``names`` in ``dtype`` (and BEFORE's norm weight @g)."""
    rng = np.random.default_rng(seed)
    store = WeightStore()
    for name in names:
        store.add(name, Tensor.from_f32(rng.normal(size=(64, 64)).astype(np.float32) / 8, dtype))
    store.add("g", Tensor.from_f32(np.ones(64, np.float32)))
    return store


def test_select_kernels_golden():
    # A module that decides no sparsity dots its 4-bit rows with int16 x; a matrix only one op
    # reads goes eight rows at a time; the residual add is done by the kernel of %p, which has
    # no other reader, while %h is read by nothing between %p and the add.
    before = parse(BEFORE)
    verify(before)
    after = run_pipeline(before, _store(), parse_pipeline("select-kernels"))
    assert print_module(after) == EXPECTED
    assert parse(EXPECTED) == after


def test_int_dots_no_keeps_float_x_and_names_follow():
    after = run_pipeline(parse(BEFORE), _store(), parse_pipeline("select-kernels{int_dots=no}"))
    linears = [op for op in after.ops() if isinstance(op, O.Linear)]
    assert [op.x_format for op in linears] == ["f32"] * 3
    assert [op.kernel for op in linears] == ["picc_gemv_q4_1", "picc_gemv_q4_1_r8", "picc_gemv_q4_1"]


def test_int_x_i8_rounds_to_int8_where_the_kernel_reads_rows8_only():
    # int8 x halves the integer work of the rows8 dot products; rows one at a time dot it as
    # int16 at the same cost, so they keep int16's finer rounding.
    after = run_pipeline(parse(BEFORE), _store(), parse_pipeline("select-kernels{int_x=i8}"))
    linears = [op for op in after.ops() if isinstance(op, O.Linear)]
    assert [op.x_format for op in linears] == ["i16", "i8", "i16"]
    assert [op.kernel for op in linears] == ["picc_gemv_q4_1_xi16", "picc_gemv_q4_1_r8_xi8", "picc_gemv_q4_1_xi16"]


@pytest.mark.parametrize("options, kernel, layout", [
    ("", "picc_gemv_mxfp4_r8_xi16", "rows8"), ("{int_x=i8}", "picc_gemv_mxfp4_r8_xi8", "rows8"),
    ("{int_dots=no}", "picc_gemv_mxfp4", "rows")])
def test_mxfp4_rows_go_eight_at_a_time_where_x_is_rounded(options, kernel, layout):
    # The rows8 layout holds mxfp4 for rounded x alone (its float-x dot products convert nibbles
    # in place, not a table's values): float x keeps it in rows.
    before = parse(BEFORE.replace("q4_1", "mxfp4"))
    after = run_pipeline(before, _store(dtype=DType.MXFP4), parse_pipeline(f"select-kernels{options}"))
    v = [op for op in after.ops() if isinstance(op, O.Linear)][1]
    assert (v.kernel, v.layout) == (kernel, layout)


def test_choices_do_not_depend_on_value_names():
    # Renaming every value (here into names that look like decoder layers') changes no choice.
    renamed = BEFORE
    for old, new in (("%h", "%l7.ffn.out"), ("%n", "%l0.attn.up"), ("%p", "%l3.ffn.up"), ("%s", "%l1.out")):
        renamed = renamed.replace(old + " ", new + " ").replace(old + ",", new + ",").replace(old + "\n", new + "\n")
    a = run_pipeline(parse(BEFORE), _store(), parse_pipeline("select-kernels"))
    b = run_pipeline(parse(renamed), _store(), parse_pipeline("select-kernels"))
    assert [op.attrs() for op in a.ops()] == [op.attrs() for op in b.ops()]


def test_the_interpreter_rounds_x_by_the_attribute_not_the_kernel_name():
    module, store = parse(BEFORE), _store()
    x = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    op = module.function().ops[0]
    interp = Interpreter(module, store)
    w = store.f32("w")
    for x_format in ("i16", "i8"):
        rounded = replace(op, x_format=x_format)  # no kernel named at all
        assert np.array_equal(interp.eval(rounded, {"x": x}), round_x_blocks(x, x_format) @ w.T)
        assert not np.array_equal(round_x_blocks(x, x_format), x)
    assert np.array_equal(interp.eval(op, {"x": x}), x @ w.T)
    assert not np.array_equal(round_x_blocks(x, "i8"), round_x_blocks(x, "i16"))


def test_bad_choices_are_verifier_errors_and_unfused_modules_are_refused():
    with pytest.raises(Exception, match="x_format must be one of"):
        verify(parse(EXPECTED.replace('x_format = "i16", layout', 'x_format = "i4", layout')))
    with pytest.raises(Exception, match="accumulated_by must be a or b"):
        verify(parse(EXPECTED.replace('accumulated_by = "b"', 'accumulated_by = "c"')))
    # Only a producer whose kernel can add into its output may do the add (%n is an rms_norm).
    with pytest.raises(Exception, match="accumulated_by = 'a': %n must come from a linear or an ffn"):
        verify(parse(EXPECTED.replace('add %h, %p {accumulated_by = "b"', 'add %n, %p {accumulated_by = "a"')))
    with pytest.raises(PiccError, match="already selected"):
        run_pipeline(parse(EXPECTED), _store(), parse_pipeline("select-kernels"))


# A tied q8_0 LM head: the embedding and the head read one table; @p is another q8_0 matrix.
TIED = """\
module @m {ctx = 64}

weight @emb : q8_0[64, 64]
weight @p : q8_0[64, 64]

func @forward(%tokens: i32[seq]) -> f32[seq, 64] {
  %x = embed %tokens, @emb : f32[seq, 64]
  %h = linear %x, @p : f32[seq, 64]
  %logits = linear %h, @emb : f32[seq, 64]
  return %logits
}
"""


def _tied_store() -> WeightStore:
    return _store(("emb", "p"), DType.Q8_0, seed=2)


@pytest.mark.parametrize(("options", "head", "inner_i8"), [
    ("", "i8", False), ("{int_dots=yes}", "i8", False), ("{head_x=f32}", "f32", False), ("{int_dots=no}", "f32", False),
    ("{int_x=i8}", "i8", True), ("{int_x=i8,head_x=f32}", "f32", True)])
def test_a_q8_0_lm_head_dots_int8_x_from_rows8_and_its_tied_embedding_reads_rows8(options, head, inner_i8):
    # The head decides nothing after it, so it rounds its x to int8 (reading the rows8 layout,
    # which the embedding tied to it then reads too) unless rounding is off; a q8_0 matrix inside
    # the model reads rows with float x, unless the module rounds to int8 (int_x=i8, picc compile
    # --int8-dots): then it reads rows8 with int8 x as the head does.
    after = run_pipeline(parse(TIED), _tied_store(), parse_pipeline(f"select-kernels{options}"))
    embed, inner, logits = after.ops()
    assert (inner.x_format, inner.layout, inner.kernel) == (
        ("i8", "rows8", "picc_gemv_q8_0_r8_xi8") if inner_i8 else ("f32", "rows", "picc_gemv_q8_0"))
    rows8 = head == "i8"
    assert (logits.x_format, logits.layout) == (head, "rows8" if rows8 else "rows")
    assert logits.kernel == ("picc_gemv_q8_0_r8_xi8" if rows8 else "picc_gemv_q8_0")
    assert (embed.layout, embed.kernel) == (("rows8", "picc_embed_q8_0_r8") if rows8 else ("rows", "picc_embed_q8_0"))
    assert parse(print_module(after)) == after
    x = np.random.default_rng(3).normal(size=(2, 64)).astype(np.float32)
    expected = (round_x_blocks(x, "i8") if rows8 else x) @ _tied_store().f32("emb").T
    assert np.array_equal(Interpreter(after, _tied_store()).eval(logits, {"h": x}), expected)


def test_a_q8_0_head_read_by_a_second_matrix_op_keeps_rows():
    # Another linear reading the table reads rows: the head cannot have the table in rows8.
    shared = TIED.replace("%h = linear %x, @p", "%h = linear %x, @emb")
    *_, logits = run_pipeline(parse(shared), _tied_store(), parse_pipeline("select-kernels")).ops()
    assert (logits.x_format, logits.layout) == ("f32", "rows")


def test_the_compile_says_the_head_rounds_and_offers_int8_only_where_it_changes_something():
    # Only the head rounds (as in a sparse model): nothing rounds to int16, so --int8-dots would
    # change nothing and is not offered.
    from picc.compile import _dot_products

    after = run_pipeline(parse(TIED), _tied_store(), parse_pipeline("select-kernels"))
    assert _dot_products(after) == "; 1 matrix op dots x rounded to int8"
    assert _dot_products(run_pipeline(parse(TIED), _tied_store(), parse_pipeline("select-kernels{int_dots=no}"))) == ""
