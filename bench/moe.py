"""picc against llama.cpp on a mixture of experts: decode speed on the same GGUF file.

    .venv/bin/python bench/moe.py [--experts 32] [--experts-used 4] [--threads 2] [--rounds 5] [--arch gpt-oss]

The file is ``bench/synthetic_model.py``'s ``moe`` shape (hidden 1024, 8 layers, each FFN
``--experts`` experts of 1024 neurons, ``--experts-used`` a token; Q4_0 matrices, F32 routers: a
Mixtral-style ``llama`` file; ``--arch gpt-oss``: a gpt-oss file of that shape, MXFP4 experts with
biases, sinks, every other layer sliding, yarn; ``--arch deepseek2``: DeepSeek-V2-Lite's layer at
that width, its latent attention, two shared experts, layer 0 dense), written once into
``build/bench``. picc compiles it for this host (``picc compile --target cpu``, its default
choices); llama.cpp runs it through llama-cpp-python.
Each round runs both, one after the other (the order alternating), a 64-token prompt then 128
greedy tokens; the table gives the prompt's and the decode's medians over the rounds and their
ratios, how far apart the
two engines' logits after the prompt are, and how many of the greedy tokens they produce alike
(random weights give flat logits, whose largest two are close: the tokens part where the two
engines' roundings do, llama.cpp's x in 8 bits, picc's in 16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compare import CACHE, Engine, LlamaCppEngine, PiccEngine, machine  # noqa: E402


def moe_gguf(experts: int, used: int, arch: str) -> Path:
    import synthetic_model as synth

    path = CACHE / f"{'moe' if arch == 'llama' else arch}-{experts}x{used}.gguf"
    if not path.exists():
        synth.write_gguf(path, synth.SHAPES["moe"], "swiglu", 0, experts, used, arch)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--experts-used", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--arch", choices=("llama", "gpt-oss", "deepseek2"), default="llama")
    args = p.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    path = moe_gguf(args.experts, args.experts_used, args.arch)
    picc = PiccEngine("picc", str(path), [], args.threads, path.stem)
    llama = LlamaCppEngine(args.threads, "MXFP4" if args.arch == "gpt-oss" else "Q4_0", path)
    engines: list[Engine] = [llama, picc]
    prompt = [int(t) for t in picc.session.text.encode(" ".join(["the market closed higher on friday"] * 16))[:64]]
    decode: dict[str, list[float]] = {e.name: [] for e in engines}
    prompts: dict[str, list[float]] = {e.name: [] for e in engines}
    tokens: dict[str, list[int]] = {}
    for e in engines:
        e.run(prompt, 8)  # untimed: page in the weights, start the threads
    for r in range(args.rounds):
        for e in engines[r % 2:] + engines[: r % 2]:
            time.sleep(0.5)
            prompt_s, seconds, out = e.run(prompt, args.n)
            decode[e.name].append((args.n - 1) / seconds)
            prompts[e.name].append(len(prompt) / prompt_s)
            tokens[e.name] = out
    same = next((i for i, (a, b) in enumerate(zip(*tokens.values(), strict=True)) if a != b), args.n)
    llama.llm.reset()
    llama.llm.eval(prompt)
    theirs = llama.logits()
    picc.session.reset()
    ours = picc.session.feed(prompt)
    apart = float(abs(ours - theirs).max() / abs(theirs).max())
    size = path.stat().st_size / 1e6
    print(f"\n{machine()}\n{path.name}: {size:.0f} MB, {args.experts} experts a layer, {args.experts_used} a token; "
          f"picc's build: {picc.modes or 'dense'}\n")
    print("| engine | prompt tok/s | vs llama.cpp | decode tok/s | vs llama.cpp | decode per round: median (range) |")
    print("|---|---|---|---|---|---|")
    for e in engines:
        rate, pre = statistics.median(decode[e.name]), statistics.median(prompts[e.name])
        ratios = [a / b for a, b in zip(decode[e.name], decode["llama.cpp"], strict=True)]
        print(f"| {e.name} | {pre:.0f} | {pre / statistics.median(prompts['llama.cpp']):.2f}x | {rate:.1f} | "
              f"{rate / statistics.median(decode['llama.cpp']):.2f}x | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    print(f"\nlogits after the prompt: largest difference {apart:.1e} of the largest logit; "
          f"greedy tokens alike: the first {same} of {args.n}")


if __name__ == "__main__":
    main()
