"""Sparse FFNs: predict / sparse_ffn semantics, predictor training, insert-predictors, eval."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_llama, with_tokenizer

from picc.cli import main
from picc.errors import PiccError
from picc.frontend.picc_file import save_picc
from picc.interpreter import Interpreter
from picc.ir import VerifyError, parse, print_module, verify
from picc.ir.sparse_ops import Predict, SparseFFN
from picc.passes import parse_pipeline, run_pipeline
from picc.sparsity.evaluation import densified, eval_windows, evaluate
from picc.sparsity.predictors import MIN_RANK, LayerData, predictor_params, train_all, train_predictor

PROFILE = "profile-activations{calib=ptb,tokens=1024,window=64,target-sparsity=0.5}"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "cache"))


def sparse_model(form: str, mode: str, **kw):
    model = with_tokenizer(tiny_llama(form, n_ff=128, **kw))
    module = run_pipeline(model.module, model.weights, parse_pipeline(f"{PROFILE},insert-predictors{{mode={mode}}}"),
                          tokenizer=model.tokenizer)
    verify(module)
    return model, module


_BUILT: dict[tuple[str, str], tuple] = {}


def built(form: str, mode: str):
    """``sparse_model`` built once per test module (for tests that only read the result)."""
    if (form, mode) not in _BUILT:
        _BUILT[form, mode] = sparse_model(form, mode)
    return _BUILT[form, mode]


def torch_sparse_ffn(op: SparseFFN, pred: Predict | None, weights, x: np.ndarray) -> np.ndarray:
    """The op's meaning written independently: a dense torch FFN with the inactive neurons masked."""
    w = {n: torch.from_numpy(weights.f32(n)).double() for n in weights if isinstance(n, str)}
    xt = torch.from_numpy(x).double()
    gate = xt @ w[op.gate].T
    up = xt @ w[op.up].T
    act = torch.relu(gate) if op.form == "reglu" else torch.nn.functional.silu(gate)
    h = act * up
    if op.mode == "predictor":
        logits = torch.relu(xt @ w[pred.fc1].T + w[pred.fc1_bias]) @ w[pred.fc2].T + w[pred.fc2_bias]
        keep = logits > pred.threshold
    elif op.mode == "gate-first":
        scale = w[op.score_scale] if op.score_scale else 1.0
        keep = act.abs() * scale > op.threshold
    else:
        keep = h.abs() > op.down_threshold
    return ((h * keep) @ w[op.down].T).numpy()


@pytest.mark.parametrize("form, mode", [("reglu", "predictor"), ("reglu", "gate-first"),
                                        ("swiglu", "gate-first"), ("swiglu", "down-only")])
def test_sparse_execution_equals_masked_dense_torch(form, mode):
    model, module = built(form, mode)
    func = module.function()
    op = next(o for o in func.ops if isinstance(o, SparseFFN))
    assert op.mode == mode
    # SwiGLU thresholds follow the fisher rule (scaled scores); ReGLU's is 0, exact, unscaled.
    assert (op.score_scale is not None) == (form == "swiglu")
    pred = func.producer(op.mask) if op.mask else None
    interp = Interpreter(module, model.weights)
    seen = []
    interp.on_ffn = lambda trace: seen.append(trace.x) if trace.op.result == op.result else None
    interp.run(model.tokenizer.encode("the company said its shares rose in new york trading"))
    x = seen[0]  # the op's real input
    env = {op.x: x}
    if pred is not None:
        env[pred.result] = interp.eval(pred, env)
    got = interp.eval(op, env)
    want = torch_sparse_ffn(op, pred, model.weights, x)
    # float32 (interpreter) against float64 (torch); a decision at the threshold's rounding edge
    # would show as a large error, so the bound also proves the masks are the same.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if pred is not None and form == "reglu":
        assert interp.eval(pred, env).mean() < 0.95  # it really skips neurons


def test_sparse_module_round_trips_and_densifies_back():
    model, module = built("reglu", "predictor")
    text = print_module(module)
    assert parse(text) == module
    assert '%l0.ffn.mask = predict %l0.ffn_norm, @l0.pred.fc1, @l0.pred.fc2' in text
    assert 'mask=%l0.ffn.mask {form = "reglu"' in text and 'mode = "predictor"' in text
    assert model.weights["l0.pred.fc1"].dtype.value == "f16"
    dense = densified(module)
    assert not any(o.NAME in ("predict", "sparse_ffn") for o in dense.ops())
    tokens = [1, 7, 20, 33, 4]
    np.testing.assert_array_equal(Interpreter(dense, model.weights).run(tokens),
                                  Interpreter(model.module, model.weights).run(tokens))


