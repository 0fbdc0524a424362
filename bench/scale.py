"""How picc grows with the model: compile time, peak memory and decode speed at three sizes.

    python bench/scale.py [--models smollm2,1b,7b] [--data /work/scale-data] [--threads 2] [--rounds 3]
                          [--json out.json]

For each model: ``picc compile --target cpu`` (wall time, and the peak resident memory of the
compiling process, from the kernel's accounting of the child), then ``--rounds`` rounds of ``picc
bench`` of the ``.pib`` (prompt and decode tokens/s, the read bandwidth probed beside each run, and
the decode's share of it: the weights a token reads times tokens/s, over the bandwidth) and
llama.cpp's decode of the same GGUF where ``llama-cpp-python`` is installed (``pip install -e
.[bench]``), in turn: medians, and the median of the rounds' ratios. ``1b`` and ``7b`` are the
synthetic Q4_0 GGUFs of ``bench/synthetic_model.py`` (LLaMA-3.2-1B's blocks, LLaMA-2-7B),
generated into ``--data`` when missing; ``smollm2`` is the model picc ships (Q4_1).

Then the placement plan of the 7B for ``pc-low`` at 11 GB and ``pc-high`` at 24 GB (and ``pc-low``
at 2 GB, since a Q4_0 7B's 3.8 GB fit 11 GB whole), ``--budgets``: the share of
FFN neurons on the GPU and the cost model's tokens/s, from the passes up to ``partition-neurons``
(no GPU code is built). Where the 7B is a ReLU model (``--placement-model``), it is profiled first
(cached by picc after a compile; ~15 minutes otherwise) and made sparse with exact gate-first
masks, so the GPU gets the hottest neurons; a dense one places whole layers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICC = [sys.executable, "-c", "import sys; from picc.cli import main; sys.exit(main(sys.argv[1:]))"]
SHAPES = {"1b": "llama1b-q4_0.gguf", "7b": "llama7b-q4_0.gguf"}


def run_measured(argv: list[str]) -> tuple[float, int, str]:
    """Run ``argv``: (wall seconds, peak resident bytes, stdout); stderr passes through."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} failed with exit status {proc.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024, out


def source(model: str, data: Path) -> str:
    if model == "smollm2":
        return "smollm2"
    path = data / SHAPES[model]
    if not path.exists():
        sys.path.insert(0, str(ROOT / "bench"))
        import synthetic_model

        if synthetic_model.main(["gguf", str(path), "--shape", model]) != 0:
            raise SystemExit(f"could not generate {path}")
    return str(path)


def measure(model: str, data: Path, threads: int, rounds: int) -> dict:
    """Compile ``model``, then ``rounds`` rounds of ``picc bench`` and (for a GGUF, where
    llama-cpp-python is installed) llama.cpp's decode, in turn: medians over the rounds, and the
    median of each round's ratio (the machine's speed moves between minutes, both engines with it)."""
    pib = data / f"scale-{model}.pib"
    compile_s, peak, _ = run_measured([*PICC, "compile", source(model, data), "--target", "cpu", "-o", str(pib)])
    benches, llamas, bench_peak = [], [], 0
    for _ in range(rounds):
        _, used, out = run_measured([*PICC, "bench", str(pib), "--threads", str(threads), "--json",
                                     "-n", "32", "--prompt-tokens", "16", "--repeat", "3"])
        benches.append(json.loads(out))
        bench_peak = max(bench_peak, used)
        llama = llama_cpp_decode(source(model, data), threads) if model in SHAPES else None
        if llama is not None:
            llamas.append(llama)
    decode = [b["decode_tokens_per_s"] for b in benches]
    return {"llama_cpp_decode_tokens_per_s": statistics.median(llamas) if llamas else None,
            "vs_llama_cpp": statistics.median(d / x for d, x in zip(decode, llamas, strict=True)) if llamas else None,
            "rounds_decode_tokens_per_s": decode, "rounds_llama_cpp_decode_tokens_per_s": llamas,
            "model": model, "rounds": rounds, "pib_bytes": pib.stat().st_size, "compile_s": compile_s,
            "compile_peak_rss": peak, "bench_peak_rss": bench_peak,
            "prefill_16_s": 16 / statistics.median(b["prompt_tokens_per_s"] for b in benches),
            "decode_tokens_per_s": statistics.median(decode),
            "weight_bytes_per_token": benches[0]["weight_bytes_per_token"],
            "read_bandwidth": statistics.median(b["read_bandwidth_bytes_per_s"] for b in benches),
            "bandwidth_share": statistics.median(b["bandwidth_share"] for b in benches)}


