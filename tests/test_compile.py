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


def ffn_share_budget(pib_path, share: float) -> int:
    """A VRAM budget that holds what the (all-on-the-GPU) ``pib_path`` holds but its output head
    (placed only once every FFN neuron is) and ``1 - share`` of its FFN weights: the partitioner
    then puts about ``share`` of the FFN on the GPU."""
    from picc.ir.fused_ops import FusedFFN
    from picc.pib import open_pib
    from picc.placement.schedule import schedule

    with open_pib(pib_path) as pib:
        plan = pib.json("plan")
    module = load_model(pib_path).module
    ffn_weights = {w for op in module.ops() if isinstance(op, FusedFFN) for w in op.weights()}
    head = set(schedule(module).head)
    head_weights = {w for op in module.ops() if op.result in head for w in op.weights()}
    gpu = {b["name"]: b["nbytes"] for b in plan["buffers"] if b["device"] == "gpu"}
    ffn_bytes = sum(n for name, n in gpu.items() if name in ffn_weights)
    head_bytes = sum(n for name, n in gpu.items() if name in head_weights)
    assert ffn_bytes > 0 and head_bytes > 0
    return int(plan["gpu_bytes"] - head_bytes - (1 - share) * ffn_bytes)


# Comparing a compiled file with the interpreter. Sparse FFNs decide per neuron against a
# threshold (a gate score, a predictor logit); the runtime's kernels sum in other orders than
# numpy, so the two see each decision's input a few float32 roundings apart (~1e-7 of the size of
# the dot product that makes it, |w| |x|). A decision closer than that to its threshold may go
# the other way, and one neuron flipped in an early layer moves the logits by percents (seen: 2e-2
# after a decision 3e-9 |w| |x| from its threshold). Such a flip is legitimate; anything else is not.
# So on each candidate prompt the logits must agree to 1e-3 (the bound) token by token,
# until a token where they do not -- which must then hold a decision within FLIP (10x the
# rounding) of its threshold, and ends that prompt's comparison (the KV cache carries the flip).
CANDIDATES = ([1, 504, 31, 7, 2020, 9], [3, 17, 250, 11, 9, 402], [1, 880, 11, 9, 31, 2020], [7, 7, 504, 3, 250, 17])
FLIP = 1e-6


class _MarginProbe:
    """The interpreter, noting per position the smallest distance of any active-set decision from
    its threshold, relative to the size of the dot product it comes from."""

    def __init__(self, model) -> None:  # noqa: ANN001
        from picc.interpreter import Interpreter, predictor_logits
        from picc.ir.fused_ops import FusedFFN
        from picc.ir.sparse_ops import Predict

        probe = self
        weights = model.weights

        class Probe(Interpreter):
            def eval(self, op, env):  # noqa: ANN001, ANN202
                if isinstance(op, Predict):
                    hid = np.maximum(env[op.x] @ weights.f32(op.fc1).T + (weights.f32(op.fc1_bias) if op.fc1_bias
                                                                           else 0), 0)
                    logits = predictor_logits(op, env[op.x], weights)
                    size = np.linalg.norm(weights.f32(op.fc2), axis=1)[None, :] * np.linalg.norm(hid, axis=1)[:, None]
                    probe.note(np.abs(logits - op.threshold) / np.maximum(size, 1e-30))
                return super().eval(op, env)

        def observe(trace) -> None:  # noqa: ANN001
            op = trace.op
            if isinstance(op, FusedFFN) and op.mode == "gate-first" and op.threshold > 0:
                rows = weights.f32(op.gate).reshape(-1, trace.x.shape[1])
                size = np.linalg.norm(rows, axis=1)[None, :] * np.linalg.norm(trace.x, axis=1)[:, None]
                probe.note(np.abs(trace.score - op.threshold) / size)
            elif isinstance(op, FusedFFN) and op.mode == "down-only":
                raise AssertionError("the margin probe does not handle down-only FFNs")

        self.interp = Probe(model.module, model.weights)
        self.interp.on_ffn = observe
        self.margins = np.zeros(0)

    def note(self, distance: np.ndarray) -> None:
        np.minimum(self.margins, distance.min(axis=1), out=self.margins)

    def run(self, ids: list[int]) -> np.ndarray:
        self.margins = np.full(len(ids), np.inf)
        self.interp.reset()
        return self.interp.run(ids)


