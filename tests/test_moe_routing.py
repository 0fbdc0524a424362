"""The moe op's DeepSeek and GLM-4.5 routing (``scoring``, ``n_group``, ``topk_group``,
``group_score``, ``routed_scale``) in the interpreter against transformers' own routers and
mixtures: DeepSeek V2's greedy and group-limited greedy softmax, DeepSeek V3's and GLM-4.5's
sigmoids ranked with a correction bias (V3's in groups scored by their two largest), each
renormalised as its model does and scaled by its routed_scaling_factor.

Tolerances: the routers' choices are compared exactly (the same logits in, random data without
near-ties); their weights to 1e-6 relative (float32 both sides, torch's sigmoid and exp against
numpy's, a few ulps); the mixtures' outputs to 1e-5 of their largest element (float32 sums in
another order, as tests/test_codegen_cpu_moe.py's kernels against the float64 reference).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from picc.interpreter import Interpreter, moe_route
from picc.ir import ops as O
from picc.ir.builder import FunctionBuilder
from picc.ir.module import Module, WeightDecl
from picc.ir.types import f32
from picc.ir.weights import Tensor, WeightStore

E, N, HIDDEN, TOKENS = 16, 16, 64, 512  # experts, an expert's neurons, the hidden size, tokens

# (transformers' family, its config's routing, the op's attributes): four groups of four experts
ROUTERS = {
    "deepseek-v2-greedy": ("deepseek_v2", dict(topk_method="greedy", n_group=1, topk_group=1,
                                                routed_scaling_factor=16.0, n_shared_experts=2),
                           dict(routed_scale=16.0)),
    "deepseek-v2-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                       routed_scaling_factor=16.0, n_shared_experts=2),
                                  dict(n_group=4, topk_group=2, group_score="max", routed_scale=16.0)),
    "deepseek-v3": ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
                                        norm_topk_prob=True),
                    dict(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2", routed_scale=2.5,
                         norm_topk=True)),
    "glm-4.5": ("glm4_moe", dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                 norm_topk_prob=True),
                dict(scoring="sigmoid", group_score="top2", routed_scale=2.5, norm_topk=True)),
}


def _mixture(family: str, routing: dict, seed: int) -> torch.nn.Module:
    """transformers' mixture of ``family`` (router, experts, shared experts), random weights; a
    correction bias of the sigmoids' spread (it reorders their ranking) where the router has one."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config, cls = {"deepseek_v2": (DeepseekV2Config, DeepseekV2Moe), "deepseek_v3": (DeepseekV3Config, DeepseekV3MoE),
                   "glm4_moe": (Glm4MoeConfig, Glm4MoeMoE)}[family]
    torch.manual_seed(seed)
    mixture = cls(config(hidden_size=HIDDEN, n_routed_experts=E, num_experts_per_tok=4, moe_intermediate_size=N,
                         hidden_act="silu", **routing)).eval()
    with torch.no_grad():
        for p in mixture.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        if hasattr(mixture.gate, "e_score_correction_bias"):
            mixture.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.05)
    return mixture


def _picc_mixture(mixture: torch.nn.Module, attrs: dict) -> tuple[Interpreter, O.MoE, np.ndarray | None]:
    """The moe op of ``mixture``: its experts' gate and up rows stacked, its shared MLP cut into
    expert-wide pieces after them (as the frontends cut Qwen2-MoE's); the interpreter, the op
    and its choice bias."""
    state = {k: v.detach().numpy() for k, v in mixture.state_dict().items()}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]  # [E, 2N, H], [E, H, N]
    n_shared = state["shared_experts.up_proj.weight"].shape[0] // N
    shared_down = state["shared_experts.down_proj.weight"].reshape(HIDDEN, n_shared, N).transpose(1, 0, 2)
    weights = {"router": state["gate.weight"],
               "up": np.concatenate([gate_up[:, N:].reshape(-1, HIDDEN), state["shared_experts.up_proj.weight"]]),
               "gate": np.concatenate([gate_up[:, :N].reshape(-1, HIDDEN), state["shared_experts.gate_proj.weight"]]),
               "down": np.concatenate([down.reshape(-1, N), shared_down.reshape(-1, N)])}
    bias = state.get("gate.e_score_correction_bias")
    if bias is not None:
        weights["choice_bias"] = bias
    store = WeightStore({name: Tensor.from_f32(np.ascontiguousarray(w, np.float32)) for name, w in weights.items()})
    types = {name: store[name].type for name in store}
    b = FunctionBuilder("forward", types)
    b.op(O.MoE, "y", x=b.arg("x", f32("seq", HIDDEN)), router="router", up="up", gate="gate", down="down",
         n_experts=E, top_k=4, form="swiglu", n_shared=n_shared, choice_bias="choice_bias" if bias is not None else None,
         **attrs)
    func = b.finish("y")
    module = Module("m", (), tuple(WeightDecl(n, t) for n, t in types.items()), (func,))
    return Interpreter(module, store), func.ops[0], bias


@pytest.mark.parametrize("router", ROUTERS)
def test_the_routers_choose_and_weigh_as_transformers(router):
    # Each token's four experts and their weights from the router's own logits: the same set of
    # experts (transformers' topk does not sort them), each with its weight. The groups matter:
    # without them some tokens would take other experts (checked where the router has groups).
    family, routing, attrs = ROUTERS[router]
    mixture = _mixture(family, routing, seed=1)
    _, op, bias = _picc_mixture(mixture, attrs)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, want_weights, want_chosen = mixture.gate(x)
    chosen, weights = moe_route(op, logits.numpy(), bias)
    assert chosen.shape == weights.shape == (TOKENS, 4) and weights.dtype == np.float32
    order, want_order = np.argsort(chosen, axis=1), torch.argsort(want_chosen, dim=1).numpy()
    np.testing.assert_array_equal(np.take_along_axis(chosen, order, 1),
                                  np.take_along_axis(want_chosen.numpy(), want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1),
                               np.take_along_axis(want_weights.numpy(), want_order, 1), rtol=1e-6)
    if op.n_group > 1:
        from dataclasses import replace

        ungrouped, _ = moe_route(replace(op, n_group=1, topk_group=1), logits.numpy(), bias)
        assert (np.sort(ungrouped, axis=1) != np.sort(chosen, axis=1)).any(axis=1).sum() > TOKENS // 10


@pytest.mark.parametrize("router", ROUTERS)
def test_the_mixtures_compute_as_transformers(router):
    # The whole mixture: the routed experts weighted as above, then the shared experts with
    # weight 1 (routed_scale is the routed experts' only).
    family, routing, attrs = ROUTERS[router]
    mixture = _mixture(family, routing, seed=3)
    interpreter, op, _ = _picc_mixture(mixture, attrs)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = mixture(x[None]).numpy()[0]
    y = interpreter.moe(op, x.numpy())
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