def llama_cpp_decode(path: str, threads: int, n: int = 32, repeat: int = 3) -> float | None:
    """llama.cpp's median decode tokens/s on the same GGUF (None without llama-cpp-python)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = [(7 * i + 11) % llm.n_vocab() for i in range(16)]
    rates = []
    for _ in range(repeat):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(n):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        rates.append(n / (time.perf_counter() - start))
    del llm
    return sorted(rates)[len(rates) // 2]


def placement(path: str, target: str, vram: str) -> dict:
    """The share of FFN neurons ``partition-neurons`` puts on the GPU, and the estimate."""
    from picc.compile import CompileOptions, _fuse, _partition
    from picc.frontend import load_model
    from picc.passes import PassSpec, run_pipeline
    from picc.placement import memory_plan as mp
    from picc.placement.plan_report import build_report
    from picc.sparsity.profiling import RELU_FORMS, ffn_ops
    from picc.sparsity.sparsify import SparsifyOptions
    from picc.targets import load_target

    model = load_model(path)
    options = CompileOptions(target=load_target(target), vram=vram)
    relu = all(op.form in RELU_FORMS for op in ffn_ops(model.module))
    passes = [PassSpec("canonicalize"), PassSpec("neuron-major-down")]
    # gate-first: exact masks for a ReLU model, and no predictor training (half an hour on a 7B)
    passes += SparsifyOptions(mode="gate-first").passes(None) if relu else []
    passes += [_partition(options, options.target), *_fuse(options)]
    weights = model.weights.copy()
    module = run_pipeline(model.module, weights, passes, tokenizer=model.tokenizer)
    plan = mp.plan_memory(module, weights, ctx=options.ctx, budget=int(dict(module.attrs)["vram_budget"]))
    report = build_report(module, weights, options.target, plan)
    gpu = sum(x["gpu_neurons"] for x in report["layers"])
    total = gpu + sum(x["cpu_neurons"] for x in report["layers"])
    return {"target": target, "vram": vram, "sparse": relu, "gpu_neuron_share": gpu / total,
            "gpu_activation_share": sum(x["gpu_activation_share"] * (x["gpu_neurons"] + x["cpu_neurons"])
                                        for x in report["layers"]) / total,
            "gpu_bytes": report["gpu_bytes"], "estimate_tokens_per_s": report["estimate_tokens_per_s"]}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,1b,7b")
    p.add_argument("--data", type=Path, default=Path("/work/scale-data"), help="where the synthetic models live")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of picc bench and llama.cpp's decode, in turn, per model (default 3)")
    p.add_argument("--placement-model", help="the 7B whose pc-low / pc-high plans are shown (default: the 7B)")
    p.add_argument("--budgets", default="pc-low:11GB,pc-high:24GB,pc-low:2GB",
                   help="TARGET:VRAM placements of the 7B to show (a Q4_0 7B fits 11 GB whole; 2 GB splits it)")
    p.add_argument("--no-placement", action="store_true")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    rows = [measure(m, args.data, args.threads, args.rounds) for m in args.models.split(",")]
    print(f"{cpu_name()}; picc compile --target cpu, then {args.rounds} round(s) of picc bench --threads "
          f"{args.threads} and llama.cpp's decode in turn (medians)")
    print("| model | .pib | compile | peak RSS (compile) | prefill 16 tok | decode tok/s | read bandwidth | "
          "decode x bytes/token / bandwidth | llama.cpp decode tok/s | vs llama.cpp (per round) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        llama = r["llama_cpp_decode_tokens_per_s"]
        print(f"| {r['model']} | {r['pib_bytes'] / 2**30:.2f} GiB | {r['compile_s']:.0f} s | "
              f"{r['compile_peak_rss'] / 2**30:.2f} GiB | {r['prefill_16_s']:.2f} s | {r['decode_tokens_per_s']:.1f} | "
              f"{r['read_bandwidth'] / 1e9:.1f} GB/s | {100 * r['bandwidth_share']:.0f}% | "
              + (f"{llama:.1f} | {r['vs_llama_cpp']:.2f}x |" if llama else "| |"))
    plans = []
    if not args.no_placement:
        path = args.placement_model or source("7b", args.data)
        plans = [placement(path, *budget.split(":")) for budget in args.budgets.split(",")]
        print(f"\nplacement of {path} (FFN neurons on the GPU, and the share of activations they serve)")
        for q in plans:
            print(f"  {q['target']} {q['vram']}: {100 * q['gpu_neuron_share']:.0f}% of FFN neurons "
                  f"({100 * q['gpu_activation_share']:.0f}% of activations), {q['gpu_bytes'] / 2**30:.1f} GiB on "
                  f"the GPU, ~{q['estimate_tokens_per_s']:.1f} tokens/s estimated")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "rows": rows, "placement": plans}, indent=1))


if __name__ == "__main__":
    main()
