"""The ``picc`` command line. Errors are one line on stderr and a non-zero exit (see ``--debug``)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

from picc.errors import PiccError

EPILOG_SOURCES = (
    "SOURCE is a model alias (smollm2, relu-demo), a Hugging Face directory (config.json + "
    "*.safetensors), a .gguf file, an .onnx file, a .picc file written by 'picc import', or a .pib written "
    "by 'picc compile'."
)


def _load(source: str):  # noqa: ANN202 - LoadedModel, imported lazily to keep --help fast
    from picc.frontend import load_model

    return load_model(source)


def _parse_tokens(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise PiccError(f"--tokens {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise PiccError("--tokens: expected at least one token id")
    return ids


def _encode(model, text: str) -> list[int]:  # noqa: ANN001
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer; pass --tokens instead")
    return model.tokenizer.encode(text)


# ---------------------------------------------------------------- commands


def cmd_import(args: argparse.Namespace) -> None:
    from picc.frontend.picc_file import save_picc

    model = _load(args.source)
    save_picc(model, Path(args.output))
    n = len(model.module.weights)
    print(f"wrote {args.output} ({len(list(model.module.ops()))} ops, {n} weights in "
          f"{args.output}.weights)", file=sys.stderr)


def cmd_opt(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from picc.frontend.picc_file import save_picc
    from picc.passes import parse_pipeline, run_pipeline

    pipeline = parse_pipeline(args.passes)
    model = _load(args.input)
    inst = _instruments(args, out=sys.stderr if args.output == "-" else sys.stdout)
    module = run_pipeline(model.module, model.weights, pipeline, inst, tokenizer=model.tokenizer)
    result = replace(model, module=module)
    if args.output == "-":
        from picc.ir.printer import print_module

        sys.stdout.write(print_module(module))
    else:
        save_picc(result, Path(args.output))


def cmd_logits(args: argparse.Namespace) -> None:
    from picc.fsutil import atomic_path
    from picc.generate import check_token_ids
    from picc.interpreter import Interpreter

    model = _load(args.source)
    ids = _parse_tokens(args.tokens) if args.tokens is not None else _encode(model, args.text)
    check_token_ids(ids, int(model.module.attr("vocab", 0) or 0) or max(ids) + 1)
    if str(args.source).endswith(".pib") and not args.interpreter:
        from picc.cli_runtime import logits_with_runtime

        logits = logits_with_runtime(args.source, ids, args.threads, args.gpu)
    else:
        logits = Interpreter(model.module, model.weights).run(ids).astype(np.float32)
    out = Path(args.out)
    with atomic_path(out) as tmp:
        buf = io.BytesIO()
        np.save(buf, logits)
        tmp.write_bytes(buf.getvalue())
    print(f"wrote {out}: logits of shape {logits.shape}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    from picc.generate import generate_ids

    if args.n < 0:
        raise PiccError(f"-n {args.n}: expected a number of tokens >= 0")
    if args.temperature < 0:
        raise PiccError(f"--temperature {args.temperature}: expected a value >= 0")
    model = _load(args.source)
    prompt = _encode(model, args.prompt)
    tok = model.tokenizer
    tokens: list[int] = []
    start = time.perf_counter()
    shown = ""
    if not args.json:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    for t in generate_ids(model, prompt, args.n, args.temperature, args.seed):
        tokens.append(t)
        if not args.json:
            text = tok.decode(tokens)
            # Print only the text that is final: a partial UTF-8 sequence decodes to U+FFFD.
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    elapsed = time.perf_counter() - start
    text = tok.decode(tokens)
    if args.json:
        print(json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": text}))
    else:
        sys.stdout.write(text[len(shown):] + "\n")
        rate = len(tokens) / elapsed if elapsed > 0 else float("inf")
        print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, {rate:.1f} tok/s on the "
              "reference interpreter]", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> None:
    from picc import profiling
    from picc.calib import token_windows

    model = _load(args.source)
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer, so calibration text cannot be read")
    windows = token_windows(model.tokenizer, args.calib, args.tokens, args.window, args.seed)
    (profile,) = profiling.calibrate(model.module, model.weights, windows, [args.target_sparsity],
                                     args.threshold_rule)
    if args.output:
        profiling.save_npz(profile, Path(args.output))
    if args.plot:
        profiling.plot(profile, Path(args.plot))
    summary = profile.summary()
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{'ffn':<16} {'sparsity':>8} {'threshold':>10} {'top10%':>7} {'top20%':>7} {'top50%':>7}")
    for layer in summary["layers"]:  # type: ignore[union-attr]
        print(f"{layer['ffn']:<16} {layer['sparsity']:8.3f} {layer['threshold']:10.4g} "
              f"{layer['top10']:7.3f} {layer['top20']:7.3f} {layer['top50']:7.3f}")
    scaled = " times its Fisher scale" if profile.rule == "fisher" else ""
    rule = ("ReLU: active means > 0" if profile.target_sparsity is None
            else f"active means |act(gate)|{scaled} > threshold, calibrated to sparsity {profile.target_sparsity}")
    print(f"mean sparsity {profile.mean_sparsity:.3f} over {len(profile.layers)} FFN layers; "
          f"{profile.tokens} tokens of {profile.calib} (seed {profile.seed}); {rule}")
    print("topN%: share of all activations that the N% most active neurons account for")


def cmd_sparsify(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from picc.frontend.picc_file import save_picc
    from picc.sparsify import sparsify

    options = _sparsify_options(args)
    model = _load(args.source)
    module = sparsify(model, options, _instruments(args), report=lambda line: print(line, file=sys.stderr))
    save_picc(replace(model, module=module), Path(args.output))
    modes: dict[str, int] = {}
    for op in module.ops():
        if op.NAME in ("ffn", "sparse_ffn"):
            mode = getattr(op, "mode", "dense")
            modes[mode] = modes.get(mode, 0) + 1
    print(f"wrote {args.output}: " + ", ".join(f"{n} {m} FFN layers" for m, n in sorted(modes.items())),
          file=sys.stderr)


def cmd_eval(args: argparse.Namespace) -> None:
    from picc.evaluation import eval_windows, evaluate
    from picc.progress import progress_bar

    model = _load(args.source)
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer, so {args.ppl} cannot be read")
    if args.max_tokens < 2:
        raise PiccError(f"--max-tokens {args.max_tokens}: expected at least 2")
    window = args.window
    max_position = model.module.attr("max_position")
    if isinstance(max_position, int) and window > max_position:
        # Past its trained context a model's perplexity says nothing about sparsity.
        print(f"note: windows of {max_position} tokens, the model's context length", file=sys.stderr)
        window = max_position
    windows = eval_windows(model.tokenizer, args.ppl, args.max_tokens, window)
    with progress_bar(sum(len(w) for w in windows), "evaluating", "tok") as advance:
        result = evaluate(model.module, model.weights, windows, args.compare_dense, progress=advance)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return
    print(f"perplexity on {args.ppl}: {result.ppl:.4f} ({result.tokens} tokens)")
    if result.ppl_dense is not None:
        print(f"dense perplexity:     {result.ppl_dense:.4f} ({100 * (result.ppl_increase or 0):+.2f}%)")
        print(f"top-1 agreement:      {result.top1_agreement:.4f}")
    if result.ffn_sparsity is not None:
        print(f"measured FFN sparsity: {result.ffn_sparsity:.4f}")
    if result.recall is not None:
        print(f"predictor recall {result.recall:.4f}, precision {result.precision:.4f}")


def cmd_compile(args: argparse.Namespace) -> None:
    from picc.compile import CompileOptions, compile_model, summary_line, write_compiled
    from picc.plan_report import format_report

    out = Path(args.output)
    if out.suffix != ".pib":
        raise PiccError(f"-o {args.output}: expected a file name ending in .pib")
    options = CompileOptions(target=args.target, vram=args.vram, ctx=args.ctx,
                             dense=args.dense, float_dots=args.float_dots, int_dots=args.int_dots,
                             solver=args.solver,
                             sparsity=_sparsify_options(args))
    options.check()
    def say(line: str) -> None:
        print(line, file=sys.stderr)

    say(f"loading {args.source}")
    model = _load(args.source)
    inst = _instruments(args)

    def stage_done(name: str, module: object) -> None:
        say(f"  {name}: {inst.timings[-1][1]:.1f} s")

    inst.on_pass = stage_done
    compiled = compile_model(model, options, inst, say=say)
    size = write_compiled(compiled, out)
    if args.verbose:
        print(format_report(compiled.report), file=sys.stderr)
    say(summary_line(compiled, out, size))


def cmd_inspect(args: argparse.Namespace) -> None:
    from picc.fsutil import write_text_atomic
    from picc.pib import open_pib
    from picc.plan_report import format_report, plot_report

    with open_pib(Path(args.model)) as pib:
        report = pib.json("report")
        meta = pib.json("meta")
        if args.emit_cuda:
            sources = [name for name in pib.sections if name.startswith("cuda/") and name.endswith(".cu")]
            if not sources:
                raise PiccError(f"{args.model}: carries no CUDA code (nothing is placed on a GPU)")
            out = Path(args.emit_cuda)
            out.mkdir(parents=True, exist_ok=True)
            for name in sources:
                write_text_atomic(out / Path(name).name, pib.text(name))
            print(f"wrote {len(sources)} CUDA sources to {out}", file=sys.stderr)
    if args.plot:
        plot_report(report, Path(args.plot))
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.model}: compiled from {meta.get('source')} by picc {meta.get('picc_version')}")
    print(format_report(report))


def _sparsify_options(args: argparse.Namespace):  # noqa: ANN202 - SparsifyOptions
    from picc.sparsify import SparsifyOptions

    if not 0 < args.recall <= 1:
        raise PiccError(f"--recall {args.recall}: expected a share in (0, 1]")
    if not 0 < args.predictor_budget <= 1:
        raise PiccError(f"--predictor-budget {args.predictor_budget}: expected a share of the FFN weights in (0, 1]")
    if args.target_sparsity is not None and not 0 <= args.target_sparsity < 1:
        raise PiccError(f"--target-sparsity {args.target_sparsity}: expected a value in [0, 1)")
    if args.max_ppl_increase is not None and args.max_ppl_increase < 0:
        raise PiccError(f"--max-ppl-increase {args.max_ppl_increase}: expected a value >= 0")
    return SparsifyOptions(
        mode=args.sparsity_mode, target_sparsity=args.target_sparsity,
        max_ppl_increase=args.max_ppl_increase, recall=args.recall, budget=args.predictor_budget,
        predictors=args.predictors, calib=args.calib, rule=args.threshold_rule, tokens=args.tokens, seed=args.seed)


def _passes_epilog() -> str:
    from picc.passes import PASSES

    listing = "; ".join(f"{p.name}: {p.summary.rstrip('.')}" for p in PASSES.values())
    return f"Passes: {listing}. Options go in braces: PASS{{key=value,...}}."


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called when help is shown: the ``opt``
    command lists the registered passes, and importing them (scipy, the partitioner...) would
    cost every other command ~0.6 s of start-up."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


class _NamesFormatter(argparse.HelpFormatter):
    """Wraps text without breaking at hyphens, so that pass names (``partition-neurons``) stay whole."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def _instruments(args: argparse.Namespace, out=sys.stderr):  # noqa: ANN001, ANN202 - TextIO, Instruments
    from picc.passes import Instruments

    return Instruments(verify=not args.no_verify, print_after_all=args.print_after_all,
                       print_after=frozenset(args.print_after or ()),
                       dump_dir=Path(args.dump_ir) if args.dump_ir else None, time_passes=args.time_passes,
                       out=out)


