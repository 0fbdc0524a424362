"""A hash of what a model computes, for the caches of what picc derives from it (trained
predictors, calibration profiles)."""

from __future__ import annotations

import hashlib

import numpy as np

from picc.ir.module import Module
from picc.ir.printer import print_module
from picc.ir.weights import WeightStore


def hash_model(h: hashlib._Hash, module: Module, weights: WeightStore) -> None:
    """Feed ``h`` the model: its IR text and the bytes of every weight its ops read."""
    h.update(print_module(module).encode())
    for name in sorted({w for op in module.ops() for w in op.weights()}):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name].data).tobytes())
