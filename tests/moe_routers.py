"""DeepSeek's and GLM-4.5's routing (the moe op's ``scoring``, ``n_group``, ``topk_group``,
``group_score``, ``routed_scale``) put on a tiny ERNIE 4.5 MoE's mixtures, whose layout theirs
shares (eight experts, two a token, a choice bias, plain shared experts): what the runtime and
Fisher tests compile and run without those models' frontends."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from picc.frontend.model import LoadedModel
from picc.ir import ops as O
from picc.ir.module import WeightDecl
from picc.ir.weights import Tensor

ROUTINGS: dict[str, dict] = {
    # softmax, the better of two groups of four by their largest probability, no choice bias, not
    # renormalised, times 16
    "deepseek-v2": dict(choice_bias=None, n_group=2, topk_group=1, group_score="max", routed_scale=16.0,
                        norm_topk=False),
    # sigmoids plus a correction bias, the two best of four groups of two by the sum of their two
    # largest, renormalised, times 2.5
    "deepseek-v3": dict(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2", routed_scale=2.5,
                        norm_topk=True),
    # V3's without groups
    "glm-4.5": dict(scoring="sigmoid", group_score="top2", routed_scale=2.5, norm_topk=True),
}


def with_routing(model: LoadedModel, routing: str, seed: int = 0) -> LoadedModel:
    """``model``'s moe ops routed as :data:`ROUTINGS` ``[routing]`` says; a sigmoid router's
    choice bias drawn anew at the sigmoids' spread (0.05), so that it reorders their ranking."""
    rng, store = np.random.default_rng(seed), model.weights
    func, decls, ops = model.module.function(), list(model.module.weights), []
    for op in func.ops:
        if isinstance(op, O.MoE):
            attrs = dict(ROUTINGS[routing])
            if attrs.get("scoring") == "sigmoid":
                name = store.fresh_name(f"{op.choice_bias}.sigmoid")
                store.add(name, Tensor.from_f32(rng.normal(0, 0.05, size=op.n_experts).astype(np.float32)))
                decls.append(WeightDecl(name, store[name].type))
                attrs["choice_bias"] = name
            op = replace(op, **attrs)
        ops.append(op)
    module = replace(model.module, weights=tuple(decls)).with_function(replace(func, ops=tuple(ops)))
    return replace(model, module=module.with_used_weights_only())
