"""What a token costs: the bytes of weights it reads. Decode is memory-bound, so bytes are time.

Later issues add device bandwidths and transfers; the FFN terms here are what choosing a
sparsity mode needs. Reading the active rows of a matrix costs about ``density`` of reading it
all (each row is contiguous in both the row-major up/gate and the neuron-major down layouts).
"""

from __future__ import annotations

from picc.ir import ops as O
from picc.ir.weights import WeightStore


def weight_bytes(weights: WeightStore, name: str | None) -> int:
    return 0 if name is None else int(weights[name].data.nbytes)


def ffn_weight_bytes(op: O.FFN, weights: WeightStore) -> int:
    """Bytes of the FFN's three matrices (and biases)."""
    names = (op.up, op.gate, op.down, op.up_bias, op.gate_bias, op.down_bias)
    return sum(weight_bytes(weights, n) for n in names)


def ffn_bytes_per_token(op: O.FFN, weights: WeightStore, mode: str, density: float,
                        predictor_bytes: int = 0) -> float:
    """Weight bytes one token reads through ``op`` in ``mode`` when ``density`` of its neurons
    are computed."""
    up = weight_bytes(weights, op.up) + weight_bytes(weights, op.up_bias)
    gate = weight_bytes(weights, op.gate) + weight_bytes(weights, op.gate_bias)
    down = weight_bytes(weights, op.down)
    if mode == "dense":
        return float(up + gate + down)
    if mode == "gate-first":
        return gate + density * (up + down)
    if mode == "down-only":
        return up + gate + density * down
    if mode == "predictor":
        return predictor_bytes + density * (up + gate + down)
    raise ValueError(f"unknown sparsity mode {mode!r}")
