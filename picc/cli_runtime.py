"""The commands that run compiled models: ``picc run`` and ``picc bench`` (and the runtime path
of ``picc logits``). They drive ``runtime.Session``; errors from the runtime become one line."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from picc.cli_commands import check_seed
from picc.errors import PiccError


@contextlib.contextmanager
def open_session(path: str, threads: int | None, ctx: int | None = None, gpu: str = "auto") -> Iterator:  # noqa: ANN401
    """A runtime session on ``path``; the runtime's errors become ``PiccError``. Says on stderr,
    in one line, when the model's GPU part runs on the host-emulated GPU."""
    from runtime.cpu import ExecutorError
    from runtime.pib import PibError
    from runtime.session import Session

    if not Path(path).suffix == ".pib":
        raise PiccError(f"{path}: expected a .pib file written by 'picc compile'")
    try:
        session = Session(path, threads, ctx, gpu)
    except (PibError, ExecutorError) as e:
        raise PiccError(str(e)) from None
    if session.executor.gpu_kind == "emulated":
        plan = session.pib.plan()
        print(f"warning: no CUDA device here; the GPU part runs on the host-emulated GPU (the host build of the same "
              f"kernels, in the plan's {plan.gpu_bytes / 2**20:.1f} of {plan.budget / 2**20:.1f} MiB of VRAM): "
              "correct but slow", file=sys.stderr)
    try:
        yield session
    except ExecutorError as e:
        raise PiccError(str(e)) from None
    finally:
        session.close()


def _sampling(args: argparse.Namespace):  # noqa: ANN202 - SamplingOptions
    from runtime.sampling import SamplingOptions

    options = SamplingOptions(args.temperature, args.top_k, args.top_p, args.repeat_penalty, args.presence_penalty,
                              args.frequency_penalty, _logit_bias(args.logit_bias), min_p=args.min_p)
    try:
        options.check()
    except ValueError as e:
        raise PiccError(str(e)) from None
    return options


def _logit_bias(items: list[str]) -> tuple[tuple[int, float], ...]:
    """``--logit-bias ID=BIAS`` flags as (token id, bias) pairs, sorted by id."""
    bias: dict[int, float] = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise PiccError(f"--logit-bias {item}: expected TOKEN_ID=BIAS, like 13=-100") from None
        if not sep:
            raise PiccError(f"--logit-bias {item}: expected TOKEN_ID=BIAS, like 13=-100")
    return tuple(sorted(bias.items()))


class _Stream:
    """Prints generated text as it becomes final (a partial UTF-8 sequence decodes to U+FFFD), or
    hands it to ``thoughts`` (a reasoning model's chat reply)."""

    def __init__(self, text, out, thoughts: _Thoughts | None = None) -> None:  # noqa: ANN001
        self.text, self.out, self.thoughts, self.ids, self.shown = text, out, thoughts, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.text.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._show(text[len(self.shown):])
            self.shown = text

    def finish(self) -> str:
        text = self.text.decode(self.ids)
        self._show(text[len(self.shown):])
        if self.thoughts is not None:
            self.thoughts.finish()
        return text

    def _show(self, text: str) -> None:
        if self.thoughts is not None:
            self.thoughts.write(text)
            return
        self.out.write(text)
        self.out.flush()