def assert_matches_the_interpreter(pib_path, gpu: str = "emulate") -> int:
    """The runtime's logits on each candidate prompt against the interpreter's (see above);
    returns how many tokens were compared (at least half of them must be)."""
    from picc.pib import load_pib
    from runtime.session import Session

    probe = _MarginProbe(load_pib(pib_path))
    compared = 0
    with Session(pib_path, gpu=gpu) as session:
        for ids in CANDIDATES:
            reference = probe.run(ids)
            session.reset()
            got = session.feed(ids, all_logits=True)
            errors = np.abs(got - reference).max(axis=1) / np.abs(reference).max()
            for t, error in enumerate(errors):
                if error > 1e-3:
                    assert probe.margins[t] < FLIP, (f"token {t} of {ids}: error {error:.1e} with every decision "
                                                     f"{probe.margins[t]:.1e} from its threshold")
                    break
                compared += 1
    assert compared >= sum(len(c) for c in CANDIDATES) // 2, compared
    return compared


def cli_logits_stderr(tmp_path, capsys, pib_path) -> str:
    """What ``picc logits`` of a compiled file says on stderr (the logits go to a file)."""
    out = tmp_path / f"{pib_path.stem}.npy"
    assert main(["logits", str(pib_path), "--tokens", "1,2,3", "--out", str(out)]) == 0
    assert np.load(out).shape[0] == 3
    return capsys.readouterr().err


