"""The text form round-trips exactly: parse(print(m)) == m, and print(parse(t)) == t."""

from __future__ import annotations

import pytest
from conftest import narrow_values, tiny_llama, tiny_mla

from picc.frontend.llama import RopeSpec
from picc.ir import ParseError, parse, print_module, verify
from picc.ir.types import DType

GOLDEN = """\
module @golden {arch = "llama", vocab = 16, scale = 0.5, chat = false, note = "a \\"quoted\\" word"}

weight @emb : q8_0[16, 32]
weight @norm : f32[32]
weight @opt_pos : f16[64, 32]
weight @up : q4_0[48, 32]
weight @down : q4_1[32, 48]
weight @ln_b : bf16[32]

func @forward(%tokens: i32[seq], %pos: i32[seq]) -> f32[seq, 32] {
  %embed = embed %tokens, @emb : f32[seq, 32]
  %posed = pos_embed %pos, @opt_pos {offset = 2} : f32[seq, 32]
  %sum = add %embed, %posed : f32[seq, 32]
  %normed = layer_norm %sum, @norm, bias=@ln_b {eps = 1e-05} : f32[seq, 32]
  %rot = rope %normed, %pos {n_heads = 4, head_dim = 8, rotary_dim = 4, style = "gptj", scaling = "llama3", factor = 8.0} : f32[seq, 32]
  %ctx = attention %rot, %normed, %normed, %pos {n_heads = 4, n_kv_heads = 4, head_dim = 8, scale = 0.35355339059327373, cache = "l0", window = 4, alibi = "falcon"} : f32[seq, 32]

  %l0.ffn.out = ffn %ctx, @up, @down {form = "relu", block = 0} : f32[seq, 32]
  %l0.act = gelu_tanh %l0.ffn.out {block = 0} : f32[seq, 32]
  return %l0.act
}
"""


def test_golden_text_round_trips_character_for_character():
    module = parse(GOLDEN)
    verify(module)
    assert print_module(module) == GOLDEN
    assert parse(print_module(module)) == module


def test_attributes_keep_their_types():
    module = parse(GOLDEN)
    assert module.attr("vocab") == 16 and isinstance(module.attr("vocab"), int)
    assert module.attr("scale") == 0.5
    assert module.attr("chat") is False
    assert module.attr("note") == 'a "quoted" word'
    rope = next(op for op in module.ops() if op.NAME == "rope")
    assert rope.factor == 8.0 and isinstance(rope.factor, float)
    assert rope.rotary_dim == 4 and rope.theta == 10000.0  # default filled in
    assert module.weight_types()["up"].dtype == DType.Q4_0


@pytest.mark.parametrize("kwargs", [
    dict(form="swiglu"),
    dict(form="relu", tied=True),
    dict(form="drelu", biases=True),
    dict(form="geglu_tanh", window=3, n_kv_heads=1),
    dict(form="swiglu", softcaps=(0.7, 0.8), sinks=True),
    dict(form="reglu", matrix_dtype=DType.Q4_1, rope=RopeSpec(scaling="linear", factor=2.0)),
    dict(form="gelu", matrix_dtype=DType.Q8_0,
         rope=RopeSpec(theta=5e5, style="gptj", scaling="llama3", factor=8.0, rotary_dim=8)),
    dict(form="swiglu", rope=RopeSpec(scaling="longrope", rotary_dim=6, freq_factors=(1.0, 1.0625, 2.5e-3),
                                      attention_factor=1.1902380714238083)),
])
def test_built_modules_round_trip(kwargs):
    module = tiny_llama(**kwargs).module
    verify(module)
    text = print_module(module)
    assert parse(text) == module
    assert print_module(parse(text)) == text


@pytest.mark.parametrize("kwargs", [dict(), dict(yarn=True, a_heads=4, b_heads=1)])
def test_joined_heads_round_trip(kwargs):
    # DeepSeek's keys: a one-head rope's output and a linear's joined head by head (or the other way round).
    module = tiny_mla(**kwargs).module
    verify(module)
    text = print_module(module)
    assert parse(text) == module and print_module(parse(text)) == text
    a_heads, b_dim = kwargs.get("a_heads", 1), 16
    line = ("%l0.attn.k_rope = concat_heads %l0.attn.k_pe_rope, %l0.attn.k_nope {n_heads = 4, a_dim = 8, "
            f"b_dim = {b_dim}, block = 0}} : f32[seq, 96]")
    assert line in text and f"%l0.attn.k_pe = linear %l0.attn_norm, @l0.attn.k_pe {{block = 0}} : f32[seq, {8 * a_heads}]" in text


def test_one_op_per_line_and_layers_separated():
    text = print_module(tiny_llama(n_layers=2).module)
    body = text[text.index("func @forward"):].splitlines()[1:-2]
    op_lines = [line for line in body if line.strip()]
    assert all(" = " in line and line.startswith("  %") for line in op_lines)
    blank = [i for i, line in enumerate(body) if not line.strip()]
    # a blank line before layer 0, before layer 1, and before the final norm
    assert len(blank) == 3
    assert body[blank[1] + 1].startswith("  %l1.")