def test_gate_first_at_relu_threshold_is_exact():
    model, module = built("reglu", "gate-first")
    tokens = list(range(1, 30))
    np.testing.assert_allclose(Interpreter(module, model.weights).run(tokens),
                               Interpreter(model.module, model.weights).run(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('{ffn = "l0.ffn.out"', '{ffn = "l1.ffn.out"'),
     "mask %l0.ffn.mask comes from a predictor trained for %l1.ffn.out, not %l0.ffn.out"),
    (lambda t: t.replace(", mask=%l0.ffn.mask", ""), "mode 'predictor' needs a mask operand"),
    (lambda t: t.replace('mode = "predictor"', 'mode = "gate-first"', 1),
     "mode 'gate-first' computes its own mask; got mask %l0.ffn.mask"),
    (lambda t: t.replace('mode = "predictor"', 'mode = "lottery"', 1), "mode must be one of"),
])
def test_verifier_checks_masks_and_modes(edit, message):
    _, module = built("reglu", "predictor")
    with pytest.raises(VerifyError, match=message.replace("(", r"\(")):
        verify(parse(edit(print_module(module))))


def test_verifier_rejects_a_full_rank_predictor():
    _, module = built("reglu", "predictor")
    text = print_module(module)
    rank = module.weight_types()["l0.pred.fc1"].shape[0]
    bad = text.replace(f"weight @l0.pred.fc1 : f16[{rank}, 64]", "weight @l0.pred.fc1 : f16[64, 64]")
    bad = bad.replace(f"weight @l0.pred.fc1_bias : f16[{rank}]", "weight @l0.pred.fc1_bias : f16[64]")
    bad = bad.replace(f"weight @l0.pred.fc2 : f16[128, {rank}]", "weight @l0.pred.fc2 : f16[128, 64]")
    with pytest.raises(VerifyError, match="predictor rank 64 must be below min"):
        verify(parse(bad))