def assert_gpu_kernels_compile_for_every_arch(pib_path, tmp_path) -> None:
    """Every kernel the compiled file's GPU ops launch, as CUDA for sm_75, sm_80, sm_89 and sm_90,
    compiles with nvcc (one translation unit per arch; the per-kernel files hold the same device
    functions). Skipped, with the reason, where nvcc is absent."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: CUDA sources cannot be compiled")
    from concurrent.futures import ThreadPoolExecutor

    from picc.codegen_cuda import ARCHS, cuda_bundle
    from picc.codegen_cuda.lower import lower_gpu
    from picc.pib import load_pib, open_pib
    from picc.placement.memory_plan import MemoryPlan

    model = load_pib(pib_path)
    with open_pib(pib_path) as pib:
        plan = MemoryPlan.from_json(pib.json("plan"))
    kernels = list(lower_gpu(model.module, model.weights, plan).kernels.values())

    def build(arch: str) -> tuple[str, int, str]:
        cu = tmp_path / f"{pib_path.stem}_{arch}.cu"
        cu.write_text(cuda_bundle(kernels, arch))
        proc = subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-w", str(cu), "-o", str(cu.with_suffix(".ptx"))],
                              capture_output=True, text=True, check=False)
        entries = cu.with_suffix(".ptx").read_text().count(".entry ") if proc.returncode == 0 else 0
        return arch, entries, proc.stderr[-1000:]

    with ThreadPoolExecutor(2) as pool:
        for arch, entries, stderr in pool.map(build, ARCHS):
            assert entries >= len(kernels), (arch, stderr)


def gpu_share(report: dict) -> float:
    layers = report["layers"]
    return sum(la["gpu_neurons"] for la in layers) / sum(la["gpu_neurons"] + la["cpu_neurons"] for la in layers)


def test_relu_demo_with_predictors_runs_on_the_emulated_gpu_at_every_budget(relu_demo_predicted, tmp_path, capsys):
    # PowerInfer's mode on picc's ReLU model: with 0, ~30% and 100% of the FFN on the (host-
    # emulated) GPU, the runtime gives the interpreter's sparse logits (the 1e-3), and
    # the emulated GPU allocates exactly the plan's bytes.
    from runtime.session import Session

    full = tmp_path / "relu_full.pib"
    reports = {"full": compile_json(capsys, relu_demo_predicted, full, "--target", "pc-low", "--vram", "1GB")}
    budgets = {"none": "0", "third": str(ffn_share_budget(full, 0.3))}
    for name, vram in budgets.items():
        dump = tmp_path / f"ir_{name}"
        reports[name] = compile_json(capsys, relu_demo_predicted, tmp_path / f"relu_{name}.pib", "--target", "pc-low",
                                     "--vram", vram, "--dump-ir", str(dump))
        # A sparse .picc skips profiling: canonicalize, neuron-major-down, then these.
        assert [p.name for p in sorted(dump.iterdir())][-4:] == ["03_partition-neurons.picc",
                                                                  "04_fuse-gather-gemv.picc", "05_dce.picc",
                                                                  "06_select-kernels.picc"]
    shares = {name: gpu_share(r) for name, r in reports.items()}
    assert shares["none"] == 0.0 and shares["full"] == 1.0 and 0.2 <= shares["third"] <= 0.6, shares
    for name, report in reports.items():
        path = tmp_path / f"relu_{name}.pib"
        assert report["target"] == "pc-low" and len(report["layers"]) == 6
        assert {la["mode"] for la in report["layers"]} == {"predictor"}
        assert_matches_the_interpreter(path)
        err = cli_logits_stderr(tmp_path, capsys, path)
        warnings = [line for line in err.splitlines() if "host-emulated GPU" in line]
        assert len(warnings) == (name != "none"), err  # said once, in one line
        with Session(path, gpu="emulate") as session:
            assert session.executor.gpu_peak_bytes == report["gpu_bytes"]
    assert main(["inspect", str(tmp_path / "relu_third.pib"), "--plot", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    assert "estimate:" in text and "tokens/s" in text
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_gpu_kernels_compile_for_every_arch(tmp_path / "relu_third.pib", tmp_path)  # last: it may skip


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: CUDA sources cannot be compiled")
def test_gpu_parts_carry_cuda_kernels_that_compile_alone_and_run_beside_the_cpu(relu_sparse, tmp_path, capsys):
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
    # The hybrid step (the emulated GPU's gate-first kernels beside the CPU's) agrees with the
    # interpreter on the same split, permuted and fused IR.
    assert_matches_the_interpreter(out)


def test_bad_arguments_fail_fast_in_one_line_and_write_nothing(relu_sparse, tmp_path, capsys):
    out = tmp_path / "x.pib"
    cases = [
        (["--target", "cpu", "--vram", "1GB"], "target 'cpu' has no GPU"),
        (["--target", "pc-low", "--vram", "lots"], "expected a size such as 11GB"),
        # More than the card holds: such a plan could only fail at load, out of device memory.
        (["--target", "pc-low", "--vram", "64GB"], "59.6 GiB is more than the 11.0 GiB of the NVIDIA GeForce RTX 2080 Ti of target pc-low"),
        (["--target", "pc-low", "--vram", "1e99GB"], "is more than the 11.0 GiB of the NVIDIA GeForce RTX 2080 Ti of target pc-low"),
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
        path = tmp_path / "a.pib"
        report = compile_json(capsys, sparse, path, "--target", "pc-low", "--vram", "11GB")
        assert all(la["cpu_neurons"] == 0 and la["gpu_activation_share"] == 1.0 for la in report["layers"])
        assert placements(path) == {"gpu"}
        assert_matches_the_interpreter(path)
        # ~30% of the FFN on the GPU, the rest on the CPU, both at once; the budget is used, not
        # left idle.
        third = tmp_path / "third.pib"
        budget = ffn_share_budget(path, 0.3)
        report = compile_json(capsys, sparse, third, "--target", "pc-low", "--vram", str(budget))
        assert 0.2 <= gpu_share(report) <= 0.6, gpu_share(report)
        assert report["gpu_bytes"] > 0.9 * budget, (report["gpu_bytes"], budget)
        assert_matches_the_interpreter(third)
        assert_gpu_kernels_compile_for_every_arch(third, tmp_path)

    def test_zero_vram_is_cpu_only_and_cpu_target_has_no_gpu(self, sparse, tmp_path, capsys):
        # c keeps f32 KV caches: the margin probe explains a divergence from the interpreter by a
        # sparse decision near its threshold, and f16 caches add another cause (float noise moving
        # a cached element across an f16 rounding boundary: test_runtime covers f16 caches).
        for name, flags in (("c", ["--target", "pc-low", "--vram", "0", "--kv-cache", "f32"]), ("d", ["--target", "cpu"])):
            report = compile_json(capsys, sparse, tmp_path / f"{name}.pib", *flags)
            assert report["gpu_bytes"] == 0 and all(la["gpu_neurons"] == 0 for la in report["layers"])
            assert placements(tmp_path / f"{name}.pib") == {"cpu"}
        assert_matches_the_interpreter(tmp_path / "c.pib")
        assert "emulated" not in cli_logits_stderr(tmp_path, capsys, tmp_path / "c.pib")  # nothing runs on a GPU
