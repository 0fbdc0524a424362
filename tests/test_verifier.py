"""The verifier rejects malformed IR with a message naming the line, the op and the broken rule."""

from __future__ import annotations

import re

import pytest

from picc.ir import VerifyError, parse, verify

HEADER = """\
module @m

weight @emb : f32[16, 8]
weight @norm : f32[8]
weight @w : f32[12, 8]
weight @wq : q4_0[8, 32]
weight @up : f32[24, 8]
weight @down : f32[8, 24]
weight @scale : f32[24]

"""


def body(*ops: str, ret: str = "%x", args: str = "%tokens: i32[seq], %pos: i32[seq]") -> str:
    lines = "\n".join(f"  {op}" for op in ops)
    return HEADER + f"func @forward({args}) {{\n{lines}\n  return {ret}\n}}\n"


EMBED = "%x = embed %tokens, @emb : f32[seq, 8]"
V12 = "%v = linear %x, @w : f32[seq, 12]"  # two value heads of 6

CASES = [
    # (ops, expected message fragment); the first op is on line 12 (texts here are in printed form, so line numbers match the file) of the text
    ([EMBED, "%y = relu %z : f32[seq, 8]"],
     "line 13: %y = relu: %z is used before it is defined"),
    ([EMBED, "%x = relu %x : f32[seq, 8]"],
     "line 13: %x = relu: %x is already defined (SSA values are defined once)"),
    ([EMBED, "%y = linear %x, @nope : f32[seq, 12]"],
     "line 13: %y = linear: weight @nope is not declared"),
    ([EMBED, "%y = linear %x, @w : f32[seq, 8]"],
     "line 13: %y = linear: result type is f32[seq, 8] but the operands give f32[seq, 12]"),
    ([EMBED, "%y = linear %x, @down : f32[seq, 8]"],
     "line 13: %y = linear: weight @down f32[8, 24] takes 24 inputs but %x has 8"),
    ([EMBED, "%y = rms_norm %x, @w {eps = 1e-05} : f32[seq, 8]"],
     "line 13: %y = rms_norm: weight @w must be [8], got [12, 8]"),
    ([EMBED, "%y = rms_norm %x, @norm {eps = 0.0} : f32[seq, 8]"],
     "line 13: %y = rms_norm: eps must be > 0, got 0.0"),
    ([EMBED, "%y = embed %x, @emb : f32[seq, 8]"],
     "line 13: %y = embed: tokens %x must be i32[seq], got f32[seq, 8]"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 3, head_dim = 2} : f32[seq, 8]"],
     "line 13: %y = rope: %x has 8 features, expected n_heads * head_dim = 3 * 2"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, style = \"neox\"} : f32[seq, 8]"],
     "line 13: %y = rope: style must be one of ('llama', 'gptj'), got 'neox'"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, scaling = \"longrope\", freq_factors = [1.0]} "
             ": f32[seq, 8]"],
     "line 13: %y = rope: freq_factors: one per rotary pair (2) with longrope or yarn scaling, none otherwise; got 1"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, scaling = \"yarn\", factor = 4.0} : f32[seq, 8]"],
     "freq_factors: one per rotary pair (2) with longrope or yarn scaling, none otherwise; got 0 with 'yarn'"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, freq_factors = [1.0, 2.0]} : f32[seq, 8]"],
     "freq_factors: one per rotary pair (2) with longrope or yarn scaling, none otherwise; got 2 with 'none'"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, attention_factor = 0.0} : f32[seq, 8]"],
     "freq_factors, long_factors and attention_factor must be > 0"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, scaling = \"longrope\", freq_factors = [1.0, 2.0], "
             "long_factors = [3.0]} : f32[seq, 8]"],
     "long_factors: one per rotary pair (2), with longrope's freq_factors; got 1"),
    ([EMBED, "%y = rope %x, %pos {n_heads = 2, head_dim = 4, scaling = \"yarn\", freq_factors = [1.0, 2.0], "
             "long_factors = [3.0, 3.0]} : f32[seq, 8]"],
     "long_factors: one per rotary pair (2), with longrope's freq_factors; got 2"),
    ([EMBED, "%y = concat_heads %x, %x {n_heads = 2, a_dim = 8, b_dim = 3} : f32[seq, 22]"],
     "line 13: %y = concat_heads: %x has 8 features, expected b_dim = 3 (one head for every head) or "
     "n_heads * b_dim = 6 (a head each)"),
    ([EMBED, "%y = concat_heads %x, %x {n_heads = 4, a_dim = 4, b_dim = 8} : f32[seq, 48]"],
     "line 13: %y = concat_heads: %x has 8 features, expected a_dim = 4 (one head for every head) or "
     "n_heads * a_dim = 16 (a head each)"),
    ([EMBED, "%y = concat_heads %x, %x {n_heads = 2, a_dim = 0, b_dim = 4} : f32[seq, 8]"],
     "line 13: %y = concat_heads: n_heads, a_dim and b_dim must be > 0, got 2, 0, 4"),
    ([EMBED, "%y = concat_heads %x, %x {n_heads = 2, a_dim = 8, b_dim = 4} : f32[seq, 16]"],
     "line 13: %y = concat_heads: result type is f32[seq, 16] but the operands give f32[seq, 24]"),
    ([EMBED, "%y = attention %x, %x, %x, %pos {n_heads = 3, n_kv_heads = 2, head_dim = 2, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 8]"],
     "line 13: %y = attention: n_heads=3 must be a multiple of n_kv_heads=2"),
    ([EMBED, "%y = attention %x, %x, %x, %pos {n_heads = 4, n_kv_heads = 2, head_dim = 2, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 8]"],
     "line 13: %y = attention: %x must be f32[seq, 4] (n_kv_heads * head_dim), got f32[seq, 8]"),
    ([EMBED,
      "%y = attention %x, %x, %x, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, scale = 1.0, "
      "cache = \"l0\"} : f32[seq, 8]",
      "%z = attention %y, %y, %y, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, scale = 1.0, "
      "cache = \"l0\"} : f32[seq, 8]"],
     "line 14: %z = attention: cache slot 'l0' is already used by %y"),
    ([EMBED, "%y = attention %x, %x, %x, %pos, sinks=@scale {n_heads = 2, n_kv_heads = 2, head_dim = 4, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 8]"],
     "line 13: %y = attention: sinks @scale must be [2], got [24]"),
    # Value heads of v_head_dim features (DeepSeek's MLA): v and the result are n_kv_heads and n_heads of them.
    ([EMBED, V12, "%y = attention %x, %x, %v, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, v_head_dim = 6, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 8]"],
     "line 14: %y = attention: result type is f32[seq, 8] but the operands give f32[seq, 12]"),
    ([EMBED, V12, "%y = attention %x, %x, %v, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, v_head_dim = 4, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 8]"],
     "line 14: %y = attention: %v must be f32[seq, 8] (n_kv_heads * v_head_dim), got f32[seq, 12]"),
    ([EMBED, V12, "%y = attention %x, %x, %v, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, scale = 1.0, "
      "cache = \"l0\"} : f32[seq, 8]"],
     "line 14: %y = attention: %v must be f32[seq, 8] (n_kv_heads * head_dim), got f32[seq, 12]"),
    ([EMBED, V12, "%y = attention %x, %x, %v, %pos {n_heads = 2, n_kv_heads = 2, head_dim = 4, v_head_dim = 0, "
      "scale = 1.0, cache = \"l0\"} : f32[seq, 0]"],
     "line 14: %y = attention: v_head_dim must be > 0, got 0"),
    ([EMBED, "%y = ffn %x, @up, @down {form = \"swiglu\"} : f32[seq, 8]"],
     "line 13: %y = ffn: form 'swiglu' needs a gate weight"),
    ([EMBED, "%y = ffn %x, @up, @down, gate=@up {form = \"relu\"} : f32[seq, 8]"],
     "line 13: %y = ffn: form 'relu' has no gate, but one is given"),
    ([EMBED, "%y = ffn %x, @up, @up {form = \"relu\"} : f32[seq, 8]"],
     "line 13: %y = ffn: down @up must be [8, 24], got [24, 8]"),
    ([EMBED, "%y = ffn %x, @up, @down {form = \"swish\"} : f32[seq, 8]"],
     "line 13: %y = ffn: form must be one of"),
    ([EMBED, "%y = ffn %x, @up, @down, gate=@up, score_scale=@norm {form = \"swiglu\"} : f32[seq, 8]"],
     "line 13: %y = ffn: score_scale @norm must be [24], got [8]"),
    ([EMBED, "%y = fused_ffn %x, @up, up=@up, score_scale=@scale {form = \"relu\", mode = \"dense\", "
      "layer = \"y\"} : f32[seq, 8]"],
     "line 13: %y = fused_ffn: score_scale scales the gate-first decision; mode 'dense' does not make one"),
    ([EMBED, "%y = linear %x, @w : f32[seq, 12]", "%z = add %x, %y : f32[seq, 8]"],
     "line 14: %z = add: operands must have the same type, got %x: f32[seq, 8] and %y: f32[seq, 12]"),
    ([EMBED, "%y = rms_norm %x, @wq {eps = 1e-05} : f32[seq, 8]"],
     "line 13: %y = rms_norm: weight @wq must be [8], got [8, 32]"),
]


