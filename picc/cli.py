"""The ``picc`` command line: its parser, one function per command declaring that command's flags,
and ``main``. The compiler's commands run in ``picc.cli_commands``, ``run`` and ``bench`` in
``picc.cli_runtime``. Errors are one line on stderr and a non-zero exit (see ``--debug``)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from picc.cli_commands import (
    cmd_compile,
    cmd_eval,
    cmd_generate,
    cmd_import,
    cmd_inspect,
    cmd_logits,
    cmd_opt,
    cmd_profile,
    cmd_sparsify,
)
from picc.cli_runtime import add_gpu_flag, add_runtime_commands, add_threads_flag
from picc.cli_serve import add_serve_command
from picc.errors import PiccError
from picc.sparsity import FISHER_TOKENS

_SOURCES = ("SOURCE is a model alias (smollm2, relu-demo), a Hugging Face directory (config.json + "
            "*.safetensors), a .gguf file, an .onnx file, a .picc file written by 'picc import'")
EPILOG_SOURCES = _SOURCES + ", or a .pib written by 'picc compile'."
EPILOG_UNCOMPILED = _SOURCES + " (not a .pib: it is compiled already)."


def _passes_epilog() -> str:
    from picc.passes import PASSES
    from picc.passes.options import describe_options

    def entry(name: str, summary: str, options: str) -> str:
        return f"{name}: {summary.rstrip('.')}" + (f" [{options}]" if options else "")

    listing = "; ".join(entry(p.name, p.summary, describe_options(p.options)) for p in PASSES.values())
    return f"Passes: {listing}. Options, [name: type = default], go in braces: PASS{{key=value,...}}."


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


def _add_instrument_flags(s: argparse.ArgumentParser) -> None:
    """The flags that print, dump, time or skip the verifier after each pass (see ``picc.passes.Instruments``)."""
    s.add_argument("--print-after-all", action="store_true", help="print the IR after each pass")
    s.add_argument("--print-after", action="append", metavar="PASS", help="print the IR after PASS (repeatable)")
    s.add_argument("--dump-ir", metavar="DIR", help="write DIR/NN_<pass>.picc after each pass")
    s.add_argument("--time-passes", action="store_true", help="print the time each pass took")
    s.add_argument("--no-verify", action="store_true", help="skip the verifier after each pass")


def _add_threshold_rule(s: argparse.ArgumentParser) -> None:
    """``--threshold-rule``: how the thresholds of non-ReLU FFNs are calibrated (profile, sparsify, compile)."""
    s.add_argument("--threshold-rule", default="fisher", choices=("fisher", "cats"),
                   help="how non-ReLU GLU thresholds are calibrated: fisher (default) scales each neuron's "
                   "|act(gate)| by how much it moves the loss and puts one threshold on all layers, so "
                   "sparsity goes where it costs least (SmolLM2 at 30%%: +2.1%% perplexity, against "
                   "+3.4%% for cats); cats: the same sparsity in every layer on unscaled scores")
    s.add_argument("--fisher-tokens", type=int, default=FISHER_TOKENS, metavar="N",
                   help=f"the fisher rule takes its gradients on the first N calibration tokens (default "
                   f"{FISHER_TOKENS}; the profile uses all of --tokens): SmolLM2 at 30%%, +2.07%% perplexity "
                   "against +2.03%% from 4096, for two thirds of the work")


def add_sparsity_flags(s: argparse.ArgumentParser) -> None:
    """The flags that choose how FFNs become sparse (shared by sparsify and compile)."""
    s.add_argument("--sparsity-mode", default="auto",
                   choices=("auto", "predictor", "gate-first", "down-only", "dense"),
                   help="how each FFN layer knows its active neurons (default auto: per layer the "
                   "way that reads its weights fastest, at the CPU's measured kernel rates when "
                   "compiling for a CPU alone; ReLU FFNs get trained predictors when they pay)")
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
    s.add_argument("--seed", type=int, default=0, help="seed for calibration windows and training (default 0)")


def _add_import_command(sub: argparse._SubParsersAction) -> None:
    """``picc import SOURCE -o FILE.picc``."""
    s = sub.add_parser("import", help="import a model into picc IR text",
                       description="Import SOURCE into picc IR: writes FILE.picc (text) and "
                       "FILE.picc.weights (its weights and tokenizer).", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="FILE.picc",
                   help="the IR text; its weights and tokenizer go to FILE.picc.weights beside it")
    s.set_defaults(func=cmd_import)


def _add_opt_command(sub: argparse._SubParsersAction) -> None:
    """``picc opt FILE.picc -p PASSES -o OUT.picc``; its help lists the registered passes."""
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


def _add_logits_command(sub: argparse._SubParsersAction) -> None:
    """``picc logits SOURCE --text|--tokens --out FILE.npy``."""
    s = sub.add_parser("logits", help="write the logits of every position to a .npy file",
                       description="Run SOURCE and save the logits of every position, float32 of shape "
                       "(tokens, vocab): a .pib runs its compiled code on the runtime, anything else the "
                       "reference interpreter.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="text to encode with the model's tokenizer")
    g.add_argument("--tokens", help="token ids, comma-separated (e.g. 1,2,3)")
    s.add_argument("--out", required=True, metavar="FILE.npy", help="where to write the logits (numpy .npy)")
    s.add_argument("--interpreter", action="store_true", help="run a .pib's IR on the reference interpreter")
    add_threads_flag(s, "CPU threads for a .pib")
    add_gpu_flag(s)
    s.set_defaults(func=cmd_logits)


def _add_generate_command(sub: argparse._SubParsersAction) -> None:
    """``picc generate SOURCE -p TEXT``."""
    s = sub.add_parser("generate", help="generate text with the reference interpreter",
                       description="Generate text from a prompt: prefill, then decode with a KV "
                       "cache, on the reference interpreter.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-p", "--prompt", required=True, metavar="TEXT",
                   help="the prompt, encoded with the model's tokenizer")
    s.add_argument("-n", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default) is greedy; otherwise softmax sampling at this temperature")
    s.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: prompt_tokens, tokens, text")
    s.set_defaults(func=cmd_generate)


def _add_profile_command(sub: argparse._SubParsersAction) -> None:
    """``picc profile SOURCE``: the calibration text and the threshold rule."""
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


def _add_sparsify_command(sub: argparse._SubParsersAction) -> None:
    """``picc sparsify SOURCE -o OUT.picc`` with the sparsity and instrument flags."""
    s = sub.add_parser("sparsify", help="profile a model and make its FFNs sparse",
                       description="Profile SOURCE on calibration text, then make each FFN sparse: "
                       "a trained predictor (PowerInfer), gate-first or down-only masks, or dense. "
                       "Writes the IR (with predictors) to OUT.picc.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="OUT.picc",
                   help="the sparse IR; its weights and predictors go to OUT.picc.weights beside it")
    add_sparsity_flags(s)
    _add_instrument_flags(s)
    s.set_defaults(func=cmd_sparsify)


def _add_eval_command(sub: argparse._SubParsersAction) -> None:
    """``picc eval SOURCE``: the corpus, the window and ``--compare-dense``."""
    s = sub.add_parser("eval", help="perplexity, and what sparsity costs against dense",
                       description="Perplexity of SOURCE on an evaluation corpus; with "
                       "--compare-dense also the dense model's, the top-1 agreement, the measured FFN "
                       "sparsity and the predictors' recall and precision.", epilog=EPILOG_SOURCES)
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("--ppl", default="ptb-valid", metavar="CORPUS",
                   help="ptb-valid (default), ptb-test, ptb, or a text file / directory")
    s.add_argument("--max-tokens", type=int, default=16384,
                   help="tokens to evaluate (default 16384; a longer --window is cut to it)")
    s.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    s.add_argument("--compare-dense", action="store_true", help="also run the dense model and compare")
    s.add_argument("--json", action="store_true",
                   help="print ppl, ppl_dense, ppl_increase, top1_agreement, ffn_sparsity, recall, "
                   "precision as one JSON object")
    s.set_defaults(func=cmd_eval)


def _add_compile_command(sub: argparse._SubParsersAction) -> None:
    """``picc compile SOURCE -o OUT.pib``: target, VRAM, context, dots, solver, and the sparsity and
    instrument flags."""
    s = sub.add_parser("compile", help="compile a model for a target under a VRAM budget into a .pib",
                       description="Run the whole pipeline on SOURCE: neuron-major FFNs, profiling and "
                       "sparsity (predictors, gate-first or down-only masks), placement of dense parts and "
                       "the hottest FFN neurons on the GPU under --vram, the memory plan, fused FFN kernels, "
                       "then code generation (CPU kernels through LLVM, GPU kernels through TVM as CUDA and "
                       "as a host build); write OUT.pib with the final IR, weights, plan, report, code and "
                       "tokenizer. A SOURCE that is already sparse (a 'picc sparsify' output) keeps its "
                       "profile and predictors.",
                       epilog=EPILOG_UNCOMPILED + " Targets: pc-high, pc-low, h100, cpu (this machine), or a YAML "
                       "file of the same form (see picc/targets/*.yaml).")
    s.add_argument("source", metavar="SOURCE")
    s.add_argument("-o", "--output", required=True, metavar="OUT.pib", help="the compiled model")
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
    which = s.add_mutually_exclusive_group()
    which.add_argument("--dense", action="store_true", help="compile without sparsity (the baseline)")
    which.add_argument("--sparse", action="store_true",
                       help="keep sparsity even where the cost model estimates the dense model faster (by "
                       "default a CPU-only compile of a dense source builds whichever it estimates faster, "
                       "and says which), and calibrate even where that is estimated to take more than 10 "
                       "minutes on this machine (by default the dense model is built then, and the compile "
                       "says why and which --tokens would fit)")
    s.add_argument("--no-batch-step", action="store_true",
                   help="leave out the batch step that lets 'picc serve' decode its sequences together (each "
                   "then steps alone; saves ~2-3 s of LLVM a compile)")
    dots = s.add_mutually_exclusive_group()
    dots.add_argument("--float-dots", action="store_true",
                      help="a dense model's q4_0 / q4_1 matrix-vector products round x to int16 per block of "
                      "32 (1.2-1.4x faster; within 2^-16 of each block's largest |x|), and every model's q8_0 "
                      "LM head rounds its x to int8 (its 8-row batch 2.6x faster for 'picc serve'; PTB "
                      "perplexity +0.1%% on SmolLM2, logits ~1e-2 from float x's); this keeps them in float")
    dots.add_argument("--int-dots", action="store_true",
                      help="round x to int16 in a sparse model's q4_0 / q4_1 products too: ~1.16x decode of "
                      "SmolLM2 Q4_1 here at the same perplexity, but decisions near a sparsity threshold flip "
                      "more often, so after a few tokens the logits follow float arithmetic only to ~1e-2 "
                      "(float dots: ~1e-6)")
    s.add_argument("--int8-dots", action="store_true",
                   help="where x is rounded (a dense model, or --int-dots) and the kernel reads q4_0 / q4_1 "
                   "rows eight at a time, round to int8 instead of int16 (1/254 of each block's largest |x|, "
                   "as llama.cpp does): half the integer work, which is what bounds the batched kernels of "
                   "'picc serve'; PTB perplexity +0.2%% on SmolLM2, whose logits move ~3-5e-2 from float "
                   "x's. q8_0 linears and FFNs then read eight rows at a time with int8 x too, as a q8_0 LM "
                   "head does by default")
    s.add_argument("--kv-cache", choices=("f16", "f32"), default="f16",
                   help="what the KV caches of attention on the CPU hold: f16 (default; keys and values "
                   "rounded to half precision as they are stored, as llama.cpp does: half the bytes each "
                   "step reads back, a third of a step at long contexts) or f32; GPU attention keeps f32")
    s.add_argument("--solver", choices=("greedy", "ilp"), default="greedy",
                   help="neuron placement: greedy top-k by frequency (default, PowerInfer's) or the ILP "
                   "on the cost model")
    s.add_argument("-v", "--verbose", action="store_true", help="print the placement report and peak memory")
    add_sparsity_flags(s)
    _add_instrument_flags(s)
    s.set_defaults(func=cmd_compile)


def _add_inspect_command(sub: argparse._SubParsersAction) -> None:
    """``picc inspect MODEL.pib``."""
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


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, in the order ``picc --help`` lists them."""
    p = argparse.ArgumentParser(
        prog="picc",
        description="picc: a compiler that lowers LLMs into a sparse hybrid CPU/GPU IR.",
        epilog=EPILOG_SOURCES,
    )
    debug = "show the traceback of an internal error"
    p.add_argument("--debug", action="store_true", help=debug)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    _add_import_command(sub)
    _add_opt_command(sub)
    _add_logits_command(sub)
    _add_generate_command(sub)
    _add_profile_command(sub)
    _add_sparsify_command(sub)
    _add_eval_command(sub)
    _add_compile_command(sub)
    _add_inspect_command(sub)
    add_runtime_commands(sub)
    add_serve_command(sub)
    for command in sub.choices.values():  # also after the command, where an error message suggests it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a service manager stopping picc), raised in the main thread
    so that it unwinds as Ctrl-C does: files being written are removed, not left half-written."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere, and
    after the block, it does what it did before)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; the exit status: 0, 1 for a ``PiccError`` (one line on stderr),
    130 when interrupted (143 for SIGTERM), 70 for any other exception (``--debug`` raises them
    instead)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with sigterm_raises():
            args.func(args)
    except PiccError as e:
        if args.debug:
            raise
        print(f"picc: error: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print("picc: terminated", file=sys.stderr)
        return 143
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
