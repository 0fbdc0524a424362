"""Calibration text and activation profiling on small models (SmolLM2 in test_profile_smollm2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_llama, with_tokenizer, word_tokenizer

from picc.cli import main
from picc.errors import PiccError
from picc.frontend.picc_file import save_picc
from picc.interpreter import Interpreter
from picc.ir import parse, print_module, verify
from picc.passes import parse_pipeline, run_pipeline
from picc.sparsity.calib import load_text, token_windows
from picc.sparsity.profiling import (
    calibrate,
    calibrated_threshold,
    calibrated_threshold_of,
    ffn_ops,
    profile_model,
    profile_sweep,
)


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(128)


class TestCalibration:
    def test_builtin_corpora(self):
        assert len(load_text("ptb")) > 4_000_000
        assert load_text("ptb-valid") != load_text("ptb-test")

    def test_files_and_directories(self, tmp_path):
        (tmp_path / "b.txt").write_text("second file")
        (tmp_path / "a.txt").write_text("first file")
        (tmp_path / "c.md").write_text("ignored")
        assert load_text(str(tmp_path)) == "first file\nsecond file"
        assert load_text(str(tmp_path / "a.txt")) == "first file"

    @pytest.mark.parametrize("make, message", [
        (lambda p: "wikitext", "'wikitext' is neither a built-in corpus (ptb, ptb-valid, ptb-test)"),
        (lambda p: str(p), "directory has no .txt files"),
        (lambda p: (p / "bad.txt").write_bytes(b"\xff\xfe\x00bad") and str(p / "bad.txt"),
         "bad.txt: cannot read as UTF-8 text"),
    ])
    def test_bad_sources(self, tmp_path, make, message):
        with pytest.raises(PiccError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_text(make(tmp_path))

    def test_windows_are_deterministic_for_a_seed(self, tok):
        a = token_windows(tok, "ptb-valid", 1000, window=100, seed=3)
        b = token_windows(tok, "ptb-valid", 1000, window=100, seed=3)
        c = token_windows(tok, "ptb-valid", 1000, window=100, seed=4)
        assert a == b and a != c
        assert len(a.windows) == 10 and all(len(w) == 100 and w[0] == tok.bos_id for w in a.windows)

    def test_too_little_text(self, tok, tmp_path):
        (tmp_path / "t.txt").write_text("the market " * 20)
        with pytest.raises(PiccError, match="has 40 tokens: not enough for 2 windows of 32"):
            token_windows(tok, str(tmp_path / "t.txt"), 64, window=32)


def test_calibrated_threshold_hits_the_target():
    scores = np.random.default_rng(0).exponential(size=(300, 77)).astype(np.float32)
    for target in (0.0, 0.1, 0.5, 0.93):
        t = calibrated_threshold(scores, target)
        sparsity = float((scores <= t).mean())
        assert target <= sparsity <= target + 1 / scores.size + 1e-12


def test_the_threshold_of_many_arrays_is_that_of_their_concatenation():
    rng = np.random.default_rng(1)
    arrays = [rng.exponential(size=(300, 77)).astype(np.float32), np.zeros((5, 77), np.float32),
              rng.normal(size=(40, 77)).astype(np.float32), np.full((64, 77), 0.5, np.float32),
              -rng.exponential(size=(3, 77)).astype(np.float32) * 1e-30]
    together = np.concatenate(arrays)
    for target in (0.0, 1e-4, 0.02, 0.1, 0.3, 0.5, 0.6, 0.93, 0.999):
        assert calibrated_threshold_of(arrays, target) == calibrated_threshold(together, target)


def test_profiling_holds_the_scores_but_one_layer_of_h_at_a_time(tok):
    # A SwiGLU layer's profile needs every token's scores (its threshold is a quantile of them, and
    # the fisher rule's is one over all layers) and |h| (for the down threshold). Held for all 32
    # layers of a 7B over 4096 tokens, with the fisher rule's concatenation, that was 17 GB; the
    # down thresholds are now taken as each layer completes and the shared one without a copy.
    import tracemalloc

    n_layers, n_ff, tokens = 6, 512, 1024
    model = tiny_llama("swiglu", n_layers=n_layers, n_ff=n_ff, seed=3)
    model.weights.f32("token_embd")  # nothing of the model's own is allocated in the measurement
    windows = token_windows(tok, "ptb", tokens, window=64, seed=2)
    scales = {op.result: np.linspace(0.5, 2, n_ff, dtype=np.float32) for op in ffn_ops(model.module)}
    layer = tokens * n_ff * 4  # one layer's scores, or its |h|, in float32
    tracemalloc.start()
    try:
        (profile,) = profile_sweep(model.module, model.weights, windows, [0.4], scales=scales)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (n_layers + 4) * layer  # all the scores, one layer's |h| and temporaries (was 3x the scores)
    scores, h = {}, {}  # every window's, recomputed without the profiling code
    interp = Interpreter(model.module, model.weights)

    def observe(trace):
        scores.setdefault(trace.op.result, []).append(trace.score * scales[trace.op.result])
        h.setdefault(trace.op.result, []).append(np.abs(trace.h))

    interp.on_ffn = observe
    for w in windows.windows:
        interp.reset()
        interp.run(list(w))
    threshold = calibrated_threshold(np.concatenate([np.concatenate(v).ravel() for v in scores.values()]), 0.4)
    for got in profile.layers:
        assert got.threshold == threshold
        np.testing.assert_array_equal(got.freq, ((np.concatenate(scores[got.ffn]) > threshold).sum(0) / tokens)
                                      .astype(np.float32))
        assert got.down_threshold == calibrated_threshold(np.concatenate(h[got.ffn]), 0.4)


def brute_force(model, windows, threshold_of, scaled=None):
    """Per-layer active counts recomputed from each window's ffn scores (no profiling code);
    ``scaled`` multiplies a layer's scores by its scales first."""
    counts, mags = {}, {}
    interp = Interpreter(model.module, model.weights)

    def observe(trace):
        scale = (scaled or {}).get(trace.op.result)
        counts.setdefault(trace.op.result, []).append(trace.score if scale is None else trace.score * scale)
        mags.setdefault(trace.op.result, []).append(np.abs(trace.h))

    interp.on_ffn = observe
    for w in windows.windows:
        interp.reset()
        interp.run(list(w))
    return ({k: (np.concatenate(v) > threshold_of(k, np.concatenate(v))).mean(0) for k, v in counts.items()},
            {k: np.concatenate(v).mean(0) for k, v in mags.items()})