def synthetic_layer(n=3000, hidden=32, n_ff=64, seed=0) -> LayerData:
    """Active sets that a rank-8 MLP can represent: sign of a low-rank projection."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, hidden)).astype(np.float32)
    proj = rng.normal(size=(hidden, 8)) @ rng.normal(size=(8, n_ff))
    return LayerData(x, (x @ proj) > 1.5)


def test_training_reaches_recall_and_is_deterministic():
    data = synthetic_layer()
    a = train_predictor(data, 16, recall_target=0.95, seed=3)
    b = train_predictor(data, 16, recall_target=0.95, seed=3)
    np.testing.assert_array_equal(a.fc2, b.fc2)
    assert a.threshold == b.threshold
    assert a.meets(0.95)
    # selective, not "everything is active": it predicts at most half the skippable neurons
    assert a.predicted_density < a.true_density + 0.5 * (1 - a.true_density)
    assert np.array_equal(a.fc1, a.fc1.astype(np.float16).astype(np.float32))  # stored as f16


def test_ranks_grow_while_they_save_bytes_within_the_budget():
    layers = {"a": synthetic_layer(hidden=64, n_ff=128, seed=1), "b": synthetic_layer(hidden=64, n_ff=128, seed=2)}
    budget = predictor_params(16, 64, 128) + predictor_params(32, 64, 128)  # room for one doubling
    rounds: list[int] = []  # each round of the search says how many it trains: the bar's total
    done: list[str] = []
    trained = train_all(layers, {"a": 16, "b": 16}, 0.97, budget_params=budget, seed=0,
                        ffn_bytes={"a": 1e9, "b": 1e9}, progress=done.append, expect=rounds.append)
    assert rounds[0] == 2 and len(rounds) > 1 and sum(rounds) == len(done)
    assert sum(predictor_params(p.rank, 64, 128) for p in trained.values()) <= budget
    assert sorted(p.rank for p in trained.values()) == [16, 32]  # rank 32 pays at these FFN bytes
    for k, p in trained.items():  # the chosen rank is no worse than the start
        start = train_predictor(layers[k], 16, 0.97, seed=0)
        assert p.bytes_per_token(1e9) <= start.bytes_per_token(1e9)


def test_a_cheap_ffn_gets_a_smaller_predictor_than_an_expensive_one():
    """Bytes decide the rank: when the FFN costs little, a big predictor cannot pay for itself."""
    layers = {"a": synthetic_layer(hidden=64, n_ff=128, seed=1)}
    big = train_all(layers, {"a": 16}, 0.9, budget_params=10**6, seed=0, ffn_bytes={"a": 1e9})["a"]
    small = train_all(layers, {"a": 32}, 0.9, budget_params=10**6, seed=0, ffn_bytes={"a": 1.0})["a"]
    assert small.rank == MIN_RANK < 32 == big.rank  # 32 = min(hidden, n_ff) / 2, the largest allowed


def test_below_a_recall_of_one_the_search_still_tries_a_rank_that_pays():
    # A predictor may predict fewer neurons than are active when its recall target is below 1 (rank
    # 16 at 0.8 here: ~40% predicted, ~47% active). Whether a bigger rank could pay is bounded by
    # the active neurons the target needs found, not all of them, or the search never tries it.
    layers = {"a": synthetic_layer(hidden=64, n_ff=128, seed=1)}
    start = train_predictor(layers["a"], 16, 0.8, seed=0)
    assert start.predicted_density < start.true_density
    grown = train_all(layers, {"a": 16}, 0.8, budget_params=10**6, seed=0, ffn_bytes={"a": 1e9})["a"]
    assert grown.rank == 32 and grown.bytes_per_token(1e9) < start.bytes_per_token(1e9)


def test_parallel_training_gives_the_same_predictors():
    layers = {"a": synthetic_layer(seed=1), "b": synthetic_layer(seed=2)}
    one = train_all(layers, {"a": 8, "b": 8}, 0.97, budget_params=10**5, seed=0, workers=1)
    two = train_all(layers, {"a": 8, "b": 8}, 0.97, budget_params=10**5, seed=0, workers=2)
    for k in layers:
        np.testing.assert_array_equal(one[k].fc2, two[k].fc2)
        assert one[k].threshold == two[k].threshold
    with pytest.raises(ValueError, match="over the budget"):
        train_all(layers, {"a": 16, "b": 16}, 0.97, budget_params=100, seed=0)


def test_auto_mode_picks_by_bytes_and_reports_recall():
    model, module = built("reglu", "auto")
    modes = {o.result: o.mode for o in module.ops() if isinstance(o, SparseFFN)}
    assert set(modes.values()) <= {"predictor", "gate-first", "down-only"}
    for o in module.ops():
        if isinstance(o, Predict):
            assert o.recall is not None and 0.9 < o.recall <= 1.0


def test_swiglu_auto_is_gate_first():
    _, module = built("swiglu", "auto")
    assert {o.mode for o in module.ops() if isinstance(o, SparseFFN)} == {"gate-first"}


@pytest.mark.parametrize("rate, way", [(0.6, "gate-first"), (0.4, "down-only")])
def test_swiglu_auto_weighs_gathered_rows_by_their_rate(rate, way):
    # At 50% sparsity gate-first reads gate whole and half of up and down gathered (1 + 1/rate
    # matrices' time), down-only gate and up whole and half of down gathered (2 + 0.5/rate): equal
    # at rate 0.5, gate-first faster above, down-only below.
    model = with_tokenizer(tiny_llama("swiglu", n_ff=128))
    module = run_pipeline(model.module, model.weights,
                          parse_pipeline(f"{PROFILE},insert-predictors{{mode=auto,gathered-rate={rate}}}"),
                          tokenizer=model.tokenizer)
    assert {o.mode for o in module.ops() if isinstance(o, SparseFFN)} == {way}
    with pytest.raises(PiccError, match=r"gathered-rate=1.5: expected a share in \(0, 1\]"):
        parse_pipeline("insert-predictors{gathered-rate=1.5}")


def test_predictors_are_cached(monkeypatch, tmp_path):
    sparse_model("reglu", "predictor")
    import picc.passes.insert_predictors as ip

    def no_training(*a, **k):
        raise AssertionError("retrained although the cache holds these predictors")

    train_all = ip.train_all
    monkeypatch.setattr(ip, "train_all", no_training)
    sparse_model("reglu", "predictor")  # same model, same settings: from the cache
    # A damaged entry (cut short: the zip reader's own error) is retrained, not trusted.
    entries = list((tmp_path / "cache" / "predictors").glob("*.npz"))
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    trained = []
    monkeypatch.setattr(ip, "train_all", lambda *a, **k: trained.append(1) or train_all(*a, **k))
    sparse_model("reglu", "predictor")
    assert len(trained) == 1
    sparse_model("reglu", "predictor")
    assert len(trained) == 1  # the retrained entry serves again
    # A change to the training code (here: picc's sources as another version would have them) retrains.
    import shutil

    from picc import digest

    changed = tmp_path / "picc"
    shutil.copytree(digest.PACKAGE, changed, ignore=shutil.ignore_patterns("__pycache__"))
    with open(changed / "sparsity" / "predictors.py", "a") as f:
        f.write("# another version of the training\n")
    monkeypatch.setattr(digest, "PACKAGE", changed)
    sparse_model("reglu", "predictor")
    assert len(trained) == 2


def test_predictors_train_on_the_profiles_forward_when_they_read_the_same_tokens(monkeypatch, tmp_path):
    # A model whose training data would pass DATA_BYTES at more tokens than it profiles (a ReLU
    # LLaMA-7B: 4096 of 16384) trains on the profiled tokens: profiling keeps the ReLU FFN inputs
    # it saw and insert-predictors does not run that forward again (the 7B's took ~6 minutes).
    # The predictors are bit for bit those of a forward of its own.
    import picc.passes.insert_predictors as ip
    from picc.sparsity.sparsify import SparsifyOptions, sparsify

    model = with_tokenizer(tiny_llama("reglu", n_layers=2, n_ff=128))
    options = SparsifyOptions(mode="predictor", tokens=512, window=64)
    monkeypatch.setattr(ip, "DATA_BYTES", 1)  # training_tokens: the profiled ones
    own_forward = ip.collect_layer_data
    forwards: list[int] = []
    monkeypatch.setattr(ip, "collect_layer_data", lambda *a: forwards.append(1) or own_forward(*a))
    assert "keep-inputs=on" in options.pipeline(None, model)
    kept = sparsify(model, options, report=lambda _: None)
    assert forwards == []
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "other-cache"))  # a profile to compute, predictors to train
    own = run_pipeline(model.module, model.weights, options.passes(None), tokenizer=model.tokenizer)
    assert forwards == [1] and "keep-inputs" not in options.pipeline(None)
    predicts = [[op for op in m.ops() if isinstance(op, Predict)] for m in (kept, own)]
    assert len(predicts[0]) == 2
    for a, b in zip(*predicts, strict=True):
        assert a.threshold == b.threshold
        np.testing.assert_array_equal(model.weights.f32(a.fc2), model.weights.f32(b.fc2))
    # Where the predictors train on more tokens than profiling reads, profiling keeps nothing.
    monkeypatch.setattr(ip, "DATA_BYTES", 2 << 30)
    assert "keep-inputs" not in options.pipeline(None, model)


def test_an_unwritable_cache_does_not_fail_the_training(monkeypatch, tmp_path):
    # The cache directory cannot be made (a file is in the way): the predictors are trained and
    # used all the same, as the other caches behave.
    (tmp_path / "blocked").write_text("a file, not a directory")
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path / "blocked" / "cache"))
    _, module = sparse_model("reglu", "predictor")
    assert any(isinstance(o, Predict) for o in module.ops())


def test_unprofiled_and_ungated_errors():
    model = with_tokenizer(tiny_llama("reglu"))
    with pytest.raises(PiccError, match="has no profile; run profile-activations first"):
        run_pipeline(model.module, model.weights, parse_pipeline("insert-predictors"), tokenizer=model.tokenizer)
    model = with_tokenizer(tiny_llama("relu"))
    with pytest.raises(PiccError, match="mode gate-first needs gated FFNs; %l0.ffn.out is 'relu'"):
        run_pipeline(model.module, model.weights, parse_pipeline(f"{PROFILE},insert-predictors{{mode=gate-first}}"),
                     tokenizer=model.tokenizer)


def test_powerinfer_predictors_import(tmp_path):
    model = with_tokenizer(tiny_llama("reglu", n_ff=128))
    rng = torch.Generator().manual_seed(0)
    for i in range(2):
        torch.save({"fc1.weight": torch.randn(16, 64, generator=rng), "fc2.weight": torch.randn(128, 16, generator=rng)},
                   tmp_path / f"model_{i}.pt")
    (tmp_path / "config.json").write_text(json.dumps({"threshold": 0.25}))
    module = run_pipeline(model.module, model.weights,
                          parse_pipeline(f"{PROFILE},insert-predictors{{mode=predictor,predictors={tmp_path}}}"),
                          tokenizer=model.tokenizer)
    preds = [o for o in module.ops() if isinstance(o, Predict)]
    assert [p.threshold for p in preds] == [0.25, 0.25] and preds[0].recall is None
    (tmp_path / "model_1.pt").unlink()
    with pytest.raises(PiccError, match=r"model_1.pt: missing predictor for layer 1 \(%l1.ffn.out\)"):
        run_pipeline(model.module, model.weights,
                     parse_pipeline(f"{PROFILE},insert-predictors{{mode=predictor,predictors={tmp_path}}}"),
                     tokenizer=model.tokenizer)


def test_eval_matches_a_direct_perplexity_computation():
    model = with_tokenizer(tiny_llama("reglu"))
    windows = eval_windows(model.tokenizer, "ptb-valid", 300, 100)
    result = evaluate(model.module, model.weights, windows)
    nll, n = 0.0, 0
    for w in windows:
        logits = torch.from_numpy(Interpreter(model.module, model.weights).run(w)[:-1]).double()
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
        n += len(w) - 1
    assert result.tokens == n
    assert result.ppl == pytest.approx(np.exp(nll / n), rel=1e-5)
    assert result.ffn_sparsity is None and result.recall is None


def test_cli_sparsify_and_eval(tmp_path, capsys):
    src = tmp_path / "tiny.picc"
    save_picc(with_tokenizer(tiny_llama("reglu", n_ff=128)), src)
    out = tmp_path / "sparse.picc"
    assert main(["sparsify", str(src), "-o", str(out), "--sparsity-mode", "predictor", "--tokens", "2048",
                 "--dump-ir", str(tmp_path / "ir")]) == 0
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == [
        "00_input.picc", "01_profile-activations.picc", "02_insert-predictors.picc"]
    capsys.readouterr()
    assert main(["eval", str(out), "--max-tokens", "600", "--window", "100", "--compare-dense", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) >= {"ppl", "ppl_dense", "ppl_increase", "top1_agreement", "ffn_sparsity", "recall", "precision"}
    assert r["ppl_increase"] == pytest.approx(r["ppl"] / r["ppl_dense"] - 1)
    assert 0 < r["ffn_sparsity"] < 1 and 0.9 < r["recall"] <= 1 and 0 < r["precision"] <= 1
    assert 0.5 < r["top1_agreement"] <= 1


def test_max_ppl_increase_picks_the_sparsest_setting_within_budget(tmp_path, capsys):
    src = tmp_path / "tiny.picc"
    save_picc(with_tokenizer(tiny_llama("swiglu", n_ff=128)), src)
    out = tmp_path / "s.picc"
    assert main(["sparsify", str(src), "-o", str(out), "--max-ppl-increase", "0.02", "--tokens", "1024"]) == 0
    err = capsys.readouterr().err
    rows = [line.split() for line in err.splitlines() if line[:1].isdigit()]
    chosen = [r for r in rows if r[-1] == "chosen"]
    assert len(rows) == 6 and len(chosen) == 1
    increases = {float(r[0]): float(r[3].rstrip("%")) / 100 for r in rows}
    target = float(chosen[0][0])
    assert increases[target] <= 0.02
    assert all(inc > 0.02 for t, inc in increases.items() if t > target)
    module = parse(out.read_text())
    assert module.attr("profile_target_sparsity") == target


@pytest.mark.parametrize("flags, message", [
    (["--recall", "1.5"], "--recall 1.5: expected a share in (0, 1]"),
    (["--predictor-budget", "0"], "--predictor-budget 0.0: expected a share of the FFN weights in (0, 1]"),
    (["--target-sparsity", "1"], "--target-sparsity 1.0: expected a value in [0, 1)"),
    (["--max-ppl-increase", "-1"], "--max-ppl-increase -1.0: expected a value >= 0"),
])
def test_cli_sparsify_rejects_bad_flags(tmp_path, capsys, flags, message):
    assert main(["sparsify", "smollm2", "-o", str(tmp_path / "x.picc"), *flags]) == 1
    assert capsys.readouterr().err.strip() == f"picc: error: {message}"
    assert not (tmp_path / "x.picc").exists()
