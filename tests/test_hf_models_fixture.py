"""Checks for the tiny-HF-checkpoint fixtures in hf_models.py (fast: builds ~60 tiny models)."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hf_models as H  # noqa: E402

IDS = [1, 7, 3, 200, 45, 9, 17, 100, 23, 5, 66, 88, 12, 250, 4, 31]
ALL = [(f, v) for f in H.FAMILIES for v in H.VARIANTS[f] + H.EXTRA_VARIANTS[f]]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[tuple[str, str], pathlib.Path]:
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for fam, var in ALL:
        p = root / fam / var
        H.make_model(fam, var, p)
        out[(fam, var)] = p
    return out


@pytest.fixture(scope="module")
def logits(built) -> dict[tuple[str, str], np.ndarray]:
    return {k: H.reference_logits(p, IDS) for k, p in built.items()}


def test_variant_tables_are_consistent():
    assert set(H.VARIANTS) == set(H.FAMILIES) == set(H.EXTRA_VARIANTS)
    for fam in H.FAMILIES:
        names = H.VARIANTS[fam] + H.EXTRA_VARIANTS[fam]
        assert len(names) == len(set(names)) and len(H.VARIANTS[fam]) >= 2
    for fam, a, b in H.SAME_WEIGHTS_DIFFERENT_LOGITS + H.SAME_LOGITS:
        assert (fam, a) in ALL and (fam, b) in ALL
    with pytest.raises(ValueError):
        H.variant_config("llama", "nope")
    with pytest.raises(ValueError):
        H.variant_config("gpt2", "base")


@pytest.mark.parametrize("fam,var", ALL, ids=[f"{f}-{v}" for f, v in ALL])
def test_variant_loads_and_runs(fam, var, built, logits):
    p = built[(fam, var)]
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["model_type"] == fam
    out = logits[(fam, var)]
    assert out.dtype == np.float32
    assert out.shape == (len(IDS), cfg.get("text_config", cfg)["vocab_size"])  # Gemma 3 4B's is nested
    assert np.isfinite(out).all()
    # large enough weights: logits spread out, rows differ, several distinct greedy picks
    assert out.std() > 0.5
    assert len(set(out.argmax(-1).tolist())) >= 3


def test_variants_differ(logits):
    for fam, a, b in H.SAME_WEIGHTS_DIFFERENT_LOGITS:
        d = np.abs(logits[(fam, a)] - logits[(fam, b)]).max()
        assert d > 0.05, f"{fam}: {a} vs {b} only differ by {d}"


def test_equivalent_variants_match(logits):
    for fam, a, b in H.SAME_LOGITS:
        d = np.abs(logits[(fam, a)] - logits[(fam, b)]).max()
        assert d < 1e-5, f"{fam}: {a} vs {b} differ by {d}"


def test_shared_names_share_weights(logits):
    # llama "gqa" and mistral "base" have identical state dicts (same names, shapes, seed)
    # and identical math (no window): a cross-check that weights only depend on the name.
    d = np.abs(logits[("llama", "gqa")] - logits[("mistral", "base")]).max()
    assert d < 1e-5


@pytest.mark.parametrize(
    "fam,windowed,full,window",
    [
        ("mistral", "sliding-window", "base", 4),
        ("qwen2", "sliding", "base", 4),
        ("qwen2", "sliding-all", "base", 4),
    ],
)
def test_sliding_window_semantics(fam, windowed, full, window, logits):
    """Query i sees keys j with i - window < j <= i (i.e. i - j < window, `window` keys incl. itself)."""
    a, b = logits[(fam, windowed)], logits[(fam, full)]
    assert np.abs(a[:window] - b[:window]).max() < 1e-5
    assert np.abs(a[window] - b[window]).max() > 1e-3
    assert np.abs(a[window:] - b[window:]).max() > 0.05


def test_checkpoint_layouts(built):
    def keys(p):
        from safetensors import safe_open

        with safe_open(str(p / "model.safetensors"), "np") as f:
            return set(f.keys())

    # tied: lm_head.weight is not stored; untied: it is
    assert "lm_head.weight" not in keys(built[("llama", "tied")])
    assert "lm_head.weight" in keys(built[("llama", "swiglu")])
    assert "lm_head.weight" not in keys(built[("opt", "pre-ln")])
    assert "lm_head.weight" in keys(built[("opt", "untied")])
    assert "lm_head.weight" not in keys(built[("falcon", "new-arch")])
    assert "lm_head.weight" in keys(built[("falcon", "untied")])
    # opt pre-LN has a decoder-level final_layer_norm, post-LN / _remove_final_layer_norm don't
    assert "model.decoder.final_layer_norm.weight" in keys(built[("opt", "pre-ln")])
    assert "model.decoder.final_layer_norm.weight" not in keys(built[("opt", "post-ln")])
    assert "model.decoder.final_layer_norm.weight" not in keys(built[("opt", "no-final-ln")])
    assert "model.decoder.project_in.weight" in keys(built[("opt", "proj-dim")])
    # legacy ("hub") config layouts
    cfg = json.loads((built[("llama", "rope-llama3-legacy")] / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_scaling"]["rope_type"] == "llama3"
    cfg = json.loads((built[("llama", "rope-linear-legacy")] / "config.json").read_text())
    assert cfg["rope_scaling"] == {"type": "linear", "factor": 4.0} and cfg["rope_theta"] == 10000.0
    cfg = json.loads((built[("qwen2", "sliding")] / "config.json").read_text())
    assert "layer_types" not in cfg and cfg["use_sliding_window"] and cfg["sliding_window"] == 4
    cfg = json.loads((built[("qwen2", "sliding-off")] / "config.json").read_text())
    assert "layer_types" not in cfg and not cfg["use_sliding_window"] and cfg["sliding_window"] == 4
    cfg = json.loads((built[("mistral", "no-window-key")] / "config.json").read_text())
    assert "sliding_window" not in cfg


def test_greedy(built, logits):
    p = built[("llama", "gqa")]
    g = H.reference_greedy(p, IDS, 5)
    assert len(g) == 5 and all(isinstance(t, int) for t in g)
    assert g[0] == int(logits[("llama", "gqa")][-1].argmax())
    assert H.reference_greedy(p, IDS, 5) == g
    # continuing the prompt with the first generated token gives the remaining ones
    assert H.reference_greedy(p, IDS + g[:1], 4) == g[1:]


def test_seed_changes_weights(tmp_path, logits):
    H.make_model("llama", "gqa", tmp_path / "s1", seed=1)
    assert np.abs(H.reference_logits(tmp_path / "s1", IDS) - logits[("llama", "gqa")]).max() > 0.05
    H.make_model("llama", "gqa", tmp_path / "s0", seed=0)
    assert np.abs(H.reference_logits(tmp_path / "s0", IDS) - logits[("llama", "gqa")]).max() < 1e-6


def test_remake_in_place_invalidates_cache(tmp_path):
    p = tmp_path / "m"
    H.make_model("opt", "pre-ln", p, seed=0)
    a = H.reference_logits(p, IDS)
    H.make_model("opt", "pre-ln", p, seed=3)
    b = H.reference_logits(p, IDS)
    assert np.abs(a - b).max() > 0.05


def test_falcon_alibi_reference_uses_sdpa(built, logits):
    """transformers 5.x Falcon eager attention adds ALiBi twice; the fixture uses SDPA.

    If this starts failing, transformers changed its Falcon ALiBi path: re-check
    docs/hf_semantics.md (section Falcon / ALiBi) and hf_models._default_attn_impl.
    """
    p = built[("falcon", "alibi")]
    eager = H.reference_logits(p, IDS, attn_implementation="eager")
    assert np.abs(eager - logits[("falcon", "alibi")]).max() > 0.05
    # for rotary Falcon the two implementations agree
    q = built[("falcon", "sequential")]
    a = H.reference_logits(q, IDS, attn_implementation="eager")
    b = H.reference_logits(q, IDS, attn_implementation="sdpa")
    assert np.abs(a - b).max() < 1e-4