class _Thoughts:
    """``picc run --chat``'s reply of a reasoning model, split as it streams (``runtime.reasoning``):
    its thoughts after "thinking: " -- dimmed on a terminal, plain otherwise -- or not at all
    (``hide``), then its answer on a line of its own. :attr:`thoughts`, :attr:`answer`: the
    whole text of each."""

    DIM, NORMAL = "\x1b[2m", "\x1b[0m"  # SGR faint, reset

    def __init__(self, split, out, hide: bool) -> None:  # noqa: ANN001 - a ReasoningSplit, a text sink
        self.split, self.out, self.hide = split, out, hide
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.thoughts, self.answer, self.thinking = "", "", False

    def write(self, text: str) -> None:
        self._show(*self.split.add(text))

    def finish(self) -> None:
        self._show(*self.split.finish())
        self._stop_thinking(newline=False)  # the turn's own newline ends the line

    def _show(self, thoughts: str, answer: str) -> None:
        self.thoughts, self.answer = self.thoughts + thoughts, self.answer + answer
        if thoughts and not self.hide:
            if not self.thinking:
                self.out.write((self.DIM if self.tty else "") + "thinking: ")
                self.thinking = True
            self.out.write(thoughts)
        if answer:
            self._stop_thinking(newline=True)
            self.out.write(answer)
        self.out.flush()

    def _stop_thinking(self, newline: bool) -> None:
        if self.thinking:
            self.out.write((self.NORMAL if self.tty else "") + ("\n" if newline else ""))
            self.thinking = False


def _turn(session, ids: list[int], args: argparse.Namespace, options, stream: bool,  # noqa: ANN001
          split=None) -> dict:  # noqa: ANN001 - a ReasoningSplit
    """Feed ``ids`` and generate: the reply streamed (its stop token is not text), its numbers;
    with ``split``, its thoughts shown apart (or not at all) and, in the numbers, the thoughts
    (``reasoning_content``) and answer (``content``) besides the whole ``text``."""
    from runtime.session import Timings

    timings = Timings()
    sink = sys.stdout if stream else open_null()
    thoughts = None if split is None else _Thoughts(split, sink, args.hide_thoughts)
    out = _Stream(session.text, sink, thoughts)
    tokens = []
    for token in session.generate(ids, args.n, options, args.seed, timings=timings):
        tokens.append(token)
        if token not in session.text.stop_ids:
            out.add(token)
    text = out.finish()
    if len(tokens) < args.n and session.pos >= session.ctx:
        print(f"\nnote: the context is full ({session.ctx} positions) after {len(tokens)} of -n {args.n} tokens "
              "(picc compile --ctx N, or run --ctx up to it)", file=sys.stderr)
    return {"prompt_tokens": len(ids), "tokens": tokens, "text": text,
            **({} if thoughts is None else {"reasoning_content": thoughts.thoughts, "content": thoughts.answer}),
            "prompt_tokens_per_s": timings.prompt_tokens_per_s, "decode_tokens_per_s": timings.decode_tokens_per_s,
            "_timings": timings}


def _text_of(session, args: argparse.Namespace):  # noqa: ANN001, ANN202 - a TextCodec
    if session.text is None:
        raise PiccError(f"{args.model}: the model has no tokenizer, so text cannot be encoded; give token ids to "
                        f"'picc logits {args.model} --tokens 1,2,3' instead")
    return session.text