def test_attention_sinks_print_as_a_weight_operand():
    text = print_module(tiny_llama(n_layers=1, sinks=True).module)
    assert "weight @l0.attn.sinks : f32[4]" in text
    assert ("  %l0.attn.ctx = attention %l0.attn.q_rope, %l0.attn.k_rope, %l0.attn.v, %pos, sinks=@l0.attn.sinks "
            "{n_heads = 4, n_kv_heads = 2, head_dim = 16, scale = 0.25, cache = \"l0\", block = 0} : f32[seq, 64]") in text


def test_values_narrower_than_keys_print_their_width_and_round_trip():
    # DeepSeek's MLA decompressed: value heads of v_head_dim (12) under key heads of 16; the
    # attribute is printed where it is set, and only there.
    module = narrow_values(tiny_llama(n_layers=1), 12).module
    verify(module)
    text = print_module(module)
    assert ("  %l0.attn.ctx = attention %l0.attn.q_rope, %l0.attn.k_rope, %l0.attn.v, %pos {n_heads = 4, "
            "n_kv_heads = 2, head_dim = 16, v_head_dim = 12, scale = 0.25, cache = \"l0\", block = 0} : f32[seq, 48]") in text
    assert "  %l0.attn.v = linear %l0.attn_norm, @l0.attn.v {block = 0} : f32[seq, 24]" in text
    assert parse(text) == module and print_module(parse(text)) == text
    assert "v_head_dim" not in print_module(tiny_llama(n_layers=1).module)


@pytest.mark.parametrize("text, message", [
    ("", "line 1: expected 'module @name'"),
    ("module @m\nweight @w : f77[3]\n", "line 2, column 13: expected a dtype"),
    ("module @m\nfunc @f() {\n  %x = frobnicate %y : f32[1]\n  return %x\n}\n",
     "line 3, column 8: expected a known op"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = relu %a {bogus = 1} : f32[1, 2]\n  return %x\n}\n",
     "line 3, column 17: expected one of the attributes"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = relu %a : f32[1, 2]\n", "has no 'return'"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = relu %a, %a : f32[1, 2]\n  return %x\n}\n",
     "line 3, column 17: expected ':' (relu takes 1 positional operands)"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = linear %a : f32[1, 2]\n  return %x\n}\n",
     "operand 'weight' of linear"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = rms_norm %a, @w : f32[1, 2]\n  return %x\n}\n",
     "line 3: rms_norm needs attribute 'eps'"),
    ("module @m\nfunc @f(%a: f32[1, 2]) {\n  %x = rms_norm %a, @w {eps = \"big\"} : f32[1, 2]\n"
     "  return %x\n}\n", "expected a value of type float"),
    ("module @m\nweight @w : f32[2] @tpu\n", "expected a placement"),
    ("module @m\nfunc @f(%a: f32[1, 16], %p: i32[1]) {\n  %x = rope %a, %p {n_heads = 2, head_dim = 8, "
     "scaling = \"longrope\", freq_factors = [1.0, \"x\"]} : f32[1, 16]\n  return %x\n}\n", "expected a number"),
    ("module @m\nfunc @f(%a: f32[1, 16], %p: i32[1]) {\n  %x = rope %a, %p {n_heads = 2, head_dim = 8, "
     "scaling = \"longrope\", freq_factors = 1.0} : f32[1, 16]\n  return %x\n}\n", "expected a list of numbers, like [1.0, 2.5]"),
])
def test_parse_errors_say_where_and_what(text, message):
    with pytest.raises(ParseError) as e:
        parse(text)
    assert message in str(e.value)


def test_placement_round_trips():
    text = "module @m\n\nweight @w : f16[640, 576] @gpu\n"
    module = parse(text)
    assert module.weights[0].type.placement is not None
    assert print_module(module) == text


def test_a_mixtures_routing_round_trips_and_prints_only_what_is_not_the_default():
    # DeepSeek V3's router: sigmoids ranked with a choice bias, the top k from the two best of four
    # groups scored by their two largest, the routed weights times 2.5; a plain mixture's line
    # shows none of those attributes.
    head = ("module @m\n\nweight @router : f32[8, 8]\nweight @up : f32[32, 8]\nweight @down : f32[64, 4]\n"
            "weight @cb : f32[8]\n\nfunc @forward(%x: f32[seq, 8]) -> f32[seq, 8] {\n")
    v3 = ('  %y = moe %x, @router, @up, @down, gate=@up, choice_bias=@cb {n_experts = 8, top_k = 4, form = "swiglu", '
          'norm_topk = true, scoring = "sigmoid", n_group = 4, topk_group = 2, group_score = "top2", '
          "routed_scale = 2.5} : f32[seq, 8]\n")
    text = head + v3 + "  return %y\n}\n"
    module = parse(text)
    verify(module)
    assert print_module(module) == text
    assert parse(print_module(module)) == module
    moe = next(module.ops())
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.group_score) == ("sigmoid", 4, 2, "top2")
    assert moe.routed_scale == 2.5 and isinstance(moe.routed_scale, float) and isinstance(moe.n_group, int)
    plain = head + '  %y = moe %x, @router, @up, @down, gate=@up {n_experts = 8, top_k = 4, form = "swiglu"} : f32[seq, 8]\n'
    plain += "  return %y\n}\n"
    moe = next(parse(plain).ops())
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.group_score, moe.routed_scale) == ("softmax", 1, 1, "max", 1.0)
    assert print_module(parse(plain)) == plain