def test_relu_profile_counts_positive_activations(tok):
    model = tiny_llama("reglu", n_layers=3)
    windows = token_windows(tok, "ptb", 512, window=64, seed=1)
    profile = profile_model(model.module, model.weights, windows)
    assert profile.target_sparsity is None
    freq, mag = brute_force(model, windows, lambda k, s: 0.0)
    for layer in profile.layers:
        assert layer.threshold == 0.0
        np.testing.assert_array_equal(layer.freq, freq[layer.ffn].astype(np.float32))
        np.testing.assert_allclose(layer.mag, mag[layer.ffn], rtol=1e-5)
        assert 0.2 < layer.sparsity < 0.8  # a random ReGLU: about half the gates are negative


def test_swiglu_thresholds_reach_the_target_sparsity(tok):
    model = tiny_llama("swiglu", n_layers=2)
    windows = token_windows(tok, "ptb", 512, window=64)
    profile = profile_model(model.module, model.weights, windows, target_sparsity=0.7)
    assert profile.target_sparsity == 0.7
    assert abs(profile.mean_sparsity - 0.7) <= 0.001
    assert all(layer.threshold > 0 for layer in profile.layers)
    thresholds = {layer.ffn: layer.threshold for layer in profile.layers}
    freq, _ = brute_force(model, windows, lambda k, s: thresholds[k])
    for layer in profile.layers:
        np.testing.assert_array_equal(layer.freq, freq[layer.ffn].astype(np.float32))


def test_fisher_rule_puts_one_threshold_on_scaled_scores(tok, monkeypatch):
    # Each neuron's |act(g)| times its Fisher scale against one threshold for every layer: the
    # recount from the interpreter's scores (no profiling code) gives the same frequencies, the
    # mean sparsity is the target, and the layers differ (CATS would make each one 0.4).
    model = tiny_llama("swiglu", n_layers=3)
    windows = token_windows(tok, "ptb", 512, window=64, seed=2)
    # The scores come from the Fisher pass's own forward (torch), not from a pass of the interpreter.
    with monkeypatch.context() as m:
        m.setattr(Interpreter, "run_many", lambda *a, **k: pytest.fail("a second forward pass"))
        (profile,) = calibrate(model.module, model.weights, windows, [0.4], rule="fisher")
    assert profile.rule == "fisher"
    thresholds = {layer.threshold for layer in profile.layers}
    assert len(thresholds) == 1 and thresholds.pop() > 0
    assert abs(profile.mean_sparsity - 0.4) <= 0.001
    assert max(layer.sparsity for layer in profile.layers) - min(layer.sparsity for layer in profile.layers) > 0.02
    scale = {layer.ffn: layer.score_scale for layer in profile.layers}
    assert all(s is not None and s.shape == (96,) and (s > 0).all() for s in scale.values())
    freq, mag = brute_force(model, windows, lambda k, s: profile.layers[0].threshold, scaled=scale)
    for layer in profile.layers:
        # torch's float32 products and numpy's may differ in the last bits, so a (token, neuron)
        # pair whose score is that close to the threshold may fall on either side: at most 2 of
        # the layer's 49152 pairs (~0.1 expected at 1e-6 relative), not a change of statistics.
        assert np.abs(layer.freq - freq[layer.ffn]).sum() * windows.n_tokens <= 2
        np.testing.assert_allclose(layer.mag, mag[layer.ffn], rtol=1e-5)
    (cats,) = calibrate(model.module, model.weights, windows, [0.4], rule="cats")
    assert cats.rule == "cats" and all(layer.score_scale is None for layer in cats.layers)
    assert all(abs(layer.sparsity - 0.4) <= 0.001 for layer in cats.layers)
    with pytest.raises(PiccError, match="threshold rule must be one of fisher, cats, got 'teal'"):
        calibrate(model.module, model.weights, windows, [0.4], rule="teal")


