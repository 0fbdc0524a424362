"""Edited copies of the tiny HF checkpoints of hf_models.py, for frontend tests.

``edited_copy`` changes config.json fields or the tensors of ``model.safetensors`` (the way a
hand-edited or differently exported checkpoint would look); ``resaved`` has transformers itself
write the model again, in another dtype or in shards.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

StateDict = dict[str, np.ndarray]


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def edited_copy(src: Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = (),
                tensors: Callable[[StateDict], StateDict] | None = None) -> Path:
    """A copy of checkpoint ``src`` with config fields set (``config``) or removed (``drop``) and
    its float32 ``model.safetensors`` passed through ``tensors``."""
    shutil.copytree(src, dst)
    if config or drop:
        cfg = read_config(dst)
        cfg.update(config or {})
        for key in drop:
            cfg.pop(key, None)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if tensors is not None:
        from safetensors.numpy import load_file, save_file

        sd = tensors(load_file(str(dst / "model.safetensors")))
        # transformers refuses safetensors files without the "format" metadata
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def resaved(src: Path, dst: Path, *, dtype: str = "float32", max_shard_size: str | None = None) -> Path:
    """``src`` loaded by transformers and saved again with ``save_pretrained`` (in ``dtype``,
    sharded when ``max_shard_size`` is given)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype), local_files_only=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(dst, **kwargs)
    return dst
