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
from picc.progress import progress_bar

PACKAGE = Path(__file__).parent


def hash_model(h: hashlib._Hash, module: Module, weights: WeightStore) -> None:
    """Feed ``h`` the model: its IR text and the bytes of every weight its ops read. A 7B's
    mapped weights not in the page cache are read from disk for it (a minute on the build VM),
    so a progress bar counts the bytes."""
    h.update(print_module(module).encode())
    names = sorted({w for op in module.ops() for w in op.weights()})
    with progress_bar(sum(weights[n].data.nbytes for n in names), "hashing the model", in_bytes=True) as advance:
        for name in names:
            h.update(name.encode())
            h.update(np.ascontiguousarray(weights[name].data).tobytes())
            advance(weights[name].data.nbytes)


def hash_sources(h: hashlib._Hash, names: Iterable[str]) -> None:
    """Feed ``h`` picc's source files ``names`` (paths inside the package): a change to the code
    a cached result comes from makes it a miss."""
    for name in names:
        h.update(name.encode())
        h.update((PACKAGE / name).read_bytes())