def test_non_relu_models_need_a_target(tok):
    model = tiny_llama("swiglu")
    with pytest.raises(PiccError, match="not ReLU-sparse .*give a target sparsity"):
        profile_model(model.module, model.weights, token_windows(tok, "ptb", 64, window=64))


def test_profile_pass_attaches_statistics_to_the_ir(tok):
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2))
    pipeline = parse_pipeline("profile-activations{calib=ptb-valid,tokens=256,window=64,target-sparsity=0.4}")
    module = run_pipeline(model.module, model.weights, pipeline, tokenizer=model.tokenizer)
    verify(module)
    text = print_module(module)
    assert parse(text) == module
    assert ("%l0.ffn.out = ffn %l0.ffn_norm, @l0.ffn.up, @l0.ffn.down, gate=@l0.ffn.gate, "
            "freq=@l0.ffn.freq, mag=@l0.ffn.mag, score_scale=@l0.ffn.score_scale {form = \"swiglu\", "
            "threshold = ") in text
    assert module.attr("profile_calib") == "ptb-valid" and module.attr("profile_tokens") == 256
    assert module.attr("profile_target_sparsity") == 0.4 and module.attr("profile_rule") == "fisher"
    # The fisher rule (the default) spreads the target over the layers; their mean is the target.
    freq = [model.weights.f32(f"l{i}.ffn.freq") for i in range(2)]
    assert freq[1].shape == (96,) and abs((1 - np.mean(freq)) - 0.4) <= 0.01
    # Profiling describes the model; it does not change what it computes.
    tokens = [1, 5, 9, 2]
    np.testing.assert_array_equal(Interpreter(module, model.weights).run(tokens),
                                  Interpreter(model.module, model.weights).run(tokens))
    # Profiling again adds new weights instead of overwriting (the store is append-only).
    again = run_pipeline(module, model.weights, pipeline, tokenizer=model.tokenizer)
    assert "freq=@l0.ffn.freq2" in print_module(again)
    # The same thresholds: the scales of the first profile do not scale the second one's scores.
    assert [op.threshold for op in ffn_ops(again)] == [op.threshold for op in ffn_ops(module)]


