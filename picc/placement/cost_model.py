"""What a token costs: the bytes of weights it reads, and which CPU kernel reads them.

Decode is memory-bound, so bytes are time at a device's read rate; on a CPU that rate depends on
the kernel (``CpuSpec.read_rate`` of :func:`cpu_weight_reads`' keys). The FFN terms here are what
choosing a sparsity mode needs. Reading the active rows of a matrix costs about ``density`` of reading it
all (each row is contiguous in both the row-major up/gate and the neuron-major down layouts).
"""

from __future__ import annotations

from collections.abc import Iterable

from picc import kernel_names
from picc.ir import ops as O
from picc.ir.fused_ops import FUSED_MODES
from picc.ir.weights import WeightStore


def weight_bytes(weights: WeightStore, name: str | None) -> int:
    return 0 if name is None else int(weights[name].data.nbytes)


def cpu_weight_reads(weights: WeightStore, names: Iterable[str | None], x_format: str,
                     axpy: str | None = None, rows8: Iterable[str | None] = (),
                     gathered: Iterable[str | None] = ()) -> list[tuple[int, str]]:
    """(bytes, CPU rate key) of each named weight as a CPU kernel reads it: with ``x_format``
    ``"i16"`` / ``"i8"`` (an ``_xi16`` / ``_xi8`` kernel) 4-bit rows are dotted in integers, except
    the ``axpy`` weight's (a neuron-major down projection, whose rows are AXPYs of h); the
    ``rows8`` weights are read eight rows at a time from the rows8 layout; the ``gathered`` ones
    are a fused sparse FFN's, whose active rows it reads a neuron at a time (the ``_gathered``
    rate of its kernel, x as it dots its up rows)."""
    in_rows8, in_gathered = set(rows8), set(gathered)

    def key(w: str) -> str:
        dtype = weights[w].dtype.value
        if w in in_gathered:
            return kernel_names.cpu_rate_key(dtype, x_format, gathered=True)
        return kernel_names.cpu_rate_key(dtype, "f32" if w == axpy else x_format, w in in_rows8)

    return [(weight_bytes(weights, w), key(w)) for w in names if w]


def gathered_matrices(mode: str, up: str, gate: str | None, down: str) -> tuple[str, ...]:
    """Of a sparse FFN's matrices, those whose rows it reads for its active neurons alone, a
    neuron at a time (not in dense mode, nor what the mode reads whole: ``read_whole``)."""
    if mode == "dense":
        return ()
    whole = kernel_names.read_whole(mode, up, gate)
    return tuple(m for m in (up, gate, down) if m is not None and m not in whole)


def ffn_weight_bytes(op: O.FFN, weights: WeightStore) -> int:
    """Bytes of the FFN's three matrices (and biases)."""
    names = (op.up, op.gate, op.down, op.up_bias, op.gate_bias, op.down_bias)
    return sum(weight_bytes(weights, n) for n in names)


def ffn_bytes_per_token(op: O.FFN, weights: WeightStore, mode: str, density: float,
                        predictor_bytes: int = 0) -> float:
    """Weight bytes one token reads through ``op`` in ``mode`` when ``density`` of its neurons
    are computed."""
    whole, gathered = ffn_reads_per_token(op, weights, mode, density, predictor_bytes)
    return whole + gathered


def ffn_reads_per_token(op: O.FFN, weights: WeightStore, mode: str, density: float,
                        predictor_bytes: int = 0) -> tuple[float, float]:
    """The bytes of :func:`ffn_bytes_per_token` split into those of matrices read whole (the
    dense matrices of the mode, the predictor) and those of the active rows, gathered one at a
    time from wherever the active neurons are (:func:`gathered_matrices`)."""
    if mode not in FUSED_MODES:
        raise ValueError(f"unknown sparsity mode {mode!r}")
    matrices = [(op.up, weight_bytes(weights, op.up) + weight_bytes(weights, op.up_bias)),
                (op.gate, weight_bytes(weights, op.gate) + weight_bytes(weights, op.gate_bias)),
                (op.down, weight_bytes(weights, op.down))]
    gathered = gathered_matrices(mode, op.up, op.gate, op.down)
    whole = (predictor_bytes if mode == "predictor" else 0) + sum(n for m, n in matrices if m not in gathered)
    return float(whole), density * sum(n for m, n in matrices if m in gathered)
