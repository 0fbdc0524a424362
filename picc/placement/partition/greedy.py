"""PowerInfer's de-facto solver: the top neurons of all layers by frequency per byte.

All neurons of all layers are ranked by frequency per byte (plain frequency when all layers'
neurons have the same size); the longest prefix of that ranking that fits the budget goes to the
GPU. It is blind to the cost model (:mod:`picc.placement.partition.problem`) and to ``min_split``. A larger
budget only adds neurons, so each layer's GPU activation share can only grow with it.
"""

from __future__ import annotations

import numpy as np

from picc.placement.partition.problem import PartitionProblem, Placement, make_placement, sorted_rates


def greedy_counts(problem: PartitionProblem, ordered: list[np.ndarray]) -> list[int]:
    """Per layer, how many neurons greedy puts on the GPU, given each layer's read rates in
    frequency order (:func:`~picc.placement.partition.problem.sorted_rates`)."""
    if not problem.layers:
        return []
    # Concatenated layer by layer, each in its own order: the stable sort breaks ties by layer,
    # then by the layer's order, so each layer's GPU neurons stay a prefix of its order.
    scores = np.concatenate([f / la.neuron_bytes for la, f in zip(problem.layers, ordered, strict=True)])
    layer_of = np.repeat(np.arange(len(problem.layers)), [la.n_ff for la in problem.layers])
    order = np.argsort(-scores, kind="stable")
    order = order[np.array([la.gpu_kernel for la in problem.layers])[layer_of[order]]]
    sizes = np.array([la.neuron_bytes for la in problem.layers], dtype=np.int64)[layer_of[order]]
    taken = int(np.searchsorted(np.cumsum(sizes), problem.budget, side="right"))
    return np.bincount(layer_of[order[:taken]], minlength=len(problem.layers)).tolist()


def greedy(problem: PartitionProblem) -> Placement:
    """The longest prefix of all neurons ranked by frequency per byte that fits the budget."""
    perms, ordered = sorted_rates(problem)
    return make_placement(problem, greedy_counts(problem, ordered), "greedy", perms,
                          "top neurons of all layers by frequency per byte")