def test_cli_profile_json_plot_and_npz(tmp_path, capsys):
    path = tmp_path / "tiny.picc"
    save_picc(with_tokenizer(tiny_llama("reglu", n_layers=3)), path)
    png, npz = tmp_path / "p.png", tmp_path / "s.npz"
    argv = ["profile", str(path), "--tokens", "256", "--window", "64", "--json", "--plot", str(png),
            "-o", str(npz)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [layer["ffn"] for layer in out["layers"]] == ["l0.ffn.out", "l1.ffn.out", "l2.ffn.out"]
    for layer in out["layers"]:
        assert 0 < layer["sparsity"] < 1 and layer["top10"] <= layer["top20"] <= layer["top50"] <= 1
        assert layer["top10"] >= 0.1  # the 10% most active neurons carry at least 10% of activity
    assert out["mean_sparsity"] == pytest.approx(np.mean([la["sparsity"] for la in out["layers"]]))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    stats = np.load(npz)
    assert stats["layer2.freq"].shape == (96,)
    assert json.loads(str(stats["summary"]))["mean_sparsity"] == out["mean_sparsity"]
    # deterministic for a seed
    assert main(argv[:-4] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == out


def test_cli_profile_table(tmp_path, capsys):
    path = tmp_path / "tiny.picc"
    save_picc(with_tokenizer(tiny_llama("swiglu", n_layers=2)), path)
    assert main(["profile", str(path), "--tokens", "128", "--window", "64", "--target-sparsity", "0.3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["ffn", "sparsity", "threshold", "top10%", "top20%", "top50%"]
    assert "mean sparsity 0.300 over 2 FFN layers; 128 tokens of ptb (seed 0)" in out


def test_calibration_is_cached_by_model_tokens_and_settings(tok, tmp_path, monkeypatch):
    """A second calibration of the same model on the same tokens reads the profiles back without
    running the model; another target, rule, seed or weight computes afresh, and a damaged entry
    is recomputed."""
    import picc.sparsity.profiling as profiling

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    model = tiny_llama("swiglu", n_layers=2)
    windows = token_windows(tok, "ptb", 256, window=64, seed=1)
    runs = []
    observe = profiling._observer  # what every profiling pass (the Fisher rule's too) starts with
    monkeypatch.setattr(profiling, "_observer", lambda *a, **k: runs.append(1) or observe(*a, **k))

    first = calibrate(model.module, model.weights, windows, [0.3, 0.5])
    again = calibrate(model.module, model.weights, windows, [0.3, 0.5])
    assert len(runs) == 1
    for a, b in zip(first, again, strict=True):
        assert (a.calib, a.tokens, a.window, a.seed, a.target_sparsity, a.rule) == \
               (b.calib, b.tokens, b.window, b.seed, b.target_sparsity, b.rule)
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert (la.ffn, la.threshold, la.down_threshold) == (lb.ffn, lb.threshold, lb.down_threshold)
            for x, y in ((la.freq, lb.freq), (la.mag, lb.mag), (la.score_scale, lb.score_scale)):
                assert x.dtype == y.dtype and np.array_equal(x, y)

    calibrate(model.module, model.weights, windows, [0.3, 0.5], cache=False)  # asked to compute again
    assert len(runs) == 2
    calibrate(model.module, model.weights, windows, [0.4])
    calibrate(model.module, model.weights, windows, [0.3, 0.5], rule="cats")
    calibrate(model.module, model.weights, token_windows(tok, "ptb", 256, window=64, seed=2), [0.3, 0.5])
    up = ffn_ops(model.module)[0].up
    kept = model.weights[up].data[0, 0]
    model.weights[up].data[0, 0] = kept + 1.0
    calibrate(model.module, model.weights, windows, [0.3, 0.5])
    assert len(runs) == 6
    model.weights[up].data[0, 0] = kept
    (entry,) = [p for p in (tmp_path / "profiles").iterdir()
                if p == profiling.profile_cache_path(model.module, model.weights, windows, [0.3, 0.5], "fisher")]
    whole = entry.read_bytes()
    for damaged in (b"not an npz", whole[: len(whole) // 2]):  # ValueError, zipfile.BadZipFile
        entry.write_bytes(damaged)
        assert calibrate(model.module, model.weights, windows, [0.3, 0.5])[0].layers[0].threshold == \
            first[0].layers[0].threshold
    assert len(runs) == 8
    # The pass's cache option: off computes again, on (the default) reads the entry.
    loaded = with_tokenizer(model)
    for option, computed in (("", True), (",cache=off", True), ("", False)):
        before = len(runs)
        run_pipeline(loaded.module, loaded.weights, parse_pipeline(
            f"profile-activations{{tokens=128,window=64,target-sparsity=0.3{option}}}"), tokenizer=loaded.tokenizer)
        assert (len(runs) > before) == computed, option


def test_corpus_ids_are_cached_by_text_and_tokenizer(tok, tmp_path, monkeypatch):
    from picc.sparsity import calib

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat . " * 50)
    source = str(tmp_path / "corpus.txt")
    calib._corpus_ids.cache_clear()
    ids = calib._corpus_ids(tok, source)
    assert ids == tok.backend.encode(load_text(source), add_special_tokens=False).ids
    (entry,) = (tmp_path / "corpus-ids").iterdir()
    assert np.load(entry).tolist() == ids
    calib._corpus_ids.cache_clear()
    monkeypatch.setattr(type(tok.backend), "encode", lambda *a, **k: pytest.fail("encoded again"))
    with pytest.raises(pytest.fail.Exception):  # the patch holds
        tok.backend.encode("the cat")
    assert calib._corpus_ids(tok, source) == ids
    calib._corpus_ids.cache_clear()


def test_the_cached_results_name_source_files_that_exist():
    # Profiles and trained predictors are cached under a hash of the code they come from; a
    # source that moved (picc/profiling.py -> picc/sparsity/profiling.py) must not make every
    # profile and every training crash with FileNotFoundError.
    from picc.digest import PACKAGE
    from picc.sparsity.predictor_store import TRAINING_SOURCES
    from picc.sparsity.profiling import _PROFILE_SOURCES

    missing = [name for name in (*_PROFILE_SOURCES, *TRAINING_SOURCES) if not (PACKAGE / name).is_file()]
    assert not missing
