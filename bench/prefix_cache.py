"""What the server's prefix cache saves: multi-turn chats against ``picc serve`` with and without it.

    python bench/prefix_cache.py [MODEL.pib] [--conversations 4] [--turns 6] [--max-tokens 32]
                                 [--threads 2]

Starts two servers on the model (default ``build/smollm2.pib``, what ``scripts/demo.sh``
compiles): one as ``picc serve`` starts by default, one with ``--no-prefix-cache``. Each
conversation (a system prompt of a few hundred tokens, then a user message a turn, each turn's
request carrying the whole conversation so far, as chat clients send it) goes to both, turn by
turn, alternating which server goes first, greedy and streamed. Reports per turn the median
prompt tokens, the median cached tokens (``usage.prompt_tokens_details``) and the median time to
the first token of the reply on each server, with their ratio; and checks that both servers gave
every turn the same reply (the cache changes no token). Exits 1 when they differ. A conversation
ends early where its next turn would not fit in the model's context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_load import Server, machine  # noqa: E402

SYSTEM = ("You are a patient assistant for a small bookshop. You answer questions about opening hours, orders, "
          "the cafe and events. Opening hours are nine to six on weekdays and ten to four on Saturdays; the shop "
          "is closed on Sundays. Orders take three to five days and can be collected in the shop or posted. The "
          "cafe serves tea, coffee and cakes baked on the premises, and it closes half an hour before the shop. "
          "Readings take place on the first Thursday of each month at seven in the evening; tickets cost five "
          "pounds and include a drink. Answer in one or two sentences, politely, and never invent a price, a "
          "date or a title that is not given here. If you do not know, say so and offer to ask a colleague.")
QUESTIONS = ["When are you open on Saturday?", "Can I order a book that is not in stock?", "How long does it take?",
             "Do you post to Ireland?", "Is the cafe open after six?", "What is on next Thursday?",
             "How much are the tickets?", "Can I bring a friend?", "Do you sell gift cards?", "Thank you!"]


class ContextFull(Exception):
    """The conversation has outgrown the model's context."""


def turn(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """One streamed greedy chat turn: seconds to the reply's first text, the reply, the usage."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, parts, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code == 400 and b"context_length_exceeded" in r.read():
            raise ContextFull
        if r.status_code != 200:
            raise SystemExit(f"prefix_cache: {url} answered {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice["delta"].get("content") or choice.get("finish_reason"):
                    first = first or time.perf_counter() - start
                    parts.append(choice["delta"].get("content") or "")
    assert first is not None
    return first, "".join(parts), usage


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "build" / "smollm2.pib"))
    ap.add_argument("--conversations", type=int, default=4, help="conversations (default 4)")
    ap.add_argument("--turns", type=int, default=6, help="user messages a conversation (default 6, at most 10)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens a reply (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="each server's compute threads (default 2)")
    args = ap.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        ap.error(f"--turns: expected 1 to {len(QUESTIONS)}")
    base = [sys.executable, "-m", "picc.cli", "serve", args.model, "--port", "0", "--threads", str(args.threads),
            "--model-name", "m"]
    servers = {"cached": Server(base), "whole": Server([*base, "--no-prefix-cache"])}
    rows: list[dict[str, list]] = [{"prompt": [], "cached": [], "cached_s": [], "whole_s": []}
                                   for _ in range(args.turns)]
    differ = 0
    try:
        with httpx.Client() as client:
            for server in servers.values():  # warm-up: code paths, the servers' imports
                turn(client, server.url, [{"role": "user", "content": "Hello"}], 4)
            for c in range(args.conversations):
                messages = [{"role": "system", "content": SYSTEM}]
                for t in range(args.turns):
                    messages.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]})
                    order = ["cached", "whole"] if (c + t) % 2 == 0 else ["whole", "cached"]
                    replies = {}
                    try:
                        answers = {name: turn(client, servers[name].url, messages, args.max_tokens) for name in order}
                    except ContextFull:
                        print(f"conversation {c + 1} ends before turn {t + 1}: the context is full", file=sys.stderr)
                        break
                    for name in order:
                        seconds, reply, usage = answers[name]
                        replies[name] = reply
                        rows[t][f"{name}_s"].append(seconds)
                        if name == "cached":
                            rows[t]["prompt"].append(usage["prompt_tokens"])
                            rows[t]["cached"].append(usage["prompt_tokens_details"]["cached_tokens"])
                    differ += replies["cached"] != replies["whole"]
                    messages.append({"role": "assistant", "content": replies["cached"]})
    finally:
        for server in servers.values():
            server.close()
    print(f"prefix cache, {Path(args.model).name}, {args.conversations} conversations, {args.threads} threads, "
          f"replies of {args.max_tokens} tokens; {machine()}")
    print("\n| turn | prompt tokens | cached | first token, cached (ms) | first token, whole (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for t, row in enumerate(rows):
        if not row["prompt"]:
            break
        cached_s, whole_s = statistics.median(row["cached_s"]), statistics.median(row["whole_s"])
        print(f"| {t + 1} | {statistics.median(row['prompt']):.0f} | {statistics.median(row['cached']):.0f} | "
              f"{1e3 * cached_s:.1f} | {1e3 * whole_s:.1f} | {whole_s / cached_s:.2f}x |")
    if differ:
        print(f"\nFAILED: {differ} turns got different replies with and without the cache")
        return 1
    print("\nEvery turn got the same reply from both servers.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