class _Chat:
    """``picc run --chat``: the conversation so far, rendered by the model's chat template for each
    turn; a turn feeds the rendering's tokens from the first that differs from those in the KV
    cache (the earlier turns' rows are kept, the last reply's as far as the template writes it
    back as it was generated). A reasoning model's replies (:attr:`reasoning`, its format) join
    the conversation as their answers, as a client of the API sends them back."""

    def __init__(self, session, args: argparse.Namespace) -> None:  # noqa: ANN001
        from runtime.reasoning import served_format

        self.session, self.text = session, _text_of(session, args)
        if self.text.chat_template is None:
            raise PiccError(f"{args.model}: the model has no chat template (its tokenizer carries none); run it "
                            "without --chat, on plain prompts")
        self.messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        self.variables = template_variables(args.chat_template_kwargs)
        self.reasoning = served_format(args.reasoning_format, self.text.chat_template)
        self.rendered = ""

    def prompt(self, user: str) -> list[int]:
        """The tokens to feed for ``user``'s message, after rewinding to what the cache shares."""
        from runtime.chat import ChatTemplateError, render_chat

        messages = [*self.messages, {"role": "user", "content": user}]
        try:
            rendered = render_chat(self.text.chat_template, messages, bos_token=self.text.bos_token,
                                   eos_token=self.text.eos_token, add_generation_prompt=True, variables=self.variables)
        except ChatTemplateError as e:
            raise PiccError(f"the chat template refuses the conversation: {e}") from None
        self.rendered = rendered
        ids = self.text.encode_chat(rendered)
        fed = self.session.history[: self.session.pos]
        same = 0
        while same < min(len(ids) - 1, len(fed)) and ids[same] == fed[same]:
            same += 1
        self.session.rewind(same)
        self.asked = messages
        return ids[same:]

    def split(self):  # noqa: ANN201 - a ReasoningSplit, or None
        """The splitter of the reply to the prompt :meth:`prompt` rendered last, for a reasoning model."""
        from runtime.reasoning import ReasoningSplit

        return None if self.reasoning is None else ReasoningSplit(self.reasoning, self.rendered)

    def replied(self, result: dict) -> None:
        """The turn :meth:`prompt` began is over: the question and ``result``'s reply (its answer
        alone, where it had thoughts apart) join the conversation (a turn that failed, its prompt
        too long for the context, leaves it as it was)."""
        self.messages = [*self.asked, {"role": "assistant", "content": result.get("content", result["text"])}]

    def reset(self) -> None:
        """``/reset``: a new conversation (with the same system message)."""
        self.messages = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        self.session.reset()


def open_null():  # noqa: ANN201 - a text sink
    import io

    return io.StringIO()


def _summary(result: dict, devices: dict | None = None) -> str:
    t = result["_timings"]
    ms = 1e3 * t.decode_seconds / t.tokens if t.tokens else 0.0
    line = (f"prompt: {t.prompt_tokens} tokens in {t.prompt_seconds * 1e3:.1f} ms "
            f"({t.prompt_tokens_per_s:.1f} tok/s) | decode: {t.tokens} tokens in {t.decode_seconds * 1e3:.1f} ms "
            f"({t.decode_tokens_per_s:.1f} tok/s, {ms:.2f} ms/token)")
    if devices:
        line += (f"\ndevices: GPU {devices['gpu_ms']:.1f} ms ({devices['gpu']}), CPU {devices['cpu_ms']:.1f} ms, "
                 f"transfers {devices['transfer_ms']:.1f} ms ({devices['transfer_bytes'] / 1024:.1f} KiB)")
    return line


def device_times(session, before) -> dict | None:  # noqa: ANN001 - a Session and its DeviceTimes copy
    """Milliseconds per device (and bytes moved) since ``before``, for a model with a GPU part."""
    ex = session.executor
    if ex.gpu_kind is None:
        return None
    now = ex.times
    return {"gpu": ex.gpu_kind, "dependent_launch": bool(getattr(ex.gpu, "dependent_launch", False)),
            "gpu_ms": 1e3 * (now.gpu_seconds - before.gpu_seconds),
            "cpu_ms": 1e3 * (now.cpu_seconds - before.cpu_seconds),
            "wait_ms": 1e3 * (now.wait_seconds - before.wait_seconds),
            "transfer_ms": 1e3 * (now.transfer_seconds - before.transfer_seconds),
            "transfer_bytes": now.transfer_bytes - before.transfer_bytes,
            "launches": now.launches - before.launches, "graph_launches": now.graph_launches - before.graph_launches}


def template_variables(text: str | None) -> dict:
    """``--chat-template-kwargs``: a JSON object of the chat template's extra variables."""
    from runtime.chat import ChatTemplateError, check_template_variables

    if text is None:
        return {}
    try:
        return check_template_variables(json.loads(text))
    except (json.JSONDecodeError, ChatTemplateError) as e:
        raise PiccError(f"--chat-template-kwargs: {str(e).splitlines()[0]}") from None


