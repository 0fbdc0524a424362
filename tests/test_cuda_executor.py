"""The CUDA executor end to end, on a machine with a CUDA device (skipped elsewhere, with the reason).

The same ``.pib`` files the host-emulated GPU runs in the other tests: logits against the
interpreter (1e-3 relative, the bound for sparse models: GPU warps sum in yet another order),
greedy generation against the emulated GPU, and device memory against the plan.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from conftest import tiny_llama, with_tokenizer

from picc.codegen_cuda import nvcc_path
from picc.compile import CompileOptions, compile_model, write_compiled
from picc.interpreter import Interpreter
from picc.pib import load_pib
from picc.sparsify import SparsifyOptions
from runtime.gpu import cuda_device_count
from runtime.session import Session

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device on this machine"),
    pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: the .pib would carry no PTX"),
]

TOKENS = [1, 5, 9, 2, 17, 33, 4, 60, 8, 3]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def free_device_memory() -> int:
    cu = ctypes.CDLL("libcuda.so.1")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value


@pytest.fixture(scope="module", params=[("predictor", "reglu"), ("gate-first", "swiglu")])
def compiled(request, tmp_path_factory):
    mode, form = request.param
    root = tmp_path_factory.mktemp(f"cuda_{mode}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICC_CACHE_DIR", str(root / "cache"))
        model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, seed=5))
        sparsity = SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5)
        paths = []
        for vram in ("0", "700KiB", "4MiB"):
            result = compile_model(model, CompileOptions(target="pc-low", vram=vram, sparsity=sparsity),
                                   say=lambda _: None)
            path = root / f"{vram}.pib"
            write_compiled(result, path)
            paths.append((path, result.plan.gpu_bytes))
    return paths


def test_logits_match_the_interpreter(compiled):
    for path, _ in compiled:
        pib = load_pib(path)
        reference = Interpreter(pib.module, pib.weights).run(TOKENS)
        with Session(path, threads=2, gpu="cuda") as session:
            assert rel_err(session.feed(TOKENS, all_logits=True), reference) <= 1e-3, path.name


def test_greedy_generation_equals_the_emulated_gpu(compiled):
    path, _ = compiled[-1]
    runs = []
    for gpu in ("cuda", "emulate"):
        with Session(path, gpu=gpu) as session:
            runs.append(list(session.generate(TOKENS[:4], 16, stop_at_eos=False)))
    assert runs[0] == runs[1]


def test_device_memory_is_the_plan(compiled):
    for path, gpu_bytes in compiled[1:]:
        before = free_device_memory()
        with Session(path, gpu="cuda") as session:
            used = before - free_device_memory()
            assert session.executor.gpu_peak_bytes == gpu_bytes
            # The driver rounds allocations up to its pages (2 MiB) and loads the module's code.
            assert gpu_bytes <= used <= gpu_bytes + 8 * 2**20, (used, gpu_bytes)
