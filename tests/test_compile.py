"""``picc compile`` and ``picc inspect`` end to end, on relu-demo and SmolLM2.

Compiling a sparsified ``.picc`` skips profiling, so one profile serves every budget here.
Logits of .pib files compiled with different budgets agree to 1e-5 relative: placement only
reorders float32 sums (see test_partition_neurons.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from picc.cli import main
from picc.frontend import load_model

REPORT_KEYS = {"target", "vram_budget_bytes", "gpu_bytes", "cpu_bytes", "layers", "estimate_tokens_per_s"}
LAYER_KEYS = {"gpu_neurons", "cpu_neurons", "gpu_activation_share"}


def compile_json(capsys, source, out, *flags) -> dict:
    assert main(["compile", str(source), "-o", str(out), *flags]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report.keys() >= REPORT_KEYS and all(la.keys() >= LAYER_KEYS for la in report["layers"])
    assert report["gpu_bytes"] <= report["vram_budget_bytes"]
    return report


def placements(path) -> set[str]:
    return {op.type.placement.value for op in load_model(path).module.ops()}


@pytest.fixture(scope="module")
def relu_sparse(tmp_path_factory):
    path = tmp_path_factory.mktemp("relu") / "relu.picc"
    assert main(["sparsify", "relu-demo", "--tokens", "512", "--sparsity-mode", "gate-first", "-o", str(path)]) == 0
    return path


def test_compile_inspect_and_logits_of_relu_demo(relu_sparse, tmp_path, capsys):
    logits = {}
    for vram in ("0", "8MB", "1GB"):
        out = tmp_path / f"relu_{vram}.pib"
        dump = tmp_path / f"ir_{vram}"
        report = compile_json(capsys, relu_sparse, out, "--target", "pc-low", "--vram", vram,
                              "--dump-ir", str(dump))
        assert report["target"] == "pc-low" and len(report["layers"]) == 6
        assert (dump / "02_neuron-major-down.picc").is_file()
        assert any(p.name.endswith("partition-neurons.picc") for p in dump.iterdir())
        npy = tmp_path / f"{vram}.npy"
        assert main(["logits", str(out), "--text", "the company said it expects", "--out", str(npy)]) == 0
        logits[vram] = np.load(npy)
    for vram in ("8MB", "1GB"):
        assert np.abs(logits[vram] - logits["0"]).max() <= 1e-5 * np.abs(logits["0"]).max()
    assert main(["inspect", str(tmp_path / "relu_8MB.pib"), "--plot", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    assert "estimate:" in text and "tokens/s" in text
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: CUDA sources cannot be compiled")
def test_gpu_parts_carry_cuda_kernels_that_compile_alone_and_the_cpu_still_runs_all(relu_sparse, tmp_path, capsys):
    out = tmp_path / "gpu.pib"
    compile_json(capsys, relu_sparse, out, "--target", "pc-low", "--vram", "12MB")
    assert {"gpu", "cpu"} <= placements(out)
    assert main(["inspect", str(out), "--emit-cuda", str(tmp_path / "cu")]) == 0
    sources = sorted((tmp_path / "cu").glob("*.cu"))
    kinds = {p.name.split("_")[0] for p in sources}
    assert {"gemv", "attention", "rms", "rope", "gate"} <= kinds, kinds
    for src in sources:  # self-contained: each compiles on its own
        proc = subprocess.run(["nvcc", "-ptx", "-arch=sm_75", str(src), "-o", str(src.with_suffix(".ptx"))],
                              capture_output=True, text=True)
        assert proc.returncode == 0, (src.name, proc.stderr[-500:])
    # Until the GPU executor lands, the CPU executor runs every op of a hybrid plan, and agrees
    # with the interpreter on the same (split, permuted) IR.
    ids = "3,17,250,11,9,402,7"
    for flag, name in (([], "rt.npy"), (["--interpreter"], "ip.npy")):
        assert main(["logits", str(out), "--tokens", ids, "--out", str(tmp_path / name), *flag]) == 0
    runtime, interp = np.load(tmp_path / "rt.npy"), np.load(tmp_path / "ip.npy")
    assert np.abs(runtime - interp).max() <= 1e-3 * np.abs(interp).max()


def test_bad_arguments_fail_fast_in_one_line_and_write_nothing(relu_sparse, tmp_path, capsys):
    out = tmp_path / "x.pib"
    cases = [
        (["--target", "cpu", "--vram", "1GB"], "target 'cpu' has no GPU"),
        (["--target", "pc-low", "--vram", "lots"], "expected a size such as 11GB"),
        (["--target", "nowhere"], "unknown target 'nowhere'"),
        (["--ctx", "0"], "--ctx 0"),
    ]
    for flags, message in cases:
        assert main(["compile", str(relu_sparse), "-o", str(out), *flags]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert "pipeline" not in err  # refused before any work
    assert main(["compile", str(relu_sparse), "-o", str(tmp_path / "x.bin")]) == 1
    assert "ending in .pib" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "bad.pib").write_bytes(b"PICCPIB\0" + b"\0" * 10)
    assert main(["inspect", str(tmp_path / "bad.pib")]) == 1
    assert "truncated" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2_sparse(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2") / "smollm2.picc"
    assert main(["sparsify", "smollm2", "--tokens", "256", "-o", str(path)]) == 0
    return path


@pytest.mark.slow
class TestSmolLM2:
    @pytest.fixture
    def sparse(self, smollm2_sparse):
        return smollm2_sparse

    def test_11gb_on_pc_low_puts_everything_on_the_gpu(self, sparse, tmp_path, capsys):
        report = compile_json(capsys, sparse, tmp_path / "a.pib", "--target", "pc-low", "--vram", "11GB")
        assert all(la["cpu_neurons"] == 0 and la["gpu_activation_share"] == 1.0 for la in report["layers"])
        assert placements(tmp_path / "a.pib") == {"gpu"}

    def test_60mb_splits(self, sparse, tmp_path, capsys):
        report = compile_json(capsys, sparse, tmp_path / "b.pib", "--target", "pc-low", "--vram", "60MB")
        gpu = sum(la["gpu_neurons"] for la in report["layers"])
        cpu = sum(la["cpu_neurons"] for la in report["layers"])
        assert gpu > 0 and cpu > 0
        assert report["gpu_bytes"] > 0.9 * 60e6  # the budget is used, not left idle

    def test_zero_vram_is_cpu_only_and_cpu_target_has_no_gpu(self, sparse, tmp_path, capsys):
        for name, flags in (("c", ["--target", "pc-low", "--vram", "0"]), ("d", ["--target", "cpu"])):
            report = compile_json(capsys, sparse, tmp_path / f"{name}.pib", *flags)
            assert report["gpu_bytes"] == 0 and all(la["gpu_neurons"] == 0 for la in report["layers"])
            assert placements(tmp_path / f"{name}.pib") == {"cpu"}