def _add_instrument_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--print-after-all", action="store_true", help="print the IR after each pass")
    s.add_argument("--print-after", action="append", metavar="PASS", help="print the IR after PASS (repeatable)")
    s.add_argument("--dump-ir", metavar="DIR", help="write DIR/NN_<pass>.picc after each pass")
    s.add_argument("--time-passes", action="store_true", help="print the time each pass took")
    s.add_argument("--no-verify", action="store_true", help="skip the verifier after each pass")


def _add_threshold_rule(s: argparse.ArgumentParser) -> None:
    s.add_argument("--threshold-rule", default="fisher", choices=("fisher", "cats"),
                   help="how non-ReLU GLU thresholds are calibrated: fisher (default) scales each neuron's "
                   "|act(gate)| by how much it moves the loss and puts one threshold on all layers, so "
                   "sparsity goes where it costs least (SmolLM2 at 30%%: +2.1%% perplexity, against "
                   "+3.4%% for cats); cats: the same sparsity in every layer on unscaled scores")


def add_sparsity_flags(s: argparse.ArgumentParser) -> None:
    """The flags that choose how FFNs become sparse (shared by sparsify and compile)."""
    s.add_argument("--sparsity-mode", default="auto",
                   choices=("auto", "predictor", "gate-first", "down-only", "dense"),
                   help="how each FFN layer knows its active neurons (default auto: the cost model "
                   "picks per layer; ReLU FFNs get trained predictors when they pay)")
    s.add_argument("--target-sparsity", type=float, metavar="S",
                   help="for non-ReLU FFNs: the sparsity the thresholds are calibrated to (default 0.3)")
    s.add_argument("--max-ppl-increase", type=float, metavar="X",
                   help="instead of --target-sparsity: the sparsest setting whose perplexity on "
                   "held-out calibration text is within X (e.g. 0.05 = 5%%) of dense")
    _add_threshold_rule(s)
    s.add_argument("--recall", type=float, default=0.99,
                   help="predictor recall target on held-out tokens (default 0.99)")
    s.add_argument("--predictor-budget", type=float, default=0.1, metavar="SHARE",
                   help="memory for all predictors, as a share of the FFN weights (default 0.1)")
    s.add_argument("--predictors", metavar="DIR",
                   help="import PowerInfer predictors (model_{layer}.pt) instead of training")
    s.add_argument("--calib", default="ptb", metavar="ptb|PATH", help="calibration text (default ptb)")
    s.add_argument("--tokens", type=int, default=4096,
                   help="calibration tokens for profiling (default 4096); predictors train on up to "
                        "16384 (or these, if more) from the same text")
    s.add_argument("--seed", type=int, default=0, help="seed for calibration windows and training")


