"""A bounded loopback load test of ``picc serve``: latency and aggregate tokens/s by concurrency.

    python bench/serve_load.py [MODEL.pib] [--concurrency 1,2,4,8] [--requests 16] [--max-tokens 64]
                               [--threads 2] [--time-limit 600] [--stream] [--llama GGUF]

Starts ``picc serve MODEL.pib --port 0`` (default ``build/smollm2.pib``, what ``scripts/demo.sh``
compiles), then for each concurrency c, c clients send ``--requests`` completions between them
(greedy, ``ignore_eos`` so every request decodes ``--max-tokens`` tokens; eight prompts in turn),
and stops by itself after ``--time-limit`` seconds in all (``--stream``: the completions
streamed, each event read as it comes). Reports per c the median and 99th percentile latency of a
request, the aggregate decode rate (generated tokens / the phase's wall time) and its ratio to
c = 1; checks that every reply equals the one its prompt got at c = 1 (the server's batches do not
change a sequence's tokens), that no reply was a 5xx, that no sequence is left behind afterwards
(``/metrics``: none active, every slot free) and that the server's memory is steady (RSS after the
load within 10% of its RSS after the warm-up). Exits 1 when a check fails.

``--batch-steps`` first times the engine's batch step itself (no server): milliseconds per call for
1, 2, 4 and 8 sequences against the one-sequence step, medians of 20 calls, in one run; with
``--profile``, then where a call's time goes by kernel for 1 and 8 rows (the batch step's
profiled twin: a clock around each call and the barrier after it).

``--ray`` runs the load against ``picc serve --ray`` on a local Ray cluster instead, twice in one
run: two replicas of one thread each, then one replica of two threads (the same cores, so it shows
what replicas cost and what they buy on one machine; docs/ray.md).

``--llama GGUF`` runs the same load against llama-cpp-python's OpenAI server (``pip install
'llama-cpp-python[server]'``; it serves one request at a time) on that GGUF, for the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Once upon a time", "The capital of France is", "In a distant galaxy,", "My favourite recipe for soup",
           "The history of the bicycle", "Write a letter to a friend about", "Three reasons to learn Python:",
           "The weather today"]
STEADY = 0.10  # RSS after the load within this share of RSS after the warm-up


def machine() -> str:
    sys.path.insert(0, str(ROOT))
    from bench.compare import machine as describe

    return describe()


@dataclass
class Phase:
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    errors: dict[int, int] = field(default_factory=dict)
    texts: dict[int, set[str]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


class Server:
    """A server subprocess on a free loopback port."""

    def __init__(self, argv: list[str], url: str | None = None, ready: str | None = None) -> None:
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        if url is None:  # the line saying where it listens (Ray logs a few lines before it)
            seen = ""
            while not (match := re.search(r"on (http://[\d.]+:\d+)/v1", line := self.proc.stderr.readline())):
                seen += line
                if not line:
                    raise SystemExit(f"serve_load: the server did not start: {seen}")
            url = match.group(1)
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.url = url
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(url + (ready or "/health"), timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    raise SystemExit("serve_load: the server exited while starting") from None
                time.sleep(0.2)
        raise SystemExit("serve_load: the server did not answer in 300 s")

    def rss(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def request(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int,
            stream: bool = False) -> tuple[int, str, int]:
    """One greedy completion: its status, text and generated tokens (streamed: the server's
    events read as they come, the count from the usage it sends last)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = client.post(url + "/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            return r.status_code, "", 0
        reply = r.json()
        return 200, reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    parts, tokens = [], 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, "", 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            parts.extend(choice["text"] for choice in event.get("choices", []))
    return 200, "".join(parts), tokens


def run_phase(url: str, model: str, c: int, requests: int, max_tokens: int, deadline: float,
              stream: bool = False) -> Phase:
    phase = Phase(c)
    lock = threading.Lock()
    todo = list(range(max(requests, c)))
    ready = threading.Barrier(c + 1)  # the clock starts when every client is made (~22 ms each here)

    def client_loop() -> None:
        with httpx.Client() as client:
            ready.wait()
            while time.time() < deadline:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                start = time.perf_counter()
                status, text, tokens = request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, stream)
                with lock:
                    if status != 200:
                        phase.errors[status] = phase.errors.get(status, 0) + 1
                        continue
                    phase.latencies.append(time.perf_counter() - start)
                    phase.tokens += tokens
                    phase.texts.setdefault(i % len(PROMPTS), set()).add(text)

    threads = [threading.Thread(target=client_loop) for _ in range(c)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    phase.wall = time.perf_counter() - start
    return phase


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def load(url: str, model: str, args: argparse.Namespace, server: Server | None) -> tuple[list[Phase], dict]:
    """Warm up, then the phases; the checks' facts (RSS before and after)."""
    deadline = time.time() + args.time_limit
    run_phase(url, model, 2, 2, 8, deadline)  # warm-up: code paths, allocator, the server's imports
    facts = {"rss_warm": server.rss() if server else None}
    phases = []
    for c in args.concurrency:
        if time.time() >= deadline:
            print(f"serve_load: time limit reached before concurrency {c}", file=sys.stderr)
            break
        phases.append(run_phase(url, model, c, args.requests, args.max_tokens, deadline, args.stream))
        p = phases[-1]
        print(f"  c={c}: {len(p.latencies)} requests, {p.rate:.1f} tok/s", file=sys.stderr)
    facts["rss_after"] = server.rss() if server else None
    return phases, facts


def batch_steps(model: str, threads: int, calls: int = 20, profile: bool = False) -> str:
    """The batch step's time per call for 1..8 rows against the one-row step's, as a table;
    ``profile``: then where a call's time goes by kernel, for one row and for eight."""
    sys.path.insert(0, str(ROOT))
    from runtime.sequences import SequencePool
    from runtime.session import Session

    lines = ["### the batch step alone", "", "| rows | ms per call | tokens/s | vs the one-sequence step |",
             "|---|---|---|---|"]
    with Session(model, threads) as s:
        ex = s.executor
        pool = SequencePool(ex, 8)
        slots = [pool.acquire() for _ in range(8)]

        def median_seconds(run: Callable[[int], None]) -> float:
            times = []
            for i in range(calls + 2):
                start = time.perf_counter()
                run(i)
                times.append(time.perf_counter() - start)
            return statistics.median(times[2:])

        def batch(rows: int) -> Callable[[int], None]:
            ptrs = pool.pointers(slots[:rows])
            return lambda i: ex.cpu.batch_step([5] * rows, [10 + i] * rows, ptrs)

        with ex.pinned():
            one = median_seconds(lambda i: ex.step(5, 10 + i))
            lines.append(f"| step | {one * 1e3:.2f} | {1 / one:.0f} | 1.00x |")
            for rows in (1, 2, 4, 8):
                t = median_seconds(batch(rows))
                lines.append(f"| {rows} | {t * 1e3:.2f} | {rows / t:.0f} | {rows * one / t:.2f}x |")
            if profile:
                lines += ["", *batch_profile(ex.cpu, {rows: batch(rows) for rows in (1, 8)}, calls)]
    return "\n".join(lines)


def batch_profile(cpu, runs: dict[int, Callable[[int], None]], calls: int) -> list[str]:  # noqa: ANN001
    """Lines of a table: us per batch step call by kernel (the call and the wait at the barrier
    after it, means over the threads and ``calls`` calls at positions 10..), for each row count
    of ``runs``, and the ratio of the last to the first."""
    spent: dict[int, dict[str, list[float]]] = {}
    for rows, run in runs.items():
        cpu.start_profile(batch=True)
        try:
            for i in range(calls):
                run(i)
        finally:
            (got,) = cpu.stop_profile()
        scale = 1e6 / got.hz / max(got.runs, 1)
        by_kernel = spent[rows] = {}
        for (symbol, _), k, w in zip(got.calls, got.kernel.mean(axis=0), got.wait.mean(axis=0), strict=True):
            entry = by_kernel.setdefault(symbol, [0, 0.0])
            entry[0] += 1
            entry[1] += (k + w) * scale
    first, last = min(spent), max(spent)
    head = " | ".join(f"{rows} row{'s' * (rows > 1)}, us" for rows in spent)
    lines = ["where a call's time goes (the batch step profiled; a kernel's calls and the waits after them)", "",
             f"| kernel | calls | {head} | {last} / {first} |", "|---|---|" + "---|" * (len(spent) + 1)]
    kernels = sorted(spent[last], key=lambda sym: -spent[last][sym][1])
    for sym in [*kernels, "all"]:
        times = [sum(e[1] for e in spent[r].values()) if sym == "all" else spent[r][sym][1] for r in spent]
        n = sum(e[0] for e in spent[last].values()) if sym == "all" else spent[last][sym][0]
        lines.append(f"| {sym} | {n} | " + " | ".join(f"{t:.0f}" for t in times) +
                     f" | {times[-1] / times[0]:.2f}x |")
    return lines


def table(title: str, phases: list[Phase]) -> str:
    base = phases[0].rate if phases else 0.0
    lines = [f"### {title}", "", "| concurrency | requests | p50 latency (s) | p99 latency (s) | aggregate tok/s "
             "| vs c=1 | errors |", "|---|---|---|---|---|---|---|"]
    for p in phases:
        lat = sorted(p.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
        lines.append(f"| {p.concurrency} | {len(lat)} | {p50:.2f} | {p99:.2f} | {p.rate:.1f} | "
                     f"{p.rate / base if base else 0:.2f}x | {sum(p.errors.values())} |")
    return "\n".join(lines)


def ray_load(args: argparse.Namespace, name: str) -> int:
    """The load against picc serve --ray, 2 replicas x 1 thread and 1 x 2, each on a new cluster."""
    import socket

    results, ok = [], True
    for replicas, threads in ((2, 1), (1, 2)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = Server([sys.executable, "-m", "picc.cli", "serve", args.model, "--ray", "--replicas", str(replicas),
                         "--threads", str(threads), "--port", str(port), "--max-batch", str(args.max_batch),
                         "--max-queue", "64"])
        try:
            phases, _ = load(server.url, name, args, None)
        finally:
            server.close()
        results.append((replicas, threads, phases))
        print(table(f"picc serve --ray {args.model}: {replicas} replica{'s' if replicas > 1 else ''} x {threads} "
                    f"thread{'s' if threads > 1 else ''} (--max-batch {args.max_batch}, {args.max_tokens} tokens a "
                    "request)", phases))
        errors_5xx = sum(n for p in phases for status, n in p.errors.items() if status >= 500)
        expected = phases[0].texts if phases else {}
        mismatched = sum(1 for p in phases for i, texts in p.texts.items() if texts != expected.get(i, texts))
        for what, good in {f"{replicas}x{threads}: no 5xx": errors_5xx == 0,
                           f"{replicas}x{threads}: replies equal to c=1's": mismatched == 0}.items():
            print(f"{'ok  ' if good else 'FAIL'} {what}")
            ok = ok and good
    (_, _, two), (_, _, one) = results
    for p, q in zip(two, one, strict=False):
        print(f"c={p.concurrency}: 2 replicas x 1 thread {p.rate:.1f} tok/s, 1 x 2 threads {q.rate:.1f} tok/s: "
              f"{p.rate / q.rate if q.rate else 0:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "model": args.model, "ray": [
            {"replicas": r, "threads": t, "phases": [{"c": p.concurrency, "tok_s": p.rate} for p in ph]}
            for r, t, ph in results]}, indent=1))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "build" / "smollm2.pib"))
    ap.add_argument("--concurrency", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")],
                    help="clients at once, one phase each (comma-separated; default 1,2,4,8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least c)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="the server's compute threads (default 2)")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    ap.add_argument("--time-limit", type=float, default=600, help="seconds for the whole load (default 600)")
    ap.add_argument("--llama", metavar="GGUF", help="also load llama-cpp-python's server on this GGUF")
    ap.add_argument("--json", metavar="OUT", help="write the numbers as JSON")
    ap.add_argument("--stream", action="store_true",
                    help="stream the completions (server-sent events, read as they come); default: whole replies")
    ap.add_argument("--batch-steps", action="store_true", help="first time the batch step alone (no server)")
    ap.add_argument("--profile", action="store_true",
                    help="with --batch-steps: where a batch step's time goes, by kernel, for 1 row and for 8")
    ap.add_argument("--ray", action="store_true", help="load picc serve --ray: 2 replicas x 1 thread, then 1 x 2")
    args = ap.parse_args()
    if not Path(args.model).is_file():
        raise SystemExit(f"serve_load: {args.model} not found (bash scripts/demo.sh compiles build/smollm2.pib)")
    if args.profile and not args.batch_steps:
        ap.error("--profile profiles the batch step: give --batch-steps too")
    print(f"machine: {machine()}")
    if args.batch_steps:
        print(batch_steps(args.model, args.threads, profile=args.profile))
    name = Path(args.model).stem
    if args.ray:
        return ray_load(args, name)
    server = Server([sys.executable, "-m", "picc.cli", "serve", args.model, "--port", "0", "--threads",
                     str(args.threads), "--max-batch", str(args.max_batch), "--max-queue", "64"])
    try:
        phases, facts = load(server.url, name, args, server)
        leaked = metric(server.url, "picc_active_sequences"), metric(server.url, "picc_free_slots")
    finally:
        server.close()
    print(table(f"picc serve {args.model} (--max-batch {args.max_batch}, {args.threads} threads, "
                f"{args.max_tokens} tokens a request{', streamed' if args.stream else ''})", phases))
    expected = phases[0].texts if phases else {}
    mismatched = sum(1 for p in phases for i, texts in p.texts.items() if texts != expected.get(i, texts))
    errors_5xx = sum(n for p in phases for status, n in p.errors.items() if status >= 500)
    growth = facts["rss_after"] / facts["rss_warm"] - 1
    checks = {"replies equal to c=1's": mismatched == 0, "no 5xx": errors_5xx == 0,
              "no sequence left (active 0, all slots free)": leaked == (0, args.max_batch),
              f"RSS steady ({facts['rss_warm'] / 2**20:.0f} -> {facts['rss_after'] / 2**20:.0f} MiB, "
              f"{100 * growth:+.1f}%)": abs(growth) <= STEADY}
    llama = []
    if args.llama:
        port = 18000 + (int(time.time()) % 1000)
        url = f"http://127.0.0.1:{port}"
        ll = Server([sys.executable, "-m", "llama_cpp.server", "--model", args.llama, "--port", str(port),
                     "--n_threads", str(args.threads), "--n_ctx", "2048", "--model_alias", name], url=url,
                    ready="/v1/models")
        try:
            llama, _ = load(url, name, args, None)
        finally:
            ll.close()
        print(table(f"llama-cpp-python server {args.llama}", llama))
        for p, q in zip(phases, llama, strict=False):
            print(f"c={p.concurrency}: picc {p.rate:.1f} tok/s, llama.cpp {q.rate:.1f} tok/s: "
                  f"{p.rate / q.rate if q.rate else 0:.2f}x")
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "model": args.model, "checks": checks,
            "picc": [{"c": p.concurrency, "tok_s": p.rate, "latencies": p.latencies} for p in phases],
            "llama": [{"c": p.concurrency, "tok_s": p.rate, "latencies": p.latencies} for p in llama]}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
