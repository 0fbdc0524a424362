"""Hashes for the caches of what picc derives from a model (trained predictors, calibration
profiles): of what the model computes, and of the picc code that derives from it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from picc.ir.module import Module
from picc.ir.printer import print_module
from picc.ir.weights import WeightStore

PACKAGE = Path(__file__).parent


def hash_model(h: hashlib._Hash, module: Module, weights: WeightStore) -> None:
    """Feed ``h`` the model: its IR text and the bytes of every weight its ops read."""
    h.update(print_module(module).encode())
    for name in sorted({w for op in module.ops() for w in op.weights()}):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name].data).tobytes())


def hash_sources(h: hashlib._Hash, names: Iterable[str]) -> None:
    """Feed ``h`` picc's source files ``names`` (paths inside the package): a change to the code
    a cached result comes from makes it a miss."""
    for name in names:
        h.update(name.encode())
        h.update((PACKAGE / name).read_bytes())