def cmd_run(args: argparse.Namespace) -> None:
    if args.n < 0:
        raise PiccError(f"-n {args.n}: expected a number of tokens >= 0")
    if args.system is not None and not args.chat:
        raise PiccError("--system: only with --chat (plain prompts have no roles)")
    if args.hide_thoughts and not args.chat:
        raise PiccError("--hide-thoughts: only with --chat (a plain prompt's text is printed as generated)")
    if args.chat_template_kwargs is not None and not args.chat:
        raise PiccError("--chat-template-kwargs: only with --chat (plain prompts are not rendered by the template)")
    template_variables(args.chat_template_kwargs)  # a bad one is refused before the model loads
    check_seed(args.seed)
    options = _sampling(args)
    with open_session(args.model, args.threads, args.ctx, args.gpu) as session:
        session.check_options(options)
        chat = _Chat(session, args) if args.chat else None
        text = _text_of(session, args)
        if args.prompt is not None:
            if not args.json and chat is None:
                sys.stdout.write(args.prompt)
            before = replace(session.executor.times)
            ids = chat.prompt(args.prompt) if chat else text.encode(args.prompt)
            result = _turn(session, ids, args, options, stream=not args.json, split=chat.split() if chat else None)
            devices = device_times(session, before)
            if args.json:
                out = {k: v for k, v in result.items() if not k.startswith("_")}
                print(json.dumps(out | ({"devices": devices} if devices else {})))
            else:
                sys.stdout.write("\n")
                print(_summary(result, devices), file=sys.stderr)
            return
        from runtime.cpu import ExecutorError

        what = "a message (/reset: a new conversation)" if chat else "a prompt"
        print(f"{args.model}: type {what} and press Enter (Ctrl-D to quit)", file=sys.stderr)
        for line in sys.stdin:
            prompt = line.rstrip("\n")
            if not prompt:
                continue
            if chat is not None and prompt.strip() == "/reset":
                chat.reset()
                continue
            before = replace(session.executor.times)
            try:
                if chat is None:
                    session.reset()
                ids = chat.prompt(prompt) if chat else text.encode(prompt)
                result = _turn(session, ids, args, options, stream=True, split=chat.split() if chat else None)
            except ExecutorError as e:  # this prompt's (too long, say): say so, and read the next
                more = "; /reset starts a new conversation" if chat is not None else ""
                print(f"picc: error: {e}{more}", file=sys.stderr)
                continue
            if chat is not None:
                chat.replied(result)
            sys.stdout.write("\n")
            print(_summary(result, device_times(session, before)), file=sys.stderr)


def logits_with_runtime(path: str, ids: list[int], threads: int | None = 1, gpu: str = "auto") -> np.ndarray:
    with open_session(path, threads, gpu=gpu) as session:
        return session.feed(ids, all_logits=True).astype(np.float32)