@pytest.mark.parametrize("ops, message", CASES)
def test_malformed_ir_is_rejected_with_a_precise_message(ops, message):
    with pytest.raises(VerifyError) as e:
        verify(parse(body(*ops)))
    assert message in str(e.value)


def test_returned_value_must_exist():
    with pytest.raises(VerifyError, match="returned value %nowhere is not defined"):
        verify(parse(body(EMBED, ret="%nowhere")))


def test_weights_need_static_shapes_and_unique_names():
    with pytest.raises(VerifyError, match="weight @v must have a static shape"):
        verify(parse("module @m\nweight @v : f32[n, 8]\n"))
    with pytest.raises(VerifyError, match="weight @v is declared twice"):
        verify(parse("module @m\nweight @v : f32[8]\nweight @v : f32[8]\n"))


def test_quantized_norm_weight_is_rejected():
    text = HEADER.replace("weight @norm : f32[8]", "weight @norm : q8_0[8]")
    text += "func @forward(%tokens: i32[seq]) {\n  " + EMBED
    text += "\n  %y = rms_norm %x, @norm {eps = 1e-05} : f32[seq, 8]\n  return %y\n}\n"
    with pytest.raises(VerifyError, match="line 13: %y = rms_norm: weight @norm must be a float tensor"):
        verify(parse(text))


