"""The GPU check, second half: on a machine with a CUDA device, in a folder ``prepare.py`` made.

    python3 check.py [--gpu cuda|emulate] [--threads 1,2,8,16] [--repeat 5] [--no-bench] [--bench-also DIR]

Needs Python with numpy, llvmlite and the NVIDIA driver (tokenizers for ``picc bench``'s text;
no TVM). Per ``.pib`` of ``pibs/``: the logits of its prompt (every position) on the GPU against
the interpreter's (relative error <= 1e-3, the bound of the hybrid tests), the greedy tokens against
the host-emulated GPU's, the device memory against the plan; then, for every kernel launch of
relu-demo whole on the GPU, its device time in a decode step (events between them in a graph); then
``picc bench`` of the relu-demo files (prompt and decode tok/s, GPU, CPU and copy time per token,
launches per token; the GPU files also at 2 threads with dependent launches off, to compare).
Prints tables; writes ``$OUT/check.json`` (or ``./check.json``).

``--gpu emulate`` runs the same on the host-emulated GPU: how to try this script where there is no
GPU (it needs TVM then, for the kernels' host build).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "src"))

from runtime.pib import PibFile  # noqa: E402
from runtime.session import Session  # noqa: E402

BOUND = 1e-3


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    simd = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"GPU: {out or 'none'}; CPU: {cpu}, {os.cpu_count()} threads, {simd}"


def free_device_memory() -> int:
    cu = ctypes.CDLL("libcuda.so.1")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuInit(0)
    ctx = ctypes.c_void_p()
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cu.cuCtxSetCurrent(ctx)
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    return free.value


def check_case(case: dict, gpu: str) -> dict:
    path = HERE / "pibs" / f"{case['name']}.pib"
    r: dict = {"name": case["name"], "gpu_bytes": case["gpu_bytes"]}
    kind = gpu if case["gpu_bytes"] else "auto"
    try:
        reference = np.load(HERE / "ref" / f"{case['name']}.npy")
        with Session(path, threads=2, gpu=kind) as s:
            logits = s.feed(case["tokens"], all_logits=True)
            r["rel_err"] = float(np.abs(logits - reference).max() / np.abs(reference).max())
            r["finite"] = bool(np.isfinite(logits).all())
        before = free_device_memory() if kind == "cuda" else 0
        with Session(path, threads=2, gpu=kind) as s:
            ids = [int(t) for t in s.generate(case["greedy_prompt"], len(case["greedy"]), stop_at_eos=False)]
            r["greedy_equal"] = ids == case["greedy"]
            r["first_difference"] = next((i for i, (a, b) in enumerate(zip(ids, case["greedy"], strict=False))
                                       if a != b), None)
            r["peak_bytes"] = int(s.executor.gpu_peak_bytes)
            r["device_bytes_used"] = before - free_device_memory() if kind == "cuda" else None
        r["ok"] = r["finite"] and r["rel_err"] <= BOUND and r["greedy_equal"] and \
            (not case["gpu_bytes"] or r["peak_bytes"] == case["gpu_bytes"])
    except Exception as e:  # noqa: BLE001 - every file is reported, whatever breaks
        r.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
    return r


def launch_profile(path: Path, gpu: str) -> list[dict]:
    """Device time of every kernel launch of one decode step of the whole-GPU ``path`` (the step's
    launches in one graph with an event between every two)."""
    if gpu != "cuda" or not path.exists():
        return []
    with Session(path, threads=2, gpu="cuda") as s:
        s.feed([1, 2, 3, 4])
        ex = s.executor
        ops = [op for st in ex.stages for op in st.gpu]
        timed = ex.gpu.launch_seconds(ops, before=lambda: ex._inputs(5, s.pos))
    return [{"op": op, "kernel": entry, "us": 1e6 * t} for op, entry, t in timed]


def bench(path: Path, threads: int, gpu: str, repeat: int, pdl: bool = True, loop: bool = True) -> dict:
    """``picc bench`` of ``path``; ``pdl=False``: with dependent launches off (PICC_CUDA_PDL=0);
    ``loop=False``: greedy steps one by one, not in the GPU's loop (PICC_GPU_LOOP=0)."""
    cmd = [sys.executable, "-c", "import sys; from picc.cli import main; sys.exit(main())", "bench",
           str(path), "--threads", str(threads), "--gpu", gpu, "--repeat", str(repeat), "--json"]
    env = {**os.environ, "PYTHONPATH": str(HERE / "src"), "PICC_CACHE_DIR": "/tmp/picc-cache",
           "PICC_CUDA_PDL": "1" if pdl else "0", "PICC_GPU_LOOP": "1" if loop else "0"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    b = {"name": path.stem + ("" if pdl else " (no PDL)") + ("" if loop else " (no GPU loop)"), "threads": threads,
         "gpu": gpu, "rc": p.returncode}
    try:
        b.update(json.loads(p.stdout))
    except json.JSONDecodeError:
        b["stderr"] = p.stderr[-800:]
    return b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="cuda", choices=("cuda", "emulate"))
    parser.add_argument("--threads", default="1,2,8,16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--bench-also", type=Path, action="append", default=[],
                        help="another check folder whose relu-demo files to bench too")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    cases = json.loads((HERE / "ref" / "cases.json").read_text())
    machine = device_name()
    print(machine, flush=True)
    results: dict = {"machine": machine, "cases": [], "profile": [], "bench": []}
    for case in cases:
        start = time.time()
        r = check_case(case, args.gpu)
        r["seconds"] = round(time.time() - start, 1)
        results["cases"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
        if "trace" in r:
            print(r["trace"], flush=True)
    whole = [d / "pibs" / "relu_h100_whole.pib" for d in [HERE, *args.bench_also]]
    results["profile"] = launch_profile(next((p for p in whole if p.exists()), whole[0]), args.gpu)
    if not args.no_bench:
        # relu-demo's files here and in the folders named by --bench-also (a check that travels in
        # two folders benches all of them in its second call, on the same warm machine).
        paths = sorted({p.name: p for d in [HERE, *args.bench_also] for p in (d / "pibs").glob("relu_*.pib")}.values())
        for path in paths:
            gpu_bytes = PibFile(path).plan().gpu_bytes
            for threads in [int(t) for t in args.threads.split(",")]:
                b = bench(path, threads, args.gpu if gpu_bytes else "auto", args.repeat)
                results["bench"].append(b)
                print(json.dumps(b)[:600], flush=True)
            if gpu_bytes and args.gpu == "cuda":  # the same file with every kernel launched plainly,
                # and with greedy steps one by one (a file whose whole step is the GPU's loops them)
                for variant in ({"pdl": False}, {"loop": False}):
                    b = bench(path, 2, "cuda", args.repeat, **variant)
                    results["bench"].append(b)
                    print(json.dumps(b)[:600], flush=True)
    (out / "check.json").write_text(json.dumps(results, indent=1))
    report(results)
    sys.exit(0 if all(r["ok"] for r in results["cases"]) else 1)


def report(results: dict) -> None:
    print(f"\n{results['machine']}")
    print("\n| file | GPU bytes | logits vs interpreter | greedy = emulated | device memory = plan | ok |")
    print("|---|---|---|---|---|---|")
    for r in results["cases"]:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else r.get("error", "?")[:120]
        used = r.get("device_bytes_used")
        memory = "-" if not r["gpu_bytes"] else f"{r.get('peak_bytes') == r['gpu_bytes']} (driver: {used} B)"
        print(f"| {r['name']} | {r['gpu_bytes']} | {err} | {r.get('greedy_equal')} | {memory} | {r['ok']} |")
    if results["profile"]:
        profile = results["profile"]
        total = sum(p["us"] for p in profile)
        by_kernel: dict[str, list[float]] = {}
        for p in profile:  # the layers' launches of one kernel function, summed
            by_kernel.setdefault(p["kernel"], []).append(p["us"])
        print(f"\nrelu_h100_whole, one decode step launch by launch: {total:.0f} us of device time in "
              f"{len(profile)} launches; by kernel function, the slowest twelve:")
        print("| kernel function | launches a step | us each (median) | us a step |")
        print("|---|---|---|---|")
        for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:12]:
            print(f"| {name} | {len(times)} | {statistics.median(times):.1f} | {sum(times):.1f} |")
    if results["bench"]:
        print("\nper decode step:")
        print("\n| file | threads | prompt tok/s | decode tok/s | GPU ms | CPU ms | waiting for the GPU ms "
              "| copies ms | KiB copied | launches | graphs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for b in results["bench"]:
            d = b.get("devices") or {}

            def f(key: str, scale: float = 1.0, digits: int = 3, d: dict = d) -> str:
                return f"{d[key] * scale:.{digits}f}" if key in d else "-"
            print(f"| {b['name']} | {b['threads']} | {b.get('prompt_tokens_per_s', b.get('stderr', '?')):.6} "
                  f"| {b.get('decode_tokens_per_s', 0):.1f} | {f('gpu_ms_per_token')} | {f('cpu_ms_per_token')} "
                  f"| {f('wait_ms_per_token')} | {f('transfer_ms_per_token')} "
                  f"| {f('transfer_bytes_per_token', 1 / 1024, 1)} "
                  f"| {f('launches_per_token', 1, 1)} | {f('graph_launches_per_token', 1, 1)} |")


if __name__ == "__main__":
    main()