def cmd_bench(args: argparse.Namespace) -> None:
    from picc.pib import open_pib
    from picc.targets.host import measure_memory_bandwidth

    with open_pib(Path(args.model)) as pib:
        report = pib.json("report")
    bytes_per_token = report.get("bytes_per_token")
    estimate = report.get("estimate_tokens_per_s")  # the cost model's, at compile time
    prompt_rates, decode_rates, bandwidths = [], [], []
    if min(args.prompt_tokens, args.n, args.repeat) < 1:
        raise PiccError("--prompt-tokens, -n and --repeat must be >= 1")
    devices: dict | None = None  # the decode steps' device times, summed over the runs
    with open_session(args.model, args.threads, gpu=args.gpu) as session:
        if args.prompt_tokens + args.n > session.ctx:
            raise PiccError(f"--prompt-tokens {args.prompt_tokens} + -n {args.n} exceed the {session.ctx} positions "
                            "the model was compiled for")
        ids = [(7 * i + 11) % session.vocab for i in range(args.prompt_tokens)]
        for _ in range(args.repeat):
            session.reset()
            start = time.perf_counter()
            session.feed(ids)
            prompt_rates.append(len(ids) / (time.perf_counter() - start))
            before = replace(session.executor.times)
            start = time.perf_counter()
            session.greedy_tokens(args.n + 1)  # n decode steps
            decode_rates.append(args.n / (time.perf_counter() - start))
            # The memory's rate right after each run: on a shared host it moves by half within a
            # minute, so each run is set against its own probe (the share is their median ratio).
            bandwidths.append(measure_memory_bandwidth())
            run = device_times(session, before)
            devices = run if devices is None or run is None else {
                k: v if isinstance(v, str | bool) else devices[k] + v for k, v in run.items()}
        threads = session.executor.cpu.team.nthreads
        profile = profile_decode(session, ids, args.n, args.repeat) if args.profile else None
    bandwidth = statistics.median(bandwidths)
    decode = statistics.median(decode_rates)
    result = {"model": args.model, "threads": threads, "repeat": args.repeat,
              "prompt_tokens": args.prompt_tokens, "tokens": args.n,
              "prompt_tokens_per_s": statistics.median(prompt_rates), "decode_tokens_per_s": decode,
              "weight_bytes_per_token": bytes_per_token, "read_bandwidth_bytes_per_s": bandwidth,
              "estimate_tokens_per_s": estimate,
              "bandwidth_share": statistics.median(bytes_per_token * rate / bw for rate, bw
                                                   in zip(decode_rates, bandwidths, strict=True))
              if bytes_per_token else None,
              "runs": [{"decode_tokens_per_s": rate, "read_bandwidth_bytes_per_s": bw}
                       for rate, bw in zip(decode_rates, bandwidths, strict=True)]}
    if devices:  # per decode step, over every run
        steps = args.repeat * args.n
        result["devices"] = {"gpu": devices["gpu"], "dependent_launch": devices["dependent_launch"],
                             "gpu_ms_per_token": devices["gpu_ms"] / steps,
                             "cpu_ms_per_token": devices["cpu_ms"] / steps,
                             "wait_ms_per_token": devices["wait_ms"] / steps,
                             "transfer_ms_per_token": devices["transfer_ms"] / steps,
                             "transfer_bytes_per_token": devices["transfer_bytes"] / steps,
                             "launches_per_token": devices["launches"] / steps,
                             "graph_launches_per_token": devices["graph_launches"] / steps}
    if profile is not None:
        result["profile"] = profile
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model}: {threads} thread(s), medians of {args.repeat} runs")
    print(f"  prompt  {result['prompt_tokens_per_s']:10.1f} tok/s  ({args.prompt_tokens} tokens)")
    print(f"  decode  {decode:10.1f} tok/s  ({args.n} tokens)"
          + (f"; the cost model estimated {estimate:.1f}" if estimate else ""))
    if bytes_per_token:
        share = result["bandwidth_share"]
        print(f"  weights read per token {bytes_per_token / 2**20:.2f} MiB (cost model); host read bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s (probed after each run, {min(bandwidths) / 1e9:.1f}-"
              f"{max(bandwidths) / 1e9:.1f}); decode reaches {100 * share:.0f}% of the limit measured beside it"
              + (" (over 100%: the weights fit in the CPU's caches)" if share > 1 else ""))
    if devices:
        d = result["devices"]
        print(f"  per decode step: GPU {d['gpu_ms_per_token']:.3f} ms ({d['gpu']}), CPU {d['cpu_ms_per_token']:.3f} "
              f"ms, waiting for the GPU {d['wait_ms_per_token']:.3f} ms, transfers {d['transfer_ms_per_token']:.3f} ms "
              f"({d['transfer_bytes_per_token'] / 1024:.1f} KiB); "
              f"{d['launches_per_token']:.1f} kernel launches and {d['graph_launches_per_token']:.1f} graph "
              "launches")
    if profile is not None:
        print_profile(profile)