def test_a_valid_module_passes():
    verify(parse(body(EMBED, "%y = linear %x, @w : f32[seq, 12]", ret="%y")))


def test_joined_heads_take_one_head_or_a_head_each_of_rows_alike():
    # a [seq, 8] as one head of 8 (every head takes it) or two of 4, b likewise; the rows must agree.
    for attrs, width in (("a_dim = 8, b_dim = 4", 24), ("a_dim = 4, b_dim = 8", 24), ("a_dim = 4, b_dim = 4", 16),
                         ("a_dim = 8, b_dim = 8", 32)):
        verify(parse(body(EMBED, f"%y = concat_heads %x, %x {{n_heads = 2, {attrs}}} : f32[seq, {width}]", ret="%y")))
    text = body(EMBED, "%y = concat_heads %x, %c {n_heads = 2, a_dim = 4, b_dim = 4} : f32[seq, 16]",
                args="%tokens: i32[seq], %pos: i32[seq], %c: f32[3, 8]")
    with pytest.raises(VerifyError, match=re.escape("%y = concat_heads: %x and %c must have the same rows, "
                                                    "got f32[seq, 8] and f32[3, 8]")):
        verify(parse(text))


@pytest.mark.parametrize("extra, message", [
    ("", None),  # gpt-oss's mixture as its frontend builds it
    (", router_bias=@up_bias", "router_bias @up_bias must be [2], got [24]"),
    (", down_bias=@rb", "down_bias @rb must be [16], got [2]"),
    (" {n_experts = 2, top_k = 1, form = \"swiglu\", swiglu_alpha = 2.0}",
     "swiglu_alpha is the clamped SwiGLU's: it needs swiglu_limit"),
    (" {n_experts = 2, top_k = 1, form = \"geglu\", swiglu_limit = 7.0}", "are form swiglu's, got form 'geglu'"),
])
def test_a_mixtures_biases_and_clamped_swiglu_are_checked(extra, message):
    # Two experts of 12 neurons: the router's bias one per expert, up's and gate's one per row,
    # down's one per output row of each expert; alpha only with the clamp (form swiglu's).
    attrs = '{n_experts = 2, top_k = 1, form = "swiglu", norm_topk = true, swiglu_limit = 7.0, swiglu_alpha = 1.702}'
    ops = f"%y = moe %x, @router, @up, @down, gate=@up, router_bias=@rb, up_bias=@up_bias{extra} {attrs}"
    if extra.startswith(" {"):
        ops = f"%y = moe %x, @router, @up, @down, gate=@up{extra}"
    text = ("module @m\n\nweight @emb : f32[16, 8]\nweight @router : f32[2, 8]\nweight @up : f32[24, 8]\n"
            "weight @down : f32[16, 12]\nweight @rb : f32[2]\nweight @up_bias : f32[24]\n\n"
            f"func @forward(%tokens: i32[seq]) {{\n  {EMBED}\n  {ops} : f32[seq, 8]\n  return %y\n}}\n")
    if message is None:
        verify(parse(text))
        return
    with pytest.raises(VerifyError, match=re.escape(message)):
        verify(parse(text))



