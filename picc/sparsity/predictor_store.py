"""Where predictors come from besides training: picc's cache, and PowerInfer's published files.

The cache lives outside the source tree (``$PICC_CACHE_DIR``, default ``~/.cache/picc``), keyed
by a hash of the model (its IR text and the bytes of the weights it reads), the calibration
settings and the code the predictors come from, so recompiling the same model the same way does
not retrain, and a change to the training does.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from picc.digest import hash_model, hash_sources
from picc.errors import PiccError
from picc.fsutil import cache_root, cached, keep_cached
from picc.ir import ops as O
from picc.ir.module import Module
from picc.ir.weights import WeightStore
from picc.sparsity.predictors import TrainedPredictor

FORMAT_VERSION = 1
# The code trained predictors come from: the training, the data it reads (the calibration windows,
# the model run by the interpreter on its ops' semantics and weights' dequantization).
TRAINING_SOURCES = ("sparsity/predictors.py", "passes/insert_predictors.py", "sparsity/calib.py", "interpreter.py",
                    "quant.py", "ir/ops.py")
_PARTS = ("fc1", "fc1_bias", "fc2", "fc2_bias")


def cache_dir() -> Path:
    return cache_root() / "predictors"


def cache_key(module: Module, weights: WeightStore, layers: list[str], settings: dict[str, object]) -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(f"v{FORMAT_VERSION} torch {version('torch')} numpy {np.__version__}".encode())
    hash_sources(h, TRAINING_SOURCES)
    hash_model(h, module, weights)
    h.update(json.dumps({"layers": layers, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:32]


def save_cached(key: str, predictors: dict[str, TrainedPredictor]) -> None:
    """Keep ``predictors`` under ``key``; a cache that cannot be written only costs the next
    compile its training."""
    directory = cache_dir()
    arrays: dict[str, np.ndarray] = {}
    meta = {}
    for i, (name, p) in enumerate(predictors.items()):
        for part in _PARTS:
            arrays[f"{i}.{part}"] = getattr(p, part)
        meta[name] = {"index": i, "threshold": p.threshold, "recall": p.recall,
                      "predicted_density": p.predicted_density, "true_density": p.true_density}
    arrays["meta"] = np.array(json.dumps(meta))
    keep_cached(directory / f"{key}.npz", lambda f: np.savez(f, **arrays))


def load_cached(key: str) -> dict[str, TrainedPredictor] | None:
    path = cached(cache_dir() / f"{key}.npz")
    if path is None:
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return {name: TrainedPredictor(*(z[f"{m['index']}.{part}"] for part in _PARTS), m["threshold"],
                                           m["recall"], m["predicted_density"], m["true_density"])
                    for name, m in meta.items()}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None  # a damaged cache entry is retrained, not trusted


def load_powerinfer(directory: Path, ffns: list[O.FFN]) -> dict[str, TrainedPredictor]:
    """PowerInfer's predictors: ``model_{i}.pt`` per layer (``fc1``/``fc2`` Linear state dicts)
    and an optional ``config.json`` whose ``threshold`` applies to the predictor's logits."""
    import torch

    if not directory.is_dir():
        raise PiccError(f"{directory}: predictor directory not found")
    threshold = 0.0
    config = directory / "config.json"
    if config.is_file():
        try:
            threshold = float(json.loads(config.read_text()).get("threshold", 0.0))
        except (ValueError, TypeError) as e:
            raise PiccError(f"{config}: expected JSON with a numeric 'threshold' ({e})") from None
    out = {}
    for i, op in enumerate(ffns):
        path = directory / f"model_{i}.pt"
        if not path.is_file():
            raise PiccError(f"{path}: missing predictor for layer {i} (%{op.result})")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            fc1 = state["fc1.weight"].float().numpy()
            fc2 = state["fc2.weight"].float().numpy()
        except Exception as e:  # torch raises many types for foreign files
            raise PiccError(f"{path}: expected a state dict with fc1.weight and fc2.weight ({e})") from None
        fc1_bias = state["fc1.bias"].float().numpy() if "fc1.bias" in state else np.zeros(fc1.shape[0], np.float32)
        fc2_bias = state["fc2.bias"].float().numpy() if "fc2.bias" in state else np.zeros(fc2.shape[0], np.float32)
        out[op.result] = TrainedPredictor(fc1, fc1_bias, fc2, fc2_bias, threshold, float("nan"),
                                          float("nan"), float("nan"))
    return out