# ---------------------------------------------------------------- argument parsing


def build_parser() -> argparse.ArgumentParser:
    from picc.cli_runtime import add_gpu_flag, add_runtime_commands, add_threads_flag

    p = argparse.ArgumentParser(
        prog="picc",
        description="picc: a compiler that lowers LLMs into a sparse hybrid CPU/GPU IR.",
        epilog=EPILOG_SOURCES,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    s = sub.add_parser("import", help="import a model into picc IR text",
                       description="Import SOURCE into picc IR: writes FILE.picc (text) and "
                       "FILE.picc.weights (its weights and tokenizer).", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="FILE.picc")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("opt", help="run passes over a .picc file",
                       description="Run a pipeline of registered passes over FILE.picc.",
                       epilog=_passes_epilog, formatter_class=_NamesFormatter)
    s.add_argument("input", metavar="FILE.picc")
    s.add_argument("-p", "--passes", required=True, metavar="PASS[,PASS...]",
                   help="the pipeline, e.g. canonicalize,dce")
    s.add_argument("-o", "--output", required=True, metavar="OUT.picc",
                   help="where to write the result ('-' prints the IR to stdout)")
    _add_instrument_flags(s)
    s.set_defaults(func=cmd_opt)

    s = sub.add_parser("logits", help="write the logits of every position to a .npy file",
                       description="Run SOURCE and save the logits of every position, float32 of shape "
                       "(tokens, vocab): a .pib runs its compiled code on the runtime, anything else the "
                       "reference interpreter.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="text to encode with the model's tokenizer")
    g.add_argument("--tokens", help="token ids, comma-separated (e.g. 1,2,3)")
    s.add_argument("--out", required=True, metavar="FILE.npy")
    s.add_argument("--interpreter", action="store_true", help="run a .pib's IR on the reference interpreter")
    add_threads_flag(s, "CPU threads for a .pib")
    add_gpu_flag(s)
    s.set_defaults(func=cmd_logits)

    s = sub.add_parser("generate", help="generate text with the reference interpreter",
                       description="Generate text from a prompt: prefill, then decode with a KV "
                       "cache, on the reference interpreter.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-p", "--prompt", required=True, metavar="TEXT")
    s.add_argument("-n", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default) is greedy; otherwise softmax sampling at this temperature")
    s.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: prompt_tokens, tokens, text")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("profile", help="measure FFN activation sparsity on calibration text",
                       description="Run calibration text through SOURCE and report, per FFN layer, "
                       "how sparse and how skewed its activations are. ReLU-family FFNs (relu, "
                       "ReGLU, dReLU): a neuron is active when its activation is > 0. Others "
                       "(SwiGLU, GeGLU): when |act(gate)| (times its Fisher scale, by default) exceeds "
                       "a threshold calibrated to --target-sparsity.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("--calib", default="ptb", metavar="ptb|PATH",
                   help="calibration text: ptb, ptb-valid, ptb-test, a .txt file or a directory of "
                   ".txt files (default ptb)")
    s.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    s.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    s.add_argument("--seed", type=int, default=0, help="which windows are drawn (default 0)")
    s.add_argument("--target-sparsity", type=float, default=0.5, metavar="S",
                   help="for non-ReLU FFNs: the sparsity the thresholds are calibrated to "
                   "(default 0.5; ignored for ReLU FFNs)")
    _add_threshold_rule(s)
    s.add_argument("-o", "--output", metavar="stats.npz", help="save the statistics")
    s.add_argument("--plot", metavar="out.png",
                   help="draw per-layer sparsity and sorted neuron frequencies")
    s.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    s.set_defaults(func=cmd_profile)

    s = sub.add_parser("sparsify", help="profile a model and make its FFNs sparse",
                       description="Profile SOURCE on calibration text, then make each FFN sparse: "
                       "a trained predictor (PowerInfer), gate-first or down-only masks, or dense. "
                       "Writes the IR (with predictors) to OUT.picc.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="OUT.picc")
    add_sparsity_flags(s)
    _add_instrument_flags(s)
    s.set_defaults(func=cmd_sparsify)

    s = sub.add_parser("eval", help="perplexity, and what sparsity costs against dense",
                       description="Perplexity of SOURCE on an evaluation corpus; with "
                       "--compare-dense also the dense model's, the top-1 agreement, the measured FFN "
                       "sparsity and the predictors' recall and precision.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("--ppl", default="ptb-valid", metavar="CORPUS",
                   help="ptb-valid (default), ptb-test, ptb, or a text file / directory")
    s.add_argument("--max-tokens", type=int, default=16384, help="tokens to evaluate (default 16384)")
    s.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    s.add_argument("--compare-dense", action="store_true", help="also run the dense model and compare")
    s.add_argument("--json", action="store_true",
                   help="print ppl, ppl_dense, ppl_increase, top1_agreement, ffn_sparsity, recall, "
                   "precision as one JSON object")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("compile", help="compile a model for a target under a VRAM budget into a .pib",
                       description="Run the whole pipeline on SOURCE: neuron-major FFNs, profiling and "
                       "sparsity (predictors, gate-first or down-only masks), placement of dense parts and "
                       "the hottest FFN neurons on the GPU under --vram, the memory plan, fused FFN kernels, "
                       "then code generation (CPU kernels through LLVM, GPU kernels through TVM as CUDA and "
                       "as a host build); write OUT.pib with the final IR, weights, plan, report, code and "
                       "tokenizer. A SOURCE that is already sparse (a 'picc sparsify' output) keeps its "
                       "profile and predictors.",
                       epilog=EPILOG_SOURCES + " Targets: pc-high, pc-low, h100, cpu (this machine), or a YAML "
                       "file of the same form (see picc/targets/*.yaml).")
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="OUT.pib")
    s.add_argument("--target", default="cpu", metavar="NAME|FILE.yaml",
                   help="the machine to compile for (default cpu: this machine, no GPU)")
    s.add_argument("--vram", metavar="SIZE",
                   help="GPU memory picc may use: 11GB, 11GiB, 11000MB, 512MiB, 0.5GB, bytes, or 0 for "
                   "CPU only; at most the target's VRAM (default: all of it, or none where the cost model "
                   "expects the CPU alone to be faster, as for small models whose GPU part is launches "
                   "and copies)")
    s.add_argument("--ctx", type=int, default=512, metavar="N",
                   help="context positions: the KV caches hold this many tokens of prompt and output "
                   "(default 512)")
    s.add_argument("--dense", action="store_true", help="compile without sparsity (the baseline)")
    dots = s.add_mutually_exclusive_group()
    dots.add_argument("--float-dots", action="store_true",
                      help="a dense model's q4_0 / q4_1 matrix-vector products round x to int16 per block of "
                      "32 (1.2-1.4x faster; within 2^-16 of each block's largest |x|); this keeps them in float")
    dots.add_argument("--int-dots", action="store_true",
                      help="round x to int16 in a sparse model's q4_0 / q4_1 products too: ~1.16x decode of "
                      "SmolLM2 Q4_1 here at the same perplexity, but decisions near a sparsity threshold flip "
                      "more often, so after a few tokens the logits follow float arithmetic only to ~1e-2 "
                      "(float dots: ~1e-6)")
    s.add_argument("--solver", choices=("greedy", "ilp"), default="greedy",
                   help="neuron placement: greedy top-k by frequency (default, PowerInfer's) or the ILP "
                   "on the cost model")
    s.add_argument("-v", "--verbose", action="store_true", help="print the placement report")
    add_sparsity_flags(s)
    _add_instrument_flags(s)
    s.set_defaults(func=cmd_compile)

    s = sub.add_parser("inspect", help="show what a .pib puts where and the estimated speed",
                       description="Per layer: GPU and CPU neurons, bytes, and the share of activations the "
                       "GPU neurons serve; totals against the VRAM budget; the cost model's tokens/s on the "
                       "target and its breakdown, and the rates at which the CPU's kernels read each weight "
                       "format (measured on the host for --target cpu).")
    s.add_argument("model", metavar="MODEL.pib")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: target, vram_budget_bytes, gpu_bytes, cpu_bytes, layers "
                   "(gpu_neurons, cpu_neurons, gpu_activation_share, ...), estimate_tokens_per_s, ...")
    s.add_argument("--plot", metavar="OUT.png", help="draw neurons per device and the GPU's activation share")
    s.add_argument("--emit-cuda", metavar="DIR",
                   help="write every CUDA source the file carries as DIR/<kernel>.cu (each compiles alone)")
    s.set_defaults(func=cmd_inspect)

    add_runtime_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except PiccError as e:
        if args.debug:
            raise
        print(f"picc: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("picc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        if args.debug:
            raise
        print(f"picc: internal error: {type(e).__name__}: {e} (run with --debug for a traceback)",
              file=sys.stderr)
        return 70
    return 0


if __name__ == "__main__":
    sys.exit(main())