def profile_decode(session, ids: list[int], n: int, repeat: int) -> dict:  # noqa: ANN001 - a runtime Session
    """``repeat`` more runs of ``ids`` and ``n`` decode steps, the steps profiled: per call of each
    stage's step, microseconds per step in the kernel and waiting at the barrier after it (means
    over the threads), and the decode's wall time per token in those runs."""
    cpu = session.executor.cpu
    wall, stages = 0.0, None
    for _ in range(repeat):
        session.reset()
        session.feed(ids)  # not profiled: the prompt's chunks, and the step of its last token
        cpu.start_profile()
        try:
            start = time.perf_counter()
            session.greedy_tokens(n + 1)  # n steps
            wall += time.perf_counter() - start
        finally:
            run = cpu.stop_profile()
        stages = run if stages is None else [
            replace(a, kernel=a.kernel + b.kernel, wait=a.wait + b.wait, runs=a.runs + b.runs)
            for a, b in zip(stages, run, strict=True)]
    assert stages is not None
    calls = []
    for st in stages:
        scale = 1e6 / st.hz / max(st.runs, 1)
        kernel, wait = st.kernel.mean(axis=0) * scale, st.wait.mean(axis=0) * scale
        calls += [{"stage": st.stage, "op": label, "kernel": symbol, "us": float(k), "wait_us": float(w)}
                  for (symbol, label), k, w in zip(st.calls, kernel, wait, strict=True)]
    steps = max(st.runs for st in stages) if stages else 0
    return {"clock_hz": stages[0].hz if stages else None, "steps": steps, "calls": calls,
            "step_us": sum(c["us"] + c["wait_us"] for c in calls),
            "wall_us_per_token": 1e6 * wall / (repeat * n)}


