"""The GPU check, first half (here, with TVM; no GPU needed): build the folder a GPU machine runs.

    .venv/bin/python bench/gpu/prepare.py OUT [--cases PREFIX,...] [--no-kernels]

A GPU machine may lack TVM, the network and picc's dependencies (it has Python, numpy, llvmlite,
tokenizers, torch and the CUDA driver), so everything it needs is made here:

* ``pibs/``: the ``.pib`` files of the check: a tiny LLaMA (hidden 64, n_ff 128, 2 layers, f32) in
  predictor, gate-first and dense mode, whole on the GPU and split between the devices, as PTX
  (pc-low, sm_75: JIT-compiled for the device) and as cubin (h100, sm_90); relu-demo for the
  h100 target split at 12 MiB, whole on the GPU, and on the CPU alone (the baseline the split
  one must beat); tiny Gemma 3 and Phi-4-mini-like models (transformers' layouts, random weights)
  whole on the GPU: the embedding kernel that scales its rows, the rope kernel that scales its
  cosines and sines (longrope); tiny Gemma 2 (soft caps), Qwen3-MoE, gpt-oss (its attention's
  sinks, yarn rope), DeepSeek V3 (its latent attention decompressed: keys joined head by head,
  values narrower than keys, yarn rope) and GLM-4.7-Flash (values wider than keys) models whose
  experts run on the CPU between the GPU's attention;
* ``ref/cases.json`` and ``ref/<case>.npy``: per file, the interpreter's logits of a prompt (every
  position) and the host-emulated GPU's greedy tokens;
* ``units/``: every distinct kernel of those files with the arena's contents before and after one
  real call of it on the emulated GPU (``unit.py`` runs each alone in exact-size allocations,
  under ``compute-sanitizer`` one process per kernel);
* ``kernels/``: PTX of the fused FFN kernels at LLaMA-7B and SmolLM2 shapes for ``kernels.py``;
* ``src/``: the runtime's and CLI's sources, and this folder's scripts.

Then on the GPU machine: ``bash run.sh`` in the folder (see run.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import half_the_ffn, tiny_llama, with_tokenizer  # noqa: E402
from hf_models import make_model  # noqa: E402

from picc.codegen_cuda import build_cuda, dense_ffn, sparse_ffn  # noqa: E402
from picc.compile import CompileOptions, compile_model, write_compiled  # noqa: E402
from picc.frontend import load_model  # noqa: E402
from picc.interpreter import Interpreter  # noqa: E402
from picc.pib import load_pib  # noqa: E402
from picc.sparsity.sparsify import SparsifyOptions  # noqa: E402
from runtime.contracts import CudaManifest, launches_from_json  # noqa: E402
from runtime.gpu import arena_image  # noqa: E402
from runtime.pib import PibFile  # noqa: E402
from runtime.session import Session  # noqa: E402

TOKENS = [1, 5, 9, 2, 17, 33, 4, 60, 8, 3]
RELU_PROMPT = "the company said it expects to report a loss for the third quarter"
# The FFN kernels the kernel benchmark times: (name, hidden, n_ff, form, format).
BENCH_KERNELS = [(h, n, form, fmt) for h, n, form in ((4096, 11008, "reglu"), (576, 1536, "swiglu"))
                 for fmt in ("f16", "q4_0")]


def say(text: str) -> None:
    print(text, flush=True)


class Folder:
    def __init__(self, root: Path) -> None:
        if root.exists():
            shutil.rmtree(root)
        self.root = root
        for sub in ("pibs", "ref", "units", "kernels", "src"):
            (root / sub).mkdir(parents=True)
        self.cases: list[dict] = []
        self.units: dict[str, dict] = {}

    def add(self, name: str, model, options: CompileOptions, tokens: list[int], greedy: int = 24) -> None:  # noqa: ANN001
        start = time.time()
        compiled = compile_model(model, options, say=lambda _: None)
        path = self.root / "pibs" / f"{name}.pib"
        write_compiled(compiled, path)
        loaded = load_pib(path)
        np.save(self.root / "ref" / f"{name}.npy", Interpreter(loaded.module, loaded.weights).run(tokens)
                .astype(np.float32))
        gpu = "emulate" if compiled.plan.gpu_bytes else "auto"
        with Session(path, threads=2, gpu=gpu) as session:
            ids = [int(t) for t in session.generate(tokens[:4], greedy, stop_at_eos=False)]
            if compiled.plan.gpu_bytes:
                self._record_units(name, session, PibFile(path))
        self.cases.append({"name": name, "tokens": tokens, "greedy_prompt": tokens[:4], "greedy": ids,
                           "gpu_bytes": int(compiled.plan.gpu_bytes), "target": options.target,
                           "vram": options.vram})
        say(f"{name}: {path.stat().st_size / 2**20:.1f} MiB, {compiled.plan.gpu_bytes} GPU bytes, "
            f"{time.time() - start:.0f} s")

    def _record_units(self, name: str, session: Session, pib: PibFile) -> None:
        """Each kernel of the file not seen yet: its arguments before and after its call in one
        real decode step on the emulated GPU (real activations, KV rows, masks, positions), and,
        where the file has the greedy loop, in two greedy steps of it."""
        gpu = session.executor.gpu
        arch = CudaManifest.from_json(pib.json("cuda/manifest")).arch
        launches = launches_from_json(pib.json("gpu/launches"))
        initial = arena_image(pib, gpu.arena_bytes)  # weights and constants: unit.py reads them off the .pib

        def run(ops: list[str]) -> None:
            for op in ops:
                for call, (fn, args) in zip(launches.get(op, ()), gpu._launches.get(op, ()), strict=True):
                    key = f"{arch}.{call.kernel}"
                    views = {a.param: gpu.view(a.offset, list(a.shape), a.dtype) for a in call.args}
                    before = {name: v.copy() for name, v in views.items()}
                    kept = {a.param for a in call.args
                            if not np.array_equal(views[a.param].view(np.uint8).reshape(-1),
                                                  initial[a.offset : a.offset + a.nbytes])}
                    fn(*args)
                    if key in self.units:
                        continue
                    # What the call changed (the rest must stay as it was, which unit.py checks too).
                    after = {name: v.copy() for name, v in views.items() if not np.array_equal(v, before[name])}
                    np.savez(self.root / "units" / f"{key}.npz",
                             **{f"in.{k}": v for k, v in before.items() if k in kept},
                             **{f"out.{k}": v for k, v in after.items()})
                    self.units[key] = {"pib": name, "kernel": call.kernel,
                                       "params": [[a.param, list(a.shape), a.dtype, a.offset] for a in call.args]}

        gpu.run = run
        ex = session.executor
        ex.step(session.history[-1] if session.history else 1, session.pos)
        if ex.gpu_loops:  # and the greedy loop's kernel, after the steps it follows
            ex.greedy_steps(ex.greedy(), session.pos + 1, 2)

    def kernels(self) -> None:
        """PTX (sm_90) of the fused FFN kernels the kernel benchmark times."""
        kernels, meta = [], {}
        for hidden, n_ff, form, fmt in BENCH_KERNELS:
            tag = f"{hidden}x{n_ff}_{form}_{fmt}"
            for k in (sparse_ffn(f"sparse_{tag}", hidden, n_ff, form, fmt),
                      dense_ffn(f"dense_{tag}", hidden, n_ff, form, fmt)):
                kernels.append(k)
                meta[k.name] = {"hidden": hidden, "n_ff": n_ff, "form": form, "fmt": fmt, "kind": k.kind,
                                "params": [[p.name, list(p.shape), p.dtype, p.role] for p in k.params]}
        for name, art in build_cuda(kernels, "sm_90", outputs=("ptx",)).items():
            (self.root / "kernels" / f"{name}.ptx").write_bytes(art.ptx or b"")
            meta[name]["launches"] = [la.to_json() for la in art.launches]
        (self.root / "kernels" / "kernels.json").write_text(json.dumps(meta, indent=1))

    def finish(self) -> None:
        (self.root / "ref" / "cases.json").write_text(json.dumps(self.cases, indent=1))
        (self.root / "units" / "units.json").write_text(json.dumps(self.units, indent=1))
        for package in ("picc", "runtime"):
            shutil.copytree(ROOT / package, self.root / "src" / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for script in Path(__file__).parent.iterdir():
            if script.suffix in (".py", ".sh") and script.name != "prepare.py":
                shutil.copy(script, self.root / script.name)
        total = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        say(f"{self.root}: {total / 2**20:.1f} MiB, {len(self.cases)} files, {len(self.units)} kernels alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default="", help="comma-separated prefixes of the files to build (default: "
                        "all); a GPU machine takes 64 MiB a call, so the check may travel in two folders")
    parser.add_argument("--no-kernels", action="store_true", help="no PTX for the kernel benchmark")
    args = parser.parse_args()
    wanted = tuple(p for p in args.cases.split(",") if p)
    folder = Folder(args.out)

    def add(name: str, model, options: CompileOptions, tokens: list[int], greedy: int = 24) -> None:  # noqa: ANN001
        if not wanted or name.startswith(wanted):
            folder.add(name, model, options, tokens, greedy)

    for mode, form in (("predictor", "reglu"), ("gate-first", "swiglu"), ("dense", "swiglu")):
        model = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, seed=5))
        sparsity = SparsifyOptions(mode="gate-first" if mode == "dense" else mode, tokens=512, window=64,
                                   budget=0.5)
        for target in ("pc-low", "h100"):
            def options(vram: str) -> CompileOptions:
                return CompileOptions(target=target, vram=vram, sparsity=sparsity, dense=mode == "dense")  # noqa: B023
            whole = compile_model(model, options("4MiB"), say=lambda _: None)
            for tag, vram in (("whole", "4MiB"), ("split", str(half_the_ffn(whole)))):
                add(f"tiny_{mode}_{target}_{tag}", model, options(vram), TOKENS)
    for family, variant, tag in (("gemma3_text", "base", "whole"), ("phi3", "longrope-partial", "whole"),
                                 ("gemma2", "base", "whole"), ("qwen3_moe", "base", "moe-on-cpu"),
                                 ("gpt_oss", "yarn", "moe-on-cpu"), ("deepseek_v3", "yarn", "moe-on-cpu"),
                                 ("glm4_moe_lite", "base", "moe-on-cpu")):
        name = f"{family}_{variant}_h100_{tag}"
        if not wanted or name.startswith(wanted):
            make_model(family, variant, args.out / "hf" / family)
            add(name, load_model(args.out / "hf" / family), CompileOptions(target="h100", vram="4MiB", dense=True),
                TOKENS)
            shutil.rmtree(args.out / "hf")
    relu = load_model("relu-demo")
    ids = [int(i) for i in relu.tokenizer.encode(RELU_PROMPT)]
    for tag, vram in (("split", "12MiB"), ("whole", "64MiB"), ("cpu", "0")):
        add(f"relu_h100_{tag}", relu, CompileOptions(target="h100", vram=vram), ids, greedy=32)
    if not args.no_kernels:
        folder.kernels()
    folder.finish()


if __name__ == "__main__":
    main()