V3_ROUTING = 'scoring = "sigmoid", n_group = 4, topk_group = 2, group_score = "top2", routed_scale = 2.5'


@pytest.mark.parametrize("top_k, attrs, message", [
    (4, V3_ROUTING, None),  # DeepSeek V3's router as its frontend builds it
    (4, 'scoring = "sigmoid", routed_scale = 2.5', None),  # GLM-4.5's (one group)
    (4, "n_group = 4, topk_group = 2", None),  # DeepSeek V2's group_limited_greedy ("max")
    (4, 'scoring = "tanh"', "line 11: %y = moe: scoring must be softmax or sigmoid, got 'tanh'"),
    (4, 'n_group = 4, topk_group = 2, group_score = "sum"', "group_score must be max or top2, got 'sum'"),
    (4, "n_group = 3", "n_group must divide n_experts, got n_group=3, n_experts=8"),
    (4, "n_group = 0", "n_group must divide n_experts, got n_group=0, n_experts=8"),
    (4, "n_group = 4, topk_group = 5", "topk_group must be in 1..n_group, got topk_group=5, n_group=4"),
    (4, "n_group = 4, topk_group = 0", "topk_group must be in 1..n_group, got topk_group=0, n_group=4"),
    (5, "n_group = 4, topk_group = 2",
     "top_k must fit in the topk_group best groups' experts, got top_k=5, topk_group=2 groups of 2"),
    (4, 'n_group = 8, topk_group = 4, group_score = "top2"', "group_score top2 needs groups of 2 or more experts, got 1"),
    (4, "routed_scale = 0.0", "routed_scale must be finite and > 0, got 0.0"),
    (4, "routed_scale = -2.5", "routed_scale must be finite and > 0, got -2.5"),
])
def test_a_mixtures_routing_is_checked(top_k, attrs, message):
    # Eight experts of four neurons with a choice bias: the groups divide the experts, the groups
    # taken hold the top k, V3's group score needs two members, the scale is a positive factor.
    text = ("module @m\n\nweight @emb : f32[16, 8]\nweight @router : f32[8, 8]\nweight @up : f32[32, 8]\n"
            "weight @down : f32[64, 4]\nweight @cb : f32[8]\n\n"
            f"func @forward(%tokens: i32[seq]) {{\n  {EMBED}\n"
            f"  %y = moe %x, @router, @up, @down, gate=@up, choice_bias=@cb {{n_experts = 8, top_k = {top_k}, "
            f'form = "swiglu", norm_topk = true, {attrs}}} : f32[seq, 8]\n  return %y\n}}\n')
    if message is None:
        verify(parse(text))
        return
    with pytest.raises(VerifyError, match=re.escape(message)):
        verify(parse(text))