def print_profile(profile: dict) -> None:
    """The table of ``picc bench --profile``: time per decode step by kernel, then the costliest ops."""
    calls, step = profile["calls"], profile["step_us"]
    if not calls:
        print("\nCPU decode step, profiled: this model's step has no CPU work")
        return
    by_kernel: dict[str, list[float]] = {}
    for c in calls:
        row = by_kernel.setdefault(c["kernel"], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += c["us"]
        row[2] += c["wait_us"]
    print(f"\nCPU decode step, profiled ({profile['steps']} steps, clock {profile['clock_hz'] / 1e9:.2f} GHz; "
          "us per step, means over the threads; wait: at the barrier after the call)")
    width = max([len(k) for k in by_kernel] + [6])
    print(f"  {'kernel':<{width}} {'calls':>5} {'us':>9} {'wait us':>8} {'share':>6}")
    for kernel, (count, us, wait) in sorted(by_kernel.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"  {kernel:<{width}} {count:5d} {us:9.1f} {wait:8.1f} {100 * (us + wait) / step:5.1f}%")
    print(f"  {'the step':<{width}} {len(calls):5d} {sum(c['us'] for c in calls):9.1f} "
          f"{sum(c['wait_us'] for c in calls):8.1f} 100.0%")
    outside = profile["wall_us_per_token"] - step
    print(f"  decode wall time per token {profile['wall_us_per_token']:.1f} us: {outside:.1f} us outside the CPU's "
          "step (sampling, Python, the GPU's part and copies)")
    top = sorted(calls, key=lambda c: -(c["us"] + c["wait_us"]))[:8]
    print("  costliest calls: " + ", ".join(f"%{c['op']} {c['us'] + c['wait_us']:.1f} us" for c in top))


def add_threads_flag(parser: argparse.ArgumentParser, what: str = "CPU threads") -> None:
    from picc.targets.host import host_cores

    parser.add_argument("--threads", type=int, help=f"{what} (default: the cores this process may use, "
                        f"{host_cores()} here, as many as the compiled code allows)")


def add_reasoning_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--reasoning-format`` (``runtime.reasoning.OPTIONS``); ``what``: what auto does there."""
    parser.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                        help="how a reasoning model's replies come back. auto (the default): where the model's "
                        "chat template writes <think> (Qwen3, DeepSeek-R1 and its distills, GLM-4.5, SmolLM3) or "
                        f"harmony's <|channel|> (gpt-oss), {what}")


def add_gpu_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", choices=("auto", "cuda", "emulate"), default="auto",
                        help="where a model's GPU part runs: a CUDA device when there is one, else the "
                        "host-emulated GPU (auto, the default); cuda insists on a device; emulate never uses one")


def add_runtime_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("run", help="generate text with a compiled .pib",
                       description="Load MODEL.pib, feed the prompt, and stream the generated text; then a "
                       "timing summary like llama.cpp's. Without -p, an interactive prompt loop. With --chat, "
                       "a conversation: each line is a user's message, rendered with the earlier turns by the "
                       "model's chat template, and only what is new is fed. Generation ends at the model's stop "
                       "tokens (picc inspect lists them) or after -n tokens.")
    s.add_argument("model", metavar="MODEL.pib")
    s.add_argument("-p", "--prompt", help="the prompt (default: read prompts from stdin, one per line)")
    s.add_argument("--chat", action="store_true",
                   help="chat: prompts are a user's messages, in the model's chat template, and each turn "
                        "continues the conversation (its KV rows kept)")
    s.add_argument("--system", metavar="TEXT", help="with --chat: the system message that opens the conversation")
    add_reasoning_flag(s, "--chat prints a reply's thoughts apart from its answer: after 'thinking: ' on a line "
                       "of their own (dimmed on a terminal, plain otherwise), the answer on the next line, and "
                       "only the answer joins the conversation; none: the reply as generated, tags included. "
                       "Plain prompts' text is always printed as generated")
    s.add_argument("--hide-thoughts", action="store_true",
                   help="with --chat and a reasoning model: print only the answer, not the thoughts before it")
    s.add_argument("--chat-template-kwargs", metavar="JSON",
                   help="with --chat: more variables for the model's chat template, a JSON object, as the API's "
                        "chat_template_kwargs (e.g. '{\"enable_thinking\": false}' turns Qwen3's thinking off)")
    s.add_argument("-n", type=int, default=128, help="tokens to generate at most (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than MIN_P times the most likely one, as llama.cpp's --min-p "
                        "(default 0: off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="repetition penalty over the prompt's and the generated tokens, as llama.cpp and "
                        "transformers apply it (default 1: off)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token generated so far, as OpenAI's API defines it "
                        "(-2 to 2; default 0: off)")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once for each time it was generated so far, as "
                        "OpenAI's API defines it (-2 to 2; default 0: off)")
    s.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100 to 100) to that token's logit before sampling, as OpenAI's logit_bias; "
                        "repeat for more tokens (-100 all but bans one)")
    s.add_argument("--seed", type=int, default=0, help="seed for sampling (default 0)")
    add_threads_flag(s)
    s.add_argument("--ctx", type=int, help="context positions (default: what the model was compiled for)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: prompt_tokens, tokens, text, prompt_tokens_per_s, decode_tokens_per_s "
                   "(with --chat, a reasoning model's reply also as reasoning_content and content)")
    add_gpu_flag(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("bench", help="measure prompt and decode speed of a compiled .pib",
                       description="Median prompt and decode tokens/s over repeated runs, the weight bytes a "
                       "token reads (cost model), the host's read bandwidth probed after each run and the share of "
                       "it reached (the median over runs of each run's decode against its own probe).")
    s.add_argument("model", metavar="MODEL.pib")
    add_threads_flag(s)
    s.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    s.add_argument("-n", type=int, default=128, help="tokens decoded per run (default 128)")
    s.add_argument("--repeat", type=int, default=5, help="runs (default 5)")
    s.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    s.add_argument("--profile", action="store_true",
                   help="then as many runs again with a clock around every kernel call of the CPU's decode "
                   "step: time per token by kernel and by IR op, and the wait at the barrier after each")
    add_gpu_flag(s)
    s.set_defaults(func=cmd_bench)
